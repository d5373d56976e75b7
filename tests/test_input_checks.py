"""Input checks of fa4gen.attention (issue 10, item 13): nested and sparse tensors are refused in
tensor_meta, and every problem the metadata shows is reported in one error, device or not.

tensor_meta is exercised with a stand-in `torch` module (duck-typed tensors) so it runs without
torch; the same cases run on real torch tensors where torch is installed."""
import sys
import types

import pytest

from fa4gen.runtime.validate import (DeviceError, Fa4genInputError, InputErrors, InputTypeError, InputValueError,
                                     TensorMeta, check_problem, tensor_meta)


def meta(name, shape, dtype="bfloat16", device="cuda:0"):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return TensorMeta(name, tuple(shape), tuple(reversed(strides)), dtype, device, 1 << 20, 2)


def test_every_metadata_problem_in_one_error():
    # a CPU user with fp32 tensors and head_dim 100 hears of all three at once
    q, k, v = (meta(n, (1, 64, 2, 100), dtype="float32", device="cpu") for n in "qkv")
    with pytest.raises(InputErrors) as ei:
        check_problem(q, k, v, causal="yes")
    e = ei.value
    assert isinstance(e, Fa4genInputError) and isinstance(e, TypeError) and isinstance(e, ValueError)
    text = str(e)
    for words in ("must be a CUDA tensor", "dtype float32", "head_dim 100", "causal must be True or False"):
        assert words in text, (words, text)
    assert len(e.errors) == 4 and isinstance(e.errors[0], DeviceError)
    assert len(text.splitlines()) == 1


def test_one_problem_keeps_its_own_class():
    q, k, v = (meta(n, (1, 64, 2, 128), device="cpu") for n in "qkv")
    with pytest.raises(DeviceError, match="q must be a CUDA tensor.*k must be.*v must be"):
        check_problem(q, k, v)
    q, k, v = (meta(n, (1, 64, 2, 80)) for n in "qkv")
    with pytest.raises(InputValueError, match="head_dim 80") as ei:
        check_problem(q, k, v)
    assert not isinstance(ei.value, InputErrors)


# ---- tensor_meta on duck-typed tensors (a stand-in torch module) --------------------------------
class _Layout:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


def _fake_torch():
    torch = types.ModuleType("torch")
    torch.strided, torch.sparse_coo, torch.sparse_csr = (_Layout(n) for n in ("strided", "sparse_coo", "sparse_csr"))

    class Tensor:
        def __init__(self, layout=torch.strided, nested=False):
            self.layout, self.is_nested = layout, nested
            self.shape, self.dtype = (1, 8, 2, 64), "torch.bfloat16"
            self.device = types.SimpleNamespace(type="cpu", __str__=lambda s: "cpu")

        def stride(self):
            if self.is_nested:
                raise RuntimeError("Internal error: NestedTensorImpl doesn't support strides.")
            return (0, 0, 0, 0) if self.layout is not torch.strided else (1024, 128, 64, 1)

        def data_ptr(self):
            return 0

        def element_size(self):
            return 2

    torch.Tensor = Tensor
    return torch


@pytest.fixture
def fake_torch(monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_nested_tensor_is_refused(fake_torch):
    with pytest.raises(InputTypeError, match="q is a nested tensor"):
        tensor_meta(fake_torch.Tensor(nested=True), "q")


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_tensor_is_refused(fake_torch, layout):
    with pytest.raises(InputTypeError, match=f"k has layout torch.{layout}.*dense"):
        tensor_meta(fake_torch.Tensor(layout=getattr(fake_torch, layout)), "k")


def test_dense_duck_tensor_still_reads(fake_torch):
    m = tensor_meta(fake_torch.Tensor(), "v")
    assert m.shape == (1, 8, 2, 64) and m.strides == (1024, 128, 64, 1) and m.dtype == "bfloat16"


# ---- the same on real torch, where installed ----------------------------------------------------
def test_real_torch_nested_and_sparse_are_refused():
    torch = pytest.importorskip("torch")
    import fa4gen

    dense = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    nested = torch.nested.nested_tensor([torch.randn(8, 2, 64), torch.randn(5, 2, 64)], dtype=torch.bfloat16)
    with pytest.raises(InputTypeError, match="nested tensor"):
        fa4gen.attention(nested, dense, dense)
    with pytest.raises(InputTypeError, match="layout torch.sparse_coo"):
        fa4gen.attention(dense, dense.to_sparse(), dense)


def test_real_torch_cpu_fp32_bad_head_dim_all_reported():
    torch = pytest.importorskip("torch")
    import fa4gen

    x = torch.randn(1, 8, 2, 100)
    with pytest.raises(InputErrors, match="CUDA tensor.*float32.*head_dim 100"):
        fa4gen.attention(x, x, x)


def test_error_collector_passes_keyword_arguments():
    """validate._Errors.attempt forwards keywords (fa4gen.distributed calls check_problem with its
    keyword-only flags through it; without them the CUDA path raised TypeError on the H200)."""
    from fa4gen.runtime import validate
    from fa4gen.runtime.validate import TensorMeta

    errs = validate._Errors()
    q, k, v = (TensorMeta(n, (1, 8, 2, 64), (1024, 128, 64, 1), "bfloat16", "cuda:0", 4096) for n in "qkv")
    got = errs.attempt(validate.check_problem, q, k, v, causal=True, softmax_scale=0.125, return_lse=True,
                       layout=False)
    assert not errs and got is not None and got.causal and got.return_lse
    errs.attempt(validate.check_problem, q, k, v, causal="yes", softmax_scale=0.125)
    assert len(errs) == 1
