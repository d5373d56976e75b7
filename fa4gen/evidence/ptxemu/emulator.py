"""The emulator of one launch: a parsed module compiled into ops (the synchronous instructions of
ops.py, the asynchronous ones of async_units.py), its parameters and global memory, and the CTAs
of machine.py, two resident at a time and interleaved (Emulator._run). Above ops, async_units and machine, which never import it.
"""
from __future__ import annotations

import numpy as np

from . import async_units as au, fp
from .machine import CTA, Fault, GlobalMemory, Op
from .ops import (Ctx, _regnames, compile_alu, compile_bar, compile_cvt, compile_fence, compile_griddepcontrol, compile_atom, compile_ld_st,
                  compile_mbarrier, compile_setmaxnreg, compile_setp, compile_warp_coll, init_registers, reader,
                  unsupported, writer)
from .parse import Module, Sym, UnsupportedInstruction


# ---- the compiled program: one op per instruction -----------------------------------------------
def compile_instr(ctx: Ctx, ins) -> Op:
    parts = ins.parts
    head = parts[0]
    srcs, dsts = (), ()
    ops_ = ins.operands
    if ops_:
        first = ops_[0]
        writes_first = head not in ("st", "bar", "barrier", "mbarrier", "cp", "prefetch", "tcgen05", "bra",
                                    "setmaxnreg", "wgmma", "fence")
        if head == "mbarrier" and parts[1] in ("try_wait", "test_wait"):
            writes_first = True
        if head == "tcgen05" and parts[1] == "ld":
            writes_first = False  # async destination: poisoned, handled by the unit
        if head == "wgmma" and parts[1] == "mma_async":
            # chained accumulators are allowed between wgmma ops of one shape: the unit checks them
            srcs = tuple(n for o in ops_[1:] for n in _regnames(o))
        elif writes_first:
            dsts = _regnames(first)
            srcs = tuple(n for o in ops_[1:] for n in _regnames(o))
        else:
            srcs = tuple(n for o in ops_ for n in _regnames(o))
    if ins.guard:
        srcs = srcs + (ins.guard,)
    aligned = "aligned" in parts
    guard_pred = ins.guard is not None and ctx.mod.regs.get(ins.guard) == ".pred"
    if head == "bra":
        if len(ops_) != 1 or not isinstance(ops_[0], Sym):
            raise unsupported(ins, "bra needs one label")
        tgt = ctx.mod.labels.get(ops_[0].name)
        if tgt is None:
            raise UnsupportedInstruction(f"bra to an undefined label {ops_[0].name} at line {ins.line}")
        return Op(ins, None, "bra", tgt, uni="uni" in parts, srcs=srcs, guard_pred=guard_pred)
    if head in ("ret", "exit"):
        return Op(ins, None, "ret", guard_pred=guard_pred)
    if head == "setp":
        fn = compile_setp(ctx, ins, parts)
    elif head == "cvt":
        fn = compile_cvt(ctx, ins, parts)
    elif head == "cvta":
        a = reader(ctx, ops_[1], parts[-1], ins)
        d = writer(ctx, ops_[0], parts[-1], ins)
        fn = lambda w, m: d(w, a(w), m)  # noqa: E731  (param/shared windows map 1:1 into generic)
    elif head in ("ld", "st"):
        fn = compile_ld_st(ctx, ins, parts)
    elif head == "atom":
        fn = compile_atom(ctx, ins, parts)
    elif head == "mbarrier":
        fn = compile_mbarrier(ctx, ins, parts)
    elif head == "bar" or (head == "barrier" and len(parts) > 1):
        fn = compile_bar(ctx, ins, parts)
    elif head in ("elect", "vote", "shfl"):
        fn = compile_warp_coll(ctx, ins, parts)
    elif head == "setmaxnreg":
        fn = compile_setmaxnreg(ctx, ins, parts)
    elif head == "fence":
        fn = compile_fence(ctx, ins, parts)
    elif head == "griddepcontrol":
        fn = compile_griddepcontrol(ctx, ins, parts)
    elif head in ("tcgen05", "cp", "prefetch", "wgmma"):
        fn = au.compile_async(ctx, ins, parts)
    elif head in ("mov", "add", "sub", "mul", "mad", "fma", "max", "min", "neg", "abs", "div", "rem", "rcp",
                  "ex2", "lg2", "tanh", "sqrt", "and", "or", "xor", "not", "shl", "shr", "selp"):
        fn = compile_alu(ctx, ins, parts)
    else:
        raise unsupported(ins)
    return Op(ins, fn, "alu", aligned=aligned, srcs=srcs, dsts=dsts, guard_pred=guard_pred,
              plain=ins.guard is None)


def compile_program(emu) -> list:
    ctx = Ctx(emu)
    return [compile_instr(ctx, ins) for ins in emu.mod.instrs]


