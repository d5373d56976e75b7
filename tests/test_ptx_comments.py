"""The reviewable sm_100a PTX: every comment the lowering prints next to an instruction says what
that instruction touches in the IR's names, and says it correctly (checked here against the
instruction itself: the barrier its address falls in, the State register its slot and parity come
from, the descriptor value decoded, the Compute op's fn). Comments never change an instruction:
fa4gen check and the emulator strip them (tests/test_ptxemu.py runs both on generated/)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from fa4gen import codegen
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.encodings import DescArch, SmemMatrixDesc, TcgenInstrDesc
from fa4gen.spec.exp2 import emulated_mask
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import BarrierKind, Compute, Mma, walk_ops

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "generated"
CONFIGS = [KernelConfig(), KernelConfig(causal=True), KernelConfig(head_dim=64, gqa_ratio=4),
           KernelConfig(dtype="fp16", causal=True, gqa_ratio=4)]
# Mnemonics tests and scripts count in the raw PTX text: a comment must never spell one.
MNEMONICS = ("mbarrier.", "tcgen05.", "cp.async", "ex2.approx", "bar.sync", "bar.arrive", "add.rm.", "fma.rn.",
             "wgmma.")


@functools.lru_cache(maxsize=None)
def emitted(cfg: KernelConfig):
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    return build_pipeline(cfg), res.ptx, res.manifest


def code_and_comment(line: str) -> tuple[str, str]:
    code, _, note = line.partition("//")
    return code.strip(), note.strip()


def roles(ptx: str, pipe):
    """(role, [(line number, code, comment)]) of each role's section."""
    lines = ptx.splitlines()
    for r in pipe.roles:
        a, b = lines.index(f"// role {r.name}"), lines.index(f"// end role {r.name}")
        yield r, [(i + 1, *code_and_comment(lines[i])) for i in range(a + 1, b)]


def barrier_at(manifest, pipe, off: int):
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED:
            continue
        base = manifest["smem_layout"]["barriers"][b.name]
        if base <= off < base + 8 * b.slots:
            return b.name, (off - base) // 8
    raise AssertionError(f"offset {off} is no barrier of the manifest's table")


_BAR_OPS = (("mbarrier.init.", "init"), ("mbarrier.try_wait.", "wait"), ("mbarrier.arrive.expect_tx.", "expect_tx"),
            ("mbarrier.arrive.", "arrive"), ("tcgen05.commit.", "commit"))


