"""fa4gen.integrations.transformers: the attention function transformers calls with
attn_implementation="fa4gen".

CPU, without transformers (CI): which entry point each call takes (prefill, decode over the cache,
padded batch), the unpadding and the scatter back, the window / softcap / sinks / scale passed on, and
the errors; fa4gen's three entry points replaced by stand-ins that compute the float64 reference
(fa4gen.evidence.reference.attention_exact) on the CPU and record their arguments. The expected
outputs are computed independently here, the way transformers' eager attention does: a positional
mask (causal, padding, sliding window) over the full key range, softcap, a sink logit column.
CPU with transformers installed (skipped otherwise): tiny random Llama-, Mistral- and gpt-oss-like
models with attn_implementation="fa4gen" (same stand-ins) against the same model with "eager":
padded prefill and greedy generate(). GPU (marker `gpu`, transformers installed): the real kernels,
logit error against a float32 model within 1.25x the model's own bf16 sdpa error.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fa4gen.runtime import api  # noqa: E402
from fa4gen.evidence.reference import attention_exact  # noqa: E402
from fa4gen.integrations import transformers as fa4hf  # noqa: E402


class Recorder:
    """Stand-ins for fa4gen's entry points on CPU tensors (float64 reference, returned in q's dtype)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _ref(q, k, v, causal, scale, window_size, softcap, sink):
        win = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        o, _ = attention_exact(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal, scale,
                               window=win, softcap=softcap, sinks=None if sink is None else sink.double().numpy())
        return torch.from_numpy(o)

    def attention(self, q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  learnable_sink=None):
        self.calls.append(("attention", dict(causal=causal, scale=softmax_scale, window=window_size, softcap=softcap,
                                             sink=learnable_sink, q=q.shape, k=k.shape)))
        return self._ref(q, k, v, causal, softmax_scale, window_size, softcap, learnable_sink).to(q.dtype)

    def attention_with_kvcache(self, q, kc, vc, lens, page_table=None, causal=True, softmax_scale=None,
                               window_size=(-1, -1), softcap=0.0, learnable_sink=None):
        self.calls.append(("kvcache", dict(causal=causal, scale=softmax_scale, window=window_size, lens=lens.tolist(),
                                           cache_is_view=not kc.is_contiguous())))
        outs = [self._ref(q[b:b + 1], kc[b:b + 1, :int(n)], vc[b:b + 1, :int(n)], causal, softmax_scale, window_size,
                          softcap, learnable_sink) for b, n in enumerate(lens.tolist())]
        return torch.cat(outs).to(q.dtype)

    def attention_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, learnable_sink=None):
        cq, ck = cu_q.tolist(), cu_k.tolist()
        self.calls.append(("varlen", dict(cu_q=cq, cu_k=ck, max=(max_q, max_k), window=window_size)))
        outs = [self._ref(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]], causal,
                          softmax_scale, window_size, softcap, learnable_sink)[0] for i in range(len(cq) - 1)]
        return torch.cat(outs).to(q.dtype)


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    for name in ("attention", "attention_varlen", "attention_with_kvcache"):  # fa4gen.<name> reads api.<name>
        monkeypatch.setattr(api, name, getattr(r, name))
    return r


class Layer:
    """What the attention function reads of a transformers attention module."""
    is_causal = True
    training = False


def eager_expected(query, key, value, pad, scaling, sliding_window=None, softcap=None, sinks=None):
    """transformers' eager attention, float64: HF layouts (B, H, S, D); pad (B, Skv) bool over the
    key positions (the queries are the last Sq of them); padded query rows are zero."""
    b, hq, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    g = hq // hkv
    k = key.double().repeat_interleave(g, dim=1)
    v = value.double().repeat_interleave(g, dim=1)
    s = query.double() @ k.transpose(-1, -2) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(skv - sq, skv)[:, None]
    kpos = torch.arange(skv)[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (kpos > qpos - sliding_window)
    allowed = allowed[None, None] & pad[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(b, -1, sq, 1)], dim=-1)
    m = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True)
    p = torch.nan_to_num(p[..., :skv])
    o = (p @ v).transpose(1, 2)  # (B, Sq, H, DV)
    return o * pad[:, -sq:, None, None]


def inputs(b=3, hq=8, hkv=2, sq=37, skv=37, d=64, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(b, hq, sq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, hkv, skv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, skv, dv, generator=g).to(torch.bfloat16)
    return q, k, v


def check(got, want, tol=2e-2):
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got.double() - want).abs().max().item()
    assert err <= tol, err


