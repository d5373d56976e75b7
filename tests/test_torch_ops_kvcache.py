"""fa4gen.attention_with_kvcache under torch.compile: the custom op
torch.ops.fa4gen.attention_with_kvcache_fwd (fa4gen/runtime/torch_ops.py).

CPU part (needs torch; CI installs it): the fake implementation's shapes, dtypes and errors
(contiguous and paged caches), and fullgraph tracing of a decode step on fake CUDA tensors. GPU part
(marker `gpu`, an sm_90 GPU): opcheck, a fullgraph inductor compile against eager, and CUDA-graph
capture of a decode step replayed while the cache grows (the lengths live on the GPU). The op runs
the eager path, so its outputs must equal eager's bitwise.
"""

import pytest

torch = pytest.importorskip("torch")

import fa4gen  # noqa: E402
from fa4gen.runtime import launch, torch_ops  # noqa: E402
from fa4gen.runtime.validate import InputTypeError, InputValueError  # noqa: E402

OP = torch.ops.fa4gen.attention_with_kvcache_fwd


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_decode(b=3, sq=1, smax=1000, hq=8, hkv=2, d=128, dv=None, dtype=torch.bfloat16, page_size=0):
    """Fake CUDA q, k_cache, v_cache, cache_seqlens, page_table (None when contiguous); inside fake_mode()."""
    dv = dv or d
    q = torch.empty(b, sq, hq, d, device="cuda", dtype=dtype)
    if page_size:
        pages = -(-smax // page_size)
        k = torch.empty(b * pages, page_size, hkv, d, device="cuda", dtype=dtype)
        v = torch.empty(b * pages, page_size, hkv, dv, device="cuda", dtype=dtype)
        pt = torch.empty(b, pages, device="cuda", dtype=torch.int32)
    else:
        k = torch.empty(b, smax, hkv, d, device="cuda", dtype=dtype)
        v = torch.empty(b, smax, hkv, dv, device="cuda", dtype=dtype)
        pt = None
    lens = torch.empty(b, device="cuda", dtype=torch.int32)
    return q, k, v, lens, pt


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- CPU: the fake implementation -------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fake_impl_shapes_and_dtypes(page_size, return_lse):
    with fake_mode():
        q, k, v, lens, pt = fake_decode(b=3, sq=4, hq=16, hkv=4, d=64, dtype=torch.float16, page_size=page_size)
        o, lse = OP(q, k, v, lens, pt, True, None, 0, return_lse)
        assert o.shape == (3, 4, 16, 64) and o.dtype == torch.float16 and o.is_contiguous()
        assert lse.dtype == torch.float32 and lse.shape == ((3, 16, 4) if return_lse else (0,))
        out = torch_ops.attention_with_kvcache(q, k, v, lens, pt, return_lse=return_lse)
        if return_lse:
            assert out[0].shape == o.shape and out[1].shape == (3, 16, 4)
        else:
            assert isinstance(out, torch.Tensor) and out.shape == o.shape


def test_fake_impl_takes_dv_and_the_score_modifiers():
    with fake_mode():
        q, k, v, lens, pt = fake_decode(d=192, dv=128, hq=8, hkv=8, page_size=16)
        sink = torch.empty(8, device="cuda", dtype=torch.float32)
        o, lse = OP(q, k, v, lens, pt, True, 0.1, 3, True, 127, 0, 30.0, sink)
        assert o.shape == (3, 1, 8, 128) and lse.shape == (3, 8, 1)


def test_fake_impl_validates_like_eager():
    with fake_mode():
        q, k, v, lens, pt = fake_decode(page_size=64)
        with pytest.raises(InputTypeError, match="page_table must have dtype int32"):
            OP(q, k, v, lens, pt.long(), True, None, 0, False)
        with pytest.raises(InputTypeError, match="cache_seqlens must have dtype int32"):
            OP(q, k, v, lens.long(), pt, True, None, 0, False)
        with pytest.raises(InputValueError, match="cache_seqlens must have shape"):
            OP(q, k, v, torch.empty(2, device="cuda", dtype=torch.int32), pt, True, None, 0, False)
        with pytest.raises(InputValueError, match="multiple of k/v's heads"):
            OP(fake_decode(hq=7)[0], k, v, lens, pt, True, None, 0, False)
        with pytest.raises(InputValueError, match="softcap must be finite and >= 0"):
            OP(q, k, v, lens, pt, True, None, 0, False, -1, -1, -3.0, None)
        with pytest.raises(InputTypeError, match="num_splits must be an int"):
            torch_ops.attention_with_kvcache(q, k, v, lens, pt, num_splits=2.0)
        with pytest.raises(InputTypeError, match="cache_seqlens must be a torch.Tensor"):
            torch_ops.attention_with_kvcache(q, k, v, [5, 5, 5], pt)
        with pytest.raises(InputTypeError, match="causal must be True or False"):
            torch_ops.attention_with_kvcache(q, k, v, lens, pt, causal=1)
        with pytest.raises(InputValueError, match="window_size's left side must be -1"):
            torch_ops.attention_with_kvcache(q, k, v, lens, pt, window_size=(-2, 0))
        q.requires_grad_()
        with pytest.raises(InputValueError, match="attention_with_kvcache is forward-only"):
            torch_ops.attention_with_kvcache(q, k, v, lens, pt)


def test_batch_invariant_is_an_op_argument_validated_once():
    """batch_invariant reaches the op (its fake implementation resolves it in check_kvcache_problem, as
    eager does) and a decode step's graph carries it."""
    with fake_mode():
        q, k, v, lens, pt = fake_decode(page_size=64)
        assert OP(q, k, v, lens, pt, True, None, 0, False, -1, -1, 0.0, None, True)[0].shape == q.shape
        with pytest.raises(InputTypeError, match="batch_invariant must be True or False, got int"):
            torch_ops.attention_with_kvcache(q, k, v, lens, pt, batch_invariant=1)
        ex = torch._dynamo.explain(lambda *a: fa4gen.attention_with_kvcache(*a, batch_invariant=True))(q, k, v, lens, pt)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    call = [ln for ln in ex.graphs[0].code.splitlines() if "attention_with_kvcache_fwd.default" in ln]
    assert len(call) == 1 and "0, False, -1, -1, 0.0, None, True)" in call[0], call


# ---- CPU: tracing ---------------------------------------------------------------------------------
def _decode_step(q, k, v, lens, pt, sink):
    o, lse = fa4gen.attention_with_kvcache(q, k, v, lens, pt, window_size=(127, 0), learnable_sink=sink,
                                           return_lse=True)
    return o.float() * 2, lse.amax(dim=1)


@pytest.mark.parametrize("page_size", [0, 16])
def test_explain_one_graph_no_breaks_and_the_op_in_it(page_size):
    with fake_mode():
        args = fake_decode(d=64, page_size=page_size)
        sink = torch.empty(8, device="cuda", dtype=torch.float32)
        ex = torch._dynamo.explain(_decode_step)(*args, sink)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    call = [ln for ln in ex.graphs[0].code.splitlines() if "torch.ops.fa4gen.attention_with_kvcache_fwd.default" in ln]
    assert len(call) == 1 and "127, 0, 0.0, l_sink_" in call[0], call
    assert "perf_counter" not in ex.graphs[0].code


def test_fullgraph_compile_traces_and_dynamic_shapes_compile_once():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_decode_step, fullgraph=True, backend=counter, dynamic=True)
    with fake_mode():
        sink = torch.empty(8, device="cuda", dtype=torch.float32)
        for b, smax in ((3, 1000), (5, 4096), (7, 300)):  # batch and cache capacity vary
            o, lse = fn(*fake_decode(b=b, smax=smax, d=64, page_size=64), sink)
            assert o.shape == (b, 1, 8, 64) and o.dtype == torch.float32 and lse.shape == (b, 1)
    assert counter.frame_count == 1


