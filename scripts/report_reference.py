#!/usr/bin/env python3
"""Report the reference's two headline numbers: the exp2 emulation's error, and how often FA4's
conditional rescaling skips the O rescale (FA4's authors report about 90% skipped on real models).

    python3 scripts/report_reference.py [--seqlen 4096] [--heads 1] [--amps 1,2,3,4]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fa4gen.config import KernelConfig  # noqa: E402
from fa4gen.exp2 import EXP2_POLY, exp2_error_report  # noqa: E402
from fa4gen.reference import attention_exact, fa4_forward, round_to_dtype  # noqa: E402


def report_exp2() -> None:
    print("exp2 emulation, EXP2_POLY =", ", ".join(f"{c!r}" for c in EXP2_POLY))
    for lo, hi in ((-127.0, 0.0), (0.0, 8.0)):
        t = time.perf_counter()
        r = exp2_error_report(lo, hi)
        print(f"  x in [{lo:g}, {hi:g}]: max relative error {r.max_rel_error:.4e} at x = {r.argmax_x!r} "
              f"({r.points} fp32 points, {time.perf_counter() - t:.1f} s)")
        if lo < -126:
            print(f"    (relative error over x >= -126; x in [-127, -126) gives subnormal patterns with "
                  f"max absolute error {r.max_abs_error_subnormal:.3e} = 2^{math.log2(r.max_abs_error_subnormal):.1f})")
    print(f"  for scale: unit roundoff fp16 {2.0 ** -11:.3e}, bf16 {2.0 ** -8:.3e}")


def report_rescale(seqlen: int, heads: int, dtype: str, amps: list[float], seed: int, check: bool) -> None:
    d = 128
    cfg = KernelConfig(head_dim=d, dtype=dtype, causal=False)
    rng = np.random.default_rng(seed)
    base = [rng.standard_normal((1, seqlen, heads, d)) for _ in range(3)]
    print(f"\nconditional rescaling: B=1, S={seqlen}, H={heads}, D={d}, {dtype}, non-causal, "
          f"softmax_scale=1/sqrt(D), threshold {cfg.rescale_threshold:g}; q, k ~ amp * N(0, 1), v ~ N(0, 1)")
    for amp in amps:
        q, k = (round_to_dtype(x * amp, dtype) for x in base[:2])
        v = round_to_dtype(base[2], dtype)
        stats = {}
        t = time.perf_counter()
        o, lse = fa4_forward(q, k, v, cfg, stats=stats)
        dt = time.perf_counter() - t
        later = stats["later_row_block_updates"]
        line = (f"  amp {amp:g}: rescale skipped on {stats['rescale_skipped']}/{later} later (row, block) "
                f"updates = {stats['rescale_skipped'] / later:.2%} "
                f"(of all updates incl. first blocks: {stats['rescale_skipped'] / stats['row_block_updates']:.2%}); "
                f"warps skipping O rescale {1 - stats['warp_rescales'] / stats['warp_block_updates']:.2%}; "
                f"exp2 emulated {stats['exp2_emulated'] / (stats['exp2_emulated'] + stats['exp2_hardware']):.2%}; "
                f"{dt:.1f} s")
        if check:
            o_ex, lse_ex = attention_exact(q, k, v, False)
            line += (f"; vs exact: max |dO| {np.abs(o.astype(np.float64) - o_ex).max():.2e}, "
                     f"max |dLSE| {np.abs(lse - lse_ex).max():.2e}")
        print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    ap.add_argument("--amps", default="1,2,3,4", help="comma-separated q/k amplitudes (1 = N(0, 1))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the float64 exact comparison")
    ap.add_argument("--skip-exp2", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_exp2:
        report_exp2()
    report_rescale(args.seqlen, args.heads, args.dtype, [float(a) for a in args.amps.split(",")],
                   args.seed, not args.no_check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
