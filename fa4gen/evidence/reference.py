"""NumPy references for the FA4 forward: exact float64 attention, and the FA4 algorithm itself.

``attention_exact`` is the mathematical answer (float64, max-subtracted softmax). ``fa4_forward``
replays the generated kernels' algorithm (the FA4 forward that fa4gen/ir/sm100.py and
fa4gen/lower/sm90.py build) tile by tile and block by block, with the kernel's fp32 decisions: GQA
row packing, reverse K/V order, causal block skipping, masks only where a block crosses the
diagonal or the Skv tail, conditional rescaling, the ex2 / cubic-emulation split, P rounded to
fp16/bf16 for the PV product. Its exponent inputs, max, reference choice, acc_scale and P (fp32)
are meant to be bit-identical to the kernel's; the reductions are not (see ``block_update``), so
row_sum and O agree with hardware to a few fp32 ulp.

Tensor conventions (flash-attn layout): q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], o like q,
lse [B, Hq, Sq] float32. An 'fp16' tensor is a numpy float16 array; a 'bf16' tensor is a float32
array whose values are bf16-representable (``round_to_dtype(x, 'bf16')`` makes one).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..spec.config import DTYPES, KernelConfig
from ..spec.plan import BlockInfo, kernel_score_scalars, kernel_window_args, key_begin, key_end, window_sides
from ..spec.exp2 import emulated_columns, exp2_emulated, exp2_hardware, fma_f32

__all__ = [
    "LN2",
    "LOG2E",
    "STATS_KEYS",
    "BlockUpdate",
    "RowState",
    "StepResult",
    "attention_exact",
    "block_needs_mask",
    "block_update",
    "col_begins",
    "col_limits",
    "kernel_score_args",
    "kernel_window_args",
    "fa4_forward",
    "n_block_max",
    "online_softmax_step",
    "round_to_dtype",
    "scale_log2_f32",
    "sink_terms",
    "softcap_scores",
    "tanh_approx_f32",
    "TANH_APPROX_MAX_REL_ERR",
    "tile_block_info",
    "visible_keys",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Counters fa4_forward adds into its optional ``stats`` dict (created as 0 when missing):
STATS_KEYS = (
    "tiles",                    # (batch, kv_head, m_block) Q tiles
    "tiles_without_blocks",     # tiles whose rows see no key (causal Sq > Skv, Skv = 0): their one block
                                # (plan.BlockInfo) is fully masked, O = 0, LSE = -inf
    "blocks",                   # (tile, K/V block) pairs processed
    "masked_blocks",            # of which took the mask path (diagonal or Skv tail)
    "row_block_updates",        # (valid row, block) softmax updates
    "later_row_block_updates",  # of which on a block after the tile's first one
    "rescale_skipped",          # later updates that kept the old reference (delta >= -threshold)
    "rescaled",                 # later updates that took the candidate (acc_scale = exp2(delta))
    "warp_block_updates",       # (32-row warp with a valid row, later block) pairs
    "warp_rescales",            # of which had some row with acc_scale < 1: WG2 rescales O
    "exp2_hardware",            # P exponentials on ex2.approx (incl. masked and tail columns)
    "exp2_emulated",            # P exponentials on the cubic emulation
)


# ---- dtypes -------------------------------------------------------------------------------------

def _f64_to_f32_round_odd(x64: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounding to odd (inexact results get an odd last bit): a later
    round-to-nearest to bf16 (8 bits <= 24 - 2) then equals one rounding of the float64 value."""
    with np.errstate(over="ignore"):
        r = x64.astype(np.float32)
    r64 = r.astype(np.float64)
    fix = np.isfinite(r) & (r64 != x64) & ~np.isnan(x64) & ((r.view(np.uint32) & 1) == 0)
    if np.any(fix):
        toward = np.where(x64 > r64, np.float32(np.inf), np.float32(-np.inf))
        r = np.where(fix, np.nextafter(r, toward), r)
    return r


