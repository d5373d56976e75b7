"""The plan below the IR and the lowering: facts both read (the arch limits, tile geometry, the ABI).
The SMEM layout is derived from the Pipeline (fa4gen/ir/layout.py); the sm_90a ring depths are chosen
by it (fa4gen/ir/sm90.py sm90_stages).

Imports run down the chain only: spec (tiles -> config -> plan, and the ISA facts of
fa4gen/spec/encodings.py, which imports nothing of the package) -> ir -> verify -> lower. Nothing here
imports ir/ or lower/, and nothing in the package imports in a circle (tests/test_imports.py holds both).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .config import KernelConfig
from .encodings import TMEM_COLUMNS, Swizzle, TmaL2Promotion
from .tiles import ROWS, SM90_WG_ROWS, PlanError, gqa_pack


@dataclass(frozen=True)
class ArchLimits:
    """What one CTA of a target may use: every limit the IR, the verifier, the lowerings and the CLI
    check against reads this table (ARCH_LIMITS); ISA encoding facts stay in fa4gen/spec/encodings.py,
    which the table reads where the two meet (TMEM columns, the swizzle pattern)."""

    smem_per_cta: int  # bytes of dynamic SMEM a CTA may opt into
    smem_align: int  # the dynamic SMEM base is aligned to this (the kernel rounds it up; the slack is requested)
    regs_per_sm: int  # 32-bit registers a CTA's warps share (setmaxnreg budgets x threads stay within)
    tmem_cols: int  # 32-bit TMEM columns a CTA may allocate (0: no Tensor Memory)


# 227 KiB of dynamic SMEM per CTA on both; 128B-swizzle patterns (8 rows x 128 B) start on their
# 1024-byte boundary (descriptor base_offset 0), so the layouts align the base to it.
ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_90a": ArchLimits(smem_per_cta=232448, smem_align=Swizzle.B128.pattern_bytes, regs_per_sm=65536,
                         tmem_cols=0),
    "sm_100a": ArchLimits(smem_per_cta=232448, smem_align=Swizzle.B128.pattern_bytes, regs_per_sm=65536,
                          tmem_cols=TMEM_COLUMNS),
}


# The `.version` each target's kernel declares, in one place: both lowerings (fa4gen/lower/sm90.py,
# fa4gen/lower/sm100.py) print it into the PTX header. Both must be read by the toolchains in play:
# ptxas/nvJitLink 13.0 here, and on the H200 machines the driver r580 (CUDA 13.0, PTX ISA <= 9.0)
# whose JIT would compile the PTX if it were loaded as text (tests/test_assemble.py checks both).
# - sm_100a: 8.8 (CUDA 12.9, driver r575), the oldest ISA that is current for everything the kernel
#   uses (tcgen05.*, setmaxnreg on sm_100a: 8.6). Emitting 9.0 would lock out CUDA 12.9 toolchains
#   for no feature the kernel needs.
# - sm_90a: 8.5 (CUDA 12.5). What the Hopper kernel uses (wgmma, setmaxnreg, elect.sync, 5-D TMA)
#   is PTX 8.0+ (assemble.MIN_PTX_ISA_FOR_ARCH); 8.5 is the header of the sm_90a PTX that ran on the H200
#   (generated/fa4_sm90a_*.ptx), kept so that PTX stays byte-identical.
PTX_VERSION_FOR_ARCH: dict[str, str] = {"sm_90a": "8.5", "sm_100a": "8.8"}


# The kernel ABI (docs/ABI.md): every entry's parameters, in signature order, with their PTX
# declarations. The manifest's "params", the runtime's argument packing and both templates read this.
ABI_PARAMS: tuple[tuple[str, str], ...] = (
    ("tmap_q", ".param .align 64 .b8 tmap_q[128]"),
    ("tmap_k", ".param .align 64 .b8 tmap_k[128]"),
    ("tmap_v", ".param .align 64 .b8 tmap_v[128]"),
    ("tmap_o", ".param .align 64 .b8 tmap_o[128]"),
    ("lse_ptr", ".param .u64 lse_ptr"),
    ("batch", ".param .u32 batch"),
    ("seqlen_q", ".param .u32 seqlen_q"),
    ("seqlen_k", ".param .u32 seqlen_k"),
    ("num_heads_kv", ".param .u32 num_heads_kv"),
    ("scale_log2", ".param .f32 scale_log2"),
    ("num_m_blocks", ".param .u32 num_m_blocks"),
    ("num_tasks", ".param .u32 num_tasks"),
    ("l2_group", ".param .u32 l2_group"),
)
# Appended for dense (not varlen, not KV-cache) kernels that store O from the registers (sm_90a
# (192, 128) and (256, 256): no O staging fits beside their rings, ir/sm90.sm90_o_staged; the Pipeline says which, and
# lower/manifest.entry_params asks it): O (B, Sq, Hq, DV) contiguous, each thread writing its rows < Sq.
DENSE_O_ABI_PARAMS: tuple[tuple[str, str], ...] = (("o_ptr", ".param .u64 o_ptr"),)
# Appended for varlen kernels (KernelConfig.varlen; docs/ABI.md "Varlen"): sequence b's query rows
# are [cu_seqlens_q[b], cu_seqlens_q[b+1]) of the packed (total_q, Hq, D) tensors, its keys
# [cu_seqlens_k[b], ...) of (total_k, Hkv, D), at most seqused_k[b] of them when that pointer is not 0.
# O is written through o_ptr by the threads (a TMA store would write the rows of the next sequence
# that share the tile); `batch` is B, seqlen_q / seqlen_k the caller's max_seqlen (not trusted),
# num_tasks the host's bound on the tasks (varlen_task_bound).
VARLEN_ABI_PARAMS: tuple[tuple[str, str], ...] = (
    ("cu_seqlens_q", ".param .u64 cu_seqlens_q"),
    ("cu_seqlens_k", ".param .u64 cu_seqlens_k"),
    ("seqused_k", ".param .u64 seqused_k"),
    ("o_ptr", ".param .u64 o_ptr"),
    ("total_q", ".param .u32 total_q"),
    ("total_k", ".param .u32 total_k"),
)
# Appended for KV-cache kernels (KernelConfig.kvcache; docs/ABI.md "KV cache"). The dense
# parameters keep their meaning with seqlen_k = the cache's key capacity per sequence (contiguous:
# Smax; paged: max_pages * page_size) and num_tasks = B * Hkv * (G / P) * num_m_blocks * num_splits.
KVCACHE_ABI_PARAMS: tuple[tuple[str, str], ...] = (
    ("cache_seqlens", ".param .u64 cache_seqlens"),  # int32 [B]: keys of sequence b (clamped on the device)
    ("page_table", ".param .u64 page_table"),  # int32 [B, max_pages] rows page_table_stride apart; 0 if contiguous
    ("page_table_stride", ".param .u32 page_table_stride"),
    ("max_pages", ".param .u32 max_pages"),
    ("num_pages", ".param .u32 num_pages"),
    ("num_splits", ".param .u32 num_splits"),
    ("o_partial", ".param .u64 o_partial"),  # fp32 [num_splits, R, D], R = B * Sq * Hq rows (b, pos, head)
    ("lse_partial", ".param .u64 lse_partial"),  # fp32 [num_splits, R], natural log
    ("o_ptr", ".param .u64 o_ptr"),  # O (B, Sq, Hq, D) contiguous: sm_90a stores it from registers
)
# Appended for score modifiers (KernelConfig.window / softcap / sinks; docs/ABI.md "Windows, softcap,
# sinks"), in this order, each only when its flag is set:
# - window_left, window_right: the sides as s32 in [0, WINDOW_UNBOUNDED] (-1 -> WINDOW_UNBOUNDED; a
#   causal kernel ignores window_right: it is 0). Query i sees keys j with
#   i + Skv - Sq - left <= j <= i + Skv - Sq + right (Skv per sequence: varlen's, the cache's k_len).
# - softcap_in = softmax_scale / softcap: the kernel replaces each raw score x = q.k by
#   tanh(x * softcap_in) and takes scale_log2 = softcap * log2(e) for what follows.
# - sink_ptr: fp32 [Hq], query head h's sink logit (natural log units, the scaled-score scale).
WINDOW_ABI_PARAMS: tuple[tuple[str, str], ...] = (
    ("window_left", ".param .s32 window_left"),
    ("window_right", ".param .s32 window_right"),
)
SOFTCAP_ABI_PARAMS: tuple[tuple[str, str], ...] = (("softcap_in", ".param .f32 softcap_in"),)
SINKS_ABI_PARAMS: tuple[tuple[str, str], ...] = (("sink_ptr", ".param .u64 sink_ptr"),)

# Appended (after varlen's, before the score modifiers') for kernels whose tasks are dealt dynamically
# (dynamic_tasks): a u32 in global memory that is 0 at launch; each CTA's loading role (ir/tasks.py) takes
# task indices from it with atom.global.add (docs/ABI.md "The dynamic deal"). The runtime passes a fresh zeroed
# word per launch, so launches never share one.
DYNAMIC_ABI_PARAMS: tuple[tuple[str, str], ...] = (("task_counter", ".param .u64 task_counter"),)


def dynamic_tasks(cfg: KernelConfig) -> bool:
    """Whether the kernel's CTAs take tasks from a counter as they free up (the dynamic deal: each CTA's
    loading role fetches the next index and hands it to the other roles through SMEM, ir/tasks.py)
    instead of the static persistent deal (round * CTAs + a CTA's slot). Varlen kernels, on both
    targets: their tasks' costs differ by sequence, so a static deal leaves the most loaded CTA
    1.03-1.12x the ideal in a block-count model (bench/README.md "Removed probes": varlen_balance_model.py), the dynamic one
    1.00-1.01x; on the H200 the static deal took 1.006-1.072x the dynamic one's time on bench.varlen's
    mixes. sm_90a causal dense kernels too: the static deal cannot take L2 sections without unbalancing
    its CTAs (schedule.choose_l2_group refused every section size at 2 x 8192 and 1 x 32k, D 64 and
    128), so they ran one LPT order over every (batch, head) pair, whose K/V outgrow the L2 (H200 ncu,
    2 x 8192 x 16 heads D 128: L2 hit 66%, 1.14 GB read from DRAM for 0.2 GB of inputs); a dynamic deal
    takes sections of the L2 budget and stays balanced (+4-9% on long causal D 128, bench/README.md
    "Fair timing, the 192-row varlen tile, the dynamic causal deal"). Non-causal dense kernels keep the static deal
    (their linear order already reuses one head's K/V; both deals measured the same, bench/README.md
    "The dynamic deal"); sm_100a causal kernels launch one CTA per task, which the hardware deals."""
    return cfg.varlen or (cfg.arch == "sm_90a" and cfg.causal and not cfg.kvcache)


def score_mods_record(cfg: KernelConfig) -> dict | None:
    """The manifest's `score_mods` record (docs/ABI.md "Windows, softcap, sinks"): which score modifiers
    the kernel applies and the entry parameters that carry their run-time values; None (no record)
    for a kernel without any, so their manifests are unchanged. Prebuilt-kernel loading checks it."""
    if not (cfg.window or cfg.softcap or cfg.sinks):
        return None
    params = ((WINDOW_ABI_PARAMS if cfg.window else ()) + (SOFTCAP_ABI_PARAMS if cfg.softcap else ())
              + (SINKS_ABI_PARAMS if cfg.sinks else ()))
    return {"window": cfg.window, "softcap": cfg.softcap, "sinks": cfg.sinks, "params": [n for n, _ in params]}


ABI_PARAM_NAMES: tuple[str, ...] = tuple(n for n, _ in ABI_PARAMS + VARLEN_ABI_PARAMS + KVCACHE_ABI_PARAMS + DYNAMIC_ABI_PARAMS
                                         + WINDOW_ABI_PARAMS + SOFTCAP_ABI_PARAMS + SINKS_ABI_PARAMS)

# The combine kernel of a KV-cache module (a second entry beside fa4_fwd; templates/common/combine.ptx.j2):
# one warp per row r = (b * Sq + pos) * Hq + head merges the num_splits partial rows by their LSE.
COMBINE_ENTRY = "fa4_combine"
COMBINE_ABI_PARAMS: tuple[tuple[str, str], ...] = (
    ("o_partial", ".param .u64 o_partial"),
    ("lse_partial", ".param .u64 lse_partial"),
    ("o_ptr", ".param .u64 o_ptr"),  # O (B, Sq, Hq, D) contiguous, the kernel's dtype
    ("lse_ptr", ".param .u64 lse_ptr"),  # fp32 [B, Hq, Sq]; 0 = do not write
    ("rows", ".param .u32 rows"),  # R = B * Sq * Hq
    ("num_splits", ".param .u32 num_splits"),
    ("seqlen_q", ".param .u32 seqlen_q"),
    ("num_heads_q", ".param .u32 num_heads_q"),
)
# With sinks (KernelConfig.sinks) the combine takes sink_ptr too (combine_abi_params): a split's partial
# (S > 1) is normalised WITHOUT the sink, and fa4_combine counts it once, as one more term of the
# merge, lse = log(sum_s exp(lse_s) + exp(sink[head])), O = sum_s exp(lse_s - lse) O_s (head = r % Hq);
# with S == 1 fa4_fwd normalises with the sink itself (the partials are untouched).
COMBINE_SINKS_ABI_PARAMS: tuple[tuple[str, str], ...] = (("sink_ptr", ".param .u64 sink_ptr"),)

# Programmatic dependent launch of fa4_combine (sm_90+): the runtime launches it with the
# programmatic-stream-serialization attribute (cuLaunchKernelEx), every CTA of fa4_fwd signals
# `griddepcontrol.launch_dependents` once its barriers are set up, and fa4_combine starts with
# `griddepcontrol.wait` (which returns once fa4_fwd has completed and its writes are visible). The
# combine's CTAs are launched while fa4_fwd runs and wait on SMs it leaves free, instead of being
# launched after it: the kernel boundary's latency leaves the call. Launched without the attribute
# (a driver without cuLaunchKernelEx), griddepcontrol.wait returns at once and stream order alone
# orders the two kernels, as before. The manifest's kvcache.combine record says `programmatic`.
COMBINE_PROGRAMMATIC = True
COMBINE_THREADS = 128  # 4 warps, one row each
COMBINE_ROWS_PER_CTA = COMBINE_THREADS // 32
# fa4_combine's second pass loads this many floats per lane (COMBINE_UNROLL_FLOATS / vec splits' O
# columns) before it adds them: the loads of a row's splits are in flight together instead of one
# L2 latency per split (the merge took 0.35 us per split before: 7.5 us at 16 splits on the H200)
COMBINE_UNROLL_FLOATS = 32
COMBINE_UNROLL_SPLITS = 8  # and at most this many splits a round (DV = 64: 16 spilled a register)


def abi_params(cfg: KernelConfig, o_from_registers: bool = False) -> tuple[tuple[str, str], ...]:
    """The entry's parameters, in signature order: the dense ABI, plus o_ptr for a dense kernel that
    stores O from the registers (o_from_registers: its Pipeline has no O staging), or the varlen or
    KV-cache ones (which have o_ptr already), plus the score modifiers' (window, softcap, sinks: each
    when set)."""
    dense_o = DENSE_O_ABI_PARAMS if o_from_registers and not (cfg.varlen or cfg.kvcache) else ()
    return (ABI_PARAMS + dense_o + (VARLEN_ABI_PARAMS if cfg.varlen else ()) + (KVCACHE_ABI_PARAMS if cfg.kvcache else ())
            + (DYNAMIC_ABI_PARAMS if dynamic_tasks(cfg) else ())
            + (WINDOW_ABI_PARAMS if cfg.window else ()) + (SOFTCAP_ABI_PARAMS if cfg.softcap else ())
            + (SINKS_ABI_PARAMS if cfg.sinks else ()))


# A launch's parameters as one buffer: each at the next offset of its alignment, as the PTX ABI lays
# out an entry's .param space; cuLaunchKernel gets a pointer to each. struct codes: 128-byte tensor
# maps as bytes, pointers u64, counts u32, window sides s32, scales f32.
_PARAM_CODES = {".u64": ("Q", 8, 8), ".u32": ("I", 4, 4), ".s32": ("i", 4, 4), ".f32": ("f", 4, 4)}
ALL_ABI_DECLS: dict[str, str] = dict(ABI_PARAMS + DENSE_O_ABI_PARAMS + VARLEN_ABI_PARAMS + KVCACHE_ABI_PARAMS + DYNAMIC_ABI_PARAMS
                                     + WINDOW_ABI_PARAMS
                                     + SOFTCAP_ABI_PARAMS + SINKS_ABI_PARAMS)
COMBINE_ABI_DECLS: dict[str, str] = dict(COMBINE_ABI_PARAMS + COMBINE_SINKS_ABI_PARAMS)


def param_buffer_layout(decls) -> tuple[str, tuple[int, ...]]:
    """The little-endian struct format of an entry's parameters from their PTX declarations (in
    signature order), each at the next multiple of its alignment ('x' pads), the whole padded to the
    largest alignment; and each parameter's byte offset."""
    fmt, offsets, off, top = ["<"], [], 0, 1
    for decl in decls:
        m = re.fullmatch(r"\.param (?:\.align (\d+) )?(\.\w+) \w+(?:\[(\d+)\])?", decl)
        if not m:
            raise ValueError(f"not a parameter declaration this runtime can pack: {decl!r}")
        if m.group(2) == ".b8":
            code, size, align = f"{int(m.group(3))}s", int(m.group(3)), int(m.group(1) or 1)
        else:
            code, size, align = _PARAM_CODES[m.group(2)]
            align = int(m.group(1) or align)
        pad = -off % align
        fmt.append("x" * pad + code)
        offsets.append(off + pad)
        off += pad + size
        top = max(top, align)
    fmt.append("x" * (-off % top))
    return "".join(fmt), tuple(offsets)


