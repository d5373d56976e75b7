"""Sliding windows, logit softcap and attention sinks on an H100/H200 (marker `gpu`; skipped without
one), through the public API (fa4gen.attention, attention_varlen, attention_with_kvcache and under
torch.compile), against a float32 torch reference written here with plain torch: the window's mask
(bottom-right aligned, per sequence, to the cache end for decode), softcap * tanh(s / softcap), the
sink in the softmax denominator and the LSE.

Tolerances: test_gpu.py's elementwise bound (its module docstring derives it: P and O rounding,
exp2 emulation, fp16 subnormals), with the probabilities p normalised by the denominator that
includes the sink, plus the softcap's tanh.approx.f32: its relative error <= 2^-11 (the PTX ISA's
bound, reference.TANH_APPROX_MAX_REL_ERR) moves a capped score c = softcap * t by at most |c| 2^-11,
so each p_j of a row by a factor within e^(+-2 delta), delta = 2^-11 * max_j |c_j| over the row's
visible keys: O may move by (e^(2 delta) - 1) * P @ |V| more and the LSE by delta more. A row that
sees no key has O = 0 exactly and LSE = its sink (-inf without one; the sink to 1e-6 relative, the
kernel's log2 / ln2 round trip).
"""

import math
import zlib

import pytest

torch = pytest.importorskip("torch")

import fa4gen  # noqa: E402
from fa4gen.runtime import api  # noqa: E402
from fa4gen.evidence.reference import TANH_APPROX_MAX_REL_ERR  # noqa: E402
from test_gpu import EMU_AND_LOGITS, SUBNORMAL_HALF_SPACING, TORCH_DTYPE, UNIT_ROUNDOFF  # noqa: E402
from test_gpu_kvcache import make_cache  # noqa: E402
from test_gpu_varlen import _cu, ragged_lengths  # noqa: E402

pytestmark = pytest.mark.gpu


