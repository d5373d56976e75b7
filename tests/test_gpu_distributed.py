"""fa4gen.distributed on GPUs (marker `gpu`; conftest skips these without an sm_90 GPU).

- world size 1 (a one-process NCCL group): ring_attention is fa4gen.attention, bit for bit;
- the ring simulated on one GPU (`simulate_ring`: every rank's steps in turn with the real kernel,
  the same schedule, slices and fp32 merge) against fa4gen.attention on the full sequence and an
  fp32 torch reference, W = 2, 4, 8;
- several GPUs (skipped unless torch sees >= 2): W = device_count NCCL processes, each checks its
  zigzag shard of ring_attention against fa4gen.attention on the full sequence on its own GPU.

Tolerance: the kernel's O is within (2u + 4e-4) * P|V| + 2u |O| of the fp32 reference
(tests/test_gpu.py's derivation); the ring rounds each partial O to the input dtype before the
fp32 merge, one more u * P|V| at most, so ring vs reference gets (3u + 4e-4) * P|V| + 3u |O| and ring
vs single-GPU the sum of both bounds. LSE: the merge adds fp32 rounding only.
"""

import datetime
import math
import os
import tempfile
import traceback

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import fa4gen  # noqa: E402
from fa4gen import distributed as fd  # noqa: E402
from _ranks import run_ranks  # noqa: E402

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
EMU = 4e-4


def _inputs(b, s, hq, hkv, d, dtype, seed, device, dv=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda h, dd=d: torch.randn(b, s, h, dd, generator=g).to(dtype).to(device)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv, dv or d)


