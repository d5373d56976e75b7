"""`fa4gen check`: read a PTX file back (as it is on disk) against the verified IR of its manifest's
config, and list every difference with its PTX line and the IR op it should be.

sm_100a (lowered from the IR's role programs): per role, the ordered protocol events (mbarrier
waits with barrier, slot and parity state; arrives, expect_tx bytes; TMA loads/stores with tensor,
region, slot and barrier; tcgen05.mma with D/A TMEM columns, B state, N, B major, accumulate flag,
k steps; commits; tcgen05.ld/st columns; wait::ld/st; named barriers with id and thread count;
fences), the prologue (every mbarrier slot initialised once with the IR's arrival count, the TMEM
allocation's columns) and each role's TMEM lane field. The parser knows nothing of the lowering: it
reads instructions, resolves offsets through the manifest's SMEM layout and the IR's TMEM regions,
and follows address registers back to the State register they came from.

sm_90a (lowered from the IR by the walker both targets share): per role section, the replicated
consumer warpgroups once, the ordered protocol events (waits with barrier, ring state and parity
register; arrives with their predicate against the IR's scope; expect_tx bytes; TMA copies with
their barrier; named barriers by id, literal or held in a register whose computation from %cw is
read back, and thread count; wgmma commits and wait_group depths; bulk-store waits and proxy fences
up to the role's ret), each ring state's start values and advance, and the mbarrier init counts on
the SMEM layout derived from the Pipeline. What the sm_90a IR does not describe (descriptors,
wgmma.fence) is not read back: `fa4gen emulate` judges it.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from .config import KernelConfig
from .ptxemu.parse import _split_top as _operands
from .encodings import EncodingError, Major, TcgenInstrDesc
from .ir.core import (Arrive, BarrierKind, BlockRef, Commit, ExpectTx, FenceProxyAsync, If, InstSlot, Loop, Mma,
                      MmaWait, NamedArrive, NamedSync, Scope, StorePartial, StoreRows, TmaLoad, TmaStore, TmaStoreWait, TmemLd, TmemSt,
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
    parameters are COMBINE_ABI_PARAMS in order with their declared types (and the manifest's list),
    .maxntid is the manifest's threads_per_cta, it touches no shared memory, mbarrier, named barrier,
    TMA, tensor core or async proxy (it is a plain load/compute/store kernel that runs after fa4_fwd),
    each lane's O store and its LSE store go to global memory, and every ld.param reads a declared
    parameter."""
    from .plan import COMBINE_ABI_PARAMS
    role = mod.entry
    rec = (manifest.get("kvcache") or {}).get("combine", {})
    want = [n for n, _ in COMBINE_ABI_PARAMS]
    got = [p.name for p in mod.params]
    if got != want or list(rec.get("params", want)) != want:
        rep.differences.append(Difference(role, mod.lines[0], f"parameters {got} (manifest: {rec.get('params')})",
                                          f"the combine ABI {want} (fa4gen.plan.COMBINE_ABI_PARAMS)"))
    for p, (name, decl) in zip(mod.params, COMBINE_ABI_PARAMS):
        m = re.match(r"\.param\s+(\.\w+)\s+(\w+)$", decl)
        if m and p.name == name and p.type != m.group(1):
            rep.differences.append(Difference(role, mod.lines[0], f"parameter {p.name} {p.type}", decl))
    threads = rec.get("threads_per_cta")
    if threads is not None and mod.maxntid != int(threads):
        rep.differences.append(Difference(role, mod.lines[0], f".maxntid {mod.maxntid}",
                                          f"the manifest's {threads} threads per combine CTA"))
    declared = {p.name for p in mod.params}
    stores = set()
    for ins in mod.instrs:
        opc = ins.opcode
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
    from .codegen import _pipeline, verify_cached
    pipe = _pipeline(cfg)
    report, _ = verify_cached(pipe)
    return pipe, report


# ---- sm_100a --------------------------------------------------------------------------------------
class _Layout:
    """Offsets -> names, from the manifest (SMEM) and the pipeline (TMEM, named barriers)."""

    def __init__(self, pipe, manifest):
        lay = manifest["smem_layout"]
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

    def barrier(self, off: int):
        for base, slots, name in self.bars:
            if base <= off < base + 8 * slots and (off - base) % 8 == 0:
                return name, (off - base) // 8
        return None

    def region(self, off: int):
        for base, size, slots, name in self.regions:
            if base <= off < base + size * slots:
                return name, (off - base) // size, (off - base) % size
        return None


class _Unreadable(Exception):
    def __init__(self, line, msg):
        super().__init__(msg)
        self.line = line


