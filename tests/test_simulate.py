"""The simulator, executing the verified programs, computes what the reference computes."""

import numpy as np
import pytest

from fa4gen import KernelConfig
from fa4gen.evidence.reference import fa4_forward, attention_exact
from fa4gen.evidence.simulate import simulate, schedule_tasks


def _inputs(rng, b, sq, skv, hkv, g, d, dtype, scale=1.0):
    np_dt = np.float16 if dtype == "fp16" else np.float32
    from fa4gen.evidence.reference import round_to_dtype
    mk = lambda *s: round_to_dtype(rng.standard_normal(s) * scale, dtype).astype(np_dt)  # noqa: E731
    return mk(b, sq, hkv * g, d), mk(b, skv, hkv, d), mk(b, skv, hkv, d)


CASES = [
    # causal, gqa, sq, skv, d, dtype, batch, hkv
    (False, 1, 300, 300, 64, "fp16", 1, 1),
    (False, 4, 129, 517, 128, "bf16", 1, 2),
    (True, 1, 300, 300, 64, "bf16", 2, 1),
    (True, 4, 200, 450, 128, "fp16", 1, 1),
    (True, 16, 100, 60, 64, "fp16", 1, 1),  # Sq > Skv: rows without a valid key
    (False, 16, 40, 260, 64, "bf16", 1, 1),
]


def _check_simulation(cfg, q, k, v, seed):
    """The simulator on (q, k, v) equals reference.fa4_forward (O within one rounding step of the
    output dtype: same P rounding, only the fp32 accumulation order of the split PV MMA differs;
    LSE to 1e-5) and exact attention to 2e-2, with every output element written."""
    dtype, causal = cfg.dtype, cfg.causal
    res = simulate(cfg, q, k, v, seed=seed, num_ctas=2)
    assert res.findings == []
    assert not np.isnan(res.o).any() and not np.isnan(res.lse).any(), "output not fully written"
    o_ref, lse_ref = fa4_forward(q, k, v, cfg)
    o, o_ref = res.o.astype(np.float64), o_ref.astype(np.float64)
    # Same P rounding; only the fp32 accumulation order of the split PV MMA differs: at most one
    # rounding step of the output dtype.
    ulp = np.spacing(np.abs(o_ref).astype(np.float16 if dtype == "fp16" else np.float32)).astype(np.float64)
    if dtype == "bf16":
        ulp = np.maximum(np.abs(o_ref) * 2.0 ** -7, 2.0 ** -133)
    assert np.all(np.abs(o - o_ref) <= ulp + 1e-7)
    assert np.array_equal(np.isinf(lse_ref), np.isinf(res.lse))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(res.lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    o_exact, _ = attention_exact(q, k, v, causal)
    assert np.max(np.abs(o - o_exact)) < 2e-2


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_equals_reference(case, seed):
    causal, g, sq, skv, d, dtype, b, hkv = case
    cfg = KernelConfig(causal=causal, gqa_ratio=g, head_dim=d, dtype=dtype)
    rng = np.random.default_rng(100 * seed + sum(case[1:5]))
    q, k, v = _inputs(rng, b, sq, skv, hkv, g, d, dtype)
    _check_simulation(cfg, q, k, v, seed)


def test_scaled_inputs_force_rescales_and_still_match():
    cfg = KernelConfig(head_dim=64, dtype="bf16")
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 128, 640, 1, 1, 64, "bf16", scale=30.0)
    stats = {}
    o_ref, _ = fa4_forward(q, k, v, cfg, stats=stats)
    assert stats["rescaled"] > 0
    res = simulate(cfg, q, k, v, seed=5)
    assert res.findings == []
    np.testing.assert_allclose(res.o, o_ref, rtol=2 ** -7, atol=1e-6)


