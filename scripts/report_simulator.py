#!/usr/bin/env python3
"""Simulator (executing the verified sm_100a programs) versus the NumPy reference: max differences.

    python scripts/report_simulator.py
"""

import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4gen import KernelConfig  # noqa: E402
from fa4gen.reference import fa4_forward, round_to_dtype  # noqa: E402
from fa4gen.simulate import simulate  # noqa: E402


def main():
    rng = np.random.default_rng(2026)
    worst_ulps, worst_lse, cases = 0.0, 0.0, 0
    print(f"{'variant':42s} {'Sq':>5s} {'Skv':>5s} {'seeds':>5s} {'max|dO|':>10s} {'ulps':>5s} {'max|dLSE|':>10s}")
    for causal, g, (sq, skv), d, dtype in itertools.product(
            (False, True), (1, 4, 16), ((256, 384), (200, 517)), (64, 128), ("fp16", "bf16")):
        cfg = KernelConfig(causal=causal, gqa_ratio=g, head_dim=d, dtype=dtype)
        np_dt = np.float16 if dtype == "fp16" else np.float32
        mk = lambda *s: round_to_dtype(rng.standard_normal(s), dtype).astype(np_dt)  # noqa: E731
        q, k, v = mk(1, sq, g, d), mk(1, skv, 1, d), mk(1, skv, 1, d)
        o_ref, lse_ref = fa4_forward(q, k, v, cfg)
        o_ref = o_ref.astype(np.float64)
        step = np.maximum(np.abs(o_ref), 2.0 ** -14) * (2.0 ** -10 if dtype == "fp16" else 2.0 ** -7)
        dmax = ulps = dl = 0.0
        for seed in range(3):
            res = simulate(cfg, q, k, v, seed=seed, num_ctas=2)
            assert not res.findings, res.findings
            diff = np.abs(res.o.astype(np.float64) - o_ref)
            dmax, ulps = max(dmax, diff.max()), max(ulps, (diff / step).max())
            fin = np.isfinite(lse_ref)
            dl = max(dl, float(np.abs(res.lse[fin] - lse_ref[fin]).max()) if fin.any() else 0.0)
            cases += 1
        worst_ulps, worst_lse = max(worst_ulps, ulps), max(worst_lse, dl)
        print(f"{cfg.name:42s} {sq:5d} {skv:5d} {3:5d} {dmax:10.3g} {ulps:5.2f} {dl:10.3g}")
    print(f"\n{cases} simulations: worst O difference {worst_ulps:.2f} output-dtype rounding steps, "
          f"worst LSE difference {worst_lse:.3g}")


if __name__ == "__main__":
    main()
