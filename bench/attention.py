"""Forward attention throughput: fa4gen against torch SDPA's cuDNN and flash backends, same run.

    python -m bench.attention            (or: python bench/attention.py)  [--dtype bf16] [--only 0,3]

TFLOP/s = 4 * B * Hq * Sq * Skv * D / time, halved for causal (half the score matrix is skipped);
time = the median of triton.testing.do_bench (its own warm-up, L2 flushed between runs) after one
untimed call of each implementation. Shapes are /work/shared/BASELINES.md's. Two fa4gen columns:
`fa4gen` times the public `fa4gen.attention` (validation, output allocation and launch included),
`fa4gen_kernel` the loaded Kernel called directly into a preallocated output (the kernel alone,
as the SDPA numbers nearly are). Each result is also compared with cuDNN's output (max abs diff),
so a fast wrong kernel shows.

Writes bench/results/<UTC time>_<gpu>.json (one file per run; also copied to $OUT when set) and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/attention.py` from anywhere
    sys.path.insert(0, str(ROOT))

# (B, S, Hq, Hkv, D, causal): BASELINES.md's table, Sq = Skv = S
SHAPES = (
    (16, 1024, 16, 16, 128, False),
    (4, 4096, 16, 16, 128, False),
    (2, 8192, 16, 16, 128, False),
    (1, 16384, 16, 16, 128, False),
    (2, 8192, 32, 8, 128, False),
    (4, 4096, 32, 32, 64, False),
    (16, 1024, 16, 16, 128, True),
    (2, 8192, 16, 16, 128, True),
    (2, 8192, 32, 8, 128, True),
    (4, 4096, 32, 32, 64, True),
)
DEVICE = "cuda"
IMPLS = ("fa4gen", "fa4gen_kernel", "cudnn", "flash")


def tflops(b, hq, sq, skv, d, causal, ms):
    flop = 4.0 * b * hq * sq * skv * d * (0.5 if causal else 1.0)
    return flop / (ms * 1e-3) / 1e12


def _median_ms(fn, warmup_ms, rep_ms):
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    # fallback: CUDA events around each call, median of as many calls as fit in rep_ms
    fn()
    torch.cuda.synchronize()
    times = []
    total = 0.0
    while total < rep_ms or len(times) < 10:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        total += times[-1]
    return statistics.median(times)


def _sdpa(backend_name, q, k, v, causal):
    """A callable running SDPA with one backend on (B, S, H, D) tensors, and a note. GQA goes
    through enable_gqa; if the backend refuses it, K/V heads are expanded (noted: more traffic)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    attempts = [(kt, vt, dict(enable_gqa=True) if gqa else {}, "")]
    if gqa:
        g = q.shape[2] // k.shape[2]
        attempts.append((kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1), {}, "kv heads expanded"))
    errors = []
    for kk, vv, kw, note in attempts:
        def fn(kk=kk, vv=vv, kw=kw):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=causal, **kw)
        try:
            out = fn()
            torch.cuda.synchronize()
            return fn, out.transpose(1, 2), note
        except Exception as e:  # a backend that does not take this shape says so; record it
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return None, None, "; ".join(errors)


