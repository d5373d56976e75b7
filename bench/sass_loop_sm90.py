#!/usr/bin/env python3
"""Static SASS of the sm_90a consumers' steady-state K/V loop: what ptxas made of one block's work.

    python3 -m bench.sass_loop_sm90 [--head-dim D] [--causal] [--block-m auto|128|192] [--gqa G] [--sass FILE ...]
                                    [--out FILE.json]

Builds the kernel through the chain (fa4gen.codegen: PTX, then ptxas -O3; the Q tile the API runs
unless --block-m), disassembles it (nvdisasm / cuobjdump) and finds the consumer's steady-state loop:
of the loops (a backward branch and its target) that hold both a QK wgmma (A from a shared-memory
descriptor) and a PV wgmma (A, P, from registers), the shortest: the K/V loop inside the task loop. Reported per loop (static counts: each
instruction of the body once, whatever branch it sits in):
- the instruction count by family (HGMMA, MUFU, FFMA, FMUL, FADD, FMNMX, F2FP, SHFL, FSEL/FSETP,
  barriers, R2UR, uniform integer, vector integer, WARPGROUP, control);
- `pv_wait_gap`: the instructions from the wait for S (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the QK done, the
  PV may run) to the wait for the PV (`... 0x0`), and the MUFU.EX2 between them: how much of the
  softmax overlaps the PV wgmma. ptxas moves the second wait up to the first write of a register the
  PV still reads, so register pressure shows here.
`--sass FILE` adds the same report for any other disassembly (e.g. a peer's kernel, `nvdisasm -c`).
`--order` prints each loop's opcodes in program order (e.g. whether each row-sum FADD follows a
MUFU.EX2 or the adds come in a block after them; the JSON always holds it).
Writes JSON to --out (default: stdout only). Measures nothing on a GPU: a screen before an A/B.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")

FAMILIES = (  # (family, opcode prefixes): first match wins
    ("HGMMA", ("HGMMA",)), ("MUFU", ("MUFU",)), ("FFMA", ("FFMA",)), ("FMUL", ("FMUL",)), ("FADD", ("FADD",)),
    ("FMNMX", ("FMNMX",)), ("F2FP", ("F2FP",)), ("SHFL", ("SHFL",)), ("FSEL/FSETP", ("FSEL", "FSETP")),
    ("barriers", ("BAR", "SYNCS", "DEPBAR", "MEMBAR")), ("R2UR", ("R2UR",)), ("WARPGROUP", ("WARPGROUP",)),
    ("uniform int", ("UIADD3", "UMOV", "ULEA", "USEL", "ULOP3", "UISETP", "ULDC", "USHF", "UIMAD", "UPRMT")),
    ("vector int", ("IADD3", "IMAD", "MOV", "LEA", "SHF", "LOP3", "ISETP", "SEL", "IMNMX", "PRMT", "VOTE", "P2R",
                    "R2P", "PLOP3")),
    ("control", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "WARPSYNC", "NOP", "YIELD")),
)


def split_instruction(text: str) -> tuple[str, str]:
    """(opcode with modifiers, operands) of one SASS instruction's text, its predicate guard dropped."""
    op, _, rest = _GUARD.sub("", text.strip()).partition(" ")
    return op, rest.strip()


def base_opcode(op: str) -> str:
    """The mnemonic without modifiers: MUFU for MUFU.EX2."""
    return op.split(".")[0]


