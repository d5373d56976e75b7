"""fa4gen command line: build, verify and (on a GPU machine) benchmark generated kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .spec.config import HEAD_DIM_PAIRS, ConfigError, KernelConfig
from .spec.plan import ARCH_LIMITS

_ARCH = click.Choice(["sm_100a", "sm_90a"])


class HeadDims(click.ParamType):
    """--head-dim D or D,DV: (head_dim, head_dim_v); DV defaults to D. Which pairs are generated is
    KernelConfig's to say (spec.config.HEAD_DIM_PAIRS), so this only parses."""

    name = "D[,DV]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            dims = ()
        if len(dims) not in (1, 2):
            self.fail(f"{value!r} is not D or D,DV (integers: head_dim, and head_dim_v when v's differs)", param, ctx)
        return dims if len(dims) == 2 else (dims[0], dims[0])


def _config_options(f):
    opts = [
        click.option("--arch", type=_ARCH, default="sm_100a", show_default=True,
                     help="Target: sm_100a (Blackwell, generated and checked here, not executed) or sm_90a "
                          "(Hopper H100/H200, runs)."),
        click.option("--head-dim", "head_dim", type=HeadDims(), default="128", show_default=True,
                     help="Head dimension D of q and k, or D,DV with v's (and o's) DV. (D, DV) pairs generated: "
                          + "; ".join(f"{a} " + ", ".join(f"{d},{dv}" if dv != d else str(d) for d, dv in pairs)
                                      for a, pairs in HEAD_DIM_PAIRS.items()) + "."),
        click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True),
        click.option("--causal", is_flag=True, help="Bottom-right causal mask with block skipping and LPT order."),
        click.option("--gqa", "gqa", type=int, default=1, show_default=True,
                     help="Query heads per KV head (GQA ratio), any integer >= 1: a divisor of 128 packs the ratio's heads "
                          "into one Q tile, any other ratio runs one head per tile."),
        click.option("--varlen", is_flag=True,
                     help="Variable-length batches: packed (total, H, D) tensors with cu_seqlens offsets "
                          "(fa4gen.attention_varlen); per-sequence causal, a varlen tile scheduler, O stored "
                          "row by row so no tile writes the next sequence."),
        click.option("--kvcache", is_flag=True,
                     help="Decode over a KV cache (docs/ABI.md \"KV cache\"): q (B, Sq, Hq, D) against a cache of "
                          "per-sequence lengths cache_seqlens (clamped to [0, capacity]), split-KV over num_splits "
                          "key ranges whose fp32 partials a second entry, fa4_combine, merges (the PTX module has "
                          "both kernels). Contiguous cache (B, Smax, Hkv, D) unless --page-size."),
        click.option("--page-size", "page_size", type=click.IntRange(0), default=0, show_default=True,
                     help="With --kvcache: a paged cache (num_pages, N, Hkv, D) read through a page table "
                          "(B, max_pages) int32, N a power of two in [16, 256]; 0 = contiguous."),
        click.option("--block-m", "block_m", type=click.Choice(["auto", "128", "192"]), default="auto", show_default=True,
                     help="Q tile rows. auto: what fa4gen.attention runs (fa4gen.spec.tiles.q_tile_rows: 192 for dense "
                          "and varlen sm_90a D = 64 and 96, three consumer warpgroups; 128 otherwise). 192 is "
                          "sm_90a-only, not KV cache, GQA packs of at most 64 heads."),
        click.option("--window", is_flag=True,
                     help="Sliding window (docs/ABI.md \"Windows, softcap, sinks\"): a kernel variant whose window "
                          "sides are run-time arguments (window_left, window_right; fa4gen.attention's window_size="
                          "(left, right), -1 unbounded), so one build serves every window size. Tiles visit only "
                          "the K/V blocks their window reaches."),
        click.option("--softcap", is_flag=True,
                     help="Logit softcap: scores s become softcap * tanh(s / softcap) before the softmax; the cap "
                          "is a run-time argument (softcap > 0 at every call of this variant)."),
        click.option("--sinks", is_flag=True,
                     help="Attention sinks: a learnable_sink tensor (float32, one logit per query head, a run-time "
                          "argument) joins every row's softmax denominator and LSE."),
        click.option("--kv-stages", type=int, default=None, help="K/V SMEM ring depth (default: the arch's)."),
        click.option("--rescale-threshold", type=float, default=None,
                     help="Skip rescaling O while the reference max moved less than this (log2 units, default 8)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _make_config(arch, head_dim, dtype, causal, gqa, kv_stages, rescale_threshold, varlen=False, kvcache=False,
                 page_size=0, block_m="auto", window=False, softcap=False, sinks=False) -> KernelConfig:
    d, dv = head_dim
    kw = dict(arch=arch, head_dim=d, head_dim_v=dv, dtype=dtype, causal=causal, gqa_ratio=gqa, varlen=varlen,
              kvcache=kvcache, page_size=page_size, window=window, softcap=softcap, sinks=sinks)
    if block_m != "auto":
        kw["block_m"] = int(block_m)
    elif (d, dv) in HEAD_DIM_PAIRS[arch] and isinstance(gqa, int) and gqa >= 1:  # others: KernelConfig says what is wrong
        from .spec.tiles import q_tile_rows
        kw["block_m"] = q_tile_rows(arch, d, gqa, varlen, kvcache)
    if kv_stages is not None:
        kw["kv_stages"] = kv_stages
    if rescale_threshold is not None:
        kw["rescale_threshold"] = rescale_threshold
    try:
        from .ir import refuse_ignored
        return refuse_ignored(KernelConfig(**kw))
    except ConfigError as e:
        click.echo(f"fa4gen: error: {e}", err=True)
        sys.exit(2)


