"""A trace of an emulated launch: what each warp issued, what it waited on and what the asynchronous
units did, in the emulator's time (machine.CTA.now: one unit per warp-instruction issued in the CTA).

Off by default: a launch records only when its Emulator's `trace` is a Recorder (harness.run_once's
`trace=`); the machine then reports to it at three points (a warp's burst of instructions, a blocked
warp released, an asynchronous operation scheduled) and otherwise runs unchanged. fa4gen/evidence/draw.py
draws the events as a timeline.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "Recorder", "ISSUE", "WAIT", "EXIT"]

ISSUE, WAIT, EXIT = "issue", "wait", "exit"  # a warp's events; an async operation's kind is its unit's


@dataclass(frozen=True)
class Event:
    """One thing that happened in CTA `cta` over [time, end].

    kind ISSUE: warp issued `count` instructions (end = time + count). WAIT: warp was blocked on
    `detail` (a barrier's name, "bar.sync ID" for a named barrier, or the wait instruction) from
    time until released at end; `barrier` is the waited-on mbarrier's SMEM address (None otherwise).
    EXIT: warp exited. Any other kind: an asynchronous operation ("TMA load", "tcgen05.mma", ...)
    the warp issued at time that lands at end; `barrier` is the mbarrier its landing completes
    (TMA loads, tcgen05.commit), detail names what it moves and where it arrives, line its PTX line.
    """

    cta: int
    time: int
    end: int
    warp: int
    kind: str
    detail: str = ""
    barrier: int | None = None
    line: int | None = None
    count: int = 0


class Recorder:
    """Collects the Events of a launch (mbarriers by the names the launch gave them, harness.barrier_names)."""

    def __init__(self):
        self.events: list[Event] = []
        self._open: dict = {}  # (cta, warp) -> (start, what it waits on, barrier address)

    def burst(self, cta: int, t: int, w, n: int) -> None:
        """Warp w issued n instructions from time t (the machine's scheduling quantum); it may now be
        blocked (a wait opens) or done."""
        if n:
            self.events.append(Event(cta, t, t + n, w.wid, ISSUE, count=n))
        blk = w.block
        if blk is not None:
            on = blk.on
            if on is None:
                what, addr = blk.what.split(": ")[0], None
            elif isinstance(on, int):
                what, addr = f"bar.sync {on}", None
            else:
                what, addr = on.name, on.addr
            self._open[(cta, w.wid)] = (t + n, what, addr)
        elif w.done:
            self.events.append(Event(cta, t + n, t + n, w.wid, EXIT))

    def unblock(self, cta: int, t: int, wid: int) -> None:
        start, what, addr = self._open.pop((cta, wid))
        self.events.append(Event(cta, start, max(t, start), wid, WAIT, what, addr))

    def async_op(self, cta: int, t: int, end: int, what: tuple) -> None:
        kind, line, wid = what[:3]
        b = what[3] if len(what) > 3 else None
        src = what[4] if len(what) > 4 else ""
        detail = " -> ".join(x for x in (src, b.name if b is not None else "") if x)
        self.events.append(Event(cta, t, end, -1 if wid is None else wid, kind, detail,
                                 b.addr if b is not None else None, line))
