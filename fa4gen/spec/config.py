"""KernelConfig: every knob of one generated kernel, validated once.

A config is the cache key of everything downstream (pipeline, PTX, cubin): its `name` is stable and
readable, its `content_hash` covers every field plus GENERATOR_VERSION, so a generator change never
loads a stale cubin.
"""

from __future__ import annotations

import dataclasses
import contextlib
import contextvars
import enum
import functools
import hashlib
import json
import math
import numbers
import operator
from dataclasses import dataclass
from pathlib import Path

from .encodings import TMEM_COLUMNS
from .tiles import ROWS, gqa_pack, kv_block_keys, q_tile_rows_refusal, q_tiles_per_task

GENERATOR_VERSION = "0.1.0"

# Sources whose text decides the emitted PTX or cubin: a change to any of them is a new generator,
# so cached cubins keyed by content_hash can never outlive the code that made them.
_FINGERPRINT_SOURCES = ("spec", "ir", "lower", "render", "assemble/assemble.py", "codegen.py")


@functools.lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """sha256 over the generator's PTX-deciding sources and templates (first 12 hex digits)."""
    from .paths import templates_dir

    pkg = Path(__file__).resolve().parent.parent
    files = []
    for name in _FINGERPRINT_SOURCES:
        p = pkg / name
        files += sorted(p.rglob("*.py")) if p.is_dir() else ([p] if p.exists() else [])
    tdir = templates_dir()
    files += sorted(tdir.rglob("*.j2"))
    h = hashlib.sha256()
    for f in files:
        rel = f.relative_to(tdir) if f.is_relative_to(tdir) else f.relative_to(pkg)
        h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]

ARCHS = ("sm_100a", "sm_90a")
# (head_dim, head_dim_v) pairs each target generates: q and k have head_dim columns, v and o head_dim_v.
# The one table KernelConfig, the API (runtime/validate.py), the CLI and prebuilt-kernel checks read.
HEAD_DIM_PAIRS: dict[str, tuple[tuple[int, int], ...]] = {
    "sm_100a": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
    "sm_90a": ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
}
HEAD_DIMS = tuple(sorted({d for pairs in HEAD_DIM_PAIRS.values() for d, _ in pairs}))  # every head_dim of some pair
# Pairs the design of docs/HEAD_DIMS.md plans on a target that does not generate them (none today: D = 96,
# DeepSeek's (192, 128) and D = 256, once planned, both targets generate): inside `planning_head_dims()` a
# KernelConfig takes them on every target so the IR's budget checks can be asked about them
# (scripts/head_dim_budgets.py), and the lowerings refuse those their target does not generate.
HEAD_DIM_PLANNED: tuple[tuple[int, int], ...] = ()
DTYPES = ("fp16", "bf16")
PAGE_SIZES = (16, 32, 64, 128, 256)  # keys per KV-cache page (kvcache kernels; 0 = contiguous cache)
MMA_K = 16  # reduction positions per MMA step for 16-bit inputs (tcgen05 kind::f16, wgmma k16)

# Seed constants: in every 16 exponentials of a 32-column fragment the last 2*EMU_PAIRS are emulated
# on the FMA units, in fragments [EMU_START, 3); fragment 3 and masked blocks always use ex2.approx.
# sm_90a default: no emulation. Hopper's MUFU keeps up with its wgmma rate, and the emulation's FMAs
# compete with the softmax's: all-ex2 measured 4-9% faster at D = 128 on the H200, same at D = 64
# (bench/sm90_dev_notes.md, run 3, "noemu" column).
EMU_PAIRS_DEFAULT = {"sm_100a": 2, "sm_90a": 0}
EMU_START_DEFAULT = {False: 1, True: 0}  # keyed by causal
K_SPLIT_DEFAULT = {False: 6 * MMA_K, True: 4 * MMA_K}  # 96 + 32 non-causal, 64 + 64 causal
KV_STAGES_MIN, KV_STAGES_MAX = 2, 4  # the K/V ring depths a config may ask for


def head_dim_pairs_text(arch: str) -> str:
    """The pairs `arch` generates, as an error message names them: "(64, 64), (96, 96), (128, 128)"."""
    return ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIM_PAIRS[arch])