def _print_summary(s: dict) -> None:
    click.echo(f"{s['name']}  ({s['arch']}, {s['threads_per_cta']} threads, hash {s['content_hash']})")
    click.echo(f"  SMEM  {s['smem_bytes']} / {s['smem_limit']} bytes: " +
               ", ".join(f"{m['region']} {m['slots']}x{m['bytes_per_slot']}" for m in s["smem_map"]))
    if s["tmem_map"]:
        click.echo(f"  TMEM  {s['tmem_alloc_cols']} columns: " + ", ".join(
            f"{m['region']}[{m['cols'][0]},{m['cols'][1]})" + (f" in {m['alias_of']}" if m["alias_of"] else "")
            for m in s["tmem_map"]))
    click.echo(f"  regs  {s['registers_per_cta']} / {ARCH_LIMITS[s['arch']].regs_per_sm} per CTA: " +
               ", ".join(f"{r['role']} {r['setmaxnreg']}" for r in s["roles"]))
    click.echo("  barriers: " + ", ".join(
        f"{b['name']}[{b['slots']}]:{b['kind']}/{b.get('arrivals', b.get('threads'))}" for b in s["barriers"]))
    v = s["verify"]
    click.echo(f"  verify: {'OK' if v['ok'] else 'FAILED'} ({v['runs']} runs)")
    asm = s.get("assembler")
    if asm:
        for e in asm["entries"]:
            click.echo(f"  {asm['backend']} {asm['tool_version']} ({asm['arch']}): {e['name']} {e['registers']} "
                       f"registers at entry, spills {e['spill_stores']}/{e['spill_loads']} bytes, stack "
                       f"{e['stack_frame']}, dynamic SMEM {s.get('dynamic_smem_bytes', '?')} bytes; "
                       "setmaxnreg honoured")
    for f in v["findings"]:
        click.echo(f"    [{f['code']}] {f['subject']}: {f['message']}")


@click.group(help="fa4gen: generate FlashAttention-4-style attention forward kernels as PTX.\n\n"
                  "sm_100a kernels are generated, verified, simulated and assembled here but never executed "
                  "(no Blackwell GPU); sm_90a kernels run on H100/H200.")
@click.version_option(package_name="fa4gen")
def main():
    pass


def _unusable_out_dir(out_dir: Path) -> str | None:
    """Why out_dir cannot take the build's files (None: it can): created if missing, then a
    directory that a file can be created in. Checked before anything is verified or assembled."""
    import os
    import tempfile

    if out_dir.exists() and not out_dir.is_dir():
        return "exists and is not a directory"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "a part of the path is not a directory"
    except OSError as e:
        return f"cannot create the folder ({e.strerror or e})"
    if not out_dir.is_dir():
        return "is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".fa4gen-probe-", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"not writable ({e.strerror or e})"
    return None


