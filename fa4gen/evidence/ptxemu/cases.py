"""What one emulated run is: its shape and inputs, the roles of the kernel's warps, its result, and
the judgement of O and LSE against the float64 reference. Below the dense/varlen harness and the KV-cache
launcher (kvcache.py), which both read it.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import numpy as np

from .. import reference
from .coverage import Coverage, EntryCoverage
from .machine import MAX_REGS_PER_THREAD, REGS_PER_SM, SMEM_BASE
from .parse import manifest_entries

MODEL_LSE_ATOL, MODEL_LSE_RTOL = 5e-5, 2e-5

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


SUBNORMAL_HALF_SPACING = {"fp16": 2.0 ** -25, "bf16": 0.0}


EMU_AND_LOGITS = 4e-4  # the cubic exp2 emulation (8.6e-5 relative) and f32 logits, with margin


class UsageError(Exception):
    """Bad arguments (exit 2)."""


def split_nolse(text: str, sep: str) -> tuple[list[str], bool]:
    """A launch spelled on the command line, cut at `sep`: (its fields, whether it asks for LSE). A
    last field `nolse` (every kind of shape: --shape, --lens, --kv) launches with lse_ptr = 0."""
    fields = text.split(sep)
    with_lse = fields[-1].strip() != "nolse"
    return (fields if with_lse else fields[:-1]), with_lse


@dataclass(frozen=True)
class ScoreMods:
    """The run-time values of a kernel's score modifiers for one launch (KernelConfig.window /
    softcap / sinks say which the kernel takes). On the command line a shape takes them as
    space-separated suffixes after its fields (every kind: --shape, --lens, --kv):
      w=L,R      window_size in flash-attn's convention (-1 unbounded; a causal kernel's right is 0)
      cap=X      softcap X > 0 (the scaled scores become X * tanh(s / X))
      sink=Z     the sink logit of every query head, or sink=Z0,Z1,... one per query head (-inf allowed)
    e.g. --shape '1,300,500,4,1 w=128,0 cap=30 sink=50,-inf,0.5,2'. A value the kernel does not take is
    a usage error; one it takes but the shape omits gets DEFAULT_MODS' (sinks: default_sinks)."""
    window: tuple | None = None
    softcap: float = 0.0
    sinks: tuple | None = None  # one value (every head) or one per query head

    def __str__(self):
        parts = []
        if self.window is not None:
            parts.append(f"w={self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap={self.softcap:g}")
        if self.sinks is not None:
            parts.append("sink=" + ",".join(f"{z:g}" for z in self.sinks))
        return " ".join(parts)

    @classmethod
    def parse(cls, tokens, what: str) -> "ScoreMods | None":
        if not tokens:
            return None
        usage = f"{what}: score-modifier suffixes are w=L,R cap=X sink=Z[,Z...] (space-separated)"
        vals = {}
        for tok in tokens:
            key, eq, val = tok.partition("=")
            if not eq or key not in ("w", "cap", "sink") or key in vals:
                raise UsageError(f"{usage}, got {tok!r}")
            try:
                if key == "w":
                    w = tuple(int(x) for x in val.split(","))
                    if len(w) != 2 or min(w) < -1:
                        raise ValueError
                    vals[key] = w
                elif key == "cap":
                    c = float(val)
                    if not (math.isfinite(c) and c > 0):
                        raise ValueError
                    vals[key] = c
                else:
                    z = tuple(float(x) for x in val.split(","))
                    if any(math.isnan(x) or x == math.inf for x in z):
                        raise ValueError
                    vals[key] = z
            except ValueError:
                raise UsageError(f"{usage}: w takes two ints >= -1, cap a number > 0, sink numbers or -inf; "
                                 f"got {tok!r}") from None
        return cls(vals.get("w"), vals.get("cap", 0.0), vals.get("sink"))


# the values a launch of a kernel with the flag gets when its shape gives none
DEFAULT_MODS = ScoreMods(window=(100, 20), softcap=30.0)


SOFTCAPS = (30.0, 5.0, 50.0)  # default shape i of a softcap kernel takes SOFTCAPS[i % 3] (5: tanh far from linear)


