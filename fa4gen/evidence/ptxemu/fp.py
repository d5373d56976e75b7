"""IEEE-exact f32 arithmetic on NumPy lane vectors, with PTX's rounding modes.

Sums and products to nearest are one IEEE f32 operation each (correctly rounded). fma and the
directed modes .rm/.rp/.rz are computed in float64 with the exact error term (TwoSum); rounding the
pair to f32 in the requested mode is then exact (fma: one rounding). Division and reciprocal in float64 then f32 are exact (53 >= 2*24 + 2).
The .approx functions (ex2, lg2, rcp.approx, tanh) are the correctly rounded values: the hardware's are
within its documented error (2 ulp class), which the emulator does not reproduce bit for bit.
"""
from __future__ import annotations

import contextlib

import numpy as np

F32 = np.float32
F64 = np.float64
_MID_MASK = np.uint64((1 << 29) - 1)
_MID = np.uint64(1 << 28)
_F32_MIN_NORMAL = np.float32(1.1754943508222875e-38)
_U64 = np.uint64
_cnz = np.count_nonzero  # on a bool lane vector: a C call, where .any() costs NumPy's Python wrappers

# ---- floating-point warnings ------------------------------------------------------------------------
# Each helper silences the NumPy warnings its arithmetic may raise (inf - inf, overflow, ...). An
# np.errstate costs 2-3 us, several times per emulated instruction, so an emulation runs inside
# quiet() (Emulator.run): every warning off once, and the helpers skip their own. Called directly
# (tests, the reference), they still set it. The flag is per process, not per thread: another
# thread calling a helper during an emulation may see a RuntimeWarning, never a different value.
_NULL = contextlib.nullcontext()
_quiet = False


@contextlib.contextmanager
def quiet():
    """NumPy floating-point warnings off for the block (an emulation); the helpers skip their own."""
    global _quiet
    prev = _quiet
    with np.errstate(all="ignore"):
        _quiet = True
        try:
            yield
        finally:
            _quiet = prev


def _ignore(**kw):
    return _NULL if _quiet else np.errstate(**kw)


def _no_tie(s) -> bool:
    """Whether no lane of s (float64) lies exactly halfway between two f32 values: there rounding
    s to f32 to nearest is already the correctly rounded value of s + err for any small err, and
    the error term (TwoSum) need not be computed. The common case of add and fma."""
    return _cnz((np.asarray(s, F64).view(_U64) & _MID_MASK) == _MID) == 0


def two_sum(a: np.ndarray, b: np.ndarray):
    with _ignore(over="ignore", invalid="ignore"):
        s = a + b
        bb = s - a
        err = (a - (s - bb)) + (b - bb)
    return s, np.where(np.isfinite(s), err, 0.0)


