#!/usr/bin/env python3
"""Head sizes beyond 64 / 128 on sm_90a: fa4gen against cuDNN (torch SDPA) and FA4-CuTe, same run.

    python3 -m bench.head_dims [--pairs 192,128 [256,256 ...]] [--quick] [--rounds 3] [--out FILE.json]

Pairs: every (D, DV) that sm_90a generates (fa4gen.spec.config.HEAD_DIM_PAIRS), or --pairs; with --quick
and no --pairs, those bench.attention does not time (its SHAPES have D = DV in 64 / 128).
Shapes (`shapes()`), bf16, Sq = Skv = S: S 1k-32k at 16k tokens (B = 16384 // S; B 1 at 32k), causal and
not, 16/16 heads (16/2 at D 256, Qwen3.5-like); at (192, 128) also DeepSeek-V3's 128/128 heads at S 4k.
--quick: S 4k non-causal, S 16k causal and the 128-head row (3 shapes at (192, 128); ~1 min on an H200).

Contenders alternate (bench.attention.interleaved_ms: --rounds rounds of triton do_bench medians):
`fa4gen` (fa4gen.attention: validation, allocation and launch), `fa4gen_kernel` (the loaded Kernel into a
preallocated O), `cudnn` (SDPA under SDPBackend.CUDNN_ATTENTION; GQA through enable_gqa, else K/V
expanded) and `fa4cute` (flash-attn-4's sm_90 flash_attn_func, when scripts/fa4_peer.sh brought it;
its first call per variant JIT-compiles, untimed). A contender that refuses a shape (cuDNN may refuse
D != DV) says why in one line, in the row's `notes`. TFLOP/s = 2 * B * Hq * Sq * Skv * (D + DV) / time,
halved for causal. Each output's max abs difference from fa4gen.attention's is printed and recorded.
Writes --out (default bench/results/<UTC time>_<gpu>_head_dims.json; copied to $OUT when set) after
every shape and prints a markdown table. A pair fa4gen does not generate (a planned D = 256 named in
--pairs) runs too: fa4gen's refusal goes to `notes`, the peers are timed.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import (SHAPES, _fa4cute, _one_line, _sdpa, _write, environment,  # noqa: E402
                             interleaved_ms, load_fa4cute, result_path, tflops)
from fa4gen.spec.config import HEAD_DIM_PAIRS  # noqa: E402

PAIRS = HEAD_DIM_PAIRS["sm_90a"]
TOKENS = 16384
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK = ((4096, False), (16384, True))  # (S, causal) of the --quick sweep
HEADS = {256: (16, 2)}  # (Hq, Hkv) by D where not 16/16
WIDE = {(192, 128): (128, 128, 4096)}  # (Hq, Hkv, S) of a pair's model-sized row (DeepSeek-V3: 128 heads)
IMPLS = ("fa4gen", "fa4gen_kernel", "cudnn", "fa4cute")
DEVICE = "cuda"


def default_pairs(quick: bool) -> tuple[tuple[int, int], ...]:
    timed_elsewhere = {(s[4], s[4]) for s in SHAPES}
    return tuple(p for p in PAIRS if not (quick and p in timed_elsewhere))


def shapes(pairs, quick: bool = False) -> list[tuple[int, int, int, int, int, int, bool]]:
    """(B, S, Hq, Hkv, D, DV, causal) rows, pair by pair."""
    sweep = QUICK if quick else tuple((s, c) for c in (False, True) for s in LENGTHS)
    rows = []
    for d, dv in pairs:
        hq, hkv = HEADS.get(d, (16, 16))
        rows += [(max(1, TOKENS // s), s, hq, hkv, d, dv, c) for s, c in sweep]
        if (d, dv) in WIDE:
            hq, hkv, s = WIDE[(d, dv)]
            rows += [(max(1, TOKENS // s), s, hq, hkv, d, dv, c) for c in ((True,) if quick else (False, True))]
    return rows


def shape_tflops(shape, ms: float) -> float:
    """TFLOP/s of one row at `ms`: 2 * B * Hq * S * S * (D + DV), halved for causal (bench.attention's
    4 * ... * D with D the mean of D and DV)."""
    b, s, hq, _, d, dv, causal = shape
    return tflops(b, hq, s, s, (d + dv) / 2, causal, ms)


def cudnn_reasons(messages) -> list[str]:
    """SDPA's reasons for refusing cuDNN: the warnings after its "CuDNN attention kernel not used because:"
    until the next backend's header, first lines only."""
    out, inside = [], False
    for m in messages:
        line = (m.strip().splitlines() or [""])[0]
        if "kernel not used because" in line:
            inside = line.lower().startswith("cudnn")
        elif inside:
            out.append(line)
    return out


def _pair(text: str) -> tuple[int, int]:
    try:
        d, dv = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D,DV (e.g. 192,128), got {text!r}") from None
    return d, dv


