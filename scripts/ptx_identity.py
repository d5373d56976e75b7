#!/usr/bin/env python3
"""Is the generated PTX unchanged against an earlier commit? Hashes both generators' PTX.

    python scripts/ptx_identity.py [BASE_COMMIT (default HEAD~1)]

Exports BASE_COMMIT with `git archive` into a temporary directory, renders the PTX of every
variant of both targets (D 64/128 x fp16/bf16 x causal x GQA 1, 2, 4, ..., 128 x emu_pairs default,
2, 0: 384 kernels; then varlen, KV cache with pages of 0/16/64/256 keys and the 192-row sm_90a tile at
GQA 1/4/6) with that tree and with this one, and lists the variants whose PTX differs.
The kernel name in the PTX header is masked: a tuned (non-default) config's name carries the
content hash, which covers the generator's sources and so changes with any edit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HASHER = r'''
import hashlib, itertools, json, sys
try:
    from fa4gen.spec.config import KernelConfig
    from fa4gen.render.kernels import build_sm90, build_sm100
except ImportError:  # a tree from before the stage folders (fa4gen/config.py; build_sm90/100 in lower/)
    from fa4gen.config import KernelConfig
    from fa4gen.lower.sm90 import build_sm90
    from fa4gen.lower.sm100 import build_sm100
out = {}
for arch, d, dt, c, g, e in itertools.product(("sm_90a", "sm_100a"), (64, 128), ("bf16", "fp16"), (False, True),
                                              (1, 2, 4, 8, 16, 32, 64, 128), (None, 2, 0)):
    cfg = KernelConfig(arch=arch, head_dim=d, dtype=dt, causal=c, gqa_ratio=g, emu_pairs=e)
    ptx, _ = (build_sm90 if arch == "sm_90a" else build_sm100)(cfg)
    out[f"{arch} d{d} {dt} {'causal' if c else 'noncausal'} gqa{g} emu_pairs={e}"] = \
        hashlib.sha256(ptx.replace(cfg.name, "NAME").encode()).hexdigest()
# the entry points and tile sizes: varlen, KV cache (contiguous and paged), 192-row sm_90a tiles
for arch, d, c, g, kind in itertools.product(("sm_90a", "sm_100a"), (64, 128), (False, True), (1, 4, 6),
                                             ("varlen", "kv0", "kv16", "kv64", "kv256", "m192")):
    if kind == "m192" and (arch != "sm_90a" or d != 64):
        continue
    extra = ({"varlen": True} if kind == "varlen" else {"block_m": 192} if kind == "m192" else
             {"kvcache": True, "page_size": int(kind[2:])})
    try:
        cfg = KernelConfig(arch=arch, head_dim=d, causal=c, gqa_ratio=g, **extra)
    except ValueError:
        continue
    ptx, _ = (build_sm90 if arch == "sm_90a" else build_sm100)(cfg)
    out[f"{arch} d{d} {'causal' if c else 'noncausal'} gqa{g} {kind}"] = \
        hashlib.sha256(ptx.replace(cfg.name, "NAME").encode()).hexdigest()
json.dump(out, sys.stdout)
'''


def hashes(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run([sys.executable, "-c", HASHER], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main(argv=None) -> int:
    base = (argv or sys.argv[1:] or ["HEAD~1"])[0]
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(["git", "archive", "-o", str(tar), base], cwd=ROOT, check=True)
        with tarfile.open(tar) as t:
            t.extractall(Path(tmp) / "base")
        old = hashes(Path(tmp) / "base")
    new = hashes(ROOT)
    differ = [k for k in old if old[k] != new.get(k)]
    print(f"{len(old)} variants compared against {base}: {len(differ)} differ"
          f" ({sum(k.startswith('sm_90a') for k in old)} sm_90a, {sum(k.startswith('sm_100a') for k in old)} sm_100a)")
    for k in differ:
        print("  differs:", k)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
