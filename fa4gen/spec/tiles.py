"""The Q tile rules, at the bottom of the chain: KernelConfig validates its block_m with them, the
plan, the API and `fa4gen build` choose tiles with them. Imports nothing of fa4gen.
"""
from __future__ import annotations

ROWS = 128  # Q tile rows == TMEM lanes (both targets) == K/V block keys (but sm_90a D = 256: kv_block_keys)


class PlanError(ValueError):
    """A configuration whose plan cannot exist (e.g. no room for the pipeline in SMEM)."""


# GQA row packing: the one rule deciding how a 128-row Q tile maps to (sequence position, query head).
# P = G when G divides 128: row r of a tile holds position m * (128 / P) + r // P of query head
# hkv * G + j * P + r % P (today's packing: the GQA group's heads share the tile and its K/V loads).
# Otherwise P = 1: each tile holds 128 positions of one query head. Either way a task's tile is
# (batch, kv head, head group j in [0, G / P), m block) and its query heads are hkv * G + j * P + (0..P-1);
# the kernels index the (batch, head group) pairs as b * (Hkv * G / P) + hkv * (G / P) + j, and the
# K/V head of head group hg is hg // (G / P). Recorded in the manifest as "gqa" (gqa_manifest).


def gqa_pack(gqa_ratio: int) -> int:
    """P, the query heads packed into one 128-row Q tile: G when G divides 128, else 1."""
    g = int(gqa_ratio)
    if g < 1:
        raise PlanError(f"GQA ratio {g}: must be >= 1")
    return g if ROWS % g == 0 else 1


# Q tile rows (KernelConfig.block_m): 64 rows per sm_90a consumer warpgroup (wgmma M), so a
# 192-row tile is three consumer warpgroups. At D = 64 the two-warpgroup kernel is latency bound
# (ncu, bench/results/2026-12-02T0745Z_NVIDIA-H200_ncu_sm90a.txt: 38% issue slots busy, 60% of cycles
# with no eligible warp): its QK and PV GEMMs are half the D = 128 ones while the softmax is not, so
# one warpgroup's softmax no longer hides behind the other's GEMMs. A third warpgroup keeps the tensor
# core fed (two softmaxes under each GEMM). sm_100a keeps 128 (one TMEM lane per row).
# D = 96 too (H200, 2026-12-04: +8.6-12% over the 128-row tile on long shapes; its consumers issue PV
# then QK, plan.sm90_overlap, for want of registers).
# Varlen kernels take the same tile (their m unit: 192 / P positions of a sequence; causal varlen
# calls read max_seqlen_q as Sq below); KV-cache kernels keep 128 (a decode tile's real rows are few).
SM90_Q_ROWS = {64: 192, 96: 192, 128: 128}  # dense and varlen sm_90a kernels, by head_dim
Q_ROWS_CHOICES = (128, 192)
SM90_WG_ROWS = 64  # Q tile rows per sm_90a consumer warpgroup (the wgmma M)


# Causal attention over few packed rows (Sq * P) keeps the 128-row tile: a 192-row tile's diagonal
# crosses more masked K/V blocks per unit of work, and fewer, larger tasks balance worse. Measured
# on the H200 (bench/results/2026-12-02T185756Z_NVIDIA-H200_d64.json, D = 64 bf16, 16 heads):
# causal 32x512 217 vs 243 TFLOP/s and 16x1024 284 vs 324 (192 vs 128 rows), 8x2048 393 vs 391,
# 2x8192 474 vs 429; non-causal 192 rows >= 128 at every length (385 / 385 at 512).
SM90_WIDE_CAUSAL_MIN_ROWS = 2048


