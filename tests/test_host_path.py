"""The per-call host path: the eager path's validation memo (fa4gen.runtime.launch.prepared: a call
reuses a validated Problem only when everything validation reads is the same, and never skips a
failing check) and the launch's packed parameter buffer (plan.param_buffer_layout)."""

import struct
import types

import pytest

from fa4gen.runtime import launch
from fa4gen.spec import plan
from fa4gen.spec.config import KernelConfig

STRIDED = object()


class FakeTensor:
    """What _tensor_sig reads of a torch tensor."""

    def __init__(self, shape=(1, 128, 8, 64), dtype="bfloat16", device=("cuda", 0), ptr=1 << 20, strides=None,
                 layout=STRIDED, nested=False, cuda=True):
        self.shape, self.dtype, self.device, self._ptr = tuple(shape), dtype, device, ptr
        if strides is None:
            strides, acc = [], 1
            for s in reversed(shape):
                strides.insert(0, acc)
                acc *= s
        self._strides = tuple(strides)
        self.layout, self.is_nested, self.is_cuda = layout, nested, cuda

    def stride(self):
        return self._strides

    def data_ptr(self):
        return self._ptr


class SubTensor(FakeTensor):
    pass


TORCH = types.SimpleNamespace(Tensor=FakeTensor, strided=STRIDED)


def sig(*tensors, scalars=(False, None, False, (-1, -1), 0)):
    return launch.call_signature(TORCH, "dense", tensors, scalars)


def test_every_field_validation_reads_is_in_the_key():
    base = sig(FakeTensor())
    assert base is not None and base == sig(FakeTensor())
    for other in (FakeTensor(shape=(1, 128, 8, 128)), FakeTensor(dtype="float16"), FakeTensor(device=("cuda", 1)),
                  FakeTensor(strides=(128 * 8 * 64, 8 * 64, 64, 2)), FakeTensor(ptr=(1 << 20) + 8)):
        assert sig(other) != base, vars(other)
    # the pointer matters only modulo 16 (TMA's alignment; the offsets' 4 divides it)
    assert sig(FakeTensor(ptr=(1 << 20) + 4096)) == base
    # an absent optional tensor is a signature of its own
    assert sig(FakeTensor(), None) != sig(FakeTensor(), FakeTensor(shape=(8,)))


@pytest.mark.parametrize("a, b", [
    ((True, None, False, (-1, -1), 0), (1, None, False, (-1, -1), 0)),  # bool vs int: equal and hash alike
    ((False, None, False, (-1, -1), 0), (False, None, False, (-1, -1), 0.0)),  # int vs float softcap
    ((False, 0.125, False, (-1, -1), 0), (False, 0.25, False, (-1, -1), 0)),
    ((False, None, False, (128, 0), 0), (False, None, False, (128, False), 0)),  # inside the window tuple too
    ((False, None, False, (-1, -1), 0), (False, None, True, (-1, -1), 0)),
])
def test_scalars_differ_by_type_and_value(a, b):
    assert sig(FakeTensor(), scalars=a) != sig(FakeTensor(), scalars=b)


@pytest.mark.parametrize("tensor, scalars", [
    (SubTensor(), (False, None, False, (-1, -1), 0)),  # a subclass (Parameter, FakeTensor, ...)
    (FakeTensor(layout=object()), (False, None, False, (-1, -1), 0)),  # sparse
    (FakeTensor(nested=True), (False, None, False, (-1, -1), 0)),
    (FakeTensor(cuda=False), (False, None, False, (-1, -1), 0)),  # CPU tensors: validated (and refused) in full
    (FakeTensor(), (False, FakeTensor(shape=()), False, (-1, -1), 0)),  # a 0-d tensor as the scale
    (FakeTensor(), (False, None, False, [-1, -1], 0)),  # a list window
    (FakeTensor(), (False, None, False, (-1, -1), 2.0 ** 0.5 + 0j)),  # a complex softcap
])
def test_calls_without_a_signature(tensor, scalars):
    assert sig(tensor, scalars=scalars) is None


def _problem():
    return types.SimpleNamespace(relayout=(("k", "its data pointer is not 16-byte aligned"),), is_empty=False,
                                 no_keys=False)


