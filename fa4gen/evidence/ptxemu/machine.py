"""One CTA of a PTX kernel on the CPU: warps in SIMT lock-step over NumPy lanes, shared memory,
Tensor Memory, mbarriers and named barriers, and the asynchronous units (TMA, tcgen05.mma,
tcgen05.ld/st, wgmma, bulk stores) as agents whose completions land at seeded random times.

Visibility is tracked, not assumed. Every shared-memory byte and TMEM cell carries a guard: what a
reader must have observed before it may read it (a phase of an mbarrier, the completion of a
tensor-core pipe up to an MMA, another warp's stores released through a barrier, ...). Warps carry
knowledge (a vector clock keyed by those sources) that flows through mbarrier arrivals and phase
completions, named barriers and tcgen05.commit; a read whose guard is not in the reader's
knowledge, or of bytes an async unit is still writing, is a Fault with the PTX line, warp, lane and
address. Registers that an async op will write (tcgen05.ld, wgmma accumulators) are poisoned until
the matching wait. So an unordered read fails loudly instead of passing by luck.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .coverage import ENABLED, FALLTHROUGH, TAKEN
from .parse import Instr, Module

WARP = 32
SMEM_BASE = 16  # the dynamic window starts 16 B past a 1024 B boundary: the kernel must align it
PARAM_BASE = 0x7F00_0000_0000
# The machine model's own numbers, deliberately not read from the generator's table (plan.ARCH_LIMITS)
# nor from fa4gen.spec.encodings: the emulator is a second opinion on the kernels the generator derives
# from those, so a wrong limit there is not silently accepted here (tests/test_ptxemu.py holds the two
# equal, so neither drifts unseen).
TMEM_LANES, TMEM_COLS = 128, 512  # Tensor Memory of one CTA (sm_100a): 128 lanes x 512 32-bit columns
TMEM_ALLOC_MIN = 32  # tcgen05.alloc: a power of two in [TMEM_ALLOC_MIN, TMEM_COLS]
REGS_PER_SM = 65536  # 32-bit registers a CTA's warps share (both targets)
MAX_REGS_PER_THREAD = 255  # what ptxas gives one thread at most

_U32, _S32, _F32, _U64, _S64, _U16, _S16 = (np.uint32, np.int32, np.float32, np.uint64, np.int64,
                                           np.uint16, np.int16)
_DT = {"u32": _U32, "b32": _U32, "s32": _S32, "f32": _F32, "u64": _U64, "b64": _U64, "s64": _S64,
       "u16": _U16, "b16": _U16, "s16": _S16, "f16": _U16, "bf16": _U16, "pred": np.bool_,
       "f16x2": _U32, "bf16x2": _U32, "u8": np.uint8, "s8": np.int8, "b8": np.uint8}
_STORE = {1: np.bool_, 2: _U16, 4: _U32, 8: _U64}
_WIDTH = {"pred": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "b32": 4, "u32": 4, "s32": 4,
          "f32": 4, "f16x2": 4, "bf16x2": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


class Fault(Exception):
    def __init__(self, kind: str, message: str, *, line=None, warp=None, lane=None, addr=None, text=None):
        self.kind, self.message, self.line, self.warp, self.lane, self.addr, self.text = (
            kind, message, line, warp, lane, addr, text)
        where = []
        if line is not None:
            where.append(f"PTX line {line}")
        if warp is not None:
            where.append(f"warp {warp}")
        if lane is not None:
            where.append(f"lane {lane}")
        if addr is not None:
            where.append(f"address {addr:#x}" if isinstance(addr, int) else f"address {addr}")
        super().__init__(f"{kind}: {message}" + (f" ({', '.join(where)})" if where else "")
                         + (f"\n    {text}" if text else ""))


# Reductions over one warp's 32 lanes run once or more per emulated instruction: np.count_nonzero is
# a plain C call (~0.3 us) where ndarray.any()/.all() go through NumPy's Python-level reduction
# wrappers (~1.5-2.5 us). Same answers on bool lane vectors.
_cnz = np.count_nonzero
_NO_LANES = np.zeros(WARP, np.bool_)  # the executing lanes of an instruction no lane executes
_NO_LANES.flags.writeable = False


def distinct_ids(ids: np.ndarray) -> list:
    """np.unique(ids) as Python ints, for guard-id arrays (small non-negative ints, often one value):
    min/max or a bincount instead of np.unique's sort, the guard checks' hot spot on whole tiles."""
    if ids.size == 0:
        return []
    lo, hi = int(ids.min()), int(ids.max())
    if lo == hi:
        return [lo]
    if lo < 0 or hi > 4 * ids.size + 4096:
        return [int(g) for g in np.unique(ids)]
    return np.flatnonzero(np.bincount(ids.reshape(-1))).tolist()


# ---- knowledge (vector clocks) ------------------------------------------------------------------
def _join(dst: dict, src: dict) -> None:
    """dst[k] = max(dst[k], src[k]) over src's keys (a missing key is below every value: values are >= 0)."""
    if not dst:  # a fresh accumulator (a phase's first arrival): the join is a copy
        dst.update(src)
        return
    get = dst.get  # bound once: joins of whole clocks run per arrival and barrier
    for k, v in src.items():
        if get(k, -1) < v:
            dst[k] = v


