"""fa4gen as a Hugging Face transformers attention backend.

    import fa4gen.integrations.transformers as fa4hf
    fa4hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="fa4gen")

`register()` adds "fa4gen" to transformers' AttentionInterface (the function below) and its
AttentionMaskInterface (transformers' own flash-attention mask: None when no token is padded, else
the 2-D padding mask, sliced to the keys of the layer). Each attention call goes to one entry point:

- no padding, queries as many as the keys (prefill): `fa4gen.attention` (bottom-right causal);
- no padding, fewer queries than keys (decode, speculative decode, chunked prefill over the model's
  cache): `fa4gen.attention_with_kvcache` over the cache's keys as they are (no copy; the split over
  keys is chosen from the shape);
- a padding mask: the valid tokens are gathered into packed sequences and run through
  `fa4gen.attention_varlen` (as transformers' flash-attention path does), the padded query rows of
  the output are zero.

The layer's `scaling` is the softmax scale; `sliding_window` W (the query sees W keys, itself
included) is `window_size=(W - 1, 0)`; `softcap` and gpt-oss's sinks (`s_aux`) pass through. Under a
padding mask the window counts valid keys (transformers' flash-attention convention; with left
padding, as `generate` pads, that is the positional window). What fa4gen cannot do is an error that
names it, never a silent fallback: dropout in training, `output_attentions`, float32 tensors, a
custom 4-D mask, a head size it does not generate.
"""
from __future__ import annotations

NAME = "fa4gen"


class UnsupportedAttention(ValueError):
    """A model's attention call asks for something fa4gen does not do (the message says what)."""


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention function signature: query (B, Hq, Sq, D), key (B, Hkv, Skv, D), value
    (B, Hkv, Skv, DV); returns (attn_output (B, Sq, Hq, DV), None)."""
    import torch

    import fa4gen

    if kwargs.get("output_attentions"):
        raise UnsupportedAttention("fa4gen does not return attention weights (output_attentions=True): use "
                                   "attn_implementation='eager' for them")
    if dropout and getattr(module, "training", False):
        raise UnsupportedAttention(f"fa4gen is forward-only: attention dropout {dropout} in training needs another "
                                   f"attn_implementation")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedAttention(f"fa4gen's kernels take float16 or bfloat16 tensors, got {query.dtype}: load the "
                                   f"model with dtype=torch.bfloat16 (or float16)")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedAttention("fa4gen does not add a position bias to the scores (T5-style relative attention)")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views, no copy
    b, sq = q.shape[0], q.shape[1]
    skv = k.shape[1]
    window = (-1, -1)
    if sliding_window is not None and 0 < int(sliding_window) < max(skv, sq) + 1:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    mods = dict(window_size=window, softcap=float(softcap or 0.0),
                learnable_sink=None if s_aux is None else s_aux.detach().to(torch.float32).contiguous())
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedAttention(f"fa4gen takes a 2-D padding mask (its registered mask function makes one), got a "
                                   f"{attention_mask.dim()}-D mask: a custom mask needs another attn_implementation")
    if attention_mask is None:
        if sq < skv and causal:
            lens = torch.full((b,), skv, dtype=torch.int32, device=q.device)
            o = fa4gen.attention_with_kvcache(q, k, v, lens, causal=True, softmax_scale=scaling, **mods)
        else:
            o = fa4gen.attention(q, k, v, causal=causal, softmax_scale=scaling, **mods)
        return o, None
    return _padded(q, k, v, attention_mask, causal, scaling, mods), None


def _padded(q, k, v, mask, causal, scaling, mods):
    """A padded batch through attention_varlen: the valid tokens of each row packed, the output
    scattered back (padded query rows zero). mask: (B, >= Skv) bool, True = a real token; its last Skv
    columns are the keys, its last Sq the queries."""
    import torch

    import fa4gen

    b, sq, hq, _ = q.shape
    skv = k.shape[1]
    kmask = mask[:, -skv:].to(torch.bool)
    qmask = kmask[:, -sq:] if sq <= skv else torch.ones(b, sq, dtype=torch.bool, device=q.device)
    qlens, klens = qmask.sum(1, dtype=torch.int32), kmask.sum(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q, cu_k = torch.cat([zero, qlens.cumsum(0, dtype=torch.int32)]), torch.cat([zero, klens.cumsum(0, dtype=torch.int32)])
    qi, ki = qmask.flatten().nonzero().squeeze(1), kmask.flatten().nonzero().squeeze(1)
    qp = q.reshape(b * sq, hq, q.shape[-1]).index_select(0, qi)
    kp = k.reshape(b * skv, k.shape[2], k.shape[3]).index_select(0, ki)
    vp = v.reshape(b * skv, v.shape[2], v.shape[3]).index_select(0, ki)
    maxes = torch.stack([qlens.max(), klens.max()]).tolist()  # one host sync for both
    op = fa4gen.attention_varlen(qp, kp, vp, cu_q, cu_k, maxes[0], maxes[1], causal=causal, softmax_scale=scaling,
                                 **mods)
    out = q.new_zeros(b * sq, hq, v.shape[-1])
    out.index_copy_(0, qi, op)
    return out.reshape(b, sq, hq, v.shape[-1])


def register() -> str:
    """Register "fa4gen" with transformers (attention and mask interfaces); returns the name to pass
    as attn_implementation. Needs transformers >= 5 (pip install "fa4gen[transformers]")."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("fa4gen.integrations.transformers needs transformers >= 5 with AttentionInterface and "
                          "AttentionMaskInterface (pip install 'transformers>=5')") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME
