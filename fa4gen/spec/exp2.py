"""exp2 on the FMA units: the cubic emulation shared, bit for bit, by the kernels and the reference.

FA4 splits a softmax row's exponentials between the MUFU unit (``ex2.approx``) and this
polynomial on the FP32 pipes, so that neither unit alone bounds the softmax. Everything here is
NumPy that replays, in the same order and with the same roundings, the PTX sequence a template
spells (one value; the kernel's ``ex2_emulation_2`` runs two at a time with the same ops):

    max.f32        xc, x, 0fC2FE0000;     // clamp at -127.0 (max returns the non-NaN operand)
    add.rm.f32     xr, xc, 0f4B400000;    // + 1.5 * 2^23 rounding toward -inf: xr = 12582912 + floor(xc)
    sub.rn.f32     xi, xr, 0f4B400000;    // floor(xc) as a float (exact: both are integers < 2^24)
    sub.rn.f32     f, xc, xi;             // fraction in [0, 1]
    fma.rn.f32     p, C3, f, C2;          // Horner, three FMAs
    fma.rn.f32     p, p, f, C1;
    fma.rn.f32     p, p, f, C0;
    shl.b32        e, xr, 23;             // low 9 bits of xr's pattern = floor(xc) mod 512 -> exponent field
    add.s32        y, p, e;               // 2^floor(xc) * p(f)

Why each step is the way it is:

* ``add.rm`` (round toward -inf: PTX ISA, Floating Point Instructions: add, rounding modifiers) makes the integer part the
  floor, so the fraction is in [0, 1) and one polynomial on [0, 1) covers every input. In
  [2^23, 2^24) the fp32 spacing is 1, so the sum's pattern is 0x4B400000 + floor(xc) and its low 9
  bits, shifted left 23, are floor(xc) * 2^23 mod 2^32: adding that to p's bits adds floor(xc) to
  p's exponent. Valid while 12582912 + floor(xc) stays in [2^23, 2^24) and the exponent does not
  overflow: xc in [-127, 128).
* ``sub.rn`` (explicit rounding) so ptxas may not contract anything; the fraction subtraction is
  exact for |xc| >= 1 and for xc in [0, 1); for xc in (-1, 0) it rounds xc + 1 (error <= 2^-25,
  i.e. a relative error <= 2^-25 * ln 2 in the result, included in the scan below). For
  -2^-25 < xc < 0 the fraction is 1.0 exactly, so the polynomial is also used at f = 1.
* FTZ (``.ftz``) variants give the same results: f is subnormal only for 0 < xc < 2^-126, where
  p(f) rounds to C0 = 1 either way.

Inputs at or below -127, -inf and NaN (max.f32 without .NaN returns the non-NaN operand: PTX ISA, Floating Point Instructions: max) all become
-127: floor = -127, f = 0, p = C0 = 1.0 exactly, and 0x3F800000 + (-127 << 23) = 0x00000000, so the
result is exactly +0.0. This is one reason C0 is fixed at 1 (see EXP2_POLY). For xc in (-127, -126)
the exponent field becomes 0 and the pattern reads as the subnormal (p(f) - 1) * 2^-126 instead of
p(f) * 2^-127: relative error up to 100%, absolute error <= 2^-127. Those values round to 0 in fp16;
in bf16 they are bf16 subnormals (bf16 has fp32's exponent range), off by <= 2^-127 absolute, which
is invisible next to a row sum >= ~1 (the reference element contributes ~1). In the kernel the
emulated path only sees unmasked blocks, whose inputs are finite; masked blocks use ex2.approx.

The kernel's other exponential, MUFU ``ex2.approx.f32``, is modelled by ``exp2_hardware`` (NumPy's
fp32 exp2, within ~1 ulp; the hardware's documented error is ~2 ulp: PTX ISA, Floating Point Instructions: ex2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import KernelConfig

__all__ = [
    "EXP2_POLY",
    "EXP2_POLY_MAX_REL_ERROR",
    "EXP2_CLAMP",
    "ROUND_MAGIC",
    "FRAG_COLS",
    "Exp2ErrorReport",
    "emulated_columns",
    "emulated_mask",
    "exp2_emulated",
    "exp2_error_report",
    "exp2_hardware",
    "fit_exp2_poly",
    "fma_f32",
    "hopper_emulated",
    "max_relative_error",
]

EXP2_CLAMP = -127.0
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: its sum with x in [-2^22, 2^22) stays in [2^23, 2^24)
FRAG_COLS = 32  # columns per tcgen05.ld fragment (32x32b shape, 32 registers per thread)

# Cubic p(f) ~ 2^f on [0, 1], coefficients (C0, C1, C2, C3), fp32 values.
# Fitted by `fit_exp2_poly()`: Remez exchange minimising the max RELATIVE error |p(f) / 2^f - 1|
# over [0, 1] with C0 = 1 fixed, then each coefficient rounded to the nearest fp32. The result
# equioscillates at 4 points (f = 1 is one of them) with |error| = 8.559e-5 before rounding.
# Why C0 = 1 fixed rather than free: a free C0 lowers the minimax error only to 7.48e-5 (13%), while
# C0 = 1 makes (a) every integer x exact (p(0) = 1: x = 0 gives 1.0, x = 3 gives 8.0), so the
# row's reference element gets p = 1 exactly on either exp path, and (b) the -127 clamp produce
# exactly +0.0 for -inf, NaN and x <= -127 (the exponent add cancels 1.0's pattern to 0).
# The published FA4 set (1, 0.69515, 0.22756, 0.07712) is the same kind of fit; these were
# recomputed here, not copied. tests/test_exp2.py refits and compares.
EXP2_POLY = (
    1.0,
    float(np.float32(0.695116786411201)),
    float(np.float32(0.22764499121162643)),
    float(np.float32(0.0770670419881968)),
)
# Bound on the emulation's relative error for every fp32 x in [-126, 127] (fit + coefficient and
# FMA roundings); checked against the scan in tests/test_exp2.py (which also requires the scan to
# come within 1% of it, so the bound is not loose).
EXP2_POLY_MAX_REL_ERROR = 8.6e-5

_C = tuple(np.float32(c) for c in EXP2_POLY)


# ---- exact fp32 primitives --------------------------------------------------------------------

def _f32_array(x, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise TypeError(f"{what} must be float32 (got {arr.dtype}); round explicitly first, "
                        "the emulation is defined on fp32 inputs")
    return arr


def fma_f32(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add ``fma.rn.f32``: a * b + c with ONE round-to-nearest-even to fp32.

    The product of two fp32 is exact in float64 (24 + 24 <= 53 bits), but ``float32(a*b + c)``
    computed in float64 rounds twice, and that is NOT always correct: e.g.
    a = b = 1 + 2^-12, c = 2^-80 gives a*b + c = 1 + 2^-11 + 2^-24 + 2^-80; float64 drops 2^-80,
    leaving an fp32 tie that rounds to even (down) while the true result rounds up.
    So the float64 sum is first made round-to-odd (Boldo & Melquiond: rounding to odd at
    53 >= 24 + 2 bits, then to nearest at 24 bits, equals one rounding to nearest): the exact
    error of the float64 add comes from TwoSum, and an inexact, even result steps one float64 ulp
    toward the exact value. Exact for all finite inputs whose results do not overflow; infinities
    and NaNs propagate as IEEE says.
    """
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    prod = a64 * b64  # exact
    s = prod + c64
    with np.errstate(invalid="ignore"):
        # TwoSum (Knuth): err = (prod + c) - s exactly, valid without any ordering assumption.
        bv = s - prod
        err = (prod - (s - bv)) + (c64 - bv)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        fix = np.isfinite(s) & (err != 0) & even
    if np.any(fix):
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _add_rm_magic(xc: np.ndarray) -> np.ndarray:
    """``add.rm.f32 xr, xc, 1.5*2^23`` for xc in [-2^22, 2^22): the exact sum's floor is an fp32
    integer in [2^23, 2^24), which is what rounding toward -inf returns there."""
    return (np.floor(xc.astype(np.float64)) + ROUND_MAGIC).astype(np.float32)


