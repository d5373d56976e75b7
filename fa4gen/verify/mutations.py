"""The broken-pipeline corpus: mutations of the real pipelines that `verify` must reject.

Each Mutation names what it breaks and the finding (code, culprit) that must catch it. Tests run the
whole corpus; `fa4gen verify --mutation NAME` shows one report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..spec.plan import ARCH_LIMITS
from ..ir.core import (Arrive, Commit, Cond, ExpectTx, FetchTask, If, Loop, ReadTask, LoopKind, MmaWait, NamedArrive, NamedSync, Pipeline, Role, SmemSt,
                       State, TmaLoad, Wait, WaitLd, WaitSt, walk_ops)


def rewrite(program: tuple, fn: Callable) -> tuple:
    """Map every op through fn(op) -> tuple of ops (empty to drop it), keeping loop structure."""
    out = []
    for st in program:
        if isinstance(st, Loop):
            out.append(dataclasses.replace(st, body=rewrite(st.body, fn), head=rewrite(st.head, fn)))
        elif isinstance(st, If):
            out.append(dataclasses.replace(st, then=rewrite(st.then, fn), orelse=rewrite(st.orelse, fn)))
        else:
            out.extend(fn(st))
    return tuple(out)


def with_role(pipe: Pipeline, name: str, **changes) -> Pipeline:
    roles = tuple(dataclasses.replace(r, **changes) if r.name == name else r for r in pipe.roles)
    return dataclasses.replace(pipe, roles=roles)


def edit_program(pipe: Pipeline, role: str, fn: Callable) -> Pipeline:
    return with_role(pipe, role, program=rewrite(pipe.role(role).program, fn))


def drop_first(pred: Callable) -> Callable:
    """An op filter that drops only the first op matching pred (textual order)."""
    done = []

    def fn(op):
        if not done and pred(op):
            done.append(op)
            return ()
        return (op,)

    return fn


def with_barrier(pipe: Pipeline, name: str, **changes) -> Pipeline:
    bars = tuple(dataclasses.replace(b, **changes) if b.name == name else b for b in pipe.barriers)
    return dataclasses.replace(pipe, barriers=bars)


def with_region(pipe: Pipeline, name: str, **changes) -> Pipeline:
    regs = tuple(dataclasses.replace(r, **changes) if r.name == name else r for r in pipe.regions)
    return dataclasses.replace(pipe, regions=regs)


def with_states(pipe: Pipeline, role: str, fn: Callable[[State], State]) -> Pipeline:
    r = pipe.role(role)
    return with_role(pipe, role, states=tuple(fn(s) for s in r.states))


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    apply: Callable[[Pipeline], Pipeline]
    code: str  # the finding code that must appear
    culprit: str  # ... naming this barrier / region / role
    breaks_data: bool = False  # the simulator must diverge or report a hazard


def _overflowing_regs(pipe: Pipeline, role: str) -> int:
    """The least setmaxnreg (a multiple of 8, at most 256) for `role` that takes the CTA's registers
    (sum of setmaxnreg x threads) past the SM's register file, the others' budgets as they are."""
    others = sum(32 * len(r.warps) * r.regs for r in pipe.roles if r.name != role)
    threads = 32 * len(pipe.role(role).warps)
    need = (ARCH_LIMITS[pipe.arch].regs_per_sm - others) // threads + 1
    return min(256, -(-need // 8) * 8)


def _sscale_early(pipe: Pipeline) -> Pipeline:
    # softmax0 writes sScale before waiting for WG2 to hand the slot back
    def fn(op):
        if isinstance(op, Wait) and op.barrier == "softmax_corr_empty":
            return ()
        if isinstance(op, SmemSt) and op.region == "sScale":
            return (op, Wait("softmax_corr_empty", "ce"))
        return (op,)

    return edit_program(pipe, "softmax0", fn)


def _kv_empty_early(pipe: Pipeline) -> Pipeline:
    # the MMA warp releases the V stage (kv_empty commit) before issuing the PV MMA of Q tile 1
    def fn(op):
        if isinstance(op, Commit) and op.barrier == "kv_empty" and op.slot == "v":
            return ()
        if isinstance(op, Wait) and op.barrier == "p_o_rescale" and op.state == "por1":
            return (Commit("kv_empty", "v"), op)
        return (op,)

    return edit_program(pipe, "mma", fn)


def _kv_depth(pipe: Pipeline) -> Pipeline:
    # the load warp walks a ring one stage shorter than the MMA warp's
    return with_states(pipe, "load", lambda s: dataclasses.replace(s, depth=s.depth - 1) if s.name in ("k", "v") else s)


CORPUS: tuple[Mutation, ...] = (
    Mutation("dropped_wait_p_ready_2", "MMA issues the second PV part without waiting p_ready_2",
             lambda p: edit_program(p, "mma", drop_first(lambda op: isinstance(op, Wait) and op.barrier == "p_ready_2")),
             "HAZARD_RAW", "P0", breaks_data=True),
    Mutation("wrong_arrival_count", "p_o_rescale declared with 128 arrivals (softmax and WG2 bring 256)",
             lambda p: with_barrier(p, "p_o_rescale", count=128), "ARRIVAL_COUNT", "p_o_rescale"),
    Mutation("flipped_phase", "softmax0 waits s_ready starting at parity 1 (a producer's phase)",
             lambda p: with_states(p, "softmax0", lambda s: dataclasses.replace(s, start_phase=1) if s.name == "sr" else s),
             "PHASE_ROUND", "s_ready", breaks_data=True),
    Mutation("p_over_o", "P0 placed in O0's columns while still declared an alias of S0",
             lambda p: with_region(p, "P0", col=256), "TMEM_ALIAS", "P0"),
    Mutation("missing_wait_st", "softmax0 arrives p_o_rescale without tcgen05.wait::st after its P stores",
             lambda p: edit_program(p, "softmax0", drop_first(lambda op: isinstance(op, WaitSt))),
             "HAZARD_RAW", "P0", breaks_data=True),
    Mutation("missing_pre_arrival", "WG2 does not pre-arrive p_o_rescale[0] before the first PV MMA",
             lambda p: edit_program(p, "correction", drop_first(
                 lambda op: isinstance(op, Arrive) and op.barrier == "p_o_rescale" and op.slot == 0)),
             "DEADLOCK", "p_o_rescale"),
    Mutation("sscale_reused_early", "softmax0 rewrites sScale before softmax_corr_empty hands it back",
             _sscale_early, "HAZARD_WAR", "sScale", breaks_data=True),
    Mutation("kv_ring_depth_off_by_one", "the load warp's K/V ring is one stage shorter than the MMA warp's",
             _kv_depth, "DEADLOCK", "kv_full"),
    Mutation("register_budget", "WG2 asks the least setmaxnreg past the CTA's 65,536 registers (two softmax "
             "warpgroups: 72, 128 x (200 + 200 + 72 + 48) > 65,536; one Q tile: 248)",
             lambda p: with_role(p, "correction", regs=_overflowing_regs(p, "correction")), "REG_BUDGET", "cta"),
    Mutation("tmem_over_512", "O1 starts at column 480: its D columns run past the 512-column allocation",
             lambda p: with_region(p, "O1", col=480), "TMEM_BUDGET", "O1"),
    Mutation("named_barrier_count", "statistics named barrier declared with 192 threads",
             lambda p: with_barrier(p, "stats", count=192), "NAMED_COUNT", "stats"),
    Mutation("kv_read_after_empty", "PV MMA of Q tile 1 reads the V stage after its kv_empty commit",
             _kv_empty_early, "HAZARD_WAR", "KV", breaks_data=True),
    Mutation("dropped_wait_ld", "softmax0 uses S registers without tcgen05.wait::ld",
             lambda p: edit_program(p, "softmax0", drop_first(lambda op: isinstance(op, WaitLd))),
             "HAZARD_REG", "softmax0", breaks_data=True),
    Mutation("dropped_commit_s_ready", "MMA never commits its last Q tile's s_ready (s_ready[1] with two tiles)",
             lambda p: edit_program(p, "mma", lambda op: () if isinstance(op, Commit) and op.barrier == "s_ready"
                                    and op.slot == p.region("Q").slots - 1 else (op,)),
             "DEADLOCK", "s_ready"),
    Mutation("expect_tx_bytes", "the load warp announces half the Q bytes in expect_tx",
             lambda p: edit_program(p, "load", lambda op: (dataclasses.replace(op, bytes=op.bytes // 2),)
                                    if isinstance(op, ExpectTx) and op.barrier == "q_full" else (op,)),
             "TX_COUNT", "q_full"),
    Mutation("named_barrier_id_zero", "statistics barrier on hardware id 0 (__syncthreads')",
             lambda p: with_barrier(p, "stats", named_id=0), "NAMED_ID", "stats"),
    Mutation("dropped_named_sync", "WG2 reads sScale[0] without joining the statistics barrier",
             lambda p: edit_program(p, "correction", lambda op: () if isinstance(op, NamedSync) and op.slot == 0
                                    else (op,)),
             "NAMED_COUNT", "stats"),
)


def _sm90_pack_early(pipe: Pipeline) -> Pipeline:
    # rewrite P while the PV wgmma that reads it may still run: drop the K/V loop's wait_group 0
    def in_loop(st):
        if isinstance(st, Loop) and st.kind is LoopKind.KV_REST:
            return dataclasses.replace(st, body=tuple(op for op in st.body
                                                      if not (isinstance(op, MmaWait) and op.pending == 0)))
        if isinstance(st, Loop):
            return dataclasses.replace(st, body=tuple(in_loop(b) for b in st.body))
        if isinstance(st, If):  # the blocks of a consumer with rows (If ROWS_IN_SQ)
            return dataclasses.replace(st, then=tuple(in_loop(b) for b in st.then),
                                       orelse=tuple(in_loop(b) for b in st.orelse))
        return st

    return with_role(pipe, "consumer0", program=tuple(in_loop(st) for st in pipe.role("consumer0").program))


def _sm90_release_k_early(pipe: Pipeline) -> Pipeline:
    # consumer 1 hands the K stage back before wgmma.wait_group has retired the QK^T reading it
    def fn(op):
        if isinstance(op, MmaWait):
            return ()
        return (op,)

    return edit_program(pipe, "consumer1", fn)


def _sm90_idle_keeps_v(pipe: Pipeline) -> Pipeline:
    # consumer 1's barrier-only path (its rows all past Sq: If ROWS_IN_SQ's orelse) never hands a V
    # stage back: every v_empty arrival of that branch dropped
    def fn(st):
        return () if isinstance(st, Arrive) and st.barrier == "v_empty" else (st,)

    def branch(program):
        return tuple(dataclasses.replace(st, orelse=rewrite(st.orelse, fn)) if isinstance(st, If)
                     and st.cond is Cond.ROWS_IN_SQ else
                     dataclasses.replace(st, body=branch(st.body)) if isinstance(st, Loop) else st
                     for st in program)

    return with_role(pipe, "consumer1", program=branch(pipe.role("consumer1").program))


SM90_CORPUS: tuple[Mutation, ...] = (
    Mutation("sm90_pack_p_before_pv_done", "consumer0 rewrites the P registers while the PV wgmma reads them",
             _sm90_pack_early, "HAZARD_WAR", "P"),
    Mutation("sm90_release_k_before_wait", "consumer1 arrives k_empty without wgmma.wait_group",
             _sm90_release_k_early, "HAZARD_WAR", "K"),
    Mutation("sm90_no_pingpong_prearrive", "consumer1 does not pre-arrive, so consumer0 never gets the tensor core",
             lambda p: with_role(p, "consumer1", program=tuple(
                 st for st in p.role("consumer1").program if not isinstance(st, NamedArrive))),
             "DEADLOCK", "sched"),
    Mutation("sm90_q_empty_count", "q_empty declared with 4 arrivals (two consumers x 4 warps bring 8)",
             lambda p: with_barrier(p, "q_empty", count=4), "ARRIVAL_COUNT", "q_empty"),
)

# sm_90a mutations of what only KV-cache pipelines have (plan.sm90_idle_consumers: a consumer with no
# row before Sq keeps only the barrier steps); on another pipeline they change nothing
SM90_KV_CORPUS: tuple[Mutation, ...] = (
    Mutation("sm90_idle_keeps_v", "consumer1's path for a tile whose rows it has none of (all past Sq) never "
             "hands a V stage back", _sm90_idle_keeps_v, "DEADLOCK", "v_empty"),
)


def _v_load_k_tx(pipe: Pipeline) -> Pipeline:
    # the load warp's V loads announce K's tile bytes in expect_tx (one count for the whole ring)
    k_bytes = next(op.bytes for op in walk_ops(pipe.role("load").program)
                   if isinstance(op, TmaLoad) and op.tensor == "k")
    return edit_program(pipe, "load", lambda op: (dataclasses.replace(op, bytes=k_bytes),)
                        if isinstance(op, ExpectTx) and op.barrier == "kv_full" and op.slot == "v" else (op,))


# sm_100a mutations that need a pipeline whose K and V tiles differ (dv != d: (192, 128)); on a dv == d
# pipeline they change nothing
SM100_DV_CORPUS: tuple[Mutation, ...] = (
    Mutation("v_load_with_k_tx", "the V loads' expect_tx announces K's 48 KiB tile, not V's 32 KiB",
             _v_load_k_tx, "TX_COUNT", "kv_full"),
)


def _task_role(pipe: Pipeline, op_type) -> str | None:
    """The first role whose program has an op of op_type (the dynamic deal's fetcher: FetchTask; a
    reader: ReadTask), None where the pipeline deals its tasks statically."""
    return next((r.name for r in pipe.roles if any(isinstance(op, op_type) for op in walk_ops(r.program))), None)


def _drop_task_wait(pipe: Pipeline, op_type, barrier: str) -> Pipeline:
    role = _task_role(pipe, op_type)
    if role is None:
        return pipe
    return edit_program(pipe, role, drop_first(lambda op: isinstance(op, Wait) and op.barrier == barrier))


# Mutations of the dynamic deal's task hand-off (plan.dynamic_tasks: varlen pipelines, both targets; ir/tasks.py);
# on a statically dealt pipeline they change nothing
DYNAMIC_CORPUS: tuple[Mutation, ...] = (
    Mutation("task_read_before_full", "the first reading role reads the task index without waiting for task_full",
             lambda p: _drop_task_wait(p, ReadTask, "task_full"), "HAZARD_RAW", "T"),
    Mutation("task_publish_before_empty", "the fetching role publishes a task index without waiting for "
             "task_empty (over an index a reader has not read)",
             lambda p: _drop_task_wait(p, FetchTask, "task_empty"), "HAZARD_WAR", "T"),
    Mutation("task_empty_count", "task_empty declared with half the arrivals its readers bring",
             lambda p: with_barrier(p, "task_empty", count=p.barrier("task_empty").count // 2)
             if any(b.name == "task_empty" for b in p.barriers) else p, "ARRIVAL_COUNT", "task_empty"),
)


def by_name(name: str) -> Mutation:
    every = CORPUS + SM90_CORPUS + SM90_KV_CORPUS + DYNAMIC_CORPUS + SM100_DV_CORPUS
    for m in every:
        if m.name == name:
            return m
    raise KeyError(f"no mutation {name!r}; known: {', '.join(m.name for m in every)}")


__all__ = ["CORPUS", "DYNAMIC_CORPUS", "SM100_DV_CORPUS", "SM90_CORPUS", "SM90_KV_CORPUS", "Mutation", "by_name", "rewrite", "Role"]
