"""fa4gen's sm_90a kernels against a float32 reference, on an H100/H200 (marker `gpu`; conftest skips
these without torch, CUDA or an sm_90 GPU).

Coverage (`CASES`, 64 kernel runs): all 32 configs (head_dim {64, 128} x {fp16, bf16} x causal x
GQA {1, 2, 4, 8}) run twice each; the 16 (Sq, Skv) pairs drawn from {1, 17, 127, 128, 129, 1000,
4096, 8192} (8 square, 8 with Sq != Skv, 4 of them Sq > Skv) run 4 times each, and each pair's 4
runs span both head dims, both dtypes, causal and not, and plain and x30 inputs. Batch is 3/2/1 by
size, Hkv 3/2/1. Every run draws fresh random inputs, calls the Kernel directly with O and LSE
pre-filled with NaN (so an element the kernel never writes is caught), and checks every element.
`ANY_RATIO_CASES` (20 more runs) covers GQA ratios that do not divide 128 (3, 5, 6, 7, 12 with real
models' head counts) over D 64/128 and causal/non-causal, Sq != Skv with tails.

Tolerances (an elementwise bound, derived rather than tuned). The kernel differs from the fp32
reference by rounding P to the input dtype before the PV MMA and rounding O at the end (unit
roundoff u = 2^-8 bf16, 2^-11 fp16); everything else accumulates in fp32. Rounding each p_j with
relative error <= u moves o_i by at most u * sum_j p_ij |v_j| (with p the normalised
probabilities: `pv_abs` = P @ |V|); a row sum taken from the rounded P adds at most u * |o_i|, the
final cast u * |o_i| more. So |o - o_ref| <= 2u * pv_abs + 2u |o_ref|, plus a relative 4e-4 * pv_abs
for the exp2 polynomial emulation (spec: well under fp16 rounding) and fp32 logit differences at
x30 (products of 16-bit inputs are exact in fp32; only summation order differs). fp16 P also
rounds values below 2^-14 with absolute error <= 2^-25 (subnormal spacing / 2); with the kernel's
row sum >= 1 that adds <= 2^-25 * sum_j |v_j|. LSE is fp32 log(row_sum) + max: off by the row sum's
relative error, <= u (P rounding) + 5e-4 (emulation, logits).
"""

import math
import zlib
from collections import Counter

import pytest
from pathlib import Path

torch = pytest.importorskip("torch")

from fa4gen.runtime import api  # noqa: E402
from fa4gen.assemble.cache import KERNELS  # noqa: E402
from fa4gen.spec.config import KernelConfig  # noqa: E402
from fa4gen.spec.tiles import q_tile_rows  # noqa: E402
from fa4gen.runtime.validate import DeviceError, InputTypeError, InputValueError  # noqa: E402

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
SUBNORMAL_HALF_SPACING = {"fp16": 2.0 ** -25, "bf16": 0.0}  # bf16 has fp32's exponent range
EMU_AND_LOGITS = 4e-4
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

PAIRS = ((1, 1), (17, 17), (127, 127), (128, 128), (129, 129), (1000, 1000), (4096, 4096), (8192, 8192),
         (1, 8192), (17, 1000), (127, 129), (129, 127), (1000, 17), (4096, 1000), (128, 4096), (8192, 129))
GQA = (1, 2, 4, 8)


