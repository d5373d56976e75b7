"""Forward attention throughput: fa4gen against torch SDPA's cuDNN and flash backends and FA4-CuTe, same run.

    python -m bench.attention            (or: python bench/attention.py)  [--dtype bf16] [--only 0,3]

TFLOP/s = 4 * B * Hq * Sq * Skv * D / time, halved for causal (half the score matrix is skipped);
time = the median of triton.testing.do_bench (its own warm-up, L2 flushed between runs), taken in
`--rounds` rounds (default 3) with the contenders interleaved and the order rotated each round, the
median over the rounds; every implementation makes its untimed first call (builds, JIT compiles)
before any timing. (Until 2026-12-04 each contender was timed once, right after its first call: the
first timed after an idle spell, such as FA4-CuTe after its compile, ran on a cooler, faster-clocked
GPU; the same fa4gen kernel measured up to 6% apart between two columns.) Shapes are /work/shared/BASELINES.md's. Two fa4gen columns:
`fa4gen` times the public `fa4gen.attention` (validation, output allocation and launch included),
`fa4gen_kernel` the loaded Kernel called directly into a preallocated output (the kernel alone,
as the SDPA numbers nearly are). Each result is also compared with cuDNN's output (max abs diff),
so a fast wrong kernel shows.

`--sustained SECONDS` times each contender back to back over that span instead (CUDA events around
the whole span, no L2 flush between calls), so that every contender runs at the clock its own power
allows under the H200's 700 W cap; do_bench's short windows gave FA4-CuTe 60-300 MHz higher sampled
clocks than fa4gen at equal power (bench/README.md "Clocks and power"; cause not found).

`--clocks` samples the GPU (bench/gpu_clocks.py) while each contender is timed: a row's `clocks` holds
the median SM clock, power and utilization per contender. Every row has `<name>_busy_share`: its calls
x its median time over the wall time of its timing (do_bench's flushes and host included), so a
contender whose calls leave the GPU idle between them (a lower average power, so higher clocks in its
kernels under the power cap) shows a lower share.

`fa4cute` is flash-attn-4's CuTe-DSL forward (its sm_90 path), a peer only: present when its
unpacked wheels are at $FA4_PEER_SITE or /tmp/fa4/site (scripts/fa4_peer.sh puts them there in two
device calls), else the column is empty and the JSON's `fa4cute.status` says why in one line. Its
first call of each variant JIT-compiles (seconds; recorded per row as `fa4cute_first_call_s`) and is
kept out of the timing. "best peer" = fa4gen_kernel / max(cudnn, flash, fa4cute).

Time: the whole run must fit the GPU check's device call (~180 s beside the GPU tests): do_bench
keeps 25 ms warm-up / 100 ms repetitions (about 0.15 s per timed column, shape and round, ~30 s for
all; the peer's JIT compiles dominate), and `--budget-s` (default 160) skips the shapes left once that
much wall time has gone, so a slow run still ends with its rows written (`complete: false`).

`previous` (with `--baseline DIR`, or $FA4GEN_BENCH_BASELINE): the kernels of an earlier generator,
DIR/<variant name>.cubin + .json as `fa4gen build --arch sm_90a --out DIR` wrote them, loaded with
fa4gen.load and timed like `fa4gen_kernel`; "vs previous" = fa4gen_kernel / previous (a generator
change must not slow any shape down: same run, same inputs).

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

# (B, S, Hq, Hkv, D, causal[, dtype]): BASELINES.md's table, Sq = Skv = S, then the issue tracker's
# additions; a 7th element fixes that row's dtype, otherwise --dtype (default bf16) applies.
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
    (1, 32768, 16, 16, 128, True),
    (2, 8192, 16, 16, 128, False, "fp16"),
)
# --suite gqa (the any-ratio issue): ratios 3, 5, 6, 7 beside the ratios that divide 128 around them
# (2, 4, 8), one kv-head count (8), S 8192, D 128; non-causal and causal
GQA_SHAPES = tuple((2, 8192, 8 * g, 8, 128, causal) for causal in (False, True) for g in (2, 3, 4, 5, 6, 7, 8))
# --suite d64 (head_dim 64 across S, the 192-row tile's quantization at short S included; GQA 4; fp16)
D64_SHAPES = tuple((16 * 1024 // s, s, 16, 16, 64, causal) for causal in (False, True)
                   for s in (512, 1024, 2048, 8192)) + ((2, 8192, 32, 8, 64, False), (2, 8192, 32, 8, 64, True),
                                                        (4, 4096, 32, 32, 64, False, "fp16"),
                                                        (1, 32768, 16, 16, 64, True))
DEVICE = "cuda"
IMPLS = ("fa4gen", "fa4gen_kernel", "fa4gen_m128", "previous", "cudnn", "flash", "fa4cute")
PEERS = ("cudnn", "flash", "fa4cute")
FA4_DEFAULT_SITE = "/tmp/fa4/site"
FA4_PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl")


def shape_dtype(shape, default: str) -> str:
    """The dtype a SHAPES row runs in: its own 7th element, else `default` (--dtype)."""
    return shape[6] if len(shape) > 6 else default


def load_fa4cute(site_dir: str | None = None):
    """FA4-CuTe's flash_attn_func, or None, and an info dict for the JSON: status ("ok" or one line
    saying why not), the site, the versions of flash-attn-4 and nvidia-cutlass-dsl, import seconds.
    Never raises: a missing or broken peer must not fail the benchmark."""
    import site
    import time

    site_dir = site_dir or os.environ.get("FA4_PEER_SITE") or FA4_DEFAULT_SITE
    info = {"site": site_dir, "status": None, "import_s": None, "module": None}
    info.update({pkg: None for pkg in FA4_PACKAGES})
    if not Path(site_dir).is_dir():
        info["status"] = (f"not installed: no {site_dir} (bash scripts/fa4_peer.sh stage1, stage1b, then stage2, "
                          f"in three device calls; or set FA4_PEER_SITE)")
        return None, info
    t0 = time.perf_counter()
    try:
        if site_dir not in sys.path:
            site.addsitedir(site_dir)  # also runs the .pth that puts the DSL's packages on sys.path
        from flash_attn.cute.interface import flash_attn_func
    except BaseException as e:  # noqa: BLE001 - an import can fail in any way (SystemExit from a DSL too)
        if isinstance(e, KeyboardInterrupt):
            raise
        info["status"] = f"import failed: {_one_line(e)}"
        return None, info
    info["import_s"] = round(time.perf_counter() - t0, 3)
    info["module"] = getattr(sys.modules.get("flash_attn.cute.interface"), "__file__", None)
    for pkg in FA4_PACKAGES:
        info[pkg] = _dist_version(pkg, site_dir)
    info["status"] = "ok"
    return flash_attn_func, info


def _dist_version(pkg: str, site_dir: str) -> str | None:
    """The version of pkg installed in site_dir (the copy the import used), else anywhere on sys.path."""
    dist = next(iter(importlib.metadata.distributions(name=pkg, path=[site_dir])), None)
    if dist is not None:
        return dist.version
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _one_line(e: BaseException, limit: int = 200) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


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


def interleaved_ms(fns: dict, rounds: int, warmup_ms: int, rep_ms: int, timer=None, rotate: bool = True) -> dict:
    """Time several callables alternately (A, B, C, B, C, A, C, A, B ...) for `rounds` rounds of
    `_median_ms` each, so that drift (clocks, heat) falls on all of them alike: round r starts at the
    r-th callable, so that no one is always the first after an idle spell (a cooler, faster-clocked
    GPU); `rotate=False` keeps the order fixed (A, B, C, A, B, C). Returns
    name -> (median over the rounds in ms, (min / median, max / median) over the rounds)."""
    timer = timer or _median_ms
    per = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        shift = r % len(order) if rotate and order else 0
        for name, fn in order[shift:] + order[:shift]:
            per[name].append(timer(fn, warmup_ms, rep_ms))
    out = {}
    for name, times in per.items():
        med = statistics.median(times)
        out[name] = (med, (round(min(times) / med, 4), round(max(times) / med, 4)))
    return out


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


def _fa4cute(flash_attn_func, q, k, v, causal):
    """A callable running FA4-CuTe on (B, S, H, D) tensors (its own layout), its first output and the
    first call's seconds (the JIT compile of a new variant); flash_attn_func may return (out, lse)."""
    import time

    import torch

    def fn():
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, (tuple, list)) else out

    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    fn()  # a second untimed call: nothing left of the compile path before do_bench's own warm-up
    torch.cuda.synchronize()
    return fn, out, first_s


