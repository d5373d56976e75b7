"""fa4gen.attention_varlen on an H100/H200 (marker `gpu`; skipped without one): the sm_90a varlen
kernel against a per-sequence float32 reference, guard regions around O and LSE, device-side
offsets the host cannot check (the kernel clamps), and the host-side input errors.

Every run fills O and LSE with NaN inside a larger buffer whose guard regions before and after hold
a sentinel: an element never written shows as NaN, a write outside O or LSE changes a guard.
Tolerances are test_gpu.py's (derived there)."""

import zlib

import pytest

torch = pytest.importorskip("torch")

from fa4gen.runtime import api  # noqa: E402
from fa4gen.spec.config import KernelConfig  # noqa: E402
from fa4gen.runtime.validate import DeviceError, Fa4genInputError, InputTypeError, InputValueError  # noqa: E402

from test_gpu import TORCH_DTYPE, check_against_reference  # noqa: E402

GUARD = 4096  # elements of sentinel before and after every output
SENTINEL = 12345.0


def ragged_lengths(n: int, seed: int, long_max: int = 5000) -> list[int]:
    """Many short sequences (0-300, a few exactly 0 or 1), a few long ones up to long_max."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = torch.rand((), generator=g).item()
        if i % 7 == 3:
            out.append(0)
        elif r < 0.7:
            out.append(int(torch.randint(1, 300, (), generator=g)))
        else:
            out.append(int(torch.randint(300, long_max + 1, (), generator=g)))
    return out


def _cu(lens, device):
    c = [0]
    for x in lens:
        c.append(c[-1] + x)
    return torch.tensor(c, dtype=torch.int32, device=device)


def guarded(shape, dtype, device):
    """(view, whole buffer): a NaN-filled contiguous view with SENTINEL guard regions around it."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device=device)
    view = buf[GUARD:GUARD + n].view(shape)
    view.fill_(float("nan"))
    return view, buf


def assert_guards(buf, label):
    head, tail = buf[:GUARD], buf[-GUARD:]
    assert (head == SENTINEL).all() and (tail == SENTINEL).all(), f"{label}: a write outside the output's bounds"


def run_varlen_poisoned(q, k, v, cu_q, cu_k, causal, scale, dtype, seqused_k=None, max_q=None, max_k=None):
    tq, hq, d = q.shape
    dv = v.shape[-1]  # o's columns (head_dim_v)
    cfg = KernelConfig(arch="sm_90a", head_dim=d, head_dim_v=dv, causal=causal, gqa_ratio=hq // k.shape[1], dtype=dtype,
                       varlen=True)
    kernel, _ = api.get_kernel(cfg, q.device)
    o, obuf = guarded((tq, hq, dv), q.dtype, q.device)
    lse, lbuf = guarded((hq, tq), torch.float32, q.device)
    kernel.varlen(q, k, v, o, cu_q, cu_k, max_q or tq, max_k or k.shape[0], lse=lse, seqused_k=seqused_k,
                  softmax_scale=scale)
    torch.cuda.synchronize()
    assert_guards(obuf, "O")
    assert_guards(lbuf, "LSE")
    return o, lse


def check_per_sequence(o, lse, q, k, v, lens_q, lens_k, used_k, causal, scale, dtype, label):
    q0 = k0 = 0
    for b, (lq, lk, uk) in enumerate(zip(lens_q, lens_k, used_k)):
        if lq:
            sl = slice(q0, q0 + lq)
            ks = slice(k0, k0 + uk)
            check_against_reference(o[None, sl], lse[None, :, sl], q[None, sl], k[None, ks], v[None, ks], causal,
                                    scale, dtype, f"{label} sequence {b} ({lq} queries, {uk} keys)")
        q0, k0 = q0 + lq, k0 + lk
    assert q0 == o.shape[0]


def _inputs(lens_q, lens_k, hq, hkv, d, dtype, label, device="cuda", dv=None):
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(label.encode()))
    dt = TORCH_DTYPE[dtype]
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, generator=gen, device=device).to(dt)
    k = torch.randn(tk, hkv, d, generator=gen, device=device).to(dt)
    v = torch.randn(tk, hkv, d if dv is None else dv, generator=gen, device=device).to(dt)
    return q, k, v


