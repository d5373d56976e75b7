#!/usr/bin/env python3
"""Host time per call on the GPU machine: every fa4gen entry point beside cuDNN (SDPA) and FA4-CuTe.

    python3 -m bench.host_time [--calls 400] [--profile] [--out FILE.json]

Small shapes (the GPU's work per call is a few microseconds, far below the host's), so that the
host's cost per call is what a loop of calls measures:
  host_us  - a loop of `calls` calls without a sync, over `calls` (the launch queue never fills:
             the GPU finishes each call faster than the host issues the next);
  total_us - the same loop up to its cuda synchronize, over `calls`.
Contenders: the public API (fa4gen.attention / attention_varlen / attention_with_kvcache), the
same kernel shipped as a prebuilt cubin (fa4gen.load, its __call__ / kvcache), the
loaded Kernel launched directly into preallocated outputs (the floor of the API: what a caller
that keeps its kernel and buffers pays), cuDNN through SDPA (dense cases), and FA4-CuTe's
flash_attn_func where scripts/fa4_peer.sh brought it. --profile adds a cProfile of each API case
(the top entries by own time) to the printout.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import _sdpa, environment, load_fa4cute  # noqa: E402


def per_call_us(torch, fn, calls: int) -> tuple[float, float]:
    """(host us per call, host + GPU us per call) of `calls` calls of fn, after a warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls


def profile_text(fn, calls: int, top: int = 18) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def prebuilt(api, launch):
    """The kernel of the last API call, built into a temporary folder and loaded as a prebuilt cubin."""
    import tempfile

    from fa4gen import codegen

    cfg = launch.config_for(api.last_call_info().problem)
    out = Path(tempfile.mkdtemp(prefix="fa4gen_prebuilt_"))
    codegen.build(cfg, emit=("cubin",), out_dir=out)
    return api.load(out / f"{cfg.name}.cubin")


def cases(torch, fa4):
    """(name, {contender: callable}) for each case."""
    from fa4gen.runtime import api, launch

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    out = []
    # 1. dense prefill, one small tile: 32/8 heads, D 128
    q, k, v = rnd(1, 128, 32, 128), rnd(1, 128, 8, 128), rnd(1, 128, 8, 128)
    o = torch.empty_like(q)
    fns = {"fa4gen_api": lambda: api.attention(q, k, v, causal=True)}
    api.attention(q, k, v, causal=True)
    kern, _ = launch.kernel_for(api.last_call_info().problem, q.device)
    fns["fa4gen_kernel"] = lambda: kern(q, k, v, o)
    pre = prebuilt(api, launch)
    fns["fa4gen_prebuilt"] = lambda: pre(q, k, v)
    fn, _, _ = _sdpa("cudnn", q, k, v, True)
    fns["cudnn"] = fn
    if fa4 is not None:
        fns["fa4cute"] = lambda: fa4(q, k, v, causal=True)
    out.append(("dense B1 S128 32/8 D128 causal", fns))
    # 2. the same with a window, softcap and sinks (gpt-oss / Gemma-style modifiers)
    z = torch.randn(32, device=dev, dtype=torch.float32, generator=g)
    kw = dict(causal=True, window_size=(64, 0), softcap=30.0, learnable_sink=z)
    fns = {"fa4gen_api": lambda: api.attention(q, k, v, **kw)}
    if fa4 is not None:
        fns["fa4cute"] = lambda: fa4(q, k, v, **kw)
    out.append(("dense B1 S128 32/8 D128 causal window 64 softcap 30 sinks", fns))
    # 3. varlen, four sequences
    lens = [100, 28, 64, 36]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
    tq = sum(lens)
    qv, kv_, vv = rnd(tq, 32, 128), rnd(tq, 8, 128), rnd(tq, 8, 128)
    fns = {"fa4gen_api": lambda: api.attention_varlen(qv, kv_, vv, cu, cu, max(lens), max(lens), causal=True)}
    out.append(("varlen 4 seqs (228 rows) 32/8 D128 causal", fns))
    # 4. decode over a contiguous cache, B 1 x 4k
    qd = rnd(1, 1, 32, 128)
    kc, vc = rnd(1, 4096, 8, 128), rnd(1, 4096, 8, 128)
    sl = torch.full((1,), 4096, device=dev, dtype=torch.int32)
    fns = {"fa4gen_api": lambda: api.attention_with_kvcache(qd, kc, vc, sl)}
    api.attention_with_kvcache(qd, kc, vc, sl)
    pre_d = prebuilt(api, launch)
    fns["fa4gen_prebuilt"] = lambda: pre_d.kvcache(qd, kc, vc, sl)
    fns["cudnn"] = _sdpa("cudnn", qd, kc, vc, False)[0]
    if fa4 is not None:
        fns["fa4cute"] = lambda: fa4(qd, kc, vc, causal=True)
    out.append(("decode B1 cache 4096 32/8 D128 contiguous", fns))
    # 5. decode over a paged cache (64-row pages)
    kp, vp = rnd(64, 64, 8, 128), rnd(64, 64, 8, 128)
    pt = torch.arange(64, device=dev, dtype=torch.int32).view(1, 64)
    fns = {"fa4gen_api": lambda: api.attention_with_kvcache(qd, kp, vp, sl, page_table=pt)}
    out.append(("decode B1 cache 4096 32/8 D128 paged 64", fns))
    # 6. gpt-oss-like decode: 64/8 heads, D 64, window (127, 0) + sinks
    qg = rnd(1, 1, 64, 64)
    kg, vg = rnd(1, 4096, 8, 64), rnd(1, 4096, 8, 64)
    zg = torch.randn(64, device=dev, dtype=torch.float32, generator=g)
    fns = {"fa4gen_api": lambda: api.attention_with_kvcache(qg, kg, vg, sl, window_size=(127, 0), learnable_sink=zg)}
    if fa4 is not None:
        fns["fa4cute"] = lambda: fa4(qg, kg, vg, causal=True, window_size=(127, 0), learnable_sink=zg)
    out.append(("decode B1 cache 4096 64/8 D64 window 127 sinks", fns))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each fa4gen API case")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.host_time: no CUDA GPU", file=sys.stderr)
        return 2
    fa4, info = load_fa4cute()
    print(f"fa4cute: {info.get('status')}", flush=True)
    rows = []
    with torch.no_grad():
        for name, fns in cases(torch, fa4):
            row = {"case": name}
            for who, fn in fns.items():
                try:
                    h, t = per_call_us(torch, fn, a.calls)
                except Exception as e:  # noqa: BLE001 - a peer refusing a case says why
                    row[f"{who}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    continue
                row[f"{who}_host_us"], row[f"{who}_total_us"] = round(h, 1), round(t, 1)
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{w} {row[f'{w}_host_us']} us" for w in fns if f"{w}_host_us" in row),
                  flush=True)
            if a.profile:
                print(profile_text(fns["fa4gen_api"], a.calls)[-5000:], flush=True)
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%M%SZ}_host_time.json"
    env = environment(["-m", "bench.host_time", *(argv if argv is not None else sys.argv[1:])])
    out.write_text(json.dumps({**env, "fa4cute": info, "calls": a.calls, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
