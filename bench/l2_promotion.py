#!/usr/bin/env python3
"""TMA L2 promotion probe on the GPU machine: every tensor map of every launch forced to one promotion
mode (none, 64B, 128B, 256B), decode and prefill timed under it, one process per mode.

    for p in 256B 128B none 64B 256B 128B none 64B; do python3 -m bench.l2_promotion $p; done

Prints one JSON line per process: decode {B}x{L} = (us per call from CUDA-graph replays of 20 calls,
no L2 flush (bench.decode_combine.graph_us), TB/s of the K/V bytes, cuDNN's us (at 256B only: cuDNN
does not read our maps)); prefill = fa4gen.attention TFLOP/s (triton do_bench median). Hq/Hkv 32/8 D 128
decode; prefill shapes below. The rule this measured is fa4gen.spec.plan.tma_l2_promotion.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DECODE = ((64, 4096), (33, 32768), (1, 32768), (8, 32768))
PREFILL = ((2, 8192, 16, 128, False), (1, 32768, 16, 128, True), (4, 4096, 32, 64, False), (1, 16384, 32, 64, True))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    from fa4gen.runtime import api, runtime
    from fa4gen.spec.plan import TMA_L2_PROMOTIONS

    mode = argv[0]
    if mode not in TMA_L2_PROMOTIONS:
        print(f"bench.l2_promotion: {mode!r} is not one of {', '.join(TMA_L2_PROMOTIONS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.l2_promotion: no CUDA GPU", file=sys.stderr)
        return 2
    runtime.map_l2_promotion = lambda role, spec, kvcache: mode  # every map the runtime encodes from here on
    from triton.testing import do_bench

    from bench.decode_combine import cache, cudnn_us, graph_us

    out = {"l2_promotion": mode}
    for B, L in DECODE:
        q, kc, vc, sl, gb = cache(torch, B, L)
        api.attention_with_kvcache(q, kc, vc, sl)
        us = graph_us(torch, lambda: api.attention_with_kvcache(q, kc, vc, sl))
        cu = cudnn_us(torch, q, kc, vc) if mode == "256B" else float("nan")
        out[f"decode {B}x{L}"] = (round(us, 2), round(gb / us * 1e3, 3), round(cu, 2))
        del q, kc, vc
        torch.cuda.empty_cache()
    for b, s, h, d, causal in PREFILL:
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        api.attention(q, k, v, causal=causal)
        ms = do_bench(lambda: api.attention(q, k, v, causal=causal), warmup=25, rep=100, return_mode="median")
        out[f"prefill {b}x{s} h{h} d{d}{' causal' if causal else ''}"] = round(
            4 * b * h * s * s * d * (0.5 if causal else 1) / ms / 1e9, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
