"""Context-parallel (ring) attention over torch.distributed.

A sequence too long for one GPU is split along S across the ranks of a process group: every rank
holds a shard of Q, K and V. The K/V shards travel around the ring (rank r sends to r+1 and receives
from r-1, torch.distributed P2P: NCCL on GPUs, gloo on CPUs) while each rank attends its Q shard to
the K/V shard in hand with the local attention (`fa4gen.attention` on CUDA tensors) and merges the
partial outputs exactly by their log-sum-exp, in float32.

    o = ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, return_lse=False)

Sharding. Non-causal attention takes any sharding (every query sees every key; the output rows
follow q's rows). Causal attention needs the zigzag (load-balanced) sharding: the sequence of
length S is cut into 2W chunks of c = S / 2W rows and rank r holds chunks r and 2W-1-r, concatenated
(`zigzag_shard`, `zigzag_unshard`, `zigzag_positions`, `gather_sequence`). At ring step t rank r
holds the K/V shard of rank s = (r - t) mod W and computes (`ring_schedule`):

    s == r  local q against local k/v, causal (Sq == Skv == 2c: the bottom-right causal mask on the
            concatenation is exactly the global one for these rows and keys)
    s <  r  all of q against the first half of k/v (chunk s), not causal
    s >  r  the second half of q (chunk 2W-1-r) against all of k/v, not causal

so every rank computes 2c^2 (query, key) pairs per step (step 0: 2c^2 + c, the diagonal) and the
whole is the causal mask of the full sequence, each pair once.

Overlap. At each step the send of the current K/V (one packed buffer, k's elements then v's) to r+1 and the
receive of the next from r-1 are posted (`torch.distributed.batch_isend_irecv`) before the step's
attention is launched; on CUDA they are posted from a side stream that first waits for the compute
stream (the buffer being received into was read by the previous step's attention), and the compute
stream waits for the receive only before the next step. Two K/V buffers alternate. The host does
not synchronise with the device anywhere in the loop.

On CPU tensors the local attention is `torch_attention`, a float32 (float64 for float64 inputs)
torch implementation with the kernel's conventions (GQA, bottom-right causal, O = 0 and
LSE = -inf for rows without a key): the stand-in for the kernel in the gloo tests. `attn_fn=`
replaces the local attention (a callable (q, k, v, causal, softmax_scale) -> (o, lse)).

Forward only, like `fa4gen.attention`. Every rank of the group must call with inputs of the same
shapes, dtype and flags: the ranks exchange a small descriptor of their inputs first (one
all_gather), so a rank with bad or mismatched inputs makes every rank raise the same
`fa4gen.runtime.validate.Fa4genInputError` instead of hanging in the ring.

Imports torch lazily: `import fa4gen`, `fa4gen.distributed` and `from fa4gen import distributed` work without torch.
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass

from . import validate
from .validate import DeviceError, InputTypeError, InputValueError

__all__ = ["ring_attention", "ring_schedule", "RingStep", "zigzag_shard", "zigzag_unshard", "zigzag_positions",
           "contiguous_shard", "gather_sequence", "simulate_ring", "merge_partial_", "torch_attention", "step_work"]

_CPU_DTYPES = ("float16", "bfloat16", "float32", "float64")


# ---- sharding --------------------------------------------------------------------------------------
def _check_split(seqlen: int, world_size: int, parts: int, what: str) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if seqlen % parts:
        raise InputValueError(f"{what}: the sequence length {seqlen} is not divisible by {parts} "
                              f"(2 x world_size {world_size} chunks for zigzag, world_size for contiguous); pad it")
    return seqlen // parts


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def _narrow(x, dim: int, start: int, length: int):
    if hasattr(x, "narrow"):  # torch
        return x.narrow(dim, start, length)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, start + length)
    return x[tuple(idx)]


def _cat(parts, dim: int):
    if hasattr(parts[0], "narrow"):
        import torch

        return torch.cat(list(parts), dim)
    import numpy as np

    return np.concatenate(list(parts), axis=dim)


def zigzag_shard(x, rank: int, world_size: int, dim: int = 1):
    """Rank `rank`'s zigzag shard of x (torch tensor or NumPy array) along `dim`: the sequence is cut
    into 2 * world_size equal chunks and the shard is chunk `rank` followed by chunk
    2 * world_size - 1 - rank (a new, contiguous tensor). The sharding `ring_attention(causal=True)`
    needs; the length along dim must be divisible by 2 * world_size."""
    c = _check_split(x.shape[dim], world_size, 2 * world_size, "zigzag_shard")
    _check_rank(rank, world_size)
    return _cat((_narrow(x, dim, rank * c, c), _narrow(x, dim, (2 * world_size - 1 - rank) * c, c)), dim)


def zigzag_unshard(shards, dim: int = 1):
    """The full sequence from the zigzag shards of ranks 0..W-1 (in rank order): the inverse of
    `zigzag_shard`."""
    shards = list(shards)
    if not shards:
        raise InputValueError("zigzag_unshard needs the shards of ranks 0..W-1, got none")
    lens = {s.shape[dim] for s in shards}
    if len(lens) != 1 or next(iter(lens)) % 2:
        raise InputValueError(f"zigzag shards must all have the same even length along dim {dim}, got "
                              f"{[s.shape[dim] for s in shards]}")
    c = next(iter(lens)) // 2
    first = [_narrow(s, dim, 0, c) for s in shards]
    second = [_narrow(s, dim, c, c) for s in reversed(shards)]
    return _cat(first + second, dim)


def zigzag_positions(seqlen: int, rank: int, world_size: int) -> list[int]:
    """The global sequence positions of the rows of rank `rank`'s zigzag shard (e.g. for rotary
    embeddings), in the shard's row order."""
    c = _check_split(seqlen, world_size, 2 * world_size, "zigzag_positions")
    _check_rank(rank, world_size)
    hi = (2 * world_size - 1 - rank) * c
    return list(range(rank * c, rank * c + c)) + list(range(hi, hi + c))