# KV-cache rules (one definition; fa4gen/spec/schedule.py kvcache_task / kvcache_key_page and BlockInfo
# below implement them in Python, templates/common/scheduler.ptx.j2 decode_kvcache, block_info_ptx
# and the targets' K/V loads in PTX):
# - keys of sequence b: k_len = min(max(cache_seqlens[b], 0), seqlen_k) (seqlen_k = the capacity);
#   causal aligns the Sq queries to the end: query i sees keys j <= i + k_len - Sq.
# - task t -> split s = t % S, then (m block, pair) as the dense non-causal order: m = (t / S) % M,
#   bh = t / (S M). A tile's nblk visible K/V blocks (the dense block range with k_len) are cut
#   into S ranges of bps = ceil(nblk / S): split s takes blocks [min(s bps, nblk), min((s+1) bps, nblk)),
#   one fully masked block at its start when that is empty (BlockInfo below).
# - paged key j of sequence b: page = page_table[b * stride + min(j / page_size, max_pages - 1)],
#   then min(page as unsigned, num_pages - 1) (a negative or too large entry reads the last page, never
#   outside the cache); row j % page_size of that page. A K/V block of block_n keys is block_n /
#   min(page_size, block_n) TMA boxes of min(page_size, block_n) rows (kv_box_rows).
# - S > 1: each split writes its row's normalized O (fp32) and LSE (natural log, -inf when it saw no
#   key) to o_partial / lse_partial at row r = (b * Sq + pos) * Hq + head; fa4_combine merges them:
#   lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s (O = 0, LSE = -inf when every split is
#   -inf). S == 1: the kernel writes O and LSE itself, as the dense kernels do; the partials are untouched.
KVCACHE_ORDER = "kvcache: split fastest, then m_block, then (batch, head group); blocks cut into num_splits ranges"
KVCACHE_MAX_SPLITS = 256


