#!/usr/bin/env python3
"""Evidence for the sm_100a KV-cache kernels (CPU only; no Blackwell GPU exists here): for D 64/128 x
bf16/fp16 x causal x GQA 1/4/8 x page_size 0/16/64/256, one JSON line each: the IR verified
(codegen.build raises otherwise; both num_splits paths), `fa4gen check` of the module, ptxas -v
of the module (registers, spills and stack of both entries, warnings), simulate_kvcache against the
exact attention, and `fa4gen emulate` of the module (fa4_fwd + fa4_combine, fa4gen/ptxemu/kvcache.py)
on its default decode batches (3 splits with uneven / empty ones, a sequence of no key and one past the
capacity; 1 split; 2 splits without LSE) with 2 seeds.

    PYTHONPATH=. python scripts/kvcache_sm100_evidence.py PART NPARTS [--no-emulate]
"""
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fa4gen import codegen
from fa4gen.check import check_ptx
from fa4gen.config import KernelConfig
from fa4gen.reference import attention_exact, round_to_dtype
from fa4gen.schedule import kvcache_k_len, kvcache_page
from fa4gen.simulate import simulate_kvcache

ROOT = Path(__file__).resolve().parent.parent


def problem(cfg):
    """(B, Sq, Hkv, capacity, cache_seqlens): a partial block, a length past the capacity."""
    cap = 512 if cfg.page_size == 256 else 384
    return 2, 2, 2 if cfg.gqa_ratio == 1 else 1, cap, (300, cap + 50)


def simulate_ok(cfg, S=3) -> bool:
    B, sq, hkv, cap, lens = problem(cfg)
    rng = np.random.default_rng(0)
    hq, d = hkv * cfg.gqa_ratio, cfg.head_dim
    q = round_to_dtype(rng.standard_normal((B, sq, hq, d)), cfg.dtype)
    kc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), cfg.dtype)
    vc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), cfg.dtype)
    pt, kin, vin = None, kc, vc
    if cfg.page_size:
        ps, mp = cfg.page_size, cap // cfg.page_size
        pt = rng.permutation(B * mp).reshape(B, mp)
        kin = np.zeros((B * mp, ps, hkv, d), kc.dtype)
        vin = np.zeros_like(kin)
        for b in range(B):
            for i in range(mp):
                kin[pt[b, i]], vin[pt[b, i]] = kc[b, i * ps:(i + 1) * ps], vc[b, i * ps:(i + 1) * ps]
    res = simulate_kvcache(cfg, q, kin, vin, np.array(lens), pt, num_splits=S, num_ctas=2)
    if res.findings:
        return False
    for b, ln in enumerate(lens):
        kl = kvcache_k_len(ln, cap)
        o, lse = (np.asarray(x)[0] for x in attention_exact(q[b:b + 1], kc[b:b + 1, :kl], vc[b:b + 1, :kl], cfg.causal))
        fin = np.isfinite(lse)
        if not np.array_equal(np.isfinite(res.lse[b]), fin) or np.max(np.abs(res.o[b] - o)) > 2e-2:
            return False
        if fin.any() and np.max(np.abs(res.lse[b][fin] - lse[fin])) > 1e-3:
            return False
    return True


def main(argv):
    part, nparts = int(argv[0]), int(argv[1])
    emulate = "--no-emulate" not in argv
    from fa4gen.ptxemu import harness
    variants = list(itertools.product((64, 128), ("bf16", "fp16"), (False, True), (1, 4, 8), (0, 16, 64, 256)))
    for i, (d, dt, c, g, ps) in enumerate(variants):
        if i % nparts != part:
            continue
        cfg = KernelConfig(arch="sm_100a", kvcache=True, page_size=ps, causal=c, gqa_ratio=g, head_dim=d, dtype=dt)
        r = codegen.build(cfg, emit=("ptx",))  # verifies the IR (raises otherwise)
        ck = check_ptx(r.ptx, r.manifest).ok  # fa4_fwd against the IR, fa4_combine's static checks
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "k.ptx"
            p.write_text(r.ptx)
            out = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(p), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
            log = out.stdout + out.stderr
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
        spills = [tuple(map(int, s)) for s in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
        stacks = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
        rec = dict(name=cfg.name, verify=r.report.ok, verify_runs=r.report.runs, check=ck, ptxas_rc=out.returncode,
                   regs=regs, spills=spills, stack=stacks, ptxas_warning="warning" in log.lower(),
                   simulate=simulate_ok(cfg))
        if emulate:
            t = time.time()
            rep = harness.emulate_file("k.ptx", ptx_text=r.ptx, manifest=r.manifest, seeds=2)
            rec.update(emulate=rep.ok, emulate_runs=len(rep.runs), emu_s=round(time.time() - t, 1))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
