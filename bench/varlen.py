"""Varlen throughput (issue 12): fa4gen's varlen kernel on ragged batches, beside fa4gen's dense kernel
at equal work and FA4-CuTe's flash_attn_varlen_func, same run, same GPU.

    python -m bench.varlen [--out-dir DIR] [--only 0,3] [--budget-s 200]
    python -m bench.varlen --model     # each mix's tiles' bound on kernel / dense, no GPU

Mixes (seeded, deterministic; 32768 tokens each): `uniform`, lengths uniform in [1, 8192]; `heavy`,
a heavy-tailed mix (85% of sequences log-uniform in [16, 512], 15% in [2048, 8192]). Each at H 16
(Hq = Hkv), D 128 and 64, causal and not, bf16.

TFLOP/s count only the real work: sum over sequences of 4 * Lq * Lk * H * D (causal: the visible
pairs, Lq * Lk - Lq * (Lq - 1) / 2 for Lq = Lk). `dense (equal work)` runs fa4gen's dense kernel on
B x S with the same tokens and the same FLOPs: S = sum L^2 / sum L rounded to 64, B = tokens / S.
`fa4gen` times fa4gen.attention_varlen (validation, allocation, launch); `fa4gen_kernel` the loaded
kernel it runs (its Q tile rows, tiles.q_tile_rows with the mix's longest sequence, in `tile`) into a
preallocated output; beside a 192-row kernel, `fa4gen_m128` the same generator's 128-row one. The
dense kernel at equal work is the one fa4gen.attention runs at B x S. Every implementation's O is compared with fa4gen's (max |diff|).
`tiles' bound` (tile_bound): the kernel / dense ratio at equal work that part-filled tiles alone allow.
Timing: triton do_bench median (bench.attention._median_ms), every contender's first call first; then
they alternate for --rounds rounds, each round starting one contender later
(bench.attention.interleaved_ms: median over the rounds, min/max over median recorded as `*_spread`).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

from bench.attention import ROOT, _one_line, _write, environment, interleaved_ms, load_fa4cute, result_path

TOKENS = 32768
HEADS = 16


def mix_lengths(kind: str, tokens: int = TOKENS, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(f"{kind}-{seed}")
    out, left = [], tokens
    while left > 0:
        if kind == "uniform":
            n = rng.randint(1, 8192)
        elif kind == "heavy":
            lo, hi = (16, 512) if rng.random() < 0.85 else (2048, 8192)
            n = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        else:
            raise ValueError(kind)
        n = min(n, left)
        out.append(n)
        left -= n
    return out


MIXES = tuple((kind, d, causal) for kind in ("uniform", "heavy") for d in (128, 64) for causal in (False, True))


def real_flop(lens, h, d, causal) -> float:
    pairs = sum(L * L - (L * (L - 1)) // 2 if causal else L * L for L in lens)
    return 4.0 * pairs * h * d


def equal_work_dense(lens) -> tuple[int, int]:
    """(B, S) with the mix's tokens and the same sum of L^2 (so the same FLOPs, causal or not)."""
    s = max(64, int(round(sum(L * L for L in lens) / sum(lens) / 64)) * 64)
    return max(1, round(sum(lens) / s)), s


def kernel_config(d: int, causal: bool, seqlen_q: int, varlen: bool = True):
    """The sm_90a kernel fa4gen's API runs on these mixes (H 16, bf16): the varlen one for a batch whose
    longest sequence is seqlen_q, or the dense one at Sq = seqlen_q, its Q tile rows by tiles.q_tile_rows."""
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    return KernelConfig(arch="sm_90a", head_dim=d, causal=causal, dtype="bf16", varlen=varlen,
                        block_m=q_tile_rows("sm_90a", d, 1, varlen=varlen, causal=causal, seqlen_q=seqlen_q))


