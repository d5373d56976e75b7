#!/usr/bin/env python3
"""A/B timing of this generator's sm_90a kernels against an earlier generator's, interleaved.

    python3 -m bench.ab --baseline DIR [--rounds 7] [--rep-ms 100] [--out FILE.json]

DIR holds the earlier kernels as `fa4gen build --arch sm_90a --out DIR` writes them
(<name>.cubin + <name>.json). For every shape of bench/attention.py's SHAPES (plus two with tails,
where the masks run on every row block's last K/V block) both kernels are called into preallocated
outputs on the same inputs, alternating A, B, A, B ... for `--rounds` rounds of triton's do_bench
(median of each round); the result per shape is the median over rounds of each and their ratio,
with the spread (min-max over rounds) so that noise is visible beside the difference. Outputs are
compared bit for bit (a generator change that must not alter results says so).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import D64_SHAPES, SHAPES, environment, interleaved_ms, shape_dtype, tflops  # noqa: E402

EXTRA = ((8, 2000, 16, 16, 128, False), (8, 2000, 16, 16, 128, True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--suite", choices=("main", "d64", "both"), default="main",
                    help="main: bench.attention SHAPES + two with tails; d64: D64_SHAPES; both")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    from fa4gen import api
    from fa4gen.config import KernelConfig
    from fa4gen.tiles import q_tile_rows

    if not torch.cuda.is_available():
        print("bench.ab: no CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    shapes = {"main": SHAPES + EXTRA, "d64": D64_SHAPES, "both": SHAPES + EXTRA + D64_SHAPES}[a.suite]
    for shape in shapes:
        b, s, hq, hkv, d, causal = shape[:6]
        dt_name = shape_dtype(shape, "bf16")
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt_name]
        cfg = KernelConfig(arch="sm_90a", head_dim=d, dtype=dt_name, causal=causal, gqa_ratio=hq // hkv,
                           block_m=q_tile_rows("sm_90a", d, hq // hkv, causal=causal, seqlen_q=s))  # fa4gen.attention's
        path = a.baseline / f"{cfg.name}.cubin"
        if not path.exists():
            print(f"  {shape}: no {path.name} in {a.baseline}, skipped", flush=True)
            continue
        gen = torch.Generator(device="cuda").manual_seed(99)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt, generator=gen) for h in (hq, hkv, hkv))
        new, _ = api.get_kernel(cfg, q.device)
        old = api.load(path).kernel
        o_new, o_old = torch.empty_like(q), torch.empty_like(q)
        sc = d ** -0.5
        fns = {"new": lambda: new(q, k, v, o_new, softmax_scale=sc), "old": lambda: old(q, k, v, o_old, softmax_scale=sc)}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = bool(torch.equal(o_new, o_old))
        timed = interleaved_ms(fns, a.rounds, 25, a.rep_ms)
        med = {n: t[0] for n, t in timed.items()}
        row = dict(shape=list(shape), name=cfg.name, outputs_bitwise_equal=same,
                   new_ms=med["new"], old_ms=med["old"],
                   new_tflops=round(tflops(b, hq, s, s, d, causal, med["new"]), 1),
                   old_tflops=round(tflops(b, hq, s, s, d, causal, med["old"]), 1),
                   ratio_new_over_old=round(med["old"] / med["new"], 4),
                   spread_new=list(timed["new"][1]), spread_old=list(timed["old"][1]))
        rows.append(row)
        print(f"  {shape}: new {row['new_tflops']} old {row['old_tflops']} TFLOP/s, new/old {row['ratio_new_over_old']}"
              f" (spread new {row['spread_new']}, old {row['spread_old']}), bitwise equal {same}", flush=True)
        del q, k, v, o_new, o_old
        torch.cuda.empty_cache()
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%M%SZ}_ab_sm90a.json"
    env = environment(["-m", "bench.ab", *(argv or sys.argv[1:])])
    out.write_text(json.dumps({**env, "baseline": str(a.baseline), "rounds": a.rounds, "rep_ms": a.rep_ms,
                               "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
