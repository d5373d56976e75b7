#!/usr/bin/env python3
"""Regenerate generated/, the review matrix of both targets, as <name>.ptx + <name>.json.

    python scripts/regen_generated.py [--out DIR] [--no-assemble]

The variants are fa4gen.codegen.GENERATED_MATRIX: DEFAULT_MATRIX (sm_100a), the sm_90a review variants
(SM90_REVIEW_CONFIG, SM90_WIDE_REVIEW_CONFIG) and a varlen and a KV-cache variant of each target. Each goes through the whole chain (fa4gen.codegen.build: IR, verify,
lower, render and, when ptxas is available, assembly for its target, whose resource report lands in
the .json). The
cubins are not checked in. tests/test_sm100_emit.py regenerates into a temporary directory and
diffs against the checked-in files, so a generator change that alters the PTX must come with a
regenerated generated/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa4gen import codegen  # noqa: E402
from fa4gen.assemble.assemble import find_ptxas  # noqa: E402


def progress(done: int, total: int, label: str, width: int = 24) -> None:
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def regenerate(out_dir: Path, assemble: bool = True, quiet: bool = False) -> list[Path]:
    """Write GENERATED_MATRIX into out_dir; returns the files written (.ptx and .json only)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    emit = ("ptx", "cubin") if assemble else ("ptx",)
    written = []
    cfgs = codegen.GENERATED_MATRIX
    for i, cfg in enumerate(cfgs):
        if not quiet:
            progress(i, len(cfgs), cfg.name)
        res = codegen.build(cfg, out_dir=out_dir, emit=emit)
        for p in res.files:
            if p.suffix == ".cubin":
                p.unlink()  # reviewers read PTX; cubins are rebuilt, never checked in
            else:
                written.append(p)
    if not quiet:
        progress(len(cfgs), len(cfgs), "done")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "generated")
    ap.add_argument("--no-assemble", action="store_true", help="skip ptxas (the .json then has no assembler section)")
    args = ap.parse_args(argv)
    assemble = not args.no_assemble
    if assemble and find_ptxas() is None:
        print("regen_generated: no ptxas found; writing PTX and manifests without assembling", file=sys.stderr)
        assemble = False
    t = time.perf_counter()
    files = regenerate(args.out, assemble=assemble)
    print(f"wrote {len(files)} files to {args.out} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