@main.command(help="Build one kernel variant: verify its pipeline IR, write DIR/<name>.json (DIR: --out, "
                   "default ./fa4gen-out) (config, TMEM "
                   "map, SMEM bytes, register budgets, barrier table, verify result) and, when the emitter "
                   "and an assembler are available, DIR/<name>.ptx and DIR/<name>.cubin.")
@_config_options
@click.option("--out", "out", type=click.Path(), default="fa4gen-out", show_default=True,
              help="Output folder, created if missing (generated/ is the checked-in golden set that "
                   "scripts/regen_generated.py writes).")
@click.option("--emit", type=click.Choice(["ir", "ptx", "cubin", "sass"]), multiple=True,
              help="Artifacts to write besides the manifest (repeatable). Default: ptx and cubin.")
def build(arch, head_dim, dtype, causal, gqa, varlen, kvcache, page_size, block_m, window, softcap, sinks, kv_stages,
          rescale_threshold, out, emit):
    cfg = _make_config(arch, head_dim, dtype, causal, gqa, kv_stages, rescale_threshold, varlen, kvcache, page_size,
                       block_m, window, softcap, sinks)
    out_dir = Path(out)
    problem = _unusable_out_dir(out_dir)
    if problem:
        click.echo(f"fa4gen: error: --out {out}: {problem}", err=True)
        sys.exit(2)
    from . import codegen

    try:
        res = codegen.build(cfg, out_dir=out_dir, emit=tuple(emit) or ("ptx", "cubin"))
    except Exception as e:  # verifier, lowering and assembler errors carry their own report / log
        click.echo(f"fa4gen: build failed: {e}", err=True)
        sys.exit(1)
    summary = res.manifest
    _print_summary(summary)
    for suffix in (".json", ".ptx", ".cubin", ".sass", ".ir.json"):
        p = out_dir / f"{cfg.name}{suffix}"
        if p.exists():
            click.echo(f"  wrote {p}")


@main.command(help="Verify a variant's pipeline IR and print the full report (exit 0 ok, 1 findings). "
                   "--mutation NAME verifies a broken variant from the corpus instead.")
@_config_options
@click.option("--mutation", default=None, help="Apply a corpus mutation (see --list-mutations).")
@click.option("--list-mutations", is_flag=True, help="List the broken-pipeline corpus of --arch and exit.")
def verify(arch, head_dim, dtype, causal, gqa, varlen, kvcache, page_size, block_m, window, softcap, sinks, kv_stages,
           rescale_threshold, mutation, list_mutations):
    from .codegen import pipeline_summary
    from .ir import build_pipeline
    from .verify import verify as run_verify
    from .verify.mutations import CORPUS, DYNAMIC_CORPUS, SM90_CORPUS, SM90_KV_CORPUS, SM100_DV_CORPUS

    corpus = {"sm_100a": CORPUS + SM100_DV_CORPUS + DYNAMIC_CORPUS,
              "sm_90a": SM90_CORPUS + SM90_KV_CORPUS + DYNAMIC_CORPUS}
    # mutations that edit what only some pipelines have: the option that builds one
    needs = {**{m.name: "K and V tiles of two sizes: --head-dim 192,128" for m in SM100_DV_CORPUS},
             **{m.name: "a KV-cache kernel: --kvcache" for m in SM90_KV_CORPUS},
             **{m.name: "the dynamic deal: --varlen" for m in DYNAMIC_CORPUS}}
    if list_mutations:
        for m in corpus[arch]:
            note = f" (needs {needs[m.name]})" if m.name in needs else ""
            click.echo(f"{m.name:28s} {m.code:14s} {m.culprit:12s} {m.what}{note}")
        return
    cfg = _make_config(arch, head_dim, dtype, causal, gqa, kv_stages, rescale_threshold, varlen, kvcache, page_size,
                       block_m, window, softcap, sinks)
    if mutation:
        mine = [m for m in corpus[arch] if m.name == mutation]
        if not mine:
            other = next((a for a, ms in corpus.items() if any(m.name == mutation for m in ms)), None)
            if other:
                msg = f"mutation {mutation!r} breaks the {other} pipeline; use it with --arch {other}"
            else:
                msg = (f"no mutation {mutation!r} for {arch}; known: "
                       f"{', '.join(m.name for m in corpus[arch])} (fa4gen verify --arch {arch} --list-mutations)")
            click.echo(f"fa4gen: error: {msg}", err=True)
            sys.exit(2)
    pipe = build_pipeline(cfg)
    if mutation:
        broken = mine[0].apply(pipe)
        if broken == pipe:
            click.echo(f"fa4gen: error: mutation {mutation!r} changes nothing in {cfg.name}'s pipeline"
                       + (f" (it needs {needs[mutation]})" if mutation in needs else ""), err=True)
            sys.exit(2)
        pipe = broken
    rep = run_verify(pipe)
    _print_summary(pipeline_summary(pipe, rep))
    sys.exit(0 if rep.ok else 1)


