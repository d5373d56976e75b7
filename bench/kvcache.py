"""Decode over a KV cache on the H200: achieved K/V read bandwidth of fa4gen.attention_with_kvcache
beside a plain torch read of a large tensor, cuDNN SDPA (contiguous cache) and FA4-CuTe
(flash_attn_func contiguous; flash_attn_varlen_func with page_table and seqused_k for paged), same run.

    python3 -m bench.kvcache [--out-dir DIR] [--shapes B:L,...] [--sq 1,4] [--layouts contig,p16,p64]
                             [--splits N]    (on the GPU machine; FA4-CuTe from /tmp/fa4/site if present)

Hq/Hkv 32/8, D 128, bf16. Bandwidth = the K and V bytes of the valid keys (2 * B * L * Hkv * D * 2)
over the median time (triton do_bench: warm-up, L2 flushed between calls). fa4gen runs causal=True
(the Sq queries aligned to the end of the cache); the peers run non-causal (SDPA's is_causal aligns
top-left, wrong for Sq < Skv); with Sq = 1 both are the same computation, with Sq = 4 the causal mask
hides 6 of the 4L (query, key) pairs. The fa4gen columns: `api` (the whole call: validation, split
choice, partial buffers, kernel + combine) and `kernel` (Kernel.kvcache with preallocated buffers).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HQ, HKV, D = 32, 8, 128
SHAPES = ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768), (8, 131072), (64, 4096), (64, 32768),
          (64, 131072))


def _tbps(nbytes, ms):
    return round(nbytes / (ms * 1e-3) / 1e12, 3) if ms else None


def _capture(torch, fn, calls, flush):
    """(a CUDA graph of `calls` x (an L2 flush, fn), None) or (None, why not); fn None: the flushes alone."""
    from bench.attention import capture_graph

    try:
        return capture_graph(torch, fn, calls, flush), None
    except Exception as e:  # a contender that cannot be captured says why
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def timed_rounds(torch, fns, calls, flush, rounds, warmup_ms, rep_ms, timer, interleaved):
    """Every contender timed eagerly, then replayed from a CUDA graph of `calls` x (an L2 flush, call),
    both in `rounds` interleaved rounds (bench.attention.interleaved_ms: the order rotates, so no
    contender always runs first after the previous shape's set-up); a graph of the flushes alone,
    timed in the same rounds, is subtracted, so every call starts from a cold L2 and none of the
    host's per-call cost is counted. Returns (eager ms, graph ms per call, notes) by name; calls = 0:
    no graph timing."""
    eager = {name: med for name, (med, _) in interleaved(fns, rounds, warmup_ms, rep_ms, timer=timer).items()}
    graph, notes, graphs = {}, {}, {}
    if calls:
        for name, fn in fns.items():
            g, why = _capture(torch, fn, calls, flush)
            if g is None:
                notes[name] = why
            else:
                graphs[name] = g
        flush_only, why = _capture(torch, None, calls, flush)
        if graphs and flush_only is not None:
            replays = {name: g.replay for name, g in graphs.items()}
            replays["_flush_only"] = flush_only.replay
            got = interleaved(replays, rounds, warmup_ms, rep_ms, timer=timer)
            only = got.pop("_flush_only")[0]
            graph = {name: max(med - only, 1e-6) / calls for name, (med, _) in got.items()}
        elif graphs:
            notes = {name: f"the flush-only graph failed: {why}" for name in fns}
    return eager, graph, notes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--shapes", default=None, help="B:L,... (default: B 1/8/64 x L 4k/32k/128k)")
    ap.add_argument("--sq", default="1,4")
    ap.add_argument("--layouts", default="contig,p16,p64")
    ap.add_argument("--splits", type=int, default=0, help="num_splits for fa4gen (0 = its choice)")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds per row, the contenders interleaved, each round starting one contender "
                         "later; each figure is the median over the rounds (default 3)")
    ap.add_argument("--graph-calls", type=int, default=20,
                    help="also time each contender replayed from a CUDA graph of this many calls (0: skip): "
                         "the GPU time without the host's per-call cost, which bounds the small shapes")
    args = ap.parse_args(argv)
    import torch

    from bench.attention import _median_ms, _sdpa, environment, interleaved_ms, load_fa4cute
    from fa4gen.runtime import api
    from fa4gen.spec.config import KernelConfig

    env = environment(["bench/kvcache.py", *(argv if argv is not None else sys.argv[1:])])
    fa4, info = load_fa4cute()
    fa4_varlen = None
    if fa4 is not None:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4_varlen
    shapes = SHAPES if args.shapes is None else tuple(tuple(int(x) for x in s.split(":")) for s in args.shapes.split(","))
    sqs = [int(x) for x in args.sq.split(",")]
    layouts = args.layouts.split(",")
    dt = torch.bfloat16
    rows = []
    # a plain read of a large tensor: the achievable bandwidth in this run
    big = torch.empty(512 << 20, dtype=torch.float32, device="cuda").normal_()  # 2 GiB
    ms = _median_ms(lambda: big.sum(), args.warmup_ms, args.rep_ms)
    torch_read = _tbps(big.numel() * 4, ms)
    big = None
    l2_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than the L2

    def flush():
        l2_buf.zero_()
    print(f"torch read of 2 GiB: {torch_read} TB/s", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    path = out / f"{stamp}_kvcache.json"

    def write():  # after every row: a late failure keeps the rows measured before it
        path.write_text(json.dumps({**env, "fa4cute": info, "torch_read_TBps": torch_read, "hq": HQ, "hkv": HKV,
                                    "timing": f"median of {args.rounds} interleaved round(s), the order rotated "
                                              f"each round, after every contender's first call",
                                    "head_dim": D, "rows": rows}, indent=1))
    for b, length in shapes:
        for layout in layouts:
            ps = 0 if layout == "contig" else int(layout[1:])
            torch.cuda.empty_cache()
            gen = torch.Generator(device="cuda").manual_seed(b * 1000003 + length)
            if ps:
                npages_seq = -(-length // ps)
                num_pages = b * npages_seq
                kc = torch.empty(num_pages, ps, HKV, D, device="cuda", dtype=dt).normal_(generator=gen)
                vc = torch.empty_like(kc).normal_(generator=gen)
                perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
                pt = perm.view(b, npages_seq).contiguous()
            else:
                kc = torch.empty(b, length, HKV, D, device="cuda", dtype=dt).normal_(generator=gen)
                vc = torch.empty_like(kc).normal_(generator=gen)
                pt = None
            seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
            nbytes = 2 * b * length * HKV * D * 2
            for sq in sqs:
                q = torch.empty(b, sq, HQ, D, device="cuda", dtype=dt).normal_(generator=gen)
                row = {"batch": b, "cache_len": length, "sq": sq, "layout": layout, "kv_bytes": nbytes}
                cfg = KernelConfig(arch="sm_90a", head_dim=D, causal=True, gqa_ratio=HQ // HKV, kvcache=True,
                                   page_size=ps)
                kern, _ = api.get_kernel(cfg)
                cap = length if not ps else pt.shape[1] * ps
                S = args.splits or kern.kvcache_num_splits(b, HKV, sq, cap)
                row["num_splits"] = S
                o = torch.empty_like(q)
                rws = b * sq * HQ
                op = torch.empty(S, rws, D, device="cuda", dtype=torch.float32) if S > 1 else None
                lp = torch.empty(S, rws, device="cuda", dtype=torch.float32) if S > 1 else None
                fns = {
                    "fa4gen_kernel": lambda: kern.kvcache(q, kc, vc, o, seqlens, pt, num_splits=S, o_partial=op,
                                                          lse_partial=lp),
                    "fa4gen_api": lambda: api.attention_with_kvcache(q, kc, vc, seqlens, page_table=pt,
                                                                     num_splits=args.splits),
                }
                if not ps:
                    try:
                        fn, _, why = _sdpa("cudnn", q, kc, vc, False)
                    except torch.OutOfMemoryError as e:  # its kv-heads-expanded fallback on the largest caches
                        fn, why = None, f"OutOfMemoryError: {str(e).splitlines()[0][:120]}"
                        torch.cuda.empty_cache()
                    if fn is not None:
                        fns["cudnn"] = fn
                    if why:
                        row["cudnn_note"] = why
                if fa4 is not None:
                    try:
                        if ps:
                            def f4(q=q):
                                return fa4_varlen(q, kc, vc, seqused_k=seqlens, page_table=pt, causal=False)
                        else:
                            def f4(q=q):
                                return fa4(q, kc, vc, causal=False)
                        t0 = time.perf_counter()
                        f4()
                        torch.cuda.synchronize()
                        row["fa4cute_first_call_s"] = round(time.perf_counter() - t0, 2)
                        fns["fa4cute"] = f4
                    except Exception as e:  # a peer that refuses the shape says why
                        row["fa4cute_note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                # correctness of the timed configuration against SDPA in fp32 (first batch entry)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[:1].transpose(1, 2).float(),
                    (kc[pt[0].long()].reshape(1, -1, HKV, D)[:, :length] if ps else kc[:1]).transpose(1, 2).float(),
                    (vc[pt[0].long()].reshape(1, -1, HKV, D)[:, :length] if ps else vc[:1]).transpose(1, 2).float(),
                    enable_gqa=True, is_causal=False, attn_mask=None if sq == 1 else
                    torch.ones(sq, length, device="cuda", dtype=torch.bool).tril(length - sq))
                got = api.attention_with_kvcache(q, kc, vc, seqlens, page_table=pt, num_splits=args.splits)
                row["max_diff_vs_fp32"] = round((got[:1].float() - ref.transpose(1, 2)).abs().max().item(), 5)
                for f in fns.values():  # every first call before any timing
                    f()
                torch.cuda.synchronize()
                eager, graph, gnotes = timed_rounds(torch, fns, args.graph_calls, flush, max(args.rounds, 1),
                                                    args.warmup_ms, args.rep_ms, _median_ms, interleaved_ms)
                for name in fns:
                    row[f"{name}_us"] = round(eager[name] * 1e3, 2)
                    row[f"{name}_TBps"] = _tbps(nbytes, eager[name])
                    if name in graph:
                        row[f"{name}_graph_us"] = round(graph[name] * 1e3, 2)
                        row[f"{name}_graph_TBps"] = _tbps(nbytes, graph[name])
                    elif name in gnotes:
                        row[f"{name}_graph_note"] = gnotes[name]
                for sfx in ("", "_graph"):
                    peers = [row.get(f"{k}{sfx}_TBps") for k in ("cudnn", "fa4cute") if row.get(f"{k}{sfx}_TBps")]
                    if peers and row.get(f"fa4gen_kernel{sfx}_TBps"):
                        row[f"kernel_vs_best_peer{sfx}"] = round(row[f"fa4gen_kernel{sfx}_TBps"] / max(peers), 3)
                    if peers and row.get(f"fa4gen_api{sfx}_TBps"):
                        row[f"api_vs_best_peer{sfx}"] = round(row[f"fa4gen_api{sfx}_TBps"] / max(peers), 3)
                rows.append(row)
                write()
                print(json.dumps(row), flush=True)
            kc = vc = pt = None
    write()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
