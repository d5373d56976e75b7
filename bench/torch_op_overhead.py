"""Host cost of routing `fa4gen.attention` through the custom op (fa4gen/runtime/torch_ops.py) instead of
calling the eager path directly: the eager body is replaced by a stand-in returning preallocated
tensors, so only the dispatch differs. Runs on CPU (torch needed, no GPU).

    python3 -m bench.torch_op_overhead [--calls N]

Measured 2026-12-02 on the CPU machine (2 cores, noisy), torch 2.13.0+cpu, five runs: direct
0.3-1.0 us, through the op 13-40 us a call (custom_op's Python wrapper and the dispatcher), which is
why eager calls skip the op and only compiled code uses it.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/torch_op_overhead.py` from anywhere
    sys.path.insert(0, str(ROOT))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="timed calls per measurement")
    n = ap.parse_args(argv).calls
    import torch


    from fa4gen.runtime import api, launch, torch_ops

    q = torch.randn(2, 100, 8, 64, dtype=torch.float16)
    o, lse = torch.empty_like(q), torch.empty(2, 8, 100)

    def stand_in(torch, q, k, v, causal, s, rl, check_grad=True):
        return (o, lse) if rl else o

    launch.attention_eager = stand_in  # the eager path both callers reach

    def per_call_us(fn):
        for _ in range(1000):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    with torch.no_grad():
        for rl in (False, True):
            d = per_call_us(lambda: api.attention(q, q, q, causal=True, return_lse=rl))
            p = per_call_us(lambda: torch_ops.attention(q, q, q, causal=True, return_lse=rl))
            print(f"return_lse={rl}: direct {d:.1f} us, through the op {p:.1f} us, overhead {p - d:.1f} us a call")


if __name__ == "__main__":
    main()
