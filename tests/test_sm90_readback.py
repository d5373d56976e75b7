"""Read-back: the sm_90a PTX's protocol instructions, in order, are the verified IR programs'.

The Hopper kernel's template spells the consumers' and the producer's code; the IR in
fa4gen/ir/sm90.py is what `verify` proves and the simulator executes. fa4gen.check (`fa4gen check`)
reads the PTX's barrier / wgmma-ordering / TMA instructions per role, with barrier, ring state and
parity, and compares them with the IR's op sequence, so the two cannot drift apart silently.
"""

import itertools

import pytest

from fa4gen import KernelConfig
from fa4gen.check import check_ptx
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import NamedArrive, NamedSync

sm90 = pytest.importorskip("fa4gen.lower.sm90")

def _kinds(text: str) -> list[str]:
    """Protocol token kinds of a piece of PTX (fa4gen.check's sm_90a reader)."""
    from fa4gen.check import _numbered, _sm90_tokens
    return [tok.split()[0] for _, tok in _sm90_tokens(_numbered(text), {})]


CONFIGS = [KernelConfig(arch="sm_90a", head_dim=d, causal=c, gqa_ratio=g)
           for d, c, g in itertools.product((64, 128), (False, True), (1, 4))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_consumer_and_producer_follow_the_ir(cfg):
    ptx, manifest = sm90.build_sm90(cfg)
    rep = check_ptx(ptx, manifest)
    assert rep.ok, rep.summary()
    assert rep.events["consumer0"] > 20 and rep.events["producer"] > 10
    pipe = build_pipeline(cfg)
    # role-specific ends: consumer 1 pre-arrives the ping-pong barrier, consumer 0 takes the last hand-off
    pre = _kinds(ptx[ptx.index("\n$L_c_task:") - 400:ptx.index("\n$L_c_task:")])
    assert pre[-1:] == ["bar.arrive"] and isinstance(pipe.role("consumer1").program[0], NamedArrive)
    i = ptx.index("\n$L_c_done:")
    post = _kinds(ptx[i:ptx.index("\n$L_producer:", i)])
    assert post[:1] == ["bar.sync"] and isinstance(pipe.role("consumer0").program[-2], NamedSync)


def test_readback_catches_a_dropped_wait_group():
    cfg = KernelConfig(arch="sm_90a")
    ptx, manifest = sm90.build_sm90(cfg)
    broken = ptx.replace("wgmma.wait_group.sync.aligned 1;", "// dropped", 1)
    rep = check_ptx(broken, manifest)
    assert not rep.ok and any("MmaWait" in str(d) for d in rep.differences)


@pytest.mark.parametrize("cfg", CONFIGS + [KernelConfig(arch="sm_90a", head_dim=64, kv_stages=4)],
                         ids=lambda c: c.name)
def test_ir_rings_are_the_kernels(cfg):
    """The verified pipeline has the Q and K/V ring depths the emitted kernel's SMEM plan uses."""
    _, manifest = sm90.build_sm90(cfg)
    plan = sm90.smem_plan(cfg)
    pipe = build_pipeline(cfg)
    slots = {r.name: r.slots for r in pipe.regions}
    assert (slots["Q"], slots["K"], slots["V"]) == (plan.q_stages, plan.kv_stages, plan.kv_stages)
    assert manifest["sm90"]["kv_stages"] == plan.kv_stages
