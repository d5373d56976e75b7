#!/usr/bin/env python3
"""A/B timing of this generator's sm_90a kernels against an earlier generator's, interleaved.

    python3 -m bench.ab --baseline DIR [--suite main|d64|both|varlen|kvcache|all] [--rounds 7] [--out FILE.json]
    python3 -m bench.ab --suite all --list-builds   # the `fa4gen build` options of every kernel it needs
    python3 -m bench.ab --suite all --build-into DIR [--rev REV [--patch FILE]] [--env KEY=VALUE ...] [--match S]
        # builds those kernels into DIR (no GPU): from this checkout as it stands, or from REV (a
        # temporary git worktree, FILE applied to it with `git apply`); --env sets build-time variables

DIR holds the earlier kernels as `fa4gen build --arch sm_90a --out DIR` writes them
(<name>.cubin + <name>.json). For every shape of bench/attention.py's SHAPES (plus two with tails,
where the masks run on every row block's last K/V block) both kernels are called into preallocated
outputs on the same inputs, alternating A, B, A, B ... for `--rounds` rounds of triton's do_bench
(median of each round); the result per shape is the median over rounds of each and their ratio,
with the spread (min-max over rounds) so that noise is visible beside the difference. Outputs are
compared bit for bit (a generator change that must not alter results says so). The varlen suite
runs bench/varlen.py's length mixes through `kernel.varlen`; the kvcache suite runs decode steps
through `kernel.kvcache` with the split count each kernel chooses, timed from CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention import D64_SHAPES, SHAPES, environment, interleaved_ms, shape_dtype, tflops  # noqa: E402

EXTRA = ((8, 2000, 16, 16, 128, False), (8, 2000, 16, 16, 128, True))


def dense_cases(suite: str):
    """(shape, KernelConfig) of the dense suites: fa4gen.attention's tile choice per shape."""
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows

    shapes = {"main": SHAPES + EXTRA, "d64": D64_SHAPES}[suite]
    for shape in shapes:
        b, s, hq, hkv, d, causal = shape[:6]
        yield shape, KernelConfig(arch="sm_90a", head_dim=d, dtype=shape_dtype(shape, "bf16"), causal=causal,
                                  gqa_ratio=hq // hkv, block_m=q_tile_rows("sm_90a", d, hq // hkv, causal=causal,
                                                                            seqlen_q=s))


def varlen_cases():
    """(mix, KernelConfig) of bench/varlen.py's MIXES: the tile fa4gen.attention_varlen runs for the mix
    (tiles.q_tile_rows with its longest sequence)."""
    from bench.varlen import MIXES, kernel_config, mix_lengths

    for kind, d, causal in MIXES:
        yield (kind, d, causal), kernel_config(d, causal, max(mix_lengths(kind)))


KV_SHAPES = ((1, 32768), (1, 131072), (8, 32768), (64, 4096))  # (batch, cache length), Sq 1, 32/8 heads, D 128
KV_LAYOUTS = (0, 64)  # page size: contiguous, 64-row pages


def kvcache_cases():
    from bench.kvcache import D, HKV, HQ
    from fa4gen.spec.config import KernelConfig

    for b, length in KV_SHAPES:
        for ps in KV_LAYOUTS:
            yield (b, length, ps), KernelConfig(arch="sm_90a", head_dim=D, causal=True, gqa_ratio=HQ // HKV,
                                                kvcache=True, page_size=ps)


def all_cases(suite: str):
    parts = {"main": ("main",), "d64": ("d64",), "both": ("main", "d64"), "varlen": ("varlen",),
             "kvcache": ("kvcache",), "all": ("main", "d64", "varlen", "kvcache")}[suite]
    for part in parts:
        cases = (dense_cases(part) if part in ("main", "d64") else
                 varlen_cases() if part == "varlen" else kvcache_cases())
        for shape, cfg in cases:
            yield part, shape, cfg


def _graph_timer(torch, calls: int = 20):
    """A timer of a callable replayed from a CUDA graph of `calls` calls (the GPU time without the
    host's per-call cost, which bounds decode-sized kernels): ms per call."""
    from bench.attention import _median_ms, capture_graph

    graphs = {}

    def timer(fn, warmup_ms, rep_ms):
        if fn not in graphs:
            graphs[fn] = capture_graph(torch, fn, calls)
        return _median_ms(graphs[fn].replay, warmup_ms, rep_ms) / calls
    return timer