def computed_pairs(lens, tile: int, block_n: int, causal: bool) -> int:
    """(query, key) pairs a kernel computes for sequences of these lengths (Lq = Lk) with Q tiles of
    `tile` rows and K/V blocks of `block_n` keys: every tile runs all its rows over every block it
    visits (schedule.tile_blocks: the causal and tail blocks in full), rows past the sequence end too."""
    from fa4gen.spec.schedule import tile_blocks

    return sum(int(tile_blocks(m, n, n, tile, causal, block_n=block_n)) * tile * block_n
               for n in lens for m in range(-(-n // tile)))


def tile_bound(lens, d: int, causal: bool) -> dict:
    """What the tiles alone allow the varlen kernel against the dense one at equal work: each side's
    real (query, key) pairs over the pairs its tiles compute (`computed_pairs`, the tiles and K/V
    blocks the API picks: tiles.q_tile_rows, plan.block_n), and their ratio, the kernel / dense
    TFLOP/s ratio if both computed pairs at the same rate. A varlen batch ends each sequence in a
    part-filled tile; the dense shape has B of them. Per-task costs (Q load, epilogue) and the deal's
    balance come on top."""
    from fa4gen.spec.plan import block_n

    b_eq, s_eq = equal_work_dense(lens)

    def side(seqs, varlen):
        cfg = kernel_config(d, causal, max(seqs), varlen)
        real = sum(n * n - (n * (n - 1)) // 2 if causal else n * n for n in seqs)
        return real / computed_pairs(seqs, cfg.block_m, block_n(cfg), causal), cfg.block_m

    (ev, tv), (ed, td) = side(lens, True), side([s_eq] * b_eq, False)
    return {"varlen_useful": round(ev, 4), "dense_useful": round(ed, 4), "varlen_tile": tv, "dense_tile": td,
            "bound": round(ev / ed, 3)}


H200_SMS, H200_L2_BYTES = 132, 50 * 2 ** 20


def deal_balance(lens, d: int, causal: bool, longest_first: bool = False, sms: int = H200_SMS,
                 l2_bytes: int = H200_L2_BYTES) -> float:
    """The dynamic deal's most loaded CTA over the ideal (1.0 = perfectly balanced) in a block-count
    model: the varlen kernel's tasks in the order the kernels decode them (schedule.varlen_tasks:
    sequences in batch order, heaviest m units first inside a causal sequence), each costing its K/V
    blocks plus one for its Q load and epilogue (schedule.cta_work's unit), handed to whichever of `sms`
    CTAs frees up first. longest_first: the same with the sequences sorted longest first (what a
    device-side sort of the batch would give; the kernels do not do it)."""
    import heapq

    from fa4gen.spec.plan import block_n
    from fa4gen.spec.schedule import tile_blocks, varlen_l2_rows, varlen_tasks

    seqs = sorted(lens, reverse=True) if longest_first else list(lens)
    cfg = kernel_config(d, causal, max(seqs))
    rows, keys = cfg.block_m, block_n(cfg)
    cu = [0, *itertools.accumulate(seqs)]
    tasks = varlen_tasks(cu, cu, cu[-1], cu[-1], HEADS, rows, causal, l2_rows=varlen_l2_rows(l2_bytes, d, 2))
    costs = [int(tile_blocks(m, ql, kl, rows, causal, block_n=keys)) + 1 for _, _, m, _, ql, _, kl in tasks]
    free = [0] * min(sms, len(costs))
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free) / (sum(costs) / len(free))


def run_mix(kind, d, causal, warmup_ms, rep_ms, fa4_varlen=None, rounds=3):
    import torch

    from fa4gen.runtime import api

    lens = mix_lengths(kind)
    total = sum(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    maxlen = max(lens)
    dt = torch.bfloat16
    q, k, v = (torch.randn(total, HEADS, d, device="cuda", dtype=dt) for _ in range(3))
    flop = real_flop(lens, HEADS, d, causal)
    row = {"mix": kind, "head_dim": d, "causal": causal, "heads": HEADS, "tokens": total, "sequences": len(lens),
           "max_len": maxlen, "real_tflop": round(flop / 1e12, 4)}
    ms, outs, notes, fns = {}, {}, {}, {}

    def tf(x):
        return round(flop / (x * 1e-3) / 1e12, 1) if x else None

    try:
        outs["fa4gen"] = api.attention_varlen(q, k, v, cu, cu, maxlen, maxlen, causal=causal)
        fns["fa4gen"] = lambda: api.attention_varlen(q, k, v, cu, cu, maxlen, maxlen, causal=causal)
        # the tile fa4gen.attention_varlen runs (tiles.q_tile_rows), and the 128-row kernel beside a 192-row one
        cfg = kernel_config(d, causal, maxlen)
        rows = row["fa4gen_block_m"] = cfg.block_m
        kernel, _ = api.get_kernel(cfg)
        o = torch.empty_like(q)
        fns["fa4gen_kernel"] = lambda: kernel.varlen(q, k, v, o, cu, cu, maxlen, maxlen, softmax_scale=d ** -0.5)
        if rows != 128:
            k128, _ = api.get_kernel(cfg.replace(block_m=128))
            o128 = torch.empty_like(q)
            k128.varlen(q, k, v, o128, cu, cu, maxlen, maxlen, softmax_scale=d ** -0.5)
            outs["fa4gen_m128"] = o128
            fns["fa4gen_m128"] = lambda: k128.varlen(q, k, v, o128, cu, cu, maxlen, maxlen, softmax_scale=d ** -0.5)
    except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
        notes["fa4gen"] = _one_line(e)
    b_eq, s_eq = equal_work_dense(lens)
    row["dense_shape"] = [b_eq, s_eq]
    row["tile_bound"] = tile_bound(lens, d, causal)
    try:
        qd, kd, vd = (torch.randn(b_eq, s_eq, HEADS, d, device="cuda", dtype=dt) for _ in range(3))
        cfg = kernel_config(d, causal, s_eq, varlen=False)
        row["dense_block_m"] = cfg.block_m
        dk, _ = api.get_kernel(cfg)
        od = torch.empty_like(qd)
        fns["dense"] = lambda: dk(qd, kd, vd, od, softmax_scale=d ** -0.5)
        dflop = 4.0 * b_eq * HEADS * s_eq * s_eq * d * ((s_eq + 1) / (2 * s_eq) if causal else 1.0)
    except Exception as e:  # noqa: BLE001
        notes["dense"] = _one_line(e)
    if fa4_varlen is not None:
        try:
            def fn():
                r = fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen, max_seqlen_k=maxlen,
                               causal=causal)
                return r[0] if isinstance(r, (tuple, list)) else r

            t0 = time.perf_counter()
            outs["fa4cute"] = fn()
            torch.cuda.synchronize()
            row["fa4cute_first_call_s"] = round(time.perf_counter() - t0, 2)
            fn()
            fns["fa4cute"] = fn
        except Exception as e:  # noqa: BLE001
            notes["fa4cute"] = _one_line(e)
    # every contender's first call is made; now they alternate, each round starting one later, so that
    # clock drift and the idle spells before a round fall on all alike
    for name, (med, spread) in interleaved_ms(fns, rounds, warmup_ms, rep_ms).items():
        ms[name] = med
        row[f"{name}_spread"] = spread
    if "dense" in ms:
        row["dense_kernel_tflops"] = round(dflop / (ms["dense"] * 1e-3) / 1e12, 1)
    for name in ("fa4gen", "fa4gen_kernel", "fa4gen_m128", "fa4cute"):
        row[f"{name}_ms"] = round(ms[name], 4) if name in ms else None
        row[f"{name}_tflops"] = tf(ms.get(name))
    if "fa4gen_m128" in outs and "fa4gen" in outs:
        row["max_diff_m128"] = round((outs["fa4gen"].float() - outs["fa4gen_m128"].float()).abs().max().item(), 5)
    if "fa4gen" in outs and "fa4cute" in outs:
        row["max_diff_vs_fa4cute"] = round((outs["fa4gen"].float() - outs["fa4cute"].float()).abs().max().item(), 5)
    kt, dt_, ft = row["fa4gen_kernel_tflops"], row.get("dense_kernel_tflops"), row["fa4cute_tflops"]
    row["vs_dense"] = round(kt / dt_, 3) if kt and dt_ else None
    row["vs_fa4cute"] = round(kt / ft, 3) if kt and ft else None
    mt = row["fa4gen_m128_tflops"]
    row["vs_m128"] = round(kt / mt, 3) if kt and mt else None
    if notes:
        row["notes"] = notes
    return row


def markdown(rows) -> str:
    def c(x):
        return "-" if x is None else f"{x}"

    lines = ["| mix | D | causal | seqs (max) | tile | fa4gen | fa4gen kernel | 128-row kernel | dense, equal work (B x S) | "
             "FA4-CuTe varlen | kernel / dense | tiles' bound | kernel / FA4-CuTe |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mix']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['sequences']} "
                     f"({r['max_len']}) | {c(r.get('fa4gen_block_m'))} | {c(r['fa4gen_tflops'])} | "
                     f"{c(r['fa4gen_kernel_tflops'])} | {c(r.get('fa4gen_m128_tflops'))} | "
                     f"{c(r.get('dense_kernel_tflops'))} ({r['dense_shape'][0]} x {r['dense_shape'][1]}) | "
                     f"{c(r['fa4cute_tflops'])} | {c(r['vs_dense'])} | {c((r.get('tile_bound') or {}).get('bound'))} | "
                     f"{c(r['vs_fa4cute'])} |")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated indices into MIXES (default: all)")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new mix after this many seconds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per mix (default 3)")
    ap.add_argument("--no-fa4cute", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--model", action="store_true",
                    help="print each mix's tiles' bound (tile_bound: the kernel / dense ratio at equal work that "
                         "part-filled tiles alone allow) and the dynamic deal's balance (deal_balance, on the "
                         "H200's 132 SMs) and exit; needs no GPU")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    mixes = MIXES if not args.only else tuple(MIXES[int(i)] for i in args.only.split(","))
    if args.model:
        for kind, d, causal in mixes:
            lens = mix_lengths(kind)
            tb = tile_bound(lens, d, causal)
            b_eq, s_eq = equal_work_dense(lens)
            print(f"{kind:8s} D {d:3d} {'causal' if causal else 'full  '}: {len(lens)} sequences (max {max(lens)}), "
                  f"{tb['varlen_tile']}-row tiles, {tb['varlen_useful']:.3f} of computed pairs real; dense "
                  f"{b_eq} x {s_eq}, {tb['dense_tile']}-row tiles, {tb['dense_useful']:.3f}; kernel / dense bound "
                  f"{tb['bound']:.3f}; the deal's most loaded CTA / ideal {deal_balance(lens, d, causal):.3f} "
                  f"(sequences longest first: {deal_balance(lens, d, causal, longest_first=True):.3f})")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench.varlen: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    env = environment(["-m", "bench.varlen", *argv])
    fa4_varlen, info = (None, {"status": "left out (--no-fa4cute)"}) if args.no_fa4cute else load_fa4cute()
    if fa4_varlen is not None:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4_varlen
    print(f"  fa4cute: {info['status']}", flush=True)
    path = result_path(args.out_dir, env, "varlen")
    result = {**env, "suite": "varlen", "fa4cute": info, "tokens": TOKENS, "heads": HEADS, "dtype": "bf16",
              "timing": f"triton do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms; kernel, dense "
                        f"and fa4cute interleaved over {args.rounds} rounds",
              "complete": False, "results": []}
    for i, (kind, d, causal) in enumerate(mixes):
        if time.perf_counter() - t0 > args.budget_s:
            result["skipped"] = [list(m) for m in mixes[i:]]
            break
        row = run_mix(kind, d, causal, args.warmup_ms, args.rep_ms, fa4_varlen, args.rounds)
        result["results"].append(row)
        result["complete"] = i == len(mixes) - 1
        _write(path, result)
        print(f"  {kind} d{d} {'causal' if causal else 'full'}: kernel {row['fa4gen_kernel_tflops']}, dense "
              f"{row.get('dense_kernel_tflops')}, fa4cute {row['fa4cute_tflops']} TFLOP/s"
              + (f"  notes: {row['notes']}" if row.get("notes") else ""), flush=True)
    print()
    print(markdown(result["results"]))
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
