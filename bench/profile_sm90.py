#!/usr/bin/env python3
"""One fa4gen sm_90a launch of a shape, for a profiler to wrap (ncu / nsys):

    ncu --kernel-name fa4_fwd --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \\
        python3 -m bench.profile_sm90 4,4096,32,32,64 [--causal] [--dtype bf16] [--emu-pairs N] [--block-m R] [--cubin F]
        python3 -m bench.profile_sm90 --varlen heavy --head-dim 64 [--causal] [--cubin F]
        python3 -m bench.profile_sm90 2,8192,16,16,64 --peer fa4cute [--causal]   (ncu --kernel-name regex:flash)

Builds (or takes from the cache) the kernel, runs it twice (the first launch warms up and is
skipped by --launch-skip 1), synchronises. Prints the config name. `--peer fa4cute` launches
FA4-CuTe's flash_attn_func on the same dense tensors instead (bench.attention.load_fa4cute: the
unpacked wheels of scripts/fa4_peer.sh), for a profile of both kernels at one shape."""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", help="B,S,Hq,Hkv,D (dense)")
    ap.add_argument("--varlen", choices=("uniform", "heavy"), help="a bench/varlen.py length mix (16 heads) instead "
                                                                   "of a dense shape, through the varlen kernel")
    ap.add_argument("--head-dim", type=int, default=128, help="with --varlen: D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--emu-pairs", type=int, default=None)
    ap.add_argument("--block-m", default="auto", choices=("auto", "128", "192"),
                    help="Q tile rows; auto (default): what fa4gen.attention runs for the shape (tiles.q_tile_rows)")
    ap.add_argument("--cubin", help="launch this prebuilt cubin (fa4gen.load: <stem>.cubin + <stem>.json, e.g. an "
                                    "earlier generator's) in place of this generator's kernel")
    ap.add_argument("--peer", choices=("fa4cute",), help="launch this peer's kernel (dense shapes only) in place of "
                                                          "fa4gen's")
    a = ap.parse_args()
    if (a.shape is None) == (a.varlen is None):
        ap.error("give a dense shape B,S,Hq,Hkv,D or --varlen MIX")
    if a.peer and (a.varlen or a.cubin):
        ap.error("--peer runs a dense shape through the peer: not with --varlen or --cubin")
    import itertools

    import torch

    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    if a.varlen:
        from bench.varlen import HEADS, mix_lengths

        lens, d = mix_lengths(a.varlen), a.head_dim
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(sum(lens), HEADS, d, device="cuda", dtype=dt) for _ in range(3))
        hq = hkv = HEADS
    else:
        b, s, hq, hkv, d = (int(x) for x in a.shape.split(","))
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for h in (hq, hkv, hkv))
    if a.peer:
        from bench.attention import load_fa4cute

        fn, info = load_fa4cute()
        if fn is None:
            print(f"profile_sm90: FA4-CuTe {info['status']}", file=sys.stderr)
            return 2
        for _ in range(2):
            fn(q, k, v, causal=a.causal)
        torch.cuda.synchronize()
        print(f"fa4cute {info.get('flash-attn-4')} B,S,Hq,Hkv,D={a.shape} causal={a.causal}")
        return 0
    seqlen_q = max(lens) if a.varlen else s
    rows = (q_tile_rows("sm_90a", d, hq // hkv, varlen=bool(a.varlen), causal=a.causal, seqlen_q=seqlen_q)
            if a.block_m == "auto" else int(a.block_m))
    cfg = KernelConfig(arch="sm_90a", head_dim=d, dtype=a.dtype, causal=a.causal, gqa_ratio=hq // hkv,
                       emu_pairs=a.emu_pairs, varlen=bool(a.varlen), block_m=rows)
    if a.cubin:
        kern = api.load(a.cubin).kernel
        cfg = KernelConfig.from_dict(kern.manifest["config"])
    else:
        kern, _ = api.get_kernel(cfg, q.device)
    o = torch.empty_like(q)
    for _ in range(2):
        if a.varlen:
            kern.varlen(q, k, v, o, cu, cu, max(lens), max(lens), softmax_scale=d ** -0.5)
        else:
            kern(q, k, v, o, softmax_scale=d ** -0.5)
    torch.cuda.synchronize()
    print(cfg.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