def q_tile_rows(arch: str, head_dim: int, gqa_ratio: int, varlen: bool = False, kvcache: bool = False,
                causal: bool = False, seqlen_q: int | None = None) -> int:
    """The Q tile rows (KernelConfig.block_m) fa4gen.attention and `fa4gen build` choose for a kernel.
    seqlen_q (the call's query length, a varlen call's max_seqlen_q; None for a kernel built for any
    shape) decides causal calls."""
    rows = SM90_Q_ROWS.get(head_dim, ROWS) if arch == "sm_90a" and not kvcache else ROWS
    if rows != ROWS and causal and seqlen_q is not None and seqlen_q * gqa_pack(gqa_ratio) < SM90_WIDE_CAUSAL_MIN_ROWS:
        return ROWS
    return rows if q_tile_rows_refusal(arch, head_dim, gqa_ratio, varlen, kvcache, rows) is None else ROWS


def q_tile_rows_refusal(arch: str, head_dim: int, gqa_ratio: int, varlen: bool, kvcache: bool, rows) -> str | None:
    """Why a Q tile of `rows` rows cannot be built for this config (None when it can)."""
    if rows == ROWS:
        return None
    if rows not in Q_ROWS_CHOICES:
        return f"one of {', '.join(map(str, Q_ROWS_CHOICES))} (Q tile rows)"
    if arch != "sm_90a":
        return "128 on sm_100a (one TMEM lane per Q row); 192 is sm_90a's three-consumer tile"
    if kvcache:
        return "128 for KV-cache kernels (a decode tile's rows are few); 192 is for dense and varlen kernels"
    if SM90_WG_ROWS % gqa_pack(gqa_ratio):
        return (f"128 at GQA ratio {gqa_ratio}: a 192-row tile packs at most {SM90_WG_ROWS} heads (the packed "
                f"heads of one position must sit in one consumer warpgroup's {SM90_WG_ROWS} rows)")
    return None


# Keys per K/V block (KernelConfig.block_n, which every block rule reads: plan.BlockInfo and its PTX,
# the masks, the K/V tiles and TMA boxes, the wgmma shapes, the schedules, the emulator's inputs).
# 128 (ROWS) everywhere but sm_90a D = 256, where no 128-key ring fits SMEM (Q 64 KiB + 2 stages of
# K and V, 64 KiB each, > 227 KiB) and the wgmma fragments of a 128-key block leave 16 of 240
# registers: 64-key blocks, 1 Q slot, 2 stages, O from the registers (docs/HEAD_DIMS.md "sm_90a").
# A power of two, so the block rules stay shifts and whole 32-bit mask words.
SM90_KV_BLOCK = {256: 64}  # by head_dim


def kv_block_keys(arch: str, head_dim: int) -> int:
    """Keys per K/V block of a kernel (KernelConfig.block_n): SM90_KV_BLOCK on sm_90a, else ROWS."""
    return SM90_KV_BLOCK.get(int(head_dim), ROWS) if arch == "sm_90a" else ROWS


# Q tiles a task keeps in flight (the m unit of every schedule): the seed's sm_100a design runs two
# 128-row tiles per CTA, each with its own S (128 TMEM columns) and O (DV columns) in the 512 columns of
# TMEM: 2 * 128 + 2 * DV <= 512, so DV <= 128. At DV = 256 the two O tiles alone take all of TMEM: one
# tile per task, S at [0, 128) and O at [256, 512) (docs/HEAD_DIMS.md "sm_100a", D = 256). sm_90a
# splits its one tile over its consumer warpgroups.


def q_tiles_per_task(arch: str, head_dim_v: int, tmem_cols: int) -> int:
    """Q tiles in flight per task (KernelConfig.tiles_per_task): sm_100a 2 where two S and two O tiles
    fit TMEM's tmem_cols columns (the ISA's, spec.encodings.TMEM_COLUMNS: this module imports nothing),
    else 1; sm_90a 1."""
    if arch != "sm_100a":
        return 1
    return 2 if 2 * ROWS + 2 * int(head_dim_v) <= tmem_cols else 1


def head_groups(gqa_ratio: int) -> int:
    """G / P: the head groups (tiles side by side in the head dimension) per kv head."""
    return int(gqa_ratio) // gqa_pack(gqa_ratio)
