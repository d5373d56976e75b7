"""Sustained load, clocks and power (issue 27's D = 128 non-causal >= 700 TFLOP/s question): each
workload runs back to back for --seconds (launches queued without a host sync in between, so the GPU
never idles) while bench/gpu_clocks.py samples the SM clock, the power draw and the clock-event
reasons; then TFLOP/s over the whole span, the median clock and power inside it, and the dense FLOP
the workload retired per SM clock, as a share of the bf16 tensor peak per clock (4096 FLOP per SM
per clock on Hopper: 989 TFLOP/s at 1830 MHz x 132 SMs). That share does not depend on the clock,
so it separates "the kernel leaves the tensor pipe idle" from "the GPU runs at a lower clock".

    python3 -m bench.power_probe [--seconds 3] [--only fa4gen,cudnn,fa4cute,cublas] [--shape 2,8192,16,16,128[,1]] ...

Workloads: `fa4gen` (the loaded kernel into a preallocated output), `cudnn` (SDPA's cuDNN backend),
`fa4cute` (FA4-CuTe's flash_attn_func, when staged: scripts/fa4_peer.sh), each on every --shape (bf16;
fa4gen's Q tile as fa4gen.attention picks it); `cublas`, an 8192^3 bf16 matmul (torch.mm): the dense ceiling of the same chip. They run
in the order given, each after a 1 s idle, then again in reverse order (a second pass: heat and clock
drift fall on all). Writes bench/results/<UTC>_<gpu>_power_probe.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLOP_PER_CLOCK_PER_SM = 4096  # dense bf16 / fp16 wgmma on sm_90 (H100/H200 datasheet: 989.4 TFLOP/s, 1830 MHz)


def pipe_share(tflops: float, sm_mhz: float, sms: int) -> float | None:
    """The dense FLOP retired per SM clock as a share of the tensor peak per clock."""
    if not tflops or not sm_mhz or not sms:
        return None
    return tflops * 1e12 / (sm_mhz * 1e6 * sms * FLOP_PER_CLOCK_PER_SM)


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool]:
    """"B,S,Hq,Hkv,D[,causal]" -> (B, S, Hq, Hkv, D, causal)."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (5, 6) or min(parts[:5]) < 1 or parts[2] % parts[3]:
        raise ValueError(f"--shape {text!r}: B,S,Hq,Hkv,D[,causal] with Hq a multiple of Hkv")
    return (*parts[:5], bool(parts[5]) if len(parts) == 6 else False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained span per workload and pass (default 3)")
    ap.add_argument("--only", default="fa4gen,cudnn,fa4cute,cublas", help="workloads, in order")
    ap.add_argument("--shape", action="append", default=None,
                    help="B,S,Hq,Hkv,D[,causal] of the attention workloads, repeatable (default 2,8192,16,16,128); "
                         "a sixth field 1 makes it causal (FLOP count halved)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(x) for x in (args.shape or ["2,8192,16,16,128"])]
    except ValueError as e:
        ap.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("bench.power_probe: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    from bench.attention import _fa4cute, _sdpa, environment, load_fa4cute, sustained_ms
    from bench.gpu_clocks import GpuSampler
    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    env = environment(["-m", "bench.power_probe", *(argv if argv is not None else sys.argv[1:])])
    gen = torch.Generator(device="cuda").manual_seed(1234)
    work, notes = {}, {}
    names = [n for n in args.only.split(",") if n]
    f4 = None
    for (b, s, hq, hkv, d, causal) in shapes:
        label = f"{b}x{s}x{hq}/{hkv}xD{d}{'c' if causal else ''}"
        attn_flop = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (hq, hkv, hkv))
        for name in names:
            if name == "cublas":
                continue
            key = f"{name}@{label}"
            try:
                if name == "fa4gen":
                    g = hq // hkv
                    cfg = KernelConfig(arch="sm_90a", head_dim=d, gqa_ratio=g, causal=causal,
                                       block_m=q_tile_rows("sm_90a", d, g, causal=causal, seqlen_q=s))
                    kern, _ = api.get_kernel(cfg, q.device)
                    o = torch.empty_like(q)
                    work[key] = (lambda kern=kern, q=q, k=k, v=v, o=o, d=d: kern(q, k, v, o, softmax_scale=d ** -0.5),
                                 attn_flop)
                elif name == "cudnn":
                    fn, _, why = _sdpa("cudnn", q, k, v, causal)
                    if fn is None:
                        raise RuntimeError(why)
                    work[key] = (fn, attn_flop)
                elif name == "fa4cute":
                    if f4 is None:
                        f4, info = load_fa4cute()
                        if f4 is None:
                            raise RuntimeError(info["status"])
                    fn, _, _ = _fa4cute(f4, q, k, v, causal)
                    work[key] = (fn, attn_flop)
                else:
                    raise ValueError(f"unknown workload {name!r} (fa4gen, cudnn, fa4cute, cublas)")
            except Exception as e:  # noqa: BLE001 - a missing peer loses its row, not the run
                notes[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"  {key}: {notes[key]}", flush=True)
    if "cublas" in names:
        n = 8192
        a_, b_ = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        c_ = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        work["cublas"] = (lambda a_=a_, b_=b_, c_=c_: torch.mm(a_, b_, out=c_), 2.0 * n ** 3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    sampler = GpuSampler()
    if not sampler.start():
        print(f"  clocks: {sampler.why}", flush=True)
    try:
        order = list(work)
        for pas, seq in enumerate((order, order[::-1])):
            for name in seq:
                fn, flop = work[name]
                time.sleep(1.0)  # the same idle before each workload
                with sampler.window(f"{pas}:{name}"):
                    ms = sustained_ms(fn, args.seconds)
                tf = flop / (ms * 1e-3) / 1e12
                rows.append({"pass": pas, "name": name, "ms_per_call": round(ms, 4), "tflops": round(tf, 1)})
                print(f"  pass {pas} {name}: {tf:.1f} TFLOP/s over {args.seconds:g} s", flush=True)
    finally:
        time.sleep(0.3)
        sampler.stop()
    summ = sampler.summary()
    for r in rows:
        c = summ.get(f"{r['pass']}:{r['name']}", {"samples": 0})
        r["clocks"] = c
        share = pipe_share(r["tflops"], c.get("sm_mhz"), sms)
        r["tensor_share_per_clock"] = round(share, 4) if share else None
        print(f"  pass {r['pass']} {r['name']}: {r['tflops']} TFLOP/s at {c.get('sm_mhz')} MHz, {c.get('power_w')} W "
              f"(limit {c.get('power_limit_w')}), reasons {c.get('reasons')}, "
              f"{r['tensor_share_per_clock']} of the tensor peak per clock", flush=True)
    by_name = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    summary = {n: {"tflops_median": statistics.median(x["tflops"] for x in rs),
                   "sm_mhz_median": statistics.median(x["clocks"].get("sm_mhz") or 0 for x in rs) or None,
                   "power_w_median": statistics.median(x["clocks"].get("power_w") or 0 for x in rs) or None,
                   "tensor_share_median": statistics.median(x["tensor_share_per_clock"] or 0 for x in rs) or None}
               for n, rs in by_name.items()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    gpu = "".join(ch if ch.isalnum() else "-" for ch in env["gpu"]).strip("-")
    path = out / f"{stamp}_{gpu}_power_probe.json"
    path.write_text(json.dumps({**env, "shapes": [list(x) for x in shapes], "seconds": args.seconds, "sm_count": sms,
                                "clocks_fields": list(sampler.fields), "clocks_note": sampler.why, "notes": notes,
                                "rows": rows, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