def _load_ptx(path: Path, manifest: str | None, mutation: str | None, read_back: bool = False) -> tuple[str, dict]:
    """(PTX text as on disk, its manifest), a corpus mutation applied if asked (read_back: the
    read-back-only corpus too); UsageError otherwise."""
    from .evidence.ptxemu import harness
    from .evidence.ptxemu.mutations import MutationMiss, by_name

    if not path.exists():
        raise harness.UsageError(f"{path}: no such file")
    man = harness.load_manifest(path, Path(manifest) if manifest else None)
    text = path.read_text()
    if mutation:
        try:
            text = by_name(mutation, read_back).apply(text, man)
        except (KeyError, MutationMiss) as e:
            raise harness.UsageError(str(e.args[0] if isinstance(e, KeyError) else e)) from None
    return text, man


@main.command(help="Execute a PTX file exactly as it is on disk in the CPU emulator (fa4gen/evidence/ptxemu): every "
                   "warp in SIMT lock-step, TMA / tcgen05 / wgmma as asynchronous agents with seeded random "
                   "completion orders, reads checked against what the protocol made visible. Random inputs "
                   "(with O rescales, tails, fully masked rows) are run for each seed and shape and O / LSE "
                   "compared with the float64 reference. Exit 0 when every run matches, 1 on a mismatch, "
                   "fault or deadlock (one report each), 2 on bad usage.")
@click.argument("ptx_file", type=click.Path(dir_okay=False))
@click.option("--manifest", type=click.Path(dir_okay=False), default=None,
              help="The build manifest (default: the .json beside the .ptx).")
@click.option("--shape", "shapes", multiple=True, metavar="B,Sq,Skv,Hq,Hkv",
              help="Problem shape (repeatable). Default: small shapes with tails on both lengths, GQA "
                   "packing and, for causal kernels, Sq < Skv and Sq > Skv (rows that see no key). Every kind "
                   "of shape (--shape, --lens, --kv) takes the score modifiers' run-time values as "
                   "space-separated suffixes, for kernels built with them: 'w=L,R' (window_size, -1 "
                   "unbounded; causal kernels use right 0), 'cap=X' (softcap), 'sink=Z' or 'sink=Z0,Z1,...' "
                   "(one logit for every query head or one each; -inf allowed), e.g. "
                   "--shape '1,300,500,4,1 w=128,0 cap=30 sink=50,-inf,0.5,2'. Omitted values: w=100,20, "
                   "cap=30, sinks per head and seed among 50, -inf, 2 and a random one. The defaults of such "
                   "kernels add windows smaller than a block, crossing tile and split boundaries, on "
                   "Sq != Skv, softcaps 30 / 5 / 50 with raw scores ~1e4, sinks that dominate and of -inf.")
@click.option("--lens", "lens", multiple=True, metavar="LQ:LK,...;HQ,HKV",
              help="Varlen kernels: a ragged batch (repeatable), per-sequence query:key lengths then the "
                   "heads, e.g. '131:200,0:17,40:0;4,1'. Default: ragged batches with a zero-length "
                   "sequence, one with no keys, q_len != k_len both ways, and one with seqused_k.")