def capture_graph(torch, fn, calls: int, flush=None):
    """A CUDA graph of `calls` x (flush(), fn()), for timing replays (the GPU time without the host's
    per-call cost): fn is called once on a side stream first (lazy set-up stays out of the capture),
    and the graph is replayed once before it is returned (its first replay uploads it). fn None: the
    flushes alone; flush None: fn alone. Raises what the capture raises. The one capture of
    bench.kvcache, bench.ab (its kvcache suite) and bench.decode_combine."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if fn is not None:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            if flush is not None:
                flush()
            if fn is not None:
                fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def sustained_ms(fn, seconds: float, batch: int = 20) -> float:
    """ms per call of fn run back to back for about `seconds` (CUDA events around the whole span; the
    host stays at most 8 batches ahead, so the GPU never idles): under a power cap, every contender
    then runs at the clock its own power allows, which do_bench's short windows do not ensure."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        calls += batch
        if calls % (batch * 8) == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def run_shape(shape, dtype_name, warmup_ms, rep_ms, fa4cute=None, baseline=None, rounds=1, sampler=None,
              sustained_s: float = 0.0, timed=None):
    """One shape's row. sampler: a started bench.gpu_clocks.GpuSampler: each contender's timing is a
    window of it, and the row's `clocks` gives the median SM clock and power while each was timed.
    sustained_s > 0: each timing is sustained_ms over that many seconds instead of do_bench.
    timed: the contenders to time (None: all); the others still run once (their outputs checked)."""
    import contextlib
    import time

    import torch

    from fa4gen.runtime import api

    b, s, hq, hkv, d, causal = shape[:6]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=dt, generator=gen) for h in (hq, hkv, hkv))
    row = dict(B=b, Sq=s, Skv=s, Hq=hq, Hkv=hkv, D=d, dtype=dtype_name, causal=causal)
    outputs, notes, fns = {}, {}, {}

    # every contender's first call (builds, loads, JIT compiles) comes before any timing, so that no
    # contender's timing follows its own idle compile (a cooler, faster-clocked GPU) alone
    with torch.no_grad():
        try:
            outputs["fa4gen"] = api.attention(q, k, v, causal=causal)
            torch.cuda.synchronize()
            info = api.last_call_info()
            if info.kernel is not None:
                row["fa4gen_first_call"] = dict(source=info.kernel.source, build_s=round(info.kernel.build_s, 4),
                                                cache_s=round(info.kernel.cache_s, 4),
                                                load_s=round(info.kernel.load_s, 4))
            fns["fa4gen"] = lambda: api.attention(q, k, v, causal=causal)
            kernel, _ = api.get_kernel(api.config_for(info.problem), q.device)
            o = torch.empty_like(q)
            scale = d ** -0.5
            fns["fa4gen_kernel"] = lambda: kernel(q, k, v, o, softmax_scale=scale)
            chosen = api.config_for(info.problem)
            row["fa4gen_block_m"] = chosen.block_m
            if chosen.block_m != 128:  # the same generator's 128-row (two-consumer) kernel beside it
                k128, _ = api.get_kernel(chosen.replace(block_m=128), q.device)
                o128 = torch.empty_like(q)
                k128(q, k, v, o128, softmax_scale=scale)
                torch.cuda.synchronize()
                outputs["fa4gen_m128"] = o128
                fns["fa4gen_m128"] = lambda: k128(q, k, v, o128, softmax_scale=scale)
        except Exception as e:
            notes["fa4gen"] = _one_line(e)
        if baseline:
            try:
                name = api.config_for(api.last_call_info().problem).name
                path = Path(baseline) / f"{name}.cubin"
                if not path.exists():
                    raise FileNotFoundError(f"no {path.name} in {baseline}")
                prev = api.load(path)
                o_prev = torch.empty_like(q)
                prev.kernel(q, k, v, o_prev, softmax_scale=d ** -0.5)
                torch.cuda.synchronize()
                outputs["previous"] = o_prev
                fns["previous"] = lambda: prev.kernel(q, k, v, o_prev, softmax_scale=d ** -0.5)
            except Exception as e:
                notes["previous"] = _one_line(e)
        for name in ("cudnn", "flash"):
            fn, out, note = _sdpa(name, q, k, v, causal)
            if note:
                notes[name] = note
            if fn is not None:
                outputs[name] = out
                fns[name] = fn
        if fa4cute is not None:  # (when it is None, the JSON's top-level `fa4cute.status` says why)
            try:
                fn, out, first_s = _fa4cute(fa4cute, q, k, v, causal)
                row["fa4cute_first_call_s"] = round(first_s, 3)
                outputs["fa4cute"] = out
                fns["fa4cute"] = fn
            except Exception as e:  # a variant the peer does not take: say so, keep the run going
                notes["fa4cute"] = _one_line(e)
                torch.cuda.synchronize()
        ms, failed = {}, {}
        if timed is not None:
            fns = {name: fn for name, fn in fns.items() if name in timed}
        names = {id(fn): name for name, fn in fns.items()}

        tag = f"{shape}:"  # this shape's windows
        busy = {name: [0, 0.0, 0.0] for name in fns}  # calls, wall seconds, GPU ms (calls x median) while timed

        def timer(fn, warmup, rep):  # a contender that fails while timed: noted, its column left empty
            name = names[id(fn)]
            acc = busy[name]

            def counted():
                acc[0] += 1
                return fn()
            try:
                calls0, t0 = acc[0], time.perf_counter()
                with sampler.window(tag + name) if sampler else contextlib.nullcontext():
                    ms = sustained_ms(counted, sustained_s) if sustained_s > 0 else _median_ms(counted, warmup, rep)
                acc[1] += time.perf_counter() - t0
                acc[2] += (acc[0] - calls0) * ms
                return ms
            except Exception as e:  # noqa: BLE001 - a peer's failure must not end the run
                failed[names[id(fn)]] = _one_line(e)
                torch.cuda.synchronize()
                return float("nan")

        for name, (med, spread) in interleaved_ms(fns, rounds, warmup_ms, rep_ms, timer=timer).items():
            if name in failed:
                notes[name] = failed[name]
                continue
            ms[name] = med
            if rounds > 1:
                row[f"{name}_round_spread"] = spread
        for name, (calls, wall, gpu_ms) in busy.items():  # the share of its timing the GPU spent in its calls
            if calls and wall and name not in failed:
                row[f"{name}_busy_share"] = round(gpu_ms * 1e-3 / wall, 3)
        if sampler is not None:
            time.sleep(0.2)  # the sampler's last lines of this shape
            got = sampler.summary()
            row["clocks"] = {key[len(tag):]: val for key, val in got.items() if key.startswith(tag)}

    for name in IMPLS:
        row[f"{name}_ms"] = round(ms[name], 5) if name in ms else None
        row[f"{name}_tflops"] = round(tflops(b, hq, s, s, d, causal, ms[name]), 1) if name in ms else None
    ref_name = "cudnn" if "cudnn" in outputs else "flash" if "flash" in outputs else None
    for name in ("fa4gen", "fa4gen_m128", "previous", "fa4cute"):
        if name in outputs and ref_name:
            diff = (outputs[name].float() - outputs[ref_name].float()).abs().max().item()
            row[f"{name}_max_abs_diff_vs_{ref_name}"] = diff
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
    env["fa4gen_commit"] = tree_commit()
    from fa4gen.spec.config import GENERATOR_VERSION, generator_fingerprint
    env["fa4gen_generator_version"] = GENERATOR_VERSION
    # the PTX-deciding sources' hash: names the generator even where the commit cannot
    env["fa4gen_fingerprint"] = generator_fingerprint()
    return env