def default_mods(cfg: dict, i: int, window=None, softcap: float | None = None) -> "ScoreMods | None":
    """The score-modifier values of default shape i: `window` (when the kernel has one), a softcap
    (when it has one: `softcap`, else SOFTCAPS[i % 3]); sinks are left to default_sinks (per seed:
    dominant, -inf, moderate, random)."""
    cap = SOFTCAPS[i % len(SOFTCAPS)] if softcap is None else float(softcap)
    m = ScoreMods(window=tuple(window) if cfg.get("window") and window is not None else None,
                  softcap=cap if cfg.get("softcap") else 0.0)
    return m if (m.window is not None or m.softcap) else None


def default_sinks(hq: int, seed: int) -> np.ndarray:
    """Sink logits [Hq] for a launch that names none: per head, by seed, one of a dominant sink
    (50: the row's keys get ~e^-50 of the weight), none (-inf), a moderate one (2) and one drawn
    from N(0, 1)."""
    rng = np.random.default_rng([seed, 4099])
    pool = (50.0, -np.inf, 2.0)
    return np.array([pool[(h + seed) % 4] if (h + seed) % 4 < 3 else rng.standard_normal() for h in range(hq)])


def shape_mods(cfg: dict, shape, seed: int) -> dict:
    """The score-modifier values of one launch as attention_exact's keywords (window, softcap, sinks
    [Hq]), from the shape's suffixes or the defaults; {} for a kernel without the flags."""
    mods = getattr(shape, "mods", None) or ScoreMods()
    flags = {"w": bool(cfg.get("window")), "cap": bool(cfg.get("softcap")), "sink": bool(cfg.get("sinks"))}
    given = {"w": mods.window is not None, "cap": bool(mods.softcap), "sink": mods.sinks is not None}
    extra = [k for k in flags if given[k] and not flags[k]]
    if extra:
        raise UsageError(f"shape {shape}: the kernel takes no {', '.join(extra)} value (its config lacks the flag)")
    out = {}
    if flags["w"]:
        out["window"] = tuple(mods.window if mods.window is not None else DEFAULT_MODS.window)
    if flags["cap"]:
        out["softcap"] = float(mods.softcap or DEFAULT_MODS.softcap)
    if flags["sink"]:
        if mods.sinks is None:
            out["sinks"] = default_sinks(shape.hq, seed)
        elif len(mods.sinks) in (1, shape.hq):
            out["sinks"] = np.broadcast_to(np.asarray(mods.sinks, np.float64), (shape.hq,)).copy()
        else:
            raise UsageError(f"shape {shape}: sink= takes one value or Hq = {shape.hq}, got {len(mods.sinks)}")
    return out


def mods_scalars(cfg: dict, values: dict, scale: float, gmem, hq: int) -> dict:
    """The ABI scalars (plan.abi_params) for the values, as the runtime passes them: window_left /
    window_right (reference.kernel_window_args), scale_log2 and softcap_in (kernel_score_args), and
    sink_ptr -> an fp32 [Hq] buffer "sinks" in gmem. scale_log2 is always in the dict."""
    args = reference.kernel_score_args(scale, values.get("softcap", 0.0))
    out = {"scale_log2": ("<f", args["scale_log2"])}
    if "softcap_in" in args:
        out["softcap_in"] = ("<f", args["softcap_in"])
    if cfg.get("window"):
        w = reference.kernel_window_args(values["window"], bool(cfg["causal"]))
        out.update({n: ("<i", int(x)) for n, x in w.items()})
    if cfg.get("sinks"):
        out["sink_ptr"] = ("<Q", gmem.add("sinks", np.asarray(values["sinks"], np.float32).reshape(hq)))
    return out


def parse_suffixes(text: str, what: str):
    """A shape spelled on the command line -> (its fields, ScoreMods or None): the fields are the first
    whitespace-separated word, the score-modifier suffixes the rest."""
    words = text.split()
    if not words:
        raise UsageError(f"{what}: empty")
    return words[0], ScoreMods.parse(words[1:], f"{what} {text!r}")


