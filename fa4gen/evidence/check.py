"""`fa4gen check`: read a PTX file back (as it is on disk) against the verified IR of its manifest's
config, and list every difference with its PTX line and the IR op it should be.

One reader for both targets (`_read_section`): each role section ($L_role_<name> .. $L_<name>_end;
sm_90a: on to its ret) is read instruction by instruction, every instruction classified by the
target's Spelling (fa4gen/lower: the classes its OP_PTX rows name, the ring-state register names of
the walker), into ordered protocol events: mbarrier waits with barrier, slot and parity state;
arrives, expect_tx bytes; TMA loads/stores with tensor, region, slot and barrier; named barriers with
id and thread count; bulk-store waits, proxy fences; ring-state advances (step and wrap); sm_100a's
tcgen05.mma (D/A TMEM columns, B state, N, B major, accumulate flag, k steps), commits, tcgen05.ld/st
columns, wait::ld/st; sm_90a's wgmma groups (k steps, fenced) and wait_group depths. Addresses are
resolved through the SMEM layout (the manifest's on sm_100a, the one derived from the Pipeline on
sm_90a) and address registers followed back to the State register they came from. A role instance is
read with what it knows (its warpgroup index, on sm_90a the instance index %cw computed from it):
branches on it are followed and named-barrier ids held in registers evaluated, so the sm_90a consumer
warpgroups' one section is read once per instance and compared with that instance's verified program.
For every mbarrier the arrivals of one phase (the threads each arriving role instance lets through: its
warps, the arrive's predicate and the branches around it) must be its mbarrier.init count, both read
from the PTX. Also checked: every slot initialised once with the IR's count, each ring state's start;
sm_100a: the TMEM allocation, each role's TMEM lane field, the setup sync and setmaxnreg budgets.
What the IR does not describe (descriptors, wgmma.fence, data-path arithmetic) is `fa4gen emulate`'s.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field

from ..spec.config import KernelConfig
from .ptxemu.parse import _split_top as _operands
from ..spec.encodings import EncodingError, Major, TcgenInstrDesc
from ..ir.core import (Advance, Arrive, BarrierKind, BlockRef, Commit, ExpectTx, FenceProxyAsync, Mma,
                       MmaWait, NamedArrive, NamedSync, Scope, StoreO, StorePartial, StoreRows, TmaLoad, TmaStore, TmaStoreWait, TmemLd, TmemSt,
                       Wait, WaitLd, WaitSt, walk_ops)


class CheckUsageError(Exception):
    """The manifest does not describe a buildable config (exit 2)."""


@dataclass(frozen=True)
class Difference:
    role: str
    line: int | None  # PTX line (None: something the PTX lacks)
    got: str
    want: str

    def __str__(self):
        where = f"PTX line {self.line}" if self.line else "missing from the PTX"
        return f"[{self.role}] {where}: {self.got} -- the IR says: {self.want}"


@dataclass
class CheckReport:
    name: str
    arch: str
    differences: list = field(default_factory=list)
    events: dict = field(default_factory=dict)  # role -> number of events compared
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        head = (f"{self.name} ({self.arch}): " + ("PTX protocol == IR" if self.ok else
                                                   f"{len(self.differences)} difference(s)"))
        roles = ", ".join(f"{r} {n}" for r, n in self.events.items())
        lines = [head, f"  events compared per role: {roles}"]
        lines += [f"  {d}" for d in self.differences]
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


# ---- shared PTX reading ---------------------------------------------------------------------------
_INSTR = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);\s*$")
_LABEL = re.compile(r"^\s*(\$\w+):\s*$")


@functools.lru_cache(maxsize=1 << 16)
def _parsed(line: str):
    """(predicate, mnemonic, operand text, operands) of an instruction line (None: not one)."""
    m = _INSTR.match(line)
    return (m.group(1) or "", m.group(2), m.group(3), tuple(_operands(m.group(3)))) if m else None


def _numbered(ptx: str) -> list[tuple[int, str]]:
    return [(i + 1, ln.split("//")[0].rstrip()) for i, ln in enumerate(ptx.splitlines())]


def config_of(manifest: dict) -> KernelConfig:
    try:
        return KernelConfig(**manifest["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckUsageError(f"the manifest's config does not build a KernelConfig: {e}") from None


def check_ptx(ptx: str, manifest: dict) -> CheckReport:
    """Every difference between the PTX and what the manifest's config says it is: the file's
    entries are exactly the manifest's (a KV-cache module: fa4_fwd and fa4_combine), the main entry's
    protocol is read back against the verified IR, and a combine entry gets the static checks of
    `_check_combine` (no IR describes it: the report says so)."""
    from .ptxemu.parse import PtxSyntaxError, manifest_entries, parse_for_manifest
    cfg = config_of(manifest)
    rep = CheckReport(manifest.get("name", cfg.name), cfg.arch)
    try:
        mods = parse_for_manifest(ptx, manifest)
    except PtxSyntaxError as e:
        rep.differences.append(Difference("parse", None, f"not readable as the manifest's kernels: {e}",
                                          "the emitted PTX"))
        return rep
    entries = manifest_entries(manifest)
    if cfg.kvcache and not manifest.get("kvcache"):
        rep.differences.append(Difference("manifest", None, "a KV-cache config without the manifest's \"kvcache\" record",
                                          "plan.kvcache_manifest(cfg): the cache layout and the fa4_combine entry"))
    mod = mods[entries[0]]
    if mod.target != cfg.arch:
        rep.differences.append(Difference("header", None, f".target {mod.target}", f"the manifest's arch {cfg.arch}"))
        return rep
    pipe, report = _verified(cfg)
    if not report.ok:
        rep.differences.append(Difference("ir", None, "the IR of this config does not verify",
                                          "; ".join(f"[{f.code}] {f.subject}" for f in report.findings)))
        return rep
    rep = (_check_sm100 if cfg.arch == "sm_100a" else _check_sm90)(_entry_text(ptx, mod, mods), manifest, cfg, pipe,
                                                                    rep)
    if cfg.kvcache:
        rep.notes.append(f"{entries[0]}: read back at the IR's level; the split-KV partial stores, the cache_seqlens "
                         "and page-table reads are not IR events (`fa4gen emulate` judges them)")
    for extra in entries[1:]:
        _check_combine(mods[extra], _entry_text(ptx, mods[extra], mods), manifest, cfg, rep)
    named = name_in_header(ptx)
    if named and named != manifest.get("name"):
        rep.notes.append(f"note: the PTX header names {named}, the manifest {manifest.get('name')}")
    return rep


def _entry_text(ptx: str, mod, mods: dict) -> str:
    """The file with only the module header (the lines before the first entry) and `mod`'s own
    lines left; every other line is blank, so line numbers stay the file's."""
    first = min(m.lines[0] for m in mods.values())
    lo, hi = mod.lines
    return "\n".join(t if i < first or lo <= i <= hi else "" for i, t in enumerate(ptx.splitlines(), start=1))