def combine_abi_params(cfg: KernelConfig) -> tuple[tuple[str, str], ...]:
    """fa4_combine's parameters, in signature order: COMBINE_ABI_PARAMS, plus sink_ptr with sinks."""
    return COMBINE_ABI_PARAMS + (COMBINE_SINKS_ABI_PARAMS if cfg.sinks else ())


def kvcache_manifest(cfg: KernelConfig) -> dict:
    """The manifest's record of a KV-cache kernel's layout (read by the runtime and the harness)."""
    cache = ("(num_pages, page_size, Hkv, D) through page_table (B, max_pages) int32" if cfg.page_size
             else "(B, Smax, Hkv, D)")
    return {"q": "(B, Sq, Hq, D)", "k": cache, "v": cache, "o": "(B, Sq, Hq, D)", "lse": "(B, Hq, Sq) fp32",
            "page_size": cfg.page_size, "box_rows": kv_box_rows(cfg),
            "seqlens": "k_len = min(max(cache_seqlens[b], 0), seqlen_k)",
            "partials": "o_partial fp32 [S, B*Sq*Hq, D], lse_partial fp32 [S, B*Sq*Hq]; row (b*Sq + pos)*Hq + head",
            "combine": {"entry": COMBINE_ENTRY, "threads_per_cta": COMBINE_THREADS,
                        "rows_per_cta": COMBINE_ROWS_PER_CTA, "params": [n for n, _ in combine_abi_params(cfg)],
                        "programmatic": COMBINE_PROGRAMMATIC}}