def exp2_emulated(x) -> np.ndarray:
    """2^x by the cubic emulation, replaying the kernel's fp32 operation sequence exactly.

    ``x``: float32 array (or np.float32 scalar); returns float32 of the same shape. Contract:
    x < 128 (the kernel's inputs are <= rescale_threshold + rounding); -inf, NaN and x <= -127 give
    +0.0 exactly; see the module docstring for (-127, -126).
    """
    x = _f32_array(x, "exp2_emulated input")
    shape = x.shape
    x = x.reshape(-1)  # 1-D so .view works the same for 0-d inputs
    xc = np.fmax(x, np.float32(EXP2_CLAMP))  # fmax: NaN -> -127, like max.f32
    xr = _add_rm_magic(xc)
    xi = xr - np.float32(ROUND_MAGIC)  # exact
    f = xc - xi  # fp32 sub.rn
    c0, c1, c2, c3 = _C
    p = fma_f32(fma_f32(fma_f32(c3, f, c2), f, c1), f, c0)
    e = np.left_shift(xr.view(np.uint32), np.uint32(23))  # uint32: wraps like shl.b32
    y = (p.view(np.uint32) + e).view(np.float32)  # uint32 add wraps like add.s32
    return y.reshape(shape)


def exp2_hardware(x) -> np.ndarray:
    """Model of MUFU ``ex2.approx.f32``: NumPy's fp32 exp2 (exp2(-inf) = 0, ~1 ulp).

    The real unit is within ~2 ulp and flushes subnormal results in its .ftz form; the reference
    and the simulator use this function, so they agree with each other exactly and with hardware
    to a few fp32 ulp.
    """
    x = _f32_array(x, "exp2_hardware input")
    with np.errstate(over="ignore", under="ignore"):
        return np.exp2(x, dtype=np.float32)