@dataclass
class Shape:
    b: int
    sq: int
    skv: int
    hq: int
    hkv: int
    with_lse: bool = True  # False: lse_ptr = 0, the API's default launch (nothing may be written through it)
    mods: ScoreMods | None = None  # window / softcap / sink values (None: the defaults, shape_mods)

    def __str__(self):
        return (f"B={self.b} Sq={self.sq} Skv={self.skv} Hq={self.hq} Hkv={self.hkv}" + ("" if self.with_lse else " no-LSE")
                + (f" {self.mods}" if self.mods else ""))

    @classmethod
    def parse(cls, s: str) -> "Shape":
        s, mods = parse_suffixes(s, "--shape")
        items, with_lse = split_nolse(s, ",")
        try:
            vals = [int(x) for x in items]
        except ValueError:
            raise UsageError(f"--shape {s!r}: five integers B,Sq,Skv,Hq,Hkv[,nolse]") from None
        if len(vals) != 5 or any(v < 1 for v in vals):
            raise UsageError(f"--shape {s!r}: five positive integers B,Sq,Skv,Hq,Hkv[,nolse]")
        return cls(*vals, with_lse=with_lse, mods=mods)


@dataclass
class RunResult:
    ok: bool
    shape: Shape
    seed: int
    kind: str = "ok"  # ok | mismatch | fault
    finding: str = ""  # the Fault kind (RACE, DEADLOCK, ...) or "mismatch"
    report: str = ""
    max_err: float = 0.0
    warp_instructions: int = 0
    seconds: float = 0.0
    o: np.ndarray | None = None
    lse: np.ndarray | None = None
    coverage: Coverage | None = None  # the paths this run took (coverage.py), also of a failed run


HUGE_ROWS = 400.0  # query rows scaled so their raw scores q.k reach ~1e4 (softcap kernels)
RESCALE_ROW = 3.0  # make_inputs(rescale_row=True): the last query position's scale


