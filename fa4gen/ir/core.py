"""The pipeline IR: memory regions, barriers, pipeline states, roles and their programs.

Everything is a frozen dataclass holding tuples, so a Pipeline is hashable, comparable and dumpable.
The verifier proves these programs and the CPU simulator executes them. Both targets' PTX is lowered
from them op by op by one walker (fa4gen/lower/walk.py), and `fa4gen check` (fa4gen/evidence/check.py) reads
the PTX back against them.

Phase convention (defined once, here): a `State` walks a ring of barrier slots. After `p` advances
its slot is `slot_base + (start + stride * p) % depth` and its round is `(start + stride * p) // depth`.
A wait uses parity `(round + start_phase) % 2`: consumers start at phase 0 (block until the first
completion), producers at phase 1 (a fresh mbarrier counts as having completed the phase before
phase 0, so the first wait on an empty buffer passes at once). Hardware rule (PTX ISA 9.0,
"mbarrier.test_wait/try_wait"): `try_wait.parity P` succeeds iff the current phase's parity != P.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, is_dataclass
from typing import Union

from ..spec.config import KernelConfig


class Space(enum.Enum):
    GMEM = "gmem"
    SMEM = "smem"
    TMEM = "tmem"
    REG = "reg"  # per-thread registers (sm_90a wgmma accumulators and the P A-fragments)


class BarrierKind(enum.Enum):
    MBAR = "mbarrier"  # plain mbarrier: explicit arrivals only
    TMA = "tma"  # mbarrier completed by one arrive.expect_tx plus the TMA transaction bytes
    TCGEN05 = "tcgen05"  # mbarrier arrived by tcgen05.commit once the issuer's prior MMAs complete
    NAMED = "named"  # hardware named barrier (bar.arrive / bar.sync), no phase


class Scope(enum.Enum):
    """Who executes an op inside its role: one elected thread, or every thread of the role."""

    ELECTED = "elected"
    WARP = "warp"  # one elected lane per warp of the role
    ALL = "all"


class Cond(enum.Enum):
    FIRST_BLOCK = "first_block"  # the current K/V iteration is the task's first block
    NOT_FIRST_BLOCK = "not_first_block"
    LAST_BLOCK = "last_block"  # the current K/V iteration (block 0 outside a K/V loop) is the last
    ANY_RESCALE = "any_rescale"  # data-dependent: vote.any(acc_scale < 1) over the warp
    HAS_LSE = "has_lse"  # runtime: the caller asked for LSE (lse_ptr != 0)
    # runtime, uniform over the launch: a KV-cache kernel launched with num_splits > 1 writes each
    # split's normalized fp32 O and LSE to o_partial / lse_partial (fa4gen/spec/plan.py "KV-cache rules")
    SPLIT_KV = "split_kv"
    # runtime, per warpgroup (sm_90a KV cache): some of this consumer's rows are query positions < Sq;
    # otherwise (decode packs Sq * G rows into the first warpgroup) it takes the barrier-only path
    ROWS_IN_SQ = "rows_in_sq"
    # replicated roles (Role.instances > 1): which instance runs the program. Static for each instance
    # (`instantiate` resolves them), a test of the instance index where one program serves them all.
    FIRST_INSTANCE = "first_instance"
    LAST_INSTANCE = "last_instance"


class BlockRef(enum.Enum):
    """Which K/V iteration an op works on, relative to the loop it sits in (t = loop counter)."""

    FIRST = "first"  # iteration 0 (prologue ops before the loop)
    CUR = "cur"  # t (inside a loop of n iterations), or t+1 inside a loop of n-1 iterations
    PREV = "prev"  # t - 1 relative to CUR
    LAST = "last"  # n - 1 (tail ops after the loop)


class LoopKind(enum.Enum):
    TASKS = "tasks"  # persistent / LPT task loop
    KV = "kv"  # all n K/V iterations of the task
    KV_REST = "kv_rest"  # iterations 1 .. n-1 (the steady state after a peeled first iteration)


# ---------------------------------------------------------------------------------------------------
# Declarations


@dataclass(frozen=True)
class Region:
    """A buffer. SMEM: `slots` stages of `bytes_per_slot`. TMEM: columns [col, col + cols)."""

    name: str
    space: Space
    dtype: str  # "f32", "f16" (16-bit view), "u8" ...
    rows: int
    slots: int = 1
    bytes_per_slot: int = 0  # SMEM only
    col: int = 0  # TMEM only: first physical 32-bit column
    cols: int = 0  # TMEM only: physical 32-bit columns
    alias_of: str | None = None  # explicit aliasing: this region lives inside `alias_of`'s columns

    @property
    def col_end(self) -> int:
        return self.col + self.cols


@dataclass(frozen=True)
class Barrier:
    """A barrier family. Kind and arrival count are required, never defaulted: a defaulted count
    would let a barrier silently disagree with the number of arrivals its protocol makes."""

    name: str
    kind: BarrierKind
    slots: int
    count: int  # mbarrier: arrivals per phase; named: threads per instance
    tx_bytes: int = 0  # TMA: bytes expected per phase (documentation + checked against the loads)
    named_id: int = 0  # NAMED: first hardware id; slot s uses named_id + s
    # NAMED only: one instance per (slot, warp % 4) pairing a producer warp with its consumer warp,
    # `count` threads each (2 warps); instance id named_id + 4 * slot + warp % 4. Declared, never inferred.
    per_warp: bool = False


@dataclass(frozen=True)
class State:
    """A PipelineState over a barrier ring (see the module docstring for the phase convention)."""

    name: str
    depth: int
    start_phase: int  # 0 consumer, 1 producer
    slot_base: int = 0
    start: int = 0
    stride: int = 1

    def position(self, advances: int) -> tuple[int, int]:
        """(slot, round) after `advances` advances."""
        p = self.start + self.stride * advances
        return self.slot_base + p % self.depth, p // self.depth

    def parity(self, advances: int) -> int:
        return (self.position(advances)[1] + self.start_phase) % 2

    def completions_needed(self, advances: int) -> int:
        """How many completed phases of the slot the wait at `advances` intends to observe."""
        return self.position(advances)[1] + 1 - self.start_phase


@dataclass(frozen=True)
class InstSlot:
    """A slot (or Q tile / row-group index) relative to the instance of a replicated role:
    (instance + offset) mod instances. The sm_90a consumer warpgroups use it for their own rows, O
    staging slot and epilogue barrier (offset 0) and to pass the ping-pong ring's tensor-core turn on
    to the next consumer (offset 1)."""

    offset: int = 0


# A slot operand: a constant slot, the current slot of one of the role's States, or a slot relative to
# the instance of a replicated role.
Slot = Union[int, str, InstSlot]


# ---------------------------------------------------------------------------------------------------
# Ops. Each is one PTX-level action of the role (or of its elected thread).


@dataclass(frozen=True)
class Wait:
    """mbarrier.try_wait.parity loop on the State's slot with the State's parity."""

    barrier: str
    state: str


@dataclass(frozen=True)
class Arrive:
    """mbarrier.arrive (Scope.ALL: every thread of the role arrives once)."""

    barrier: str
    slot: Slot
    scope: Scope


@dataclass(frozen=True)
class ExpectTx:
    """mbarrier.arrive.expect_tx by the elected thread: 1 arrival plus `bytes` of transactions."""

    barrier: str
    slot: Slot
    bytes: int


@dataclass(frozen=True)
class TmaLoad:
    """cp.async.bulk.tensor global -> shared, completing `bytes` on barrier[slot]."""

    tensor: str  # "q" | "k" | "v"
    dst: str  # SMEM region
    dst_slot: Slot
    barrier: str
    bar_slot: Slot
    bytes: int
    qtile: int = 0  # for Q: which Q tile of the task
    block: BlockRef = BlockRef.CUR  # for K/V: which iteration's block (blocks visited in reverse)


@dataclass(frozen=True)
class TmaStore:
    """cp.async.bulk.tensor shared -> global of one O tile, then commit_group."""

    src: str
    src_slot: Slot


@dataclass(frozen=True)
class StoreRows:
    """The role's threads copy one O tile from an SMEM slot (the 128B-swizzled staging layout the
    epilogue writes) to global memory with ld.shared / st.global, one predicate per row: only the
    rows of the task's sequence are written (varlen: a TMA store of the tile would also write the
    rows of the next sequence that share it). Synchronous generic-proxy reads of the slot: once the
    role's threads pass the op, the slot may be handed back (no bulk group to wait for)."""

    src: str
    src_slot: Slot