# (B, head dim, dtype, causal, G, Hkv, k lengths differ from q lengths)
CASES = [
    (64, 128, "bf16", False, 1, 2, False),
    (64, 128, "bf16", True, 1, 2, True),
    (40, 64, "fp16", True, 4, 2, True),
    (40, 128, "fp16", False, 8, 1, True),
    (24, 64, "bf16", False, 8, 1, False),
    (24, 128, "bf16", True, 4, 1, False),
    (17, 64, "bf16", True, 1, 3, True),
    (9, 128, "fp16", True, 3, 2, True),  # a ratio that does not divide 128: one head per tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-d{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}-g{c[4]}"
                                                     f"-hkv{c[5]}{'-qk' if c[6] else ''}")
def test_varlen_matches_per_sequence_reference(case, exact_fp32):
    b, d, dtype, causal, g, hkv, differ = case
    lens_q = ragged_lengths(b, seed=b * 31 + d)
    lens_k = ragged_lengths(b, seed=b * 17 + d + 1) if differ else list(lens_q)
    if differ:  # and some sequences with keys but no queries, queries but no keys
        lens_q[1], lens_k[1] = 0, 57
        lens_q[2], lens_k[2] = 33, 0
    label = str(case)
    q, k, v = _inputs(lens_q, lens_k, g * hkv, hkv, d, dtype, label)
    scale = d ** -0.5
    o, lse = run_varlen_poisoned(q, k, v, _cu(lens_q, "cuda"), _cu(lens_k, "cuda"), causal, scale, dtype)
    check_per_sequence(o, lse, q, k, v, lens_q, lens_k, lens_k, causal, scale, dtype, label)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_limits_the_keys(causal, exact_fp32):
    lens_q = [100, 0, 300, 5, 129]
    lens_k = [400, 50, 300, 600, 1000]
    used = [130, 0, 300, 1, 700]
    q, k, v = _inputs(lens_q, lens_k, 8, 2, 128, "bf16", f"seqused{causal}")
    su = torch.tensor(used, dtype=torch.int32, device="cuda")
    o, lse = run_varlen_poisoned(q, k, v, _cu(lens_q, "cuda"), _cu(lens_k, "cuda"), causal, 128 ** -0.5, "bf16",
                                 seqused_k=su)
    check_per_sequence(o, lse, q, k, v, lens_q, lens_k, used, causal, 128 ** -0.5, "bf16", "seqused_k")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_equal_the_dense_kernel_bitwise(causal):
    """B sequences of one length: the same arithmetic as the dense kernel, so the same bits."""
    bsz, s, hq, hkv, d = 3, 1000, 8, 2, 128
    q, k, v = (torch.randn(bsz, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    o_d, lse_d = api.attention(q, k, v, causal=causal, return_lse=True)
    cu = torch.arange(0, (bsz + 1) * s, s, dtype=torch.int32, device="cuda")
    o_v, lse_v = api.attention_varlen(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), cu, cu,
                                      s, s, causal=causal, return_lse=True)
    assert torch.equal(o_v.view(bsz, s, hq, d), o_d)
    assert torch.equal(lse_v.view(hq, bsz, s).transpose(0, 1), lse_d)


@pytest.mark.gpu
def test_garbage_offsets_stay_in_bounds():
    """Offsets the host cannot see (non-monotonic, past the end, negative): the kernel clamps them
    and never writes outside O / LSE or faults (a fault would poison the context: the test after
    would fail)."""
    tq, tk = 700, 900
    q, k, v = _inputs([tq], [tk], 4, 1, 64, "bf16", "garbage")
    for cu_q, cu_k in (([0, 500, 100, 700, 650], [0, 900, 10, 5, 900]),
                       ([0, 10_000_000, -5, 700, 2**31 - 1], [-100, 50, 2**31 - 1, 0, 900]),
                       ([300, 200, 100, 0, 0], [900, 900, 900, 900, 900])):
        cq = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
        ck = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
        run_varlen_poisoned(q, k, v, cq, ck, True, 0.125, "bf16", max_q=tq, max_k=tk)
    torch.cuda.synchronize()
    x = torch.ones(4, device="cuda")
    assert x.sum().item() == 4  # the context still works


@pytest.mark.gpu
def test_varlen_input_errors():
    dev = "cuda"
    q = torch.randn(100, 4, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(120, 2, 64, device=dev, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 40, 100], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 60, 120], dtype=torch.int32, device=dev)
    f = api.attention_varlen
    with pytest.raises(InputTypeError, match="int32"):
        f(q, k, k, cu_q.long(), cu_k, 60, 60)
    with pytest.raises(DeviceError, match="cu_seqlens_k"):
        f(q, k, k, cu_q, cu_k.cpu(), 60, 60)
    with pytest.raises(InputValueError, match="3 entries"):
        f(q, k, k, cu_q, cu_k[:2], 60, 60)
    with pytest.raises(InputValueError, match="smaller than a real sequence length"):
        f(q, k, k, cu_q, cu_k, 49, 60)
    with pytest.raises(InputValueError, match="3 dims"):
        f(q[None], k, k, cu_q, cu_k, 60, 60)
    with pytest.raises(InputValueError, match="seqused_k must have 2 entries"):
        f(q, k, k, cu_q, cu_k, 60, 60, seqused_k=torch.zeros(3, dtype=torch.int32, device=dev))
    with pytest.raises(Fa4genInputError) as e:
        f(q.float(), k, k, cu_q.long(), cu_k, 60, 60)
    assert "float32" in str(e.value) and "int32" in str(e.value)  # every problem in one error
    o = f(q, k, k, cu_q, cu_k, 60, 60)  # and the valid call runs
    assert o.shape == q.shape and not torch.isnan(o).any()