@dataclass
class Block:
    """Why a warp is not runnable, and what happens when it may go on."""
    ready: object  # callable -> bool
    what: str
    release: object = None  # callable run once when ready
    on: object = None  # what it waits on, for a trace (trace.py): an MBar, or a named barrier's id


@dataclass
class MBar:
    addr: int
    name: str
    count: int
    pending: int
    tx: int = 0
    phase: int = 0  # completed phases
    version: int = 0
    acc: dict = field(default_factory=dict)
    know: dict = field(default_factory=dict)  # knowledge released by the last completed phase
    init_by: int = -1  # the warp whose mbarrier.init made it (others must have synchronised since)
    init_epoch: int = 0
    seen: int = 0  # phases a successful wait has observed (try_wait true once phase k - 1 completed)
    tx_line: int | None = None  # the TMA load that last landed bytes in the current phase
    tx_done: tuple | None = None  # (phase, PTX line) of the last phase a TMA load's bytes completed

    def state(self) -> str:
        return (f"{self.name}: phase {self.phase} (parity {self.phase & 1} pending), "
                f"{self.pending}/{self.count} arrivals outstanding, tx-count {self.tx}")


@dataclass
class NamedBar:
    id: int
    count: int = 0
    arrived: int = 0
    waiters: list = field(default_factory=list)
    acc: dict = field(default_factory=dict)
    generation: int = 0


