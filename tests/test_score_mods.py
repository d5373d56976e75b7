"""Sliding windows, logit softcap and attention sinks: the exact float64 reference against a
brute-force formula written from the definitions, the kernel model (fa4_forward) against it, and
the emulator harness's handling of the values (shape suffixes, ABI scalars, judge)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fa4gen.spec.config import KernelConfig
from fa4gen.spec.plan import WINDOW_UNBOUNDED, abi_params
from fa4gen.evidence.ptxemu import cases
from fa4gen.evidence.ptxemu.harness import Shape, UsageError, VarShape, default_shapes
from fa4gen.evidence.ptxemu.kvcache import KvShape, KvUsageError
from fa4gen.evidence.ptxemu.machine import GlobalMemory
from fa4gen.evidence.reference import (LOG2E, attention_exact, fa4_forward, kernel_score_args, round_to_dtype,
                                       tanh_approx_f32)


def brute(q, k, v, causal, scale, window=None, softcap=0.0, sinks=None):
    """Row by row from the definitions: key j visible to query i iff j < Skv, j >= i + Skv - Sq - left
    (left >= 0), j <= i + Skv - Sq + right (right >= 0; causal: right = 0); s = scale q.k, capped;
    O = sum e^s v / (sum e^s + e^z), LSE = log of the denominator (max-shifted in float64)."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    o = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            z = -math.inf if sinks is None else float(sinks[h])
            for i in range(sq):
                js = [j for j in range(skv) if (left < 0 or j >= i + skv - sq - left)
                      and (right < 0 or j <= i + skv - sq + right)]
                s = []
                for j in js:
                    x = scale * float(np.dot(q[bi, i, h].astype(np.float64), k[bi, j, h * hkv // hq].astype(np.float64)))
                    s.append(softcap * math.tanh(x / softcap) if softcap else x)
                m = max(s + [z])
                if m == -math.inf:
                    continue
                w = [math.exp(x - m) for x in s]
                den = math.fsum(w) + math.exp(z - m)
                for j, wj in zip(js, w):
                    o[bi, i, h] += wj * v[bi, j, h * hkv // hq].astype(np.float64) / den
                lse[bi, h, i] = m + math.log(den)
    return o, lse


def _qkv(rng, b, sq, skv, hq, hkv, d, mult=1.0):
    return (rng.standard_normal((b, sq, hq, d)) * mult, rng.standard_normal((b, skv, hkv, d)),
            rng.standard_normal((b, skv, hkv, d)))


CASES = [  # (Sq, Skv, causal, window, softcap, sinks)
    (5, 7, False, (1, 0), 0.0, None),        # window smaller than anything, Sq < Skv
    (7, 5, False, (2, 3), 0.0, None),        # Sq > Skv: the first rows see no key
    (6, 6, True, (2, 5), 0.0, None),         # window + causal: right becomes 0
    (5, 9, False, (-1, 1), 2.0, None),       # unbounded left, softcap
    (6, 4, True, (0, 0), 0.0, (0.5, -math.inf)),  # one key per row, rows without a key: LSE = sink
    (4, 6, False, None, 3.0, (50.0, 1.0)),   # a dominant sink
    (3, 0, False, (3, 3), 0.0, (1.5, -math.inf)),  # no key at all
]


@pytest.mark.parametrize("sq,skv,causal,window,cap,sinks", CASES)
def test_exact_matches_the_brute_force_definition(sq, skv, causal, window, cap, sinks):
    rng = np.random.default_rng(sq * 31 + skv)
    q, k, v = _qkv(rng, 1, sq, skv, 2, 1, 4, mult=2.0)
    o, lse = attention_exact(q, k, v, causal, 0.7, window=window, softcap=cap, sinks=sinks)
    ob, lb = brute(q, k, v, causal, 0.7, window, cap, sinks)
    np.testing.assert_allclose(o, ob, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, lb, rtol=1e-12, atol=1e-14)


def test_rows_without_a_key_take_the_sink_and_a_sink_of_minus_inf_is_none():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 6, 3, 2, 1, 4)
    z = (2.5, -math.inf)
    o, lse = attention_exact(q, k, v, True, window=(1, -1), sinks=z)  # rows 0-2 see no key (causal, Sq > Skv)
    assert (o[0, :3] == 0).all() and (lse[0, 0, :3] == 2.5).all() and (lse[0, 1, :3] == -np.inf).all()
    o0, lse0 = attention_exact(q, k, v, True, window=(1, -1))
    assert np.array_equal(o[:, :, 1], o0[:, :, 1]) and np.array_equal(lse[:, 1], lse0[:, 1])
    assert not np.allclose(o[:, 3:, 0], o0[:, 3:, 0])  # the finite sink takes weight from the keys


def test_softcap_with_huge_logits_stays_finite_and_bounded():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 9, 1, 1, 8, mult=3000.0)  # |scale q.k| ~ 1e4
    o, lse = attention_exact(q, k, v, False, softcap=30.0)
    ob, lb = brute(q, k, v, False, 1 / math.sqrt(8), None, 30.0)
    assert np.isfinite(o).all() and (np.abs(lse) <= 30.0 + math.log(9) + 1e-9).all()
    np.testing.assert_allclose(o, ob, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, lb, rtol=1e-12)


def test_kernel_scalars():
    a = kernel_score_args(0.125, 30.0)
    assert a["scale_log2"] == np.float32(30.0 * LOG2E) and a["softcap_in"] == np.float32(0.125 / 30.0)
    assert kernel_score_args(0.125) == {"scale_log2": np.float32(0.125 * LOG2E)}
    x = np.array([0, 1e-30, -0.3, 9.0, 1e4, -np.inf], np.float32)
    assert tanh_approx_f32(x).tolist() == np.tanh(x.astype(np.float64)).astype(np.float32).tolist()


# ---- the kernel model -------------------------------------------------------------------------------

MODEL_CASES = [  # (cfg flags, Sq, Skv, window, softcap, sink values)
    (dict(causal=False, window=True), 150, 300, (5, 2), 0.0, None),      # window < block, 3 blocks, Sq != Skv
    (dict(causal=True, window=True, sinks=True), 300, 170, (140, 9), 0.0, (50.0, -math.inf)),  # Sq > Skv
    (dict(causal=False, softcap=True, sinks=True), 130, 140, None, 5.0, (2.0, 0.3)),
    (dict(causal=True, window=True, softcap=True), 200, 260, (-1, 0), 30.0, None),
]


@pytest.mark.parametrize("flags,sq,skv,window,cap,sinks", MODEL_CASES)
def test_fa4_forward_agrees_with_exact_within_the_harness_tolerance(flags, sq, skv, window, cap, sinks):
    """The kernel model judged exactly as the emulator judges a kernel (cases.judge: O within the
    bf16 bound, LSE against exact and against the model itself)."""
    cfg = KernelConfig(arch="sm_90a", head_dim=64, **flags)
    rng = np.random.default_rng(sq)
    q, k, v = (round_to_dtype(x, "bf16") for x in _qkv(rng, 1, sq, skv, 2, 2, 64))
    q[0, ::7] *= 512.0 if cap else 1.0  # huge raw scores on some rows (|q.k| ~ 4e3)
    mods = {kk: val for kk, val in (("window", window), ("softcap", cap), ("sinks", sinks)) if val}
    stats = {}
    o, lse = fa4_forward(q, k, v, cfg, 0.125, stats, **mods)
    ok, rep, _ = cases.judge(o.astype(np.float64), lse.astype(np.float64), q, k, v, cfg.to_dict(), 0.125, mods)
    assert ok, rep
    if window is not None and window[0] >= 0:  # only the window's blocks are visited
        assert stats["blocks"] < stats["tiles"] * -(-skv // 128)


def test_fa4_forward_visits_blocks_of_the_window_only():
    cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=True, window=True)
    rng = np.random.default_rng(3)
    q, k, v = (round_to_dtype(x, "bf16") for x in _qkv(rng, 1, 640, 640, 1, 1, 64))
    stats = {}
    cfg = cfg.replace(block_m=128)
    fa4_forward(q, k, v, cfg, stats=stats, window=(64, 0))
    # tile m sees keys [128 m - 64, 128 m + 127]: 2 blocks (1 for m = 0) instead of m + 1
    assert stats["tiles"] == 5 and stats["blocks"] == 9


def test_fa4_forward_refuses_values_the_kernel_does_not_take():
    cfg = KernelConfig(arch="sm_90a", head_dim=64)
    q = round_to_dtype(np.ones((1, 1, 1, 64)), "bf16")
    for kw in ({"window": (1, 1)}, {"softcap": 3.0}, {"sinks": [1.0]}):
        with pytest.raises(ValueError):
            fa4_forward(q, q, q, cfg, **kw)
    with pytest.raises(ValueError):  # a softcap kernel needs its value
        fa4_forward(q, q, q, cfg.replace(softcap=True))


# ---- the emulator harness ---------------------------------------------------------------------------

def test_shape_suffixes_parse_and_print():
    s = Shape.parse("1,300,500,4,1,nolse w=128,0 cap=30 sink=50,-inf,0.5,2")
    assert (s.b, s.sq, s.with_lse, s.mods.window, s.mods.softcap) == (1, 300, False, (128, 0), 30.0)
    assert s.mods.sinks == (50.0, -math.inf, 0.5, 2.0)
    assert str(s).endswith("no-LSE w=128,0 cap=30 sink=50,-inf,0.5,2")
    assert VarShape.parse("3:70,0:5;4,1 w=-1,3").mods.window == (-1, 3)
    assert KvShape.parse("129,1;3;4,1;3;600 sink=1").mods.sinks == (1.0,)
    assert Shape.parse("1,3,70,2,2").mods is None
    for bad in ("1,3,70,2,2 w=1", "1,3,70,2,2 cap=0", "1,3,70,2,2 sink=nan", "1,3,70,2,2 x=1", "1,3,70,2,2 w=-2,0"):
        with pytest.raises(UsageError):
            Shape.parse(bad)
    with pytest.raises(KvUsageError):
        KvShape.parse("129;3;4,1;3 cap=-1")


@pytest.mark.parametrize("kind", ["dense", "varlen", "kvcache"])
@pytest.mark.parametrize("causal", [False, True])
def test_abi_scalars_cover_the_params_of_every_flag(kind, causal):
    """mods_scalars gives exactly the score-modifier parameters plan.abi_params appends, with the
    runtime's values: sides (-1 -> WINDOW_UNBOUNDED, causal right 0), softcap_in and scale_log2
    from the softcap, sink_ptr at an fp32 [Hq] buffer holding the sinks."""
    for flags in (dict(window=True), dict(softcap=True), dict(sinks=True), dict(window=True, softcap=True, sinks=True)):
        cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=causal, varlen=kind == "varlen",
                           kvcache=kind == "kvcache", **flags)
        shape = Shape(1, 9, 20, 2, 2, mods=cases.ScoreMods(window=(-1, 7) if cfg.window else None,
                                                          softcap=20.0 if cfg.softcap else 0.0,
                                                          sinks=(1.0, -math.inf) if cfg.sinks else None))
        vals = cases.shape_mods(cfg.to_dict(), shape, seed=0)
        gm = GlobalMemory()
        sc = cases.mods_scalars(cfg.to_dict(), vals, 0.125, gm, 2)
        base = abi_params(cfg.replace(window=False, softcap=False, sinks=False))
        assert set(sc) - {"scale_log2"} == {n for n, _ in abi_params(cfg)} - {n for n, _ in base}
        if cfg.window:
            assert sc["window_left"] == ("<i", WINDOW_UNBOUNDED) and sc["window_right"] == ("<i", 0 if causal else 7)
        assert sc["scale_log2"][1] == np.float32((20.0 if cfg.softcap else 0.125) * LOG2E)
        if cfg.softcap:
            assert sc["softcap_in"][1] == np.float32(0.125 / 20.0)
        if cfg.sinks:
            assert gm.buffer("sinks").view(np.float32).tolist() == [1.0, -math.inf]
        with pytest.raises(UsageError):  # a value the kernel does not take
            cases.shape_mods(cfg.replace(window=False, softcap=False, sinks=False).to_dict(), shape, 0)


def test_default_shapes_of_flagged_variants_hold_the_adversarial_inputs():
    from fa4gen.evidence.ptxemu.kvcache import default_kv_shapes
    man = {"config": KernelConfig(arch="sm_90a", head_dim=64, causal=True, window=True, softcap=True,
                                  sinks=True).to_dict(), "grid": {"tiles_per_task": 1}}
    shapes = default_shapes(man)
    wins = [s.mods.window for s in shapes]
    # windows smaller than a block ((0, 0): one key per row, this kernel being causal; (20, 5)), Sq > Skv,
    # a wide left side on Sq != Skv, and the unbounded left side that leaves later blocks unmasked
    assert {(0, 0), (20, 5), (-1, 0)} <= set(wins) and any(s.sq > s.skv for s in shapes)
    assert any(s.sq != s.skv and s.mods.window[0] > 64 for s in shapes)
    assert {s.mods.softcap for s in shapes} == set(cases.SOFTCAPS)
    z = np.concatenate([cases.shape_mods(man["config"], s, seed)["sinks"] for s in shapes for seed in (0, 1)])
    assert 50.0 in z and -np.inf in z
    kv = default_kv_shapes(dict(man, kvcache={"page_size": 0}))
    assert (300, -1) in [s.mods.window for s in kv] and any(s.num_splits == 3 for s in kv)
    assert {s.mods.softcap for s in kv} == set(cases.SOFTCAPS)


@pytest.mark.parametrize("arch,per_task", [("sm_100a", 2), ("sm_90a", 1)])
def test_default_dense_shapes_rescale_o_under_a_cap_that_does_not_saturate(arch, per_task):
    """A non-causal softcap kernel's default shapes: the one launch of more than one K/V block (the
    only one whose O rescales) takes a softcap that keeps the rescale row's scores apart, not the
    saturating 5 (under which the correction's rescale blocks went unreached); all three caps still run."""
    man = {"config": KernelConfig(arch=arch, head_dim=64, softcap=True).to_dict(),
           "grid": {"tiles_per_task": per_task}}
    shapes = default_shapes(man)
    multi = [s for s in shapes if s.skv > 128]
    assert len(multi) == 1 and multi[0].mods.softcap == 30.0
    assert {s.mods.softcap for s in shapes} == set(cases.SOFTCAPS)


def test_schedule_counts_the_window_blocks():
    from fa4gen.spec.schedule import cta_work, tile_blocks
    m = np.arange(16)
    assert tile_blocks(m, 2048, 2048, 128, True).tolist() == (m + 1).tolist()
    assert tile_blocks(m, 2048, 2048, 128, True, window=(100, 0)).tolist() == [1] + [2] * 15
    kw = dict(num_bh=4, m_count=16, nctas=8, seqlen_q=2048, seqlen_k=2048, seq_q_per_tile=128)
    assert cta_work(4, **kw, window=(100, 0)).sum() == 4 * (16 + 31) < cta_work(4, **kw).sum()
