"""The eager launch behind the torch-facing API (fa4gen.runtime.api) and its custom ops (fa4gen.runtime.torch_ops):
validate a call, find its kernel (this process's table, the disk cache, or a build), launch it on the
current stream, and record `last_call_info`.

First call of a variant: generate the sm_90a PTX, assemble it (ptxas, or nvJitLink on a machine
without a toolkit), cache the cubin on disk, load it; later calls in the process reuse the loaded
kernel, and later processes load the cached cubin. `last_call_info()` says which of these happened
and how long each took (also logged at DEBUG on the "fa4gen" logger).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass

from . import bundle, validate
from ..assemble.cache import KERNELS, CubinCache, EntryState
from .runtime import dense_ptrs, kvcache_ptrs, out_ptrs, run_kvcache, varlen_ptrs  # noqa: F401 (api.py reads them here)
from ..spec.config import KernelConfig
from ..spec.tiles import q_tile_rows
from .validate import RUNTIME_ARCH, Fa4genInputError, Problem

log = logging.getLogger("fa4gen")


@dataclass(frozen=True)
class LoadInfo:
    """How the kernel of one call was obtained."""

    name: str
    content_hash: str
    source: str  # "memory" (already loaded), "bundle" (a loaded bundle's cubin), "disk" (cache hit), "built"
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
    info = getattr(_local, "info", None)
    if type(info) is tuple:  # a call records CallInfo's fields; the object is made when asked for
        info = _local.info = CallInfo(*info)
    return info


def config_fields(problem) -> tuple[tuple[str, object], ...]:
    """The KernelConfig fields of a validated Problem (dense), VarlenProblem or KvcacheProblem: the one
    place that decides a call's kernel. `config_for` builds the config from them and the fast path
    of `kernel_for` memoises on them, so whatever this reads of the problem (the Q tile rows read the
    query length) is in the memo key too."""
    kv = isinstance(problem, validate.KvcacheProblem)
    varlen = isinstance(problem, validate.VarlenProblem)
    return (("arch", RUNTIME_ARCH), ("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v),
            ("causal", problem.causal),
            ("gqa_ratio", problem.gqa_ratio), ("dtype", problem.dtype), ("varlen", varlen), ("kvcache", kv),
            ("page_size", problem.page_size if kv else 0),
            ("block_m", q_tile_rows(RUNTIME_ARCH, problem.head_dim, problem.gqa_ratio, varlen, kv, problem.causal,
                                    problem.max_seqlen_q if varlen else getattr(problem, "seqlen_q", None)))) + problem.mods.flags


def config_for(problem) -> KernelConfig:
    """The kernel of a validated problem (dense, varlen or KV cache): `config_fields` made a config."""
    return KernelConfig(**dict(config_fields(problem)))


def build(cfg: KernelConfig) -> tuple[bytes, dict]:
    """Generate and assemble one kernel through the one chain (codegen.build: pipeline -> verify,
    cached -> lower -> render -> assemble): (cubin, manifest). A pipeline with findings raises."""
    from .. import codegen

    res = codegen.build(cfg, emit=("cubin",))
    return res.cubin, res.manifest


def registry_key(cfg: KernelConfig, device_index) -> tuple[str, object]:
    """The key of cfg's loaded kernel in this process's table (KERNELS): its config and device. Not
    the content hash: that hashes the generator's sources (~0.1 s at a process's first call), which
    a process that loads a bundle never needs; within one process the sources do not change."""
    return bundle.config_key(cfg), device_index


def get_kernel(cfg: KernelConfig, device=None, cache: CubinCache | None = None):
    """The loaded Kernel for cfg on a CUDA device (default: the current one): from this process's
    table, else a loaded bundle (fa4gen/runtime/bundle.py), else the disk cache, else built.
    Returns (kernel, LoadInfo)."""
    import torch

    from .runtime import Kernel

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    info: list[LoadInfo] = []
    key = registry_key(cfg, device.index)

    def factory():
        t0 = time.perf_counter()
        hit = bundle.find(cfg)
        r = None if hit is not None else (cache if cache is not None else CubinCache()).get_or_build(cfg, build)
        cubin, manifest = ((hit.cubin_path.read_bytes(), json.loads(hit.manifest_path.read_text())) if r is None
                           else (r.cubin, r.manifest))
        t1 = time.perf_counter()
        with torch.cuda.device(device):
            kernel = Kernel.load(cubin, manifest)
        t2 = time.perf_counter()
        if r is None:
            li = LoadInfo(name=cfg.name, content_hash=hit.content_hash, source="bundle", cache_s=t1 - t0,
                          load_s=t2 - t1, cache_path=str(hit.cubin_path))
        else:
            li = LoadInfo(name=cfg.name, content_hash=cfg.content_hash, source="disk" if r.hit else "built",
                          build_s=r.build_s, cache_s=(t1 - t0) - r.build_s, load_s=t2 - t1, cache_path=str(r.path),
                          rebuilt_reason=r.reason if r.found is EntryState.CORRUPT else "")
        log.debug("fa4gen %s: %s; build %.3f s, cache %.3f s, load %.3f s%s", cfg.name, li.source, li.build_s,
                  li.cache_s, li.load_s, f" (rebuilt: {li.rebuilt_reason})" if li.rebuilt_reason else "")
        info.append(li)
        _hashes[key] = li.content_hash
        return kernel

    kernel, created = KERNELS.get_or_create(key, factory)
    if not created:
        info.append(LoadInfo(name=cfg.name, content_hash=_hashes.get(key) or cfg.content_hash, source="memory"))
    return kernel, info[-1]


_hashes: dict[tuple[str, object], str] = {}  # registry key -> the content hash its kernel was built with


# Per-call host cost matters at small shapes (a 16 x 1024 causal call is ~180 us of GPU time):
# registry_key (dataclass -> JSON) costs tens of us, so calls after the first map the
# problem's kernel key (config_fields: a tuple of a few ints and strings) straight to the loaded kernel,
# as long as the registry still holds it.
_fast: dict[tuple, tuple[tuple[str, int], LoadInfo]] = {}
_arch_ok: set[int] = set()


# ---- the per-call fast path ------------------------------------------------------------------------
# Validation is a pure function of the arguments' metadata (shapes, strides, dtypes, devices, the
# data pointers' alignment) and the scalar arguments; it costs ~50-100 us of Python a call, more than
# a decode kernel runs. A call whose signature was validated before reuses that Problem. A signature
# exists only for plain dense CUDA tensors and scalars of the exact types bool / int / float / None
# (and tuples of them): anything else (subclasses, a 0-d tensor as a scale, a list) has no signature
# and is validated in full every time, so a memo hit can never skip a check that would have failed.
_SIG_SCALARS = frozenset((bool, int, float, type(None)))
_MEMO_LIMIT = 256


class _NoSignature(Exception):
    pass


def _scalar_sig(x):
    """(type, value) of a scalar argument, element-wise for a tuple; _NoSignature for anything else
    (True == 1 and hash alike: the type keeps a bool from reusing an int's entry)."""
    t = type(x)
    if t in _SIG_SCALARS:
        return (t, x)
    if t is tuple:
        return (t, tuple(_scalar_sig(e) for e in x))
    raise _NoSignature


def call_signature(torch, kind: str, tensors, scalars):
    """The memo key of a call (None: the call has no signature and is validated in full). Per tensor,
    what validation reads of it: shape, strides, dtype, device and the data pointer's alignment (mod
    16, the TMA's); None is a signature too (an absent optional tensor). One flat tuple, built
    in one loop: this runs on every call."""
    key = [kind]
    tensor_type, strided = torch.Tensor, torch.strided
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is not tensor_type or t.layout is not strided or t.is_nested or not t.is_cuda:
            return None
        else:
            key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
    try:
        for x in scalars:
            key.append((type(x), x) if type(x) in _SIG_SCALARS else _scalar_sig(x))
    except _NoSignature:
        return None
    return tuple(key)


@dataclass(frozen=True)
class Prepared:
    """A validated call: its Problem, its kernel's config fields (None when it launches nothing: empty
    or keyless), and per input tensor how the launch
    takes it (None: as it is; a tuple: the same storage with those strides (size-1 dims given legal
    ones); a str: why it is first copied to a packed layout)."""

    problem: object
    fields: tuple
    takes: tuple


class _Memo:
    def __init__(self, limit: int):
        self._d: dict = {}
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, key):
        return None if key is None else self._d.get(key)

    def put(self, key, value) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._d) >= self._limit:
                self._d.clear()
            self._d[key] = value


