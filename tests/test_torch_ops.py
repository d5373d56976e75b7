"""fa4gen.attention under torch.compile: the custom op torch.ops.fa4gen.attention_fwd (fa4gen/runtime/torch_ops.py).

CPU part (needs torch, skipped without it; CI installs it with the test extra): the fake
implementation's shapes, dtypes and errors, and fullgraph tracing of a function calling
fa4gen.attention on fake CUDA tensors (FakeTensorMode makes them without a GPU). GPU part (marker `gpu`, an sm_90 GPU): opcheck on real
tensors, a fullgraph inductor compile against eager, and CUDA-graph capture / replay.
Tolerance: the compiled graph calls the same kernel through the same eager path, so the op's o and
lse must equal eager's bitwise (CUDA-graph replays too); only the ops inductor fuses around it
(o * 2 + o2, a sum) get one rounding's slack.
"""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import fa4gen  # noqa: E402
from fa4gen.runtime import launch, torch_ops  # noqa: E402
from fa4gen.runtime.validate import InputTypeError, InputValueError  # noqa: E402

OP = torch.ops.fa4gen.attention_fwd


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_qkv(b=2, sq=100, skv=300, hq=8, hkv=2, d=128, dtype=torch.bfloat16):
    """Fake CUDA tensors; call inside fake_mode()."""
    q = torch.empty(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.empty(b, skv, hkv, d, device="cuda", dtype=dtype)
    v = torch.empty(b, skv, hkv, d, device="cuda", dtype=dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- CPU: the op's fake implementation --------------------------------------------------------------
def test_api_import_needs_no_torch_ops():
    code = "import sys, fa4gen.runtime.api; assert 'fa4gen.runtime.torch_ops' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fake_impl_shapes_and_dtypes(dtype, return_lse):
    with fake_mode():
        q, k, v = fake_qkv(b=3, sq=77, skv=1000, hq=16, hkv=4, d=64, dtype=dtype)
        o, lse = OP(q, k, v, True, None, return_lse)
        assert o.shape == (3, 77, 16, 64) and o.dtype == dtype and o.device == q.device and o.is_contiguous()
        assert lse.dtype == torch.float32 and lse.device == q.device and lse.is_contiguous()
        assert lse.shape == ((3, 16, 77) if return_lse else (0,))
        # the wrapper returns what fa4gen.attention returns
        out = torch_ops.attention(q, k, v, causal=True, return_lse=return_lse)
        if return_lse:
            assert out[0].shape == o.shape and out[1].shape == (3, 16, 77)
        else:
            assert isinstance(out, torch.Tensor) and out.shape == o.shape


def test_fake_impl_takes_strided_views_and_empty_problems():
    with fake_mode():
        qkv = torch.empty(2, 50, 3, 4, 128, device="cuda", dtype=torch.float16)
        q, k, v = qkv.unbind(dim=2)
        assert OP(q, k, v, False, 0.5, True)[0].shape == (2, 50, 4, 128)
        q0 = torch.empty(2, 0, 4, 128, device="cuda", dtype=torch.float16)
        o, lse = OP(q0, k, v, False, None, True)
        assert o.shape == (2, 0, 4, 128) and lse.shape == (2, 4, 0)


def test_fake_impl_validates_like_eager():
    with fake_mode():
        q, k, v = fake_qkv(d=80)
        with pytest.raises(InputValueError, match="head_dim 80 is not supported"):
            OP(q, k, v, False, None, False)
        q, k, v = fake_qkv()
        with pytest.raises(InputTypeError, match="same dtype"):
            OP(q, k.half(), v, False, None, False)
        with pytest.raises(InputValueError, match="multiple of k/v's heads"):
            OP(fake_qkv(hq=7)[0], k, v, False, None, False)
        with pytest.raises(InputValueError, match="softmax_scale must be finite and > 0"):
            OP(q, k, v, False, -1.0, False)
        with pytest.raises(InputTypeError, match="softmax_scale must be a real number"):
            torch_ops.attention(q, k, v, softmax_scale="0.1")
        with pytest.raises(InputTypeError, match="causal must be True or False"):
            torch_ops.attention(q, k, v, causal=1)
    with pytest.raises(InputValueError, match="must be a CUDA tensor, got one on cpu"):
        OP(torch.empty(1, 4, 2, 64, dtype=torch.float16), torch.empty(1, 4, 2, 64, dtype=torch.float16),
           torch.empty(1, 4, 2, 64, dtype=torch.float16), False, None, False)


def test_fake_impl_takes_the_score_modifiers():
    with fake_mode():
        q, k, v = fake_qkv()
        sink = torch.empty(8, device="cuda", dtype=torch.float32)
        o, lse = OP(q, k, v, True, None, True, 127, 0, 30.0, sink)
        assert o.shape == q.shape and lse.shape == (2, 8, 100)
        with pytest.raises(InputValueError, match=r"learnable_sink must have shape \(8,\)"):
            OP(q, k, v, True, None, True, -1, -1, 0.0, torch.empty(4, device="cuda", dtype=torch.float32))
        with pytest.raises(InputValueError, match="softcap must be finite and >= 0"):
            OP(q, k, v, True, None, True, -1, -1, -2.0, None)
        with pytest.raises(InputValueError, match="window_size's left side must be -1"):
            torch_ops.attention(q, k, v, window_size=(-2, 0))
        with pytest.raises(InputTypeError, match="learnable_sink must be a torch.Tensor or None"):
            torch_ops.attention(q, k, v, learnable_sink=[0.0] * 8)
        qv = torch.empty(200, 8, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(600, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.zeros(3, device="cuda", dtype=torch.int32)
        o, lse = torch_ops.attention_varlen(qv, kv, kv, cu, cu, 100, 300, window_size=(64, 64), softcap=50.0,
                                            learnable_sink=sink, return_lse=True)
        assert o.shape == qv.shape and lse.shape == (8, 200)


# ---- CPU: tracing ---------------------------------------------------------------------------------
def _model(q, k, v):
    o = fa4gen.attention(q, k, v, causal=True)
    o2, lse = fa4gen.attention(q, k, v, softmax_scale=0.1, return_lse=True)
    return o * 2 + o2, lse.sum(dim=-1)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile_traces_on_fake_cuda_tensors(backend):
    with fake_mode():
        q, k, v = fake_qkv()
        out, lse_sum = torch.compile(_model, fullgraph=True, backend=backend)(q, k, v)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse_sum.shape == (2, 8) and lse_sum.dtype == torch.float32


def test_explain_one_graph_no_breaks_and_the_op_in_it():
    with fake_mode():
        q, k, v = fake_qkv(d=64, dtype=torch.float16)
        ex = torch._dynamo.explain(_model)(q, k, v)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    code = ex.graphs[0].code
    assert code.count("torch.ops.fa4gen.attention_fwd.default") == 2
    assert "perf_counter" not in code


def test_fullgraph_trace_passes_the_score_modifiers_to_the_op():
    def model(q, k, v, sink):
        return fa4gen.attention(q, k, v, causal=True, window_size=(127, 0), softcap=30.0, learnable_sink=sink,
                                return_lse=True)

    with fake_mode():
        q, k, v = fake_qkv(d=64)
        ex = torch._dynamo.explain(model)(q, k, v, torch.empty(8, device="cuda", dtype=torch.float32))
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    call = [ln for ln in ex.graphs[0].code.splitlines() if "torch.ops.fa4gen.attention_fwd.default" in ln]
    assert len(call) == 1 and "127, 0, 30.0, l_sink_" in call[0], call


def test_dynamic_shapes_compile_once():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v: fa4gen.attention(q, k, v, causal=True), fullgraph=True, backend=counter,
                       dynamic=True)
    with fake_mode():
        for sq, skv in ((100, 300), (257, 1000), (64, 8)):  # (sizes 0 and 1 are specialised)
            q, k, v = fake_qkv(sq=sq, skv=skv)
            assert fn(q, k, v).shape == (2, sq, 8, 128)
    assert counter.frame_count == 1


@pytest.mark.parametrize("what", ["head_dim", "flag", "grad"])
def test_errors_surface_while_tracing(what):
    fn = torch.compile(lambda q, k, v, kw: fa4gen.attention(q, k, v, **kw), fullgraph=True, backend="aot_eager")
    with fake_mode():
        q, k, v = fake_qkv(d=80 if what == "head_dim" else 128)
        kw = {"causal": 1} if what == "flag" else {}
        if what == "grad":
            q.requires_grad_()
        message = {"head_dim": "head_dim 80 is not supported", "flag": "causal must be True or False",
                   "grad": "forward-only"}[what]
        with pytest.raises(Exception, match=message):  # Dynamo wraps it (Unsupported / TorchRuntimeError)
            fn(q, k, v, kw)


def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "attention_eager", lambda *a, **kw: calls.append(a) or "eager")
    monkeypatch.setattr(torch_ops, "attention", lambda *a, **kw: pytest.fail("eager call went through the op"))
    assert fa4gen.attention(1, 2, 3) == "eager" and len(calls) == 1


# ---- GPU ------------------------------------------------------------------------------------------
def _cuda_qkv(b=2, sq=300, skv=1000, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen)
                 for s, h in ((sq, hq), (skv, hkv), (skv, hkv)))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,return_lse,d,dtype", [(False, True, 128, torch.bfloat16),
                                                       (True, False, 64, torch.float16)])