def contiguous_shard(x, rank: int, world_size: int, dim: int = 1):
    """Rank `rank`'s contiguous shard (rows [rank * S/W, (rank+1) * S/W)) along `dim`: enough for
    non-causal ring attention (not load-balanced for causal, and not what causal=True computes).
    Its inverse is a concatenation of the shards in rank order."""
    n = _check_split(x.shape[dim], world_size, world_size, "contiguous_shard")
    _check_rank(rank, world_size)
    return _narrow(x, dim, rank * n, n)


def gather_sequence(x_local, group=None, dim: int = 1, zigzag: bool = True):
    """The full sequence on every rank: all_gather of the ranks' shards along `dim`, then
    `zigzag_unshard` (zigzag=True) or a concatenation in rank order (contiguous shards). Every rank of
    the group must call it with shards of the same shape."""
    import torch
    import torch.distributed as dist

    w = dist.get_world_size(group)
    parts = [torch.empty_like(x_local) for _ in range(w)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return zigzag_unshard(parts, dim) if zigzag else torch.cat(parts, dim)


# ---- the schedule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingStep:
    """What one rank computes at one ring step, in rows of its local shards (length 2c when causal):
    its q rows [q_start, q_stop) against rows [kv_start, kv_stop) of the K/V shard of rank `source`."""

    step: int
    source: int
    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool


def ring_schedule(rank: int, world_size: int, seqlen_local: int, causal: bool) -> list[RingStep]:
    """Rank `rank`'s steps: at step t it holds the K/V shard of rank (rank - t) mod W. Not causal:
    every step is all q against all k/v. Causal (zigzag shards of 2c rows): see the module docstring."""
    _check_rank(rank, world_size)
    n = seqlen_local
    steps = []
    for t in range(world_size):
        s = (rank - t) % world_size
        if not causal:
            steps.append(RingStep(t, s, 0, n, 0, n, False))
            continue
        if n % 2:
            raise InputValueError(f"causal ring attention needs an even local sequence length (two zigzag chunks), "
                                  f"got {n}")
        c = n // 2
        if s == rank:
            steps.append(RingStep(t, s, 0, n, 0, n, True))
        elif s < rank:
            steps.append(RingStep(t, s, 0, n, 0, c, False))
        else:
            steps.append(RingStep(t, s, c, n, 0, n, False))
    return steps


def step_work(step: RingStep) -> int:
    """The (query, key) pairs a step computes (the bottom-right causal mask counted exactly)."""
    sq, skv = step.q_stop - step.q_start, step.kv_stop - step.kv_start
    if not step.causal:
        return sq * skv
    off = skv - sq
    return sum(max(0, min(skv, i + off + 1)) for i in range(sq))


# ---- local attention and the merge -------------------------------------------------------------------
def _acc_dtype(torch, dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """The CPU stand-in for the kernel: (o, lse) of softmax(q k^T * scale) v computed with torch in
    float32 (float64 for float64 inputs), with fa4gen.attention's conventions: q (B, Sq, Hq, D),
    k (B, Skv, Hkv, D), v (B, Skv, Hkv, DV), GQA (query head h reads kv head h // (Hq / Hkv)), bottom-right causal mask
    (query i sees keys j <= i + Skv - Sq), rows without a key get O = 0 and LSE = -inf. Returns o in
    q's dtype and lse (B, Hq, Sq) in the compute dtype. Works on any device; memory O(Sq * Skv)."""
    import torch

    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    acc = _acc_dtype(torch, q.dtype)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    g = hq // hkv
    qf = q.to(acc).reshape(b, sq, hkv, g, d)
    s = torch.einsum("bihgd,bjhd->bhgij", qf, k.to(acc)) * scale
    if causal:
        allowed = (torch.arange(skv, device=q.device)[None, :]
                   <= torch.arange(sq, device=q.device)[:, None] + (skv - sq))
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row without a key
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - base[..., None])
    o = torch.einsum("bhgij,bjhd->bihgd", p, v.to(acc)).reshape(b, sq, hq, v.shape[-1])
    return o.to(q.dtype), lse.reshape(b, hq, sq)


def merge_partial_(out, lse, o_i, lse_i) -> None:
    """Merge a partial result into the running one, in place and exactly:
    lse <- logaddexp(lse, lse_i), out <- out * exp(lse_old - lse) + o_i * exp(lse_i - lse).
    out (B, S, H, D) and lse (B, H, S) in the accumulation dtype (float32); o_i (B, S, H, D) any float
    dtype, lse_i (B, H, S). Rows where both are -inf (no key so far) stay O = 0, LSE = -inf, no NaN."""
    import torch

    new = torch.logaddexp(lse, lse_i.to(lse.dtype))
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    a = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)
    b = torch.exp(lse_i.to(lse.dtype) - base).transpose(1, 2).unsqueeze(-1)
    out.mul_(a).addcmul_(o_i, b)
    lse.copy_(new)