_calls = _Memo(_MEMO_LIMIT)


_NO_KEY = object()


def prepared(torch, kind: str, tensors, scalars, validate_call, tma_inputs, key=_NO_KEY) -> Prepared:
    """The Prepared of a call: from the memo when its signature was validated before, else
    `validate_call()` (which raises on any input problem) and memoised. tma_inputs: the (tensor,
    name) pairs the kernel reads through TMA, in launch order. key: the call's signature when the
    caller has it already."""
    if key is _NO_KEY:
        key = call_signature(torch, kind, tensors, scalars)
    hit = _calls.get(key)
    if hit is not None:
        return hit
    problem = validate_call()
    takes = takes_of(problem, tma_inputs)
    # empty and keyless problems launch nothing (answer); their sizes need not make a kernel
    fields = None if problem.is_empty or problem.no_keys else config_fields(problem)
    prep = Prepared(problem, fields, takes)
    _calls.put(key, prep)
    return prep


def kernel_for(problem, dev, fields=None):
    key = (fields if fields is not None else config_fields(problem), dev.index)
    known = _fast.get(key)
    if known is not None:
        kernel = KERNELS.peek(known[0])
        if kernel is not None:
            return kernel, known[1]
    cfg = KernelConfig(**dict(key[0]))
    kernel, info = get_kernel(cfg, dev)
    _fast[key] = (registry_key(cfg, dev.index), LoadInfo(name=cfg.name, content_hash=info.content_hash,
                                                         source="memory"))
    return kernel, info