def test_lpt_order_for_causal():
    cfg = KernelConfig(causal=True, gqa_ratio=1)
    tasks = schedule_tasks(cfg, 1, 1, 1024, 1024)
    ms = [t.m_block for t in tasks]
    assert ms == sorted(ms, reverse=True)
    assert tasks[0].n_blocks == 8 and tasks[-1].n_blocks == 2  # two 128-row Q tiles per task


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_sm90_simulator_equals_reference(case):
    """The sm_90a programs (S/P/O in consumer registers) compute the reference's output exactly:
    one PV MMA per block, like the reference, so no extra rounding."""
    causal, g, sq, skv, d, dtype, b, hkv = case
    cfg = KernelConfig(arch="sm_90a", causal=causal, gqa_ratio=g, head_dim=d, dtype=dtype)
    rng = np.random.default_rng(sum(case[1:5]))
    q, k, v = _inputs(rng, b, sq, skv, hkv, g, d, dtype)
    res = simulate(cfg, q, k, v, seed=3, num_ctas=2)
    assert res.findings == []
    o_ref, lse_ref = fa4_forward(q, k, v, cfg)
    np.testing.assert_array_equal(res.o, o_ref)
    np.testing.assert_array_equal(res.lse, lse_ref)


def test_sm90_hazard_mutation_reported_by_simulator():
    from fa4gen.ir import build_pipeline
    from fa4gen.verify.mutations import by_name
    cfg = KernelConfig(arch="sm_90a", head_dim=64, dtype="fp16")
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 1, 128, 384, 1, 1, 64, "fp16")
    res = simulate(by_name("sm90_pack_p_before_pv_done").apply(build_pipeline(cfg)), q, k, v, seed=0)
    assert any(f.code == "HAZARD_WAR" and f.subject == "P" for f in res.findings)


# ---- any integer GQA ratio: the programs over the (batch, kv head, head group, m block) tasks ----
ANY_RATIO_CASES = [
    # causal, gqa, sq, skv, d, dtype, batch, hkv
    (True, 3, 150, 97, 64, "bf16", 1, 2),  # Sq > Skv: rows without keys
    (False, 5, 130, 203, 128, "bf16", 1, 2),
    (True, 6, 40, 300, 64, "fp16", 2, 1),  # Sq < Skv
    (False, 7, 129, 129, 64, "bf16", 1, 2),
    (True, 12, 200, 333, 128, "bf16", 1, 1),
]


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
@pytest.mark.parametrize("case", ANY_RATIO_CASES, ids=str)
def test_any_ratio_simulator_equals_reference(case, arch):
    causal, g, sq, skv, d, dtype, b, hkv = case
    cfg = KernelConfig(arch=arch, causal=causal, gqa_ratio=g, head_dim=d, dtype=dtype)
    assert cfg.head_groups == g  # none of these divides 128: one query head per tile
    rng = np.random.default_rng(sum(case[1:5]))
    q, k, v = _inputs(rng, b, sq, skv, hkv, g, d, dtype)
    _check_simulation(cfg, q, k, v, 1)


def _check_simulation_exact(cfg, q, k, v, num_ctas):
    """The simulator on (q, k, v) equals reference.fa4_forward bit for bit, without findings."""
    res = simulate(cfg, q, k, v, seed=0, num_ctas=num_ctas)
    assert res.findings == []
    o_ref, lse_ref = fa4_forward(q, k, v, cfg)
    np.testing.assert_array_equal(res.o, o_ref)
    np.testing.assert_array_equal(res.lse, lse_ref)


def test_mqa_256_heads_on_sm90_simulator():
    cfg = KernelConfig(arch="sm_90a", causal=True, gqa_ratio=256, head_dim=64)
    rng = np.random.default_rng(256)
    q, k, v = _inputs(rng, 1, 5, 70, 1, 256, 64, "bf16")
    _check_simulation_exact(cfg, q, k, v, num_ctas=3)


def test_unpacked_schedule_covers_every_head_group_once():
    cfg = KernelConfig(causal=True, gqa_ratio=6)
    tasks = schedule_tasks(cfg, 2, 3, 700, 900, l2_group=4)
    seen = sorted((t.batch, t.kv_head, t.head_group, t.m_block) for t in tasks)
    assert seen == [(b, h, j, m) for b in range(2) for h in range(3) for j in range(6) for m in range(3)]


def test_sm90_d256_simulator_runs_64_key_blocks_as_the_reference():
    """The pipeline simulator over sm_90a D = 256's 64-key blocks (K/V tiles, the masked diagonal, the
    block positions of each task) equals the reference bit for bit, causal with Sq != Skv."""
    cfg = KernelConfig(arch="sm_90a", causal=True, gqa_ratio=2, head_dim=256)
    rng = np.random.default_rng(64)
    q, k, v = _inputs(rng, 1, 70, 200, 1, 2, 256, "bf16")
    _check_simulation_exact(cfg, q, k, v, num_ctas=2)