def head_dim_refusal(arch: str, head_dim: int, head_dim_v: int) -> str | None:
    """Why `arch` does not generate this (head_dim, head_dim_v) pair (None when it does)."""
    if (head_dim, head_dim_v) in HEAD_DIM_PAIRS[arch]:
        return None
    pair = (head_dim, head_dim_v)
    elsewhere = [a for a in ARCHS if a != arch and pair in HEAD_DIM_PAIRS[a]]
    notes = ([f"{' and '.join(elsewhere)} generates it"] if elsewhere else []) + (
        ["planned here: docs/HEAD_DIMS.md" if elsewhere else "planned: docs/HEAD_DIMS.md"] if pair in HEAD_DIM_PLANNED else [])
    noted = f" ({'; '.join(notes)})" if notes else ""
    return (f"(head_dim, head_dim_v) = ({head_dim}, {head_dim_v}) is not generated for {arch}{noted}; "
            f"it generates {head_dim_pairs_text(arch)}")


_PLANNING = contextvars.ContextVar("fa4gen_head_dim_planning", default=False)


@contextlib.contextmanager
def planning_head_dims():
    """Inside, KernelConfig also takes the HEAD_DIM_PLANNED pairs: the IR can be built and its budget
    checks read for a head size no target generates yet (scripts/head_dim_budgets.py). The lowerings
    refuse such a config wherever it goes (lower/sm90.py, lower/sm100.py)."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


class ConfigError(ValueError):
    """An invalid KernelConfig field: names the field, the value and what is allowed."""

    def __init__(self, field_name: str, value, allowed: str):
        self.field = field_name
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field_name}={value!r}: {allowed}")


_INT_FIELDS = ("head_dim", "head_dim_v", "gqa_ratio", "block_m", "block_n", "q_stages", "kv_stages", "emu_pairs", "emu_start",
               "k_split", "page_size")
_STR_FIELDS = ("arch", "dtype")
GQA_RATIO_MAX = 1 << 16  # Hq = Hkv * G and the task counts stay far inside the kernels' 32-bit arithmetic


def _exact_int(name: str, value):
    """value as a plain int: ints and numpy integers (anything Integral with __index__) pass, bool,
    floats (even 128.0) and everything else raise ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(name, value, f"an integer, not {type(value).__name__}")
    return operator.index(value)