@dataclass(frozen=True)
class PageLookup:
    """Paged KV cache (fa4gen/spec/plan.py "KV-cache rules"): the role's threads read the page-table
    entries of K/V block `block` (one per TMA box of the block, clamped as the rules say) from global
    memory into registers, before the waits of that block's loads, so the reads are in flight while
    the role waits. The K and V TmaLoads of the same block that follow address their boxes by them.
    No SMEM or TMEM access."""

    block: BlockRef = BlockRef.CUR


@dataclass(frozen=True)
class StorePartial:
    """KV-cache split-KV epilogue (fa4gen/spec/plan.py "KV-cache rules"): every thread of the role writes
    columns [col_lo, col_hi) of its row's normalized fp32 O (register buffer `src`, the result of
    Compute "normalize_partial") to o_partial[(split * R + r) * D ...], r = (b * Sq + pos) * Hq +
    head, rows pos < Sq only, with st.global. Reads registers only: no SMEM or TMEM access (the O
    columns came from TMEM through the TmemLd / WaitLd before it)."""

    src: str
    col_lo: int
    col_hi: int
    qtile: int


@dataclass(frozen=True)
class StoreO:
    """O from the registers (sm_100a, O not staged in SMEM: `ir/sm100.sm100_o_staged`): every thread of
    the role writes columns [col_lo, col_hi) of its row's normalized, cast O (register buffer `src`,
    the result of Compute "normalize") to o_ptr with st.global, rows of the task's sequence only (one
    predicate per row, as StoreRows). Reads registers only: no SMEM or TMEM access."""

    src: str
    col_lo: int
    col_hi: int
    qtile: int