# ---- CPU: entry points, numerics --------------------------------------------------------------------
def test_prefill_without_padding_is_one_dense_call(rec):
    q, k, v = inputs()
    o, w = fa4hf.attention_forward(Layer(), q, k, v, None, scaling=0.125)
    assert w is None and [c[0] for c in rec.calls] == ["attention"]
    call = rec.calls[0][1]
    assert call["causal"] and call["scale"] == 0.125 and call["window"] == (-1, -1) and call["q"] == (3, 37, 8, 64)
    check(o, eager_expected(q, k, v, torch.ones(3, 37, dtype=torch.bool), 0.125))


def test_decode_over_the_cache_is_a_kvcache_call_on_views(rec):
    q, k, v = inputs(sq=1, skv=300, d=128)
    o, _ = fa4hf.attention_forward(Layer(), q, k, v, None, scaling=0.09)
    (kind, call), = rec.calls
    assert kind == "kvcache" and call["lens"] == [300] * 3 and call["cache_is_view"]  # the cache is not copied
    check(o, eager_expected(q, k, v, torch.ones(3, 300, dtype=torch.bool), 0.09))


def test_left_padded_prefill_goes_through_varlen_and_zeroes_padded_rows(rec):
    q, k, v = inputs(sq=40, skv=40)
    pad = torch.ones(3, 40, dtype=torch.bool)
    pad[1, :7] = False  # left padding, as generate() pads
    pad[2, :39] = False  # one real token
    o, _ = fa4hf.attention_forward(Layer(), q, k, v, pad, scaling=0.125)
    (kind, call), = rec.calls
    assert kind == "varlen" and call["cu_q"] == [0, 40, 73, 74] and call["cu_k"] == call["cu_q"]
    assert call["max"] == (40, 40)
    want = eager_expected(q, k, v, pad, 0.125)
    check(o, want)
    assert (o[1, :7] == 0).all() and (o[2, :39] == 0).all()


def test_padded_decode_step_and_chunked_prefill(rec):
    q, k, v = inputs(sq=4, skv=90, d=128, dv=128)
    pad = torch.ones(3, 90, dtype=torch.bool)
    pad[0, :20] = False
    pad[2, :87] = False  # the chunk's first query (position 86) is a pad too
    o, _ = fa4hf.attention_forward(Layer(), q, k, v, pad, scaling=0.1)
    assert rec.calls[0][0] == "varlen" and rec.calls[0][1]["cu_q"] == [0, 4, 8, 11]
    check(o, eager_expected(q, k, v, pad, 0.1))


@pytest.mark.parametrize("padded", [False, True])
def test_window_softcap_sinks_and_mla_head_dims(rec, padded):
    q, k, v = inputs(sq=50, skv=50, d=192, dv=128, hq=4, hkv=4)
    sinks = torch.randn(4).to(torch.bfloat16)
    pad = torch.ones(3, 50, dtype=torch.bool)
    if padded:
        pad[0, :9] = False
    o, _ = fa4hf.attention_forward(Layer(), q, k, v, pad if padded else None, scaling=0.07, sliding_window=16,
                                   softcap=30.0, s_aux=sinks)
    kind, call = rec.calls[0]
    assert kind == ("varlen" if padded else "attention") and call["window"] == (15, 0)
    check(o, eager_expected(q, k, v, pad, 0.07, sliding_window=16, softcap=30.0, sinks=sinks))


def test_a_window_wider_than_the_keys_runs_the_unwindowed_kernel(rec):
    q, k, v = inputs(sq=1, skv=100)
    fa4hf.attention_forward(Layer(), q, k, v, None, scaling=0.1, sliding_window=4096)
    assert rec.calls[0][1]["window"] == (-1, -1)
    fa4hf.attention_forward(Layer(), q, k, v, None, scaling=0.1, sliding_window=100)
    assert rec.calls[1][1]["window"] == (99, 0)


@pytest.mark.parametrize("what,message", [
    ("fp32", "float16 or bfloat16 tensors, got torch.float32"),
    ("attn_weights", "output_attentions"),
    ("dropout", "forward-only: attention dropout 0.1"),
    ("mask4d", "2-D padding mask"),
    ("bias", "position bias"),
])
def test_what_fa4gen_cannot_do_is_an_error(rec, what, message):
    q, k, v = inputs()
    layer, kw, mask = Layer(), {}, None
    if what == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif what == "attn_weights":
        kw["output_attentions"] = True
    elif what == "dropout":
        layer.training = True
        kw["dropout"] = 0.1
    elif what == "mask4d":
        mask = torch.ones(3, 1, 37, 37, dtype=torch.bool)
    elif what == "bias":
        kw["position_bias"] = torch.zeros(1)
    with pytest.raises(fa4hf.UnsupportedAttention, match=message):
        fa4hf.attention_forward(layer, q, k, v, mask, scaling=0.1, **kw)
    assert rec.calls == []