# ---- which elements the kernel emulates -------------------------------------------------------

def emulated_mask(cfg: KernelConfig, frag_idx: int, apply_mask: bool) -> np.ndarray:
    """bool[32]: which columns of 32-column fragment ``frag_idx`` (0..3) use exp2_emulated.

    FA4's softmax loop (its `ex2_emulation_2` dispatch) walks pairs
    (idx, idx + 1) with idx = frag_idx * 32 + 2 * i, i in 0..15, and uses hardware ex2 when
    ``2*i % 16 < 16 - 2*emu_pairs or frag_idx >= 3 or frag_idx < emu_start or apply_mask``.
    Since 16 - 2*emu_pairs is even, pair i's test equals the per-element test on j in {2i, 2i+1}:
    column j of the fragment is emulated iff
        (j % 16) >= 16 - 2*emu_pairs  and  emu_start <= frag_idx < 3  and  not apply_mask,
    i.e. the last 2*emu_pairs of every 16 columns, in fragments emu_start..2; fragment 3 and
    masked blocks (causal diagonal, Skv tail) always use the hardware unit.
    Defaults: emu_pairs 2 -> columns 12-15 and 28-31; emu_start 1 non-causal (12.5% of a row),
    0 causal (18.75%).
    """
    if isinstance(frag_idx, bool) or not isinstance(frag_idx, (int, np.integer)) or not 0 <= frag_idx < 4:
        raise ValueError(f"frag_idx must be an integer in [0, 4) (four 32-column fragments), got {frag_idx!r}")
    if not isinstance(apply_mask, (bool, np.bool_)):
        raise TypeError(f"apply_mask must be a bool, got {apply_mask!r}")
    j = np.arange(FRAG_COLS)
    in_frag = cfg.emu_start <= frag_idx < 3 and not apply_mask
    return ((j % 16) >= 16 - 2 * cfg.emu_pairs) & in_frag