# ---- item 1: barriers, slots and phases ------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_every_mbarrier_instruction_names_its_barrier_slot_and_phase(cfg):
    pipe, ptx, man = emitted(cfg)
    table = man["smem_layout"]["barriers"]
    seen = 0
    sections = [("prologue", [(i + 1, *code_and_comment(ln)) for i, ln in enumerate(ptx.splitlines())
                              if "mbarrier.init" in ln])] + [(r.name, body) for r, body in roles(ptx, pipe)]
    for role, body in sections:
        qs = setp = None  # the State register %qs was decoded from, and its depth
        for n, code, note in body:
            m = re.match(r"setp\.ge\.u32 %p_q, (%q_\w+), (\d+);", code)
            if m:
                setp = (m.group(1), int(m.group(2)))
            if re.match(r"mov\.u32 %qs, (%q_\w+);", code):
                qs = setp
            instr = re.sub(r"^@!?%\w+\s+", "", code)
            verb = next((v for prefix, v in _BAR_OPS if instr.startswith(prefix)), None)
            if verb is None:
                continue
            seen += 1
            where = f"line {n} ({role}): {code}"
            assert note.startswith(verb + " "), f"{where}: comment {note!r} does not say {verb!r}"
            base, off = re.search(r"\[%(bar|qb)\+(\d+)\]", instr).groups()
            name, slot = barrier_at(man, pipe, int(off))
            assert name in table
            if base == "bar":
                assert note.startswith(f"{verb} {name}[{slot}]"), f"{where}: {note!r} is not {name}[{slot}]"
            else:  # a ring State's slot: the comment names the register and depth %qs was decoded from
                q, depth = qs
                assert note.startswith(f"{verb} {name}[{slot} + {q} mod {depth}]" if slot else
                                       f"{verb} {name}[{q} mod {depth}]"), f"{where}: {note!r}, slot from {q} mod {depth}"
            if verb == "wait":
                parity = instr.rstrip(";").split(",")[-1].strip()
                if parity == "%qp":  # selp'd from the ring State's q >= depth
                    assert f"phase parity ({setp[0]} >= {setp[1]})" in note, f"{where}: {note!r}"
                else:  # a depth-1 State: its register is the parity
                    assert f"phase parity {parity}:" in note, f"{where}: {note!r}"
                st = re.search(r"state (\w+), start phase (\d)", note)
                state = pipe.role(role).state(st.group(1))
                assert f"%q_{role}_{state.name}" in note and int(st.group(2)) == state.start_phase
            if verb == "init":
                assert f"{pipe.barrier(name).count} arrival" in note
    n_bar = sum(b.slots for b in pipe.barriers if b.kind is not BarrierKind.NAMED)
    assert seen > n_bar + 40  # every init plus the roles' waits, arrivals, expect_tx and commits


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: c.name)
def test_comments_spell_no_instruction(cfg):
    """Tests and scripts count mnemonics in the raw text (test_sm100_emit.profile): no comment the
    lowering adds may contain one, nor a ';' (line readers split on it)."""
    _, ptx, _ = emitted(cfg)
    for line in ptx.splitlines():
        code, note = code_and_comment(line)
        if code and note:
            assert not any(m in note for m in MNEMONICS), line
            assert ";" not in note, line


def test_state_registers_are_introduced_with_their_ring():
    pipe, ptx, _ = emitted(KernelConfig())
    mma = dict(roles(ptx, pipe))[pipe.role("mma")]
    notes = {code.split()[1].rstrip(","): note for _, code, note in mma if code.startswith("mov.u32 %q_mma_")}
    assert notes["%q_mma_k"] == ("state k (kv_full, KV, kv_empty): q in [0, 6), slot = q mod 3, "
                                 "phase parity = (q >= 3), start 0, start phase 0, stride 2")
    assert notes["%q_mma_por0"].startswith("state por0 (p_o_rescale): slot 0, phase parity = q")


