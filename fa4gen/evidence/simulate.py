"""CPU simulator: executes the pipeline's role programs on NumPy data.

The Blackwell kernel's stand-in for hardware here (it runs the sm_90a pipeline's programs too, with
S, P and O in per-consumer registers). It runs the same programs the verifier proves and
the PTX is lowered from, under a seeded random interleaving with asynchronous TMA / MMA /
tcgen05.ld / tcgen05.st completion (a result lands at a random later step, before the wait or commit
that publishes it). TMEM is one 128 x 512 float32 array; P is written through a 16-bit view of the
same bytes (16-bit column c -> physical column c // 2), so P really overwrites the upper half of S.
The softmax math is the reference's (`reference.block_update`, `exp2`), so on a sound pipeline the
output equals `reference.fa4_forward` up to fp32 rounding of the MMA accumulation order.

Score modifiers (KernelConfig.window / softcap / sinks), with run-time values as fa4_forward takes
them: a window's blocks and masks come from plan.BlockInfo (`reference.tile_block_info`, per task
unit and per Q tile) with both per-row column limits; softcap caps the raw scores
(`reference.tanh_approx_f32`) before the mask; a sink joins the final normalisation
(`reference.sink_terms`; sm_100a's apply_sink hands the divisor row_sum + 2^(z2 - m2) on to the
epilogue, as its kernel does) and, with several KV-cache splits, fa4_combine's merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec.config import KernelConfig
from ..spec.encodings import TMEM_COLUMNS, TMEM_LANES
from ..ir import build_pipeline
from ..ir.core import Cond, Pipeline, Role
from ..verify.engine import DataModel, Engine, Finding, Scenario
from .reference import (LN2, LOG2E, RowState, _as_compute, _check_shapes, _default_scale, _score_mods_for,
                        _sink_epilogue, block_update, col_begins, col_limits, kernel_score_args, round_to_dtype,
                        sink_terms, tanh_approx_f32, tile_block_info)
from ..spec.exp2 import emulated_columns, exp2_hardware
from ..spec.schedule import kvcache_k_len, kvcache_page, kvcache_task, task_tile, varlen_tasks


def _to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return (round_to_dtype(x, "bf16").astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bits(b: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return b.view(np.float16).astype(np.float32)
    return (b.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Task:
    batch: int
    kv_head: int
    m_block: int  # covers Q tiles 2*m_block and 2*m_block + 1
    n_blocks: int
    head_group: int = 0  # j in [0, G / P): the tile's query heads are kv_head * G + j * P + (0..P-1)
    # varlen (simulate_varlen): the sequence's first rows in the packed tensors and its lengths
    # (None: a dense task, the batch's Sq / Skv)
    q_start: int = 0
    q_len: int | None = None
    k_start: int = 0
    k_len: int | None = None
    # KV cache (simulate_kvcache): the split and its first K/V block (blocks [block_lo, block_lo + n_blocks))
    split: int = 0
    block_lo: int = 0


def unit_info(cfg: KernelConfig, m: int, sq: int, skv: int, window=None, split: int = 0, num_splits: int = 1):
    """plan.BlockInfo of task unit m (tiles_per_task Q tiles; sm_100a a pair): the blocks its task
    runs. window: flash-attn's (left, right) or None, as reference.tile_block_info takes it."""
    return tile_block_info(cfg, m, sq, skv, window, tiles=cfg.tiles_per_task, split=split, num_splits=num_splits)