class Warp:
    def __init__(self, cta: "CTA", wid: int, nthreads: int):
        self.cta, self.wid = cta, wid
        n = min(WARP, max(nthreads - wid * WARP, 0))
        self.alive = np.arange(WARP) < n
        self.full = n == WARP  # every lane alive: the common case skips mask reductions
        self.pc = 0
        self.pcs = np.zeros(WARP, np.int64)
        self.div = False
        self.done = not self.alive.any()
        self.regs: dict = {}
        self.poison: dict = {}  # reg -> (kind "rw"|"w", what, line)
        self.block: Block | None = None
        self.know: dict = {("w", wid): 0}
        self.epoch = 0
        self.steps = 0
        # async bookkeeping
        # tcgen05 ordering across thread synchronisation (PTX ISA, tcgen05 memory consistency):
        # what a warp acquired reaches its later tcgen05 ops only through
        # tcgen05.fence::after_thread_sync (tc_view is w.know as of the last one), and its own
        # tcgen05 completions (wait::st) are released to others only through
        # tcgen05.fence::before_thread_sync (tc_unpublished until then). own_tc: its own, always seen.
        self.tc_view: dict = {}
        self.tc_unpublished: dict = {}
        self.own_tc: dict = {}
        self.tc_pending = 0  # tcgen05.ld in flight
        self.tc_ld_regs: list = []
        self.st_seq = 0  # tcgen05.st issued / landed, in order
        self.st_landed = 0
        self.st_tail = 0  # time this warp's stores are busy until
        self.ld_seq = 0  # tcgen05.ld issued
        self.mma_seq = 0
        self.mma_tail = 0  # time the pipe is busy until
        self.bulk_groups: list = []  # committed bulk-store groups
        self.bulk_open: list = []
        self.bulk_seq = 0
        self.wg_groups: list = []
        self.wg_open: list = []
        self.wg_seq = 0
        self.wg_fence: dict | None = None  # reg -> its vector at the last wgmma.fence (None: none yet)
        self.regbudget = None
        lane = np.arange(WARP, dtype=np.uint32)
        self.sregs = {
            "%tid.x": (lane + np.uint32(wid * WARP)).astype(_U32), "%tid.y": np.zeros(WARP, _U32),
            "%tid.z": np.zeros(WARP, _U32), "%laneid": lane, "%warpid": np.full(WARP, wid, _U32),
            "%ntid.x": np.full(WARP, nthreads, _U32), "%ntid.y": np.ones(WARP, _U32), "%ntid.z": np.ones(WARP, _U32),
            "%ctaid.x": np.full(WARP, cta.ctaid, _U32), "%ctaid.y": np.zeros(WARP, _U32),
            "%ctaid.z": np.zeros(WARP, _U32), "%nctaid.x": np.full(WARP, cta.nctas, _U32),
            "%nctaid.y": np.ones(WARP, _U32), "%nctaid.z": np.ones(WARP, _U32),
            "%nwarpid": np.full(WARP, 64, _U32),
        }

    def tmem_knowledge(self) -> dict:
        """What this warp's tcgen05 ops may assume (acquired before its last fence::after, its own)."""
        k = dict(self.tc_view)
        _join(k, self.own_tc)
        return k

    def release_epoch(self):
        self.epoch += 1
        self.know[("w", self.wid)] = self.epoch

    def describe(self) -> str:
        pc = int(self.pcs[self.alive].min()) if self.div else self.pc
        prog = self.cta.prog
        line = prog[pc].ins.line if pc < len(prog) else "end"
        b = f"blocked: {self.block.what}" if self.block else "runnable"
        return f"warp {self.wid} at PTX line {line}: {b}"


# ---- compiled instructions ----------------------------------------------------------------------
@dataclass
class Op:
    ins: Instr
    fn: object  # fn(w, m) -> Block | None ; m: bool mask of executing lanes or None (all 32)
    kind: str = "alu"  # alu | bra | ret
    target: int = -1
    uni: bool = False
    aligned: bool = False  # .sync.aligned: every lane of the warp must execute it together
    srcs: tuple = ()
    dsts: tuple = ()
    guard_pred: bool = False  # the guard is a declared .pred register (its value a bool lane vector)
    plain: bool = False  # kind alu without a guard: CTA.run executes it inline on a converged full warp


LONG_TAIL = 8


