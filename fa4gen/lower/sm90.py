"""sm_90a (Hopper) lowering: KernelConfig -> template context -> PTX + manifest.

The kernel is the FA4 algorithm (conditional rescaling, exp2 split between MUFU and an FMA cubic,
reverse K/V order, bottom-right causal mask, GQA row packing, LSE) on FlashAttention-3's Hopper
structure:

* CTA = 1 + C warpgroups. WG0 is the producer (one thread issues every TMA load; setmaxnreg.dec),
  WG1 .. WGC are consumers (setmaxnreg.inc), each owning 64 rows of the block_m-row Q tile
  (C = block_m / 64: 2 for 128-row tiles, 3 for the 192-row tiles of D = 64, tiles.SM90_Q_ROWS).
* S = Q K^T: wgmma m64n128k16, A and B from 128B-swizzled K-major SMEM.
  O += P V: wgmma m64n{D}k16 with P from registers (RS form) and V MN-major (imm-trans-b = 1).
* mbarrier rings: Q (q_stages slots: consecutive tasks' tiles), K and V (kv stages each, capped by
  SMEM: fa4gen.plan.smem_plan), full = TMA expect_tx, empty = one arrival per consumer warp (4 C).
* Ping-pong: named barriers hand the tensor core around the consumer WGs in a ring (0, 1, .., C-1),
  so the others' softmax overlaps one WG's GEMMs; inside a WG the next block's QK^T is issued
  before the previous block's PV and both run under this block's softmax.

Everything the templates print is computed here: register names, SMEM offsets, descriptor
constants, per-register mask columns and exp-path choices. The templates only spell PTX.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..assemble import PTX_VERSION_FOR_ARCH
from ..config import GENERATOR_VERSION, KernelConfig
from ..plan import (abi_params, block_info_ptx, combine_context, kv_box_rows, HALF_COLS, MASK_AS_WORDS, MASK_WORD_BITS, REGS_PER_SM, ROWS,
                    SM90_REGS, SM90_SCHED_BAR_ID,
                    SM90_SMEM_LIMIT as SMEM_LIMIT, mask_words, panel_bytes, q_panel_bytes, q_tile_bytes,
                    sm90_consumers, sm90_epi_bar_id, smem_plan, tile_bytes)
from ..ir.sm90 import build_sm90_pipeline
from ..render import render
from .manifest import ENTRY, GridFacts, manifest

from ..exp2 import EXP2_POLY as _EXP2_POLY  # fitted coefficients, shared with the reference and sm_100a
from ..exp2 import hopper_emulated

__all__ = ["Sm90Options", "Probe", "build_sm90", "lower_sm90", "manifest_sm90",
           "smem_plan", "Sm90LoweringError", "SMEM_LIMIT"]

WG_ROWS = 64  # rows per consumer warpgroup (wgmma M)


def threads_of(cfg: KernelConfig) -> int:
    """Threads per CTA: the producer warpgroup and one consumer warpgroup per 64 Q rows."""
    return 128 * (1 + sm90_consumers(cfg.block_m))


def entry_regs_of(cfg: KernelConfig) -> int:
    """ptxas's per-thread register cap of a .maxntid threads / .minnctapersm 1 kernel (multiple of 8):
    168 for the 384 threads of a 128-row tile, 128 for the 512 of a 192-row one."""
    return (REGS_PER_SM // threads_of(cfg)) // 8 * 8


NEG_INF = "0fFF800000"
LN2 = math.log(2.0)

# wgmma SMEM matrix-descriptor layout (PTX ISA 9.7.15.5.1, "Matrix Descriptor Format"):
# start>>4 in [0,14), leading-dim byte offset>>4 in [16,30), stride-dim byte offset>>4 in [32,46),
# base offset in [49,52), swizzle mode in [62,64) with 1 = 128B.
SWIZZLE_128B = 1


class Sm90LoweringError(ValueError):
    """A config the sm_90a kernel cannot take (names what and why)."""


class Probe(enum.Enum):
    """Diagnostic variants of the same kernel (same ABI), for the device harness.

    QK: O <- cast(Q K^T) of the first visited K block (needs D == 128 so a 128-key row fits a
        128-column O row): checks TMA loads, the SS descriptors, the accumulator layout and the
        epilogue store without softmax.
    PV: O <- cast(cast(Q K^T) V) of that block: adds the RS wgmma with transposed V.
    """

    NONE = "none"
    QK = "qk"
    PV = "pv"


@dataclass(frozen=True)
class Sm90Options:
    """Lowering knobs that are not part of the algorithm's config (tuning and diagnostics)."""

    pingpong: bool = True
    persistent: bool = True  # False: one CTA per task (the same kernel runs a single round)
    producer_regs: int | None = None  # None: plan.SM90_REGS for the config's consumer count
    consumer_regs: int | None = None
    probe: Probe = Probe.NONE

    def __post_init__(self):
        for name in ("producer_regs", "consumer_regs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v % 8 or not 24 <= v <= 256):
                raise Sm90LoweringError(f"{name}={v!r}: setmaxnreg takes a multiple of 8 in [24, 256]")
        if not isinstance(self.probe, Probe):
            raise Sm90LoweringError(f"probe={self.probe!r}: a Probe")
        # 128-row tiles (2 consumers), the common case: refuse an impossible budget at once
        if self.producer_regs is not None and self.consumer_regs is not None:
            _check_budget(2, self.producer_regs, self.consumer_regs, must_fit_some=True)

    def regs(self, cfg: KernelConfig) -> tuple[int, int]:
        """(producer, consumer) setmaxnreg budgets for cfg, checked against its launch pool."""
        nc = sm90_consumers(cfg.block_m)
        dp, dc = SM90_REGS[nc]
        p = dp if self.producer_regs is None else self.producer_regs
        c = dc if self.consumer_regs is None else self.consumer_regs
        _check_budget(nc, p, c)
        return p, c


def _check_budget(nc: int, producer: int, consumer: int, must_fit_some: bool = False) -> None:
    """setmaxnreg moves registers inside the CTA's launch-time allocation (threads x the entry cap);
    an inc that the pool cannot cover blocks forever (seen on the H200: 32/240/240 hangs,
    24/240/240 = 3 x 168 runs). must_fit_some: the budget must fit the pool of some consumer count."""
    counts = sorted(SM90_REGS) if must_fit_some else [nc]
    for n in counts:
        threads = 128 * (1 + n)
        cap = (REGS_PER_SM // threads) // 8 * 8
        if 128 * (producer + n * consumer) <= threads * cap:
            return
    n = counts[0]
    cap = (REGS_PER_SM // (128 * (1 + n))) // 8 * 8
    raise Sm90LoweringError(f"register budget: producer + {n} x consumer must be <= {(1 + n) * cap} "
                            f"({1 + n} warpgroups x the entry cap {cap}), got {producer} + {n} x {consumer}")


def _desc_const(lbo: int, sbo: int) -> int:
    """Descriptor bits independent of the start address (added at run time, >>4, in [0, 14))."""
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (SWIZZLE_128B << 62)


def _tree(op: str, srcs: list[str], tmp: str) -> tuple[list[tuple[str, str, str]], str]:
    """Pairwise reduction as (dst, a, b) ops over fresh temporaries `tmp0, tmp1, ...`: depth log2(n)."""
    ops, level, n = [], list(srcs), 0
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            dst = f"{tmp}{n}"
            n += 1
            ops.append((dst, level[i], level[i + 1]))
            nxt.append(dst)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return ops, level[0]


def lower_sm90(cfg: KernelConfig, options: Sm90Options | None = None) -> dict:
    """Template context for templates/sm90/fa4_fwd.ptx.j2."""
    opt = options or Sm90Options()
    if cfg.arch != "sm_90a":
        raise Sm90LoweringError(f"arch {cfg.arch!r}: this lowering emits sm_90a only")
    if opt.probe is not Probe.NONE and cfg.head_dim != 128:
        raise Sm90LoweringError("probes write a 128-key S row into O: head_dim must be 128")
    D = cfg.head_dim
    G = cfg.gqa_ratio
    P = cfg.gqa_pack  # heads per tile (tiles.gqa_pack): G when G divides 128, else 1
    sqt = cfg.seq_q_per_tile
    plan = smem_plan(cfg)
    halves = D // HALF_COLS
    half_bytes = panel_bytes(cfg)  # 16 KiB: one 128-row x 128-byte swizzled slab (K, V)
    q_half_bytes = q_panel_bytes(cfg)  # one block_m-row slab of a Q slot or the O staging
    nc = sm90_consumers(cfg.block_m)
    producer_regs, consumer_regs = opt.regs(cfg)
    dt = {"bf16": "bf16", "fp16": "f16"}[cfg.dtype]

    s_regs = [f"%s{i}" for i in range(ROWS // 2)]  # m64n128 f32 accumulator: 64 per thread
    o_regs = [f"%o{i}" for i in range(D // 2)]
    p_regs = [f"%pk{i}" for i in range(ROWS // 4)]  # 8 k16-steps x 4 .b32 A-fragment registers

    # wgmma accumulator fragment (PTX ISA 9.7.15.5.1, "Register Fragments", m64nNk16 .f32 D):
    # register i of a thread holds row lane/4 + 8*((i>>1)&1) of its warp's 16 rows and column
    # 8*(i>>2) + 2*(lane%4) + (i&1). The A fragment of a k16 step j is (rows r, r+8) x (cols
    # 16j + 2*(lane%4) + {0,1}, +8): exactly accumulator registers 8j..8j+7 paired in order, so P
    # is S converted pairwise with no data movement (cvt packs its first source in the upper half).
    p_pack = [(p_regs[4 * j + t], s_regs[8 * j + 2 * t + 1], s_regs[8 * j + 2 * t]) for j in range(8) for t in range(4)]

    rows = []
    for r in range(2):
        elems = []
        for i, reg in enumerate(s_regs):
            if (i >> 1) & 1 != r:
                continue
            c, e = i >> 2, i & 1
            elems.append({"reg": reg, "col": 8 * c + e, "emu": hopper_emulated(cfg, c, e), "i": i})
        words, where = mask_words([x["col"] for x in elems]) if MASK_AS_WORDS[cfg.arch] else ([], [])
        for x, (w, bit) in zip(elems, where):
            x["mword"], x["mbit"] = f"%mw{w}", bit
        max_ops, max_res = _tree("max", [x["reg"] for x in elems], f"%mx{r}_")
        sum_ops, sum_res = _tree("add", [x["reg"] for x in elems], f"%sm{r}_")
        rows.append({"elems": elems, "max_ops": max_ops, "max_res": max_res, "sum_ops": sum_ops,
                     "sum_res": sum_res, "ref": f"%ref{r}", "nrs": f"%nrs{r}", "sum": f"%sum{r}",
                     "acc": f"%acc{r}", "lim": f"%lim{r}", "bmax": f"%bmax{r}", "idx": r,
                     "mask_words": [{"reg": f"%mw{w}", "base": w * MASK_WORD_BITS} for w in words],
                     "mtmp": "%mt", "word_ids": words})
    n_tmp = max(len(r["max_ops"]) for r in rows)
    n_words = 1 + max((w for r in rows for w in r.pop("word_ids")), default=-1)

    o_rescale = [(reg, f"%acc{(i >> 1) & 1}") for i, reg in enumerate(o_regs)]
    # O staging in 128B-swizzled SMEM (the TMA store's layout): 16-byte chunk c of row R sits at
    # chunk c ^ (R % 8) (CU_TENSOR_MAP_SWIZZLE_128B). A thread's rows are lane/4 and lane/4 + 8, so
    # R % 8 == lane/4 for both and the XOR term is one per-thread register (%xsw).
    o_store = []
    for cfull in range(D // 8):
        h, c8 = divmod(cfull, 8)
        for r in range(2):
            i0 = 4 * cfull + 2 * r
            o_store.append({"c16": c8 * 16, "off": h * q_half_bytes + r * 8 * 128,
                            "lo": o_regs[i0], "hi": o_regs[i0 + 1], "inv": f"%inv{r}"})

    ksteps_qk = D // 16
    qk_steps = [{"a": (k // 4) * (q_half_bytes >> 4) + (k % 4) * 2, "b": (k // 4) * (half_bytes >> 4) + (k % 4) * 2,
                 "scale_d": "%p_false" if k == 0 else "%p_true"} for k in range(ksteps_qk)]
    # V is [keys, D] with D contiguous: MN-major for the B operand of O += P V. One k16 step reads
    # 16 keys = 2 x 8-row groups 1024 B apart (SBO) of every 64-column slab; slabs are LBO apart.
    pv_steps = [{"b": (16 * 128 * j) >> 4, "a": p_regs[4 * j:4 * j + 4]} for j in range(ROWS // 16)]

    bars = plan.barriers
    ctx = {
        "generator_version": GENERATOR_VERSION,
        "name": cfg.name,
        "ptx_version": PTX_VERSION_FOR_ARCH["sm_90a"],
        "target": "sm_90a",
        "entry": ENTRY,
        "param_decls": [decl for _, decl in abi_params(cfg)],
        "threads": threads_of(cfg),
        "consumers": nc,
        "block_m": cfg.block_m,
        "producer_regs": producer_regs,
        "consumer_regs": consumer_regs,
        "pingpong": opt.pingpong,
        "probe": opt.probe.value,
        "causal": cfg.causal,
        "varlen": cfg.varlen,
        "kvcache": cfg.kvcache,
        "page_size": cfg.page_size,
        "log2_page": cfg.page_size.bit_length() - 1,
        "box_rows": kv_box_rows(cfg),
        "kv_boxes": ROWS // kv_box_rows(cfg),
        # split-KV partial O from the accumulator: column pair 8 c + 2 (lane % 4) of row half r
        "o_part_store": [{"r": r, "lo": o_regs[4 * c + 2 * r], "hi": o_regs[4 * c + 2 * r + 1], "off": 32 * c}
                         for r in range(2) for c in range(D // 8)],
        "o_direct_store": [{"r": r, "lo": o_regs[4 * c + 2 * r], "hi": o_regs[4 * c + 2 * r + 1], "off": 16 * c}
                           for r in range(2) for c in range(D // 8)],
        "cmb": combine_context(cfg),
        "log2e": f"0f{_f32_hex(1.0 / LN2)}",
        "log2_sqt": sqt.bit_length() - 1,
        # varlen O store by the threads (templates/sm90/fa4_fwd.ptx.j2): 16-byte chunks per row,
        # rows one pass of the WG's 128 threads covers, passes over the WG's 64 rows
        "vl": {"cpr": D // 8, "cpr_shift": (D // 8).bit_length() - 1, "row_step": 128 // (D // 8),
               "iters": WG_ROWS // (128 // (D // 8)), "row_shift": (2 * D).bit_length() - 1},
        "G": G,
        "P": P,
        "NG": cfg.head_groups,
        "log2_P": P.bit_length() - 1,
        "sqt": sqt,
        # the task's K/V blocks (plan.BlockInfo over the Q tile): %nunm, %nblk (>= 1; KV cache: the
        # split's, from %nlo); printed by the scheduler macros after the task decode
        "block_info": block_info_ptx(causal=cfg.causal, rows=sqt, m="%mb", sq="%sq", skv="%skv", tmp="%tmp0",
                                     n="%nblk", n_unmasked="%nunm",
                                     split=("%split", "%nsplit", "%nlo", "%tmp0") if cfg.kvcache else None),
        "head_dim": D,
        "halves": halves,
        "half_cols": HALF_COLS,
        "half_bytes": half_bytes,
        "q_half_bytes": q_half_bytes,
        "o_wg_bytes": WG_ROWS * 128,
        "kv_stages": plan.kv_stages,
        "q_stages": plan.q_stages,
        "smem": plan,
        "bars": bars,
        "empty_arrivals": 4 * nc,
        "q_tx": q_tile_bytes(cfg),
        "kv_tx": tile_bytes(cfg),
        # named barrier ids: ping-pong turns 1 .. C, then the C epilogue ids (plan.sm90_epi_bar_id)
        "nb": {"sched_wg1": SM90_SCHED_BAR_ID, "sched_wg2": SM90_SCHED_BAR_ID + 1, "epi_wg1": sm90_epi_bar_id(nc)},
        "wgmma_qk": f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{dt}.{dt}",
        "wgmma_pv": f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{dt}.{dt}",
        "cvt_pack": f"cvt.rn.{dt}x2.f32",
        "desc_k_major": hex(_desc_const(lbo=16, sbo=1024)),
        "desc_v": hex(_desc_const(lbo=half_bytes, sbo=1024)),
        "qk_steps": qk_steps,
        "pv_steps": pv_steps,
        "s_regs": s_regs,
        "o_regs": o_regs,
        "p_regs": p_regs,
        "p_pack": p_pack,
        "rows": rows,
        "n_tmp": n_tmp,
        "mask_words": n_words,
        "o_rescale": o_rescale,
        "o_store": o_store,
        "neg_inf": NEG_INF,
        "threshold": f"0f{_f32_hex(-cfg.rescale_threshold)}",
        "ln2": f"0f{_f32_hex(LN2)}",
        "poly": [f"0f{_f32_hex(c)}" for c in _EXP2_POLY],
        # O store box: 64 rows = one consumer WG (see manifest): P <= 64 -> (P, 64/P) else (64, 1).
        "o_box_g": min(P, WG_ROWS),
        "o_box_s": max(WG_ROWS // P, 1),
        "o_wg_g_step": WG_ROWS if P > WG_ROWS else 0,
        "o_wg_s_step": WG_ROWS // P if P <= WG_ROWS else 0,
    }
    return ctx


def _f32_hex(x: float) -> str:
    import struct

    return struct.pack(">f", x).hex().upper()


def manifest_sm90(cfg: KernelConfig, options: Sm90Options | None = None) -> dict:
    """The ABI manifest (fa4gen.lower.manifest) with the sm_90a facts: the SMEM of smem_plan (the
    offsets this kernel uses), O boxes of one consumer warpgroup's 64 rows, one Q tile per task
    (persistent: causal tasks heaviest first inside L2 sections, fa4gen/schedule.py, dealt to the
    resident CTAs with odd rounds reversed), and the `sm90` record of the plan and the options."""
    opt = options or Sm90Options()
    plan = smem_plan(cfg)
    producer_regs, consumer_regs = opt.regs(cfg)
    grid = GridFacts(policy="persistent" if opt.persistent else "one_per_task", tiles_per_task=1, deal="",
                     lpt_deal="; snake deal", varlen_lpt=True, mode_keys=False, launch=False)
    return manifest(build_sm90_pipeline(cfg), smem_bytes=plan.total, o_rows=WG_ROWS, grid=grid,
                    variant="" if opt == Sm90Options() else _options_tag(opt),
                    sections={"sm90": {"kv_stages": plan.kv_stages, "q_stages": plan.q_stages,
                                       "pingpong": opt.pingpong, "probe": opt.probe.value,
                                       "consumers": sm90_consumers(cfg.block_m), "producer_regs": producer_regs,
                                       "consumer_regs": consumer_regs}})


def _options_tag(opt: Sm90Options) -> str:
    parts = []
    if not opt.pingpong:
        parts.append("nopp")
    if not opt.persistent:
        parts.append("onepertask")
    if opt.probe is not Probe.NONE:
        parts.append(f"probe{opt.probe.value}")
    if (opt.producer_regs, opt.consumer_regs) != (None, None):
        parts.append(f"r{opt.producer_regs}-{opt.consumer_regs}")
    return "_".join(parts) or "opt"


def build_sm90(cfg: KernelConfig, options: Sm90Options | None = None) -> tuple[str, dict]:
    """(PTX text, manifest) of the sm_90a kernel for `cfg`."""
    ctx = lower_sm90(cfg, options)
    return render("sm90/fa4_fwd.ptx.j2", ctx), manifest_sm90(cfg, options)