def run_shape(shape, fa4cute, rounds: int, warmup_ms: int, rep_ms: int) -> dict:
    import torch

    import fa4gen
    from fa4gen.runtime import api

    b, s, hq, hkv, d, dv, causal = shape
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    q, k = (torch.randn(b, s, h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen) for h in (hq, hkv))
    v = torch.randn(b, s, hkv, dv, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    row = dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d, DV=dv, causal=causal, dtype="bf16")
    fns, outs, notes = {}, {}, {}
    with torch.no_grad():
        try:
            outs["fa4gen"] = fa4gen.attention(q, k, v, causal=causal)
            fns["fa4gen"] = lambda: fa4gen.attention(q, k, v, causal=causal)
            cfg = api.config_for(api.last_call_info().problem)
            kernel, _ = api.get_kernel(cfg, q.device)
            o = torch.empty(b, s, hq, dv, device=DEVICE, dtype=q.dtype)
            fns["fa4gen_kernel"] = lambda: kernel(q, k, v, o, softmax_scale=d ** -0.5)
            fns["fa4gen_kernel"]()
            outs["fa4gen_kernel"] = o
            row["fa4gen_block_m"] = cfg.block_m
        except Exception as e:  # noqa: BLE001 - a refused shape is a result
            notes["fa4gen"] = _one_line(e)
        with warnings.catch_warnings(record=True) as caught:  # SDPA says why a backend refused in warnings
            warnings.simplefilter("always")
            fn, out, note = _sdpa("cudnn", q, k, v, causal)
        if fn is None:
            note = "; ".join(dict.fromkeys([*note.split("; "), *cudnn_reasons([str(w.message) for w in caught])]))[:400]
        if note:
            notes["cudnn"] = note
        if fn is not None:
            fns["cudnn"], outs["cudnn"] = fn, out
        if fa4cute is not None:
            try:
                fn, out, first_s = _fa4cute(fa4cute, q, k, v, causal)
                fns["fa4cute"], outs["fa4cute"] = fn, out
                row["fa4cute_first_call_s"] = round(first_s, 3)
            except Exception as e:  # noqa: BLE001
                notes["fa4cute"] = _one_line(e)
        torch.cuda.synchronize()
        if "fa4gen" in outs:
            for name, out in outs.items():
                if name != "fa4gen":
                    row[f"{name}_max_abs_diff"] = (out.float() - outs["fa4gen"].float()).abs().max().item()
        timed = interleaved_ms(fns, rounds, warmup_ms, rep_ms) if fns else {}
    for name in IMPLS:
        ms, spread = timed.get(name, (None, None))
        row[f"{name}_ms"] = round(ms, 5) if ms else None
        row[f"{name}_spread"] = spread
        row[f"{name}_tflops"] = round(shape_tflops(shape, ms), 1) if ms else None
    if notes:
        row["notes"] = notes
    q = k = v = fns = outs = None  # frees the inputs and outputs before empty_cache
    torch.cuda.empty_cache()
    return row


def markdown(rows) -> str:
    def cell(x, fmt="{:.0f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(r, peer):
        a, b = r.get("fa4gen_kernel_tflops"), r.get(f"{peer}_tflops")
        return f"{a / b:.2f}" if a and b else "—"

    lines = ["| B, S, Hq/Hkv | D, DV | causal | fa4gen | fa4gen kernel | cuDNN | FA4-CuTe | kernel/cuDNN | "
             "kernel/FA4-CuTe | max diff cuDNN / FA4-CuTe |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']}, {r['S']}, {r['Hq']}/{r['Hkv']} | {r['D']}, {r['DV']} | {'yes' if r['causal'] else 'no'} | "
                     + " | ".join(cell(r[f"{n}_tflops"]) for n in IMPLS)
                     + f" | {ratio(r, 'cudnn')} | {ratio(r, 'fa4cute')} | "
                     f"{cell(r.get('cudnn_max_abs_diff'), '{:.3g}')} / {cell(r.get('fa4cute_max_abs_diff'), '{:.3g}')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", type=_pair, metavar="D,DV",
                    help=f"head-dim pairs (default: sm_90a's, {', '.join(f'{d},{dv}' for d, dv in PAIRS)})")
    ap.add_argument("--quick", action="store_true", help="S 4k and S 16k causal per pair, the wide row causal")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--no-fa4cute", action="store_true", help="leave the FA4-CuTe peer out even if installed")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import time

    import torch

    if not torch.cuda.is_available():
        print("bench.head_dims: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    pairs = tuple(a.pairs) if a.pairs else default_pairs(a.quick)
    rows_todo = shapes(pairs, a.quick)
    env = environment(["-m", "bench.head_dims", *argv])
    fa4cute, info = (None, {"status": "left out (--no-fa4cute)"}) if a.no_fa4cute else load_fa4cute()
    print(f"fa4cute: {info['status']}; pairs {pairs}, {len(rows_todo)} shapes", flush=True)
    path = a.out or result_path(ROOT / "bench" / "results", env, "head_dims")
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**env, "fa4cute": info, "pairs": [list(p) for p in pairs], "quick": a.quick,
              "timing": f"interleaved, {a.rounds} rounds of triton do_bench median (warmup {a.warmup_ms} ms, "
                        f"rep {a.rep_ms} ms)", "complete": False, "results": []}
    for i, shape in enumerate(rows_todo):
        row = run_shape(shape, fa4cute, a.rounds, a.warmup_ms, a.rep_ms)
        result["results"].append(row)
        result["complete"] = i == len(rows_todo) - 1
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        _write(path, result)
        print(f"  {shape}: " + ", ".join(f"{n} {row[f'{n}_tflops']}" for n in IMPLS) + " TFLOP/s; max abs diff vs "
              "fa4gen: " + ", ".join(f"{n} {row.get(f'{n}_max_abs_diff')}" for n in IMPLS[1:])
              + (f"  notes: {row['notes']}" if "notes" in row else ""), flush=True)
    print()
    print(markdown(result["results"]))
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