def test_opcheck(causal, return_lse, d, dtype):
    q, k, v = _cuda_qkv(d=d, dtype=dtype)
    torch.library.opcheck(OP, (q, k, v, causal, None, return_lse))
    torch.library.opcheck(OP, (q, k, v, causal, 0.3, return_lse))


@pytest.mark.gpu
def test_inductor_fullgraph_matches_eager():
    q, k, v = _cuda_qkv()
    with torch.no_grad():
        expected = _model(q, k, v)
        o_eager, lse_eager = fa4gen.attention(q, k, v, softmax_scale=0.1, return_lse=True)
        compiled = torch.compile(_model, fullgraph=True)
        got = compiled(q, k, v)
        o_c, lse_c = torch.compile(lambda q, k, v: fa4gen.attention(q, k, v, softmax_scale=0.1, return_lse=True),
                                   fullgraph=True)(q, k, v)
        torch.cuda.synchronize()
    assert torch.equal(o_c, o_eager) and torch.equal(lse_c, lse_eager)  # the op's outputs: the same launch
    # around the op inductor fuses o * 2 + o2 in fp32 and may reorder the sum: allow one bf16 rounding
    torch.testing.assert_close(got[0], expected[0], rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    # (dynamic shapes: test_dynamic_shapes_compile_once on CPU; each inductor compile costs GPU-run seconds)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    q, k, v = _cuda_qkv(hq=8, hkv=8, d=64, dtype=torch.float16)
    static = [t.clone() for t in (q, k, v)]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: loads the kernel (a module load cannot be captured)
            for _ in range(2):
                fa4gen.attention(*static, causal=True, return_lse=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static, lse_static = fa4gen.attention(*static, causal=True, return_lse=True)
        for seed in (1, 2):
            new = _cuda_qkv(hq=8, hkv=8, d=64, dtype=torch.float16, seed=seed)
            for dst, src in zip(static, new):
                dst.copy_(src)
            graph.replay()
            o_ref, lse_ref = fa4gen.attention(*new, causal=True, return_lse=True)
            torch.cuda.synchronize()
            assert torch.equal(o_static, o_ref) and torch.equal(lse_static, lse_ref), f"replay {seed}"


@pytest.mark.gpu
def test_compile_reduce_overhead_cuda_graphs_match_eager():
    q, k, v = _cuda_qkv(sq=512, skv=512, hq=4, hkv=4)
    fn = torch.compile(lambda q, k, v: fa4gen.attention(q, k, v, causal=True) * 2, fullgraph=True,
                       mode="reduce-overhead")
    with torch.no_grad():
        ref = fa4gen.attention(q, k, v, causal=True) * 2
        for _ in range(3):  # warm-up run(s), then the recorded graph replays
            out = fn(q, k, v).clone()
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