def _cases():
    """Pair p gets the 4 (head_dim, dtype, causal) combos of one parity (each attribute takes both
    values); each combo's successive uses cycle through the GQA ratios, so every config runs twice."""
    uses, out = Counter(), []
    for p, (sq, skv) in enumerate(PAIRS):
        combos = [b for b in range(8) if bin(b).count("1") % 2 == p % 2]
        for pos, bits in enumerate(combos):
            d, dt, causal = (64, 128)[bits >> 2 & 1], ("fp16", "bf16")[bits >> 1 & 1], bool(bits & 1)
            k = uses[(d, dt, causal)]
            uses[(d, dt, causal)] += 1
            g = GQA[(k + k // 4) % 4]
            work = sq * skv
            b = 3 if work <= 200_000 else 2 if work <= 5_000_000 else 1
            hkv = 3 if work <= 200_000 else 2 if work <= 20_000_000 else 1
            # half the runs use the seed's exp2 split (sm_90a's default emulates nothing), so the
            # FMA emulation shared with sm_100a executes on the GPU too
            out.append(dict(d=d, dtype=dt, causal=causal, g=g, b=b, hkv=hkv, sq=sq, skv=skv, x30=(p + pos) % 2 == 1,
                            emu=2 if pos % 2 == 0 else None))
    return out


CASES = _cases()


def case_id(c):
    return (f"d{c['d']}-{c['dtype']}-{'causal' if c['causal'] else 'full'}-g{c['g']}-b{c['b']}h{c['hkv']}"
            f"-{c['sq']}x{c['skv']}{'-x30' if c['x30'] else ''}{'-emu' if c.get('emu') else ''}")


# ---- reference ---------------------------------------------------------------------------------
def reference(q, k, v, causal, scale):
    """float32 math attention: GQA by repeat_interleave (query head h reads kv head h // G), causal
    mask bottom-right aligned (key j visible to query i iff j <= i + Skv - Sq). Returns o (B, Sq, Hq,
    D), lse (B, Hq, Sq) with -inf for rows that see no key (their o is 0), and P @ |V|."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(skv, device=q.device)[None, :]
        s.masked_fill_(j > i + (skv - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)  # -inf - -inf would be NaN
    o = torch.matmul(p, vf)
    pv_abs = torch.matmul(p, vf.abs())
    return o.transpose(1, 2), lse, pv_abs.transpose(1, 2)


def check_against_reference(o, lse, q, k, v, causal, scale, dtype, label):
    o_ref, lse_ref, pv_abs = reference(q, k, v, causal, scale)
    nan_o = torch.isnan(o).sum().item()
    assert nan_o == 0, f"{label}: {nan_o} of {o.numel()} O elements are NaN (never written, or computed NaN)"
    u, g = UNIT_ROUNDOFF[dtype], q.shape[2] // k.shape[2]
    vsum = v.float().abs().sum(dim=1).repeat_interleave(g, dim=1)[:, None]  # (B, 1, Hq, D)
    tol = (2 * u + EMU_AND_LOGITS) * pv_abs + 2 * u * o_ref.abs() + SUBNORMAL_HALF_SPACING[dtype] * vsum + 1e-6
    err = (o.float() - o_ref).abs()
    bad = err > tol
    if bad.any():
        worst = (err / tol).max().item()
        where = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {o.numel()} O elements outside the bound (worst err/tol {worst:.2f}); "
            f"first at (b, s, h, d) = {where}: got {o[where].item():.6g}, ref {o_ref[where].item():.6g}, "
            f"tol {tol[where].item():.3g}; max abs err {err.max().item():.3g}")
    if lse is None:
        return
    masked = torch.isinf(lse_ref)  # rows with no visible key
    if masked.any():
        rows = masked.transpose(1, 2)  # (B, Sq, Hq)
        assert (o[rows] == 0).all(), f"{label}: fully masked rows must have O == 0 exactly"
        assert (lse[masked] == float("-inf")).all(), f"{label}: fully masked rows must have LSE == -inf"
    nan_l = torch.isnan(lse).sum().item()
    assert nan_l == 0, f"{label}: {nan_l} of {lse.numel()} LSE elements are NaN (never written)"
    seen = ~masked
    lse_err = (lse[seen] - lse_ref[seen]).abs()
    lse_tol = u + 5e-4 + 1e-6 * lse_ref[seen].abs()
    assert torch.isfinite(lse[seen]).all(), f"{label}: LSE is infinite on a row that sees keys"
    assert (lse_err <= lse_tol).all(), (
        f"{label}: LSE off by up to {lse_err.max().item():.3g} (bound {u + 5e-4:.3g}); "
        f"{int((lse_err > lse_tol).sum())} rows outside")


def make_inputs(c, seed_label, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(seed_label.encode()))
    dt = TORCH_DTYPE[c["dtype"]]
    hq = c["hkv"] * c["g"]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = rnd(c["b"], c["sq"], hq, c["d"]) * (30.0 if c["x30"] else 1.0)
    k = rnd(c["b"], c["skv"], c["hkv"], c["d"])
    v = rnd(c["b"], c["skv"], c["hkv"], c.get("dv", c["d"]))  # v (and o) may have their own head_dim_v
    return q.to(dt), k.to(dt), v.to(dt)


def run_kernel_poisoned(q, k, v, causal, scale, dtype, emu_pairs=None, block_m=None):
    """Call the Kernel itself with O and LSE filled with NaN, so unwritten elements show. block_m None:
    the Q tile fa4gen.attention picks (tiles.q_tile_rows: 192 rows, three consumers, at D = 64 unless
    causal over fewer than 2048 packed rows)."""
    b, sq, hq, d = q.shape
    g, dv = hq // k.shape[2], v.shape[-1]
    cfg = KernelConfig(arch="sm_90a", head_dim=d, head_dim_v=dv, causal=causal, gqa_ratio=g, dtype=dtype,
                       emu_pairs=emu_pairs,
                       block_m=q_tile_rows("sm_90a", d, g, causal=causal, seqlen_q=sq) if block_m is None else block_m)
    kernel, _ = api.get_kernel(cfg, q.device)
    o = torch.full((b, sq, hq, dv), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((b, hq, sq), float("nan"), device=q.device, dtype=torch.float32)
    kernel(q, k, v, o, lse=lse, softmax_scale=scale)
    torch.cuda.synchronize()
    return o, lse


# ---- the kernel against the reference ----------------------------------------------------------
def test_case_table_covers_what_it_claims():
    assert len(CASES) == 64
    assert len({(c["d"], c["dtype"], c["causal"], c["g"]) for c in CASES}) == 32
    for pair in PAIRS:
        sel = [c for c in CASES if (c["sq"], c["skv"]) == pair]
        for key in ("d", "dtype", "causal", "x30"):
            assert len({c[key] for c in sel}) == 2, (pair, key)
    assert any(c["causal"] and c["sq"] > c["skv"] for c in CASES)  # fully masked rows
    assert any(c["b"] > 1 for c in CASES)
    assert {c["emu"] for c in CASES} == {2, None}


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_kernel_matches_reference(c, exact_fp32):
    label = case_id(c)
    q, k, v = make_inputs(c, label)
    scale = 1.0 / math.sqrt(c["d"])
    with torch.no_grad():
        o, lse = run_kernel_poisoned(q, k, v, c["causal"], scale, c["dtype"], c["emu"])
        check_against_reference(o, lse, q, k, v, c["causal"], scale, c["dtype"], label)


# D = 64 runs 192-row tiles (three consumer warpgroups) by default, except causal calls over fewer
# than 2048 packed rows, which run the 128-row kernel (tiles.q_tile_rows). Both tiles on the cases
# the default does not give them: the 192-row kernel on every causal D = 64 case (a build for any
# shape takes it), the 128-row two-consumer kernel (KernelConfig(block_m=128)) on every other D = 64 case.
CASES_D64_TILES = ([(c, 192) for c in CASES if c["d"] == 64 and c["causal"]]
                   + [(c, 128) for c in [c for c in CASES if c["d"] == 64][::2]])


@pytest.mark.gpu
@pytest.mark.parametrize("c, block_m", CASES_D64_TILES, ids=lambda x: case_id(x) if isinstance(x, dict) else f"m{x}")
def test_d64_tile_matches_reference(c, block_m, exact_fp32):
    label = f"{case_id(c)}-m{block_m}"
    q, k, v = make_inputs(c, label)
    scale = 1.0 / math.sqrt(c["d"])
    with torch.no_grad():
        o, lse = run_kernel_poisoned(q, k, v, c["causal"], scale, c["dtype"], c["emu"], block_m=block_m)
        check_against_reference(o, lse, q, k, v, c["causal"], scale, c["dtype"], label)


# ---- GQA ratios that do not divide 128 (tiles.gqa_pack: one query head per Q tile) ------------------
# (G, Hkv): Llama-3.2-3B 24/8, Qwen2.5-14B 40/8, Qwen2-1.5B 12/2, Qwen2.5-7B 28/4, and 12/1. Each
# ratio runs D 64/128 x causal/non-causal (20 kernel configs), on (Sq, Skv) pairs with Sq != Skv
# (both ways) and tails on both lengths, dtypes and x30 inputs alternating.
ANY_RATIO_HEADS = ((3, 8), (5, 8), (6, 2), (7, 4), (12, 1))
ANY_RATIO_PAIRS = ((129, 127), (1000, 17), (300, 1000), (4096, 1000), (17, 1000), (1000, 4095), (257, 255),
                   (1500, 700))


def _any_ratio_cases():
    out = []
    for i, (g, hkv) in enumerate(ANY_RATIO_HEADS):
        for j, (d, causal) in enumerate((d, c) for d in (64, 128) for c in (False, True)):
            n = 4 * i + j
            sq, skv = ANY_RATIO_PAIRS[n % len(ANY_RATIO_PAIRS)]
            b = 2 if sq * skv <= 2_000_000 else 1
            out.append(dict(d=d, dtype=("bf16", "fp16")[n % 2], causal=causal, g=g, b=b, hkv=hkv, sq=sq, skv=skv,
                            x30=n % 3 == 0, emu=None))
    return out


ANY_RATIO_CASES = _any_ratio_cases()


def test_any_ratio_case_table_covers_what_it_claims():
    assert len({(c["g"], c["d"], c["causal"]) for c in ANY_RATIO_CASES}) == 20
    assert {c["g"] for c in ANY_RATIO_CASES} == {3, 5, 6, 7, 12}
    assert all(c["sq"] != c["skv"] and (c["sq"] % 128 or c["skv"] % 128) for c in ANY_RATIO_CASES)
    assert any(c["causal"] and c["sq"] > c["skv"] for c in ANY_RATIO_CASES)
    assert any(c["causal"] and c["sq"] < c["skv"] for c in ANY_RATIO_CASES)
    assert all(128 % c["g"] for c in ANY_RATIO_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("c", ANY_RATIO_CASES, ids=case_id)
def test_any_gqa_ratio_kernel_matches_reference(c, exact_fp32):
    label = "anyratio-" + case_id(c)
    q, k, v = make_inputs(c, label)
    scale = 1.0 / math.sqrt(c["d"])
    with torch.no_grad():
        o, lse = run_kernel_poisoned(q, k, v, c["causal"], scale, c["dtype"], c["emu"])
        check_against_reference(o, lse, q, k, v, c["causal"], scale, c["dtype"], label)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(24, 8), (12, 2), (256, 1)])
def test_attention_with_any_ratio_equals_direct_kernel_bitwise(hq, hkv, exact_fp32):
    """fa4gen.attention picks the ratio's config (api.config_for) and equals the kernel bit for bit;
    MQA 256/1 runs 256 head groups of one head each."""
    c = dict(d=128, dtype="bf16", causal=True, g=hq // hkv, b=2, hkv=hkv, sq=333, skv=700, x30=False)
    q, k, v = make_inputs(c, f"api-any-ratio-{hq}-{hkv}")
    with torch.no_grad():
        o, lse = api.attention(q, k, v, causal=True, return_lse=True)
        o2, lse2 = run_kernel_poisoned(q, k, v, True, 1 / math.sqrt(128), "bf16")
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    check_against_reference(o, lse, q, k, v, True, 1 / math.sqrt(128), "bf16", f"api {hq}/{hkv}")


@pytest.mark.gpu
def test_custom_softmax_scale(exact_fp32):
    c = dict(d=128, dtype="bf16", causal=False, g=2, b=2, hkv=2, sq=300, skv=700, x30=False)
    q, k, v = make_inputs(c, "custom-scale")
    o, lse = api.attention(q, k, v, softmax_scale=0.3, return_lse=True)
    torch.cuda.synchronize()
    check_against_reference(o, lse, q, k, v, False, 0.3, "bf16", "softmax_scale=0.3")


# ---- the public API ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_direct_kernel_bitwise(causal):
    c = dict(d=64, dtype="fp16", causal=causal, g=4, b=2, hkv=2, sq=333, skv=1000, x30=False)
    q, k, v = make_inputs(c, f"api-{causal}")
    scale = 1 / 8
    o_direct, lse_direct = run_kernel_poisoned(q, k, v, causal, scale, "fp16")
    o1, lse1 = api.attention(q, k, v, causal=causal, return_lse=True)
    info = api.last_call_info()
    o2 = api.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(o1, o_direct) and torch.equal(o2, o_direct) and torch.equal(lse1, lse_direct)
    assert info.launched and info.copied == () and info.kernel.source == "memory"
    assert o1.shape == q.shape and o1.dtype == q.dtype and lse1.shape == (2, 8, 333) and lse1.dtype == torch.float32


@pytest.mark.gpu
def test_packed_qkv_and_bhsd_views_are_read_in_place(exact_fp32):
    b, s, h, d = 2, 257, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    o = api.attention(q, k, v, causal=True)
    assert api.last_call_info().copied == ()
    check_against_reference(o, None, q, k, v, True, d ** -0.5, "bf16", "packed qkv")
    qt = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    o = api.attention(qt, k, v)
    assert api.last_call_info().copied == ()
    check_against_reference(o, None, qt, k, v, False, d ** -0.5, "bf16", "(B, H, S, D) transposed")


@pytest.mark.gpu
def test_layouts_tma_cannot_read_are_copied(exact_fp32):
    b, s, h, d = 2, 200, 2, 64
    wide = torch.randn(b, s, h, 2 * d, device="cuda", dtype=torch.float16)
    q = wide[..., ::2]  # last dim stride 2
    k = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
    v_storage = torch.randn(b * s * h * d + 1, device="cuda", dtype=torch.float16)
    v = v_storage[1:].view(b, s, h, d)  # base address 2 bytes past alignment
    o, lse = api.attention(q, k, v, return_lse=True)
    assert api.last_call_info().copied == ("q", "v")
    check_against_reference(o, lse, q, k, v, False, d ** -0.5, "fp16", "copied layouts")


@pytest.mark.gpu
def test_empty_and_keyless_inputs_launch_nothing():
    dev, dt = "cuda", torch.bfloat16
    for shape_q, shape_kv in [((0, 5, 4, 64), (0, 7, 2, 64)), ((2, 0, 4, 64), (2, 7, 2, 64)),
                              ((2, 5, 0, 64), (2, 7, 0, 64))]:
        q = torch.randn(shape_q, device=dev, dtype=dt)
        kv = torch.randn(shape_kv, device=dev, dtype=dt)
        o, lse = api.attention(q, kv, kv, return_lse=True)
        assert o.shape == shape_q and lse.shape == (shape_q[0], shape_q[2], shape_q[1])
        assert not api.last_call_info().launched
    q = torch.randn(2, 5, 4, 128, device=dev, dtype=dt)
    kv = torch.randn(2, 0, 2, 128, device=dev, dtype=dt)
    for causal in (False, True):
        o, lse = api.attention(q, kv, kv, causal=causal, return_lse=True)
        assert not api.last_call_info().launched
        assert o.shape == q.shape and (o == 0).all() and (lse == float("-inf")).all()


@pytest.mark.gpu
def test_gpu_input_errors():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="k must be a CUDA tensor, got one on cpu"):
        api.attention(q, q.cpu(), q)
    with pytest.raises(InputTypeError, match="v has dtype float32"):
        api.attention(q, q, q.float())
    with pytest.raises(InputTypeError, match="same dtype"):
        api.attention(q, q.half(), q.half())
    with pytest.raises(InputValueError, match="head_dim 80 is not supported"):  # no generated pair has 80
        x = torch.randn(1, 64, 2, 80, device="cuda", dtype=torch.bfloat16)
        api.attention(x, x, x)
    with pytest.raises(InputValueError, match="forward-only"):
        api.attention(q.clone().requires_grad_(), q, q)
    with torch.no_grad():
        assert api.attention(q.clone().requires_grad_(), q, q).shape == q.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_two_gpus_are_refused():
    q = torch.randn(1, 64, 2, 64, device="cuda:0", dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="same CUDA device"):
        api.attention(q, q, q.to("cuda:1"))


@pytest.mark.gpu
def test_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path))
    c = dict(d=128, dtype="bf16", causal=True, g=1, b=1, hkv=2, sq=200, skv=200, x30=False)
    q, k, v = make_inputs(c, "cache")
    torch.cuda.synchronize()
    KERNELS.clear()
    first = api.attention(q, k, v, causal=True)
    built = api.last_call_info().kernel
    assert built.source == "built" and built.build_s > 0 and built.load_s > 0, built
    cfg = KernelConfig(arch='sm_90a', causal=True)
    cubin = Path(built.cache_path)  # <name>-<content hash>-<assembler id>.cubin (fa4gen/assemble/cache.py)
    assert cubin.exists() and cubin.parent == tmp_path and cubin.name.startswith(f"{cfg.name}-{cfg.content_hash}")
    torch.cuda.synchronize()
    KERNELS.clear()
    again = api.attention(q, k, v, causal=True)
    assert api.last_call_info().kernel.source == "disk"
    cubin.write_bytes(cubin.read_bytes()[: cubin.stat().st_size // 2])  # a torn copy
    torch.cuda.synchronize()
    KERNELS.clear()
    rebuilt = api.attention(q, k, v, causal=True)
    info = api.last_call_info().kernel
    assert info.source == "built" and "bytes, the manifest says" in info.rebuilt_reason
    torch.cuda.synchronize()
    assert torch.equal(first, again) and torch.equal(first, rebuilt)


# ---- the reference itself (runs on CPU too, wherever torch is installed) -------------------------
def test_reference_matches_torch_sdpa_math():
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    b, hkv, g, d = 2, 2, 3, 16
    for sq, skv, causal in [(5, 9, True), (9, 9, True), (7, 4, False), (6, 6, False)]:
        q = torch.randn(b, sq, hkv * g, d, generator=gen)
        k = torch.randn(b, skv, hkv, d, generator=gen)
        v = torch.randn(b, skv, hkv, d, generator=gen)
        o_ref, lse_ref, _ = reference(q, k, v, causal, 0.37)
        for h in range(hkv * g):  # the spec's head map, one head at a time
            qh, kh, vh = (t[:, :, i][:, None] for t, i in ((q, h), (k, h // g), (v, h // g)))  # (B, 1, S, D)
            mask = causal_lower_right(sq, skv) if causal else None
            oh = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.37)
            torch.testing.assert_close(o_ref[:, :, h], oh[:, 0], atol=1e-5, rtol=1e-5)
            s = (qh @ kh.transpose(-1, -2))[:, 0] * 0.37
            if causal:
                s = s.masked_fill(torch.ones(sq, skv).tril(skv - sq) == 0, float("-inf"))
            torch.testing.assert_close(lse_ref[:, h], s.logsumexp(-1))
    o_ref, lse_ref, pv = reference(q[:, :1].repeat(1, 5, 1, 1), k[:, :2], v[:, :2], True, 1.0)
    assert (o_ref[:, :3] == 0).all() and torch.isinf(lse_ref[:, :, :3]).all() and torch.isfinite(lse_ref[:, :, 3:]).all()


def simulated_kernel(q, k, v, causal, scale, dtype, drop_keys=0):
    """What the kernel computes, on any device: fp32 logits and softmax, P rounded to the input
    dtype for the PV product, fp32 row sums, O rounded at the end. drop_keys > 0 plants a bug."""
    g = q.shape[2] // k.shape[2]
    if drop_keys:
        k, v = k[:, :-drop_keys], v[:, :-drop_keys]
    kf = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    s = torch.matmul(q.float().transpose(1, 2), kf.transpose(-1, -2)) * scale
    if causal:
        sq, skv = s.shape[-2], s.shape[-1]
        s.masked_fill_(torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq).logical_not(), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    row_sum = p.sum(-1, keepdim=True)
    o = torch.matmul(p.to(TORCH_DTYPE[dtype]).float(), vf) / row_sum
    return o.transpose(1, 2).to(TORCH_DTYPE[dtype]), (torch.log(row_sum) + m)[..., 0]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("x30", [False, True])
def test_tolerance_accepts_the_kernels_rounding_and_rejects_bugs(dtype, x30):
    c = dict(d=64, dtype=dtype, causal=False, g=2, b=1, hkv=2, sq=150, skv=1000, x30=x30)
    q, k, v = make_inputs(c, f"tol-{dtype}-{x30}", device="cpu")
    scale = 0.125
    o, lse = simulated_kernel(q, k, v, False, scale, dtype)
    check_against_reference(o, lse, q, k, v, False, scale, dtype, "simulated")
    o_bug, lse_bug = simulated_kernel(q, k, v, False, scale, dtype, drop_keys=128)
    with pytest.raises(AssertionError, match="O elements outside the bound"):
        check_against_reference(o_bug, None, q, k, v, False, scale, dtype, "dropped block")
    with pytest.raises(AssertionError, match="LSE off by"):
        check_against_reference(o, lse_bug, q, k, v, False, scale, dtype, "dropped block, LSE only")
    o_hole = o.clone()
    o_hole[0, 149, 3, 63] = float("nan")
    with pytest.raises(AssertionError, match="1 of .* O elements are NaN"):
        check_against_reference(o_hole, lse, q, k, v, False, scale, dtype, "poison left")


def test_tolerance_checks_fully_masked_rows():
    c = dict(d=64, dtype="bf16", causal=True, g=1, b=1, hkv=2, sq=40, skv=30, x30=False)
    q, k, v = make_inputs(c, "masked", device="cpu")
    o_ref, lse_ref, _ = reference(q, k, v, True, 0.125)
    o = o_ref.to(torch.bfloat16)
    check_against_reference(o, lse_ref.clone(), q, k, v, True, 0.125, "bf16", "masked rows")
    lse_bad = lse_ref.clone()
    lse_bad[0, 0, 0] = 0.0
    with pytest.raises(AssertionError, match="LSE == -inf"):
        check_against_reference(o, lse_bad, q, k, v, True, 0.125, "bf16", "masked row LSE")


@pytest.mark.gpu
@pytest.mark.parametrize("d, s", [(128, 700), (64, 4096)])
def test_prebuilt_dense_kernel_equals_attention(tmp_path, d, s):
    """`fa4gen build` + `fa4gen.load` of a dense kernel, called as kernel(q, k, v): the same bits as
    fa4gen.attention on the same tile (the dense prebuilt path had no GPU test; a name shadowing the
    fa4gen.runtime.launch module broke it unseen). D = 64 at a long causal length is the 192-row tile."""
    from click.testing import CliRunner

    import fa4gen
    from fa4gen.cli import main

    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--head-dim", str(d), "--causal", "--gqa", "4",
                                  "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    (cubin,) = tmp_path.glob("*.cubin")
    kernel = fa4gen.load(cubin)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"prebuilt{d}".encode()))
    q = torch.randn(2, s, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    o1, l1 = kernel(q, k, v, return_lse=True)
    o2, l2 = api.attention(q, k, v, causal=True, return_lse=True)
    assert kernel.config == api.config_for(api.last_call_info().problem)  # the same kernel, so the same bits
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert torch.equal(kernel(q, k, v), o1)  # the default launch: no LSE
