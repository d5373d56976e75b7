"""The sm_100a varlen kernel (packed variable-length batches), lowered from its IR.

- The IR names the varlen O store (StoreRows: the store warp's threads copy the sequence's rows of
  O_smem to o_ptr with one predicate per row) instead of a TMA store; the verifier sees its reads
  of O_smem (hazards when it is moved across the barriers that guard them).
- `fa4gen emulate` runs the emitted PTX on the default ragged shapes (zero-length sequence, a
  sequence without keys, q_len != k_len both ways, pairs whose second tile lies past the sequence,
  seqused_k) and `fa4gen check` reads the PTX back against the IR, StoreRows included.
- The IR simulator runs ragged batches against the reference (simulate_varlen).
- ptxas accepts the kernels without spills.
- The varlen PTX mutations of the corpus (fa4gen/evidence/ptxemu/mutations.py, run by tests/test_ptxemu.py)
  edit exactly the varlen instruction they name.

No Blackwell GPU exists here: the sm_100a kernel is never executed, only emulated.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path

import numpy as np
import pytest

from fa4gen.assemble import assemble as asm
from fa4gen import codegen
from fa4gen.evidence.check import check_ptx
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.plan import dynamic_tasks
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Arrive, Loop, LoopKind, StoreRows, TmaStore, TmaStoreWait, Wait, walk_ops
from fa4gen.verify.verify import verify
from fa4gen.evidence.ptxemu.harness import VarShape, default_shapes, emulate_file, judge_varlen, make_varlen_inputs
from fa4gen.evidence.ptxemu.mutations import PTX_MUTATIONS, MutationMiss
from fa4gen.evidence.simulate import simulate_varlen

HAVE_PTXAS = asm.find_ptxas() is not None


def vl(**kw) -> KernelConfig:
    return KernelConfig(**{"arch": "sm_100a", "varlen": True, **kw})


@functools.lru_cache(maxsize=None)
def built(cfg: KernelConfig):
    res = codegen.build(cfg, emit=("ptx",))  # verifies the IR: raises on a finding
    return res.ptx, res.manifest


# emulate + check: non-causal / causal, GQA 1, 4 and the unpacked 3, D 64 and 128 (1-4 s each)
EMULATED = [vl(head_dim=64), vl(head_dim=64, causal=True, gqa_ratio=4), vl(causal=True, gqa_ratio=3),
            vl(gqa_ratio=4, dtype="fp16")]


@pytest.mark.parametrize("cfg", EMULATED, ids=lambda c: c.name)
def test_varlen_kernel_emulates_on_ragged_batches_and_reads_back(cfg):
    ptx, man = built(cfg)
    rep = check_ptx(ptx, man)
    assert rep.ok, rep.summary()
    # per tile: wait corr_epi_full, StoreRows, arrive corr_epi_empty, advance e; and the dynamic deal's
    # hand-off of the task index (ir/tasks.py): wait task_full, arrive task_empty, advance t
    assert rep.events["store"] == 8 + 3
    shapes = default_shapes(man)
    assert all(isinstance(s, VarShape) for s in shapes)
    res = emulate_file(Path(man["name"] + ".ptx"), ptx_text=ptx, manifest=man, seeds=1)
    assert res.ok, res.summary()
    assert len(res.runs) == len(shapes)


def test_default_ragged_shapes_reach_the_varlen_corners():
    """The shapes the emulator runs: a zero-length sequence, one without keys, q_len > k_len and
    q_len < k_len, a sequence of more than one (pair) task, a pair whose second tile lies wholly
    past the sequence, and seqused_k capping keys."""
    for cfg in (vl(), vl(gqa_ratio=4, causal=True)):
        _, man = built(cfg)
        unit = 2 * cfg.seq_q_per_tile
        shapes = default_shapes(man)
        lens = [(a, b) for s in shapes for a, b in zip(s.lens_q, s.lens_k)]
        assert any(a == 0 for a, _ in lens) and any(a > 0 and b == 0 for a, b in lens)
        assert any(a > b > 0 for a, b in lens) and any(0 < a < b for a, b in lens)
        assert any(a > unit for a, _ in lens)
        assert any(0 < a % unit <= cfg.seq_q_per_tile for a, _ in lens)
        assert any(s.seqused_k and s.used_k != s.lens_k for s in shapes)


def test_ir_names_the_varlen_store():
    for causal in (False, True):
        dense, var = build_pipeline(KernelConfig(causal=causal)), build_pipeline(vl(causal=causal))
        ops = lambda p: [type(op) for op in walk_ops(p.role("store").program)]  # noqa: E731
        assert TmaStore in ops(dense) and StoreRows not in ops(dense)
        assert StoreRows in ops(var) and TmaStore not in ops(var) and TmaStoreWait not in ops(var)
        assert verify(var).ok


def _store_body(pipe, fn):
    role = pipe.role("store")
    loop = role.program[0]
    assert isinstance(loop, Loop) and loop.kind is LoopKind.TASKS
    new = dataclasses.replace(role, program=(dataclasses.replace(loop, body=fn(list(loop.body))),))
    return dataclasses.replace(pipe, roles=tuple(new if r.name == "store" else r for r in pipe.roles))


def _swap(body, i, j):
    body[i], body[j] = body[j], body[i]
    return tuple(body)


@pytest.mark.parametrize("where", ["before_wait", "after_release"])
def test_verifier_sees_the_store_rows_reads(where):
    """StoreRows moved before its corr_epi_full wait reads O_smem before the epilogue wrote it;
    moved after the corr_epi_empty arrive, the epilogue may overwrite the slot it still reads."""
    pipe = build_pipeline(vl())
    k = next(i for i, op in enumerate(pipe.role("store").program[0].body) if isinstance(op, StoreRows))
    body = pipe.role("store").program[0].body
    assert isinstance(body[k - 1], Wait) and isinstance(body[k + 1], Arrive)
    bad = _store_body(pipe, lambda b: _swap(b, k, k - 1 if where == "before_wait" else k + 1))
    rep = verify(bad)
    code = "HAZARD_RAW" if where == "before_wait" else "HAZARD_WAR"
    assert any(f.code == code and "O_smem" in f.subject for f in rep.findings), rep.text()


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


@pytest.mark.parametrize("cfg", [vl(head_dim=64), vl(head_dim=64, causal=True, gqa_ratio=4),
                                 vl(causal=True, gqa_ratio=3),
                                 KernelConfig(arch="sm_90a", varlen=True, head_dim=64, causal=True)],
                         ids=lambda c: c.name)
def test_simulator_runs_ragged_batches_against_the_reference(cfg):
    _, man = built(cfg)
    for shape in default_shapes(man):
        q, k, v = make_varlen_inputs(shape, cfg.dtype, cfg.head_dim, 1)
        res = simulate_varlen(cfg, q, k, v, _cu(shape.lens_q), _cu(shape.lens_k), shape.seqused_k, num_ctas=2, seed=1)
        assert not res.findings, res.findings
        ok, rep, _ = judge_varlen(res.o, res.lse, q, k, v, cfg.to_dict(), 1 / np.sqrt(cfg.head_dim), shape)
        assert ok, f"{shape}:\n{rep}"


def test_simulator_fails_a_broken_varlen_pipeline():
    """The store warp releasing O_smem before copying it: the simulator's engine reports the hazard."""
    pipe = build_pipeline(vl(head_dim=64))
    k = next(i for i, op in enumerate(pipe.role("store").program[0].body) if isinstance(op, StoreRows))
    bad = _store_body(pipe, lambda b: _swap(b, k, k + 1))
    shape = VarShape((300, 0, 40), (200, 17, 130), 1, 1)
    q, k_, v = make_varlen_inputs(shape, "bf16", 64, 0)
    res = simulate_varlen(bad, q, k_, v, _cu(shape.lens_q), _cu(shape.lens_k))
    assert any(f.code == "HAZARD_WAR" for f in res.findings)


@pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")
@pytest.mark.parametrize("cfg", [vl(), vl(causal=True, gqa_ratio=3), vl(head_dim=64, causal=True, gqa_ratio=8)],
                         ids=lambda c: c.name)
def test_ptxas_accepts_without_spills(cfg):
    ptx, man = built(cfg)
    res = asm.assemble(ptx, "sm_100a", name=man["name"], backend="ptxas")  # strict policy: spills are errors
    kern = res.kernel(man["entry"])
    assert kern.spills == 0 and kern.stack_frame == 0


# the edits of varlen code; the LSE null-guard mutations edit the LSE store that dense kernels share, on a
# varlen kernel (its own copy of that store), so they are not varlen text
VARLEN_MUTATIONS = [m for m in PTX_MUTATIONS if m.kernel_config().varlen and "lse_null_guard" not in m.name]


def test_corpus_has_varlen_mutations_of_both_targets():
    archs = {m.kernel_config().arch for m in VARLEN_MUTATIONS}
    assert archs == {"sm_100a", "sm_90a"}
    assert len([m for m in VARLEN_MUTATIONS if m.kernel_config().arch == "sm_100a"]) >= 5


@pytest.mark.parametrize("mut", VARLEN_MUTATIONS, ids=lambda m: m.name)
def test_varlen_mutation_edits_only_varlen_text(mut):
    """Each edit changes a few lines, every one of them varlen code (or the dynamic deal's, which
    sm_90a causal dense kernels share); a statically dealt dense kernel has none of that text (the
    edit misses there)."""
    cfg = mut.kernel_config()
    ptx, man = built(cfg)
    broken = mut.apply(ptx, man)
    changed = [ln for ln in difflib.unified_diff(ptx.splitlines(), broken.splitlines(), n=0, lineterm="")
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 16, changed
    dense = dataclasses.replace(cfg, varlen=False)
    if dynamic_tasks(dense):  # sm_90a causal dense kernels deal dynamically too: a statically dealt one
        dense = KernelConfig(arch=cfg.arch, head_dim=cfg.head_dim, gqa_ratio=cfg.gqa_ratio, dtype=cfg.dtype,
                             block_m=cfg.block_m)
    dptx, dman = built(dense)
    with pytest.raises(MutationMiss):
        mut.apply(dptx, dman)
