"""Every mutation of the broken-pipeline corpus is rejected with a finding naming its culprit."""

import functools

import numpy as np
import pytest

from fa4gen import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.verify import verify
from fa4gen.verify.mutations import CORPUS
from fa4gen.evidence.reference import fa4_forward
from fa4gen.evidence.simulate import simulate

BASE = {False: build_pipeline(KernelConfig(head_dim=64, dtype="fp16")),
        True: build_pipeline(KernelConfig(head_dim=64, dtype="fp16", causal=True, gqa_ratio=4))}


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 12
    assert len({m.name for m in CORPUS}) == len(CORPUS)


@functools.lru_cache(maxsize=None)
def base_verifies(causal: bool) -> bool:
    """The unmutated pipeline verifies (once per worker: the pipelines are immutable values, and the
    verifier is deterministic for fixed scenarios and schedules)."""
    return verify(BASE[causal], scenarios=((2,),), random_schedules=1).ok


@pytest.mark.parametrize("mut", CORPUS, ids=lambda m: m.name)
@pytest.mark.parametrize("causal", [False, True])
def test_mutation_rejected_with_culprit(mut, causal):
    base = BASE[causal]
    assert base_verifies(causal)
    rep = verify(mut.apply(base))
    assert not rep.ok
    hits = [f for f in rep.findings if f.code == mut.code and mut.culprit in f.subject.split(", ")]
    assert hits, f"{mut.name}: expected {mut.code} on {mut.culprit}, got:\n{rep.text()}"


@pytest.mark.parametrize("mut", [m for m in CORPUS if m.breaks_data], ids=lambda m: m.name)
def test_data_breaking_mutations_fail_in_the_simulator(mut):
    cfg = KernelConfig(head_dim=64, dtype="fp16")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 256, 1, 64)).astype(np.float16)
    k = rng.standard_normal((1, 384, 1, 64)).astype(np.float16)
    v = rng.standard_normal((1, 384, 1, 64)).astype(np.float16)
    o_ref, _ = fa4_forward(q, k, v, cfg)
    pipe = mut.apply(build_pipeline(cfg))
    failed = False
    for seed in range(4):
        res = simulate(pipe, q, k, v, seed=seed)
        diverged = np.isnan(res.o).any() or not np.allclose(res.o.astype(np.float32), o_ref.astype(np.float32),
                                                             atol=2e-3, rtol=2e-3)
        if diverged or res.findings:
            failed = True
            break
    assert failed, f"{mut.name}: the simulator neither diverged nor reported a hazard"


from fa4gen.verify.mutations import DYNAMIC_CORPUS, SM90_CORPUS, SM90_KV_CORPUS  # noqa: E402


@pytest.mark.parametrize("mut", SM90_CORPUS, ids=lambda m: m.name)
def test_sm90_mutation_rejected_with_culprit(mut):
    base = build_pipeline(KernelConfig(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=2))
    rep = verify(mut.apply(base))
    hits = [f for f in rep.findings if f.code == mut.code and mut.culprit in f.subject.split(", ")]
    assert hits, f"{mut.name}: expected {mut.code} on {mut.culprit}, got:\n{rep.text()}"


# The KV-cache pipeline's idle consumer path (If ROWS_IN_SQ, plan.sm90_idle_consumers): each broken path
# rejected naming its culprit; a dense pipeline has no such path (the edit changes nothing)
@pytest.mark.parametrize("mut", SM90_KV_CORPUS, ids=lambda m: m.name)
def test_sm90_kv_mutation_rejected_with_culprit(mut):
    base = build_pipeline(KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4, kvcache=True))
    assert verify(base).ok
    rep = verify(mut.apply(base))
    hits = [f for f in rep.findings if f.code == mut.code and mut.culprit in f.subject.split(", ")]
    assert hits, f"{mut.name}: expected {mut.code} on {mut.culprit}, got:\n{rep.text()}"
    dense = build_pipeline(KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4))
    assert mut.apply(dense) == dense


# The dynamic deal's task hand-off (varlen on both targets, sm_90a causal: ir/tasks.py): each broken hand-off rejected
# naming its culprit; a statically dealt pipeline has no hand-off to break
DYNAMIC = {"sm_90a": build_pipeline(KernelConfig(arch="sm_90a", head_dim=64, causal=True, varlen=True)),
           "sm_100a": build_pipeline(KernelConfig(arch="sm_100a", head_dim=64, causal=True, varlen=True)),
           "sm_100a one tile": build_pipeline(KernelConfig(arch="sm_100a", head_dim=256, varlen=True))}
STATIC = build_pipeline(KernelConfig(arch="sm_90a", head_dim=64, gqa_ratio=2))  # non-causal: the static deal


@pytest.mark.parametrize("which", list(DYNAMIC))
@pytest.mark.parametrize("mut", DYNAMIC_CORPUS, ids=lambda m: m.name)
def test_dynamic_deal_mutation_rejected_with_culprit(mut, which):
    pipe = DYNAMIC[which]
    assert verify(pipe).ok
    broken = mut.apply(pipe)
    assert broken != pipe
    rep = verify(broken)
    hits = [f for f in rep.findings if f.code == mut.code and mut.culprit in f.subject.split(", ")]
    assert hits, f"{mut.name}: expected {mut.code} on {mut.culprit}, got:\n{rep.text()}"
    assert mut.apply(STATIC) == STATIC


# One Q tile per task (sm_100a D = 256): the corpus applies to its pipeline too, each mutation rejected
# naming its culprit, but those that need a second tile (they edit O1), which change nothing and say so,
# and two whose edit means another bug there: with no PV of a tile 1 to move the V release before, the
# release is dropped (the ring deadlocks); with one statistics slot, dropping WG2's only sync lets the
# softmax lap the sScale hand-back
ONE_TILE = build_pipeline(KernelConfig(head_dim=256, causal=True, gqa_ratio=2))
TWO_TILES_ONLY = {"tmem_over_512"}
ONE_TILE_FINDS = {"kv_read_after_empty": ("DEADLOCK", "kv_empty"),
                  "dropped_named_sync": ("PHASE_ROUND", "softmax_corr_empty")}


@pytest.mark.parametrize("mut", CORPUS, ids=lambda m: m.name)
def test_mutation_of_the_one_tile_pipeline_rejected_with_culprit(mut):
    broken = mut.apply(ONE_TILE)
    if mut.name in TWO_TILES_ONLY:
        assert broken == ONE_TILE
        return
    assert broken != ONE_TILE
    rep = verify(broken)
    assert not rep.ok, f"{mut.name} went unnoticed on the one-tile pipeline"
    code, culprit = ONE_TILE_FINDS.get(mut.name, (mut.code, mut.culprit))
    hits = [f for f in rep.findings if f.code == code and culprit in f.subject.split(", ")]
    assert hits, f"{mut.name}: expected {code} on {culprit}, got:\n{rep.text()}"
