"""Read the emitted sm_100a PTX back into per-role protocol sequences and compare with the IR
(fa4gen.evidence.check, the code behind `fa4gen check`).

The parser knows nothing of the lowering: it reads instructions (mbarrier, cp.async.bulk,
tcgen05, bar, fence), resolves barrier/region identities from address offsets through the manifest's
SMEM layout and the IR's TMEM regions, follows the few address registers back to the State register
they came from (a small dataflow over the role's instructions), and notes whether an instruction
sits in an elected-lane region. Roles are cut at their labels ($L_role_X ... $L_X_end); comments
are ignored. The expected sequence comes from the IR programs through the op -> PTX table
(fa4gen.lower.sm100.OP_PTX), inverted in fa4gen.evidence.check.

Mutated templates (a dropped wait, arrive, commit or wait::st; a wait::st moved after its arrive)
must make the comparison fail.
"""

from __future__ import annotations

import functools
import re

import jinja2
import pytest

from fa4gen.render import jinja as render_mod
from fa4gen.evidence.check import _INSTR, check_ptx
from fa4gen.spec.config import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Mma, Wait, walk_ops
from fa4gen.lower.sm100 import OP_PTX
from fa4gen.render.kernels import build_sm100

MATRIX = [KernelConfig(head_dim=d, causal=c, gqa_ratio=g) for d in (64, 128) for c in (False, True) for g in (1, 4)]
MATRIX += [KernelConfig(dtype="fp16", causal=True, gqa_ratio=4), KernelConfig(gqa_ratio=128, causal=True),
           KernelConfig(kv_stages=2, head_dim=64, k_split=32)]
# one Q tile per task (D = 256): a depth-1 Q State, whose slot is the constant 0 in every address
MATRIX += [KernelConfig(head_dim=256), KernelConfig(head_dim=256, causal=True, gqa_ratio=4)]


@functools.lru_cache(maxsize=None)
def emitted(cfg: KernelConfig):
    pipe = build_pipeline(cfg)
    ptx, manifest = build_sm100(pipe)
    return pipe, ptx, manifest


def check(ptx, pipe, manifest) -> list[str]:
    """Differences between the PTX's protocol and the IR's, as `fa4gen check` reports them."""
    return [str(d) for d in check_ptx(ptx, manifest).differences]


# ---------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.name)
def test_ptx_reads_back_to_the_ir_programs(cfg):
    pipe, ptx, manifest = emitted(cfg)
    rep = check_ptx(ptx, manifest)
    assert rep.ok, rep.summary()
    # the comparison covered real work: every role with a program produced protocol events
    for role in pipe.roles:
        if role.program:
            assert rep.events[role.name], role.name


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
    "drop mbarrier wait": ("{{ mb.wait_parity(it.addr, it.parity, it.pred, it.uid, it.note) }}", ""),
    "drop plain arrive": ("{% else %}\n{{ mb.arrive(it.addr, it.note) }}\n{% endif %}", "{% else %}\n{% endif %}"),
    "drop tcgen05.commit": ("{{ tc.commit(\"%p_el\", it.addr, it.note) }}", ""),
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
    env.filters.update(render_mod.FILTERS)
    monkeypatch.setattr(render_mod, "environment", lambda: env)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutated_template_fails_the_read_back(monkeypatch, name, d):
    old, new = MUTATIONS[name]
    extra = None
    if name == "wait::st after its arrive":
        # the arrive now emits wait::st after the mbarrier arrive: same instructions, wrong order
        extra = [("{% else %}\n{{ mb.arrive(it.addr, it.note) }}\n{% endif %}",
                  "{% else %}\n{{ mb.arrive(it.addr, it.note) }}\n{% if it.fence_before %}\n{{ tc.wait_st() }}\n{% endif %}"
                  "\n{% endif %}")]
    cfg = KernelConfig(head_dim=d, causal=True, gqa_ratio=4)
    good = emitted(cfg)[1]  # before the mutated templates (emitted is cached: a first call after would cache the mutant)
    _mutated_env(monkeypatch, old, new, extra)
    pipe = build_pipeline(cfg)
    ptx, manifest = build_sm100(pipe)
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


@pytest.mark.parametrize("cfg", [KernelConfig(), KernelConfig(causal=True, gqa_ratio=4),
                                 KernelConfig(kvcache=True, page_size=16), KernelConfig(kvcache=True, causal=True)],
                         ids=lambda c: c.name)
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
