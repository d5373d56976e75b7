"""Context-parallel (ring) attention on several GPUs: fa4gen.distributed.ring_attention, causal, zigzag
shards, one process per GPU (NCCL), against fa4gen.attention on the full sequence on one GPU.

    python3 -m bench.ring [--out-dir DIR] [--seqlens 131072,524288] [--world N] [--heads 32]
                          [--head-dim 128] [--reps 5] [--warmup 1] [--no-single]

B 1, Hq = Hkv = --heads, bf16. Per sequence length S (total), each of the N ranks holds S/N rows of
q, k and v. Timed per rank with CUDA events after a barrier, each repetition's time the slowest
rank's, the median over --reps after --warmup calls:

  ring     ring_attention (the call as a user makes it: descriptor exchange, ring, merge)
  compute  the same steps and merges without the transfers (every step attends the local K/V)
  comm     the transfers alone (N-1 ring rounds of the packed K/V shard, nothing computed)
  single   fa4gen.attention on the full sequence on GPU 0 (None when it does not fit)

TFLOP/s per GPU = 4 * B * H * S^2 * D / 2 (causal) / N / time. speedup = single / ring.
hidden = 1 - max(0, ring - compute) / comm: the fraction of the transfer time not added to the
compute time (1: fully overlapped; None for one GPU, which sends nothing).
Writes DIR/<UTC time>_<gpu>_ring_w<N>.json (default DIR bench/results; also copied to $OUT when set).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SEQLENS = (131072, 524288)


def causal_flop(b, h, s, d) -> float:
    return 4.0 * b * h * s * s * d * 0.5


def metrics(s, world, heads, head_dim, ring_ms, compute_ms=None, comm_ms=None, single_ms=None, batch=1) -> dict:
    """The derived numbers of one row (pure arithmetic, tested on CPU)."""
    flop = causal_flop(batch, heads, s, head_dim)
    row = {"tflops_per_gpu": round(flop / world / (ring_ms * 1e-3) / 1e12, 1) if ring_ms else None,
           "single_tflops": round(flop / (single_ms * 1e-3) / 1e12, 1) if single_ms else None,
           "speedup_vs_single": round(single_ms / ring_ms, 3) if single_ms and ring_ms else None,
           "scaling_efficiency": round(single_ms / ring_ms / world, 3) if single_ms and ring_ms else None,
           "hidden_comm_fraction": None, "exposed_comm_ms": None}
    if comm_ms and compute_ms is not None and ring_ms and world > 1:
        exposed = max(0.0, ring_ms - compute_ms)
        row["exposed_comm_ms"] = round(exposed, 3)
        row["hidden_comm_fraction"] = round(min(1.0, max(0.0, 1.0 - exposed / comm_ms)), 3)
    if comm_ms and world > 1:
        step_bytes = 2 * batch * (s // world) * heads * head_dim * 2  # k and v, bf16
        row["comm_GBps_per_link"] = round(step_bytes * (world - 1) / (comm_ms * 1e-3) / 1e9, 1)
    return row


def _timed(torch, dist, fn, warmup, reps):
    """Median over reps of the slowest rank's time of fn (ms), after warmup calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), times


def _measure_ring(torch, dist, fd, dev, rank, world, s, h, d, args, row):
    """ring (and, for world > 1, compute-only and comm-only) times of this rank's shards into row."""
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    q, k, v = (torch.randn(1, s // world, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    ring_ms, ring_all = _timed(torch, dist, lambda: fd.ring_attention(q, k, v, causal=True), args["warmup"],
                               args["reps"])
    row["ring_ms"], row["ring_ms_all"] = round(ring_ms, 3), [round(t, 3) for t in ring_all]
    if world > 1:
        c_ms, _ = _timed(torch, dist, lambda: fd._ring(q, k, v, None, True, None, False, check_ranks=False,
                                                        communicate=False), args["warmup"], args["reps"])
        m_ms, _ = _timed(torch, dist, lambda: fd._ring(q, k, v, None, True, None, False, check_ranks=False,
                                                        compute=False), args["warmup"], args["reps"])
        row["compute_ms"], row["comm_ms"] = round(c_ms, 3), round(m_ms, 3)


def _single(torch, fa4gen, dev, s, h, d, args):
    """fa4gen.attention on the full sequence on this GPU: (median ms, all ms)."""
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    for _ in range(args["warmup"]):
        fa4gen.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(args["reps"]):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fa4gen.attention(q, k, v, causal=True)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), ts


