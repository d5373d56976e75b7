"""KV-cache kernels in the emulator: a decode launch exactly as the runtime would make it (fa4_fwd over a
contiguous or paged cache with per-sequence lengths and split-KV, then fa4_combine over the fp32
partials when num_splits > 1), inputs that exercise the KV-cache rules (fa4gen/spec/plan.py "KV-cache
rules"), and the verdict against the float64 reference over the keys each sequence sees.

The inputs: q (B, Sq, Hq, D); the cache either (B, Smax, Hkv, D) or (num_pages, page_size, Hkv, D)
through a page table (B, max_pages) int32 whose rows are page_table_stride apart. Pages are dealt to
the sequences in a shuffled order, some pages belong to no sequence, unused table entries hold -1 or
a page number past the cache, one used entry is past the cache too (the clamp makes it read the
last page), and every cache row no sequence may see holds large garbage, so a kernel that reads a
key it should not see, or the wrong page, moves O far outside the tolerance. The reference gathers
each sequence's keys with fa4gen.spec.schedule.kvcache_page / kvcache_k_len (the Python side of the same
rules), so it never shares an index computation with the PTX under test.
"""
from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass

import numpy as np

from .. import reference
from ...spec.plan import COMBINE_ABI_PARAMS, kvcache_num_tasks
from ...runtime.runtime import launch_geometry, manifest_gqa, manifest_tile_rows
from ...spec.schedule import kvcache_k_len, kvcache_page
from . import units
from .cases import (RunResult, ScoreMods, Shape, UsageError, _from_dtype_bytes, _np_dtype_bytes, barrier_names,
                    default_mods,
                    entry_registers,
                    judge, make_inputs, mods_scalars, parse_suffixes, role_budgets, role_of, run_coverage, shape_mods,
                    split_nolse)
from .emulator import Emulator
from .machine import Fault, GlobalMemory
from .parse import manifest_entries

GARBAGE = 8.0  # scale of the values in cache rows no sequence may see (real keys are ~N(0, 1))


class KvUsageError(Exception):
    """Bad kvcache shape arguments (the harness turns it into its UsageError)."""