def hopper_emulated(cfg: KernelConfig, c: int, e: int) -> bool:
    """sm_90a: whether the value in 8-column chunk c, pair element e of a thread's row takes the
    FMA cubic (masked blocks use MUFU only; `emulated_columns` applies that).

    On sm_100a a thread owns one whole row and the split is by column: the last 2*emu_pairs of
    every 16 columns, in 32-column fragments [emu_start, 3). A Hopper thread owns 32 values of a
    row (columns 8c + 2*(lane%4) + e), so the column-based rule would depend on the lane. The same
    fractions are kept with a per-register rule: the thread's k-th value (k = 2c + e, column
    order) lies in fragment k // 8 (the same 32 columns as on sm_100a); the last emu_pairs of each
    fragment's 8 values are emulated in fragments [emu_start, 3). As a rule on the block's column
    j that is c = j // 8, e = j % 2: the same for every lane.
    """
    k = 2 * c + e
    return cfg.emu_start <= k // 8 < 3 and k % 8 >= 8 - cfg.emu_pairs


def emulated_columns(cfg: KernelConfig, apply_mask: bool) -> np.ndarray:
    """bool[block_n]: which columns of one 128-column K/V block the kernel of cfg.arch computes
    with exp2_emulated (none in a masked block). sm_100a: emulated_mask's four fragments,
    concatenated; sm_90a: hopper_emulated per column."""
    if cfg.arch == "sm_90a":
        j = np.arange(cfg.block_n)
        return np.array([hopper_emulated(cfg, int(c), int(e)) for c, e in zip(j // 8, j % 2)]) & (not apply_mask)
    return np.concatenate([emulated_mask(cfg, f, apply_mask) for f in range(cfg.block_n // FRAG_COLS)])


# ---- fitting and error scan -------------------------------------------------------------------

def fit_exp2_poly(fix_c0: bool = True, grid_points: int = 200_001, iters: int = 40):
    """Remez exchange for the cubic minimising max |p(f) / 2^f - 1| on [0, 1].

    Returns (coefficients (c0, c1, c2, c3) as float64, levelled error |E|). With ``fix_c0`` the
    polynomial is 1 + c1 f + c2 f^2 + c3 f^3 (3 unknowns, 4 alternation points in (0, 1]); the
    error at f = 0 is then 0 and not a reference point.
    """
    unknown_powers = (1, 2, 3) if fix_c0 else (0, 1, 2, 3)
    npts = len(unknown_powers) + 1
    grid = np.linspace(0.0, 1.0, grid_points)
    # Chebyshev-like start, excluding 0 when c0 is fixed
    k = np.arange(npts)
    pts = 0.5 - 0.5 * np.cos(np.pi * (k + 1) / npts) if fix_c0 else 0.5 - 0.5 * np.cos(np.pi * k / (npts - 1))
    coeffs = None
    level = math.inf
    for _ in range(iters):
        w = np.exp2(pts)
        a = np.column_stack([pts ** p for p in unknown_powers] + [(-1.0) ** k * w])
        rhs = w - 1.0 if fix_c0 else w
        sol = np.linalg.solve(a, rhs)
        coeffs = ((1.0,) if fix_c0 else ()) + tuple(float(c) for c in sol[:-1])
        err = np.polynomial.polynomial.polyval(grid, coeffs) / np.exp2(grid) - 1.0
        # new reference: one extremum per sign run of the error, keep npts alternating ones
        sign = np.sign(err)
        start = 1 if fix_c0 else 0
        runs = np.flatnonzero(np.diff(sign[start:]) != 0) + start + 1
        bounds = np.concatenate([[start], runs, [len(grid)]])
        ext = [lo + int(np.argmax(np.abs(err[lo:hi]))) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        while len(ext) > npts:
            ext.pop(0 if abs(err[ext[0]]) < abs(err[ext[-1]]) else -1)
        level = float(np.max(np.abs(err)))
        if len(ext) < npts:
            break
        new_pts = grid[ext]
        if np.array_equal(new_pts, pts):
            break
        pts = new_pts
    return coeffs, level


@dataclass(frozen=True)
class Exp2ErrorReport:
    """Result of scanning exp2_emulated over [lo, hi] against float64 2^x."""

    lo: float
    hi: float
    points: int
    max_rel_error: float  # over scanned x >= -126 (results are normal fp32 numbers)
    argmax_x: float
    max_abs_error_subnormal: float  # over scanned x in [lo, -126): see the module docstring


def _scan_points(lo: float, hi: float, dense: int, exhaustive_binade: bool) -> np.ndarray:
    parts = []
    if exhaustive_binade and lo <= -2.0 and hi >= -1.0:
        # Every fp32 in [-2, -1] (spacing 2^-23): for x <= -1 with a normal result, the emulation is
        # 2^floor(x) * p(x - floor(x)) with x - floor(x) a multiple of 2^-23, so this binade covers
        # every fraction the kernel can produce from x in [-126, -1] (tests check the periodicity).
        parts.append(-2.0 + np.arange((1 << 23) + 1, dtype=np.float64) * 2.0 ** -23)
    parts.append(np.linspace(lo, hi, dense))
    ints = np.arange(math.ceil(lo), math.floor(hi) + 1, dtype=np.float64)
    i32 = ints.astype(np.float32)
    parts += [ints, np.nextafter(i32, np.float32(-np.inf)).astype(np.float64),
              np.nextafter(i32, np.float32(np.inf)).astype(np.float64)]
    tiny = 2.0 ** -np.arange(1, 150, dtype=np.float64)  # x just below / above 0: f rounds to 1.0 / is tiny
    parts += [-tiny, tiny, np.array([lo, hi, 0.0])]
    x = np.concatenate(parts).astype(np.float32)
    return np.unique(x[(x >= np.float32(lo)) & (x <= np.float32(hi))])


def exp2_error_report(lo: float = EXP2_CLAMP, hi: float = 0.0, *, dense: int = 1 << 22,
                      exhaustive_binade: bool = True) -> Exp2ErrorReport:
    """Scan exp2_emulated over fp32 x in [lo, hi]: every fp32 in [-2, -1] (when inside the range),
    ``dense`` evenly spaced points, every integer and its fp32 neighbours, +-2^-k for k = 1..149
    and the ends; compare with float64 2^x."""
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"need finite lo < hi, got [{lo}, {hi}]")
    if lo < EXP2_CLAMP or hi >= 128.0:
        raise ValueError(f"[{lo}, {hi}] leaves the emulation's domain [-127, 128)")
    x = _scan_points(lo, hi, dense, exhaustive_binade)
    got = exp2_emulated(x).astype(np.float64)
    x64 = x.astype(np.float64)
    true = np.exp2(x64)
    normal = x64 >= -126.0
    rel = np.abs(got[normal] / true[normal] - 1.0)
    i = int(np.argmax(rel)) if rel.size else 0
    sub = np.abs(got[~normal] - true[~normal])
    return Exp2ErrorReport(lo=lo, hi=hi, points=int(x.size),
                           max_rel_error=float(rel[i]) if rel.size else 0.0,
                           argmax_x=float(x64[normal][i]) if rel.size else math.nan,
                           max_abs_error_subnormal=float(sub.max()) if sub.size else 0.0)


def max_relative_error(lo: float = EXP2_CLAMP, hi: float = 0.0, *, dense: int = 1 << 22,
                       exhaustive_binade: bool = True) -> float:
    """Max relative error of exp2_emulated vs float64 2^x over the scan of ``exp2_error_report``.

    Relative error is measured where 2^x is a normal fp32 (x >= -126); in [-127, -126) the result
    is a subnormal pattern with absolute error <= 2^-127 (``exp2_error_report`` reports it).
    """
    return exp2_error_report(lo, hi, dense=dense, exhaustive_binade=exhaustive_binade).max_rel_error