def run_shape(shape, dtype_name, warmup_ms, rep_ms):
    import torch

    from fa4gen import api

    b, s, hq, hkv, d, causal = shape
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=dt, generator=gen) for h in (hq, hkv, hkv))
    row = dict(B=b, Sq=s, Skv=s, Hq=hq, Hkv=hkv, D=d, dtype=dtype_name, causal=causal)
    outputs, notes, ms = {}, {}, {}

    with torch.no_grad():
        try:
            outputs["fa4gen"] = api.attention(q, k, v, causal=causal)
            torch.cuda.synchronize()
            info = api.last_call_info()
            if info.kernel is not None:
                row["fa4gen_first_call"] = dict(source=info.kernel.source, build_s=round(info.kernel.build_s, 4),
                                                cache_s=round(info.kernel.cache_s, 4),
                                                load_s=round(info.kernel.load_s, 4))
            ms["fa4gen"] = _median_ms(lambda: api.attention(q, k, v, causal=causal), warmup_ms, rep_ms)
            kernel, _ = api.get_kernel(api.config_for(info.problem), q.device)
            o = torch.empty_like(q)
            scale = d ** -0.5
            ms["fa4gen_kernel"] = _median_ms(lambda: kernel(q, k, v, o, softmax_scale=scale), warmup_ms, rep_ms)
        except Exception as e:
            notes["fa4gen"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        for name in ("cudnn", "flash"):
            fn, out, note = _sdpa(name, q, k, v, causal)
            if note:
                notes[name] = note
            if fn is not None:
                outputs[name] = out
                ms[name] = _median_ms(fn, warmup_ms, rep_ms)

    for name in IMPLS:
        row[f"{name}_ms"] = round(ms[name], 5) if name in ms else None
        row[f"{name}_tflops"] = round(tflops(b, hq, s, s, d, causal, ms[name]), 1) if name in ms else None
    ref_name = "cudnn" if "cudnn" in outputs else "flash" if "flash" in outputs else None
    if "fa4gen" in outputs and ref_name:
        diff = (outputs["fa4gen"].float() - outputs[ref_name].float()).abs().max().item()
        row[f"fa4gen_max_abs_diff_vs_{ref_name}"] = diff
    if notes:
        row["notes"] = notes
    del q, k, v, outputs
    torch.cuda.empty_cache()
    return row


def environment(argv):
    import torch

    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *argv]),
    }
    for pkg in ("cuda-bindings", "triton", "nvidia-nvjitlink", "nvidia-cudnn-cu13"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    env["driver"] = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        env["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        env["fa4gen_commit"] = r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["fa4gen_commit"] = None
    from fa4gen.config import GENERATOR_VERSION
    env["fa4gen_generator_version"] = GENERATOR_VERSION
    return env


def markdown(rows) -> str:
    def cell(x):
        return "—" if x is None else f"{x:.0f}"

    lines = ["| B, S, Hq/Hkv, D | causal | fa4gen | fa4gen kernel | cuDNN | flash | fa4gen/cuDNN | max diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (f"{r['fa4gen_kernel_tflops'] / r['cudnn_tflops']:.2f}"
                 if r.get("fa4gen_kernel_tflops") and r.get("cudnn_tflops") else "—")
        diff = next((v for key, v in r.items() if key.startswith("fa4gen_max_abs_diff")), None)
        lines.append(f"| {r['B']}, {r['Sq']}, {r['Hq']}/{r['Hkv']}, {r['D']} | {'yes' if r['causal'] else 'no'} | "
                     f"{cell(r['fa4gen_tflops'])} | {cell(r['fa4gen_kernel_tflops'])} | {cell(r['cudnn_tflops'])} | "
                     f"{cell(r['flash_tflops'])} | {ratio} | {'—' if diff is None else f'{diff:.3g}'} |")
    return "\n".join(lines)


def _write(path: Path, result: dict) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")
    if os.environ.get("OUT") and Path(os.environ["OUT"]).is_dir():
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--only", default="", help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench.attention: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    shapes = SHAPES if not args.only else tuple(SHAPES[int(i)] for i in args.only.split(","))
    env = environment(["-m", "bench.attention", *argv])
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-")
    path = out_dir / f"{stamp}_{gpu}.json"
    result = {**env, "dtype": args.dtype, "timing": f"triton do_bench median, warmup {args.warmup_ms} ms, "
                                                      f"rep {args.rep_ms} ms", "complete": False, "results": []}
    for i, shape in enumerate(shapes):
        row = run_shape(shape, args.dtype, args.warmup_ms, args.rep_ms)
        result["results"].append(row)
        result["complete"] = i == len(shapes) - 1
        _write(path, result)  # after every shape: a hang later still leaves the rows measured so far
        print(f"  {shape}: fa4gen {row['fa4gen_tflops']} / kernel {row['fa4gen_kernel_tflops']}, "
              f"cudnn {row['cudnn_tflops']}, flash {row['flash_tflops']} TFLOP/s"
              + (f"  notes: {row['notes']}" if row.get("notes") else ""), flush=True)
    rows = result["results"]
    print()
    print(markdown(rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
