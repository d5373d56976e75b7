"""Read-back: the sm_90a PTX's protocol instructions, in order, are the verified IR programs'.

The Hopper kernel's template spells the consumers' and the producer's code; the IR in
fa4gen/ir/sm90.py is what `verify` proves and the simulator executes. This test tokenises the PTX's
barrier / wgmma-ordering / TMA instructions per role and compares them with the IR's op sequence,
so the two cannot drift apart silently (a dropped wait, arrive or wait_group fails it).
"""

import itertools
import re

import pytest

from fa4gen import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import (Arrive, ExpectTx, FenceProxyAsync, If, Loop, LoopKind, Mma, MmaWait, NamedArrive,
                            NamedSync, TmaLoad, TmaStore, TmaStoreWait, Wait)

sm90 = pytest.importorskip("fa4gen.lower.sm90")

_PTX_TOKENS = [
    (re.compile(r"mbarrier\.try_wait"), "wait"),
    (re.compile(r"mbarrier\.arrive\.expect_tx"), "expect_tx"),
    (re.compile(r"mbarrier\.arrive\b"), "arrive"),
    (re.compile(r"\bbar\.sync\b"), "bar.sync"),
    (re.compile(r"\bbar\.arrive\b"), "bar.arrive"),
    (re.compile(r"wgmma\.commit_group"), "mma"),
    (re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)"), "wait_group {0}"),
    (re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global"), "tma_load"),
    (re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"), "tma_store"),
    (re.compile(r"cp\.async\.bulk\.wait_group\.read"), "tma_store_wait"),
    (re.compile(r"fence\.proxy\.async"), "fence"),
]


def ptx_tokens(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.split("//")[0]
        for rx, tok in _PTX_TOKENS:
            m = rx.search(line)
            if m:
                tok = tok.format(*m.groups())
                # one TMA box per 64-column half: several instructions are one IR copy
                if not (tok in ("tma_load", "tma_store") and out and out[-1] == tok):
                    out.append(tok)
                break
    return out


def ir_tokens(stmts, taken=lambda cond: True) -> list[str]:
    out = []
    for st in stmts:
        if isinstance(st, Loop):
            out += ir_tokens(st.body, taken)
        elif isinstance(st, If):
            out += ir_tokens(st.then if taken(st.cond) else st.orelse, taken)
        else:
            tok = {Wait: "wait", ExpectTx: "expect_tx", Arrive: "arrive", NamedSync: "bar.sync",
                   NamedArrive: "bar.arrive", Mma: "mma", TmaLoad: "tma_load", TmaStore: "tma_store",
                   TmaStoreWait: "tma_store_wait", FenceProxyAsync: "fence"}.get(type(st))
            if isinstance(st, MmaWait):
                tok = f"wait_group {st.pending}"
            if tok:
                out.append(tok)
    return out


def _section(ptx: str, start: str, end: str) -> str:
    i = ptx.index(f"\n{start}:")
    return ptx[i:ptx.index(f"\n{end}:", i)]


CONFIGS = [KernelConfig(arch="sm_90a", head_dim=d, causal=c, gqa_ratio=g)
           for d, c, g in itertools.product((64, 128), (False, True), (1, 4))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_consumer_and_producer_follow_the_ir(cfg):
    ptx, _ = sm90.build_sm90(cfg)
    pipe = build_pipeline(cfg)
    task_body = lambda role: next(st for st in pipe.role(role).program  # noqa: E731
                                  if isinstance(st, Loop) and st.kind is LoopKind.TASKS).body
    # consumers: one code path for both warpgroups; every data-dependent branch taken
    assert ptx_tokens(_section(ptx, "$L_c_task", "$L_c_done")) == ir_tokens(task_body("consumer0"))
    assert ir_tokens(task_body("consumer0")) == ir_tokens(task_body("consumer1"))
    assert ptx_tokens(_section(ptx, "$L_p_task", "$L_exit")) == ir_tokens(task_body("producer"))
    # role-specific ends: consumer 1 pre-arrives the ping-pong barrier, consumer 0 takes the last hand-off
    pre = ptx_tokens(ptx[ptx.index("\n$L_c_task:") - 400:ptx.index("\n$L_c_task:")])
    assert pre[-1:] == ["bar.arrive"] and ir_tokens(pipe.role("consumer1").program[:1]) == ["bar.arrive"]
    post = ptx_tokens(_section(ptx, "$L_c_done", "$L_producer"))
    assert post[:1] == ["bar.sync"] and ir_tokens(pipe.role("consumer0").program[-2:-1]) == ["bar.sync"]


def test_readback_catches_a_dropped_wait_group():
    cfg = KernelConfig(arch="sm_90a")
    ptx, _ = sm90.build_sm90(cfg)
    broken = ptx.replace("wgmma.wait_group.sync.aligned 1;", "// dropped", 1)
    body = next(st for st in build_pipeline(cfg).role("consumer0").program if isinstance(st, Loop)).body
    assert ptx_tokens(_section(broken, "$L_c_task", "$L_c_done")) != ir_tokens(body)


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