def _role_sections(numbered, roles) -> dict:
    """Role name -> its (line, text) list: from label $L_role_<name> to $L_<name>_end."""
    out = {}
    idx = {text.strip(): i for i, (_, text) in enumerate(numbered) if _LABEL.match(text)}
    for r in roles:
        a, b = idx.get(f"$L_role_{r}:"), idx.get(f"$L_{r}_end:")
        if a is not None and b is not None and a < b:
            out[r] = numbered[a + 1:b]
    return out


def _parse_sm100(numbered, pipe, manifest) -> dict:
    lay = _Layout(pipe, manifest)
    tmaps = {"%tmq": "q", "%tmk": "k", "%tmv": "v", "%tmo": "o"}
    result = {}
    for role, lines in _role_sections(numbered, [r.name for r in pipe.roles]).items():
        prov: dict = {}
        consts: dict = {}
        guard = None
        events: list = []
        pending_before = False
        last_was_sync = False
        selp: dict = {}  # register -> (a, b, predicate) of its last selp
        setp_ge: dict = {}  # predicate -> (state, bound) of its last setp.ge.u32 on a state register
        sq_guard: set = set()  # predicates whose last setp is `setp.lt.u32 p, x, %sq` (a row of the sequence)
        rows_src: list = []  # (region, slot, predicate) of the last ld.shared.v4 (StoreRows' source)
        depths = {st.name: st.depth for st in pipe.role(role).states}

        def src_states(ops, role=role, prov=prov):
            s = set()
            for o in ops:
                for reg in re.findall(r"%\w+", o):
                    m = re.match(rf"%q_{role}_(\w+)$", reg)
                    if m:
                        s.add(m.group(1))
                    elif reg in prov:
                        s |= prov[reg]
            return frozenset(s)

        for ln, line in lines:
            def addr(op, ln=ln):
                m = re.match(r"\[(%\w+)\+(\d+)\]$", op)
                if not m:
                    raise _Unreadable(ln, f"unexpected address {op}")
                base, off = m.group(1), int(m.group(2))
                if base in ("%bar", "%smem"):
                    return None, off
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
                if guard == lm.group(1):
                    guard = None
                continue
            m = _INSTR.match(line)
            if not m:
                continue
            pred, opc, rest = (m.group(1) or "").strip(), m.group(2), m.group(3)
            ops = _operands(rest)
            elected = guard is not None or pred == "@%p_el"
            ev = None
            if opc == "bra" and pred == "@!%p_el":
                guard = ops[0]
            elif opc.startswith("mbarrier.try_wait.parity"):
                name, slot = bar_slot(ops[1])
                par = ops[2]
                pm = re.match(rf"%q_{role}_(\w+)$", par)
                if pm:  # a one-slot ring: q in [0, 2) is the parity itself
                    st = pm.group(1)
                    parity = st if depths.get(st) == 1 else f"{st} used directly as parity (depth {depths.get(st)})"
                elif par in selp and selp[par][2] in setp_ge:
                    a_, b_, p_ = selp[par]
                    st, d_ = setp_ge[p_]
                    parity = st if (a_, b_, d_) == ("1", "0", str(depths.get(st))) else \
                        f"{st} with parity selp {a_}, {b_} on q >= {d_} (depth {depths.get(st)})"
                else:
                    parity = f"? ({par})"
                ev = ("wait", name, slot, parity)
            elif opc.startswith("mbarrier.arrive.expect_tx"):
                name, slot = bar_slot(ops[1])
                ev = ("expect_tx", name, slot, int(ops[2], 0), elected)
            elif opc.startswith("mbarrier.arrive"):
                name, slot = bar_slot(ops[1])
                ev = ("arrive", name, slot, elected, pending_before)
            elif opc.startswith("cp.async.bulk.tensor") and ".global.shared::cta" in opc:
                ev = ("tma_store", tmaps.get(ops[0][1:].split(",")[0].strip(), "?"), elected)
            elif opc.startswith("cp.async.bulk.tensor"):
                st, off = addr(ops[0])
                reg = lay.region(off)
                if reg is None:
                    raise _Unreadable(ln, f"TMA destination offset {off} is in no SMEM region")
                region, slot, _ = reg
                bname, bslot = bar_slot(ops[2])
                ev = ("tma_load", tmaps.get(ops[1][1:].split(",")[0].strip(), "?"), region,
                      slot if st is None else (st, slot), bname, bslot, elected)
            elif opc == "cp.async.bulk.commit_group":
                ev = ("bulk_commit", elected)
            elif opc.startswith("cp.async.bulk.wait_group.read"):
                ev = ("store_wait", elected)
            elif opc.startswith("tcgen05.mma"):
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
            elif opc.startswith("tcgen05.commit"):
                name, slot = bar_slot(ops[0])
                ev = ("commit", name, slot, pred == "@%p_el")
            elif opc.startswith(("tcgen05.ld", "tcgen05.st")):
                n = int(re.search(r"\.x(\d+)\.", opc).group(1))
                cm = re.match(r"\[%tml\+(\d+)\]$", ops[1] if opc.startswith("tcgen05.ld") else ops[0])
                col = int(cm.group(1)) if cm else -1
                ev = ("tmem_ld" if opc.startswith("tcgen05.ld") else "tmem_st", col, col + n)
            elif opc.startswith("tcgen05.wait::ld"):
                ev = ("wait_ld",)
            elif opc.startswith("tcgen05.wait::st"):
                ev = ("wait_st",)
            elif opc in ("bar.arrive", "bar.sync") and ops[0] != "0":
                bid = consts.get(ops[0]) if ops[0].startswith("%") else int(ops[0])
                if bid not in lay.named:
                    raise _Unreadable(ln, f"{opc} {ops[0]}: id {bid} is no named barrier of the IR")
                name, slot, _count = lay.named[bid]
                threads = int(ops[1]) if len(ops) > 1 else None
                ev = (opc.replace(".", "_"), name, slot, pending_before if opc == "bar.arrive" else None, threads)
            elif opc.startswith("ld.shared.v4"):  # StoreRows: the threads read the O staging slot
                st, off = addr(ops[1])
                reg = lay.region(off)
                if reg is None:
                    raise _Unreadable(ln, f"ld.shared offset {off} is in no SMEM region")
                rows_src[:] = [(reg[0], reg[1] if st is None else (st, reg[1]), pred)]
                continue
            elif opc.startswith("st.global.v4.f32"):  # StorePartial (KV cache): fp32 O of the thread's row
                p = pred.lstrip("@")
                ev = ("store_partial", "rows < %sq" if p in sq_guard and not p.startswith("!")
                      else f"st.global predicate {pred or 'none'}")
            elif opc.startswith("st.global.v4"):  # ... and write its rows to global memory
                region, slot, ld_pred = rows_src[0] if rows_src else ("?", None, None)
                p = pred.lstrip("@")
                rows = ("rows < %sq" if p in sq_guard and not p.startswith("!") and ld_pred == pred
                        else f"st.global predicate {pred or 'none'}, ld.shared predicate {ld_pred or 'none'}")
                ev = ("store_rows", region, slot, rows)
            elif opc == "fence.proxy.async.shared::cta":
                ev = ("fence_proxy_async",)
            elif opc == "tcgen05.fence::before_thread_sync":
                pending_before = True
                continue
            elif opc == "tcgen05.fence::after_thread_sync":
                if last_was_sync:
                    events[-1] = (events[-1][0], events[-1][1] + ("fence_after",))
                    last_was_sync = False
                    continue
                ev = ("fence_after without a wait",)
            elif opc.startswith(("tcgen05.", "mbarrier.", "cp.async.", "bar.", "fence.")) and opc != "bar.warp.sync":
                ev = ("unknown protocol instruction", opc)
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
                if opc.startswith("setp") and ops:
                    if opc == "setp.lt.u32" and len(ops) == 3 and ops[2] == "%sq":
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
                if opc == "setp.ge.u32" and len(ops) == 3:
                    qm = re.match(rf"%q_{role}_(\w+)$", ops[1])
                    if qm:
                        setp_ge[ops[0]] = (qm.group(1), ops[2])
            if ev is not None:
                if ev[0] in ("arrive", "bar_arrive"):
                    pending_before = False
                events.append((ln, ev))
                last_was_sync = ev[0] in ("wait", "bar_sync")
        result[role] = _collapse(events)
    return result


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
        if ev[0] == "store_partial":  # one st.global.v4.f32 per 4 columns: n instructions, one op
            if out and out[-1][1][0] == "store_partial_n" and out[-1][1][1] == ev[1]:
                out[-1] = (out[-1][0], ("store_partial_n", ev[1], out[-1][1][2] + 1))
            else:
                out.append((ln, ("store_partial_n", ev[1], 1)))
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