def combine_context(cfg: KernelConfig) -> dict:
    """What templates/common/combine.ptx.j2 prints from (both targets)."""
    # lane l owns columns [vec l, vec l + vec): vec a power of two (vector loads and stores), DV / 32
    # rounded up (DV = 96: 4 columns on 24 lanes, the other 8 idle in the merge)
    vec = 1 << (cfg.head_dim_v // 32 - 1).bit_length()
    return {"entry": COMBINE_ENTRY, "param_decls": [d for _, d in combine_abi_params(cfg)], "threads": COMBINE_THREADS,
            "rows_per_cta": COMBINE_ROWS_PER_CTA, "head_dim": cfg.head_dim_v, "vec": vec, "lanes": cfg.head_dim_v // vec,
            "sinks": cfg.sinks, "unroll": min(COMBINE_UNROLL_SPLITS, COMBINE_UNROLL_FLOATS // vec), "programmatic": COMBINE_PROGRAMMATIC}


def block_n(cfg: KernelConfig) -> int:
    """Keys per K/V block of the kernel (cfg.block_n, tiles.kv_block_keys: 128, sm_90a D = 256 64)."""
    return cfg.block_n


def kv_box_rows(cfg: KernelConfig) -> int:
    """Rows of one K/V TMA box: a whole block_n-key block, or one page when pages are smaller."""
    return min(cfg.page_size, block_n(cfg)) if cfg.page_size else block_n(cfg)


# TMA L2 promotion (cuTensorMapEncodeTiled's l2Promotion; PTX-invisible, recorded per map in the
# manifest's tensor_maps and read by the runtime): how much the L2 fetches from DRAM around a box row.
# A K/V box row is one 128-byte panel row of a 256-byte (D = 128) key row; 256B promotion brings the
# row's other panel in with it. A KV-cache kernel streams every K/V byte once from DRAM, and 256B
# costs it a tenth of its rate; the dense and varlen kernels, whose K/V blocks many CTAs read through
# the L2, keep 256B. H200, 2026-12-04, every map of a launch at one promotion (two rounds each,
# bench/README.md "TMA L2 promotion"): decode 64 x 4k 4.09-4.11 TB/s at 256B, 4.49-4.56 at 128B, none
# or 64B (cuDNN 4.52); 33 x 32k 4.20 -> 4.65; dense D 64 causal 1 x 16k 497 TFLOP/s at 256B,
# 485-490 at the others; D 128 causal 1 x 32k 627-634 at 256B, 618-626 at 128B; D 128 non-causal even.
TMA_L2_PROMOTIONS = tuple(mode.label for mode in TmaL2Promotion)  # "none", "64B", "128B", "256B"
TMA_L2_PROMOTION_STREAMED = "128B"  # KV-cache kernels
TMA_L2_PROMOTION_REUSED = "256B"  # dense and varlen kernels


def tma_l2_promotion(kvcache: bool) -> str:
    """The L2 promotion of every tensor map of a kernel (one of TMA_L2_PROMOTIONS): a KV-cache kernel's
    (config.kvcache) or another's. The manifest records it; the runtime applies it to manifests
    written before it did."""
    return TMA_L2_PROMOTION_STREAMED if kvcache else TMA_L2_PROMOTION_REUSED


def kvcache_num_tasks(batch: int, num_heads_kv: int, groups: int, num_m_blocks: int, num_splits: int) -> int:
    return int(batch) * int(num_heads_kv) * int(groups) * int(num_m_blocks) * int(num_splits)


# Varlen task order (one rule; fa4gen/spec/schedule.py varlen_task and the PTX decode in
# templates/common/scheduler.ptx.j2 implement it): sequences in index order; inside sequence b,
# its (head group, m unit) tasks with the m unit fastest; causal: the dense kernels' sectioned LPT
# over the sequence's head groups (heaviest m unit first, a section's groups fastest), sections of
# clamp(l2_group / k_len, 1, groups) groups, l2_group being K/V rows that fit the L2 budget.
# An m unit is `tiles_per_task` Q tiles of 128 / P positions; sequence b has
# ceil(len_q(b) / (tiles_per_task * 128 / P)) of them, for each of the Hkv * G / P head groups.
# Offsets are clamped on the device: start = min(cu[b], total), end = min(max(cu[b+1], start), total),
# so no sequence reaches outside its tensor whatever the offsets hold.
VARLEN_ORDER = {False: "varlen: sequences in order; per sequence its head groups, m units fastest",
                True: "varlen: sequences in order; per sequence the dense LPT over its head groups in L2 "
                      "sections of clamp(l2_group / k_len, 1, groups) groups (heaviest m unit first, the "
                      "section's groups fastest); snake deal"}


def varlen_manifest(cfg: KernelConfig) -> dict:
    """The manifest's record of a varlen kernel's layout (read by the runtime and the harness)."""
    return {"q": "(total_q, Hq, D): sequence b's rows [cu_seqlens_q[b], cu_seqlens_q[b+1])",
            "k": "(total_k, Hkv, D): rows [cu_seqlens_k[b], ...), at most seqused_k[b] of them",
            "o": "(total_q, Hq, D) through o_ptr", "lse": "(Hq, total_q) fp32",
            "tensor_maps": "the packed tensors as a batch of one (B = 1, Sq = total_q, Skv = total_k)",
            "clamp": "start = min(cu[b], total), end = min(max(cu[b+1], start), total)"}


def varlen_task_bound(batch: int, total_q: int, groups: int, unit_rows: int) -> int:
    """An upper bound on the varlen tasks, from what the host knows without reading cu_seqlens:
    sum_b ceil(l_b / u) <= (total_q + B * (u - 1)) / u for lengths l_b summing to total_q."""
    return int(groups) * ((int(total_q) + int(batch) * (int(unit_rows) - 1)) // int(unit_rows))


def gqa_manifest(gqa_ratio: int, block_m: int = ROWS) -> dict:
    """The manifest's record of the packing rule (read by the runtime and the emulator harness)."""
    p = gqa_pack(gqa_ratio)
    return {"ratio": int(gqa_ratio), "pack": p, "head_groups": int(gqa_ratio) // p,
            "rule": f"pack = ratio if 128 % ratio == 0 else 1; tile rows r -> position m * ({block_m} / pack) + r // pack, "
                    "query head hkv * ratio + j * pack + r % pack for head group j in [0, ratio / pack); "
                    "kv head of head group index hg = hg // head_groups"}


def qo_map_dims(cfg: KernelConfig) -> list[str]:
    """Dimension names of the 5-D Q/O tensor maps (innermost first): the head axis splits into
    (P heads of a tile, Hq / P head groups). P = G keeps the names of the packed view, (G, Hkv).
    Varlen kernels use the same maps over the packed tensors seen as a batch of one: B = 1, Sq = total."""
    return ["D", "G", "Hkv", "Sq", "B"] if cfg.head_groups == 1 else ["D", "P", "Hg", "Sq", "B"]


def tile_bytes(cfg: KernelConfig) -> int:
    """One block_n-row x head_dim tile of 16-bit elements: a K stage (a V stage when dv == d) and its TMA tx count."""
    return block_n(cfg) * cfg.head_dim * cfg.elem_bytes


def v_tile_bytes(cfg: KernelConfig) -> int:
    """One block_n-row x head_dim_v tile: a V stage and its TMA tx count (tile_bytes when dv == d)."""
    return block_n(cfg) * cfg.head_dim_v * cfg.elem_bytes


def q_tile_bytes(cfg: KernelConfig) -> int:
    """One block_m-row x head_dim Q tile (a Q slot, its TMA tx count, the O staging)."""
    return cfg.block_m * cfg.head_dim * cfg.elem_bytes


@dataclass(frozen=True)
class Panels:
    """How an SMEM tile of `cols` 16-bit columns is cut into swizzled panels, side by side: each panel
    is `panel_cols` columns (one row of the swizzle, `row_bytes` bytes), one TMA box's inner extent
    and one wgmma descriptor's span, with the panels of a rows-row tile rows * row_bytes apart.

    The swizzle is the widest whose row divides the tile's row (CUTLASS's ss_smem_selector makes the
    same choice): 128B and 64-column panels where 64 divides cols (D = 64, 128, 192), else 64B and
    32-column panels (D = 96: three of them). One swizzle per tile keeps every operand one
    descriptor: V, the MN-major B operand of O += P V, spans its DV columns through one LBO (the
    panel stride), which a 64 + 32 split into a 128B and a 64B panel could not describe."""

    cols: int
    panel_cols: int
    swizzle: Swizzle
    elem_bytes: int

    @property
    def row_bytes(self) -> int:
        return self.panel_cols * self.elem_bytes

    @property
    def count(self) -> int:
        return self.cols // self.panel_cols

    def bytes(self, rows: int) -> int:
        """One rows-row panel: the step between a rows-row tile's panels."""
        return rows * self.row_bytes

    @property
    def row_swizzle_shift(self) -> int:
        """The swizzle as a function of a panel's row R: 16-byte chunk c sits at chunk
        c ^ ((R >> shift) % (row_bytes / 16)), the address bits [4, 4 + b) XOR bits [7, 7 + b) of the
        8-row pattern: 128-byte rows (128B) shift 0, 64-byte rows (64B: two rows per 128 bytes) shift 1."""
        return (128 // self.row_bytes).bit_length() - 1

    @property
    def k_steps(self) -> int:
        """k16 wgmma steps inside one panel row (K-major: each advances 32 bytes along the row)."""
        return self.row_bytes // 32


def panels(cols: int, elem_bytes: int = 2) -> Panels:
    """The panels of a tile of cols columns (Panels: 128B swizzle where 64 columns divide it, else 64B)."""
    for sw in (Swizzle.B128, Swizzle.B64):
        per = sw.span_bytes // elem_bytes
        if cols % per == 0:
            return Panels(cols, per, sw, elem_bytes)
    raise PlanError(f"{cols} columns: not a multiple of the {Swizzle.B64.span_bytes // elem_bytes}-column "
                    "panel of a 64-byte swizzle")


def qk_panels(cfg: KernelConfig) -> Panels:
    """The panels of Q and K (head_dim columns)."""
    return panels(cfg.head_dim, cfg.elem_bytes)


def vo_panels(cfg: KernelConfig) -> Panels:
    """The panels of V and the O staging (head_dim_v columns)."""
    return panels(cfg.head_dim_v, cfg.elem_bytes)


# Causal / tail masks as 32-bit column words (the seed's mask_r2p): for a thread's column offsets
# `cols` (relative to its first column, so that column c is visible iff c < lim), word w holds bit
# c - 32w for the columns c in [32w, 32w + 32): word = (1 << clamp(lim - 32w, 0, 32)) - 1 (a shift
# by 32 gives 0 in PTX, so a fully visible word is all ones), and each element is one bit test,
# which ptxas turns into R2P (up to 7 predicates per instruction) instead of one compare each.
MASK_WORD_BITS = 32
# Which targets spell their masks as words. sm_90a keeps one compare per element: on the H200
# (2026-12-02, bench/ab.py, 7 interleaved rounds, bench/results/*_ab_sm90a.json) the word
# form was +0.5-1% on causal shapes (within the rounds' spread) and a reproducible -2.5% on long
# non-causal ones (2x8192, 1x16384, bf16 and fp16) whose masked path never runs: no gain to pay for.
MASK_AS_WORDS = {"sm_100a": True, "sm_90a": False}


def mask_words(cols) -> tuple[list[int], list[tuple[int, int]]]:
    """(the word indices the columns need, sorted; per column (word index, bit value 1 << bit))."""
    where = [(c // MASK_WORD_BITS, 1 << (c % MASK_WORD_BITS)) for c in cols]
    if any(c < 0 for c in cols):
        raise PlanError(f"mask columns must be >= 0, got {min(cols)}")
    return sorted({w for w, _ in where}), where


# Named barriers (bar.sync / bar.arrive ids; 0 is the CTA-wide barrier after mbarrier init).
SM100_STATS_BAR_ID = 1  # softmax -> correction statistics hand-off (ids 1..8 when paired per warp)
SM90_SCHED_BAR_ID = 1  # ids 1 .. C: ping-pong turn on the tensor core for consumer i (C consumers)


def sm90_consumers(block_m: int) -> int:
    """Consumer warpgroups of the sm_90a kernel: one per SM90_WG_ROWS Q rows."""
    return block_m // SM90_WG_ROWS


def sm90_row_reduction(cfg: KernelConfig) -> str:
    """How an sm_90a consumer thread reduces its share of a score row, the block max and the row sum
    (lower/sm90.py; templates/common/softmax.ptx.j2):
    - "chain": serial (lower.walk.chain), the sum's k-th add emitted right after element k + 1's exp,
      so ptxas interleaves the adds with the MUFU stream;
    - "tree": pairwise levels (lower.walk.pairwise), the sum after all the exps.
    Chains for three consumer warpgroups (the 192-row tile, where ncu found the tree sum's adds
    stalled on fixed latency, stall_wait 2.12 against FA4-CuTe's 1.49 per issued instruction:
    bench/results/2026-12-04_NVIDIA-H200_ncu_d64_vs_fa4cute.txt), trees for two. A/B on the H200
    (bench/results/2026-12-04_NVIDIA-H200_ab_rowmax_rowsum_chains_vs_trees_all.json): 192-row dense
    kernels 1.007-1.034 (all 12 D 64 shapes), varlen causal 1.018-1.028, varlen non-causal 0.984;
    128-row kernels 0.943-1.008, median 0.987 (D 128; D 64 causal 0.943), hence trees there. (D 96 and
    the window / softcap / sinks kernels on the 192-row tile follow the rule without an A/B of their own.)
    Varlen kernels keep trees on every tile: the two orders round differently, and a varlen call's tile
    follows the batch (tiles.q_tile_rows reads max_seqlen_q for causal calls), so with chains a
    sequence's output bits would depend on what else is in its batch (the H200's
    tests/test_gpu_head_dims.py caught attention_varlen's 192-row kernel differing from the 128-row
    one). A dense call's tile follows its own shape only."""
    return "chain" if sm90_consumers(cfg.block_m) >= 3 and not cfg.varlen else "tree"


def sm90_pack_first(cfg: KernelConfig) -> bool:
    """Order of the two steps after the overlap loop's wait for PV(t-1) (ir/sm90.py): True packs P(t)
    into bf16/fp16 registers before O *= acc(t), False rescales first. Packing first lets ptxas
    interleave the F2FP packs with the exps; rescaling first leaves them as one block after the
    rescale branch. A/B on the H200, interleaved, bitwise equal outputs:
    - pack first on every kernel against rescale first, 5 rounds
      (bench/results/2026-12-04_NVIDIA-H200_ab_pack_before_rescale_vs_base_all.json): tree kernels
      (sm90_row_reduction) gained, D 128 non-causal 1.003-1.022, varlen 0.997-1.017; the 192-row chain
      kernels lost, D 64 non-causal 0.969-0.991;
    - this rule against rescale first, 7 rounds (..._ab_pack_first_on_trees_vs_base_all.json): D 128
      non-causal 0.997-1.021 (median 1.015), varlen 1.002-1.028, D 128 causal 0.993-1.013, decode
      0.999-1.007; the unchanged chain kernels 0.990-1.004 (the comparison's noise).
    Hence pack first where the row reduction is a tree. (Rescaling O on every block, without the
    vote's branch, lost on every prefill shape, 0.945-0.999: ..._ab_rescale_every_block_vs_branch_all.json.)"""
    return sm90_row_reduction(cfg) == "tree"


def sm90_epi_bar_id(consumers: int) -> int:
    """First of the C epilogue named-barrier ids: right after the C ping-pong ids."""
    return SM90_SCHED_BAR_ID + consumers

# sm_90a setmaxnreg budgets: the producer warpgroup gives registers to the consumers
SM90_PRODUCER_REGS, SM90_CONSUMER_REGS = 24, 240
# by consumer count: the CTA's launch pool is (C + 1) x 128 threads x the entry cap
# (ARCH_LIMITS regs_per_sm / threads, a multiple of 8): 24 + 2 x 240 <= 3 x 168, 24 + 3 x 160 <= 4 x 128
SM90_REGS = {2: (24, 240), 3: (24, 160)}


def sm90_reg_floor(dv: int, block_n: int, overlap: bool = True) -> int:
    """32-bit registers per consumer thread that the wgmma fragments of a 64-row warpgroup hold: the
    O accumulator (64 x dv fp32 over 128 threads: dv / 2), S (64 x block_n fp32: block_n / 2) and P as
    16-bit A fragments (64 x block_n, two per register: block_n / 4). With the QK of block t issued
    beside the PV of block t - 1 (overlap) S and P are live together; issued after it, one at a time.
    Addresses, row statistics, loop state and the softmax's temporaries come on top."""
    return dv // 2 + (block_n // 2 + block_n // 4 if overlap else block_n // 2)


# Registers a consumer needs beside its fragments: the headroom of the tightest kernel that compiles
# without spills (D 64, 192-row tile: 160 - 128). The D 96 192-row kernel with the overlap has 16 and
# spills 144 bytes; without it, 48 and none.
SM90_MIN_REG_HEADROOM = 32


def sm90_overlap(cfg: KernelConfig) -> bool:
    """Whether the sm_90a consumers issue block t's QK beside block t - 1's PV (ir/sm90.py: S(t) is
    computed while P(t-1) still feeds the PV) or the PV first, then the QK (S and P never live together):
    the overlap where its fragments leave SM90_MIN_REG_HEADROOM of the consumer budget. Only the D = 96
    192-row tile goes without: 160 - 144 = 16 registers (measured on the H200, 192-row serial against
    128-row overlapped: +8.6-12% on long shapes, docs/HEAD_DIMS.md "D = 96 on the 192-row tile")."""
    return sm90_regs(cfg)[1] - sm90_reg_floor(cfg.head_dim_v, block_n(cfg)) >= SM90_MIN_REG_HEADROOM


def sm90_idle_consumers(cfg: KernelConfig) -> bool:
    """Whether an sm_90a consumer warpgroup whose 64 rows all lie past Sq skips its GEMMs and softmax,
    keeping only the barrier steps of its blocks (ir/sm90.py, If ROWS_IN_SQ): KV-cache kernels, whose
    decode tiles hold Sq x P rows in the first consumer. Not dense or varlen kernels: there the idle
    path (the last tile of a sequence whose rows leave its last consumers none) measured slower on the
    H200, 0.922-1.026 of the same kernels without it, median 0.996 over 42 cases, 0.959-0.987 on
    D 128 shapes that never idle but one (bench/results/2026-12-04_NVIDIA-H200_ab_idle_consumers_vs_base_all.json),
    and it made ptxas spill 8 bytes in the 192-row window + sinks kernel at 128 registers."""
    return cfg.arch == "sm_90a" and cfg.kvcache


# The dynamic deal's producer (dynamic_tasks) holds the task ring's state and fetches the index
# besides the varlen decode: at 24 registers ptxas spills it (4-20 bytes, D 64-256 varlen); 32 do not.
SM90_DYNAMIC_PRODUCER_REGS = 32


def sm90_regs(cfg: KernelConfig) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg budgets of cfg's sm_90a kernel: SM90_REGS by its consumer
    count; a dynamic deal's producer gets SM90_DYNAMIC_PRODUCER_REGS and the consumers what is left
    of the launch pool ((C + 1) x 128 threads x the entry cap), at most their static budget:
    32 + 2 x 232 <= 3 x 168, 32 + 3 x 160 <= 4 x 128."""
    nc = sm90_consumers(cfg.block_m)
    producer, consumer = SM90_REGS[nc]
    if not dynamic_tasks(cfg):
        return producer, consumer
    threads = 128 * (1 + nc)
    pool = (ARCH_LIMITS["sm_90a"].regs_per_sm // threads) // 8 * 8 * (1 + nc)
    return SM90_DYNAMIC_PRODUCER_REGS, min(consumer, (pool - SM90_DYNAMIC_PRODUCER_REGS) // nc // 8 * 8)


# ---- K/V block ranges: the one definition (both targets' PTX, the reference, schedule, simulator) ----
# Blocks are block_n keys (plan.block_n(cfg), a power of two); BLOCK_N is the block of every kernel
# but sm_90a D = 256 (tiles.kv_block_keys), the default of the functions below.
BLOCK_N = ROWS


def _block_shift(block_n: int) -> int:
    """log2 of a block size: the block rules are shifts (and 32-bit mask words cover a block)."""
    if block_n <= 0 or block_n & (block_n - 1) or block_n % MASK_WORD_BITS:
        raise PlanError(f"K/V blocks of {block_n} keys: a power of two of at least {MASK_WORD_BITS} keys")
    return block_n.bit_length() - 1


def _lo_hi(x, lo, hi):
    """min(max(x, lo), hi) on ints (an int back) or NumPy arrays."""
    if isinstance(x, (int, np.integer)):
        return int(min(max(x, lo), hi))
    return np.minimum(np.maximum(x, lo), hi)


WINDOW_UNBOUNDED = 1 << 30  # a window side of -1 (unbounded) in the kernels' registers
# Sq and Skv of a windowed launch stay below this (validate.py): the largest s32 sum the kernels form
# is a unit's last row (< Sq + 2 ROWS, an sm_100a pair of tiles past Sq) + 1 + Skv - Sq + a side of
# WINDOW_UNBOUNDED, < Skv + 2 ROWS + 2^30 <= 2^31 - 1
WINDOW_SEQ_LIMIT = WINDOW_UNBOUNDED - 2 * ROWS


def key_end(q, seqlen_q: int, seqlen_k: int, causal: bool, right: int | None = None):
    """Exclusive end of the keys query position q sees: Skv, or causally (bottom-right aligned:
    query i sees keys j <= i + Skv - Sq) min(Skv, q + 1 + Skv - Sq), which is <= 0 when q sees no
    key; with a window's right side (keys j <= i + Skv - Sq + right; causal is right = 0)
    min(Skv, q + 1 + Skv - Sq + right). The mask's per-row column limit and the block ranges
    below. Ints or NumPy arrays of q."""
    if causal:
        right = 0
    if right is None:
        return int(seqlen_k) if isinstance(q, (int, np.integer)) else np.full(np.shape(q), int(seqlen_k), np.int64)
    end = q + 1 + int(seqlen_k) - int(seqlen_q) + int(right)
    return int(min(end, seqlen_k)) if isinstance(q, (int, np.integer)) else np.minimum(end, int(seqlen_k))


def key_begin(q, seqlen_q: int, seqlen_k: int, left: int | None = None):
    """First key query position q sees: 0, or with a window's left side (keys j >= i + Skv - Sq -
    left) max(0, q + Skv - Sq - left), which is >= Skv when q sees no key. Ints or NumPy arrays."""
    if left is None:
        return 0 if isinstance(q, (int, np.integer)) else np.zeros(np.shape(q), np.int64)
    b = q + int(seqlen_k) - int(seqlen_q) - int(left)
    return int(max(b, 0)) if isinstance(q, (int, np.integer)) else np.maximum(b, 0)


def window_sides(window, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) of a window_size=(left, right) in flash-attn's convention: -1 (or None) is
    unbounded (None here); causal makes right 0. Sides are ints >= -1."""
    if window is None:
        return None, (0 if causal else None)
    left, right = (None if w is None or int(w) < 0 else int(w) for w in window)
    return left, (0 if causal else right)


def split_blocks(nblk: int, split: int, num_splits: int) -> tuple[int, int]:
    """[lo, hi) of split `split` of `num_splits` over nblk blocks: ranges of ceil(nblk / S), so
    split s takes [min(s bps, nblk), min(s bps + bps, nblk)); a split past the end gets [nblk, nblk)."""
    bps = -(-int(nblk) // int(num_splits))
    lo = min(int(split) * bps, int(nblk))
    return lo, min(lo + bps, int(nblk))


def kernel_score_scalars(softmax_scale: float, softcap: float = 0.0) -> dict:
    """The score scalars a kernel takes (docs/ABI.md "Windows, softcap, sinks"), in float64 (the
    launch rounds each once to fp32): scale_log2 = softmax_scale * log2(e), or with a softcap > 0
    scale_log2 = softcap * log2(e) and softcap_in = softmax_scale / softcap (the kernel's
    t = tanh(x * softcap_in) of the raw score x = q.k is the capped score / softcap)."""
    log2e = math.log2(math.e)
    if not softcap:
        return {"scale_log2": float(softmax_scale) * log2e}
    return {"scale_log2": float(softcap) * log2e, "softcap_in": float(softmax_scale) / float(softcap)}


def kernel_window_args(window, causal: bool) -> dict:
    """window_left / window_right as a kernel takes them (s32 in [0, WINDOW_UNBOUNDED]): a side of -1
    (or None) or >= WINDOW_UNBOUNDED is WINDOW_UNBOUNDED; a causal kernel's right side is 0."""
    left, right = window_sides(window, causal)
    return {"window_left": WINDOW_UNBOUNDED if left is None else min(left, WINDOW_UNBOUNDED),
            "window_right": WINDOW_UNBOUNDED if right is None else min(right, WINDOW_UNBOUNDED)}


@dataclass(frozen=True)
class BlockInfo:
    """The K/V blocks of one task: query positions [m * rows, (m + 1) * rows) (an m unit: sm_90a one
    Q tile of seq_q_per_tile positions, sm_100a a pair of them; the GQA packing is folded into
    seq_q_per_tile), seqlen_q, the visible keys seqlen_k (varlen: the sequence's; KV cache: k_len),
    causal, and a KV-cache split s of S. Blocks are block_n keys (plan.block_n); the kernels visit
    [lo, lo + n) in reverse order.

    - visible blocks [first, end): those holding a key some row of the unit sees (first = 0; the
      unit's last row sees the most keys, key_end of it clipped to [0, Skv], rounded up);
    - blocks < n_unmasked are whole for every row (key_end of the unit's FIRST row, rounded down):
      no mask; blocks >= n_unmasked need it (the diagonal, the Skv tail);
    - split s: [lo, lo + n) = split_blocks(end, s, S); unsplit: [0, end).

    A unit or split that sees no key (causal Sq > Skv above the diagonal, Skv = 0, a split past the
    last visible block) still runs ONE block, at lo, whose keys every row's mask hides (it is
    >= n_unmasked, and its keys >= end * block_n lie past every row's key_end): row_max stays -inf,
    row_sum 0, so O = 0 and LSE = -inf come out of the ordinary epilogue. Why not n = 0 and skip:
    the verified pipeline IR of both targets runs its tasks with >= 1 block (verify.engine Scenario:
    the sm_100a roles' K/V loops are do-while loops with a peeled first block, and the S/P/O
    hand-offs between roles count blocks), so a skip would be a path outside the verified protocol
    that every role must take alike; sm_90a's old skip was such a template-only path. The cost is
    one K/V load and one masked block per empty unit or split: rare (the first (Sq - Skv) / rows
    units of a causal Sq > Skv launch, splits beyond a short sequence's blocks).

    A sliding window (left, right) (keys j in [i + Skv - Sq - left, i + Skv - Sq + right] for query
    i; None = unbounded; causal is right = 0) moves both ends: first = key_begin of the unit's
    first row, rounded down; end = key_end of its last row, rounded up; blocks are whole for every
    row in [unmasked_lo, n_unmasked): unmasked_lo = key_begin of the unit's LAST row rounded up,
    n_unmasked = key_end of its FIRST row rounded down. Blocks below unmasked_lo or from
    n_unmasked on take the mask (both column limits). A unit whose window holds no key runs one
    block, at min(first, end): its keys lie past every row's key_end.
    """

    first: int  # first visible block (0 without a left window side)
    end: int  # visible blocks [first, end); end <= first: no row sees a key
    n_unmasked: int  # blocks [unmasked_lo, n_unmasked) need no mask
    lo: int  # first block the task runs
    n: int  # blocks the task runs, [lo, lo + n), >= 1
    unmasked_lo: int = 0  # first block every row sees whole (0 without a left window side)

    @classmethod
    def of(cls, m: int, rows: int, seqlen_q: int, seqlen_k: int, causal: bool, split: int = 0,
           num_splits: int = 1, window=None, block_n: int = BLOCK_N) -> "BlockInfo":
        """window: (left, right) as window_sides gives them (None = unbounded), or None; block_n: the
        kernel's keys per block (plan.block_n)."""
        m, rows, split, num_splits, bn = int(m), int(rows), int(split), int(num_splits), int(block_n)
        _block_shift(bn)
        if rows <= 0 or m < 0 or num_splits < 1 or not 0 <= split < num_splits or seqlen_k < 0 or seqlen_q < 0:
            raise ValueError(f"BlockInfo.of(m={m}, rows={rows}, Sq={seqlen_q}, Skv={seqlen_k}, split {split} of {num_splits})")
        left, right = window if window is not None else (None, None)
        if any(w is not None and (isinstance(w, bool) or int(w) < 0) for w in (left, right)):
            raise ValueError(f"BlockInfo.of: window sides must be ints >= 0 or None, got {window!r}")
        r0, r1 = m * rows, (m + 1) * rows - 1
        last = _lo_hi(key_end(r1, seqlen_q, seqlen_k, causal, right), 0, seqlen_k)
        full = _lo_hi(key_end(r0, seqlen_q, seqlen_k, causal, right), 0, seqlen_k)
        begin = _lo_hi(key_begin(r0, seqlen_q, seqlen_k, left), 0, seqlen_k)
        begin_last = _lo_hi(key_begin(r1, seqlen_q, seqlen_k, left), 0, seqlen_k)
        end = -(-last // bn)
        first = min(begin // bn, end)
        lo, hi = split_blocks(end - first, split, num_splits)
        return cls(first=first, end=end, n_unmasked=full // bn, lo=first + lo, n=max(hi - lo, 1),
                   unmasked_lo=-(-begin_last // bn))

    @property
    def empty(self) -> bool:
        """No row sees a key in [lo, lo + n) (the one block run is fully masked)."""
        return self.lo >= self.end

    def needs_mask(self, block: int) -> bool:
        return block >= self.n_unmasked or block < self.unmasked_lo

    def blocks(self) -> range:
        """The blocks in the kernels' order: lo + n - 1 down to lo."""
        return range(self.lo + self.n - 1, self.lo - 1, -1)


def later_blocks_need_mask(causal: bool, window: bool) -> bool:
    """Whether a block a task runs after its first can need a mask (BlockInfo.needs_mask). Without
    causal or a window only the keys' tail is masked, and the tail block is the highest of every
    range (a split's too) the task runs, so it runs first: the kernels then emit no masked path for
    the later blocks (it could never run)."""
    return bool(causal or window)


def block_info_ptx(*, causal: bool, rows: int, m: str, sq: str, skv: str, tmp: str, n: str | None = None,
                   n_unmasked: str | None = None, split: tuple[str, str, str, str] | None = None,
                   window: tuple[str, str] | None = None, lo: str | None = None,
                   unmasked_lo: str | None = None, block_n: int = BLOCK_N) -> list[tuple]:
    """BlockInfo.of in PTX: the instructions, as (opcode, dst, src...) tuples the templates print,
    that compute from registers m (the m unit), sq, skv (both <= 2^31 - 2 block_n: the causal limits
    are signed 32-bit) what is asked for, over blocks of block_n keys (plan.block_n):
    n_unmasked; n (unsplit: the blocks [0, n) run; split: the split's count, with split =
    (split reg, num_splits reg (>= 1), lo dst, tmp2) writing lo as well). `rows` is the unit's
    query positions (a constant). Only `tmp` (and tmp2) are clobbered; tmp may be m when only one
    of n / n_unmasked is asked for. Causal limits are signed (Sq > Skv makes them negative).

    window = (left reg, right reg) (sides as s32, WINDOW_UNBOUNDED for -1; with Sq, Skv < 2^30;
    right may be the literal "0", a causal window): the blocks run are [lo, lo + n) with lo (a dst,
    required with n; split: split's lo, and tmp2 must differ from tmp) the window's first block;
    unmasked_lo (a dst) the first block every row sees whole."""
    if window is not None:
        return _block_info_window_ptx(rows=rows, m=m, sq=sq, skv=skv, tmp=tmp, n=n, n_unmasked=n_unmasked,
                                      split=split, window=window, lo=lo, unmasked_lo=unmasked_lo, block_n=block_n)
    if lo is not None or unmasked_lo is not None:
        raise ValueError("lo / unmasked_lo are window outputs (without a window: lo = 0, unmasked_lo = 0)")
    if tmp == m and n and n_unmasked:
        raise ValueError("tmp may be m only when one of n / n_unmasked is computed")
    rnd, sh = str(block_n - 1), str(_block_shift(block_n))
    ins: list[tuple] = []
    if n:  # key_end of the unit's last row clipped to [0, Skv] (unsplit: [1, Skv], n >= 1), rounded up
        floor = "0" if split else "1"
        if causal:
            ins += [("add.u32", tmp, m, "1"), ("mul.lo.u32", tmp, tmp, str(rows)), ("add.s32", tmp, tmp, skv),
                    ("sub.s32", tmp, tmp, sq), ("min.s32", tmp, tmp, skv), ("max.s32", tmp, tmp, floor),
                    ("add.s32", tmp, tmp, rnd), ("shr.s32", n, tmp, sh)]
        elif split:
            ins += [("add.u32", tmp, skv, rnd), ("shr.u32", n, tmp, sh)]
        else:
            ins += [("max.u32", tmp, skv, "1"), ("add.u32", tmp, tmp, rnd), ("shr.u32", n, tmp, sh)]
        if split:  # n holds the visible blocks: split_blocks, then at least one block
            s, ns, lo, t2 = split
            ins += [("add.u32", t2, n, ns), ("sub.u32", t2, t2, "1"), ("div.u32", t2, t2, ns),
                    ("mul.lo.u32", lo, s, t2), ("min.u32", lo, lo, n), ("add.u32", t2, t2, lo),
                    ("min.u32", t2, t2, n), ("sub.u32", n, t2, lo), ("max.u32", n, n, "1")]
    if n_unmasked:  # key_end of the unit's first row, clipped to [0, Skv], rounded down
        if causal:
            ins += [("mul.lo.u32", tmp, m, str(rows)), ("add.s32", tmp, tmp, skv), ("sub.s32", tmp, tmp, sq),
                    ("add.s32", tmp, tmp, "1"), ("min.s32", tmp, tmp, skv), ("max.s32", tmp, tmp, "0"),
                    ("shr.s32", n_unmasked, tmp, sh)]
        else:
            ins += [("shr.u32", n_unmasked, skv, sh)]
    return ins


def _block_info_window_ptx(*, rows, m, sq, skv, tmp, n, n_unmasked, split, window, lo, unmasked_lo,
                           block_n) -> list[tuple]:
    """block_info_ptx with a window: BlockInfo.of's formulas with key_begin / key_end of the sides."""
    wl, wr = window
    asked = [x for x in (n, n_unmasked, unmasked_lo) if x]
    if tmp == m and (len(asked) > 1 or n):
        raise ValueError("tmp may be m only when n_unmasked or unmasked_lo alone is computed")
    if n and not lo:
        raise ValueError("a window's block count needs lo (the first block run)")
    if split and split[3] == tmp:
        raise ValueError("a window's split needs tmp2 != tmp (tmp holds the window's first block)")
    rnd, sh = str(block_n - 1), str(_block_shift(block_n))
    right = [] if wr == "0" else [("add.s32", tmp, tmp, wr)]  # a causal window adds no right side

    def clip(lst):  # tmp in [0, Skv]
        return lst + [("max.s32", tmp, tmp, "0"), ("min.s32", tmp, tmp, skv)]
    ins: list[tuple] = []
    if n:
        # first = key_begin(first row) // N; end = ceil(key_end(last row) / N); first = min(first, end)
        ins += clip([("mul.lo.u32", tmp, m, str(rows)), ("add.s32", tmp, tmp, skv), ("sub.s32", tmp, tmp, sq),
                     ("sub.s32", tmp, tmp, wl)])
        ins += [("shr.s32", lo, tmp, sh)]
        ins += clip([("add.u32", tmp, m, "1"), ("mul.lo.u32", tmp, tmp, str(rows)), ("add.s32", tmp, tmp, skv),
                     ("sub.s32", tmp, tmp, sq)] + right)
        ins += [("add.s32", tmp, tmp, rnd), ("shr.s32", n, tmp, sh), ("min.s32", lo, lo, n), ("sub.s32", n, n, lo)]
        if split:  # the visible count cut as split_blocks, then offset by the first block
            s, ns, slo, t2 = split
            ins += [("mov.u32", tmp, lo),
                    ("add.u32", t2, n, ns), ("sub.u32", t2, t2, "1"), ("div.u32", t2, t2, ns),
                    ("mul.lo.u32", slo, s, t2), ("min.u32", slo, slo, n), ("add.u32", t2, t2, slo),
                    ("min.u32", t2, t2, n), ("sub.u32", n, t2, slo), ("max.u32", n, n, "1"),
                    ("add.u32", slo, slo, tmp)]
            if slo != lo:
                raise ValueError("with a window and a split, split's lo dst must be lo")
        else:
            ins += [("max.s32", n, n, "1")]
    if n_unmasked:  # key_end of the unit's first row, clipped, rounded down
        ins += clip([("mul.lo.u32", tmp, m, str(rows)), ("add.s32", tmp, tmp, skv), ("sub.s32", tmp, tmp, sq)]
                    + right + [("add.s32", tmp, tmp, "1")])
        ins += [("shr.s32", n_unmasked, tmp, sh)]
    if unmasked_lo:  # key_begin of the unit's last row, clipped, rounded up
        ins += clip([("add.u32", tmp, m, "1"), ("mul.lo.u32", tmp, tmp, str(rows)), ("add.s32", tmp, tmp, skv),
                     ("sub.s32", tmp, tmp, sq), ("sub.s32", tmp, tmp, wl), ("sub.s32", tmp, tmp, "1")])
        ins += [("add.s32", tmp, tmp, rnd), ("shr.s32", unmasked_lo, tmp, sh)]
    return ins


def key_limits_ptx(*, causal: bool, q: str, sq: str, skv: str, end: str, begin: str | None = None,
                   window: tuple[str, str] | None = None) -> list[tuple]:
    """key_end (and key_begin) of the query position in register q, in PTX (the per-row column limits
    of the element mask: key c of the row is visible iff begin <= c < end), as (opcode, dst, src...)
    tuples: end = key_end(q, Sq, Skv, causal, right) (signed: <= 0 when the row sees no key);
    with window = (left reg, right reg or "0") also begin = key_begin(q, Sq, Skv, left) (>= 0, >= Skv
    when the row sees no key; needs Sq, Skv < 2^30 as block_info_ptx's window)."""
    if window is None:
        if begin is not None:
            raise ValueError("key_limits_ptx: begin is a window's limit (0 without one)")
        if not causal:
            return [("mov.u32", end, skv)]
        return [("sub.s32", end, skv, sq), ("add.s32", end, end, q), ("add.s32", end, end, "1"),
                ("min.s32", end, end, skv)]
    wl, wr = window
    ins = [("sub.s32", end, skv, sq), ("add.s32", end, end, q), ("add.s32", end, end, "1")]
    if wr != "0":
        ins += [("add.s32", end, end, wr)]
    ins += [("min.s32", end, end, skv)]
    if begin is not None:
        ins += [("sub.s32", begin, skv, sq), ("add.s32", begin, begin, q), ("sub.s32", begin, begin, wl),
                ("max.s32", begin, begin, "0")]
    return ins
