"""The SMEM layout of a Pipeline: the one rule both targets' kernels, their manifests and the sm_90a
stage choice (ir/sm90.py `sm90_stages`) read.

Regions in declaration order (aligned to the arch's SMEM alignment where their slots are multiples
of it), then 8 bytes per mbarrier slot, then the 8-byte TMEM address slot; offsets are from the
aligned dynamic SMEM base, and the bytes requested at launch add the alignment slack.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.plan import ARCH_LIMITS
from ..spec.tiles import PlanError
from .core import BarrierKind, Pipeline, Space

__all__ = ["SmemLayout", "fits", "layout_of", "o_staged", "smem_layout"]


@dataclass(frozen=True)
class SmemLayout:
    """Byte offsets from the aligned dynamic SMEM base."""

    regions: dict  # region name -> (offset of slot 0, bytes per slot, slots)
    barriers: dict  # barrier name -> offset of slot 0 (8 bytes per slot)
    tmem_slot: int  # 4 bytes: the TMEM base address written by tcgen05.alloc
    used: int
    total: int  # dynamic SMEM bytes to request: used + alignment slack
    align: int  # the base's alignment (the arch's; the slack is this much)

    def region_offset(self, name: str) -> int:
        return self.regions[name][0]

    def slot_bytes(self, name: str) -> int:
        return self.regions[name][1]


def layout_of(pipe: Pipeline, error: type[Exception] = PlanError) -> SmemLayout:
    """pipe's SMEM layout, whether or not it fits the arch's limit (smem_layout checks that)."""
    align = ARCH_LIMITS[pipe.arch].smem_align
    off = 0
    regions = {}
    for r in pipe.regions:
        if r.space is not Space.SMEM:
            continue
        if r.bytes_per_slot % align == 0 and off % align:
            raise error(f"SMEM region {r.name} would start at {off}, not {align}-aligned")
        regions[r.name] = (off, r.bytes_per_slot, r.slots)
        off += r.slots * r.bytes_per_slot
    off = -(-off // 8) * 8
    bars = {}
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED:
            continue
        bars[b.name] = off
        off += 8 * b.slots
    tmem_slot = off
    off += 8
    return SmemLayout(regions, bars, tmem_slot, off, off + align, align)


def smem_layout(pipe: Pipeline, error: type[Exception] = PlanError) -> SmemLayout:
    """layout_of(pipe), refused with `error` when its bytes (with the slack) exceed pipe.smem_limit."""
    lay = layout_of(pipe, error)
    if lay.total > pipe.smem_limit:
        raise error(f"SMEM: {lay.used} bytes + {lay.align} alignment slack = {lay.total} exceed the "
                    f"{pipe.smem_limit}-byte limit of {pipe.arch} (fewer kv_stages?)")
    return lay


def fits(pipe: Pipeline) -> bool:
    """pipe's layout (the kernel's own, with the slack) fits the arch's SMEM limit."""
    return layout_of(pipe).total <= pipe.smem_limit


def o_staged(smallest_with_staging: Pipeline) -> bool:
    """The one rule both targets take for O's way out: O is staged in SMEM (for a TMA store, or the
    varlen store's row copies) where the smallest rings the kernel would take fit beside the staging
    slots (`smallest_with_staging`: sm_90a 1 Q slot and KV_STAGES_MIN K/V stages, ir/sm90.sm90_o_staged;
    sm_100a its two Q tiles and KV_STAGES_MIN K/V stages, ir/sm100.sm100_o_staged); otherwise each
    thread stores its O rows from the registers."""
    return fits(smallest_with_staging)
