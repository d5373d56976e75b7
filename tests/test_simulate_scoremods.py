"""The simulator honours the score modifiers (KernelConfig.window / softcap / sinks) as the reference
does: windowed block ranges and masks (plan.BlockInfo), the softcap's tanh before the mask, sinks in
the final normalisation and, over split KV-cache partials, in the combine."""

import numpy as np
import pytest

from fa4gen import KernelConfig
from fa4gen.evidence.reference import attention_exact, fa4_forward, round_to_dtype
from fa4gen.evidence.simulate import schedule_tasks, simulate, simulate_kvcache


def _qkv(rng, b, sq, skv, hkv, g, d, dtype, scale=1.0):
    mk = lambda *s: round_to_dtype(rng.standard_normal(s) * scale, dtype)  # noqa: E731
    return mk(b, sq, hkv * g, d), mk(b, skv, hkv, d), mk(b, skv, hkv, d)


CASES = [
    # arch, causal, gqa, sq, skv, dtype, window, softcap, sink logits per query head
    ("sm_100a", False, 2, 150, 600, "bf16", (70, 20), 30.0, (2.0, -np.inf)),  # Sq < Skv, both sides
    ("sm_100a", True, 1, 300, 300, "fp16", (40, 0), 0.0, (50.0,)),  # blocks below the window skipped, dominant sink
    ("sm_90a", False, 1, 400, 200, "bf16", (-1, 5), 5.0, None),  # right side only, Sq > Skv: tiles without keys
    ("sm_90a", True, 4, 100, 450, "fp16", (130, 0), 0.0, (0.5, -np.inf, 3.0, -1.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}-w{c[6]}")
def test_simulator_equals_reference_with_score_mods(case):
    arch, causal, g, sq, skv, dtype, window, cap, sinks = case
    cfg = KernelConfig(arch=arch, head_dim=64, causal=causal, gqa_ratio=g, dtype=dtype, window=True,
                       softcap=cap > 0, sinks=sinks is not None)
    q, k, v = _qkv(np.random.default_rng(sq + skv), 1, sq, skv, 1, g, 64, dtype, scale=3.0)
    mods = dict(window=window, softcap=cap, sinks=None if sinks is None else np.array(sinks))
    tasks = schedule_tasks(cfg, 1, 1, sq, skv, window=window)
    # the window's blocks only: fewer than the unwindowed schedule runs
    assert sum(t.n_blocks for t in tasks) < sum(t.n_blocks for t in schedule_tasks(cfg, 1, 1, sq, skv))
    res = simulate(cfg, q, k, v, seed=1, num_ctas=2, **mods)
    assert res.findings == []
    o_ref, lse_ref = fa4_forward(q, k, v, cfg, **mods)
    o, o_ref = res.o.astype(np.float64), o_ref.astype(np.float64)
    if arch == "sm_90a":  # one PV MMA per block, as the reference: the same bits
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(res.lse, lse_ref)
    else:  # the split PV MMA's fp32 order and the apply_sink divisor: one rounding step of the output dtype
        ulp = np.maximum(np.abs(o_ref) * (2.0 ** -7 if dtype == "bf16" else 2.0 ** -10), 2.0 ** -24)
        assert np.all(np.abs(o - o_ref) <= ulp)
        assert np.array_equal(np.isinf(lse_ref), np.isinf(res.lse))
        fin = np.isfinite(lse_ref)
        np.testing.assert_allclose(res.lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    o_exact, _ = attention_exact(q, k, v, causal, window=window, softcap=cap, sinks=mods["sinks"])
    assert np.max(np.abs(o - o_exact)) < 2e-2 * max(1.0, np.abs(o_exact).max())  # P and O in 16 bits


def test_windowed_split_kvcache_with_sinks_equals_exact():
    """A (W, 0) window over a paged cache, split three ways: the splits cut the window's blocks and
    the combine counts the sink once."""
    cfg = KernelConfig(arch="sm_100a", head_dim=64, gqa_ratio=4, kvcache=True, page_size=64, window=True, sinks=True)
    rng = np.random.default_rng(5)
    B, sq, cap, ps = 2, 1, 1024, 64
    q = round_to_dtype(rng.standard_normal((B, sq, 4, 64)), "bf16")
    kc, vc = (round_to_dtype(rng.standard_normal((B, cap, 1, 64)), "bf16") for _ in range(2))
    pt = rng.permutation(B * cap // ps).reshape(B, cap // ps).astype(np.int32)
    kp, vp = np.zeros((B * cap // ps, ps, 1, 64), np.float32), np.zeros((B * cap // ps, ps, 1, 64), np.float32)
    for b in range(B):
        for i in range(cap // ps):
            kp[pt[b, i]], vp[pt[b, i]] = kc[b, i * ps:(i + 1) * ps], vc[b, i * ps:(i + 1) * ps]
    lens, window, sinks = np.array([1000, 300]), (200, 0), np.array([1.0, -np.inf, 8.0, -2.0])
    res = simulate_kvcache(cfg, q, kp, vp, lens, pt, num_splits=3, seed=2, window=window, sinks=sinks)
    assert not res.findings
    for b, n in enumerate(lens):
        o_ref, lse_ref = attention_exact(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], False, window=window,
                                         sinks=sinks)
        assert np.max(np.abs(res.o[b] - o_ref[0])) < 2e-2
        assert np.max(np.abs(res.lse[b] - lse_ref[0])) < 1e-3