def check_device_and_grad(torch, dev, tensors, check_grad: bool, entry: str) -> None:
    """The checks of a validated call that need the device: its compute capability (once per device)
    and, when check_grad, no input that requires grad while grad mode is on (forward only)."""
    if dev.index not in _arch_ok:
        validate.check_arch(torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
        _arch_ok.add(dev.index)
    if check_grad and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise validate.InputValueError(FORWARD_ONLY.replace("fa4gen.attention", entry))


def _tma_ready(t, name: str, take):
    """t as the launch takes it (Prepared.takes): itself, the same storage with legal strides for its
    size-1 dims, or, when TMA cannot address it (take: why), a packed copy."""
    if take is None:
        return t
    if isinstance(take, str):
        log.debug("fa4gen copies %s to a contiguous layout: %s", name, take)
        # .contiguous() returns a misaligned but packed view unchanged; a clone gets a fresh
        # (allocator-aligned) block
        c = t.contiguous()
        return c if c.data_ptr() != t.data_ptr() else t.clone()
    return t.as_strided(t.shape, take)


def sink_meta(learnable_sink, meta=None):
    """The TensorMeta of learnable_sink (None when absent)."""
    return None if learnable_sink is None else (meta or validate.tensor_meta)(learnable_sink, "learnable_sink")


def sink_f32(torch, learnable_sink):
    """learnable_sink as the kernels read it: contiguous float32 (a copy only when it is not already)."""
    if learnable_sink is None:
        return None
    return learnable_sink.to(torch.float32).contiguous()


# ---- the per-signature fast path ---------------------------------------------------------------
# A call whose signature launched before with every input read in place (no copy, no re-strided
# view; a KV cache's lengths and page table on the device) reuses that launch: its problem, its
# kernel's Bounds (runtime.Bound: every parameter the metadata decides, packed once) and the size of
# its fp32 partials. Per call it allocates the outputs, reads the data pointers and launches: no
# validation, no kernel lookup, no parameter assembly. Taken only while the kernel stays loaded.
@dataclass(frozen=True)
class _Fast:
    problem: object
    rkey: tuple  # the kernel's registry key (KERNELS.peek)
    kinfo: LoadInfo  # source "memory"
    run: object  # (pointers by parameter name) -> None: the kernel's Bound(s)
    ws_elems: int = 0  # KV cache with splits: fp32 elements of the partials (every split's O, then its LSE)
    lse_offset: int = 0  # bytes from the partials' start to their LSEs


_fasts = _Memo(_MEMO_LIMIT)


def fast_for(key, memo: _Memo = _fasts) -> _Fast | None:
    """The fast path of a call signature (None: none, or its kernel was unloaded since)."""
    fast = memo.get(key)
    return fast if fast is not None and (fast.rkey is None or KERNELS.peek(fast.rkey) is not None) else None


def remember(key, problem, takes, copied, run, rkey=None, kinfo=None, ws_elems: int = 0, lse_offset: int = 0,
             memo: _Memo = _fasts) -> None:
    """Keep a signature's launch for the fast path when it read every input in place. rkey: the
    kernel's registry key (None: a kernel its caller holds, fa4gen.load's)."""
    if key is None or run is None or copied or any(t is not None for t in takes):
        return
    memo.put(key, _Fast(problem, rkey, kinfo, run, ws_elems, lse_offset))


def _remember(key, problem, fields, dev, takes, copied, run, ws_elems: int = 0, lse_offset: int = 0) -> None:
    rkey, kinfo = _fast[(fields, dev.index)]
    remember(key, problem, takes, copied, run, rkey, kinfo, ws_elems, lse_offset)


def takes_of(problem, tensors) -> tuple:
    """Prepared.takes of a validated problem's TMA inputs ((tensor, name) pairs)."""
    why = dict(problem.relayout)
    return tuple(why[n] if n in why else _strides_take(t) for t, n in tensors)


def partials_layout(num_splits: int, rows: int, head_dim_v: int) -> tuple[int, int]:
    """A split KV-cache launch's fp32 partials in one buffer: (elements, byte offset of the LSEs):
    o_partial (S, rows, DV), then lse_partial (S, rows)."""
    o_elems = num_splits * rows * head_dim_v
    return o_elems + num_splits * rows, 4 * o_elems


def with_partials(torch, ptrs: dict, ws_elems: int, lse_offset: int, dev):
    """A split launch's fp32 partials (partials_layout) allocated and their pointers added to ptrs
    (0 without splits); returns the buffer, which the caller keeps until the launch is enqueued (torch's
    allocator then reuses it in the stream's order)."""
    if not ws_elems:
        ptrs["o_partial"] = ptrs["lse_partial"] = 0
        return None
    ws = torch.empty(ws_elems, dtype=torch.float32, device=dev)
    ptrs["o_partial"] = base = ws.data_ptr()
    ptrs["lse_partial"] = base + lse_offset
    return ws


def fast_answer(torch, fast: _Fast, q, ptrs: dict, t0: float | None):
    """The outputs of a fast-path call: allocated, their pointers added to ptrs, the launch run on q's
    device, the call recorded (last_call_info) unless t0 is None."""
    problem = fast.problem
    dev = q.device
    o = torch.empty(problem.out_shape, dtype=q.dtype, device=dev)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=dev) if problem.return_lse else None
    ws = with_partials(torch, out_ptrs(ptrs, o, lse), fast.ws_elems, fast.lse_offset, dev)
    if dev.index == torch.cuda.current_device():
        fast.run(ptrs)
    else:
        with torch.cuda.device(dev):
            fast.run(ptrs)
    del ws
    if t0 is not None:
        _local.info = (problem, True, fast.kinfo, (), time.perf_counter() - t0)
    return (o, lse) if problem.return_lse else o