def round_to_dtype(x, dtype: str) -> np.ndarray:
    """Round to nearest-even into ``dtype`` ('fp16' or 'bf16'), as cvt.rn.{f16,bf16}x2.f32 does.

    'fp16' returns a float16 array (overflow -> inf, subnormals kept); 'bf16' returns a float32
    array holding bf16 values (the top 16 bits of fp32; overflow -> inf; NaN stays a quiet NaN).
    Float64 inputs are rounded once (no double rounding through fp32).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float64)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return arr.astype(np.float16)  # NumPy converts f32 and f64 to f16 with one RNE rounding
    x32 = _f64_to_f32_round_odd(arr) if arr.dtype == np.float64 else arr.astype(np.float32)
    bits = np.atleast_1d(x32).reshape(-1).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)  # RNE on the dropped half
    nan = np.isnan(np.atleast_1d(x32).reshape(-1))
    rounded = np.where(nan, (bits | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), rounded)
    return rounded.view(np.float32).reshape(np.shape(x32))


def _as_compute(x: np.ndarray, dtype: str, name: str) -> np.ndarray:
    """Check that an input tensor holds ``dtype`` values; return it as float64."""
    if dtype == "fp16":
        if x.dtype != np.float16:
            raise TypeError(f"{name}: cfg.dtype is 'fp16', expected a float16 array, got {x.dtype}")
    else:
        if x.dtype != np.float32:
            raise TypeError(f"{name}: cfg.dtype is 'bf16', expected a float32 array of bf16 values, "
                            f"got {x.dtype} (use round_to_dtype(x, 'bf16'))")
        if np.any(x.view(np.uint32) & np.uint32(0xFFFF)):
            raise ValueError(f"{name}: float32 values are not bf16-representable "
                             "(use round_to_dtype(x, 'bf16'))")
    return x.astype(np.float64)


def scale_log2_f32(softmax_scale: float) -> np.float32:
    """The kernel's ``scale_log2`` parameter: softmax_scale * log2(e), computed in float64 and
    rounded once to fp32 (the runtime must pass exactly this value)."""
    return np.float32(float(softmax_scale) * LOG2E)


def _default_scale(head_dim: int, softmax_scale) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return s


def _check_shapes(q, k, v) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, np.ndarray) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D numpy array [B, S, H, D], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape[:3] != v.shape[:3]:  # v's last dim (head_dim_v, o's) may differ from k's
        raise ValueError(f"k and v shapes differ but for the last dim: {k.shape} vs {v.shape}")
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    return b, sq, hq, skv, hkv, d


# ---- score modifiers: window, softcap, sinks -------------------------------------------------------

# tanh.approx.f32 (sm_75+, the MUFU.TANH unit), the softcap's tanh in the kernels. The PTX ISA,
# section 9.7.3.22 "Floating Point Instructions: tanh"
# (https://docs.nvidia.com/cuda/parallel-thread-execution/#floating-point-instructions-tanh):
# "The maximum relative error over the entire floating point range is 2^-11." (The 2^-10.987 of
# section 9.7.4.9, the half-precision tanh, is tanh.approx.f16's maximum ABSOLUTE error, not this
# one.) Measured on sm_75 it is 1.113e-5 relative, 134 ulp (N. Juffa, NVIDIA developer forums,
# "Hardware-accelerated tanh() on Turing", 2021). fa4_forward and the emulator (ptxemu fp.tanh_approx)
# model it as the correctly rounded fp32 tanh, NOT bit-exact to the hardware: judging a GPU's output
# takes this bound (see ptxemu.cases.softcap_score_err), judging the models' takes fp32 rounding.
TANH_APPROX_MAX_REL_ERR = 2.0 ** -11


def tanh_approx_f32(x) -> np.ndarray:
    """The model of tanh.approx.f32: float32(tanh(float64(x))) for fp32 x (correctly rounded; the
    hardware is within TANH_APPROX_MAX_REL_ERR of it). NaN stays NaN, +-inf -> +-1."""
    x32 = np.asarray(x, np.float32)
    return np.tanh(x32.astype(np.float64)).astype(np.float32)


def _softcap_value(softcap) -> float:
    c = float(softcap or 0.0)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    return c


def softcap_scores(s, softcap: float):
    """float64 scaled scores s -> softcap * tanh(s / softcap) (flash-attn's convention); softcap 0:
    s unchanged. -inf stays -inf (masked entries are masked after the cap)."""
    c = _softcap_value(softcap)
    if c == 0.0:
        return s
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(s), -np.inf, c * np.tanh(np.asarray(s, np.float64) / c))


def kernel_score_args(softmax_scale: float, softcap: float = 0.0) -> dict:
    """plan.kernel_score_scalars rounded to fp32 as a launch passes them."""
    return {k: np.float32(v) for k, v in kernel_score_scalars(softmax_scale, _softcap_value(softcap)).items()}


def _sinks_array(sinks, hq: int):
    if sinks is None:
        return None
    z = np.asarray(sinks, np.float64).reshape(-1)
    if z.shape != (hq,):
        raise ValueError(f"sinks must hold one logit per query head ({hq}), got shape {np.shape(sinks)}")
    if np.isnan(z).any() or np.isposinf(z).any():
        raise ValueError("sinks must be finite or -inf (no NaN, no +inf)")
    return z


def visible_keys(sq: int, skv: int, causal: bool, window) -> np.ndarray:
    """bool [Sq, Skv]: key j visible to query i (bottom-right aligned causal mask and window)."""
    left, right = window_sides(window, causal)
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    return (j >= key_begin(i, sq, skv, left)) & (j < key_end(i, sq, skv, False, right))


# ---- exact attention ----------------------------------------------------------------------------

def masked_scores(q, k, causal: bool, scale: float, *, window=None, softcap: float = 0.0) -> np.ndarray:
    """float64 logits q k^T * scale as [B, Hkv, G, Sq, Skv] (query head h = kv_head * G + g), capped
    to softcap * tanh(s / softcap) when softcap > 0, -inf where the bottom-right causal mask or the
    window (flash-attn's (left, right), -1 unbounded) hides key j from query i: visible iff
    i + Skv - Sq - left <= j <= i + Skv - Sq + right (causal: right = 0)."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    qg = q.astype(np.float64).reshape(b, sq, hkv, hq // hkv, d)
    s = softcap_scores(np.einsum("bihgd,bjhd->bhgij", qg, k.astype(np.float64)) * scale, softcap)
    if causal or window is not None:
        s = np.where(visible_keys(sq, skv, causal, window), s, -np.inf)
    return s


def attention_exact(q, k, v, causal: bool, softmax_scale=None, *, window=None, softcap: float = 0.0,
                    sinks=None):
    """float64 softmax(q k^T * scale) v with GQA (q head h reads kv head h // (Hq // Hkv)) and the
    bottom-right causal mask (query i sees keys j <= i + Skv - Sq).

    window = (left, right) (flash-attn's convention, -1 unbounded; causal makes right 0): query i
    sees keys j with i + Skv - Sq - left <= j <= i + Skv - Sq + right. softcap > 0: the scaled
    scores s become softcap * tanh(s / softcap) before the softmax. sinks: float [Hq] (-inf = none
    for that head), one logit z_h per query head joining every row's denominator and no value:
    O = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{z_h}), LSE = log(sum_j e^{s_j} + e^{z_h}).
    Rows without a valid key: O = 0, LSE = z_h (-inf without a sink).
    v may have its own last dim DV (head_dim_v; k's is q's D).
    Returns (o [B, Sq, Hq, DV] float64, lse [B, Hq, Sq] float64)."""
    q, k, v = (np.asarray(t) for t in (q, k, v))
    b, sq, hq, skv, hkv, d = _check_shapes(q, k, v)
    scale = _default_scale(d, softmax_scale)
    z = _sinks_array(sinks, hq)
    s = masked_scores(q, k, causal, scale, window=window, softcap=softcap)
    m = s.max(axis=-1, initial=-np.inf)
    if z is not None:  # the sink joins the max: a dominant sink (z >> s) stays finite
        m = np.maximum(m, z.reshape(hkv, hq // hkv)[None, :, :, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(axis=-1)
    if z is not None:
        denom = denom + np.exp(z.reshape(hkv, hq // hkv)[None, :, :, None] - m_safe)
    num = np.einsum("bhgij,bjhd->bhgid", e, v.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(denom[..., None] > 0, num / denom[..., None], 0.0)
        lse = np.where(denom > 0, m_safe + np.log(denom), -np.inf)
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, v.shape[-1])
    return o, lse.reshape(b, hq, sq)


# ---- tile geometry (shared with the simulator and the lowering) ---------------------------------

def tile_block_info(cfg: KernelConfig, m_block: int, seqlen_q: int, seqlen_k: int, window=None, *,
                    tiles: int = 1, split: int = 0, num_splits: int = 1) -> BlockInfo:
    """The K/V blocks of Q tile m_block (plan.BlockInfo over its seq_q_per_tile positions), or with
    tiles > 1 of unit m_block of that many consecutive tiles (a task's: sm_100a pairs two), split
    `split` of num_splits (KV cache); window: flash-attn's (left, right) (-1 unbounded), or None."""
    sides = window_sides(window, cfg.causal) if window is not None else None
    return BlockInfo.of(m_block, tiles * cfg.seq_q_per_tile, seqlen_q, seqlen_k, cfg.causal, split, num_splits,
                        window=sides, block_n=cfg.block_n)


def n_block_max(cfg: KernelConfig, m_block: int, seqlen_q: int, seqlen_k: int, window=None) -> int:
    """Exclusive end of the K/V blocks holding a key some row of the Q tile sees (BlockInfo.end;
    0 when no row does: the tile then runs one fully masked block)."""
    return tile_block_info(cfg, m_block, seqlen_q, seqlen_k, window).end


def block_needs_mask(cfg: KernelConfig, m_block: int, n_block: int, seqlen_q: int, seqlen_k: int,
                     window=None) -> bool:
    """True when some element of the block must be masked (BlockInfo.needs_mask): it runs past Skv
    (TMA zero-fills K, so the scores there are 0, not -inf), (causal) it crosses the tile's first
    row's diagonal, or (window) it holds a key below some row's window."""
    return tile_block_info(cfg, m_block, seqlen_q, seqlen_k, window).needs_mask(n_block)


def col_limits(cfg: KernelConfig, seq: np.ndarray, seqlen_q: int, seqlen_k: int, window=None) -> np.ndarray:
    """Per row, the exclusive key limit: Skv, or causally min(Skv, seq + Skv - Sq + 1) (may be <= 0);
    with a window's right side min(Skv, seq + Skv - Sq + right + 1)."""
    _, right = window_sides(window, cfg.causal)
    return key_end(np.asarray(seq).astype(np.int64), seqlen_q, seqlen_k, False, right)


def col_begins(cfg: KernelConfig, seq: np.ndarray, seqlen_q: int, seqlen_k: int, window=None) -> np.ndarray:
    """Per row, the first key it sees: 0, or with a window's left side max(0, seq + Skv - Sq - left)."""
    left, _ = window_sides(window, cfg.causal)
    return key_begin(np.asarray(seq).astype(np.int64), seqlen_q, seqlen_k, left)


# ---- one softmax step -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RowState:
    """Per-row online-softmax state of a tile: the reference ``ref`` (the seed's row_max, not always
    the true max), row_sum and the unnormalised O, all fp32."""

    ref: np.ndarray  # [R] float32
    row_sum: np.ndarray  # [R] float32
    o: np.ndarray  # [R, DV] float32

    @classmethod
    def initial(cls, rows: int, head_dim: int) -> "RowState":
        return cls(np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32),
                   np.zeros((rows, head_dim), np.float32))


@dataclass(frozen=True)
class BlockUpdate:
    state: RowState
    acc_scale: np.ndarray  # [R] float32; 1 on the first block and where the old reference was kept
    p: np.ndarray  # [R, N] float32 P before the cast for the PV MMA
    rescaled: np.ndarray  # [R] bool; True where a later block took the candidate reference


def block_update(state: RowState, s, v, scale_log2, threshold: float, *, first: bool,
                 emulated=None, p_dtype: str | None = None) -> BlockUpdate:
    """One K/V block of the online softmax for many rows at once, exactly the seed's steps.

    s: [R, N] float32 scores (masked entries -inf); v: [N, D] values (any float; rows past Skv 0).
    ``emulated``: bool[N] columns using exp2_emulated (None: all hardware). ``p_dtype``: the
    dtype P is rounded to for the PV product (None: unrounded). Steps, all fp32:
      blockmax; first block: ref = blockmax, acc = 1; later: cand = max(ref, blockmax),
      safe = cand or 0 if -inf, delta = (ref - safe) * scale_log2; delta >= -threshold keeps ref
      (acc = 1), else ref = cand, acc = ex2(delta) (hardware ex2, as the seed's T.ptx.exp2);
      x = fma(s, scale_log2, -(ref_safe * scale_log2)) (the seed's one-FMA form, not
      (s - ref) * scale_log2); p = ex2 or emulation per column.
    row_sum = row_sum * acc + sum(p) and O = O * acc + round(p) @ v: the products by acc are fp32;
    the block sums are formed in float64 and rounded once (the kernel's reduction trees and the
    tensor cores' accumulation order are not modelled: a few fp32 ulp of difference).
    """
    s = np.asarray(s)
    if s.dtype != np.float32 or s.ndim != 2:
        raise TypeError(f"s must be a 2-D float32 array, got {s.dtype} {s.shape}")
    sl2 = np.float32(scale_log2)
    thr = np.float32(threshold)  # the kernel compares against an fp32 immediate
    blk_max = s.max(axis=1, initial=np.float32(-np.inf))
    with np.errstate(invalid="ignore"):
        if first:
            ref_new = blk_max
            safe = np.where(blk_max == -np.inf, np.float32(0), blk_max)
            acc = np.ones_like(blk_max)
            rescaled = np.zeros(blk_max.shape, bool)
        else:
            cand = np.maximum(state.ref, blk_max)
            safe_c = np.where(cand == -np.inf, np.float32(0), cand)
            delta = (state.ref - safe_c) * sl2
            keep = delta >= -thr
            ref_new = np.where(keep, state.ref, cand)
            safe = np.where(keep, state.ref, safe_c)
            acc = np.where(keep, np.float32(1), exp2_hardware(delta))
            rescaled = ~keep
    neg_ref_scaled = (-safe) * sl2
    x = fma_f32(s, sl2, neg_ref_scaled[:, None])
    p = exp2_hardware(x)
    if emulated is not None:
        cols = np.flatnonzero(np.asarray(emulated, dtype=bool))
        if cols.size:
            p[:, cols] = exp2_emulated(np.ascontiguousarray(x[:, cols]))
    p_mma = p if p_dtype is None else round_to_dtype(p, p_dtype)
    row_sum = ((state.row_sum * acc).astype(np.float64) + p.astype(np.float64).sum(axis=1)).astype(np.float32)
    o = ((state.o * acc[:, None]).astype(np.float64)
         + p_mma.astype(np.float64) @ np.asarray(v, dtype=np.float64)).astype(np.float32)
    return BlockUpdate(RowState(ref_new.astype(np.float32), row_sum, o), acc.astype(np.float32), p, rescaled)


@dataclass(frozen=True)
class StepResult:
    ref: np.float32
    row_sum: np.float32
    o: np.ndarray  # [D] float32
    acc_scale: np.float32
    p: np.ndarray  # [N] float32
    rescaled: bool


def online_softmax_step(ref, row_sum, o, s, v, scale_log2, threshold, *, first: bool = False,
                        emulated=None, p_dtype: str | None = None) -> StepResult:
    """One row, one block, written element by element straight from the seed's softmax code
    (the readable twin of ``block_update``; tests hold them equal). Same arguments as
    block_update for a single row: s [N], v [N, D], o [D]."""
    f32 = np.float32
    s = np.asarray(s, dtype=np.float32)
    sl2, thr = f32(scale_log2), f32(threshold)
    ref, row_sum = f32(ref), f32(row_sum)
    tile_max = f32(-np.inf)
    for val in s:
        tile_max = max(tile_max, val)
    if first:
        new_ref, acc, rescaled = tile_max, f32(1), False
        ref_safe = f32(0) if tile_max == -np.inf else tile_max
    else:
        tile_max = max(ref, tile_max)  # the seed seeds the max with the old row_max
        ref_safe = f32(0) if tile_max == -np.inf else tile_max
        delta = f32((ref - ref_safe) * sl2)
        if delta >= -thr:
            new_ref, ref_safe, acc, rescaled = ref, ref, f32(1), False
        else:
            new_ref, acc, rescaled = tile_max, exp2_hardware(delta)[()], True
    neg = f32(-ref_safe * sl2)
    emu = np.zeros(s.shape, bool) if emulated is None else np.asarray(emulated, dtype=bool)
    p = np.empty(s.shape, np.float32)
    for j, val in enumerate(s):
        xj = fma_f32(val, sl2, neg)
        p[j] = (exp2_emulated(xj) if emu[j] else exp2_hardware(xj))[()]
    p_mma = p if p_dtype is None else round_to_dtype(p, p_dtype)
    new_sum = f32(float(f32(row_sum * acc)) + float(p.astype(np.float64).sum()))
    o32 = np.asarray(o, dtype=np.float32)
    new_o = ((o32 * acc).astype(np.float64)
             + p_mma.astype(np.float64) @ np.asarray(v, dtype=np.float64)).astype(np.float32)
    return StepResult(f32(new_ref), new_sum, new_o, f32(acc), p, rescaled)


# ---- the FA4 forward --------------------------------------------------------------------------------

def _bump(stats, key, n):
    if stats is not None:
        stats[key] = stats.get(key, 0) + int(n)


def _score_mods_for(cfg: KernelConfig, hq: int, window, softcap, sinks):
    """Check the values against the kernel's flags; (window or None, softcap, sinks float64 or None)."""
    if window is not None and not cfg.window:
        raise ValueError(f"a window was given but {cfg.name} has no window (KernelConfig.window)")
    c = _softcap_value(softcap)
    if cfg.softcap != (c > 0):
        raise ValueError(f"{cfg.name}: softcap {softcap!r} " + ("must be > 0 (the kernel caps its scores)"
                                                               if cfg.softcap else "given to a kernel without softcap"))
    if sinks is not None and not cfg.sinks:
        raise ValueError(f"sinks were given but {cfg.name} has no sinks (KernelConfig.sinks)")
    return window, c, _sinks_array(sinks, hq)


def fa4_forward(q, k, v, cfg: KernelConfig, softmax_scale=None, stats: dict | None = None, *, window=None,
                softcap: float = 0.0, sinks=None):
    """The FA4 forward as the generated kernel computes it. Returns (o, lse): o [B, Sq, Hq, DV] in
    cfg.dtype's array convention, lse [B, Hq, Sq] float32 (LSE = ln(row_sum) + ref * scale, with
    row_sum relative to the final reference ref; -inf where no key is valid).

    Per (batch, kv_head, head group j, m_block) Q tile of block_m rows (fa4gen.spec.tiles.gqa_pack: P
    heads per tile, G / P head groups per kv head): row r holds sequence position
    m_block * seq_q_per_tile + r // P of head kv_head * G + j * P + r % P (rows past Sq are padding
    the kernel computes and never stores; skipped here). K/V blocks plan.BlockInfo.blocks() (lo + n - 1
    down to lo; one fully masked block when no row sees a key); masked blocks
    all use hardware ex2, others split per ``emulated_columns``. O = O * (1 / row_sum) in fp32
    (0 where row_sum is 0), then rounded to cfg.dtype.

    Score modifiers (the kernel's flags cfg.window / softcap / sinks; values as attention_exact's):
    - window (left, right): BlockInfo's window range; a masked block hides column c of a row unless
      key_begin(row) <= c < key_end(row) (both per-row limits).
    - softcap: each raw fp32 score x becomes t = tanh.approx(fp32(x * softcap_in)) (modelled by
      tanh_approx_f32: correctly rounded, not bit-exact to the hardware), before the mask and the
      row max; scale_log2 = fp32(softcap * log2 e) (kernel_score_args), the rest unchanged.
    - sinks z_h, at the final normalisation (fp32): m2 = ref * scale_log2 (-inf if no key),
      z2 = z_h * fp32(log2 e), M = max(m2, z2), a = ex2(m2 - M), l' = fma(row_sum, a, ex2(z2 - M)),
      O = O * (a * (1 / l')), LSE = (M + log2 l') * ln 2 (float64 from the fp32 M, l'); M = -inf
      (no key, no sink) keeps O = 0, LSE = -inf.
    """
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"cfg must be a KernelConfig, got {type(cfg).__name__}")
    q, k, v = (np.asarray(t) for t in (q, k, v))
    b, sq, hq, skv, hkv, d = _check_shapes(q, k, v)
    dv = v.shape[-1]
    if (d, dv) != cfg.head_dims:
        raise ValueError(f"(head_dim, head_dim_v) = ({d}, {dv}) (q's and v's last dims) does not match the "
                         f"config's {cfg.head_dims}")
    if hq != hkv * cfg.gqa_ratio:
        raise ValueError(f"Hq / Hkv = {hq} / {hkv} does not match cfg.gqa_ratio {cfg.gqa_ratio}")
    window, cap, z = _score_mods_for(cfg, hq, window, softcap, sinks)
    q64, k64, v64 = (_as_compute(t, cfg.dtype, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = _default_scale(d, softmax_scale)
    args = kernel_score_args(scale, cap)
    sl2 = args["scale_log2"]
    g, pk, sqt, bm, bn = cfg.gqa_ratio, cfg.gqa_pack, cfg.seq_q_per_tile, cfg.block_m, cfg.block_n
    emu_cols = emulated_columns(cfg, apply_mask=False)
    n_emu = int(emu_cols.sum())
    win = (window if window is not None else (-1, -1)) if cfg.window else None

    o_out = np.zeros((b, sq, hq, dv), np.float32)
    lse_out = np.full((b, hq, sq), -np.inf, np.float32)
    rows = np.arange(bm)
    for bi in range(b):
        for kvh in range(hkv):
            k_bh = k64[bi, :, kvh, :]
            v_pad = np.zeros((-(-skv // bn) * bn, dv))
            v_pad[:skv] = v64[bi, :, kvh, :]  # TMA zero-fills the tail rows of the last V block
            for j, m in itertools.product(range(g // pk), range(-(-sq // sqt))):
                seq = m * sqt + rows // pk
                valid = seq < sq
                seq_v, head_v, warp_v = seq[valid], (kvh * g + j * pk + rows % pk)[valid], (rows // 32)[valid]
                _bump(stats, "tiles", 1)
                info = tile_block_info(cfg, m, sq, skv, win)
                # a tile whose rows see no key runs one block its mask hides whole: O = 0, LSE = -inf
                _bump(stats, "tiles_without_blocks", info.empty)
                r = seq_v.size
                s_all = (q64[bi, seq_v, head_v, :] @ k_bh.T).astype(np.float32)  # fp32 accumulate, one rounding
                if cap:
                    s_all = tanh_approx_f32(s_all * args["softcap_in"])  # mul.f32 then tanh.approx.f32
                limits = col_limits(cfg, seq_v, sq, skv, win)
                begins = col_begins(cfg, seq_v, sq, skv, win)
                state = RowState.initial(r, dv)
                for i, n in enumerate(info.blocks()):
                    c0 = n * bn
                    s = np.full((r, bn), -np.inf, np.float32)
                    s[:, :max(0, min(bn, skv - c0))] = s_all[:, c0:c0 + bn]
                    masked = info.needs_mask(n)
                    if masked:
                        col = c0 + np.arange(bn)[None, :]
                        s[(col >= limits[:, None]) | (col < begins[:, None])] = -np.inf
                    first = i == 0
                    v_blk = v_pad[c0:c0 + bn] if c0 < v_pad.shape[0] else np.zeros((bn, dv))  # TMA zero fill
                    upd = block_update(state, s, v_blk, sl2, cfg.rescale_threshold,
                                       first=first, emulated=None if masked else emu_cols,
                                       p_dtype=cfg.dtype)
                    state = upd.state
                    if stats is not None:
                        _bump(stats, "blocks", 1)
                        _bump(stats, "masked_blocks", masked)
                        _bump(stats, "row_block_updates", r)
                        emu = 0 if masked else n_emu * r
                        _bump(stats, "exp2_emulated", emu)
                        _bump(stats, "exp2_hardware", r * bn - emu)
                        if not first:
                            _bump(stats, "later_row_block_updates", r)
                            _bump(stats, "rescaled", upd.rescaled.sum())
                            _bump(stats, "rescale_skipped", r - upd.rescaled.sum())
                            warps = np.unique(warp_v)
                            _bump(stats, "warp_block_updates", warps.size)
                            _bump(stats, "warp_rescales", np.unique(warp_v[upd.acc_scale < 1]).size)
                if z is not None:
                    o_rows, lse_rows = _sink_epilogue(state, z[head_v], sl2)
                else:
                    pos = state.row_sum > 0
                    inv = np.zeros(r, np.float32)
                    inv[pos] = np.float32(1) / state.row_sum[pos]
                    o_rows = state.o * inv[:, None]
                    with np.errstate(divide="ignore"):
                        lse = np.log(state.row_sum.astype(np.float64)) + state.ref.astype(np.float64) * float(sl2) * LN2
                    lse_rows = np.where(pos, lse, -np.inf)
                o_out[bi, seq_v, head_v, :] = o_rows
                lse_out[bi, head_v, seq_v] = lse_rows.astype(np.float32)
    return round_to_dtype(o_out, cfg.dtype), lse_out


def _sink_epilogue(state: RowState, z: np.ndarray, sl2) -> tuple[np.ndarray, np.ndarray]:
    """The final normalisation with a sink logit per row (fa4_forward's docstring), fp32: (O, LSE)."""
    factor, lse = sink_terms(state.ref, state.row_sum, z, sl2)
    return (state.o * factor[:, None]).astype(np.float32), lse


def sink_terms(ref, row_sum, z: np.ndarray, sl2) -> tuple[np.ndarray, np.ndarray]:
    """Per row, O's factor a * (1 / l') and the LSE of the sink epilogue (fa4_forward's docstring)
    from the final reference, row_sum (fp32) and the row's sink logit z."""
    f32 = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        m2 = np.where(ref == -np.inf, f32(-np.inf), ref * f32(sl2)).astype(f32)
        z2 = (z.astype(f32) * f32(LOG2E)).astype(f32)
        big = np.maximum(m2, z2)
        live = big > -np.inf
        safe = np.where(live, big, f32(0))
        a = exp2_hardware((m2 - safe).astype(f32))
        l2 = fma_f32(row_sum, a, exp2_hardware((z2 - safe).astype(f32)))
        inv = np.where(live & (l2 > 0), f32(1) / np.where(l2 > 0, l2, f32(1)), f32(0)).astype(f32)
        lse = (safe.astype(np.float64) + np.log2(np.where(live, l2, 1).astype(np.float64))) * LN2
    return (a * inv).astype(f32), np.where(live, lse, -np.inf)