@pytest.mark.gpu
def test_prebuilt_varlen_kernel_equals_attention_varlen(tmp_path):
    from click.testing import CliRunner

    import fa4gen
    from fa4gen.cli import main

    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--varlen", "--causal", "--gqa", "4",
                                  "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    kernel = fa4gen.load(tmp_path / "fa4_sm90a_d128_bf16_causal_gqa4_varlen.cubin")
    lens = [300, 0, 1000, 77]
    q, k, v = _inputs(lens, lens, 8, 2, 128, "bf16", "prebuilt")
    cu = _cu(lens, "cuda")
    o1, l1 = kernel.varlen(q, k, v, cu, cu, 1000, 1000, return_lse=True)
    o2, l2 = api.attention_varlen(q, k, v, cu, cu, 1000, 1000, causal=True, return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    with pytest.raises(InputValueError, match="varlen kernel"):
        kernel(q[None], k[None], v[None])


@pytest.mark.gpu
def test_varlen_under_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces attention_varlen through its custom op; same bits as eager."""
    lens = [300, 0, 129, 1000]
    q, k, v = _inputs(lens, lens, 8, 2, 64, "bf16", "compile")
    cu = _cu(lens, "cuda")

    def f(q, k, v, cu):
        return api.attention_varlen(q, k, v, cu, cu, 1000, 1000, causal=True, return_lse=True)

    o1, l1 = torch.compile(f, fullgraph=True)(q, k, v, cu)
    o2, l2 = f(q, k, v, cu)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    torch.library.opcheck(torch.ops.fa4gen.attention_varlen_fwd,
                          (q, k, v, cu, cu, 1000, 1000, True, None, True, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_dynamic_deal_repeats_and_replays_the_same_bits():
    """The varlen kernel deals its tasks from a counter each launch zeroes (plan.dynamic_tasks): back
    to back launches, launches on a second stream and a CUDA-graph replay (the zeroing captured with
    the kernel) all give the bits of the first launch, and every sequence still matches the reference
    (a counter left over from an earlier launch would skip tasks: rows of NaN in the poisoned output)."""
    lens = ragged_lengths(96, seed=5, long_max=3000)
    q, k, v = _inputs(lens, lens, 8, 2, 64, "bf16", "dynamic deal")
    cu = _cu(lens, "cuda")
    mx = max(lens)

    def run():
        return api.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True, return_lse=True)

    o0, l0 = run()
    for _ in range(5):
        o1, l1 = run()
        assert torch.equal(o1, o0) and torch.equal(l1, l0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [run() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(o, o0) and torch.equal(lse, l0) for o, lse in outs)
    run()  # warm-up outside the capture (the kernel is loaded, its validation cached)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lg = run()
    for _ in range(3):
        og.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, o0) and torch.equal(lg, l0)
    o, lse = run_varlen_poisoned(q, k, v, cu, cu, True, 64 ** -0.5, "bf16")
    check_per_sequence(o, lse, q, k, v, lens, lens, lens, True, 64 ** -0.5, "bf16", "dynamic deal")
