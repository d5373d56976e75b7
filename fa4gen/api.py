"""The torch-facing entry point: `attention(q, k, v, causal=False, softmax_scale=None, return_lse=False)`.

First call of a variant: generate the sm_90a PTX, assemble it (ptxas, or nvJitLink on a machine
without a toolkit), cache the cubin on disk, load it; later calls in the process reuse the loaded
kernel, and later processes load the cached cubin. `last_call_info()` says which of these happened
and how long each took (also logged at DEBUG on the "fa4gen" logger).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from . import validate
from .cache import KERNELS, CubinCache, EntryState
from .config import KernelConfig
from .validate import Fa4genInputError, Problem  # noqa: F401  (re-exported for callers)

log = logging.getLogger("fa4gen")

RUNTIME_ARCH = "sm_90a"  # the only arch with a runtime that has run (see validate.check_arch)


@dataclass(frozen=True)
class LoadInfo:
    """How the kernel of one call was obtained."""

    name: str
    content_hash: str
    source: str  # "memory" (already loaded), "disk" (cache hit), "built" (generated + assembled)
    build_s: float = 0.0  # generate + assemble (0 unless built)
    cache_s: float = 0.0  # cache lookup and write, outside the build
    load_s: float = 0.0  # cuModuleLoadData and friends
    cache_path: str = ""
    rebuilt_reason: str = ""  # why a cache entry on disk was not used


@dataclass(frozen=True)
class CallInfo:
    problem: Problem
    launched: bool  # False for empty outputs and Skv == 0 (answered without a kernel)
    kernel: LoadInfo | None
    copied: tuple[str, ...]  # inputs copied to a TMA-legal layout
    host_s: float  # host time of the call (the launch is asynchronous)


_local = threading.local()

FORWARD_ONLY = ("fa4gen.attention is forward-only (no backward): call it under torch.no_grad() / "
                "torch.inference_mode() or pass detached tensors")


def last_call_info() -> CallInfo | None:
    """What this thread's last `attention` call did (None before the first call)."""
    return getattr(_local, "info", None)


def config_for(problem) -> KernelConfig:
    """The kernel of a validated Problem (dense) or VarlenProblem (varlen)."""
    from .plan import q_tile_rows

    kv = isinstance(problem, validate.KvcacheProblem)
    varlen = isinstance(problem, validate.VarlenProblem)
    return KernelConfig(arch=RUNTIME_ARCH, head_dim=problem.head_dim, causal=problem.causal,
                        gqa_ratio=problem.gqa_ratio, dtype=problem.dtype, varlen=varlen, kvcache=kv,
                        page_size=problem.page_size if kv else 0,
                        block_m=q_tile_rows(RUNTIME_ARCH, problem.head_dim, problem.gqa_ratio, varlen, kv,
                                            problem.causal, getattr(problem, "seqlen_q", None)))


def build(cfg: KernelConfig) -> tuple[bytes, dict]:
    """Generate and assemble one kernel through the one chain (codegen.build: pipeline -> verify,
    cached -> lower -> render -> assemble): (cubin, manifest). A pipeline with findings raises."""
    from . import codegen

    res = codegen.build(cfg, emit=("cubin",))
    return res.cubin, res.manifest


def get_kernel(cfg: KernelConfig, device=None, cache: CubinCache | None = None):
    """The loaded Kernel for cfg on a CUDA device (default: the current one): from this process's
    table, else the disk cache, else built. Returns (kernel, LoadInfo)."""
    import torch

    from .runtime import Kernel

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    store = cache if cache is not None else CubinCache()
    info: list[LoadInfo] = []

    def factory():
        t0 = time.perf_counter()
        r = store.get_or_build(cfg, build)
        t1 = time.perf_counter()
        with torch.cuda.device(device):
            kernel = Kernel.load(r.cubin, r.manifest)
        t2 = time.perf_counter()
        li = LoadInfo(name=cfg.name, content_hash=cfg.content_hash, source="disk" if r.hit else "built",
                      build_s=r.build_s, cache_s=(t1 - t0) - r.build_s, load_s=t2 - t1, cache_path=str(r.path),
                      rebuilt_reason=r.reason if r.found is EntryState.CORRUPT else "")
        log.debug("fa4gen %s: %s; build %.3f s, cache %.3f s, load %.3f s%s", cfg.name, li.source, li.build_s,
                  li.cache_s, li.load_s, f" (rebuilt: {li.rebuilt_reason})" if li.rebuilt_reason else "")
        info.append(li)
        return kernel

    kernel, created = KERNELS.get_or_create((cfg.content_hash, device.index), factory)
    if not created:
        info.append(LoadInfo(name=cfg.name, content_hash=cfg.content_hash, source="memory"))
    return kernel, info[-1]


