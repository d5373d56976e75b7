"""Read-back: the sm_90a PTX's protocol instructions, in order, are the verified IR programs'.

The Hopper kernel is lowered from the IR in fa4gen/ir/sm90.py (what `verify` proves and the simulator
executes) by the shared statement walker (fa4gen/lower/walk.py, fa4gen/lower/sm90.py). fa4gen.evidence.check
(`fa4gen check`) reads the PTX's barrier / wgmma-ordering / TMA instructions back per role section
(`$L_role_<name>` .. its `ret`; the consumer warpgroups share one section, the replicated program,
read once per instance with the branches on its instance index %cw followed), with barrier, ring state
and parity, and compares them with the IR's op sequence, so the two cannot drift apart silently. The
role-specific ends of the consumer instances (which instance pre-arrives the ping-pong barrier, which
takes the last hand-off) are read here.
"""

import itertools

import re

import pytest

from fa4gen import KernelConfig
from fa4gen.evidence.check import check_ptx
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Cond, If, Loop, NamedArrive, NamedSync
from fa4gen.ir.sm90 import sm90_stages
from fa4gen.render.kernels import build_sm90
from fa4gen.spec.plan import dynamic_tasks

sm90 = pytest.importorskip("fa4gen.lower.sm90")


def _role_ends(ptx: str, manifest: dict, pipe) -> tuple[list, list]:
    """Each consumer instance's protocol events (fa4gen.evidence.check's reader, the instance's own branches
    followed) before its first wait and after its last advance: {instance: [event]} twice."""
    from fa4gen.evidence.check import _Layout, _numbered, _read_roles
    from fa4gen.lower.sm90 import SPELLING
    got, _, unreadable = _read_roles(_numbered(ptx), pipe, _Layout.derived(pipe), SPELLING, to_ret=True)
    assert not unreadable
    pre, post = {}, {}
    for name, (events, _) in got.items():
        if not name.startswith("consumer"):
            continue
        kinds = [ev[0] for _, ev in events]
        first = kinds.index("wait")
        last = len(kinds) - 1 - kinds[::-1].index("advance")
        pre[int(name[len("consumer"):])] = [ev for _, ev in events[:first]]
        post[int(name[len("consumer"):])] = [ev for _, ev in events[last + 1:]]
    return pre, post


CONFIGS = [KernelConfig(arch="sm_90a", head_dim=d, causal=c, gqa_ratio=g)
           for d, c, g in itertools.product((64, 128), (False, True), (1, 4))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_consumer_and_producer_follow_the_ir(cfg):
    ptx, manifest = build_sm90(cfg)
    rep = check_ptx(ptx, manifest)
    assert rep.ok, rep.summary()
    assert all(rep.events[f"consumer{i}"] > 20 for i in range(2)) and rep.events["producer"] > 10
    pipe = build_pipeline(cfg)
    (cons,) = pipe.replicated
    last = cons.instances - 1
    assert last >= 1
    # role-specific ends: the last consumer pre-arrives the ping-pong barrier (consumer 0's turn) before
    # its task loop, consumer 0 takes the last hand-off after it; the IR says the same
    pre, post = _role_ends(ptx, manifest, pipe)
    assert pre == {i: ([("bar_arrive", "sched", 0, False, 256)] if i == last else []) for i in range(last + 1)}
    assert post == {i: ([("bar_sync", "sched", 0, None, 256)] if i == 0 else []) + [("store_wait", True)]
                    for i in range(last + 1)}
    assert isinstance(cons.program[0], If) and cons.program[0].cond is Cond.LAST_INSTANCE
    assert isinstance(cons.program[-2], If) and cons.program[-2].cond is Cond.FIRST_INSTANCE
    assert isinstance(pipe.role(f"consumer{last}").program[0], NamedArrive)
    assert isinstance(pipe.role("consumer0").program[0], Loop)
    assert isinstance(pipe.role("consumer0").program[-2], NamedSync)
    assert not isinstance(pipe.role(f"consumer{last}").program[-2], NamedSync)


@pytest.mark.parametrize("edit", [
    ("setp.ne.u32 %p_c, %cw, 1;\n    @%p_c bra.uni $L_consumer_else", "setp.ne.u32 %p_c, %cw, 0;\n    @%p_c bra.uni "
     "$L_consumer_else"),  # consumer 0 would pre-arrive its own turn
    ("bar.arrive 1, 256;", "bar.arrive 2, 256;"),  # the pre-arrive on consumer 1's turn
])
def test_role_ends_catch_the_wrong_instance(edit):
    cfg = KernelConfig(arch="sm_90a", head_dim=128)
    ptx, manifest = build_sm90(cfg)
    pipe = build_pipeline(cfg)
    assert _role_ends(ptx, manifest, pipe)[0][1] == [("bar_arrive", "sched", 0, False, 256)]
    bad = ptx.replace(*edit, 1)
    assert bad != ptx
    assert _role_ends(bad, manifest, pipe)[0][1] != [("bar_arrive", "sched", 0, False, 256)]
    assert not check_ptx(bad, manifest).ok


def test_readback_catches_a_dropped_wait_group():
    cfg = KernelConfig(arch="sm_90a")
    ptx, manifest = build_sm90(cfg)
    broken = ptx.replace("wgmma.wait_group.sync.aligned 1;", "// dropped", 1)
    rep = check_ptx(broken, manifest)
    assert not rep.ok and any("MmaWait" in str(d) for d in rep.differences)


@pytest.mark.parametrize("cfg", CONFIGS + [KernelConfig(arch="sm_90a", head_dim=64, kv_stages=4)],
                         ids=lambda c: c.name)
def test_ir_rings_are_the_kernels(cfg):
    """The verified pipeline has the Q and K/V ring depths the emitted kernel initialises barriers for."""
    ptx, manifest = build_sm90(cfg)
    nq, kv = sm90_stages(cfg)
    pipe = build_pipeline(cfg)
    slots = {r.name: r.slots for r in pipe.regions}
    assert (slots["Q"], slots["K"], slots["V"]) == (nq, kv, kv)
    assert (manifest["sm90"]["q_stages"], manifest["sm90"]["kv_stages"]) == (nq, kv)
    # q_full / q_empty per Q slot, k/v full / empty per stage (and the dynamic deal's task_full /
    # task_empty per task slot, plan.dynamic_tasks): one mbarrier.init each
    tasks = {b.name: b.slots for b in pipe.barriers}.get("task_full", 0)
    assert (tasks > 0) == dynamic_tasks(cfg)
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64", ptx)) == 2 * nq + 4 * kv + 2 * tasks


def test_the_reader_knows_every_instruction_class_of_the_op_tables():
    """`fa4gen check` classifies instructions by each target's Spelling (lower/): every class an OP_PTX
    row names is one it reads, and the shared ones are spelled the same on both targets."""
    from fa4gen.lower import sm100
    for mod in (sm90, sm100):
        classes = [c for c, _, _ in mod.SPELLING.classes]
        assert len(set(classes)) == len(classes)
        for row in mod.OP_PTX.values():
            for cls in row:
                assert cls.rstrip("*") in classes, (mod.__name__, cls)
    assert sm90.SPELLING.classify("wgmma.commit_group.sync.aligned") == "wgmma.commit_group"
    assert sm90.SPELLING.classify("tcgen05.commit.cta_group::1.mbarrier::arrive::one.b64") is None