def make_inputs(shape: Shape, dtype: str, head_dim: int, seed: int, huge: bool = False, head_dim_v: int | None = None,
                rescale_row: bool = False):
    """Random q, k (head_dim columns), v (head_dim_v, default head_dim) in the kernel dtype (NumPy:
    float16, or float32 holding bf16 values): one
    K/V block of larger keys so the reverse visit order raises the row maximum by more than the
    rescale threshold (O rescales), and a few rows of x30 queries (large logits; none when Sq = 1,
    whose one row stays N(0, 1): a one-hot softmax hides a dropped term). huge (every launch of the
    harness: dense, varlen, KV cache): a few more rows x HUGE_ROWS, raw scores |q.k| ~ 1e4 (400 * 3 *
    sqrt(D) on block 0), deep in tanh's saturation under a softcap, and without one a row whose
    exponentials overflow unless the row maximum subtracted is the true one (a maximum over part of
    the row, or a stale reference, gives inf); at least one row stays N(0, 1) (Sq = 1: batch 0's;
    the other batches' are huge). rescale_row: the last query position is none of those but x
    RESCALE_ROW, a row that rescales wherever it reaches block 0 after another block: its scaled
    scores' maximum, ~3 * 2.6 on a block of N(0, 1) keys, rises to ~3 * 3 * 2.5 on block 0's, by
    ~15 (natural-log units; ~13 under a softcap of 30 or 50), well above the threshold (8 log2 =
    5.5; tests/test_kvcache_tools.py measures the margin on the default KV batches): an x30 row's
    maxima saturate such a cap on every block (they tie and nothing rescales), and a N(0, 1) row's
    rise is about the threshold."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((shape.b, shape.sq, shape.hq, head_dim))
    k = rng.standard_normal((shape.b, shape.skv, shape.hkv, head_dim))
    v = rng.standard_normal((shape.b, shape.skv, shape.hkv, head_dim if head_dim_v is None else head_dim_v))
    k[:, : min(128, shape.skv)] *= 3.0  # block 0 is visited last: its larger scores force rescales
    if rescale_row:
        pool = shape.sq - 1
        rows = rng.choice(pool, size=min(pool, max(1, shape.sq // 16)), replace=False)
        q[:, -1] *= RESCALE_ROW
    else:
        pool = shape.sq
        # one query position (a decode-like tile) stays a N(0, 1) row: a x30 or huge row's softmax is
        # one-hot, so a term dropped from its sums or exponentials would not show
        rows = rng.choice(pool, size=max(1, shape.sq // 16) if pool > 1 else 0, replace=False)
    q[:, rows] *= 30.0
    rest = np.setdiff1d(np.arange(pool), rows)  # not the x30 rows: fp16 q stays finite
    if huge and rest.size > 1:
        q[:, rng.choice(rest, size=max(1, rest.size // 8), replace=False)] *= HUGE_ROWS
    elif huge and pool == 1 and shape.b > 1:
        q[1:, 0] *= HUGE_ROWS  # Sq = 1: batch 0's row stays N(0, 1), the later batches' rows are huge
    return tuple(reference.round_to_dtype(x, dtype) for x in (q, k, v))


def _np_dtype_bytes(dtype: str, x: np.ndarray) -> np.ndarray:
    if dtype == "fp16":
        return np.ascontiguousarray(x.astype(np.float16))
    return np.ascontiguousarray((x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))


def _from_dtype_bytes(dtype: str, buf: np.ndarray, shape) -> np.ndarray:
    u16 = buf.view(np.uint16).reshape(shape)
    if dtype == "fp16":
        return u16.view(np.float16).astype(np.float64)
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def softcap_score_err(softcap: float, tanh_rel_err: float = 2.0 ** -24) -> float:
    """A bound on the error a softcap kernel adds to a scaled score (natural-log units), beyond an
    uncapped kernel's. The kernel's t = tanh(fp32(x * softcap_in)) and exponent t * scale_log2:
    - the argument carries 2 roundings (softcap_in, the product): relative 2^-23, moving t by at
      most max_a(a sech^2 a) 2^-23 = 0.45 * 2^-23;
    - tanh itself: |t| tanh_rel_err <= tanh_rel_err (2^-24: the emulator's and the model's
      correctly rounded tanh; reference.TANH_APPROX_MAX_REL_ERR, 2^-11, for hardware);
    - scale_log2 = fp32(softcap log2 e): relative 2^-24 of |t| softcap.
    Times softcap (the scaled score is softcap * t). The raw score's own fp32 error is not
    amplified: d/dx softcap tanh(x scale / softcap) <= scale."""
    return float(softcap) * (0.45 * 2.0 ** -23 + tanh_rel_err + 2.0 ** -24) if softcap else 0.0


def tolerance(o_ref, pv_abs, vsum, dtype, score_err: float = 0.0):
    """O's bound. score_err: a further bound d on each scaled score's error (softcap_score_err): each
    P element moves by a factor e^{+-d}, O = sum p v / sum p by at most (e^{2d} - 1) P|V|."""
    u = UNIT_ROUNDOFF[dtype]
    return ((2 * u + EMU_AND_LOGITS + math.expm1(2 * score_err)) * pv_abs + 2 * u * np.abs(o_ref)
            + SUBNORMAL_HALF_SPACING[dtype] * vsum + 1e-6)


def _pv_abs(q, k, v, causal, scale, **mods):
    """P |V| in float64 ([B, Sq, Hq, D]): the bound on what rounding P can move in O (P with the
    score modifiers: window, softcap, and a sink in the denominator)."""
    return reference.attention_exact(q, k, np.abs(np.asarray(v, np.float64)), causal, scale, **mods)[0]


def entry_registers(mod, man: dict | None, threads: int) -> int:
    """Registers per thread at kernel entry: the assembler's report when the manifest has one, else
    what ptxas gives a kernel of this many threads (.maxnreg, or 64K / threads rounded down to 8)."""
    asm = (man or {}).get("assembler", {}).get("entries", [])
    mine = [e for e in asm if e.get("name") == mod.entry]
    if mine or (asm and len(asm) == 1 and len(manifest_entries(man)) == 1):
        return int((mine or asm)[0]["registers"])
    if mod.maxnreg:
        return int(mod.maxnreg)
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // max(threads, 1) // 8 * 8)


def role_budgets(man: dict) -> dict:
    """warp -> (role, setmaxnreg) from the manifest: the PTX must ask for exactly these budgets."""
    return {w: (r["role"], int(r["setmaxnreg"])) for r in man.get("roles", []) if r.get("setmaxnreg")
            for w in r.get("warps", [])}


def run_coverage(man: dict, *emus) -> Coverage:
    """The coverage of one run from its emulators (the kernel's entry first: its warps are named by the
    manifest's roles; a further entry, the KV-cache combine kernel, is one role "all")."""
    cov = Coverage()
    for i, emu in enumerate(emus):
        if emu is not None:
            named = i == 0 and bool(man.get("roles"))
            cov.add(EntryCoverage.of_run(emu.mod, emu.hits, emu.dirs,
                                         (lambda w: role_of(man, w)) if named else (lambda w: "all")))
    return cov


def manifest_smem_layout(man: dict) -> dict:
    """The kernel's SMEM layout as the manifest's `smem_layout` section spells it (regions: offset,
    bytes_per_slot, slots; barriers: offset; tmem_addr_slot; align). A manifest without the
    section (sm_90a's before 2026-12-04) gets the one its config's pipeline has: the same rule
    (ir/layout.py) and writer."""
    if man.get("smem_layout"):
        return man["smem_layout"]
    return _layout_of_config(json.dumps(man["config"], sort_keys=True))


@functools.lru_cache(maxsize=16)
def _layout_of_config(config_json: str) -> dict:
    from ...ir import build_pipeline
    from ...ir.layout import layout_of
    from ...lower.manifest import smem_layout_section
    from ...spec.config import KernelConfig

    return smem_layout_section(layout_of(build_pipeline(KernelConfig.from_dict(json.loads(config_json)))))["smem_layout"]


def barrier_names(man: dict) -> dict:
    """SMEM address (as the emulator places the aligned dynamic window) -> "name[slot]" of every mbarrier
    ({} for a manifest with no smem_layout whose config builds no pipeline: the reports then name
    mbarriers by address)."""
    try:
        lay = manifest_smem_layout(man)
    except (ValueError, KeyError, TypeError):  # ConfigError, PlanError, a config that is no KernelConfig's
        return {}
    slots = {b["name"]: b.get("slots", 1) for b in man.get("barriers", [])}
    align = int(lay.get("align", 1024))
    base = (SMEM_BASE + align - 1) // align * align
    return {base + off + 8 * s: f"{name}[{s}]" for name, off in lay["barriers"].items()
            for s in range(int(slots.get(name, 1)))}


def role_of(man: dict, warp: int) -> str:
    for r in man.get("roles", []):
        if warp in r.get("warps", []):
            return r["role"]
    return f"warp {warp}"


def _model_lse(q, k, v, cfg, scale, mods=None):
    """LSE of reference.fa4_forward for the manifest's config (None when it does not build one)."""
    from ...spec.config import ConfigError, KernelConfig
    try:
        kc = KernelConfig(**cfg)
    except (TypeError, ValueError, ConfigError):
        return None
    return reference.fa4_forward(q, k, v, kc, softmax_scale=scale, **(mods or {}))[1]


def judge(o, lse, q, k, v, cfg, scale, mods: dict | None = None):
    """O and LSE of a launch against reference.attention_exact; mods: the score modifiers' values
    (shape_mods: window, softcap, sinks), {} / None for a kernel without them."""
    causal = bool(cfg["causal"])
    dtype = cfg["dtype"]
    mods = dict(mods or {})
    o_ref, lse_ref = reference.attention_exact(q, k, v, causal, scale, **mods)
    pv = _pv_abs(q, k, v, causal, scale, **mods)
    g = q.shape[2] // k.shape[2]
    vsum = np.repeat(np.abs(v.astype(np.float64)).sum(axis=1), g, axis=1)[:, None]
    score_err = softcap_score_err(mods.get("softcap", 0.0))
    tol = tolerance(o_ref, pv, vsum, dtype, score_err)
    err = np.abs(o - o_ref)
    nan = np.isnan(o)
    bad = nan | (err > tol)
    max_err = float(np.nanmax(np.where(nan, np.inf, err))) if o.size else 0.0
    msgs = []
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        msgs.append(f"O: {int(bad.sum())} of {o.size} elements wrong ({int(nan.sum())} never written / NaN); "
                    f"max |err| {max_err:.4g}")
        b, s, h, dd = first
        msgs.append(f"  first bad (b, s, h, d) = {first}: got {o[first]:.6g}, reference {o_ref[first]:.6g}, "
                    f"tolerance {tol[first]:.3g}")
        bad_d = np.flatnonzero(bad.any(axis=(0, 1, 2)))
        msgs.append(f"  bad head-dim columns: {_ranges(bad_d)}; bad rows (s): {_ranges(np.flatnonzero(bad.any(axis=(0, 2, 3))))}")
        ratio = o[bad & ~nan] / np.where(o_ref[bad & ~nan] == 0, np.nan, o_ref[bad & ~nan])
        if ratio.size and np.isfinite(ratio).any():
            msgs.append(f"  got/reference over the bad elements: median {np.nanmedian(ratio):.4g}")
    if lse is not None:
        masked = np.isinf(lse_ref)
        lbad = np.zeros(lse.shape, bool)
        lbad |= np.isnan(lse)
        lbad |= masked & ~(lse == -np.inf)
        seen = ~masked
        with np.errstate(invalid="ignore"):
            lerr = np.abs(np.where(seen, lse - lse_ref, 0))
        u = UNIT_ROUNDOFF[dtype]
        lbad |= seen & ~(lerr <= u + 5e-4 + score_err + 1e-6 * np.abs(np.where(seen, lse_ref, 0)))
        if lbad.any():
            first = tuple(int(i) for i in np.argwhere(lbad)[0])
            msgs.append(f"LSE: {int(lbad.sum())} of {lse.size} wrong; first (b, h, s) = {first}: got {lse[first]:.6g}, "
                        f"reference {lse_ref[first]:.6g}")
        # The kernel's own arithmetic: reference.fa4_forward replays the FA4 algorithm as the
        # generated kernel computes it (the same exp2 split and cubic, the conditional rescale,
        # fp32 state). Measured on every default variant (2 seeds): sm_90a within 9e-5 + 2e-6*|LSE|
        # of it; sm_100a up to ~9e-6 relative in ~3% of rows. Cause (traced on the registers): S
        # differs from the model's by an ulp (accumulation order), so the row's reference moves by
        # an ulp and its largest element's x = s*scale - ref*scale lands just below 0 instead of
        # on it; in an emulated column the cubic then evaluates p(1 - eps) / 2 = 1 - 8.6e-5 where
        # p(0) = 1 is exact (the fit's endpoint error), and that element dominates the row sum.
        # With emu_pairs = 0 the two agree to 3 ulp. An exponential computed wrongly moves LSE by
        # 1e-3 and more (exp2_round_to_nearest: 3.7e-3) while O stays inside the dtype's tolerance.
        lse_model = _model_lse(q, k, v, cfg, scale, mods)
        if lse_model is not None:
            with np.errstate(invalid="ignore"):
                merr = np.abs(np.where(seen, lse - lse_model, 0))
            mbad = seen & ~(merr <= MODEL_LSE_ATOL + MODEL_LSE_RTOL * np.abs(np.where(seen, lse_model, 0)))
            if mbad.any() and not lbad.any():
                first = tuple(int(i) for i in np.argwhere(mbad)[0])
                msgs.append(f"LSE: {int(mbad.sum())} of {lse.size} differ from the kernel's arithmetic "
                            f"(reference.fa4_forward) by more than {MODEL_LSE_ATOL:g} + {MODEL_LSE_RTOL:g}*|LSE| "
                            f"(max {float(np.nanmax(merr)):.3g}); first (b, h, s) = {first}: got {lse[first]:.8g}, "
                            f"model {lse_model[first]:.8g} (an exponential or the softmax state computed "
                            "differently from the model)")
    # rows that see no key (LSE -inf, or the sink's): O exactly 0
    sees = reference.visible_keys(q.shape[1], k.shape[1], causal, mods.get("window")).any(axis=1)
    if not sees.all() and not (o[:, ~sees] == 0).all():
        msgs.append("O: rows that see no key are not exactly 0")
    return (not msgs), "\n".join(msgs), max_err


def _ranges(idx) -> str:
    idx = list(int(i) for i in idx)
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")
