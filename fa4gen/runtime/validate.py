"""Input validation for `fa4gen.attention`, done before anything is built or launched.

The checks work on plain metadata (`TensorMeta`: shape, strides, dtype name, device string, data
pointer), so every rule is testable without torch or a GPU; `tensor_meta` is the only function that
touches a torch tensor, and it imports nothing at module import time.

Every failure raises one subclass of `Fa4genInputError` (a TypeError or ValueError too) with one
message naming the argument, what it got and what is allowed.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

from ..spec.config import GQA_RATIO_MAX, HEAD_DIM_PLANNED, HEAD_DIMS, head_dim_pairs_text, head_dim_refusal
from ..spec.plan import WINDOW_SEQ_LIMIT

RUNTIME_ARCH = "sm_90a"  # the only arch with a runtime that has run (see check_arch)

LOG2E = 1.4426950408889634
TMA_ALIGN = 16  # bytes: cuTensorMapEncodeTiled wants the base address and every stride 16-byte aligned
TMA_MAX_STRIDE = 1 << 40  # bytes: the tensor map's stride field limit
U32_PARAM_LIMIT = 1 << 31  # batch/seqlen/heads/num_tasks travel as .u32 params; stay clear of the sign bit

_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}  # torch dtype name -> KernelConfig dtype


class Fa4genInputError(Exception):
    """Base of every input error `fa4gen.attention` raises before launching."""


class InputTypeError(Fa4genInputError, TypeError):
    """An argument of the wrong kind (not a tensor, unsupported dtype, non-bool flag)."""


class InputValueError(Fa4genInputError, ValueError):
    """An argument of the right kind with a value the kernel cannot take (shape, scale)."""


class DeviceError(InputValueError):
    """Tensors not on CUDA, or not all on the same CUDA device."""


class UnsupportedArchError(InputValueError):
    """The GPU has no executable fa4gen kernel."""


class InputErrors(InputTypeError, InputValueError):
    """Several input problems at once (device, dtype, shape, ...): `.errors` holds each one, and the
    message lists them all, so a user fixes everything in one round instead of one per run."""

    def __init__(self, errors):
        self.errors = tuple(errors)
        super().__init__(f"{len(self.errors)} problems with the inputs: " + "; ".join(str(e) for e in self.errors))


class _Errors(list):
    """The problems one validation collects: `attempt(fn, *args)` returns fn's result, or records the
    Fa4genInputError it raised and returns None, so every check group runs and all are reported."""

    def attempt(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Fa4genInputError as e:
            self.append(e)
            return None


def raise_all(errors) -> None:
    """Raise nothing, the one error, or InputErrors of several."""
    errors = list(errors)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise InputErrors(errors)


@dataclass(frozen=True)
class TensorMeta:
    """What validation needs to know about one tensor (torch conventions: strides in elements)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # torch's name without the "torch." prefix: "float16", "bfloat16", "float32", ...
    device: str  # "cuda:0", "cpu", ...
    data_ptr: int = 0
    element_size: int = 2


class _HeadDims:
    """head_dim (q's and k's last dim) and head_dim_v (v's and o's; a problem made without it has
    head_dim's)."""

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def head_dims(self) -> tuple[int, int]:
        return self.head_dim, self.head_dim_v


class _BshdOutputs(_HeadDims):
    """The outputs of a problem in flash-attn's (B, Sq, Hq, D) layout (dense and KV-cache calls)."""

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 0

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def is_empty(self) -> bool:
        """No output element: nothing to compute."""
        return self.batch == 0 or self.seqlen_q == 0 or self.heads_q == 0


SINK_DTYPES = ("float32", "bfloat16", "float16")  # learnable_sink: float32 read as is, 16-bit copied to fp32


@dataclass(frozen=True)
class ScoreMods:
    """A call's sliding window, logit softcap and attention sinks (docs/ABI.md "Windows, softcap,
    sinks"), validated: the window's sides after causal folding (None = unbounded; causal makes right
    0), softcap (0.0 = none) and whether a learnable_sink tensor came with the call. The kernel variant
    follows from it (`flags`); the values are the kernel's run-time arguments."""

    window_left: int | None = None
    window_right: int | None = None
    causal: bool = False
    softcap: float = 0.0
    sinks: bool = False

    @property
    def window(self) -> bool:
        """A windowed kernel is needed: a bounded left side, or a bounded right side without causal
        (causal already bounds the right side at 0: causal with an unbounded left is the causal kernel)."""
        return self.window_left is not None or (self.window_right is not None and not self.causal)

    @property
    def flags(self) -> tuple[tuple[str, bool], ...]:
        """The KernelConfig flags of this call's kernel variant."""
        return (("window", self.window), ("softcap", self.softcap > 0), ("sinks", self.sinks))


