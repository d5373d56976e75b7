#!/usr/bin/env python3
"""Sweep sm_90a kernel knobs on the GPU: which config of the same IR is fastest per shape.

    python3 -m bench.tune_sm90 [--shapes issue14|all] [--rounds 5] [--out FILE.json]

Knobs (all fields of KernelConfig that the sm_90a kernel reads): emu_pairs (exponentials per 16
on the FMA cubic instead of MUFU), emu_start, kv_stages (K/V ring depth, as far as SMEM allows),
rescale_threshold. For each shape every candidate is built (fa4gen.runtime.api.get_kernel: IR, verify,
lower, assemble) and timed into a preallocated output, candidates interleaved for `--rounds`
rounds of triton's do_bench (median of each); the JSON lists median ms, TFLOP/s, the spread and
the max |difference| to the default config's output per candidate. Nothing here changes a
default: it measures, a person decides (and records the decision where the default lives).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import SHAPES, environment, interleaved_ms, shape_dtype, tflops  # noqa: E402

ISSUE14 = ((4, 4096, 32, 32, 64, False), (4, 4096, 32, 32, 64, True), (1, 32768, 16, 16, 128, True),
           (2, 8192, 16, 16, 128, False, "fp16"), (2, 8192, 16, 16, 128, False), (16, 1024, 16, 16, 128, False))
# --shapes d64: the 192- and 128-row tiles (block_m) against each other and the exp2 split, D = 64
D64 = ((4, 4096, 32, 32, 64, False), (4, 4096, 32, 32, 64, True), (2, 8192, 32, 8, 64, False),
       (2, 8192, 32, 8, 64, True), (16, 1024, 16, 16, 64, True), (4, 4096, 32, 32, 64, False, "fp16"))


def candidates(d: int, tiles: bool = False):
    out = []
    if tiles:  # D = 64: both tiles x the exp2 split x the K/V ring
        for rows, pairs, stages in itertools.product((192, 128), (0, 1, 2, 3), (3, 4)):
            out.append(dict(block_m=rows, emu_pairs=pairs, emu_start=None, kv_stages=stages, rescale_threshold=8.0))
        return out
    for pairs, start, stages, thr in itertools.product((0, 1, 2, 3), (None,), (2, 3, 4), (8.0,)):
        out.append(dict(emu_pairs=pairs, emu_start=start, kv_stages=stages, rescale_threshold=thr))
    for thr in (6.0, 10.0):
        out.append(dict(emu_pairs=0, emu_start=None, kv_stages=3, rescale_threshold=thr))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=("issue14", "all", "d64"), default="issue14")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig

    from fa4gen.spec.tiles import q_tile_rows

    shapes = {"issue14": ISSUE14, "all": SHAPES, "d64": D64}[a.shapes]
    tiles = a.shapes == "d64"
    rows = []
    for shape in shapes:
        b, s, hq, hkv, d, causal = shape[:6]
        dt_name = shape_dtype(shape, "bf16")
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt_name]
        gen = torch.Generator(device="cuda").manual_seed(7)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt, generator=gen) for h in (hq, hkv, hkv))
        sc = d ** -0.5
        base = dict(arch="sm_90a", head_dim=d, dtype=dt_name, causal=causal, gqa_ratio=hq // hkv)
        default = KernelConfig(**base, block_m=q_tile_rows("sm_90a", d, hq // hkv))  # what fa4gen.attention runs
        kernels, skipped = {}, {}
        for knobs in candidates(d, tiles):
            try:
                cfg = KernelConfig(**{**base, "block_m": default.block_m, **knobs})
                kern, _ = api.get_kernel(cfg, q.device)
            except Exception as e:  # a knob this shape or SMEM refuses: listed, not fatal
                skipped[json.dumps(knobs)] = str(e)[:160]
                continue
            kernels[json.dumps(knobs)] = (cfg, kern, torch.empty_like(q))
        for _, kern, o in kernels.values():
            kern(q, k, v, o, softmax_scale=sc)
        torch.cuda.synchronize()
        # outputs are compared with the default config's (the first candidate's if the default is refused)
        default_key = next((key for key, (cfg, _, _) in kernels.items() if cfg == default), None)
        first = json.dumps(candidates(d, tiles)[0])
        ref_key = default_key or (first if first in kernels else None)
        ref = kernels[ref_key][2] if ref_key else None
        timed = interleaved_ms({key: (lambda kern=kern, o=o: kern(q, k, v, o, softmax_scale=sc))
                                for key, (_, kern, o) in kernels.items()}, a.rounds, 10, a.rep_ms)
        res = []
        for key, (cfg, _, o) in kernels.items():
            med, spread = timed[key]
            res.append(dict(knobs=json.loads(key), name=cfg.name, default=key == default_key, ms=med,
                            tflops=round(tflops(b, hq, s, s, d, causal, med), 1), spread=list(spread),
                            max_abs_diff_vs_default=None if ref is None else float((o.float() - ref.float()).abs().max())))
        res.sort(key=lambda r: r["ms"])
        dflt = next((r for r in res if r["default"]), None)
        rows.append(dict(shape=list(shape), candidates=res, skipped=skipped))
        best = res[0]
        print(f"  {shape}: default {dflt and dflt['tflops']} TFLOP/s; best {best['tflops']} {best['knobs']}; "
              f"top3 {[(r['tflops'], r['knobs'].get('block_m'), r['knobs']['emu_pairs'], r['knobs']['kv_stages']) for r in res[:3]]}",
              flush=True)
        del q, k, v, kernels
        torch.cuda.empty_cache()
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%M%SZ}_tune_sm90a.json"
    env = environment(["-m", "bench.tune_sm90", *(argv or sys.argv[1:])])
    out.write_text(json.dumps({**env, "rounds": a.rounds, "rep_ms": a.rep_ms, "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
