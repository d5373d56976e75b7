"""The real pipelines verify clean; the static checks fire on what they guard."""

import itertools

import pytest

from fa4gen import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import BarrierKind, Space, walk_ops, Arrive
from fa4gen.verify import VerificationError, check_or_raise, verify

MATRIX = [KernelConfig(head_dim=d, causal=c, gqa_ratio=g)
          for d, c, g in itertools.product((64, 128), (False, True), (1, 4))]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.name)
def test_real_pipelines_verify_clean(cfg):
    rep = verify(build_pipeline(cfg))
    assert rep.ok, rep.text()
    assert rep.runs >= 4 * 8


def test_tmem_map_matches_spec():
    p = build_pipeline(KernelConfig())
    cols = {r.name: (r.col, r.col_end, r.alias_of) for r in p.regions if r.space is Space.TMEM}
    assert cols == {"S0": (0, 128, None), "P0": (64, 128, "S0"), "S1": (128, 256, None),
                    "P1": (192, 256, "S1"), "O0": (256, 384, None), "O1": (384, 512, None)}
    assert p.tmem_alloc_cols == 512


def test_register_budget_is_exactly_the_seed_split():
    p = build_pipeline(KernelConfig())
    assert {r.name: r.regs for r in p.roles} == {"softmax0": 200, "softmax1": 200, "correction": 64,
                                                 "mma": 48, "load": 48, "store": 48, "idle": 48}
    assert sum(r.threads * r.regs for r in p.roles) == 65536


def test_barrier_table_matches_spec():
    p = build_pipeline(KernelConfig(gqa_ratio=4))
    table = {b.name: (b.kind, b.slots, b.count) for b in p.barriers}
    assert table["p_o_rescale"] == (BarrierKind.MBAR, 2, 256)
    assert table["p_ready_2"] == (BarrierKind.MBAR, 2, 128)
    assert table["kv_full"] == (BarrierKind.TMA, 3, 1)
    assert table["kv_empty"] == (BarrierKind.TCGEN05, 3, 1)
    assert table["stats"] == (BarrierKind.NAMED, 2, 256)
    assert table["corr_epi_empty"] == (BarrierKind.MBAR, 2, 32)
    g1 = {b.name: (b.slots, b.count) for b in build_pipeline(KernelConfig(gqa_ratio=1)).barriers}
    assert g1["stats"] == (8, 64)  # four 64-thread barriers per stage pair warp k with warp k


@pytest.mark.parametrize("causal,first_chunks", [(False, 3), (True, 2)])
def test_p_store_split_follows_k_split(causal, first_chunks):
    """Softmax stores K_SPLIT/32 chunks, wait::st, arrive p_o_rescale; then the rest."""
    p = build_pipeline(KernelConfig(causal=causal))
    seq = [type(op).__name__ for op in walk_ops(p.role("softmax0").program)
           if type(op).__name__ in ("TmemSt", "WaitSt", "Arrive")]
    i = seq.index("Arrive")
    assert seq[:i] == ["TmemSt"] * first_chunks + ["WaitSt"]
    assert seq[i + 1:i + 2 + 4 - first_chunks] == ["TmemSt"] * (4 - first_chunks) + ["WaitSt"]


def test_epilogue_owner_depends_on_causal():
    nc, c = build_pipeline(KernelConfig()), build_pipeline(KernelConfig(causal=True))
    owner = lambda p: {r.name for r in p.roles for op in walk_ops(r.program)  # noqa: E731
                       if isinstance(op, Arrive) and op.barrier == "corr_epi_full"}
    assert owner(nc) == {"correction"}
    assert owner(c) == {"softmax0", "softmax1"}


def test_check_or_raise_carries_the_report():
    import dataclasses
    p = build_pipeline(KernelConfig())
    bad = dataclasses.replace(p, smem_limit=1000)
    with pytest.raises(VerificationError) as ei:
        check_or_raise(bad, scenarios=((1,),))
    assert "SMEM_BUDGET" in ei.value.report.codes()
    assert not ei.value.report.ok


def test_smem_budget_counts_the_alignment_slack_the_kernel_requests():
    """The limit holds for the bytes requested at launch (the layout's total), not the regions' sum:
    a pipeline 8 bytes short of fitting with its slack is refused by the verifier, not first by the lowering."""
    import dataclasses
    from fa4gen.ir.layout import layout_of

    p = build_pipeline(KernelConfig(arch="sm_90a"))
    lay = layout_of(p)
    assert verify(dataclasses.replace(p, smem_limit=lay.total), scenarios=((1,),)).ok
    rep = verify(dataclasses.replace(p, smem_limit=lay.total - 8), scenarios=((1,),))
    assert rep.codes() == {"SMEM_BUDGET"}, rep.text()


