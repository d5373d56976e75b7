"""fa4gen.attention_with_kvcache on an H100/H200 (marker `gpu`; skipped without one): the sm_90a KV-cache
kernels (contiguous and paged caches, split-KV + the generated combine kernel) against a float32
reference that gathers each sequence's pages, guard regions around O and LSE, device-side lengths and
page entries the host cannot check (the kernel clamps), and the host-side input errors.

Tolerances are test_gpu.py's (check_against_reference), applied per sequence to the gathered keys."""

import zlib

import pytest

torch = pytest.importorskip("torch")

from fa4gen.runtime import api  # noqa: E402
from fa4gen.spec.config import KernelConfig  # noqa: E402
from fa4gen.runtime.validate import DeviceError, Fa4genInputError, InputTypeError, InputValueError  # noqa: E402

from test_gpu import TORCH_DTYPE, check_against_reference  # noqa: E402
from test_gpu_varlen import assert_guards, guarded  # noqa: E402

pytestmark = pytest.mark.gpu


def make_cache(b, lens, sq, hkv, g, d, dtype, page_size, seed, extra_pages=3, max_pages=None, dv=None):
    """q, k_cache, v_cache (dv columns, default d), cache_seqlens, page_table (None if contiguous) and the
    per-sequence gathered (k, v): pages of a paged cache are a random permutation with unused pages
    between them."""
    dv = d if dv is None else dv
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DTYPE[dtype]
    hq = hkv * g

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)

    q = rnd(b, sq, hq, d)
    cap_keys = max(max(lens), 1)
    if page_size:
        need = [-(-n // page_size) for n in lens]
        mp = max_pages or max(max(need), 1)
        num_pages = sum(need) + extra_pages
        k_cache, v_cache = rnd(num_pages, page_size, hkv, d), rnd(num_pages, page_size, hkv, dv)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        table = torch.full((b, mp), -7, dtype=torch.int32)  # unused entries: garbage the kernel must not need
        it = iter(perm)
        for i, n in enumerate(need):
            for j in range(n):
                table[i, j] = next(it)
        page_table = table.cuda()
        ks, vs = [], []
        for i, n in enumerate(lens):
            pages = table[i, :need[i]].tolist()
            ks.append(k_cache[pages].reshape(-1, hkv, d)[:n] if n else k_cache[:0, 0])
            vs.append(v_cache[pages].reshape(-1, hkv, dv)[:n] if n else v_cache[:0, 0])
    else:
        k_cache, v_cache = rnd(b, cap_keys, hkv, d), rnd(b, cap_keys, hkv, dv)
        page_table = None
        ks = [k_cache[i, :n] for i, n in enumerate(lens)]
        vs = [v_cache[i, :n] for i, n in enumerate(lens)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, seqlens, page_table, ks, vs


def check_kvcache(o, lse, q, ks, vs, causal, scale, dtype, label):
    for i, (k, v) in enumerate(zip(ks, vs)):
        if k.shape[0] == 0:
            assert (o[i] == 0).all(), f"{label}: sequence {i} has no keys: O must be 0"
            assert (lse[i] == float("-inf")).all(), f"{label}: sequence {i} has no keys: LSE must be -inf"
            continue
        check_against_reference(o[i:i + 1], lse[i:i + 1], q[i:i + 1], k[None], v[None], causal, scale, dtype,
                                f"{label} seq {i} (k_len {k.shape[0]})")


def run_poisoned(q, k_cache, v_cache, seqlens, page_table, causal, num_splits, dtype, scale):
    """The kernel's own launch path with NaN-poisoned, guarded O and LSE."""
    b, sq, hq, d = q.shape
    dv = v_cache.shape[-1]  # o's and the partials' columns (head_dim_v)
    cfg = KernelConfig(arch="sm_90a", head_dim=d, head_dim_v=dv, causal=causal, gqa_ratio=hq // k_cache.shape[2],
                       dtype=dtype, kvcache=True, page_size=0 if page_table is None else k_cache.shape[1])
    kernel, _ = api.get_kernel(cfg, q.device)
    cap = k_cache.shape[1] if page_table is None else page_table.shape[1] * k_cache.shape[1]
    S = num_splits or kernel.kvcache_num_splits(b, k_cache.shape[2], sq, cap)
    o, obuf = guarded((b, sq, hq, dv), q.dtype, q.device)
    lse, lbuf = guarded((b, hq, sq), torch.float32, q.device)
    rows = b * sq * hq
    op = lp = None
    if S > 1:
        op, opb = guarded((S, rows, dv), torch.float32, q.device)
        lp, lpb = guarded((S, rows), torch.float32, q.device)
    kernel.kvcache(q, k_cache, v_cache, o, seqlens, page_table, num_splits=S, lse=lse, softmax_scale=scale,
                   o_partial=op, lse_partial=lp)
    torch.cuda.synchronize()
    assert_guards(obuf, "O")
    assert_guards(lbuf, "LSE")
    if S > 1:
        assert_guards(opb, "o_partial")
        assert_guards(lpb, "lse_partial")
    return o, lse, S


CASES = [
    # (label, B, lens, Sq, Hkv, G, D, dtype, page_size, causal, num_splits)
    ("decode-contig", 1, [4000], 1, 8, 4, 128, "bf16", 0, True, 0),
    ("decode-contig-1split", 2, [300, 129], 1, 2, 4, 128, "fp16", 0, True, 1),
    ("decode-contig-large-splits", 2, [5000, 17], 1, 2, 8, 64, "bf16", 0, True, 64),
    ("decode-p16", 3, [1, 700, 2049], 1, 2, 4, 128, "bf16", 16, True, 0),
    ("decode-p64-mqa", 4, [64, 65, 1000, 3], 1, 1, 8, 64, "fp16", 64, True, 5),
    ("decode-p256", 2, [40000, 255], 1, 2, 4, 128, "bf16", 256, True, 0),
    ("decode-p32-g1", 3, [33, 500, 96], 1, 4, 1, 128, "bf16", 32, True, 3),
    ("decode-p128", 2, [128, 1200], 1, 2, 4, 64, "bf16", 128, True, 1),
    ("spec-sq4-p16", 4, [4, 100, 3000, 2], 4, 2, 4, 128, "bf16", 16, True, 0),
    ("chunk-sq16-contig", 2, [16, 2000], 16, 2, 8, 128, "fp16", 0, True, 0),
    ("chunk-sq16-noncausal-p64", 2, [1, 777], 16, 2, 4, 64, "bf16", 64, False, 7),
    ("sq3-g1-causal-short", 3, [1, 2, 3000], 3, 2, 1, 64, "fp16", 0, True, 2),
    ("batch64-p16", 64, None, 1, 2, 4, 128, "bf16", 16, True, 0),
    ("batch64-contig-noncausal", 64, None, 2, 1, 8, 128, "fp16", 0, False, 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvcache_against_reference(case, exact_fp32):
    label, b, lens, sq, hkv, g, d, dtype, ps, causal, ns = case
    seed = zlib.crc32(label.encode())
    if lens is None:
        gl = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, 3000, (b,), generator=gl).tolist()
        lens[5] = 1
        lens[9] = 2048
    q, kc, vc, sl, pt, ks, vs = make_cache(b, lens, sq, hkv, g, d, dtype, ps, seed)
    scale = d ** -0.5
    o, lse, S = run_poisoned(q, kc, vc, sl, pt, causal, ns, dtype, scale)
    check_kvcache(o, lse, q, ks, vs, causal, scale, dtype, f"{label} (S={S})")
    # the public API on the same inputs gives the same result
    o2, lse2 = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, causal=causal, num_splits=ns or 0,
                                          return_lse=True)
    assert torch.equal(o2, o) and torch.equal(lse2, lse), f"{label}: attention_with_kvcache != Kernel.kvcache"


def test_kvcache_splits_agree(exact_fp32):
    """num_splits 1, 2, 13 and auto give results within rounding of each other and of the reference."""
    lens = [9000, 130]
    q, kc, vc, sl, pt, ks, vs = make_cache(2, lens, 1, 2, 4, 128, "bf16", 64, 11)
    outs = {}
    for ns in (1, 2, 13, 0):
        o, lse = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, num_splits=ns, return_lse=True)
        check_kvcache(o, lse, q, ks, vs, True, 128 ** -0.5, "bf16", f"splits={ns}")
        outs[ns] = o
    assert (outs[1].float() - outs[13].float()).abs().max().item() < 0.02


def test_kvcache_device_values_clamped():
    """Lengths beyond the cache and page entries out of range on the device: no fault, no stray write;
    rows read only clamped pages (the result is some attention over in-cache keys, finite)."""
    q, kc, vc, sl, pt, ks, vs = make_cache(3, [100, 200, 300], 1, 2, 4, 128, "bf16", 16, 5, max_pages=20)
    bad_lens = torch.tensor([10 ** 9, -5, 300], dtype=torch.int32, device="cuda")
    bad_table = pt.clone()
    bad_table[0, :] = 10 ** 8
    bad_table[2, 3] = -1
    o, lse, _ = run_poisoned(q, kc, vc, bad_lens, bad_table, True, 3, "bf16", 128 ** -0.5)
    assert torch.isfinite(o[0]).all() and torch.isfinite(o[2]).all()
    assert (o[1] == 0).all() and (lse[1] == float("-inf")).all(), "a negative length means no keys"
    # contiguous: a length past Smax reads Smax keys
    q, kc, vc, sl, pt, ks, vs = make_cache(2, [50, 70], 1, 2, 4, 64, "fp16", 0, 6)
    o, lse, _ = run_poisoned(q, kc, vc, torch.tensor([10 ** 6, 70], dtype=torch.int32, device="cuda"), None, True, 2,
                             "fp16", 0.125)
    full = [kc[0], kc[1, :70]], [vc[0], vc[1, :70]]
    check_kvcache(o, lse, q, full[0], full[1], True, 0.125, "fp16", "clamped length")


def test_kvcache_host_index_checked():
    """CPU cache_seqlens / page_table: values checked on the host with a clear error, else copied."""
    q, kc, vc, sl, pt, ks, vs = make_cache(2, [100, 40], 1, 2, 4, 128, "bf16", 16, 7)
    with pytest.raises(InputValueError, match=r"cache_seqlens\[0\] = 5000"):
        api.attention_with_kvcache(q, kc, vc, torch.tensor([5000, 40], dtype=torch.int32), page_table=pt.cpu())
    bad = pt.cpu().clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(InputValueError, match=r"page_table\[1, 0\]"):
        api.attention_with_kvcache(q, kc, vc, sl.cpu(), page_table=bad)
    o_cpu = api.attention_with_kvcache(q, kc, vc, sl.cpu(), page_table=pt.cpu(), num_splits=2)
    o_dev = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, num_splits=2)
    assert torch.equal(o_cpu, o_dev)


def test_kvcache_input_errors():
    q, kc, vc, sl, pt, ks, vs = make_cache(2, [100, 40], 1, 2, 4, 128, "bf16", 16, 8)
    with pytest.raises(InputTypeError, match="cache_seqlens must have dtype int32"):
        api.attention_with_kvcache(q, kc, vc, sl.long(), page_table=pt)
    with pytest.raises(InputValueError, match="page size 48"):
        odd = torch.zeros(kc.shape[0], 48, *kc.shape[2:], dtype=kc.dtype, device=kc.device)
        api.attention_with_kvcache(q, odd, odd, sl, page_table=pt)
    with pytest.raises(InputValueError, match="num_splits"):
        api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, num_splits=10_000)
    with pytest.raises(InputValueError, match="contiguous cache has one row per sequence"):
        api.attention_with_kvcache(q, kc[:3], vc[:3], sl)
    with pytest.raises(Fa4genInputError):
        api.attention_with_kvcache(q, kc, vc, sl[:1], page_table=pt)
    if torch.cuda.device_count() > 1:
        with pytest.raises(DeviceError):
            api.attention_with_kvcache(q, kc, vc, sl.to("cuda:1"), page_table=pt)


def test_kvcache_prebuilt_equals_attention_with_kvcache(tmp_path):
    """`fa4gen build --kvcache --page-size 16` then fa4gen.load: PrebuiltKernel.kvcache gives the API's bits,
    refuses a cache of another layout and a dense call."""
    from click.testing import CliRunner

    import fa4gen
    from fa4gen.cli import main

    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--kvcache", "--page-size", "16", "--causal", "--gqa",
                                  "4", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    kernel = fa4gen.load(tmp_path / "fa4_sm90a_d128_bf16_causal_gqa4_kvcache_p16.cubin")
    q, kc, vc, sl, pt, ks, vs = make_cache(3, [1, 900, 2000], 1, 2, 4, 128, "bf16", 16, 21)
    o1, l1 = kernel.kvcache(q, kc, vc, sl, page_table=pt, return_lse=True)
    o2, l2 = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    with pytest.raises(InputValueError, match="page size 16"):
        kernel.kvcache(q, kc[:3].contiguous(), vc[:3].contiguous(), sl)  # a contiguous cache of 16 keys
    with pytest.raises(InputValueError, match="KV-cache kernel"):
        kernel(q, kc, vc)