NO_SCORE_MODS = ScoreMods()


def _f32(x: float) -> float:
    """x rounded to float32 (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def check_window_size(window_size) -> tuple[int, int]:
    """flash-attn's window_size=(left, right): two ints >= -1 (-1 = unbounded); a side of 2^30 or more
    is unbounded too (it reaches past every key of a sequence the windowed kernels take)."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise InputTypeError(f"window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), "
                             f"got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise InputTypeError(f"window_size's {side} side must be an int >= -1, got {type(w).__name__} {w!r}")
        if int(w) < -1:
            raise InputValueError(f"window_size's {side} side must be -1 (unbounded) or >= 0, got {int(w)}")
        # a side >= 2^30 reaches past every key the kernels take (lengths < 2^30): unbounded
        out.append(-1 if int(w) >= WINDOW_SEQ_LIMIT else int(w))
    return out[0], out[1]


def check_softcap(softcap, softmax_scale: float) -> float:
    """softcap as a float: 0 (no cap) or finite > 0, with softmax_scale / softcap and softcap * log2(e)
    finite normal float32 values (the kernel's softcap_in and scale_log2 parameters; the kernel flushes
    subnormals to zero)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise InputTypeError(f"softcap must be a real number (0.0 = no cap), got {type(softcap).__name__}")
    c = float(softcap)
    if not math.isfinite(c) or c < 0:
        raise InputValueError(f"softcap must be finite and >= 0 (0.0 = no cap), got {c!r}")
    if c > 0:
        for what, x in (("softmax_scale / softcap", softmax_scale / c), ("softcap * log2(e)", c * LOG2E)):
            f = _f32(x)
            if not math.isfinite(f) or f < 2.0 ** -126:
                raise InputValueError(f"softcap {c!r}: {what} = {x!r} is not a finite normal float32")
    return c


def check_sink_meta(m: TensorMeta | None, heads_q: int | None, device: str | None) -> bool:
    """learnable_sink: None, or a 1-D (Hq,) float32 tensor (bfloat16 / float16 are copied to float32)
    on q's device. Any stride: a strided one is copied."""
    if m is None:
        return False
    if m.dtype not in SINK_DTYPES:
        raise InputTypeError(f"learnable_sink must be float32 (bfloat16 and float16 are converted), got {m.dtype}")
    if len(m.shape) != 1 or (heads_q is not None and m.shape[0] != heads_q):
        want = f"({heads_q},)" if heads_q is not None else "(Hq,)"
        raise InputValueError(f"learnable_sink must have shape {want}, one logit per query head; got {m.shape}")
    if device is not None and m.device != device:
        raise DeviceError(f"learnable_sink must be on {device} with q, got {m.device} (move it with .to(q.device))")
    return True


def check_score_mods(window_size, softcap, sink: TensorMeta | None, *, causal, heads_q, device, softmax_scale,
                     lengths=()) -> ScoreMods:
    """The validated ScoreMods of a call. lengths: (name, value) of the sizes a window needs below 2^30
    (seqlen_q, seqlen_k, or varlen's totals, the cache's capacity). Every problem in one error."""
    errors = _Errors()
    sides = errors.attempt(check_window_size, window_size)
    cap = errors.attempt(check_softcap, softcap, softmax_scale)
    sinks = errors.attempt(check_sink_meta, sink, heads_q, device)
    raise_all(errors)
    from ..spec.plan import window_sides

    left, right = window_sides(sides, bool(causal))
    mods = ScoreMods(window_left=left, window_right=right, causal=bool(causal), softcap=cap, sinks=sinks)
    if mods.window:
        big = [f"{n} = {v}" for n, v in lengths if v >= WINDOW_SEQ_LIMIT]
        if big:
            raise InputValueError(f"a sliding window needs lengths below 2^30 - 256 ({WINDOW_SEQ_LIMIT}); "
                                  f"got {', '.join(big)}")
    return mods


