#!/usr/bin/env python3
"""The budget tables of docs/HEAD_DIMS.md, computed by the code's own checks (issue 26).

    python scripts/head_dim_budgets.py

For every (head_dim, head_dim_v) pair fa4gen generates or plans (spec.config HEAD_DIM_PAIRS and
HEAD_DIM_PLANNED), on both targets, a dense non-causal GQA-1 bf16 kernel with the config's defaults:

- "IR": the pipeline fa4gen.ir.build_pipeline makes for the pair (inside spec.config.planning_head_dims), its SMEM
  layout (ir/layout.py layout_of, the kernels' own) and the budget findings of verify.static_findings
  (TMEM_*, SMEM_*, REG_*); the sm_90a rings are ir/sm90.sm90_stages', a PlanError when < 2 K/V stages fit.
- design options: that pipeline with its regions edited as the row says, laid out and checked by the
  same functions (so an option's SMEM bytes and TMEM overlaps are the verifier's, not arithmetic here).
- sm_90a registers per consumer thread: the wgmma fragments (plan.sm90_reg_floor; without the QK/PV
  overlap where plan.sm90_overlap says so) against plan.SM90_REGS.
- a throughput model per 128-row Q tile and K/V block (MODEL, published peak rates; not measured).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa4gen.ir import build_pipeline  # noqa: E402
from fa4gen.ir.core import Region, Space  # noqa: E402
from fa4gen.ir.layout import layout_of  # noqa: E402
from fa4gen.ir.sm100 import sm100_kv_stages, sm100_o_staged, smem_pipeline as smem100  # noqa: E402
from fa4gen.ir.sm90 import sm90_o_staged, sm90_stages, smem_pipeline  # noqa: E402
from fa4gen.spec.config import (HEAD_DIM_PAIRS, HEAD_DIM_PLANNED, KernelConfig,  # noqa: E402
                                planning_head_dims)
from fa4gen.spec.exp2 import emulated_columns  # noqa: E402
from fa4gen.spec.plan import ARCH_LIMITS, SM90_REGS, sm90_consumers, sm90_overlap, sm90_reg_floor  # noqa: E402
from fa4gen.spec.tiles import ROWS, PlanError, kv_block_keys, q_tile_rows  # noqa: E402
from fa4gen.verify.verify import static_findings  # noqa: E402

BUDGET_CODES = ("TMEM_", "SMEM_", "REG_")
EMU_OPS = 9  # FP32/INT-pipe instructions per emulated exponential (spec/exp2.py's sequence)

# Published peak rates per SM per clock (dense 16-bit MMA, MUFU ex2, SMEM reads): B200 2.25 PFLOP/s
# over 148 SMs at ~1.86 GHz; H100/H200 SXM 989 TFLOP/s over 132 SMs at ~1.83 GHz; MUFU and SMEM
# unchanged from Hopper to Blackwell (the FA4 paper's "asymmetric scaling"). FP32 lanes: 128.
MODEL = {"sm_100a": {"mma_flops": 8192, "ex2": 16, "smem_bytes": 128, "fp32_lanes": 128},
         "sm_90a": {"mma_flops": 4096, "ex2": 16, "smem_bytes": 128, "fp32_lanes": 128}}


def all_pairs(arch: str) -> list[tuple[int, int]]:
    return sorted(set(HEAD_DIM_PAIRS[arch]) | set(HEAD_DIM_PLANNED))


@dataclass(frozen=True)
class Row:
    arch: str
    d: int
    dv: int
    design: str
    smem: int  # bytes the layout requests (used + alignment slack)
    regions: str  # SMEM regions as slots x bytes
    tmem: str  # TMEM regions' columns ("" on sm_90a)
    regs: str  # the register budget in words
    problems: tuple[str, ...]  # budget findings, or why the design does not exist

    @property
    def fits(self) -> bool:
        return not self.problems


def _bytes(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n}B"


def _smem_text(pipe) -> str:
    return ", ".join(f"{r.name} {r.slots}x{_bytes(r.bytes_per_slot)}" for r in pipe.regions if r.space is Space.SMEM)


def _tmem_text(pipe) -> str:
    return " ".join(f"{r.name}[{r.col},{r.col_end})" for r in pipe.regions if r.space is Space.TMEM and not r.alias_of)


def row_of(pipe, design: str, regs: str = "", extra: tuple[str, ...] = ()) -> Row:
    """A Row from the verifier's static budget checks and the kernels' layout of pipe."""
    cfg = pipe.config
    problems = [str(f) for f in static_findings(pipe) if f.code.startswith(BUDGET_CODES)]
    lay = layout_of(pipe)
    if lay.total > pipe.smem_limit and not any("SMEM_BUDGET" in p for p in problems):
        problems.append(f"[SMEM_BUDGET] smem: {lay.total} > {pipe.smem_limit}")
    if not regs:
        regs = (f"{sum(32 * len(r.warps) * r.regs for r in pipe.roles)} / {ARCH_LIMITS[pipe.arch].regs_per_sm} per CTA"
                if pipe.roles else "roles to design")
    return Row(pipe.arch, cfg.head_dim, cfg.head_dim_v, design, lay.total, _smem_text(pipe), _tmem_text(pipe), regs,
               tuple(problems) + extra)


def _edit(pipe, *, drop=(), slots=None, slot_bytes=None, tmem=None):
    """pipe with SMEM regions dropped or resized and (optionally) its TMEM regions replaced, and no
    roles: a design option's programs do not exist yet, so only its regions are checked (the role
    programs of the IR address today's regions: 128-column S, two O tiles)."""
    regs = []
    for r in pipe.regions:
        if r.name in drop or (tmem is not None and r.space is Space.TMEM):
            continue
        if slots and r.name in slots:
            r = dataclasses.replace(r, slots=slots[r.name])
        if slot_bytes and r.name in slot_bytes:
            r = dataclasses.replace(r, bytes_per_slot=slot_bytes[r.name])
        regs.append(r)
    return dataclasses.replace(pipe, regions=tuple(regs) + tuple(tmem or ()), roles=())