def _reference(q, k, v, causal):
    """fp32 (o, lse, P|V|) of the full problem, one head at a time (bounded memory)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    o = torch.empty((*q.shape[:3], v.shape[-1]), dtype=torch.float32, device=q.device)
    pv = torch.empty_like(o)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    mask = torch.ones(s, k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - s) if causal else None
    for h in range(hq):
        kh, vh = k[:, :, h // (hq // hkv)].float(), v[:, :, h // (hq // hkv)].float()
        sc = torch.einsum("bid,bjd->bij", q[:, :, h].float(), kh) / math.sqrt(d)
        if mask is not None:
            sc = sc.masked_fill(~mask, float("-inf"))
        lse[:, h] = torch.logsumexp(sc, -1)
        p = torch.softmax(sc, -1)
        o[:, :, h] = p @ vh
        pv[:, :, h] = p @ vh.abs()
    return o, lse, pv


def _check(label, o, lse, o_ref, lse_ref, pv, u, extra=1.0):
    bound = (3 * u + EMU) * pv + 3 * u * o_ref.abs() + 1e-6
    err = (o.float() - o_ref).abs()
    assert (err <= extra * bound).all(), f"{label}: O worst err/bound {(err / bound).max().item():.2f}"
    lerr = (lse - lse_ref).abs()
    assert (lerr <= extra * (u + 5e-4 + 1e-6 * lse_ref.abs())).all(), f"{label}: LSE max err {lerr.max().item():.3g}"


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_world_size_one_is_fa4gen_attention(one_rank_group, d, causal):
    q, k, v = _inputs(2, 1024, 8, 2, d, torch.bfloat16, 11 + d + causal, "cuda")
    with torch.no_grad():
        o, lse = fd.ring_attention(q, k, v, causal=causal, return_lse=True)
        ro, rlse = fa4gen.attention(q, k, v, causal=causal, return_lse=True)
        o2 = fd.ring_attention(q, k, v, causal=causal, softmax_scale=0.05)
        ro2 = fa4gen.attention(q, k, v, causal=causal, softmax_scale=0.05)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 8, 1024)
    assert torch.equal(o, ro) and torch.equal(lse, rlse) and torch.equal(o2, ro2)


@pytest.mark.gpu
def test_world_size_one_refuses_what_the_kernel_refuses(one_rank_group):
    q = torch.zeros(1, 64, 2, 80, dtype=torch.float32, device="cuda")  # no generated pair has head_dim 80
    with pytest.raises(fa4gen.runtime.validate.Fa4genInputError) as e:
        fd.ring_attention(q, q, q, causal=True)
    assert "float32" in str(e.value) and "head_dim 80" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("w,causal,d,hq,hkv,dtype,dv", [
    (2, True, 128, 8, 8, torch.bfloat16, None), (4, True, 64, 8, 2, torch.bfloat16, None),
    (8, True, 128, 4, 1, torch.float16, None), (2, False, 128, 8, 2, torch.bfloat16, None),
    (4, False, 64, 4, 4, torch.float16, None),
    (2, True, 192, 8, 2, torch.bfloat16, 128)])  # DeepSeek's (192, 128): k and v of other head dims in one message
def test_simulated_ring_with_the_kernel(w, causal, d, hq, hkv, dtype, dv):
    s = 4096
    q, k, v = _inputs(1, s, hq, hkv, d, dtype, 100 * w + d + hq + causal, "cuda", dv)
    shard = fd.zigzag_shard if causal else fd.contiguous_shard
    qs, ks, vs = ([shard(t, r, w) for r in range(w)] for t in (q, k, v))
    with torch.no_grad():
        res = fd.simulate_ring(qs, ks, vs, causal=causal, return_lse=True)
        single_o, single_lse = fa4gen.attention(q, k, v, causal=causal, return_lse=True)
    join = (lambda xs, dim: fd.zigzag_unshard(xs, dim)) if causal else (lambda xs, dim: torch.cat(xs, dim))
    o, lse = join([r[0] for r in res], 1), join([r[1] for r in res], 2)
    o_ref, lse_ref, pv = _reference(q, k, v, causal)
    _check("ring vs fp32 reference", o, lse, o_ref, lse_ref, pv, U[dtype])
    _check("single vs fp32 reference", single_o, single_lse, o_ref, lse_ref, pv, U[dtype])
    _check("ring vs single GPU", o, lse, single_o.float(), single_lse, pv, U[dtype], extra=2.0)


# ---- several GPUs (NCCL) -----------------------------------------------------------------------------------
MULTI_CASES = [  # (B, S, Hq, Hkv, D, causal, dtype)
    (1, 8192, 8, 8, 128, True, "bfloat16"), (2, 4096, 8, 2, 64, True, "float16"),
    (1, 8192, 4, 1, 128, False, "bfloat16"),
]


def _multi_worker(rank, world, init_file, out_dir):
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120), device_id=dev)
        lines = []
        with torch.no_grad():
            for i, (b, s, hq, hkv, d, causal, dt) in enumerate(MULTI_CASES):
                dtype = getattr(torch, dt)
                q, k, v = _inputs(b, s, hq, hkv, d, dtype, 7 + i, dev)  # same seed: the same full problem everywhere
                shard = fd.zigzag_shard if causal else fd.contiguous_shard
                qs, ks, vs = (shard(t, rank, world) for t in (q, k, v))
                o, lse = fd.ring_attention(qs, ks, vs, causal=causal, return_lse=True)
                so, slse = fa4gen.attention(q, k, v, causal=causal, return_lse=True)
                o_ref, lse_ref, pv = _reference(q, k, v, causal)
                sh = (lambda t, dim=1: shard(t, rank, world, dim=dim))
                _check(f"case {i} rank {rank} ring vs fp32", o, lse, sh(o_ref), sh(lse_ref, 2), sh(pv), U[dtype])
                _check(f"case {i} rank {rank} ring vs single", o, lse, sh(so).float(), sh(slse, 2), sh(pv), U[dtype],
                       extra=2.0)
                full = fd.gather_sequence(o, zigzag=causal)
                assert full.shape == q.shape
                lines.append(f"case {i} ok: max |ring - single| {(o.float() - sh(so).float()).abs().max().item():.3g}")
        dist.barrier()
        dist.destroy_process_group()
        with open(os.path.join(out_dir, f"rank{rank}.ok"), "w") as f:
            f.write("\n".join(lines))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.gpu
def test_ring_on_several_gpus_equals_one_gpu(tmp_path):
    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        pytest.skip(f"needs >= 2 GPUs, torch sees {world}")
    run_ranks(_multi_worker, world, tmp_path, timeout=300)
    print("\n".join((tmp_path / f"rank{r}.ok").read_text() for r in range(world)))
