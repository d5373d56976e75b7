#!/usr/bin/env python3
"""Two kernels' ncu profiles side by side: where one's warps wait that the other's do not.

    python3 -m bench.ncu_compare A_raw.csv B_raw.csv [--sass A_sass.csv B_sass.csv] [--names a,b]
                                 [--top 22] [--out FILE.txt]

Inputs are ncu exports of one profiled launch each (`ncu --set full -o NAME ...`, then
`ncu --import NAME.ncu-rep --page raw --csv` and, for the per-opcode table,
`ncu --import NAME.ncu-rep --page source --csv --print-source sass`); scripts/ncu_sm90_vs_peer.sh
makes them for fa4gen's sm_90a kernel and FA4-CuTe's at one shape. Printed:
- the warp-state ratios (smsp__average_warps_issue_stalled_<reason>_per_issue_active: cycles a warp
  spends in each state per issued instruction; their sum is the warp cycles per issued instruction),
  with the elapsed cycles, executed instructions and each pipe's share of its peak;
- with --sass, per opcode (the SASS mnemonic's base, e.g. FADD, MUFU) the executed instructions and the
  warp-state samples by reason: which instructions carry the stalls.
Reads files only (no GPU, no ncu): bench/results/2026-12-04_NVIDIA-H200_ncu_d64_vs_fa4cute.txt was made
with it.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.sass_loop_sm90 import base_opcode, split_instruction  # noqa: E402

STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE = re.compile(r"^sm__inst_executed_pipe_(\w+)\.avg\.pct_of_peak_sustained_active$")
TOTALS = (("sm__cycles_elapsed.max", "elapsed cycles"), ("smsp__inst_executed.sum", "instructions executed"))
SASS_COLUMNS = ("stall_wait", "stall_math", "stall_mio", "stall_short_sb", "stall_long_sb", "stall_barrier",
                "stall_dispatch", "stall_selected", "stall_not_selected")


class NcuCsvError(ValueError):
    """An export that is not what the reader expects (says which file and why)."""


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_raw(path: Path) -> dict[str, float]:
    """metric -> value of the first kernel in an `ncu --page raw --csv` export (header, units, values)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise NcuCsvError(f"{path}: not an `ncu --page raw --csv` export (a header, a units row, a kernel row)")
    return {name: _number(value) for name, value in zip(rows[0], rows[2])}


def raw_summary(raw: dict[str, float]) -> dict:
    return {"stalls": {m.group(1): v for k, v in raw.items() if (m := STALL.match(k))},
            "pipes": {m.group(1): v for k, v in raw.items() if (m := PIPE.match(k))},
            "totals": {label: raw[k] for k, label in TOTALS if k in raw}}


def read_sass(path: Path) -> dict[str, collections.Counter]:
    """opcode -> Counter(inst, samples, stall_<reason>...) of an `ncu --page source --csv --print-source
    sass` export (a "Kernel Name" line, then the per-instruction table)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Source" in r and "# Samples" in r), None)
    if head is None:
        raise NcuCsvError(f"{path}: no per-instruction table (Source, # Samples columns): export it with "
                          f"--page source --csv --print-source sass")
    cols = rows[head]
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows[head + 1:]:
        if len(r) != len(cols):
            continue
        row = dict(zip(cols, r))
        op = base_opcode(split_instruction(row["Source"])[0])
        if not op:
            continue
        c = out[op]
        c["inst"] += _number(row.get("Instructions Executed", "0"))
        c["samples"] += _number(row.get("# Samples", "0"))
        for name, value in row.items():
            if name.startswith("stall_") and "Not Issued" not in name:
                c[name] += _number(value)
    return out


def format_raw(names, summaries) -> list[str]:
    lines = ["warp cycles per issued instruction by state (smsp__average_warps_issue_stalled_*_per_issue_active):",
             f"{'state':24s} " + " ".join(f"{n:>12s}" for n in names)]
    reasons = sorted({r for s in summaries for r in s["stalls"]})
    for r in reasons:
        vals = [s["stalls"].get(r, 0.0) for s in summaries]
        if max(vals) >= 0.01:
            lines.append(f"{r:24s} " + " ".join(f"{v:12.3f}" for v in vals))
    lines.append(f"{'sum':24s} " + " ".join(f"{sum(s['stalls'].values()):12.3f}" for s in summaries))
    for _, label in TOTALS:
        if all(label in s["totals"] for s in summaries):
            lines.append(f"{label:24s} " + " ".join(f"{s['totals'][label]:12.0f}" for s in summaries))
    lines.append("pipe activity, % of peak (sm__inst_executed_pipe_*):")
    for p in sorted({p for s in summaries for p in s["pipes"]}):
        vals = [s["pipes"].get(p, 0.0) for s in summaries]
        if max(vals) >= 0.5:
            lines.append(f"{p:24s} " + " ".join(f"{v:12.2f}" for v in vals))
    return lines


def format_sass(name: str, table: dict[str, collections.Counter], top: int) -> list[str]:
    total = sum(c["samples"] for c in table.values())
    lines = [f"{name}: {total:.0f} warp-state samples; per opcode (executed instructions in millions, samples, "
             f"then samples by state):",
             f"{'op':10s} {'inst(M)':>8s} {'samples':>8s} " + " ".join(f"{c[6:]:>9s}" for c in SASS_COLUMNS)]
    for op, c in sorted(table.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        lines.append(f"{op:10s} {c['inst'] / 1e6:8.2f} {c['samples']:8.0f} "
                     + " ".join(f"{c[col]:9.0f}" for col in SASS_COLUMNS))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="+", type=Path, help="`--page raw --csv` exports, one per kernel")
    ap.add_argument("--sass", nargs="*", type=Path, default=[],
                    help="`--page source --csv --print-source sass` exports, in the same order")
    ap.add_argument("--names", default="", help="comma-separated column names (default: the file names)")
    ap.add_argument("--top", type=int, default=22, help="opcodes per kernel in the per-opcode table (default 22)")
    ap.add_argument("--out", type=Path, help="also write the report here")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.names.split(",")] if a.names else [p.stem for p in a.raw]
    if len(names) != len(a.raw) or (a.sass and len(a.sass) != len(a.raw)):
        ap.error("give as many --names and --sass files as raw exports")
    try:
        lines = format_raw(names, [raw_summary(read_raw(p)) for p in a.raw])
        for name, path in zip(names, a.sass):
            lines += [""] + format_sass(name, read_sass(path), a.top)
    except (OSError, NcuCsvError) as e:
        print(f"bench.ncu_compare: {e}", file=sys.stderr)
        return 2
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
