"""The ABI manifest of a generated kernel (docs/ABI.md), one builder for both targets.

`manifest(pipe, smem_bytes=, o_rows=, grid=, variant=, sections=)` writes the JSON that sits beside
each .ptx/.cubin and that the loader (fa4gen/runtime/runtime.py, launch.py, api.py), the emulator
(fa4gen/evidence/ptxemu), `fa4gen check` and the CLI read. Each fact comes from one place: the KernelConfig
(name, config, hash, GQA / varlen / KV-cache records, params, tensor-map dims), the Pipeline (arch,
threads), and the target facts its lowering passes in: the SMEM bytes its PTX uses, the rows one O
store box covers, how its scheduler walks the tasks (GridFacts) and its own sections (sm_100a: the
SMEM layout, `smem_layout_section`; sm_90a: the `sm90` record). codegen adds the pipeline summary
and the assembler report on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import GENERATOR_VERSION, KernelConfig
from ..ir.core import Pipeline
from ..spec.plan import (KVCACHE_ORDER, VARLEN_ORDER, abi_params, gqa_manifest, kv_box_rows, kvcache_manifest, qk_panels, qo_map_dims, varlen_manifest,
                         score_mods_record, tma_l2_promotion, vo_panels)

__all__ = ["ENTRY", "GridFacts", "entry_params", "grid_section", "manifest", "score_mods_record",
           "smem_layout_section", "tensor_maps"]

ENTRY = "fa4_fwd"  # the attention kernel's entry on both targets (the KV-cache combine: plan.COMBINE_ENTRY)


@dataclass(frozen=True)
class GridFacts:
    """How a target's kernel walks its task list: the data behind the manifest's `grid` section."""

    policy: str  # "persistent" (min(num_tasks, SMs) CTAs loop over tasks) or "one_per_task"
    deal: str  # how a CTA steps to its next task, as the linear, varlen and KV-cache orders end
    lpt_deal: str  # the same for the dense causal order (LPT in L2 sections)
    varlen_lpt: bool  # causal varlen: the sectioned LPT (plan.VARLEN_ORDER[True]); else linear, heaviest first
    mode_keys: bool  # task_unit names the split (KV cache) or sequence (varlen) key of a task
    launch: bool  # the section also spells the host's num_tasks and grid_x and the kernel's clamp


# tiles_per_task -> (what a task holds, its m key, the order's m unit, the LPT order's m units)
_UNITS = {1: ("one {rows}-row Q tile", "m_block", "m_block", "m_block"),
          2: ("two {rows}-row Q tiles in flight", "pair of m_blocks", "m_block pair", "m_block pairs")}


# How a CTA steps to its next task under the dynamic deal (plan.dynamic_tasks), as the orders end
DYNAMIC_DEAL = "; dynamic deal: each CTA takes the next task from task_counter"


def grid_section(cfg: KernelConfig, g: GridFacts) -> dict:
    """The manifest's `grid`: policy, task unit, tiles per task and the task order in words (plus,
    where the target spells them, the host's task count, grid size and the kernel's clamp)."""
    n = cfg.tiles_per_task  # Q tiles a task keeps in flight (1 or 2); its m unit is that many m_blocks
    held, key, unit, lpt_units = _UNITS[n]
    hg, hgu = (f" * {cfg.head_groups}", "head group, ") if cfg.head_groups > 1 else ("", "")
    if g.mode_keys and cfg.kvcache:
        keys = f"split, batch, kv_head, {hgu}{key}"
    elif g.mode_keys and cfg.varlen:
        keys = f"sequence, kv_head, {hgu}{key} of the sequence"
    else:
        keys = f"batch, kv_head, {hgu}{key}"
    if cfg.kvcache:
        order = KVCACHE_ORDER + (f"; m unit = a {key}" if n > 1 else "") + g.deal
        num_tasks = f"batch * num_heads_kv{hg} * ceil(num_m_blocks / {n}) * max(num_splits, 1)"
        note = f"the kernel clamps num_tasks to {num_tasks}"
    elif cfg.varlen:
        lpt = cfg.causal and g.varlen_lpt
        order = VARLEN_ORDER[lpt] + (" and heaviest first" if cfg.causal and not lpt else "") + g.deal
        num_tasks = f"fa4gen.spec.plan.varlen_task_bound(batch, total_q, num_heads_kv{hg}, {cfg.seq_q_per_task})"
        note = "the kernel stops at the last sequence's tasks: num_tasks is only a bound"
    else:
        order = (f"LPT in sections of l2_group (batch, kv_head) pairs: {lpt_units} heaviest first, "
                 f"the section's pairs fastest{g.lpt_deal}" if cfg.causal else f"linear: {unit} fastest{g.deal}")
        num_tasks = f"batch * num_heads_kv{hg} * ceil(num_m_blocks / {n})"
        note = f"the kernel clamps num_tasks to {num_tasks}: a grid sized in single Q tiles only adds idle CTAs"
    grid = {"policy": g.policy, "task_unit": f"{held.format(rows=cfg.block_m)}: ({keys})"}
    if g.launch:
        grid["num_tasks"] = num_tasks
    grid.update(tiles_per_task=n, order=order)
    if g.launch:
        grid["grid_x"] = "num_tasks" if g.policy == "one_per_task" else "min(num_tasks, SM count read from the device)"
        grid["note"] = note
    return grid


def tensor_maps(cfg: KernelConfig, o_rows: int) -> dict:
    """The four TMA maps: Q/O 5-D over (D, heads of a tile, head groups, Sq, B), K/V 4-D (a paged
    cache: one box per page, or per K/V block of block_n keys). The Q box is one block_m-row tile, the O box
    o_rows rows (a whole tile, or the 64 rows one sm_90a consumer warpgroup stores); one panel's
    columns wide with its swizzle (plan.Panels: 64 columns, 128B; D = 96: 32 columns, 64B), and the
    L2 promotion the runtime encodes it with (plan.tma_l2_promotion)."""
    p = cfg.gqa_pack
    qk, vo = qk_panels(cfg), vo_panels(cfg)

    def box(pn, rows: int) -> list[int]:
        return [pn.panel_cols, min(p, rows), 1, max(rows // p, 1), 1]

    def tmap(dims: list[str], box: list[int], pn) -> dict:
        return {"dims": dims, "box": box, "swizzle": f"{pn.swizzle.span_bytes}B", "dtype": cfg.dtype,
                "l2_promotion": tma_l2_promotion(cfg.kvcache)}

    qo_dims = qo_map_dims(cfg)
    kv_dims = ["D", "Hkv", "Page", "Pages"] if cfg.page_size else ["D", "Hkv", "Skv", "B"]
    kv_box = [1, kv_box_rows(cfg), 1]
    return {"q": tmap(qo_dims, box(qk, cfg.block_m), qk), "k": tmap(kv_dims, [qk.panel_cols, *kv_box], qk),
            "v": tmap(kv_dims, [vo.panel_cols, *kv_box], vo), "o": tmap(qo_dims, box(vo, o_rows), vo)}


def smem_layout_section(layout) -> dict:
    """The manifest's `smem_layout` section (both targets): the SMEM layout the kernel uses (ir/layout.py
    SmemLayout; its 8-byte TMEM address slot is laid out on sm_90a too, unused there)."""
    return {"smem_layout": {
        "regions": {k: {"offset": v[0], "bytes_per_slot": v[1], "slots": v[2]} for k, v in layout.regions.items()},
        "barriers": dict(layout.barriers),
        "tmem_addr_slot": layout.tmem_slot,
        "align": layout.align,
    }}


def entry_params(pipe: Pipeline) -> tuple[tuple[str, str], ...]:
    """The entry's parameters (plan.abi_params) of pipe's kernel: a dense kernel whose pipeline has no
    O staging (sm_90a (192, 128) and (256, 256), ir/sm90.sm90_o_staged) stores O from the registers through o_ptr."""
    return abi_params(pipe.config, o_from_registers=all(r.name != "O_smem" for r in pipe.regions))


def manifest(pipe: Pipeline, *, smem_bytes: int, o_rows: int, grid: GridFacts, variant: str = "",
             sections: dict | None = None) -> dict:
    """The ABI manifest of pipe's kernel. smem_bytes: the dynamic SMEM its PTX uses; o_rows: the rows
    of one O store box; grid: its scheduler's facts; variant: a suffix naming non-default lowering
    options; sections: the target's own records, last."""
    cfg = pipe.config
    return {
        "name": f"{cfg.name}_{variant}" if variant else cfg.name,
        "config": cfg.to_dict(),
        "content_hash": cfg.content_hash,
        "generator_version": GENERATOR_VERSION,
        "arch": pipe.arch,
        "entry": ENTRY,
        "threads_per_cta": pipe.threads,
        "dynamic_smem_bytes": smem_bytes,
        "grid": grid_section(cfg, grid),
        "tensor_maps": tensor_maps(cfg, o_rows),
        "gqa": gqa_manifest(cfg.gqa_ratio, cfg.block_m),
        **({"varlen": varlen_manifest(cfg)} if cfg.varlen else {}),
        **({"kvcache": kvcache_manifest(cfg)} if cfg.kvcache else {}),
        "params": [n for n, _ in entry_params(pipe)],
        **({"score_mods": score_mods_record(cfg)} if score_mods_record(cfg) else {}),
        **(sections or {}),
    }