def nothing(ptrs) -> None:  # a Bound of None: nothing to launch
    return None


def attention_eager(torch, q, k, v, causal, softmax_scale, return_lse, check_grad: bool = True, window_size=(-1, -1),
                    softcap=0.0, learnable_sink=None):
    """`attention` outside a compiled region (and the body of the custom op's real implementation):
    validate (or find the call's signature validated before), get the kernel, launch on the current
    stream, record `last_call_info`."""
    t0 = time.perf_counter()
    key = call_signature(torch, "dense", (q, k, v, learnable_sink), (causal, softmax_scale, return_lse, window_size,
                                                                      softcap))
    fast = fast_for(key)
    if fast is not None:
        check_device_and_grad(torch, q.device, (q, k, v), check_grad, "fa4gen.attention")
        sink = sink_f32(torch, learnable_sink)
        return fast_answer(torch, fast, q, dense_ptrs(q, k, v, sink), t0)

    def check():
        metas = validate.tensor_metas(q, k, v)  # every argument that is not a dense tensor, in one error
        return validate.check_problem(*metas, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                      window_size=window_size, softcap=softcap,
                                      learnable_sink=sink_meta(learnable_sink))

    prep = prepared(torch, "dense", (), (), check, ((q, "q"), (k, "k"), (v, "v")), key=key)
    problem = prep.problem
    dev = q.device
    check_device_and_grad(torch, dev, (q, k, v), check_grad, "fa4gen.attention")

    sink = sink_f32(torch, learnable_sink)
    made = []

    def launch(q, k, v, o, lse):
        kernel, kinfo = kernel_for(problem, dev, prep.fields)
        b = kernel.bind(q, k, v, o, lse=lse, softmax_scale=problem.softmax_scale, mods=problem.mods, sink=sink)
        run = nothing if b is None else b.run
        run(out_ptrs(dense_ptrs(q, k, v, sink), o, lse))
        made.append(run)
        return kinfo

    o, lse, launched, kinfo, copied = answer(torch, problem, q, k, v, return_lse, launch, sink, prep.takes)
    if launched:
        _remember(key, problem, prep.fields, dev, prep.takes, copied, made[0])
    return _record(problem, t0, o, lse, launched, kinfo, copied)