def _expected_sm100(pipe) -> dict:
    cfg = pipe.config
    boxes = cfg.head_dim // 64
    from .plan import ROWS, kv_box_rows
    kv_boxes = boxes * (ROWS // kv_box_rows(cfg))  # a paged K/V block: one box per page and 64 columns
    out = {}
    mtype = {"bf16": "BF16", "fp16": "F16"}[cfg.dtype]
    for role in pipe.roles:
        tc_any = any(isinstance(op, (Mma, TmemLd, TmemSt)) for op in walk_ops(role.program))
        tc_ldst = any(isinstance(op, (TmemLd, TmemSt)) for op in walk_ops(role.program))

        def slot(s, role=role):
            if isinstance(s, int):
                return s
            st = role.state(s)
            return st.slot_base if st.depth == 1 else (s, st.slot_base)

        def phys(rname, lo, hi):
            r = pipe.region(rname)
            return (r.col + lo // 2, r.col + hi // 2) if r.dtype == "f16" else (r.col + lo, r.col + hi)

        evs = []
        for k, op in enumerate(walk_ops(role.program)):
            if isinstance(op, Wait):
                ev = ("wait", op.barrier, slot(op.state), op.state)
                if tc_any and pipe.barrier(op.barrier).kind is not BarrierKind.TMA:
                    ev = (ev, ("fence_after",))
            elif isinstance(op, Arrive):
                ev = ("arrive", op.barrier, slot(op.slot), op.scope is Scope.ELECTED, tc_ldst)
            elif isinstance(op, ExpectTx):
                ev = ("expect_tx", op.barrier, slot(op.slot), op.bytes, True)
            elif isinstance(op, TmaLoad):
                ev = ("tma_load_n", (op.tensor, op.dst, slot(op.dst_slot), op.barrier, slot(op.bar_slot), True),
                      boxes if op.tensor == "q" else kv_boxes)
            elif isinstance(op, TmaStore):
                ev = ("tma_store_n", ("o", True), boxes, "committed")
            elif isinstance(op, TmaStoreWait):
                ev = ("store_wait", True)
            elif isinstance(op, StoreRows):
                ev = ("store_rows", op.src, slot(op.src_slot), "rows < %sq")
            elif isinstance(op, StorePartial):
                ev = ("store_partial_n", "rows < %sq", (op.col_hi - op.col_lo) // 4)
            elif isinstance(op, Mma):
                d = pipe.region(op.d)
                steps = (op.k_hi - op.k_lo) // 16
                if op.accumulate == "false" or (op.accumulate == "not_first" and op.block is BlockRef.FIRST):
                    acc = "0"
                elif op.accumulate == "true":
                    acc = "1"
                else:
                    acc = "%p_acc"
                b_states = tuple(sorted({op.b_slot} if isinstance(op.b_slot, str) else set()))
                if op.kind == "qk":
                    a = ("smem",) + tuple(sorted({op.a_slot} if isinstance(op.a_slot, str) else set()))
                    n, major = pipe.region(op.d).cols, Major.K.name
                else:
                    p = pipe.region(op.a)
                    a = ("tmem",) + tuple(p.col + kk // 2 for kk in range(op.k_lo, op.k_hi, 16))
                    n, major = cfg.head_dim, Major.MN.name
                ev = ("mma_n", d.col, a, b_states, n, major, acc, True, steps, 128, Major.K.name, mtype)
            elif isinstance(op, Commit):
                ev = ("commit", op.barrier, slot(op.slot), True)
            elif isinstance(op, TmemLd):
                ev = ("tmem_ld", *phys(op.region, op.col_lo, op.col_hi))
            elif isinstance(op, TmemSt):
                ev = ("tmem_st", *phys(op.region, op.col_lo, op.col_hi))
            elif isinstance(op, WaitLd):
                ev = ("wait_ld",)
            elif isinstance(op, WaitSt):
                ev = ("wait_st",)
            elif isinstance(op, NamedArrive):
                ev = ("bar_arrive", op.barrier, op.slot, tc_ldst, pipe.barrier(op.barrier).count)
            elif isinstance(op, NamedSync):
                ev = ("bar_sync", op.barrier, op.slot, None, pipe.barrier(op.barrier).count)
                if tc_any:
                    ev = (ev, ("fence_after",))
            elif isinstance(op, FenceProxyAsync):
                ev = ("fence_proxy_async",)
            else:
                continue
            if isinstance(ev[0], tuple):  # (event, extras) from a wait followed by its fence
                ev = (ev[0][0], ev[0][1:] + ev[1])
            else:
                ev = (ev[0], ev[1:])
            evs.append((k, op, ev))
        out[role.name] = evs
    return out


def _norm(ev):
    """A parsed event as (kind, fields), the form _expected_* produce."""
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


def _prologue_sm100(numbered, pipe, manifest) -> list:
    diffs = _init_counts(numbered, pipe, _Layout(pipe, manifest).barrier)
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


def _states_sm100(sections, pipe) -> list:
    """Each ring State's register: its initial value and every advance (q += stride mod 2*depth)."""
    diffs = []
    for role in pipe.roles:
        lines = sections.get(role.name, [])
        for st in role.states:
            q = f"%q_{role.name}_{st.name}"
            want0 = (st.start + st.depth * st.start_phase) % (2 * st.depth)
            inits = [(ln, t) for ln, t in lines if re.match(rf"^\s*mov\.u32 {re.escape(q)}, ", t)]
            if len(inits) != 1 or inits[0][1].strip() != f"mov.u32 {q}, {want0};":
                diffs.append(Difference(role.name, inits[0][0] if inits else None,
                                        inits[0][1].strip() if inits else f"no initial value for {q}",
                                        f"State {st.name} starts at q = {want0} (slot {st.start}, phase {st.start_phase})"))
            for i, (ln, t) in enumerate(lines):
                m = re.match(rf"^\s*add\.u32 {re.escape(q)}, {re.escape(q)}, (\w+);$", t)
                if not m:
                    continue
                nxt = [x.strip() for _, x in lines[i + 1:i + 3]]
                wrap = [f"setp.ge.u32 %p_q, {q}, {2 * st.depth};", f"@%p_q sub.u32 {q}, {q}, {2 * st.depth};"]
                if int(m.group(1), 0) != st.stride or nxt != wrap:
                    diffs.append(Difference(role.name, ln, f"{t.strip()} then {nxt}",
                                            f"Advance({st.name}): q += {st.stride} mod {2 * st.depth}"))
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


def _check_sm100(ptx: str, manifest: dict, cfg: KernelConfig, pipe, rep: CheckReport) -> CheckReport:
    numbered = _numbered(ptx)
    rep.differences += _prologue_sm100(numbered, pipe, manifest)
    sections = _role_sections(numbered, [r.name for r in pipe.roles])
    rep.differences += _tmem_lanes_sm100(sections, pipe)
    rep.differences += _states_sm100(sections, pipe)
    rep.differences += _setup_sm100(numbered, pipe)
    try:
        got = _parse_sm100(numbered, pipe, manifest)
    except _Unreadable as e:
        rep.differences.append(Difference("parse", e.line, f"unreadable protocol: {e}", "a readable role program"))
        return rep
    want = _expected_sm100(pipe)
    for role in pipe.roles:
        if role.name not in got:
            rep.differences.append(Difference(role.name, None, "no $L_role_ .. _end section", "the role's program"))
            continue
        rep.events[role.name] = len(want[role.name])
        rep.differences += _align(role.name, got[role.name], want[role.name])
    return rep


# ---- sm_90a ---------------------------------------------------------------------------------------
# The sm_90a kernel is lowered from its IR by the shared walker (fa4gen/lower/sm90.py): one
# section per role ($L_role_<name> .. $L_<name>_end), the C consumer warpgroups sharing one (the
# Pipeline's replicated program). A ring state lives in a slot register %st_<role>_<state> and a
# parity register %ph_<role>_<state>; a barrier slot's address is `mad.lo.u32 %r, %st_.., 8, %bar`
# then `[%r+OFF]` (OFF names the barrier family: the SMEM layout derived from the Pipeline), or
# `[%bar+OFF]` for a constant slot. The reader knows these spellings, not the lowering's code.
_SM90_TOKENS = [
    (re.compile(r"^\s*(@!?%\w+\s+)?mbarrier\.try_wait\S*\s+%\w+, \[(%\w+)(?:\+(\d+))?\], (%\w+)"), "wait"),
    (re.compile(r"^\s*(@!?%\w+\s+)?mbarrier\.arrive\.expect_tx\S*\s+_, \[(%\w+)(?:\+(\d+))?\], (\w+)"), "expect_tx"),
    (re.compile(r"^\s*(@!?%\w+\s+)?mbarrier\.arrive\S*\s+_, \[(%\w+)(?:\+(\d+))?\]"), "arrive"),
    (re.compile(r"^\s*(@!?%\w+\s+)?bar\.sync\s+([%\w]+)(?:,\s*(\w+))?"), "bar.sync"),
    (re.compile(r"^\s*(@!?%\w+\s+)?bar\.arrive\s+([%\w]+),\s*(\w+)"), "bar.arrive"),
    (re.compile(r"wgmma\.commit_group"), "mma"),
    (re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)"), "wait_group"),
    (re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\S*\s+\[[^\]]+\], \[(%\w+),[^\]]*\], "
                r"\[(%\w+)(?:\+(\d+))?\]"), "tma_load"),
    (re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"), "tma_store"),
    (re.compile(r"cp\.async\.bulk\.wait_group\.read"), "tma_store_wait"),
    (re.compile(r"^\s*@%\w+ st\.global\.v4"), "store_rows"),  # varlen: the threads' row-predicated O copy
    (re.compile(r"fence\.proxy\.async"), "fence"),
]
_SM90_TMAPS = {"%tmq": "q", "%tmk": "k", "%tmv": "v", "%tmo": "o"}
# who executes an arrive: the predicate the walker spells for each IR scope
# (%p_al = the last K/V block and %p_lead: the consumers' Q-slot release, predicated, not branched)
_SM90_SCOPE_PRED = {None: "all", "@%p_lead": "warp", "@%p_al": "warp"}


def _sm90_layout(pipe):
    from .lower.walk import smem_layout
    return smem_layout(pipe)


def _sm90_tokens(lines, role_name: str, pipe, named_ids: dict) -> list:
    """Protocol tokens of one role section, with barrier identity: `mad.lo.u32 %r, %st_<role>_<X>, 8,
    %bar` makes %r the slot base of state X; `[%r+OFF]` / `[%bar+OFF]` name the barrier family at
    OFF (and the constant slot); a wait's parity operand must be the same state's %ph_ register."""
    out, addr = [], {}
    bars = _sm90_layout(pipe).barriers
    fam = sorted(((off, name) for name, off in bars.items()), reverse=True)
    st_rx = re.compile(rf"^%st_{re.escape(role_name)}_(\w+)$")
    ph_rx = re.compile(rf"^%ph_{re.escape(role_name)}_(\w+)$")

    def bar(reg, off):
        off = int(off or 0)
        if reg == "%bar":
            for base, name in fam:
                if off >= base:
                    return f"{name}[{(off - base) // 8}]"
            return f"offset {off}"
        st = addr.get(reg)
        if st is None:
            return f"? ({reg})"
        name = next((n for b, n in fam if b == off), f"offset {off}")
        return f"{name}[{st}]"

    for ln, line in lines:
        text = line.strip()
        m = re.match(r"^mad\.lo\.u32\s+(%\w+),\s*(%\w+),\s*8,\s*%bar;$", text)
        if m and st_rx.match(m.group(2)):
            addr[m.group(1)] = st_rx.match(m.group(2)).group(1)
        else:
            m = re.match(r"^(?:@!?%\w+\s+)?[a-z][\w.:]*\s+(%\w+)\s*,", text)
            if m and m.group(1) in addr and not text.startswith(("mbarrier", "@")):
                addr.pop(m.group(1), None)
        for rx, kind in _SM90_TOKENS:
            m = rx.search(line)
            if not m:
                continue
            g = m.groups()
            if kind == "wait":
                pm = ph_rx.match(g[3])
                tok = f"wait {bar(g[1], g[2])} parity {pm.group(1) if pm else '? ' + g[3]}"
            elif kind == "expect_tx":
                tok = f"expect_tx {bar(g[1], g[2])} {int(g[3], 0)}"
            elif kind == "arrive":
                pred = (g[0] or "").strip() or None
                who = _SM90_SCOPE_PRED.get(pred, f"? {pred}")
                tok = f"arrive {bar(g[1], g[2])} {who}"
            elif kind in ("bar.sync", "bar.arrive"):
                ident = g[1]
                if ident.startswith("%"):
                    ident = named_ids.get(ident, f"? {ident}")
                else:
                    ident = _sm90_literal_named(pipe, int(ident))
                tok = f"{kind} {ident} {g[2]}"
            elif kind == "wait_group":
                tok = f"wait_group {g[0]}"
            elif kind == "tma_load":
                tok = f"tma_load {_SM90_TMAPS.get(g[0], g[0])} {bar(g[1], g[2])}"
            else:
                tok = kind
            if not (kind in ("tma_load", "tma_store", "store_rows") and out and out[-1][1] == tok):
                out.append((ln, tok))
            break
    return out


def _sm90_literal_named(pipe, ident: int) -> str:
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED and b.named_id <= ident < b.named_id + b.slots:
            return f"{b.name}[{ident - b.named_id}]"
    return f"id {ident} (no named barrier of the IR)"


def _sm90_named_ids(lines, pipe, role, first_wg: int) -> tuple[dict, list]:
    """The named-barrier ids a replicated role holds in registers: %nb_<barrier>_<k> must be
    named_id + (cw + k) mod instances, cw = %wg - the role's first warpgroup. -> ({reg: token}, diffs)."""
    ids, diffs, text = {}, [], [(ln, t.strip()) for ln, t in lines]
    n = role.instances
    cw_ok = any(t == f"sub.u32 %cw, %wg, {first_wg};" for _, t in text)
    if n > 1 and not cw_ok:
        diffs.append(Difference(role.name, None, "no `sub.u32 %cw, %wg, ...` of the role's first warpgroup",
                                f"%cw = %wg - {first_wg}: the instance index"))
    for i, (ln, t) in enumerate(text):
        m = re.match(r"^add\.u32 (%nb_(\w+?)_(\d+)), (%\w+), (\d+);$", t)
        if not m:
            continue
        reg, bname, k, src, base = m.group(1), m.group(2), int(m.group(3)), m.group(4), int(m.group(5))
        b = next((x for x in pipe.barriers if x.name == bname and x.kind is BarrierKind.NAMED), None)
        if b is None:
            diffs.append(Difference(role.name, ln, t, "a named barrier of the IR"))
            continue
        if k == 0:
            good = src == "%cw"
        else:  # add tmp, %cw, k ; setp.ge p, tmp, n ; @p sub tmp, tmp, n ; add reg, tmp, base
            prev = [x for _, x in text[max(0, i - 3):i]]
            good = prev == [f"add.u32 {src}, %cw, {k};", f"setp.ge.u32 %pp0, {src}, {n};",
                            f"@%pp0 sub.u32 {src}, {src}, {n};"]
        if not good or base != b.named_id:
            diffs.append(Difference(role.name, ln, t, f"{reg} = {b.named_id} + (%cw + {k}) mod {n}"))
        ids[reg] = f"{bname}+{k}"
    return ids, diffs


def _sm90_states(lines, role, pipe) -> list:
    """Each ring state's registers start at the IR's slot and parity and advance by its stride and depth."""
    diffs, text = [], [(ln, t.strip()) for ln, t in lines]
    for st in role.states:
        sreg, preg = f"%st_{role.name}_{st.name}", f"%ph_{role.name}_{st.name}"
        want = {sreg: st.start % st.depth, preg: (st.start // st.depth + st.start_phase) % 2}
        for reg, v in want.items():
            inits = [(ln, t) for ln, t in text if re.match(rf"^mov\.u32 {re.escape(reg)}, (\d+);", t)]
            if len(inits) != 1 or int(re.match(r"^mov\.u32 \S+, (\d+);", inits[0][1]).group(1)) != v:
                diffs.append(Difference(role.name, inits[0][0] if inits else None,
                                        "; ".join(t for _, t in inits) or f"no initial value of {reg}",
                                        f"{reg} starts at {v} (state {st.name})"))
        for i, (ln, t) in enumerate(text):
            if t.startswith(f"add.u32 {sreg}, {sreg},"):
                got = [x for _, x in text[i:i + 4]]
                exp = ([f"add.u32 {sreg}, {sreg}, 1;", f"setp.eq.u32 %p_q, {sreg}, {st.depth};",
                        f"@%p_q mov.u32 {sreg}, 0;", f"@%p_q xor.b32 {preg}, {preg}, 1;"] if st.stride == 1 else
                       [f"add.u32 {sreg}, {sreg}, {st.stride};", f"setp.ge.u32 %p_q, {sreg}, {st.depth};",
                        f"@%p_q sub.u32 {sreg}, {sreg}, {st.depth};", f"@%p_q xor.b32 {preg}, {preg}, 1;"])
                if got != exp:
                    diffs.append(Difference(role.name, ln, " / ".join(got),
                                            f"advance of state {st.name}: {' / '.join(exp)}"))
            elif re.match(rf"^(@!?%\w+\s+)?\S+\s+{re.escape(preg)},", t) and not t.startswith(f"mov.u32 {preg},") \
                    and t != f"@%p_q xor.b32 {preg}, {preg}, 1;":
                diffs.append(Difference(role.name, ln, t, f"{preg} changes only where state {st.name} advances"))
    return diffs


def _sm90_ir_tokens(stmts, pipe, role) -> list:
    out = []

    def slot(x):
        return x if isinstance(x, str) else f"{x}"

    for st in stmts:
        if isinstance(st, Loop):
            out += _sm90_ir_tokens(st.body, pipe, role)
        elif isinstance(st, If):  # the PTX spells the then-branch first, the else-branch (if any) after it
            out += _sm90_ir_tokens(st.then, pipe, role) + _sm90_ir_tokens(st.orelse, pipe, role)
        else:
            tok = None
            if isinstance(st, Wait):
                tok = f"wait {st.barrier}[{st.state}] parity {st.state}"
            elif isinstance(st, ExpectTx):
                tok = f"expect_tx {st.barrier}[{slot(st.slot)}] {st.bytes}"
            elif isinstance(st, Arrive):
                tok = f"arrive {st.barrier}[{slot(st.slot)}] {st.scope.value}"
            elif isinstance(st, (NamedSync, NamedArrive)):
                b = pipe.barrier(st.barrier)
                ident = f"{b.name}+{st.slot.offset % role.instances}" if isinstance(st.slot, InstSlot) else \
                    f"{b.name}[{st.slot}]"
                tok = f"{'bar.sync' if isinstance(st, NamedSync) else 'bar.arrive'} {ident} {b.count}"
            elif isinstance(st, Mma):
                tok = "mma"
            elif isinstance(st, MmaWait):
                tok = f"wait_group {st.pending}"
            elif isinstance(st, TmaLoad):
                tok = f"tma_load {st.tensor} {st.barrier}[{slot(st.bar_slot)}]"
            elif isinstance(st, TmaStore):
                tok = "tma_store"
            elif isinstance(st, StoreRows):
                tok = "store_rows"
            elif isinstance(st, TmaStoreWait):
                tok = "tma_store_wait"
            elif isinstance(st, FenceProxyAsync):
                tok = "fence"
            if tok:
                out.append((None, st, (tok, ())))
    return out


def _section_lines(numbered, start: str, end: str):
    labels = [i for i, (_, t) in enumerate(numbered) if t.strip() == f"{start}:"]
    if not labels:
        return None
    a = labels[0]
    b = next((i for i in range(a + 1, len(numbered)) if numbered[i][1].strip() == f"{end}:"), None)
    return numbered[a + 1:b + 1] if b is not None else None


def _check_sm90(ptx: str, manifest: dict, cfg: KernelConfig, pipe, rep: CheckReport) -> CheckReport:
    numbered = _numbered(ptx)
    replicated = {f"{t.name}{i}": t for t in pipe.replicated for i in range(t.instances)}
    roles = []
    for r in pipe.roles:  # each replicated program once: its instances share its section
        r = replicated.get(r.name, r)
        if r not in roles:
            roles.append(r)
    for role in roles:
        lines = _section_lines(numbered, f"$L_role_{role.name}", f"$L_{role.name}_end")
        if lines is None:
            rep.differences.append(Difference(role.name, None, f"no $L_role_{role.name} .. $L_{role.name}_end section",
                                              "the role's program"))
            continue
        if lines and lines[-1][1].strip() == f"$L_{role.name}_end:":
            after = next((t.strip() for _, t in numbered[numbered.index(lines[-1]) + 1:]
                          if t.strip() and not t.strip().startswith("//")), "")
            if after != "ret;":
                rep.differences.append(Difference(role.name, lines[-1][0], after or "nothing",
                                                  "ret: the role's program is all it runs"))
        named, diffs = _sm90_named_ids(lines, pipe, role, role.warps[0] // 4)
        if any(re.match(r"^\s*@%p_(lead|al) mbarrier\.arrive", t) for _, t in lines) and \
                not any(t.strip() == "setp.eq.u32 %p_lead, %lane, 0;" for _, t in lines):
            diffs.append(Difference(role.name, None, "per-warp arrives under %p_lead without `setp.eq.u32 %p_lead, "
                                    "%lane, 0` in the role", "one lane per warp (the IR's Scope.WARP)"))
        for ln, t in lines:  # %p_al must be some block test AND %p_lead, each time it is set
            if re.match(r"^\s*\S+\s+%p_al,", t) and t.strip() != "and.pred %p_al, %p_c, %p_lead;":
                diffs.append(Difference(role.name, ln, t.strip(), "and.pred %p_al, %p_c, %p_lead: one lane per warp"))
        rep.differences += diffs + _sm90_states(lines, role, pipe)
        got = [(ln, (tok,)) for ln, tok in _sm90_tokens(lines, role.name, pipe, named)]
        want = _sm90_ir_tokens(role.program, pipe, role)
        rep.events[role.name] = len(want)
        rep.differences += _align(role.name, got, [(i, op, ev) for i, (_, op, ev) in enumerate(want)])
    # mbarrier init counts, through the SMEM layout derived from the Pipeline
    offs = _sm90_layout(pipe).barriers

    def locate(off):
        for b in pipe.barriers:
            base = offs.get(b.name)
            if base is not None and base <= off < base + 8 * b.slots and (off - base) % 8 == 0:
                return b.name, (off - base) // 8
        return None
    rep.differences += _init_counts(numbered, pipe, locate)
    # named barrier ids used with a literal id must be the IR's
    ids = {b.named_id + s: b for b in pipe.barriers if b.kind is BarrierKind.NAMED for s in range(b.slots)}
    for ln, text in numbered:
        m = re.search(r"\bbar\.(sync|arrive)\s+(\d+),\s*(\d+)", text)
        if m and int(m.group(2)) != 0:
            b = ids.get(int(m.group(2)))
            if b is None or b.count != int(m.group(3)):
                rep.differences.append(Difference("named", ln, text.strip(),
                                                  f"named barriers {sorted(ids)} with their IR thread counts"))
    return rep