@click.option("--kv", "kvs", multiple=True, metavar="LENS;SQ;HQ,HKV;SPLITS[;CAP]",
              help="KV-cache kernels: a decode batch (repeatable): cache_seqlens as the device reads them, the "
                   "query positions per sequence, the heads, num_splits and the key capacity per sequence, e.g. "
                   "'129,1,-3,1000000;3;4,1;3;600'. Paged kernels get a shuffled page table (pages scattered, "
                   "unused pages and out-of-range unused entries present). Default: Sq = 3 with 3 splits "
                   "(uneven and empty splits, a sequence of no key, one past the capacity) and Sq = 1 with one "
                   "split (the kernel writes O itself); fa4_combine runs after fa4_fwd when splits > 1.")
@click.option("--seeds", type=click.IntRange(1, 1000), default=2, show_default=True,
              help="Seeds per shape: inputs and completion orders both change with the seed.")
@click.option("--seed0", type=click.IntRange(0), default=0, show_default=True, help="First seed.")
@click.option("--ctas", type=click.IntRange(1, 4096), default=2, show_default=True,
              help="SM count to emulate: persistent kernels launch min(tasks, N) CTAs, so N < tasks "
                   "exercises the persistent task loop.")
@click.option("--step-limit", type=click.IntRange(1000), default=30_000_000, show_default=True,
              help="Warp-instructions per CTA before the run is called a livelock.")
@click.option("--persistent", is_flag=True,
              help="Launch a persistent grid of --ctas CTAs even where the manifest says one CTA per task "
                   "(causal kernels): every CTA then runs several tasks through the kernel's task loop.")
@click.option("--mutation", default=None, help="Apply a PTX corpus mutation to the file first (see --list-mutations).")
@click.option("--list-mutations", is_flag=True, help="List the PTX mutation corpus and exit.")
@click.option("--quiet", is_flag=True, help="Only the verdict line and reports.")
@click.option("--coverage", "coverage", is_flag=True,
              help="After the runs, report which paths of each entry they took: basic blocks reached (by warp "
                   "role), guarded branches seen both ways, and the blocks and branch directions never reached, "
                   "with their PTX lines. Does not change the exit code.")
