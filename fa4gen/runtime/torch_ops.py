"""`fa4gen.attention`, `attention_varlen` and `attention_with_kvcache` as torch custom ops, so that
`torch.compile(fullgraph=True)` traces them.

Dynamo cannot trace the eager path (`time.perf_counter`, cuda-python's launch, data pointers), so
under `torch.compile` `fa4gen.attention` calls `attention` below, which calls the op

    torch.ops.fa4gen.attention_fwd(q, k, v, causal, softmax_scale, return_lse, window_left=-1,
                                   window_right=-1, softcap=0.0, learnable_sink=None) -> (o, lse)

registered with `torch.library.custom_op` (likewise `attention_varlen_fwd` and
`attention_with_kvcache_fwd`; the window's sides are separate ints: a schema has no
int pair; learnable_sink is an optional tensor argument). Its fake implementation validates the inputs' metadata
(the same checks as eager, less the layout checks that need a data pointer) and returns
o (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) float32, or lse of shape (0,) when return_lse is
False (an op returns a fixed number of tensors). Its real implementation is the eager path itself
(`launch.attention_eager`): it launches on the current stream and does no host synchronisation, so
the op can be captured in a CUDA graph (inductor's "reduce-overhead" mode too). The first call of a
kernel variant loads its module (and builds it if the cache misses): run once before capturing,
as any CUDA-graph warm-up does. A replayed graph runs no Python: `last_call_info()` is not updated.

Forward only, like the eager API: under grad mode, inputs that require grad are refused while
tracing; the op registers no autograd formula. Imported lazily by fa4gen.runtime.api (importing it
registers the op), so fa4gen without torch is unaffected.
"""

import numbers  # (no `from __future__ import annotations`: custom_op reads the annotations)
from typing import Optional

import torch

from . import launch, validate

__all__ = ["attention", "attention_fwd", "attention_varlen", "attention_varlen_fwd", "attention_with_kvcache",
           "attention_with_kvcache_fwd"]


@torch.library.custom_op("fa4gen::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], return_lse: bool, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0,
                  learnable_sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of `fa4gen.attention(q, k, v, causal, softmax_scale, return_lse=True, window_size=
    (window_left, window_right), softcap=softcap, learnable_sink=learnable_sink)`; lse has shape (0,)
    when return_lse is False. The grad check was the caller's (`attention` below)."""
    out = launch.attention_eager(torch, q, k, v, causal, softmax_scale, return_lse, check_grad=False,
                                 window_size=(window_left, window_right), softcap=softcap,
                                 learnable_sink=learnable_sink)
    if return_lse:
        return out
    return out, _no_lse(q)


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _fake_meta(t: torch.Tensor, name: str) -> validate.TensorMeta:
    """A TensorMeta of a fake (or meta) tensor: no data pointer exists, so none is read."""
    if not isinstance(t, torch.Tensor):
        raise validate.InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return validate.TensorMeta(name=name, shape=tuple(t.shape), strides=tuple(t.stride()),
                               dtype=str(t.dtype).removeprefix("torch."), device=str(t.device), data_ptr=0,
                               element_size=t.element_size())


def _sink_fake_meta(learnable_sink):
    return None if learnable_sink is None else _fake_meta(learnable_sink, "learnable_sink")


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, return_lse, window_left=-1, window_right=-1, softcap=0.0,
                        learnable_sink=None):
    problem = validate.check_problem(_fake_meta(q, "q"), _fake_meta(k, "k"), _fake_meta(v, "v"), causal=causal,
                                     softmax_scale=softmax_scale, return_lse=return_lse, layout=False,
                                     window_size=(window_left, window_right), softcap=softcap,
                                     learnable_sink=_sink_fake_meta(learnable_sink))
    o = q.new_empty(problem.out_shape)
    lse = q.new_empty(problem.lse_shape, dtype=torch.float32) if return_lse else _no_lse(q)
    return o, lse


