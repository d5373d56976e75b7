"""The FA4 NumPy reference: the seed's worked exercise, the per-row step, dtype rounding, and
fa4_forward against exact float64 attention with error bounds derived from the roundings."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fa4gen.spec.config import KernelConfig
from fa4gen.spec.exp2 import EXP2_POLY_MAX_REL_ERROR, emulated_columns
from fa4gen.evidence.reference import (LN2, RowState, attention_exact, block_needs_mask, block_update, col_limits,
                                       fa4_forward, n_block_max, online_softmax_step, round_to_dtype,
                                       scale_log2_f32)

f32 = np.float32
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


# ---- a worked step by hand: two keys, threshold 8, the reference kept and then rescaled ----------

@pytest.mark.parametrize("emulated", [None, [True, True]])
def test_exercise_1_keep(emulated):
    # the emulation is exact on integer exponents (C0 = 1), so both exp paths give the same numbers
    r = online_softmax_step(2.0, 3.0, [4.0, 6.0], [5.0, 4.0], np.eye(2), 1.0, 8.0, emulated=emulated)
    assert r.ref == 2.0 and r.acc_scale == 1.0 and not r.rescaled
    assert r.p.tolist() == [8.0, 4.0]
    assert r.row_sum == 15.0
    assert r.o.tolist() == [12.0, 10.0]


@pytest.mark.parametrize("emulated", [None, [True, True]])
def test_exercise_1_rescale(emulated):
    r = online_softmax_step(2.0, 3.0, [4.0, 6.0], [11.0, 10.0], np.eye(2), 1.0, 8.0, emulated=emulated)
    assert r.ref == 11.0 and r.rescaled
    assert r.acc_scale == 2.0 ** -9
    assert r.p.tolist() == [1.0, 0.5]
    assert Fraction(float(r.row_sum)) == Fraction(3, 512) + Fraction(3, 2)
    assert [Fraction(float(x)) for x in r.o] == [Fraction(4, 512) + 1, Fraction(6, 512) + Fraction(1, 2)]


def test_exercise_1_vectorised_agrees():
    state = RowState(np.array([2.0, 2.0], f32), np.array([3.0, 3.0], f32), np.array([[4.0, 6.0]] * 2, f32))
    s = np.array([[5.0, 4.0], [11.0, 10.0]], f32)
    u = block_update(state, s, np.eye(2), 1.0, 8.0, first=False)
    assert u.state.ref.tolist() == [2.0, 11.0]
    assert u.rescaled.tolist() == [False, True]
    assert u.state.row_sum.tolist() == [15.0, float(f32(3 / 512 + 1.5))]
    assert u.state.o.tolist() == [[12.0, 10.0], [float(f32(4 / 512 + 1)), float(f32(6 / 512 + 0.5))]]


def test_threshold_is_inclusive():
    # delta == -threshold keeps the reference (the seed tests delta >= -threshold)
    r = online_softmax_step(2.0, 3.0, [4.0, 6.0], [10.0, 4.0], np.eye(2), 1.0, 8.0)
    assert not r.rescaled and r.ref == 2.0 and r.p[0] == 256.0


def test_fully_masked_rows_stay_zero_then_recover():
    inf = -np.inf
    r = online_softmax_step(inf, 0.0, [0.0, 0.0], [inf, inf], np.eye(2), 1.0, 8.0, first=True)
    assert r.ref == -np.inf and r.row_sum == 0 and not np.isnan(r.o).any() and r.p.tolist() == [0, 0]
    r2 = online_softmax_step(r.ref, r.row_sum, r.o, [1.0, inf], np.eye(2), 1.0, 8.0)
    assert r2.ref == 1.0 and r2.acc_scale == 0.0 and r2.row_sum == 1.0 and r2.o.tolist() == [1.0, 0.0]
    # a masked block after valid keys changes nothing
    r3 = online_softmax_step(r2.ref, r2.row_sum, r2.o, [inf, inf], np.eye(2), 1.0, 8.0)
    assert (r3.ref, r3.row_sum, r3.acc_scale, r3.rescaled) == (1.0, 1.0, 1.0, False)


# ---- the vectorised update equals the per-row step --------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), first=st.booleans(), amp=st.sampled_from([1.0, 8.0, 60.0]),
       threshold=st.sampled_from([0.0, 8.0]), p_dtype=st.sampled_from([None, "fp16", "bf16"]))
def test_block_update_equals_row_steps(seed, first, amp, threshold, p_dtype):
    rng = np.random.default_rng(seed)
    rows, n, d = 6, 128, 8
    ref = (rng.standard_normal(rows) * amp).astype(f32)
    ref[0] = -np.inf  # nothing valid so far
    row_sum = np.where(np.isinf(ref), 0, rng.uniform(1, 50, rows)).astype(f32)
    o = (rng.standard_normal((rows, d)) * row_sum[:, None]).astype(f32)
    s = (rng.standard_normal((rows, n)) * amp).astype(f32)
    s[rng.random((rows, n)) < 0.2] = -np.inf
    s[1] = -np.inf  # a fully masked row
    v = rng.standard_normal((n, d))
    emulated = emulated_columns(KernelConfig(causal=bool(seed & 1)), apply_mask=False)
    sl2 = scale_log2_f32(1 / math.sqrt(d))
    u = block_update(RowState(ref, row_sum, o), s, v, sl2, threshold, first=first,
                     emulated=emulated, p_dtype=p_dtype)
    for i in range(rows):
        r = online_softmax_step(ref[i], row_sum[i], o[i], s[i], v, sl2, threshold, first=first,
                                emulated=emulated, p_dtype=p_dtype)
        # decisions and P are bit-identical; the float64 sums may differ in the last fp32 ulp
        assert np.array_equal(u.state.ref[i], r.ref) and u.acc_scale[i] == r.acc_scale
        assert u.rescaled[i] == r.rescaled
        assert np.array_equal(u.p[i], r.p)
        np.testing.assert_allclose(u.state.row_sum[i], r.row_sum, rtol=2.0 ** -22, atol=0)
        np.testing.assert_allclose(u.state.o[i], r.o, rtol=2.0 ** -22, atol=1e-30)


# ---- round_to_dtype ---------------------------------------------------------------------------------

def _rne(value: Fraction, precision: int, emin: int) -> Fraction:
    if value == 0:
        return Fraction(0)
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - precision + 1)
    n = math.floor(a / quantum)
    rem = a / quantum - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2):
        n += 1
    return (1 if value > 0 else -1) * n * quantum


@settings(max_examples=300, deadline=None)
@given(st.floats(-1e38, 1e38, allow_nan=False), st.sampled_from(["fp16", "bf16"]))
def test_round_to_dtype_is_one_rne_rounding(x, dtype):
    precision, emin, top = (11, -14, 65504.0) if dtype == "fp16" else (8, -126, 3.3e38)
    got = float(round_to_dtype(np.array([x]), dtype)[0])
    if abs(x) > top:
        return
    assert Fraction(got) == _rne(Fraction(x), precision, emin)
    got32 = float(round_to_dtype(np.array([x], f32), dtype)[0])
    assert Fraction(got32) == _rne(Fraction(float(f32(x))), precision, emin)


def test_bf16_double_rounding_avoided():
    # 1 + 2^-8 + 2^-40: above a bf16 midpoint; through fp32 (RNE) it would become the tie 1 + 2^-8
    x = 1 + 2.0 ** -8 + 2.0 ** -40
    assert round_to_dtype(np.array([x]), "bf16")[0] == 1 + 2.0 ** -7
    assert round_to_dtype(np.array([x], f32), "bf16")[0] == 1.0  # fp32 input is already the tie


def test_round_to_dtype_specials():
    x = np.array([np.inf, -np.inf, np.nan, 3.4e38, 70000.0], f32)
    b = round_to_dtype(x, "bf16")
    assert b.dtype == np.float32 and b[0] == np.inf and b[1] == -np.inf and np.isnan(b[2]) and b[3] == np.inf
    assert np.all(b.view(np.uint32) & 0xFFFF == 0)
    h = round_to_dtype(x, "fp16")
    assert h.dtype == np.float16 and h[4] == np.inf
    with pytest.raises(ValueError, match="dtype"):
        round_to_dtype(x, "fp32")


# ---- geometry ---------------------------------------------------------------------------------------

def test_seed_exercise_7_limits():
    # Sq = 6, Skv = 8, bottom-right: query 0 sees keys <= 2, query 5 sees keys <= 7
    cfg = KernelConfig(causal=True)
    assert col_limits(cfg, np.array([0, 5]), 6, 8).tolist() == [3, 8]
    assert col_limits(KernelConfig(), np.array([0, 5]), 6, 8).tolist() == [8, 8]


def test_causal_block_geometry():
    # the exercise scaled to 128-key blocks: Sq = 192, Skv = 256, query i sees keys <= i + 64
    cfg = KernelConfig(causal=True)
    sq, skv = 192, 256
    assert [n_block_max(cfg, m, sq, skv) for m in (0, 1)] == [2, 2]
    # tile 0 (queries 0..127): row 0 sees keys <= 64, so both blocks cross its diagonal
    assert block_needs_mask(cfg, 0, 0, sq, skv) and block_needs_mask(cfg, 0, 1, sq, skv)
    # tile 1 (queries 128..191): block 0 fully visible, block 1 crosses
    assert not block_needs_mask(cfg, 1, 0, sq, skv) and block_needs_mask(cfg, 1, 1, sq, skv)
    # Sq > Skv: queries 0..282 of 300 see no key among 17: tiles 0 and 1 visit nothing
    assert [n_block_max(cfg, m, 300, 17) for m in range(3)] == [0, 0, 1]
    # GQA packing: 16 heads per tile leave 8 sequence positions per tile
    assert n_block_max(KernelConfig(causal=True, gqa_ratio=16), 0, 300, 300) == 1
    assert n_block_max(KernelConfig(causal=True, gqa_ratio=16), 36, 300, 300) == 3
    # non-causal: only the Skv tail is masked
    nc = KernelConfig()
    assert n_block_max(nc, 0, 5, 300) == 3
    assert block_needs_mask(nc, 0, 2, 5, 300) and not block_needs_mask(nc, 0, 1, 5, 300)


# ---- fa4_forward vs exact ---------------------------------------------------------------------------

def _inputs(rng, b, sq, skv, hkv, g, d, dtype, amp=1.0):
    q = round_to_dtype(rng.standard_normal((b, sq, hkv * g, d)) * amp, dtype)
    k = round_to_dtype(rng.standard_normal((b, skv, hkv, d)) * amp, dtype)
    v = round_to_dtype(rng.standard_normal((b, skv, hkv, d)), dtype)
    return q, k, v


def _check_against_exact(q, k, v, cfg, softmax_scale=None, stats=None):
    """fa4_forward vs attention_exact on the same (already rounded) inputs, with a bound built from
    the algorithm's roundings. Per output element, with A = sum_j p_j |v_j| / sum_j p_j (exact
    attention applied to |v|):
      - P cast to cfg.dtype: relative u_P per weight in the numerator only (row_sum uses fp32 P);
      - exp2: emulation <= EXP2_POLY_MAX_REL_ERROR, hardware model ~1 ulp, in numerator and
        denominator;
      - exponent input x: S rounded to fp32, scale_log2 rounded, one FMA: <= smax * 2^-22 + 2^-21
        absolute (smax = max |S * scale_log2|), i.e. ln 2 times that relative in p;
      - fp32 rescale/accumulate roundings: ~2 * 2^-24 per block;
      - fp16 P below 2^-14 is subnormal: absolute 2^-25 per key (row_sum >= ~1);
      - the output cast: u_out * |O|.
    LSE = ln(row_sum) + ref * scale: denominator errors, the reference's fp32 product (common to the
    row, ln2 * |ref * scale_log2| * 2^-23) and its own fp32 rounding."""
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    o, lse = fa4_forward(q, k, v, cfg, softmax_scale=softmax_scale, stats=stats)
    assert o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert o.dtype == (np.float16 if cfg.dtype == "fp16" else np.float32) and lse.dtype == np.float32
    o_ex, lse_ex = attention_exact(q, k, v, cfg.causal, softmax_scale)
    a_abs, _ = attention_exact(q, k, np.abs(v.astype(np.float64)), cfg.causal, softmax_scale)
    g = cfg.gqa_ratio
    qg = q.astype(np.float64).reshape(q.shape[0], q.shape[1], k.shape[2], g, d)
    smax = float(np.abs(np.einsum("bihgd,bjhd->bhgij", qg, k.astype(np.float64))).max(initial=0)) * scale / LN2
    u = UNIT_ROUNDOFF[cfg.dtype]
    nblk = -(-k.shape[1] // 128)
    e_exp = EXP2_POLY_MAX_REL_ERROR + 2.0 ** -22
    e_x = LN2 * (smax * 2.0 ** -22 + 2.0 ** -21)
    e_den = e_exp + e_x + (nblk + 4) * 2.0 ** -22
    e_w = 1.01 * (u + e_exp + e_x + e_den)
    sub = k.shape[1] * 2.0 ** -25 * float(np.abs(v.astype(np.float64)).max(initial=0)) if cfg.dtype == "fp16" else 0
    tol_o = e_w * a_abs + u * (np.abs(o_ex) + e_w * a_abs) + sub + 1e-30
    err_o = np.abs(o.astype(np.float64) - o_ex)
    worst = np.unravel_index(np.argmax(err_o - tol_o), err_o.shape)
    assert np.all(err_o <= tol_o), f"O error {err_o[worst]:.3g} > bound {tol_o[worst]:.3g} at {worst}"
    empty = np.isinf(lse_ex)
    assert np.array_equal(np.isinf(lse), empty) and np.all(lse[empty] == -np.inf)
    tol_lse = 1.01 * (e_den + LN2 * (smax + 9) * 2.0 ** -23) + 2.0 ** -23 * np.abs(lse_ex[~empty])
    assert np.all(np.abs(lse[~empty] - lse_ex[~empty]) <= tol_lse)
    return o, lse, o_ex


LENGTHS = [1, 17, 127, 128, 129, 300]


@settings(max_examples=25, deadline=None)
@given(sq=st.sampled_from(LENGTHS), skv=st.sampled_from(LENGTHS), g=st.sampled_from([1, 2, 4, 8, 16]),
       d=st.sampled_from([64, 128]), dtype=st.sampled_from(["fp16", "bf16"]), causal=st.booleans(),
       amp=st.sampled_from([1.0, 30.0]), hkv=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 32 - 1))
def test_fa4_forward_matches_exact(sq, skv, g, d, dtype, causal, amp, hkv, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, sq, skv, hkv, g, d, dtype, amp)
    cfg = KernelConfig(head_dim=d, causal=causal, gqa_ratio=g, dtype=dtype)
    _check_against_exact(q, k, v, cfg)


@pytest.mark.parametrize("g", [1, 2, 4, 8, 16])
def test_gqa_ratios_batch_and_heads(g):
    rng = np.random.default_rng(g)
    q, k, v = _inputs(rng, 2, 129, 300, 2, g, 64, "bf16")
    _check_against_exact(q, k, v, KernelConfig(head_dim=64, gqa_ratio=g, causal=True))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("g", [1, 4])
def test_causal_rows_without_keys(dtype, g):
    rng = np.random.default_rng(7)
    sq, skv = 300, 129
    q, k, v = _inputs(rng, 1, sq, skv, 1, g, 128, dtype)
    stats = {}
    o, lse, _ = _check_against_exact(q, k, v, KernelConfig(causal=True, gqa_ratio=g, dtype=dtype), stats=stats)
    assert np.all(o[:, : sq - skv] == 0) and np.all(lse[:, :, : sq - skv] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, sq - skv:])) and np.any(o[:, sq - skv:] != 0)
    assert stats["tiles_without_blocks"] >= 1  # whole tiles above the diagonal are never computed


def test_large_inputs_rescale_and_still_match():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 300, 300, 1, 1, 128, "bf16", amp=30.0)
    stats = {}
    _check_against_exact(q, k, v, KernelConfig(), stats=stats)
    assert stats["rescaled"] > 0 and stats["warp_rescales"] > 0
    assert stats["rescaled"] + stats["rescale_skipped"] == stats["later_row_block_updates"]


def test_threshold_zero_rescales_more_and_both_match():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 256, 512, 1, 1, 64, "fp16", amp=3.0)
    counts = {}
    for thr in (0.0, 8.0):
        stats = {}
        _check_against_exact(q, k, v, KernelConfig(head_dim=64, dtype="fp16", rescale_threshold=thr),
                             stats=stats)
        counts[thr] = stats["rescaled"]
    assert counts[0.0] > counts[8.0]


def test_custom_softmax_scale():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, 200, 200, 1, 2, 64, "bf16")
    _check_against_exact(q, k, v, KernelConfig(head_dim=64, gqa_ratio=2), softmax_scale=0.5)


@pytest.mark.parametrize("causal", [False, True])
def test_exp2_split_counts(causal):
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, 1, 512, 512, 1, 1, 64, "bf16")
    cfg = KernelConfig(head_dim=64, causal=causal)
    stats = {}
    fa4_forward(q, k, v, cfg, stats=stats)
    total = stats["exp2_emulated"] + stats["exp2_hardware"]
    assert total == stats["row_block_updates"] * 128
    unmasked = stats["blocks"] - stats["masked_blocks"]
    assert stats["exp2_emulated"] == unmasked * 128 * int(emulated_columns(cfg, False).sum())
    # 4 Q tiles x 4 K/V blocks; causal: 10 blocks visited, the 4 diagonal ones masked
    assert (stats["blocks"], stats["masked_blocks"]) == ((10, 4) if causal else (16, 0))


def test_large_scores_in_the_last_visited_block_force_rescales():
    # blocks are visited n_block_max - 1 down to 0: block 0's 8x larger scores arrive last
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 1, 128, 512, 1, 1, 64, "bf16")
    k[:, :128] *= 8  # exact in bf16
    stats = {}
    _check_against_exact(q, k, v, KernelConfig(head_dim=64), stats=stats)
    assert stats["rescaled"] > 0


# ---- input validation ---------------------------------------------------------------------------------

def test_input_errors():
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 1, 8, 8, 1, 2, 64, "bf16")
    cfg = KernelConfig(head_dim=64, gqa_ratio=2)
    with pytest.raises(TypeError, match="bf16"):
        fa4_forward(q.astype(np.float16), k, v, cfg)
    with pytest.raises(ValueError, match="bf16-representable"):
        fa4_forward(q + f32(1e-3), k, v, cfg)
    with pytest.raises(ValueError, match="head_dim"):
        fa4_forward(q, k, v, KernelConfig(head_dim=128, gqa_ratio=2))
    with pytest.raises(ValueError, match="gqa_ratio"):
        fa4_forward(q, k, v, KernelConfig(head_dim=64, gqa_ratio=4))
    with pytest.raises(ValueError, match="k and v"):
        fa4_forward(q, k, v[:, :4], cfg)
    with pytest.raises(ValueError, match="4-D"):
        fa4_forward(q[0], k, v, cfg)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa4_forward(q, k, v, cfg, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="fp16"):
        fa4_forward(q, k, v, KernelConfig(head_dim=64, gqa_ratio=2, dtype="fp16"))


# ---- any integer GQA ratio (tiles.gqa_pack: P = G when G divides 128, else one head per tile) ----
ANY_RATIOS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", ANY_RATIOS)
def test_any_gqa_ratio_matches_exact(g, d, causal):
    """Sq != Skv both ways with tails on both lengths, two kv heads (so the kv head of each query
    head, h // G, is exercised), both packings."""
    rng = np.random.default_rng(1000 * g + d + causal)
    sq, skv = (150, 97) if g % 2 else (129, 300)
    hkv = 2 if g <= 16 else 1
    q, k, v = _inputs(rng, 1, sq, skv, hkv, g, d, "bf16")
    _check_against_exact(q, k, v, KernelConfig(head_dim=d, gqa_ratio=g, causal=causal))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_mqa_with_more_than_128_query_heads(causal):
    """MQA Hq = 256, Hkv = 1 (G = 256 does not divide 128: 256 head groups of one head each)."""
    rng = np.random.default_rng(256)
    q, k, v = _inputs(rng, 1, 9, 140, 1, 256, 64, "fp16")
    _check_against_exact(q, k, v, KernelConfig(head_dim=64, gqa_ratio=256, causal=causal, dtype="fp16"))


@pytest.mark.parametrize("g", [3, 5, 6, 7, 12])
def test_unpacked_ratio_equals_per_head_g1_kernels(g):
    """P = 1: every tile holds one query head, so the result is bit-identical to running each
    query head h as G = 1 attention against kv head h // G (same tiles, same block order)."""
    rng = np.random.default_rng(g)
    q, k, v = _inputs(rng, 1, 200, 333, 2, g, 64, "bf16")
    o, lse = fa4_forward(q, k, v, KernelConfig(head_dim=64, gqa_ratio=g, causal=True))
    for h in range(q.shape[2]):
        o1, lse1 = fa4_forward(q[:, :, h:h + 1], k[:, :, h // g:h // g + 1], v[:, :, h // g:h // g + 1],
                               KernelConfig(head_dim=64, gqa_ratio=1, causal=True))
        np.testing.assert_array_equal(o[:, :, h:h + 1], o1)
        np.testing.assert_array_equal(lse[:, h:h + 1], lse1)
