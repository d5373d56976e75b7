"""An interpreter for pipeline programs: the common core of `verify` and `simulate`.

It runs every role's program as a process, models the asynchronous units the way the PTX ISA
describes them, and records a happens-before relation with sparse vector clocks:

* roles are sequential agents (a warpgroup acts as one process: its threads run the same program);
* one tensor-core unit per issuing role executes its MMAs and tcgen05.commit arrivals in issue order
  (PTX ISA 9.0 "tcgen05 memory consistency": MMAs from one thread are pipelined in order and a commit
  tracks every prior async tcgen05 op of that thread);
* every TMA copy, tcgen05.ld and tcgen05.st is its own agent, completing at any point between its issue
  and the wait that forces it (complete_tx, wait::ld, wait::st, bulk wait_group);
* mbarriers count arrivals (and TMA transaction bytes) per phase; a wait joins the clock of the phase
  it observed; named barriers release when their thread count has arrived.

On top of that it checks: deadlock (nothing can move), phase rounds (every wait observes exactly the
phase its State intends, both in this run and, via happens-before, in every other order of the same
program), arrival counts (nothing left pending in a half-filled phase at the end, no transaction
overflow), named-barrier reuse, and data hazards on SMEM slots and TMEM columns (every read
happens-after the write it needs, every overwrite happens-after the earlier reads and writes).

The scheduler is pluggable: a seeded random choice among enabled steps, or a fixed priority order of
roles. Data effects are optional hooks (`DataModel`), used by the simulator.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from ..ir.core import (BarrierKind, BlockRef, Cond, If, Loop, LoopKind, MmaWait, NamedSync, Pipeline, Role,
                       Scope, Space, TmaStoreWait, Wait, WaitLd, WaitSt)


@dataclass(frozen=True)
class Finding:
    code: str  # e.g. DEADLOCK, PHASE_ROUND, ARRIVAL_COUNT, HAZARD_RAW, TMEM_BUDGET
    subject: str  # the barrier / region / role named as the culprit
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.subject}: {self.message}"


TMEM_GRANULE = 16


class VC:
    """Vector clock. Sequential agents (roles, tensor-core units) keep epochs in `seq`; agents with
    exactly one event (each TMA copy, tcgen05.ld/st) are a set `once`, so joins of the many
    asynchronous copies are C-speed set unions rather than a Python loop."""

    __slots__ = ("seq", "once")

    def __init__(self, seq=None, once=None):
        self.seq = {} if seq is None else seq
        self.once = set() if once is None else once

    def join(self, other: "VC") -> "VC":
        mine = self.seq
        for k, v in other.seq.items():
            if mine.get(k, 0) < v:
                mine[k] = v
        self.once |= other.once
        return self

    def copy(self) -> "VC":
        return VC(dict(self.seq), set(self.once))


class Label:
    """An event's description, formatted only when a finding quotes it (most runs quote none)."""

    __slots__ = ("role", "op", "task", "t", "suffix")

    def __init__(self, role: str, op, task, t, suffix: str = ""):
        self.role, self.op, self.task, self.t, self.suffix = role, op, task, t, suffix

    def __add__(self, more: str) -> "Label":
        return Label(self.role, self.op, self.task, self.t, self.suffix + more)

    def __str__(self) -> str:
        where = f"task {self.task}" + (f", block {self.t}" if self.t is not None else "")
        op = self.op if isinstance(self.op, str) else _op_str(self.op)
        return f"{self.role}: {op} ({where}){self.suffix}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


@dataclass
class Event:
    agent: str
    epoch: int
    vc: VC
    label: Label

    once: bool = False

    def hb(self, vc: VC) -> bool:
        """self happens-before a point whose clock is vc."""
        if self.once:
            return self.agent in vc.once
        return vc.seq.get(self.agent, 0) >= self.epoch


class _Agent:
    def __init__(self, name: str, once: bool = False):
        self.name = name
        self.epoch = 0
        self.once = once  # an agent of exactly one event
        self.vc = VC()

    def tick(self, label) -> Event:
        self.epoch += 1
        if self.once:
            if self.epoch > 1:
                raise AssertionError(f"single-event agent {self.name} ticked twice")
            self.vc.once.add(self.name)
        else:
            self.vc.seq[self.name] = self.epoch
        return Event(self.name, self.epoch, self.vc.copy(), label, self.once)