def answer(torch, problem, q, k, v, return_lse, launch, sink=None, takes=None):
    """The outputs of a validated problem (dense or varlen): o and, with return_lse, lse allocated on
    q's device; empty problems answered as they are and keyless ones with O = 0, LSE = -inf (with
    sinks: LSE = the query head's sink, float32 `sink`), without a launch; otherwise the inputs TMA
    cannot read in place copied (problem.relayout; `takes`: Prepared.takes when the caller has it)
    and `launch(q, k, v, o, lse)` called on q's device. Returns (o, lse, whether it launched, what
    launch returned, the names of the copied inputs)."""
    dev = q.device
    o = torch.empty(problem.out_shape, dtype=q.dtype, device=dev)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=dev) if return_lse else None
    if problem.is_empty:
        return o, lse, False, None, ()
    if problem.no_keys:
        o.zero_()
        if lse is not None:
            if sink is None:
                lse.fill_(float("-inf"))
            else:  # lse is (..., Hq, S): the head is the second-to-last dim
                lse.copy_(sink[:, None].expand(lse.shape[-2:]))
        return o, lse, False, None, ()
    if takes is None:
        takes = takes_of(problem, ((q, "q"), (k, "k"), (v, "v")))
    q, k, v = (_tma_ready(t, n, tk) for t, n, tk in zip((q, k, v), ("q", "k", "v"), takes))
    if dev.index == torch.cuda.current_device():
        ran = launch(q, k, v, o, lse)
    else:
        with torch.cuda.device(dev):
            ran = launch(q, k, v, o, lse)
    return o, lse, True, ran, tuple(n for n, tk in zip(("q", "k", "v"), takes) if isinstance(tk, str))


