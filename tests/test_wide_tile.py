"""The 192-row Q tile of sm_90a (three consumer warpgroups; tiles.SM90_Q_ROWS, KernelConfig.block_m).

Where it may be built, what chooses it, and that the pipeline, the lowering and the emitted PTX agree
on three consumers (the emulation of its variants is in tests/test_ptxemu.py: SM90_VARIANTS, the
golden review PTX and the sm90w_* mutations)."""

from __future__ import annotations

import re

import pytest

from fa4gen import codegen
from fa4gen.evidence.check import check_ptx
from fa4gen.spec.config import ConfigError, KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.lower.sm90 import Sm90LoweringError, Sm90Options, entry_regs_of, threads_of
from fa4gen.render.kernels import build_sm90
from fa4gen.verify import verify
from fa4gen.spec.tiles import SM90_Q_ROWS, q_tile_rows
from fa4gen.runtime.runtime import launch_geometry

WIDE = dict(arch="sm_90a", head_dim=64, block_m=192)


def test_the_plan_picks_192_rows_for_dense_and_varlen_sm90_d64_and_d96_only():
    assert SM90_Q_ROWS == {64: 192, 96: 192, 128: 128}
    assert q_tile_rows("sm_90a", 96, 4) == 192 and q_tile_rows("sm_90a", 96, 1, varlen=True) == 192
    assert q_tile_rows("sm_90a", 96, 1, causal=True, seqlen_q=1024) == 128  # short causal calls keep 128
    assert q_tile_rows("sm_90a", 192, 1) == 128 and q_tile_rows("sm_90a", 256, 1) == 128
    assert q_tile_rows("sm_90a", 64, 1) == 192
    assert q_tile_rows("sm_90a", 64, 64) == 192
    assert q_tile_rows("sm_90a", 64, 3) == 192  # unpacked ratio: 192 positions of one head
    assert q_tile_rows("sm_90a", 64, 128) == 128  # a 128-head pack does not divide 192 rows
    assert q_tile_rows("sm_90a", 128, 1) == 128
    assert q_tile_rows("sm_100a", 64, 1) == 128
    assert q_tile_rows("sm_90a", 64, 1, varlen=True) == 192
    assert q_tile_rows("sm_90a", 128, 1, varlen=True) == 128
    # varlen causal: the longest sequence (max_seqlen_q) stands for the call's query length
    assert q_tile_rows("sm_90a", 64, 1, varlen=True, causal=True, seqlen_q=1024) == 128
    assert q_tile_rows("sm_90a", 64, 1, varlen=True, causal=True, seqlen_q=8192) == 192
    assert q_tile_rows("sm_90a", 64, 1, kvcache=True) == 128


@pytest.mark.parametrize("kw, words", [
    (dict(arch="sm_100a", head_dim=64), "sm_100a"),
    (dict(arch="sm_90a", head_dim=64, kvcache=True), "KV-cache"),
    (dict(arch="sm_90a", head_dim=64, gqa_ratio=128), "64 heads"),
])
def test_192_rows_refused_where_it_cannot_be_built(kw, words):
    with pytest.raises(ConfigError, match=words) as e:
        KernelConfig(block_m=192, **kw)
    assert e.value.field == "block_m"


@pytest.mark.parametrize("rows", [64, 256, 96])
def test_other_tile_rows_are_refused(rows):
    with pytest.raises(ConfigError, match="128, 192"):
        KernelConfig(arch="sm_90a", head_dim=64, block_m=rows)


def test_name_says_the_tile_and_the_default_names_stay():
    assert KernelConfig(**WIDE).name == "fa4_sm90a_d64_bf16_noncausal_gqa1_m192"
    assert KernelConfig(arch="sm_90a", head_dim=64).name == "fa4_sm90a_d64_bf16_noncausal_gqa1"
    assert KernelConfig(**WIDE).content_hash != KernelConfig(arch="sm_90a", head_dim=64).content_hash
    assert KernelConfig.from_dict(KernelConfig(**WIDE).to_dict()) == KernelConfig(**WIDE)