@dataclass
class _MbarSlot:
    count: int
    completed: int = 0
    arrived: int = 0
    tx: int = 0
    acc: VC = field(default_factory=VC)
    phase_vcs: list = field(default_factory=list)  # clock of each completed phase
    arrivals: dict = field(default_factory=lambda: defaultdict(list))  # phase -> [Event]
    who: dict = field(default_factory=lambda: defaultdict(set))  # phase -> roles that arrived in it


@dataclass
class _NamedInst:
    count: int
    arrived: int = 0
    roles: list = field(default_factory=list)
    acc: VC = field(default_factory=VC)
    generation: int = 0
    released_vc: dict = field(default_factory=dict)  # generation -> VC


@dataclass
class Scenario:
    """What the programs run over: a list of tasks, each with its number of K/V blocks (>= 1)."""

    blocks_per_task: tuple[int, ...]
    has_lse: bool = True
    split_kv: bool = False  # KV-cache kernels: the launch's num_splits > 1 (Cond.SPLIT_KV)
    idle_roles: tuple[str, ...] = ()  # roles whose rows are all past Sq (Cond.ROWS_IN_SQ false)


class DataModel:
    """Data effects; the verifier uses this no-op base, the simulator a NumPy one."""

    def cond(self, role: Role, cond: Cond, ctx: dict) -> bool:
        return True  # verifier: take every data-dependent branch (a superset of the accesses)

    def effect(self, kind: str, role: Role, op, ctx: dict, slots: dict) -> None:
        pass


class Deadlock(Exception):
    pass


