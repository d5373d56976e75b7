"""What one emulated run is: its shape and inputs, the roles of the kernel's warps, its result, and
the judgement of O and LSE against the float64 reference. Below the dense/varlen harness and the KV-cache
launcher (kvcache.py), which both read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import reference
from .coverage import Coverage, EntryCoverage
from .machine import MAX_REGS_PER_THREAD, REGS_PER_SM
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


@dataclass
class Shape:
    b: int
    sq: int
    skv: int
    hq: int
    hkv: int
    with_lse: bool = True  # False: lse_ptr = 0, the API's default launch (nothing may be written through it)

    def __str__(self):
        return f"B={self.b} Sq={self.sq} Skv={self.skv} Hq={self.hq} Hkv={self.hkv}" + ("" if self.with_lse else " no-LSE")

    @classmethod
    def parse(cls, s: str) -> "Shape":
        items, with_lse = split_nolse(s, ",")
        try:
            vals = [int(x) for x in items]
        except ValueError:
            raise UsageError(f"--shape {s!r}: five integers B,Sq,Skv,Hq,Hkv[,nolse]") from None
        if len(vals) != 5 or any(v < 1 for v in vals):
            raise UsageError(f"--shape {s!r}: five positive integers B,Sq,Skv,Hq,Hkv[,nolse]")
        return cls(*vals, with_lse=with_lse)


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


def make_inputs(shape: Shape, dtype: str, head_dim: int, seed: int):
    """Random q, k, v in the kernel dtype (NumPy: float16, or float32 holding bf16 values): one
    K/V block of larger keys so the reverse visit order raises the row maximum by more than the
    rescale threshold (O rescales), and a few rows of x30 queries (large logits)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((shape.b, shape.sq, shape.hq, head_dim))
    k = rng.standard_normal((shape.b, shape.skv, shape.hkv, head_dim))
    v = rng.standard_normal((shape.b, shape.skv, shape.hkv, head_dim))
    k[:, : min(128, shape.skv)] *= 3.0  # block 0 is visited last: its larger scores force rescales
    rows = rng.choice(shape.sq, size=max(1, shape.sq // 16), replace=False)
    q[:, rows] *= 30.0
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


def tolerance(o_ref, pv_abs, vsum, dtype):
    u = UNIT_ROUNDOFF[dtype]
    return (2 * u + EMU_AND_LOGITS) * pv_abs + 2 * u * np.abs(o_ref) + SUBNORMAL_HALF_SPACING[dtype] * vsum + 1e-6


def _pv_abs(q, k, v, causal, scale):
    """P |V| in float64 ([B, Sq, Hq, D]): the bound on what rounding P can move in O."""
    b, sq, hq, d = q.shape
    s = reference.masked_scores(q, k, causal, scale)
    m = s.max(axis=-1, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(m), m, 0)[..., None])
    den = e.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(den[..., None] > 0, e / den[..., None], 0.0)
    pv = np.einsum("bhgij,bjhd->bhgid", p, np.abs(v.astype(np.float64)))
    return pv.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d)


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


def role_of(man: dict, warp: int) -> str:
    for r in man.get("roles", []):
        if warp in r.get("warps", []):
            return r["role"]
    return f"warp {warp}"


def _model_lse(q, k, v, cfg, scale):
    """LSE of reference.fa4_forward for the manifest's config (None when it does not build one)."""
    from ..config import ConfigError, KernelConfig
    try:
        kc = KernelConfig(**cfg)
    except (TypeError, ValueError, ConfigError):
        return None
    return reference.fa4_forward(q, k, v, kc, softmax_scale=scale)[1]


def judge(o, lse, q, k, v, cfg, scale):
    causal = bool(cfg["causal"])
    dtype = cfg["dtype"]
    o_ref, lse_ref = reference.attention_exact(q, k, v, causal, scale)
    pv = _pv_abs(q, k, v, causal, scale)
    g = q.shape[2] // k.shape[2]
    vsum = np.repeat(np.abs(v.astype(np.float64)).sum(axis=1), g, axis=1)[:, None]
    tol = tolerance(o_ref, pv, vsum, dtype)
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
        lbad |= seen & ~(lerr <= u + 5e-4 + 1e-6 * np.abs(np.where(seen, lse_ref, 0)))
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
        lse_model = _model_lse(q, k, v, cfg, scale)
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
        if masked.any():
            rows = masked.transpose(0, 2, 1)  # (B, Sq, Hq)
            if not (o[rows] == 0).all():
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