def test_errors_surface_while_tracing():
    fn = torch.compile(lambda *a: fa4gen.attention_with_kvcache(*a), fullgraph=True, backend="aot_eager")
    with fake_mode():
        q, k, v, lens, pt = fake_decode(page_size=64)
        with pytest.raises(Exception, match="page_table must have dtype int32"):
            fn(q, k, v, lens, pt.long())


def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "attention_with_kvcache_eager", lambda *a, **kw: calls.append(a) or "eager")
    monkeypatch.setattr(torch_ops, "attention_with_kvcache",
                        lambda *a, **kw: pytest.fail("eager call went through the op"))
    assert fa4gen.attention_with_kvcache(1, 2, 3, 4) == "eager" and len(calls) == 1


# ---- GPU ------------------------------------------------------------------------------------------
def _cuda_decode(b=4, sq=1, smax=3000, hq=8, hkv=2, d=128, page_size=0, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    if page_size:
        pages = -(-smax // page_size)
        k = torch.randn(b * pages, page_size, hkv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b * pages, page_size, hkv, d, device="cuda", dtype=dtype, generator=gen)
        pt = torch.randperm(b * pages, device="cuda", generator=gen).to(torch.int32).reshape(b, pages)
    else:
        k = torch.randn(b, smax, hkv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b, smax, hkv, d, device="cuda", dtype=dtype, generator=gen)
        pt = None
    lens = torch.randint(1, smax + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    return q, k, v, lens, pt


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,return_lse", [(0, True), (64, False)])
def test_opcheck(page_size, return_lse):
    q, k, v, lens, pt = _cuda_decode(page_size=page_size)
    torch.library.opcheck(OP, (q, k, v, lens, pt, True, None, 0, return_lse))
    torch.library.opcheck(OP, (q, k, v, lens, pt, True, 0.2, 3, return_lse, 255, 0, 30.0, None))


@pytest.mark.gpu
def test_inductor_fullgraph_matches_eager():
    q, k, v, lens, pt = _cuda_decode(page_size=16)
    sink = torch.randn(8, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        o_eager, lse_eager = fa4gen.attention_with_kvcache(q, k, v, lens, pt, window_size=(127, 0),
                                                           learnable_sink=sink, return_lse=True)
        o_c, lse_c = torch.compile(
            lambda *a: fa4gen.attention_with_kvcache(*a, window_size=(127, 0), learnable_sink=sink, return_lse=True),
            fullgraph=True)(q, k, v, lens, pt)
        torch.cuda.synchronize()
    assert torch.equal(o_c, o_eager) and torch.equal(lse_c, lse_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 64])
def test_cuda_graph_decode_loop_replays_as_the_cache_grows(page_size):
    """A serving loop's shape: one captured decode step, replayed with a new query and the lengths
    advanced in place on the GPU; every replay equals an eager call on the same inputs."""
    q, k, v, lens, pt = _cuda_decode(b=4, smax=4096, page_size=page_size)
    lens.clamp_(max=3000)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: loads the kernels (a module load cannot be captured)
            for _ in range(2):
                fa4gen.attention_with_kvcache(q, k, v, lens, pt, return_lse=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static, lse_static = fa4gen.attention_with_kvcache(q, k, v, lens, pt, return_lse=True)
        for step in range(3):
            q.copy_(_cuda_decode(b=4, smax=4096, page_size=page_size, seed=10 + step)[0])
            lens.add_(37)
            graph.replay()
            o_ref, lse_ref = fa4gen.attention_with_kvcache(q, k, v, lens, pt, return_lse=True)
            torch.cuda.synchronize()
            assert torch.equal(o_static, o_ref) and torch.equal(lse_static, lse_ref), f"step {step}"
