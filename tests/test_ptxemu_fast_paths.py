"""The emulator's speed tricks give the bits of the definitions they replace: the float32 form of
mma_accumulate against its float64 definition, the tie-free fast path of add/fma against TwoSum
rounding, quiet() against per-helper np.errstate, distinct_ids against np.unique."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from fa4gen.evidence.ptxemu import fp
from fa4gen.evidence.ptxemu.async_units import _f32_exact, _mma_accumulate_f64, mma_accumulate
from fa4gen.evidence.ptxemu.machine import distinct_ids


def _bf16(x):
    return fp.bf16_bits_to_f32(fp.f32_to_bf16_bits(np.asarray(x, np.float32))).astype(np.float64)


def _f16(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float16).astype(np.float64)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("model", [(16, 2, "rz"), (16, 2, "rn"), (8, 3, "exact"), (4, 0, "rm"), (16, 30, "rz"), None])
def test_mma_accumulate_float32_form_is_the_float64_definition(model):
    rng = np.random.default_rng(7)
    fast = 0
    for trial in range(60):
        M, N = int(rng.choice([64, 128])), int(rng.choice([16, 64, 256]))
        conv = _bf16 if trial % 2 else _f16
        spread = 3.0 if trial % 3 == 0 else 0.0  # operands over many binades: truncation and exponents vary
        A = conv(rng.standard_normal((M, 16)) * 10.0 ** rng.uniform(-6, 2) * np.exp(rng.standard_normal((M, 16)) * spread))
        B = conv(rng.standard_normal((N, 16)) * 10.0 ** rng.uniform(-6, 2))
        if trial % 5 == 0:  # zeros of both signs (masked probabilities, -0 products)
            A[rng.random(A.shape) < 0.3] = 0.0
            B[rng.random(B.shape) < 0.2] = -0.0
        old = None
        if trial % 4:
            old = (rng.standard_normal((M, N)) * 10.0 ** rng.uniform(-10, 6)).astype(np.float32)
            if trial % 7 == 0:
                old[0, 0], old[1, 1], old[2, 2], old[3, 3] = np.nan, np.inf, -0.0, 1e-42
        if trial % 11 == 0:
            A[0, 0] = np.inf  # not finite: the float64 form
        if trial % 6 == 1:  # probabilities near f32's smallest normals: products below its normal range
            A[: M // 2] = conv(np.ldexp(rng.random((M // 2, 16)) + 1, rng.integers(-140, -100, (M // 2, 16))))
            if trial % 12 == 1:
                A[M // 4] = 2.0 ** -126
                B[: N // 2] = conv(np.ldexp(1.0, -30) * rng.standard_normal((N // 2, 16)))
        with np.errstate(all="ignore"):
            got, want = mma_accumulate(A, B, old, model), _mma_accumulate_f64(A, B, old, model)
            if trial % 6 == 0:  # the emulator's call: its operands are 16-bit floats by construction
                assert np.array_equal(_bits(mma_accumulate(A, B, old, model, sixteen_bit=True)), _bits(want))
        assert np.array_equal(_bits(got), _bits(want)), (trial, model)
        fast += model is not None and _f32_exact(A, B, *model[:2])
    if model is not None and model[1] < 20:
        assert fast >= 30  # the float32 form ran on most draws (this test compares something)


def test_mma_float32_form_refuses_what_it_cannot_do_exactly():
    A = _bf16(np.ones((64, 16)))
    B = _bf16(np.ones((16, 16)))
    assert _f32_exact(A, B, 16, 2)
    assert not _f32_exact(A, B, 16, 30)  # group sums past 2^53
    A2 = A.copy()
    A2[0, 0] = np.inf
    assert not _f32_exact(A2, B, 16, 2)
    A3 = A.copy()
    A3[0, 0] = 2.0 ** 100  # a product past f32's range
    B3 = B.copy()
    B3[0, 0] = 2.0 ** 30
    assert not _f32_exact(A3, B3, 16, 2)
    A4 = A.copy()
    A4[0, 0] = 1 + 2.0 ** -20  # more significant bits than a 16-bit float has
    assert not _f32_exact(A4, B, 16, 2)
    assert _f32_exact(A4, B, 16, 2, sixteen_bit=True)  # the caller vouches for the operands: not counted
    assert not _f32_exact(A2, B, 16, 2, sixteen_bit=True) and not _f32_exact(A3, B3, 16, 2, sixteen_bit=True)


def test_mma_products_that_vanish_in_float32_are_still_exact():
    """A row whose every product underflows to zero in f32 (and a zero accumulator) is not zero in the
    definition, which aligns to the largest (tiny) product: the float32 form must notice."""
    A = np.zeros((64, 16))
    A[0, :] = 2.0 ** -110  # products 2^-150: zero in f32, sum 2^-146 (an f32 subnormal) in the definition
    A[1, :3] = -(2.0 ** -120)
    B = np.full((16, 16), 2.0 ** -40)
    for old in (None, np.zeros((64, 16), np.float32)):
        got, want = mma_accumulate(A, B, old, (16, 2, "rz")), _mma_accumulate_f64(A, B, old, (16, 2, "rz"))
        assert want[0, 0] != 0 and np.array_equal(_bits(got), _bits(want))


def _add_ref(a, b, mode):
    a64, b64 = np.asarray(a, np.float32).astype(np.float64), np.asarray(b, np.float32).astype(np.float64)
    s, e = fp.two_sum(a64, b64)
    return fp.round_pair(s, e, mode)


def _fma_ref(a, b, c, mode):
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)
    s, e = fp.two_sum(p, np.asarray(c, np.float32).astype(np.float64))
    return fp.round_pair(s, e, mode)


def _operands(rng, n=4000):
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    c = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    # ties: 1 + 2^-24 is halfway between f32 neighbours of 1; the other term's sign decides it
    t = np.float32(1 + 2.0 ** -12)
    a = np.concatenate([a, [1.0, 1.0, t, t, -t, np.inf, np.nan, 3e38]]).astype(np.float32)
    b = np.concatenate([b, [2.0 ** -24, -(2.0 ** -24), t, t, t, -np.inf, 1.0, 3e38]]).astype(np.float32)
    c = np.concatenate([c, [2.0 ** -60, -(2.0 ** -60), 2.0 ** -60, -(2.0 ** -60), 2.0 ** -60, 1.0, 1.0, -3e38]]
                       ).astype(np.float32)
    return a, b, c


@pytest.mark.parametrize("flush", [False, True])
def test_add_and_fma_fast_path_round_like_two_sum(flush):
    rng = np.random.default_rng(3)
    a, b, c = _operands(rng)
    with np.errstate(all="ignore"):
        for mode in ("rn", "rz", "rm", "rp"):
            want_add = _add_ref(fp.ftz(a) if flush else a, fp.ftz(b) if flush else b, mode)
            want_fma = _fma_ref(*((fp.ftz(x) for x in (a, b, c)) if flush else (a, b, c)), mode)
            if flush:
                want_add, want_fma = fp.ftz(want_add), fp.ftz(want_fma)
            for quiet in (False, True):
                with fp.quiet() if quiet else np.errstate():
                    assert np.array_equal(_bits(fp.add(a, b, mode, flush)), _bits(want_add)), (mode, quiet)
                    assert np.array_equal(_bits(fp.fma(a, b, c, mode, flush)), _bits(want_fma)), (mode, quiet)
    # the constructed ties are decided by the third term (the fast path must not round them blindly)
    got = fp.fma(a[-8:-3], b[-8:-3], c[-8:-3])
    naive = (a[-8:-3].astype(np.float64) * b[-8:-3] + c[-8:-3]).astype(np.float32)
    assert not np.array_equal(got, naive)


def test_ex2_ftz_flushes_the_result_only_where_the_definition_can_differ():
    """ex2.approx.ftz by its definition (flush the input, 2^x rounded to f32, flush the result) against
    fp.ex2_approx, which skips the input flush (2^x of a subnormal x is 1.0, as 2^0 is) and flushes the
    result only when some x < -126: every subnormal magnitude step, both signs, the -126 and -150 edges."""
    tiny = (np.arange(1, 1 << 23, 997, dtype=np.uint32) | np.uint32(1)).view(np.float32)
    edges = np.array([0.0, -0.0, -126.0, -126.5, -149.0, -149.5, -150.0, -151.0, -np.inf, np.inf, np.nan, 1.5,
                      np.nextafter(np.float32(-126), np.float32(0)), np.nextafter(np.float32(-126), np.float32(-1e9))],
                     np.float32)
    low = np.linspace(-151, -125, 2001, dtype=np.float32)  # results below f32's normal range
    x = np.concatenate([tiny, -tiny, edges, low, np.linspace(-125, 10, 2001, dtype=np.float32)])
    with np.errstate(all="ignore"):
        want = fp.ftz(np.exp2(fp.ftz(x).astype(np.float64)).astype(np.float32))
        assert np.array_equal(_bits(fp.ex2_approx(x, True)), _bits(want))
        assert np.array_equal(_bits(fp.ex2_approx(low, True)), _bits(fp.ftz(np.exp2(low.astype(np.float64)).astype(np.float32))))
        assert np.array_equal(_bits(fp.ex2_approx(x, False)), _bits(np.exp2(x.astype(np.float64)).astype(np.float32)))
        assert np.count_nonzero(fp.ex2_approx(low, False) != fp.ex2_approx(low, True)) > 1000  # the flush acts there


def test_round_toward_zero_by_truncation_is_the_general_rounding(monkeypatch):
    """round_pair(s, None, "rz") truncates the float64 significand where the result is an f32 (the
    MMA model's final rounding); against the general path on every range: f32 normals, subnormals,
    below the smallest subnormal, past FLT_MAX, zeros, infinities, NaN."""
    rng = np.random.default_rng(11)
    edge = [0.0, -0.0, np.inf, -np.inf, 2.0 ** -126, 2.0 ** -149, 2.0 ** -150, 3.4028234663852886e38, 2.0 ** 128]
    arrays = [rng.standard_normal(20000) * 10.0 ** rng.uniform(-46, 39, 20000), rng.standard_normal(500) * 1e3,
              np.array(edge + [-x for x in edge]), np.array([1.5, np.nan]), np.array([np.inf, 5e-324, -5e-324])]  # the last: +-0
    fast = [fp.round_pair(x, None, "rz") for x in arrays]
    assert [fp._trunc_f32(x) is not None for x in arrays] == [False, True, False, False, True]
    monkeypatch.setattr(fp, "_trunc_f32", lambda s: None)
    for x, got in zip(arrays, fast):
        with np.errstate(all="ignore"):
            assert np.array_equal(_bits(got), _bits(fp.round_pair(x, None, "rz")))
    x = arrays[0]
    ok = np.abs(x) >= 2.0 ** -126  # the f32 normals (and past FLT_MAX: those take the general path)
    ok &= np.abs(x) < 2.0 ** 128
    got = fp.round_pair(x[ok], None, "rz")
    assert np.array_equal(_bits(got), _bits(fast[0][ok])) and np.count_nonzero(x[ok] != got) > 10000


def test_add_to_nearest_in_f32_is_the_two_sum_rounding():
    """fp.add to nearest is one f32 addition: the same bits as TwoSum rounding, also where float64
    rounds the sum (exponents 29 or more apart), at f32 ties, near cancellation, on any bit pattern."""
    rng = np.random.default_rng(13)
    n = 60000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-120, 120, n)).astype(np.float32)
    gap = rng.integers(20, 60, n).astype(np.float64)
    b = (a * 2.0 ** -gap * rng.choice([-1.0, 1.0], n) * (1 + rng.integers(0, 1 << 23, n) * 2.0 ** -23)).astype(np.float32)
    near = (-a.astype(np.float64) * (1 + rng.integers(-8, 8, n) * 2.0 ** -23)).astype(np.float32)
    bits = rng.integers(0, 1 << 32, (2, n), dtype=np.uint64).astype(np.uint32).view(np.float32)
    t = np.float32(1 + 2.0 ** -23)
    ties = (np.array([1.0, 1.0, t, -t], np.float32), np.array([2.0 ** -24, -(2.0 ** -24), 2.0 ** -24, -(2.0 ** -24)], np.float32))
    with np.errstate(all="ignore"):
        assert np.count_nonzero(fp.two_sum(a.astype(np.float64), b.astype(np.float64))[1]) > n // 2  # inexact in f64
        for x, y in ((a, b), (b, a), (a, near), bits, ties):
            for flush in (False, True):
                want = _add_ref(fp.ftz(x) if flush else x, fp.ftz(y) if flush else y, "rn")
                assert np.array_equal(_bits(fp.add(x, y, "rn", flush)), _bits(fp.ftz(want) if flush else want))


def test_helpers_silence_their_own_warnings_outside_an_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inf = np.array([np.inf], np.float32)
        assert np.isnan(fp.add(inf, -inf)[0]) and np.isnan(fp.fma(inf, np.zeros(1, np.float32), inf)[0])
        assert fp.div(np.ones(1, np.float32), np.zeros(1, np.float32), "rz")[0] == np.inf
        with fp.quiet():
            assert np.isnan(fp.add(inf, -inf)[0])
            assert fp._quiet
        assert not fp._quiet


def test_distinct_ids_is_np_unique():
    rng = np.random.default_rng(5)
    for shape, hi in [((128, 64), 3), ((32, 4), 5000), ((7,), 1), ((0,), 4), ((128, 256), 200_000)]:
        ids = rng.integers(0, hi, shape).astype(np.int32)
        assert distinct_ids(ids) == [int(g) for g in np.unique(ids)]
    assert distinct_ids(np.full((16, 16), 9, np.int32)) == [9]
