"""Read the emitted sm_100a PTX back into per-role protocol sequences and compare with the IR.

The parser below knows nothing of the lowering: it reads instructions (mbarrier, cp.async.bulk,
tcgen05, bar, fence), resolves barrier/region identities from address offsets through the manifest's
SMEM layout and the IR's TMEM regions, follows the few address registers back to the State register
they came from (a small dataflow over the role's instructions), and notes whether an instruction
sits in an elected-lane region. Comments are used only to cut the text into roles (`// role X` ...
`// end role X`); the `// op N` markers are ignored. The expected sequence comes from the IR
programs through the op -> PTX table (fa4gen.lower.sm100.OP_PTX), inverted here.

Mutated templates (a dropped wait, arrive, commit or wait::st; a wait::st moved after its arrive)
must make the comparison fail.
"""

from __future__ import annotations

import functools
import re

import jinja2
import pytest

from fa4gen import render as render_mod
from fa4gen.config import KernelConfig
from fa4gen.encodings import Major, TcgenInstrDesc
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import (Arrive, BarrierKind, BlockRef, Commit, ExpectTx, FenceProxyAsync, Mma, NamedArrive,
                            NamedSync, Scope, TmaLoad, TmaStore, TmaStoreWait, TmemLd, TmemSt, Wait,
                            WaitLd, WaitSt, walk_ops)
from fa4gen.lower.sm100 import OP_PTX, build_sm100, legalize

MATRIX = [KernelConfig(head_dim=d, causal=c, gqa_ratio=g) for d in (64, 128) for c in (False, True) for g in (1, 4)]
MATRIX += [KernelConfig(dtype="fp16", causal=True, gqa_ratio=4), KernelConfig(gqa_ratio=128, causal=True),
           KernelConfig(kv_stages=2, head_dim=64, k_split=32)]


@functools.lru_cache(maxsize=None)
def emitted(cfg: KernelConfig):
    pipe, _ = legalize(build_pipeline(cfg))
    ptx, manifest = build_sm100(pipe)
    return pipe, ptx, manifest


# ---------------------------------------------------------------------------------------------------
# PTX -> events