@click.option("--coverage-json", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write that coverage report as JSON to this file.")
def emulate(ptx_file, manifest, shapes, lens, kvs, seeds, seed0, ctas, step_limit, persistent, mutation,
            list_mutations, quiet, coverage, coverage_json):
    from .evidence.ptxemu import harness
    from .evidence.ptxemu.mutations import PTX_MUTATIONS
    from .evidence.ptxemu.parse import PtxSyntaxError

    if list_mutations:
        for m in PTX_MUTATIONS:
            click.echo(f"{m.name:28s} {m.kernel_config().name:40s} {'/'.join(m.expect):28s} {m.what}")
        return
    path = Path(ptx_file)
    try:
        text, man = _load_ptx(path, manifest, mutation)
        varlen = bool(man["config"].get("varlen"))
        kvcache = bool(man["config"].get("kvcache"))
        kind = "varlen" if varlen else "KV-cache" if kvcache else "dense"
        if (shapes and kind != "dense") or (lens and not varlen) or (kvs and not kvcache):
            raise harness.UsageError("--shape is for dense kernels, --lens for varlen ones, --kv for KV-cache ones; "
                                     f"this kernel is {kind}")
        if kvcache and not man.get("kvcache"):
            raise harness.UsageError("the manifest's config is a KV-cache kernel but it has no \"kvcache\" record "
                                     "(no combine entry declared): not a KV-cache build this emulator can launch")
        try:
            shp = ([harness.Shape.parse(s) for s in shapes] + [harness.VarShape.parse(s) for s in lens]
                   + [harness.KvShape.parse(s) for s in kvs]) or None
        except harness.KvUsageError as e:
            raise harness.UsageError(str(e)) from None
        if persistent:
            man = dict(man, grid=dict(man["grid"], policy="persistent"))
    except harness.UsageError as e:
        click.echo(f"fa4gen emulate: error: {e}", err=True)
        sys.exit(2)

    def progress(run_label):
        def cb(c, cta):
            if not quiet:
                click.echo(f"  {run_label}: CTA {c + 1} done ({cta.steps} warp-instructions)", err=True)
        return cb

    shp = shp or harness.default_shapes(man)
    from .evidence.check import name_in_header
    named = name_in_header(text)
    if named and named != man.get("name"):
        click.echo(f"note: the PTX header names {named}, the manifest {man.get('name')}: runs use the manifest", err=True)
    ok = True
    total_steps, total_s = 0, 0.0
    runs = []
    try:
        from .evidence.ptxemu.parse import parse_for_manifest
        mod = parse_for_manifest(text, man)
        for sh in shp:
            for s in range(seed0, seed0 + seeds):
                try:
                    r = harness.run_once(text, man, sh, s, ctas=ctas, step_limit=step_limit, mod=mod,
                                         progress=progress(f"seed {s} {sh}"))
                except harness.UsageError as e:
                    click.echo(f"fa4gen emulate: error: {e}", err=True)
                    sys.exit(2)
                total_steps += r.warp_instructions
                total_s += r.seconds
                runs.append(r)
                rep = harness.EmulateReport(r.ok, str(path), [r])
                click.echo(rep.summary())
                ok &= r.ok
    except PtxSyntaxError as e:
        click.echo(f"fa4gen emulate: {path}: {e}", err=True)
        sys.exit(1)
    rate = f", {total_steps / total_s:,.0f} warp-instructions/s" if total_s else ""
    cov = harness.EmulateReport(ok, str(path), runs).coverage
    if coverage:
        click.echo("coverage of the runs:\n" + cov.summary(limit=1000))
    if coverage_json:
        import json

        Path(coverage_json).write_text(json.dumps(cov.as_dict(), indent=1) + "\n")
    click.echo(f"{'PASS' if ok else 'FAIL'}: {path} ({len(shp) * seeds} runs{rate})")
    sys.exit(0 if ok else 1)


@main.command(help="Read a PTX file back, as it is on disk, against the verified IR of the config in its "
                   "manifest: per role the ordered protocol events (barrier, slot, parity state, arrivals, "
                   "expect_tx bytes, TMA copies, tcgen05/wgmma commit and wait points, TMEM columns of every "
                   "tcgen05 op, named-barrier ids and thread counts), mbarrier init counts, the TMEM "
                   "allocation and lane field. sm_90a is read back at the level its IR describes (op order with "
                   "barrier, ring state and parity, counts, wait_group depths; not descriptors or "
                   "wgmma.fence). Exit 0 identical, 1 listing every "
                   "difference (PTX line and the IR op it should be), 2 bad usage.")
@click.argument("ptx_file", type=click.Path(dir_okay=False))
@click.option("--manifest", type=click.Path(dir_okay=False), default=None,
              help="The build manifest (default: the .json beside the .ptx).")
@click.option("--mutation", default=None, help="Apply a PTX corpus mutation first: one of `fa4gen emulate "
              "--list-mutations` or of the read-back corpus (fa4gen/evidence/ptxemu/mutations.py CHECK_MUTATIONS).")
def check(ptx_file, manifest, mutation):
    from .evidence.check import CheckUsageError, check_ptx
    from .evidence.ptxemu import harness

    path = Path(ptx_file)
    try:
        text, man = _load_ptx(path, manifest, mutation, read_back=True)
        rep = check_ptx(text, man)
    except (harness.UsageError, CheckUsageError) as e:
        click.echo(f"fa4gen check: error: {e}", err=True)
        sys.exit(2)
    click.echo(rep.summary())
    sys.exit(0 if rep.ok else 1)


@main.command(help="Build every kernel variant a model's attention calls need into a bundle DIR (DIR/bundle.json, "
                   "one <name>.cubin + <name>.json per kernel): causal dense and varlen prefill and KV-cache decode, "
                   "for each layer kind (sliding-window or full, with the model's softcap and sinks), read from a "
                   "Hugging Face config.json (heads, KV heads, head dims, sliding_window / layer_types, "
                   "attn_logit_softcapping, gpt-oss sinks, dtype). A process then uses it with "
                   "fa4gen.load_bundle(DIR) or FA4GEN_BUNDLE=DIR (FA4GEN_BUNDLE_ONLY=1: never build), with no "
                   "assembler at run time. --wheel also writes a pip-installable wheel that fa4gen finds once "
                   "installed.")
@click.option("--model", "model_path", type=click.Path(dir_okay=False), required=True,
              help="The model's config.json (Hugging Face format; a multimodal config's text_config is read).")
@click.option("--arch", "archs", default="sm_90a", show_default=True,
              help="Comma-separated targets: sm_90a (runs on H100/H200), sm_100a (generated and checked, not run).")
@click.option("--page-size", "page_sizes", default="0", show_default=True,
              help="Comma-separated KV-cache page sizes for decode kernels: 0 = a contiguous cache; 16..256 "
                   "(powers of two) = a paged cache of that many keys per page.")
@click.option("--entry", "entries", default="dense,varlen,kvcache", show_default=True,
              help="Comma-separated entry points to cover: dense (fa4gen.attention), varlen "
                   "(attention_varlen), kvcache (attention_with_kvcache).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Override the config's torch_dtype (needed when it is float32).")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="The bundle folder.")
