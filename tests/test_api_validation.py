"""Input validation of fa4gen.attention, on plain metadata: no torch, no GPU needed.

The last few tests use torch CPU tensors when torch is installed (skipped otherwise)."""

import math
import subprocess
import sys

import pytest

from fa4gen.runtime.validate import (DeviceError, Fa4genInputError, InputTypeError, InputValueError, Problem, TensorMeta,
                                     UnsupportedArchError, canonical_strides, check_arch, check_problem,
                                     check_softmax_scale, tma_layout_problem)


def packed(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def meta(name, shape, dtype="bfloat16", device="cuda:0", strides=None, ptr=1 << 20):
    return TensorMeta(name, tuple(shape), strides or packed(shape), dtype, device, ptr, 2 if "16" in dtype else 4)


def qkv(b=2, sq=100, skv=300, hq=8, hkv=2, d=128, **kw):
    return meta("q", (b, sq, hq, d), **kw), meta("k", (b, skv, hkv, d), **kw), meta("v", (b, skv, hkv, d), **kw)


def problem(*tensors, **kw) -> Problem:
    return check_problem(*(tensors or qkv()), **kw)


def raises(exc, match, *tensors, **kw):
    with pytest.raises(exc, match=match) as info:
        problem(*tensors, **kw)
    assert isinstance(info.value, Fa4genInputError)
    return info.value


def test_valid_problem_fields():
    p = problem(causal=True, return_lse=True)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (2, 100, 300, 8, 2, 128)
    assert (p.dtype, p.gqa_ratio, p.causal, p.return_lse, p.device) == ("bf16", 4, True, True, "cuda:0")
    assert p.softmax_scale == pytest.approx(1 / math.sqrt(128))
    assert p.out_shape == (2, 100, 8, 128) and p.lse_shape == (2, 8, 100)
    assert p.relayout == () and not p.is_empty and not p.no_keys
    assert problem(*qkv(d=64, dtype="float16")).dtype == "fp16"


def test_error_classes_are_type_and_value_errors():
    assert issubclass(InputTypeError, TypeError) and issubclass(InputValueError, ValueError)
    for cls in (InputTypeError, InputValueError, DeviceError, UnsupportedArchError):
        assert issubclass(cls, Fa4genInputError)


def test_cpu_tensor_must_be_cuda():
    q, k, v = qkv()
    e = raises(DeviceError, "k must be a CUDA tensor, got one on cpu", q, meta("k", k.shape, device="cpu"), v)
    assert isinstance(e, ValueError)


def test_devices_must_match():
    q, k, v = qkv()
    raises(DeviceError, "same CUDA device.*v on cuda:1", q, k, meta("v", v.shape, device="cuda:1"))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "float8_e4m3fn"])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    raises(InputTypeError, f"q has dtype {dtype}; fa4gen supports float16 and bfloat16", meta("q", q.shape, dtype), k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    raises(InputTypeError, "same dtype.*k: float16", q, meta("k", k.shape, "float16"), v)


@pytest.mark.parametrize("shape", [(2, 100, 128), (2, 100, 8, 128, 1), ()])
def test_rank_must_be_4(shape):
    q, k, v = qkv()
    raises(InputValueError, r"q must have 4 dims \(batch, seqlen, heads, head_dim\)", meta("q", shape), k, v)


def test_k_v_shape_mismatch():
    q, k, _ = qkv()
    raises(InputValueError, "k and v must have the same shape but for the last dim", q, k, meta("v", (2, 299, 2, 128)))


def test_batch_mismatch():
    q, k, v = qkv()
    raises(InputValueError, "same batch size, got 3 and 2", meta("q", (3, 100, 8, 128)), k, v)


def test_head_dim_mismatch():
    q, k, v = qkv(d=64)
    raises(InputValueError, "same head_dim, got 128 and 64", meta("q", (2, 100, 8, 128)), k, v)


@pytest.mark.parametrize("d", [32, 192, 80, 0])
def test_unsupported_head_dim_says_which_are(d):
    raises(InputValueError, rf"^head_dim {d} is not supported; fa4gen generates \(head_dim, head_dim_v\) "
                            r"\(64, 64\), \(96, 96\), \(128, 128\), \(192, 128\), \(256, 256\)$", *qkv(d=d))


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (192, 64), (128, 96)])
def test_v_head_dim_other_than_q_is_refused_as_a_head_dim_pair(d, dv):
    """v's last dim is head_dim_v: a pair fa4gen does not generate is a head-dim error naming the pairs
    it does, not a shape mismatch."""
    q, k, _ = qkv(d=d)
    raises(InputValueError, rf"^head_dim {d} with head_dim_v {dv} \(q's and v's last dims\) is not supported; "
                            r"fa4gen generates \(head_dim, head_dim_v\) \(64, 64\), \(96, 96\), \(128, 128\), "
                            r"\(192, 128\), \(256, 256\)$",
           q, k, meta("v", (2, 300, 2, dv)))


