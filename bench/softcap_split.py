#!/usr/bin/env python3
"""Softcap kernels with part of exp2 on the FMA cubic (emu_pairs), against the plain causal kernel.

    python3 -m bench.softcap_split OUT.json

B 2, S 8192, 32/8 heads, D 128, causal, softcap 50 (bench.scoremods's overhead shape): the softcap
kernel with emu_pairs 0-4 (exponentials per 16 moved from MUFU to the FMA pipe; emu_start 0 or 1),
interleaved with the plain kernel (bench.attention.interleaved_ms, 5 rounds); prints each one's time
over the plain kernel's and how far its output is from emu_pairs 0's. bench/README.md "Softcap's cost".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import interleaved_ms  # noqa: E402

SPLITS = ((0, None), (1, 0), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1))  # (emu_pairs, emu_start)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    from fa4gen.runtime import api
    from fa4gen.runtime.validate import ScoreMods
    from fa4gen.spec.config import KernelConfig

    torch.manual_seed(0)
    b, s, hq, hkv, d = 2, 8192, 32, 8, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mods = ScoreMods(window_right=0, causal=True, softcap=50.0)
    fns, outs = {}, {}
    plain, _ = api.get_kernel(KernelConfig(arch="sm_90a", causal=True, gqa_ratio=4))
    o_plain = torch.empty_like(q)
    fns["plain"] = lambda: plain(q, k, v, o_plain)
    for e, st in SPLITS:
        kern, _ = api.get_kernel(KernelConfig(arch="sm_90a", causal=True, gqa_ratio=4, softcap=True, emu_pairs=e,
                                              emu_start=st))
        o = torch.empty_like(q)
        outs[(e, st)] = o
        fns[f"cap_e{e}_s{st}"] = (lambda kern=kern, o=o: kern(q, k, v, o, mods=mods))
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    ref = outs[(0, None)].float()
    for key, o in outs.items():
        print(key, "max |O - O(emu_pairs 0)|", (o.float() - ref).abs().max().item())
    t = interleaved_ms(fns, 5, 25, 100)
    base = t["plain"][0]
    for n, (ms, sp) in t.items():
        print(f"{n:14s} {ms:.4f} ms  x{ms / base:.3f} of plain  spread {sp}")
    Path(args[0]).write_text(json.dumps({n: [ms, sp] for n, (ms, sp) in t.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
