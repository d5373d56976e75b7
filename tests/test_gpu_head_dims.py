"""The sm_90a (192, 128) kernels (q and k of 192 columns, v and o of 128: DeepSeek-V3 prefill), the
D = 96 ones (three 32-column panels of 64B swizzle per tile, O staged; the combine kernel's 96-column
rows on 24 lanes) and the D = 256 ones (64-key K/V blocks, O from the registers; pages of 16 to 256
keys against 64-key blocks; the combine kernel's 8 columns per lane) on an H100/H200 (marker `gpu`; skipped without one), against the float32 torch reference of test_gpu.py
(its tolerances, derived there): dense (causal or not, GQA 1 / 4 / a ratio that does not divide 128,
bf16 and fp16, the Kernel called directly with O and LSE poisoned with NaN, and fa4gen.attention equal
to it bit for bit), varlen (per-sequence reference, guarded outputs) and the KV cache (contiguous and
paged, one split and several: the combine kernel's DV-column rows). The (192, 128) and D = 256 kernels
store O from the registers through o_ptr (docs/HEAD_DIMS.md); the emulator runs them on the CPU
(tests/test_head_dims.py, `fa4gen emulate`).
"""

import math
import zlib

import pytest

torch = pytest.importorskip("torch")

from fa4gen.runtime import api  # noqa: E402

from test_gpu import case_id, check_against_reference, make_inputs, run_kernel_poisoned  # noqa: E402
from test_gpu_kvcache import check_kvcache, make_cache, run_poisoned  # noqa: E402
from test_gpu_varlen import _cu, _inputs, check_per_sequence, ragged_lengths, run_varlen_poisoned  # noqa: E402

PAIRS = [(192, 128), (96, 96), (256, 256)]  # (D, DV): q and k have D columns, v and o DV


def _tag(d: int, dv: int) -> str:
    return f"hd{d}"


# (dtype, causal, G, B, Hkv, Sq, Skv, x30): every dtype x causal x GQA {1, 4, 3}; tails on both lengths,
# Sq > Skv (causal rows that see no key), Sq = 1, long Skv, one block exactly
DENSE = [
    ("bf16", False, 1, 2, 2, 1000, 1000, False),
    ("bf16", True, 1, 2, 2, 1000, 1000, True),
    ("fp16", False, 1, 3, 1, 129, 127, True),
    ("fp16", True, 1, 1, 2, 4096, 1000, False),
    ("bf16", False, 4, 2, 2, 17, 4096, False),
    ("bf16", True, 4, 1, 2, 127, 8192, False),
    ("fp16", False, 4, 2, 1, 128, 128, False),
    ("fp16", True, 4, 2, 2, 1000, 17, True),
    ("bf16", True, 3, 2, 2, 300, 1000, False),  # a ratio that does not divide 128: one head per tile
    ("fp16", False, 3, 1, 2, 1, 8192, False),
]
DENSE_CASES = [dict(d=d, dv=dv, dtype=dt, causal=c, g=g, b=b, hkv=hkv, sq=sq, skv=skv, x30=x30, emu=None)
               for d, dv in PAIRS for dt, c, g, b, hkv, sq, skv, x30 in DENSE]