def tree_commit() -> str | None:
    """The checkout's commit, "+modified" when tracked files differ from it (a copied tree whose .git
    is older than its files: the lent GPU machine's copy), None without a git checkout of ROOT."""
    def git(*args):
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != ROOT.resolve():
            return None
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return None if head is None else head + ("+modified" if changed else "")


def best_peer(row) -> tuple[str | None, float | None]:
    """The fastest peer of a row (cudnn, flash, fa4cute) and its TFLOP/s; (None, None) if none ran."""
    got = [(row.get(f"{p}_tflops"), p) for p in PEERS if row.get(f"{p}_tflops")]
    if not got:
        return None, None
    tf, name = max(got)
    return name, tf


def markdown(rows) -> str:
    def cell(x):
        return "—" if x is None else f"{x:.0f}"

    def ratio(num, den):
        return f"{num / den:.2f}" if num and den else "—"

    def diff(r, name):
        x = next((v for key, v in r.items() if key.startswith(f"{name}_max_abs_diff")), None)
        return "—" if x is None else f"{x:.3g}"

    lines = ["| B, S, Hq/Hkv, D | dtype | causal | tile | fa4gen | fa4gen kernel | 128-row kernel | previous | cuDNN | "
             "flash | FA4-CuTe | fa4gen/cuDNN | fa4gen/best peer | vs previous | max diff fa4gen / FA4-CuTe |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer, peer_tf = best_peer(r)
        ours = r.get("fa4gen_kernel_tflops") or r.get("fa4gen_tflops")  # (the API's when the kernel was not timed)
        best = f"{ratio(ours, peer_tf)}" + (f" ({peer})" if peer and peer_tf else "")
        lines.append(f"| {r['B']}, {r['Sq']}, {r['Hq']}/{r['Hkv']}, {r['D']} | {r['dtype']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r.get('fa4gen_block_m', '—')} | "
                     f"{cell(r['fa4gen_tflops'])} | {cell(r['fa4gen_kernel_tflops'])} | {cell(r.get('fa4gen_m128_tflops'))} | "
                     f"{cell(r.get('previous_tflops'))} | "
                     f"{cell(r['cudnn_tflops'])} | "
                     f"{cell(r['flash_tflops'])} | {cell(r.get('fa4cute_tflops'))} | "
                     f"{ratio(ours, r.get('cudnn_tflops'))} | {best} | "
                     f"{ratio(r.get('fa4gen_kernel_tflops'), r.get('previous_tflops'))} | "
                     f"{diff(r, 'fa4gen')} / {diff(r, 'fa4cute')} |")
    return "\n".join(lines)


def result_path(out_dir, env: dict, suffix: str = "") -> Path:
    """bench/results naming, one place: <UTC stamp>_<GPU name>[_<suffix>].json in out_dir (made if missing)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / (f"{stamp}_{gpu}_{suffix}.json" if suffix else f"{stamp}_{gpu}.json")


def _write(path: Path, result: dict) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")
    out = os.environ.get("OUT")
    if out and Path(out).is_dir() and Path(out).resolve() != path.parent.resolve():  # --out-dir $OUT: already there
        shutil.copy(path, Path(out) / path.name)


def main(argv=None):
    import time

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="dtype of the SHAPES rows that name none (default bf16)")
    ap.add_argument("--only", default="", help="comma-separated indices into the suite's shapes (default: all)")
    ap.add_argument("--suite", choices=("main", "gqa", "d64"), default="main",
                    help="main: SHAPES (BASELINES.md's table and the tracker's rows); gqa: GQA_SHAPES; d64: D64_SHAPES")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds per shape, the contenders interleaved, each round starting one "
                         "contender later; each figure is the median over the rounds (default 3)")
    ap.add_argument("--budget-s", type=float, default=160.0,
                    help="start no new shape after this many seconds of wall time (default 160)")
    ap.add_argument("--no-fa4cute", action="store_true", help="leave the FA4-CuTe peer out even if installed")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the GPU's SM clock, power and clock-event reasons with nvidia-smi while each "
                         "contender is timed (bench/gpu_clocks.py); each row's `clocks` gives the medians")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                    help="time each contender back to back for this many seconds per round (CUDA events over the "
                         "span, no L2 flush between calls) instead of do_bench: the GPU at its power cap for every "
                         "contender alike (bench/README.md \"Clocks and power\"); 0 (default): do_bench")
    ap.add_argument("--time", default="", metavar="NAMES",
                    help=f"comma-separated contenders to time, of {','.join(IMPLS)} (default: all); the others "
                         f"still run once and are checked against the reference, their columns left empty. For "
                         f"long --sustained runs: e.g. --time fa4gen,cudnn,flash,fa4cute")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--baseline", default=os.environ.get("FA4GEN_BENCH_BASELINE") or None,
                    help="folder of an earlier generator's sm_90a <name>.cubin + .json: the `previous` column")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    timed = None
    if args.time:
        timed = {n.strip() for n in args.time.split(",") if n.strip()}
        unknown = sorted(timed - set(IMPLS))
        if unknown or not timed:
            print(f"bench.attention: --time {args.time!r}: unknown contender(s) {unknown}; known: {', '.join(IMPLS)}",
                  file=sys.stderr)
            return 2

    import torch

    if not torch.cuda.is_available():
        print("bench.attention: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    suite = {"main": SHAPES, "gqa": GQA_SHAPES, "d64": D64_SHAPES}[args.suite]
    shapes = suite if not args.only else tuple(suite[int(i)] for i in args.only.split(","))
    env = environment(["-m", "bench.attention", *argv])
    if args.no_fa4cute:
        fa4cute, fa4info = None, {"status": "left out (--no-fa4cute)"}
    else:
        fa4cute, fa4info = load_fa4cute()
    print(f"  fa4cute: {fa4info['status']}" + (f" (flash-attn-4 {fa4info.get('flash-attn-4')}, nvidia-cutlass-dsl "
                                               f"{fa4info.get('nvidia-cutlass-dsl')}, import {fa4info['import_s']} s)"
                                               if fa4cute else ""), flush=True)
    path = result_path(args.out_dir, env, "" if args.suite == "main" else args.suite)
    result = {**env, "suite": args.suite, "dtype": args.dtype, "fa4cute": fa4info, "baseline": args.baseline,
              "timing": ((f"sustained: calls back to back for {args.sustained:g} s per round (CUDA events over the "
                          f"span, no L2 flush)" if args.sustained > 0 else
                          f"triton do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms")
                         + f"; median of {args.rounds} interleaved round(s), the order rotated each round, after "
                           f"every contender's first call"),
              "timed": sorted(timed) if timed else "all", "complete": False, "results": []}
    sampler = None
    if args.clocks:
        from bench.gpu_clocks import GpuSampler
        sampler = GpuSampler()
        if not sampler.start():
            print(f"  clocks: {sampler.why}", flush=True)
            result["clocks_note"], sampler = sampler.why, None
        else:
            import atexit
            atexit.register(sampler.stop)  # a run that fails midway leaves no nvidia-smi behind
            result["clocks_fields"] = list(sampler.fields)
    for i, shape in enumerate(shapes):
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            result["skipped"] = [list(sh) for sh in shapes[i:]]
            result["skipped_why"] = f"--budget-s {args.budget_s:g} spent ({elapsed:.0f} s) before these shapes"
            _write(path, result)
            print(f"  budget spent after {elapsed:.0f} s: {len(shapes) - i} shape(s) skipped", flush=True)
            break
        row = run_shape(shape, shape_dtype(shape, args.dtype), args.warmup_ms, args.rep_ms, fa4cute=fa4cute,
                        baseline=args.baseline, rounds=max(args.rounds, 1), sampler=sampler,
                        sustained_s=args.sustained, timed=timed)
        result["results"].append(row)
        result["complete"] = i == len(shapes) - 1
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
        _write(path, result)  # after every shape: a hang later still leaves the rows measured so far
        notes = row.get("notes")
        print(f"  {shape}: fa4gen {row['fa4gen_tflops']} / kernel {row['fa4gen_kernel_tflops']}, "
              f"cudnn {row['cudnn_tflops']}, flash {row['flash_tflops']}, fa4cute {row['fa4cute_tflops']} TFLOP/s"
              + (f" (first call {row['fa4cute_first_call_s']} s)" if "fa4cute_first_call_s" in row else "")
              + (f"  notes: {notes}" if notes else ""), flush=True)
        if row.get("clocks"):
            print("    SM MHz / W: " + ", ".join(f"{n} {c.get('sm_mhz')} / {c.get('power_w')}"
                                               for n, c in row["clocks"].items()), flush=True)
    if sampler is not None:
        sampler.stop()
    rows = result["results"]
    print()
    print(markdown(rows))
    if fa4cute is None:
        print(f"\nFA4-CuTe column empty: {fa4info['status']}")
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
