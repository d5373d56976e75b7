#!/usr/bin/env python3
"""Static SASS profile of the sm_100a kernels, per warp role: what ptxas made of the generated PTX.

    python3 -m bench.sass_profile [--out FILE.json] [--names a,b] [--head-dim D[,DV]] [--keep DIR] [--quiet]

For every variant of the default sm_100a matrix (fa4gen.codegen.DEFAULT_MATRIX) the PTX is built
through the chain, assembled with ptxas (-O3, resource report: registers, spills) and disassembled
(nvdisasm, or cuobjdump, or the nvidia-cuda-nvdisasm wheel). To attribute each SASS instruction to
the warp role whose PTX it came from, a second copy of the PTX gets `.loc` line records (its own
line numbers; nothing else changes) and is assembled with -lineinfo; nvdisasm's line comments then
name the PTX line of every instruction and the `// role NAME` markers the lowering writes give the
role of that line (lines before the first marker: "prologue"). The profiled cubin is checked to
have exactly the opcode histogram of the plain one, so the line records did not change the code.

Counted per role: MUFU.EX2 (and other MUFU), FFMA, FFMA2, FADD2, FMUL2, R2P, tcgen05 (UTC*,
LDTM/STTM), mbarrier (SYNCS.*), BAR.*, and the total. These are static instruction counts (code
size), not dynamic ones: a loop body counts once. Prints a table and writes JSON (--out; default
bench/results/<UTC date>_sass_profile_sm100a.json) with the toolchain versions.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa4gen import codegen  # noqa: E402
from fa4gen.spec.config import ConfigError  # noqa: E402
from fa4gen.assemble.assemble import assemble, disassemble, find_disassembler, find_ptxas, ptxas_version  # noqa: E402

# opcode family -> the column it is counted in (first match wins); the full histogram goes to the JSON
COLUMNS = (
    ("MUFU.EX2", lambda op: op.startswith("MUFU.EX2")),
    ("MUFU.other", lambda op: op.startswith("MUFU.")),
    ("FFMA", lambda op: op == "FFMA" or op.startswith("FFMA.")),
    ("FFMA2", lambda op: op.startswith("FFMA2")),
    ("FADD2", lambda op: op.startswith("FADD2")),
    ("FMUL2", lambda op: op.startswith("FMUL2")),
    ("R2P", lambda op: op.startswith("R2P")),
    ("UTC*", lambda op: op.startswith("UTC")),
    ("LDTM/STTM", lambda op: op.startswith(("LDTM", "STTM"))),
    ("SYNCS", lambda op: op.startswith("SYNCS")),
    ("BAR", lambda op: op.startswith("BAR.")),
    ("LDL/STL", lambda op: op.startswith(("LDL", "STL"))),
)
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
_LINE = re.compile(r'//## File "[^"]*", line (\d+)')
_ROLE = re.compile(r"^// role (\S+)")


def instrument(ptx: str) -> str:
    """The PTX with a `.loc 1 N 0` record before every instruction of the entry body (N: the
    instruction's own line in `ptx`) and one `.file 1` directive; otherwise the same text."""
    out, in_body = [], False
    for n, line in enumerate(ptx.splitlines(), 1):
        s = line.strip()
        if not in_body:
            out.append(line)
            if s.startswith(".address_size"):
                out.append('.file 1 "kernel.ptx"')
            if s == "{" and any(o.lstrip().startswith((".visible .entry", ".entry")) for o in out[-40:]):
                in_body = True
            continue
        is_instr = s and not s.startswith(("//", ".", "{", "}")) and not s.endswith(":")
        if is_instr:
            out.append(f"    .loc 1 {n} 0")
        out.append(line)
    return "\n".join(out) + "\n"


def roles_by_line(ptx: str) -> list[str]:
    """role name of every PTX line (index = line - 1)."""
    role, out = "prologue", []
    for line in ptx.splitlines():
        m = _ROLE.match(line)
        if m:
            role = m.group(1)
        out.append(role)
    return out


def opcodes(sass: str) -> list[tuple[str, int | None]]:
    """(opcode with modifiers, PTX line or None) of every SASS instruction, in order."""
    res, line = [], None
    for text in sass.splitlines():
        m = _LINE.search(text)
        if m:
            line = int(m.group(1))
            continue
        m = _INSTR.match(text)
        if m:
            res.append((m.group(2), line))
    return res


def column_of(op: str) -> str | None:
    for name, pred in COLUMNS:
        if pred(op):
            return name
    return None


def profile(cfg, keep: Path | None = None) -> dict:
    res = codegen.build(cfg, emit=("ptx",))
    ptx = res.ptx
    plain = assemble(ptx, cfg.arch, name=cfg.name, keep_dir=keep, extra_options=("-O3",))
    prof = assemble(instrument(ptx), cfg.arch, name=cfg.name + "_lines", keep_dir=keep,
                    extra_options=("-O3", "-lineinfo"))
    ops_plain = opcodes(disassemble(plain.cubin))
    ops_prof = opcodes(_disassemble_lines(prof.cubin))
    hist_plain = collections.Counter(op for op, _ in ops_plain)
    hist_prof = collections.Counter(op for op, _ in ops_prof)
    if hist_plain != hist_prof:
        diff = {k: (hist_plain[k], hist_prof[k]) for k in set(hist_plain) | set(hist_prof) if hist_plain[k] != hist_prof[k]}
        raise RuntimeError(f"{cfg.name}: the line records changed the SASS (opcode: plain, profiled): {diff}")
    role_of = roles_by_line(ptx)
    per_role: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, line in ops_prof:
        role = role_of[line - 1] if line and 0 < line <= len(role_of) else "(no line)"
        per_role[role]["total"] += 1
        col = column_of(op)
        if col:
            per_role[role][col] += 1
    totals = collections.Counter()
    for c in per_role.values():
        totals.update(c)
    r = plain.resources[0] if plain.resources else None
    return {
        "name": cfg.name,
        "registers": getattr(r, "registers", None),
        "spill_stores": getattr(r, "spill_stores", None),
        "spill_loads": getattr(r, "spill_loads", None),
        "stack": getattr(r, "stack_frame", None),
        "setmaxnreg": {ro["role"]: ro["setmaxnreg"] for ro in res.manifest["roles"]},
        "totals": dict(totals),
        "per_role": {k: dict(v) for k, v in sorted(per_role.items())},
        "histogram": dict(sorted(hist_plain.items())),
    }


def _disassemble_lines(cubin: bytes) -> str:
    """nvdisasm with line records (-g); cuobjdump cannot print them."""
    tool = find_disassembler()
    if tool is None or tool[0] != "nvdisasm":
        raise RuntimeError("per-role attribution needs nvdisasm (PATH, CUDA toolkit or the nvidia-cuda-nvdisasm wheel)")
    with tempfile.TemporaryDirectory(prefix="fa4gen-sass-") as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([*tool[1], "-g", str(path)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm -g failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def table(rows: list[dict]) -> str:
    cols = ["total"] + [c for c, _ in COLUMNS]
    out = ["| variant | role | regs | spills (st/ld B) | " + " | ".join(cols) + " |",
           "|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        for role, c in list(r["per_role"].items()) + [("ALL", r["totals"])]:
            out.append(f"| {r['name']} | {role} | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} | "
                       + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, help="JSON output (default bench/results/<date>_sass_profile_sm100a.json)")
    ap.add_argument("--names", help="comma-separated variant names (default: the whole default matrix)")
    ap.add_argument("--head-dim", help="D or D,DV: the default matrix's D = 128 variants at this head size instead "
                                       "(e.g. 256, 96, 192,128); --names then names those")
    ap.add_argument("--keep", type=Path, help="keep the PTX, logs and cubins here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    ptxas = find_ptxas()
    if ptxas is None:
        print("sass_profile: no ptxas found (PATH, $FA4GEN_PTXAS, CUDA toolkit or the nvidia-cuda-nvcc wheel)", file=sys.stderr)
        return 2
    if find_disassembler() is None:
        print("sass_profile: no nvdisasm found (PATH, CUDA toolkit or the nvidia-cuda-nvdisasm wheel)", file=sys.stderr)
        return 2
    cfgs = list(codegen.DEFAULT_MATRIX)
    if a.head_dim:
        d, _, dv = a.head_dim.partition(",")
        try:
            cfgs = [c.replace(head_dim=int(d), head_dim_v=int(dv or d)) for c in cfgs if c.head_dim == 128]
        except (ValueError, ConfigError) as e:
            print(f"sass_profile: --head-dim {a.head_dim}: {e}", file=sys.stderr)
            return 2
    if a.names:
        want = set(a.names.split(","))
        unknown = want - {c.name for c in cfgs}
        if unknown:
            print(f"sass_profile: not in the default matrix: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        cfgs = [c for c in cfgs if c.name in want]
    rows = []
    for i, cfg in enumerate(cfgs, 1):
        if not a.quiet:
            print(f"[{i}/{len(cfgs)}] {cfg.name}", file=sys.stderr, flush=True)
        rows.append(profile(cfg, a.keep))
    print(table(rows))
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%MZ}_sass_profile_sm100a.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": stamp.isoformat(timespec="seconds"), "command": "python3 -m bench.sass_profile " + " ".join(argv or sys.argv[1:]),
        "ptxas": str(ptxas), "ptxas_version": ptxas_version(ptxas), "disassembler": find_disassembler()[1][0],
        "note": "static counts (code size), per warp role by PTX line records; not executed on any GPU",
        "variants": rows}, indent=1) + "\n")
    if not a.quiet:
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