class CTA:
    """One CTA. `run()` executes it (to completion, or a number of issue bursts at a time) or raises Fault."""

    def __init__(self, emu, ctaid: int):  # emu: the launch (emulator.Emulator)
        self.emu = emu
        self.mod: Module = emu.mod
        self.prog: list[Op] = emu.prog
        self.ctaid, self.nctas = ctaid, emu.nctas
        self.rng = np.random.default_rng([emu.seed, ctaid])
        # a try_wait's time limit (PTX ISA: it may return false before the phase completes) and the
        # long tail of TMA latencies: their own stream, so the base delays of a seed stay what they were
        self._timing = np.random.default_rng([emu.seed, ctaid, 0x7140])
        size = (SMEM_BASE + emu.dyn_smem + 15) // 16 * 16
        self.smem = np.zeros(size, np.uint8)
        self.sguard = np.zeros(size, np.int32)
        self.swriter = np.full(size, -1, np.int32)  # last generic writer of each byte (for reports)
        # read guards (write-after-read): the last reader of each byte / cell; an overwrite must have
        # observed that read's completion (same guard table as the write guards)
        self.srguard = np.zeros(size, np.int32)
        self.trguard = np.zeros((TMEM_LANES, TMEM_COLS), np.int32)
        self.tmem = np.zeros((TMEM_LANES, TMEM_COLS), np.uint32)
        self.tguard = np.zeros((TMEM_LANES, TMEM_COLS), np.int32)
        self.tmem_alloc: dict = {}  # col -> ncols
        self.tmem_relinquished = False
        self.guards: list = [None, ("inflight", "an async write in flight"), ("mbarrier", "an mbarrier object")]
        self._gidx: dict = {}
        self.mbars: dict = {}
        self.named: dict = {}
        self.now = 0
        self.events: list = []
        self._eseq = 0
        self.nthreads = emu.nthreads
        self.warps = [Warp(self, i, self.nthreads) for i in range((self.nthreads + WARP - 1) // WARP)]
        for w in self.warps:
            w.regs = dict(emu.reg_init)
        self.steps = 0
        self.exit_checked = False  # every warp exited: the check for work still in flight was made
        self.wg_pending: dict = {}  # (wg, seq) -> {warp: contribution}
        self.wg_tail: dict = {}
        self.reg_pool_used = 0
        self.hits, self.bdirs = emu.hits, emu.dirs  # coverage: per warp, per instruction (coverage.py)
        self.trace = emu.trace  # a trace.Recorder, or None (the default: nothing recorded)

    # ---- guards -------------------------------------------------------------------------------
    def guard_id(self, key, thr, what) -> int:
        k = (key, thr)
        g = self._gidx.get(k)
        if g is None:
            g = len(self.guards)
            self.guards.append(("know", key, thr, what))
            self._gidx[k] = g
        return g

    def check_guards(self, ids: np.ndarray, know: dict, reader: str, *, async_proxy: bool, own: int | None,
                     line=None, warp=None, addrs=None, space="SMEM"):
        for g in distinct_ids(ids):
            if g == 0:
                continue
            entry = self.guards[g]
            where = None
            if addrs is not None:
                hit = np.flatnonzero(ids.reshape(-1) == g)
                where = int(np.asarray(addrs).reshape(-1)[hit[0]]) if hit.size else None
            if entry[0] == "inflight":
                raise Fault("RACE", f"{reader} reads {space} that an asynchronous write has not finished writing",
                            line=line, warp=warp, addr=where)
            if entry[0] == "mbarrier":
                raise Fault("MBARRIER_ACCESS", f"{reader} reads {space} bytes that hold an mbarrier object",
                            line=line, warp=warp, addr=where)
            _, key, thr, what = entry
            if key[0] == "w":
                if async_proxy:
                    key = ("wa", key[1])
                elif own is not None and key[1] == own:
                    continue
            if know.get(key, -1) < thr:
                raise Fault("RACE", f"{reader} reads {space} written by {what} without observing its completion "
                                    f"(needs {key[0]}:{key[1]} >= {thr}, has {know.get(key, 'nothing')})",
                            line=line, warp=warp, addr=where)

    def check_war(self, rids: np.ndarray, know: dict, writer: str, *, own: int | None = None, skip=(),
                  line=None, warp=None, addrs=None, space="SMEM"):
        """An overwrite: every read guard on the target must be in the writer's knowledge."""
        for g in distinct_ids(rids):
            if g <= 2:
                continue
            _, key, thr, what = self.guards[g]
            if key in skip or (key[0] == "w" and key[1] == own):
                continue
            if know.get(key, -1) < thr:
                where = None
                if addrs is not None:
                    hit = np.flatnonzero(rids.reshape(-1) == g)
                    where = int(np.asarray(addrs).reshape(-1)[hit[0]]) if hit.size else None
                raise Fault("RACE", f"{writer} overwrites {space} that {what} reads, without observing that the "
                                    f"read completed (needs {key[0]}:{key[1]} >= {thr}, has {know.get(key, 'nothing')})",
                            line=line, warp=warp, addr=where)

    # ---- events -------------------------------------------------------------------------------
    def at(self, t: int, fn, what: tuple = ("an asynchronous operation", None, None)) -> None:
        """Run fn at time t: an asynchronous operation landing. what = (kind, PTX line, issuing warp[,
        the MBar it completes[, the tensor map it reads]]) names it if it is still in flight when the CTA
        exits, and for a trace (trace.py)."""
        if self.trace is not None:
            self.trace.async_op(self.ctaid, self.now, int(t), what)
        self._eseq += 1
        heapq.heappush(self.events, (int(t), self._eseq, fn, what))

    def try_wait_times_out(self) -> bool:
        """A try_wait on an incomplete phase returns false (its time limit ran out) instead of
        suspending the warp: one time in four, seeded."""
        return self._timing.random() < 0.25

    def delay(self, lo: int, hi: int, tail: bool = False) -> int:
        """A seeded latency in [lo, hi]; tail: one in eight is LONG_TAIL times longer (a load that
        misses in L2 behind others), so that a consumer also arrives at its full-barrier wait before
        the data, and that wait blocks, inside the K/V loop and not only at its start."""
        d = int(self.rng.integers(lo, hi + 1))
        if tail and self._timing.random() < 0.125:
            d *= LONG_TAIL
        return d

    def fire_until(self, t: int) -> None:
        ev = self.events
        while ev and ev[0][0] <= t:
            fn = heapq.heappop(ev)[2]
            fn()

    # ---- shared memory ------------------------------------------------------------------------
    def smem_check(self, addrs: np.ndarray, nbytes: int, line, warp, what="access"):
        lo, hi = SMEM_BASE, SMEM_BASE + self.emu.dyn_smem
        bad = (addrs < lo) | (addrs + nbytes > hi)
        if _cnz(bad):
            i = int(np.flatnonzero(bad)[0])
            raise Fault("SMEM_OOB", f"shared-memory {what} of {nbytes} B outside the dynamic window "
                                    f"[{lo:#x}, {hi:#x})", line=line, warp=warp, addr=int(addrs.reshape(-1)[i]))
        mis = (addrs % nbytes) != 0
        if _cnz(mis):
            i = int(np.flatnonzero(mis)[0])
            raise Fault("SMEM_MISALIGNED", f"shared-memory {what} of {nbytes} B is not {nbytes}-byte aligned",
                        line=line, warp=warp, addr=int(addrs.reshape(-1)[i]))

    def mbar_at(self, addr: int, line, warp, know: dict | None = None) -> MBar:
        b = self.mbars.get(addr)
        if b is None:
            raise Fault("MBARRIER", "operation on an address where no mbarrier was initialised",
                        line=line, warp=warp, addr=addr)
        if know is not None and warp != b.init_by and know.get(("w", b.init_by), -1) < b.init_epoch:
            raise Fault("MBARRIER", f"{b.name} used before its mbarrier.init (by warp {b.init_by}) is visible to "
                                    "this warp: no barrier since the init", line=line, warp=warp, addr=addr)
        return b

    def mbar_name(self, addr: int) -> str:
        return self.emu.barrier_name(addr)

    def mbar_complete_check(self, b: MBar) -> None:
        if b.pending == 0 and b.tx == 0:
            if b.tx_line is not None:
                b.tx_done, b.tx_line = (b.phase, b.tx_line), None
            b.acc[("bar", b.addr)] = b.phase + 1
            b.know = b.acc
            b.acc = {}
            b.phase += 1
            b.pending = b.count
            b.version += 1

    def mbar_arrive(self, b: MBar, n: int, know: dict, line, warp, tx: int = 0, join: bool = True):
        """join=False: `know` was joined into b.acc already (an earlier lane of the same arrive)."""
        b.tx += tx
        if abs(b.tx) >= 1 << 20:
            raise Fault("TX_COUNT", f"tx-count of {b.name} out of range ({b.tx})", line=line, warp=warp, addr=b.addr)
        if n > b.pending:
            raise Fault("ARRIVAL_OVERFLOW", f"{n} arrival(s) on {b.name} with only {b.pending} outstanding "
                                            f"in phase {b.phase} (count {b.count})", line=line, warp=warp, addr=b.addr)
        b.pending -= n
        if join:
            _join(b.acc, know)
        self.mbar_complete_check(b)

    def mbar_complete_tx(self, b: MBar, nbytes: int, know: dict, line, warp):
        b.tx -= nbytes
        b.tx_line = line
        if abs(b.tx) >= 1 << 20:
            raise Fault("TX_COUNT", f"tx-count of {b.name} out of range ({b.tx})", line=line, warp=warp, addr=b.addr)
        _join(b.acc, know)
        self.mbar_complete_check(b)

    # ---- running ------------------------------------------------------------------------------
    def runnable(self, w: Warp) -> bool:
        if w.done:
            return False
        b = w.block
        if b is None:
            return True
        if b.ready():
            w.block = None
            if self.trace is not None:
                self.trace.unblock(self.ctaid, self.now, w.wid)
            if b.release is not None:
                b.release()
            return True
        return False

    def run(self, step_limit: int, bursts: int | None = None) -> bool:
        """Execute the CTA's warps for at most `bursts` issue bursts (None: to its end); True once it
        has finished (Emulator runs several CTAs a few bursts at a time, interleaved)."""
        rng = self.rng
        warps = self.warps
        step, runnable = self.step, self.runnable
        prog = self.prog
        nprog = len(prog)
        trace = self.trace
        left = bursts
        while True:
            # runnable(w), inline for the warps that are neither blocked nor done (most of them)
            ready = [w for w in warps if (w.block is None and not w.done) or runnable(w)]
            if not ready:
                if self.events and not self.exit_checked and all(w.done for w in warps):
                    self.exit_checked = True
                    self.async_at_exit()
                if self.events:
                    t = self.events[0][0]
                    self.now = max(self.now, t)
                    self.fire_until(self.now)
                    continue
                if all(w.done for w in warps):
                    break
                self.deadlock()
            if left is not None:
                if left <= 0:
                    return False
                left -= 1
            w = ready[int(rng.integers(len(ready)))] if len(ready) > 1 else ready[0]
            burst = int(rng.integers(1, 64))
            hits = self.hits[w.wid]
            if trace is not None:
                steps0 = w.steps
            for _ in range(burst):
                # step(w), inline for the common instruction: an unguarded synchronous one on a warp
                # whose 32 lanes run converged with no register in flight (every lane executes it)
                if w.full and not w.div and not w.poison:
                    pc = w.pc
                    if pc < nprog:
                        op = prog[pc]
                        if op.plain:
                            hits[pc] = 1
                            blk = op.fn(w, None)
                            w.pc = pc + 1
                            if blk is not None:
                                w.block = blk
                                if blk.ready():  # completes at once
                                    w.block = None
                                    if blk.release is not None:
                                        blk.release()
                            w.steps += 1
                            if w.block is not None:
                                break
                            continue
                step(w)
                if w.done or w.block is not None:
                    break
            if trace is not None:
                trace.burst(self.ctaid, self.now, w, w.steps - steps0)
            self.now += burst
            self.steps += burst
            if self.steps > step_limit:
                raise Fault("STEP_LIMIT", f"CTA {self.ctaid} ran past {step_limit} warp-instructions; "
                                          + "; ".join(x.describe() for x in warps if not x.done))
            if self.events and self.events[0][0] <= self.now:
                self.fire_until(self.now)
        self.finish()
        return True

    def deadlock(self):
        lines = [w.describe() for w in self.warps if not w.done]
        bars = [b.state() for b in self.mbars.values()]
        raise Fault("DEADLOCK", "every live warp is blocked and no asynchronous operation is pending:\n    "
                    + "\n    ".join(lines) + "\n  mbarriers:\n    " + "\n    ".join(bars))

    def async_at_exit(self):
        """Every warp has exited with asynchronous operations still in flight (TMA loads or stores,
        tcgen05/wgmma work, commit arrivals): on a GPU the CTA's resources (SMEM, TMEM) are released
        under them. A finding; the emulator still lets them land so that the report can go on."""
        pend = sorted(self.events)
        names = [f"{k} (PTX line {ln}) of warp {w}" if ln is not None else k for _, _, _, (k, ln, w, *_) in pend[:4]]
        more = f" and {len(pend) - 4} more" if len(pend) > 4 else ""
        self.emu.findings.append(Fault("ASYNC_AT_EXIT", f"CTA {self.ctaid}: every warp exited with {len(pend)} "
                                                        f"asynchronous operation(s) in flight: {', '.join(names)}{more}"))

    def warp_exit_check(self, w: Warp, line) -> None:
        """A warp exits: whatever it issued and only it can wait for must have been waited for."""
        issues = []
        if w.bulk_seq > w.know.get(("bulkrd", w.wid), 0):
            issues.append(f"{w.bulk_seq - w.know.get(('bulkrd', w.wid), 0)} bulk (TMA) store(s) whose shared-memory "
                          "reads it never waited for (cp.async.bulk.wait_group.read)")
        if w.wg_groups or w.wg_open:
            issues.append(f"{len(w.wg_groups) + bool(w.wg_open)} wgmma group(s) not waited for (wgmma.wait_group)")
        if w.tc_pending:
            issues.append(f"{w.tc_pending} tcgen05.ld not waited for (tcgen05.wait::ld)")
        if issues and len(self.emu.findings) < 8:
            self.emu.findings.append(Fault("ASYNC_AT_EXIT", f"warp {w.wid} exits with " + "; ".join(issues),
                                           line=line, warp=w.wid))

    def finish(self):
        for b in self.mbars.values():
            if b.tx_done is not None and b.tx_done[0] >= b.seen:
                self.emu.findings.append(Fault(
                    "UNWAITED_LOAD", f"CTA {self.ctaid} exited with phase {b.tx_done[0]} of {b.name}, completed by "
                    f"the TMA load at PTX line {b.tx_done[1]}, never waited for: data loaded that no role read "
                    "(a load loop that runs past its last block, or a consumer that skips its wait)",
                    line=b.tx_done[1], addr=b.addr))
        if self.tmem_alloc:
            cols = ", ".join(f"{n} columns at {c}" for c, n in self.tmem_alloc.items())
            self.emu.findings.append(Fault("TMEM_LEAK", f"CTA {self.ctaid} exited with Tensor Memory still "
                                                        f"allocated ({cols})"))

    def step(self, w: Warp) -> None:
        prog = self.prog
        if not w.div:
            pc = w.pc
            act = w.alive
            act_full = w.full
        else:
            live = w.alive
            pc = int(w.pcs[live].min())
            act = live & (w.pcs == pc)
            act_full = False
        if pc >= len(prog):
            raise Fault("PC", "execution ran past the last instruction", warp=w.wid)
        op = prog[pc]
        ins = op.ins
        self.hits[w.wid][pc] = 1
        if op.aligned and not (act_full or _cnz(act) == WARP):
            raise Fault("ALIGNED", f"{ins.opcode} is .sync.aligned but only {int(act.sum())} of 32 lanes execute it",
                        line=ins.line, warp=w.wid, text=ins.text)
        if ins.guard is not None:
            p = w.regs.get(ins.guard)
            if p is None:
                raise Fault("REG", f"guard predicate {ins.guard} is not declared", line=ins.line, warp=w.wid)
            if act_full and op.guard_pred:
                # every lane executes: the executing lanes are the predicate's own (a bool lane vector),
                # counted once; a uniform predicate (the common case) needs no mask at all
                n = _cnz(p)
                if ins.guard_neg:
                    n = WARP - n
                full, any_ = n == WARP, n > 0
                m = act if full else _NO_LANES if not any_ else (~p if ins.guard_neg else p)
            else:
                m = act & ~p if ins.guard_neg else act & p
                n = _cnz(m)
                full, any_ = n == WARP, n > 0
            if any_ and op.kind != "bra":
                self.bdirs[w.wid][pc] |= ENABLED  # coverage: the guard let some lane through
        elif act_full:
            m, full, any_ = act, True, True
        else:
            m = act
            n = _cnz(m)
            full, any_ = n == WARP, n > 0
        if w.poison and any_:
            for r in op.srcs:
                pz = w.poison.get(r)
                if pz is not None and pz[0] == "rw":
                    raise Fault("REG_RACE", f"reads {r} before {pz[1]} (issued at PTX line {pz[2]}) was waited for",
                                line=ins.line, warp=w.wid, text=ins.text)
            for r in op.dsts:
                pz = w.poison.get(r)
                if pz is not None:
                    raise Fault("REG_RACE", f"writes {r} while {pz[1]} (issued at PTX line {pz[2]}) is in flight",
                                line=ins.line, warp=w.wid, text=ins.text)
        kind = op.kind
        nxt = pc + 1
        if kind == "alu":
            blk = op.fn(w, None if full else m) if any_ else None
            if w.div:  # _advance, inline: the common instruction of a converged warp only moves on
                w.pcs[act] = nxt
                CTA._reconverge(w)
            else:
                w.pc = nxt
            if blk is not None:
                w.block = blk
                if blk.ready():  # completes at once
                    w.block = None
                    if blk.release is not None:
                        blk.release()
        elif kind == "bra":
            same = any_ and (full or _cnz(m != act) == 0)  # every executing lane takes it
            if op.uni and any_ and not same:
                raise Fault("BRA_UNI", "bra.uni taken by some lanes only (the branch is not uniform)",
                            line=ins.line, warp=w.wid, text=ins.text)
            if same:
                self.bdirs[w.wid][pc] |= TAKEN
                self._advance(w, pc, act, op.target)
            elif not any_:
                self.bdirs[w.wid][pc] |= FALLTHROUGH
                self._advance(w, pc, act, nxt)
            else:
                self.bdirs[w.wid][pc] |= TAKEN | FALLTHROUGH
                if not w.div:
                    w.pcs[:] = pc
                    w.div = True
                w.pcs[m] = op.target
                w.pcs[act & ~m] = nxt
                self._reconverge(w)
        elif kind == "ret":
            if any_:
                w.alive = w.alive & ~m
                w.full = False
                if _cnz(w.alive) == 0:
                    w.done = True
                    self.warp_exit_check(w, ins.line)
                    return
            self._advance(w, pc, act & w.alive, nxt)
        w.steps += 1

    @staticmethod
    def _advance(w: Warp, pc: int, act, nxt: int) -> None:
        if not w.div:
            w.pc = nxt
            return
        w.pcs[act] = nxt
        CTA._reconverge(w)

    @staticmethod
    def _reconverge(w: Warp) -> None:
        live = w.alive
        p = w.pcs[live]
        if p.size and _cnz(p != p[0]) == 0:
            w.div = False
            w.pc = int(p[0])


class GlobalMemory:
    """Device allocations the kernel parameters point at (NumPy byte buffers)."""

    def __init__(self):
        self.allocs: list = []  # (base, buf uint8, name)
        self._next = 0x1_0000_0000

    def add(self, name: str, arr: np.ndarray) -> int:
        buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy()
        base = self._next
        self._next += (buf.size + 0xFFFF) // 0x10000 * 0x10000 + 0x10000
        self.allocs.append((base, buf, name))
        return base

    def find(self, addr: int, nbytes: int):
        for base, buf, name in self.allocs:
            if base <= addr and addr + nbytes <= base + buf.size:
                return base, buf, name
        return None

    def buffer(self, name: str) -> np.ndarray:
        for _, buf, n in self.allocs:
            if n == name:
                return buf
        raise KeyError(name)