def _default_attn(torch, device_type: str):
    if device_type == "cuda":
        from .api import attention

        def kernel(q, k, v, causal, softmax_scale):
            return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)

        return kernel
    return torch_attention


# ---- validation ----------------------------------------------------------------------------------------
_DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
_DESC = ("ok", "batch", "seqlen_q", "heads_q", "head_dim", "seqlen_k", "heads_kv", "head_dim_v", "dtype", "causal",
         "scale", "return_lse", "device_type")


def _local_checks(torch, q, k, v, causal, softmax_scale, return_lse, custom_attn: bool):
    """Every problem of this rank's inputs (a list of Fa4genInputError) and their descriptor."""
    errors = validate._Errors()
    metas = errors.attempt(validate.tensor_metas, q, k, v)
    errors.attempt(validate.check_flags, causal, return_lse)
    desc = None
    if metas is None:
        return errors, desc
    mq, mk, mv = metas

    def shapes():
        for m in metas:
            if len(m.shape) != 4:
                raise InputValueError(f"{m.name} must have 4 dims (batch, seqlen_local, heads, head_dim), got "
                                      f"shape {m.shape}")
        if mk.shape[:3] != mv.shape[:3]:
            raise InputValueError(f"k and v must have the same batch, length and heads (their head dims may differ), "
                                  f"got k {mk.shape} and v {mv.shape}")
        b, sq, hq, d = mq.shape
        bk, skv, hkv, dk = mk.shape
        if b != bk:
            raise InputValueError(f"q and k must have the same batch size, got {b} and {bk}")
        if d != dk:
            raise InputValueError(f"q and k must have the same head_dim, got {d} and {dk}")
        if hkv == 0 or hq % hkv:
            raise InputValueError(f"q's heads ({hq}) must be a multiple of k/v's heads ({hkv}) for GQA")
        if causal is True:
            if sq != skv:
                raise InputValueError(f"causal ring attention needs q and k/v shards of the same length (zigzag "
                                      f"shards of one sequence), got seqlen_local {sq} for q and {skv} for k/v")
            if sq % 2:
                raise InputValueError(f"causal ring attention needs an even local sequence length (the two zigzag "
                                      f"chunks of zigzag_shard), got {sq}")
        return b, sq, hq, d, skv, hkv, mv.shape[3]

    def devices():
        devs = {m.device for m in metas}
        if len(devs) > 1:
            raise DeviceError("q, k and v must be on the same device, got "
                              + ", ".join(f"{m.name} on {m.device}" for m in metas))
        dev = mq.device
        if not (dev.startswith("cuda") or dev == "cpu") and not custom_attn:
            raise DeviceError(f"ring_attention runs on CUDA tensors (fa4gen.attention) or CPU tensors (the torch "
                              f"stand-in), got {dev}")
        return dev

    def dtypes():
        if len({m.dtype for m in metas}) > 1:
            raise InputTypeError("q, k and v must have the same dtype, got "
                                 + ", ".join(f"{m.name}: {m.dtype}" for m in metas))
        if mq.dtype not in _CPU_DTYPES:
            raise InputTypeError(f"q has dtype {mq.dtype}; ring_attention takes float16 and bfloat16 (and float32/"
                                 f"float64 on the CPU stand-in)")
        return mq.dtype

    shp = errors.attempt(shapes)
    dev = errors.attempt(devices)
    dt = errors.attempt(dtypes)
    d = shp[3] if shp else 128
    scale = errors.attempt(validate.check_softmax_scale, softmax_scale, d)
    if dev is not None and dev.startswith("cuda") and not custom_attn and shp is not None:
        # what fa4gen.attention would refuse (dtype, head_dim, GQA ratio), before any communication
        if scale is not None:
            errors.attempt(validate.check_problem, mq, mk, mv, causal=False, softmax_scale=scale, return_lse=True,
                           layout=False)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
        errors.append(InputValueError("ring_attention is forward-only (no backward): call it under torch.no_grad() / "
                                      "torch.inference_mode() or pass detached tensors"))
    if shp is not None and dt is not None and scale is not None and dev is not None:
        bits = struct.unpack("<q", struct.pack("<d", scale))[0]
        desc = [0 if errors else 1, *shp, _DTYPE_CODES[dt], int(causal is True), bits, int(return_lse is True),
                1 if dev.startswith("cuda") else 0]
    return errors, desc