@click.option("--wheel", is_flag=True, help="Also write a wheel of the bundle into --out.")
@click.option("--list", "list_only", is_flag=True, help="Print the variants the model needs and build nothing.")
def bundle(model_path, archs, page_sizes, entries, dtype, out, wheel, list_only):
    import json as _json

    from .runtime import bundle as _bundle
    from .spec import models

    def fail(msg, code=2):
        click.echo(f"fa4gen bundle: error: {msg}", err=True)
        sys.exit(code)

    try:
        cfg = _json.loads(Path(model_path).read_text())
    except OSError as e:
        fail(f"--model {model_path}: {e.strerror or e}")
    except ValueError as e:
        fail(f"--model {model_path}: not JSON ({e})")
    try:
        pages = tuple(int(p) for p in page_sizes.split(","))
    except ValueError:
        fail(f"--page-size {page_sizes!r}: comma-separated ints (0 = contiguous)")
    try:
        model = models.ModelAttention.from_hf_config(cfg, dtype=dtype)
        configs = models.variants(model, tuple(archs.split(",")), tuple(entries.split(",")), pages)
    except models.ModelConfigError as e:
        fail(str(e))
    click.echo(f"{model.describe()}: {len(configs)} kernel variants")
    if list_only:
        for c in configs:
            click.echo(f"  {c.name}")
        return
    out_dir = Path(out)
    problem = _unusable_out_dir(out_dir)
    if problem:
        fail(f"--out {out}: {problem}")

    def progress(i, n, name):
        click.echo(f"  [{i + 1}/{n}] {name}")

    try:
        index = _bundle.write_bundle(configs, out_dir, model=model.describe(), progress=progress)
    except Exception as e:  # verifier, lowering and assembler errors carry their own report / log
        fail(f"build failed: {e}", 1)
    click.echo(f"  wrote {index}")
    if wheel:
        name = str(cfg.get("_name_or_path") or Path(model_path).resolve().parent.name or model.model_type)
        whl = _bundle.write_wheel(out_dir, out_dir, name.split("/")[-1])
        click.echo(f"  wrote {whl}  (pip install it; fa4gen finds installed bundles by itself)")


_DRAW_HELP = (
    "Pictures of a kernel, written as SVG or PNG (by the --out suffix). Needs matplotlib, the 'draw' "
    "extra: pip install 'fa4gen[draw]'.\n\n"
    "memory: the kernel's Tensor Memory map (512 columns x 128 lanes: the S0/S1 and O0/O1 regions, each P "
    "region hatched inside the S columns it aliases; sm_90a has none and says so) and its SMEM map (the byte "
    "range of every slot of every region: Q slots, the K/V stage ring, O staging, sScale, then the "
    "mbarriers and the TMEM address slot, enlarged).\n\n"
    "timeline: one CTA of the kernel run in the emulator (fa4gen emulate's machine) with its trace on, on the "
    "smallest inputs that show two K/V blocks and an O rescale: a lane per warp of every warp role (the "
    "manifest's roles) with the instructions it issued and the barrier it waited on, by name, and lanes for "
    "the asynchronous units (TMA loads per barrier slot, the tensor-core pipe, TMEM loads and stores).\n\n"
    "Each takes a built kernel (a manifest or PTX file that `fa4gen build` wrote) or the build options "
    "(--arch --head-dim --causal --gqa ... as `fa4gen build` takes them: the kernel is generated in memory).")