def test_prepared_validates_a_signature_once_and_never_memoises_a_failure(monkeypatch):
    monkeypatch.setattr(launch, "_calls", launch._Memo(4))
    monkeypatch.setattr(launch, "config_fields", lambda p: ("fields",))
    monkeypatch.setattr(launch.validate, "canonical_strides", lambda shape, strides: tuple(strides))
    calls = []

    def ok():
        calls.append("ok")
        return _problem()

    q, k, v = FakeTensor(), FakeTensor(ptr=(1 << 20) + 8), FakeTensor()
    inputs = ((q, "q"), (k, "k"), (v, "v"))
    a = launch.prepared(TORCH, "dense", (q, k, v), (False,), ok, inputs)
    b = launch.prepared(TORCH, "dense", (q, k, v), (False,), ok, inputs)
    assert a is b and calls == ["ok"]
    assert a.takes == (None, "its data pointer is not 16-byte aligned", None) and a.fields == ("fields",)

    def bad():
        calls.append("bad")
        raise launch.validate.InputValueError("refused")

    for _ in range(2):  # the same signature fails every time: nothing memoised
        with pytest.raises(launch.validate.InputValueError):
            launch.prepared(TORCH, "dense", (q, k, v), (True,), bad, inputs)
    assert calls == ["ok", "bad", "bad"]
    # no signature: validated on every call
    launch.prepared(TORCH, "dense", (SubTensor(), k, v), (False,), ok, inputs)
    launch.prepared(TORCH, "dense", (SubTensor(), k, v), (False,), ok, inputs)
    assert calls == ["ok", "bad", "bad", "ok", "ok"]


def test_empty_and_keyless_problems_need_no_kernel(monkeypatch):
    """A problem with no output (Hq = 0 here: GQA ratio 0) or no key launches nothing: preparing it
    must not ask for its kernel's config, which such sizes cannot make."""
    from fa4gen.runtime.validate import check_problem
    from test_api_validation import qkv

    monkeypatch.setattr(launch, "_calls", launch._Memo(4))
    monkeypatch.setattr(launch.validate, "canonical_strides", lambda shape, strides: tuple(strides))
    for kw in (dict(hq=0, hkv=0), dict(skv=0)):
        q, k, v = qkv(**kw)
        prep = launch.prepared(TORCH, "dense", (FakeTensor(),), (kw.get("skv"),), lambda: check_problem(q, k, v),
                               ((FakeTensor(), "q"), (FakeTensor(), "k"), (FakeTensor(), "v")))
        assert prep.fields is None and (prep.problem.is_empty or prep.problem.no_keys)


def test_memo_is_bounded(monkeypatch):
    memo = launch._Memo(3)
    for i in range(10):
        memo.put(("k", i), i)
        assert len(memo._d) <= 3
    assert memo.get(("k", 9)) == 9 and memo.get(None) is None


def test_real_torch_tensors_have_what_the_signature_reads():
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert launch.call_signature(torch, "dense", (t,), ()) is None  # a CPU tensor: validated in full
    assert t.layout is torch.strided and t.is_nested is False and isinstance(t.data_ptr(), int)


def _offsets(fmt: str) -> list[int]:
    """The byte offset of each field of a '<'-format made of 'x' pads, 'Ns' blobs and I/i/f/Q codes."""
    import re

    out, off = [], 0
    for pads, n, code in re.findall(r"(x*)(\d*)([sIifQ])", fmt[1:]):
        off += len(pads)
        out.append(off)
        off += int(n) if code == "s" else struct.calcsize("<" + code)
    return out


def test_param_buffer_layout_follows_the_ptx_abi():
    params = plan.ABI_PARAMS
    fmt, offsets = plan.param_buffer_layout([d for _, d in params])
    # four 64-byte-aligned 128-byte tensor maps, lse_ptr at 512, eight 4-byte scalars, padded to 64
    assert offsets == (0, 128, 256, 384, 512, 520, 524, 528, 532, 536, 540, 544, 548)
    assert _offsets(fmt) == list(offsets) and struct.calcsize(fmt) == 576
    # every parameter at a multiple of its alignment, in every variant's signature
    for cfg in (KernelConfig(arch="sm_90a", kvcache=True, window=True, softcap=True, sinks=True),
                KernelConfig(arch="sm_90a", varlen=True, softcap=True, sinks=True)):
        decls = [d for _, d in plan.abi_params(cfg)]
        fmt, offsets = plan.param_buffer_layout(decls)
        assert _offsets(fmt) == list(offsets)
        for decl, off in zip(decls, offsets):
            align = 64 if ".align 64" in decl else 8 if ".u64" in decl else 4
            assert off % align == 0, (decl, off)
        assert struct.calcsize(fmt) % 64 == 0
    # a u64 after an odd number of 4-byte scalars is padded to 8
    assert plan.param_buffer_layout([".param .u32 a", ".param .u64 b"]) == ("<IxxxxQ", (0, 8))
    with pytest.raises(ValueError, match="this runtime can pack"):
        plan.param_buffer_layout([".param .v2 .u32 x"])


def test_launch_config_structs_match_the_driver_abi():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute as runtime.py lays them out (cuda.h:
    seven unsigned ints, the stream pointer 8-aligned at 32, the attribute pointer, their count; an
    attribute is its 4-byte id padded to 8 and a 64-byte value union)."""
    import ctypes

    from fa4gen.runtime.runtime import _LaunchAttribute, _LaunchConfig

    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert [(_LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset, _LaunchConfig.numAttrs.offset)] == [(32, 40, 48)]
    assert ctypes.sizeof(_LaunchConfig) == 56