def round_pair(s: np.ndarray, err, mode: str = "rn") -> np.ndarray:
    """Round the exact value s + err (float64 arrays, |err| <= ulp(s)/2) to f32 in `mode`."""
    if mode == "rz" and err is None:
        f = _trunc_f32(s)
        if f is not None:
            return f
    with _ignore(over="ignore", invalid="ignore"):
        if mode == "rn":
            if err is not None:
                bits = np.asarray(s, F64).view(np.uint64)
                mid = ((bits & _MID_MASK) == _MID) & (err != 0)
                if _cnz(mid):
                    s = np.where(mid, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
            return np.asarray(s, F64).astype(F32)
        f = np.asarray(s, F64).astype(F32)
        f64 = f.astype(F64)
        e = 0.0 if err is None else err
        above = (f64 > s) | ((f64 == s) & (e < 0))  # f is above the exact value
        below = (f64 < s) | ((f64 == s) & (e > 0))
        if mode == "rz":
            down = above & (s > 0) | above & (s == 0) & (e > 0)
            up = below & (s < 0) | below & (s == 0) & (e < 0)
        elif mode == "rm":
            down, up = above, np.zeros_like(above)
        elif mode == "rp":
            down, up = np.zeros_like(below), below
        else:
            raise ValueError(mode)
        if _cnz(down):
            f = np.where(down, np.nextafter(f, F32(-np.inf)), f)
        if _cnz(up):
            f = np.where(up, np.nextafter(f, F32(np.inf)), f)
        return f


_LOW29 = np.uint64(~((1 << 29) - 1) & ((1 << 64) - 1))  # clears the 29 significand bits f32 lacks


def _trunc_f32(s) -> np.ndarray | None:
    """s (float64) rounded toward zero to f32 by dropping the 29 low significand bits, where that is
    the rounding: when every truncated value is an f32 (converts exactly; always so in f32's normal
    range, whose grid is the 24-bit one, and no f32 lies between it and s on the coarser grids below).
    None otherwise (NaN, values it cannot hold): round_pair's general path. The MMA model's final
    rounding, ~20x faster than the general path."""
    s = np.asarray(s, F64)
    t = (s.view(_U64) & _LOW29).view(F64)
    with _ignore(over="ignore"):
        f = t.astype(F32)
    if _cnz(f == t) != t.size or _cnz(s != s):  # a value that did not convert exactly, or a NaN
        return None
    return f


def ftz(x: np.ndarray) -> np.ndarray:
    """Flush f32 subnormals to sign-preserving zero."""
    sub = (np.abs(x) < _F32_MIN_NORMAL) & (x != 0)
    if _cnz(sub):
        return np.where(sub, np.copysign(F32(0), x), x).astype(F32)
    return x


def add(a, b, mode="rn", flush=False):
    a32, b32 = np.asarray(a, F32), np.asarray(b, F32)
    if flush:
        a32, b32 = ftz(a32), ftz(b32)
    if mode == "rn":
        # one IEEE rounding in f32, as mul: the correctly rounded sum. (The float64 route gives the same
        # bits: float64 rounds a sum of two f32 only when their exponents are 29 or more apart, the
        # smaller then below 1/32 of the larger's f32 ulp; the rounded sum lies that close to the
        # larger, an f32, and at least 1/4 ulp from every f32 midpoint: never a tie for the second
        # rounding. Compared bit for bit on 80M operand pairs, NaN payloads included.)
        with _ignore(over="ignore", invalid="ignore"):
            r = a32 + b32
        return ftz(r) if flush else r
    s, e = two_sum(a32.astype(F64), b32.astype(F64))  # exact
    r = round_pair(s, e, mode)
    return ftz(r) if flush else r


def mul(a, b, mode="rn", flush=False):
    a32, b32 = np.asarray(a, F32), np.asarray(b, F32)
    if flush:
        a32, b32 = ftz(a32), ftz(b32)
    if mode == "rn":
        with _ignore(over="ignore", invalid="ignore", under="ignore"):
            r = a32 * b32  # one IEEE rounding in f32
    else:
        r = round_pair(a32.astype(F64) * b32.astype(F64), None, mode)  # the product is exact in f64
    return ftz(r) if flush else r


def fma(a, b, c, mode="rn", flush=False):
    a32, b32, c32 = np.asarray(a, F32), np.asarray(b, F32), np.asarray(c, F32)
    if flush:
        a32, b32, c32 = ftz(a32), ftz(b32), ftz(c32)
    with _ignore(over="ignore", invalid="ignore"):
        p = np.multiply(a32, b32, dtype=F64)  # exact: 48 significant bits (operands widened by the ufunc)
        if mode == "rn":
            s = np.add(p, c32, dtype=F64)  # two_sum's s
            if _no_tie(s):
                r = np.asarray(s, F64).astype(F32)
                return ftz(r) if flush else r
        s, e = two_sum(p, c32.astype(F64))
        r = round_pair(s, e, mode)
    return ftz(r) if flush else r


def div(a, b, mode="rn", flush=False):
    a32, b32 = np.asarray(a, F32), np.asarray(b, F32)
    if flush:
        a32, b32 = ftz(a32), ftz(b32)
    with _ignore(divide="ignore", invalid="ignore", over="ignore"):
        q = a32.astype(F64) / b32.astype(F64)
        if mode == "rn":
            r = q.astype(F32)
        else:
            # the f64 quotient may be inexact: recover the sign of the remainder
            rem = np.where(np.isfinite(q), a32.astype(F64) - q * b32.astype(F64), 0.0)
            err = np.where(b32 < 0, -rem, rem)
            r = round_pair(q, err, mode)
    return ftz(r) if flush else r


def ex2_approx(x, flush=True):
    """2^x rounded to f32; flush (.ftz): subnormal inputs and results are flushed to zero. A flushed
    input changes nothing: 2^x of every subnormal x (either sign) is 1.0, as 2^0 is, so only the result
    is flushed, and only when some x lies in (-151, -126): 2^x is at least 2^-126, the smallest normal,
    from -126 up, and rounds to 0 from -150 down (-inf, a masked score, among them)."""
    x32 = np.asarray(x, F32)
    with _ignore(over="ignore", under="ignore"):
        r = np.exp2(x32.astype(F64)).astype(F32)
    if flush and _cnz((x32 < -126) & (x32 > -151)):
        r = ftz(r)
    return r


def lg2_approx(x, flush=True):
    x32 = ftz(np.asarray(x, F32)) if flush else np.asarray(x, F32)
    with _ignore(divide="ignore", invalid="ignore"):
        r = np.log2(x32.astype(F64)).astype(F32)
    return r


def tanh_approx(x):
    """tanh.approx.f32 (sm_75+): the correctly rounded fp32 tanh of the fp32 input (tanh(+-inf) =
    +-1, NaN stays NaN, subnormals kept). The hardware's MUFU.TANH is within a relative error of
    2^-11 (reference.TANH_APPROX_MAX_REL_ERR, the PTX ISA's bound; measured 1.1e-5): the emulator, like
    reference.tanh_approx_f32, is not bit-exact to it, so a kernel judged here is judged on its
    use of tanh, not on the unit's error (the GPU tests take that bound)."""
    with _ignore(invalid="ignore"):
        return np.tanh(np.asarray(x, F32).astype(F64)).astype(F32)


def rcp(x, approx: bool, flush=False, mode="rn"):
    x32 = ftz(np.asarray(x, F32)) if flush else np.asarray(x, F32)
    r = div(np.ones_like(x32), x32, mode)
    return ftz(r) if flush else r


# ---- 16-bit packing --------------------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray, mode: str = "rn") -> np.ndarray:
    x32 = np.asarray(x, F32)
    bits = x32.view(np.uint32)
    if mode == "rn":
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        r = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    elif mode == "rz":
        r = (bits >> np.uint32(16)).astype(np.uint16)
    else:
        raise ValueError(mode)
    nan = np.isnan(x32)
    if _cnz(nan):
        r = np.where(nan, ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16), r)
    return r.astype(np.uint16, copy=False)


def f32_to_f16_bits(x: np.ndarray, mode: str = "rn") -> np.ndarray:
    if mode != "rn":
        raise ValueError(mode)
    with _ignore(over="ignore"):
        return np.asarray(x, F32).astype(np.float16).view(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint16).astype(np.uint32) << np.uint32(16)).view(F32)


def f16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, np.uint16).view(np.float16).astype(F32)