# ---- CPU with transformers: whole models ------------------------------------------------------------------
# The attention geometry of real models (query heads, KV heads, head_dim): Llama-3-8B, Qwen2.5-7B (GQA 7),
# Mistral-7B, gpt-oss (D 64, sinks). The GPU test builds them with 2 layers, a small vocabulary and MLP;
# the windows are 12 keys (not 4096 / 128) so that a 64-token test crosses them.
REAL_ATTENTION = {"llama": (32, 8, 128), "qwen2": (28, 4, 128), "mistral": (32, 8, 128), "gpt_oss": (64, 8, 64)}


def _tiny(kind, real: bool = False):
    tr = pytest.importorskip("transformers")
    hq, hkv, d = REAL_ATTENTION[kind] if real else (4, 2, 64)
    common = dict(vocab_size=97, hidden_size=128 if not real else hq * d, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=256, head_dim=d)
    if kind == "llama":
        cfg = tr.LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = tr.Qwen2Config(**common)
    elif kind == "mistral":
        cfg = tr.MistralConfig(**common, sliding_window=12)
    else:
        cfg = tr.GptOssConfig(**{**common, "intermediate_size": 128}, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_oss"])
def test_models_with_fa4gen_match_eager(rec, kind):
    model = _tiny(kind)
    assert fa4hf.register() == "fa4gen"
    ids = torch.randint(3, 97, (3, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, :6] = 0  # left-padded batch
    mask[2, :17] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, attention_mask=mask).logits.float()
        model.set_attn_implementation("fa4gen")
        got = model(input_ids=ids, attention_mask=mask).logits.float()
        assert {c[0] for c in rec.calls} == {"varlen"}
        real = mask.bool()
        err = (got - want)[real].abs().max().item()
        assert err < 0.05 * want[real].abs().max().item(), err
        rec.calls.clear()
        # decode through the model's cache: no padding -> prefill is dense, each new token a KV-cache call
        out = model.generate(ids[:1, :20], max_new_tokens=4, do_sample=False)
        kinds = [c[0] for c in rec.calls]
        assert kinds[:2] == ["attention", "attention"] and set(kinds[2:]) == {"kvcache"}, kinds
        model.set_attn_implementation("eager")
        ref = model.generate(ids[:1, :20], max_new_tokens=4, do_sample=False)
    assert out.shape == ref.shape == (1, 24)


# ---- GPU: the real kernels ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt_oss"])
def test_models_on_the_gpu_within_the_bf16_sdpa_error(kind):
    """fa4gen's logits error against the float32 model <= 1.25x the bf16 model's own error (padded
    prefill and teacher-forced decode), and generate() runs. The model's own bf16 path is sdpa, or eager
    where transformers has no sdpa path for the model (gpt-oss: its sinks; transformers raises)."""
    tr = pytest.importorskip("transformers")
    fa4hf.register()
    model = _tiny(kind, real=True).cuda()
    ref32 = _tiny(kind, real=True).float().cuda()
    ids = torch.randint(3, 97, (3, 64), generator=torch.Generator().manual_seed(2)).cuda()
    mask = torch.ones(3, 64, dtype=torch.long, device="cuda")
    mask[1, :10] = 0
    mask[2, :40] = 0
    real = mask.bool()
    with torch.no_grad():
        ref32.set_attn_implementation("eager")
        want = ref32(input_ids=ids, attention_mask=mask).logits
        errs = {}
        own = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
        for impl in (own, "fa4gen"):
            model.set_attn_implementation(impl)
            got = model(input_ids=ids, attention_mask=mask).logits.float()
            errs[impl] = (got - want)[real].abs().max().item()
            # teacher-forced decode: prefill 48 tokens, then one token at a time through the cache
            cache = tr.DynamicCache(config=model.config)
            model(input_ids=ids[:1, :48], past_key_values=cache, use_cache=True)
            steps = [model(input_ids=ids[:1, t:t + 1], past_key_values=cache, use_cache=True).logits.float()
                     for t in range(48, 64)]
            full = ref32(input_ids=ids[:1]).logits[:, 48:]
            errs[impl + "_decode"] = (torch.cat(steps, 1) - full).abs().max().item()
        assert errs["fa4gen"] <= 1.25 * errs[own] + 1e-3, errs
        assert errs["fa4gen_decode"] <= 1.25 * errs[own + "_decode"] + 1e-3, errs
        model.set_attn_implementation("fa4gen")
        out = model.generate(ids[:2, :32], attention_mask=mask[:2, :32], max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 40) and np.isfinite(errs["fa4gen"])