# Per-call host cost matters at small shapes (a 16 x 1024 causal call is ~180 us of GPU time):
# content_hash (dataclass -> JSON -> sha256) alone is ~50 us, so calls after the first map the
# problem's kernel key straight to the loaded kernel, as long as the registry still holds it.
_fast: dict[tuple, tuple[tuple[str, int], LoadInfo]] = {}
_arch_ok: set[int] = set()


def _kernel_for(problem, dev):
    key = (problem.head_dim, problem.causal, problem.gqa_ratio, problem.dtype, dev.index,
           isinstance(problem, validate.VarlenProblem),
           problem.page_size if isinstance(problem, validate.KvcacheProblem) else -1)
    known = _fast.get(key)
    if known is not None:
        kernel = KERNELS.peek(known[0])
        if kernel is not None:
            return kernel, known[1]
    cfg = config_for(problem)
    kernel, info = get_kernel(cfg, dev)
    _fast[key] = ((cfg.content_hash, dev.index), LoadInfo(name=cfg.name, content_hash=cfg.content_hash,
                                                          source="memory"))
    return kernel, info


def _tma_ready(t, name: str, why: str | None):
    """t itself (size-1 dims given legal strides) or, when TMA cannot address it, a packed copy."""
    if why is not None:
        log.debug("fa4gen copies %s to a contiguous layout: %s", name, why)
        # .contiguous() returns a misaligned but packed view unchanged; a clone gets a fresh
        # (allocator-aligned) block
        c = t.contiguous()
        return c if c.data_ptr() != t.data_ptr() else t.clone()
    strides = validate.canonical_strides(tuple(t.shape), tuple(t.stride()))
    return t if strides == tuple(t.stride()) else t.as_strided(t.shape, strides)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Attention forward, flash-attn layout: softmax(q kᵀ * softmax_scale) v per (batch, head).

    q: (B, Sq, Hq, D); k, v: (B, Skv, Hkv, D); float16 or bfloat16, all the same, on one CUDA device of
    compute capability 9.0 (H100/H200). D is 64 or 128. Hq must be a multiple of Hkv, any ratio
    G = Hq/Hkv (GQA/MQA: query head h reads kv head h // G; a ratio dividing 128 packs G heads per
    128-row Q tile, any other ratio runs one head per tile, fa4gen.plan.gqa_pack). softmax_scale defaults to
    1/sqrt(D). causal=True masks bottom-right aligned: query i sees keys j <= i + Skv - Sq, so with
    Sq > Skv the first Sq - Skv rows see no key and get O = 0, LSE = -inf.

    Returns o (B, Sq, Hq, D) in the input dtype, or, when return_lse, (o, lse) with lse (B, Hq, Sq)
    float32: the natural-log logsumexp of each row's scaled scores over the keys it sees.

    Layout: the kernel reads q/k/v through TMA, which needs the last dim contiguous, every other
    stride a multiple of 16 bytes and a 16-byte-aligned base; views meeting that (e.g. q, k, v
    sliced out of one packed qkv tensor, or a (B, H, S, D) tensor transposed to (B, S, H, D)) are
    read in place, any other layout is first copied with `.contiguous()` (costs one copy; see
    `last_call_info().copied`). Empty outputs and Skv == 0 are answered without a launch. Forward
    only: inputs that require grad while grad mode is on are refused rather than silently
    returning a result autograd cannot differentiate.

    Raises a subclass of `fa4gen.validate.Fa4genInputError` (TypeError or ValueError) for every
    input problem, before anything is built or launched.

    Under `torch.compile` (fullgraph too) the call goes through the custom op
    `torch.ops.fa4gen.attention_fwd` (fa4gen/torch_ops.py): Dynamo cannot trace the launch, the op
    hides it behind a fake implementation that gives the output shapes, and the compiled graph calls
    this same eager path at run time (also inside CUDA graphs: the launch is on the current stream,
    with no host sync). Eager calls skip the op: its dispatch adds 13-40 us a call on
    the (noisy, 2-core) CPU machine (scripts/torch_op_overhead.py).
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention needs torch (pip install torch)") from e
    if torch.compiler.is_compiling():
        from . import torch_ops

        return torch_ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    return _attention_eager(torch, q, k, v, causal, softmax_scale, return_lse)