# ---- reference ---------------------------------------------------------------------------------
def reference(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, sink=None):
    """float32 attention with the score modifiers. q (B, Sq, Hq, D), k/v (B, Skv, Hkv, D), GQA by
    repeat_interleave. Key j visible to query i iff (left < 0 or j >= i + Skv - Sq - left) and
    (j <= i + Skv - Sq + right) where right = 0 with causal, no bound when right < 0 and not causal.
    Returns o (B, Sq, Hq, D), lse (B, Hq, Sq) (the sink's for a row with no key, -inf without one),
    P @ |V| (p normalised with the sink) and the softcap's per-row delta (B, Hq, Sq, 1)."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(skv, device=q.device)[None, :]
    diag = i + (skv - sq)
    left, right = window
    if causal:
        right = 0
    hidden = torch.zeros(sq, skv, dtype=torch.bool, device=q.device)
    if left >= 0:
        hidden |= j < diag - left
    if right >= 0:
        hidden |= j > diag + right
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    delta = 0.0
    if softcap > 0:
        delta = TANH_APPROX_MAX_REL_ERR * (s.abs().masked_fill(hidden, 0).amax(dim=-1, keepdim=True) if skv
                                           else s.new_zeros((b, hq, sq, 1)))
    if sink is not None:
        lse = torch.logaddexp(lse, sink.float()[None, :, None].expand_as(lse))
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
    o = torch.matmul(p, vf)
    pv_abs = torch.matmul(p, vf.abs())
    return o.transpose(1, 2), lse, pv_abs.transpose(1, 2), delta


def check(o, lse, q, k, v, causal, scale, dtype, label, window=(-1, -1), softcap=0.0, sink=None):
    o_ref, lse_ref, pv_abs, delta = reference(q, k, v, causal, scale, window, softcap, sink)
    nan_o = torch.isnan(o).sum().item()
    assert nan_o == 0, f"{label}: {nan_o} of {o.numel()} O elements are NaN"
    u, g = UNIT_ROUNDOFF[dtype], q.shape[2] // k.shape[2]
    vsum = v.float().abs().sum(dim=1).repeat_interleave(g, dim=1)[:, None]
    cap = (torch.exp(2 * delta) - 1).transpose(1, 2) if softcap > 0 else 0.0  # (B, Sq, Hq, 1)
    tol = (2 * u + EMU_AND_LOGITS + cap) * pv_abs + 2 * u * o_ref.abs() + SUBNORMAL_HALF_SPACING[dtype] * vsum + 1e-6
    err = (o.float() - o_ref).abs()
    bad = err > tol
    if bad.any():
        where = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"{label}: {int(bad.sum())} of {o.numel()} O elements outside the bound (worst err/tol "
                             f"{(err / tol).max().item():.2f}); first at {where}: got {o[where].item():.6g}, ref "
                             f"{o_ref[where].item():.6g}")
    # rows that see no key: O = 0 exactly, LSE = the sink (or -inf)
    i = torch.arange(q.shape[1], device=q.device)[:, None]
    j = torch.arange(k.shape[1], device=q.device)[None, :]
    diag = i + k.shape[1] - q.shape[1]
    left, right = window[0], 0 if causal else window[1]
    seen = torch.ones_like(diag + j, dtype=torch.bool)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    empty = ~seen.any(dim=-1)  # (Sq,)
    if empty.any():
        assert (o[:, empty] == 0).all(), f"{label}: rows that see no key must have O == 0 exactly"
        want = (sink.float()[None, :, None] if sink is not None else torch.tensor(float("-inf"), device=q.device))
        got = lse[:, :, empty]
        want = want.expand(lse.shape)[:, :, empty]
        fin = torch.isfinite(want)
        assert (got[~fin] == want[~fin]).all(), f"{label}: a keyless row without a finite sink must have LSE -inf"
        assert torch.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6), f"{label}: a keyless row's LSE is its sink"
    lse_s, ref_s = lse[:, :, ~empty], lse_ref[:, :, ~empty]
    assert not torch.isnan(lse_s).any(), f"{label}: NaN LSE"
    cap_l = delta[:, :, ~empty, 0] if softcap > 0 else 0.0
    lse_tol = u + 5e-4 + 1e-6 * ref_s.abs() + cap_l
    lse_err = (lse_s - ref_s).abs()
    assert (lse_err <= lse_tol).all(), f"{label}: LSE off by up to {lse_err.max().item():.3g}"


def inputs(b, sq, skv, hkv, g, d, dtype, label):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(label.encode()))
    dt = TORCH_DTYPE[dtype]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    return rnd(b, sq, hkv * g, d).to(dt), rnd(b, skv, hkv, d).to(dt), rnd(b, skv, hkv, d).to(dt)


def sinks(hq, label, kinds="mixed"):
    """float32 (Hq,): N(0, 2) logits, and with kinds="mixed" one that dominates (+12) and one -inf."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(("sink" + label).encode()))
    z = torch.randn(hq, generator=gen, device="cuda", dtype=torch.float32) * 2
    if kinds == "mixed" and hq >= 3:
        z[1], z[2] = 12.0, float("-inf")
    return z


# ---- dense -------------------------------------------------------------------------------------
# (label, b, sq, skv, hkv, g, d, dtype, causal, window, softcap, sink)
DENSE = [
    ("gpt-oss sliding layer", 1, 1000, 1000, 8, 8, 64, "bf16", True, (127, 0), 0.0, True),
    ("gpt-oss full layer", 1, 1000, 1000, 8, 8, 64, "bf16", True, (-1, -1), 0.0, True),
    ("gpt-oss sliding, prefill after a prefix", 1, 300, 1300, 8, 8, 64, "bf16", True, (127, 0), 0.0, True),
    ("mistral window 4096", 1, 5000, 5000, 8, 4, 128, "bf16", True, (4095, 0), 0.0, False),
    ("mistral window 4096 fp16", 2, 700, 4500, 8, 4, 128, "fp16", True, (4095, 0), 0.0, False),
    ("gemma-2 softcap 50 (D 128)", 2, 1000, 1000, 4, 2, 128, "bf16", True, (-1, -1), 50.0, False),
    ("gemma-2 local softcap 30", 1, 2000, 2000, 4, 2, 128, "bf16", True, (255, 0), 30.0, False),
    ("softcap 30 non-causal Sq != Skv", 2, 300, 1000, 2, 4, 64, "fp16", False, (-1, -1), 30.0, False),
    ("symmetric window non-causal", 2, 1000, 700, 2, 2, 128, "bf16", False, (64, 64), 0.0, True),
    ("right-only window", 1, 500, 500, 2, 1, 64, "bf16", False, (-1, 3), 0.0, False),
    ("window < block, Sq > Skv (keyless rows)", 2, 400, 150, 2, 4, 128, "bf16", True, (10, 0), 0.0, True),
    ("decode-shaped Sq 1", 4, 1, 3000, 8, 8, 64, "bf16", True, (127, 0), 30.0, True),
    ("everything", 1, 777, 1500, 4, 6, 128, "fp16", True, (200, 0), 20.0, True),
]


