"""The cubic exp2 emulation: exact fp32 FMA, bit-level behaviour, accuracy, and the element split."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fa4gen.spec.config import KernelConfig
from fa4gen.spec.exp2 import (EXP2_POLY, EXP2_POLY_MAX_REL_ERROR, emulated_columns, emulated_mask,
                              exp2_emulated, exp2_error_report, exp2_hardware, fit_exp2_poly, fma_f32,
                              max_relative_error)
from fa4gen.evidence.reference import round_to_dtype

f32 = np.float32
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


# ---- exact rational rounding: the independent oracle ----------------------------------------------

FP32 = (24, -126)  # (significand bits incl. the hidden one, minimum normal exponent)


def round_nearest_even(value: Fraction, fmt: tuple[int, int]) -> Fraction:
    """Round an exact rational to a binary format (no overflow handling), ties to even."""
    precision, emin = fmt
    if value == 0:
        return Fraction(0)
    sign = -1 if value < 0 else 1
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, emin)  # subnormals share the minimum exponent's quantum
    quantum = Fraction(2) ** (e - precision + 1)
    q = a / quantum
    n = math.floor(q)
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return sign * n * quantum


def _fma_oracle(a, b, c) -> Fraction:
    return round_nearest_even(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)), FP32)


# ---- fma_f32 --------------------------------------------------------------------------------------

def test_fma_double_rounding_case_is_handled():
    # (1 + 2^-12)^2 + 2^-80 = 1 + 2^-11 + 2^-24 + 2^-80: just above an fp32 midpoint.
    a = f32(1 + 2.0 ** -12)
    c = f32(2.0 ** -80)
    naive = f32(float(a) * float(a) + float(c))  # float64 drops 2^-80, then the tie goes to even
    got = fma_f32(a, a, c)
    want = _fma_oracle(a, a, c)
    assert Fraction(float(got)) == want == 1 + Fraction(2) ** -11 + Fraction(2) ** -23
    assert Fraction(float(naive)) != want
    # and the mirror case rounds down
    assert Fraction(float(fma_f32(a, a, -c))) == _fma_oracle(a, a, -c) == 1 + Fraction(2) ** -11


@settings(max_examples=300, deadline=None)
@given(finite32, finite32, finite32)
def test_fma_f32_matches_exact_rounding(a, b, c):
    want = Fraction(a) * Fraction(b) + Fraction(c)
    if abs(want) >= Fraction(2) ** 127:  # stay clear of overflow
        return
    got = fma_f32(f32(a), f32(b), f32(c))
    assert Fraction(float(got)) == round_nearest_even(want, FP32)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2 ** 11), st.integers(25, 140), st.sampled_from([-1, 1]))
def test_fma_f32_near_midpoints(k, m, sign):
    # a*b lands on or near an fp32 midpoint, c is far below float64's reach: the hard cases
    a = f32(1 + k * 2.0 ** -12)
    c = f32(sign * 2.0 ** -m)
    assert Fraction(float(fma_f32(a, a, c))) == _fma_oracle(a, a, c)


def test_fma_f32_propagates_infinities():
    out = fma_f32(np.array([-np.inf, 1.0], f32), f32(2.0), np.array([-3.0, np.inf], f32))
    assert out[0] == -np.inf and out[1] == np.inf


# ---- the polynomial ---------------------------------------------------------------------------------

def test_fit_reproduces_constants():
    coeffs, level = fit_exp2_poly(fix_c0=True)
    assert EXP2_POLY[0] == 1.0
    for got, want in zip(coeffs, EXP2_POLY):
        assert abs(f32(got) - f32(want)) <= np.spacing(f32(want))
        assert f32(want) == want  # stored as fp32 values
    assert 8.4e-5 < level < 8.7e-5
    free, free_level = fit_exp2_poly(fix_c0=False)
    # the justification for fixing c0: freeing it gains little
    assert 0.8 * level < free_level < level
    assert free[0] != 1.0


def test_fitted_error_equioscillates():
    coeffs, level = fit_exp2_poly(fix_c0=True)
    f = np.linspace(0, 1, 100_001)
    err = np.polynomial.polynomial.polyval(f, coeffs) / np.exp2(f) - 1
    assert abs(np.abs(err).max() - level) < 1e-9
    # 4 alternating extremes of equal size: count sign changes among near-extreme points
    near = err[np.abs(err) > 0.999 * level]
    assert np.count_nonzero(np.diff(np.sign(near))) == 3


# ---- exp2_emulated: exact behaviour --------------------------------------------------------------

def test_special_inputs_give_exact_zero():
    x = np.array([-np.inf, np.nan, -127.0, -127.5, -200.0, -3.0e38], f32)
    y = exp2_emulated(x)
    assert y.dtype == np.float32
    assert np.all(y.view(np.uint32) == 0)  # +0.0 exactly, not -0 or a subnormal


def test_integers_are_exact():
    n = np.arange(-126, 128).astype(f32)
    assert np.array_equal(exp2_emulated(n), np.exp2(n.astype(np.float64)).astype(f32))
    assert exp2_emulated(f32(0.0))[()] == 1.0 and exp2_emulated(f32(-0.0))[()] == 1.0


def test_subnormal_band_is_small_and_documented():
    x = np.linspace(-127, -126, 4097, dtype=np.float64).astype(f32)
    y = exp2_emulated(x).astype(np.float64)
    assert np.max(np.abs(y - np.exp2(x.astype(np.float64)))) <= 2.0 ** -127
    assert np.all(round_to_dtype(exp2_emulated(x), "fp16") == 0)
    # bf16 keeps fp32's exponent range: x = -126.5 is a (wrong but tiny) bf16 subnormal, not zero
    v = round_to_dtype(exp2_emulated(np.array([-126.5], f32)), "bf16")[0]
    assert 0 < v < 2.0 ** -126


def _emulation_oracle(x: float) -> Fraction:
    """The documented op sequence in exact arithmetic, scaling by 2^n instead of the bit trick."""
    xc = max(Fraction(x), Fraction(-127))
    n = math.floor(xc)
    frac = round_nearest_even(xc - n, FP32)
    c0, c1, c2, c3 = (Fraction(c) for c in EXP2_POLY)
    p = round_nearest_even(c3 * frac + c2, FP32)
    p = round_nearest_even(p * frac + c1, FP32)
    p = round_nearest_even(p * frac + c0, FP32)
    return p * Fraction(2) ** n


@settings(max_examples=300, deadline=None)
@given(st.floats(-126.0, 127.5, width=32))
def test_bit_trick_equals_exact_sequence(x):
    assert Fraction(float(exp2_emulated(f32(x)))) == _emulation_oracle(x)


@settings(max_examples=200, deadline=None)
@given(st.floats(-126.0, -1.0, width=32))
def test_fraction_periodicity(x):
    # exp2_error_report's exhaustive [-2, -1] binade stands for all of [-126, -1] because of this
    n = math.floor(x)
    f = f32(x) - f32(n)
    assert exp2_emulated(f32(x))[()] == f32(exp2_emulated(f - f32(2))[()] * f32(2.0 ** (n + 2)))


def test_input_must_be_float32():
    with pytest.raises(TypeError, match="float32"):
        exp2_emulated(np.zeros(3))
    with pytest.raises(TypeError, match="float32"):
        exp2_hardware(np.zeros(3, np.float16))


def test_shape_preserved():
    x = np.full((3, 4), -1.5, f32)
    assert exp2_emulated(x).shape == (3, 4)
    assert exp2_emulated(f32(-1.5)).shape == ()


# ---- accuracy -------------------------------------------------------------------------------------

def test_max_relative_error_matches_bound():
    rep = exp2_error_report(-127.0, 0.0, dense=1 << 18, exhaustive_binade=True)
    assert rep.max_rel_error <= EXP2_POLY_MAX_REL_ERROR
    assert rep.max_rel_error >= 0.98 * EXP2_POLY_MAX_REL_ERROR  # the bound is tight, not decorative
    assert rep.max_abs_error_subnormal <= 2.0 ** -127
    # well inside P's rounding: fp16 unit roundoff 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3
    assert rep.max_rel_error < 2.0 ** -11 / 5


def test_positive_side_used_when_reference_is_kept():
    # with the old reference kept, exponents reach +rescale_threshold (8)
    assert max_relative_error(0.0, 8.0, dense=1 << 16, exhaustive_binade=False) <= EXP2_POLY_MAX_REL_ERROR


def test_error_report_rejects_bad_ranges():
    with pytest.raises(ValueError, match="domain"):
        exp2_error_report(-130.0, 0.0)
    with pytest.raises(ValueError, match="lo < hi"):
        exp2_error_report(0.0, -1.0)


# ---- the element split ----------------------------------------------------------------------------

def _seed_rule(emu_pairs, emu_start, frag_idx, apply_mask):
    """The seed's pair loop, transcribed: returns the emulated element indices of the fragment."""
    out = set()
    for i in range(32 // 2):
        hardware = (i * 2 % 16 < 16 - 2 * emu_pairs or frag_idx >= 3
                    or frag_idx < emu_start or apply_mask)
        if not hardware:
            out |= {2 * i, 2 * i + 1}
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("emu_pairs", range(9))
@pytest.mark.parametrize("emu_start", range(4))
def test_mask_matches_seed_rule(causal, emu_pairs, emu_start):
    cfg = KernelConfig(causal=causal, emu_pairs=emu_pairs, emu_start=emu_start)
    for frag in range(4):
        for apply_mask in (False, True):
            m = emulated_mask(cfg, frag, apply_mask)
            assert m.shape == (32,) and m.dtype == bool
            assert set(np.flatnonzero(m)) == _seed_rule(emu_pairs, emu_start, frag, apply_mask)


def test_default_split_fractions():
    nc, c = KernelConfig(causal=False), KernelConfig(causal=True)
    assert list(np.flatnonzero(emulated_mask(nc, 1, False))) == [12, 13, 14, 15, 28, 29, 30, 31]
    assert not emulated_mask(nc, 0, False).any() and not emulated_mask(nc, 3, False).any()
    assert emulated_mask(c, 0, False).any()
    assert emulated_columns(nc, False).mean() == 0.125
    assert emulated_columns(c, False).mean() == 0.1875
    assert not emulated_columns(c, True).any()


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_mask_rejects_bad_fragment(bad):
    with pytest.raises(ValueError, match="frag_idx"):
        emulated_mask(KernelConfig(), bad, False)
