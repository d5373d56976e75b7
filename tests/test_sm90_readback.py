"""Read-back: the sm_90a PTX's protocol instructions, in order, are the verified IR programs'.

The Hopper kernel is lowered from the IR in fa4gen/ir/sm90.py (what `verify` proves and the simulator
executes) by the shared statement walker (fa4gen/lower/walk.py, fa4gen/lower/sm90.py). fa4gen.check
(`fa4gen check`) reads the PTX's barrier / wgmma-ordering / TMA instructions back per role section
(`$L_role_<name>` .. `$L_<name>_end`; the consumer warpgroups share one section, the replicated
program), with barrier, ring state and parity, and compares them with the IR's op sequence, so the two
cannot drift apart silently. The role-specific ends of the consumer instances (which instance
pre-arrives the ping-pong barrier, which takes the last hand-off) are branches on the instance index
%cw that the check flattens: they are read here.
"""

import itertools
import re

import pytest

from fa4gen import KernelConfig
from fa4gen.check import check_ptx
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Cond, If, Loop, NamedArrive, NamedSync
from fa4gen.ir.sm90 import sm90_stages

sm90 = pytest.importorskip("fa4gen.lower.sm90")


def _consumer_lines(ptx: str) -> list:
    from fa4gen.check import _numbered, _section_lines
    lines = _section_lines(_numbered(ptx), "$L_role_consumer", "$L_consumer_end")
    assert lines, "no $L_role_consumer .. $L_consumer_end section"
    return lines


def _tokens_at(lines, pipe) -> list[tuple[int, str]]:
    """(PTX line, protocol token) of the consumer section (fa4gen.check's sm_90a reader), named ids
    resolved."""
    from fa4gen.check import _sm90_named_ids, _sm90_tokens
    role = pipe.replicated[0]
    named, _ = _sm90_named_ids(lines, pipe, role, role.warps[0] // 4)
    return _sm90_tokens(lines, role.name, pipe, named)


def _role_ends(ptx: str, pipe) -> tuple[list, list]:
    """The consumer section's protocol tokens before its task loop and after it, each with the instance
    that runs it: k for a token inside `setp.ne.u32 %p_c, %cw, k; @%p_c bra L; ... L:` (only
    instance k runs it), None for a token every instance runs."""
    lines = _consumer_lines(ptx)
    text = [t.strip() for _, t in lines]
    head = next(i for i, t in enumerate(text) if re.fullmatch(r"\$L_consumer_task\d+:", t))
    done = next(i for i, t in enumerate(text) if re.fullmatch(r"\$L_consumer_tasks_done\d+:", t))
    only = [None] * len(text)  # the instance a line is guarded to
    for i in range(len(text) - 1):
        m = re.fullmatch(r"setp\.ne\.u32 %p_c, %cw, (\d+);", text[i])
        b = re.fullmatch(r"@%p_c bra(?:\.uni)? (\$L\w+);", text[i + 1])
        if m and b:
            end = text.index(f"{b.group(1)}:", i + 2)
            for j in range(i + 2, end):
                only[j] = int(m.group(1))

    toks = {lines[j][0]: j for j in range(len(lines))}  # PTX line number -> index in the section
    got = [(toks[ln], tok) for ln, tok in _tokens_at(lines, pipe)]
    return ([(tok, only[j]) for j, tok in got if j < head],
            [(tok, only[j]) for j, tok in got if j > done])


CONFIGS = [KernelConfig(arch="sm_90a", head_dim=d, causal=c, gqa_ratio=g)
           for d, c, g in itertools.product((64, 128), (False, True), (1, 4))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_consumer_and_producer_follow_the_ir(cfg):
    ptx, manifest = sm90.build_sm90(cfg)
    rep = check_ptx(ptx, manifest)
    assert rep.ok, rep.summary()
    assert rep.events["consumer"] > 20 and rep.events["producer"] > 10
    pipe = build_pipeline(cfg)
    (cons,) = pipe.replicated
    last = cons.instances - 1
    assert last >= 1
    # role-specific ends: the last consumer pre-arrives the ping-pong barrier (consumer 0's turn) before
    # its task loop, consumer 0 takes the last hand-off after it; the IR says the same
    pre, post = _role_ends(ptx, pipe)
    assert pre == [("bar.arrive sched[0] 256", last)]
    assert post == [("bar.sync sched[0] 256", 0), ("tma_store_wait", None)]
    assert isinstance(cons.program[0], If) and cons.program[0].cond is Cond.LAST_INSTANCE
    assert isinstance(cons.program[-2], If) and cons.program[-2].cond is Cond.FIRST_INSTANCE
    assert isinstance(pipe.role(f"consumer{last}").program[0], NamedArrive)
    assert isinstance(pipe.role("consumer0").program[0], Loop)
    assert isinstance(pipe.role("consumer0").program[-2], NamedSync)
    assert not isinstance(pipe.role(f"consumer{last}").program[-2], NamedSync)


@pytest.mark.parametrize("edit", [
    ("setp.ne.u32 %p_c, %cw, 1;\n    @%p_c bra $L_consumer_else", "setp.ne.u32 %p_c, %cw, 0;\n    @%p_c bra "
     "$L_consumer_else"),  # consumer 0 would pre-arrive its own turn
    ("bar.arrive 1, 256;", "bar.arrive 2, 256;"),  # the pre-arrive on consumer 1's turn
])
def test_role_ends_catch_the_wrong_instance(edit):
    cfg = KernelConfig(arch="sm_90a", head_dim=128)
    ptx, _ = sm90.build_sm90(cfg)
    pipe = build_pipeline(cfg)
    assert _role_ends(ptx, pipe)[0] == [("bar.arrive sched[0] 256", 1)]
    bad = ptx.replace(*edit, 1)
    assert bad != ptx
    assert _role_ends(bad, pipe)[0] != [("bar.arrive sched[0] 256", 1)]


def test_readback_catches_a_dropped_wait_group():
    cfg = KernelConfig(arch="sm_90a")
    ptx, manifest = sm90.build_sm90(cfg)
    broken = ptx.replace("wgmma.wait_group.sync.aligned 1;", "// dropped", 1)
    rep = check_ptx(broken, manifest)
    assert not rep.ok and any("MmaWait" in str(d) for d in rep.differences)


@pytest.mark.parametrize("cfg", CONFIGS + [KernelConfig(arch="sm_90a", head_dim=64, kv_stages=4)],
                         ids=lambda c: c.name)
def test_ir_rings_are_the_kernels(cfg):
    """The verified pipeline has the Q and K/V ring depths the emitted kernel initialises barriers for."""
    ptx, manifest = sm90.build_sm90(cfg)
    nq, kv = sm90_stages(cfg)
    pipe = build_pipeline(cfg)
    slots = {r.name: r.slots for r in pipe.regions}
    assert (slots["Q"], slots["K"], slots["V"]) == (nq, kv, kv)
    assert (manifest["sm90"]["q_stages"], manifest["sm90"]["kv_stages"]) == (nq, kv)
    # q_full / q_empty per Q slot, k/v full / empty per stage: one mbarrier.init each
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64", ptx)) == 2 * nq + 4 * kv
