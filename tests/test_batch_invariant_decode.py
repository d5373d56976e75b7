"""Batch-invariant decode: with a fixed split count a sequence's O and LSE are the same bits whatever
else is in the batch (attention_with_kvcache(batch_invariant=True), spec/schedule.py
BATCH_INVARIANT_SPLITS).

CPU: the emulator runs the real sm_90a PTX (fa4_fwd and fa4_combine) on one sequence alone and on the
same sequence beside others in a larger cache: its rows are bitwise equal with the same split count,
and differ when the split count differs (so the comparison can see a batch-dependent choice). The
host resolves batch_invariant to the fixed count. GPU (marker `gpu`): the same sequence in batches of
1, 7 and 64 through the API: identical bits.
"""
import functools

import numpy as np
import pytest

from fa4gen.evidence.ptxemu.kvcache import KvShape, make_kv_inputs, run_kvcache_once
from fa4gen.evidence.ptxemu.parse import parse_for_manifest
from fa4gen.render.kernels import build_sm90
from fa4gen.runtime import validate
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.schedule import BATCH_INVARIANT_SPLITS


@functools.lru_cache(maxsize=None)
def _kernel():
    ptx, man = build_sm90(KernelConfig(arch="sm_90a", head_dim=64, kvcache=True, causal=True, gqa_ratio=8))
    return parse_for_manifest(ptx, man), man


def _run(lens, capacity, splits):
    mods, man = _kernel()
    shape = KvShape(tuple(lens), 4, 8, 1, num_splits=splits, capacity=capacity)  # 4 queries x 8 heads: 2048 values
    inp = make_kv_inputs(shape, "bf16", 64, 0, seed=3)  # sequence 0's q, k, v depend on its length and index only
    res = run_kvcache_once(mods, man, shape, 3, inputs=inp)
    assert res.ok, res.report
    return res.o[0], res.lse[0]


def test_a_sequence_is_the_same_bits_in_any_batch_with_a_fixed_split_count():
    alone = _run((700,), 700, 4)
    beside = _run((700, 1500, 90), 1536, 4)  # other sequences, a larger cache: more blocks per split elsewhere
    assert np.array_equal(alone[0], beside[0]) and np.array_equal(alone[1], beside[1])
    other = _run((700,), 700, 2)  # 6 blocks as 3 + 3, not 2 + 2 + 2: a batch-chosen count changes the bits
    assert (other[0] != alone[0]).sum() > 100 and (other[1] != alone[1]).any()


def _meta(name, shape, dtype="bfloat16"):
    strides = tuple(int(x) for x in np.cumprod((1,) + tuple(shape[::-1])[:-1])[::-1])
    return validate.TensorMeta(name=name, shape=tuple(shape), strides=strides, dtype=dtype, device="cuda:0",
                               data_ptr=1 << 20, element_size=4 if dtype in ("int32", "float32") else 2)


@pytest.mark.parametrize("num_splits,invariant,want", [(0, False, 0), (0, True, BATCH_INVARIANT_SPLITS),
                                                       (5, True, 5), (1, True, 1)])
def test_the_host_resolves_batch_invariant_to_a_fixed_count(num_splits, invariant, want):
    for b, cap in ((1, 4096), (64, 131072)):  # neither the batch nor the capacity enters the count
        p = validate.check_kvcache_problem(_meta("q", (b, 1, 32, 128)), _meta("k", (b, cap, 8, 128)),
                                           _meta("v", (b, cap, 8, 128)), _meta("cache_seqlens", (b,), "int32"),
                                           num_splits=num_splits, batch_invariant=invariant)
        assert p.num_splits == want


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(validate.InputTypeError, match="batch_invariant must be True or False, got int"):
        validate.check_kvcache_problem(_meta("q", (1, 1, 32, 128)), _meta("k", (1, 64, 8, 128)),
                                       _meta("v", (1, 64, 8, 128)), _meta("cache_seqlens", (1,), "int32"),
                                       batch_invariant=1)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 64])
def test_same_sequence_in_batches_of_1_7_64_is_bitwise_identical(page_size):
    import torch

    import fa4gen

    gen = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, length, cap = 32, 8, 128, 20000, 32768
    seq_k = torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq_v = torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq_q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    outs = []
    for b in (1, 7, 64):
        lens = torch.randint(1, cap + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
        lens[b // 2] = length
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q[b // 2] = seq_q
        kc = torch.randn(b, cap, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(b, cap, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc[b // 2, :length], vc[b // 2, :length] = seq_k, seq_v
        pt = None
        if page_size:
            pages = cap // page_size
            perm = torch.randperm(b * pages, device="cuda", generator=gen)
            pt = perm.to(torch.int32).reshape(b, pages)
            kp = torch.empty(b * pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
            vp = torch.empty_like(kp)
            kp[perm] = kc.reshape(b * pages, page_size, hkv, d)
            vp[perm] = vc.reshape(b * pages, page_size, hkv, d)
            kc, vc = kp, vp
        o, lse = fa4gen.attention_with_kvcache(q, kc, vc, lens, pt, return_lse=True, batch_invariant=True)
        outs.append((o[b // 2].clone(), lse[b // 2].clone()))
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])
