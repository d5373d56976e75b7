"""The kernels' tile-scheduler order in Python: task index -> (m_block, batch*Hkv*ng index).

ng = G / P head groups per kv head (fa4gen.spec.tiles.gqa_pack): 1 when one Q tile packs the whole GQA
group (P = G, G divides 128), G when it holds one query head (P = 1); `task_tile` splits the pair
index into (batch, kv_head, head group).

`task_coords` is the one definition of the order; templates/common/scheduler.ptx.j2 computes the
same thing in PTX (tests/test_schedule.py interprets those instructions and compares them with this
function), the simulator's `schedule_tasks` lists tasks with it, and the runtime picks the
`l2_group` launch parameter with `choose_l2_group`.

Causal order: the B*Hkv (batch, kv_head) pairs are cut into sections of
`l2_group` pairs whose K and V fit the L2 budget; sections run one after the other, and inside a
section m_blocks go heaviest first with the section's pairs fastest. A section's K/V then stays in
L2 while all its m_blocks stream over it, instead of every pair's K/V being fetched again for each
m_block. The last section also takes the B*Hkv % l2_group pairs left over, so the schedule never
ends on a small group of heavy tasks. l2_group = B*Hkv is one section: plain LPT, the order before
the swizzle existed.

Non-causal order is linear with m_block fastest: the m_blocks of one pair are consecutive, so the
CTAs running at one time already share a few pairs' K/V; all tasks cost the same, nothing to sort.

The sm_90a kernel deals tasks statically to a persistent grid (CTA c runs task r*grid + c in round
r, odd rounds reversed: `persistent_task`). A sectioned order breaks that deal's balance where a
section boundary falls inside a round pair (a light section end shares the round pair with a heavy
section start), so `choose_l2_group` keeps only section sizes whose per-CTA work (a block-count model) is within
a tolerance of the unsectioned order's, preferring sizes whose sections are whole rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .plan import BLOCK_N, BlockInfo, split_blocks

__all__ = ["BALANCE_TOLERANCE", "BALANCE_TOLERANCE_UNSHARED", "L2_BUDGET_FRACTION", "L2Choice", "choose_l2_group",
           "clamp_l2_group", "cta_work", "l2_group_budget", "persistent_task", "task_coords", "task_tile",
           "tile_blocks"]

# Half of the device's L2 for the K/V of one section: the rest holds Q/O tiles in flight and
# absorbs the Hopper L2's two partitions and hashed set conflicts (FA3/FA4 use ~40% of a B200's L2).
L2_BUDGET_FRACTION = 0.5
# A sectioned order may make the most loaded persistent CTA this much busier than the plain LPT
# order (per the block-count model of `cta_work`). With at most half as many pairs as CTAs the
# plain order already runs two or more CTAs on each pair's K/V at once, and sections bought nothing
# measurable on the H200 (2 x 8192: +0.4%, +1.7%, noise ~2%): the model must see no loss. With
# more pairs, the CTAs running at once stream (nearly) all different pairs' K/V from HBM; there
# the best timed section size was 6-29% faster, while the model predicted up to 4-5% imbalance
# (bench/sm90_dev_notes.md; bench/results/*_l2_sweep.json).
BALANCE_TOLERANCE = 0.01
BALANCE_TOLERANCE_UNSHARED = 0.05


def clamp_l2_group(l2_group, num_bh):
    """The kernel clamps the parameter to [1, B*Hkv] before use (a zero would divide by zero)."""
    return max(min(int(l2_group), int(num_bh)), 1)


def task_coords(t, num_bh: int, m_count: int, l2_group: int, causal: bool):
    """(m index, batch * Hkv + kv_head) of task t, exactly as the kernel decodes it.

    m_count: m_blocks per pair in task units (sm_90a: Q tiles; sm_100a: pairs of Q tiles). Works on
    Python ints and on NumPy integer arrays of t alike (no branches: the kernel's selp/min are
    written as arithmetic on 0/1 comparisons).
    """
    if not causal:
        return t % m_count, t // m_count
    g = clamp_l2_group(l2_group, num_bh)
    last = num_bh // g - 1  # the last section absorbs the num_bh % g leftover pairs
    sec = t // (g * m_count)
    sec = sec - (sec - last) * (sec > last)  # min(sec, last)
    base = sec * g
    left = num_bh - base
    size = g + (left - g) * (left < 2 * g)  # section size: g, or everything left in the last one
    r = t - base * m_count
    return m_count - 1 - r // size, base + r % size


def task_tile(t, batch: int, num_heads_kv: int, head_groups: int, m_count: int, l2_group: int, causal: bool):
    """(m index, batch, kv_head, head group j) of task t, as the kernels decode it.

    The scheduler orders (batch, head group) pairs: pair index b * (Hkv * ng) + kv_head * ng + j
    with ng = head_groups = G / P (fa4gen.spec.tiles.gqa_pack; 1 when the tile packs the whole GQA group,
    and then the pairs are (batch, kv_head) as before). The kernels keep the head group index
    kv_head * ng + j in %hkv (the Q/O tensor maps' head-group coordinate) and divide it by ng for
    the K/V maps' kv head. Vectorises like `task_coords`.
    """
    ng = int(head_groups)
    m, bh = task_coords(t, batch * num_heads_kv * ng, m_count, l2_group, causal)
    per_batch = num_heads_kv * ng
    hg = bh % per_batch
    return m, bh // per_batch, hg // ng, hg % ng


def persistent_task(rnd, cta, nctas: int, causal: bool):
    """Task index CTA `cta` runs in round `rnd` of the sm_90a persistent grid. Causal rounds
    alternate direction (snake), so the heaviest-first order does not hand CTA 0 the heaviest task
    of every round."""
    if not causal:
        return rnd * nctas + cta
    odd = rnd % 2
    return rnd * nctas + cta + (nctas - 1 - 2 * cta) * odd


def tile_blocks(m_tile, seqlen_q: int, seqlen_k: int, seq_q_per_tile: int, causal: bool, window=None,
                block_n: int = BLOCK_N):
    """K/V blocks of block_n keys (plan.block_n) a Q tile visits (plan.BlockInfo.n: the kernels' %nblk,
    >= 1; with a window, (left, right) as plan.window_sides gives them, only the window's blocks).
    Ints or NumPy arrays of m_tile (an array back)."""
    if isinstance(m_tile, (int, np.integer)):
        return BlockInfo.of(m_tile, seq_q_per_tile, seqlen_q, seqlen_k, causal, window=window, block_n=block_n).n
    m = np.asarray(m_tile, dtype=np.int64)
    per = {v: BlockInfo.of(v, seq_q_per_tile, seqlen_q, seqlen_k, causal, window=window, block_n=block_n).n
           for v in np.unique(m).tolist()}
    return np.vectorize(per.__getitem__, otypes=[np.int64])(m) if m.size else np.zeros(m.shape, np.int64)


def l2_group_budget(l2_bytes: int, seqlen_k: int, head_dim: int, elem_bytes: int, num_bh: int) -> int:
    """Pairs whose K and V (2 * Skv * D elements each) fit in L2_BUDGET_FRACTION of the L2."""
    per_pair = 2 * max(seqlen_k, 1) * head_dim * elem_bytes
    return clamp_l2_group(int(l2_bytes * L2_BUDGET_FRACTION) // per_pair, num_bh)


def cta_work(l2_group: int, *, num_bh: int, m_count: int, nctas: int, seqlen_q: int, seqlen_k: int,
             seq_q_per_tile: int, tiles_per_task: int = 1, window=None, block_n: int = BLOCK_N) -> np.ndarray:
    """Per-CTA work of the causal persistent deal, in K/V blocks plus one per task for its Q load
    and epilogue: the model `choose_l2_group` balances. window: (left, right) sides (plan.window_sides;
    None = none): a tile's work is its window's blocks."""
    ntasks = num_bh * m_count
    t = np.arange(ntasks, dtype=np.int64)
    m, _ = task_coords(t, num_bh, m_count, l2_group, True)
    cost = np.ones(ntasks, dtype=np.int64)
    for j in range(tiles_per_task):
        cost += tile_blocks(tiles_per_task * m + j, seqlen_q, seqlen_k, seq_q_per_tile, True, window, block_n)
    rnd, pos = t // nctas, t % nctas
    cta = pos + (nctas - 1 - 2 * pos) * (rnd % 2)  # inverse of persistent_task: the snake is its own inverse
    return np.bincount(cta, weights=cost, minlength=nctas)


@dataclass(frozen=True)
class L2Choice:
    l2_group: int
    budget: int  # pairs that fit the L2 budget
    reason: str


def choose_l2_group(*, causal: bool, persistent: bool, l2_bytes: int, batch: int, num_heads_kv: int,
                    seqlen_q: int, seqlen_k: int, head_dim: int, elem_bytes: int, m_count: int, nctas: int,
                    seq_q_per_tile: int, tiles_per_task: int = 1, window=None, block_n: int = BLOCK_N,
                    dynamic: bool = False) -> L2Choice:
    """The `l2_group` launch parameter for one problem on one device.

    One-CTA-per-task grids and the dynamic deal (`dynamic`: CTAs take the next task as they free up,
    plan.dynamic_tasks) take the budget as is (LPT inside each section keeps the tail short). A
    statically dealt persistent grid tries, largest first, the sizes <= budget that make every
    section a whole number of rounds (boundaries then fall where the snake deal pairs two rounds of
    one slope), then the budget itself and the 3 sizes below it, and keeps the first whose most loaded CTA is within the tolerance of the unsectioned order's
    (BALANCE_TOLERANCE, or BALANCE_TOLERANCE_UNSHARED when there are more pairs than half the
    CTAs); none qualifies -> one section (the unsectioned order). window: the sides (plan.window_sides)
    of a windowed launch: the balance counts each tile's window blocks (the L2 budget still counts a
    pair's whole K/V). block_n: the kernel's keys per block (plan.block_n).
    """
    num_bh = batch * num_heads_kv
    if num_bh <= 0 or m_count <= 0:
        return L2Choice(1, 1, "empty problem")
    budget = l2_group_budget(l2_bytes, seqlen_k, head_dim, elem_bytes, num_bh)
    if not causal:
        return L2Choice(num_bh, budget, "non-causal: linear order, l2_group unused")
    if budget >= num_bh:
        return L2Choice(num_bh, budget, "all K/V fits the budget: one section")
    if not persistent:
        return L2Choice(budget, budget, "one CTA per task: sections of the budget")
    if dynamic:
        return L2Choice(budget, budget, "dynamic deal: sections of the budget")
    kw = dict(num_bh=num_bh, m_count=m_count, nctas=nctas, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
              seq_q_per_tile=seq_q_per_tile, tiles_per_task=tiles_per_task, window=window, block_n=block_n)
    tolerance = BALANCE_TOLERANCE_UNSHARED if 2 * num_bh > nctas else BALANCE_TOLERANCE
    limit = cta_work(num_bh, **kw).max() * (1 + tolerance)
    step = nctas // math.gcd(nctas, m_count)  # sections of a multiple of `step` pairs are whole rounds
    aligned = list(range(budget - budget % step, 0, -step))[:3]
    near = [g for g in range(budget, max(budget - 4, 0), -1) if g not in aligned]
    for g in aligned + near:  # at most 7 evaluations of O(B*Hkv*m_count) each, once per shape
        if cta_work(g, **kw).max() <= limit:
            how = "whole rounds per section" if g in aligned else "sections balanced within tolerance"
            return L2Choice(g, budget, how)
    return L2Choice(num_bh, budget, "no section size keeps the persistent deal balanced: one section")


# ---- varlen (fa4gen.spec.plan "Varlen task order") --------------------------------------------------------
U32 = 0xFFFFFFFF


def varlen_spans(cu_seqlens, total: int):
    """[(start, length)] per sequence, clamped exactly as the kernels clamp device-side offsets
    (unsigned 32-bit): start = min(cu[b], total), end = min(max(cu[b + 1], start), total)."""
    cu = [int(x) & U32 for x in cu_seqlens]
    out = []
    for b in range(len(cu) - 1):
        s = min(cu[b], total)
        e = min(max(cu[b + 1], s), total)
        out.append((s, e - s))
    return out


def varlen_section(l2_rows: int, k_len: int, groups: int) -> int:
    """Head groups per L2 section of a causal varlen sequence: as many as have their K and V
    (k_len rows each) inside the budget of l2_rows K/V rows, clamped to [1, groups]."""
    return max(1, min((int(l2_rows) & U32) // max(k_len, 1), groups))


def varlen_l2_rows(l2_bytes: int, head_dim: int, elem_bytes: int) -> int:
    """The varlen kernels' `l2_group` parameter: K/V rows (K and V, all their heads' elements) that
    fit L2_BUDGET_FRACTION of the L2; the kernel divides it by each sequence's key length."""
    return max(1, int(l2_bytes * L2_BUDGET_FRACTION) // (2 * head_dim * elem_bytes))


def varlen_task(task: int, cu_q, cu_k, total_q: int, total_k: int, groups: int, unit_rows: int, causal: bool,
                seqused_k=None, l2_rows: int = 1):
    """What varlen task `task` computes, as the kernels decode it: (b, head group, m unit,
    q_start, q_len, k_start, k_len), or None past the last sequence's tasks.

    groups: head groups per sequence (Hkv * G / P); unit_rows: query positions per task
    (tiles_per_task * 128 / P). Causal: inside a sequence, the dense kernels' sectioned LPT
    (`task_coords` over its head groups, sections of `varlen_section(l2_rows, k_len, groups)`):
    heaviest m units first, the section's head groups fastest, so a round of CTAs gets tiles of
    like cost and the section's K/V stays in L2."""
    qs, ks = varlen_spans(cu_q, total_q), varlen_spans(cu_k, total_k)
    base = 0
    for b, (q0, ql) in enumerate(qs):
        units = -(-ql // unit_rows)
        n = units * groups
        if task < base + n:
            r = task - base
            k0, kl = ks[b]
            if seqused_k is not None:
                kl = min(kl, int(seqused_k[b]) & U32)
            if causal:
                m, hg = task_coords(r, groups, units, varlen_section(l2_rows, kl, groups), True)
            else:
                m, hg = r % units, r // units
            return b, int(hg), int(m), q0, ql, k0, kl
        base += n
    return None


def varlen_tasks(cu_q, cu_k, total_q: int, total_k: int, groups: int, unit_rows: int, causal: bool,
                 seqused_k=None, l2_rows: int = 1) -> list:
    """Every varlen task in order (the list varlen_task indexes)."""
    out, t = [], 0
    while True:
        x = varlen_task(t, cu_q, cu_k, total_q, total_k, groups, unit_rows, causal, seqused_k, l2_rows)
        if x is None:
            return out
        out.append(x)
        t += 1


# ---- KV cache (fa4gen.spec.plan "KV-cache rules") ------------------------------------------------------------
def kvcache_k_len(cache_seqlen: int, capacity: int) -> int:
    """Keys sequence b attends to, clamped as the kernels clamp it: min(max(len, 0), capacity)."""
    v = int(cache_seqlen)
    v = v - (1 << 32) if v >= 1 << 31 else v  # the device reads a signed int32
    return min(max(v, 0), int(capacity))


def kvcache_task(t: int, num_splits: int, num_m_blocks: int, groups_per_batch: int):
    """(split, m block, batch, head group index within the batch) of KV-cache task t."""
    s = t % num_splits
    r = t // num_splits
    m = r % num_m_blocks
    bh = r // num_m_blocks
    return s, m, bh // groups_per_batch, bh % groups_per_batch


def kvcache_split(nblk: int, split: int, num_splits: int) -> tuple[int, int]:
    """[lo, hi) of the visible K/V blocks of `split` (plan.split_blocks; the split runs
    max(hi - lo, 1) blocks from lo: plan.BlockInfo)."""
    return split_blocks(nblk, split, num_splits)


def kvcache_page(page_table_row, key: int, page_size: int, max_pages: int, num_pages: int) -> tuple[int, int]:
    """(page, row in page) of key `key` of one sequence, clamped as the kernels clamp it."""
    idx = min(int(key) // page_size, int(max_pages) - 1)
    page = int(page_table_row[idx]) & U32
    return min(page, int(num_pages) - 1), int(key) % page_size


# Split-KV choice (the host's num_splits = 0 rule): enough tasks to fill the SMs, each split at least
# KV_MIN_SPLIT_BLOCKS blocks, preferring the count whose last wave wastes the least. One block: since
# fa4_combine loads a row's splits together (2.2-3.7 us a call, was 0.35 us per split), short caches
# gain from one wave of one- or two-block splits (H200, `python3 -m bench.decode_combine --sweep`,
# B 1, 8 KV heads: 1k keys 9.6 -> 6.9 us at 8 splits, 2k 9.8 -> 8.2-8.4, 4k 10.6 -> 10.0 at 16); at
# 4 blocks (before) longer caches chose the same counts.
KV_MIN_SPLIT_BLOCKS = 1

# Batch-invariant decode (attention_with_kvcache(batch_invariant=True)): a sequence's split ranges are
# split_blocks(its visible blocks, s, S), a function of that sequence and S alone, and fa4_combine
# merges a row's S partials in split order (an empty split adds exact zeros); so with S fixed, not
# chosen from the batch, the cache capacity or the SM count, each sequence's O and LSE are the same
# bits in any batch on any GPU. 16 fills an H100/H200 at batch 1 with 8 KV heads (128 tasks on 132
# SMs); its cost is a split per (sequence, head) that short caches leave empty (one masked block each).
BATCH_INVARIANT_SPLITS = 16


def choose_num_splits(base_tasks: int, kv_blocks: int, sms: int, max_splits: int = 256) -> int:
    """num_splits for `base_tasks` = B * Hkv * (G / P) * num_m_blocks tiles over `kv_blocks`
    K/V blocks (the capacity's, or the longest sequence's when the caller knows it), on `sms` SMs
    with one resident CTA each. 1 when the tiles already fill the SMs or the keys are few."""
    base_tasks, kv_blocks, sms = max(int(base_tasks), 1), max(int(kv_blocks), 1), max(int(sms), 1)
    most = max(1, min(max_splits, kv_blocks // KV_MIN_SPLIT_BLOCKS))
    if base_tasks >= sms or most == 1:
        return 1
    best, best_eff = 1, 0.0
    for s in range(1, most + 1):
        tasks = base_tasks * s
        waves = -(-tasks // sms)
        bps = -(-kv_blocks // s)
        # time ~ waves * blocks per split; ideal = all blocks over all SMs
        eff = (base_tasks * kv_blocks) / (waves * bps * sms)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
        if tasks >= 2 * sms:
            break
    return best
