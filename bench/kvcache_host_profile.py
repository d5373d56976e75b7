#!/usr/bin/env python3
"""Host cost of one fa4gen.attention_with_kvcache call on the GPU machine: the per-call host time
(no sync) of the API and of Kernel.kvcache with preallocated buffers, and a cProfile of the API.

    python3 -m bench.kvcache_host_profile [--calls N]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    import torch

    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig

    b, length, hq, hkv, d = 1, 4096, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b * length // 64, 64, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.arange(b * length // 64, device="cuda", dtype=torch.int32).view(b, -1)
    sl = torch.full((b,), length, device="cuda", dtype=torch.int32)
    kern, _ = api.get_kernel(KernelConfig(arch="sm_90a", causal=True, gqa_ratio=4, kvcache=True, page_size=64))
    S = kern.kvcache_num_splits(b, hkv, 1, length)
    o = torch.empty_like(q)
    op = torch.empty(S, b * hq, d, device="cuda")
    lp = torch.empty(S, b * hq, device="cuda")

    def api_call():
        return api.attention_with_kvcache(q, kc, vc, sl, page_table=pt)

    def kernel_call():
        kern.kvcache(q, kc, vc, o, sl, pt, num_splits=S, o_partial=op, lse_partial=lp)

    for name, f in (("api", api_call), ("kernel", kernel_call)):
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name}: host {1e6 * (t1 - t0) / args.calls:.1f} us/call, with the GPU {1e6 * (t2 - t0) / args.calls:.1f} us/call "
              f"(splits {S})")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        api_call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