def _strides_take(t):
    """Prepared.takes's entry of a tensor TMA reads in place: None, or its canonical strides."""
    strides = validate.canonical_strides(tuple(t.shape), tuple(t.stride()))
    return None if strides == tuple(t.stride()) else strides


def _record(problem, t0, o, lse, launched, kinfo, copied):
    """Record this thread's `last_call_info` (its fields: last_call_info makes the CallInfo) and return
    what the call returns."""
    _local.info = (problem, launched, kinfo, copied, time.perf_counter() - t0)
    return (o, lse) if problem.return_lse else o


def varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, meta=None):
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


def attention_varlen_eager(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                            softmax_scale, return_lse, seqused_k, check_grad: bool = True, window_size=(-1, -1),
                            softcap=0.0, learnable_sink=None):
    """`attention_varlen` outside a compiled region (and the custom op's real implementation)."""
    t0 = time.perf_counter()
    key = call_signature(torch, "varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink),
                         (max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, window_size, softcap))

    def ptrs(q, k, v, sink):
        return varlen_ptrs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)

    fast = fast_for(key)
    if fast is not None:
        check_device_and_grad(torch, q.device, (q, k, v), check_grad, "fa4gen.attention_varlen")
        return fast_answer(torch, fast, q, ptrs(q, k, v, sink_f32(torch, learnable_sink)), t0)

    def check():
        qm, km, vm, cqm, ckm, sum_ = varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        return validate.check_varlen_problem(qm, km, vm, cqm, ckm, max_seqlen_q, max_seqlen_k, seqused_k=sum_,
                                             causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                             window_size=window_size, softcap=softcap,
                                             learnable_sink=sink_meta(learnable_sink))

    prep = prepared(torch, "varlen", (), (), check, ((q, "q"), (k, "k"), (v, "v")), key=key)
    problem = prep.problem
    dev = q.device
    check_device_and_grad(torch, dev, (q, k, v), check_grad, "fa4gen.attention_varlen")
    sink = sink_f32(torch, learnable_sink)
    made = []

    def launch(q, k, v, o, lse):
        kernel, kinfo = kernel_for(problem, dev, prep.fields)
        b = kernel.bind_varlen(q, k, v, o, cu_seqlens_q, problem.max_seqlen_q, problem.max_seqlen_k, lse=lse,
                               seqused_k=seqused_k, softmax_scale=problem.softmax_scale, mods=problem.mods, sink=sink)
        run = nothing if b is None else b.run
        run(out_ptrs(ptrs(q, k, v, sink), o, lse))
        made.append(run)
        return kinfo

    o, lse, launched, kinfo, copied = answer(torch, problem, q, k, v, return_lse, launch, sink, prep.takes)
    if launched:
        _remember(key, problem, prep.fields, dev, prep.takes, copied, made[0])
    return _record(problem, t0, o, lse, launched, kinfo, copied)


