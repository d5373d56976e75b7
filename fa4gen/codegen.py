"""The generator chain: KernelConfig -> pipeline IR -> verify -> lower -> render -> assemble.

`build(cfg, out_dir=None, emit=("ptx", "cubin")) -> BuildResult` runs every stage for one variant:

    build_pipeline(cfg)            the role programs (fa4gen/ir)
    check_or_raise(verify(...))    the programs the PTX is lowered from, proven (or VerificationError)
    lower + render                 fa4gen.lower.sm100 / sm90, rendered by fa4gen.render.kernels
    assemble                       ptxas / nvJitLink under the zero-warning, no-spill policy

Assembly runs in a worker thread while the verifier runs (ptxas is a subprocess, so the two
overlap on two cores); a failed verification still raises and nothing is written. A passing
verification is cached on disk keyed by the pipeline's content and the source of the verifier and
of the IR core (State semantics), so rebuilding an unchanged variant skips the protocol
exploration (set FA4GEN_VERIFY_CACHE=0 to always re-verify). With out_dir, `<name>.json` (the manifest) is always written, plus
`<name>.ptx`, `<name>.cubin`, `<name>.sass`, `<name>.ir.json` as `emit` asks.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .spec.config import GENERATOR_VERSION, KernelConfig
from .assemble.fsutil import atomic_write

EMITS = ("ir", "ptx", "cubin", "sass")

# The default sm_100a matrix: head_dim x causal x GQA in bf16, and one fp16 variant.
DEFAULT_MATRIX = tuple(
    [KernelConfig(head_dim=d, causal=c, gqa_ratio=g) for d in (64, 128) for c in (False, True) for g in (1, 4)]
    + [KernelConfig(dtype="fp16", causal=True, gqa_ratio=4)])
# One sm_90a default variant beside it, so the PTX of both targets can be reviewed, and the 192-row
# three-consumer tile that fa4gen.attention runs at D = 64 (tiles.SM90_Q_ROWS).
SM90_REVIEW_CONFIG = KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=1)
SM90_WIDE_REVIEW_CONFIG = KernelConfig(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=4, block_m=192)
# A varlen variant of each target (packed sequences, cu_seqlens; docs/ABI.md "Varlen") for review.
VARLEN_REVIEW_CONFIGS = (KernelConfig(head_dim=128, causal=True, gqa_ratio=4, varlen=True),
                         KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4, varlen=True))
# A KV-cache variant of each target (decode over a paged cache, split-KV, the fa4_combine entry;
# docs/ABI.md "KV cache") for review.
KVCACHE_REVIEW_CONFIGS = (KernelConfig(head_dim=128, causal=True, gqa_ratio=4, kvcache=True, page_size=64),
                          KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4, kvcache=True,
                                       page_size=64))
# The variants checked in under generated/ (scripts/regen_generated.py): the sm_100a matrix, the
# sm_90a review variants, the two varlen ones and the KV-cache ones.
GENERATED_MATRIX = (DEFAULT_MATRIX + (SM90_REVIEW_CONFIG, SM90_WIDE_REVIEW_CONFIG) + VARLEN_REVIEW_CONFIGS
                    + KVCACHE_REVIEW_CONFIGS)
# Manifest keys that legitimately differ between two regenerations of the same kernel: the content
# hash covers a fingerprint of the generator's sources, and the assembler section exists only where
# an assembler is installed.
UNSTABLE_MANIFEST_KEYS = ("content_hash", "assembler")
VERIFY_CACHE_ENV = "FA4GEN_VERIFY_CACHE"


class BuildError(RuntimeError):
    """A stage of the chain failed for a reason that is not an assembler or verifier report."""


@dataclass(frozen=True)
class BuildResult:
    name: str
    ptx: str
    cubin: bytes | None  # None when "cubin" was not asked for
    manifest: dict
    report: object | None  # passes.verify.Report (None: no IR for this arch)
    resources: tuple  # assemble.KernelResources per entry (empty without a cubin)
    timings: dict = field(default_factory=dict)  # stage -> seconds
    files: tuple[Path, ...] = ()


# ---------------------------------------------------------------------------------------------------
# verify, with a content-keyed cache of passing reports


def _verifier_fingerprint() -> str:
    import importlib

    h = hashlib.sha256(GENERATOR_VERSION.encode())
    for name in ("fa4gen.ir.core", "fa4gen.verify.engine", "fa4gen.verify.verify"):
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()


def _verify_key(pipe) -> str:
    blob = json.dumps(pipe.to_json(), sort_keys=True, default=str)
    return hashlib.sha256((_verifier_fingerprint() + blob).encode()).hexdigest()[:32]


def _report_to_json(rep) -> dict:
    return {"pipeline_name": rep.pipeline_name, "runs": rep.runs, "scenarios": [list(s) for s in rep.scenarios],
            "findings": [{"code": f.code, "subject": f.subject, "message": f.message} for f in rep.findings]}


def _report_from_json(d: dict):
    from .verify.engine import Finding
    from .verify.verify import Report

    return Report(d["pipeline_name"], tuple(Finding(**f) for f in d["findings"]), int(d["runs"]),
                  tuple(tuple(s) for s in d["scenarios"]))


def verify_cached(pipe):
    """verify(pipe), reusing an on-disk record of an earlier passing run of the same pipeline content
    under the same verifier source. Returns (report, cache_hit)."""
    from .assemble.cache import default_cache_dir
    from .verify.verify import verify

    use_cache = os.environ.get(VERIFY_CACHE_ENV, "1") != "0"
    path = None
    if use_cache:
        path = default_cache_dir() / "verify" / f"{pipe.config.name}-{_verify_key(pipe)}.json"
        try:
            rep = _report_from_json(json.loads(path.read_text()))
            if rep.ok and rep.pipeline_name == pipe.config.name:
                return rep, True
        except (OSError, ValueError, KeyError, TypeError):
            pass
    rep = verify(pipe)
    if use_cache and rep.ok:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_report_to_json(rep)))
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache only costs time
    return rep, False


# ---------------------------------------------------------------------------------------------------
# manifest


def pipeline_summary(pipe, report) -> dict:
    """What a reviewer reads before the PTX: config, TMEM map, SMEM, register budgets, barriers."""
    from .ir.core import BarrierKind, Space

    cfg = pipe.config
    return {
        "name": cfg.name,
        "content_hash": cfg.content_hash,
        "config": cfg.to_dict(),
        "arch": pipe.arch,
        "threads_per_cta": pipe.threads,
        "smem_bytes": pipe.smem_bytes,
        "smem_limit": pipe.smem_limit,
        "tmem_alloc_cols": pipe.tmem_alloc_cols,
        "tmem_map": [{"region": r.name, "dtype": r.dtype, "cols": [r.col, r.col_end], "alias_of": r.alias_of}
                     for r in pipe.regions if r.space is Space.TMEM],
        "smem_map": [{"region": r.name, "slots": r.slots, "bytes_per_slot": r.bytes_per_slot}
                     for r in pipe.regions if r.space is Space.SMEM],
        "roles": [{"role": r.name, "warps": list(r.warps), "setmaxnreg": r.regs} for r in pipe.roles],
        "registers_per_cta": sum(r.threads * r.regs for r in pipe.roles),
        "barriers": [{"name": b.name, "kind": b.kind.value, "slots": b.slots,
                      ("threads" if b.kind is BarrierKind.NAMED else "arrivals"): b.count,
                      **({"tx_bytes": b.tx_bytes} if b.tx_bytes else {}),
                      **({"named_ids": [b.named_id, b.named_id + b.slots - 1]}
                         if b.kind is BarrierKind.NAMED else {})}
                     for b in pipe.barriers],
        "verify": _verify_summary(report),
    }


def _verify_summary(report) -> dict:
    if report is None:
        return {"ok": None, "runs": 0, "findings": [], "skipped": "no pipeline IR for this arch"}
    return {"ok": report.ok, "runs": report.runs, "scenarios": [list(s) for s in report.scenarios],
            "findings": [{"code": f.code, "subject": f.subject, "message": f.message} for f in report.findings]}


def _assembler_summary(res) -> dict:
    return {"backend": res.backend.value, "tool_version": res.tool_version, "arch": res.arch,
            "entries": [{"name": r.name, "registers": r.registers, "spill_stores": r.spill_stores,
                         "spill_loads": r.spill_loads, "stack_frame": r.stack_frame,
                         "static_smem_bytes": r.smem_bytes, "barriers": r.barriers} for r in res.resources],
            "note": "ptxas reports one register count per kernel: the entry's .maxnreg; each warpgroup's "
                    "setmaxnreg budget is in roles[].setmaxnreg"}


# ---------------------------------------------------------------------------------------------------
# the chain


def _lower(cfg: KernelConfig, pipe):
    """(ptx, ABI manifest) for the config's arch."""
    if cfg.arch == "sm_100a":
        from .render.kernels import build_sm100

        return build_sm100(pipe)
    if cfg.arch == "sm_90a":
        from .render.kernels import build_sm90

        return build_sm90(pipe)
    raise BuildError(f"no lowering for arch {cfg.arch!r}")


