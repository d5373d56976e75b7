"""Launch an emitted kernel in the emulator exactly as the runtime launches it on a GPU, with inputs
that exercise its paths, and judge O and LSE against the float64 reference.

The PTX text is executed as given (read from disk by the caller); the manifest supplies what the
runtime reads from it (threads, dynamic SMEM, tensor-map boxes, parameter order, grid policy).
"""
from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import reference
from ...runtime.runtime import launch_geometry, manifest_block_n, manifest_gqa, manifest_tile_rows, varlen_num_tasks
from . import units
from .kvcache import KvShape, KvUsageError, default_kv_shapes, run_kvcache_once  # noqa: F401 (KvShape re-exported)
from .emulator import Emulator
from .machine import Fault, GlobalMemory
from .cases import (RunResult, ScoreMods, Shape, UsageError, _from_dtype_bytes, _np_dtype_bytes,  # noqa: F401
                    _pv_abs, barrier_names, default_mods, entry_registers, judge, make_inputs, mods_scalars, parse_suffixes, role_budgets,
                    role_of, run_coverage, shape_mods, softcap_score_err, split_nolse,
                    tolerance)  # (re-exported: harness.X)
from .coverage import Coverage
from .parse import manifest_entries, parse, parse_for_manifest


@dataclass
class VarShape:
    """A varlen batch: per-sequence query and key lengths (packed), optional seqused_k."""
    lens_q: tuple
    lens_k: tuple
    hq: int
    hkv: int
    seqused_k: tuple | None = None
    with_lse: bool = True  # False: lse_ptr = 0 (the API's default launch)
    mods: ScoreMods | None = None  # window / softcap / sink values (None: the defaults, cases.shape_mods)

    def __post_init__(self):
        self.lens_q, self.lens_k = tuple(int(x) for x in self.lens_q), tuple(int(x) for x in self.lens_k)
        if self.seqused_k is not None:
            self.seqused_k = tuple(int(x) for x in self.seqused_k)

    @property
    def b(self) -> int:
        return len(self.lens_q)

    @property
    def used_k(self) -> tuple:
        """Keys each sequence attends to: its length, capped by seqused_k."""
        if self.seqused_k is None:
            return self.lens_k
        return tuple(min(a, u) for a, u in zip(self.lens_k, self.seqused_k))

    def __str__(self):
        pairs = " ".join(f"{a}:{b}" for a, b in zip(self.lens_q, self.lens_k))
        used = f" seqused_k={','.join(map(str, self.seqused_k))}" if self.seqused_k is not None else ""
        return (f"varlen [{pairs}] Hq={self.hq} Hkv={self.hkv}{used}" + ("" if self.with_lse else " no-LSE")
                + (f" {self.mods}" if self.mods else ""))

    @classmethod
    def parse(cls, s: str) -> "VarShape":
        """'LQ:LK,LQ:LK,...;HQ,HKV[;nolse][ w=L,R cap=X sink=Z]' (e.g. '131:200,0:17,40:0;4,1')."""
        s, mods = parse_suffixes(s, "--lens")
        fields, with_lse = split_nolse(s, ";")
        try:
            seqs, heads = fields
            pairs = [tuple(int(x) for x in p.split(":")) for p in seqs.split(",")]
            hq, hkv = (int(x) for x in heads.split(","))
        except ValueError:
            raise UsageError(f"--lens {s!r}: LQ:LK,LQ:LK,...;HQ,HKV[;nolse] (e.g. 131:200,0:17,40:0;4,1)") from None
        if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs) or hq < 1 or hkv < 1:
            raise UsageError(f"--lens {s!r}: lengths >= 0 as LQ:LK pairs, then HQ,HKV >= 1")
        return cls(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), hq, hkv, with_lse=with_lse, mods=mods)


@dataclass
class EmulateReport:
    ok: bool
    ptx: str
    runs: list = field(default_factory=list)

    @property
    def coverage(self) -> Coverage:
        """The paths the runs took, merged (per entry: basic blocks, branch directions, by role)."""
        cov = Coverage()
        for r in self.runs:
            if r.coverage is not None:
                cov.merge(r.coverage)
        return cov

    def summary(self) -> str:
        lines = []
        for r in self.runs:
            rate = r.warp_instructions / r.seconds if r.seconds else 0
            head = (f"seed {r.seed} {r.shape}: {'PASS' if r.ok else r.kind.upper()} "
                    f"({r.warp_instructions} warp-instructions, {r.seconds:.1f} s, {rate:,.0f}/s)")
            lines.append(head)
            if r.report:
                lines.extend("  " + ln for ln in r.report.splitlines())
        return "\n".join(lines)