def test_dense_case_table_covers_what_it_claims():
    assert {(c["dtype"], c["causal"]) for c in DENSE_CASES} == {(d, c) for d in ("bf16", "fp16") for c in (False, True)}
    assert {c["g"] for c in DENSE_CASES} == {1, 3, 4}
    assert {(c["d"], c["dv"]) for c in DENSE_CASES} == set(PAIRS)
    assert any(c["causal"] and c["sq"] > c["skv"] for c in DENSE_CASES)
    assert any(c["sq"] % 128 and c["skv"] % 128 for c in DENSE_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("c", DENSE_CASES, ids=lambda c: f"{_tag(c['d'], c['dv'])}-{case_id(c)}")
def test_dense_head_dims_match_reference(c, exact_fp32):
    D, DV, scale = c["d"], c["dv"], 1.0 / math.sqrt(c["d"])
    label = f"{_tag(D, DV)}-" + case_id(c)
    q, k, v = make_inputs(c, label)
    assert q.shape[-1] == D and v.shape[-1] == DV
    with torch.no_grad():
        o, lse = run_kernel_poisoned(q, k, v, c["causal"], scale, c["dtype"])
        assert o.shape == (c["b"], c["sq"], c["g"] * c["hkv"], DV)
        check_against_reference(o, lse, q, k, v, c["causal"], scale, c["dtype"], label)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: _tag(*p))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_head_dims_equal_direct_kernel_bitwise(pair, causal, exact_fp32):
    D, DV = pair
    SCALE = 1.0 / math.sqrt(D)
    c = dict(d=D, dv=DV, dtype="bf16", causal=causal, g=4, b=2, hkv=2, sq=333, skv=1000, x30=False)
    q, k, v = make_inputs(c, f"{_tag(D, DV)}-api-{causal}")
    with torch.no_grad():
        o_direct, lse_direct = run_kernel_poisoned(q, k, v, causal, SCALE, "bf16")
        o, lse = api.attention(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
    assert o.shape == (2, 333, 8, DV) and torch.equal(o, o_direct) and torch.equal(lse, lse_direct)
    assert api.last_call_info().launched
    check_against_reference(o, lse, q, k, v, causal, SCALE, "bf16", f"api {_tag(D, DV)} causal={causal}")


# (B, dtype, causal, G, Hkv, k lengths differ from q lengths)
VARLEN = [(24, "bf16", False, 1, 2, False), (17, "bf16", True, 4, 2, True), (9, "fp16", True, 3, 2, True),
          (12, "fp16", False, 8, 1, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: _tag(*p))
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"B{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}-g{c[3]}"
                                                      f"-hkv{c[4]}{'-qk' if c[5] else ''}")
def test_varlen_head_dims_match_per_sequence_reference(pair, case, exact_fp32):
    D, DV = pair
    SCALE = 1.0 / math.sqrt(D)
    b, dtype, causal, g, hkv, differ = case
    lens_q = ragged_lengths(b, seed=b * 31 + D, long_max=3000)
    lens_k = ragged_lengths(b, seed=b * 17 + D + 1, long_max=3000) if differ else list(lens_q)
    if differ:  # sequences with keys but no queries, and queries but no keys
        lens_q[1], lens_k[1] = 0, 57
        lens_q[2], lens_k[2] = 33, 0
    label = f"{_tag(D, DV)}-varlen-{case}"
    q, k, v = _inputs(lens_q, lens_k, g * hkv, hkv, D, dtype, label, dv=DV)
    o, lse = run_varlen_poisoned(q, k, v, _cu(lens_q, "cuda"), _cu(lens_k, "cuda"), causal, SCALE, dtype)
    check_per_sequence(o, lse, q, k, v, lens_q, lens_k, lens_k, causal, SCALE, dtype, label)
    o2, lse2 = api.attention_varlen(q, k, v, _cu(lens_q, "cuda"), _cu(lens_k, "cuda"), max(lens_q), max(lens_k),
                                    causal=causal, return_lse=True)
    assert o2.shape == (sum(lens_q), g * hkv, DV)
    assert torch.equal(o2, o) and torch.equal(lse2, lse), f"{label}: attention_varlen != Kernel.varlen"


# (label, B, lens, Sq, Hkv, G, dtype, page_size, causal, num_splits)
KVCACHE = [
    ("decode-contig", 2, [4000, 129], 1, 2, 4, "bf16", 0, True, 0),
    ("decode-contig-1split", 2, [300, 17], 1, 2, 4, "fp16", 0, True, 1),
    ("decode-p64", 3, [1, 700, 2049], 1, 2, 8, "bf16", 64, True, 5),
    ("spec-sq4-p16", 3, [4, 100, 3000], 4, 2, 4, "fp16", 16, True, 0),
    ("chunk-sq16-noncausal-p256", 2, [16, 2000], 16, 1, 4, "bf16", 256, False, 3),
    ("sq3-g1-contig-noncausal", 2, [1, 3000], 3, 2, 1, "bf16", 0, False, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: _tag(*p))
@pytest.mark.parametrize("case", KVCACHE, ids=[c[0] for c in KVCACHE])
def test_kvcache_head_dims_match_reference(pair, case, exact_fp32):
    D, DV = pair
    SCALE = 1.0 / math.sqrt(D)
    label, b, lens, sq, hkv, g, dtype, ps, causal, ns = case
    seed = zlib.crc32(label.encode())
    q, kc, vc, sl, pt, ks, vs = make_cache(b, lens, sq, hkv, g, D, dtype, ps, seed, dv=DV)
    o, lse, S = run_poisoned(q, kc, vc, sl, pt, causal, ns, dtype, SCALE)
    assert o.shape == (b, sq, g * hkv, DV)
    check_kvcache(o, lse, q, ks, vs, causal, SCALE, dtype, f"{_tag(D, DV)} {label} (S={S})")
    o2, lse2 = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, causal=causal, num_splits=ns or 0,
                                          return_lse=True)
    assert torch.equal(o2, o) and torch.equal(lse2, lse), f"{label}: attention_with_kvcache != Kernel.kvcache"
