#!/usr/bin/env python3
"""Feasibility probe for issue 13 (decode): split-KV expressed with the varlen kernel, no new kernel.

    python3 scripts/decode_split_probe.py [--out-dir DIR]      (on the H200)

Decode (Sq = 1) reads the whole cache for one query per head. Each (batch, split) becomes one varlen
"sequence" of 1 query row and one slice of the cache's keys (cu_seqlens_k over the flattened
contiguous cache: no copy of K/V), so B * splits * Hkv tasks fill the SMs even at B = 1; the
partial outputs are merged by their LSE in torch. This times it beside fa4gen's dense (prefill)
kernel at Sq = 1, cuDNN SDPA and FA4-CuTe's flash_attn_func, same run, and reports the achieved
K/V read bandwidth. A probe, not the issue's kernel: the partial O is rounded to bf16 before the
merge (the real split-KV keeps fp32 partials) and the merge is torch, not a generated kernel.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ((1, 4096), (1, 131072), (8, 32768), (8, 131072), (64, 32768))
HQ, HKV, D = 32, 8, 128


def splits_for(b: int, length: int, sms: int) -> int:
    """Splits per sequence so that B * splits * Hkv tasks cover the SMs about twice, each split
    at least 4 K/V blocks."""
    want = max(1, -(-2 * sms // (b * HKV)))
    return max(1, min(want, length // 512))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    import torch

    from bench.attention import _median_ms, _sdpa, environment, load_fa4cute
    from fa4gen import api
    from fa4gen.config import KernelConfig

    env = environment(["scripts/decode_split_probe.py", *(argv or sys.argv[1:])])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fa4, info = load_fa4cute()
    kern, _ = api.get_kernel(KernelConfig(arch="sm_90a", head_dim=D, gqa_ratio=HQ // HKV, varlen=True))
    rows = []
    for b, length in SHAPES:
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * k.element_size()
        ns = splits_for(b, length, sms)
        step = -(-length // ns)
        step = -(-step // 128) * 128
        ns = -(-length // step)
        starts = [bb * length + min(s * step, length) for bb in range(b) for s in range(ns)]
        cu_k = torch.tensor(starts + [b * length], dtype=torch.int32, device="cuda")
        cu_q = torch.arange(0, b * ns + 1, dtype=torch.int32, device="cuda")
        q_rep = q[:, 0].repeat_interleave(ns, dim=0).contiguous()  # (B * ns, Hq, D)
        kf, vf = k.view(b * length, HKV, D), v.view(b * length, HKV, D)
        o_part = torch.empty_like(q_rep)
        lse = torch.empty(HQ, b * ns, device="cuda", dtype=torch.float32)

        def split_kernel():
            kern.varlen(q_rep, kf, vf, o_part, cu_q, cu_k, 1, step, lse=lse, softmax_scale=D ** -0.5)

        def split_all():
            split_kernel()
            lg = lse.view(HQ, b, ns)
            w = torch.softmax(lg, dim=-1)  # exp(lse_s - logsumexp(lse))
            return torch.einsum("hbs,bshd->bhd", w, o_part.view(b, ns, HQ, D).float()).to(q.dtype)

        row = {"batch": b, "cache_len": length, "splits": ns, "split_len": step}
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), enable_gqa=True)
        got = split_all()
        row["max_diff_vs_fp32"] = round((got.float() - ref[:, :, 0]).abs().max().item(), 5)
        fns = {"fa4gen_split_kernel": split_kernel, "fa4gen_split_with_merge": split_all,
               "fa4gen_dense": lambda: api.attention(q, k, v)}
        fn, _, why = _sdpa("cudnn", q, k, v, False)
        if fn is not None:
            fns["cudnn"] = fn
        if why:
            row["cudnn_note"] = why
        if fa4 is not None:
            fns["fa4cute"] = lambda: fa4(q, k, v, causal=False)
            fns["fa4cute"]()
        for name, f in fns.items():
            f()
            torch.cuda.synchronize()
            ms = _median_ms(f, 25, 100)
            row[f"{name}_TBps"] = round(nbytes / (ms * 1e-3) / 1e12, 3)
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_split_probe.json"
    path.write_text(json.dumps({**env, "fa4cute": info, "hq": HQ, "hkv": HKV, "head_dim": D, "rows": rows}, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