def load_manifest(ptx_path: Path, manifest_path: Path | None) -> dict:
    mp = manifest_path or ptx_path.with_suffix(".json")
    if not mp.exists():
        raise UsageError(f"no manifest: {mp} does not exist (pass --manifest)")
    try:
        man = json.loads(mp.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{mp}: not JSON ({e})") from None
    for key in ("config", "threads_per_cta", "dynamic_smem_bytes", "tensor_maps", "params", "grid"):
        if key not in man:
            raise UsageError(f"{mp}: the manifest has no {key!r} (was it written by fa4gen build?)")
    return man


def default_shapes(man: dict) -> list:
    """Small shapes with tails on both lengths, GQA packing, and (causal) Sq != Skv both ways, the
    Sq > Skv one with a first task (m unit) whose rows see no key (plan.BlockInfo: it runs one fully
    masked block) before tiles that cross the diagonal.
    Varlen kernels: ragged batches with a zero-length sequence, one with no keys, q_len != k_len
    both ways, a sequence of more than one task, and seqused_k. First, for both: a small launch
    without LSE (the API's default: lse_ptr = 0).
    Score modifiers (the config's flags; values as shape suffixes, cases.ScoreMods): a window smaller
    than a block, one crossing block and tile boundaries on Sq != Skv, one leaving whole tiles of
    Sq > Skv without a key, an unbounded left side (whole blocks unmasked), window + causal, (0, 0)
    (one key per row); softcaps cycling
    cases.SOFTCAPS with raw scores ~1e4 (make_inputs huge rows); sinks per seed dominant (50), -inf,
    moderate and random (cases.default_sinks). KV-cache kernels: default_kv_shapes."""
    cfg = man["config"]
    if man.get("kvcache"):
        return default_kv_shapes(man)
    g, pack = manifest_gqa(man)
    rows = manifest_tile_rows(man) // pack
    bn = manifest_block_n(man)  # keys per K/V block
    per_task = int(man["grid"].get("tiles_per_task", 1))
    hkv = 2 if g <= 2 else 1
    causal = bool(cfg["causal"])

    def mods(shapes, windows, caps=None):
        for i, (sh, w) in enumerate(zip(shapes, windows)):
            sh.mods = default_mods(cfg, i, w, None if caps is None else caps[i])
        return shapes
    # the first launch of each kind is the API's default one, without LSE (lse_ptr = 0: a store through it
    # faults), on the smallest problem that stores LSE rows: one partial Q tile, one partial K/V block
    # (first: a kernel that mishandles it fails at once, before the longer launches)
    if cfg.get("varlen"):
        long_q = rows * per_task + rows // 2 + 3
        # with a window the long sequence has more keys (450), so that its window (400, 30) cuts leading
        # blocks (unmasked_lo > 0) and still leaves a block wholly inside (the unmasked path)
        windowed = bool(cfg.get("window"))
        # the last sequence, one query over one whole block, is the tile whose first block runs unmasked;
        # the long one's keys (at least long_q - rows * per_task + bn) give its second task a later block wholly
        # visible to the tile's first row (the loop's unmasked path: a 192-row tile of one head needs 227),
        # and at least three blocks, so that the K/V loop goes round more than once (its back edge)
        return mods([VarShape((3, 0), (70, 5), g * hkv, hkv, with_lse=False),
                     VarShape((long_q, 0, 40, 9, 70, 1), (450 if windowed else max(2 * bn + 5, long_q - rows * per_task + bn), 17, 0, 130,
                                                          30, bn), g * hkv, hkv),
                     # three KV heads (the head sections of a sequence's tasks), and seqused_k cutting the
                     # second sequence one key past a block (its block count rounds up from that one key)
                     VarShape((5, rows + 1, 0), (140, bn + 72, 0), 3 * g, 3, seqused_k=(3, bn + 1, 0))],
                    [(5, 2), (400, 30), (20, 0)])
    sq = rows * per_task + rows // 2 + 3  # a second task whose tiles are partly / wholly past Sq
    # keys of the causal Sq < Skv shape: at least three blocks, so that a tile of packed GQA heads (few
    # positions per tile: short Sq) still runs the K/V loop, masked and unmasked
    skv = max(sq + 70, 2 * bn + 5)
    no_lse = Shape(1, 3, 70, g * hkv, hkv, with_lse=False)
    # the one shape without a key tail (Skv one block; Sq = 1, a tail): the first block a task runs is
    # unmasked only when the tile's first row sees every key of it, which a causal tile can do only
    # when that row is the last query row (a decode-like tile)
    aligned = Shape(2, 1, bn, 3 * g, 3)  # and six (batch, kv head) units: the L2 sections (seeded group) split them
    if cfg.get("window"):  # Sq > Skv: the first tiles' rows see no key (left window side 20 < Sq - Skv)
        # the fourth shape's keys: enough that the second tile's first row sees all of block 0 (a
        # 192-row tile of one head needs more than 203: Sq - rows + bn)
        shapes = [no_lse, Shape(1, sq, skv, g * hkv, hkv), Shape(1, rows * per_task + 150, 97, g, 1),
                  Shape(1, sq, max(203, sq - rows + bn), g * hkv, hkv)]
        # (100, 30) on the second: its left side cuts blocks below the diagonal (unmasked_lo > 0); the
        # fourth leaves the left side unbounded, so later blocks run unmasked (causal: (0, 0), one key
        # per row, is the first's); the aligned one runs its first block unmasked
        windows = [(0, 0) if causal else (5, 2), (100, 30), (20, 5), (-1, 0)]
        shapes.append(aligned)  # window unbounded (a causal kernel's right side is 0)
        windows.append((-1, -1))
        return mods(shapes, windows)
    if causal:
        # the mask's boundaries: a column c of a masked block is hidden iff the row's visible keys in the
        # block are <= c, so `<=` against `<` differs only on a row that sees exactly c keys there. The
        # diagonal gives a tile's rows consecutive counts (a window as wide as its positions), shifted
        # by Skv - Sq: the top block a tile runs first sees the counts up to where the window ends, the
        # block below (the K/V loop's masked path) the rest. Three offsets mod the block: 3 (windows at
        # the bottom of a block, straddling into the one below), one that ends the last whole tile's
        # window at a block's top, and bn - 5. Each shape runs whole tiles (up to four, tiles narrower
        # than a block: packed GQA) plus 8 rows: the row group below the one at Sq, where the LSE
        # store's guard (row < Sq) meets row == Sq. Boundary coverage (--coverage) shows what is met.
        near = Shape(1, sq, sq + 3 + bn * max(1, -(-(2 * bn + 5 - sq - 3) // bn)), g * hkv, hkv)
        tiles = rows * per_task * min(4, bn // math.gcd(rows * per_task, bn))
        whole = tiles + 8
        return mods([no_lse, near, Shape(1, rows * per_task + 150, 97, g, 1), aligned,
                     Shape(1, whole, whole + (-tiles) % bn, g * hkv, hkv),
                     Shape(1, whole, whole + bn - 5, g * hkv, hkv)],
                    [None] * 6)
    # softcaps: the one shape of more than one K/V block (where O rescales) takes a cap that keeps the
    # rescale row's scores apart (30), the saturating 5 goes to the one-block launch without LSE
    return mods([no_lse, Shape(1, sq, 203, g * hkv, hkv), aligned], [None] * 3, caps=(5.0, 30.0, 50.0))


def make_varlen_inputs(shape: VarShape, dtype: str, head_dim: int, seed: int, huge: bool = False,
                       head_dim_v: int | None = None):
    """Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, DV): each sequence drawn like make_inputs."""
    qs, ks, vs = [], [], []
    for i, (lq, lk) in enumerate(zip(shape.lens_q, shape.lens_k)):
        q, k, v = make_inputs(Shape(1, max(lq, 1), max(lk, 1), shape.hq, shape.hkv), dtype, head_dim, seed * 1009 + i,
                              huge=huge, head_dim_v=head_dim_v)
        qs.append(q[0, :lq])
        ks.append(k[0, :lk])
        vs.append(v[0, :lk])
    return tuple(np.concatenate(x, axis=0) for x in (qs, ks, vs))


class Launch:
    """Everything the runtime would hand the driver, built on the CPU."""

    def __init__(self, mod, man: dict, shape: Shape, q, k, v, *, ctas: int, seed: int, l2_group: int | None = None,
                 with_lse: bool = True):
        cfg = man["config"]
        self.man, self.cfg, self.shape = man, cfg, shape
        self.dtype = cfg["dtype"]
        d = int(cfg["head_dim"])
        g = int(cfg["gqa_ratio"])
        if shape.hq != shape.hkv * g:
            raise UsageError(f"shape {shape}: Hq must be Hkv x the kernel's GQA ratio {g}")
        self.gmem = GlobalMemory()
        varlen = isinstance(shape, VarShape)
        if varlen != bool(cfg.get("varlen")):
            raise UsageError(f"shape {shape}: the kernel is {'' if cfg.get('varlen') else 'not '}a varlen kernel")
        tensors = {"q": q, "k": k, "v": v}
        o_init = np.full(q.shape[:-1] + v.shape[-1:], np.nan)  # O has v's columns (head_dim_v)
        self.addr = {}
        for name, x in list(tensors.items()) + [("o", o_init)]:
            self.addr[name] = self.gmem.add(name, _np_dtype_bytes(self.dtype, x))
        lse_shape = (shape.hq, q.shape[0]) if varlen else (shape.b, shape.hq, shape.sq)
        self.lse_addr = self.gmem.add("lse", np.full(lse_shape, np.nan, np.float32)) if with_lse else 0
        self.o_shape = o_init.shape
        self.lse_shape = lse_shape
        # parameters, in the manifest's order; offsets from the PTX's own declarations
        offsets, sizes, blob = {}, {}, bytearray()
        if [p.name for p in mod.params] != list(man["params"]):
            raise UsageError(f"the PTX declares parameters {[p.name for p in mod.params]}, the manifest lists "
                             f"{man['params']}: they must agree")
        scale = 1.0 / math.sqrt(d)
        self.mods = shape_mods(cfg, shape, seed)  # the score modifiers' values (window, softcap, sinks)
        if varlen:
            lg = launch_geometry(man, 1, shape.hkv, 1)
            num_tasks = varlen_num_tasks(man, shape.b, shape.hkv, q.shape[0])  # the runtime's own bound
            cu = {n: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                  for n, lens in (("q", shape.lens_q), ("k", shape.lens_k))}
            self.cu = cu
            used = self.gmem.add("seqused_k", np.asarray(shape.seqused_k, np.int32)) if shape.seqused_k else 0
            scalars = {
                "lse_ptr": ("<Q", self.lse_addr), "batch": ("<I", shape.b),
                "seqlen_q": ("<I", max(shape.lens_q)), "seqlen_k": ("<I", max(shape.lens_k)),
                "num_heads_kv": ("<I", shape.hkv), "scale_log2": ("<f", scale * math.log2(math.e)),
                "num_m_blocks": ("<I", 0), "num_tasks": ("<I", num_tasks),
                # K/V rows per L2 section (schedule.varlen_l2_rows); the seed varies the sections
                "l2_group": ("<I", l2_group if l2_group is not None else (0, 150, 400, 1 << 20)[seed % 4]),
                "cu_seqlens_q": ("<Q", self.gmem.add("cu_seqlens_q", cu["q"])),
                "cu_seqlens_k": ("<Q", self.gmem.add("cu_seqlens_k", cu["k"])),
                "seqused_k": ("<Q", used), "o_ptr": ("<Q", self.addr["o"]),
                "total_q": ("<I", q.shape[0]), "total_k": ("<I", k.shape[0]),
            }
        else:
            lg = launch_geometry(man, shape.b, shape.hkv, shape.sq)  # the runtime's own arithmetic
            num_m_blocks, num_tasks = lg.num_m_blocks, lg.num_tasks
            scalars = {
                "lse_ptr": ("<Q", self.lse_addr), "batch": ("<I", shape.b), "seqlen_q": ("<I", shape.sq),
                "seqlen_k": ("<I", shape.skv), "num_heads_kv": ("<I", shape.hkv),
                "scale_log2": ("<f", scale * math.log2(math.e)), "num_m_blocks": ("<I", num_m_blocks),
                "num_tasks": ("<I", num_tasks),
                "l2_group": ("<I", l2_group if l2_group is not None else 1 + seed % max(lg.num_bh, 1)),
                "o_ptr": ("<Q", self.addr["o"]),  # a kernel that stores O from the registers (plan.DENSE_O_ABI_PARAMS)
            }
        self.scale = scale
        if "task_counter" in man["params"]:  # the dynamic deal's counter (plan.DYNAMIC_ABI_PARAMS): zeroed, as the runtime passes it
            scalars["task_counter"] = ("<Q", self.gmem.add("task_counter", np.zeros(1, np.uint32)))
        scalars.update(mods_scalars(cfg, self.mods, scale, self.gmem, shape.hq))  # scale_log2 with a softcap
        for p in mod.params:
            align = max(p.align, 1)
            while len(blob) % align:
                blob.append(0)
            offsets[p.name] = len(blob)
            sizes[p.name] = p.size
            if p.name.startswith("tmap_"):
                role = p.name[5:]
                t = tensors.get(role, o_init)
                tshape = (1,) + t.shape if varlen else t.shape  # varlen: the packed tensor as a batch of one
                blob += units.manifest_tensor_map(man, role, tshape, lg.pack, self.addr[role])
            elif p.name in scalars:
                fmt, val = scalars[p.name]
                blob += struct.pack(fmt, val)
            else:
                raise UsageError(f"parameter {p.name} is not one the runtime knows how to pass")
        self.params, self.offsets, self.sizes = bytes(blob), offsets, sizes
        pol = man["grid"]["policy"]
        self.nctas = min(num_tasks, ctas) if pol == "persistent" else num_tasks
        self.nctas = max(self.nctas, 1)
        self.num_tasks = num_tasks

    def barrier_names(self) -> dict:
        return barrier_names(self.man)

    def output(self):
        o = _from_dtype_bytes(self.dtype, self.gmem.buffer("o"), self.o_shape)
        lse = self.gmem.buffer("lse").view(np.float32).reshape(self.lse_shape).astype(np.float64) if self.lse_addr else None
        return o, lse


def run_raw(ptx_text: str, *, threads: int, ctas: int = 1, args: tuple = (), smem: int = 0, seed: int = 0,
            step_limit: int = 1_000_000, coverage: Coverage | None = None):
    """Launch any PTX kernel in the emulator: `args` in parameter order, NumPy arrays become device
    buffers (the parameter gets their address), ints/floats are packed as the parameter's type.
    Returns the buffers after the run, in argument order (None for scalars). Raises Fault. The paths
    the run took are merged into `coverage` when given (every warp is role "all")."""
    mod = parse(ptx_text)
    if len(args) != len(mod.params):
        raise UsageError(f"{len(args)} arguments for {len(mod.params)} parameters")
    gmem = GlobalMemory()
    blob, offsets, names = bytearray(), {}, []
    for p, a in zip(mod.params, args):
        while len(blob) % max(p.align, 1):
            blob.append(0)
        offsets[p.name] = len(blob)
        if isinstance(a, np.ndarray):
            names.append(p.name)
            blob += struct.pack("<Q", gmem.add(p.name, a))
        else:
            names.append(None)
            fmt = {".u32": "<I", ".s32": "<i", ".f32": "<f", ".u64": "<Q", ".s64": "<q", ".b32": "<I", ".b64": "<Q"}[p.type]
            blob += struct.pack(fmt, a)
    emu = Emulator(mod, arch="raw", nthreads=threads, nctas=ctas, dyn_smem=smem, params=bytes(blob),
                   param_offsets=offsets, gmem=gmem, seed=seed, entry_regs=entry_registers(mod, None, threads))
    try:
        emu.run(step_limit)
    finally:
        if coverage is not None:
            coverage.merge(run_coverage({}, emu))
    if emu.findings:
        raise emu.findings[0]
    outs = []
    for n, a in zip(names, args):
        outs.append(gmem.buffer(n).view(a.dtype).reshape(a.shape) if n else None)
    return outs


def run_once(ptx_text: str, man: dict, shape: Shape, seed: int, *, ctas: int = 2, step_limit: int = 30_000_000,
             mod=None, progress=None, inputs=None, delays=None, l2_group: int | None = None,
             options: dict | None = None, trace=None) -> RunResult:
    """One launch of a dense or varlen kernel (a KV-cache one: kvcache.run_kvcache_once) on `shape`'s
    seeded inputs, judged against the reference. trace: a trace.Recorder that gets the launch's events."""
    cfg = man["config"]
    mods = mod if isinstance(mod, dict) else None
    if cfg.get("kvcache") and not man.get("kvcache"):
        raise UsageError("the manifest's config is a KV-cache kernel but it has no \"kvcache\" record (no combine "
                         "entry declared): not a KV-cache build the emulator can launch")
    if man.get("kvcache") or isinstance(shape, KvShape):
        if not man.get("kvcache") or not isinstance(shape, KvShape):
            raise UsageError(f"shape {shape}: the kernel is {'' if man.get('kvcache') else 'not '}a KV-cache kernel")
        if trace is not None:
            raise UsageError("a trace records dense and varlen launches (a KV-cache launch runs two entries)")
        mods = mods or parse_for_manifest(ptx_text, man)
        try:
            return run_kvcache_once(mods, man, shape, seed, ctas=ctas, step_limit=step_limit, progress=progress,
                                    inputs=inputs, delays=delays, options=options)
        except KvUsageError as e:
            raise UsageError(str(e)) from None
    if mods is not None:
        mod = mods[manifest_entries(man)[0]]
    mod = mod or parse_for_manifest(ptx_text, man)[manifest_entries(man)[0]]
    d = int(cfg["head_dim"])
    varlen = isinstance(shape, VarShape)
    if inputs is None:
        inputs = (make_varlen_inputs if varlen else make_inputs)(shape, cfg["dtype"], d, seed,
                                                                   huge=True,
                                                                   head_dim_v=int(cfg.get("head_dim_v", d)))
    q, k, v = inputs
    launch = Launch(mod, man, shape, q, k, v, ctas=ctas, seed=seed, l2_group=l2_group, with_lse=shape.with_lse)
    entry_regs = entry_registers(mod, man, int(man["threads_per_cta"]))
    t0 = time.perf_counter()
    res = RunResult(False, shape, seed)
    try:
        emu = Emulator(mod, arch=cfg["arch"], nthreads=int(man["threads_per_cta"]), nctas=launch.nctas,
                       dyn_smem=int(man["dynamic_smem_bytes"]), params=launch.params, param_offsets=launch.offsets,
                       gmem=launch.gmem, seed=seed, entry_regs=entry_regs, barrier_names=launch.barrier_names(),
                       delays=delays, options=dict({"role_regs": role_budgets(man)}, **(options or {})))
        emu.param_sizes = launch.sizes
        emu.trace = trace
        emu.run(step_limit, progress=progress)
    except Fault as f:
        res.warp_instructions = emu.total_steps if "emu" in locals() else 0
        res.coverage = run_coverage(man, emu) if "emu" in locals() else None
        res.kind = "fault"
        res.finding = f.kind
        role = f" [{role_of(man, f.warp)}]" if f.warp is not None else ""
        res.report = f"{f}{role}"
        res.seconds = time.perf_counter() - t0
        return res
    res.warp_instructions = emu.total_steps
    res.coverage = run_coverage(man, emu)
    res.seconds = time.perf_counter() - t0
    o, lse = launch.output()
    res.o, res.lse = o, lse
    if varlen:
        res.ok, res.report, res.max_err = judge_varlen(o, lse, q, k, v, cfg, launch.scale, shape, launch.mods)
    else:
        res.ok, res.report, res.max_err = judge(o, lse, q, k, v, cfg, launch.scale, launch.mods)
    res.kind = "ok" if res.ok else "mismatch"
    res.finding = "" if res.ok else "mismatch"
    if not res.ok and not varlen:
        res.report += "\n" + _writer_report(emu, man, o, q, k, v, cfg, launch.scale, launch.mods)
    if emu.findings:
        uniq = list({str(f): f for f in emu.findings}.values())
        extra = "\n".join(f"{f}" + (f" [{role_of(man, f.warp)}]" if f.warp is not None else "") for f in uniq)
        res.report = (extra + ("\n" + res.report if res.report else "")).strip()
        if res.ok:
            res.kind = "fault"
            res.finding = emu.findings[0].kind
        res.ok = False
    return res


def _describe_writer(emu, man, entry) -> str:
    if entry is None:
        return "never written"
    kind, warp, line = entry[:3]
    text = f"{kind} at PTX line {line} (warp {warp}, {role_of(man, warp)})"
    if len(entry) > 3:
        text += " from SMEM " + ("written by " + _describe_writer(emu, man, entry[3]) if entry[3] else "never written by a thread")
    return text


def _writer_report(emu, man, o, q, k, v, cfg, scale, mods=None) -> str:
    mods = mods or {}
    o_ref, _ = reference.attention_exact(q, k, v, bool(cfg["causal"]), scale, **mods)
    pv = _pv_abs(q, k, v, bool(cfg["causal"]), scale, **mods)
    g = q.shape[2] // k.shape[2]
    vsum = np.repeat(np.abs(v.astype(np.float64)).sum(axis=1), g, axis=1)[:, None]
    bad = np.isnan(o) | (np.abs(o - o_ref) > tolerance(o_ref, pv, vsum, cfg["dtype"],
                                                        softcap_score_err(mods.get("softcap", 0.0))))
    if not bad.any():
        return ""
    flat = int(np.flatnonzero(bad.reshape(-1))[0])
    gw = emu.gwriter.get("o")
    wid = int(gw[2 * flat]) if gw is not None else -1
    return "  the first bad element was written by " + (_describe_writer(emu, man, emu.writers[wid]) if wid >= 0 else "nothing")




def judge_varlen(o, lse, q, k, v, cfg, scale, shape: VarShape, mods: dict | None = None):
    """judge() per sequence on its own rows (a dense batch of one), keys capped by seqused_k; every
    row of o and lse belongs to exactly one sequence, so an unwritten or stray row shows up there.
    mods: the score modifiers' values (a window is per sequence: its own Sq, Skv)."""
    msgs, worst = [], 0.0
    q0 = k0 = 0
    for i, (lq, lk, uk) in enumerate(zip(shape.lens_q, shape.lens_k, shape.used_k)):
        if lq:
            sl = slice(q0, q0 + lq)
            ok, rep_, err = judge(o[None, sl], None if lse is None else lse[None, :, sl], q[None, sl],
                                  k[None, k0:k0 + uk], v[None, k0:k0 + uk], cfg, scale, mods)
            worst = max(worst, err)
            if not ok:
                msgs.append(f"sequence {i} (rows {q0}-{q0 + lq - 1}, {lq} queries, {uk} keys):")
                msgs.extend("  " + ln for ln in rep_.splitlines())
        q0, k0 = q0 + lq, k0 + lk
    return (not msgs), "\n".join(msgs), worst


def emulate_file(ptx_path, manifest_path=None, *, shapes=None, seeds=2, ctas: int = 2, step_limit=30_000_000,
                 progress=None, ptx_text: str | None = None, manifest: dict | None = None, seed0: int = 0,
                 stop_on_failure: bool = False) -> EmulateReport:
    """Run the PTX file as it is on disk (or `ptx_text`), each seed on each shape (stop_on_failure:
    the runs end with the first that fails; the corpus tests need one finding, not all)."""
    ptx_path = Path(ptx_path)
    if ptx_text is None:
        if not ptx_path.exists():
            raise UsageError(f"{ptx_path}: no such file")
        ptx_text = ptx_path.read_text()
    man = manifest if manifest is not None else load_manifest(ptx_path, Path(manifest_path) if manifest_path else None)
    mod = parse_for_manifest(ptx_text, man)  # PtxSyntaxError / UnsupportedInstruction propagate to the caller
    shapes = shapes or default_shapes(man)
    rep = EmulateReport(True, str(ptx_path))
    for shape in shapes:
        for s in range(seeds):
            r = run_once(ptx_text, man, shape, seed0 + s, ctas=ctas, step_limit=step_limit, mod=mod, progress=progress)
            rep.runs.append(r)
            rep.ok &= r.ok
            if stop_on_failure and not r.ok:
                return rep
    return rep
