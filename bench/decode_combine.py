#!/usr/bin/env python3
"""GPU time of split decode on the GPU machine: fa4gen's KV-cache kernel alone, with its fa4_combine, and
cuDNN (SDPA) in the same run; then a num_splits sweep of the whole call.

    python3 -m bench.decode_combine [--sweep] [--out FILE.txt]
    ncu --launch-skip 2 --launch-count 1 --kernel-name regex:fa4_fwd ... python3 -m bench.decode_combine --one 64,4096

Each figure is the median per call of CUDA-graph replays of 20 calls (no L2 flush: at B x L >= 32k the
K/V bytes exceed the L2). Hq/Hkv 32/8, D 128, bf16, every sequence holding L keys, Sq 1. "kernel
alone" runs the API's fast-path Bound of fa4_fwd without the combine (its output is then the
partials only): the difference is what the combine's launch and merge cost. TB/s = K + V bytes over
the time. --sweep times the whole call at num_splits 0 (the rule's choice) and fixed counts. --one B,L makes
three eager calls of fa4gen and of cuDNN at that shape and nothing else (a target for ncu).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096))
SWEEP_SHAPES = ((1, 1024), (1, 2048), (1, 4096), (2, 4096), (1, 8192), (1, 32768), (1, 131072), (8, 32768))
SWEEP_SPLITS = (0, 2, 4, 8, 12, 16, 24, 33, 48, 66)


def graph_us(torch, fn, reps: int = 20, rounds: int = 15) -> float:
    """us per call of fn replayed from a CUDA graph of `reps` calls (bench.attention.capture_graph):
    the median over `rounds` replays timed with CUDA events."""
    from bench.attention import capture_graph

    g = capture_graph(torch, fn, reps)
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(ts)


def cache(torch, B: int, L: int):
    dt = torch.bfloat16
    q = torch.randn(B, 1, 32, 128, device="cuda", dtype=dt)
    kc = torch.randn(B, L, 8, 128, device="cuda", dtype=dt)
    vc = torch.randn(B, L, 8, 128, device="cuda", dtype=dt)
    sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, kc, vc, sl, 2 * B * L * 8 * 128 * 2 / 1e9


def cudnn_us(torch, q, kc, vc) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, kc, vc))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        try:
            return graph_us(torch, lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        except Exception:  # noqa: BLE001 - a shape cuDNN refuses is a missing figure
            return float("nan")


def split_costs(torch, api, launch, say) -> None:
    for B, L in SHAPES:
        q, kc, vc, sl, gb = cache(torch, B, L)
        api.attention_with_kvcache(q, kc, vc, sl)
        api.attention_with_kvcache(q, kc, vc, sl)  # the fast path's entry exists from the second call
        fast = next(f for f in launch._fasts._d.values() if f.problem.batch == B and f.problem.capacity == L)
        main = fast.run.args[0][0] if hasattr(fast.run, "args") else None
        o = torch.empty(B, 1, 32, 128, device="cuda", dtype=q.dtype)
        ws = torch.empty(max(fast.ws_elems, 1), device="cuda", dtype=torch.float32)
        ptrs = launch.out_ptrs(launch.kvcache_ptrs(q, kc, vc, sl, None, None), o, None)
        ptrs["o_partial"], ptrs["lse_partial"] = ws.data_ptr(), ws.data_ptr() + fast.lse_offset
        both = graph_us(torch, lambda: fast.run(ptrs))
        alone = graph_us(torch, lambda: main.run(ptrs)) if main is not None else float("nan")
        S = main._vals[main.entry.params.index("num_splits")] if main is not None else 0
        cud = cudnn_us(torch, q, kc, vc)
        say(f"B {B} L {L} S {S}: kernel+combine {both:.2f} us ({gb / both * 1e3:.2f} TB/s), kernel alone {alone:.2f} us, "
            f"combine {both - alone:.2f} us; cuDNN {cud:.2f} us ({gb / cud * 1e3:.2f} TB/s)")
        del q, kc, vc
        torch.cuda.empty_cache()


def sweep(torch, api, say) -> None:
    for B, L in SWEEP_SHAPES:
        q, kc, vc, sl, gb = cache(torch, B, L)
        row = []
        for S in SWEEP_SPLITS:
            us = graph_us(torch, lambda: api.attention_with_kvcache(q, kc, vc, sl, num_splits=S))
            row.append(f"S={S or 'auto'}: {us:.1f} us {gb / us * 1e3:.2f} TB/s")
        say(f"sweep B {B} L {L}: " + "; ".join(row) + f"; cuDNN {cudnn_us(torch, q, kc, vc):.1f} us")
        del q, kc, vc
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time the whole call over num_splits")
    ap.add_argument("--out", type=Path, help="also write the lines to this file")
    ap.add_argument("--one", metavar="B,L", help="only three eager calls of fa4gen and cuDNN at B x L (for ncu)")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.decode_combine: no CUDA GPU", file=sys.stderr)
        return 2
    from fa4gen.runtime import api, launch

    if a.one:
        B, L = (int(x) for x in a.one.split(","))
        q, kc, vc, sl, _ = cache(torch, B, L)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (x.transpose(1, 2) for x in (q, kc, vc))
        with torch.no_grad():
            for _ in range(3):
                api.attention_with_kvcache(q, kc, vc, sl)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        torch.cuda.synchronize()
        return 0

    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    with torch.no_grad():
        split_costs(torch, api, launch, say)
        if a.sweep:
            sweep(torch, api, say)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
