"""The eager API's per-signature fast path (fa4gen.runtime.launch: a signature that launched before with
every input read in place reuses its launch: no validation, the kernel's Bounds, per-call pointers) on
an H100/H200 (marker `gpu`; skipped without one). Each entry point is called on fresh tensors of one
signature (new pointers, new data, new lengths); every fast call must equal the slow path's result on
the same inputs bit for bit and the float32 reference within test_gpu's tolerances."""

import pytest

torch = pytest.importorskip("torch")

from fa4gen.assemble.cache import KERNELS  # noqa: E402
from fa4gen.runtime import api, launch  # noqa: E402

from test_gpu import check_against_reference  # noqa: E402
from test_gpu_kvcache import check_kvcache, make_cache  # noqa: E402

pytestmark = pytest.mark.gpu


def _rnd(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _slow(fn):
    """fn() with the fast path forgotten: the call validates and binds again."""
    launch._fasts._d.clear()
    return fn()


@pytest.fixture
def validations(monkeypatch):
    """How many calls went through validation (launch.prepared)."""
    seen = []
    real = launch.prepared

    def counting(*a, **kw):
        seen.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(launch, "prepared", counting)
    launch._fasts._d.clear()
    return seen


@pytest.mark.parametrize("mods", [{}, {"window_size": (64, 0), "softcap": 30.0, "sinks": True}])
@pytest.mark.parametrize("return_lse", [False, True])
def test_dense_fast_calls(validations, exact_fp32, return_lse, mods):
    gen = torch.Generator(device="cuda").manual_seed(1)
    kw = {k: v for k, v in mods.items() if k != "sinks"}
    for i in range(3):
        q, k, v = _rnd(gen, 2, 200, 8, 128), _rnd(gen, 2, 333, 2, 128), _rnd(gen, 2, 333, 2, 128)
        if mods.get("sinks"):
            kw["learnable_sink"] = torch.randn(8, generator=gen, device="cuda")
        out = api.attention(q, k, v, causal=True, return_lse=return_lse, **kw)
        ref = _slow(lambda: api.attention(q, k, v, causal=True, return_lse=return_lse, **kw))
        for a, b in zip(out if return_lse else (out,), ref if return_lse else (ref,)):
            assert torch.equal(a, b), f"call {i}: the fast path differs from the slow path"
        if not mods:
            o, lse = (out if return_lse else (out, None))
            check_against_reference(o, lse, q, k, v, True, 128 ** -0.5, "bf16", f"fast call {i}")
    # first call and each _slow validated; the fast calls did not
    assert len(validations) == 1 + 3, validations


def test_varlen_fast_calls_read_each_calls_offsets(validations, exact_fp32):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for i, lens in enumerate(([100, 28, 64, 36], [1, 200, 0, 27], [57, 57, 57, 57])):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = _rnd(gen, 228, 8, 64), _rnd(gen, 228, 2, 64), _rnd(gen, 228, 2, 64)
        o, lse = api.attention_varlen(q, k, v, cu, cu, 228, 228, causal=True, return_lse=True)
        o2, lse2 = _slow(lambda: api.attention_varlen(q, k, v, cu, cu, 228, 228, causal=True, return_lse=True))
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"call {i}"
        start = 0
        for n in lens:
            if n:
                sl = slice(start, start + n)
                check_against_reference(o[None, sl], lse[None, :, sl], q[None, sl], k[None, sl], v[None, sl], True,
                                        64 ** -0.5, "bf16", f"call {i} seq at {start}")
            start += n
    assert len(validations) == 1 + 3


@pytest.mark.parametrize("page_size, num_splits", [(0, 0), (64, 0), (16, 1)])
def test_kvcache_fast_calls(validations, exact_fp32, page_size, num_splits):
    """Split decode (one fp32 buffer for every split's O and LSE) and unsplit, contiguous and paged:
    each call with new caches and new device-side lengths."""
    for i, lens in enumerate(([3000, 17], [1, 4000], [2222, 2222])):
        # one signature: the same page pool and table sizes on every call
        extra = 300 - sum(-(-n // page_size) for n in lens) if page_size else 3
        q, kc, vc, sl, pt, ks, vs = make_cache(2, lens, 1, 2, 4, 128, "bf16", page_size, 40 + i, extra_pages=extra,
                                               max_pages=-(-4000 // page_size) if page_size else None)
        if not page_size:  # one capacity for every call: the same signature
            kc, vc = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 4000 - t.shape[1])) for t in (kc, vc))
        o, lse = api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, num_splits=num_splits, return_lse=True)
        o2, lse2 = _slow(lambda: api.attention_with_kvcache(q, kc, vc, sl, page_table=pt, num_splits=num_splits,
                                                            return_lse=True))
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"call {i}"
        check_kvcache(o, lse, q, ks, vs, True, 128 ** -0.5, "bf16", f"call {i}")
    assert len(validations) == 1 + 3


def test_relayout_calls_and_unloaded_kernels_take_the_slow_path(validations):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = _rnd(gen, 1, 128, 4, 64), _rnd(gen, 1, 128, 4, 64), _rnd(gen, 1, 128, 4, 64)
    buf = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    bad = buf[4:4 + q.numel()].view(q.shape)  # 8 bytes past an aligned base: TMA needs a copy
    bad.copy_(q)
    ref = api.attention(q, k, v)
    for _ in range(2):
        assert torch.equal(api.attention(bad, k, v), ref)
        assert api.last_call_info().copied == ("q",)
    assert len(validations) == 1 + 2  # the copying signature is validated (memo hit) every call, never fast
    api.attention(q, k, v)
    assert len(validations) == 3  # fast
    KERNELS.clear()  # the fast path holds the kernel's Bounds only while it stays loaded
    assert torch.equal(api.attention(q, k, v), ref)
    assert len(validations) == 4 and api.last_call_info().kernel.source in ("disk", "bundle", "built")


def test_prebuilt_kernels_repeat_their_launch(tmp_path):
    """fa4gen.load's kernels keep a fast path of their own: repeats with fresh tensors give the API's
    bits, and a repeat under grad mode with an input that requires grad is still refused."""
    from click.testing import CliRunner

    import fa4gen
    from fa4gen.cli import main
    from fa4gen.runtime.validate import InputValueError

    for extra in ([], ["--kvcache"]):
        r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--causal", "--gqa", "4", "--out", str(tmp_path),
                                      *extra])
        assert r.exit_code == 0, r.output
    dense = fa4gen.load(tmp_path / "fa4_sm90a_d128_bf16_causal_gqa4.cubin")
    decode = fa4gen.load(tmp_path / "fa4_sm90a_d128_bf16_causal_gqa4_kvcache.cubin")
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for i in range(3):
            q, k, v = _rnd(gen, 1, 300, 8, 128), _rnd(gen, 1, 300, 2, 128), _rnd(gen, 1, 300, 2, 128)
            o, lse = dense(q, k, v, return_lse=True)
            o2, lse2 = api.attention(q, k, v, causal=True, return_lse=True)
            assert torch.equal(o, o2) and torch.equal(lse, lse2), f"dense call {i}"
            qd, kc, vc, sl, pt, ks, vs = make_cache(2, [3000 - 1000 * i, 5 + i], 1, 2, 4, 128, "bf16", 0, 60)
            kc, vc = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 3000 - t.shape[1])) for t in (kc, vc))
            o, lse = decode.kvcache(qd, kc, vc, sl, return_lse=True)
            o2, lse2 = api.attention_with_kvcache(qd, kc, vc, sl, return_lse=True)
            assert torch.equal(o, o2) and torch.equal(lse, lse2), f"decode call {i}"
    assert len(dense._fasts._d) == 1 and len(decode._fasts._d) == 1
    q.requires_grad_(True)
    with pytest.raises(InputValueError, match="forward-only"):
        dense(q, k, v, return_lse=True)