def _pipeline(cfg: KernelConfig):
    """The pipeline of the config: what the verifier proves and the sm_100a PTX is lowered from."""
    from .ir import build_pipeline

    return build_pipeline(cfg)


def build(cfg: KernelConfig, out_dir=None, emit=("ptx", "cubin"), *, backend: str = "auto",
          verify: bool = True) -> BuildResult:
    """Generate (and, if asked, assemble) one kernel variant. Raises VerificationError when the
    pipeline has findings, AssembleError when the assembler or the resource policy refuses."""
    from .assemble.assemble import assemble, disassemble
    from .verify.verify import VerificationError

    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"cfg must be a KernelConfig, got {type(cfg).__name__}")
    from .ir import refuse_ignored
    refuse_ignored(cfg)
    emit = tuple(emit)
    unknown = [e for e in emit if e not in EMITS]
    if unknown:
        raise ValueError(f"emit {unknown}: choose from {', '.join(EMITS)}")
    timings: dict[str, float] = {}
    t0 = t = time.perf_counter()
    pipe = _pipeline(cfg)
    timings["pipeline"] = time.perf_counter() - t

    t = time.perf_counter()
    ptx, manifest = _lower(cfg, pipe)
    timings["lower_render"] = time.perf_counter() - t

    want_cubin = "cubin" in emit or "sass" in emit
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if want_cubin else None
    fut = pool.submit(assemble, ptx, cfg.arch, name=cfg.name, backend=backend) if pool else None
    try:
        report, hit = None, False
        if verify and pipe is not None:
            t = time.perf_counter()
            report, hit = verify_cached(pipe)
            timings["verify"] = time.perf_counter() - t
            timings["verify_cached"] = float(hit)
            if not report.ok:
                raise VerificationError(report)
        asm = None
        if fut is not None:
            t = time.perf_counter()
            asm = fut.result()
            timings["assemble_wait"] = time.perf_counter() - t
            timings["assemble"] = asm.wall_time_s
    finally:
        if pool is not None:
            pool.shutdown(wait=True)

    if pipe is not None:
        full = pipeline_summary(pipe, report)
        full.update(manifest)  # the ABI fields (docs/ABI.md) win on shared keys
    else:
        full = dict(manifest)
        full["verify"] = _verify_summary(None)
    if asm is not None:
        full["assembler"] = _assembler_summary(asm)

    files = []
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)

        def write(suffix: str, data) -> None:
            # temporary file + os.replace: a concurrent reader (or build into the same folder)
            # sees the old file or the new one, never a torn one
            p = out / f"{cfg.name}{suffix}"
            atomic_write(p, data)
            files.append(p)

        write(".json", json.dumps(full, indent=1, sort_keys=False) + "\n")
        if "ptx" in emit:
            write(".ptx", ptx)
        if "cubin" in emit and asm is not None:
            write(".cubin", asm.cubin)
        if "sass" in emit and asm is not None:
            write(".sass", disassemble(asm.cubin))
        if "ir" in emit and pipe is not None:
            write(".ir.json", json.dumps(pipe.to_json(), indent=1) + "\n")
    timings["total"] = time.perf_counter() - t0
    return BuildResult(name=cfg.name, ptx=ptx, cubin=asm.cubin if asm is not None and "cubin" in emit else None,
                       manifest=full, report=report, resources=asm.resources if asm is not None else (),
                       timings=timings, files=tuple(files))