def role_sections(ptx: str) -> dict[str, list[str]]:
    out, cur = {}, None
    for line in ptx.splitlines():
        m = re.match(r"^// role (\w+)$", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        if re.match(r"^// end role (\w+)$", line):
            cur = None
            continue
        if cur is not None:
            out[cur].append(line)
    return out


_INSTR = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);\s*$")
_LABEL = re.compile(r"^\s*(\$\w+):\s*$")


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands (braces and brackets kept whole)."""
    ops, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            ops.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        ops.append(cur.strip())
    return ops


class Layout:
    """Offsets -> names, from the manifest (SMEM) and the pipeline (TMEM, named barriers)."""

    def __init__(self, pipe, manifest):
        lay = manifest["smem_layout"]
        self.bars = []  # (offset of slot 0, slots, name)
        for b in pipe.barriers:
            if b.kind is not BarrierKind.NAMED:
                self.bars.append((lay["barriers"][b.name], b.slots, b.name))
        self.regions = [(v["offset"], v["bytes_per_slot"], v["slots"], k) for k, v in lay["regions"].items()]
        self.named = {}
        for b in pipe.barriers:
            if b.kind is BarrierKind.NAMED:
                per_warp = b.slots > 2 and b.count == 64
                for s in range(b.slots):
                    self.named[b.named_id + s] = (b.name, s // 4 if per_warp else s, b.count)

    def barrier(self, off: int) -> tuple[str, int]:
        for base, slots, name in self.bars:
            if base <= off < base + 8 * slots and (off - base) % 8 == 0:
                return name, (off - base) // 8
        raise AssertionError(f"offset {off} is no mbarrier slot")

    def region(self, off: int) -> tuple[str, int, int]:
        """(region, slot, byte offset inside the slot)."""
        for base, size, slots, name in self.regions:
            if base <= off < base + size * slots:
                return name, (off - base) // size, (off - base) % size
        raise AssertionError(f"offset {off} is in no SMEM region")


def parse(ptx: str, pipe, manifest) -> dict[str, list[tuple]]:
    """Per role, the protocol events in textual order."""
    lay = Layout(pipe, manifest)
    tmaps = {"%tmq": "q", "%tmk": "k", "%tmv": "v", "%tmo": "o"}
    result = {}
    for role, lines in role_sections(ptx).items():
        prov: dict[str, frozenset] = {}  # register -> States (q registers) it was computed from
        consts: dict[str, int] = {}  # named-barrier id registers
        guard = None  # label that ends the current elected-lane region
        events: list[tuple] = []
        pending_before = False
        last_was_sync = False

        def src_states(ops):
            s = set()
            for o in ops:
                for reg in re.findall(r"%\w+", o):
                    m = re.match(rf"%q_{role}_(\w+)$", reg)
                    if m:
                        s.add(m.group(1))
                    elif reg in prov:
                        s |= prov[reg]
            return frozenset(s)

        def addr(op: str):
            m = re.match(r"\[(%\w+)\+(\d+)\]$", op)
            assert m, f"{role}: unexpected address {op}"
            base, off = m.group(1), int(m.group(2))
            if base in ("%bar", "%smem"):
                return None, off
            st = prov.get(base, frozenset())
            assert len(st) == 1, f"{role}: address register {base} not derived from exactly one State ({st})"
            return next(iter(st)), off

        def bar_slot(op: str):
            state, off = addr(op)
            name, k = lay.barrier(off)
            return name, (k if state is None else (state, k))

        for line in lines:
            lm = _LABEL.match(line)
            if lm:
                if guard == lm.group(1):
                    guard = None
                continue
            line = line.split("//")[0]
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
                parity = pm.group(1) if pm else next(iter(prov[par]))
                ev = ("wait", name, slot, parity)
            elif opc.startswith("mbarrier.arrive.expect_tx"):
                name, slot = bar_slot(ops[1])
                ev = ("expect_tx", name, slot, int(ops[2]), elected)
            elif opc.startswith("mbarrier.arrive"):
                name, slot = bar_slot(ops[1])
                ev = ("arrive", name, slot, elected, pending_before)
            elif opc.startswith("cp.async.bulk.tensor") and ".global.shared::cta" in opc:
                ev = ("tma_store", tmaps[ops[0][1:].split(",")[0].strip()], elected)
            elif opc.startswith("cp.async.bulk.tensor"):
                st, off = addr(ops[0])
                region, slot, inner = lay.region(off)
                bname, bslot = bar_slot(ops[2])
                ev = ("tma_load", tmaps[ops[1][1:].split(",")[0].strip()], region,
                      slot if st is None else (st, slot), bname, bslot, elected)
            elif opc == "cp.async.bulk.commit_group":
                ev = ("bulk_commit", elected)
            elif opc.startswith("cp.async.bulk.wait_group.read"):
                ev = ("store_wait", elected)
            elif opc.startswith("tcgen05.mma"):
                d = re.match(r"\[%tmem\+(\d+)\]$", ops[0])
                idesc = TcgenInstrDesc.decode(int(ops[3], 16))
                if ops[1].startswith("["):
                    a = ("tmem", int(re.match(r"\[%tmem\+(\d+)\]$", ops[1]).group(1)))
                else:
                    a = ("smem", tuple(sorted(src_states([ops[1]]))))
                ev = ("mma", int(d.group(1)), a, tuple(sorted(src_states([ops[2]]))), idesc.n,
                      idesc.b_major.name, ops[4], pred == "@%p_el")
            elif opc.startswith("tcgen05.commit"):
                name, slot = bar_slot(ops[0])
                ev = ("commit", name, slot, pred == "@%p_el")
            elif opc.startswith("tcgen05.ld"):
                n = int(re.search(r"\.x(\d+)\.", opc).group(1))
                col = int(re.match(r"\[%tml\+(\d+)\]$", ops[1]).group(1))
                ev = ("tmem_ld", col, col + n)
            elif opc.startswith("tcgen05.st"):
                n = int(re.search(r"\.x(\d+)\.", opc).group(1))
                col = int(re.match(r"\[%tml\+(\d+)\]$", ops[0]).group(1))
                ev = ("tmem_st", col, col + n)
            elif opc.startswith("tcgen05.wait::ld"):
                ev = ("wait_ld",)
            elif opc.startswith("tcgen05.wait::st"):
                ev = ("wait_st",)
            elif opc in ("bar.arrive", "bar.sync") and ops[0] != "0":
                bid = consts[ops[0]] if ops[0].startswith("%") else int(ops[0])
                name, slot, count = lay.named[bid]
                assert int(ops[1]) == count, f"{role}: {opc} {ops[0]} with {ops[1]} threads, barrier counts {count}"
                ev = (opc.replace(".", "_"), name, slot, pending_before if opc == "bar.arrive" else None)
            elif opc == "fence.proxy.async.shared::cta":
                ev = ("fence_proxy_async",)
            elif opc == "tcgen05.fence::before_thread_sync":
                pending_before = True
                continue
            elif opc == "tcgen05.fence::after_thread_sync":
                if last_was_sync:
                    events[-1] = events[-1] + ("fence_after",)
                    last_was_sync = False
                    continue
                ev = ("fence_after without a wait",)
            elif opc.startswith(("tcgen05.", "mbarrier.", "cp.async.", "bar.", "fence.")) and opc != "bar.warp.sync":
                raise AssertionError(f"{role}: protocol instruction the read-back does not know: {line.strip()}")
            else:
                # plain instruction: dataflow of address registers and named-barrier ids
                if ops and re.match(r"%\w+$", ops[0]) and not opc.startswith(("st.", "setp", "bra")):
                    dst = ops[0]
                    s = src_states(ops[1:])
                    if s:
                        prov[dst] = s
                    else:
                        prov.pop(dst, None)
                    if opc == "add.u32" and ops[1] == "%warp4":
                        consts[dst] = int(ops[2])
                if opc.startswith("setp") and len(ops) >= 3:
                    s = src_states(ops[1:])
                    if s:
                        prov[ops[0]] = s
                if opc.startswith("selp") and len(ops) >= 4:
                    prov[ops[0]] = src_states(ops[1:])
            if ev is not None:
                if ev[0] in ("arrive", "bar_arrive"):
                    pending_before = False
                events.append(ev)
                last_was_sync = ev[0] in ("wait", "bar_sync")
        result[role] = _collapse(events)
    return result


def _collapse(events: list[tuple]) -> list[tuple]:
    """Fold the repeated instructions of one op (TMA boxes, MMA k steps, store + commit_group)."""
    out = []
    for ev in events:
        if ev[0] == "tma_load" and out and out[-1][0] == "tma_load_n" and out[-1][1] == ev[1:]:
            out[-1] = ("tma_load_n", ev[1:], out[-1][2] + 1)
            continue
        if ev[0] == "tma_load":
            out.append(("tma_load_n", ev[1:], 1))
            continue
        if ev[0] == "tma_store" and out and out[-1][0] == "tma_store_n" and out[-1][1] == ev[1:]:
            out[-1] = ("tma_store_n", ev[1:], out[-1][2] + 1)
            continue
        if ev[0] == "tma_store":
            out.append(("tma_store_n", ev[1:], 1))
            continue
        if ev[0] == "bulk_commit":
            assert out and out[-1][0] == "tma_store_n", "commit_group without a preceding TMA store"
            out[-1] = out[-1] + ("committed",)
            continue
        if ev[0] == "mma" and out and out[-1][0] == "mma_n" and out[-1][1] == ev[1] and ev[6] == "1" \
                and out[-1][3] == ev[3] and out[-1][-1] < 64:
            last = out[-1]
            a = last[2] + ((ev[2][1],) if ev[2][0] == "tmem" else ())
            out[-1] = ("mma_n", last[1], a, last[3], last[4], last[5], last[6], last[7], last[8] + 1)
            continue
        if ev[0] == "mma":
            a = (ev[2][1],) if ev[2][0] == "tmem" else ev[2][1]
            out.append(("mma_n", ev[1], ("tmem",) + a if ev[2][0] == "tmem" else ("smem",) + a, ev[3], ev[4],
                        ev[5], ev[6], ev[7], 1))
            continue
        out.append(ev)
    return out


# ---------------------------------------------------------------------------------------------------
# IR -> expected events (the table OP_PTX, inverted by hand below)


def expected(pipe, manifest) -> dict[str, list[tuple]]:
    cfg = pipe.config
    boxes = cfg.head_dim // 64
    out = {}
    for role in pipe.roles:
        tc_any = any(isinstance(op, (Mma, TmemLd, TmemSt)) for op in walk_ops(role.program))
        tc_ldst = any(isinstance(op, (TmemLd, TmemSt)) for op in walk_ops(role.program))

        def slot(s):
            if isinstance(s, int):
                return s
            st = role.state(s)
            return st.slot_base if st.depth == 1 else (s, st.slot_base)

        def region_slot(s):
            if isinstance(s, int):
                return s
            st = role.state(s)
            return st.slot_base if st.depth == 1 else (s, st.slot_base)

        def phys(rname, lo, hi):
            r = pipe.region(rname)
            return (r.col + lo // 2, r.col + hi // 2) if r.dtype == "f16" else (r.col + lo, r.col + hi)

        evs = []
        for op in walk_ops(role.program):
            assert type(op) in OP_PTX, f"{type(op).__name__} has no row in the op -> PTX table"
            if isinstance(op, Wait):
                ev = ("wait", op.barrier, slot(op.state), op.state)
                if tc_any and pipe.barrier(op.barrier).kind is not BarrierKind.TMA:
                    ev += ("fence_after",)
            elif isinstance(op, Arrive):
                ev = ("arrive", op.barrier, slot(op.slot), op.scope is Scope.ELECTED, tc_ldst)
            elif isinstance(op, ExpectTx):
                ev = ("expect_tx", op.barrier, slot(op.slot), op.bytes, True)
            elif isinstance(op, TmaLoad):
                ev = ("tma_load_n", (op.tensor, op.dst, region_slot(op.dst_slot), op.barrier, slot(op.bar_slot), True),
                      boxes)
            elif isinstance(op, TmaStore):
                ev = ("tma_store_n", ("o", True), boxes, "committed")
            elif isinstance(op, TmaStoreWait):
                ev = ("store_wait", True)
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
                    a = ("tmem",) + tuple(p.col + k // 2 for k in range(op.k_lo, op.k_hi, 16))
                    n, major = cfg.head_dim, Major.MN.name
                ev = ("mma_n", d.col, a, b_states, n, major, acc, True, steps)
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
                ev = ("bar_arrive", op.barrier, op.slot, tc_ldst)
            elif isinstance(op, NamedSync):
                ev = ("bar_sync", op.barrier, op.slot, None) + (("fence_after",) if tc_any else ())
            elif isinstance(op, FenceProxyAsync):
                ev = ("fence_proxy_async",)
            else:
                assert OP_PTX[type(op)] == (), f"{type(op).__name__} lowers to {OP_PTX[type(op)]} but is not checked"
                continue
            evs.append(ev)
        out[role.name] = evs
    return out


def _diff(got: list, want: list) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return f"first difference at event {i}: got {g}, IR says {w}"
    return f"lengths differ: got {len(got)} events, IR has {len(want)}"


def check(ptx, pipe, manifest) -> list[str]:
    """Differences between the PTX's protocol and the IR's ([] when they agree). A PTX the parser
    cannot read as a protocol (e.g. a fence with no wait before it) is a difference too."""
    want = expected(pipe, manifest)
    try:
        got = parse(ptx, pipe, manifest)
    except AssertionError as e:
        return [f"unreadable protocol: {e}"]
    problems = []
    for role in pipe.roles:
        if role.name not in got:
            problems.append(f"role {role.name}: no section in the PTX")
        elif got[role.name] != want[role.name]:
            problems.append(f"role {role.name}: {_diff(got[role.name], want[role.name])}")
    return problems


# ---------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.name)
def test_ptx_reads_back_to_the_ir_programs(cfg):
    pipe, ptx, manifest = emitted(cfg)
    assert check(ptx, pipe, manifest) == []
    # the comparison covered real work: every role with a program produced protocol events
    got = parse(ptx, pipe, manifest)
    for role in pipe.roles:
        if role.program:
            assert got[role.name], role.name


def test_op_table_covers_every_op_kind_in_the_ir():
    for cfg in (KernelConfig(), KernelConfig(causal=True)):
        pipe, _, _ = emitted(cfg)
        for role in pipe.roles:
            for op in walk_ops(role.program):
                assert type(op) in OP_PTX


def test_barrier_and_region_layout_do_not_overlap():
    for cfg in MATRIX:
        pipe, _, manifest = emitted(cfg)
        lay = manifest["smem_layout"]
        spans = [(v["offset"], v["offset"] + v["bytes_per_slot"] * v["slots"]) for v in lay["regions"].values()]
        spans += [(off, off + 8 * pipe.barrier(name).slots) for name, off in lay["barriers"].items()]
        spans += [(lay["tmem_addr_slot"], lay["tmem_addr_slot"] + 4)]
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{cfg.name}: SMEM spans {(a0, a1)} and {(b0, b1)} overlap"
        assert spans[-1][1] + lay["align"] <= manifest["dynamic_smem_bytes"]


# ---- mutated templates must fail the read-back ----------------------------------------------------

MUTATIONS = {
    "drop wait::st": ("{% macro wait_st(it) %}\n{{ tc.wait_st() }}", "{% macro wait_st(it) %}\n"),
    "drop mbarrier wait": ("{{ mb.wait_parity(it.addr, it.parity, it.pred, it.uid) }}", ""),
    "drop plain arrive": ("{% else %}\n{{ mb.arrive(it.addr) }}\n{% endif %}", "{% else %}\n{% endif %}"),
    "drop tcgen05.commit": ("{{ tc.commit(\"%p_el\", it.addr) }}", ""),
    "wait::st after its arrive": ("{% macro wait_st(it) %}\n{{ tc.wait_st() }}",
                                  "{% macro wait_st(it) %}\n"),
}


def _mutated_env(monkeypatch, old: str, new: str, extra=None):
    root = render_mod.templates_dir()
    src = (root / "sm100" / "ops.ptx.j2").read_text()
    assert old in src, f"mutation anchor not found in ops.ptx.j2: {old!r}"
    src = src.replace(old, new, 1)
    if extra:
        for a, b in extra:
            assert a in src
            src = src.replace(a, b, 1)
    env = jinja2.Environment(loader=jinja2.ChoiceLoader([jinja2.DictLoader({"sm100/ops.ptx.j2": src}),
                                                         jinja2.FileSystemLoader(str(root))]),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False)
    monkeypatch.setattr(render_mod, "environment", lambda: env)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutated_template_fails_the_read_back(monkeypatch, name):
    old, new = MUTATIONS[name]
    extra = None
    if name == "wait::st after its arrive":
        # the arrive now emits wait::st after the mbarrier arrive: same instructions, wrong order
        extra = [("{% else %}\n{{ mb.arrive(it.addr) }}\n{% endif %}",
                  "{% else %}\n{{ mb.arrive(it.addr) }}\n{% if it.fence_before %}\n{{ tc.wait_st() }}\n{% endif %}"
                  "\n{% endif %}")]
    _mutated_env(monkeypatch, old, new, extra)
    cfg = KernelConfig(causal=True, gqa_ratio=4)
    pipe, _ = legalize(build_pipeline(cfg))
    ptx, manifest = build_sm100(pipe)
    good = emitted(cfg)[1]
    assert ptx != good
    problems = check(ptx, pipe, manifest)
    assert problems, f"mutation {name!r} went unnoticed"


def _op_blocks(lines: list[str], start: int, end: int) -> dict[int, tuple[int, int]]:
    """Line ranges of the `// op N` blocks between start and end (used only to build mutations)."""
    marks = [(int(re.search(r"// op (\d+)", lines[i]).group(1)), i) for i in range(start, end)
             if re.search(r"// op \d+ ", lines[i])]
    return {n: (i, (marks[k + 1][1] if k + 1 < len(marks) else end)) for k, (n, i) in enumerate(marks)}


@pytest.mark.parametrize("barrier", ["p_ready_2", "p_o_rescale"])
def test_mma_issued_before_its_wait_fails_the_read_back(barrier):
    """The PV MMA text moved above the wait that guards it (same instructions, different order)."""
    cfg = KernelConfig()
    pipe, ptx, manifest = emitted(cfg)
    mma = pipe.role("mma")
    ops = list(walk_ops(mma.program))
    i = next(k for k, op in enumerate(ops) if isinstance(op, Wait) and op.barrier == barrier)
    assert isinstance(ops[i + 1], Mma)
    lines = ptx.splitlines()
    start, end = lines.index("// role mma"), lines.index("// end role mma")
    blocks = _op_blocks(lines, start, end)
    (w0, w1), (m0, m1) = blocks[i], blocks[i + 1]
    mutated = lines[:w0] + lines[m0:m1] + lines[w0:w1] + lines[m1:]
    problems = check("\n".join(mutated), pipe, manifest)
    assert problems and "mma" in problems[0]


_MNEMONIC = [  # instruction prefix -> Ptx table class (longest prefixes first)
    ("mbarrier.try_wait.parity", "mbarrier.try_wait.parity"),
    ("mbarrier.arrive.expect_tx", "mbarrier.arrive.expect_tx"),
    ("mbarrier.arrive", "mbarrier.arrive"),
    ("cp.async.bulk.tensor", None),  # direction decides
    ("cp.async.bulk.commit_group", "cp.async.bulk.commit_group"),
    ("cp.async.bulk.wait_group.read", "cp.async.bulk.wait_group.read"),
    ("tcgen05.mma", "tcgen05.mma"), ("tcgen05.commit", "tcgen05.commit"), ("tcgen05.ld", "tcgen05.ld"),
    ("tcgen05.st", "tcgen05.st"), ("tcgen05.wait::ld", "tcgen05.wait::ld"), ("tcgen05.wait::st", "tcgen05.wait::st"),
    ("bar.arrive", "bar.arrive"), ("bar.sync", "bar.sync"),
    ("fence.proxy.async.shared::cta", "fence.proxy.async.shared::cta"),
]


def _classes(block: list[str]) -> list[str]:
    out = []
    for line in block:
        m = _INSTR.match(line.split("//")[0])
        if not m:
            continue
        opc = m.group(2)
        if opc.startswith("tcgen05.fence::"):
            continue  # added around synchronisation by fence_policy, checked by test_ptx_reads_back...
        for prefix, cls in _MNEMONIC:
            if opc.startswith(prefix):
                if cls is None:
                    cls = "cp.async.bulk.tensor.s2g" if ".global.shared::cta" in opc else "cp.async.bulk.tensor.g2s"
                out.append(cls)
                break
    return out


def _matches(row: tuple[str, ...], classes: list[str]) -> bool:
    """Does the instruction class sequence spell the table row (`x*` = one or more x)?"""
    pat = "".join(f"(?:{re.escape(c[:-1])};)+" if c.endswith("*") else f"{re.escape(c)};" for c in row)
    return re.fullmatch(pat, "".join(c + ";" for c in classes)) is not None


@pytest.mark.parametrize("cfg", [KernelConfig(), KernelConfig(causal=True, gqa_ratio=4)], ids=lambda c: c.name)
def test_each_op_segment_spells_its_op_ptx_row(cfg):
    """The table inverted mechanically: cut each role at its `// op N` markers and require every
    segment's protocol instructions to be exactly the row OP_PTX gives for op N's type."""
    pipe, ptx, _ = emitted(cfg)
    lines = ptx.splitlines()
    for role in pipe.roles:
        ops = list(walk_ops(role.program))
        a, b = lines.index(f"// role {role.name}"), lines.index(f"// end role {role.name}")
        marks = [(int(re.search(r"// op (\d+) ", lines[i]).group(1)), i) for i in range(a, b)
                 if re.search(r"// op \d+ ", lines[i])]
        assert [n for n, _ in marks] == list(range(len(ops))), role.name
        for k, (n, i) in enumerate(marks):
            end = marks[k + 1][1] if k + 1 < len(marks) else b
            # structural lines (loop/branch labels, conditions) after an op belong to no op
            classes = _classes(lines[i + 1:end])
            row = OP_PTX[type(ops[n])]
            assert _matches(row, classes), f"{role.name} op {n} {type(ops[n]).__name__}: {classes} != {row}"