@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_dense_matches_reference(case, exact_fp32):
    label, b, sq, skv, hkv, g, d, dtype, causal, window, softcap, sink = case
    q, k, v = inputs(b, sq, skv, hkv, g, d, dtype, label)
    z = sinks(hkv * g, label) if sink else None
    scale = d ** -0.5
    o, lse = fa4gen.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=z,
                              return_lse=True)
    info = api.last_call_info()
    want = (window[0] >= 0 or (window[1] >= 0 and not causal), softcap > 0, sink)
    cfg = info.problem.mods.flags
    assert tuple(f for _, f in cfg) == want and info.launched
    check(o, lse, q, k, v, causal, scale, dtype, label, window, softcap, z)


def test_sink_dtypes_and_views(exact_fp32):
    """A bf16 sink is converted to fp32 (the kernel reads its fp32 value); a strided fp32 view is copied."""
    q, k, v = inputs(1, 200, 200, 2, 4, 128, "bf16", "sink dtypes")
    z = sinks(8, "sink dtypes")
    o32, l32 = fa4gen.attention(q, k, v, causal=True, learnable_sink=z.bfloat16().float(), return_lse=True)
    o16, l16 = fa4gen.attention(q, k, v, causal=True, learnable_sink=z.bfloat16(), return_lse=True)
    assert torch.equal(o16, o32) and torch.equal(l16, l32)
    strided = torch.stack([z, z], dim=1)[:, 0]
    os_, ls_ = fa4gen.attention(q, k, v, causal=True, learnable_sink=strided, return_lse=True)
    oc, lc = fa4gen.attention(q, k, v, causal=True, learnable_sink=z, return_lse=True)
    assert torch.equal(os_, oc) and torch.equal(ls_, lc)


def test_unbounded_window_equals_the_plain_kernel_bitwise():
    """window_size=(-1, -1) and causal with an unbounded left side pick the plain kernels."""
    q, k, v = inputs(2, 300, 500, 2, 4, 128, "bf16", "unbounded")
    for causal in (False, True):
        o0, l0 = fa4gen.attention(q, k, v, causal=causal, return_lse=True)
        o1, l1 = fa4gen.attention(q, k, v, causal=causal, window_size=(-1, -1 if not causal else 5), return_lse=True)
        assert torch.equal(o0, o1) and torch.equal(l0, l1)
        assert "_win" not in api.last_call_info().kernel.name


def test_keyless_problem_with_sinks_answers_the_sink():
    q = torch.randn(2, 5, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 0, 2, 64, device="cuda", dtype=torch.bfloat16)
    z = sinks(8, "keyless")
    o, lse = fa4gen.attention(q, k, k, learnable_sink=z, return_lse=True)
    assert (o == 0).all() and torch.equal(lse, z[None, :, None].expand(2, 8, 5))
    assert not api.last_call_info().launched


# ---- varlen ------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,window,softcap,sink", [(True, (100, 0), 0.0, True), (False, (50, 20), 30.0, False),
                                                         (True, (300, 0), 50.0, True)])
