#!/usr/bin/env python3
"""Which paths of each kernel the default `fa4gen emulate` takes: per variant and entry, the basic
blocks reached and the guarded branches seen both ways, with every block and branch direction not
reached (PTX lines), as a markdown report.

    python3 scripts/coverage_report.py [--set golden|matrix] [--seeds N] [--jobs J] [--out FILE.md]

--set golden (default): the checked-in generated/ files (both targets, dense, varlen, KV cache, both
sm_90a tiles). --set matrix: a build matrix of both targets (D 64/128 x causal x GQA 1/4, dense,
varlen, KV cache paged and contiguous, both sm_90a tiles), built here. Each variant runs exactly as
`fa4gen emulate FILE` runs it (default shapes, seeds 0..N-1).
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _matrix():
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    out = []
    for arch in ("sm_100a", "sm_90a"):
        for d in (64, 128):
            for causal in (False, True):
                for g in (1, 4):
                    base = dict(arch=arch, head_dim=d, causal=causal, gqa_ratio=g, dtype="bf16")
                    out.append(KernelConfig(**base, block_m=q_tile_rows(arch, d, g)))
                    if arch == "sm_90a" and d == 64:
                        out.append(KernelConfig(**base))  # the 128-row tile beside the 192-row default
                    out.append(KernelConfig(**base, varlen=True))
                    out.append(KernelConfig(**base, kvcache=True, page_size=64 if g == 4 else 0))
    return out


def _one(job):
    name, ptx, man, seeds = job
    from fa4gen.evidence.ptxemu.harness import emulate_file

    t0 = time.perf_counter()
    rep = emulate_file(Path(name + ".ptx"), ptx_text=ptx, manifest=man, seeds=seeds)
    return name, rep.ok, rep.coverage.as_dict(), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("golden", "matrix"), default="golden")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per shape, as `fa4gen emulate` (default 2)")
    ap.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here (default: stdout)")
    a = ap.parse_args(argv)
    import json

    jobs = []
    if a.set == "golden":
        for p in sorted((ROOT / "generated").glob("*.ptx")):
            jobs.append((p.stem, p.read_text(), json.loads(p.with_suffix(".json").read_text()), a.seeds))
    else:
        from fa4gen import codegen

        for cfg in _matrix():
            res = codegen.build(cfg, emit=("ptx",), verify=False)
            jobs.append((cfg.name, res.ptx, res.manifest, a.seeds))
    rows, details = [], []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for i, (name, ok, cov, s) in enumerate(ex.map(_one, jobs), 1):
            print(f"[{i}/{len(jobs)}] {name}: {'pass' if ok else 'FAIL'} ({s:.1f} s)", file=sys.stderr)
            for entry, c in cov.items():
                hb, nb = c["blocks"]
                hd, nd = c["branches_both_ways"]
                rows.append(f"| {name} | {entry} | {'pass' if ok else 'FAIL'} | {hb}/{nb} | {hd}/{nd} |")
                if c["unreached"] or c["one_way"]:
                    details.append(f"- **{name}** `{entry}`:")
                    details += [f"  - block {u['label'] or '(unlabelled)'} (PTX lines {u['lines'][0]}-{u['lines'][1]}) "
                                "not reached" for u in c["unreached"]]
                    word = {0: "never ran", 1: "always taken", 2: "never taken"}
                    details += [f"  - branch at PTX line {o['line']}: {word[o['bits']]}" for o in c["one_way"]]
    text = "\n".join([
        f"# Coverage of the default `fa4gen emulate` ({a.set}, {a.seeds} seeds per shape)", "",
        f"`python3 scripts/coverage_report.py --set {a.set} --seeds {a.seeds}`; {len(jobs)} variants, "
        f"{time.perf_counter() - t0:.0f} s on {a.jobs} processes.", "",
        "| variant | entry | verdict | basic blocks reached | guarded branches both ways |",
        "|---|---|---|---|---|", *rows, "", "## Not reached", "", *(details or ["(nothing)"]), ""])
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