@dataclass(frozen=True)
class Problem(_BshdOutputs):
    """A validated attention call: sizes in flash-attn's (B, S, H, D) layout, the dtype and scale."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str  # "fp16" | "bf16"
    causal: bool
    softmax_scale: float
    return_lse: bool
    device: str
    relayout: tuple[tuple[str, str], ...] = ()  # (tensor name, why) for inputs copied for TMA
    mods: ScoreMods = NO_SCORE_MODS  # window, softcap, sinks
    head_dim_v: int | None = None  # v's last dim (o's); None: head_dim

    @property
    def no_keys(self) -> bool:
        """Output rows exist but no key does: O = 0 and LSE = -inf (the sink's with sinks), no launch."""
        return not self.is_empty and self.seqlen_k == 0


# ---- torch boundary ----------------------------------------------------------------------------
def tensor_meta(t, name: str) -> TensorMeta:
    """Metadata of a torch tensor; raises InputTypeError for anything that is not one."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - api.py needs torch before it gets here
        raise InputTypeError("fa4gen.attention needs torch (pip install torch)") from e
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # strides and data pointers mean nothing (nested: stride() raises; sparse: read as zeros) for
    # anything but a dense strided tensor, and TMA addresses only those
    if getattr(t, "is_nested", False):
        raise InputTypeError(f"{name} is a nested tensor; fa4gen needs dense (torch.strided) tensors, e.g. "
                             f"pad it with torch.nested.to_padded_tensor")
    if t.layout != torch.strided:
        raise InputTypeError(f"{name} has layout {t.layout}; fa4gen needs dense (torch.strided) tensors "
                             f"(.to_dense() first)")
    return TensorMeta(
        name=name,
        shape=tuple(t.shape),
        strides=tuple(t.stride()),
        dtype=str(t.dtype).removeprefix("torch."),
        device=str(t.device),
        data_ptr=t.data_ptr() if t.device.type == "cuda" else 0,
        element_size=t.element_size(),
    )


# ---- pure checks -------------------------------------------------------------------------------
def check_devices(metas: tuple[TensorMeta, ...]) -> str:
    off = [f"{m.name} must be a CUDA tensor, got one on {m.device}" for m in metas if not m.device.startswith("cuda")]
    if off:
        raise DeviceError("; ".join(off))
    devices = {m.device for m in metas}
    if len(devices) > 1:
        where = ", ".join(f"{m.name} on {m.device}" for m in metas)
        raise DeviceError(f"q, k and v must be on the same CUDA device, got {where}")
    return metas[0].device


def check_dtypes(metas: tuple[TensorMeta, ...]) -> str:
    bad = [m for m in metas if m.dtype not in _DTYPES]
    if bad:
        what = ", ".join(f"{m.name} has dtype {m.dtype}" for m in bad)
        raise InputTypeError(f"{what}; fa4gen supports float16 and bfloat16")
    if len({m.dtype for m in metas}) > 1:
        got = ", ".join(f"{m.name}: {m.dtype}" for m in metas)
        raise InputTypeError(f"q, k and v must have the same dtype, got {got}")
    return _DTYPES[metas[0].dtype]


def _check_kv_shapes(k: TensorMeta, v: TensorMeta, k_name: str = "k", v_name: str = "v") -> None:
    """k and v alike but for the last dim (v's is head_dim_v, which may differ from k's head_dim)."""
    if k.shape[:-1] != v.shape[:-1]:
        raise InputValueError(f"{k_name} and {v_name} must have the same shape but for the last dim (head_dim, "
                              f"head_dim_v), got {k_name} {k.shape} and {v_name} {v.shape}")


def check_shapes(q: TensorMeta, k: TensorMeta, v: TensorMeta) -> tuple[int, int, int, int, int, int, int]:
    """(B, Sq, Skv, Hq, Hkv, D, DV) of flash-attn-layout tensors q (B, Sq, Hq, D), k (B, Skv, Hkv, D),
    v (B, Skv, Hkv, DV)."""
    for m in (q, k, v):
        if len(m.shape) != 4:
            raise InputValueError(
                f"{m.name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {m.shape}")
    _check_kv_shapes(k, v)
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    dv = v.shape[-1]
    if b != bk:
        raise InputValueError(f"q and k must have the same batch size, got {b} and {bk}")
    _check_heads(d, dk, dv, hq, hkv)
    for label, n in (("batch", b), ("seqlen_q", sq), ("seqlen_k", skv), ("heads_q", hq)):
        if n >= U32_PARAM_LIMIT:
            raise InputValueError(f"{label} = {n} does not fit the kernel's 32-bit parameters")
    return b, sq, skv, hq, hkv, d, dv


def check_head_dims(d: int, dk: int, dv: int) -> None:
    """q's and k's last dims equal (head_dim), and (head_dim, v's last dim) a pair fa4gen generates
    for the runtime's arch (spec.config.HEAD_DIM_PAIRS)."""
    if d != dk:
        raise InputValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if head_dim_refusal(RUNTIME_ARCH, d, dv):
        what = f"head_dim {d}" if dv == d else f"head_dim {d} with head_dim_v {dv} (q's and v's last dims)"
        planned = " (planned: docs/HEAD_DIMS.md)" if (d, dv) in HEAD_DIM_PLANNED else ""
        raise InputValueError(f"{what} is not supported{planned}; fa4gen generates (head_dim, head_dim_v) "
                              f"{head_dim_pairs_text(RUNTIME_ARCH)}")


def _check_heads(d: int, dk: int, dv: int, hq: int, hkv: int) -> None:
    """check_head_dims; Hq a multiple of Hkv (GQA) within the ratio the kernels take."""
    check_head_dims(d, dk, dv)
    if hq > 0 and hkv == 0:
        raise InputValueError(f"k and v have 0 heads but q has {hq}")
    if hkv > 0 and hq % hkv:
        raise InputValueError(f"q's heads ({hq}) must be a multiple of k/v's heads ({hkv}) for GQA")
    if hq > 0 and hq // hkv > GQA_RATIO_MAX:
        raise InputValueError(f"GQA ratio {hq}/{hkv} = {hq // hkv} exceeds {GQA_RATIO_MAX} query heads per kv head")


def check_flags(causal, return_lse) -> None:
    for name, value in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(value, bool):
            raise InputTypeError(f"{name} must be True or False, got {value!r}")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale as a float: 1/sqrt(head_dim) when None; finite, > 0 and representable in the
    kernel's f32 `scale_log2` parameter (softmax_scale * log2(e))."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise InputTypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise InputValueError(f"softmax_scale must be finite and > 0, got {s!r}")
    try:
        as_f32 = struct.unpack("f", struct.pack("f", s * LOG2E))[0]
    except OverflowError:
        as_f32 = math.inf
    if not math.isfinite(as_f32) or as_f32 == 0.0:
        raise InputValueError(f"softmax_scale {s!r} times log2(e) is not a finite non-zero float32")
    return s


def tma_layout_problem(m: TensorMeta) -> str | None:
    """Why TMA cannot address this tensor in place (None: it can).

    cuTensorMapEncodeTiled needs the innermost dim packed (stride 1), every other stride a multiple
    of 16 bytes below 2^40, and a 16-byte-aligned base address. Strides of size-1 dims are never
    used to address memory; `canonical_strides` gives them a legal value, so they are not checked.
    Broadcast (stride-0) dims are refused here too: a tensor map describes distinct rows.
    """
    if m.shape and m.shape[-1] > 1 and m.strides[-1] != 1:
        return f"its last dim has stride {m.strides[-1]}, TMA needs it contiguous (stride 1)"
    for dim, (size, stride) in enumerate(zip(m.shape[:-1], m.strides[:-1])):
        if size == 1:
            continue
        nbytes = stride * m.element_size
        if stride <= 0:
            return f"dim {dim} has stride {stride} (a broadcast view), TMA needs distinct rows"
        if nbytes % TMA_ALIGN:
            return f"dim {dim} has a stride of {nbytes} bytes, TMA needs a multiple of {TMA_ALIGN}"
        if nbytes >= TMA_MAX_STRIDE:
            return f"dim {dim} has a stride of {nbytes} bytes, TMA allows less than 2^40"
    if m.data_ptr % TMA_ALIGN:
        return f"its data pointer {m.data_ptr:#x} is not {TMA_ALIGN}-byte aligned"
    return None


def canonical_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The same strides, with each size-1 dim's stride replaced by what a packed tensor would have
    there (torch leaves it arbitrary, e.g. 1 after a slice; the tensor map would reject that)."""
    out = list(strides)
    inner = 1
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1:
            out[i] = inner
        inner = max(inner, out[i] * max(shape[i], 1))
    return tuple(out)


def tensor_metas(q, k, v) -> tuple[TensorMeta, TensorMeta, TensorMeta]:
    """tensor_meta of q, k and v; every argument that is not a dense tensor reported in one error."""
    metas, errors = [], []
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        try:
            metas.append(tensor_meta(t, n))
        except Fa4genInputError as e:
            errors.append(e)
    raise_all(errors)
    return tuple(metas)


def check_arch(capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """Only compute capability 9.0 runs: sm_90a code is not forward compatible (the 'a' features,
    wgmma and setmaxnreg, exist on 9.0 alone), and no sm_100a kernel has run on a Blackwell GPU."""
    major, minor = capability
    if (major, minor) == (9, 0):
        return
    sm = f"sm_{major}{minor}"
    if major == 10:
        raise UnsupportedArchError(
            f"fa4gen runs its sm_90a (H100/H200) kernels only; {device_name} is {sm}: sm_100a kernels "
            f"are generated (fa4gen build --arch sm_100a) but have never run on a Blackwell GPU, so the "
            f"runtime refuses to launch them")
    raise UnsupportedArchError(
        f"fa4gen runs sm_90a (H100/H200) kernels; {device_name} is {sm}, which has no fa4gen kernel "
        f"(sm_90a code runs only on compute capability 9.0; sm_100a kernels are generated but not "
        f"executable here)")


def check_problem(q: TensorMeta, k: TensorMeta, v: TensorMeta, *, causal=False, softmax_scale=None,
                  return_lse=False, layout=True, window_size=(-1, -1), softcap=0.0,
                  learnable_sink: TensorMeta | None = None) -> Problem:
    """Every check that needs no GPU. Each group (devices, dtypes, shapes, flags, scale) runs even
    when an earlier one failed, and every problem found is reported in one error (InputErrors when
    there are several): a CPU user hears of fp32 or head_dim 100 now, not after moving to a GPU.
    layout=False skips the TMA layout checks (`relayout` stays empty): torch_ops' fake
    implementation has no data pointer to check, and the real call checks again anyway."""
    metas = (q, k, v)
    errors = _Errors()
    attempt = errors.attempt

    device = attempt(check_devices, metas)
    dtype = attempt(check_dtypes, metas)
    shapes = attempt(check_shapes, q, k, v)
    attempt(check_flags, causal, return_lse)
    d = shapes[5] if shapes else (q.shape[-1] if q.shape and q.shape[-1] > 0 else HEAD_DIMS[-1])
    scale = attempt(check_softmax_scale, softmax_scale, d)
    mods = attempt(check_score_mods, window_size, softcap, learnable_sink, causal=causal,
                   heads_q=shapes[3] if shapes else None, device=device, softmax_scale=scale or 1.0,
                   lengths=(("seqlen_q", shapes[1]), ("seqlen_k", shapes[2])) if shapes else ())
    raise_all(errors)
    b, sq, skv, hq, hkv, d, dv = shapes
    relayout = []
    for m in metas if layout else ():
        why = tma_layout_problem(m)
        if why is not None:
            relayout.append((m.name, why))
    return Problem(batch=b, seqlen_q=sq, seqlen_k=skv, heads_q=hq, heads_kv=hkv, head_dim=d, dtype=dtype,
                   causal=causal, softmax_scale=scale, return_lse=return_lse, device=device,
                   relayout=tuple(relayout), mods=mods, head_dim_v=dv)


# ---- varlen (fa4gen.attention_varlen) ------------------------------------------------------------
@dataclass(frozen=True)
class VarlenProblem(_HeadDims):
    """A validated varlen call: packed q (total_q, Hq, D), k/v (total_k, Hkv, D), B sequences."""

    batch: int
    total_q: int
    total_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: str
    causal: bool
    softmax_scale: float
    return_lse: bool
    device: str
    has_seqused_k: bool
    relayout: tuple[tuple[str, str], ...] = ()
    mods: ScoreMods = NO_SCORE_MODS
    head_dim_v: int | None = None  # v's last dim (o's); None: head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 0

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.total_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, int]:
        return (self.heads_q, self.total_q)

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.total_q == 0 or self.heads_q == 0

    @property
    def no_keys(self) -> bool:
        return not self.is_empty and self.total_k == 0


def check_varlen_shapes(q: TensorMeta, k: TensorMeta, v: TensorMeta) -> tuple[int, int, int, int, int, int]:
    """(total_q, total_k, Hq, Hkv, D, DV) of packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, DV)."""
    for m in (q, k, v):
        if len(m.shape) != 3:
            raise InputValueError(f"{m.name} must have 3 dims (total_tokens, heads, head_dim) for attention_varlen, "
                                  f"got shape {m.shape}")
    _check_kv_shapes(k, v)
    tq, hq, d = q.shape
    tk, hkv, dk = k.shape
    dv = v.shape[-1]
    _check_heads(d, dk, dv, hq, hkv)
    for label, n in (("total_q", tq), ("total_k", tk), ("heads_q", hq)):
        if n >= U32_PARAM_LIMIT:
            raise InputValueError(f"{label} = {n} does not fit the kernel's 32-bit parameters")
    if tq * hq * d * 2 >= 1 << 48 or tk * hkv * d * 2 >= 1 << 48:
        raise InputValueError("q or k is too large to address")
    return tq, tk, hq, hkv, d, dv


def check_offsets_meta(m: TensorMeta | None, name: str, length: int | None, device: str | None) -> int:
    """An int32, 1-D, contiguous offsets/lengths tensor on the inputs' device; returns its length."""
    if m is None:
        raise InputTypeError(f"{name} must be a torch.Tensor of int32, got None")
    if m.dtype != "int32":
        raise InputTypeError(f"{name} must have dtype int32, got {m.dtype}")
    if len(m.shape) != 1:
        raise InputValueError(f"{name} must be 1-D, got shape {m.shape}")
    if length is not None and m.shape[0] != length:
        raise InputValueError(f"{name} must have {length} entries, got {m.shape[0]}")
    if device is not None and m.device != device:
        raise DeviceError(f"{name} must be on {device} with q, k and v, got {m.device} (the kernel reads it; "
                          "move it with .to(q.device))")
    if m.shape[0] > 1 and m.strides[0] != 1:
        raise InputValueError(f"{name} must be contiguous (stride 1), got stride {m.strides[0]}")
    if m.data_ptr % 4:
        raise InputValueError(f"{name}'s data pointer is not 4-byte aligned")
    return m.shape[0]


def _check_max_seqlen(name: str, value, batch: int | None, total: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
    n = int(value)
    if n < 0 or n >= U32_PARAM_LIMIT:
        raise InputValueError(f"{name} must be in [0, 2^31), got {n}")
    if batch is not None and total is not None and n * batch < total:
        raise InputValueError(
            f"{name}={n} is smaller than a real sequence length: {batch} sequences of at most {n} rows cannot "
            f"hold the {total} rows given")
    return n


def check_varlen_problem(q: TensorMeta, k: TensorMeta, v: TensorMeta, cu_q: TensorMeta | None,
                         cu_k: TensorMeta | None, max_seqlen_q, max_seqlen_k, *, seqused_k: TensorMeta | None = None,
                         causal=False, softmax_scale=None, return_lse=False, window_size=(-1, -1), softcap=0.0,
                         learnable_sink: TensorMeta | None = None) -> VarlenProblem:
    """Everything the host can check without reading the offsets (no device sync); every problem in
    one error. What it cannot see (non-monotonic or out-of-range offsets on the device) the kernel
    clamps: no sequence reads or writes outside q, k, v, o or lse."""
    metas = (q, k, v)
    errors = _Errors()
    attempt = errors.attempt

    device = attempt(check_devices, metas)
    dtype = attempt(check_dtypes, metas)
    shapes = attempt(check_varlen_shapes, q, k, v)
    attempt(check_flags, causal, return_lse)
    d = shapes[4] if shapes else (q.shape[-1] if q.shape and q.shape[-1] > 0 else HEAD_DIMS[-1])
    scale = attempt(check_softmax_scale, softmax_scale, d)
    nq = attempt(check_offsets_meta, cu_q, "cu_seqlens_q", None, device)
    batch = nq - 1 if nq else None
    if nq == 0:
        errors.append(InputValueError("cu_seqlens_q must have B + 1 >= 1 entries, got 0"))
    attempt(check_offsets_meta, cu_k, "cu_seqlens_k", nq, device)
    if seqused_k is not None:
        attempt(check_offsets_meta, seqused_k, "seqused_k", batch, device)
    tq, tk = (shapes[0], shapes[1]) if shapes else (None, None)
    mq = attempt(_check_max_seqlen, "max_seqlen_q", max_seqlen_q, batch, tq)
    mk = attempt(_check_max_seqlen, "max_seqlen_k", max_seqlen_k, batch if seqused_k is None else None, tk)
    if batch == 0 and tq:
        errors.append(InputValueError(f"cu_seqlens_q describes no sequence but q has {tq} rows"))
    if shapes and batch:
        from ..spec.plan import varlen_task_bound
        from ..spec.tiles import gqa_pack

        hkv_, hq_ = shapes[3], shapes[2]
        if hkv_ and hq_:
            p = gqa_pack(hq_ // hkv_)
            bound = varlen_task_bound(batch, tq, hkv_ * (hq_ // hkv_ // p), 128 // p)
            if bound >= U32_PARAM_LIMIT:
                errors.append(InputValueError(
                    f"{batch} sequences of {tq} rows in all with {hq_} query heads make up to {bound} tiles; the "
                    f"kernel's 32-bit task index holds fewer than 2^31: split the batch"))
    mods = attempt(check_score_mods, window_size, softcap, learnable_sink, causal=causal,
                   heads_q=shapes[2] if shapes else None, device=device, softmax_scale=scale or 1.0,
                   lengths=(("total_q", shapes[0]), ("total_k", shapes[1])) if shapes else ())
    raise_all(errors)
    tq, tk, hq, hkv, d, dv = shapes
    relayout = tuple((m.name, why) for m in metas if (why := tma_layout_problem(m)) is not None)
    return VarlenProblem(batch=batch, total_q=tq, total_k=tk, heads_q=hq, heads_kv=hkv, head_dim=d,
                         max_seqlen_q=mq, max_seqlen_k=mk, dtype=dtype, causal=causal, softmax_scale=scale,
                         return_lse=return_lse, device=device, has_seqused_k=seqused_k is not None,
                         relayout=relayout, mods=mods, head_dim_v=dv)


# ---- KV cache (fa4gen.attention_with_kvcache) ----------------------------------------------------------
@dataclass(frozen=True)
class KvcacheProblem(_BshdOutputs):
    """A validated KV-cache call: q (B, Sq, Hq, D); a contiguous cache (B, Smax, Hkv, D) or a paged
    one (num_pages, page_size, Hkv, D) with a (B, max_pages) page table."""

    batch: int
    seqlen_q: int
    capacity: int  # keys a sequence can hold: Smax, or max_pages * page_size
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int  # 0: contiguous
    num_pages: int
    max_pages: int
    num_splits: int  # as asked (batch_invariant: BATCH_INVARIANT_SPLITS when asked 0): 0 = choose
    dtype: str
    causal: bool
    softmax_scale: float
    return_lse: bool
    device: str
    host_index: bool  # cache_seqlens / page_table given on the CPU: checked here, then copied
    relayout: tuple[tuple[str, str], ...] = ()
    mods: ScoreMods = NO_SCORE_MODS
    head_dim_v: int | None = None  # v_cache's last dim (o's); None: head_dim

    @property
    def no_keys(self) -> bool:
        return not self.is_empty and self.capacity == 0


def _index_meta(m: TensorMeta | None, name: str, shape: tuple, device: str | None) -> None:
    """An int32 index tensor of `shape` (None entries: any size), innermost dim contiguous, on the
    inputs' device or on the CPU (then its values are checked on the host)."""
    if m is None:
        raise InputTypeError(f"{name} must be a torch.Tensor of int32, got None")
    if m.dtype != "int32":
        raise InputTypeError(f"{name} must have dtype int32, got {m.dtype}")
    if len(m.shape) != len(shape) or any(want is not None and got != want for got, want in zip(m.shape, shape)):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise InputValueError(f"{name} must have shape ({want}), got {m.shape}")
    if device is not None and m.device != device and m.device != "cpu":
        raise DeviceError(f"{name} must be on {device} with q and the cache (or on the CPU), got {m.device}")
    if m.shape and m.shape[-1] > 1 and m.strides[-1] != 1:
        raise InputValueError(f"{name}'s last dim must be contiguous (stride 1), got stride {m.strides[-1]}")
    if len(m.shape) == 2 and m.shape[0] > 1 and m.strides[0] < 0:
        raise InputValueError(f"{name} has a negative row stride")


def check_kvcache_problem(q: TensorMeta, k: TensorMeta, v: TensorMeta, cache_seqlens: TensorMeta | None,
                          page_table: TensorMeta | None = None, *, causal=True, softmax_scale=None, num_splits=0,
                          return_lse=False, window_size=(-1, -1), softcap=0.0,
                          learnable_sink: TensorMeta | None = None, batch_invariant=False) -> KvcacheProblem:
    """Everything the host checks before a KV-cache launch, every problem in one error. Values of
    cache_seqlens / page_table on the device are not read (no sync): the kernel clamps them."""
    from ..spec.config import PAGE_SIZES
    from ..spec.plan import KVCACHE_MAX_SPLITS

    errors = _Errors()
    attempt = errors.attempt

    device = attempt(check_devices, (q, k, v))
    dtype = attempt(check_dtypes, (q, k, v))
    attempt(check_flags, causal, return_lse)
    ok = True
    if len(q.shape) != 4:
        errors.append(InputValueError(f"q must have 4 dims (batch, seqlen_q, heads, head_dim), got shape {q.shape}"))
        ok = False
    for m in (k, v):
        if len(m.shape) != 4:
            errors.append(InputValueError(
                f"{m.name}_cache must have 4 dims: (batch, max_seqlen, heads_kv, head_dim), or (num_pages, "
                f"page_size, heads_kv, head_dim) with a page_table; got shape {m.shape}"))
            ok = False
    if ok:
        try:
            _check_kv_shapes(k, v, "k_cache", "v_cache")
        except Fa4genInputError as e:
            errors.append(e)
            ok = False
    b = sq = hq = d = dv = hkv = 0
    page_size = num_pages = max_pages = 0
    capacity = 0
    if ok:
        b, sq, hq, d = q.shape
        n0, n1, hkv, dk = k.shape
        dv = v.shape[-1]
        try:
            _check_heads(d, dk, dv, hq, hkv)
        except Fa4genInputError as e:
            errors.append(e)
        if page_table is None:
            if n0 != b:
                errors.append(InputValueError(
                    f"a contiguous cache has one row per sequence: k_cache.shape[0] = {n0} but q has batch {b} "
                    f"(a paged cache needs page_table)"))
            capacity = n1
        else:
            page_size, num_pages = n1, n0
            if page_size not in PAGE_SIZES:
                errors.append(InputValueError(
                    f"page size {page_size} (k_cache.shape[1] with a page_table): the kernels take "
                    f"{', '.join(map(str, PAGE_SIZES))}"))
            if num_pages == 0:
                errors.append(InputValueError("a paged cache with 0 pages: the page table has nothing to point at"))
            if len(page_table.shape) == 2:
                max_pages = page_table.shape[1]
            capacity = max_pages * page_size
        for label, n in (("batch", b), ("seqlen_q", sq), ("heads_q", hq), ("cache capacity", capacity),
                         ("num_pages", num_pages)):
            if n >= U32_PARAM_LIMIT:
                errors.append(InputValueError(f"{label} = {n} does not fit the kernel's 32-bit parameters"))
    attempt(_index_meta, cache_seqlens, "cache_seqlens", (b if ok else None,), device)
    if page_table is not None:
        attempt(_index_meta, page_table, "page_table", (b if ok else None, None), device)
        if page_table.shape and len(page_table.shape) == 2 and page_table.shape[1] == 0 and ok and b:
            errors.append(InputValueError("page_table has 0 pages per sequence"))
        if (page_table.strides and len(page_table.strides) == 2
                and page_table.strides[0] * max(page_table.shape[0], 1) >= U32_PARAM_LIMIT):
            errors.append(InputValueError("page_table is too large for the kernel's 32-bit indexing"))
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        errors.append(InputTypeError(f"num_splits must be an int (0 = choose), got {type(num_splits).__name__}"))
    elif not 0 <= int(num_splits) <= KVCACHE_MAX_SPLITS:
        errors.append(InputValueError(f"num_splits must be in [0, {KVCACHE_MAX_SPLITS}] (0 = choose), got {num_splits}"))
    elif batch_invariant is True and int(num_splits) == 0:  # a fixed count: spec/schedule.py BATCH_INVARIANT_SPLITS
        from ..spec.schedule import BATCH_INVARIANT_SPLITS

        num_splits = BATCH_INVARIANT_SPLITS
    if type(batch_invariant) is not bool:
        errors.append(InputTypeError(f"batch_invariant must be True or False, got {type(batch_invariant).__name__}"))
    scale = attempt(check_softmax_scale, softmax_scale, d if d in HEAD_DIMS else HEAD_DIMS[-1])
    mods = attempt(check_score_mods, window_size, softcap, learnable_sink, causal=causal, heads_q=hq if ok else None,
                   device=device, softmax_scale=scale or 1.0,
                   lengths=(("seqlen_q", sq), ("the cache's capacity", capacity)) if ok else ())
    if ok and b and hkv and hq and not errors:
        from ..spec.tiles import gqa_pack

        p = gqa_pack(hq // hkv)
        tasks = b * hkv * (hq // hkv // p) * -(-sq // (128 // p)) * max(int(num_splits), 1)
        if tasks >= U32_PARAM_LIMIT:
            errors.append(InputValueError(f"{tasks} tiles: the kernel's 32-bit task index holds fewer than 2^31"))
    raise_all(errors)
    host = any(m is not None and m.device == "cpu" for m in (cache_seqlens, page_table))
    relayout = tuple((m.name, why) for m in (q, k, v) if (why := tma_layout_problem(m)) is not None)
    return KvcacheProblem(batch=b, seqlen_q=sq, capacity=capacity, heads_q=hq, heads_kv=hkv, head_dim=d,
                          page_size=page_size, num_pages=num_pages, max_pages=max_pages, num_splits=int(num_splits),
                          dtype=dtype, causal=causal, softmax_scale=scale, return_lse=return_lse, device=device,
                          host_index=host, relayout=relayout, mods=mods, head_dim_v=dv)


def check_kvcache_values(cache_seqlens, page_table, problem: KvcacheProblem) -> None:
    """Range checks of index values the host holds (CPU tensors or lists): lengths in [0, capacity],
    page entries in [0, num_pages). Device-side values are clamped by the kernel instead."""
    errors = []
    lens = [int(x) for x in cache_seqlens]
    bad = [(i, n) for i, n in enumerate(lens) if not 0 <= n <= problem.capacity]
    if bad:
        i, n = bad[0]
        errors.append(InputValueError(
            f"cache_seqlens[{i}] = {n} is outside [0, {problem.capacity}] (the cache holds {problem.capacity} keys "
            f"per sequence){f'; {len(bad)} entries in all' if len(bad) > 1 else ''}"))
    if page_table is not None and problem.page_size:
        for i, n in enumerate(lens):
            used = -(-min(max(n, 0), problem.capacity) // problem.page_size)
            row = [int(x) for x in page_table[i][:used]]
            off = [(j, p) for j, p in enumerate(row) if not 0 <= p < problem.num_pages]
            if off:
                j, p = off[0]
                errors.append(InputValueError(
                    f"page_table[{i}, {j}] = {p} is not a page of the cache (0 <= page < {problem.num_pages})"))
                break
    raise_all(errors)