@dataclass(frozen=True)
class KernelConfig:
    arch: str = "sm_100a"
    head_dim: int = 128  # columns of q and k
    head_dim_v: int | None = None  # columns of v and o; None: head_dim (normalised to it)
    causal: bool = False
    gqa_ratio: int = 1
    dtype: str = "bf16"
    block_m: int = 128  # rows of one Q tile: 128, or 192 (sm_90a D = 64: three consumers; tiles.q_tile_rows)
    block_n: int | None = None  # keys per K/V block; None: tiles.kv_block_keys (normalised to it)
    q_stages: int = 2  # Q tiles in flight per CTA task
    kv_stages: int = 3  # K/V SMEM ring depth
    rescale_threshold: float = 8.0
    emu_pairs: int | None = None  # None: the seed's value
    emu_start: int | None = None  # None: the seed's value for this causal mode
    k_split: int | None = None  # None: 96 non-causal, 64 causal
    varlen: bool = False  # packed variable-length batches (cu_seqlens): docs/ABI.md "Varlen"
    kvcache: bool = False  # decode over a KV cache: per-sequence lengths, split-KV, combine: docs/ABI.md "KV cache"
    page_size: int = 0  # kvcache only: 0 = contiguous cache (B, Smax, Hkv, D); else keys per page (16..256, 2^k)
    # Score modifiers (docs/ABI.md "Windows, softcap, sinks"); their values are run-time arguments:
    window: bool = False  # a sliding window (window_left, window_right: keys i + Skv - Sq - left .. + right)
    softcap: bool = False  # scores s become softcap * tanh(s / softcap) before the softmax
    sinks: bool = False  # a learned logit per query head joins every row's softmax denominator

    def __post_init__(self):
        def fix(name, value):
            object.__setattr__(self, name, value)

        # exact types first, so no float, bool or bytes ever reaches the range checks (128.0 == 128)
        for name in _STR_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, str):
                raise ConfigError(name, v, f"a string, not {type(v).__name__}")
            fix(name, str(v.value) if isinstance(v, enum.Enum) else str(v))
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is not None or name not in ("head_dim_v", "block_n", "emu_pairs", "emu_start", "k_split"):
                fix(name, _exact_int(name, v))
        for name in ("causal", "varlen", "kvcache", "window", "softcap", "sinks"):
            flag = getattr(self, name)
            if type(flag) is not bool:
                import numpy as np

                if not isinstance(flag, np.bool_):
                    raise ConfigError(name, flag, "True or False")
                fix(name, bool(flag))
        if self.arch not in ARCHS:
            raise ConfigError("arch", self.arch, f"one of {', '.join(ARCHS)}")
        if self.head_dim_v is None:
            fix("head_dim_v", self.head_dim)
        allowed = HEAD_DIM_PAIRS[self.arch] + (HEAD_DIM_PLANNED if _PLANNING.get() else ())
        if (self.head_dim, self.head_dim_v) not in allowed:
            # the field to blame: head_dim when no pair has it, else head_dim_v
            field = "head_dim_v" if any(d == self.head_dim for d, _ in allowed) else "head_dim"
            raise ConfigError(field, getattr(self, field),
                              head_dim_refusal(self.arch, self.head_dim, self.head_dim_v)
                              if not _PLANNING.get() else f"(head_dim, head_dim_v) one of "
                              f"{', '.join(map(str, allowed))} (generated and planned)")
        if not isinstance(self.causal, bool):
            raise ConfigError("causal", self.causal, "True or False")
        if isinstance(self.gqa_ratio, bool) or not 1 <= self.gqa_ratio <= GQA_RATIO_MAX:
            raise ConfigError("gqa_ratio", self.gqa_ratio, f"an integer in [1, {GQA_RATIO_MAX}] (query heads per "
                                                           "KV head; tiles.gqa_pack decides the Q tile's row packing)")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        why = q_tile_rows_refusal(self.arch, self.head_dim, self.gqa_ratio, self.varlen, self.kvcache, self.block_m)
        if why:
            raise ConfigError("block_m", self.block_m, why)
        keys = kv_block_keys(self.arch, self.head_dim)
        if self.block_n is None:
            fix("block_n", keys)
        if self.block_n != keys:
            raise ConfigError("block_n", self.block_n, f"{keys} on {self.arch} at head_dim {self.head_dim} "
                                                       "(tiles.kv_block_keys)")
        if self.q_stages != 2:
            raise ConfigError("q_stages", self.q_stages, "2 (two Q tiles in flight per task)")
        if isinstance(self.kv_stages, bool) or not isinstance(self.kv_stages, int) or not KV_STAGES_MIN <= self.kv_stages <= KV_STAGES_MAX:
            raise ConfigError("kv_stages", self.kv_stages, f"an integer in [{KV_STAGES_MIN}, {KV_STAGES_MAX}]")
        thr = self.rescale_threshold
        if isinstance(thr, bool) or not isinstance(thr, numbers.Real) or not math.isfinite(thr) or not 0 <= thr <= 15:
            # P reaches 2^threshold between rescales: fp16 overflows at 2^16
            raise ConfigError("rescale_threshold", thr, "a number in [0, 15] (log2 units; 0 = always rescale; "
                                                        "P can reach 2^threshold and fp16 overflows at 2^16)")
        fix("rescale_threshold", float(thr))
        pairs = EMU_PAIRS_DEFAULT[self.arch] if self.emu_pairs is None else self.emu_pairs
        if isinstance(pairs, bool) or not isinstance(pairs, int) or not 0 <= pairs <= 8:
            raise ConfigError("emu_pairs", pairs, "an integer in [0, 8] (pairs emulated per 16 exponentials)")
        fix("emu_pairs", pairs)
        start = EMU_START_DEFAULT[self.causal] if self.emu_start is None else self.emu_start
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= 3:
            raise ConfigError("emu_start", start, "an integer in [0, 3] (first emulated 32-column fragment)")
        fix("emu_start", start)
        ks = K_SPLIT_DEFAULT[self.causal] if self.k_split is None else self.k_split
        if isinstance(ks, bool) or not isinstance(ks, int) or ks % 32 or not 0 < ks < ROWS:
            raise ConfigError("k_split", ks, "a multiple of 32 in (0, 128): P is stored in 32-column chunks")
        fix("k_split", ks)
        if self.kvcache and self.varlen:
            raise ConfigError("kvcache", self.kvcache, "not with varlen (a KV cache kernel takes per-sequence key "
                                                       "lengths through cache_seqlens)")
        if self.page_size and not self.kvcache:
            raise ConfigError("page_size", self.page_size, "0 unless kvcache (pages are a KV cache's layout)")
        if self.page_size not in PAGE_SIZES + (0,):
            raise ConfigError("page_size", self.page_size, "0 (contiguous cache) or a power of two in [16, 256]")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def gqa_pack(self) -> int:
        """Query heads packed into one Q tile (the rule is fa4gen.spec.tiles.gqa_pack)."""
        return gqa_pack(self.gqa_ratio)

    @property
    def head_groups(self) -> int:
        """Tiles side by side in the head dimension per kv head: gqa_ratio / gqa_pack."""
        return self.gqa_ratio // self.gqa_pack

    @property
    def tiles_per_task(self) -> int:
        """Q tiles a task keeps in flight, its m unit (the rule is fa4gen.spec.tiles.q_tiles_per_task):
        sm_100a two (one at DV = 256), sm_90a one."""
        return q_tiles_per_task(self.arch, self.head_dim_v, TMEM_COLUMNS)

    @property
    def seq_q_per_tile(self) -> int:
        """Sequence positions per block_m-row Q tile: the rest of the rows are the packed heads."""
        return self.block_m // self.gqa_pack

    @property
    def seq_q_per_task(self) -> int:
        """Sequence positions per task (its m unit): tiles_per_task Q tiles of seq_q_per_tile each."""
        return self.tiles_per_task * self.seq_q_per_tile

    @property
    def p_chunks_first(self) -> int:
        """32-column P chunks stored before p_o_rescale (3 non-causal, 2 causal)."""
        return self.k_split // 32

    @property
    def elem_bytes(self) -> int:
        return 2

    @property
    def head_dims(self) -> tuple[int, int]:
        """(head_dim, head_dim_v): the columns of q/k and of v/o."""
        return self.head_dim, self.head_dim_v

    @property
    def name(self) -> str:
        d = f"d{self.head_dim}" if self.head_dim_v == self.head_dim else f"d{self.head_dim}v{self.head_dim_v}"
        parts = ["fa4", self.arch.replace("_", ""), d, self.dtype]
        parts.append("causal" if self.causal else "noncausal")
        parts.append(f"gqa{self.gqa_ratio}")
        if self.varlen:
            parts.append("varlen")
        if self.kvcache:
            parts.append(f"kvcache_p{self.page_size}" if self.page_size else "kvcache")
        parts += [tag for flag, tag in ((self.window, "win"), (self.softcap, "cap"), (self.sinks, "sink")) if flag]
        if self.block_m != 128:
            parts.append(f"m{self.block_m}")
        with planning_head_dims():  # self's head-dim pair passed validation when self was made
            defaults = KernelConfig(arch=self.arch, head_dim=self.head_dim, head_dim_v=self.head_dim_v,
                                    causal=self.causal, gqa_ratio=self.gqa_ratio, dtype=self.dtype, varlen=self.varlen,
                                    kvcache=self.kvcache, page_size=self.page_size, block_m=self.block_m,
                                    window=self.window, softcap=self.softcap, sinks=self.sinks)
        if self != defaults:  # tuned variants must never share a name with the default one
            parts.append(self.content_hash[:8])
        return "_".join(parts)

    def to_dict(self) -> dict:
        """Every field, except head_dim_v where it equals head_dim: the dict (so the manifests, the
        content hash's config part and the golden files) of every dv == d kernel is the one it had
        before head_dim_v existed. from_dict reads a missing head_dim_v as head_dim."""
        out = dataclasses.asdict(self)
        if self.head_dim_v == self.head_dim:
            del out["head_dim_v"]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(unknown[0], d[unknown[0]], f"not a KernelConfig field (fields: {', '.join(sorted(known))})")
        return cls(**d)

    @property
    def content_hash(self) -> str:
        """Covers every field, GENERATOR_VERSION and the generator's source fingerprint: the cubin
        cache key, so an edited template or lowering never loads a stale cubin."""
        blob = json.dumps({"config": self.to_dict(), "generator": GENERATOR_VERSION,
                           "sources": generator_fingerprint()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def replace(self, **changes) -> "KernelConfig":
        """A copy with `changes`; head_dim_v follows a changed head_dim unless it differed or is given,
        block_n a changed head_dim or arch unless given."""
        if "head_dim" in changes and "head_dim_v" not in changes and self.head_dim_v == self.head_dim:
            changes["head_dim_v"] = None
        # block_n follows a changed target or head_dim (tiles.kv_block_keys) unless given
        if ("head_dim" in changes or "arch" in changes) and "block_n" not in changes:
            changes["block_n"] = None
        return dataclasses.replace(self, **changes)
