"""Causal sm_90a kernel time against the l2_group launch parameter, on one GPU (H100/H200).

    python3 -m bench.l2_group [--out results.json]

For each shape: the runtime's choice (fa4gen.spec.schedule.choose_l2_group), one section (= B*Hkv, the
order before L2 sections) and a few section sizes around the L2 budget, each timed twice in
alternation (triton do_bench median, L2 flushed between runs) so run-to-run noise shows beside the
differences. Every l2_group must give bit-identical O (order moves tasks, never changes them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (B, S, Hq, Hkv, D): bench/attention.py's causal rows, then two with many (batch, kv_head) pairs
SHAPES = ((16, 1024, 16, 16, 128), (2, 8192, 16, 16, 128), (2, 8192, 32, 8, 128), (4, 4096, 32, 32, 64),
          (8, 2048, 16, 16, 128), (64, 1024, 16, 16, 64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench

    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig

    rows = []
    for b, s, hq, hkv, d in SHAPES:
        cfg = KernelConfig(arch="sm_90a", head_dim=d, causal=True, gqa_ratio=hq // hkv, dtype="bf16")
        kernel, _ = api.get_kernel(cfg, torch.device("cuda"))
        gen = torch.Generator(device="cuda").manual_seed(1234)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (hq, hkv, hkv))
        choice = kernel.l2_group(b, hkv, s, s, d, 2)
        nbh = b * hkv
        values = [nbh, choice.l2_group, choice.budget, max(choice.budget // 2, 1)]
        values = list(dict.fromkeys(v for v in values if 1 <= v <= nbh))
        flop = 4.0 * b * hq * s * s * d * 0.5
        times = {g: [] for g in values}
        outs = {}
        with torch.no_grad():
            for _ in range(2):
                for g in values:
                    o = torch.empty_like(q)
                    kernel(q, k, v, o, softmax_scale=d ** -0.5, l2_group=g)
                    torch.cuda.synchronize()
                    outs.setdefault(g, o)
                    times[g].append(do_bench(lambda g=g, o=o: kernel(q, k, v, o, softmax_scale=d ** -0.5, l2_group=g),
                                             warmup=25, rep=100, return_mode="median"))
        ref = outs[nbh]
        identical = {g: bool(torch.equal(o, ref)) for g, o in outs.items()}
        row = dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d, pairs=nbh, l2_bytes=kernel.l2_bytes, sm_count=kernel.sm_count,
                   choice=choice.l2_group, budget=choice.budget, reason=choice.reason,
                   ms={str(g): [round(t, 5) for t in ts] for g, ts in times.items()},
                   tflops={str(g): round(flop / (min(ts) * 1e-3) / 1e12, 1) for g, ts in times.items()},
                   bit_identical=identical)
        rows.append(row)
        cells = "  ".join(f"g={g}{'*' if g == choice.l2_group else ''}: {row['tflops'][str(g)]:.0f} "
                          f"({'/'.join(f'{t:.4f}' for t in times[g])} ms)" for g in values)
        print(f"{b}x{s} H{hq}/{hkv} d{d} pairs {nbh} budget {choice.budget} [{choice.reason}]  {cells}  "
              f"identical={all(identical.values())}", flush=True)
        del q, k, v, outs, ref
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(all(r["bit_identical"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