def test_varlen_windows_per_sequence(causal, window, softcap, sink, exact_fp32):
    lens_q = ragged_lengths(9, seed=5, long_max=2000)
    lens_k = ragged_lengths(9, seed=6, long_max=2000)
    lens_q[1], lens_k[1] = 0, 57
    lens_q[2], lens_k[2] = 33, 0
    hkv, g, d, dtype = 2, 4, 128, "bf16"
    label = f"varlen {causal} {window} {softcap} {sink}"
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(label.encode()))
    q = torch.randn(sum(lens_q), hkv * g, d, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    z = sinks(hkv * g, label) if sink else None
    o, lse = fa4gen.attention_varlen(q, k, v, _cu(lens_q, "cuda"), _cu(lens_k, "cuda"), max(lens_q), max(lens_k),
                                     causal=causal, window_size=window, softcap=softcap, learnable_sink=z,
                                     return_lse=True)
    cq, ck = 0, 0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq:
            qs, ks, vs = q[cq:cq + lq][None], k[ck:ck + lk][None], v[ck:ck + lk][None]
            check(o[cq:cq + lq][None], lse[:, cq:cq + lq][None], qs, ks, vs, causal, d ** -0.5, dtype,
                  f"{label} seq {i} ({lq}x{lk})", window, softcap, z)
        cq, ck = cq + lq, ck + lk


# ---- KV cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size,sq,num_splits,window,sink", [
    (64, 1, 0, (127, 0), True),  # gpt-oss decode: paged, sliding window, sinks
    (64, 1, 3, (127, 0), True),  # splits: the sink counted once
    (16, 4, 2, (40, 0), True),  # speculative decode, a window inside one block
    (0, 1, 0, (4095, 0), False),  # Mistral decode on a contiguous cache
    (128, 1, 1, (-1, -1), True),  # full layer with sinks, one split
])
def test_kvcache_windows_and_sinks(page_size, sq, num_splits, window, sink, exact_fp32):
    lens = [5000, 1, 0, 127, 128, 300, 4097]
    hkv, g, d, dtype = 8, 8, 64, "bf16"
    label = f"kv p{page_size} sq{sq} s{num_splits} {window} {sink}"
    q, kc, vc, seqlens, table, ks, vs = make_cache(len(lens), lens, sq, hkv, g, d, dtype, page_size,
                                                   seed=zlib.crc32(label.encode()))
    z = sinks(hkv * g, label) if sink else None
    o, lse = fa4gen.attention_with_kvcache(q, kc, vc, seqlens, table, causal=True, num_splits=num_splits,
                                           window_size=window, learnable_sink=z, return_lse=True)
    for i, (k, v) in enumerate(zip(ks, vs)):
        check(o[i:i + 1], lse[i:i + 1], q[i:i + 1], k[None], v[None], True, d ** -0.5, dtype,
              f"{label} seq {i} (k_len {k.shape[0]})", window, 0.0, z)


def test_kvcache_softcap_decode(exact_fp32):
    lens = [900, 3, 2000]
    q, kc, vc, seqlens, table, ks, vs = make_cache(3, lens, 1, 4, 2, 128, "bf16", 32, seed=7)
    o, lse = fa4gen.attention_with_kvcache(q, kc, vc, seqlens, table, softcap=50.0, window_size=(255, 0),
                                           num_splits=2, return_lse=True)
    for i, (k, v) in enumerate(zip(ks, vs)):
        check(o[i:i + 1], lse[i:i + 1], q[i:i + 1], k[None], v[None], True, 128 ** -0.5, "bf16", f"softcap kv {i}",
              (255, 0), 50.0)


# ---- torch.compile -----------------------------------------------------------------------------
def test_compile_fullgraph_with_score_mods_equals_eager():
    q, k, v = inputs(2, 500, 500, 8, 8, 64, "bf16", "compile")
    z = sinks(64, "compile")

    def layer(q, k, v, z):
        o1 = fa4gen.attention(q, k, v, causal=True, window_size=(127, 0), learnable_sink=z)
        o2, lse = fa4gen.attention(q, k, v, causal=True, softcap=30.0, learnable_sink=z, return_lse=True)
        return o1, o2, lse

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(q, k, v, z)
    want = layer(q, k, v, z)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_prebuilt_refuses_a_window_it_was_not_built_for(tmp_path):
    from fa4gen import codegen
    from fa4gen.spec.config import KernelConfig
    from fa4gen.runtime.validate import InputValueError

    cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=4)
    codegen.build(cfg, out_dir=tmp_path, emit=("cubin",))
    kernel = fa4gen.load(tmp_path / f"{cfg.name}.cubin")
    q, k, v = inputs(1, 64, 64, 2, 4, 64, "bf16", "prebuilt")
    with pytest.raises(InputValueError, match="built without a sliding window"):
        kernel(q, k, v, window_size=(16, 0))
    assert math.isfinite(kernel(q, k, v, return_lse=True)[1].max().item())