def test_deepseek_head_dims_are_a_problem_whose_output_has_v_columns():
    """(192, 128) is generated for the runtime's arch (sm_90a): q and k of 192 columns, v and o of 128."""
    q, k, _ = qkv(d=192)
    p = problem(q, k, meta("v", (2, 300, 2, 128)))
    assert p.head_dims == (192, 128) and p.out_shape == (2, 100, 8, 128)


@pytest.mark.parametrize("d", [96, 256])
def test_d96_and_d256_are_problems_of_their_columns(d):
    """(96, 96) and (256, 256) are generated for the runtime's arch (sm_90a)."""
    p = problem(*qkv(d=d))
    assert p.head_dims == (d, d) and p.out_shape == (2, 100, 8, d)


def test_v_head_dim_is_refused_by_every_entry_point():
    from fa4gen.runtime.validate import check_kvcache_problem, check_varlen_problem

    msg = r"head_dim 128 with head_dim_v 64 \(q's and v's last dims\) is not supported"
    cu = meta("cu_seqlens_q", (3,), "int32")
    with pytest.raises(InputValueError, match=msg):
        check_varlen_problem(meta("q", (100, 8, 128)), meta("k", (300, 2, 128)), meta("v", (300, 2, 64)), cu,
                             meta("cu_seqlens_k", (3,), "int32"), 50, 150)
    with pytest.raises(InputValueError, match=msg):
        check_kvcache_problem(meta("q", (2, 1, 8, 128)), meta("k", (2, 300, 2, 128)), meta("v", (2, 300, 2, 64)),
                              meta("cache_seqlens", (2,), "int32"))


def test_prebuilt_kernel_compares_head_dim_v():
    """A prebuilt kernel's (head_dim, head_dim_v) must be the call's, dv included (checked before
    anything touches the device)."""
    from fa4gen.runtime.api import PrebuiltKernel
    from fa4gen.spec.config import KernelConfig

    kernel = PrebuiltKernel(None, {}, KernelConfig(arch="sm_90a", head_dim=128), "k.cubin")
    p = Problem(batch=1, seqlen_q=8, seqlen_k=8, heads_q=2, heads_kv=2, head_dim=128, dtype="bf16", causal=False,
                softmax_scale=0.1, return_lse=False, device="cuda:0", head_dim_v=64)
    assert p.head_dims == (128, 64) and p.out_shape == (1, 8, 2, 64)
    with pytest.raises(InputValueError, match=r"built for \(head_dim, head_dim_v\) \(128, 128\).* the inputs are "
                                              r"\(head_dim, head_dim_v\) \(128, 64\)"):
        kernel._check_fits(None, p, None, None, None)


def test_heads_not_multiple():
    raises(InputValueError, r"q's heads \(12\) must be a multiple of k/v's heads \(8\)", *qkv(hq=12, hkv=8))


@pytest.mark.parametrize("hq,hkv", [(12, 4), (24, 8), (40, 8), (12, 2), (28, 4), (256, 1), (96, 8)])
def test_any_integer_gqa_ratio_passes(hq, hkv):
    """Llama-3.2-3B 24/8, Qwen2.5-14B 40/8, Qwen2-1.5B 12/2, Qwen2.5-7B 28/4, MQA 256/1: no ratio
    needs to divide 128 (tiles.gqa_pack runs one head per tile otherwise)."""
    p = problem(*qkv(hq=hq, hkv=hkv))
    assert p.gqa_ratio == hq // hkv
    from fa4gen.runtime.api import config_for

    assert config_for(p).gqa_ratio == hq // hkv


@pytest.mark.parametrize("ratio", [1, 2, 4, 8, 16, 32, 64, 128])
def test_every_power_of_two_ratio_passes(ratio):
    assert problem(*qkv(hq=ratio, hkv=1)).gqa_ratio == ratio


def test_kv_without_heads():
    raises(InputValueError, "k and v have 0 heads but q has 8", *qkv(hkv=0))


@pytest.mark.parametrize("kw", [dict(b=0), dict(sq=0), dict(hq=0, hkv=0), dict(b=0, skv=0)])
def test_empty_outputs_are_valid(kw):
    p = problem(*qkv(**kw))
    assert p.is_empty and not p.no_keys
    assert math.prod(p.out_shape) == 0 and math.prod(p.lse_shape) == 0


def test_no_keys():
    p = problem(*qkv(skv=0))
    assert p.no_keys and not p.is_empty and p.out_shape == (2, 100, 8, 128)


def test_too_large_for_u32_params():
    raises(InputValueError, "seqlen_q = 2147483648 does not fit", *qkv(sq=1 << 31))


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_must_be_bool(flag, value):
    raises(InputTypeError, f"{flag} must be True or False", **{flag: value})


@pytest.mark.parametrize("scale", [0.0, -0.1, math.inf, -math.inf, math.nan, 1e39, 1e-46])
def test_bad_softmax_scale_values(scale):
    raises(InputValueError, "softmax_scale", softmax_scale=scale)


@pytest.mark.parametrize("scale", [True, "0.1", [0.1], 1j])
def test_bad_softmax_scale_types(scale):
    raises(InputTypeError, "softmax_scale must be a real number", softmax_scale=scale)