def _attention_eager(torch, q, k, v, causal, softmax_scale, return_lse, check_grad: bool = True):
    """`attention` outside a compiled region (and the body of the custom op's real implementation):
    validate, get the kernel, launch on the current stream, record `last_call_info`."""
    t0 = time.perf_counter()
    metas = validate.tensor_metas(q, k, v)  # every argument that is not a dense tensor, in one error
    problem = validate.check_problem(*metas, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    dev = q.device
    if dev.index not in _arch_ok:
        validate.check_arch(torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
        _arch_ok.add(dev.index)
    if check_grad and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise validate.InputValueError(FORWARD_ONLY)

    def launch(q, k, v, o, lse):
        kernel, kinfo = _kernel_for(problem, dev)
        kernel(q, k, v, o, lse=lse, softmax_scale=problem.softmax_scale)
        return kinfo

    return _record(problem, t0, *_answer(torch, problem, q, k, v, return_lse, launch))


def _answer(torch, problem, q, k, v, return_lse, launch):
    """The outputs of a validated problem (dense or varlen): o and, with return_lse, lse allocated on
    q's device; empty problems answered as they are and keyless ones with O = 0, LSE = -inf, without
    a launch; otherwise the inputs TMA cannot read in place copied (problem.relayout) and
    `launch(q, k, v, o, lse)` called on q's device. Returns (o, lse, whether it launched, what
    launch returned, the names of the copied inputs)."""
    dev = q.device
    o = torch.empty(problem.out_shape, dtype=q.dtype, device=dev)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=dev) if return_lse else None
    if problem.is_empty:
        return o, lse, False, None, ()
    if problem.no_keys:
        o.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return o, lse, False, None, ()
    why = dict(problem.relayout)
    q, k, v = (_tma_ready(t, n, why.get(n)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    with torch.cuda.device(dev):
        ran = launch(q, k, v, o, lse)
    return o, lse, True, ran, tuple(why)


def _record(problem, t0, o, lse, launched, kinfo, copied):
    """Record this thread's `last_call_info` and return what the call returns."""
    _local.info = CallInfo(problem, launched, kinfo, copied, time.perf_counter() - t0)
    return (o, lse) if problem.return_lse else o


# ---- varlen ------------------------------------------------------------------------------------
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False, seqused_k=None):
    """Attention over a packed batch of variable-length sequences (flash-attn's varlen conventions).

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D); float16 or bfloat16, on one CUDA device of compute
    capability 9.0. cu_seqlens_q / cu_seqlens_k: int32 (B + 1,) on the same device; sequence b's
    queries are rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q, its keys rows
    [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v, of which only the first seqused_k[b] are used
    when seqused_k (int32 (B,)) is given. A sequence may have length 0. GQA as in `attention`.
    causal=True is bottom-right aligned per sequence (query i of a sequence with Lq queries and Lk
    keys sees keys j <= i + Lk - Lq); rows that see no key get O = 0 and LSE = -inf.

    max_seqlen_q / max_seqlen_k: the longest sequence (flash-attn's arguments). The kernel does not
    depend on them (its scheduler reads the lengths on the device); they are checked where the host
    can: B sequences of at most max_seqlen_q rows must be able to hold total_q rows.

    Returns o (total_q, Hq, D) and, with return_lse, lse (Hq, total_q) float32. Rows of q outside
    every sequence are not written.

    Raises a `fa4gen.validate.Fa4genInputError` for every problem visible without a device sync
    (wrong dtype, device or length of cu_seqlens or seqused_k, inconsistent sizes). The offsets
    themselves stay on the device: non-monotonic or out-of-range values are clamped by the kernel
    (start = min(cu[b], total), end = min(max(cu[b+1], start), total)), so it never reads or writes
    outside its tensors, whatever they hold.

    Under `torch.compile` (fullgraph too) the call goes through the custom op
    `torch.ops.fa4gen.attention_varlen_fwd` (fa4gen/torch_ops.py), as `attention` does.
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention_varlen needs torch (pip install torch)") from e
    if torch.compiler.is_compiling():
        from . import torch_ops

        return torch_ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                          seqused_k=seqused_k)
    return _attention_varlen_eager(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, return_lse, seqused_k)


def _varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, meta=None):
    """TensorMetas of the varlen arguments (None for an absent seqused_k); every argument that is not
    a dense tensor reported in one error. `meta` replaces validate.tensor_meta (fake tensors)."""
    return _metas_of(((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"),
                      (seqused_k, "seqused_k")), ("seqused_k",), meta)


def _metas_of(items, optional, meta=None):
    """TensorMeta per (tensor, name) in items, None for an absent (None) optional one; every argument
    that is not a dense tensor reported in one error."""
    meta = meta or validate.tensor_meta
    metas, errors = [], []
    for t, n in items:
        if t is None and n in optional:
            metas.append(None)
            continue
        try:
            metas.append(meta(t, n))
        except Fa4genInputError as e:
            metas.append(None)
            errors.append(e)
    validate.raise_all(errors)
    return metas


def _attention_varlen_eager(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                            softmax_scale, return_lse, seqused_k, check_grad: bool = True):
    """`attention_varlen` outside a compiled region (and the custom op's real implementation)."""
    t0 = time.perf_counter()
    qm, km, vm, cqm, ckm, sum_ = _varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
    problem = validate.check_varlen_problem(qm, km, vm, cqm, ckm, max_seqlen_q, max_seqlen_k, seqused_k=sum_,
                                            causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    dev = q.device
    if dev.index not in _arch_ok:
        validate.check_arch(torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
        _arch_ok.add(dev.index)
    if check_grad and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise validate.InputValueError(FORWARD_ONLY.replace("fa4gen.attention", "fa4gen.attention_varlen"))
    def launch(q, k, v, o, lse):
        kernel, kinfo = _kernel_for(problem, dev)
        kernel.varlen(q, k, v, o, cu_seqlens_q, cu_seqlens_k, problem.max_seqlen_q, problem.max_seqlen_k, lse=lse,
                      seqused_k=seqused_k, softmax_scale=problem.softmax_scale)
        return kinfo

    return _record(problem, t0, *_answer(torch, problem, q, k, v, return_lse, launch))


# ---- KV cache (decode) ---------------------------------------------------------------------------
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=None, causal: bool = True,
                           softmax_scale: float | None = None, num_splits: int = 0, return_lse: bool = False):
    """Attention of a few new queries over a KV cache (decode, speculative decode, chunked prefill).

    q: (B, Sq, Hq, D), Sq >= 1. The cache is contiguous, k_cache / v_cache (B, Smax, Hkv, D), or
    paged, (num_pages, page_size, Hkv, D) with page_table (B, max_pages) int32: key j of sequence b
    is row j % page_size of page page_table[b, j // page_size] (vLLM-style block tables; page_size
    a power of two in [16, 256]). cache_seqlens (B,) int32: the valid keys of each sequence.
    float16 or bfloat16, D 64 or 128, any GQA ratio Hq / Hkv, on one CUDA device of compute
    capability 9.0. causal=True aligns the Sq queries to the end of each sequence (query i sees
    keys j <= i + cache_seqlens[b] - Sq); rows that see no key get O = 0 and LSE = -inf.

    num_splits: the keys of each (sequence, kv head) are cut into this many ranges processed by
    different CTAs, whose partial outputs (fp32) a generated combine kernel merges by their LSE.
    0 (default) chooses from the shape and the SM count (fa4gen.schedule.choose_num_splits); 1
    writes O directly (no combine kernel).

    cache_seqlens and page_table may live on the GPU (no host sync: out-of-range values are clamped
    by the kernel, which never reads outside the cache: lengths to [0, capacity], page entries to
    the last page) or on the CPU (then their values are checked here, with a clear error, and
    copied to the GPU). Returns o (B, Sq, Hq, D) and, with return_lse, lse (B, Hq, Sq) float32.
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention_with_kvcache needs torch (pip install torch)") from e
    t0 = time.perf_counter()
    metas = _kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table)
    problem = validate.check_kvcache_problem(*metas, causal=causal, softmax_scale=softmax_scale,
                                             num_splits=num_splits, return_lse=return_lse)
    dev = q.device
    if dev.index not in _arch_ok:
        validate.check_arch(torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
        _arch_ok.add(dev.index)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise validate.InputValueError(FORWARD_ONLY.replace("fa4gen.attention", "fa4gen.attention_with_kvcache"))
    return _record(problem, t0, *_kvcache_answer(torch, problem, lambda: _kernel_for(problem, dev), q, k_cache,
                                                 v_cache, cache_seqlens, page_table, return_lse))


def _kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table, meta=None):
    """TensorMetas of the KV-cache arguments (None for an absent page_table), every argument that is
    not a dense tensor reported in one error."""
    return _metas_of(((q, "q"), (k_cache, "k"), (v_cache, "v"), (cache_seqlens, "cache_seqlens"),
                      (page_table, "page_table")), ("page_table",), meta)


def _kvcache_answer(torch, problem, get_kernel, q, k_cache, v_cache, cache_seqlens, page_table, return_lse):
    """`_answer` for a validated KV-cache problem: CPU-held lengths / page entries checked and copied
    to the device, the kernel got (`get_kernel()` -> (Kernel, LoadInfo)), the split count chosen
    (num_splits = 0), the fp32 partials allocated, the kernel (and the combine kernel) launched."""
    dev = q.device
    if problem.host_index and not problem.is_empty and not problem.no_keys:
        validate.check_kvcache_values(cache_seqlens.tolist(), None if page_table is None else page_table.tolist(),
                                      problem)
        cache_seqlens = cache_seqlens.to(dev, non_blocking=True)
        if page_table is not None:
            page_table = page_table.to(dev, non_blocking=True)

    def launch(q, k, v, o, lse):
        kernel, kinfo = get_kernel()
        S = problem.num_splits or kernel.kvcache_num_splits(problem.batch, problem.heads_kv, problem.seqlen_q,
                                                            problem.capacity)
        o_part = lse_part = None
        if S > 1:
            rows = problem.batch * problem.seqlen_q * problem.heads_q
            o_part = torch.empty((S, rows, problem.head_dim), dtype=torch.float32, device=dev)
            lse_part = torch.empty((S, rows), dtype=torch.float32, device=dev)
        kernel.kvcache(q, k, v, o, cache_seqlens, page_table, num_splits=S, lse=lse,
                       softmax_scale=problem.softmax_scale, o_partial=o_part, lse_partial=lse_part)
        return kinfo

    return _answer(torch, problem, q, k_cache, v_cache, return_lse, launch)


# ---- prebuilt cubins ---------------------------------------------------------------------------
class KernelLoadError(ValueError):
    """fa4gen.load was given files that are not a loadable fa4gen kernel (missing or mismatched)."""


_MANIFEST_KEYS = ("name", "config", "arch", "entry", "params", "dynamic_smem_bytes", "grid", "tensor_maps",
                  "threads_per_cta")


def read_prebuilt(cubin_path) -> tuple[bytes, dict, KernelConfig]:
    """(cubin, manifest, config) of a prebuilt kernel: `<stem>.cubin` and the `<stem>.json` manifest
    that `fa4gen build` writes beside it, checked against each other. Needs neither torch nor a GPU."""
    import hashlib
    import json
    from pathlib import Path

    from .config import ConfigError
    from .cubin import cubin_problem

    path = Path(cubin_path)
    if not path.is_file():
        raise KernelLoadError(f"{path}: no such cubin file")
    mpath = path.with_suffix(".json")
    if not mpath.is_file():
        raise KernelLoadError(f"{path}: no manifest {mpath.name} beside it (fa4gen build writes DIR/<name>.json "
                              "next to DIR/<name>.cubin; ship both)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise KernelLoadError(f"{mpath}: not a readable JSON manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise KernelLoadError(f"{mpath}: not a JSON object")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise KernelLoadError(f"{mpath}: not an fa4gen build manifest (no {', '.join(missing)})")
    try:
        cfg = KernelConfig.from_dict(manifest["config"])
    except (ConfigError, TypeError) as e:
        raise KernelLoadError(f"{mpath}: its config is not valid here ({e})") from None
    if manifest["arch"] != cfg.arch or manifest["name"] != cfg.name:
        raise KernelLoadError(f"{mpath}: says {manifest['name']} ({manifest['arch']}) but its config is "
                              f"{cfg.name} ({cfg.arch})")
    cubin = path.read_bytes()
    bad = cubin_problem(cubin, cfg.arch)
    if bad:
        raise KernelLoadError(f"{path} is {bad}, but its manifest {mpath.name} describes {cfg.name} ({cfg.arch})")
    want = manifest.get("cubin_sha256")
    if want is not None and hashlib.sha256(cubin).hexdigest() != want:
        raise KernelLoadError(f"{path}: its sha256 is not the one {mpath.name} names (a different cubin)")
    if str(manifest["entry"]).encode() not in cubin:
        raise KernelLoadError(f"{path} has no entry {manifest['entry']!r}, which {mpath.name} names")
    if cfg.arch != RUNTIME_ARCH:
        raise KernelLoadError(f"{path} is an {cfg.arch} kernel; fa4gen launches {RUNTIME_ARCH} (H100/H200) kernels "
                              "only (sm_100a kernels have never run on a Blackwell GPU)")
    return cubin, manifest, cfg


class PrebuiltKernel:
    """A kernel loaded from a shipped cubin: call it like fa4gen.attention, minus `causal` (fixed at
    build time). Inputs are validated the same way; head_dim, dtype and GQA ratio must be the ones
    the kernel was built for."""

    def __init__(self, kernel, manifest: dict, config: KernelConfig, path: str):
        self.kernel = kernel
        self.manifest = manifest
        self.config = config
        self.path = path

    def __repr__(self):
        return f"PrebuiltKernel({self.config.name}, {self.path})"

    def __call__(self, q, k, v, softmax_scale: float | None = None, return_lse: bool = False):
        import torch

        if self.config.varlen:
            raise validate.InputValueError(f"{self.config.name} is a varlen kernel: call kernel.varlen(q, k, v, "
                                           "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)")
        if self.config.kvcache:
            raise validate.InputValueError(f"{self.config.name} is a KV-cache kernel: call kernel.kvcache(q, k_cache, "
                                           "v_cache, cache_seqlens, page_table=..., ...)")
        metas = validate.tensor_metas(q, k, v)
        cfg = self.config
        p = validate.check_problem(*metas, causal=cfg.causal, softmax_scale=softmax_scale, return_lse=return_lse)
        self._check_fits(torch, p, q, k, v)

        def launch(q, k, v, o, lse):
            self.kernel(q, k, v, o, lse=lse, softmax_scale=p.softmax_scale)

        o, lse, *_ = _answer(torch, p, q, k, v, return_lse, launch)
        return (o, lse) if return_lse else o

    def _check_fits(self, torch, p, q, k, v) -> None:
        """The validated problem p is one this kernel was built for, on its device, without grad."""
        cfg = self.config
        got = (p.head_dim, p.dtype, p.gqa_ratio)
        if not p.is_empty and got != (cfg.head_dim, cfg.dtype, cfg.gqa_ratio):
            raise validate.InputValueError(
                f"{cfg.name} was built for head_dim {cfg.head_dim}, {cfg.dtype}, GQA ratio {cfg.gqa_ratio}; "
                f"the inputs are head_dim {p.head_dim}, {p.dtype}, GQA ratio {p.gqa_ratio}")
        if q.device.index != self.kernel.device:
            raise validate.DeviceError(f"{self.path} was loaded on cuda:{self.kernel.device}, the inputs are on "
                                       f"{q.device}: load it once per device")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise validate.InputValueError("fa4gen kernels are forward-only: call under torch.no_grad()")


    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float | None = None, return_lse: bool = False, seqused_k=None):
        """A prebuilt varlen kernel (`fa4gen build --varlen`), called like fa4gen.attention_varlen
        minus `causal` (fixed at build time); inputs validated the same way."""
        import torch

        cfg = self.config
        if not cfg.varlen:
            raise validate.InputValueError(f"{cfg.name} is not a varlen kernel: call kernel"
                                           + (".kvcache(q, k_cache, v_cache, cache_seqlens, ...)" if cfg.kvcache
                                              else "(q, k, v, ...)"))
        metas = _varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        p = validate.check_varlen_problem(*metas[:5], max_seqlen_q, max_seqlen_k, seqused_k=metas[5],
                                          causal=cfg.causal, softmax_scale=softmax_scale, return_lse=return_lse)
        self._check_fits(torch, p, q, k, v)

        def launch(q, k, v, o, lse):
            self.kernel.varlen(q, k, v, o, cu_seqlens_q, cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, lse=lse,
                               seqused_k=seqused_k, softmax_scale=p.softmax_scale)

        o, lse, *_ = _answer(torch, p, q, k, v, return_lse, launch)
        return (o, lse) if return_lse else o


    def kvcache(self, q, k_cache, v_cache, cache_seqlens, page_table=None, softmax_scale: float | None = None,
                num_splits: int = 0, return_lse: bool = False):
        """A prebuilt KV-cache kernel (`fa4gen build --kvcache [--page-size N]`), called like
        fa4gen.attention_with_kvcache minus `causal` (fixed at build time); inputs validated the same way,
        and the cache's layout (contiguous, or paged with this page size) must be the kernel's."""
        import torch

        cfg = self.config
        if not cfg.kvcache:
            raise validate.InputValueError(f"{cfg.name} is not a KV-cache kernel: call kernel"
                                           + (".varlen(...)" if cfg.varlen else "(q, k, v, ...)"))
        metas = _kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table)
        p = validate.check_kvcache_problem(*metas, causal=cfg.causal, softmax_scale=softmax_scale,
                                           num_splits=num_splits, return_lse=return_lse)
        self._check_fits(torch, p, q, k_cache, v_cache)
        if p.page_size != cfg.page_size:
            want = f"a paged cache of page size {cfg.page_size} (and a page_table)" if cfg.page_size else \
                "a contiguous cache (B, Smax, Hkv, D) and no page_table"
            got = f"page size {p.page_size}" if p.page_size else "a contiguous cache"
            raise validate.InputValueError(f"{cfg.name} takes {want}; got {got}")
        o, lse, *_ = _kvcache_answer(torch, p, lambda: (self.kernel, None), q, k_cache, v_cache, cache_seqlens,
                                     page_table, return_lse)
        return (o, lse) if return_lse else o


def load(cubin_path, device=None) -> PrebuiltKernel:
    """Load a prebuilt kernel: `cubin_path` and the manifest beside it (same stem, .json), as
    `fa4gen build --arch sm_90a` writes them. Returns a callable `kernel(q, k, v, softmax_scale=None,
    return_lse=False)`. Raises KernelLoadError when the manifest is missing or does not match the
    cubin (not a cubin, another arch, another sha256 or entry), before touching torch or the GPU;
    needs torch and cuda-python to load."""
    cubin, manifest, cfg = read_prebuilt(cubin_path)
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.load needs torch (pip install -e \".[cuda,torch]\")") from e
    from .runtime import Kernel

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    validate.check_arch(torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
    with torch.cuda.device(dev):
        kernel = Kernel.load(cubin, manifest)
    return PrebuiltKernel(kernel, manifest, cfg, str(cubin_path))