def _op_args(causal, return_lse, softmax_scale, window_size, softcap, learnable_sink):
    """The Python arguments checked as the op's schema would otherwise reject them (with a torch
    error), converted to its types: (softmax_scale, window_left, window_right, softcap)."""
    validate.check_flags(causal, return_lse)
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        raise validate.InputTypeError(
            f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    left, right = validate.check_window_size(window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise validate.InputTypeError(f"softcap must be a real number (0.0 = no cap), got {type(softcap).__name__}")
    if learnable_sink is not None and not isinstance(learnable_sink, torch.Tensor):
        raise validate.InputTypeError(f"learnable_sink must be a torch.Tensor or None, got "
                                      f"{type(learnable_sink).__name__}")
    return None if softmax_scale is None else float(softmax_scale), left, right, float(softcap)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              window_size=(-1, -1), softcap: float = 0, learnable_sink=None):
    """`fa4gen.attention` through the op (what it runs under torch.compile; callable eagerly too).
    Checks the Python arguments the op's schema would otherwise reject with a torch error."""
    scale, left, right, cap = _op_args(causal, return_lse, softmax_scale, window_size, softcap, learnable_sink)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise validate.InputValueError(launch.FORWARD_ONLY)
    o, lse = attention_fwd(q, k, v, causal, scale, return_lse, left, right, cap, learnable_sink)
    return (o, lse) if return_lse else o


# ---- varlen: the output shapes depend on q's shape alone, so the op needs no data-dependent size ----
@torch.library.custom_op("fa4gen::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float], return_lse: bool,
                         seqused_k: Optional[torch.Tensor], window_left: int = -1, window_right: int = -1,
                         softcap: float = 0.0,
                         learnable_sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of `fa4gen.attention_varlen(...)`; lse has shape (0,) when return_lse is False."""
    out = launch.attention_varlen_eager(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal, softmax_scale, return_lse, seqused_k, check_grad=False,
                                        window_size=(window_left, window_right), softcap=softcap,
                                        learnable_sink=learnable_sink)
    if return_lse:
        return out
    return out, _no_lse(q)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, return_lse, seqused_k, window_left=-1, window_right=-1, softcap=0.0,
                               learnable_sink=None):
    qm, km, vm, cqm, ckm, sum_ = launch.varlen_metas(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, meta=_fake_meta)
    problem = validate.check_varlen_problem(qm, km, vm, cqm, ckm, max_seqlen_q, max_seqlen_k, seqused_k=sum_,
                                            causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                            window_size=(window_left, window_right), softcap=softcap,
                                            learnable_sink=_sink_fake_meta(learnable_sink))
    o = q.new_empty(problem.out_shape)
    lse = q.new_empty(problem.lse_shape, dtype=torch.float32) if return_lse else _no_lse(q)
    return o, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False, seqused_k=None,
                     window_size=(-1, -1), softcap: float = 0, learnable_sink=None):
    """`fa4gen.attention_varlen` through the op (what it runs under torch.compile)."""
    scale, left, right, cap = _op_args(causal, return_lse, softmax_scale, window_size, softcap, learnable_sink)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise validate.InputTypeError(f"{name} must be an int, got {type(n).__name__}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise validate.InputValueError(launch.FORWARD_ONLY.replace("fa4gen.attention", "fa4gen.attention_varlen"))
    o, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal,
                                  scale, return_lse, seqused_k, left, right, cap, learnable_sink)
    return (o, lse) if return_lse else o


# ---- KV cache: the output shapes depend on q's shape alone; the split count is the real
# implementation's choice (from shapes and the SM count: no host sync), so a decode step compiles
# and is captured in a CUDA graph like `attention`. CPU-held cache_seqlens / page_table are read on
# the host by the real implementation (checked, then copied): such a call cannot be captured.
@torch.library.custom_op("fa4gen::attention_with_kvcache_fwd", mutates_args=())
def attention_with_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_seqlens: torch.Tensor, page_table: Optional[torch.Tensor], causal: bool,
                               softmax_scale: Optional[float], num_splits: int, return_lse: bool,
                               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                               learnable_sink: Optional[torch.Tensor] = None,
                               batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of `fa4gen.attention_with_kvcache(...)`; lse has shape (0,) when return_lse is False."""
    out = launch.attention_with_kvcache_eager(torch, q, k_cache, v_cache, cache_seqlens, page_table, causal,
                                              softmax_scale, num_splits, return_lse,
                                              window_size=(window_left, window_right), softcap=softcap,
                                              learnable_sink=learnable_sink, check_grad=False,
                                              batch_invariant=batch_invariant)
    if return_lse:
        return out
    return out, _no_lse(q)


@attention_with_kvcache_fwd.register_fake
def _attention_with_kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale,
                                     num_splits, return_lse, window_left=-1, window_right=-1, softcap=0.0,
                                     learnable_sink=None, batch_invariant=False):
    metas = launch.kvcache_metas(q, k_cache, v_cache, cache_seqlens, page_table, meta=_fake_meta)
    problem = validate.check_kvcache_problem(*metas, causal=causal, softmax_scale=softmax_scale,
                                             num_splits=num_splits, return_lse=return_lse,
                                             window_size=(window_left, window_right), softcap=softcap,
                                             learnable_sink=_sink_fake_meta(learnable_sink),
                                             batch_invariant=batch_invariant)
    o = q.new_empty(problem.out_shape)
    lse = q.new_empty(problem.lse_shape, dtype=torch.float32) if return_lse else _no_lse(q)
    return o, lse


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=None, causal: bool = True,
                           softmax_scale: float | None = None, num_splits: int = 0, return_lse: bool = False,
                           window_size=(-1, -1), softcap: float = 0, learnable_sink=None,
                           batch_invariant: bool = False):
    """`fa4gen.attention_with_kvcache` through the op (what it runs under torch.compile)."""
    scale, left, right, cap = _op_args(causal, return_lse, softmax_scale, window_size, softcap, learnable_sink)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise validate.InputTypeError(f"num_splits must be an int (0 = chosen from the shape), got "
                                      f"{type(num_splits).__name__}")
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table)):
        if not (isinstance(t, torch.Tensor) or (t is None and name == "page_table")):
            raise validate.InputTypeError(f"{name} must be a torch.Tensor{' or None' if name == 'page_table' else ''}"
                                          f", got {type(t).__name__}")
    if type(batch_invariant) is not bool:  # the schema's bool would reject it with a torch error
        raise validate.InputTypeError(f"batch_invariant must be True or False, got {type(batch_invariant).__name__}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k_cache, v_cache)):
        raise validate.InputValueError(launch.FORWARD_ONLY.replace("fa4gen.attention", "fa4gen.attention_with_kvcache"))
    o, lse = attention_with_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, page_table, causal, scale,
                                        int(num_splits), return_lse, left, right, cap, learnable_sink, batch_invariant)
    return (o, lse) if return_lse else o