def _worker(rank, world, init_file, out_file, args):
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=900), device_id=dev)
        import fa4gen
        from fa4gen import distributed as fd

        h, d = args["heads"], args["head_dim"]
        rows = []
        for s in args["seqlens"]:
            row = {"seqlen": s, "world": world, "batch": 1, "heads_q": h, "heads_kv": h, "head_dim": d,
                   "causal": True, "dtype": "bf16", "notes": []}
            if s % (2 * world):
                row["notes"].append(f"S {s} not divisible by 2 x {world}: skipped")
                rows.append(row)
                continue
            with torch.no_grad():
                _measure_ring(torch, dist, fd, dev, rank, world, s, h, d, args, row)
                torch.cuda.empty_cache()
                single_ms = None
                if not args["no_single"]:
                    if rank == 0:
                        try:
                            single_ms, ts = _single(torch, fa4gen, dev, s, h, d, args)
                            row["single_ms_all"] = [round(t, 3) for t in ts]
                        except torch.cuda.OutOfMemoryError as e:
                            row["notes"].append(f"single GPU: out of memory ({str(e).splitlines()[0][:120]})")
                        torch.cuda.empty_cache()
                    dist.barrier()
                row["single_ms"] = round(single_ms, 3) if single_ms else None
            row.update(metrics(s, world, h, d, row["ring_ms"], row.get("compute_ms"), row.get("comm_ms"), single_ms))
            if rank == 0:
                print(f"  S {s:>7} x{world}: ring {row['ring_ms']} ms ({row['tflops_per_gpu']} TFLOP/s/GPU), "
                      f"compute {row.get('compute_ms')} ms, comm {row.get('comm_ms')} ms, hidden "
                      f"{row['hidden_comm_fraction']}; single {row['single_ms']} ms ({row['single_tflops']} TFLOP/s), "
                      f"speedup {row['speedup_vs_single']}", flush=True)
            rows.append(row)
        if rank == 0:
            from bench.attention import environment

            env = environment(args["argv"])
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(world)]
            try:
                ver = torch.cuda.nccl.version()
                env["nccl"] = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
            except Exception as e:  # noqa: BLE001 - the version is a nicety
                env["nccl"] = f"unknown ({type(e).__name__})"
            Path(out_file).write_text(json.dumps({"env": env, "rows": rows}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(f"{out_file}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="total sequence lengths, comma-separated")
    ap.add_argument("--world", type=int, default=0, help="GPUs / ranks (default: every GPU torch sees)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-single", action="store_true", help="leave out the one-GPU fa4gen.attention baseline")
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        print("bench.ring: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    world = args.world or n
    if world > n:
        print(f"bench.ring: --world {world} but torch sees {n} GPU(s)", file=sys.stderr)
        return 2
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"heads": args.heads, "head_dim": args.head_dim, "reps": args.reps, "warmup": args.warmup,
           "no_single": args.no_single, "seqlens": seqlens, "argv": ["-m", "bench.ring", *argv]}
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "rows.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "init"), part, cfg))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        errs = [Path(f"{part}.rank{r}.err").read_text() for r in range(world) if Path(f"{part}.rank{r}.err").exists()]
        if errs or not Path(part).exists():
            print("bench.ring: a rank failed:\n" + "\n".join(errs), file=sys.stderr)
            return 1
        got = json.loads(Path(part).read_text())
    from bench.attention import _write, result_path

    env = got["env"]
    path = result_path(out_dir, env, f"ring_w{world}")
    result = {**env, "suite": "ring", "world": world,
              "timing": f"CUDA events after a barrier, slowest rank per repetition, median of {args.reps} after "
                        f"{args.warmup} warm-up call(s)", "results": got["rows"]}
    _write(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