class Engine:
    MAX_STEPS = 200_000

    def __init__(self, pipe: Pipeline, scenario: Scenario, data: DataModel | None = None,
                 seed: int = 0, priority: tuple[str, ...] | None = None):
        self.pipe = pipe
        self.sc = scenario
        self.data = data or DataModel()
        self.rng = random.Random(seed)
        # priority order of roles (roles the order omits come last, in pipeline order)
        self.priority = None if priority is None else tuple(priority) + tuple(
            r.name for r in pipe.roles if r.name not in priority)
        self.findings: list[Finding] = []
        self._seen: set = set()
        self.agents: dict[str, _Agent] = {}
        self.mbar: dict[tuple[str, int], _MbarSlot] = {}
        self.named: dict[tuple[str, int], _NamedInst] = {}
        for b in pipe.barriers:
            for s in range(b.slots):
                if b.kind is BarrierKind.NAMED:
                    self.named[(b.name, s)] = _NamedInst(b.count)
                else:
                    self.mbar[(b.name, s)] = _MbarSlot(b.count)
        self.async_q: list = []  # pending async events: dict(kind, ready(), fire())
        self.mma_queues: dict[str, list] = defaultdict(list)
        self.pending_ld: dict[str, list] = defaultdict(list)
        self.pending_st: dict[str, list] = defaultdict(list)
        self.pending_store: dict[str, list] = defaultdict(list)
        # hazard tracking: key -> (last write Event, [read Events since])
        self.mem: dict = {}
        self.reg_pending: dict = {}  # (role, reg) -> label of an incomplete tcgen05.ld into it
        self.wait_records: list = []  # (Event, barrier, slot, needed)
        self._done_vcs: dict = defaultdict(list)  # (role, "ld"|"st"|"store"|"mma") -> completed clocks
        self._sync_tokens: dict = {}  # role -> (NamedSync op, instances joined, generations awaited)
        self.procs = {}
        self._roles = {r.name: r for r in pipe.roles}
        self.advances: dict[str, dict[str, int]] = {}
        self.next_op: dict[str, tuple] = {}
        self.done: set[str] = set()
        self._tma_n = 0
        for role in pipe.roles:
            self.agents[role.name] = _Agent(role.name)
            self.advances[role.name] = defaultdict(int)
            self.procs[role.name] = self._program(role)
            self._pull(role.name, None)

    # ---- findings -------------------------------------------------------------------------------
    def find(self, code: str, subject: str, message: str) -> None:
        key = (code, subject)
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(Finding(code, subject, message))

    # ---- program walking ------------------------------------------------------------------------
    def _program(self, role: Role):
        ctx = {"task": 0, "n": self.sc.blocks_per_task[0], "t": None, "loop": None}
        yield from self._stmts(role, role.program, ctx)

    def _stmts(self, role, stmts, ctx):
        for st in stmts:
            if isinstance(st, Loop):
                if st.kind is LoopKind.TASKS:
                    for task, n in enumerate(self.sc.blocks_per_task):
                        yield from self._stmts(role, st.head, dict(ctx, task=task, n=n))
                        yield from self._stmts(role, st.body, dict(ctx, task=task, n=n))
                    # the head runs once more: the hand-off of the index that ends the loop
                    yield from self._stmts(role, st.head, dict(ctx, task=len(self.sc.blocks_per_task)))
                else:
                    start = 0 if st.kind is LoopKind.KV else 1
                    for t in range(start, ctx["n"]):
                        yield from self._stmts(role, st.body, dict(ctx, t=t, loop=st.kind))
            elif isinstance(st, If):
                if st.cond in (Cond.FIRST_BLOCK, Cond.NOT_FIRST_BLOCK, Cond.LAST_BLOCK):
                    t = 0 if ctx["t"] is None else ctx["t"]  # outside a K/V loop: the prologue's block 0
                    if st.cond is Cond.LAST_BLOCK:
                        taken = t == ctx["n"] - 1
                    else:
                        taken = (t == 0) == (st.cond is Cond.FIRST_BLOCK)
                elif st.cond is Cond.HAS_LSE:
                    taken = self.sc.has_lse
                elif st.cond is Cond.SPLIT_KV:
                    taken = self.sc.split_kv
                elif st.cond is Cond.ROWS_IN_SQ:
                    taken = role.name not in self.sc.idle_roles
                else:
                    taken = yield ("cond", st.cond, ctx)
                yield from self._stmts(role, st.then if taken else st.orelse, ctx)
            else:
                yield ("op", st, ctx)

    def _pull(self, rname: str, send):
        gen = self.procs[rname]
        try:
            item = gen.send(send) if send is not None else next(gen)
            while item[0] == "cond":
                ans = self.data.cond(self._roles[rname], item[1], item[2])
                item = gen.send(bool(ans))
            self.next_op[rname] = item[1:]
        except StopIteration:
            self.next_op.pop(rname, None)
            self.done.add(rname)

    # ---- helpers --------------------------------------------------------------------------------
    def slot(self, role: Role, s) -> int:
        if isinstance(s, int):
            return s
        return role.state(s).position(self.advances[role.name][s])[0]

    @staticmethod
    def block_index(ref: BlockRef, ctx: dict) -> int:
        t, n = ctx["t"], ctx["n"]
        return {BlockRef.FIRST: 0, BlockRef.LAST: n - 1, BlockRef.CUR: t,
                BlockRef.PREV: None if t is None else t - 1}[ref]

    def label(self, role: Role, op, ctx) -> Label:
        return Label(role.name, op, ctx["task"], ctx["t"])

    def _tmem_cols(self, region_name: str, lo: int, hi: int) -> range:
        r = self.pipe.region(region_name)
        if r.dtype == "f16":  # 16-bit view: element column c lives in physical column c // 2
            return range(r.col + lo // 2, r.col + (hi + 1) // 2)
        return range(r.col + lo, r.col + hi)

    def _keys(self, region_name: str, slot: int, lo=None, hi=None, owner: str = ""):
        r = self.pipe.region(region_name)
        if r.space is Space.REG:  # registers are private to the role that owns them
            return [("reg", owner, region_name)]
        if r.space is Space.TMEM:
            full = (0, 2 * r.cols if r.dtype == "f16" else r.cols)
            lo, hi = (full if lo is None else (lo, hi))
            cols = self._tmem_cols(region_name, lo, hi)
            # tracked in 16-column granules (every TMEM access of these kernels is 16-column aligned:
            # 32-column S/O loads, 16-column O rescale chunks, 32 fp16 = 16 physical P columns);
            # an unaligned access widens to whole granules, a conservative superset
            return [("tmem", g) for g in range(cols.start // TMEM_GRANULE, -(-cols.stop // TMEM_GRANULE))]
        return [(region_name, slot)]

    def access(self, ev: Event, keys, write: bool, region: str) -> None:
        for key in keys:
            last_w, reads = self.mem.get(key, (None, []))
            if last_w is not None and not last_w.hb(ev.vc):
                code = "HAZARD_WAW" if write else "HAZARD_RAW"
                self.find(code, region, f"{ev.label} is not ordered after the write by {last_w.label}")
            if write:
                for rd in reads:
                    if not rd.hb(ev.vc) and rd.agent != ev.agent:
                        self.find("HAZARD_WAR", region,
                                  f"{ev.label} may overwrite data before {rd.label} has read it")
                self.mem[key] = (ev, [])
            else:
                reads.append(ev)
                self.mem[key] = (last_w, reads)

    def new_async_agent(self, prefix: str, issue_vc: VC) -> _Agent:
        self._tma_n += 1
        a = _Agent(f"{prefix}#{self._tma_n}", once=True)
        a.vc = issue_vc.copy()
        self.agents[a.name] = a
        return a

    # ---- mbarriers -----------------------------------------------------------------------------
    def mbar_arrive(self, bname: str, slot: int, n: int, ev: Event, tx: int = 0, who: str = "") -> None:
        b = self.mbar[(bname, slot)]
        b.who[b.completed].add(who)
        b.arrived += n
        b.tx += tx
        b.acc.join(ev.vc)
        b.arrivals[b.completed].append(ev)
        if b.arrived > b.count:
            self.find("ARRIVAL_COUNT", bname,
                      f"slot {slot}: {b.arrived} arrivals in one phase, more than the declared count "
                      f"{b.count} (last by {ev.label})")
        self._maybe_complete(bname, slot)

    def mbar_tx_done(self, bname: str, slot: int, nbytes: int, ev: Event, who: str = "") -> None:
        b = self.mbar[(bname, slot)]
        b.who[b.completed].add(who)
        b.tx -= nbytes
        b.acc.join(ev.vc)
        b.arrivals[b.completed].append(ev)
        if b.tx < 0:
            self.find("TX_COUNT", bname, f"slot {slot}: TMA completed more bytes than expect_tx "
                                         f"announced ({ev.label})")
        self._maybe_complete(bname, slot)

    def _maybe_complete(self, bname, slot):
        b = self.mbar[(bname, slot)]
        if b.arrived >= b.count and b.tx <= 0:
            b.phase_vcs.append(b.acc.copy())
            b.completed += 1
            b.arrived -= b.count
            b.tx = 0
            b.acc = VC()

    # ---- stepping ------------------------------------------------------------------------------
    def _role_enabled(self, rname: str) -> bool:
        op, ctx = self.next_op[rname]
        check = _ENABLE_CHECKS.get(type(op))
        return True if check is None else check(self, rname, op)

    def _wait_enabled(self, rname: str, op) -> bool:
        st = self._roles[rname].state(op.state)
        p = st.start + st.stride * self.advances[rname][op.state]
        b = self.mbar[(op.barrier, st.slot_base + p % st.depth)]
        return b.completed % 2 != (p // st.depth + st.start_phase) % 2

    def _async_ready(self):
        ready = []
        for issuer, q in self.mma_queues.items():
            if q:
                ready.append(("mma", issuer))
        for rname, lst in self.pending_ld.items():
            ready += [("ld", rname, i) for i in range(len(lst))]
        for rname, lst in self.pending_st.items():
            ready += [("st", rname, i) for i in range(len(lst))]
        for rname, lst in self.pending_store.items():
            ready += [("store", rname, i) for i in range(len(lst))]
        ready += [("tma", i) for i in range(len(self.async_q))]
        return ready

    def run(self) -> list[Finding]:
        steps = 0
        while True:
            steps += 1
            if steps > self.MAX_STEPS:
                self.find("NO_PROGRESS", "engine", "step limit reached")
                break
            if not self._step():
                break
        self._arriver_checks()
        if self.next_op:
            self._report_deadlock()
        else:
            self._end_checks()
        self._phase_hb_checks()
        return self.findings

    def _step(self) -> bool:
        """Run one enabled role op or fire one pending completion; False when nothing can move."""
        if self.priority is not None:
            # the first enabled role in priority order; asynchronous units still move: with
            # probability 1/2 a pending completion fires first (so completions land late too)
            best = next((r for r in self.priority if r in self.next_op and self._role_enabled(r)), None)
            if best is not None and self.rng.random() >= 0.5:
                self._exec_role(best)
                return True
            asyncs = self._async_ready()
            if asyncs:
                self._fire(self.rng.choice(asyncs))
            elif best is not None:
                self._exec_role(best)
            return bool(asyncs) or best is not None
        roles = [r for r in self.next_op if self._role_enabled(r)]
        items = [("role", r) for r in roles] + [("async", a) for a in self._async_ready()]
        if not items:
            return False
        kind, what = self.rng.choice(items)
        self._exec_role(what) if kind == "role" else self._fire(what)
        return True

    def _arriver_checks(self):
        """Every completed phase must contain an arrival from each role that arrives on the slot:
        a phase completed by a subset means the declared count is smaller than what the programs
        arrive per round, and the rest spills into the next phase."""
        for (bname, slot), b in self.mbar.items():
            everyone = set().union(*b.who.values()) if b.who else set()
            for ph in range(b.completed):
                missing = everyone - b.who.get(ph, set())
                if missing:
                    self.find("ARRIVAL_COUNT", bname,
                              f"slot {slot}: phase {ph} completed (count {b.count}) before {sorted(missing)} "
                              f"arrived; their arrivals spill into the next phase")
                    break

    def _report_deadlock(self):
        blocked = []
        partial, empty = [], []
        for rname, (op, ctx) in sorted(self.next_op.items()):
            role = self._roles[rname]
            desc = str(self.label(role, op, ctx))
            if isinstance(op, Wait):
                st = role.state(op.state)
                adv = self.advances[rname][op.state]
                slot = st.position(adv)[0]
                b = self.mbar[(op.barrier, slot)]
                need = st.completions_needed(adv)
                desc += f" [slot {slot} parity {st.parity(adv)}; phases completed {b.completed}, " \
                        f"needs {need}; pending arrivals {b.arrived}/{b.count}]"
                if b.completed > need:
                    self.find("PHASE_OVERRUN", op.barrier,
                              f"slot {slot} completed {b.completed} phases but {rname} waits for the "
                              f"{need}-th: it was lapped and waits on the wrong parity forever")
                (partial if b.arrived else empty).append(op.barrier)
            elif isinstance(op, NamedSync):
                partial.append(op.barrier)
            blocked.append(desc)
        # the subject lists every barrier in the cycle, half-arrived ones (the likely culprits) first
        culprits = list(dict.fromkeys(partial + empty)) or ["pipeline"]
        self.find("DEADLOCK", ", ".join(culprits), "no role can proceed; blocked: " + "; ".join(blocked))

    def _end_checks(self):
        for (bname, slot), b in self.mbar.items():
            if b.arrived or b.tx:
                self.find("ARRIVAL_COUNT", bname,
                          f"slot {slot}: {b.arrived} arrivals (of {b.count}) left in an unfinished phase "
                          "after every role ended: the programs arrive a different number of times "
                          "than the declared count")
        for (bname, slot), inst in self.named.items():
            if inst.arrived:
                self.find("NAMED_COUNT", bname, f"instance {slot}: {inst.arrived} of {inst.count} threads "
                                                "arrived and nobody released them")

    def _phase_hb_checks(self):
        """The wait observed its intended phase here; prove it does in every order of this program:
        the phase two before must happen-before the wait (else it could pass one round early on the
        stale parity), and the phase after must happen-after it (else the waiter could be lapped)."""
        for ev, bname, slot, need in self.wait_records:
            b = self.mbar[(bname, slot)]
            if need >= 2 and need - 2 < len(b.phase_vcs):
                earlier = b.arrivals.get(need - 2, [])
                if earlier and not all(a.hb(ev.vc) for a in earlier):
                    self.find("PHASE_ROUND", bname,
                              f"slot {slot}: {ev.label} may pass on phase {need - 2} (same parity as the "
                              f"phase {need - 1} it intends): that phase is not ordered before the wait")
            nxt = b.arrivals.get(need, [])
            if nxt and need < len(b.phase_vcs) and not any(ev.hb(a.vc) for a in nxt):
                self.find("PHASE_ROUND", bname,
                          f"slot {slot}: phase {need} can complete before {ev.label} observes phase "
                          f"{need - 1}: the waiter can be lapped")

    # ---- role ops --------------------------------------------------------------------------------
    def _exec_role(self, rname: str) -> None:
        op, ctx = self.next_op[rname]
        role = self._roles[rname]
        agent = self.agents[rname]
        ev = agent.tick(self.label(role, op, ctx))
        slots = {}
        h = getattr(self, "_op_" + type(op).__name__)
        h(role, op, ctx, ev, slots)
        self._pull(rname, None)

    def _op_Wait(self, role, op, ctx, ev, slots):
        st = role.state(op.state)
        adv = self.advances[role.name][op.state]
        slot = st.position(adv)[0]
        b = self.mbar[(op.barrier, slot)]
        need = st.completions_needed(adv)
        if b.completed != need:
            self.find("PHASE_ROUND", op.barrier,
                      f"slot {slot}: {ev.label} passed with {b.completed} phases completed but intends "
                      f"to observe {need}")
        if b.completed >= 1:
            self.agents[role.name].vc.join(b.phase_vcs[b.completed - 1])
        ev.vc.join(self.agents[role.name].vc)
        self.wait_records.append((ev, op.barrier, slot, need))

    def _op_Arrive(self, role, op, ctx, ev, slots):
        n = {Scope.ALL: role.threads, Scope.WARP: len(role.warps), Scope.ELECTED: 1}[op.scope]
        slot = self.slot(role, op.slot)
        self.mbar_arrive(op.barrier, slot, n, ev, who=role.name)

    def _op_ExpectTx(self, role, op, ctx, ev, slots):
        self.mbar_arrive(op.barrier, self.slot(role, op.slot), 1, ev, tx=op.bytes, who=role.name)

    def _op_TmaLoad(self, role, op, ctx, ev, slots):
        dslot, bslot = self.slot(role, op.dst_slot), self.slot(role, op.bar_slot)
        agent = self.new_async_agent("tma", ev.vc)
        blk = self.block_index(op.block, ctx) if op.tensor != "q" else None
        label = ev.label

        def fire():
            e = agent.tick(label + " completes")
            self.access(e, self._keys(op.dst, dslot), True, op.dst)
            self.data.effect("tma_load", role, op, dict(ctx, block=blk), {"dst": dslot})
            self.mbar_tx_done(op.barrier, bslot, op.bytes, e, who=role.name)

        self.async_q.append(fire)

    def _op_Mma(self, role, op, ctx, ev, slots):
        aslot, bslot = self.slot(role, op.a_slot), self.slot(role, op.b_slot)
        blk = self.block_index(op.block, ctx)
        acc = {"true": True, "false": False, "not_first": blk != 0}[op.accumulate]
        label = ev.label
        issue_vc = ev.vc.copy()
        unit = self._mma_unit(role)

        def fire():
            unit.vc.join(issue_vc)
            e = unit.tick(label + " completes")
            if op.kind == "qk":
                self.access(e, self._keys(op.a, aslot, owner=role.name), False, op.a)
                self.access(e, self._keys(op.b, bslot, owner=role.name), False, op.b)
                self.access(e, self._keys(op.d, 0, owner=role.name), True, op.d)
            else:
                self.access(e, self._keys(op.a, 0, op.k_lo, op.k_hi, owner=role.name), False, op.a)
                self.access(e, self._keys(op.b, bslot, owner=role.name), False, op.b)
                if acc:
                    self.access(e, self._keys(op.d, 0, owner=role.name), False, op.d)
                self.access(e, self._keys(op.d, 0, owner=role.name), True, op.d)
            self.data.effect("mma", role, op, dict(ctx, block=blk, accumulate=acc), {"a": aslot, "b": bslot})
            self._done_vcs[(role.name, "mma")].append(e.vc)

        self.mma_queues[role.name].append(fire)

    def _mma_unit(self, role) -> _Agent:
        name = f"tensorcore@{role.name}"
        if name not in self.agents:
            self.agents[name] = _Agent(name)
        return self.agents[name]

    def _op_MmaWait(self, role, op, ctx, ev, slots):
        self._join_done(role, "mma")
        ev.vc.join(self.agents[role.name].vc)

    def _op_Commit(self, role, op, ctx, ev, slots):
        slot = self.slot(role, op.slot)
        issue_vc = ev.vc.copy()
        unit = self._mma_unit(role)
        label = ev.label

        def fire():
            unit.vc.join(issue_vc)
            e = unit.tick(label + " fires")
            self.mbar_arrive(op.barrier, slot, 1, e, who=role.name)

        self.mma_queues[role.name].append(fire)

    def _op_TmemLd(self, role, op, ctx, ev, slots):
        agent = self.new_async_agent("tcgen05.ld", ev.vc)
        label = ev.label
        self.reg_pending[(role.name, op.dst)] = label

        def fire():
            e = agent.tick(label + " completes")
            self.access(e, self._keys(op.region, 0, op.col_lo, op.col_hi), False, op.region)
            self.data.effect("tmem_ld", role, op, ctx, {})
            return e

        self.pending_ld[role.name].append(fire)

    def _op_TmemSt(self, role, op, ctx, ev, slots):
        self._check_regs(role, (op.src,), ev)
        agent = self.new_async_agent("tcgen05.st", ev.vc)
        label = ev.label
        snapshot = self.data.effect("tmem_st_issue", role, op, ctx, {})

        def fire():
            e = agent.tick(label + " completes")
            self.access(e, self._keys(op.region, 0, op.col_lo, op.col_hi), True, op.region)
            self.data.effect("tmem_st", role, op, dict(ctx, snapshot=snapshot), {})
            return e

        self.pending_st[role.name].append(fire)

    def _check_regs(self, role, regs, ev):
        for r in regs:
            lbl = self.reg_pending.get((role.name, r))
            if lbl is not None:
                self.find("HAZARD_REG", role.name,
                          f"{ev.label} uses register buffer {r!r} before tcgen05.wait::ld completed {lbl}")

    def _op_WaitLd(self, role, op, ctx, ev, slots):
        for (rn, reg) in [k for k in self.reg_pending if k[0] == role.name]:
            del self.reg_pending[(rn, reg)]
        self._join_done(role, "ld")
        ev.vc.join(self.agents[role.name].vc)

    def _op_WaitSt(self, role, op, ctx, ev, slots):
        self._join_done(role, "st")
        ev.vc.join(self.agents[role.name].vc)

    def _join_done(self, role, kind):
        key = (role.name, kind)
        for vc in self._done_vcs.pop(key, []):
            self.agents[role.name].vc.join(vc)


    def _op_SmemSt(self, role, op, ctx, ev, slots):
        self._check_regs(role, (op.src,), ev)
        slot = self.slot(role, op.slot)
        self.access(ev, self._keys(op.region, slot), True, op.region)
        self.data.effect("smem_st", role, op, ctx, {"slot": slot})

    def _op_SmemLd(self, role, op, ctx, ev, slots):
        slot = self.slot(role, op.slot)
        self.access(ev, self._keys(op.region, slot), False, op.region)
        self.data.effect("smem_ld", role, op, ctx, {"slot": slot})

    def _op_FenceProxyAsync(self, role, op, ctx, ev, slots):
        pass

    def _op_FetchTask(self, role, op, ctx, ev, slots):
        pass  # a global atomic into a register: no SMEM, TMEM or barrier

    def _op_PublishTask(self, role, op, ctx, ev, slots):
        slot = self.slot(role, op.slot)
        self.access(ev, self._keys(op.region, slot), True, op.region)

    def _op_ReadTask(self, role, op, ctx, ev, slots):
        slot = self.slot(role, op.slot)
        self.access(ev, self._keys(op.region, slot), False, op.region)

    def _op_TmaStore(self, role, op, ctx, ev, slots):
        slot = self.slot(role, op.src_slot)
        agent = self.new_async_agent("tma.store", ev.vc)
        label = ev.label

        def fire():
            e = agent.tick(label + " completes")
            self.access(e, self._keys(op.src, slot), False, op.src)
            self.data.effect("tma_store", role, op, ctx, {"slot": slot})
            return e

        self.pending_store[role.name].append(fire)

    def _op_StoreRows(self, role, op, ctx, ev, slots):
        # the role's own threads read the slot (ld.shared) and write global memory: synchronous
        slot = self.slot(role, op.src_slot)
        self.access(ev, self._keys(op.src, slot), False, op.src)
        self.data.effect("store_rows", role, op, ctx, {"slot": slot})

    def _op_PageLookup(self, role, op, ctx, ev, slots):
        pass  # global reads into the role's registers: nothing the protocol or the hazards see

    def _op_StorePartial(self, role, op, ctx, ev, slots):
        # the role's threads store registers to global memory: no SMEM/TMEM access; the registers
        # must have arrived (tcgen05.wait::ld after their tcgen05.ld)
        self._check_regs(role, (op.src,), ev)
        self.data.effect("store_partial", role, op, ctx, {})

    def _op_StoreO(self, role, op, ctx, ev, slots):
        # as StorePartial: registers to global memory, after their tcgen05.wait::ld
        self._check_regs(role, (op.src,), ev)
        self.data.effect("store_o", role, op, ctx, {})

    def _op_TmaStoreWait(self, role, op, ctx, ev, slots):
        self._join_done(role, "store")
        ev.vc.join(self.agents[role.name].vc)

    def _op_Advance(self, role, op, ctx, ev, slots):
        self.advances[role.name][op.state] += 1

    def _op_Compute(self, role, op, ctx, ev, slots):
        self._check_regs(role, op.reads, ev)
        reg_regions = {r.name for r in self.pipe.regions if r.space is Space.REG}
        for name in op.reads:
            if name in reg_regions:
                self.access(ev, [("reg", role.name, name)], False, name)
        for name in op.writes:
            if name in reg_regions:
                self.access(ev, [("reg", role.name, name)], True, name)
        self.data.effect("compute", role, op, ctx, {})

    def _named_instances(self, op, role):
        b = self.pipe.barrier(op.barrier)
        slot = self.slot(role, op.slot)
        if b.per_warp:  # instance stage*4 + warp, 32 threads each
            return [(op.barrier, slot * 4 + w) for w in range(4)], 32
        return [(op.barrier, slot)], role.threads

    def _named_arrive(self, role, op, ev):
        keys, n = self._named_instances(op, role)
        for key in keys:
            inst = self.named[key]
            if role.name in inst.roles:
                self.find("NAMED_OVERRUN", op.barrier,
                          f"instance {key[1]}: {ev.label} arrives again before the previous use was released "
                          "(named barriers have no phase: the counts of two uses merge)")
            inst.roles.append(role.name)
            inst.arrived += n
            inst.acc.join(ev.vc)
            if inst.arrived > inst.count:
                self.find("NAMED_COUNT", op.barrier, f"instance {key[1]}: {inst.arrived} threads arrived, "
                                                      f"declared {inst.count}")
            if inst.arrived >= inst.count:
                inst.released_vc[inst.generation] = inst.acc.copy()
                inst.generation += 1
                inst.arrived, inst.roles, inst.acc = 0, [], VC()
        return keys

    def _op_NamedArrive(self, role, op, ctx, ev, slots):
        self._named_arrive(role, op, ev)

    def _named_sync_ready(self, role, op) -> bool:
        # bar.sync = arrive + wait: the engine performs the arrive when the op is first reached,
        # then the op stays blocked until every instance it joined has released that generation.
        token = self._sync_tokens.get(role.name)
        if token is None or token[0] is not op:
            ev = self.agents[role.name].tick(Label(role.name, "bar.arrive part of bar.sync", "-", None))
            keys = self._named_arrive(role, op, ev)
            gens = [self.named[k].generation - (0 if role.name in self.named[k].roles else 1) for k in keys]
            token = (op, keys, gens)
            self._sync_tokens[role.name] = token
        _, keys, gens = token
        return all(self.named[k].generation > g for k, g in zip(keys, gens))


    def _op_NamedSync(self, role, op, ctx, ev, slots):
        _, keys, gens = self._sync_tokens.pop(role.name)
        for k, g in zip(keys, gens):
            self.agents[role.name].vc.join(self.named[k].released_vc[g])
        ev.vc.join(self.agents[role.name].vc)

    # ---- async completions ---------------------------------------------------------------------
    def _fire(self, a) -> None:
        kind = a[0]
        if kind == "mma":
            self.mma_queues[a[1]].pop(0)()
        elif kind == "tma":
            self.async_q.pop(a[1])()
        else:
            lst = {"ld": self.pending_ld, "st": self.pending_st, "store": self.pending_store}[kind][a[1]]
            e = lst.pop(a[2])()
            self._done_vcs[(a[1], kind)].append(e.vc)


_ENABLE_CHECKS = {
    Wait: Engine._wait_enabled,
    NamedSync: lambda e, r, op: e._named_sync_ready(e._roles[r], op),
    WaitLd: lambda e, r, op: not e.pending_ld[r],
    WaitSt: lambda e, r, op: not e.pending_st[r],
    TmaStoreWait: lambda e, r, op: not e.pending_store[r],
    MmaWait: lambda e, r, op: len(e.mma_queues[r]) <= op.pending,
}


def _op_str(op) -> str:
    name = type(op).__name__
    parts = []
    for k in ("barrier", "state", "slot", "tensor", "kind", "region", "fn", "a", "d", "k_lo", "k_hi",
              "col_lo", "col_hi", "qtile"):
        if hasattr(op, k):
            parts.append(f"{k}={getattr(op, k)}")
    return f"{name}({', '.join(parts)})"