def test_api_config_follows_the_plan():
    from fa4gen.runtime import api, validate

    def prob(d, sq=4096, causal=True):
        return validate.Problem(batch=1, seqlen_q=sq, seqlen_k=sq, heads_q=4, heads_kv=1, head_dim=d, dtype="bf16",
                                causal=causal, softmax_scale=0.125, return_lse=False, device="cuda:0")
    assert api.config_for(prob(64)).block_m == 192
    assert api.config_for(prob(64)).name == "fa4_sm90a_d64_bf16_causal_gqa4_m192"
    assert api.config_for(prob(128)).block_m == 128
    # causal over fewer than 2048 packed rows (Sq * P, P = 4 here) keeps 128 rows; non-causal never does
    assert api.config_for(prob(64, sq=511)).block_m == 128
    assert api.config_for(prob(64, sq=512)).block_m == 192
    assert api.config_for(prob(64, sq=10, causal=False)).block_m == 192


def test_api_varlen_config_reads_the_longest_sequence():
    from fa4gen.runtime import api, launch, validate

    def prob(max_q, causal=True, d=64):
        return validate.VarlenProblem(batch=3, total_q=3 * max_q, total_k=3 * max_q, max_seqlen_q=max_q,
                                      max_seqlen_k=max_q, heads_q=4, heads_kv=1, head_dim=d, dtype="bf16",
                                      causal=causal, softmax_scale=0.125, return_lse=False, device="cuda:0",
                                      has_seqused_k=False)
    assert api.config_for(prob(8192)).block_m == 192
    assert api.config_for(prob(8192)).name == "fa4_sm90a_d64_bf16_causal_gqa4_varlen_m192"
    assert api.config_for(prob(511)).block_m == 128  # causal, 511 x 4 packed rows < 2048
    assert api.config_for(prob(100, causal=False)).block_m == 192
    assert api.config_for(prob(8192, d=128)).block_m == 128
    assert dict(launch.config_fields(prob(511)))["block_m"] == 128


def test_fast_path_gives_each_call_the_kernel_config_for_chooses(monkeypatch):
    """The per-process fast path memoises on everything config_for reads: a short causal D = 64 call
    made after a long one gets the 128-row kernel, not the 192-row one the long call loaded (the memo
    once keyed on (D, causal, G, dtype, device, varlen, page size) only, without the query length)."""
    from types import SimpleNamespace

    from fa4gen.runtime import launch, validate

    loaded = {}  # the registry: (config key, device) -> kernel

    def fake_get_kernel(cfg, dev):
        loaded[launch.registry_key(cfg, dev.index)] = cfg  # the "kernel" is its config
        return cfg, launch.LoadInfo(name=cfg.name, content_hash=cfg.content_hash, source="built")

    monkeypatch.setattr(launch, "get_kernel", fake_get_kernel)
    monkeypatch.setattr(launch, "KERNELS", SimpleNamespace(peek=loaded.get))
    monkeypatch.setattr(launch, "_fast", {})
    dev = SimpleNamespace(index=0)

    def prob(sq):
        return validate.Problem(batch=1, seqlen_q=sq, seqlen_k=sq, heads_q=4, heads_kv=4, head_dim=64, dtype="bf16",
                                causal=True, softmax_scale=0.125, return_lse=False, device="cuda:0")
    for sq in (8192, 512, 8192, 512, 4096, 100):
        kernel, _ = launch.kernel_for(prob(sq), dev)
        assert kernel == launch.config_for(prob(sq)), sq
        assert kernel.block_m == (192 if sq >= 2048 else 128), sq
    assert len(loaded) == 2  # one 192-row and one 128-row kernel, each built once


