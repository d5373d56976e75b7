#!/usr/bin/env python3
"""Mutation testing of the evidence: generic one-line edits of a kernel's PTX (fa4gen/evidence/sweep.py),
each judged by `fa4gen check` and `fa4gen emulate` (default cases); prints per edit class how many
each tool killed and lists the survivors ptxas accepts (equivalent edits, or holes in the evidence).

    python3 scripts/mutation_sweep.py generated/fa4_sm90a_d128_bf16_causal_gqa1.ptx [--ops drop,swap]
        [--per-op 60 | --all] [--seed 0] [--jobs 2] [--lines A-B] [--both] [--json F] [--write-survivors DIR]

Exit 0 when no mutant survives, 1 when some do, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fa4gen.evidence import sweep  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ptx", type=Path, help="a PTX file with its build manifest (.json) beside it; with --replay, "
                    "an earlier sweep's --json file")
    ap.add_argument("--replay", action="store_true",
                    help="judge the survivors of an earlier sweep (PTX is its --json file) with the evidence as it is now")
    ap.add_argument("--ops", default=",".join(sweep.OPS), help=f"edit classes, of {','.join(sweep.OPS)}")
    ap.add_argument("--per-op", type=int, default=60, help="mutants sampled per class (seeded; default 60)")
    ap.add_argument("--all", action="store_true", help="every mutant of every class (slow: thousands)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--seeds", type=int, default=2, help="emulator seeds per shape (fa4gen emulate's default: 2)")
    ap.add_argument("--lines", default=None, help="only edit PTX lines A-B")
    ap.add_argument("--both", action="store_true", help="run emulate even on mutants check already rejected")
    ap.add_argument("--no-assemble", action="store_true", help="do not ask ptxas whether survivors assemble")
    ap.add_argument("--json", type=Path, default=None, help="write every verdict to this file")
    ap.add_argument("--write-survivors", type=Path, default=None,
                    help="write each survivor as PTX + manifest into this folder")
    ap.add_argument("--quiet", action="store_true", help="no per-mutant progress")
    a = ap.parse_args(argv)
    def progress(k, n, v):
        if not a.quiet:
            print(f"[{k}/{n}] {v.op} line {v.line}: {v.result} ({v.seconds:.1f} s)", file=sys.stderr, flush=True)

    if a.replay:
        import json

        res = sweep.replay(json.loads(a.ptx.read_text()), jobs=a.jobs, progress=progress)
        print(sweep.summary(res))
        if a.json:
            sweep.dump(res, a.json)
        return 1 if any(v["result"] == "survived" for v in res["verdicts"]) else 0
    ops = tuple(o for o in a.ops.split(",") if o)
    bad = [o for o in ops if o not in sweep.OPS]
    if bad or not a.ptx.exists() or not a.ptx.with_suffix(".json").exists():
        print(f"mutation_sweep: error: {'unknown ops ' + ','.join(bad) if bad else f'{a.ptx} or its .json is missing'}",
              file=sys.stderr)
        return 2
    lines = None
    if a.lines:
        lo, _, hi = a.lines.partition("-")
        lines = (int(lo), int(hi or lo))

    res = sweep.run_sweep(a.ptx, ops=ops, per_op=None if a.all else a.per_op, seed=a.seed, jobs=a.jobs,
                          seeds=a.seeds, both=a.both, assemble=not a.no_assemble, lines=lines, progress=progress)
    print(sweep.summary(res))
    if a.json:
        sweep.dump(res, a.json)
    if a.write_survivors:
        for p in sweep.write_survivors(res, a.ptx, a.write_survivors):
            print(f"wrote {p}")
    return 1 if any(v["result"] == "survived" for v in res["verdicts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
