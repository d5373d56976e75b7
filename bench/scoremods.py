#!/usr/bin/env python3
"""Sliding windows, softcap and sinks on the GPU: fa4gen against FA4-CuTe, in the same run.

    python3 -m bench.scoremods [--rounds 3] [--rep-ms 100] [--quick] [--parts window,overhead,decode]
                               [--out FILE.json]

1. Windows: causal prefill, B = 1, at S 8k / 32k / 128k (--quick: 8k / 32k) with window_size
   (W, 0) for W = 128 / 1024 / 4096, Mistral-like (32/8 heads, D 128) and gpt-oss-like (64/8, D 64),
   beside the plain causal kernel at the same S: a windowed call's time must scale with W, not S.
   TFLOP/s count the visible (query, key) pairs only.
2. Overhead of softcap 50, sinks and both against the plain causal kernel (B 2, S 8192, 32/8, D 128).
3. gpt-oss-like decode over a contiguous KV cache (Sq 1, 64/8, D 64, window (127, 0) + sinks), timed
   eagerly (host cost included: a 60-130 us call is host-bound) and from CUDA-graph replay with the L2
   flushed before each call (bench.kvcache's graph timer: the GPU time a serving loop with graphs sees).
Contenders alternate (bench.attention.interleaved_ms); FA4-CuTe is flash-attn-4's sm_90 path
(flash_attn.cute.interface) when scripts/fa4_peer.sh has brought it. cuDNN (SDPA) has no sliding window
or sink argument: a dense boolean mask would time another algorithm, so it is not a contender here.
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

from bench.attention import _median_ms, environment, interleaved_ms, load_fa4cute  # noqa: E402
from bench.kvcache import _graph_ms  # noqa: E402

MODELS = {"mistral": (32, 8, 128), "gpt-oss": (64, 8, 64)}
WINDOWS = (128, 1024, 4096)


def causal_window_pairs(s: int, w: int | None) -> int:
    """Visible (query, key) pairs of a causal self-attention of length s with window (w, 0)."""
    if w is None or w >= s:
        return s * (s + 1) // 2
    return (w + 1) * (w + 2) // 2 + (s - w - 1) * (w + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="S 8k and 32k only")
    ap.add_argument("--parts", default="window,overhead,decode",
                    help="which of the three parts to run, comma-separated (default: all)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    if not parts or parts - {"window", "overhead", "decode"}:
        ap.error(f"--parts: choose from window, overhead, decode (got {a.parts!r})")
    import torch

    import fa4gen

    if not torch.cuda.is_available():
        print("bench.scoremods: no CUDA GPU", file=sys.stderr)
        return 2
    fa4, info = load_fa4cute()
    print(f"fa4cute: {info.get('status')}", flush=True)
    rows = []

    def run(kind, label, fns, flop=None, **extra):
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        timed = interleaved_ms(fns, a.rounds, 25, a.rep_ms)
        row = dict(kind=kind, case=label, **extra)
        for name, (ms, spread) in timed.items():
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_spread"] = spread
            if flop:
                row[f"{name}_tflops"] = round(flop / (ms * 1e-3) / 1e12, 1)
        if "fa4cute_ms" in row:
            row["fa4gen_vs_fa4cute"] = round(row["fa4cute_ms"] / row["fa4gen_ms"], 3)
        rows.append(row)
        print(f"  {kind} {label}: " + ", ".join(f"{n} {row[f'{n}_ms'] * 1e3:.1f} us" for n in fns)
              + (f"  fa4gen/fa4cute {row['fa4gen_vs_fa4cute']}" if "fa4gen_vs_fa4cute" in row else ""), flush=True)
        return row

    def peer(fn):
        """The FA4-CuTe callable, or None with the reason in the row (a peer refusing a shape says why)."""
        if fa4 is None:
            return None
        try:
            fn()
            torch.cuda.synchronize()
            return fn
        except Exception as e:  # noqa: BLE001
            print(f"    fa4cute refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            return None

    gen = torch.Generator(device="cuda").manual_seed(7)
    dt = torch.bfloat16
    lengths = (8192, 32768) if a.quick else (8192, 32768, 131072)
    # 1. windows
    for model, (hq, hkv, d) in MODELS.items() if "window" in parts else ():
        for s in lengths:
            q = torch.randn(1, s, hq, d, device="cuda", dtype=dt, generator=gen)
            k = torch.randn(1, s, hkv, d, device="cuda", dtype=dt, generator=gen)
            v = torch.randn(1, s, hkv, d, device="cuda", dtype=dt, generator=gen)
            for w in (*WINDOWS, None):
                win = (w, 0) if w is not None else (-1, -1)
                fns = {"fa4gen": lambda win=win: fa4gen.attention(q, k, v, causal=True, window_size=win)}
                p = peer(lambda w=w: fa4(q, k, v, causal=True, window_size=(w, 0) if w is not None else (None, None)))
                if p is not None:
                    fns["fa4cute"] = p
                flop = 4.0 * causal_window_pairs(s, w) * hq * d
                run("window", f"{model} S {s} W {w if w is not None else 'full'}", fns, flop, model=model, seqlen=s,
                    window=w)
            q = k = v = None  # frees the inputs (the timed lambdas are done)
            torch.cuda.empty_cache()
    # 2. softcap / sinks overhead
    hq, hkv, d, b, s = 32, 8, 128, 2, 8192
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dt, generator=gen)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dt, generator=gen)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dt, generator=gen)
    z = torch.randn(hq, device="cuda", dtype=torch.float32, generator=gen)
    flop = 4.0 * b * causal_window_pairs(s, None) * hq * d
    for label, kw in (("plain", {}), ("softcap 50", dict(softcap=50.0)), ("sinks", dict(learnable_sink=z)),
                      ("softcap 50 + sinks", dict(softcap=50.0, learnable_sink=z))) if "overhead" in parts else ():
        fns = {"fa4gen": lambda kw=kw: fa4gen.attention(q, k, v, causal=True, **kw)}
        p = peer(lambda kw=kw: fa4(q, k, v, causal=True, **kw))
        if p is not None:
            fns["fa4cute"] = p
        run("overhead", label, fns, flop)
    q = k = v = None  # frees the inputs (the timed lambdas are done)
    torch.cuda.empty_cache()
    # 3. gpt-oss-like decode
    hq, hkv, d = MODELS["gpt-oss"]
    l2_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than the L2
    for b, length in ((1, 32768), (16, 8192)) if "decode" in parts else ():
        kc = torch.randn(b, length, hkv, d, device="cuda", dtype=dt, generator=gen)
        vc = torch.randn(b, length, hkv, d, device="cuda", dtype=dt, generator=gen)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt, generator=gen)
        seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        z = torch.randn(hq, device="cuda", dtype=torch.float32, generator=gen)
        fns = {"fa4gen": lambda: fa4gen.attention_with_kvcache(q, kc, vc, seqlens, causal=True, window_size=(127, 0),
                                                               learnable_sink=z)}
        p = peer(lambda: fa4(q, kc, vc, causal=True, window_size=(127, 0), learnable_sink=z))
        if p is not None:
            fns["fa4cute"] = p
        row = run("decode", f"gpt-oss B {b} cache {length} W 127 + sinks", fns, None, batch=b, cache_len=length)
        for name, f in fns.items():
            gms, why = _graph_ms(torch, f, 20, _median_ms, 25, a.rep_ms, l2_buf.zero_)
            row[f"{name}_graph_ms"] = round(gms, 5) if gms is not None else None
            if why:
                row[f"{name}_graph_note"] = why
        if row.get("fa4gen_graph_ms") and row.get("fa4cute_graph_ms"):
            row["fa4gen_vs_fa4cute_graph"] = round(row["fa4cute_graph_ms"] / row["fa4gen_graph_ms"], 3)
        print("    CUDA graph: " + ", ".join(f"{n} {row[f'{n}_graph_ms'] * 1e3:.1f} us" if row[f"{n}_graph_ms"] else
                                             f"{n} {row.get(f'{n}_graph_note')}" for n in fns)
              + (f"  fa4gen/fa4cute {row['fa4gen_vs_fa4cute_graph']}" if "fa4gen_vs_fa4cute_graph" in row else ""),
              flush=True)
        kc = vc = None
        torch.cuda.empty_cache()
    l2_buf = None
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%M%SZ}_scoremods.json"
    env = environment(["-m", "bench.scoremods", *(argv if argv is not None else sys.argv[1:])])
    out.write_text(json.dumps({**env, "fa4cute": info, "rounds": a.rounds, "rep_ms": a.rep_ms, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