def _check_combine(mod, text: str, manifest: dict, cfg: KernelConfig, rep: CheckReport) -> None:
    """fa4_combine, the split-KV merge of a KV-cache module: no IR describes it, so it is not read back
    against one (the note says so; `fa4gen emulate` judges what it computes). What is checked: its
    parameters are plan.combine_abi_params in order with their declared types (and the manifest's list),
    .maxntid is the manifest's threads_per_cta, it touches no shared memory, mbarrier, named barrier,
    TMA, tensor core or async proxy (it is a plain load/compute/store kernel that runs after fa4_fwd),
    each lane's O store and its LSE store go to global memory, and every ld.param reads a declared
    parameter."""
    from ..spec.plan import combine_abi_params
    params = combine_abi_params(cfg)
    role = mod.entry
    rec = (manifest.get("kvcache") or {}).get("combine", {})
    want = [n for n, _ in params]
    got = [p.name for p in mod.params]
    if got != want or list(rec.get("params", want)) != want:
        rep.differences.append(Difference(role, mod.lines[0], f"parameters {got} (manifest: {rec.get('params')})",
                                          f"the combine ABI {want} (fa4gen.spec.plan.combine_abi_params)"))
    for p, (name, decl) in zip(mod.params, params):
        m = re.match(r"\.param\s+(\.\w+)\s+(\w+)$", decl)
        if m and p.name == name and p.type != m.group(1):
            rep.differences.append(Difference(role, mod.lines[0], f"parameter {p.name} {p.type}", decl))
    threads = rec.get("threads_per_cta")
    if threads is not None and mod.maxntid != int(threads):
        rep.differences.append(Difference(role, mod.lines[0], f".maxntid {mod.maxntid}",
                                          f"the manifest's {threads} threads per combine CTA"))
    declared = {p.name for p in mod.params}
    stores = set()
    # launched programmatically (plan.COMBINE_PROGRAMMATIC), it may start while fa4_fwd still writes
    # the partials: an unguarded griddepcontrol.wait must come before its first global load
    waited = not rec.get("programmatic", False)
    for ins in mod.instrs:
        opc = ins.opcode
        if opc == "griddepcontrol.wait" and ins.guard is None:
            waited = True
        if opc.startswith("ld.global") and not waited:
            rep.differences.append(Difference(role, ins.line, ins.text, "griddepcontrol.wait before the first global "
                                              "load (the manifest launches the combine programmatically)"))
            waited = True  # one report
        if opc.startswith(("mbarrier", "bar.", "barrier", "cp.", "wgmma", "tcgen05", "fence", "setmaxnreg")) or \
                opc == "bar" or ".shared" in opc:
            rep.differences.append(Difference(role, ins.line, ins.text, "no SMEM, barrier, TMA, tensor-core or "
                                                                        "async-proxy instruction in the combine"))
        if opc.startswith("ld.param"):
            src = ins.operands[1]
            name = getattr(getattr(src, "base", None), "name", None)
            if name not in declared:
                rep.differences.append(Difference(role, ins.line, ins.text, f"ld.param of one of {sorted(declared)}"))
        if opc.startswith("st."):
            stores.add("global" if opc.startswith("st.global") else opc)
    if stores != {"global"}:
        rep.differences.append(Difference(role, None, f"stores {sorted(stores) or 'none'}",
                                          "O and LSE stored with st.global"))
    rep.notes.append(f"{role}: not checked against an IR (none describes it); checked: its parameters, .maxntid, "
                     f"no SMEM / barrier / async instruction, global stores ({len(mod.instrs)} instructions); what it "
                     "computes is judged by `fa4gen emulate`")


def name_in_header(ptx: str) -> str | None:
    """The kernel name the generator writes in the PTX's first comment line (None if absent)."""
    m = re.match(r"^//\s*\n//\s*(fa4_\w+):", ptx)
    return m.group(1) if m else None


def _verified(cfg: KernelConfig):
    from ..codegen import _pipeline, verify_cached
    pipe = _pipeline(cfg)
    report, _ = verify_cached(pipe)
    return pipe, report