def _exchange(torch, dist, group, errors, desc, device):
    """All ranks' descriptors (one all_gather); every rank raises the same kind of error when any
    rank's inputs are bad or the ranks disagree."""
    w = dist.get_world_size(group)
    mine = torch.tensor(desc if desc is not None else [0] * len(_DESC), dtype=torch.int64, device=device)
    allv = [torch.empty_like(mine) for _ in range(w)]
    dist.all_gather(allv, mine, group=group)
    rows = [t.tolist() for t in allv]
    if errors:
        validate.raise_all(errors)
    bad = [r for r, row in enumerate(rows) if row[0] != 1]
    if bad:
        raise InputValueError(f"ring_attention: the inputs of rank(s) {bad} of the group failed validation (their "
                              f"own error says why); every rank raises")
    ref = rows[0]
    diff = []
    for r, row in enumerate(rows[1:], 1):
        for name, a, b in zip(_DESC, ref, row):
            if a != b:
                if name == "scale":
                    a, b = (struct.unpack("<d", struct.pack("<q", x))[0] for x in (a, b))
                diff.append(f"{name}: rank 0 has {a}, rank {r} has {b}")
    if diff:
        raise InputValueError("ring_attention: every rank must pass shards of the same shapes, dtype and flags; "
                              + "; ".join(diff))