# ---- the emulator: a module, a launch, the compiled program -------------------------------------
class Emulator:
    def __init__(self, mod: Module, *, arch: str, nthreads: int, nctas: int, dyn_smem: int, params: bytes,
                 param_offsets: dict, gmem: "GlobalMemory", seed: int, entry_regs: int | None,
                 barrier_names: dict | None = None, delays: dict | None = None, options: dict | None = None):
        self.mod, self.arch = mod, arch
        self.nthreads, self.nctas, self.dyn_smem = nthreads, nctas, dyn_smem
        self.params, self.param_offsets = params, param_offsets
        self.gmem, self.seed = gmem, seed
        self.entry_regs = entry_regs
        self._bar_names = barrier_names or {}
        self.delays = dict(DEFAULT_DELAYS, **(delays or {}))
        self.options = dict(options or {})
        self.param_sizes = {p.name: p.size for p in mod.params}
        # The compiled program depends on the module, the parameter layout, the delays and the options,
        # never on a launch's values (ld.param reads them when it runs; every runtime closure reaches
        # the launch through w.cta.emu): the runs of one parsed module share it.
        key = (tuple(sorted(param_offsets.items())), tuple(sorted(self.delays.items())), repr(sorted(self.options.items())))
        self.prog = mod.programs.get(key)
        if self.prog is None:
            self.prog = mod.programs[key] = compile_program(self)
        self.reg_init = init_registers(mod)
        nwarps = (nthreads + 31) // 32  # coverage records, per warp over every CTA (coverage.py reads them)
        self.hits = [bytearray(len(self.prog)) for _ in range(nwarps)]
        self.dirs = [bytearray(len(self.prog)) for _ in range(nwarps)]
        self.total_steps = 0
        self.findings: list = []  # faults that do not stop the run (TMEM dealloc/leak): still failures
        self.writers: list = []  # (kind, warp, line[, via]) for reports: who wrote an output byte
        self._writer_idx: dict = {}
        self.gwriter: dict = {}  # allocation name -> int32 writer id per byte
        self.gwrites: dict = {}  # allocation name -> writes per byte (an output is written once)
        self.gcta: dict = {}
        self.tma_loads: list | None = None  # a list: every TMA load's (tensor-map parameter, coordinates) appended
        self.trace = None  # a trace.Recorder: every CTA's issue bursts, waits and async operations recorded
        self.live_ctas = 2  # CTAs resident at once, interleaved (_run)
        if mod.maxntid is not None and nthreads > mod.maxntid:
            raise Fault("LAUNCH", f"{nthreads} threads per CTA exceed .maxntid {mod.maxntid}")

    def writer_id(self, entry: tuple) -> int:
        i = self._writer_idx.get(entry)
        if i is None:
            i = self._writer_idx[entry] = len(self.writers)
            self.writers.append(entry)
        return i

    def mark_gmem(self, name: str, buf_size: int, byte_idx: np.ndarray, wid: np.ndarray | int, cta: int = -1) -> None:
        arr = self.gwriter.get(name)
        if arr is None:
            arr = self.gwriter[name] = np.full(buf_size, -1, np.int32)
            self.gwrites[name] = np.zeros(buf_size, np.uint8)
            self.gcta[name] = np.full(buf_size, -1, np.int32)
        arr[byte_idx] = wid
        idx = np.asarray(byte_idx).reshape(-1)
        cnt = self.gwrites[name]
        again = idx[cnt[idx] > 0]
        if again.size and len(self.findings) < 8:
            b = int(again[0])
            self.findings.append(Fault("WRITTEN_TWICE", f"output {name} byte {b} written again (first by CTA "
                                                        f"{int(self.gcta[name][b])}, now CTA {cta}): two tasks "
                                                        "computed the same tile, a write race on a GPU"))
        cnt[idx] = np.minimum(cnt[idx].astype(np.int32) + 1, 255).astype(np.uint8)
        self.gcta[name][idx] = cta

    def barrier_name(self, addr: int) -> str:
        return self._bar_names.get(addr, f"mbarrier@{addr:#x}")

    def run(self, step_limit: int = 20_000_000, ctas=None, progress=None) -> None:
        with fp.quiet():  # NumPy's floating-point warnings off once for the run (fp.py says why)
            self._run(step_limit, ctas, progress)

    def _run(self, step_limit, ctas, progress) -> None:
        """Up to `live_ctas` CTAs resident at once (SMs), taken in order as earlier ones finish; the
        resident ones advance a seeded random number of issue bursts at a time, interleaved, so that
        CTAs that share global memory (a dynamic deal's task counter) meet as they would on a GPU."""
        waiting = list(range(self.nctas) if ctas is None else ctas)
        waiting.reverse()
        live: list = []
        rng = np.random.default_rng([self.seed, 0x5EED])
        while waiting or live:
            while waiting and len(live) < max(self.live_ctas, 1):
                live.append(CTA(self, waiting.pop()))
            cta = live[int(rng.integers(len(live)))] if len(live) > 1 else live[0]
            before = cta.steps
            try:
                done = cta.run(step_limit, bursts=int(rng.integers(1, 64)) if len(live) > 1 or waiting else None)
            except Fault as f:
                f.cta = cta.ctaid
                f.args = (f"CTA {cta.ctaid}: {f.args[0]}",)
                self.total_steps += cta.steps - before
                raise
            self.total_steps += cta.steps - before
            if done:
                live.remove(cta)
                if progress:
                    progress(cta.ctaid, cta)


DEFAULT_DELAYS = {
    "tma": (150, 2500), "mma": (20, 400), "commit": (1, 60), "tmem": (2, 200), "bulk_store": (150, 2500),
    "wgmma": (20, 400),
}