def test_short_causal_rule_is_in_packed_rows():
    assert q_tile_rows("sm_90a", 64, 1, causal=True, seqlen_q=1024) == 128
    assert q_tile_rows("sm_90a", 64, 1, causal=True, seqlen_q=2048) == 192
    assert q_tile_rows("sm_90a", 64, 8, causal=True, seqlen_q=256) == 192  # 2048 packed rows
    assert q_tile_rows("sm_90a", 64, 3, causal=True, seqlen_q=1024) == 128  # unpacked: P = 1
    assert q_tile_rows("sm_90a", 64, 1, causal=True) == 192  # no shape: the long-sequence choice


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [1, 3, 4, 8, 64])
def test_three_consumer_pipeline_verifies(causal, g):
    pipe = build_pipeline(KernelConfig(causal=causal, gqa_ratio=g, **WIDE))
    consumers = [r for r in pipe.roles if r.name.startswith("consumer")]
    assert [r.warps for r in consumers] == [(4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert {b.name: b.count for b in pipe.barriers}["k_empty"] == 12
    rep = verify(pipe)
    assert rep.ok, rep


def _three_consumer_ring(ptx: str) -> dict:
    """What the 192-row kernel's PTX says of its three consumers' named barriers (the walker's
    spelling: ids in %nb_<barrier>_<k> registers computed from the instance index %cw)."""
    nl = r"\n    "
    wrap = re.search(r"add\.u32 (%\w+), %cw, 1;" + nl + r"setp\.ge\.u32 (%\w+), \1, (\d+);" + nl +
                     r"@\2 sub\.u32 \1, \1, \3;" + nl + r"add\.u32 %nb_sched_1, \1, (\d+);", ptx)
    pre = re.search(r"setp\.ne\.u32 %p_c, %cw, (\d+);" + nl + r"@%p_c bra(?:\.uni)? (\$L\w+);\n(?:    //[^\n]*\n)?"
                    r"    bar\.arrive (\d+), 256;\n\2:", ptx)
    return {"sched_0": re.findall(r"add\.u32 %nb_sched_0, %cw, (\d+);", ptx),
            "sched_1": wrap and (int(wrap.group(3)), int(wrap.group(4))),  # (mod, base)
            "epi_0": re.findall(r"add\.u32 %nb_epi_0, %cw, (\d+);", ptx),
            "pre_arrive": pre and (int(pre.group(1)), int(pre.group(3)))}  # (instance, id)


RING = {"sched_0": ["1"], "sched_1": (3, 1), "epi_0": ["4"], "pre_arrive": (2, 1)}


def test_lowering_and_ptx_agree_on_three_consumers():
    from fa4gen.evidence.check import _Layout, _numbered, _read_roles
    from fa4gen.lower.sm90 import SPELLING
    from fa4gen.lower.walk import smem_layout

    cfg = KernelConfig(causal=True, gqa_ratio=4, **WIDE)
    ptx, man = build_sm90(cfg)
    pipe = build_pipeline(cfg)
    assert threads_of(cfg) == 512 and entry_regs_of(cfg) == 128
    assert man["threads_per_cta"] == 512 and ".maxntid 512, 1, 1" in ptx
    assert man["sm90"]["consumers"] == 3 and pipe.replicated[0].instances == 3
    # a causal kernel deals dynamically (plan.dynamic_tasks): its producer keeps 32 registers for the hand-off
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32 (\d+);", ptx) == [("dec", "32"), ("inc", "160")]
    assert 32 + 3 * 160 <= 4 * 128  # the launch pool covers the incs (a larger inc would block forever)
    static, _ = build_sm90(KernelConfig(gqa_ratio=4, **WIDE))  # non-causal: the static deal
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32 (\d+);", static) == [("dec", "24"), ("inc", "160")]
    # Q slots and the O staging are 192 rows (3 x 64), K/V stages 128 (the layout derived from the Pipeline)
    lay = smem_layout(pipe)
    assert lay.regions["Q"] == (0, 192 * 64 * 2, 2) and lay.regions["K"][1:] == (128 * 64 * 2, 3)
    assert lay.regions["O_smem"][1:] == (64 * 128, 3)  # one 64-row O staging per consumer
    got, _, _ = _read_roles(_numbered(ptx), pipe, _Layout.derived(pipe), SPELLING, to_ret=True)
    assert ("expect_tx", "q_full", ("q", 0), 24576, True) in [ev for _, ev in got["producer"][0]]
    assert man["tensor_maps"]["q"]["box"] == [64, 4, 1, 48, 1]  # 48 positions x 4 packed heads
    # the ring: 3 turn barriers (ids 1-3: consumer cw waits on 1 + cw, hands off on 1 + (cw + 1) mod 3),
    # epilogue ids 4-6 (4 + cw), consumer 2 pre-arrives on consumer 0's turn (id 1)
    assert _three_consumer_ring(ptx) == RING
    counts = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%bar\+\d+\], (\d+);", ptx)
    # full barriers 1, empty ones 4 x 3 warps; the dynamic deal's task_empty one per reading thread (3 x 128)
    assert set(counts) == {"1", "12", "384"} and counts.count("384") == 2  # its two task slots
    rep = check_ptx(ptx, man)
    assert rep.ok, rep.summary()


@pytest.mark.parametrize("edit", [
    ("setp.ge.u32 %pp0, %tmp0, 3;\n    @%pp0 sub.u32 %tmp0, %tmp0, 3;",
     "setp.ge.u32 %pp0, %tmp0, 2;\n    @%pp0 sub.u32 %tmp0, %tmp0, 2;"),  # a ring of two turns
    ("add.u32 %nb_epi_0, %cw, 4;", "add.u32 %nb_epi_0, %cw, 3;"),  # epilogue ids on the turns' 3
    ("setp.ne.u32 %p_c, %cw, 2;", "setp.ne.u32 %p_c, %cw, 1;"),  # consumer 1 pre-arrives
])
def test_three_consumer_ring_reading_catches_an_edit(edit):
    ptx, _ = build_sm90(KernelConfig(causal=True, gqa_ratio=4, **WIDE))
    bad = ptx.replace(*edit, 1)
    assert bad != ptx and _three_consumer_ring(ptx) == RING
    assert _three_consumer_ring(bad) != RING


def test_register_budget_is_checked_against_the_three_consumer_pool():
    cfg = KernelConfig(**WIDE)
    build_sm90(cfg, Sm90Options(consumer_regs=160))
    with pytest.raises(Sm90LoweringError, match="3 x consumer"):
        build_sm90(cfg, Sm90Options(consumer_regs=200))  # fits 2 consumers' pool, not 3


def test_launch_geometry_reads_the_tile_rows():
    _, man = build_sm90(KernelConfig(gqa_ratio=4, **WIDE))
    geo = launch_geometry(man, batch=2, num_heads_kv=3, seqlen_q=1000)
    assert geo.rows_per_tile == 48 and geo.num_m_blocks == 21  # ceil(1000 / 48)
    _, man128 = build_sm90(KernelConfig(arch="sm_90a", head_dim=64, gqa_ratio=4))
    assert launch_geometry(man128, batch=2, num_heads_kv=3, seqlen_q=1000).num_m_blocks == 32


def test_three_consumer_kernels_assemble_without_spills():
    from fa4gen.assemble.assemble import available_backends

    if not available_backends():
        pytest.skip("no PTX assembler")
    for causal in (False, True):
        res = codegen.build(KernelConfig(causal=causal, gqa_ratio=8, dtype="fp16", **WIDE), emit=("ptx", "cubin"))
        (ent,) = res.resources
        assert ent.spill_stores == 0 and ent.spill_loads == 0 and ent.stack_frame == 0


def test_cli_build_defaults_to_the_plans_tile(tmp_path):
    from click.testing import CliRunner

    from fa4gen.cli import main

    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--head-dim", "64", "--emit", "ptx", "--out",
                                  str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "fa4_sm90a_d64_bf16_noncausal_gqa1_m192.ptx").exists()
    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--head-dim", "64", "--block-m", "128", "--emit",
                                  "ptx", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "fa4_sm90a_d64_bf16_noncausal_gqa1.ptx").exists()
    r = CliRunner().invoke(main, ["build", "--head-dim", "64", "--block-m", "192", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "block_m=192" in r.output


def test_consumers_overlap_qk_with_pv_only_where_the_registers_allow():
    """plan.sm90_overlap: block t's QK beside block t-1's PV where SM90_MIN_REG_HEADROOM registers stay
    beside S, P and O; else (D 96 on 192 rows: 16 left) the PV first, then the QK, in the same turn."""
    from fa4gen.ir import build_pipeline
    from fa4gen.ir.core import If, Loop, LoopKind, Mma
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.plan import SM90_MIN_REG_HEADROOM, sm90_overlap, sm90_reg_floor, sm90_regs

    def rest_loop_mmas(cfg):
        prog = build_pipeline(cfg).role("consumer0").program
        task = next(st for st in prog if isinstance(st, Loop) and st.kind is LoopKind.TASKS)
        # the blocks of a consumer with rows: the task body's, or the then-branch of If ROWS_IN_SQ
        body = [b for st in task.body for b in (st.then if isinstance(st, If) else (st,))]
        loop = next(st for st in body if isinstance(st, Loop) and st.kind is LoopKind.KV_REST)
        return [op.kind for op in loop.body if isinstance(op, Mma)]

    for d, rows, overlap in ((64, 192, True), (96, 192, False), (96, 128, True), (128, 128, True), (256, 128, True)):
        cfg = KernelConfig(arch="sm_90a", head_dim=d, block_m=rows)
        assert sm90_overlap(cfg) is overlap, (d, rows)
        left = sm90_regs(cfg)[1] - sm90_reg_floor(d, cfg.block_n)
        assert (left >= SM90_MIN_REG_HEADROOM) is overlap
        assert rest_loop_mmas(cfg) == (["qk", "pv"] if overlap else ["pv", "qk"])
