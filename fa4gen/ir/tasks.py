"""The dynamic deal's task hand-off (fa4gen/spec/plan.py dynamic_tasks), one definition for both
targets' pipelines: the role that loads Q/K/V fetches each task index from the launch's counter
(FetchTask) and publishes it in a slot of SMEM region T (PublishTask, then one arrival on task_full);
every other role with a task loop waits task_full, reads the index (ReadTask) and frees the slot (every
thread arrives on task_empty once its own read is done). The ops form the TASKS loop's `head`, which
runs before each exit test and once more for the index that ends the loop (ir/core.Loop)."""

from __future__ import annotations

import dataclasses

from .core import (Advance, Arrive, Barrier, BarrierKind, FetchTask, Loop, LoopKind, PublishTask, ReadTask, Region,
                   Role, Scope, Space, State, Wait)

TASK_SLOTS = 2  # the fetcher publishes task i + 1 while the other roles still run task i
STATE = "t"


def task_ring(reader_threads: int) -> tuple[tuple[Region, ...], tuple[Barrier, ...]]:
    """Region T (one 32-bit index per slot) and its barriers: task_full (the fetcher's one arrival) and
    task_empty (one arrival per reading thread: `reader_threads`, every thread of every reading role)."""
    return ((Region("T", Space.SMEM, "u32", 1, slots=TASK_SLOTS, bytes_per_slot=4),),
            (Barrier("task_full", BarrierKind.MBAR, TASK_SLOTS, 1),
             Barrier("task_empty", BarrierKind.MBAR, TASK_SLOTS, reader_threads)))


def task_state(start_phase: int) -> State:
    """A role's walk over the ring: 1 for the fetcher (it waits task_empty), 0 for the readers."""
    return State(STATE, TASK_SLOTS, start_phase)


def fetch_head() -> tuple:
    """The fetching role's head: the next index, into a slot the readers have freed, announced."""
    return (FetchTask(), Wait("task_empty", STATE), PublishTask("T", STATE), Arrive("task_full", STATE, Scope.ELECTED),
            Advance(STATE))


def read_head() -> tuple:
    """A reading role's head: the published index, then the slot handed back by every thread."""
    return (Wait("task_full", STATE), ReadTask("T", STATE), Arrive("task_empty", STATE, Scope.ALL), Advance(STATE))


def with_task_head(role: Role, fetcher: bool) -> Role:
    """`role` taking part in the hand-off: its TASKS loop gets the fetcher's or a reader's head and the
    role the ring's state. A role without a TASKS loop (an idle one) is returned as it is."""
    if not any(isinstance(st, Loop) and st.kind is LoopKind.TASKS for st in role.program):
        return role
    head = fetch_head() if fetcher else read_head()
    program = tuple(dataclasses.replace(st, head=head) if isinstance(st, Loop) and st.kind is LoopKind.TASKS else st
                    for st in role.program)
    return dataclasses.replace(role, states=role.states + (task_state(1 if fetcher else 0),), program=program)