# ---- the reader, both targets --------------------------------------------------------------------
class _Layout:
    """Offsets -> names, from the SMEM layout (the manifest's record on sm_100a, the one derived from
    the Pipeline on sm_90a: walk.smem_layout) and the pipeline (TMEM, named barriers)."""

    def __init__(self, pipe, lay: dict):
        self.lay = lay
        self.bars = [(lay["barriers"][b.name], b.slots, b.name) for b in pipe.barriers
                     if b.kind is not BarrierKind.NAMED]
        self.regions = [(v["offset"], v["bytes_per_slot"], v["slots"], k) for k, v in lay["regions"].items()]
        self.named = {}
        for b in pipe.barriers:
            if b.kind is BarrierKind.NAMED:
                per_warp = b.per_warp
                for s in range(b.slots):
                    self.named[b.named_id + s] = (b.name, s // 4 if per_warp else s, b.count)

    @classmethod
    def derived(cls, pipe):
        from ..lower.walk import smem_layout
        sl = smem_layout(pipe)
        return cls(pipe, {"barriers": sl.barriers, "regions": {k: {"offset": o, "bytes_per_slot": n, "slots": s}
                                                                for k, (o, n, s) in sl.regions.items()}})

    def barrier(self, off: int):
        for base, slots, name in self.bars:
            if base <= off < base + 8 * slots and (off - base) % 8 == 0:
                return name, (off - base) // 8
        return None

    def slot_bytes(self, name: str) -> int:
        return next(size for _, size, _, n in self.regions if n == name)

    def region(self, off: int):
        for base, size, slots, name in self.regions:
            if base <= off < base + size * slots:
                return name, (off - base) // size, (off - base) % size
        return None


class _Unreadable(Exception):
    def __init__(self, line, msg):
        super().__init__(msg)
        self.line = line


def _role_sections(numbered, roles, to_ret: bool = False) -> dict:
    """Role name -> its (line, text) list: from label $L_role_<name> to $L_<name>_end (to_ret: on to
    the role's ret, the end label included)."""
    out = {}
    idx = {text.strip(): i for i, (_, text) in enumerate(numbered) if _LABEL.match(text)}
    for r in roles:
        a, b = idx.get(f"$L_role_{r}:"), idx.get(f"$L_{r}_end:")
        if a is not None and b is not None and a < b:
            if to_ret:
                b = next((i + 1 for i in range(b, len(numbered)) if numbered[i][1].strip() == "ret;"), b + 1)
            out[r] = numbered[a + 1:b]
    return out


# ---- values the reader can know: integers and predicates computed from constants and the role
# instance's warpgroup (%wg), along straight-line code (a label forgets what is not fixed for the section)
_ARITH = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
          "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
          "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "min": min, "max": max}
_CMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
        "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}
# who a predicate selects: `setp.eq.u32 P, REG, 0` on these registers picks one thread of a group of N
# (None: of the CTA)
_ONE_OF = {"%lane": 32, "%ctid": 128, "%tidx": None}
_THREAD_IDS = ("%tid.x", "%laneid")


def _value(op, env):
    if re.fullmatch(r"-?\d+|0[xX][0-9a-fA-F]+", op):
        return int(op, 0)
    return env.get(op)


def _evaluate(opc, ops, env):
    """The value an instruction writes to ops[0], if the reader knows it (None otherwise)."""
    parts = opc.split(".")
    vals = [_value(o, env) for o in ops[1:]]
    if None in vals or not vals:
        return None
    if parts[0] == "mov" and len(vals) == 1:
        return vals[0]
    if parts[0] == "setp" and len(vals) == 2 and parts[1] in _CMP:
        return _CMP[parts[1]](vals[0], vals[1])
    if opc in ("and.pred", "or.pred") and len(vals) == 2:
        return (vals[0] and vals[1]) if opc == "and.pred" else (vals[0] or vals[1])
    if parts[0] == "mad" and len(vals) == 3:
        return (vals[0] * vals[1] + vals[2]) & 0xFFFFFFFF
    if parts[0] in _ARITH and len(vals) == 2 and parts[-1] in ("u32", "s32", "b32"):
        return _ARITH[parts[0]](vals[0], vals[1]) & 0xFFFFFFFF
    return None


def _setup_facts(numbered, first_section: int):
    """(predicate definitions, thread-dependent registers) of the kernel's code before its roles."""
    defs, tainted = {}, set(_THREAD_IDS)
    for _, line in numbered[:first_section]:
        m = _parsed(line)
        if m:
            _note_def(m[1], m[3], defs, tainted, {})
    return defs, tainted


def _dest(opc, ops) -> str | None:
    """The register an instruction writes (None: it writes none, or memory)."""
    if not ops or opc.startswith(("st.", "bra", "bar", "mbarrier", "cp.", "wgmma", "tcgen05", "fence")):
        return None
    dst = ops[0].split("|")[-1]
    return dst if re.fullmatch(r"%\w+", dst) else None


def _note_def(opc, ops, defs, tainted, env):
    """Record what an instruction writes: the definition of a predicate, whether the register now depends
    on the thread (a value the reader knows does not)."""
    dst = _dest(opc, ops)
    if dst is None:
        return
    defs[dst] = (opc, ops)
    srcs = [r for o in ops[1:] for r in re.findall(r"%[\w.]+", o)]
    if opc.startswith("elect.sync") or (any(r in tainted for r in srcs) and dst not in env):
        tainted.add(dst)
    else:
        tainted.discard(dst)


def _issuers(pred, defs, tainted, env, threads):
    """How many of the role's `threads` a predicate `P` / `!P` lets through (None: not readable)."""
    neg = pred.startswith("!")
    p = pred.lstrip("!")
    if p in env:
        return threads if bool(env[p]) != neg else 0
    if p not in tainted:
        return threads  # the same for every thread of the role: when it runs, all of them do
    if neg:
        return None
    opc, ops = defs.get(p, ("", ()))
    if opc.startswith("elect.sync"):
        return threads // 32
    if opc == "setp.eq.u32" and len(ops) == 3 and ops[1] in _ONE_OF and ops[2] == "0":
        n = _ONE_OF[ops[1]]
        return 1 if n is None else max(threads // n, 1)
    if opc == "and.pred" and len(ops) == 3:
        a, b = (_issuers(x, defs, tainted, env, threads) for x in ops[1:])
        return None if a is None or b is None else min(a, b)
    return None


def _retried(lines, i: int, labels: dict, pred: str) -> bool:
    """Is the try_wait at lines[i - 1] a wait: the next instruction `@!pred bra L` with L the label just
    before it? A try_wait may return false before the phase completes (its time limit): without the
    branch back the role runs on, unsynchronised, whenever it does."""
    def quiet(t):  # a blank or comment line
        return not t.strip() or t.strip().startswith("//")
    nxt = next((t.strip() for _, t in lines[i:] if not quiet(t)), "")
    m = re.match(rf"@!{re.escape(pred)}\s+bra(?:\.uni)?\s+(\S+);", nxt)
    j = labels.get(m.group(1)) if m else None
    return j is not None and j < i - 1 and all(quiet(t) for _, t in lines[j + 1:i - 1])


def _read_section(role: str, lines, pipe, lay: _Layout, spell, threads: int, setup, env0: dict) -> tuple:
    """The protocol events of one role section as one instance of it runs it: `env0` fixes what the
    instance knows (its warpgroup %wg), branches on what the reader knows (the instance index) are
    followed; `spell` (the target's walk.Spelling) classifies every instruction. -> (events, arrivals:
    [(line, barrier, threads issuing or None)])."""
    tmaps = {"%tmq": "q", "%tmk": "k", "%tmv": "v", "%tmo": "o"}
    prov: dict = {}
    consts: dict = {}
    bases: set = set()  # registers holding %smem / %bar itself
    strides: dict = {}  # register -> ("%bar" | "%smem", bytes per slot) of `mad.lo.u32 r, slot, K, base`
    slot_of: dict = {}  # register -> (state, depth or None while unfinished) of a slot derived from a ring state
    guards: list = []  # (label, predicate) of each `@!P bra L` around this point
    events: list = []
    arrivals: list = []
    pending_before = False
    last_was_sync = False
    selp: dict = {}
    setp_ge: dict = {}
    sq_guard: set = set()
    rows_src: list = []
    wg_steps, wg_fenced = 0, False
    depths = {st.name: st.depth for st in _role_named(pipe, role).states}
    defs, tainted = dict(setup[0]), set(setup[1])
    env = dict(env0)
    # fixed for the section: what the straight-line code before its first label writes and nothing after
    first_label = next((k for k, (_, t) in enumerate(lines) if _LABEL.match(t)), len(lines))
    later = set()
    for _, line in lines[first_label:]:
        m = _parsed(line)
        later.add(_dest(m[1], m[3]) if m else None)
    fixed = {r for _, line in lines[:first_label] for m in [_parsed(line)] if m
             for r in [_dest(m[1], m[3])] if r and r not in later}
    then_ends: list = []  # labels ending the then-branch of a known-false `@P bra` now being read
    labels = {text.strip()[:-1]: i for i, (_, text) in enumerate(lines) if _LABEL.match(text)}

    def src_states(ops):
        s = set()
        for o in ops:
            for reg in re.findall(r"%\w+", o):
                st = spell.state_of(reg, role)
                if st:
                    s.add(st)
                elif reg in prov:
                    s |= prov[reg]
        return frozenset(s)

    i = 0
    while i < len(lines):
        ln, line = lines[i]
        i += 1

        def addr(op, ln=ln):
            m = re.match(r"\[(%\w+)(?:\+(\d+))?\]$", op)
            if not m:
                raise _Unreadable(ln, f"unexpected address {op}")
            base, off = m.group(1), int(m.group(2) or 0)
            if base in ("%bar", "%smem") or base in bases:
                return None, off
            if base in strides:  # slot * stride + %bar / %smem: the stride is the slot's size
                kind, k = strides[base]
                if kind == "%bar" and k != 8:
                    raise _Unreadable(ln, f"{base} steps {k} bytes per ring slot from %bar: an mbarrier slot is 8")
                reg = lay.region(off) if kind == "%smem" else None
                if reg is not None and k != lay.slot_bytes(reg[0]):
                    raise _Unreadable(ln, f"{base} steps {k} bytes per ring slot from %smem: a slot of "
                                          f"{reg[0]} is {lay.slot_bytes(reg[0])}")
            st = prov.get(base, frozenset())
            if len(st) != 1:
                raise _Unreadable(ln, f"address register {base} not derived from exactly one State ({set(st)})")
            return next(iter(st)), off

        def bar_slot(op, ln=ln):
            state, off = addr(op)
            hit = lay.barrier(off)
            if hit is None:
                raise _Unreadable(ln, f"offset {off} is no mbarrier slot of the layout")
            name, k = hit
            return name, (k if state is None else (state, k))

        lm = _LABEL.match(line)
        if lm:
            lab = lm.group(1)
            guards = [g for g in guards if g[0] != lab]
            if then_ends and then_ends[-1] == lab:
                then_ends.pop()
            env = {k: v for k, v in env.items() if k in fixed or k in env0}
            continue
        m = _parsed(line)
        if not m:
            continue
        pred, opc, ops = m[0].strip(), m[1], list(m[3])
        p = pred.lstrip("@")
        if p and p.lstrip("!") in env and not opc.startswith("bra"):  # a predicate the reader knows
            if bool(env[p.lstrip("!")]) == p.startswith("!"):
                continue  # this instance does not run it
            pred, p = "", ""
        cls = spell.classify(opc)
        elected = any(g[1] in spell.single for g in guards) or p in spell.single
        ev = None
        if opc.startswith("bra"):
            target = ops[0]
            if p and p.lstrip("!") in env:  # a branch the reader can follow
                if bool(env[p.lstrip("!")]) != p.startswith("!"):
                    j = labels.get(target)
                    if j is None:
                        break  # out of the role: this instance runs nothing more of it
                    if j < i:
                        raise _Unreadable(ln, f"a known branch back to {target}")
                    i = j
                else:
                    then_ends.append(target)
                continue
            if not p and then_ends and i < len(lines) and lines[i][1].strip() == f"{then_ends[-1]}:":
                then_ends.pop()  # the end of a then-branch the instance took: skip its else-branch
                j = labels.get(target)
                if j is None:
                    break
                i = j
                continue
            if p.startswith("!") and not opc.endswith(".uni") and p[1:] in tainted and target in labels \
                    and labels[target] >= i:
                guards.append((target, p[1:]))
            continue
        if opc == "ret":
            break
        if cls == "mbarrier.try_wait.parity":
            name, slot = bar_slot(ops[1])
            par = ops[2]
            st = spell.state_of(par, role, "parity_reg") or spell.state_of(par, role)
            if spell.parity_reg is not None:
                parity = st if spell.state_of(par, role, "parity_reg") else f"? ({par})"
            elif st:  # a one-slot ring: q in [0, 2) is the parity itself
                parity = st if depths.get(st) == 1 else f"{st} used directly as parity (depth {depths.get(st)})"
            elif par in selp and selp[par][2] in setp_ge:
                a_, b_, p_ = selp[par]
                st, d_ = setp_ge[p_]
                parity = st if (a_, b_, d_) == ("1", "0", str(depths.get(st))) else \
                    f"{st} with parity selp {a_}, {b_} on q >= {d_} (depth {depths.get(st)})"
            else:
                parity = f"? ({par})"
            ev = ("wait", name, slot, parity if _retried(lines, i, labels, ops[0]) else
                  f"{parity}, not retried (a wait is the try_wait looped on by `@!{ops[0]} bra` back to it)")
        elif cls == "mbarrier.arrive.expect_tx":
            name, slot = bar_slot(ops[1])
            ev = ("expect_tx", name, slot, int(ops[2], 0), elected)
        elif cls == "mbarrier.arrive":
            name, slot = bar_slot(ops[1])
            ev = ("arrive", name, slot, elected, pending_before)
        elif cls == "cp.async.bulk.tensor.s2g":
            ev = ("tma_store", tmaps.get(ops[0][1:].split(",")[0].strip(), "?"), elected)
        elif cls == "cp.async.bulk.tensor.g2s":
            st, off = addr(ops[0])
            reg = lay.region(off)
            if reg is None:
                raise _Unreadable(ln, f"TMA destination offset {off} is in no SMEM region")
            region, slot, _ = reg
            bname, bslot = bar_slot(ops[2])
            ev = ("tma_load", tmaps.get(ops[1][1:].split(",")[0].strip(), "?"), region,
                  slot if st is None else (st, slot), bname, bslot, elected)
        elif cls == "cp.async.bulk.commit_group":
            ev = ("bulk_commit", elected)
        elif cls == "cp.async.bulk.wait_group.read":
            ev = ("store_wait", elected)
        elif cls == "tcgen05.mma":
            d = re.match(r"\[%tmem\+(\d+)\]$", ops[0])
            try:
                idesc = TcgenInstrDesc.decode(int(ops[3], 0))
            except (EncodingError, ValueError) as e:
                raise _Unreadable(ln, f"instruction descriptor {ops[3]}: {e}") from None
            if ops[1].startswith("["):
                am = re.match(r"\[%tmem\+(\d+)\]$", ops[1])
                a = ("tmem", int(am.group(1)) if am else ops[1])
            else:
                a = ("smem", tuple(sorted(src_states([ops[1]]))))
            ev = ("mma", int(d.group(1)) if d else ops[0], a, tuple(sorted(src_states([ops[2]]))), idesc.n,
                  idesc.b_major.name, ops[4], pred == "@%p_el", idesc.m, idesc.a_major.name, idesc.a_type.name)
        elif cls == "tcgen05.commit":
            name, slot = bar_slot(ops[0])
            ev = ("commit", name, slot, pred == "@%p_el")
        elif cls in ("tcgen05.ld", "tcgen05.st"):
            n = int(re.search(r"\.x(\d+)\.", opc).group(1))
            cm = re.match(r"\[%tml\+(\d+)\]$", ops[1] if cls == "tcgen05.ld" else ops[0])
            col = int(cm.group(1)) if cm else -1
            ev = ("tmem_ld" if cls == "tcgen05.ld" else "tmem_st", col, col + n)
        elif cls == "tcgen05.wait::ld":
            ev = ("wait_ld",)
        elif cls == "tcgen05.wait::st":
            ev = ("wait_st",)
        elif cls in ("bar.arrive", "bar.sync") and ops[0] != "0":
            if ops[0].startswith("%"):
                bid = env.get(ops[0], consts.get(ops[0]))
            else:
                bid = int(ops[0])
            if bid not in lay.named:
                raise _Unreadable(ln, f"{opc} {ops[0]}: id {bid} is no named barrier of the IR"
                                  + (" (the register's value is not computed from the instance index)"
                                     if bid is None else ""))
            name, slot, _count = lay.named[bid]
            threads_ = int(ops[1]) if len(ops) > 1 else None
            ev = (cls.replace(".", "_"), name, slot, pending_before if cls == "bar.arrive" else None, threads_)
        elif cls == "wgmma.fence":
            wg_fenced = True
            continue
        elif cls == "wgmma.mma_async":
            wg_steps += 1
            continue
        elif cls == "wgmma.commit_group":
            ev = ("wgmma", wg_steps, wg_fenced)
            wg_steps, wg_fenced = 0, False
        elif cls == "wgmma.wait_group":
            ev = ("wgmma_wait", int(ops[0], 0))
        elif opc.startswith("ld.shared.v4"):  # StoreRows: the threads read the O staging slot
            try:
                st, off = addr(ops[1])
                reg = lay.region(off)
                src = (reg[0], reg[1] if st is None else (st, reg[1])) if reg else None
            except _Unreadable:
                src = None  # sm_90a: each consumer's slot, from %cw (the store's rows are what is read back)
            rows_src[:] = [(src, pred)]
            continue
        elif opc.startswith("st.global.v4.f32"):  # StorePartial (KV cache): fp32 O of the thread's row
            q = pred.lstrip("@")
            ev = ("store_partial", "rows < %sq" if q in sq_guard and not q.startswith("!")
                  else f"st.global predicate {pred or 'none'}")
        elif opc.startswith("st.global.v4.b32") and ops[0].lstrip("[").startswith("%kop"):
            # StoreO (O not staged): the thread's row of cast O from its registers, through the
            # address register StorePartial's fp32 rows take
            q = pred.lstrip("@")
            ev = ("store_o", "rows < %sq" if q in sq_guard and not q.startswith("!")
                  else f"st.global predicate {pred or 'none'}")
        elif opc.startswith("st.global.v4"):  # ... and write its rows to global memory
            src, ld_pred = rows_src[0] if rows_src else (None, None)
            q = pred.lstrip("@")
            rows = ("rows < %sq" if q in sq_guard and not q.startswith("!") and ld_pred == pred
                    else f"st.global predicate {pred or 'none'}, ld.shared predicate {ld_pred or 'none'}")
            ev = ("store_rows",) + (src or ("?", None)) + (rows,)
            if events and events[-1][1] == ev:  # one op: a row group per instruction pair
                continue
        elif cls == "fence.proxy.async.shared::cta":
            ev = ("fence_proxy_async",)
        elif cls == "tcgen05.fence::before_thread_sync":
            pending_before = True
            continue
        elif cls == "tcgen05.fence::after_thread_sync":
            if last_was_sync:
                events[-1] = (events[-1][0], events[-1][1] + ("fence_after",))
                last_was_sync = False
                continue
            ev = ("fence_after without a wait",)
        elif opc.startswith(("tcgen05.", "mbarrier.", "cp.async.", "bar.", "fence.", "wgmma.")) \
                and opc != "bar.warp.sync":
            ev = ("unknown protocol instruction", opc)
        elif ops and (spell.state_of(ops[0], role) or spell.state_of(ops[0], role, "parity_reg")):
            ev = _advance(role, opc, pred, ops, lines, i, spell)
            if ev is None:
                continue  # the state's initial value (read by _state_inits)
            i += ev[1]
            ev = ev[0]
        else:
            if ops and re.match(r"%\w+$", ops[0]) and not opc.startswith(("st.", "setp", "bra")):
                dst = ops[0]
                s = src_states(ops[1:])
                if s:
                    prov[dst] = s
                else:
                    prov.pop(dst, None)
                if opc == "add.u32" and len(ops) > 2 and ops[1] == "%warp4":
                    consts[dst] = int(ops[2], 0)
                if opc == "mov.u32" and len(ops) == 2 and ops[1] in ("%smem", "%bar"):
                    bases.add(dst)
                else:
                    bases.discard(dst)
                if opc == "mad.lo.u32" and len(ops) == 4 and ops[3] in ("%bar", "%smem") and s \
                        and re.match(r"\d+$", ops[2]):
                    strides[dst] = (ops[3], int(ops[2]))
                    q_, d_ = slot_of.get(ops[1], (None, 0))
                    if q_ is not None and d_ is None:  # an address (barrier, TMA box, MMA operand) from it
                        raise _Unreadable(ln, f"{ops[1]}, the slot of ring state {q_}, is not {q_} mod "
                                              f"{depths.get(q_)} (`mov {ops[1]}, q` then `@p sub {ops[1]}, q, depth` "
                                              "with p = q >= depth)")
                else:
                    strides.pop(dst, None)
                # a ring slot kept apart from its state (sm_100a: q in [0, 2 depth), the parity q >= depth):
                # `mov %qs, %q` then `@%p sub %qs, %q, depth` with %p = (q >= depth) is q mod depth
                q0 = spell.state_of(ops[1], role) if len(ops) > 1 else None
                if opc == "mov.u32" and len(ops) == 2 and q0 and not pred:
                    slot_of[dst] = (q0, None)
                elif dst in slot_of and slot_of[dst][0] == q0:  # the slot's reduction, or an edit of it
                    ok = opc == "sub.u32" and len(ops) == 3 and re.match(r"@%\w+$", pred) \
                        and setp_ge.get(pred[1:]) == (q0, ops[2]) and ops[2] == str(depths.get(q0))
                    slot_of[dst] = (q0, int(ops[2]) if ok else None)
                else:
                    slot_of.pop(dst, None)
            if opc.startswith("setp") and ops:
                # rows < %sq, alone or and-ed with another predicate (D = 96's copy: its chunks < 12)
                if (opc == "setp.lt.u32" and len(ops) == 3 or opc == "setp.lt.and.u32" and len(ops) == 4) \
                        and ops[2] == "%sq":
                    sq_guard.add(ops[0])
                else:
                    sq_guard.discard(ops[0])
            if opc.startswith("setp") and len(ops) >= 3:
                s = src_states(ops[1:])
                if s:
                    prov[ops[0]] = s
            if opc.startswith("selp") and len(ops) >= 4:
                prov[ops[0]] = src_states(ops[1:])
                selp[ops[0]] = (ops[1], ops[2], ops[3])
            if opc.startswith("setp") and ops:
                setp_ge.pop(ops[0], None)  # a predicate written again no longer says q >= depth
            if opc == "setp.ge.u32" and len(ops) == 3:
                qs = spell.state_of(ops[1], role)
                if qs:
                    setp_ge[ops[0]] = (qs, ops[2])
        if not (ev and ev[0] in ("advance",)):
            dst = _dest(opc, ops)
            if dst and cls is None:
                val = _evaluate(opc, ops, env) if not p else None
                if val is None:
                    env.pop(dst, None)
                else:
                    env[dst] = val
                _note_def(opc, ops, defs, tainted, env)
        if ev is not None:
            if ev[0] in ("arrive", "expect_tx"):
                who = threads
                for _, g in guards:
                    w = _issuers(g, defs, tainted, env, threads)
                    who = None if w is None or who is None else min(who, w)
                if p and who is not None:
                    w = _issuers(p, defs, tainted, env, threads)
                    who = None if w is None else min(who, w)
                arrivals.append((ln, ev[1], ev[2], who, pred or "no predicate"))
            if ev[0] in ("arrive", "bar_arrive"):
                pending_before = False
            events.append((ln, ev))
            last_was_sync = ev[0] in ("wait", "bar_sync")
    return _collapse(events), arrivals


def _advance(role, opc, pred, ops, lines, i, spell):
    """A write to a ring state's register: its initial `mov` (None) or the walker's advance, read as
    (("advance", state, step, modulus) or a malformed one, instructions consumed after this one)."""
    st = spell.state_of(ops[0], role) or spell.state_of(ops[0], role, "parity_reg")
    if opc == "mov.u32" and not pred and re.fullmatch(r"\d+", ops[1] if len(ops) > 1 else ""):
        return None
    if spell.parity_reg is not None and spell.state_of(ops[0], role, "parity_reg") and not pred \
            and opc == "xor.b32" and ops[1:] == [ops[0], "1"]:
        return ("advance", st, 1, 1), 0  # a one-slot ring: the parity flips
    text = f"{pred + ' ' if pred else ''}{opc} {', '.join(ops)}"
    if pred or opc != "add.u32" or len(ops) != 3 or ops[1] != ops[0] or not spell.state_of(ops[0], role):
        return ("write of a ring state's register", st, text), 0
    s = ops[0]
    nxt = []
    for _, t in lines[i:i + (3 if spell.parity_reg else 2)]:
        nxt.append(t.split("//")[0].strip())
    step = int(ops[2], 0)
    m = re.fullmatch(rf"setp\.(eq|ge)\.u32 %p_q, {re.escape(s)}, (\d+);", nxt[0]) if nxt else None
    mod = int(m.group(2)) if m else None
    if spell.parity_reg is not None:
        ph = "%" + spell.parity_reg.format(role=role, state=st)
        wrap = [f"@%p_q mov.u32 {s}, 0;"] if m and m.group(1) == "eq" else [f"@%p_q sub.u32 {s}, {s}, {mod};"]
        good = m is not None and nxt[1:] == wrap + [f"@%p_q xor.b32 {ph}, {ph}, 1;"] and \
            (m.group(1) == "ge" or step == 1)
    else:
        good = m is not None and m.group(1) == "ge" and nxt[1:] == [f"@%p_q sub.u32 {s}, {s}, {mod};"]
    if not good:
        return ("advance", st, step, "wrap " + " / ".join(nxt)), len(nxt)
    return ("advance", st, step, mod), len(nxt)


def _role_named(pipe, name: str):
    return next((r for r in tuple(pipe.roles) + tuple(pipe.replicated) if r.name == name), None)


def _read_roles(numbered, pipe, lay: _Layout, spell, to_ret: bool) -> tuple[dict, dict, list]:
    """Every role instance's protocol events, read by `_read_section` from its section (the instances of
    a replicated program share one: each is read with its own warpgroup index). -> ({role: (events,
    arrivals)}, {section: lines}, differences of unreadable sections)."""
    instance_of = {f"{t.name}{i}": t.name for t in pipe.replicated for i in range(t.instances)}
    sections = _role_sections(numbered, list(dict.fromkeys(instance_of.get(r.name, r.name) for r in pipe.roles)),
                              to_ret)
    first = next((i for i, (_, t) in enumerate(numbered) if t.strip().startswith("$L_role_")), len(numbered))
    setup = _setup_facts(numbered, first)
    out, diffs = {}, []
    for r in pipe.roles:
        sec = instance_of.get(r.name, r.name)
        if sec not in sections:
            continue
        try:
            out[r.name] = _read_section(sec, sections[sec], pipe, lay, spell, 32 * len(r.warps), setup,
                                        {"%wg": r.warps[0] // 4})
        except _Unreadable as e:
            out[r.name] = None
            diffs.append(Difference("parse", e.line, f"unreadable protocol ({r.name}): {e}", "a readable role program"))
    return out, sections, diffs


def _state_inits(sections, pipe, spell) -> list:
    """Each ring State's register(s) initialised once, to the IR's start slot and phase."""
    diffs = []
    for name, lines in sections.items():
        role = _role_named(pipe, name)
        for st in role.states if role else ():
            if spell.parity_reg is not None:
                want = {"%" + spell.state_reg.format(role=name, state=st.name): st.start % st.depth,
                        "%" + spell.parity_reg.format(role=name, state=st.name):
                            (st.start // st.depth + st.start_phase) % 2}
            else:
                want = {"%" + spell.state_reg.format(role=name, state=st.name):
                        (st.start + st.depth * st.start_phase) % (2 * st.depth)}
            for reg, v in want.items():
                inits = [(ln, t.strip()) for ln, t in lines if re.match(rf"^\s*mov\.u32 {re.escape(reg)}, ", t)]
                if len(inits) != 1 or inits[0][1] != f"mov.u32 {reg}, {v};":
                    diffs.append(Difference(name, inits[0][0] if inits else None,
                                            "; ".join(t for _, t in inits) or f"no initial value for {reg}",
                                            f"{reg} starts at {v} (State {st.name}: slot {st.start}, phase "
                                            f"{st.start_phase})"))
    return diffs


def _arrivals_per_phase(numbered, lay: _Layout, reads: dict) -> list:
    """For each mbarrier: the arrivals of one phase (each role instance that arrives on it: the threads
    its arrive / expect_tx lets through, by the role's warps and the instruction's predicates and guards)
    equal the count its mbarrier.init gives (both read from the PTX)."""
    diffs, inits = [], {}
    for ln, text in numbered:
        m = re.match(r"^\s*mbarrier\.init\.shared::cta\.b64 \[%bar\+(\d+)\], (\w+);$", text)
        hit = lay.barrier(int(m.group(1))) if m else None
        if hit:
            inits.setdefault(hit[0], []).append((ln, hit[1], int(m.group(2), 0)))
    per_slot: dict = {}  # (barrier, constant slot or None: every slot of a ring) -> [(role, threads)]
    for role, read in reads.items():
        arrivals = read[1] if read else []
        seen: dict = {}
        for ln, bar, slot, who, pred in arrivals:
            key = (bar, slot if isinstance(slot, int) else None)
            if who is None:
                diffs.append(Difference(role, ln, f"arrive on {bar} under {pred}",
                                        "a predicate whose arriving threads are readable (one lane per warp, the "
                                        "elected thread, or all)"))
                continue
            if key in seen and seen[key][1] != who:
                diffs.append(Difference(role, ln, f"{who} threads arrive on {bar} ({pred})",
                                        f"{seen[key][1]}, as at PTX line {seen[key][0]}: one phase, one count"))
                continue
            seen.setdefault(key, (ln, who))
        for key, (ln, who) in seen.items():
            per_slot.setdefault(key, []).append((role, who))
    for bar, inits_ in inits.items():
        for ln, slot, count in inits_:
            whos = per_slot.get((bar, slot), []) + per_slot.get((bar, None), [])
            total = sum(w for _, w in whos)
            if whos and count != total:
                diffs.append(Difference("arrivals", ln, f"mbarrier.init {bar}[{slot}] count {count}",
                                        f"the PTX's arrivals per phase: {total} ("
                                        + ", ".join(f"{r} {w}" for r, w in whos) + ")"))
    return diffs


# ---- the events: read ones folded, the IR's expected, both compared (both targets) ----------------
def _collapse(events):
    """Fold the repeated instructions of one op (TMA boxes, MMA k steps, store + commit_group);
    each folded event keeps the line of its first instruction."""
    out = []
    for ln, ev in events:
        if ev[0] in ("tma_load", "tma_store"):  # one box per 64-column half: n instructions, one op
            kind = ev[0] + "_n"
            if out and out[-1][1][0] == kind and out[-1][1][1] == ev[1:]:
                out[-1] = (out[-1][0], (kind, ev[1:], out[-1][1][2] + 1))
            else:
                out.append((ln, (kind, ev[1:], 1)))
            continue
        if ev[0] in ("store_partial", "store_o"):  # one st.global.v4 per 4 (8) columns: n instructions, one op
            kind = ev[0] + "_n"
            if out and out[-1][1][0] == kind and out[-1][1][1] == ev[1]:
                out[-1] = (out[-1][0], (kind, ev[1], out[-1][1][2] + 1))
            else:
                out.append((ln, (kind, ev[1], 1)))
            continue
        if ev[0] == "bulk_commit":
            if out and out[-1][1][0] == "tma_store_n":
                out[-1] = (out[-1][0], out[-1][1] + ("committed",))
            else:
                out.append((ln, ("commit_group without a TMA store",)))
            continue
        if ev[0] == "mma":
            last = out[-1][1] if out else None
            if (last is not None and last[0] == "mma_n" and last[1] == ev[1] and ev[6] == "1" and last[3] == ev[3]
                    and last[8] < 64 and last[9:] == ev[8:]):
                a = last[2] + ((ev[2][1],) if ev[2][0] == "tmem" else ())
                out[-1] = (out[-1][0], ("mma_n", last[1], a, last[3], last[4], last[5], last[6], last[7], last[8] + 1)
                           + last[9:])
                continue
            a = ("tmem", ev[2][1]) if ev[2][0] == "tmem" else ("smem",) + ev[2][1]
            out.append((ln, ("mma_n", ev[1], a, ev[3], ev[4], ev[5], ev[6], ev[7], 1) + ev[8:]))
            continue
        out.append((ln, ev))
    return out


def _expected(pipe) -> dict:
    """Each role instance's events as the reader spells them, from its verified program (on sm_90a the
    replicated consumer once per instance: its own barrier slots and branches). The ops of both
    targets share one spelling here; what the targets spell apart is `_target_event`'s."""
    from ..spec.plan import block_n, kv_box_rows, qk_panels, vo_panels
    cfg = pipe.config
    sm100 = cfg.arch == "sm_100a"
    # one box per panel (plan.Panels): Q and K have head_dim columns, V and O head_dim_v; a paged K/V
    # block has one box per page and panel
    nq, nv = qk_panels(cfg).count, vo_panels(cfg).count
    per_block = block_n(cfg) // kv_box_rows(cfg)
    boxes = {"q": nq, "k": nq * per_block, "v": nv * per_block, "o": nv}
    out = {}
    for role in pipe.roles:
        ops = list(walk_ops(role.program))
        # sm_100a: a role that touches the tensor core fences after each wait / named sync (tcgen05
        # fence::after_thread_sync); one that does tcgen05.ld/st marks its arrives as such
        fenced = sm100 and any(isinstance(op, (Mma, TmemLd, TmemSt)) for op in ops)
        tc_ldst = any(isinstance(op, (TmemLd, TmemSt)) for op in ops)

        def slot(s, role=role):
            if isinstance(s, int):
                return s
            st = role.state(s)
            return st.slot_base if st.depth == 1 else (s, st.slot_base)

        evs = []
        for k, op in enumerate(ops):
            if isinstance(op, Wait):
                ev = ("wait", op.barrier, slot(op.state), op.state)
                if fenced and pipe.barrier(op.barrier).kind is not BarrierKind.TMA:
                    ev += ("fence_after",)
            elif isinstance(op, Arrive):
                ev = ("arrive", op.barrier, slot(op.slot), op.scope is Scope.ELECTED, tc_ldst)
            elif isinstance(op, ExpectTx):
                ev = ("expect_tx", op.barrier, slot(op.slot), op.bytes, True)
            elif isinstance(op, TmaLoad):
                ev = ("tma_load_n", (op.tensor, op.dst, slot(op.dst_slot), op.barrier, slot(op.bar_slot), True),
                      boxes[op.tensor])
            elif isinstance(op, TmaStore):
                ev = ("tma_store_n", ("o", True), boxes["o"], "committed")
            elif isinstance(op, TmaStoreWait):
                ev = ("store_wait", True)
            elif isinstance(op, NamedArrive):
                ev = ("bar_arrive", op.barrier, op.slot, tc_ldst, pipe.barrier(op.barrier).count)
            elif isinstance(op, NamedSync):
                ev = ("bar_sync", op.barrier, op.slot, None, pipe.barrier(op.barrier).count)
                if fenced:
                    ev += ("fence_after",)
            elif isinstance(op, FenceProxyAsync):
                ev = ("fence_proxy_async",)
            else:
                ev = (_event_sm100 if sm100 else _event_sm90)(op, pipe, role, slot)
                if ev is None:
                    continue
            evs.append((k, op, (ev[0], ev[1:])))
        out[role.name] = evs
    return out


def _event_sm100(op, pipe, role, slot):
    """sm_100a's own spelling of an op (None: no event): row stores, the tcgen05 MMA / commit / ld / st
    and their waits, a ring advance's step and wrap over the doubled phase range."""
    cfg = pipe.config

    def phys(rname, lo, hi):
        r = pipe.region(rname)
        return (r.col + lo // 2, r.col + hi // 2) if r.dtype == "f16" else (r.col + lo, r.col + hi)

    if isinstance(op, StoreRows):
        return ("store_rows", op.src, slot(op.src_slot), "rows < %sq")
    if isinstance(op, StorePartial):
        return ("store_partial_n", "rows < %sq", (op.col_hi - op.col_lo) // 4)
    if isinstance(op, StoreO):
        return ("store_o_n", "rows < %sq", (op.col_hi - op.col_lo) // 8)
    if isinstance(op, Mma):
        d = pipe.region(op.d)
        if op.accumulate == "false" or (op.accumulate == "not_first" and op.block is BlockRef.FIRST):
            acc = "0"
        elif op.accumulate == "true":
            acc = "1"
        else:
            acc = "%p_acc"
        def ring(s):  # the State an SMEM operand's address reads (none: a constant slot, depth-1 States too)
            return (s,) if not isinstance(slot(s), int) else ()

        b_states = ring(op.b_slot)
        if op.kind == "qk":
            a = ("smem",) + ring(op.a_slot)
            n, major = d.cols, Major.K.name
        else:
            p = pipe.region(op.a)
            a = ("tmem",) + tuple(p.col + kk // 2 for kk in range(op.k_lo, op.k_hi, 16))
            n, major = cfg.head_dim_v, Major.MN.name  # PV: N = DV
        mtype = {"bf16": "BF16", "fp16": "F16"}[cfg.dtype]
        return ("mma_n", d.col, a, b_states, n, major, acc, True, (op.k_hi - op.k_lo) // 16, 128, Major.K.name,
                mtype)
    if isinstance(op, Commit):
        return ("commit", op.barrier, slot(op.slot), True)
    if isinstance(op, TmemLd):
        return ("tmem_ld", *phys(op.region, op.col_lo, op.col_hi))
    if isinstance(op, TmemSt):
        return ("tmem_st", *phys(op.region, op.col_lo, op.col_hi))
    if isinstance(op, WaitLd):
        return ("wait_ld",)
    if isinstance(op, WaitSt):
        return ("wait_st",)
    if isinstance(op, Advance):
        st = role.state(op.state)
        return ("advance", op.state, st.stride % (2 * st.depth), 2 * st.depth)
    return None


def _event_sm90(op, pipe, role, slot):
    """sm_90a's own spelling of an op (None: no event): row stores (the consumer's slot is %cw's: the
    rows' predicate is read back), wgmma groups (k steps) and their waits, a ring advance."""
    if isinstance(op, StoreRows):
        return ("store_rows", "?", None, "rows < %sq")
    if isinstance(op, Mma):
        return ("wgmma", (op.k_hi - op.k_lo) // 16, True)  # k16 steps: QK^T over D, PV over the block's keys
    if isinstance(op, MmaWait):
        return ("wgmma_wait", op.pending)
    if isinstance(op, Advance):
        st = role.state(op.state)
        return ("advance", op.state, 1, 1) if st.depth == 1 else ("advance", op.state, st.stride, st.depth)
    return None


def _norm(ev):
    """A parsed event as (kind, fields), the form _expected produces."""
    return (ev[0], ev[1:])


def _fmt(ev) -> str:
    kind, fields = ev
    return f"{kind}({', '.join(map(str, fields))})" if fields else kind


def _align(role: str, got: list, want: list) -> list:
    """Every difference between two event lists (got: (line, event); want: (op index, op, event))."""
    g = [_norm(ev) for _, ev in got]
    w = [ev for _, _, ev in want]
    diffs = []
    sm = difflib.SequenceMatcher(a=g, b=w, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        n = max(i2 - i1, j2 - j1)
        for t in range(n):
            gi, wj = i1 + t, j1 + t
            line = got[gi][0] if gi < i2 else (got[i2][0] if i2 < len(got) else None)
            gtxt = _fmt(g[gi]) if gi < i2 else "nothing"
            if wj < j2:
                k, op, _ = want[wj]
                wtxt = f"op {k} {type(op).__name__}: {_fmt(w[wj])}"
            else:
                wtxt = "no op here"
            if gi >= i2:
                gtxt = "nothing" + (f" (before PTX line {line})" if line else " (at the end of the role)")
            diffs.append(Difference(role, line if gi < i2 else None, gtxt, wtxt))
    return diffs


def _init_counts(numbered, pipe, locate) -> list:
    """Every mbarrier slot of the IR initialised exactly once, with its arrival count; `locate(off)`
    names the (barrier, slot) at a %bar offset (None: no barrier of the IR there)."""
    diffs, seen = [], {}
    for ln, text in numbered:
        m = re.match(r"^\s*mbarrier\.init\.shared::cta\.b64 \[%bar\+(\d+)\], (\w+);$", text)
        if not m:
            continue
        off, count = int(m.group(1)), int(m.group(2), 0)
        hit = locate(off)
        if hit is None:
            diffs.append(Difference("prologue", ln, f"mbarrier.init at offset {off}", "no mbarrier of the IR there"))
            continue
        name, slot = hit
        want = pipe.barrier(name).count
        if (name, slot) in seen:
            diffs.append(Difference("prologue", ln, f"{name}[{slot}] initialised again", f"once (line {seen[(name, slot)]})"))
        seen[(name, slot)] = ln
        if count != want:
            diffs.append(Difference("prologue", ln, f"mbarrier.init {name}[{slot}] count {count}",
                                    f"{name} expects {want} arrivals per phase"))
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED:
            continue
        for s in range(b.slots):
            if (b.name, s) not in seen:
                diffs.append(Difference("prologue", None, f"no mbarrier.init of {b.name}[{s}]",
                                        f"{b.name}: {b.count} arrivals per phase"))
    return diffs


# ---- sm_100a --------------------------------------------------------------------------------------
def _prologue_sm100(numbered, pipe, manifest) -> list:
    diffs = _init_counts(numbered, pipe, _Layout(pipe, manifest["smem_layout"]).barrier)
    slot_off = manifest["smem_layout"]["tmem_addr_slot"]
    allocs = [(ln, t) for ln, t in numbered if "tcgen05.alloc" in t]
    if len(allocs) != 1:
        diffs.append(Difference("prologue", allocs[1][0] if len(allocs) > 1 else None,
                                f"{len(allocs)} tcgen05.alloc", "one allocation"))
    for ln, t in allocs:
        m = re.search(r"\[%smem\+(\d+)\], (\d+);", t)
        if not m or int(m.group(1)) != slot_off or int(m.group(2)) != pipe.tmem_alloc_cols:
            diffs.append(Difference("prologue", ln, t.strip(),
                                    f"tcgen05.alloc of {pipe.tmem_alloc_cols} columns into the slot at {slot_off}"))
    deallocs = [(ln, t) for ln, t in numbered if "tcgen05.dealloc" in t]
    for ln, t in deallocs:
        if not t.strip().endswith(f", {pipe.tmem_alloc_cols};"):
            diffs.append(Difference("epilogue", ln, t.strip(), f"dealloc of {pipe.tmem_alloc_cols} columns"))
    return diffs


def _tmem_lanes_sm100(sections, pipe) -> list:
    """Each role that does tcgen05.ld/st: %tml = %tmem + ((warp % 4) << 21), i.e. lane 32*(warp%4)
    in the address's lane field (bits 16-31)."""
    diffs = []
    for role in pipe.roles:
        if not any(isinstance(op, (TmemLd, TmemSt)) for op in walk_ops(role.program)):
            continue
        lines = sections.get(role.name, [])
        text = "\n".join(t for _, t in lines)
        ok_and = re.search(r"and\.b32 %warp4, %warp, 3;", text)
        m = re.search(r"shl\.b32 (%\w+), %warp4, (\d+);\s*\n\s*add\.u32 %tml, %tmem, \1;", text)
        if not ok_and or not m or int(m.group(2)) != 21:
            ln = next((l for l, t in lines if "%warp4" in t or "%tml, %tmem" in t), None)
            got = f"lane field from shift {m.group(2)}" if m else "no %tml = %tmem + (warp4 << k)"
            diffs.append(Difference(role.name, ln, got, "TMEM lane = 32 * (warp % 4) in bits 16-31: "
                                                        "and.b32 %warp4, %warp, 3; shl.b32 .., %warp4, 21"))
    return diffs


def _setup_sm100(numbered, pipe) -> list:
    """The CTA-wide sync between the prologue (mbarrier.init, tcgen05.alloc) and the roles, and each
    warpgroup budget spelled as the IR's setmaxnreg."""
    diffs = []
    lines = [(ln, t.strip()) for ln, t in numbered]
    last_setup = max((ln for ln, t in lines if t.startswith(("mbarrier.init", "tcgen05.alloc"))), default=None)
    first_role = min((ln for ln, t in lines if t.startswith("setmaxnreg")), default=None)
    if last_setup and first_role and not any(last_setup < ln < first_role and t == "bar.sync 0;" for ln, t in lines):
        diffs.append(Difference("prologue", first_role, "no bar.sync 0 between mbarrier.init / tcgen05.alloc and the roles",
                                "every warp synchronises on the initialised barriers and the TMEM address"))
    got = sorted(int(m.group(1)) for _, t in lines for m in [re.match(r"setmaxnreg\.\w+\.sync\.aligned\.u32 (\d+);", t)] if m)
    want = sorted({r.regs for r in pipe.roles})
    if got != want:
        ln = next((ln for ln, t in lines if t.startswith("setmaxnreg")), None)
        diffs.append(Difference("dispatch", ln, f"setmaxnreg budgets {got}", f"the roles' budgets {want}"))
    return diffs


def _compare(rep: CheckReport, pipe, got: dict, want: dict) -> None:
    for role in pipe.roles:
        if role.name not in got:
            rep.differences.append(Difference(role.name, None, "no $L_role_ .. _end section", "the role's program"))
            continue
        if got[role.name] is not None:  # None: unreadable, reported as such
            rep.events[role.name] = len(want[role.name])
            rep.differences += _align(role.name, got[role.name][0], want[role.name])


def _check_sm100(ptx: str, manifest: dict, cfg: KernelConfig, pipe, rep: CheckReport) -> CheckReport:
    from ..lower.sm100 import SPELLING
    numbered = _numbered(ptx)
    lay = _Layout(pipe, manifest["smem_layout"])
    rep.differences += _prologue_sm100(numbered, pipe, manifest)
    got, sections, unreadable = _read_roles(numbered, pipe, lay, SPELLING, to_ret=False)
    rep.differences += _tmem_lanes_sm100(sections, pipe)
    rep.differences += _state_inits(sections, pipe, SPELLING)
    rep.differences += _setup_sm100(numbered, pipe)
    if unreadable:
        rep.differences += unreadable
        return rep
    _compare(rep, pipe, got, _expected(pipe))
    rep.differences += _arrivals_per_phase(numbered, lay, got)
    return rep


# ---- sm_90a ---------------------------------------------------------------------------------------
def _check_sm90(ptx: str, manifest: dict, cfg: KernelConfig, pipe, rep: CheckReport) -> CheckReport:
    from ..lower.sm90 import SPELLING
    numbered = _numbered(ptx)
    lay = _Layout.derived(pipe)
    rep.differences += _init_counts(numbered, pipe, lay.barrier)
    got, sections, unreadable = _read_roles(numbered, pipe, lay, SPELLING, to_ret=True)
    rep.differences += unreadable + _state_inits(sections, pipe, SPELLING)
    _compare(rep, pipe, got, _expected(pipe))
    rep.differences += _arrivals_per_phase(numbered, lay, got)
    return rep