def _one_tile_tmem(s_cols: int, dv: int) -> tuple[Region, ...]:
    """One Q tile per CTA: S double-buffered (S(j+1) = Q K(j+1) while the softmax reads S(j)), P in
    each S's upper half as today, one O tile after them."""
    out = []
    for i in (0, 1):
        out += [Region(f"S{i}", Space.TMEM, "f32", ROWS, col=i * s_cols, cols=s_cols),
                Region(f"P{i}", Space.TMEM, "f16", ROWS, col=i * s_cols + s_cols // 2, cols=s_cols // 2, alias_of=f"S{i}")]
    return tuple(out) + (Region("O0", Space.TMEM, "f32", ROWS, col=2 * s_cols, cols=dv),)


def _deepest(make, stages=(4, 3, 2)) -> Row:
    """The first (deepest K/V ring) design that fits, else the shallowest's row."""
    rows = [make(k) for k in stages]
    return next((r for r in rows if r.fits), rows[-1])


def sm100_rows(d: int, dv: int) -> list[Row]:
    base = KernelConfig(arch="sm_100a", head_dim=d, head_dim_v=dv)
    tile, vtile = ROWS * d * 2, ROWS * dv * 2
    # the IR's rings and O path: ir/sm100.sm100_kv_stages and sm100_o_staged (ir/layout.o_staged)
    staged = "O staged" if sm100_o_staged(base) else "O from registers"
    tiles = {2: "2 Q tiles/CTA", 1: "1 Q tile/CTA, one S"}[base.tiles_per_task]
    rows = [row_of(build_pipeline(base), f"IR: {tiles}, {sm100_kv_stages(base)} K/V stages, {staged}")]
    if base.tiles_per_task == 2 and (d, dv) not in HEAD_DIM_PLANNED:
        return rows
    # the designs weighed where two tiles do not fit TMEM (spec.tiles.q_tiles_per_task): today's map
    # with two tiles, and two tiles with O staged (what the staging rule weighs)
    rows.append(row_of(smem100(base, 2, False, tiles=2), "2 Q tiles/CTA, 2 K/V stages, O from registers"))
    for k in (3, 2):
        rows.append(row_of(smem100(base, k, True, tiles=2), f"2 Q tiles, {k} K/V stages, O staged"))

    def one_tile(k: int, keys: int, kv_slot: int, label: str) -> Row:
        pipe = _edit(smem100(base, k, False, tiles=1), slots={"Q": 1},
                     slot_bytes={"KV": kv_slot}, tmem=_one_tile_tmem(keys, dv))
        return row_of(pipe, f"{label}, {k} K/V stages")
    rows.append(_deepest(lambda k: one_tile(k, 128, max(tile, vtile), "1 Q tile/CTA, S double-buffered")))
    rows.append(_deepest(lambda k: one_tile(k, 64, max(tile, vtile) // 2, "1 Q tile/CTA, 64-key K/V blocks")))
    # cta_group::2: the pair's MMA is M = 256 (each CTA's 128-row Q tile); each CTA holds half of the B
    # operand: 64 of K's 128 keys (QK^T, N = keys) and dv/2 of V's columns (PV, N = dv)
    pair_slot = max(64 * d * 2, ROWS * (dv // 2) * 2)
    rows.append(_deepest(lambda k: one_tile(k, 128, pair_slot, "cta_group::2 pair, 1 Q tile/CTA")))
    return rows


def sm90_headroom_today() -> int:
    """The smallest consumer budget - floor of a dense sm_90a kernel fa4gen builds today."""
    out = []
    for d, dv in HEAD_DIM_PAIRS["sm_90a"]:
        for rows in {ROWS, q_tile_rows("sm_90a", d, 1)}:
            cfg = KernelConfig(arch="sm_90a", head_dim=d, head_dim_v=dv, block_m=rows)
            out.append(SM90_REGS[sm90_consumers(rows)][1] - sm90_reg_floor(dv, cfg.block_n, sm90_overlap(cfg)))
    return min(out)


def _regs90(cfg: KernelConfig, block_n: int) -> str:
    budget = SM90_REGS[sm90_consumers(cfg.block_m)][1]
    overlap = sm90_overlap(cfg) if block_n == cfg.block_n else True
    floor = sm90_reg_floor(cfg.head_dim_v, block_n, overlap)
    return f"{floor} / {budget} (headroom {budget - floor}{'' if overlap else ', PV then QK'})"


def sm90_rows(d: int, dv: int) -> list[Row]:
    cfg = KernelConfig(arch="sm_90a", head_dim=d, head_dim_v=dv, block_m=q_tile_rows("sm_90a", d, 1))
    low = sm90_headroom_today()

    def reg_problem(c, n):
        overlap = sm90_overlap(c) if n == c.block_n else True
        left = SM90_REGS[sm90_consumers(c.block_m)][1] - sm90_reg_floor(c.head_dim_v, n, overlap)
        return (f"[REG_HEADROOM] consumer: {left} registers beside the fragments, fewer than the {low} of "
                f"today's tightest kernel",) if left < low else ()

    def o_text(c):  # how the IR's kernel stores O (ir/sm90.sm90_o_staged: staged where a ring fits beside it)
        return "O staged" if sm90_o_staged(c) else "O from registers"

    def ir_row(c, label):
        try:
            nq, kv = sm90_stages(c)
        except PlanError as e:
            pipe = smem_pipeline(c, 1, 2)
            return row_of(pipe, f"{label}: no ring fits", _regs90(c, c.block_n), (f"[PlanError] {e}",))
        return row_of(smem_pipeline(c, nq, kv), f"{label}: {nq} Q slots, {kv} K/V stages", _regs90(c, c.block_n),
                      reg_problem(c, c.block_n))

    keys = "" if cfg.block_n == ROWS else f", {cfg.block_n}-key K/V blocks"
    rows = [ir_row(cfg, f"IR ({cfg.block_m}-row tile{keys}, {o_text(cfg)})")]
    if (d, dv) in HEAD_DIM_PAIRS["sm_90a"] and cfg.block_n == ROWS:
        return rows
    if cfg.block_n != ROWS:  # what 128-key blocks would take (the smallest ring, O from the registers)
        pipe = _edit(smem_pipeline(cfg, 1, 2, False), slot_bytes={"K": ROWS * d * 2, "V": ROWS * dv * 2})
        rows.append(row_of(pipe, f"{ROWS}-key K/V blocks, O from registers: 1 Q slots, 2 K/V stages",
                           _regs90(cfg, ROWS), reg_problem(cfg, ROWS)))
    if d == 96:  # the three-consumer 192-row tile (FA3's choice at 96; fa4gen's at 64)
        wide = cfg.replace(block_m=192)
        rows.append(ir_row(wide, f"IR (192-row tile, {o_text(wide)})"))
    nostage = cfg.replace(kvcache=True, block_m=ROWS)  # the KV-cache kernels' layout: O stored from the registers
    if sm90_o_staged(cfg):
        rows.append(ir_row(nostage, "O from registers (the KV-cache layout)"))
    # smaller K/V blocks: the largest multiple of 16 keys whose ring (2 Q slots, else 1; >= 2 stages) fits
    for c, o_staged, staged in ((cfg, True, "O staged"), (nostage, False, "O from registers")):
        for n in range(112, 15, -16):
            found = None
            for nq in (2, 1):
                for kv in (4, 3, 2):
                    pipe = smem_pipeline(c, nq, kv, o_staged)
                    pipe = _edit(pipe, slot_bytes={"K": n * d * 2, "V": n * dv * 2})
                    if layout_of(pipe).total <= pipe.smem_limit:
                        found = pipe
                        break
                if found:
                    break
            if found:
                nq, kv = found.region("Q").slots, found.region("K").slots
                rows.append(row_of(found, f"{n}-key K/V blocks, {staged}: {nq} Q slots, {kv} K/V stages",
                                   _regs90(c, n), reg_problem(c, n)))
                break
    return rows


def throughput(arch: str, d: int, dv: int, design: str, block_n: int = 128, tiles_per_load: int = 1,
               b_share: float = 1.0, b_reads: int = 1, emu: float | None = None, serial: bool = False) -> dict:
    """Clocks per 128-row Q tile and block_n-key K/V block on one SM: the tensor core (QK^T and PV),
    MUFU (the exponentials it takes), the FP32 pipes' emulated exponentials, SMEM operand reads (Q,
    and K and V b_reads times, b_share of them: a cta_group::2 CTA holds half), and the K/V bytes per
    clock the CTA loads when the tensor core sets the pace (one load serves tiles_per_load tiles).
    serial: one S buffer, so the softmax of a block and the tensor core's work alternate (the pace is
    their sum, not the larger)."""
    m = MODEL[arch]
    if emu is None:
        emu = float(emulated_columns(KernelConfig(arch=arch), False).mean())
    mma = 2 * ROWS * block_n * (d + dv) / m["mma_flops"]
    exps = ROWS * block_n
    mufu = exps * (1 - emu) / m["ex2"]
    fma = exps * emu * EMU_OPS / m["fp32_lanes"]
    smem = (ROWS * d * 2 + b_reads * b_share * block_n * (d + dv) * 2) / m["smem_bytes"]
    kv_bytes = block_n * (d + dv) * 2 * b_share / tiles_per_load
    top = max(mma, mufu, smem)
    bound = " = ".join(name for t, name in ((mma, "tensor"), (mufu, "MUFU"), (smem, "SMEM")) if t >= 0.95 * top)
    if serial:
        top, bound = mma + mufu, f"tensor + MUFU in series ({mma / (mma + mufu):.0%} of tensor peak)"
    return {"arch": arch, "pair": (d, dv), "design": design, "mma": mma, "mufu": mufu, "emu_fma": fma, "smem": smem,
            "kv_bytes_per_clk": kv_bytes / top, "bound": bound, "emu": emu}


def model_rows() -> list[dict]:
    """The designs the budget tables let fit (today's two-tile sm_100a design cannot hold D = 256, nor
    a 128-key sm_90a ring)."""
    out = []
    for d, dv in all_pairs("sm_100a"):
        if d != 256:
            out.append(throughput("sm_100a", d, dv, "2 Q tiles/CTA", tiles_per_load=2))
            continue
        out.append(throughput("sm_100a", d, dv, "1 Q tile/CTA, one S (generated)", tiles_per_load=1, serial=True))
        out.append(throughput("sm_100a", d, dv, "1 Q tile/CTA, S double-buffered", tiles_per_load=1))
        out.append(throughput("sm_100a", d, dv, "1 Q tile/CTA, 64-key blocks", block_n=64, tiles_per_load=1))
        out.append(throughput("sm_100a", d, dv, "cta_group::2 pair", tiles_per_load=1, b_share=0.5))
    for d, dv in all_pairs("sm_90a"):
        # two consumer warpgroups per 128 rows: each one's wgmma reads all of K and V
        if d != 256:
            out.append(throughput("sm_90a", d, dv, "128-row tile", b_reads=2))
        else:
            n = kv_block_keys("sm_90a", d)  # the kernel's blocks (64)
            out.append(throughput("sm_90a", d, dv, f"128-row tile, {n}-key blocks", block_n=n, b_reads=2))
            out.append(throughput("sm_90a", d, dv, "128-row tile, 80-key blocks (FA3's)", block_n=80, b_reads=2))
    return out


def budget_rows(arch: str) -> list[Row]:
    """Every row of `arch`'s budget table (the planned pairs' configs exist inside planning_head_dims)."""
    with planning_head_dims():
        return [r for d, dv in all_pairs(arch) for r in (sm100_rows if arch == "sm_100a" else sm90_rows)(d, dv)]


def _fmt_rows(rows: list[Row]) -> list[str]:
    out = ["| D, DV | design | SMEM bytes | SMEM regions | TMEM columns | registers | fits |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "yes" if r.fits else "NO: " + "; ".join(r.problems)
        out.append(f"| {r.d}, {r.dv} | {r.design} | {r.smem} | {r.regions} | {r.tmem or '-'} | {r.regs} | {fits} |")
    return out


def main() -> int:
    print(f"SMEM limit per CTA: sm_100a {ARCH_LIMITS['sm_100a'].smem_per_cta}, sm_90a "
          f"{ARCH_LIMITS['sm_90a'].smem_per_cta} bytes (with {ARCH_LIMITS['sm_90a'].smem_align} of alignment "
          f"slack counted in each row); TMEM {ARCH_LIMITS['sm_100a'].tmem_cols} columns.\n")
    print("## sm_100a\n")
    print("\n".join(_fmt_rows(budget_rows("sm_100a"))))
    print(f"\n## sm_90a (consumer registers: fragment floor / setmaxnreg budget; today's tightest headroom "
          f"{sm90_headroom_today()})\n")
    print("\n".join(_fmt_rows(budget_rows("sm_90a"))))
    print("\n## Throughput model: clocks per 128-row Q tile and K/V block on one SM\n")
    print("| target | D, DV | design | tensor core | MUFU | emulated exp (FP32 pipes) | SMEM reads | bound | "
          "K/V bytes/clk loaded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in model_rows():
        d, dv = t["pair"]
        print(f"| {t['arch']} | {d}, {dv} | {t['design']} | {t['mma']:.0f} | {t['mufu']:.0f} | {t['emu_fma']:.0f} "
              f"({t['emu']:.1%}) | {t['smem']:.0f} | {t['bound']} | {t['kv_bytes_per_clk']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
