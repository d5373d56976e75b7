#!/usr/bin/env python3
"""Device harness for the sm_90a kernel: build, probe, check against float32 torch, time vs SDPA.

Two halves, so the device call spends no time assembling:
  here (CPU, ptxas):   python scripts/dev_sm90.py prebuild --out .devbuild
  device (H200):       PYTHONPATH=. python scripts/dev_sm90.py run --cubins .devbuild --log $OUT/log.txt
`run` regenerates each variant's PTX and uses the carried cubin only when its recorded PTX hash
matches (else it assembles with ptxas or nvJitLink there). It checks, in order: the QK and PV
probes (which layer is wrong), correctness of every variant on odd shapes (fresh random inputs,
NaN-poisoned outputs), then timing vs torch SDPA cuDNN / flash with triton's do_bench (median).
A launch that does not finish within a watchdog timeout aborts the process (a deadlock must not
eat the device lease).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fa4gen.config import KernelConfig  # noqa: E402
from fa4gen.lower.sm90 import Probe, Sm90Options, build_sm90  # noqa: E402


def variants() -> dict[str, tuple[KernelConfig, Sm90Options]]:
    V = {}

    def add(tag, opt=None, **kw):
        V[tag] = (KernelConfig(arch="sm_90a", **kw), opt or Sm90Options())

    add("probe_qk", Sm90Options(probe=Probe.QK))
    add("probe_pv", Sm90Options(probe=Probe.PV))
    for causal in (False, True):
        c = "c" if causal else "nc"
        add(f"d128_{c}", causal=causal)
        add(f"d128_{c}_gqa4", causal=causal, gqa_ratio=4)
        add(f"d64_{c}", causal=causal, head_dim=64)
    add("d128_nc_fp16", dtype="fp16")
    add("d128_c_gqa2_fp16", causal=True, gqa_ratio=2, dtype="fp16")
    add("d128_nc_gqa128", gqa_ratio=128)
    add("d128_nc_nopp", Sm90Options(pingpong=False))
    add("d128_nc_noemu", emu_pairs=0)
    add("d128_c_noemu", causal=True, emu_pairs=0)
    add("d128_nc_thr0", rescale_threshold=0.0)
    add("d128_c_onepertask", Sm90Options(persistent=False), causal=True)
    add("d64_nc_noemu", head_dim=64, emu_pairs=0)
    add("d64_c_noemu", head_dim=64, causal=True, emu_pairs=0)
    add("d128_c_gqa4_noemu", causal=True, gqa_ratio=4, emu_pairs=0)
    add("d128_nc_gqa4_noemu", gqa_ratio=4, emu_pairs=0)
    return V


def ptx_hash(ptx: str) -> str:
    return hashlib.sha256(ptx.encode()).hexdigest()[:16]


def assemble(ptx: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    """ptxas when on PATH (with its -v report), else nvJitLink through cuda-python."""
    ptxas = shutil.which("ptxas")
    if ptxas:
        with tempfile.TemporaryDirectory() as d:
            src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
            src.write_text(ptx)
            r = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(out)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"ptxas failed:\n{r.stderr}")
            return out.read_bytes(), r.stderr
    from cuda.bindings import nvjitlink

    h = nvjitlink.create(2, [f"-arch={arch}", "-O3"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "fa4")
        try:
            nvjitlink.complete(h)
        except Exception as e:
            size = nvjitlink.get_error_log_size(h)
            buf = bytearray(size)
            nvjitlink.get_error_log(h, buf)
            raise RuntimeError(f"nvJitLink failed: {e}\n{buf.decode(errors='replace')}") from e
        size = nvjitlink.get_linked_cubin_size(h)
        buf = bytearray(size)
        nvjitlink.get_linked_cubin(h, buf)
        return bytes(buf), "nvjitlink"
    finally:
        nvjitlink.destroy(h)


def cmd_prebuild(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for tag, (cfg, opt) in variants().items():
        ptx, man = build_sm90(cfg, opt)
        cubin, log = assemble(ptx)
        bad = [ln for ln in log.splitlines() if "warning" in ln.lower() or ("spill" in ln and " 0 bytes spill" not in ln)]
        if bad:
            raise SystemExit(f"{tag}: ptxas reported:\n" + "\n".join(bad))
        regs = [ln.strip() for ln in log.splitlines() if "registers" in ln]
        (out / f"{tag}.cubin").write_bytes(cubin)
        (out / f"{tag}.json").write_text(json.dumps({"manifest": man, "ptx_hash": ptx_hash(ptx)}, indent=1))
        (out / f"{tag}.ptx").write_text(ptx)
        print(f"{tag:22s} {len(cubin):7d} B cubin  {regs[0] if regs else ''}")


# ------------------------------------------------------------------------------- device half ----

class Log:
    def __init__(self, path):
        self.f = open(path, "w") if path else None

    def __call__(self, *a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        if self.f:
            self.f.write(s + "\n")
            self.f.flush()


def load_kernels(args, log):
    from fa4gen.runtime import Kernel

    kernels = {}
    for tag, (cfg, opt) in variants().items():
        ptx, man = build_sm90(cfg, opt)
        meta = Path(args.cubins) / f"{tag}.json" if args.cubins else None
        cubin = None
        if meta and meta.exists():
            rec = json.loads(meta.read_text())
            if rec["ptx_hash"] == ptx_hash(ptx):
                cubin = (Path(args.cubins) / f"{tag}.cubin").read_bytes()
        src = "carried"
        if cubin is None:
            t0 = time.time()
            cubin, _ = assemble(ptx)
            src = f"assembled here {time.time() - t0:.1f}s"
        kernels[tag] = (cfg, opt, Kernel.load(cubin, man))
        log(f"loaded {tag:22s} ({src}, smem {man['dynamic_smem_bytes']}, grid {man['grid']['policy']})")
    return kernels


def wait_or_die(log, what, timeout=10.0):
    import torch

    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout:
            log(f"HANG: {what} did not finish in {timeout}s; aborting")
            os._exit(3)
        time.sleep(0.001)
    torch.cuda.synchronize()


def reference(q, k, v, causal, scale):
    """float32 attention on [B, S, H, D] tensors; rows with no visible key -> O = 0, LSE = -inf."""
    import torch

    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(G, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(G, dim=2).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + Skv - Sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p, vf).transpose(1, 2)
    return o, lse


def run_probe(kern, tag, log):
    import torch

    cfg, opt, K = kern
    torch.manual_seed(1)
    B, Sq, Skv, H, D = 2, 300, 128, 3, 128
    dt = torch.bfloat16
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, Skv, H, D, device="cuda", dtype=dt)
    v = torch.randn(B, Skv, H, D, device="cuda", dtype=dt)
    o = torch.full_like(q, float("nan"))
    K(q, k, v, o, None, softmax_scale=1.0)
    wait_or_die(log, tag)
    s = torch.einsum("bshd,bthd->bsht", q.float(), k.float())  # [B, Sq, H, 128]
    if opt.probe is Probe.QK:
        ref = s
    else:
        ref = torch.einsum("bsht,bthd->bshd", s.to(dt).float(), v.float())
    err = (o.float() - ref).norm() / ref.norm()
    nan = torch.isnan(o).sum().item()
    ok = err < 1e-2 and nan == 0
    log(f"PROBE {tag}: rel_err {err:.2e} unwritten {nan} -> {'PASS' if ok else 'FAIL'}")
    if not ok:
        d = (o.float() - ref).abs()
        bad = (d > 0.05 * ref.abs().max()).nonzero()[:8].tolist()
        log(f"  first bad [b,s,h,col]: {bad}")
        log(f"  o[0,0,0,:8]={o[0,0,0,:8].float().tolist()}")
        log(f"  r[0,0,0,:8]={ref[0,0,0,:8].tolist()}")
    return ok


CASES = [  # (B, Sq, Skv, Hq, Hkv, D)
    (2, 1024, 1024, 4, 4, 128),
    (1, 1000, 1037, 3, 3, 128),
    (1, 1037, 1000, 2, 2, 128),
    (2, 257, 300, 2, 2, 128),
    (2, 1, 1024, 4, 4, 128),
    (1, 300, 50, 2, 2, 128),
    (1, 128, 128, 1, 1, 128),
]


def cases_for(cfg):
    G = cfg.gqa_ratio
    out = []
    for B, Sq, Skv, H, _, D in CASES:
        out.append((B, Sq, Skv, H * G, H, cfg.head_dim))
    if G == 128:
        out = [(1, 37, 300, 128, 1, 128), (2, 5, 1024, 256, 2, 128)]
    return out


def check_variant(tag, kern, log, big=False):
    import torch

    cfg, opt, K = kern
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    worst = 0.0
    ok_all = True
    shapes = cases_for(cfg)
    if big:
        shapes = shapes + [(2, 8192, 8192, 16 * cfg.gqa_ratio, 16, cfg.head_dim)]
    for B, Sq, Skv, Hq, Hkv, D in shapes:
        torch.manual_seed(hash((tag, B, Sq, Skv)) & 0xFFFF)
        q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
        k = torch.randn(B, Skv, Hkv, D, device="cuda", dtype=dt)
        v = torch.randn(B, Skv, Hkv, D, device="cuda", dtype=dt)
        q[:, :, :, :3] *= 4.0  # spread the scores so rescaling is exercised
        o = torch.full_like(q, float("nan"))
        lse = torch.full((B, Hq, Sq), float("nan"), device="cuda", dtype=torch.float32)
        scale = 1.0 / math.sqrt(D)
        K(q, k, v, o, lse, softmax_scale=scale)
        wait_or_die(log, f"{tag} {B}x{Sq}x{Skv}")
        if Sq * Skv * Hq * B > 2**31:  # reference on a slice: batch 0, first two query heads' group
            sl = slice(0, 1)
            hq = slice(0, cfg.gqa_ratio * 1)
            ro, rl = reference(q[sl, :, hq], k[sl, :, 0:1], v[sl, :, 0:1], cfg.causal, scale)
            oo, ll = o[sl, :, hq], lse[sl, hq]
        else:
            ro, rl = reference(q, k, v, cfg.causal, scale)
            oo, ll = o, lse
        unwritten = torch.isnan(oo).sum().item() + torch.isnan(ll).sum().item()
        err = ((oo.float() - ro).norm() / ro.norm().clamp_min(1e-30)).item()
        maxabs = (oo.float() - ro).abs().max().item()
        fin = torch.isfinite(rl)
        lse_err = (ll[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
        inf_ok = bool((ll[~fin] == float("-inf")).all()) if (~fin).any() else True
        ok = err < 2e-2 and unwritten == 0 and lse_err < 1e-2 and inf_ok
        worst = max(worst, err)
        ok_all &= ok
        log(f"  {tag:20s} B{B} Sq{Sq} Skv{Skv} Hq{Hq} Hkv{Hkv} D{D}: rel {err:.2e} maxabs {maxabs:.2e} "
            f"lse {lse_err:.1e} unwritten {unwritten} empty-rows-ok {inf_ok} -> {'ok' if ok else 'FAIL'}")
    return ok_all, worst


BENCH = [  # (B, S, Hq, Hkv, D, causal)
    (16, 1024, 16, 16, 128, False), (4, 4096, 16, 16, 128, False), (2, 8192, 16, 16, 128, False),
    (1, 16384, 16, 16, 128, False), (2, 8192, 32, 8, 128, False), (4, 4096, 32, 32, 64, False),
    (16, 1024, 16, 16, 128, True), (2, 8192, 16, 16, 128, True), (2, 8192, 32, 8, 128, True),
    (4, 4096, 32, 32, 64, True),
]


def bench(kernels, log, tags_for_main):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    def tflops(ms, B, S, Hq, D, causal):
        f = 4 * B * Hq * S * S * D / (2 if causal else 1)
        return f / (ms * 1e-3) / 1e12

    rows = []
    for B, S, Hq, Hkv, D, causal in BENCH:
        G = Hq // Hkv
        tag = f"d{D}_{'c' if causal else 'nc'}" + (f"_gqa{G}" if G > 1 else "")
        if tag not in kernels:
            continue
        _, _, K = kernels[tag]
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(q)
        res = {}
        K(q, k, v, o, None)
        wait_or_die(log, f"bench warmup {tag}")
        res["fa4gen"] = do_bench(lambda: K(q, k, v, o, None), warmup=50, rep=300, return_mode="median")
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=G > 1)  # noqa: E731
                    fn()
                    res[name] = do_bench(fn, warmup=50, rep=300, return_mode="median")
            except Exception as e:  # a backend may refuse a shape
                res[name] = float("nan")
                log(f"  {name} unavailable for {tag} B{B} S{S}: {type(e).__name__}: {str(e)[:100]}")
        extra = {}
        if True:
            for t in tags_for_main.get(tag, ()):
                if t in kernels:
                    Kt = kernels[t][2]
                    Kt(q, k, v, o, None)
                    wait_or_die(log, f"bench warmup {t}")
                    extra[t] = do_bench(lambda: Kt(q, k, v, o, None), warmup=50, rep=300, return_mode="median")
        row = (B, S, Hq, Hkv, D, causal, {n: tflops(ms, B, S, Hq, D, causal) for n, ms in res.items()},
               {n: tflops(ms, B, S, Hq, D, causal) for n, ms in extra.items()})
        rows.append(row)
        log(f"  bench {tag} B{B} S{S} Hq{Hq}/{Hkv}: " + ", ".join(f"{n} {v:.0f}" for n, v in row[6].items())
            + ("  | " + ", ".join(f"{n} {v:.0f}" for n, v in row[7].items()) if extra else ""))
        del q, k, v, o
    return rows


def cmd_run(args):
    import torch

    log = Log(args.log)
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
        f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    try:
        import cuda.bindings

        log(f"cuda-bindings {cuda.bindings.__version__}")
    except Exception:
        pass
    kernels = load_kernels(args, log)
    probes_ok = all([run_probe(kernels[t], t, log) for t in ("probe_qk", "probe_pv")])
    results = {}
    for tag in kernels:
        if tag.startswith("probe"):
            continue
        results[tag] = check_variant(tag, kernels[tag], log, big=(tag in ("d128_nc", "d128_c")))
    n_ok = sum(ok for ok, _ in results.values())
    log(f"correctness: {n_ok}/{len(results)} variants ok, probes {'ok' if probes_ok else 'FAIL'}")
    rows = []
    if args.bench and (n_ok == len(results) or args.bench_anyway):
        rows = bench(kernels, log, {"d128_nc": ["d128_nc_nopp", "d128_nc_noemu", "d128_nc_thr0"],
                                    "d128_c": ["d128_c_noemu", "d128_c_onepertask"], "d64_nc": ["d64_nc_noemu"],
                                    "d64_c": ["d64_c_noemu"], "d128_c_gqa4": ["d128_c_gqa4_noemu"],
                                    "d128_nc_gqa4": ["d128_nc_gqa4_noemu"]})
    log("\n== correctness ==")
    for tag, (ok, worst) in results.items():
        log(f"{tag:22s} {'ok  ' if ok else 'FAIL'} worst rel err {worst:.2e}")
    if rows:
        log("\n== TFLOP/s (bf16, median of do_bench) ==")
        log(f"{'B':>3} {'S':>6} {'Hq/Hkv':>7} {'D':>4} {'causal':>6} {'fa4gen':>7} {'cuDNN':>7} {'flash':>7} {'/cuDNN':>7}  variants")
        for B, S, Hq, Hkv, D, causal, r, ex in rows:
            ratio = r["fa4gen"] / r["cudnn"] if r.get("cudnn") == r.get("cudnn") and r.get("cudnn") else float("nan")
            log(f"{B:>3} {S:>6} {Hq:>3}/{Hkv:<3} {D:>4} {str(causal):>6} {r['fa4gen']:7.0f} {r.get('cudnn', float('nan')):7.0f} "
                f"{r.get('flash', float('nan')):7.0f} {ratio:7.2f}  " + " ".join(f"{n}={v:.0f}" for n, v in ex.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prebuild")
    p.add_argument("--out", default=".devbuild")
    r = sub.add_parser("run")
    r.add_argument("--cubins", default=None)
    r.add_argument("--log", default=None)
    r.add_argument("--no-bench", dest="bench", action="store_false")
    r.add_argument("--bench-anyway", action="store_true")
    args = ap.parse_args()
    {"prebuild": cmd_prebuild, "run": cmd_run}[args.cmd](args)


if __name__ == "__main__":
    main()