# ---- item 2: descriptors decoded -----------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_descriptor_comments_are_the_printed_values_decoded(cfg):
    pipe, ptx, _ = emitted(cfg)
    n_idesc = n_sdesc = 0
    body = dict(roles(ptx, pipe))[pipe.role("mma")]
    step = None
    for _, code, note in body:
        m = re.match(r"add\.s64 %dak, %da, (\d+);", code)
        if m:
            step = int(m.group(1))
        m = re.match(r"or\.b64 %d([ab]), %d\1, (0x[0-9a-f]+);", code)
        if m:
            n_sdesc += 1
            want = SmemMatrixDesc.decode(int(m.group(2), 16), DescArch.SM100A).describe()
            assert note.startswith(f"{m.group(1).upper()} desc ") and want in note, (code, note)
        m = re.search(r"tcgen05\.mma\S* (\[%tmem\+\d+\]), ([^,]+|\[%tmem\+\d+\]), %dbk, (0x[0-9a-f]+), ", code)
        if m:
            n_idesc += 1
            assert note.endswith("idesc: " + TcgenInstrDesc.decode(int(m.group(3), 16)).describe()), (code, note)
            if m.group(2) == "%dak":  # SS form: the k step's byte offset is the descriptor's start advance
                k = re.match(r"k (\d+)-(\d+) \(\+(\d+) B\)", note)
                assert int(k.group(2)) - int(k.group(1)) == 15 and int(k.group(3)) == 16 * step, (code, note)
            else:  # TS form: A is P in TMEM at the printed column
                assert f"at TMEM col {m.group(2)[7:-1]}," in note, (code, note)
    assert n_idesc == 2 * 2 * (cfg.head_dim // 16 + 128 // 16) and n_sdesc > 0


def test_descriptor_comments_by_hand():
    """Table 42 / Table 40 read by hand for the bf16 D=128 kernel and the fp16 one."""
    _, ptx, _ = emitted(KernelConfig())
    assert ("0x8200490, 0; // k 0-15 (+0 B), idesc: D f32, A bf16 K-major, B bf16 K-major, M 128, N 128") in ptx
    assert "0x8210490, %p_acc; // keys 0-15: A = P0 at TMEM col 64, B +0 B, idesc: D f32, A bf16 K-major, " \
           "B bf16 MN-major, M 128, N 128" in ptx
    assert ("or.b64 %da, %da, 0x4000404000010000; // A desc Q[%q_mma_qa mod 2] K-major: 128B swizzle, LBO 16 B, "
            "SBO 1024 B, base offset 0, start = address >> 4") in ptx
    assert ("or.b64 %db, %db, 0x4000404004000000; // B desc KV[%q_mma_v mod 3] (V) MN-major: 128B swizzle, "
            "LBO 16384 B, SBO 1024 B, base offset 0") in ptx
    _, ptx16, _ = emitted(KernelConfig(dtype="fp16", head_dim=64, gqa_ratio=4))
    assert "idesc: D f32, A f16 K-major, B f16 MN-major, M 128, N 64" in ptx16


# ---- item 3: what each Compute (and Mma) block computes -------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_compute_and_mma_markers_say_what_they_compute(cfg):
    pipe, ptx, _ = emitted(cfg)
    n_emu = sum(int(emulated_mask(cfg, f, False).sum()) for f in range(4))
    want = {
        "softmax_max": ["row max of S (128 cols)", f"conditional rescale decision (threshold {cfg.rescale_threshold:g}",
                        "causal mask" if cfg.causal else "Skv tail mask"],
        "softmax_exp": ["P = 2^(S*scale - ref*scale)", f"{n_emu} of 128 columns on the FMA cubic (packed f32x2)"],
        "row_sum": ["row_sum = row_sum * acc_scale + sum of P"],
        "rescale_o": ["correction: O", "*= acc_scale (packed f32x2)"],
        "normalize": ["*= 1/row_sum", f"cast to {cfg.dtype} pairs"],
        "store_lse": ["LSE = (ref*scale + log2(row_sum)) * ln 2"],
    }
    fns = set()
    for role, body in roles(ptx, pipe):
        ops = list(walk_ops(role.program))
        for _, code, note in body:
            m = re.match(r"op (\d+) (\w+)(: (.*))?$", note) if not code else None
            if not m:
                continue
            op = ops[int(m.group(1))]
            assert m.group(2) == type(op).__name__
            if isinstance(op, Compute):
                text = m.group(4) or ""
                fns.add(op.fn)
                assert text.startswith("correction: " if op.fn == "rescale_o" else op.fn), note
                for w in want[op.fn]:
                    assert w in text, f"{role.name} op {m.group(1)} {op.fn}: {w!r} not in {text!r}"
                if op.qtile is not None and op.fn not in ("rescale_o", "normalize"):
                    assert f"(Q tile {op.qtile})" in text
            elif isinstance(op, Mma):
                text = m.group(4)
                d = pipe.region(op.d)
                assert text.startswith(f"{op.d} {'=' if op.kind == 'qk' else '+='} "), note
                assert f"into TMEM cols {d.col}-{d.col_end - 1}" in text
                assert ("overwrite" if op.accumulate == "false" else "accumulate") in text
            else:
                assert m.group(3) is None, note  # the other ops' comments sit on their instructions
    assert fns == set(want)


def test_notes_cannot_break_a_line():
    from fa4gen.render.jinja import _comment
    assert _comment("") == "" and _comment("wait x[0]") == " // wait x[0]"
    for bad in ("a;b", "a\nb"):
        with pytest.raises(ValueError):
            _comment(bad)