def _inputs(torch, part, shape, cfg):
    """Inputs, and a function (kernel, output) -> callable, of one case."""
    import itertools

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    gen = torch.Generator(device="cuda").manual_seed(99)
    d = cfg.head_dim
    sc = d ** -0.5

    def rnd(*size):
        return torch.randn(*size, device="cuda", dtype=dt, generator=gen)
    if part in ("main", "d64"):
        b, s, hq, hkv = shape[:4]
        q, k, v = rnd(b, s, hq, d), rnd(b, s, hkv, d), rnd(b, s, hkv, d)
        flop = tflops(b, hq, s, s, d, cfg.causal, 1.0) * 1e-3  # TFLOP of the call
        return q, flop, lambda kern, o: (lambda: kern(q, k, v, o, softmax_scale=sc))
    if part == "varlen":
        from bench.varlen import HEADS, mix_lengths, real_flop

        lens = mix_lengths(shape[0])
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        q, k, v = (rnd(sum(lens), HEADS, d) for _ in range(3))
        m = max(lens)
        return q, real_flop(lens, HEADS, d, cfg.causal) / 1e12, \
            lambda kern, o: (lambda: kern.varlen(q, k, v, o, cu, cu, m, m, softmax_scale=sc))
    from bench.kvcache import HKV, HQ

    b, length, ps = shape
    if ps:
        npg = -(-length // ps)
        kc, vc = rnd(b * npg, ps, HKV, d), rnd(b * npg, ps, HKV, d)
        pt = torch.randperm(b * npg, device="cuda", generator=gen).to(torch.int32).view(b, npg).contiguous()
    else:
        kc, vc, pt = rnd(b, length, HKV, d), rnd(b, length, HKV, d), None
    seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    q = rnd(b, 1, HQ, d)

    def make(kern, o):
        S = kern.kvcache_num_splits(b, HKV, 1, length if not ps else pt.shape[1] * ps)
        op = torch.empty(S, b * HQ, d, device="cuda", dtype=torch.float32) if S > 1 else None
        lp = torch.empty(S, b * HQ, device="cuda", dtype=torch.float32) if S > 1 else None
        return lambda: kern.kvcache(q, kc, vc, o, seqlens, pt, num_splits=S, o_partial=op, lse_partial=lp)
    return q, None, make


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="folder of the earlier generator's cubins and manifests")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--suite", choices=("main", "d64", "both", "varlen", "kvcache", "all"), default="main",
                    help="main: bench.attention SHAPES + two with tails; d64: D64_SHAPES; both: the two; varlen: "
                         "bench/varlen.py's MIXES; kvcache: decode (Sq 1) over contiguous and 64-row-paged caches, "
                         "timed from CUDA-graph replay; all: every one")
    ap.add_argument("--candidate", type=Path,
                    help="folder of cubins to time as 'new' in place of this generator's kernels (--candidate DIR "
                         "--baseline DIR times a build against itself: the noise floor of the comparison)")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--list-builds", action="store_true",
                    help="print the `fa4gen build` options of every kernel the suite needs (one line each), to "
                         "build the baseline folder with the earlier generator; needs no GPU")
    ap.add_argument("--build-into", type=Path, metavar="DIR",
                    help="build every kernel the suite needs into DIR (no GPU), from this checkout or --rev")
    ap.add_argument("--rev", help="with --build-into: build from this git revision (a temporary worktree)")
    ap.add_argument("--patch", type=Path, help="with --build-into --rev: `git apply` this file to that worktree first")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="with --build-into: set this variable for the builds (repeatable)")
    ap.add_argument("--match", default="", help="with --list-builds / --build-into: only kernels whose name holds this")
    a = ap.parse_args(argv)
    if a.list_builds:
        for _, args in suite_builds(a.suite, a.match):
            print(" ".join(args))
        return 0
    if a.build_into is not None:
        bad = [e for e in a.env if "=" not in e or not e.split("=", 1)[0]]
        if bad:
            ap.error(f"--env takes KEY=VALUE, not {bad[0]!r}")
        try:
            build_into(a.build_into, a.suite, a.rev, a.patch, dict(e.split("=", 1) for e in a.env), a.match)
        except RuntimeError as e:
            print(f"bench.ab: {e}", file=sys.stderr)
            return 1
        return 0
    if a.rev or a.patch or a.env:
        ap.error("--rev, --patch and --env go with --build-into")
    if a.baseline is None:
        ap.error("--baseline DIR is required")
    import torch

    from fa4gen.runtime import api

    if not torch.cuda.is_available():
        print("bench.ab: no CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for part, shape, cfg in all_cases(a.suite):
        path = a.baseline / f"{cfg.name}.cubin"
        if not path.exists():
            print(f"  {part} {shape}: no {path.name} in {a.baseline}, skipped", flush=True)
            continue
        q, flop, make = _inputs(torch, part, shape, cfg)
        if a.candidate is not None:
            cpath = a.candidate / f"{cfg.name}.cubin"
            if not cpath.exists():
                print(f"  {part} {shape}: no {cpath.name} in {a.candidate}, skipped", flush=True)
                continue
            new = api.load(cpath).kernel
        else:
            new, _ = api.get_kernel(cfg, q.device)
        old = api.load(path).kernel
        o_new, o_old = torch.empty_like(q), torch.empty_like(q)
        fns = {"new": make(new, o_new), "old": make(old, o_old)}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = bool(torch.equal(o_new, o_old))
        timed = interleaved_ms(fns, a.rounds, 25, a.rep_ms, timer=_graph_timer(torch) if part == "kvcache" else None)
        med = {n: t[0] for n, t in timed.items()}
        row = dict(suite=part, shape=list(shape), name=cfg.name, outputs_bitwise_equal=same,
                   new_ms=med["new"], old_ms=med["old"],
                   ratio_new_over_old=round(med["old"] / med["new"], 4),
                   spread_new=list(timed["new"][1]), spread_old=list(timed["old"][1]))
        if flop:
            row.update(new_tflops=round(flop / (med["new"] * 1e-3), 1), old_tflops=round(flop / (med["old"] * 1e-3), 1))
        rows.append(row)
        print(f"  {part} {shape}: new {med['new'] * 1e3:.1f} old {med['old'] * 1e3:.1f} us, new/old "
              f"{row['ratio_new_over_old']} (spread new {row['spread_new']}, old {row['spread_old']}), "
              f"bitwise equal {same}", flush=True)
        del q, o_new, o_old, fns
        torch.cuda.empty_cache()
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = a.out or ROOT / "bench" / "results" / f"{stamp:%Y-%m-%dT%H%M%SZ}_ab_sm90a.json"
    env = environment(["-m", "bench.ab", *(argv or sys.argv[1:])])
    out.write_text(json.dumps({**env, "baseline": str(a.baseline),
                               "candidate": str(a.candidate) if a.candidate else "this generator",
                               "rounds": a.rounds, "rep_ms": a.rep_ms,
                               "results": rows}, indent=1) + "\n")
    ratios = [r["ratio_new_over_old"] for r in rows]
    if ratios:
        print(f"new/old over {len(ratios)} cases: min {min(ratios)}, median {sorted(ratios)[len(ratios) // 2]}")
    print(f"wrote {out}")
    return 0


def suite_builds(suite: str, match: str = "") -> list[tuple[str, list[str]]]:
    """(kernel name, `fa4gen build` options) of every kernel `suite` times, once each, in suite order;
    only those whose name holds `match`."""
    jobs = {}
    for _, _, cfg in all_cases(suite):
        if match in cfg.name:
            jobs.setdefault(cfg.name, build_args(cfg))
    return list(jobs.items())


def build_into(out: Path, suite: str, rev: str | None = None, patch: Path | None = None, env: dict | None = None,
               match: str = "", log=print) -> list[str]:
    """Build every kernel `suite` times (`suite_builds`: `--list-builds`'s lines) into `out` with
    `fa4gen build`, run from a source tree: this checkout as it stands (rev None), or a temporary git
    worktree of `rev` with `patch` applied (`git apply`). The tree's own fa4gen builds them (it is first
    on PYTHONPATH), with `env` added to the environment. Returns the kernel names built; raises
    RuntimeError with the tool's message when git or a build fails."""
    import os
    import subprocess
    import tempfile

    def run(cmd, cwd, extra=None):
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(extra or {})})
        if r.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} (in {cwd}) failed:\n{r.stdout}{r.stderr}".rstrip())
        return r.stdout

    if patch is not None and rev is None:
        raise RuntimeError("--patch needs --rev: it is applied to a worktree of that revision, never to this checkout")
    jobs = suite_builds(suite, match)
    if not jobs:
        raise RuntimeError(f"no kernel of suite {suite!r} has {match!r} in its name")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fa4gen-ab-") as tmp:
        tree = ROOT
        if rev is not None:
            tree = Path(tmp) / "tree"
            run(["git", "worktree", "add", "--detach", str(tree), rev], ROOT)
        try:
            if patch is not None:
                run(["git", "apply", str(Path(patch).resolve())], tree)
            extra = {**(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
            for i, (name, args) in enumerate(jobs, 1):
                run([sys.executable, "-m", "fa4gen.cli", "build", *args, "--out", str(out)], tree, extra)
                log(f"  [{i}/{len(jobs)}] {name}", flush=True)
        finally:
            if rev is not None:
                run(["git", "worktree", "remove", "--force", str(tree)], ROOT)
    src = "this checkout" if rev is None else f"{rev}" + (f" + {Path(patch).name}" if patch else "")
    log(f"built {len(jobs)} kernel(s) of suite {suite} from {src}"
        + (f" with {' '.join(f'{k}={v}' for k, v in env.items())}" if env else "") + f" into {out}", flush=True)
    return [n for n, _ in jobs]


def build_args(cfg) -> list[str]:
    """`fa4gen build` options that make this config's kernel (names match: api.load checks them)."""
    args = ["--arch", cfg.arch, "--head-dim", str(cfg.head_dim), "--dtype", cfg.dtype, "--gqa", str(cfg.gqa_ratio),
            "--block-m", str(cfg.block_m)]
    if cfg.causal:
        args.append("--causal")
    if cfg.varlen:
        args.append("--varlen")
    if cfg.kvcache:
        args += ["--kvcache", "--page-size", str(cfg.page_size)]
    return args


if __name__ == "__main__":
    sys.exit(main())