def _group_info(dist, group):
    if not dist.is_available():
        raise InputValueError("ring_attention needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise InputValueError("ring_attention needs an initialized process group: call "
                              "torch.distributed.init_process_group first (every rank)")
    g = dist.group.WORLD if group is None else group
    rank, w = dist.get_rank(g), dist.get_world_size(g)
    if rank < 0:
        raise InputValueError("this process is not a member of the group passed to ring_attention")
    return g, rank, w


# ---- the ring ------------------------------------------------------------------------------------------
_comm_streams: dict = {}


def _comm_stream(torch, device):
    key = device.index
    s = _comm_streams.get(key)
    if s is None:
        s = _comm_streams[key] = torch.cuda.Stream(device=device)
    return s


def kv_message(torch, k, v):
    """One ring step's message: k's elements then v's in one contiguous 1-D tensor (k and v may have
    different head dims: DeepSeek's (192, 128)). v's part starts k.numel() elements in: a multiple of
    D * 2 bytes, so its view keeps TMA's 16-byte alignment."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def kv_views(msg, k_shape: tuple, v_shape: tuple):
    """(k, v) as views of a kv_message."""
    nk = math.prod(k_shape)
    return msg[:nk].view(k_shape), msg[nk:nk + math.prod(v_shape)].view(v_shape)


def _attend(out, lse, q, kv, st: RingStep, attn, scale, first: bool) -> None:
    """One ring step: q's rows of `st` against the K/V shard kv = (k, v) (kv_views), merged into
    out/lse (the first full-row step is copied in)."""
    qs = q[:, st.q_start:st.q_stop]
    k, v = kv
    o_i, lse_i = attn(qs, k[:, st.kv_start:st.kv_stop], v[:, st.kv_start:st.kv_stop], st.causal, scale)
    if first and st.q_start == 0 and st.q_stop == q.shape[1]:
        out.copy_(o_i)
        lse.copy_(lse_i)
    else:
        rows = slice(st.q_start, st.q_stop)
        merge_partial_(out[:, rows], lse[:, :, rows], o_i, lse_i)


def simulate_ring(q_shards, k_shards, v_shards, causal: bool = False, softmax_scale: float | None = None,
                  return_lse: bool = False, *, attn_fn=None):
    """Every rank's ring_attention computed in turn in this process, without communication: rank r
    attends the K/V shard of rank (r - t) mod W at step t, exactly as in the ring (same schedule, same
    slices, same merge). For checking the schedule and the merge with the real kernel on one GPU.
    Takes and returns lists of the W ranks' shards (outputs, or (output, lse) pairs)."""
    import torch

    w = len(q_shards)
    res = []
    for r in range(w):
        q = q_shards[r]
        scale = validate.check_softmax_scale(softmax_scale, q.shape[-1])
        attn = attn_fn if attn_fn is not None else _default_attn(torch, q.device.type)
        acc = _acc_dtype(torch, q.dtype)
        b, sq, hq = q.shape[:3]
        out = torch.zeros((b, sq, hq, v_shards[r].shape[-1]), dtype=acc, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
        for st in ring_schedule(r, w, sq, causal):
            k, v = k_shards[st.source], v_shards[st.source]
            # the K/V shard as the ring passes it: one message, read through views
            kv = kv_views(kv_message(torch, k, v), tuple(k.shape), tuple(v.shape))
            _attend(out, lse, q, kv, st, attn, scale, st.step == 0)
        o = out.to(q.dtype)
        res.append((o, lse) if return_lse else o)
    return res


def ring_attention(q, k, v, group=None, causal: bool = False, softmax_scale: float | None = None,
                   return_lse: bool = False, *, attn_fn=None, check_ranks: bool = True):
    """Attention of this rank's query shard over the whole sequence, whose K/V shards are spread over
    the ranks of `group` (None: the default group); every rank of the group calls it.

    q: (B, S_local, Hq, D), k: (B, S_local_kv, Hkv, D), v: (B, S_local_kv, Hkv, DV), the same shapes
    on every rank. On CUDA (fa4gen.attention locally): float16/bfloat16, (D, DV) any pair
    fa4gen.attention takes ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)), Hq a multiple of
    Hkv, one GPU per rank.
    On CPU (gloo): the `torch_attention` stand-in, also float32/float64. causal=True needs zigzag
    shards (`zigzag_shard`) of one sequence, S_local_kv == S_local even; the result is then exactly the
    causal attention of the full sequence (top-left = bottom-right aligned: Sq == Skv globally).
    softmax_scale defaults to 1/sqrt(D).

    Returns o (B, S_local, Hq, DV) in q's dtype, or with return_lse (o, lse), lse (B, Hq, S_local)
    float32 (float64 for float64 inputs), rows in the shard's order. `attn_fn` replaces the local
    attention (q, k, v, causal, softmax_scale) -> (o, lse); `check_ranks=False` skips the descriptor
    exchange (one small all_gather and a host sync; the ranks must then agree on their own).
    """
    return _ring(q, k, v, group, causal, softmax_scale, return_lse, attn_fn=attn_fn, check_ranks=check_ranks)


def _ring(q, k, v, group, causal, softmax_scale, return_lse, *, attn_fn=None, check_ranks=True,
          communicate=True, compute=True):
    """ring_attention; communicate=False / compute=False drop the transfers / the attention (the
    benchmark's compute-only and comm-only times; the result is then not the attention)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise InputTypeError("fa4gen.distributed.ring_attention needs torch (pip install torch)") from e
    g, rank, w = _group_info(dist, group)
    errors, desc = _local_checks(torch, q, k, v, causal, softmax_scale, return_lse, attn_fn is not None)
    if w > 1 and check_ranks:
        backend = str(dist.get_backend(g))
        if desc is not None and desc[-1] == 1:
            xdev = q.device
        elif "nccl" in backend and torch.cuda.is_available():
            xdev = torch.device("cuda", torch.cuda.current_device())
        else:
            xdev = torch.device("cpu")
        _exchange(torch, dist, g, errors, desc, xdev)
    else:
        validate.raise_all(errors)
    scale = validate.check_softmax_scale(softmax_scale, q.shape[-1])
    attn = attn_fn if attn_fn is not None else _default_attn(torch, q.device.type)
    cuda = q.device.type == "cuda"

    if w == 1 and compute:  # one rank: the local attention is the answer
        o, lse = attn(q, k, v, causal, scale)
        return (o, lse) if return_lse else o

    steps = ring_schedule(rank, w, q.shape[1], causal)
    acc = _acc_dtype(torch, q.dtype)
    b, sq, hq = q.shape[:3]
    out = torch.zeros((b, sq, hq, v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
    kv_cur = kv_message(torch, k, v)  # one message per step: k's elements, then v's, contiguous
    kv_next = torch.empty_like(kv_cur) if w > 1 else None
    shapes = (tuple(k.shape), tuple(v.shape))
    send_to = dist.get_global_rank(g, (rank + 1) % w)
    recv_from = dist.get_global_rank(g, (rank - 1) % w)
    side = _comm_stream(torch, q.device) if cuda else None
    first = True
    for st in steps:
        reqs = []
        if communicate and st.step < w - 1:
            if cuda:
                # kv_cur is complete (stack / last receive waited on), and kv_next (the previous step's
                # kv_cur) has been read by the previous step's attention: both are on the compute stream
                side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                ops = [dist.P2POp(dist.isend, kv_cur, send_to, g), dist.P2POp(dist.irecv, kv_next, recv_from, g)]
                reqs = dist.batch_isend_irecv(ops)
        if compute:
            _attend(out, lse, q, kv_views(kv_cur, *shapes), st, attn, scale, first)
            first = False
        for r in reqs:
            r.wait()  # CUDA: the current stream waits for the transfer (no host sync); gloo: blocks
        if reqs and cuda:
            torch.cuda.current_stream(q.device).wait_stream(side)
        if reqs:
            kv_cur, kv_next = kv_next, kv_cur
    o = out.to(q.dtype)
    return (o, lse) if return_lse else o