def attention_with_kvcache_eager(torch, q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale,
                                 num_splits, return_lse, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
                                 check_grad: bool = True, batch_invariant: bool = False):
    """`attention_with_kvcache` once torch is imported (and the custom op's real implementation):
    validate (or reuse the validation of the same signature; the values of CPU-held lengths and page
    entries are checked on every call), get the kernel, launch, record."""
    t0 = time.perf_counter()
    # CPU-held lengths / page entries have no signature (call_signature): such calls are validated in full
    key = call_signature(torch, "kvcache", (q, k_cache, v_cache, cache_seqlens, page_table, learnable_sink),
                         (causal, softmax_scale, num_splits, return_lse, window_size, softcap, batch_invariant))
    fast = fast_for(key)
    if fast is not None:
        check_device_and_grad(torch, q.device, (q, k_cache, v_cache), check_grad, "fa4gen.attention_with_kvcache")
        sink = sink_f32(torch, learnable_sink)
        return fast_answer(torch, fast, q, kvcache_ptrs(q, k_cache, v_cache, cache_seqlens, page_table, sink), t0)

    def check():
        metas = kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table)
        return validate.check_kvcache_problem(*metas, causal=causal, softmax_scale=softmax_scale,
                                              num_splits=num_splits, return_lse=return_lse, window_size=window_size,
                                              softcap=softcap, learnable_sink=sink_meta(learnable_sink),
                                              batch_invariant=batch_invariant)

    prep = prepared(torch, "kvcache", (), (), check, ((q, "q"), (k_cache, "k"), (v_cache, "v")), key=key)
    problem = prep.problem
    dev = q.device
    check_device_and_grad(torch, dev, (q, k_cache, v_cache), check_grad, "fa4gen.attention_with_kvcache")
    made = []
    o, lse, launched, kinfo, copied = kvcache_answer(torch, problem, lambda: kernel_for(problem, dev, prep.fields), q,
                                                     k_cache, v_cache, cache_seqlens, page_table, return_lse,
                                                     sink_f32(torch, learnable_sink), prep.takes, made)
    if launched and not problem.host_index:
        _remember(key, problem, prep.fields, dev, prep.takes, copied, *made[0])
    return _record(problem, t0, o, lse, launched, kinfo, copied)


def kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table, meta=None):
    """TensorMetas of the KV-cache arguments (None for an absent page_table), every argument that is
    not a dense tensor reported in one error."""
    return _metas_of(((q, "q"), (k_cache, "k"), (v_cache, "v"), (cache_seqlens, "cache_seqlens"),
                      (page_table, "page_table")), ("page_table",), meta)


def kvcache_answer(torch, problem, get_kernel, q, k_cache, v_cache, cache_seqlens, page_table, return_lse, sink=None,
                   takes=None, made=None):
    """`answer` for a validated KV-cache problem: CPU-held lengths / page entries checked and copied
    to the device, the kernel got (`get_kernel()` -> (Kernel, LoadInfo)), the split count chosen
    (num_splits = 0), the fp32 partials allocated (one buffer, partials_layout), the kernel (and the
    combine kernel) launched. `made`, a list, gets (run, partials' elements, LSE offset): the launch
    the fast path can repeat."""
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
                                                            window_keys(problem.mods, problem.seqlen_q,
                                                                        problem.capacity))
        bounds = kernel.bind_kvcache(q, k, v, o, page_table, num_splits=S, lse=lse,
                                     softmax_scale=problem.softmax_scale, mods=problem.mods, sink=sink)
        run = nothing if bounds is None else functools.partial(run_kvcache, bounds)
        ws_elems, lse_offset = (partials_layout(S, problem.batch * problem.seqlen_q * problem.heads_q,
                                                problem.head_dim_v) if S > 1 else (0, 0))
        ptrs = out_ptrs(kvcache_ptrs(q, k, v, cache_seqlens, page_table, sink), o, lse)
        ws = with_partials(torch, ptrs, ws_elems, lse_offset, dev)  # noqa: F841 (alive until enqueued)
        run(ptrs)
        if made is not None:
            made.append((run, ws_elems, lse_offset))
        return kinfo

    return answer(torch, problem, q, k_cache, v_cache, return_lse, launch, sink, takes)


def window_keys(mods, seqlen_q: int, kv_len: int) -> int:
    """The most keys one tile of seqlen_q queries can see out of kv_len: a bounded window covers at
    most left + seqlen_q + right of them (the split count's work estimate, not a correctness bound)."""
    if mods.window_left is None:
        return kv_len
    right = kv_len if mods.window_right is None else mods.window_right
    return max(min(kv_len, mods.window_left + seqlen_q + right), 1)