def test_smem_over_limit_for_deep_kv_ring():
    rep = verify(build_pipeline(KernelConfig(kv_stages=4)), scenarios=((1,),))
    assert "SMEM_BUDGET" in rep.codes()


SM90_MATRIX = [KernelConfig(arch="sm_90a", head_dim=d, causal=c, gqa_ratio=g)
               for d, c, g in itertools.product((64, 128), (False, True), (1, 8))]


@pytest.mark.parametrize("cfg", SM90_MATRIX, ids=lambda c: c.name)
def test_sm90_pipelines_verify_clean(cfg):
    p = build_pipeline(cfg)
    rep = verify(p)
    assert rep.ok, rep.text()
    assert p.tmem_alloc_cols == 0 and not [r for r in p.regions if r.space is Space.TMEM]
    assert sum(r.threads * r.regs for r in p.roles) <= 65536


def test_undeclared_names_are_reported_not_crashed_on():
    import dataclasses
    from fa4gen.ir.core import Wait, TmemLd
    from fa4gen.verify.mutations import edit_program
    p = build_pipeline(KernelConfig())
    bad_state = edit_program(p, "softmax0", lambda op: (dataclasses.replace(op, state="nope"),)
                             if isinstance(op, Wait) and op.barrier == "s_ready" else (op,))
    bad_region = edit_program(p, "softmax1", lambda op: (dataclasses.replace(op, region="S9"),)
                              if isinstance(op, TmemLd) else (op,))
    for pipe, needle in ((bad_state, "state 'nope'"), (bad_region, "region 'S9'")):
        rep = verify(pipe)
        assert not rep.ok and rep.runs == 0  # the engine does not run on an ill-formed pipeline
        assert any(f.code == "IR_REF" and needle in f.message for f in rep.findings)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
@pytest.mark.parametrize("g", [3, 5, 6, 7, 12, 256])
def test_any_gqa_ratio_verifies_through_the_cli(arch, g):
    """`fa4gen verify --gqa G` for ratios that do not divide 128 (one query head per tile)."""
    from click.testing import CliRunner

    from fa4gen.cli import main

    for causal in ([], ["--causal"]):
        r = CliRunner().invoke(main, ["verify", "--arch", arch, "--gqa", str(g), "--head-dim", "64", *causal])
        assert r.exit_code == 0, r.output
        assert "verify: OK" in r.output


def test_replicated_roles_are_the_instances_the_verifier_proves():
    """The sm_90a consumers are one program (Pipeline.replicated) emitted once; `roles` holds its
    instances. Instantiation resolves InstSlot and the FIRST_/LAST_INSTANCE branches per instance."""
    from fa4gen.ir.core import Cond, If, InstSlot, NamedArrive, NamedSync, instantiate, walk_ops
    from fa4gen.ir.sm90 import build_sm90_pipeline

    for block_m in (128, 192):
        cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=True, block_m=block_m)
        pipe = build_sm90_pipeline(cfg)
        (tmpl,) = pipe.replicated
        n = tmpl.instances
        assert n == block_m // 64
        insts = [pipe.role(f"consumer{i}") for i in range(n)]
        assert insts == [instantiate(tmpl, i) for i in range(n)]
        for i, role in enumerate(insts):
            assert role.warps == tuple(range(4 + 4 * i, 8 + 4 * i))
            ops = list(walk_ops(role.program))
            assert not any(isinstance(getattr(op, f, None), InstSlot) for op in ops for f in op.__dataclass_fields__)
            assert not any(isinstance(st, If) and st.cond in (Cond.FIRST_INSTANCE, Cond.LAST_INSTANCE)
                           for st in role.program)
            syncs = {op.slot for op in ops if isinstance(op, NamedSync) and op.barrier == "sched"}
            arrives = {op.slot for op in ops if isinstance(op, NamedArrive) and op.barrier == "sched"}
            # its own turn, plus slot 0 (the final hand-off) for consumer 0; hands on to i + 1 mod n
            assert syncs == ({0} if i == 0 else {i})
            assert arrives == {(i + 1) % n} | ({0} if i == n - 1 else set())
    with pytest.raises(ValueError):
        instantiate(tmpl, n)