def schedule_tasks(cfg: KernelConfig, batch: int, hkv: int, sq: int, skv: int,
                   l2_group: int | None = None, window=None) -> list[Task]:
    """Tasks in kernel order (fa4gen.spec.schedule.task_coords): linear for non-causal; causal LPT,
    heaviest m_blocks first, in sections of `l2_group` (batch, kv_head) pairs (default: one section,
    the simulator has no L2); each runs its unit's blocks (a window's from its first)."""
    m_blocks = -(-sq // cfg.seq_q_per_task)
    ng = cfg.head_groups
    num_bh = batch * hkv * ng  # (batch, head group) pairs: hg = kv_head * ng + j
    g = num_bh if l2_group is None else l2_group
    tasks = []
    for t in range(num_bh * m_blocks):
        m, b, kvh, hgrp = (int(x) for x in task_tile(t, batch, hkv, ng, m_blocks, g, cfg.causal))
        info = unit_info(cfg, m, sq, skv, window)
        tasks.append(Task(b, kvh, m, info.n, hgrp, block_lo=info.lo))
    return tasks


class NumpyData(DataModel):
    def __init__(self, pipe: Pipeline, q, k, v, scale: float, tasks: list[Task], mods=(None, 0.0, None)):
        self.cfg = cfg = pipe.config
        self.pipe = pipe
        self.q, self.k, self.v = q, k, v
        self.b, self.sq, self.hq, self.skv, self.hkv, self.d = _check_shapes(q, k, v)
        self.dv = v.shape[-1]  # O's columns (head_dim_v)
        self.scale = scale
        # the score modifiers' values (_mods): window (left, right) or None, softcap (0: none), sinks [Hq] or None
        self.window, cap, self.sinks = mods
        args = kernel_score_args(scale, cap)
        self.sl2, self.softcap_in = args["scale_log2"], args.get("softcap_in")
        self.tasks = tasks
        self.smem: dict = {}
        self.tmem = np.full((TMEM_LANES, TMEM_COLUMNS), np.nan, np.float32)
        self.tmem16 = self.tmem.view(np.uint16)
        self.regs: dict[str, dict] = {r.name: {} for r in pipe.roles}
        self.o = np.full((self.b, self.sq, self.hq, self.dv), np.nan, np.float32)
        self.lse = np.full((self.b, self.hq, self.sq), np.nan, np.float32)
        rows = np.arange(128)
        self.row_seq_off = rows // cfg.gqa_pack
        self.row_head_off = rows % cfg.gqa_pack

    # ---- geometry --------------------------------------------------------------------------------
    def task_sq(self, task: Task) -> int:
        return self.sq if task.q_len is None else task.q_len

    def task_skv(self, task: Task) -> int:
        return self.skv if task.k_len is None else task.k_len

    def tile_rows(self, task: Task, qtile: int):
        """(sequence position, query head, position < the task's Sq) of the tile's 128 rows; the
        tile's row in the (packed) tensor is task.q_start + position."""
        seq = (self.cfg.tiles_per_task * task.m_block + qtile) * self.cfg.seq_q_per_tile + self.row_seq_off
        head = task.kv_head * self.cfg.gqa_ratio + task.head_group * self.cfg.gqa_pack + self.row_head_off
        return seq, head, seq < self.task_sq(task)

    def _tma_rows(self, src, task: Task, start: int, pos: np.ndarray, valid: np.ndarray, head) -> np.ndarray:
        """A TMA tile of `src` [B, S, H, D]: dense, the task's rows (zero past S, where TMA fills
        zeros); varlen, the packed tensor's rows start + pos, whatever sequence they belong to (only
        past the tensor's end are they zero): the mask must hide them."""
        tile = np.zeros((len(pos), src.shape[-1]))
        rows = start + pos
        ok = valid if task.q_len is None and task.k_len is None else rows < src.shape[1]
        tile[ok] = src[task.batch, rows[ok], head[ok] if isinstance(head, np.ndarray) else head, :]
        return tile

    def kv_block(self, task: Task, t: int) -> int:
        return task.block_lo + task.n_blocks - 1 - t  # blocks are visited in reverse

    # ---- hooks -----------------------------------------------------------------------------------
    def cond(self, role: Role, cond: Cond, ctx: dict) -> bool:
        if cond is Cond.ANY_RESCALE:
            return bool(np.any(self.regs[role.name]["acc_scale"] < 1))
        raise ValueError(cond)

    def effect(self, kind, role, op, ctx, slots):
        regs = self.regs[role.name]
        task = self.tasks[ctx["task"]]
        if kind == "tma_load":
            if op.tensor == "q":
                seq, head, valid = self.tile_rows(task, op.qtile)
                tile = self._tma_rows(self.q, task, task.q_start, seq, valid, head)
            else:
                src = self.k if op.tensor == "k" else self.v
                bn = self.cfg.block_n  # keys per K/V block
                pos = self.kv_block(task, ctx["block"]) * bn + np.arange(bn)
                tile = self._tma_rows(src, task, task.k_start, pos, pos < self.task_skv(task), task.kv_head)
            self.smem[(op.dst, slots["dst"])] = tile
        elif kind == "mma":
            d_reg = self.pipe.region(op.d)
            if op.kind == "qk":
                s = self.smem[(op.a, slots["a"])] @ self.smem[(op.b, slots["b"])].T
                self.tmem[:, d_reg.col:d_reg.col + 128] = s.astype(np.float32)
            else:
                p_reg = self.pipe.region(op.a)
                bits = self.tmem16[:, 2 * p_reg.col + op.k_lo: 2 * p_reg.col + op.k_hi]
                with np.errstate(invalid="ignore"):  # a hazardous pipeline may read never-written NaN bits
                    p = _from_bits(np.ascontiguousarray(bits), self.cfg.dtype).astype(np.float64)
                vv = self.smem[(op.b, slots["b"])][op.k_lo:op.k_hi]
                cols = slice(d_reg.col, d_reg.col + self.dv)
                old = self.tmem[:, cols].astype(np.float64) if ctx["accumulate"] else 0.0
                self.tmem[:, cols] = (old + p @ vv).astype(np.float32)
        elif kind == "tmem_ld":
            r = self.pipe.region(op.region)
            buf = regs.setdefault(op.dst, np.full((128, 128), np.nan, np.float32))
            buf[:, op.col_lo:op.col_hi] = self.tmem[:, r.col + op.col_lo:r.col + op.col_hi]
        elif kind == "tmem_st_issue":
            r = self.pipe.region(op.region)
            vals = regs[op.src][:, op.col_lo:op.col_hi]
            return _to_bits(vals, self.cfg.dtype) if r.dtype == "f16" else vals.astype(np.float32).copy()
        elif kind == "tmem_st":
            r = self.pipe.region(op.region)
            if r.dtype == "f16":
                self.tmem16[:, 2 * r.col + op.col_lo:2 * r.col + op.col_hi] = ctx["snapshot"]
            else:
                self.tmem[:, r.col + op.col_lo:r.col + op.col_hi] = ctx["snapshot"]
        elif kind == "smem_st":
            self.smem[(op.region, slots["slot"])] = (regs.get("tag"), np.array(regs[op.src], copy=True))
        elif kind == "smem_ld":
            tag, val = self.smem[(op.region, slots["slot"])]
            regs[op.dst] = np.array(val, copy=True)
        elif kind in ("tma_store", "store_rows"):  # the rows of the task's sequence (StoreRows: by row predicate)
            (t_idx, qtile), tile = self.smem[(op.src, slots["slot"])]
            t = self.tasks[t_idx]
            seq, head, valid = self.tile_rows(t, qtile)
            self.o[t.batch, t.q_start + seq[valid], head[valid], :] = tile[valid][:, :self.dv]
        elif kind == "store_o":  # O from the registers: the columns of the rows of the task's sequence
            seq, head, valid = self.tile_rows(task, op.qtile)
            self.o[task.batch, task.q_start + seq[valid], head[valid], op.col_lo:op.col_hi] = \
                regs[op.src][valid, op.col_lo:op.col_hi]
        elif kind == "store_partial":  # KV cache: the split's fp32 O columns of the rows < Sq
            seq, head, valid = self.tile_rows(task, op.qtile)
            r = (task.batch * self.sq + seq[valid]) * self.hq + head[valid]
            self.o_partial[task.split, r, op.col_lo:op.col_hi] = regs[op.src][valid, op.col_lo:op.col_hi]
        elif kind == "compute":
            self._compute(role, op, ctx, task, regs)

    # ---- the softmax math both targets share (the reference's functions) -------------------------
    def _softmax_block(self, regs, scores, task: Task, qtile: int, t: int, rows: slice):
        """Mask the block's scores where needed and run the reference's block update on them."""
        cfg, n, bn = self.cfg, rows.stop - rows.start, self.cfg.block_n
        if t == 0:
            regs["row_max"] = np.full(n, -np.inf, np.float32)
            regs["row_sum"] = np.zeros(n, np.float32)
        nb = self.kv_block(task, t)
        seq = self.tile_rows(task, qtile)[0][rows]
        s = np.array(scores[:, :bn], np.float32)
        if self.softcap_in is not None:  # mul.f32 then tanh.approx.f32 of every raw score, before the mask
            s = tanh_approx_f32(s * self.softcap_in)
        sq, skv = self.task_sq(task), self.task_skv(task)
        masked = tile_block_info(cfg, cfg.tiles_per_task * task.m_block + qtile, sq, skv,
                                 self.window).needs_mask(nb)
        if masked:
            col = nb * bn + np.arange(bn)[None, :]
            s[(col >= col_limits(cfg, seq, sq, skv, self.window)[:, None])
              | (col < col_begins(cfg, seq, sq, skv, self.window)[:, None])] = -np.inf
        upd = block_update(RowState(regs["row_max"], regs["row_sum"], np.zeros((n, 1), np.float32)),
                           s, np.zeros((bn, 1)), self.sl2, cfg.rescale_threshold, first=t == 0,
                           emulated=emulated_columns(cfg, apply_mask=masked))
        regs["row_max"], regs["acc_scale"] = upd.state.ref, upd.acc_scale
        return upd

    def _normalized(self, o, row_sum):
        inv = np.zeros(row_sum.shape, np.float32)
        pos = row_sum > 0
        inv[pos] = np.float32(1) / row_sum[pos]
        return round_to_dtype(o[:, :self.dv] * inv[:, None], self.cfg.dtype)

    def _store_lse(self, task: Task, qtile: int, rows: slice, regs):
        seq, head, valid = (x[rows] for x in self.tile_rows(task, qtile))
        if self.sinks is not None:  # the sink's LSE (apply_sink / the sm_90a normalize computed it)
            lse = regs["lse"]
        else:
            rs, ref = regs["row_sum"], regs["row_max"]
            with np.errstate(divide="ignore", invalid="ignore"):
                lse = np.where(rs > 0, np.log(rs.astype(np.float64)) + ref.astype(np.float64) * float(self.sl2) * LN2,
                               -np.inf)
        self.lse[task.batch, head[valid], task.q_start + seq[valid]] = lse.astype(np.float32)[valid]

    def _sink_z(self, task: Task, qtile: int, rows: slice) -> np.ndarray:
        """The sink logit of each row's query head."""
        return self.sinks[self.tile_rows(task, qtile)[1][rows]]

    def _compute(self, role, op, ctx, task, regs):
        rows = slice(0, 128)
        if op.fn == "softmax_max":
            upd = self._softmax_block(regs, regs["s"], task, op.qtile, ctx["t"], rows)
            regs["_p"], regs["_row_sum_next"] = upd.p, upd.state.row_sum
        elif op.fn == "softmax_exp":
            regs["p"] = regs.pop("_p")
        elif op.fn == "row_sum":
            regs["row_sum"] = regs.pop("_row_sum_next")
        elif op.fn == "rescale_o":
            regs["o"] = (regs["o"] * regs["acc_scale"][:, None]).astype(np.float32)
        elif op.fn == "normalize":
            regs["o_out"] = self._normalized(regs["o"], regs[op.reads[1]])
            regs["tag"] = (ctx["task"], op.qtile)
        elif op.fn == "store_lse":
            self._store_lse(task, op.qtile, rows, regs)
        elif op.fn == "apply_sink":
            # the LSE as the reference's sink epilogue gives it; row_sum becomes O's divisor
            # row_sum + 2^(z2 - m2) (m2 = ref * scale_log2, z2 = z log2 e), handed on to normalize
            z = self._sink_z(task, op.qtile, rows)
            _, regs["lse"] = sink_terms(regs["row_max"], regs["row_sum"], z, self.sl2)
            with np.errstate(invalid="ignore", over="ignore"):
                m2 = np.where(regs["row_max"] == -np.inf, np.float32(-np.inf), regs["row_max"] * self.sl2)
                z2 = (z.astype(np.float32) * np.float32(LOG2E)).astype(np.float32)
                regs["row_sum"] = (regs["row_sum"] + exp2_hardware((z2 - m2).astype(np.float32))).astype(np.float32)
        elif op.fn == "normalize_partial":  # fp32, not cast: the split's partial O
            inv = np.zeros(regs[op.reads[1]].shape, np.float32)
            pos = regs[op.reads[1]] > 0
            inv[pos] = np.float32(1) / regs[op.reads[1]][pos]
            regs["o"] = (regs["o"] * inv[:, None]).astype(np.float32)
        elif op.fn == "store_lse_partial":
            seq, head, valid = self.tile_rows(task, op.qtile)
            rs, ref = regs["row_sum"], regs["row_max"]
            with np.errstate(divide="ignore", invalid="ignore"):
                lse = np.log(rs.astype(np.float64)) + ref.astype(np.float64) * float(self.sl2) * LN2
            r = (task.batch * self.sq + seq[valid]) * self.hq + head[valid]
            self.lse_partial[task.split, r] = np.where(rs > 0, lse, -np.inf).astype(np.float32)[valid]
        else:
            raise ValueError(f"simulator has no function {op.fn!r}")


class NumpyDataSm90(NumpyData):
    """sm_90a: S, P and O are per-consumer registers (64 rows each); Q is one 128-row tile."""

    def effect(self, kind, role, op, ctx, slots):
        regs = self.regs[role.name]
        task = self.tasks[ctx["task"]]
        if kind == "mma":
            half = slice(64 * int(role.name[-1]), 64 * int(role.name[-1]) + 64)
            if op.kind == "qk":
                regs["S"] = (self.smem[(op.a, slots["a"])][half] @ self.smem[(op.b, slots["b"])].T).astype(np.float32)
            else:
                old = regs["O"].astype(np.float64) if ctx["accumulate"] else 0.0
                pv = regs["P"].astype(np.float64) @ self.smem[(op.b, slots["b"])]
                regs["O"] = (old + pv).astype(np.float32)
        elif kind == "smem_st":
            self.smem[(op.region, slots["slot"])] = (regs["tag"], np.array(regs["o_out"], copy=True))
        elif kind in ("tma_store", "store_rows"):
            (t_idx, half), tile = self.smem[(op.src, slots["slot"])]
            t = self.tasks[t_idx]
            seq, head, valid = (x[64 * half:64 * half + 64] for x in self.tile_rows(t, 0))
            self.o[t.batch, t.q_start + seq[valid], head[valid], :] = tile[valid][:, :self.dv]
        elif kind == "compute":
            self._compute90(op, ctx, task, regs)
        else:
            super().effect(kind, role, op, ctx, slots)

    def _compute90(self, op, ctx, task, regs):
        half = op.qtile  # the consumer warpgroup: rows 64 * half ... of the task's one Q tile
        rows = slice(64 * half, 64 * half + 64)
        if op.fn == "softmax":
            upd = self._softmax_block(regs, regs["S"], task, 0, 0 if ctx["t"] is None else ctx["t"], rows)
            regs["row_sum"], regs["S"] = upd.state.row_sum, upd.p
        elif op.fn == "pack_p":
            regs["P"] = round_to_dtype(regs["S"], self.cfg.dtype).astype(np.float32)
        elif op.fn == "rescale_o":
            regs["O"] = (regs["O"] * regs["acc_scale"][:, None]).astype(np.float32)
        elif op.fn == "normalize" and self.sinks is not None:  # the reference's sink epilogue, fp32
            o, regs["lse"] = _sink_epilogue(RowState(regs["row_max"], regs["row_sum"], regs["O"]),
                                            self._sink_z(task, 0, rows), self.sl2)
            regs["o_out"] = round_to_dtype(o[:, :self.dv], self.cfg.dtype)
            regs["tag"] = (ctx["task"], half)
        elif op.fn == "normalize":
            regs["o_out"] = self._normalized(regs["O"], regs["row_sum"])
            regs["tag"] = (ctx["task"], half)
        elif op.fn == "store_lse":
            self._store_lse(task, 0, rows, regs)
        elif op.fn == "store_o_rows" and not self.cfg.kvcache:  # O from the registers: the rows < Sq
            seq, head, valid = (x[rows] for x in self.tile_rows(task, 0))
            self.o[task.batch, task.q_start + seq[valid], head[valid], :] = regs["o_out"][valid]
        else:
            raise ValueError(f"simulator has no sm_90a function {op.fn!r}")


@dataclass
class SimResult:
    o: np.ndarray
    lse: np.ndarray
    findings: list[Finding]


def _mods(cfg: KernelConfig, hq: int, window, softcap, sinks) -> tuple:
    """The score modifiers' values checked against the kernel's flags as fa4_forward checks them:
    (window or None (a windowed kernel without one: unbounded), softcap, sinks [Hq] or None)."""
    window, cap, z = _score_mods_for(cfg, hq, window, softcap, sinks)
    return (window if window is not None else (-1, -1)) if cfg.window else None, cap, z


def simulate(pipe_or_cfg, q, k, v, softmax_scale=None, seed: int = 0, num_ctas: int = 1,
             priority=None, *, window=None, softcap: float = 0.0, sinks=None) -> SimResult:
    """Run the pipeline's programs over q [B, Sq, Hq, D], k, v [B, Skv, Hkv, D].

    Tasks are dealt to `num_ctas` CTAs round-robin (the persistent scheduler's task += num_ctas);
    each CTA is one engine run. window / softcap / sinks: the values of the kernel's score
    modifiers, as reference.fa4_forward takes them. Returns O, LSE and the engine's findings
    (hazards, deadlocks).
    """
    pipe = pipe_or_cfg if isinstance(pipe_or_cfg, Pipeline) else build_pipeline(pipe_or_cfg)
    cfg = pipe.config
    q, k, v = (np.asarray(t) for t in (q, k, v))
    b, sq, hq, skv, hkv, d = _check_shapes(q, k, v)
    if (d, v.shape[-1]) != cfg.head_dims or hq != hkv * cfg.gqa_ratio:
        raise ValueError(f"shapes {q.shape}/{k.shape} do not fit {cfg.name}")
    if skv == 0:
        raise ValueError("Skv = 0: no keys (the API returns O = 0, LSE = -inf without a launch)")
    q64, k64, v64 = (_as_compute(t, cfg.dtype, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = _default_scale(d, softmax_scale)
    mods = _mods(cfg, hq, window, softcap, sinks)
    tasks = schedule_tasks(cfg, b, hkv, sq, skv, window=mods[0])
    data = (NumpyData if pipe.arch == "sm_100a" else NumpyDataSm90)(pipe, q64, k64, v64, scale, tasks, mods)
    return SimResult(data.o, data.lse, _run_ctas(pipe, data, tasks, num_ctas, seed, priority))


def _run_ctas(pipe, data, tasks, num_ctas: int, seed: int, priority, split_kv: bool = False) -> list:
    """Deal the tasks round-robin to num_ctas CTAs and run each CTA's programs over its share (one
    engine per CTA, seeded per CTA); the findings of all of them."""
    findings: list[Finding] = []
    for cta in range(num_ctas):
        mine = tasks[cta::num_ctas]
        if not mine:
            continue
        data.tasks = mine
        eng = Engine(pipe, Scenario(tuple(t.n_blocks for t in mine), split_kv=split_kv), data=data,
                     seed=seed * 7919 + cta, priority=priority)
        findings += eng.run()
    return findings


def simulate_varlen(pipe_or_cfg, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, softmax_scale=None,
                    seed: int = 0, num_ctas: int = 1, priority=None, l2_rows: int = 1, *, window=None,
                    softcap: float = 0.0, sinks=None) -> SimResult:
    """Run a varlen pipeline's programs over a packed batch: q (total_q, Hq, D), k, v (total_k, Hkv,
    D), sequence b's rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and keys [cu_seqlens_k[b], ...), at
    most seqused_k[b] of them. Tasks come in the kernels' varlen order (fa4gen.spec.schedule.varlen_tasks,
    offsets clamped as on the device; causal sections from `l2_rows`, the kernels' l2_group); a TMA
    tile reads the packed tensor's rows whatever sequence they belong to (zero only past its end),
    as the hardware does; window (per sequence) / softcap / sinks as simulate's. Returns O (total_q,
    Hq, D) (NaN where no task wrote), LSE (Hq, total_q) and the engine's findings."""
    pipe = pipe_or_cfg if isinstance(pipe_or_cfg, Pipeline) else build_pipeline(pipe_or_cfg)
    cfg = pipe.config
    if not cfg.varlen:
        raise ValueError(f"{cfg.name} is not a varlen pipeline")
    q, k, v = (np.asarray(t)[None] for t in (q, k, v))  # the packed tensors as a batch of one
    _, total_q, hq, total_k, hkv, d = _check_shapes(q, k, v)
    if (d, v.shape[-1]) != cfg.head_dims or hq != hkv * cfg.gqa_ratio:
        raise ValueError(f"shapes {q.shape[1:]}/{k.shape[1:]} do not fit {cfg.name}")
    q64, k64, v64 = (_as_compute(t, cfg.dtype, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = _default_scale(d, softmax_scale)
    mods = _mods(cfg, hq, window, softcap, sinks)
    ng = cfg.head_groups
    tasks = []
    for b, hg, m, q0, ql, k0, kl in varlen_tasks(cu_seqlens_q, cu_seqlens_k, total_q, total_k, hkv * ng,
                                                 cfg.seq_q_per_task, cfg.causal, seqused_k, l2_rows):
        info = unit_info(cfg, m, ql, kl, mods[0])  # the pair's (or tile's) blocks
        tasks.append(Task(0, hg // ng, m, info.n, hg % ng, q0, ql, k0, kl, block_lo=info.lo))
    data = (NumpyData if pipe.arch == "sm_100a" else NumpyDataSm90)(pipe, q64, k64, v64, scale, tasks, mods)
    findings = _run_ctas(pipe, data, tasks, num_ctas, seed, priority)
    return SimResult(data.o[0], data.lse[0], findings)


@dataclass
class KvSimResult:
    o: np.ndarray  # (B, Sq, Hq, D): the kernel's O (S == 1) or fa4_combine's merge of the partials
    lse: np.ndarray  # (B, Hq, Sq)
    o_partial: np.ndarray | None  # (S, B*Sq*Hq, D) fp32 when S > 1 (NaN where no task wrote)
    lse_partial: np.ndarray | None  # (S, B*Sq*Hq)
    findings: list[Finding]


def combine_partials(o_partial: np.ndarray, lse_partial: np.ndarray, sink=None):
    """fa4_combine's merge (fa4gen/spec/plan.py "KV-cache rules") in NumPy: lse = log sum_s exp(lse_s),
    O = sum_s exp(lse_s - lse) O_s; O = 0, LSE = -inf where every split is -inf. (S, R, D) -> (R, D), (R,).
    sink: (R,) each row's sink logit, one more term of lse's sum and none of O's (counted once)."""
    lp = lse_partial.astype(np.float64)
    terms = lp if sink is None else np.concatenate([lp, np.asarray(sink, np.float64)[None]])
    mx = terms.max(axis=0)
    empty = ~np.isfinite(mx)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.exp(terms - np.where(empty, 0.0, mx)[None])
        tot = w.sum(axis=0)
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, tot)) + np.where(empty, 0.0, mx))
        wn = np.where(empty[None], 0.0, w[:len(lp)] / np.where(empty, 1.0, tot)[None])
    o = np.einsum("sr,srd->rd", wn, np.where(wn[..., None] > 0, o_partial, 0.0))
    return o.astype(np.float32), lse.astype(np.float32)


def simulate_kvcache(pipe_or_cfg, q, k_cache, v_cache, cache_seqlens, page_table=None, num_splits: int = 1,
                     softmax_scale=None, seed: int = 0, num_ctas: int = 1, priority=None, *, window=None,
                     softcap: float = 0.0, sinks=None) -> KvSimResult:
    """Run a KV-cache pipeline's programs (fa4gen/spec/plan.py "KV-cache rules") over q (B, Sq, Hq, D)
    and a cache: contiguous k_cache, v_cache (B, Smax, Hkv, D), or paged (num_pages, page_size,
    Hkv, D) through page_table (B, max_pages). Tasks in the kernels' order (schedule.kvcache_task
    over m units of the pipeline's tiles per task), each split's blocks from plan.BlockInfo
    (an empty split runs one block whose keys every row's mask hides, as the kernels do), lengths
    and page entries clamped as on the device (kvcache_k_len, kvcache_page). A TMA K/V tile reads
    the keys of its pages (zero past the capacity). num_splits > 1 runs the split-KV epilogue
    (Cond.SPLIT_KV: StorePartial / store_lse_partial) and merges the partials as fa4_combine does
    (the sink once, there). window (to each cache's end) / softcap / sinks as simulate's."""
    pipe = pipe_or_cfg if isinstance(pipe_or_cfg, Pipeline) else build_pipeline(pipe_or_cfg)
    cfg = pipe.config
    if not cfg.kvcache:
        raise ValueError(f"{cfg.name} is not a KV-cache pipeline")
    q, k_cache, v_cache = (np.asarray(t) for t in (q, k_cache, v_cache))
    B, sq, hq, d = q.shape
    if cfg.page_size:
        if page_table is None or k_cache.shape[1] != cfg.page_size:
            raise ValueError(f"{cfg.name}: a paged cache (num_pages, {cfg.page_size}, Hkv, D) and a page_table")
        pt = np.asarray(page_table)
        max_pages, num_pages = pt.shape[1], k_cache.shape[0]
        capacity = max_pages * cfg.page_size
        idx = [[kvcache_page(pt[b], j, cfg.page_size, max_pages, num_pages) for j in range(capacity)]
               for b in range(B)]
        k = np.stack([np.stack([k_cache[p, r] for p, r in row]) for row in idx])  # the keys as TMA reads them
        v = np.stack([np.stack([v_cache[p, r] for p, r in row]) for row in idx])
    else:
        k, v, capacity = k_cache, v_cache, k_cache.shape[1]
    _, _, hq, skv, hkv, _ = _check_shapes(q, k, v)
    if (d, v.shape[-1]) != cfg.head_dims or hq != hkv * cfg.gqa_ratio:
        raise ValueError(f"shapes {q.shape}/{k.shape} do not fit {cfg.name}")
    q64, k64, v64 = (_as_compute(t, cfg.dtype, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = _default_scale(d, softmax_scale)
    mods = _mods(cfg, hq, window, softcap, sinks)
    S = max(int(num_splits), 1)
    ng = cfg.head_groups
    units = -(-sq // cfg.seq_q_per_task)
    tasks = []
    for t in range(B * hkv * ng * units * S):
        split, m, b, hg = kvcache_task(t, S, units, hkv * ng)
        kl = kvcache_k_len(int(np.asarray(cache_seqlens)[b]), capacity)
        info = unit_info(cfg, m, sq, kl, mods[0], split, S)
        tasks.append(Task(b, hg // ng, m, info.n, hg % ng, k_len=kl, split=split, block_lo=info.lo))
    data = (NumpyData if pipe.arch == "sm_100a" else NumpyDataSm90)(pipe, q64, k64, v64, scale, tasks, mods)
    R = B * sq * hq
    data.o_partial = np.full((S, R, v.shape[-1]), np.nan, np.float32)
    data.lse_partial = np.full((S, R), np.nan, np.float32)
    findings = _run_ctas(pipe, data, tasks, num_ctas, seed, priority, split_kv=S > 1)
    if S == 1:
        return KvSimResult(data.o, data.lse, None, None, findings)
    sink = None if mods[2] is None else np.tile(mods[2], B * sq)  # row r = (b * Sq + seq) * Hq + head
    o, lse = combine_partials(data.o_partial, data.lse_partial, sink)
    o = round_to_dtype(o, cfg.dtype).reshape(B, sq, hq, v.shape[-1])
    return KvSimResult(o, lse.reshape(B, sq, hq).transpose(0, 2, 1), data.o_partial, data.lse_partial, findings)
