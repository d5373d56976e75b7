"""sm_90a (Hopper) lowering: the verified pipeline IR (fa4gen/ir/sm90.py) -> template context -> PTX + manifest.

The kernel is the FA4 algorithm (conditional rescaling, exp2 split between MUFU and an FMA cubic,
reverse K/V order, bottom-right causal mask, GQA row packing, LSE) on FlashAttention-3's Hopper
structure: CTA = 1 + C warpgroups; WG0 is the producer (one thread issues every TMA load;
setmaxnreg.dec), WG1 .. WGC the consumers (setmaxnreg.inc), each owning 64 rows of the block_m-row Q
tile; S = Q K^T and O += P V are wgmma (P from registers); mbarrier rings for Q, K and V; named
barriers pass the tensor core around the consumers (ping-pong).

The roles' programs are walked statement by statement by the walker both targets share
(fa4gen/lower/walk.py): the producer, the idle warps 1-3 of its warpgroup, and ONE program for the C
consumer warpgroups (Pipeline.replicated; the verifier proves its instances). Where the instances
differ (their 64 rows, O staging slot, epilogue barrier, the ping-pong turn they wait for and the one
they pass on) the program says InstSlot, lowered to registers computed once from the warpgroup
index; FIRST_/LAST_INSTANCE branches test it. Every protocol instruction (waits, arrives, parities,
ring steps, barrier ids, thread counts) is computed here; templates/sm90/ops.ptx.j2 spells.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..spec.plan import PTX_VERSION_FOR_ARCH, SM90_WG_ROWS
from ..spec.config import GENERATOR_VERSION, KernelConfig
from ..spec.exp2 import EXP2_POLY, hopper_emulated
from ..ir.core import (Advance, Arrive, BarrierKind, BlockRef, Compute, Cond, ExpectTx, FenceProxyAsync, FetchTask, If,
                       InstSlot, Mma, PublishTask, ReadTask, MmaWait, NamedArrive, NamedSync, PageLookup, Pipeline, Role, Scope, SmemSt, StoreRows,
                       TmaLoad, TmaStore, TmaStoreWait, Wait, instantiate, uses_cond, walk_ops)
from ..ir.sm90 import build_sm90_pipeline
from ..spec.encodings import DescArch, SmemMatrixDesc
from ..spec.plan import (ARCH_LIMITS, block_info_ptx, block_n, MASK_AS_WORDS, MASK_WORD_BITS, SM90_REGS,
                         WINDOW_UNBOUNDED, combine_context, dynamic_tasks, sm90_regs, key_limits_ptx, kv_box_rows,
                         later_blocks_need_mask, mask_words, qk_panels, sm90_consumers, sm90_row_reduction, vo_panels)
from .manifest import DYNAMIC_DEAL, ENTRY, GridFacts, entry_params, manifest, smem_layout_section
from .walk import LoweringError, WalkCtx, Walker, chain, dispatch, exact_log2, f32, pairwise, refuse_planned, smem_layout

__all__ = ["OP_PTX", "SPELLING", "Sm90LoweringError", "Sm90Options", "entry_regs_of", "lower_sm90",
           "lowered_sm90", "manifest_sm90", "threads_of"]

TARGET = "sm_90a"
WG_ROWS = SM90_WG_ROWS  # rows per consumer warpgroup (wgmma M): the plan's
NEG_INF = "0fFF800000"
LN2 = math.log(2.0)
REGS_PER_SM = ARCH_LIMITS[TARGET].regs_per_sm


class Sm90LoweringError(LoweringError):
    """A config or pipeline the sm_90a lowering cannot emit (names what and why)."""


# IR op -> the protocol instructions it lowers to on sm_90a, in order (`*` = repeated per unit:
# 64-column TMA box, k16 wgmma step). `fa4gen check` inverts this table.
OP_PTX: dict[type, tuple[str, ...]] = {
    Wait: ("mbarrier.try_wait.parity",),
    Arrive: ("mbarrier.arrive",),
    ExpectTx: ("mbarrier.arrive.expect_tx",),
    TmaLoad: ("cp.async.bulk.tensor.g2s*",),
    TmaStore: ("cp.async.bulk.tensor.s2g*", "cp.async.bulk.commit_group"),
    TmaStoreWait: ("cp.async.bulk.wait_group.read",),
    Mma: ("wgmma.fence", "wgmma.mma_async*", "wgmma.commit_group"),
    MmaWait: ("wgmma.wait_group",),
    NamedArrive: ("bar.arrive",),
    NamedSync: ("bar.sync",),
    FenceProxyAsync: ("fence.proxy.async.shared::cta",),
    StoreRows: (),
    PageLookup: (),
    SmemSt: (),
    Advance: (),
    # the dynamic deal's task hand-off (plan.dynamic_tasks): its ring's waits and arrives are the
    # protocol; the index itself (atom.global.add, st/ld.shared of one word) is `fa4gen emulate`'s
    FetchTask: (),
    PublishTask: (),
    ReadTask: (),
    Compute: (),
}
# How this target's instructions read back (fa4gen.evidence.check): the wgmma classes after the shared ones
# (walk.COMMON_PTX); the one thread that issues a single-thread op: %p_t0 (the producer role, thread 0
# of the CTA) and %p_elect (thread 0 of a consumer warpgroup: its O store and the wait for it).
WGMMA_PTX = (("wgmma.fence", "wgmma.fence", ""), ("wgmma.mma_async", "wgmma.mma_async", ""),
             ("wgmma.commit_group", "wgmma.commit_group", ""), ("wgmma.wait_group", "wgmma.wait_group", ""))


def threads_of(cfg: KernelConfig) -> int:
    """Threads per CTA: the producer warpgroup and one consumer warpgroup per 64 Q rows."""
    return 128 * (1 + sm90_consumers(cfg.block_m))


def entry_regs_of(cfg: KernelConfig) -> int:
    """ptxas's per-thread register cap of a .maxntid threads / .minnctapersm 1 kernel (multiple of 8):
    168 for the 384 threads of a 128-row tile, 128 for the 512 of a 192-row one."""
    return (REGS_PER_SM // threads_of(cfg)) // 8 * 8


@dataclass(frozen=True)
class Sm90Options:
    """Lowering knobs that are not part of the algorithm's config (tuning and diagnostics)."""

    persistent: bool = True  # False: one CTA per task (the same kernel runs a single round)
    producer_regs: int | None = None  # None: plan.sm90_regs for the config
    consumer_regs: int | None = None

    def __post_init__(self):
        for name in ("producer_regs", "consumer_regs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v % 8 or not 24 <= v <= 256):
                raise Sm90LoweringError(f"{name}={v!r}: setmaxnreg takes a multiple of 8 in [24, 256]")
        # 128-row tiles (2 consumers), the common case: refuse an impossible budget at once
        if self.producer_regs is not None and self.consumer_regs is not None:
            _check_budget(2, self.producer_regs, self.consumer_regs, must_fit_some=True)

    def regs(self, cfg: KernelConfig) -> tuple[int, int]:
        """(producer, consumer) setmaxnreg budgets for cfg, checked against its launch pool."""
        nc = sm90_consumers(cfg.block_m)
        dp, dc = sm90_regs(cfg)
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


def count_down(cfg) -> bool:
    """How the sm_90a K/V loops count (Walker.COUNT_DOWN). Non-causal kernels count down (%kb is the
    block itself): one register and one branch less per iteration, measured +0.1 to +1.4% on D = 64
    and up to +3.5% on D = 128 non-causal against counting up on the H200. Causal kernels count up
    (%t = 0, 1, ...): their tasks run few blocks and counting down measured 1-4% slower on D = 64
    causal (16 x 1024: -3.8%, 32 x 512: -2.3%) and was even on D = 128 causal (python3 -m bench.ab
    --candidate UP --baseline DOWN, 2026-12-03)."""
    return not cfg.causal


class Sm90Walker(Walker):
    OP_PTX = OP_PTX
    Error = Sm90LoweringError
    target = TARGET
    SPLIT_STATES = True

    def __init__(self, ctx: WalkCtx, role: Role, instances: int = 1):
        super().__init__(ctx, role)
        self.COUNT_DOWN = count_down(self.cfg)
        self.instances = instances
        self.s_block: BlockRef | None = None  # the block whose S the registers hold (last QK)
        self.arrive_pred = "%p_lead"  # the predicate of a per-warp arrive (one lane per warp)
        self.page_block: BlockRef | None = None

    # ---- structure ---------------------------------------------------------------------------
    def run(self) -> dict:
        role = self.role
        ops = list(walk_ops(role.program))
        consumer = any(isinstance(op, Mma) for op in ops)
        single = any(isinstance(op, (ExpectTx, TmaLoad)) for op in ops)
        warps = list(role.warps) if self.instances == 1 else [
            w + i * len(role.warps) for i in range(self.instances) for w in role.warps]
        label, end = f"$L_role_{role.name}", f"$L_{role.name}_end"
        self.emit("role_begin", name=role.name, label=label, single=single, end=end)
        if consumer:
            self.consumer_setup(ops)
        for st in role.states:
            self.init_state(st)
        self.stmts(role.program)
        self.emit("role_end", name=role.name, label=end)
        return {"name": role.name, "warps": warps, "regs": role.regs, "items": self.items, "label": label}

    def consumer_setup(self, ops) -> None:
        cfg, lay = self.cfg, self.ctx.layout
        first_wg = self.role.warps[0] // 4
        ids = []
        for op in ops:
            if isinstance(op, (NamedSync, NamedArrive)) and isinstance(op.slot, InstSlot):
                reg, base, count = self.named_reg(op)
                if reg not in [i["dst"] for i in ids]:
                    ids.append({"dst": reg, "base": base, "offset": op.slot.offset % self.instances,
                                "n": self.instances})
        o = lay.regions.get("O_smem")
        qk, vo = qk_panels(cfg), vo_panels(cfg)
        self.emit("consumer_setup", first_wg=first_wg, ids=ids, wg_bytes=WG_ROWS * qk.row_bytes,
                  q_off=lay.region_offset("Q"), k_off=lay.region_offset("K"), v_off=lay.region_offset("V"),
                  o_off=o[0] if o else None, o_wg_bytes=WG_ROWS * vo.row_bytes, o_row_bytes=vo.row_bytes,
                  # the O staging's swizzle: 16-byte chunk c of row R at c ^ ((R >> o_sw_shift) % chunks)
                  o_sw_shift=vo.row_swizzle_shift,
                  # the descriptors' address-independent bits (start 0): the kernel adds each operand's address
                  desc_k_major=hex(SmemMatrixDesc.k_major(DescArch.SM90A, 0, qk.swizzle).encode()),
                  desc_v=hex(SmemMatrixDesc.mn_major(DescArch.SM90A, 0, vo.swizzle,
                                                     panel_stride=vo.bytes(block_n(cfg))).encode()))

    def task_begin(self, head: str, done: str) -> None:
        cfg = self.cfg
        consumer = any(isinstance(op, Mma) for op in walk_ops(self.role.program))
        # the task's K/V blocks (plan.BlockInfo over the Q tile): %nunm, %n >= 1 (KV cache: the split's,
        # from %nlo); printed by the scheduler macros after the task decode
        # a sliding window: the window's blocks [%nlo, %nlo + %n), unmasked [%unlo, %nunm)
        window = self.ctx.window
        blocks = block_info_ptx(causal=cfg.causal, rows=cfg.seq_q_per_tile, m="%mb", sq="%sq", skv="%skv",
                                tmp="%tmp0", n="%n", n_unmasked="%nunm",
                                split=("%split", "%nsplit", "%nlo", "%tmp1" if window else "%tmp0")
                                if cfg.kvcache else None, window=window,
                                lo="%nlo" if window else None,
                                unmasked_lo=self.r("b32", "unlo") if window else None, block_n=block_n(cfg))
        # per row: the first invisible key (and with a window the first visible one), minus this
        # thread's column base 2 (lane % 4): the element mask's limits (plan.key_limits_ptx)
        limits = []
        if consumer:
            for r in range(2):
                end, begin = f"%climit{r}", self.r("b32", f"cbeg{r}") if window else None
                limits += key_limits_ptx(causal=cfg.causal, q=f"%seq{r}", sq="%sq", skv="%skv", end=end,
                                         begin=begin, window=window)
                limits += [("shl.b32", "%tmp0", "%q4", "1"), ("sub.s32", end, end, "%tmp0")]
                limits += [("sub.s32", begin, begin, "%tmp0")] if begin else []
        # a consumer with a barrier-only path (If ROWS_IN_SQ) learns per task whether its rows are past Sq
        idle = consumer and uses_cond(self.role.program, Cond.ROWS_IN_SQ)
        if idle:
            self.r("pred", "p_idle")  # declared by the lowering; read by if_begin's rows_in_sq
        self.emit("task_begin", head=head, done=done, uid=self.p[0], consumer=consumer, blocks=blocks, idle=idle,
                  sqt=cfg.seq_q_per_tile, log2_sqt=exact_log2(cfg.seq_q_per_tile),
                  log2_p=cfg.gqa_pack.bit_length() - 1, p=cfg.gqa_pack, limits=limits,
                  o_regs=self.ctx.o_regs if consumer else [], neg_inf=NEG_INF)

    def if_args(self, st: If) -> dict:
        if st.cond is Cond.LAST_BLOCK:
            if self.loop_kind is None or self.loop_kind.value == "tasks":
                return {"pre": [("setp.ne.u32", "%p_c", "%n", "1")]}
            if self.COUNT_DOWN:  # block 0 is the last
                return {"pre": [("setp.ne.u32", "%p_c", "%kb", "0")]}
            return {"pre": [("sub.u32", "%kb", "%n", "1"), ("setp.ne.u32", "%p_c", "%t", "%kb")]}  # t == n-1
        if st.cond in (Cond.FIRST_INSTANCE, Cond.LAST_INSTANCE):
            k = 0 if st.cond is Cond.FIRST_INSTANCE else self.instances - 1
            return {"pre": [("setp.ne.u32", "%p_c", "%cw", str(k))]}
        return {"pre": []}

    def if_(self, st: If) -> None:
        """An If(LAST_BLOCK) of per-warp arrives only (the consumers' Q-slot release) is predicated,
        not branched around: a branch in the middle of the K/V loop would cut its one basic block in
        two, and ptxas schedules no instruction across it (measured about 2% on D = 64 on the H200)."""
        if (st.cond is Cond.LAST_BLOCK and not st.orelse and st.then
                and all(isinstance(o, Arrive) and o.scope is Scope.WARP for o in st.then)):
            pre = [("setp.eq.u32", *i[1:]) if i[0] == "setp.ne.u32" else i for i in self.if_args(st)["pre"]]
            self.emit("predicate", list=pre + [("and.pred", "%p_al", "%p_c", "%p_lead")],
                      note="the last K/V block of the task: one lane per warp arrives")
            self.arrive_pred = "%p_al"
            self.stmts(st.then)
            self.arrive_pred = "%p_lead"
            return
        super().if_(st)

    # ---- ops ---------------------------------------------------------------------------------
    def op_Arrive(self, op: Arrive) -> None:
        super().op_Arrive(op)
        self.items[-1]["pred"] = self.arrive_pred if op.scope is Scope.WARP else None

    def arrivals(self, scope: Scope) -> int:
        if scope is Scope.WARP:
            return len(self.role.warps)
        return super().arrivals(scope)

    def named_reg(self, op) -> tuple[str, int, int]:
        b = self.pipe.barrier(op.barrier)
        off = op.slot.offset % self.instances
        return self.r("b32", f"nb_{op.barrier}_{off}"), b.named_id, b.count

    def named(self, op) -> tuple[str, int, bool]:
        if isinstance(op.slot, InstSlot):
            reg, _, count = self.named_reg(op)
            return reg, count, False
        return super().named(op)

    def op_MmaWait(self, op: MmaWait) -> None:
        self.emit("mma_wait", n=op.pending)

    def slot_desc(self, region: str, state: str, base: str) -> tuple[list[tuple], str]:
        """(instructions, register): the wgmma descriptor of the state's slot of an SMEM region, base
        descriptor + (slot * slot bytes) >> 4, kept until the state advances."""
        kind, v = self.slot(state)
        nbytes = self.ctx.layout.slot_bytes(region)

        def compute(dst):
            if kind == "const":
                return [("add.s64", dst, base, str((v * nbytes) >> 4))]
            pre, qs = self.slot_reg(v)
            return pre + [("mul.lo.u32", "%tmp5", qs, str(nbytes >> 4)), ("cvt.u64.u32", dst, "%tmp5"),
                          ("add.s64", dst, dst, base)]
        return self.cached(f"desc{region}", state, compute)

    def op_Mma(self, op: Mma) -> None:
        cfg = self.cfg
        dt = {"bf16": "bf16", "fp16": "f16"}[cfg.dtype]
        qk, vo = qk_panels(cfg), vo_panels(cfg)
        bn = block_n(cfg)  # keys per K/V block: QK^T's N, PV's K
        q_half, half, kpp = qk.bytes(cfg.block_m), qk.bytes(bn), qk.k_steps
        if op.kind == "qk":
            self.s_block = op.block
            pa, da = self.slot_desc("Q", op.a_slot, "%dq")
            pb, db = self.slot_desc("K", op.b_slot, "%dk0")
            pre = pa + pb
            # k16 step k: panel k // kpp, 32 bytes (2 units of 16) further along its swizzled rows per step
            steps = [{"a": (k // kpp) * (q_half >> 4) + (k % kpp) * 2, "b": (k // kpp) * (half >> 4) + (k % kpp) * 2,
                      "scale_d": "%p_false" if k == 0 else "%p_true"} for k in range(cfg.head_dim // 16)]
            self.what(f"S = Q[{self.slot_note(op.a_slot)}] x K[{self.slot_note(op.b_slot)}]^T (block "
                      f"{self.block_note(op.block)}): wgmma m64n{bn}k16, {len(steps)} k-steps")
            self.emit("gemm_ss", pre=pre, inst=f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{dt}.{dt}",
                      d_regs=self.ctx.s_regs, a=da, b=db, steps=steps)
            return
        pre, dv = self.slot_desc("V", op.b_slot, "%dv0")
        p = self.ctx.p_regs
        steps = [{"b": (16 * vo.row_bytes * j) >> 4, "a": p[4 * j:4 * j + 4]} for j in range(bn // 16)]  # 16 key rows
        # O is zeroed at the task's start, so accumulating on the first PV equals not accumulating
        self.what(f"O += P x V[{self.slot_note(op.b_slot)}] (block {self.block_note(op.block)}): wgmma "
                  f"m64n{cfg.head_dim_v}k16, P from registers")
        self.emit("gemm_rs", pre=pre, inst=f"wgmma.mma_async.sync.aligned.m64n{cfg.head_dim_v}k16.f32.{dt}.{dt}",
                  d_regs=self.ctx.o_regs, b=dv, steps=steps)

    def op_PageLookup(self, op: PageLookup) -> None:
        cfg = self.cfg
        rows = kv_box_rows(cfg)
        self.page_block = op.block
        self.what(f"page-table entries of K/V block {self.block_note(op.block)}")
        self.emit("page_entries", pre=self.block_reg(op.block, "%tmp4"), boxes=[i * rows for i in range(block_n(cfg) // rows)],
                  log2_page=cfg.page_size.bit_length() - 1)

    def op_TmaLoad(self, op: TmaLoad) -> None:
        cfg = self.cfg
        pre, base, off = self.smem_addr(op.dst, op.dst_slot, "%dst")
        if base == "%smem":
            pre = pre + [("mov.u32", "%dst", "%smem")]
        bpre, mbar = self.bar_addr(op.barrier, op.bar_slot)
        if op.tensor == "q":
            qk = qk_panels(cfg)
            self.emit("tma_load_q", pre=pre + bpre, mbar=mbar, sqt=cfg.seq_q_per_tile, varlen=cfg.varlen,
                      boxes=[{"c0": h * qk.panel_cols, "off": off + h * qk.bytes(cfg.block_m)} for h in range(qk.count)])
            return
        pn = qk_panels(cfg) if op.tensor == "k" else vo_panels(cfg)  # K: D columns, V: DV
        half = pn.bytes(block_n(cfg))  # the step between a K/V tile's panels
        pre = pre + self.block_reg(op.block, "%tmp4")
        if cfg.page_size:
            if self.page_block is not op.block:
                raise self.Error(f"{self.p}: paged TmaLoad of block {op.block.value} without its PageLookup")
            rows = kv_box_rows(cfg)
            boxes = [{"c0": h * pn.panel_cols, "off": off + h * half + i * rows * pn.row_bytes, "pg": f"%pg{i}"}
                     for i in range(block_n(cfg) // rows) for h in range(pn.count)]
        else:
            boxes = [{"c0": h * pn.panel_cols, "off": off + h * half} for h in range(pn.count)]
        self.emit("tma_load_kv", pre=pre + bpre, mbar=mbar, tmap=f"%tm{op.tensor}", boxes=boxes,
                  varlen=cfg.varlen, paged=bool(cfg.page_size), page_size=cfg.page_size)

    def op_SmemSt(self, op: SmemSt) -> None:
        if op.region != "O_smem" or not isinstance(op.slot, InstSlot) or op.slot.offset:
            raise self.Error(f"{self.p}: SmemSt of {op.region}: the consumer's own O staging slot only")
        self.emit("smem_st_o", o_store=self.ctx.o_store)

    def op_TmaStore(self, op: TmaStore) -> None:
        cfg = self.cfg
        vo = vo_panels(cfg)  # the staging: a block_m-row tile of DV columns, each consumer's 64 rows in every panel
        P = cfg.gqa_pack
        self.emit("tma_store_o", boxes=[{"c0": h * vo.panel_cols,
                                         "off": self.ctx.layout.region_offset("O_smem") + h * vo.bytes(cfg.block_m)}
                                        for h in range(vo.count)],
                  g_step=WG_ROWS if P > WG_ROWS else 0, s_step=WG_ROWS // P if P <= WG_ROWS else 0,
                  sqt=cfg.seq_q_per_tile, wg_bytes=WG_ROWS * vo.row_bytes, skip=self.label("noel"))

    def op_StoreRows(self, op: StoreRows) -> None:
        cfg = self.cfg
        D = cfg.head_dim_v  # O's columns
        vo = vo_panels(cfg)
        # thread t copies 16-byte chunk t % cpr of rows t / cpr (+ row_step ...): cpr is the row's chunks
        # rounded up to a power of two (D = 96: 12 of 16; the other 4 threads of a row idle)
        chunks = 2 * D // 16
        cpr = 1 << (chunks - 1).bit_length()
        row_bytes = 2 * D
        self.emit("store_rows_o", vl={"cpr": cpr, "cpr_shift": cpr.bit_length() - 1, "chunks": chunks,
                                      "row_step": 128 // cpr, "iters": WG_ROWS // (128 // cpr),
                                      "row_shift": exact_log2(row_bytes), "row_bytes": row_bytes},
                  pn={"shift": (vo.row_bytes // 16).bit_length() - 1, "mask": vo.row_bytes // 16 - 1,
                      "row_bytes": vo.row_bytes, "sw_shift": vo.row_swizzle_shift},
                  q_half_bytes=vo.bytes(cfg.block_m), o_off=self.ctx.layout.region_offset("O_smem"),
                  sqt=cfg.seq_q_per_tile, log2_p=cfg.gqa_pack.bit_length() - 1, p=cfg.gqa_pack, g=cfg.gqa_ratio)

    def op_Compute(self, op: Compute) -> None:
        fn = getattr(self, "compute_" + op.fn, None)
        if fn is None:
            raise self.Error(f"{self.p}: Compute fn {op.fn!r} has no sm_90a lowering")
        fn(op)

    def compute_softmax(self, op: Compute) -> None:
        if self.s_block is None:
            raise self.Error(f"{self.p}: softmax before any QK MMA")
        cfg = self.cfg
        # plan.BlockInfo.needs_mask: block >= n_unmasked, or (a window) block < unmasked_lo; a block after
        # the task's first needs none without causal or a window (plan.later_blocks_need_mask)
        test = [("setp.ge.s32", "%p_mask", "%nb", "%nunm")]
        if cfg.window:
            test += [("setp.lt.or.s32", "%p_mask", "%nb", "%unlo", "%p_mask")]
        where = "blocks >= %nunm or < %unlo" if cfg.window else "blocks >= %nunm"
        if self.s_block is not BlockRef.FIRST and not later_blocks_need_mask(cfg.causal, cfg.window):
            test, where = None, "no block (no block after the task's first needs one)"
        cap = "S = tanh(S * softcap_in), " if cfg.softcap else ""
        self.what(f"softmax of S (block {self.block_note(self.s_block)}): {cap}mask on {where}, row max, "
                  f"conditional rescale (threshold {cfg.rescale_threshold:g}), exp2, row sums; "
                  "%p_rescale = some row of the warp moved its reference")
        self.emit("softmax", pre=self.block_reg(self.s_block, "%nb"), rows=self.ctx.rows, mask_test=test,
                  softcap=self.ctx.softcap_in, masked=self.label("masked"), done=self.label("sm_done"),
                  threshold=f32(-cfg.rescale_threshold), poly=[f32(c) for c in EXP2_POLY])

    def compute_pack_p(self, op: Compute) -> None:
        self.emit("pack_p", p_pack=self.ctx.p_pack)

    def compute_rescale_o(self, op: Compute) -> None:
        self.emit("rescale_o", o_rescale=self.ctx.o_rescale)

    def compute_normalize(self, op: Compute) -> None:
        cfg = self.cfg
        sink = [self.sink_normalize(r) for r in range(2)] if cfg.sinks else None
        if sink:
            self.what("normalize with the row's sink z (sink_ptr[head], log2 units z2 = z log2 e; KV cache: "
                      "none in a split's partial, fa4_combine adds it): m = ref * scale_log2, M = max(m, z2), "
                      "l = row_sum 2^(m - M) + 2^(z2 - M), O *= 2^(m - M) / l, LSE = (M + log2 l) ln 2 "
                      "(M = -inf: O = 0, LSE = -inf)")
        else:
            self.what("normalize: O *= 1 / row_sum (0 for a row that saw no key); LSE = (ref * scale_log2 + "
                      "log2(row_sum)) * ln 2 (-inf then)")
        self.emit("normalize", o_scale=[(reg, f"%inv{(i >> 1) & 1}") for i, reg in enumerate(self.ctx.o_regs)],
                  ln2=f32(LN2), neg_inf=NEG_INF, sink=sink)

    def sink_normalize(self, r: int) -> list[tuple]:
        """Row half r's normalisation with its sink (plan.SINKS_ABI_PARAMS; the spec's robust form):
        after the row sum's reduction, %inv<r> = 2^(m - M) / l and %lsev<r> = (M + log2 l) ln 2."""
        sink, m, big = (self.r("f32", f"{n}{r}") for n in ("snk", "smr", "smx"))
        ssum, inv, lse = f"%sum{r}", f"%inv{r}", f"%lsev{r}"
        ins = [("ld.param.u64", "%rda", "[sink_ptr]"), ("mul.wide.u32", "%rdt", f"%head{r}", "4"),
               ("add.s64", "%rdt", "%rdt", "%rda"), ("ld.global.nc.f32", sink, "[%rdt]"),
               ("mul.f32", sink, sink, f32(1.0 / LN2))]
        if self.cfg.kvcache:  # several splits: the partials leave the sink to fa4_combine (counted once)
            ins += [("setp.gt.u32", "%pp2", "%nsplit", "1"), ("@%pp2 mov.f32", sink, NEG_INF)]
        ins += [("mul.f32", m, f"%ref{r}", "%scale"), ("max.f32", big, m, sink),
                ("sub.f32", m, m, big), ("ex2.approx.ftz.f32", m, m),
                ("sub.f32", sink, sink, big), ("ex2.approx.ftz.f32", sink, sink),
                ("fma.rn.f32", ssum, ssum, m, sink),
                ("rcp.approx.ftz.f32", inv, ssum), ("mul.f32", inv, inv, m),
                ("lg2.approx.ftz.f32", lse, ssum), ("add.f32", lse, lse, big), ("mul.f32", lse, lse, f32(LN2)),
                ("setp.eq.f32", "%pp2", big, NEG_INF), ("@%pp2 mov.f32", inv, "0f00000000"),
                ("@%pp2 mov.f32", lse, NEG_INF)]
        return ins

    def compute_store_lse(self, op: Compute) -> None:
        self.emit("store_lse", varlen=self.cfg.varlen, g=self.cfg.gqa_ratio)

    def compute_store_lse_partial(self, op: Compute) -> None:
        self.emit("store_lse_partial", g=self.cfg.gqa_ratio)

    def o_row_stores(self, elem_bytes: int) -> list[dict]:
        """A thread's O accumulator column pairs 8 c + 2 (lane % 4) of row half r, as stores of
        elem_bytes-wide elements: the byte offset of pair c in its row (fragment layout of Sm90Ctx)."""
        o = self.ctx.o_regs
        return [{"r": r, "lo": o[4 * c + 2 * r], "hi": o[4 * c + 2 * r + 1], "off": 8 * elem_bytes * c}
                for r in range(2) for c in range(self.cfg.head_dim_v // 8)]

    def compute_store_o_rows(self, op: Compute) -> None:
        cfg = self.cfg
        if not cfg.kvcache:
            self.what("O from the registers: each thread's rows < Sq" + (" of the sequence" if cfg.varlen else "")
                      + f" through o_ptr ({'(total_q' if cfg.varlen else '(B, Sq'}, Hq, {cfg.head_dim_v}) contiguous)")
        self.emit("store_o_rows", g=cfg.gqa_ratio, row_bytes=2 * cfg.head_dim_v, stores=self.o_row_stores(2),
                  varlen=cfg.varlen)

    def compute_store_o_partial(self, op: Compute) -> None:
        self.emit("store_o_partial", g=self.cfg.gqa_ratio, row_bytes=4 * self.cfg.head_dim_v,
                  stores=self.o_row_stores(4))


class Sm90Ctx(WalkCtx):
    """The walk context plus the consumer's register tiles (wgmma fragments) every role shares."""

    def __init__(self, pipe: Pipeline, layout):
        super().__init__(pipe, layout, tmem_warp=-1)
        cfg = pipe.config
        DV = cfg.head_dim_v  # O's columns (Q's and K's are cfg.head_dim)
        # score modifiers' run-time values, loaded once at the entry (score_params): the window's
        # sides (block_info_ptx / key_limits_ptx; a causal window's right side is 0), softcap_in
        self.window = (self.reg("b32", "%wl"), "0" if cfg.causal else self.reg("b32", "%wr")) if cfg.window else None
        self.softcap_in = self.reg("f32", "%capin") if cfg.softcap else None
        if cfg.window and not cfg.kvcache:  # the window's first block (KV-cache kernels declare %nlo already)
            self.reg("b32", "%nlo")
        if "O_smem" not in layout.regions and not (cfg.varlen or cfg.kvcache):  # (theirs declare it already)
            self.reg("b64", "%vop")  # o_ptr: a dense kernel storing O from the registers
        bn = block_n(cfg)  # keys per K/V block
        self.s_regs = [f"%s{i}" for i in range(bn // 2)]  # m64n<bn> f32 accumulator: bn / 2 per thread
        self.o_regs = [f"%o{i}" for i in range(DV // 2)]
        self.p_regs = [f"%pk{i}" for i in range(bn // 4)]  # bn / 16 k16 steps x 4 .b32 A fragments
        # wgmma accumulator fragment (PTX ISA 9.7.15.5.1): register i holds row lane/4 + 8*((i>>1)&1)
        # of the warp's 16 and column 8*(i>>2) + 2*(lane%4) + (i&1); the A fragment of k16 step j is
        # accumulator registers 8j..8j+7 paired in order (cvt packs its first source in the upper half).
        s, p = self.s_regs, self.p_regs
        self.p_pack = [(p[4 * j + t], s[8 * j + 2 * t + 1], s[8 * j + 2 * t]) for j in range(bn // 16) for t in range(4)]
        self.o_rescale = [(reg, f"%acc{(i >> 1) & 1}") for i, reg in enumerate(self.o_regs)]
        rows, self.n_mask_words = [], 0
        reduction = sm90_row_reduction(cfg)  # "chain" | "tree": the row max and sum (plan.sm90_row_reduction)
        for r in range(2):
            elems = []
            for i, reg in enumerate(s):
                if (i >> 1) & 1 != r:
                    continue
                c, e = i >> 2, i & 1
                elems.append({"reg": reg, "col": 8 * c + e, "emu": hopper_emulated(cfg, c, e), "i": i, "sum_op": None})
            words, where = mask_words([x["col"] for x in elems]) if MASK_AS_WORDS[cfg.arch] else ([], [])
            self.n_mask_words = max([self.n_mask_words, *(w + 1 for w in words)])
            for x, (w, bit) in zip(elems, where):
                x["mword"], x["mbit"] = f"%mw{w}", bit
            regs = [x["reg"] for x in elems]
            if reduction == "chain":  # the sum's k-th add follows element k + 1's exp (exps emits "sum_op")
                max_ops, max_res = chain(regs, f"%mx{r}_")
                sum_chain, sum_res = chain(regs, f"%sm{r}_")
                for x, op in zip(elems[1:], sum_chain):
                    x["sum_op"] = op
                sum_ops = []  # (row_sum: only the rescale and the chain's result)
            else:
                max_ops, max_res = pairwise(regs, f"%mx{r}_")
                sum_ops, sum_res = pairwise(regs, f"%sm{r}_")
            rows.append({"elems": elems, "max_ops": max_ops, "max_res": max_res, "sum_ops": sum_ops,
                         "sum_res": sum_res, "ref": f"%ref{r}", "nrs": f"%nrs{r}", "sum": f"%sum{r}",
                         "acc": f"%acc{r}", "lim": f"%lim{r}", "bmax": f"%bmax{r}", "idx": r,
                         # a window: the first visible column's limit (visible iff blim <= col < lim)
                         "blim": self.reg("b32", f"%blim{r}") if cfg.window else None,
                         "cbeg": f"%cbeg{r}" if cfg.window else None,
                         "mask_words": [{"reg": f"%mw{w}", "base": w * MASK_WORD_BITS} for w in words],
                         "mtmp": "%mt"})
        self.rows = rows
        # temporaries per row family (%mx<r>_, %sm<r>_): the max's ops; the sum's tree, or its chain's adds on the elems
        self.n_tmp = max(max(len(r["max_ops"]), len(r["sum_ops"]) + sum(x["sum_op"] is not None for x in r["elems"]))
                         for r in rows)
        vo = vo_panels(cfg)
        q_half, per_row = vo.bytes(cfg.block_m), vo.row_bytes // 16  # 16-byte chunks (8 columns) per panel row
        self.o_store = []
        for cfull in range(DV // 8):
            h, c8 = divmod(cfull, per_row)
            for r in range(2):
                i0 = 4 * cfull + 2 * r
                self.o_store.append({"c16": c8 * 16, "off": h * q_half + r * 8 * vo.row_bytes,
                                     "lo": self.o_regs[i0], "hi": self.o_regs[i0 + 1]})


def _check_instances(pipe: Pipeline) -> None:
    """The PTX is emitted from each replicated program once: its instances must be the verified roles."""
    for tmpl in pipe.replicated:
        for i in range(tmpl.instances):
            if pipe.role(f"{tmpl.name}{i}") != instantiate(tmpl, i):
                raise Sm90LoweringError(f"role {tmpl.name}{i} is not instance {i} of the replicated {tmpl.name}: "
                                    "the verified program would not be the emitted one")


def lower_sm90(pipe: Pipeline) -> dict:
    """Template context of templates/sm90/fa4_fwd.ptx.j2 from a (verified) sm_90a pipeline."""
    cfg = pipe.config
    if pipe.arch != TARGET or cfg.arch != TARGET:
        raise Sm90LoweringError(f"arch {cfg.arch!r}: this lowering emits {TARGET} only")
    refuse_planned(cfg, Sm90LoweringError)
    _check_instances(pipe)
    layout = smem_layout(pipe, Sm90LoweringError)
    ctx = Sm90Ctx(pipe, layout)
    first_of = {f"{t.name}0": t for t in pipe.replicated}
    later = {f"{t.name}{i}" for t in pipe.replicated for i in range(1, t.instances)}
    roles = [Sm90Walker(ctx, first_of[r.name], first_of[r.name].instances).run() if r.name in first_of
             else Sm90Walker(ctx, r).run() for r in pipe.roles if r.name not in later]
    inits = []
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED:
            continue
        for s in range(b.slots):
            inits.append({"addr": f"%bar+{layout.barriers[b.name] + 8 * s}", "count": b.count,
                          "what": f"init {b.name}[{s}]: {b.kind.value}, {b.count} arrival{'s' if b.count != 1 else ''} per phase"})
    P = cfg.gqa_pack
    score_params = _score_params(ctx)
    return {
        "generator_version": GENERATOR_VERSION,
        "name": cfg.name,
        "ptx_version": PTX_VERSION_FOR_ARCH[TARGET],
        "target": TARGET,
        "entry": ENTRY,
        "param_decls": [decl for _, decl in entry_params(pipe)],
        "score_params": score_params,
        "threads": pipe.threads,
        "block_m": cfg.block_m,
        "consumers": pipe.replicated[0].instances,
        "causal": cfg.causal, "varlen": cfg.varlen, "kvcache": cfg.kvcache, "page_size": cfg.page_size,
        "head_dim": cfg.head_dim, "head_dim_v": cfg.head_dim_v, "G": cfg.gqa_ratio, "P": P, "NG": cfg.head_groups,
        "sqt": cfg.seq_q_per_tile, "log2_P": P.bit_length() - 1,
        "kv_stages": pipe.barrier("k_full").slots,
        "box_rows": kv_box_rows(cfg), "log2_page": cfg.page_size.bit_length() - 1,
        "block_n": block_n(cfg), "log2_bn": block_n(cfg).bit_length() - 1,
        "wg_rows": WG_ROWS, "log2_wg_rows": exact_log2(WG_ROWS),  # a consumer's first row: %cw x wg_rows
        "inits": inits,
        "decls": ctx.decls(),
        "roles": roles,
        "dispatch": dispatch(pipe, roles, Sm90LoweringError),
        "s_n": len(ctx.s_regs), "o_n": len(ctx.o_regs), "p_n": len(ctx.p_regs), "n_tmp": ctx.n_tmp,
        "mask_words": ctx.n_mask_words,
        "neg_inf": NEG_INF,
        "cvt_pack": {"bf16": "cvt.rn.bf16x2.f32", "fp16": "cvt.rn.f16x2.f32"}[cfg.dtype],
        "ln2": f32(LN2), "log2e": f32(1.0 / LN2),
        "cmb": combine_context(cfg),
        "regs_per_sm": REGS_PER_SM,
    }


def _score_params(ctx: Sm90Ctx) -> list[tuple]:
    """The score modifiers' parameters (plan.WINDOW_ABI_PARAMS, SOFTCAP_ABI_PARAMS) into the registers
    the kernel reads them from; window sides clamped to the ABI's [0, WINDOW_UNBOUNDED]. sink_ptr is
    read where the normalisation loads a sink."""
    ins = []
    if ctx.window:
        for reg, name in zip(ctx.window, ("window_left", "window_right")):
            if reg != "0":
                ins += [("ld.param.s32", reg, f"[{name}]"), ("max.s32", reg, reg, "0"),
                        ("min.s32", reg, reg, str(WINDOW_UNBOUNDED))]
    if ctx.softcap_in:
        ins += [("ld.param.f32", ctx.softcap_in, "[softcap_in]")]
    return ins


def _with_regs(pipe: Pipeline, producer: int, consumer: int) -> Pipeline:
    """The pipeline with Sm90Options' setmaxnreg budgets (the producer warpgroup's and the consumers')."""
    def fix(r):
        return dataclasses.replace(r, regs=consumer if r.warps[0] >= 4 else producer)
    return dataclasses.replace(pipe, roles=tuple(fix(r) for r in pipe.roles),
                               replicated=tuple(fix(r) for r in pipe.replicated))


def lowered_sm90(cfg_or_pipe, options: Sm90Options | None = None) -> tuple[dict, dict]:
    """(template context, manifest) of the sm_90a kernel, lowered from its pipeline IR; render.kernels.build_sm90
    renders it. Takes a KernelConfig (builds its pipeline, unverified: fa4gen.codegen.build is the verified
    chain) or a Pipeline."""
    if isinstance(cfg_or_pipe, KernelConfig):
        cfg, pipe = cfg_or_pipe, build_sm90_pipeline(cfg_or_pipe)
    else:
        cfg, pipe = cfg_or_pipe.config, cfg_or_pipe
    opt = options or Sm90Options()
    if cfg.arch != TARGET:
        raise Sm90LoweringError(f"arch {cfg.arch!r}: this lowering emits sm_90a only")
    p, c = opt.regs(cfg)
    if (p, c) != (pipe.roles[0].regs, pipe.replicated[0].regs):
        pipe = _with_regs(pipe, p, c)
    return lower_sm90(pipe), manifest_sm90(cfg, options)



def manifest_sm90(cfg: KernelConfig, options: Sm90Options | None = None) -> dict:
    """The ABI manifest (fa4gen.lower.manifest) with the sm_90a facts: the SMEM layout derived from
    the Pipeline (the offsets this kernel uses), O boxes of one consumer warpgroup's 64 rows, one Q
    tile per task (persistent: causal tasks heaviest first inside L2 sections, fa4gen/spec/schedule.py,
    dealt to the resident CTAs with odd rounds reversed), and the `sm90` record of the plan and the
    options."""
    opt = options or Sm90Options()
    pipe = build_sm90_pipeline(cfg)
    producer_regs, consumer_regs = opt.regs(cfg)
    # the dynamic deal (plan.dynamic_tasks): each CTA takes the next task index from the task counter
    grid = GridFacts(policy="persistent" if opt.persistent else "one_per_task",
                     deal=DYNAMIC_DEAL if dynamic_tasks(cfg) else "",
                     lpt_deal=DYNAMIC_DEAL if dynamic_tasks(cfg) else "; snake deal", varlen_lpt=True, mode_keys=False,
                     launch=False)
    layout = smem_layout(pipe, Sm90LoweringError)
    return manifest(pipe, smem_bytes=layout.total, o_rows=WG_ROWS, grid=grid,
                    variant="" if opt == Sm90Options() else _options_tag(opt),
                    sections={"sm90": {"kv_stages": pipe.region("K").slots, "q_stages": pipe.region("Q").slots,
                                       "consumers": sm90_consumers(cfg.block_m), "producer_regs": producer_regs,
                                       "consumer_regs": consumer_regs}, **smem_layout_section(layout)})


def _options_tag(opt: Sm90Options) -> str:
    parts = []
    if not opt.persistent:
        parts.append("onepertask")
    if (opt.producer_regs, opt.consumer_regs) != (None, None):
        parts.append(f"r{opt.producer_regs}-{opt.consumer_regs}")
    return "_".join(parts) or "opt"


SPELLING = Sm90Walker.spelling(WGMMA_PTX, single=("%p_t0", "%p_elect"))