@dataclass
class KvShape:
    """A decode batch over a KV cache: raw cache_seqlens (the kernel clamps them to [0, capacity]),
    Sq query positions per sequence, the heads, num_splits and the cache's key capacity per sequence
    (contiguous: Smax; paged: rounded up to whole pages, max_pages = ceil(capacity / page_size))."""
    seqlens: tuple
    sq: int
    hq: int
    hkv: int
    num_splits: int = 3
    capacity: int = 300
    extra_pages: int = 3  # paged: pages of the cache no sequence's table row points at
    stride_pad: int = 1  # paged: page_table_stride = max_pages + stride_pad (the last row has no padding)
    with_lse: bool = True  # False: lse_ptr = 0 for both kernels (nothing may be written through it)
    mods: ScoreMods | None = None  # window / softcap / sink values (None: the defaults, cases.shape_mods)

    def __post_init__(self):
        self.seqlens = tuple(int(x) for x in self.seqlens)

    @property
    def b(self) -> int:
        return len(self.seqlens)

    def max_pages(self, page_size: int) -> int:
        return -(-self.capacity // page_size) if page_size else 0

    def cap(self, page_size: int) -> int:
        """The seqlen_k parameter: the cache's keys per sequence."""
        return self.max_pages(page_size) * page_size if page_size else self.capacity

    def k_lens(self, page_size: int) -> tuple:
        cap = self.cap(page_size)
        return tuple(kvcache_k_len(x & 0xFFFFFFFF, cap) for x in self.seqlens)

    def __str__(self):
        return (f"kvcache lens={','.join(map(str, self.seqlens))} Sq={self.sq} Hq={self.hq} Hkv={self.hkv} "
                f"splits={self.num_splits} capacity={self.capacity}" + ("" if self.with_lse else " no-LSE")
                + (f" {self.mods}" if self.mods else ""))

    @classmethod
    def parse(cls, s: str) -> "KvShape":
        """'L,L,...;SQ;HQ,HKV;SPLITS[;CAPACITY][;nolse][ w=L,R cap=X sink=Z]' (e.g. '129,1,-3,1000;3;4,1;3;600')."""
        try:
            s, mods = parse_suffixes(s, "--kv")
        except UsageError as e:
            raise KvUsageError(str(e)) from None
        usage = (f"--kv {s!r}: LENS;SQ;HQ,HKV;SPLITS[;CAPACITY][;nolse], e.g. '129,1,-3,1000;3;4,1;3;600' "
                 "(cache_seqlens as the device reads them, clamped to [0, capacity]; nolse: lse_ptr = 0)")
        parts, with_lse = split_nolse(s, ";")
        try:
            if len(parts) not in (4, 5):
                raise ValueError
            lens = tuple(int(x) for x in parts[0].split(","))
            sq = int(parts[1])
            hq, hkv = (int(x) for x in parts[2].split(","))
            splits = int(parts[3])
            cap = int(parts[4]) if len(parts) == 5 else max(max(lens), 1)
        except ValueError:
            raise KvUsageError(usage) from None
        if not lens or sq < 1 or hq < 1 or hkv < 1 or not 1 <= splits <= 256 or cap < 1:
            raise KvUsageError(usage + ": Sq, heads, capacity >= 1, splits in [1, 256]")
        if any(not -(1 << 31) <= x < (1 << 31) for x in lens):
            raise KvUsageError(usage + ": lengths are int32")
        return cls(lens, sq, hq, hkv, splits, cap, with_lse=with_lse, mods=mods)


def default_kv_shapes(man: dict) -> list:
    """Four decode batches. The first: Sq = 3 with num_splits = 3, sequences of 129 keys (2 blocks:
    splits of 1, 1 and 0 blocks), 1 key (causal: two of its rows see none), a negative length (no
    key: every split empty, O = 0, LSE = -inf) and one past the capacity (clamped to it: 600 keys,
    or the paged capacity, 5 or 6 blocks split 2 + 2 + 1 or 2 + 2 + 2, its last block partly past
    the cache; the longest sequence last, so an unclamped page index leaves the table). The second:
    Sq = 1, num_splits = 1 (the kernel writes O and LSE itself, the partials stay untouched), its one
    split walking 3 blocks of a 300-key sequence. The third: Sq = R / P + 3 query positions, R the
    rows where a task's second row group starts (sm_90a's second consumer warpgroup: 64; sm_100a's
    second Q tile: 128), so that group holds P * 3 real rows, with 2 splits of 2 + 2 blocks (the
    390-key sequence's queries see keys 371-389 of blocks 2 and 3: the second split's later block is
    masked too), and no LSE asked (lse_ptr = 0 for fa4_fwd and fa4_combine); with an odd Hq its
    B * Sq * Hq rows leave the last combine CTA partly empty. The fourth: the API's default decode
    launch, one split (the kernel stores O itself) and no LSE: the kernel's direct LSE store must
    skip lse_ptr = 0; with the third's R / P + 3 query positions, so that the direct O store of the
    second row group runs too (with Sq = 1 it never did: coverage's guarded instructions).
    O rescales: each sequence's last query position is make_inputs' rescale row (Sq = 1: the one
    position, so those batches have no x30 row), which rescales where its split reaches block 0
    after another block: the second batch's one split for the first row group, the third's first
    split (blocks 0 and 1 of the 390-key sequence) for the second.
    Score modifiers (the config's flags): windows (300, -1) on the first (the 600-key sequence's
    window covers blocks 2-4, one per split: it crosses the split boundaries; the 129-key one sees
    all its keys and leaves split 2 empty), (298, -1) on the second (its row sees keys 1-299: block 0
    cut by the window's left side, and block 1 whole for every row of the tile, those past Sq too:
    with GQA 1 the tile's last row is 127 positions on, so a wider cut would leave no block
    unmasked), (330, 0) on the third (the 390-key sequence's last row sees keys 59-389: block 0 in
    its first split for both row groups, and every Q tile has a block it sees whole) and (0, 0) (one
    key per query). Softcaps 5, 30, 50, 30: the rescales run under 30 and 50, which the rescale row
    does not saturate (5 does: tanh far from linear on the first batch); sinks as
    harness.default_shapes. The block counts above are for 128-key blocks; a kernel of 64-key blocks
    (sm_90a D = 256) cuts the same sequences into twice the blocks, and still reaches every basic block
    (docs/HEAD_DIMS.md)."""
    g, pack = manifest_gqa(man)
    hkv = 2 if g <= 2 else 1
    cfg = man["config"]
    # the rows where a task's second row group starts: sm_90a's second consumer warpgroup (64 rows of
    # the 128-row tile), sm_100a's second Q tile (the pair's rows 128-255)
    rows = manifest_tile_rows(man)
    second = rows // 2 if int(man["grid"].get("tiles_per_task", 1)) == 1 else rows
    shapes = [KvShape((129, 1, -3, 1000), 3, g * hkv, hkv, num_splits=3, capacity=600),
              KvShape((300, 0), 1, g * hkv, hkv, num_splits=1, capacity=310),
              KvShape((390, 40, 77), second // pack + 3, g * hkv, hkv, num_splits=2, capacity=400, with_lse=False),
              KvShape((70,), second // pack + 3, g * hkv, hkv, num_splits=1, capacity=128, with_lse=False)]
    for i, (sh, w, cap) in enumerate(zip(shapes, [(300, -1), (298, -1), (330, 0), (0, 0)], (5, 30, 50, 30))):
        sh.mods = default_mods(cfg, i, w, cap)
    return shapes


@dataclass
class KvInputs:
    q: np.ndarray  # (B, Sq, Hq, D), the dtype's values in float64/float32 arrays
    k_cache: np.ndarray  # (B, Smax, Hkv, D) or (num_pages, page_size, Hkv, D)
    v_cache: np.ndarray
    seqlens: np.ndarray  # int32 [B]
    page_table: np.ndarray | None  # int32, B * stride - (stride - max_pages) entries; None if contiguous
    page_size: int
    max_pages: int
    stride: int
    num_pages: int
    cap: int
    k_lens: tuple

    def gather(self, b: int):
        """Sequence b's visible keys and values (k_len, Hkv, D), read through the KV-cache rules."""
        n = self.k_lens[b]
        if not self.page_size:
            return self.k_cache[b, :n], self.v_cache[b, :n]
        row = self.page_table[b * self.stride: b * self.stride + self.max_pages]
        idx = [kvcache_page(row, j, self.page_size, self.max_pages, self.num_pages) for j in range(n)]
        pages = np.array([p for p, _ in idx], np.int64).reshape(-1)
        rows = np.array([r for _, r in idx], np.int64).reshape(-1)
        return self.k_cache[pages, rows], self.v_cache[pages, rows]


def make_kv_inputs(shape: KvShape, dtype: str, head_dim: int, page_size: int, seed: int, huge: bool = False,
                   head_dim_v: int | None = None) -> KvInputs:
    """q (B, Sq, Hq, D) and the caches, K with D columns and V with head_dim_v (default D)."""
    rng = np.random.default_rng([seed, 7919])
    b, d = shape.b, head_dim
    dv = d if head_dim_v is None else head_dim_v
    cap = shape.cap(page_size)
    k_lens = shape.k_lens(page_size)
    qs, ks, vs = [], [], []
    for i, n in enumerate(k_lens):
        q, k, v = make_inputs(Shape(1, shape.sq, max(n, 1), shape.hq, shape.hkv), dtype, d, seed * 1009 + i, huge=huge,
                              head_dim_v=dv, rescale_row=True)
        qs.append(q[0])
        ks.append(k[0, :n])
        vs.append(v[0, :n])
    q = np.stack(qs)

    def garbage(*dims):
        return reference.round_to_dtype(GARBAGE * rng.standard_normal(dims), dtype)

    seqlens = np.array(shape.seqlens, np.int64).astype(np.int32)
    if not page_size:
        kc, vc = garbage(b, cap, shape.hkv, d), garbage(b, cap, shape.hkv, dv)
        for i, n in enumerate(k_lens):
            kc[i, :n], vc[i, :n] = ks[i], vs[i]
        return KvInputs(q, kc, vc, seqlens, None, 0, 0, 0, 0, cap, k_lens)
    mp = shape.max_pages(page_size)
    stride = mp + shape.stride_pad
    used = [-(-n // page_size) for n in k_lens]
    num_pages = sum(used) + shape.extra_pages + 1  # + 1: the last page, read only through the clamp
    perm = rng.permutation(num_pages - 1)  # the sequences' pages, scattered; the last page is none's
    table = np.empty(b * stride - (stride - mp), np.int64)
    table[:] = np.where(np.arange(table.size) % 2, -1, num_pages + 100)  # unused entries: past the cache
    nxt = 0
    for i, u in enumerate(used):
        table[i * stride: i * stride + u] = perm[nxt: nxt + u]
        nxt += u
    # one used entry past the cache: the rule reads the last page for it
    first = next((i for i, u in enumerate(used) if u), None)
    if first is not None:
        table[first * stride + min(1, used[first] - 1)] = num_pages + 7
    kc, vc = garbage(num_pages, page_size, shape.hkv, d), garbage(num_pages, page_size, shape.hkv, dv)
    table32 = table.astype(np.int32)
    for i, n in enumerate(k_lens):
        row = table32[i * stride: i * stride + mp]
        for j in range(n):
            p, r = kvcache_page(row, j, page_size, mp, num_pages)
            kc[p, r], vc[p, r] = ks[i][j], vs[i][j]
    return KvInputs(q, kc, vc, seqlens, table32, page_size, mp, stride, num_pages, cap, k_lens)


def entry_regs(mod, man: dict, threads: int) -> int:
    return entry_registers(mod, man, threads)


class KvLaunch:
    """The two launches of a KV-cache decode, built on the CPU as the runtime would build them."""

    def __init__(self, mods: dict, man: dict, shape: KvShape, inp: KvInputs, *, ctas: int, seed: int):
        cfg = man["config"]
        self.man, self.cfg, self.shape, self.inp = man, cfg, shape, inp
        self.dtype = cfg["dtype"]
        d, g = int(cfg["head_dim"]), int(cfg["gqa_ratio"])
        dv = inp.v_cache.shape[-1]  # O's and the partials' columns (head_dim_v)
        if shape.hq != shape.hkv * g:
            raise UsageError(f"shape {shape}: Hq must be Hkv x the kernel's GQA ratio {g}")
        self.fwd_entry, self.comb_entry = manifest_entries(man)
        self.fwd, self.comb = mods[self.fwd_entry], mods[self.comb_entry]
        ps = int(man["kvcache"].get("page_size", cfg.get("page_size", 0)))
        if ps != inp.page_size:
            raise UsageError(f"inputs built for page_size {inp.page_size}, the kernel pages {ps}")
        gm = self.gmem = GlobalMemory()
        B, S = shape.b, shape.num_splits
        R = B * shape.sq * shape.hq
        self.rows = R
        self.addr = {}
        o_init = np.full(inp.q.shape[:-1] + (dv,), np.nan)
        for name, x in (("q", inp.q), ("k", inp.k_cache), ("v", inp.v_cache), ("o", o_init)):
            self.addr[name] = gm.add(name, _np_dtype_bytes(self.dtype, x))
        self.o_shape = o_init.shape
        self.lse_shape = (B, shape.hq, shape.sq)
        self.addr["lse"] = gm.add("lse", np.full(self.lse_shape, np.nan, np.float32)) if shape.with_lse else 0
        self.addr["cache_seqlens"] = gm.add("cache_seqlens", inp.seqlens)
        self.addr["page_table"] = gm.add("page_table", inp.page_table) if inp.page_table is not None else 0
        # the partials exist only for S > 1: the runtime passes null pointers otherwise (a write faults)
        self.addr["o_partial"] = gm.add("o_partial", np.full((S, R, dv), np.nan, np.float32)) if S > 1 else 0
        self.addr["lse_partial"] = gm.add("lse_partial", np.full((S, R), np.nan, np.float32)) if S > 1 else 0
        lg = launch_geometry(man, B, shape.hkv, shape.sq)
        self.num_tasks = kvcache_num_tasks(B, shape.hkv, lg.head_groups, lg.num_m_blocks, S)
        self.scale = 1.0 / math.sqrt(d)
        self.mods = shape_mods(cfg, shape, seed)  # the score modifiers' values (window, softcap, sinks)
        scalars = {
            "lse_ptr": ("<Q", self.addr["lse"]), "batch": ("<I", B), "seqlen_q": ("<I", shape.sq),
            "seqlen_k": ("<I", inp.cap), "num_heads_kv": ("<I", shape.hkv),
            "scale_log2": ("<f", self.scale * math.log2(math.e)), "num_m_blocks": ("<I", lg.num_m_blocks),
            # l2_group: not read by the KV-cache kernels (the runtime passes 1); varied to show it
            "num_tasks": ("<I", self.num_tasks), "l2_group": ("<I", 1 + seed % 3),
            "cache_seqlens": ("<Q", self.addr["cache_seqlens"]), "page_table": ("<Q", self.addr["page_table"]),
            "page_table_stride": ("<I", inp.stride), "max_pages": ("<I", inp.max_pages),
            "num_pages": ("<I", inp.num_pages), "num_splits": ("<I", S),
            "o_partial": ("<Q", self.addr["o_partial"]), "lse_partial": ("<Q", self.addr["lse_partial"]),
            "o_ptr": ("<Q", self.addr["o"]),
        }
        scalars.update(mods_scalars(cfg, self.mods, self.scale, gm, shape.hq))  # scale_log2 with a softcap
        if [p.name for p in self.fwd.params] != list(man["params"]):
            raise UsageError(f"the PTX's {self.fwd_entry} declares parameters {[p.name for p in self.fwd.params]}, "
                             f"the manifest lists {man['params']}: they must agree")
        tensors = {"q": inp.q, "k": inp.k_cache, "v": inp.v_cache, "o": o_init}

        def tmap(role):
            return units.manifest_tensor_map(man, role, tensors[role].shape, lg.pack, self.addr[role])

        self.fwd_params, self.fwd_offsets, self.fwd_sizes = _pack(self.fwd, scalars, tmap, UsageError)
        comb_names = [n for n, _ in COMBINE_ABI_PARAMS]
        declared = [p.name for p in self.comb.params]
        if declared != list(man["kvcache"]["combine"].get("params", comb_names)):
            raise UsageError(f"the PTX's {self.comb_entry} declares parameters {declared}, the manifest lists "
                             f"{man['kvcache']['combine'].get('params')}: they must agree")
        cscalars = {"o_partial": ("<Q", self.addr["o_partial"]), "lse_partial": ("<Q", self.addr["lse_partial"]),
                    "o_ptr": ("<Q", self.addr["o"]), "lse_ptr": ("<Q", self.addr["lse"]), "rows": ("<I", R),
                    "num_splits": ("<I", S), "seqlen_q": ("<I", shape.sq), "num_heads_q": ("<I", shape.hq)}
        if "sink_ptr" in scalars:  # should the combine take the sinks (docs/ABI.md): the same buffer
            cscalars["sink_ptr"] = scalars["sink_ptr"]
        self.comb_params, self.comb_offsets, self.comb_sizes = _pack(self.comb, cscalars, None, UsageError)
        comb = man["kvcache"]["combine"]
        self.comb_threads = int(comb["threads_per_cta"])
        self.comb_ctas = max(-(-R // int(comb["rows_per_cta"])), 1)
        pol = man["grid"]["policy"]
        self.nctas = max(min(self.num_tasks, ctas) if pol == "persistent" else self.num_tasks, 1)

    def output(self):
        o = _from_dtype_bytes(self.dtype, self.gmem.buffer("o"), self.o_shape)
        if not self.addr["lse"]:
            return o, None
        lse = self.gmem.buffer("lse").view(np.float32).reshape(self.lse_shape).astype(np.float64)
        return o, lse

    def partials(self):
        """(o_partial [S, R, DV], lse_partial [S, R]) after the launch; None when S == 1."""
        if self.shape.num_splits == 1:
            return None
        S, R, d = self.shape.num_splits, self.rows, self.o_shape[-1]
        return (self.gmem.buffer("o_partial").view(np.float32).reshape(S, R, d),
                self.gmem.buffer("lse_partial").view(np.float32).reshape(S, R))


def _pack(mod, scalars: dict, tmap, UsageError):
    offsets, sizes, blob = {}, {}, bytearray()
    for p in mod.params:
        while len(blob) % max(p.align, 1):
            blob.append(0)
        offsets[p.name], sizes[p.name] = len(blob), p.size
        if p.name.startswith("tmap_") and tmap is not None:
            blob += tmap(p.name[5:])
        elif p.name in scalars:
            fmt, val = scalars[p.name]
            blob += struct.pack(fmt, val)
        else:
            raise UsageError(f"parameter {p.name} of {mod.entry} is not one the runtime knows how to pass")
    return bytes(blob), offsets, sizes


def _written(emu, name: str, size: int) -> np.ndarray:
    """Per byte of allocation `name`: how often the launch wrote it."""
    cnt = emu.gwrites.get(name)
    return np.zeros(size, np.uint8) if cnt is None else cnt


def run_kvcache_once(mods: dict, man: dict, shape: KvShape, seed: int, *, ctas: int = 2,
                     step_limit: int = 30_000_000, progress=None, inputs: KvInputs | None = None,
                     delays=None, options: dict | None = None, tma_loads: list | None = None):
    """One decode launch (fa4_fwd, then fa4_combine when split) judged against the reference;
    tma_loads: a list that gets fa4_fwd's TMA loads, (tensor-map parameter, coordinates) each."""
    cfg = man["config"]
    ps = int(man["kvcache"].get("page_size", 0))
    inp = inputs or make_kv_inputs(shape, cfg["dtype"], int(cfg["head_dim"]), ps, seed, huge=True,
                                   head_dim_v=int(cfg.get("head_dim_v", cfg["head_dim"])))
    launch = KvLaunch(mods, man, shape, inp, ctas=ctas, seed=seed)
    res = RunResult(False, shape, seed)
    t0 = time.perf_counter()
    S = shape.num_splits
    stage = f"{launch.fwd_entry}"
    emu = cemu = None
    try:
        emu = Emulator(launch.fwd, arch=cfg["arch"], nthreads=int(man["threads_per_cta"]), nctas=launch.nctas,
                       dyn_smem=int(man["dynamic_smem_bytes"]), params=launch.fwd_params,
                       param_offsets=launch.fwd_offsets, gmem=launch.gmem, seed=seed,
                       entry_regs=entry_regs(launch.fwd, man, int(man["threads_per_cta"])),
                       barrier_names=barrier_names(man), delays=delays,
                       options=dict({"role_regs": role_budgets(man)}, **(options or {})))
        emu.param_sizes = launch.fwd_sizes
        emu.tma_loads = tma_loads
        emu.run(step_limit, progress=progress)
        res.warp_instructions = emu.total_steps
        findings = [(stage, f) for f in emu.findings]
        notes = _partial_coverage(emu, launch, S)
        cemu = None
        if S > 1:
            stage = launch.comb_entry
            cemu = Emulator(launch.comb, arch=cfg["arch"], nthreads=launch.comb_threads, nctas=launch.comb_ctas,
                            dyn_smem=0, params=launch.comb_params, param_offsets=launch.comb_offsets,
                            gmem=launch.gmem, seed=seed, entry_regs=entry_regs(launch.comb, man, launch.comb_threads),
                            delays=delays, options=dict(options or {}))
            cemu.param_sizes = launch.comb_sizes
            cemu.run(step_limit)
            res.warp_instructions += cemu.total_steps
            findings += [(stage, f) for f in cemu.findings]
    except Fault as f:
        res.warp_instructions += (emu.total_steps if emu is not None and stage == launch.fwd_entry else 0)
        res.coverage = run_coverage(man, emu, cemu if stage != launch.fwd_entry else None)
        res.kind, res.finding = "fault", f.kind
        role = f" [{role_of(man, f.warp)}]" if f.warp is not None and stage == launch.fwd_entry else ""
        res.report = f"{stage}: {f}{role}"
        res.seconds = time.perf_counter() - t0
        return res
    res.coverage = run_coverage(man, emu, cemu)
    res.seconds = time.perf_counter() - t0
    o, lse = launch.output()
    res.o, res.lse = o, lse
    ok, rep, res.max_err = judge_kvcache(o, lse, inp, cfg, launch.scale, shape, judge, launch.mods)
    uniq = list({str(f): (st, f) for st, f in findings}.values())
    faults = [f"{st}: {f}" + (f" [{role_of(man, f.warp)}]" if f.warp is not None and st == launch.fwd_entry else "")
              for st, f in uniq]
    res.report = "\n".join(faults + notes + ([rep] if rep else []))
    res.ok = ok and not faults and not notes
    if uniq:
        res.kind, res.finding = "fault", uniq[0][1].kind
    elif notes:
        res.kind, res.finding = "fault", "PARTIALS"
    else:
        res.kind, res.finding = ("ok", "") if ok else ("mismatch", "mismatch")
    return res


def _partial_coverage(emu, launch: KvLaunch, S: int) -> list:
    """What fa4_fwd wrote, against the rules: S > 1 -> every partial byte exactly once (the combine
    reads all of them: an unwritten LSE partial is a NaN that max() would silently drop) and
    neither O nor LSE. S == 1 -> the partial pointers are null, as the runtime passes them (a write
    through them is a GMEM_OOB fault), and O and LSE are judged on their values."""
    notes = []
    for name in ("o_partial", "lse_partial") if S > 1 else ():
        size = launch.gmem.buffer(name).size
        cnt = _written(emu, name, size)
        never = int((cnt == 0).sum())
        if never:
            first = int(np.flatnonzero(cnt == 0)[0])
            elem = first // 4
            dv = launch.o_shape[-1]
            what = (f"split {elem // (launch.rows * dv)}, row {elem // dv % launch.rows}" if name == "o_partial"
                    else f"split {elem // launch.rows}, row {elem % launch.rows}")
            notes.append(f"{launch.fwd_entry}: {never} of {size} bytes of {name} never written (first: {what}); "
                         "every split writes every row of its partials")
    if S > 1:
        for name in ("o", "lse") if launch.addr["lse"] else ("o",):
            cnt = _written(emu, name, launch.gmem.buffer(name).size)
            if cnt.any():
                notes.append(f"{launch.fwd_entry}: num_splits = {S} but it wrote {int((cnt > 0).sum())} bytes of {name} "
                             "(only fa4_combine writes O and LSE then)")
    return notes


def judge_kvcache(o, lse, inp: KvInputs, cfg: dict, scale: float, shape: KvShape, judge, mods: dict | None = None):
    """judge() per sequence on its own rows against its gathered keys (causal and a window: the Sq
    queries end-aligned with its k_len keys); every element of O and LSE belongs to exactly one
    sequence. mods: the score modifiers' values."""
    msgs, worst = [], 0.0
    for b in range(shape.b):
        k, v = inp.gather(b)
        ok, rep, err = judge(o[b:b + 1], None if lse is None else lse[b:b + 1], inp.q[b:b + 1], k[None], v[None],
                             cfg, scale, mods)
        worst = max(worst, err)
        if not ok:
            msgs.append(f"sequence {b} (cache_seqlens {shape.seqlens[b]} -> {inp.k_lens[b]} keys, {shape.sq} queries):")
            msgs.extend("  " + ln for ln in rep.splitlines())
    return (not msgs), "\n".join(msgs), worst