def _draw_kernel(ctx, path: str | None, manifest: str | None, want_ptx: bool, cfg_args: dict) -> tuple[str | None, dict]:
    """(PTX text or None, manifest) of the kernel to draw: the file given (a manifest .json, or a .ptx
    with its manifest beside it or --manifest), else the kernel the build options generate."""
    import json

    from click.core import ParameterSource

    given = sorted(n for n in cfg_args if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE)
    if path:
        if given:
            raise click.UsageError(f"give a kernel file or build options, not both (--{given[0].replace('_', '-')})")
        from .evidence.ptxemu import harness

        p = Path(path)
        if p.suffix == ".json" and not want_ptx:
            if not p.exists():
                raise click.UsageError(f"{p}: no such file")
            return None, json.loads(p.read_text())
        if p.suffix != ".ptx":
            raise click.UsageError(f"{p}: a .ptx file{'' if want_ptx else ' or its manifest (.json)'} is needed")
        try:
            text, man = _load_ptx(p, manifest, None)
        except harness.UsageError as e:
            raise click.UsageError(str(e)) from None
        return text, man
    cfg = _make_config(**cfg_args)
    from . import codegen

    try:
        res = codegen.build(cfg, out_dir=None, emit=("ptx",))
    except Exception as e:  # verifier and lowering errors carry their own report
        click.echo(f"fa4gen: build failed: {e}", err=True)
        sys.exit(1)
    return res.ptx, res.manifest


def _draw_out(out: str):
    from .evidence import draw as d

    try:
        d.check_out(out)
        d.require_matplotlib()
    except d.DrawError as e:
        click.echo(f"fa4gen draw: error: {e}", err=True)
        sys.exit(2)
    return d


@main.group(help=_DRAW_HELP)
def draw():
    pass


@draw.command("memory", help="Draw the TMEM and SMEM maps of a kernel: KERNEL is its manifest (DIR/<name>.json of "
                             "`fa4gen build`) or its .ptx (the manifest beside it); without KERNEL, of the kernel "
                             "the build options describe. Every number is the manifest's (its SMEM layout: for an "
                             "sm_90a manifest, which has no smem_layout section, its config's pipeline layout).")
@click.argument("kernel", required=False, type=click.Path(dir_okay=False))
@_config_options
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="FILE.svg or FILE.png.")
@click.pass_context
def draw_memory(ctx, kernel, out, **cfg_args):
    d = _draw_out(out)
    _, man = _draw_kernel(ctx, kernel, None, False, cfg_args)
    click.echo(f"wrote {d.render(d.memory_map(man), out)}")


@draw.command("timeline", help="Emulate one CTA of a kernel with the emulator's trace on and draw what each warp "
                               "role did over the emulator's time (warp-instructions issued in the CTA): bursts "
                               "of issued instructions, waits named by barrier, and the TMA, tensor-core and TMEM "
                               "operations from issue to landing. PTX_FILE as for `fa4gen emulate` (dense kernels); "
                               "without it, the kernel the build options describe. The run is checked against "
                               "the reference like an emulate run; a failing run draws nothing (exit 1).")
@click.argument("ptx_file", required=False, type=click.Path(dir_okay=False))
@click.option("--manifest", type=click.Path(dir_okay=False), default=None,
              help="The build manifest (default: the .json beside the .ptx).")
@_config_options
@click.option("--shape", default=None, metavar="B,Sq,Skv,Hq,Hkv",
              help="Problem shape (default: one task's Q rows of one KV head, two K/V blocks: one CTA).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Inputs and asynchronous completion order.")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="FILE.svg or FILE.png.")
@click.pass_context
def draw_timeline(ctx, ptx_file, manifest, shape, seed, out, **cfg_args):
    d = _draw_out(out)
    from .evidence.ptxemu import harness

    text, man = _draw_kernel(ctx, ptx_file, manifest, True, cfg_args)
    try:
        sh = harness.Shape.parse(shape) if shape else None
        res, rec = d.trace_run(text, man, sh, seed)
    except harness.UsageError as e:
        click.echo(f"fa4gen draw: error: {e}", err=True)
        sys.exit(2)
    except d.DrawError as e:
        click.echo(f"fa4gen draw: {e}", err=True)
        sys.exit(1)
    note = f"shape {res.shape}, seed {seed}, {res.warp_instructions} warp-instructions"
    click.echo(f"wrote {d.render(d.timeline(man, rec.events, note=note), out)}")


if __name__ == "__main__":
    main()