def test_softmax_scale_default_and_explicit():
    assert check_softmax_scale(None, 64) == 0.125
    assert check_softmax_scale(2, 64) == 2.0 and isinstance(check_softmax_scale(2, 64), float)
    assert problem(softmax_scale=0.5).softmax_scale == 0.5


# ---- layout (TMA) ------------------------------------------------------------------------------
def test_packed_and_packed_qkv_views_need_no_copy():
    b, s, h, d = 2, 100, 8, 128
    # q, k, v sliced from one (B, S, 3, H, D) tensor: strides (S*3*H*D, 3*H*D, D, 1)
    st = (s * 3 * h * d, 3 * h * d, d, 1)
    q = meta("q", (b, s, h, d), strides=st)
    k = meta("k", (b, s, h, d), strides=st, ptr=(1 << 20) + h * d * 2)
    v = meta("v", (b, s, h, d), strides=st, ptr=(1 << 20) + 2 * h * d * 2)
    assert problem(q, k, v).relayout == ()
    # (B, H, S, D) transposed to (B, S, H, D)
    assert tma_layout_problem(meta("q", (b, s, h, d), strides=(h * s * d, d, s * d, 1))) is None


def test_layouts_that_need_a_copy():
    b, s, h, d = 2, 100, 8, 64
    assert "last dim has stride 2" in tma_layout_problem(meta("q", (b, s, h, d), strides=(s * h * 2 * d, h * 2 * d, 2 * d, 2)))
    # heads 68 elements = 136 bytes apart (e.g. padded D): not a multiple of 16
    assert "dim 2 has a stride of 136 bytes" in tma_layout_problem(
        meta("q", (b, s, h, d), strides=(s * h * 68, h * 68, 68, 1)))
    assert "broadcast" in tma_layout_problem(meta("k", (b, s, h, d), strides=(s * d, d, 0, 1)))
    assert "not 16-byte aligned" in tma_layout_problem(meta("q", (b, s, h, d), ptr=(1 << 20) + 2))
    q, k, v = qkv(d=64)
    p = problem(q, meta("k", k.shape, strides=tuple(x * 2 for x in k.strides)), v)
    assert [name for name, _ in p.relayout] == ["k"]


def test_size_one_dims_get_canonical_strides_and_are_not_checked():
    # torch gives size-1 dims arbitrary strides (e.g. 1 after slicing one head out)
    shape, strides = (1, 100, 1, 128), (7, 3 * 128, 1, 1)
    assert tma_layout_problem(meta("q", shape, strides=strides)) is None
    assert canonical_strides(shape, strides) == (100 * 3 * 128, 3 * 128, 128, 1)
    assert canonical_strides((2, 5, 3, 64), packed((2, 5, 3, 64))) == packed((2, 5, 3, 64))


# ---- architecture ------------------------------------------------------------------------------
def test_arch_90_runs():
    check_arch((9, 0), "NVIDIA H200")


@pytest.mark.parametrize("cc, words", [
    ((8, 0), "this GPU is sm_80, which has no fa4gen kernel"),
    ((8, 9), "sm_89"),
    ((12, 0), "sm_120"),
    ((10, 0), "sm_100: sm_100a kernels are generated .* never run on a Blackwell GPU"),
    ((10, 3), "sm_103"),
])
def test_other_archs_refused(cc, words):
    with pytest.raises(UnsupportedArchError, match="fa4gen runs .*sm_90a \\(H100/H200\\) kernels") as e:
        check_arch(cc, "this GPU")
    assert e.match(words) and isinstance(e.value, ValueError)


def test_validate_and_api_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fa4gen.runtime.validate, fa4gen.runtime.api, fa4gen.assemble.cache\n"
            "try:\n    fa4gen.runtime.api.attention(1, 2, 3)\n"
            "except fa4gen.runtime.validate.InputTypeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused: fa4gen.attention needs torch" in out.stdout


# ---- with torch CPU tensors (skipped when torch is absent) --------------------------------------
def test_torch_cpu_tensors_are_refused_before_anything_else():
    torch = pytest.importorskip("torch")
    import fa4gen

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="q must be a CUDA tensor, got one on cpu"):
        fa4gen.attention(q, q, q)


def test_torch_non_tensor_argument():
    torch = pytest.importorskip("torch")
    from fa4gen.runtime.api import attention

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InputTypeError, match="v must be a torch.Tensor, got list"):
        attention(q, q, [[1.0]])


def test_torch_tensor_meta_reads_views():
    torch = pytest.importorskip("torch")
    from fa4gen.runtime.validate import tensor_meta

    base = torch.zeros(2, 10, 3, 4, 64, dtype=torch.float16)
    m = tensor_meta(base[:, :, 1], "k")
    assert m.shape == (2, 10, 4, 64) and m.strides == (10 * 3 * 4 * 64, 3 * 4 * 64, 64, 1)
    assert (m.dtype, m.device, m.element_size) == ("float16", "cpu", 2)