@dataclass(frozen=True)
class TmaStoreWait:
    """cp.async.bulk.wait_group.read 0: the SMEM source of every prior store may be reused."""


@dataclass(frozen=True)
class Mma:
    """One tensor-core MMA (tcgen05.mma on sm_100a; wgmma on sm_90a), issued by one thread.

    QK: d[dslot] = a[aslot] @ b[bslot]^T.  PV: d += a[:, k_lo:k_hi] @ b[k_lo:k_hi, :].
    """

    kind: str  # "qk" | "pv"
    a: str
    a_slot: Slot
    b: str
    b_slot: Slot
    d: str
    k_lo: int
    k_hi: int
    accumulate: str  # "false" | "true" | "not_first" (false on the task's first K/V block)
    block: BlockRef = BlockRef.CUR


@dataclass(frozen=True)
class MmaWait:
    """wgmma.wait_group N: every MMA this role issued, except the N most recent, has completed."""

    pending: int


@dataclass(frozen=True)
class Commit:
    """tcgen05.commit: barrier[slot] gets 1 arrival once the issuer's prior MMAs complete."""

    barrier: str
    slot: Slot


@dataclass(frozen=True)
class TmemLd:
    """tcgen05.ld.32x32b of columns [col_lo, col_hi) of a TMEM region into registers (async)."""

    region: str
    col_lo: int  # in the region's own element columns
    col_hi: int
    dst: str  # register buffer name


@dataclass(frozen=True)
class TmemSt:
    """tcgen05.st.32x32b of registers into columns [col_lo, col_hi) of a TMEM region (async)."""

    region: str
    col_lo: int
    col_hi: int
    src: str


@dataclass(frozen=True)
class WaitLd:
    """tcgen05.wait::ld: every prior tcgen05.ld of this thread has completed."""


@dataclass(frozen=True)
class WaitSt:
    """tcgen05.wait::st: every prior tcgen05.st of this thread has completed."""


@dataclass(frozen=True)
class SmemSt:
    """st.shared of per-row values (sScale) or a tile (O_smem)."""

    region: str
    slot: Slot
    src: str


@dataclass(frozen=True)
class SmemLd:
    region: str
    slot: Slot
    dst: str


@dataclass(frozen=True)
class FenceProxyAsync:
    """fence.proxy.async.shared::cta: generic-proxy SMEM writes become visible to TMA / MMA."""


@dataclass(frozen=True)
class NamedArrive:
    barrier: str
    slot: Slot


@dataclass(frozen=True)
class NamedSync:
    barrier: str
    slot: Slot


@dataclass(frozen=True)
class Advance:
    state: str


@dataclass(frozen=True)
class FetchTask:
    """The dynamic deal (plan.dynamic_tasks): the role's one issuing thread takes the next task index
    from the launch's task counter (`atom.global.add.u32 task, [task_counter], 1`), so CTAs take
    tasks in order as they free up. Register-only here; the index reaches the other roles through
    PublishTask / ReadTask. Indices at or past the last task end the task loop of every role."""


@dataclass(frozen=True)
class PublishTask:
    """st.shared of the task index the role fetched into slot `slot` of SMEM region `region` (one
    32-bit word per slot), by the role's one issuing thread; the barrier arrive after it publishes it."""

    region: str
    slot: Slot


@dataclass(frozen=True)
class ReadTask:
    """ld.shared of the task index in slot `slot` of SMEM region `region` by every thread of the role
    (after the wait that orders it behind its PublishTask)."""

    region: str
    slot: Slot


@dataclass(frozen=True)
class Compute:
    """Register-only math. `fn` names the template macro (PTX) and the NumPy function (simulator).

    Functions: "softmax_max" (mask + row max + rescale decision), "softmax_exp" (P = exp2 split,
    cast), "row_sum" (row_sum = row_sum * acc_scale + sum P), "rescale_o" (O regs *= acc_scale),
    "normalize" (O / row_sum, cast, LSE), "store_lse"; KV-cache split-KV: "normalize_partial"
    (O / row_sum kept in fp32 for StorePartial), "store_lse_partial" (LSE to lse_partial); sinks:
    "apply_sink" (the head's sink logit joins row_sum and the LSE, before both are used).
    """

    fn: str
    qtile: int
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


Op = Union[Wait, Arrive, ExpectTx, TmaLoad, PageLookup, TmaStore, StoreRows, StorePartial, StoreO, TmaStoreWait, Mma, MmaWait, Commit, TmemLd, TmemSt, WaitLd,
           WaitSt, SmemSt, SmemLd, FenceProxyAsync, NamedArrive, NamedSync, Advance, FetchTask, PublishTask, ReadTask,
           Compute]


@dataclass(frozen=True)
class Loop:
    """A loop. `head` (TASKS loops only): ops every role runs before each task's exit test, the test
    that ends the loop included (so once more than the tasks it runs): the dynamic deal's hand-off of
    the next task index (FetchTask / PublishTask / ReadTask and their ring's waits and arrives)."""

    kind: LoopKind
    body: tuple
    head: tuple = ()


@dataclass(frozen=True)
class If:
    cond: Cond
    then: tuple
    orelse: tuple = ()


Stmt = Union[Op, Loop, If]


@dataclass(frozen=True)
class Role:
    name: str
    warps: tuple[int, ...]  # warp indices in the CTA
    regs: int  # setmaxnreg budget per thread
    states: tuple[State, ...]
    program: tuple  # of Stmt
    qtile: int | None = None  # the Q tile this role owns (softmax roles)
    # > 1: one program for `instances` copies of the role (instance i runs warps + i * len(warps)); its
    # slots may be InstSlot and its Ifs FIRST_/LAST_INSTANCE. The Pipeline's `roles` hold the
    # instances (`instantiate`), which the verifier proves; its `replicated` hold this program, which
    # a lowering emits once for all of them.
    instances: int = 1

    @property
    def threads(self) -> int:
        return 32 * len(self.warps)

    def state(self, name: str) -> State:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(f"role {self.name} has no state {name!r}")