def parse_sass(text: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """[(address, opcode with modifiers, operands)] and label -> address of a disassembly."""
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        op, rest = split_instruction(m.group(2))
        addr = int(m.group(1), 16)
        for lab in pending:
            labels[lab] = addr
        pending = []
        ins.append((addr, op, rest))
    return ins, labels


def family(op: str) -> str:
    for name, prefixes in FAMILIES:
        if op.startswith(prefixes):
            return name
    return "other"


def wgmma_kind(operands: str) -> str:
    """"ss" (A from a shared-memory descriptor: the QK) or "rs" (A from registers: the PV) of an HGMMA's
    operand list (accumulator, A, B, ...)."""
    parts = [p.strip() for p in operands.split(",")]
    return "ss" if len(parts) > 1 and parts[1].startswith("gdesc") else "rs"


def steady_loop(ins, labels) -> list[tuple[int, str, str]] | None:
    """The body of the innermost loop holding both wgmma kinds (a QK from shared memory and a PV from
    registers): the shortest such loop (the task loop around it holds them too), or None."""
    addrs = [a for a, _, _ in ins]
    best = None
    for i, (a, op, rest) in enumerate(ins):
        m = re.search(r"`\((\.L_x_\d+)\)", rest) if op.startswith("BRA") else None
        if not m or labels.get(m.group(1), a + 1) > a:
            continue
        body = ins[addrs.index(labels[m.group(1)]):i + 1]
        kinds = {wgmma_kind(rest2) for _, op2, rest2 in body if op2.startswith("HGMMA")}
        if kinds >= {"ss", "rs"} and (best is None or len(body) < best[0]):
            best = (len(body), body)
    return None if best is None else best[1]


def loop_report(text: str) -> dict:
    ins, labels = parse_sass(text)
    body = steady_loop(ins, labels)
    if body is None:
        return {"loop": None, "why": "no loop with both a QK and a PV wgmma (HGMMA) in this disassembly"}
    fam = collections.Counter(family(op) for _, op, _ in body)
    ops = [(op, rest) for _, op, rest in body]
    waits = [k for k, (op, rest) in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR")]
    gap = None
    first = next((k for k in waits if rest_has(ops[k][1], "0x1")), None)
    if first is not None:
        after = next((k for k in waits if k > first and rest_has(ops[k][1], "0x0")), None)
        if after is not None:
            gap = {"instructions": after - first,
                   "mufu_ex2": sum(op.startswith("MUFU.EX2") for op, _ in ops[first:after])}
    return {"loop": {"first": hex(body[0][0]), "last": hex(body[-1][0]), "instructions": len(body),
                     "families": dict(fam.most_common())}, "pv_wait_gap": gap}


def loop_order(text: str) -> list[str]:
    """The steady loop's opcodes in program order (the base opcode, e.g. MUFU for MUFU.EX2; the two
    wgmma waits as WAIT_S / WAIT_PV): where ptxas put the reductions' adds against the exponentials,
    the packs and the waits, which the family counts do not show. [] when there is no such loop."""
    ins, labels = parse_sass(text)
    body = steady_loop(ins, labels) or []
    out = []
    for _, op, rest in body:
        if op.startswith("WARPGROUP.DEPBAR"):
            out.append("WAIT_S" if rest_has(rest, "0x1") else "WAIT_PV" if rest_has(rest, "0x0") else "DEPBAR")
        else:
            out.append(base_opcode(op))
    return out


def rest_has(rest: str, value: str) -> bool:
    return rest.replace(" ", "").endswith("," + value) or rest.replace(" ", "").endswith(value)


def kernel_report(head_dim: int, causal: bool, block_m: str, gqa: int) -> dict:
    from fa4gen import codegen
    from fa4gen.assemble.assemble import assemble, disassemble
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    rows = q_tile_rows("sm_90a", head_dim, gqa, causal=causal) if block_m == "auto" else int(block_m)
    cfg = KernelConfig(arch="sm_90a", head_dim=head_dim, causal=causal, gqa_ratio=gqa, block_m=rows)
    res = codegen.build(cfg, emit=("ptx",))
    asm = assemble(res.ptx, cfg.arch, name=cfg.name, extra_options=("-O3",))
    text = disassemble(asm.cubin)
    return {"kernel": cfg.name, **loop_report(text), "order": loop_order(text)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--block-m", default="auto", choices=("auto", "128", "192"))
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--sass", action="append", default=[], help="also report this disassembly (repeatable)")
    ap.add_argument("--order", action="store_true",
                    help="also print each loop's opcodes in program order (WAIT_S / WAIT_PV: the two wgmma waits)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    reports = [kernel_report(a.head_dim, a.causal, a.block_m, a.gqa)]
    for f in a.sass:
        text = Path(f).read_text()
        reports.append({"kernel": f, **loop_report(text), "order": loop_order(text)})
    for r in reports:
        loop, gap = r.get("loop"), r.get("pv_wait_gap")
        if loop is None:
            print(f"{r['kernel']}: {r['why']}")
            continue
        print(f"{r['kernel']}: loop {loop['first']}-{loop['last']}, {loop['instructions']} instructions; "
              f"wait for S -> wait for the PV: "
              + (f"{gap['instructions']} instructions, {gap['mufu_ex2']} MUFU.EX2" if gap else "not found"))
        print("    " + ", ".join(f"{k} {v}" for k, v in loop["families"].items()))
        if a.order:
            print("    order: " + " ".join(r["order"]))
    if a.out:
        a.out.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
