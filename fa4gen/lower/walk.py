"""The statement walker both targets lower their verified role programs with.

A `Walker` visits one role's program (fa4gen/ir/core.py) statement by statement and appends template
items: each op becomes one item (a macro of the target's templates/<arch>/ops.ptx.j2, preceded by a
`// op N` marker), each Loop / If becomes labels and predicated branches. What an op means for the
protocol (which barrier slot, which parity, which ring state, how a state advances, which block a
BlockRef names) is decided here, once, for both targets; a target's subclass adds the ops of its
machine (tcgen05 / wgmma, TMEM / registers) and its op table `OP_PTX` (IR op -> the protocol
instructions it lowers to, the table `fa4gen check` inverts).

Ring states: each State lives in one register q in [0, 2*depth): slot = slot_base + q mod depth, wait
parity = q >= depth, advanced by stride modulo 2*depth -- exactly ir.core.State's convention.

Also here, because both targets derive them from the Pipeline the same way: the SMEM layout
(`smem_layout`, fa4gen/ir/layout.py's rule raising LoweringError) and the register bookkeeping shared
by a kernel's roles (`WalkCtx`).
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field

from ..ir.core import (Advance, Arrive, BlockRef, Cond, ExpectTx, FenceProxyAsync, FetchTask, If, Loop, PublishTask, ReadTask,
                       LoopKind, NamedArrive, NamedSync, Pipeline, Role, Scope, TmaStoreWait, Wait,
                       walk_ops)
from ..ir.layout import SmemLayout, smem_layout as ir_smem_layout
from ..spec.config import KernelConfig, head_dim_refusal
from ..spec.plan import ARCH_LIMITS, dynamic_tasks

__all__ = ["COMMON_PTX", "LoweringError", "SmemLayout", "Spelling", "WalkCtx", "Walker", "chain", "dispatch", "f32", "pairwise",
           "refuse_planned", "smem_layout"]


class LoweringError(ValueError):
    """A pipeline or config a lowering cannot emit (says what and why)."""


def refuse_planned(cfg: KernelConfig, error: type[LoweringError]) -> None:
    """A head-dim pair the target does not generate (a config made inside
    spec.config.planning_head_dims, for the IR's budgets only) never reaches PTX."""
    why = head_dim_refusal(cfg.arch, cfg.head_dim, cfg.head_dim_v)
    if why:
        raise error(f"{why}: the IR may plan it, no lowering emits it")


def exact_log2(n: int) -> int | None:
    """k when n == 2**k (a division by n can be a shift), else None (the PTX divides: a 192-row
    tile's 192 positions, a 96-dim row's bytes)."""
    n = int(n)
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def f32(x: float) -> str:
    """A PTX .f32 immediate (0fXXXXXXXX) of x rounded to fp32."""
    return "0f" + struct.pack(">f", x).hex().upper()


def chain(srcs: list[str], tmp: str) -> tuple[list[tuple[str, str, str]], str]:
    """A serial reduction over `srcs` as (dst, acc, src) ops on fresh temporaries tmp0, tmp1...:
    tmp0 = s0 op s1, tmp1 = tmp0 op s2, ...; op k takes srcs[k + 1], so a template can emit it right
    after that source is computed (the sm_90a row sum beside its exps: each add waits on one MUFU
    result, not on a tree level)."""
    ops, acc = [], srcs[0]
    for n, src in enumerate(srcs[1:]):
        ops.append((f"{tmp}{n}", acc, src))
        acc = f"{tmp}{n}"
    return ops, acc


def pairwise(srcs: list[str], tmp: str, arity: int = 2) -> tuple[list[tuple[str, ...]], str]:
    """A balanced reduction tree over `srcs` as (dst, a, b[, c]) ops on fresh temporaries tmp0,
    tmp1...: groups of `arity` sources per op (3: sm_100a's three-input max.f32, FMNMX3); a level's
    last group may be smaller (2 sources), a single leftover passes up unchanged."""
    ops, level, n = [], list(srcs), 0
    while len(level) > 1:
        nxt = []
        i = 0
        while len(level) - i >= 2:
            k = min(arity, len(level) - i)
            ops.append((f"{tmp}{n}", *level[i:i + k]))
            nxt.append(f"{tmp}{n}")
            n += 1
            i += k
        nxt.extend(level[i:])
        level = nxt
    return ops, level[0]


# ---------------------------------------------------------------------------------------------------
# How the protocol is spelled: the table `fa4gen check` reads the PTX back through

# The protocol instructions of the shared macros (templates/common: mbarrier, sync, tma): (class, the
# mnemonic prefix, an infix the mnemonic must contain). A class is the name an OP_PTX row uses; the TMA
# copies' direction is the state-space pair of their mnemonic (g2s: shared::cluster <- global, s2g:
# global <- shared::cta). A target's Spelling adds its machine's classes (tcgen05, wgmma).
COMMON_PTX: tuple[tuple[str, str, str], ...] = (
    ("mbarrier.try_wait.parity", "mbarrier.try_wait.parity", ""),
    ("mbarrier.arrive.expect_tx", "mbarrier.arrive.expect_tx", ""),
    ("mbarrier.arrive", "mbarrier.arrive", ""),
    ("cp.async.bulk.tensor.g2s", "cp.async.bulk.tensor.", ".shared::cluster.global."),
    ("cp.async.bulk.tensor.s2g", "cp.async.bulk.tensor.", ".global.shared::cta."),
    ("cp.async.bulk.commit_group", "cp.async.bulk.commit_group", ""),
    ("cp.async.bulk.wait_group.read", "cp.async.bulk.wait_group.read", ""),
    ("bar.arrive", "bar.arrive", ""),
    ("bar.sync", "bar.sync", ""),
    ("fence.proxy.async.shared::cta", "fence.proxy.async.shared::cta", ""),
)


@dataclass(frozen=True)
class Spelling:
    """How a target spells what its walker emits, for `fa4gen check` to read it back (one reader for
    both targets, fa4gen.evidence.check._read_section): the protocol instruction classes (OP_PTX's names) by
    mnemonic, the registers a ring state lives in (the walker's own name patterns), and the predicates
    that pick the one thread or lane that issues (the walker's `elected` ops)."""

    classes: tuple[tuple[str, str, str], ...]  # (class, mnemonic prefix, infix), first match wins
    state_reg: str  # a ring state's register, "{role}" / "{state}" filled in (Walker.STATE_REG)
    parity_reg: str | None  # SPLIT_STATES: its parity register (Walker.PARITY_REG); None: from state_reg
    single: tuple[str, ...]  # predicates of the one issuing thread / lane (`@!P bra` around, or `@P`)

    def classify(self, opcode: str) -> str | None:
        """The protocol class of an instruction mnemonic (None: not a protocol instruction)."""
        for cls, prefix, infix in self.classes:
            if opcode.startswith(prefix) and infix in opcode:
                return cls
        return None

    def state_of(self, reg: str, role: str, which: str = "state_reg") -> str | None:
        """The ring state whose register `reg` is in `role` (None: no state register)."""
        pat = getattr(self, which)
        if pat is None:
            return None
        m = _reg_pattern(pat, role).fullmatch(reg)
        return m.group(1) if m else None


@functools.lru_cache(maxsize=None)
def _reg_pattern(pat: str, role: str) -> re.Pattern:
    return re.compile("%" + re.escape(pat).replace(r"\{role\}", re.escape(role)).replace(r"\{state\}", r"(\w+)"))


# ---------------------------------------------------------------------------------------------------
# SMEM layout (ir/layout.py), refused as a lowering error


def smem_layout(pipe: Pipeline, error: type[Exception] = LoweringError) -> SmemLayout:
    """The SMEM layout derived from pipe (fa4gen/ir/layout.py); `error` when it does not fit."""
    return ir_smem_layout(pipe, error)


def dispatch(pipe: Pipeline, roles: list[dict], error: type[Exception] = LoweringError) -> list[dict]:
    """One if/else chain on the warpgroup index, grouped by setmaxnreg budget; inside each group a
    branch on the warp index enters the role. ptxas needs setmaxnreg first on every path (else C7508)."""
    wgs: dict[int, int] = {}
    for r in pipe.roles:
        for w in r.warps:
            wg = w // 4
            if wgs.setdefault(wg, r.regs) != r.regs:
                raise error(f"warpgroup {wg}: roles ask different setmaxnreg budgets")
    by_budget: dict[int, list[int]] = {}
    for wg, regs in sorted(wgs.items()):
        by_budget.setdefault(regs, []).append(wg)
    entry = ARCH_LIMITS[pipe.arch].regs_per_sm // pipe.threads
    blocks = []
    # decreasing warpgroups first: their registers return to the pool the increasing ones wait for
    for regs, group in sorted(by_budget.items(), key=lambda kv: kv[0]):
        members = [r for r in roles if r["warps"][0] // 4 in group]
        for r in members:
            ws = r["warps"]
            if ws != list(range(ws[0], ws[0] + len(ws))):
                raise error(f"role {r['name']}: warps {ws} are not contiguous")
        blocks.append({"label": f"$L_budget{regs}", "wgs": group, "lo": min(group), "hi": max(group),
                       "kind": "inc" if regs > entry else "dec", "regs": regs, "roles": members})
    return blocks


# ---------------------------------------------------------------------------------------------------
# The walker


@dataclass
class WalkCtx:
    """Per-kernel lowering state shared by the role walkers."""

    pipe: Pipeline
    layout: SmemLayout
    tmem_warp: int  # sm_100a: the one warp that allocates Tensor Memory and frees it after the final sync
    regs: dict = field(default_factory=dict)  # ptx type -> ordered set of declared names / families
    n_uid: int = 0

    def uid(self) -> int:
        self.n_uid += 1
        return self.n_uid

    def reg(self, kind: str, name: str) -> str:
        self.regs.setdefault(kind, {})[name] = None
        return name

    def family(self, kind: str, prefix: str, n: int) -> None:
        fam = self.regs.setdefault(kind, {})
        key = f"{prefix}<{n}>"
        for k in list(fam):
            if k.startswith(prefix + "<"):
                if int(k[len(prefix) + 1:-1]) >= n:
                    return
                del fam[k]
        fam[key] = None

    def decls(self) -> list[str]:
        return [f".reg .{kind} {n};" for kind, names in self.regs.items() for n in names]


class Walker:
    """Walks one role's program into template items. Subclasses set `OP_PTX` (the op table), `Error`
    and `target`, and add `op_<Op>` handlers for their machine's ops and the hooks below."""

    OP_PTX: dict = {}
    Error: type[Exception] = LoweringError
    target = "?"
    # How a ring state lives in registers. False: one register q in [0, 2*depth), decoded into slot
    # and parity at each use (sm_100a: one register per state). True: a slot register and a parity
    # register, advanced together (fewer instructions per use: sm_90a's consumers wait and arrive
    # several times per K/V block); values derived from the slot (wgmma descriptors) are then kept
    # until the state advances (`cached`).
    SPLIT_STATES = False
    # How a K/V loop counts. False: %t = 0, 1, .. n-1 up, the block n-1-t computed at each use
    # (sm_100a). True: %kb holds the block itself, counting down to 0, and the loop tests it at its
    # bottom only (sm_90a: fewer uniform instructions per iteration and one branch, not two).
    COUNT_DOWN = False
    # the registers of a ring state (Spelling reads them back by these patterns)
    STATE_REG = "q_{role}_{state}"  # one register q in [0, 2*depth)
    SLOT_REG = "st_{role}_{state}"  # SPLIT_STATES: the slot register ...
    PARITY_REG = "ph_{role}_{state}"  # ... and the parity register

    @classmethod
    def spelling(cls, classes: tuple, single: tuple[str, ...]) -> Spelling:
        """The target's Spelling: COMMON_PTX then its own classes, its ring-state registers."""
        if cls.SPLIT_STATES:
            return Spelling(COMMON_PTX + classes, cls.SLOT_REG, cls.PARITY_REG, single)
        return Spelling(COMMON_PTX + classes, cls.STATE_REG, None, single)

    def __init__(self, ctx: WalkCtx, role: Role):
        self.ctx = ctx
        self.pipe = ctx.pipe
        self.cfg = ctx.pipe.config
        self.role = role
        self.p = role.name
        self.items: list[dict] = []
        self.op_index = 0
        self.loop_kind: LoopKind | None = None
        self.cache: dict[tuple[str, str], str] = {}  # (what, state) -> register holding it (SPLIT_STATES)

    # ---- names -------------------------------------------------------------------------------
    def r(self, kind: str, name: str) -> str:
        return self.ctx.reg(kind, f"%{name}")

    def label(self, what: str) -> str:
        return f"$L_{self.p}_{what}{self.ctx.uid()}"

    def emit(self, m: str, **kw) -> None:
        self.items.append({"m": m, **kw})

    def qreg(self, name: str) -> str:
        """The State's one register q in [0, 2*depth): slot = q mod depth, wait parity = q >= depth
        (q = (start + stride*advances + depth*start_phase) mod 2*depth, see ir.core's convention)."""
        self.role.state(name)
        return self.r("b32", self.STATE_REG.format(role=self.p, state=name))

    def split_regs(self, name: str) -> tuple[str, str]:
        """SPLIT_STATES: the State's slot register ((start + stride*advances) mod depth, slot_base not
        included) and its parity register ((round + start_phase) mod 2), ir.core's convention."""
        self.role.state(name)
        return (self.r("b32", self.SLOT_REG.format(role=self.p, state=name)),
                self.r("b32", self.PARITY_REG.format(role=self.p, state=name)))

    def slot(self, s) -> tuple[str, object]:
        """("const", slot) or ("state", State) of a slot operand."""
        if isinstance(s, int):
            return "const", s
        st = self.role.state(s)
        if st.depth == 1:
            return "const", st.slot_base
        return "state", st

    def resolve(self, st, slot_dst: str | None = None, parity_dst: str | None = None) -> list[tuple]:
        """Instructions decoding a ring state's q register into its slot index and/or wait parity."""
        q = self.qreg(st.name)
        ins = [("setp.ge.u32", "%p_q", q, str(st.depth))]
        if slot_dst:
            ins += [("mov.u32", slot_dst, q), ("@%p_q sub.u32", slot_dst, q, str(st.depth))]
        if parity_dst:
            ins += [("selp.u32", parity_dst, "1", "0", "%p_q")]
        return ins

    # ---- values derived from a ring state's slot, kept until it advances (SPLIT_STATES) -------
    # Valid along straight-line code until an Advance of the state; a Loop or If drops, after it,
    # what its body computed (the body may not run) and, before and after it, what depends on a
    # state its body advances.
    def cached(self, what: str, state: str, compute) -> tuple[list[tuple], str]:
        """(instructions, register) of `what` of a state: compute(dst) -> instructions the first time."""
        key = (what, state)
        if key in self.cache:
            return [], self.cache[key]
        dst = self.r("b64" if what.startswith("desc") else "b32", f"{what}_{self.p}_{state}")
        ins = compute(dst)
        self.cache[key] = dst
        return ins, dst

    def slot_reg(self, st) -> tuple[list[tuple], str]:
        """(instructions, register) of a ring state's current slot index (slot_base not included)."""
        if self.SPLIT_STATES:
            return [], self.split_regs(st.name)[0]
        return self.resolve(st, slot_dst="%qs"), "%qs"

    def _drop(self, states) -> None:
        self.cache = {k: v for k, v in self.cache.items() if k[1] not in states}

    def _advanced(self, stmts: tuple) -> set:
        return {op.state for op in walk_ops(stmts) if isinstance(op, Advance)}

    def bar_addr(self, bname: str, s) -> tuple[list[tuple], str]:
        """(setup instructions, address expression) of barrier slot s."""
        base = self.ctx.layout.barriers[bname]
        kind, v = self.slot(s)
        if kind == "const":
            return [], f"%bar+{base + 8 * v}"
        pre, qs = self.slot_reg(v)
        pre = pre + [("mad.lo.u32", "%qb", qs, "8", "%bar")]
        return pre, f"%qb+{base + 8 * v.slot_base}"

    def parity(self, name: str) -> tuple[list[tuple], str]:
        st = self.role.state(name)
        if self.SPLIT_STATES:
            return [], self.split_regs(name)[1]
        if st.depth == 1:
            return [], self.qreg(name)
        return self.resolve(st, parity_dst="%qp"), "%qp"

    def smem_addr(self, region: str, s, dst: str) -> tuple[list[tuple], str, int]:
        """(setup instructions, base register, byte offset) of slot s of an SMEM region."""
        off, nbytes, _ = self.ctx.layout.regions[region]
        kind, v = self.slot(s)
        if kind == "const":
            return [], "%smem", off + v * nbytes
        pre, qs = self.slot_reg(v)
        pre = pre + [("mad.lo.u32", dst, qs, str(nbytes), "%smem")]
        return pre, dst, off + v.slot_base * nbytes

    # ---- comments: the IR's names for what each instruction touches ---------------------------
    # Printed after the instruction (templates: `{{ note | comment }}`), never part of it: one line,
    # no ';', and no instruction mnemonic (tests count mnemonics in the raw text).
    def slot_note(self, s) -> str:
        """A slot operand in words: "1" (constant) or "%q_mma_k mod 3" (a ring State's slot)."""
        kind, v = self.slot(s)
        if kind == "const":
            return str(v)
        if self.SPLIT_STATES:
            sreg = self.split_regs(v.name)[0]
            return f"{v.slot_base} + {sreg}" if v.slot_base else sreg
        q = self.qreg(v.name)
        return f"{v.slot_base} + {q} mod {v.depth}" if v.slot_base else f"{q} mod {v.depth}"

    def bar_note(self, bname: str, s) -> str:
        return f"{bname}[{self.slot_note(s)}]"

    def phase_note(self, name: str) -> str:
        """The parity a Wait passes, as the State's register says it (ir.core's phase convention:
        try_wait.parity P passes once the barrier's phase of parity P has completed)."""
        st = self.role.state(name)
        how = f"start phase {st.start_phase}" + (f", stride {st.stride}" if st.stride != 1 else "")
        if self.SPLIT_STATES:
            return f"phase parity {self.split_regs(name)[1]}: state {name}, {how}"
        q = self.qreg(name)
        par = q if st.depth == 1 else f"({q} >= {st.depth})"
        return f"phase parity {par}: state {name}, {how}"

    @staticmethod
    def block_note(ref: BlockRef) -> str:
        """The K/V block a BlockRef names (blocks are visited in reverse: n-1, n-2, ..., 0)."""
        return {BlockRef.FIRST: "n-1", BlockRef.CUR: "n-1-t", BlockRef.PREV: "n-t", BlockRef.LAST: "0"}[ref]

    def what(self, text: str) -> None:
        """Say what the current op's block computes, on its `// op N` marker."""
        marker = next(it for it in reversed(self.items) if it["m"] == "marker")
        marker["what"] = text

    def state_users(self, name: str) -> list[str]:
        """The barriers and regions whose slot a State walks, in program order."""
        out = []
        for op in walk_ops(self.role.program):
            for f in ("state", "slot", "bar_slot", "dst_slot", "src_slot", "a_slot", "b_slot"):
                if getattr(op, f, None) == name:
                    key = {"dst_slot": "dst", "src_slot": "src", "a_slot": "a", "b_slot": "b",
                           "bar_slot": "barrier"}.get(f, "barrier")
                    target = getattr(op, key, None)
                    if isinstance(target, str) and target not in out:
                        out.append(target)
        return out

    # ---- program walk ------------------------------------------------------------------------
    def init_state(self, st) -> None:
        users = ", ".join(self.state_users(st.name))
        if self.SPLIT_STATES:
            sreg, preg = self.split_regs(st.name)
            note = (f"state {st.name} ({users}): slot {f'{st.slot_base} + ' if st.slot_base else ''}{sreg} of "
                    f"{st.depth}, phase parity {preg}, start {st.start}, start phase {st.start_phase}"
                    + (f", stride {st.stride}" if st.stride != 1 else ""))
            self.emit("state_init_split", slot=sreg, slot_value=st.start % st.depth, parity=preg,
                      parity_value=(st.start // st.depth + st.start_phase) % 2, note=note)
            return
        if st.depth == 1:
            shape = f"slot {st.slot_base}, phase parity = q"
        else:
            base = f"{st.slot_base} + " if st.slot_base else ""
            shape = f"q in [0, {2 * st.depth}), slot = {base}q mod {st.depth}, phase parity = (q >= {st.depth})"
        note = (f"state {st.name} ({users}): {shape}, start {st.start}, start phase {st.start_phase}"
                + (f", stride {st.stride}" if st.stride != 1 else ""))
        self.emit("state_init", q=self.qreg(st.name),
                  value=(st.start + st.depth * st.start_phase) % (2 * st.depth), state=st.name, note=note)

    def stmts(self, stmts: tuple) -> None:
        for st in stmts:
            if isinstance(st, Loop):
                self.loop(st)
            elif isinstance(st, If):
                self.if_(st)
            else:
                self.op(st)

    def loop(self, lp: Loop) -> None:
        if lp.kind is LoopKind.TASKS:
            if self.loop_kind is not None:
                raise self.Error(f"{self.p}: a TASKS loop must be outermost")
            head, done = self.label("task"), self.label("tasks_done")
            before, adv = dict(self.cache), self._advanced(lp.body) | self._advanced(lp.head)
            self._drop(adv)
            if bool(lp.head) != dynamic_tasks(self.cfg):
                raise self.Error(f"{self.p}: the TASKS loop has {'a' if lp.head else 'no'} head, the config "
                                 f"{'deals' if dynamic_tasks(self.cfg) else 'does not deal'} its tasks dynamically")
            # the loop's label: the static deal computes the first task before it (and the next at the
            # loop's end); the dynamic one's head ops, after it, hand each index over (they leave it in %task)
            self.emit("task_init", head=head, dynamic=bool(lp.head), varlen=self.cfg.varlen)
            self.stmts(lp.head)
            self.task_begin(head, done)
            self.loop_kind = lp.kind
            self.stmts(lp.body)
            self.loop_kind = None
            self.emit("task_end", head=head, done=done, dynamic=bool(lp.head))
            self.cache = {k: v for k, v in before.items() if k[1] not in adv}
            return
        if self.loop_kind is not LoopKind.TASKS:
            raise self.Error(f"{self.p}: K/V loops must sit directly inside the TASKS loop")
        head, done = self.label("kv"), self.label("kv_done")
        first = 0 if lp.kind is LoopKind.KV else 1
        before, adv = dict(self.cache), self._advanced(lp.body)
        self._drop(adv)
        self.emit("kv_begin", head=head, done=done, first=first, count_down=self.COUNT_DOWN)
        self.loop_kind = lp.kind
        self.stmts(lp.body)
        self.loop_kind = LoopKind.TASKS
        self.emit("kv_end", head=head, done=done, first=first, count_down=self.COUNT_DOWN)
        self.cache = {k: v for k, v in before.items() if k[1] not in adv}

    def task_begin(self, head: str, done: str) -> None:
        """Target hook: after the loop's label and head ops, the test that ends the loop, the task's decode
        (its block range) and per-task setup."""
        raise NotImplementedError

    def if_(self, st: If) -> None:
        other, end = self.label("else"), self.label("endif")
        if st.cond in (Cond.FIRST_BLOCK, Cond.NOT_FIRST_BLOCK):
            if self.loop_kind not in (LoopKind.KV, LoopKind.KV_REST):
                raise self.Error(f"{self.p}: {st.cond.value} outside a K/V loop")
        self.emit("if_begin", cond=st.cond.value, other=other, **self.if_args(st))
        before, adv = dict(self.cache), self._advanced(st.then) | self._advanced(st.orelse)
        self.stmts(st.then)
        self.cache = dict(before)
        if st.orelse:
            self.emit("if_else", other=other, end=end)
            self.stmts(st.orelse)
            self.emit("if_end", label=end)
        else:
            self.emit("if_end", label=other)
        self.cache = {k: v for k, v in before.items() if k[1] not in adv}

    def if_args(self, st: If) -> dict:
        """Target hook: the operands an If's condition reads (registers of the target)."""
        return {}

    def varlen_regs(self) -> None:
        """The registers of the varlen decode (templates/common/scheduler.ptx.j2 decode_varlen): scan
        state %vb/%vbase, this sequence's first rows %qoff/%koff, the parameters it reads."""
        for n in ("vb", "vbase", "qoff", "koff", "totq", "totk"):
            self.r("b32", n)
        for n in ("cuq", "cuk", "sused", "rdv"):
            self.r("b64", n)

    # ---- ops ---------------------------------------------------------------------------------
    def op(self, op) -> None:
        idx = self.op_index
        self.op_index += 1
        handler = getattr(self, "op_" + type(op).__name__, None)
        if handler is None or type(op) not in self.OP_PTX:
            raise self.Error(f"{self.p}: {type(op).__name__} has no {self.target} lowering")
        self.emit("marker", index=idx, op=type(op).__name__, what="")
        handler(op)

    def fences(self, op) -> tuple[bool, bool]:
        """Target hook: (fence before, fence after) a thread-synchronising op (sm_100a: tcgen05 fences)."""
        return False, False

    def op_Wait(self, op: Wait) -> None:
        _, after = self.fences(op)
        pre, addr = self.bar_addr(op.barrier, op.state)
        ppre, par = self.parity(op.state)
        note = f"wait {self.bar_note(op.barrier, op.state)}, {self.phase_note(op.state)}"
        self.emit("wait", pre=pre + ppre, addr=addr, parity=par, uid=self.ctx.uid(), pred="%p_w",
                  fence_after=after, note=note)

    def arrivals(self, scope: Scope) -> int:
        """Arrivals one execution of an Arrive of this scope makes."""
        return {Scope.ELECTED: 1, Scope.WARP: len(self.role.warps), Scope.ALL: self.role.threads}[scope]

    def op_Arrive(self, op: Arrive) -> None:
        before, _ = self.fences(op)
        elected = op.scope is Scope.ELECTED
        pre, addr = self.bar_addr(op.barrier, op.slot)
        n = self.arrivals(op.scope)
        who = {Scope.ELECTED: f"the elected lane of {self.p}", Scope.WARP: f"one lane per warp of {self.p}",
               Scope.ALL: f"every thread of {self.p}"}[op.scope]
        note = (f"arrive {self.bar_note(op.barrier, op.slot)}: {who}, {n} of the "
                f"{self.pipe.barrier(op.barrier).count} arrivals per phase")
        self.emit("arrive", pre=pre, addr=addr, elected=elected, fence_before=before,
                  skip=self.label("noel") if elected else "", note=note, scope=op.scope.value)

    def op_ExpectTx(self, op: ExpectTx) -> None:
        pre, addr = self.bar_addr(op.barrier, op.slot)
        note = (f"expect_tx {self.bar_note(op.barrier, op.slot)}: 1 arrival + {op.bytes} transaction bytes "
                "(the TMA loads complete the phase)")
        self.emit("expect_tx", pre=pre, addr=addr, bytes=op.bytes, skip=self.label("noel"), note=note)

    def block_reg(self, ref: BlockRef, dst: str) -> list[tuple]:
        """Instructions computing the K/V block index (blocks visited in reverse: n-1, n-2, ...).
        KV cache (the split's blocks) and sliding windows (the window's blocks) run [%nlo, %nlo + n)
        (plan.BlockInfo's lo), so the index is %nlo + that."""
        ins = self._block_rel(ref, dst)
        if self.cfg.kvcache or self.cfg.window:
            ins = [("mov.u32", dst, "%nlo")] if ins == [("mov.u32", dst, "0")] else ins + [("add.u32", dst, dst, "%nlo")]
        return ins

    def _block_rel(self, ref: BlockRef, dst: str) -> list[tuple]:
        if ref is BlockRef.FIRST:
            return [("sub.u32", dst, "%n", "1")]
        if ref is BlockRef.LAST:
            return [("mov.u32", dst, "0")]
        if self.loop_kind not in (LoopKind.KV, LoopKind.KV_REST):
            raise self.Error(f"{self.p}: block {ref.value} outside a K/V loop")
        if self.COUNT_DOWN:  # %kb = n-1-t, the block itself
            return [("mov.u32", dst, "%kb")] if ref is BlockRef.CUR else [("add.u32", dst, "%kb", "1")]
        if ref is BlockRef.CUR:
            return [("sub.u32", dst, "%n", "1"), ("sub.u32", dst, dst, "%t")]
        return [("sub.u32", dst, "%n", "%t")]  # PREV: iteration t-1

    def op_TmaStoreWait(self, op: TmaStoreWait) -> None:
        self.emit("tma_store_wait", skip=self.label("noel"))

    def op_FenceProxyAsync(self, op: FenceProxyAsync) -> None:
        self.emit("fence_proxy_async")

    def named(self, op) -> tuple[str, int, bool]:
        """(id operand, thread count, per-warp) of a named-barrier op."""
        b = self.pipe.barrier(op.barrier)
        kind, v = self.slot(op.slot)
        if kind != "const":
            raise self.Error("named barriers take constant slots")
        if b.per_warp:  # instance slot*4 + warp % 4 (engine model)
            return self.r("b32", f"nbid_{self.p}_{v}"), 64, True
        return str(b.named_id + v), b.count, False

    def op_NamedArrive(self, op: NamedArrive) -> None:
        before, _ = self.fences(op)
        bid, count, _ = self.named(op)
        self.emit("named_arrive", id=bid, count=count, fence_before=before)

    def op_NamedSync(self, op: NamedSync) -> None:
        _, after = self.fences(op)
        bid, count, _ = self.named(op)
        self.emit("named_sync", id=bid, count=count, fence_after=after)

    def op_FetchTask(self, op: FetchTask) -> None:
        # the counter's address is read from the parameter at each fetch, not held in a register pair
        # for the whole kernel by the fetching role, whose budget is the smallest
        self.emit("fetch_task", dst="%task", counter=self.r("b64", "tctr"), param="task_counter",
                  note="the dynamic deal: the next task index from the launch's task counter")

    def op_PublishTask(self, op: PublishTask) -> None:
        pre, base, off = self.smem_addr(op.region, op.slot, "%qb")
        self.emit("publish_task", pre=pre, addr=f"{base}+{off}", src="%task",
                  note=f"the task index to {op.region}[{self.slot_note(op.slot)}]")

    def op_ReadTask(self, op: ReadTask) -> None:
        pre, base, off = self.smem_addr(op.region, op.slot, "%qb")
        self.emit("read_task", pre=pre, addr=f"{base}+{off}", dst="%task",
                  note=f"the task index from {op.region}[{self.slot_note(op.slot)}]")

    def op_Advance(self, op: Advance) -> None:
        self._drop({op.state})
        st = self.role.state(op.state)
        if self.SPLIT_STATES:
            if not 0 < st.stride < st.depth and st.depth > 1:
                raise self.Error(f"{self.p}: state {st.name}: split registers advance by 0 < stride < depth")
            sreg, preg = self.split_regs(op.state)
            if st.depth == 1:
                ins = [("xor.b32", preg, preg, "1")]
            elif st.stride == 1:  # the wrap is slot == depth: a select, no subtract (one instruction fewer)
                ins = [("add.u32", sreg, sreg, "1"), ("setp.eq.u32", "%p_q", sreg, str(st.depth)),
                       ("@%p_q mov.u32", sreg, "0"), ("@%p_q xor.b32", preg, preg, "1")]
            else:
                ins = [("add.u32", sreg, sreg, str(st.stride)), ("setp.ge.u32", "%p_q", sreg, str(st.depth)),
                       ("@%p_q sub.u32", sreg, sreg, str(st.depth)), ("@%p_q xor.b32", preg, preg, "1")]
            self.emit("advance_split", list=ins,
                      note=f"advance state {op.state}: slot += {st.stride} mod {st.depth}, parity flips on the wrap")
            return
        self.emit("advance", q=self.qreg(op.state), add=st.stride % (2 * st.depth), wrap=2 * st.depth,
                  note=f"advance state {op.state}: q += {st.stride % (2 * st.depth)} mod {2 * st.depth}")