@dataclass(frozen=True)
class Pipeline:
    config: KernelConfig
    arch: str
    warps_per_cta: int
    regions: tuple[Region, ...]
    barriers: tuple[Barrier, ...]
    roles: tuple[Role, ...]
    tmem_alloc_cols: int  # 0 on sm_90a
    smem_limit: int
    notes: tuple[str, ...] = ()
    # replicated roles (Role.instances > 1) whose instances `roles` holds as <name><i> (instantiate)
    replicated: tuple[Role, ...] = ()

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r}")

    def barrier(self, name: str) -> Barrier:
        for b in self.barriers:
            if b.name == name:
                return b
        raise KeyError(f"no barrier {name!r}")

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"no role {name!r}")

    @property
    def smem_bytes(self) -> int:
        return sum(r.slots * r.bytes_per_slot for r in self.regions if r.space is Space.SMEM) + 8 * sum(
            b.slots for b in self.barriers if b.kind is not BarrierKind.NAMED)

    @property
    def threads(self) -> int:
        return 32 * self.warps_per_cta

    def to_json(self) -> dict:
        return _jsonable(self)


def _jsonable(x):
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, KernelConfig):
        return x.to_dict()
    if is_dataclass(x):
        d = {"op": type(x).__name__} if type(x).__module__ == __name__ and type(x).__name__ not in (
            "Pipeline", "Role", "Region", "Barrier", "State") else {}
        d.update({f.name: _jsonable(getattr(x, f.name)) for f in fields(x)})
        return d
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def _inst_value(x, i: int, n: int):
    return (i + x.offset) % n if isinstance(x, InstSlot) else x


def _instantiate_stmts(stmts: tuple, i: int, n: int) -> tuple:
    out = []
    for st in stmts:
        if isinstance(st, Loop):
            out.append(Loop(st.kind, _instantiate_stmts(st.body, i, n), _instantiate_stmts(st.head, i, n)))
        elif isinstance(st, If) and st.cond in (Cond.FIRST_INSTANCE, Cond.LAST_INSTANCE):
            taken = (i == 0) if st.cond is Cond.FIRST_INSTANCE else (i == n - 1)
            out.extend(_instantiate_stmts(st.then if taken else st.orelse, i, n))
        elif isinstance(st, If):
            out.append(If(st.cond, _instantiate_stmts(st.then, i, n), _instantiate_stmts(st.orelse, i, n)))
        else:
            out.append(type(st)(**{f.name: _inst_value(getattr(st, f.name), i, n) for f in fields(st)}))
    return tuple(out)


def instantiate(role: Role, i: int) -> Role:
    """Instance i of a replicated role: named <name><i>, on warps + i * len(warps), every InstSlot
    resolved to (i + offset) mod instances and every FIRST_/LAST_INSTANCE If to the branch it takes."""
    n = role.instances
    if not 0 <= i < n:
        raise ValueError(f"role {role.name} has {n} instances, not an instance {i}")
    k = len(role.warps)
    return Role(f"{role.name}{i}", tuple(w + i * k for w in role.warps), role.regs, role.states,
                _instantiate_stmts(role.program, i, n), _inst_value(role.qtile, i, n))


def uses_cond(program: tuple, cond) -> bool:
    """Whether a program has an If on `cond` (at any depth: loop heads and bodies, both branches)."""
    for st in program:
        if isinstance(st, If) and (st.cond is cond or uses_cond(st.then, cond) or uses_cond(st.orelse, cond)):
            return True
        if isinstance(st, Loop) and (uses_cond(st.head, cond) or uses_cond(st.body, cond)):
            return True
    return False


def walk_ops(program: tuple):
    """Every op of a program, in textual order (both branches of an If)."""
    for st in program:
        if isinstance(st, Loop):
            yield from walk_ops(st.head)
            yield from walk_ops(st.body)
        elif isinstance(st, If):
            yield from walk_ops(st.then)
            yield from walk_ops(st.orelse)
        else:
            yield st
