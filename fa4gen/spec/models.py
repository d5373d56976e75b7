"""What a model's attention asks of fa4gen, read from its Hugging Face config (config.json), and the
kernel variants that serve it: the input of `fa4gen bundle` (fa4gen/runtime/bundle.py).

`ModelAttention.from_hf_config(cfg)` reads the attention's shape (query and KV heads, head dims),
its score modifiers (sliding window per layer kind, logit softcap, learned sinks) and the dtype, for
the families whose configs say so in these fields:

- heads: `num_attention_heads`, `num_key_value_heads` (absent: multi-head); head dim: `head_dim`, else
  `hidden_size / num_attention_heads`; DeepSeek-V3 / Kimi-K2 (MLA) prefill: `qk_nope_head_dim +
  qk_rope_head_dim` for q and k, `v_head_dim` for v (the decompressed keys, one KV head per query head);
- sliding window: `sliding_window` (an int) unless `use_sliding_window` is false (Qwen2); which layers
  slide: `layer_types` ("sliding_attention" / "full_attention"), else every layer (Mistral);
- softcap: `attn_logit_softcapping` (Gemma 2); sinks: gpt-oss (`model_type` "gpt_oss"), whose every
  layer has a learned sink logit per head;
- dtype: `torch_dtype` / `dtype` ("bfloat16", "float16"; any other is an error that asks for one);
- a multimodal config's language model is its `text_config`.

`variants(...)` turns that into KernelConfigs: for each arch, entry point (dense prefill, varlen
prefill, KV-cache decode), layer kind (windowed or not, with the model's softcap and sinks) and the Q
tile rows a call of that kind can take (`tiles.q_tile_rows` over short and long queries). The
kernels are causal (decoder attention). Anything fa4gen does not generate is a ModelConfigError that
names it, never a partial bundle.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ARCHS, DTYPES, HEAD_DIM_PAIRS, PAGE_SIZES, ConfigError, KernelConfig
from .tiles import q_tile_rows

ENTRY_POINTS = ("dense", "varlen", "kvcache")
_DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


class ModelConfigError(ValueError):
    """A model config fa4gen cannot read, or an attention it does not generate (the message says which)."""


@dataclass(frozen=True)
class ModelAttention:
    model_type: str
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str  # "bf16" | "fp16"
    window: int | None  # the sliding layers' window (keys a query sees, itself included); None: no sliding layer
    layer_kinds: tuple[bool, ...]  # per distinct layer kind: windowed or not (sorted: full first)
    softcap: float  # 0.0: none
    sinks: bool

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @classmethod
    def from_hf_config(cls, cfg: dict, dtype: str | None = None) -> "ModelAttention":
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"a model config is a JSON object (config.json), got {type(cfg).__name__}")
        if isinstance(cfg.get("text_config"), dict):  # multimodal: the language model's attention
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        mt = str(cfg.get("model_type", "unknown"))
        hq = _pos_int(cfg, "num_attention_heads")
        if "qk_nope_head_dim" in cfg or "qk_rope_head_dim" in cfg:  # MLA (DeepSeek-V3, Kimi-K2): prefill shape
            d = _pos_int(cfg, "qk_nope_head_dim") + _pos_int(cfg, "qk_rope_head_dim")
            dv = _pos_int(cfg, "v_head_dim")
            hkv = hq
        else:
            hkv = _pos_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else hq
            if cfg.get("head_dim") is not None:
                d = _pos_int(cfg, "head_dim")
            else:
                hidden = _pos_int(cfg, "hidden_size")
                if hidden % hq:
                    raise ModelConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {hq} "
                                           f"and the config has no head_dim")
                d = hidden // hq
            dv = d
        if hq % hkv:
            raise ModelConfigError(f"num_attention_heads {hq} is not a multiple of num_key_value_heads {hkv}")
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelConfigError(f"sliding_window must be a positive int or null, got {window!r}")
        types = cfg.get("layer_types")
        if window is None:
            kinds = (False,)
        elif isinstance(types, list) and types:
            unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
            if unknown:
                raise ModelConfigError(f"layer_types holds {unknown}: fa4gen knows sliding_attention and "
                                       f"full_attention layers")
            kinds = tuple(sorted({t == "sliding_attention" for t in types}))
        else:
            kinds = (True,)
        cap = cfg.get("attn_logit_softcapping") or 0.0
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ModelConfigError(f"attn_logit_softcapping must be a number >= 0 or null, got {cap!r}")
        want = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
        if want not in _DTYPE_NAMES:
            raise ModelConfigError(f"the model's dtype is {want!r}: fa4gen's kernels take bfloat16 or float16 "
                                   f"(choose one: --dtype {' / --dtype '.join(DTYPES)})")
        return cls(model_type=mt, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv,
                   dtype=_DTYPE_NAMES.get(want, want), window=window if True in kinds else None,
                   layer_kinds=kinds, softcap=float(cap), sinks=mt == "gpt_oss")

    def describe(self) -> str:
        dims = f"D {self.head_dim}" + (f", DV {self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        kinds = " + ".join(f"window {self.window}" if w else "full" for w in self.layer_kinds)
        mods = "".join([f", softcap {self.softcap:g}" if self.softcap else "", ", sinks" if self.sinks else ""])
        return f"{self.model_type}: {self.heads_q}/{self.heads_kv} heads, {dims}, {self.dtype}, layers {kinds}{mods}"


def _pos_int(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelConfigError(f"the config's {key} must be a positive int, got {v!r}")
    return v


def variants(model: ModelAttention, archs=("sm_90a",), entry_points=ENTRY_POINTS,
             page_sizes=(0,)) -> list[KernelConfig]:
    """Every kernel variant the model's attention calls take, per arch: dense and varlen prefill and
    KV-cache decode (one per page size; 0 = a contiguous cache), for each layer kind, with every Q
    tile size a call of that kind can choose. Sorted by name, no duplicates."""
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        raise ModelConfigError(f"arch {bad or archs!r}: choose from {', '.join(ARCHS)}")
    bad = [e for e in entry_points if e not in ENTRY_POINTS]
    if bad or not entry_points:
        raise ModelConfigError(f"entry point {bad or entry_points!r}: choose from {', '.join(ENTRY_POINTS)}")
    bad = [p for p in page_sizes if p != 0 and p not in PAGE_SIZES]
    if bad or not page_sizes:
        raise ModelConfigError(f"page size {bad or page_sizes!r}: 0 (a contiguous cache) or one of "
                               f"{', '.join(map(str, PAGE_SIZES))}")
    out = {}
    for arch in archs:
        if (model.head_dim, model.head_dim_v) not in HEAD_DIM_PAIRS[arch]:
            pairs = ", ".join(f"{d}" if d == dv else f"({d}, {dv})" for d, dv in HEAD_DIM_PAIRS[arch])
            raise ModelConfigError(f"{model.describe()}: head dims ({model.head_dim}, {model.head_dim_v}) are not "
                                   f"generated for {arch} (it generates {pairs})")
        for entry in entry_points:
            for windowed in model.layer_kinds:
                for page in (page_sizes if entry == "kvcache" else (0,)):
                    base = dict(arch=arch, head_dim=model.head_dim, head_dim_v=model.head_dim_v, causal=True,
                                gqa_ratio=model.gqa_ratio, dtype=model.dtype, varlen=entry == "varlen",
                                kvcache=entry == "kvcache", page_size=page, window=windowed,
                                softcap=model.softcap > 0, sinks=model.sinks)
                    rows = {q_tile_rows(arch, model.head_dim, model.gqa_ratio, entry == "varlen", entry == "kvcache",
                                        True, sq) for sq in (1, None)}
                    for m in sorted(rows):
                        try:
                            cfg = KernelConfig(**base, block_m=m)
                        except ConfigError as e:
                            raise ModelConfigError(f"{model.describe()}: {e}") from e
                        out[cfg.name] = cfg
    return [out[k] for k in sorted(out)]
