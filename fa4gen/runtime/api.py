"""The torch-facing entry points: `attention`, `attention_varlen`, `attention_with_kvcache`, and `load`
for prebuilt cubins. Eager calls go to fa4gen.runtime.launch; under torch.compile the first two go through the
custom ops of fa4gen.runtime.torch_ops (which call fa4gen.runtime.launch in turn).
"""

from __future__ import annotations

from . import launch, validate
from ..spec.config import KernelConfig
from .bundle import BundleError, BundleMissError, load_bundle
from .launch import RUNTIME_ARCH, CallInfo, LoadInfo, build, config_for, get_kernel, last_call_info
from .prebuilt import KernelLoadError, read_prebuilt
from .validate import Fa4genInputError, Problem

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "load", "load_bundle", "BundleError",
           "BundleMissError", "read_prebuilt", "PrebuiltKernel",
           "KernelLoadError", "last_call_info", "config_for", "get_kernel", "build", "CallInfo", "LoadInfo",
           "Fa4genInputError", "Problem", "RUNTIME_ARCH"]  # the launch's names are the API's too (fa4gen.runtime.api.X)


# softcap's default is the int 0, not 0.0: torch.compile(dynamic=True) makes a float default it reads from
# the function a symbolic float, whose specialisation restarts the frame's analysis (a second compile)
def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0, learnable_sink=None):
    """Attention forward, flash-attn layout: softmax(q kᵀ * softmax_scale) v per (batch, head).

    q: (B, Sq, Hq, D); k: (B, Skv, Hkv, D), v: (B, Skv, Hkv, DV); float16 or bfloat16, all the same, on one
    CUDA device of compute capability 9.0 (H100/H200). (D, DV) is (64, 64), (96, 96), (128, 128), (192, 128)
    (DeepSeek-V3's) or (256, 256) (spec.config.HEAD_DIM_PAIRS). Hq must be a multiple of Hkv, any ratio
    G = Hq/Hkv (GQA/MQA: query head h reads kv head h // G; a ratio dividing 128 packs G heads per
    128-row Q tile, any other ratio runs one head per tile, fa4gen.spec.tiles.gqa_pack). softmax_scale defaults to
    1/sqrt(D). causal=True masks bottom-right aligned: query i sees keys j <= i + Skv - Sq, so with
    Sq > Skv the first Sq - Skv rows see no key and get O = 0, LSE = -inf.

    Returns o (B, Sq, Hq, DV) in the input dtype, or, when return_lse, (o, lse) with lse (B, Hq, Sq)
    float32: the natural-log logsumexp of each row's scaled scores over the keys it sees.

    Score modifiers, in flash-attn's conventions (docs/ABI.md "Windows, softcap, sinks"):
    window_size=(left, right): query i sees keys j with i + Skv - Sq - left <= j <= i + Skv - Sq +
    right (bottom-right aligned like the causal mask; -1 = unbounded side; with causal, right is 0).
    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) before the softmax.
    learnable_sink: a (Hq,) float32 tensor on q's device (bfloat16 / float16 are converted): query head
    h's logit z_h joins every row's softmax denominator and no value, O = sum_j e^s_j v_j /
    (sum_j e^s_j + e^z_h), and the LSE includes it; a row that sees no key gets O = 0 and LSE = z_h.
    Each modifier is a flag of the kernel variant (`window`, `softcap`, `sinks` in KernelConfig); its
    values are run-time arguments, so one kernel serves every window, cap and sink tensor.

    Layout: the kernel reads q/k/v through TMA, which needs the last dim contiguous, every other
    stride a multiple of 16 bytes and a 16-byte-aligned base; views meeting that (e.g. q, k, v
    sliced out of one packed qkv tensor, or a (B, H, S, D) tensor transposed to (B, S, H, D)) are
    read in place, any other layout is first copied with `.contiguous()` (costs one copy; see
    `last_call_info().copied`). Empty outputs and Skv == 0 are answered without a launch. Forward
    only: inputs that require grad while grad mode is on are refused rather than silently
    returning a result autograd cannot differentiate.

    Raises a subclass of `fa4gen.runtime.validate.Fa4genInputError` (TypeError or ValueError) for every
    input problem, before anything is built or launched.

    Under `torch.compile` (fullgraph too) the call goes through the custom op
    `torch.ops.fa4gen.attention_fwd` (fa4gen/runtime/torch_ops.py): Dynamo cannot trace the launch, the op
    hides it behind a fake implementation that gives the output shapes, and the compiled graph calls
    this same eager path at run time (also inside CUDA graphs: the launch is on the current stream,
    with no host sync). Eager calls skip the op: its dispatch adds 13-40 us a call on
    the (noisy, 2-core) CPU machine (`python3 -m bench.torch_op_overhead`).
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention needs torch (pip install torch)") from e
    if torch.compiler.is_compiling():
        from . import torch_ops

        return torch_ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                   window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
    return launch.attention_eager(torch, q, k, v, causal, softmax_scale, return_lse, window_size=window_size,
                                  softcap=softcap, learnable_sink=learnable_sink)


# ---- varlen ------------------------------------------------------------------------------------
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False, seqused_k=None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0, learnable_sink=None):
    """Attention over a packed batch of variable-length sequences (flash-attn's varlen conventions).

    q: (total_q, Hq, D); k: (total_k, Hkv, D), v: (total_k, Hkv, DV) ((D, DV) as `attention`'s); float16
    or bfloat16, on one CUDA device of compute capability 9.0. cu_seqlens_q / cu_seqlens_k: int32 (B + 1,) on the same device; sequence b's
    queries are rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q, its keys rows
    [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v, of which only the first seqused_k[b] are used
    when seqused_k (int32 (B,)) is given. A sequence may have length 0. GQA as in `attention`.
    causal=True is bottom-right aligned per sequence (query i of a sequence with Lq queries and Lk
    keys sees keys j <= i + Lk - Lq); rows that see no key get O = 0 and LSE = -inf.
    window_size, softcap and learnable_sink as in `attention`, the window per sequence (Lq, Lk in
    place of Sq, Skv).

    max_seqlen_q / max_seqlen_k: the longest sequence (flash-attn's arguments). The kernel does not
    depend on them (its scheduler reads the lengths on the device); they are checked where the host
    can: B sequences of at most max_seqlen_q rows must be able to hold total_q rows.

    Returns o (total_q, Hq, DV) and, with return_lse, lse (Hq, total_q) float32. Rows of q outside
    every sequence are not written.

    Raises a `fa4gen.runtime.validate.Fa4genInputError` for every problem visible without a device sync
    (wrong dtype, device or length of cu_seqlens or seqused_k, inconsistent sizes). The offsets
    themselves stay on the device: non-monotonic or out-of-range values are clamped by the kernel
    (start = min(cu[b], total), end = min(max(cu[b+1], start), total)), so it never reads or writes
    outside its tensors, whatever they hold.

    Under `torch.compile` (fullgraph too) the call goes through the custom op
    `torch.ops.fa4gen.attention_varlen_fwd` (fa4gen/runtime/torch_ops.py), as `attention` does.
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention_varlen needs torch (pip install torch)") from e
    if torch.compiler.is_compiling():
        from . import torch_ops

        return torch_ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                          seqused_k=seqused_k, window_size=window_size, softcap=softcap,
                                          learnable_sink=learnable_sink)
    return launch.attention_varlen_eager(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         softmax_scale, return_lse, seqused_k, window_size=window_size,
                                         softcap=softcap, learnable_sink=learnable_sink)


# ---- KV cache (decode) ---------------------------------------------------------------------------
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=None, causal: bool = True,
                           softmax_scale: float | None = None, num_splits: int = 0, return_lse: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0, learnable_sink=None,
                           batch_invariant: bool = False):
    """Attention of a few new queries over a KV cache (decode, speculative decode, chunked prefill).

    q: (B, Sq, Hq, D), Sq >= 1. The cache is contiguous, k_cache / v_cache (B, Smax, Hkv, D), or
    paged, (num_pages, page_size, Hkv, D) with page_table (B, max_pages) int32: key j of sequence b
    is row j % page_size of page page_table[b, j // page_size] (vLLM-style block tables; page_size
    a power of two in [16, 256]). cache_seqlens (B,) int32: the valid keys of each sequence.
    float16 or bfloat16, (D, DV) as `attention`'s (v_cache and O have DV columns), any GQA ratio Hq / Hkv,
    on one CUDA device of compute
    capability 9.0. causal=True aligns the Sq queries to the end of each sequence (query i sees
    keys j <= i + cache_seqlens[b] - Sq); rows that see no key get O = 0 and LSE = -inf.

    num_splits: the keys of each (sequence, kv head) are cut into this many ranges processed by
    different CTAs, whose partial outputs (fp32) a generated combine kernel merges by their LSE.
    0 (default) chooses from the shape and the SM count (fa4gen.spec.schedule.choose_num_splits); 1
    writes O directly (no combine kernel). Any fixed num_splits makes each sequence's O and LSE the
    same bits whatever else is in the batch and on any GPU (its split ranges depend on it and the
    count alone); batch_invariant=True asks for that with num_splits=0 resolved to a fixed count
    (fa4gen.spec.schedule.BATCH_INVARIANT_SPLITS) instead of one chosen from the shape and SMs.

    cache_seqlens and page_table may live on the GPU (no host sync: out-of-range values are clamped
    by the kernel, which never reads outside the cache: lengths to [0, capacity], page entries to
    the last page) or on the CPU (then their values are checked here, with a clear error, and
    copied to the GPU). Returns o (B, Sq, Hq, D) and, with return_lse, lse (B, Hq, Sq) float32.

    window_size, softcap and learnable_sink as in `attention`, the window aligned to the end of each
    sequence (cache_seqlens[b] in place of Skv): a decode step with window (W, 0) sees its last W + 1
    keys, and the kernel reads only the pages of the window. With splits the sink is counted once.

    Under `torch.compile` (fullgraph too) the call goes through the custom op
    `torch.ops.fa4gen.attention_with_kvcache_fwd` (fa4gen/runtime/torch_ops.py), as `attention` does;
    with cache_seqlens and page_table on the GPU the compiled step can be captured in a CUDA graph.
    """
    try:
        import torch
    except ImportError as e:
        raise validate.InputTypeError("fa4gen.attention_with_kvcache needs torch (pip install torch)") from e
    if torch.compiler.is_compiling():
        from . import torch_ops

        return torch_ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, causal=causal,
                                                softmax_scale=softmax_scale, num_splits=num_splits,
                                                return_lse=return_lse, window_size=window_size, softcap=softcap,
                                                learnable_sink=learnable_sink, batch_invariant=batch_invariant)
    return launch.attention_with_kvcache_eager(torch, q, k_cache, v_cache, cache_seqlens, page_table, causal,
                                              softmax_scale, num_splits, return_lse, window_size=window_size,
                                              softcap=softcap, learnable_sink=learnable_sink,
                                              batch_invariant=batch_invariant)


# ---- prebuilt cubins ---------------------------------------------------------------------------
def score_mods_refusal(cfg: KernelConfig, mods) -> str | None:
    """Why a prebuilt kernel of config cfg cannot run a call with these validated ScoreMods (None: it
    can). A windowed kernel runs any window (its sides are run-time values, unbounded included); a
    softcap or sinks kernel always applies them, so it needs the value, and no kernel ignores one."""
    flags = dict(mods.flags)
    if flags["window"] and not cfg.window:
        return (f"{cfg.name} was built without a sliding window: window_size=({mods.window_left}, "
                f"{mods.window_right}) needs a kernel built with --window")
    for flag, what in (("softcap", "softcap > 0"), ("sinks", "a learnable_sink")):
        if flags[flag] and not getattr(cfg, flag):
            return f"{cfg.name} was built without --{flag}: the call's {what} needs a kernel built with it"
        if getattr(cfg, flag) and not flags[flag]:
            return f"{cfg.name} was built with --{flag}: call it with {what}"
    return None


class PrebuiltKernel:
    """A kernel loaded from a shipped cubin: call it like fa4gen.attention, minus `causal` (fixed at
    build time). Inputs are validated the same way; head_dim, head_dim_v, dtype and GQA ratio must be the ones
    the kernel was built for, and so must the score modifiers: a kernel built with --window takes any
    window_size (unbounded too), one without refuses a bounded window; --softcap needs softcap > 0
    and --sinks a learnable_sink, and a kernel without them refuses them."""

    def __init__(self, kernel, manifest: dict, config: KernelConfig, path: str):
        self.kernel = kernel
        self.manifest = manifest
        self.config = config
        self.path = path
        # call signature -> its launch (fa4gen.runtime.launch's fast path, for this kernel alone)
        self._fasts = launch._Memo(launch._MEMO_LIMIT)

    def __repr__(self):
        return f"PrebuiltKernel({self.config.name}, {self.path})"

    def __call__(self, q, k, v, softmax_scale: float | None = None, return_lse: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0, learnable_sink=None):
        import torch

        if self.config.varlen:
            raise validate.InputValueError(f"{self.config.name} is a varlen kernel: call kernel.varlen(q, k, v, "
                                           "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)")
        if self.config.kvcache:
            raise validate.InputValueError(f"{self.config.name} is a KV-cache kernel: call kernel.kvcache(q, k_cache, "
                                           "v_cache, cache_seqlens, page_table=..., ...)")
        key = launch.call_signature(torch, "dense", (q, k, v, learnable_sink),
                                    (softmax_scale, return_lse, window_size, softcap))
        fast = launch.fast_for(key, self._fasts)
        if fast is not None:
            self._check_grad(torch, (q, k, v))
            sink = launch.sink_f32(torch, learnable_sink)
            return launch.fast_answer(torch, fast, q, launch.dense_ptrs(q, k, v, sink), None)
        metas = validate.tensor_metas(q, k, v)
        cfg = self.config
        p = validate.check_problem(*metas, causal=cfg.causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                   window_size=window_size, softcap=softcap,
                                   learnable_sink=launch.sink_meta(learnable_sink))
        self._check_fits(torch, p, q, k, v)
        sink = launch.sink_f32(torch, learnable_sink)
        made = []

        def run(q, k, v, o, lse):
            b = self.kernel.bind(q, k, v, o, lse=lse, softmax_scale=p.softmax_scale, mods=p.mods, sink=sink)
            go = launch.nothing if b is None else b.run
            go(launch.out_ptrs(launch.dense_ptrs(q, k, v, sink), o, lse))
            made.append(go)

        return self._answer(torch, key, p, q, k, v, return_lse, run, sink, made)

    def _answer(self, torch, key, p, q, k, v, return_lse, run, sink, made):
        """launch.answer, then the call's launch kept for its signature's later calls."""
        takes = launch.takes_of(p, ((q, "q"), (k, "k"), (v, "v")))
        o, lse, launched, _, copied = launch.answer(torch, p, q, k, v, return_lse, run, sink, takes)
        if launched:
            launch.remember(key, p, takes, copied, made[0], memo=self._fasts)
        return (o, lse) if return_lse else o

    def _check_grad(self, torch, tensors) -> None:
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise validate.InputValueError("fa4gen kernels are forward-only: call under torch.no_grad()")

    def _check_fits(self, torch, p, q, k, v) -> None:
        """The validated problem p is one this kernel was built for, on its device, without grad."""
        cfg = self.config
        got = (p.head_dims, p.dtype, p.gqa_ratio)
        if not p.is_empty and got != (cfg.head_dims, cfg.dtype, cfg.gqa_ratio):
            raise validate.InputValueError(
                f"{cfg.name} was built for (head_dim, head_dim_v) {cfg.head_dims}, {cfg.dtype}, GQA ratio "
                f"{cfg.gqa_ratio}; the inputs are (head_dim, head_dim_v) {p.head_dims}, {p.dtype}, GQA ratio "
                f"{p.gqa_ratio}")
        if q.device.index != self.kernel.device:
            raise validate.DeviceError(f"{self.path} was loaded on cuda:{self.kernel.device}, the inputs are on "
                                       f"{q.device}: load it once per device")
        self._check_grad(torch, (q, k, v))
        why = score_mods_refusal(cfg, p.mods)
        if why:
            raise validate.InputValueError(why)


    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float | None = None, return_lse: bool = False, seqused_k=None,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0, learnable_sink=None):
        """A prebuilt varlen kernel (`fa4gen build --varlen`), called like fa4gen.attention_varlen
        minus `causal` (fixed at build time); inputs validated the same way."""
        import torch

        cfg = self.config
        if not cfg.varlen:
            raise validate.InputValueError(f"{cfg.name} is not a varlen kernel: call kernel"
                                           + (".kvcache(q, k_cache, v_cache, cache_seqlens, ...)" if cfg.kvcache
                                              else "(q, k, v, ...)"))
        key = launch.call_signature(torch, "varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink),
                                    (max_seqlen_q, max_seqlen_k, softmax_scale, return_lse, window_size, softcap))
        fast = launch.fast_for(key, self._fasts)
        if fast is not None:
            self._check_grad(torch, (q, k, v))
            return launch.fast_answer(torch, fast, q, launch.varlen_ptrs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                                         launch.sink_f32(torch, learnable_sink)), None)
        metas = launch.varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        p = validate.check_varlen_problem(*metas[:5], max_seqlen_q, max_seqlen_k, seqused_k=metas[5],
                                          causal=cfg.causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                          window_size=window_size, softcap=softcap,
                                          learnable_sink=launch.sink_meta(learnable_sink))
        self._check_fits(torch, p, q, k, v)
        sink = launch.sink_f32(torch, learnable_sink)
        made = []

        def run(q, k, v, o, lse):
            b = self.kernel.bind_varlen(q, k, v, o, cu_seqlens_q, p.max_seqlen_q, p.max_seqlen_k, lse=lse,
                                        seqused_k=seqused_k, softmax_scale=p.softmax_scale, mods=p.mods, sink=sink)
            go = launch.nothing if b is None else b.run
            go(launch.out_ptrs(launch.varlen_ptrs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink), o, lse))
            made.append(go)

        return self._answer(torch, key, p, q, k, v, return_lse, run, sink, made)

    def kvcache(self, q, k_cache, v_cache, cache_seqlens, page_table=None, softmax_scale: float | None = None,
                num_splits: int = 0, return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
                softcap: float = 0, learnable_sink=None):
        """A prebuilt KV-cache kernel (`fa4gen build --kvcache [--page-size N]`), called like
        fa4gen.attention_with_kvcache minus `causal` (fixed at build time); inputs validated the same way,
        and the cache's layout (contiguous, or paged with this page size) must be the kernel's."""
        import torch

        cfg = self.config
        if not cfg.kvcache:
            raise validate.InputValueError(f"{cfg.name} is not a KV-cache kernel: call kernel"
                                           + (".varlen(...)" if cfg.varlen else "(q, k, v, ...)"))
        key = launch.call_signature(torch, "kvcache", (q, k_cache, v_cache, cache_seqlens, page_table, learnable_sink),
                                    (softmax_scale, num_splits, return_lse, window_size, softcap))
        fast = launch.fast_for(key, self._fasts)
        if fast is not None:
            self._check_grad(torch, (q, k_cache, v_cache))
            return launch.fast_answer(torch, fast, q, launch.kvcache_ptrs(q, k_cache, v_cache, cache_seqlens, page_table,
                                                                          launch.sink_f32(torch, learnable_sink)), None)
        metas = launch.kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table)
        p = validate.check_kvcache_problem(*metas, causal=cfg.causal, softmax_scale=softmax_scale,
                                           num_splits=num_splits, return_lse=return_lse, window_size=window_size,
                                           softcap=softcap, learnable_sink=launch.sink_meta(learnable_sink))
        self._check_fits(torch, p, q, k_cache, v_cache)
        if p.page_size != cfg.page_size:
            want = f"a paged cache of page size {cfg.page_size} (and a page_table)" if cfg.page_size else \
                "a contiguous cache (B, Smax, Hkv, D) and no page_table"
            got = f"page size {p.page_size}" if p.page_size else "a contiguous cache"
            raise validate.InputValueError(f"{cfg.name} takes {want}; got {got}")
        made = []
        takes = launch.takes_of(p, ((q, "q"), (k_cache, "k"), (v_cache, "v")))
        o, lse, launched, _, copied = launch.kvcache_answer(torch, p, lambda: (self.kernel, None), q, k_cache, v_cache,
                                                            cache_seqlens, page_table, return_lse,
                                                            launch.sink_f32(torch, learnable_sink), takes, made)
        if launched and not p.host_index:
            go, ws_elems, lse_offset = made[0]
            launch.remember(key, p, takes, copied, go, ws_elems=ws_elems, lse_offset=lse_offset, memo=self._fasts)
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
