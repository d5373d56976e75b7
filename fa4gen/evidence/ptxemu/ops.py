"""PTX instruction semantics: each instruction compiled once into a closure over lane vectors.

An instruction outside the modelled subset raises UnsupportedInstruction("unsupported instruction X
at line N") when the program is compiled, before anything runs.
"""
from __future__ import annotations

import re

import numpy as np

from . import fp
from .machine import (_DT, _STORE, _WIDTH, PARAM_BASE, REGS_PER_SM, SMEM_BASE, WARP, Block, Fault, MBar, NamedBar, _cnz,
                      _join)
from .coverage import BOUNDARY, ORDERED
from .parse import Addr, FImm, Imm, PredPair, Reg, Sink, SReg, Sym, TmaAddr, UnsupportedInstruction, Vec

_U32, _S32, _F32, _U64 = np.uint32, np.int32, np.float32, np.uint64
_ZERO = {np.bool_: np.zeros(WARP, np.bool_), np.uint16: np.zeros(WARP, np.uint16),
         np.uint32: np.zeros(WARP, np.uint32), np.uint64: np.zeros(WARP, np.uint64)}
for _z in _ZERO.values():
    _z.flags.writeable = False


_LANES = (WARP,)


def _bcast(x):
    """x as a read-only lane vector: itself when it is one already (a register's value, the common
    case), else np.broadcast_to's view of a scalar (an immediate, a uniform value)."""
    if getattr(x, "shape", None) == _LANES:
        return x
    return np.broadcast_to(x, _LANES)


def unsupported(ins, why=""):
    return UnsupportedInstruction(f"unsupported instruction {ins.opcode} at line {ins.line}"
                                  + (f": {why}" if why else ""))


class Ctx:
    """Compile-time context: the module and the launch facts instructions need."""

    def __init__(self, emu):
        self.emu = emu
        self.mod = emu.mod
        self.regs = emu.mod.regs
        self._pcs = None

    def pc_of(self, ins) -> int:
        """The instruction's index in the entry (its slot in the per-warp coverage records)."""
        if self._pcs is None:
            self._pcs = {id(x): i for i, x in enumerate(self.mod.instrs)}
        return self._pcs[id(ins)]

    def reg_type(self, name, ins):
        t = self.regs.get(name.lstrip("!"))
        if t is None:
            raise UnsupportedInstruction(f"register {name} is not declared (line {ins.line})")
        return t[1:]


# ---- operand access -------------------------------------------------------------------------------
def _const(value, t):
    dt = _DT[t]
    if t == "pred":
        return np.bool_(bool(value))
    if np.issubdtype(dt, np.floating):
        return dt(value)
    bits = np.dtype(dt).itemsize * 8
    v = int(value) & ((1 << bits) - 1)
    return np.array(v, dtype=np.dtype(f"u{bits // 8}")).view(dt)[()]


def reader(ctx: Ctx, o, t: str, ins):
    """fn(w) -> lane vector (or NumPy scalar) of type t."""
    dt = _DT[t]
    if isinstance(o, Reg):
        neg = o.name.startswith("!")
        name = o.name.lstrip("!")
        rt = ctx.reg_type(name, ins)
        if _WIDTH[rt] != _WIDTH.get(t, -1) and not (t in ("u8", "s8", "b8")):
            raise unsupported(ins, f"register {name} is .{rt}, the instruction reads .{t}")
        if neg:
            if t != "pred":
                raise unsupported(ins, "! on a non-predicate operand")
            return lambda w: ~w.regs[name]
        ddt = np.dtype(dt)

        def read(w):  # the register's bits as type t: itself when it holds a type-t vector (writer says why)
            v = w.regs[name]
            return v if v.dtype is ddt else v.view(dt)
        return read
    if isinstance(o, Imm):
        c = _const(o.value, t)
        return lambda w: c
    if isinstance(o, FImm):
        if t == "f32":
            c = np.array(o.bits, dtype=_U32).view(_F32)[()]
        elif _WIDTH.get(t) == 4:
            c = _const(o.bits, t)
        else:
            raise unsupported(ins, f"float immediate for .{t}")
        return lambda w: c
    if isinstance(o, SReg):
        name = o.name
        if dt == _U32:
            return lambda w: w.sregs[name]
        if dt == _S32:
            return lambda w: w.sregs[name].view(_S32)
        if dt == _U64:
            return lambda w: w.sregs[name].astype(_U64)
        raise unsupported(ins, f"special register {name} as .{t}")
    if isinstance(o, Sym):
        if o.name in ctx.mod.shared_symbols:
            c = _const(SMEM_BASE, t)
            return lambda w: c
        if o.name in ctx.emu.param_offsets:
            c = _const(PARAM_BASE + ctx.emu.param_offsets[o.name], t)
            return lambda w: c
        raise unsupported(ins, f"symbol {o.name} is neither a parameter nor a shared symbol")
    raise unsupported(ins, f"operand {o!r}")


def writer(ctx: Ctx, o, t: str, ins):
    """fn(w, value, m) storing a type-t value (lanes in m, or all when m is None)."""
    if isinstance(o, Sink):
        return lambda w, v, m: None
    if not isinstance(o, Reg):
        raise unsupported(ins, f"destination {o!r} is not a register")
    name = o.name
    rt = ctx.reg_type(name, ins)
    if _WIDTH[rt] != _WIDTH.get(t, -1):
        raise unsupported(ins, f"register {name} is .{rt}, the instruction writes .{t}")
    dt = _DT[t]
    ddt = np.dtype(dt)  # the dtype object of a lane vector of type t (compared by identity: ~4x cheaper)

    # A register holds the lane vector as it was written, in the writer's type (of the declared width):
    # an f32 result stays an f32 vector, and the next f32 read takes it as it is. A read in another
    # type of that width views the same bits (reader), so no view is made per write and per read of
    # the common case; bits never change (np.where and views copy or share them unchanged).
    def store(w, v, m):
        if type(v) is not np.ndarray or v.dtype is not ddt or v.shape != _LANES:  # else: a lane vector already
            v = np.asarray(v, dtype=dt)
            if v.shape != _LANES:
                v = np.full(WARP, v, dt)
        if m is None:
            w.regs[name] = v
        else:
            old = w.regs[name]
            w.regs[name] = np.where(m, v, old if old.dtype is ddt else old.view(dt))
    return store


def _regnames(o):
    if isinstance(o, Reg):
        return (o.name.lstrip("!"),)
    if isinstance(o, Vec):
        return tuple(n for it in o.items for n in _regnames(it))
    if isinstance(o, Addr) and isinstance(o.base, Reg):
        return (o.base.name,)
    if isinstance(o, TmaAddr):
        return _regnames(o.tmap) + tuple(n for c in o.coords for n in _regnames(c))
    if isinstance(o, PredPair):
        return _regnames(o.first) + _regnames(o.pred)
    return ()


def addr_reader(ctx, o: Addr, ins, t="u32"):
    """Per-lane int64 byte address of [base+off]."""
    if not isinstance(o, Addr):
        raise unsupported(ins, f"expected an address, got {o!r}")
    off = o.offset
    if o.base is None:
        return lambda w: np.full(WARP, off, np.int64)
    base = reader(ctx, o.base, t, ins)

    def f(w):
        b = base(w)
        return np.asarray(b, np.int64) + off if np.ndim(b) else np.full(WARP, int(b) + off, np.int64)
    return f


_ALL_LANES = np.arange(WARP)
_ALL_LANES.flags.writeable = False


def _lanes(m):
    """The executing lanes' indices (a shared read-only vector when all 32 execute)."""
    return _ALL_LANES if m is None else np.flatnonzero(m)


def _mask(m):
    return np.ones(WARP, bool) if m is None else m


# ---- ALU --------------------------------------------------------------------------------------------
_CMP_INT = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}


def _cmp_float(c, a, b):
    nan = np.isnan(a) | np.isnan(b)
    base = c.rstrip("u") if c not in ("num", "nan") else c
    if c == "num":
        return ~nan
    if c == "nan":
        return nan
    r = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
         "ge": np.greater_equal}[base](a, b)
    if c.endswith("u") and c != "num":
        return r | nan
    return r & ~nan


def _int_info(t):
    return np.dtype(_DT[t])


def compile_alu(ctx, ins, parts):
    head = parts[0]
    mods = parts[1:]
    ops_ = ins.operands
    t = mods[-1] if mods else None
    R = lambda i, tt=None: reader(ctx, ops_[i], tt or t, ins)  # noqa: E731
    Wr = lambda i, tt=None: writer(ctx, ops_[i], tt or t, ins)  # noqa: E731
    rnd = next((x for x in mods if x in ("rn", "rz", "rm", "rp")), "rn")
    ftz = "ftz" in mods
    sat = "sat" in mods
    isf = t == "f32"

    def sat_(x):
        return np.clip(np.nan_to_num(x, nan=0.0), 0, 1).astype(_F32) if sat else x

    if head == "mov":
        if t not in _DT:
            raise unsupported(ins)
        if isinstance(ops_[0], Vec) or isinstance(ops_[1], Vec):
            return _compile_mov_vec(ctx, ins, t)
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, a(w), m)
    if t == "f32x2":
        return _compile_f32x2(ctx, ins, head, mods, rnd, ftz)
    if head in ("add", "sub") and isf:
        a, b, d = R(1), R(2), Wr(0)
        if head == "add":
            return lambda w, m: d(w, sat_(fp.add(a(w), b(w), rnd, ftz)), m)
        return lambda w, m: d(w, sat_(fp.add(a(w), -np.asarray(b(w), _F32), rnd, ftz)), m)
    if head == "mul" and isf:
        a, b, d = R(1), R(2), Wr(0)
        return lambda w, m: d(w, sat_(fp.mul(a(w), b(w), rnd, ftz)), m)
    if head in ("fma", "mad") and isf:
        a, b, c, d = R(1), R(2), R(3), Wr(0)
        return lambda w, m: d(w, sat_(fp.fma(a(w), b(w), c(w), rnd, ftz)), m)
    if head in ("max", "min") and isf and len(ops_) == 4:
        # three-input form (PTX ISA 8.8, sm_100a: FMNMX3): max(max(a, b), c), NaN loses like the two-input op
        a, b, c, d = R(1), R(2), R(3), Wr(0)
        f = np.fmax if head == "max" else np.fmin
        fl = fp.ftz if ftz else (lambda x: x)
        return lambda w, m: d(w, f(f(fl(np.asarray(a(w), _F32)), fl(np.asarray(b(w), _F32))),
                                   fl(np.asarray(c(w), _F32))), m)
    if head in ("max", "min") and isf:
        a, b, d = R(1), R(2), Wr(0)
        f = np.fmax if head == "max" else np.fmin
        if ftz:
            return lambda w, m: d(w, f(fp.ftz(np.asarray(a(w), _F32)), fp.ftz(np.asarray(b(w), _F32))), m)
        return lambda w, m: d(w, f(a(w), b(w)), m)
    if head == "neg" and isf:
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, -np.asarray(a(w), _F32), m)
    if head == "abs" and isf:
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, np.abs(np.asarray(a(w), _F32)), m)
    if head == "div" and isf:
        a, b, d = R(1), R(2), Wr(0)
        return lambda w, m: d(w, fp.div(a(w), b(w), rnd, ftz), m)
    if head == "rcp" and isf:
        a, d = R(1), Wr(0)
        approx = "approx" in mods
        return lambda w, m: d(w, fp.rcp(a(w), approx, ftz, rnd), m)
    if head == "ex2" and isf:
        a, d = R(1), Wr(0)
        noise = int(ctx.emu.options.get("ex2_noise_ulp", 0))
        if noise:  # sensitivity experiments only: ex2.approx off by up to `noise` ulp, seeded per CTA
            def fn(w, m):
                r = fp.ex2_approx(a(w), ftz)
                jitter = w.cta.rng.integers(-noise, noise + 1, WARP).astype(np.int64)
                bits = np.where(r > 0, r.view(np.uint32).astype(np.int64) + jitter, r.view(np.uint32))
                d(w, bits.astype(np.uint32).view(_F32), m)
            return fn
        return lambda w, m: d(w, fp.ex2_approx(a(w), ftz), m)
    if head == "tanh" and isf:  # tanh.approx.f32: fp.tanh_approx (correctly rounded, not the MUFU's bits)
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, fp.tanh_approx(a(w)), m)
    if head == "lg2" and isf:
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, fp.lg2_approx(a(w), ftz), m)
    if head == "sqrt" and isf:
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, np.sqrt(np.asarray(a(w), _F32).astype(np.float64)).astype(_F32), m)
    if isf:
        raise unsupported(ins)
    # integer / bit ops
    if t in ("pred",) and head in ("and", "or", "xor", "not"):
        if head == "not":
            a, d = R(1), Wr(0)
            return lambda w, m: d(w, ~np.asarray(a(w), bool), m)
        a, b, d = R(1), R(2), Wr(0)
        f = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[head]
        return lambda w, m: d(w, f(a(w), b(w)), m)
    if t not in _DT:
        raise unsupported(ins)
    if head in ("add", "sub", "and", "or", "xor", "min", "max"):
        a, b, d = R(1), R(2), Wr(0)
        f = {"add": np.add, "sub": np.subtract, "and": np.bitwise_and, "or": np.bitwise_or,
             "xor": np.bitwise_xor, "min": np.minimum, "max": np.maximum}[head]
        dt = _DT[t]

        def fn(w, m):
            with fp._ignore(over="ignore"):
                d(w, f(a(w), b(w)).astype(dt, copy=False), m)
        return fn
    if head == "not":
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, np.invert(a(w)), m)
    if head == "neg":
        a, d = R(1), Wr(0)
        return lambda w, m: d(w, (np.zeros((), _DT[t]) - a(w)), m)
    if head == "mul" and "wide" in mods:
        wt = {"u32": "u64", "s32": "s64", "u16": "u32", "s16": "s32"}[t]
        a, b, d = R(1), R(2), Wr(0, wt)
        wdt = _DT[wt]
        return lambda w, m: d(w, np.asarray(a(w)).astype(wdt) * np.asarray(b(w)).astype(wdt), m)
    if head == "mul" and "lo" in mods:
        a, b, d = R(1), R(2), Wr(0)
        return lambda w, m: d(w, np.multiply(a(w), b(w), dtype=_DT[t]), m)
    if head == "mad" and "lo" in mods:
        a, b, c, d = R(1), R(2), R(3), Wr(0)
        dt = _DT[t]
        return lambda w, m: d(w, (np.multiply(a(w), b(w), dtype=dt) + c(w)).astype(dt, copy=False), m)
    if head in ("div", "rem"):
        a, b, d = R(1), R(2), Wr(0)
        signed = t.startswith("s")

        def fn(w, m):
            av, bv = _bcast(a(w)), _bcast(b(w))
            mm = _mask(m)
            if (bv[mm] == 0).any():
                lane = int(np.flatnonzero(mm & (bv == 0))[0])
                raise Fault("DIV_ZERO", f"{ins.opcode} by zero", line=ins.line, warp=w.wid, lane=lane, text=ins.text)
            bs = np.where(bv == 0, 1, bv).astype(bv.dtype)
            if signed:
                q = (np.abs(av.astype(np.int64)) // np.abs(bs.astype(np.int64))) * np.sign(av.astype(np.int64)) * np.sign(bs.astype(np.int64))
                r = av.astype(np.int64) - q * bs.astype(np.int64)
                res = (q if head == "div" else r).astype(av.dtype)
            else:
                res = av // bs if head == "div" else av % bs
            d(w, res, m)
        return fn
    if head in ("shl", "shr"):
        a, b, d = R(1), R(2, "u32"), Wr(0)
        dt = _DT[t]
        bits = np.dtype(dt).itemsize * 8
        signed = t.startswith("s")

        def fn(w, m):
            av = np.asarray(a(w), dt)
            bv = np.asarray(b(w), np.int64)
            big = bv >= bits
            sh = np.minimum(bv, bits - 1).astype(dt if not signed else np.dtype(f"u{np.dtype(dt).itemsize}"))
            if head == "shl":
                r = np.left_shift(av, sh.astype(av.dtype) if av.dtype.kind == "u" else sh.astype(av.dtype))
                r = np.where(big, np.zeros((), dt), r)
            else:
                r = np.right_shift(av, sh.astype(av.dtype))
                if big.any():
                    fill = np.where(av < 0, -1, 0).astype(dt) if signed else np.zeros((), dt)
                    r = np.where(big, fill, r)
            d(w, np.asarray(r, dt), m)
        return fn
    if head == "selp":
        a, b, c, d = R(1), R(2), reader(ctx, ops_[3], "pred", ins), Wr(0)
        return lambda w, m: d(w, np.where(c(w), a(w), b(w)), m)
    raise unsupported(ins)


def _compile_mov_vec(ctx, ins, t):
    """``mov.b64 %rd, {%lo, %hi}`` packs two 32-bit registers (the first is bits 0-31: PTX ISA, Data
    Movement Instructions: mov); ``mov.b64 {%lo, %hi}, %rd`` unpacks. Only the b64 <- 2 x b32 shape."""
    ops_ = ins.operands
    if t not in ("b64", "u64", "s64"):
        raise unsupported(ins, "vector mov other than .b64 <-> {b32, b32}")
    vec_dst = isinstance(ops_[0], Vec)
    vec = ops_[0] if vec_dst else ops_[1]
    if len(vec.items) != 2 or not all(isinstance(i, (Reg, Sink)) for i in vec.items):
        raise unsupported(ins, "vector mov needs two registers")
    if vec_dst:
        a = reader(ctx, ops_[1], "b64", ins)
        lo, hi = (writer(ctx, it, "b32", ins) for it in vec.items)

        def fn(w, m):
            # the .b64 lanes as (low, high) .b32 pairs (little-endian), each half copied out
            x = a(w)
            if type(x) is np.ndarray and x.shape == _LANES and x.flags.c_contiguous:  # a register's lanes
                v = x.view(_U32)
                lo(w, v[0::2].copy(), m)
                hi(w, v[1::2].copy(), m)
                return
            v = np.ascontiguousarray(_bcast(np.asarray(x, _U64))).view(_U32).reshape(WARP, 2)
            lo(w, v[:, 0].copy(), m)
            hi(w, v[:, 1].copy(), m)
        return fn
    lo, hi = (reader(ctx, it, "b32", ins) for it in vec.items)
    d = writer(ctx, ops_[0], "b64", ins)

    def pack(w, m):
        v = np.empty(2 * WARP, _U32)  # (low, high) pairs: the .b64 lanes, little-endian
        v[0::2], v[1::2] = lo(w), hi(w)
        d(w, v.view(_U64), m)
    return pack


def _compile_f32x2(ctx, ins, head, mods, rnd, ftz):
    """Packed fp32 (``add/sub/mul/fma.rnd{.ftz}.f32x2``, sm_100a): the .b64 operands hold two f32,
    element 0 in bits 0-31; each element is computed and rounded exactly as the scalar .f32 op
    (PTX ISA, Floating Point Instructions: add, sub, mul, fma). fma and the rounding modes other
    than rn need the explicit .rnd, as the ISA requires for fma."""
    if head not in ("add", "sub", "mul", "fma") or "sat" in mods:
        raise unsupported(ins, ".f32x2 is modelled for add/sub/mul/fma without .sat")
    if head == "fma" and not any(x in mods for x in ("rn", "rz", "rm", "rp")):
        raise unsupported(ins, "fma.f32x2 needs a rounding modifier")
    n = 3 if head == "fma" else 2
    srcs = [reader(ctx, o, "b64", ins) for o in ins.operands[1:1 + n]]
    d = writer(ctx, ins.operands[0], "b64", ins)

    # Both elements of every lane in one call of the (element-wise) fp helper: the .b64 lane vector
    # viewed as 64 f32, lane i's element 0 at 2i and element 1 at 2i + 1 (little-endian), and the 64
    # results viewed back as 32 .b64 lanes. The same values as two calls on the halves, at half the cost.
    def pairs(v):
        v = np.asarray(v, _U64)
        if v.shape != _LANES or not v.flags.c_contiguous:
            v = np.ascontiguousarray(np.broadcast_to(v, _LANES))
        return v.view(_F32)

    def one(x):
        if head == "add":
            return fp.add(x[0], x[1], rnd, ftz)
        if head == "sub":
            return fp.add(x[0], -x[1], rnd, ftz)
        if head == "mul":
            return fp.mul(x[0], x[1], rnd, ftz)
        return fp.fma(x[0], x[1], x[2], rnd, ftz)

    def fn(w, m):
        r = np.ascontiguousarray(one([pairs(s(w)) for s in srcs]), _F32)
        d(w, r.view(_U64), m)
    return fn


def compile_setp(ctx, ins, parts):
    # setp.CmpOp[.BoolOp][.ftz].type  p[|q], a, b[, {!}c]
    mods = parts[1:]
    cmp_ = mods[0]
    t = mods[-1]
    boolop = next((x for x in mods[1:-1] if x in ("and", "or", "xor")), None)
    ops_ = ins.operands
    dst = ops_[0]
    q = None
    if isinstance(dst, PredPair):
        dst, q = dst.first, dst.pred
    a, b = reader(ctx, ops_[1], t, ins), reader(ctx, ops_[2], t, ins)
    c = reader(ctx, ops_[3], "pred", ins) if boolop else None
    dp = writer(ctx, dst, "pred", ins)
    dq = writer(ctx, q, "pred", ins) if q is not None else None
    isf = t in ("f32", "f64", "f16")
    if not isf and cmp_ not in _CMP_INT:
        raise unsupported(ins)
    comb = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}.get(boolop)
    # coverage: an ordered integer comparison met at its boundary (a == b on a lane that runs it), the
    # one input where lt and le (or a bound off by one) differ
    edge = ctx.pc_of(ins) if not isf and cmp_ in ORDERED else None

    def fn(w, m):
        av, bv = a(w), b(w)
        if edge is not None:
            seen = w.cta.bdirs[w.wid]
            if not seen[edge] & BOUNDARY:
                eq = np.asarray(av) == np.asarray(bv)
                if (eq if m is None else eq & m).any():
                    seen[edge] |= BOUNDARY
        r = _cmp_float(cmp_, np.asarray(av), np.asarray(bv)) if isf else _CMP_INT[cmp_](av, bv)
        r = _bcast(r)
        if comb is not None:
            cv = c(w)
            dp(w, comb(r, cv), m)
            if dq is not None:
                dq(w, comb(~r, cv), m)
        else:
            dp(w, r, m)
            if dq is not None:
                dq(w, ~r, m)
    return fn


def compile_cvt(ctx, ins, parts):
    mods = parts[1:]
    rnd = next((x for x in mods if x in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")), None)
    types = [x for x in mods if x in _DT or x in ("f64",)]
    if len(types) != 2:
        raise unsupported(ins)
    dt_, st_ = types
    ops_ = ins.operands
    if dt_ in ("bf16x2", "f16x2"):
        if st_ != "f32" or len(ops_) != 3:
            raise unsupported(ins)
        a, b = reader(ctx, ops_[1], "f32", ins), reader(ctx, ops_[2], "f32", ins)
        d = writer(ctx, ops_[0], "b32", ins)
        conv = fp.f32_to_bf16_bits if dt_ == "bf16x2" else fp.f32_to_f16_bits
        mode = rnd or "rn"
        if dt_ == "bf16x2" and mode == "rn":
            def fn(w, m):
                x = np.empty(2 * WARP, _F32)  # lane i's low half (b) at 2i, its high half (a) at 2i + 1
                x[0::2], x[1::2] = b(w), a(w)
                if _cnz(x != x):  # a NaN: the general conversion (its quiet-NaN bits)
                    d(w, np.ascontiguousarray(conv(x, mode), np.uint16).view(_U32), m)
                    return
                # fp.f32_to_bf16_bits' rounding to nearest even at bit 16; the high 16 bits of each
                # f32 are its bf16, so the 64 high halves viewed as 32 .b32 lanes are the packed pairs
                bits = x.view(_U32)
                r = (bits + 0x7FFF) + ((bits >> 16) & 1)
                d(w, r.view(np.uint16)[1::2].copy().view(_U32), m)
            return fn

        def fn(w, m):
            # one conversion of both sources: lane i's low half (b) at 2i, its high half (a) at 2i + 1,
            # so the 64 converted 16-bit values are the 32 packed .b32 lanes (little-endian)
            x = np.empty((WARP, 2), _F32)
            x[:, 0], x[:, 1] = b(w), a(w)
            d(w, np.ascontiguousarray(conv(x.reshape(-1), mode), np.uint16).view(_U32), m)
        return fn
    a = reader(ctx, ops_[1], st_, ins)
    d = writer(ctx, ops_[0], dt_, ins)
    ddt = _DT[dt_]
    if st_ == "f32" and dt_ in ("bf16", "f16"):
        conv = fp.f32_to_bf16_bits if dt_ == "bf16" else fp.f32_to_f16_bits
        return lambda w, m: d(w, conv(_bcast(a(w)), rnd or "rn"), m)
    if st_ in ("bf16", "f16") and dt_ == "f32":
        conv = fp.bf16_bits_to_f32 if st_ == "bf16" else fp.f16_bits_to_f32
        return lambda w, m: d(w, conv(a(w)), m)
    if st_ == "f32" and dt_ != "f32":  # float -> int
        f = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil, None: np.trunc}[rnd if rnd in ("rni", "rzi", "rmi", "rpi") else None]
        info = np.iinfo(ddt)

        def fn(w, m):
            x = f(np.asarray(a(w), np.float64))
            x = np.nan_to_num(x, nan=0.0)
            d(w, np.clip(x, info.min, info.max).astype(ddt), m)
        return fn
    if dt_ == "f32":  # int -> float
        return lambda w, m: d(w, fp.round_pair(np.asarray(a(w)).astype(np.float64), None, rnd or "rn"), m)
    # int -> int: sign/zero extension or truncation by the source type
    sdt = _DT[st_]

    def fn(w, m):
        v = np.asarray(a(w), sdt)
        d(w, v.astype(np.int64 if np.dtype(sdt).kind == "i" else np.uint64).astype(ddt), m)
    return fn


# ---- memory -------------------------------------------------------------------------------------------
def _gmem_slot(gm, a: int, nb: int, what: str, ins, w, lane):
    """(base, buffer, name) of the allocation holding GMEM bytes [a, a + nb); faults when they lie
    outside every allocation or are not nb-aligned."""
    hit = gm.find(a, nb)
    if hit is None:
        raise Fault("GMEM_OOB", f"{what} of {nb} B outside every allocation", line=ins.line,
                    warp=w.wid, lane=int(lane), addr=a, text=ins.text)
    if a % nb:
        raise Fault("GMEM_MISALIGNED", f"{what} of {nb} B not {nb}-byte aligned", line=ins.line,
                    warp=w.wid, lane=int(lane), addr=a)
    return hit


def _st_global_at_once(w, addrs, vals, nb: int, gm, ins) -> bool:
    """st.global of every lane in one pass, where that is the lane-by-lane loop's exact outcome: all
    lanes in one allocation, nb-aligned, at distinct addresses, over bytes no store wrote before (so
    no fault, no finding, and no order between the lanes to keep). False (nothing done) otherwise:
    the caller's loop then stores lane by lane, faulting or reporting at the lane it did."""
    if addrs.size == 0:
        return False
    lo, hi = int(addrs.min()), int(addrs.max())
    hit, last = gm.find(lo, nb), gm.find(hi, nb)
    if hit is None or last is None or last[0] != hit[0]:
        return False
    base, buf, gname = hit
    if _cnz(addrs % nb) or np.unique(addrs).size != addrs.size:
        return False
    emu = w.cta.emu
    idx = (addrs - base)[:, None] + np.arange(nb)[None, :]
    cnt = emu.gwrites.get(gname)
    if cnt is not None and _cnz(cnt[idx]):
        return False
    buf[idx] = np.ascontiguousarray(vals).view(np.uint8).reshape(addrs.size, nb)
    emu.mark_gmem(gname, buf.size, idx.reshape(-1), emu.writer_id(("st.global", w.wid, ins.line)), w.cta.ctaid)
    return True


# atom{.sem}{.scope}.global.add.type: the modelled atomic (a task counter's fetch-and-add)
_ATOM_RE = re.compile(r"atom(?:\.(?:relaxed|acquire|release|acq_rel))?(?:\.(?:cta|cluster|gpu|sys))?"
                      r"\.global\.add\.(u32|s32|u64)")


def compile_atom(ctx, ins, parts):
    """atom.global.add: each executing lane, in lane order, reads the value at its address (bounds and
    alignment checked like ld.global), writes old + src (modulo 2^width) and gets old in its
    destination, so lanes naming one address see each other's additions. The resident CTAs run
    interleaved (Emulator._run), so their fetches from one counter interleave. The bytes are not recorded with mark_gmem, whose
    written-once check judges outputs: a counter is legitimately updated by every CTA. Ordering
    against plain GMEM accesses (the .sem qualifier) is not modelled, as for ld/st.global."""
    m_ = _ATOM_RE.fullmatch(ins.opcode)
    if m_ is None:
        raise unsupported(ins, "atom is modelled as atom{.sem}{.scope}.global.add.{u32,s32,u64} only")
    t = m_.group(1)
    if len(ins.operands) != 3:
        raise unsupported(ins, "atom needs a destination, an address and a source")
    dst, addr, src = ins.operands
    d = writer(ctx, dst, t, ins)
    ar = addr_reader(ctx, addr, ins, "u64")
    r = reader(ctx, src, t, ins)
    dt = _DT[t]
    nb = _WIDTH[t]
    udt = np.dtype(f"u{nb}")
    wrap = (1 << (8 * nb)) - 1

    def fn(w, m):
        lanes = _lanes(m)
        addrs = ar(w)[lanes]
        adds = _bcast(np.asarray(r(w), dt))[lanes].view(udt)
        gm = w.cta.emu.gmem
        old = np.zeros(WARP, udt)
        for a, lane, v in zip(addrs, lanes, adds):
            a = int(a)
            base, buf, _ = _gmem_slot(gm, a, nb, "atom.global", ins, w, lane)
            o = int(buf[a - base: a - base + nb].view(udt)[0])
            buf[a - base: a - base + nb] = np.array([(o + int(v)) & wrap], udt).view(np.uint8)
            old[lane] = o
        d(w, old.view(dt), m)
    return fn


def compile_ld_st(ctx, ins, parts):
    emu = ctx.emu
    head = parts[0]
    space = parts[1]
    vec = next((int(x[1:]) for x in parts[2:] if re.fullmatch(r"v[248]", x)), 1)
    t = parts[-1]
    width = _WIDTH.get(t)
    if width is None or width == 1:
        raise unsupported(ins)
    ops_ = ins.operands
    if head == "ld":
        dst, src = ops_
        dsts = dst.items if isinstance(dst, Vec) else (dst,)
        ws = [writer(ctx, x, t, ins) for x in dsts]
        if len(ws) != vec:
            raise unsupported(ins, "vector width and operand count differ")
        if space == "param":
            if not isinstance(src, Addr) or not isinstance(src.base, Sym):
                raise unsupported(ins, "ld.param needs [param_name]")
            off = emu.param_offsets.get(src.base.name)
            if off is None:
                raise unsupported(ins, f"unknown parameter {src.base.name}")
            off += src.offset
            pdt = np.dtype(_DT[t]).newbyteorder("<")

            def fn(w, m):  # the launch's values, read when it runs: a compiled program serves every launch
                vals = np.frombuffer(w.cta.emu.params, dtype=pdt, count=vec, offset=off)
                for i in range(vec):
                    ws[i](w, vals[i], m)
            return fn
        if space == "shared" or space.startswith("shared"):
            ar = addr_reader(ctx, src, ins)
            dt = _DT[t]

            def fn(w, m):
                cta = w.cta
                lanes = _lanes(m)
                addrs = ar(w)[lanes]
                nb = width * vec
                cta.smem_check(addrs, nb, ins.line, w.wid, "load")
                idx = addrs[:, None] + np.arange(nb)[None, :]
                cta.check_guards(cta.sguard[idx], w.know, f"ld.shared by warp {w.wid}", async_proxy=False,
                                 own=w.wid, line=ins.line, warp=w.wid, addrs=idx)
                cta.srguard[idx] = cta.guard_id(("w", w.wid), w.epoch + 1, f"ld.shared of warp {w.wid} (PTX line {ins.line})")
                raw = cta.smem[idx].reshape(-1).view(dt).reshape(len(lanes), vec)
                for i in range(vec):
                    full = np.zeros(WARP, dt)
                    full[lanes] = raw[:, i]
                    ws[i](w, full, m)
            return fn
        if space == "global":
            # Plain global loads (test harnesses; the kernels read GMEM through TMA only). Bounds
            # and alignment are checked; ordering against other writers of GMEM is not modelled.
            ar = addr_reader(ctx, src, ins, "u64")
            dt = _DT[t]
            nb = width * vec

            def fn(w, m):
                lanes = _lanes(m)
                addrs = ar(w)[lanes]
                gm = w.cta.emu.gmem
                full = [np.zeros(WARP, dt) for _ in range(vec)]
                for a, lane in zip(addrs, lanes):
                    a = int(a)
                    base, buf, _ = _gmem_slot(gm, a, nb, "ld.global", ins, w, lane)
                    vals = buf[a - base: a - base + nb].copy().view(dt)
                    for i in range(vec):
                        full[i][lane] = vals[i]
                for i in range(vec):
                    ws[i](w, full[i], m)
            return fn
        raise unsupported(ins, f"loads from .{space}")
    # st
    dst, src = ops_
    srcs = src.items if isinstance(src, Vec) else (src,)
    if len(srcs) != vec:
        raise unsupported(ins, "vector width and operand count differ")
    rs = [reader(ctx, x, t, ins) for x in srcs]
    dt = _DT[t]
    nb = width * vec
    if space.startswith("shared"):
        ar = addr_reader(ctx, dst, ins)

        def fn(w, m):
            cta = w.cta
            lanes = _lanes(m)
            addrs = ar(w)[lanes]
            cta.smem_check(addrs, nb, ins.line, w.wid, "store")
            idx = addrs[:, None] + np.arange(nb)[None, :]
            g = cta.sguard[idx]
            if _cnz(g == 1) or _cnz(g == 2):
                what = "an mbarrier object" if (g == 2).any() else "bytes an asynchronous write is still filling"
                hit = idx.reshape(-1)[np.flatnonzero((g == 1) | (g == 2))[0]]
                raise Fault("RACE", f"st.shared overwrites {what}", line=ins.line, warp=w.wid, addr=int(hit),
                            text=ins.text)
            cta.check_war(cta.srguard[idx], w.know, f"st.shared of warp {w.wid}", own=w.wid, line=ins.line,
                          warp=w.wid, addrs=idx)
            cta.srguard[idx] = 0
            if vec == 1:  # one column: the lanes' values themselves (np.stack's Python-level loop skipped)
                vals = _bcast(np.asarray(rs[0](w), dt))[lanes][:, None]
            else:
                vals = np.stack([_bcast(np.asarray(r(w), dt))[lanes] for r in rs], axis=1)
            cta.smem[idx] = vals.reshape(len(lanes), vec).copy().view(np.uint8).reshape(len(lanes), nb)
            cta.sguard[idx] = cta.guard_id(("w", w.wid), w.epoch + 1, f"st.shared of warp {w.wid}")
            cta.swriter[idx] = cta.emu.writer_id(("st.shared", w.wid, ins.line))
        return fn
    if space == "global":
        ar = addr_reader(ctx, dst, ins, "u64")

        def fn(w, m):
            lanes = _lanes(m)
            addrs = ar(w)[lanes]
            gm = w.cta.emu.gmem
            vals = np.stack([_bcast(np.asarray(r(w), dt))[lanes] for r in rs], axis=1)
            if _st_global_at_once(w, addrs, vals, nb, gm, ins):
                return
            for j, (a, lane) in enumerate(zip(addrs, lanes)):
                a = int(a)
                base, buf, gname = _gmem_slot(gm, a, nb, "st.global", ins, w, lane)
                buf[a - base: a - base + nb] = vals[j].copy().view(np.uint8)
                w.cta.emu.mark_gmem(gname, buf.size, np.arange(a - base, a - base + nb),
                                    w.cta.emu.writer_id(("st.global", w.wid, ins.line)), w.cta.ctaid)
        return fn
    raise unsupported(ins, f"stores to .{space}")


# ---- barriers ---------------------------------------------------------------------------------------
def _uniform(vals: np.ndarray, lanes, what, ins, w):
    v = vals[lanes]
    if v.size and not (v == v[0]).all():
        raise Fault("NON_UNIFORM", f"{what} differs between the lanes of the warp", line=ins.line, warp=w.wid,
                    text=ins.text)
    return int(v[0]) if v.size else None


def compile_mbarrier(ctx, ins, parts):
    op = parts[1]
    ops_ = ins.operands
    if op == "init":
        ar = addr_reader(ctx, ops_[0], ins)
        cnt = reader(ctx, ops_[1], "u32", ins)

        def fn(w, m):
            cta = w.cta
            lanes = _lanes(m)
            addrs = ar(w)[lanes]
            cta.smem_check(addrs, 8, ins.line, w.wid, "mbarrier.init")
            counts = _bcast(cnt(w))[lanes]
            for a, c in zip(addrs, counts):
                a, c = int(a), int(c)
                if not 1 <= c < (1 << 20):
                    raise Fault("MBARRIER", f"mbarrier.init count {c} outside 1..2^20-1", line=ins.line,
                                warp=w.wid, addr=a)
                cta.mbars[a] = MBar(a, cta.mbar_name(a), c, c, init_by=w.wid, init_epoch=w.epoch + 1)
                cta.sguard[a: a + 8] = 2
        return fn
    if op == "arrive":
        expect = "expect_tx" in parts
        ar = addr_reader(ctx, ops_[1], ins)
        extra = reader(ctx, ops_[2], "u32", ins) if len(ops_) > 2 else None
        if not isinstance(ops_[0], Sink):
            raise unsupported(ins, "mbarrier.arrive with a state destination")

        def fn(w, m):
            cta = w.cta
            lanes = _lanes(m)
            addrs = ar(w)[lanes]
            w.release_epoch()
            ex = _bcast(extra(w))[lanes] if extra is not None else None
            # Lane by lane (each lane is an arrival). The lanes of a warp mostly name one barrier: its
            # lookup is done once, and the warp's knowledge (unchanged during the instruction) is joined
            # once into each accumulator it reaches (joining it again would change nothing).
            last_a, b, joined = None, None, None
            for i, a in enumerate(addrs):
                a = int(a)
                if a != last_a:
                    b, last_a = cta.mbar_at(a, ins.line, w.wid, w.know), a
                acc = b.acc
                if expect:
                    cta.mbar_arrive(b, 1, w.know, ins.line, w.wid, tx=int(ex[i]), join=acc is not joined)
                else:
                    cta.mbar_arrive(b, int(ex[i]) if ex is not None else 1, w.know, ins.line, w.wid,
                                    join=acc is not joined)
                joined = acc
        return fn
    if op in ("try_wait", "test_wait") and "parity" in parts:
        dp = writer(ctx, ops_[0], "pred", ins)
        ar = addr_reader(ctx, ops_[1], ins)
        par = reader(ctx, ops_[2], "u32", ins)

        def fn(w, m):
            cta = w.cta
            lanes = _lanes(m)
            addrs = ar(w)[lanes]
            pv = _bcast(par(w))[lanes]
            res = np.zeros(WARP, bool)
            blocked_on = None
            # the lanes mostly wait on one barrier: looked up once, its released knowledge joined once
            # (the barrier does not change during the instruction; a second join would change nothing)
            last_a, b, joined = None, None, None
            for i, (a, p) in enumerate(zip(addrs, pv)):
                a = int(a)
                if a != last_a:
                    b, last_a = cta.mbar_at(a, ins.line, w.wid, w.know), a
                ok = (b.phase & 1) != (int(p) & 1)
                res[lanes[i]] = ok
                if ok:
                    if b.phase > b.seen:
                        b.seen = b.phase
                    if b.phase >= 1 and b.know is not joined:
                        _join(w.know, b.know)
                        joined = b.know
                else:
                    blocked_on = b
            dp(w, res, m)
            if blocked_on is not None and (op == "test_wait" or cta.try_wait_times_out()):
                return None  # false on the lanes whose phase is incomplete: the code must loop on it
            if blocked_on is not None:
                b, v = blocked_on, blocked_on.version
                return Block(lambda: b.version != v, f"spinning on {b.name} for parity {int(pv[0]) & 1}: {b.state()}",
                             on=b)
            return None
        return fn
    raise unsupported(ins)


def compile_bar(ctx, ins, parts):
    head = parts[0]
    ops_ = ins.operands
    if head == "bar" and parts[1] == "warp":
        msk = reader(ctx, ops_[0], "u32", ins)

        def fn(w, m):
            mv = int(_bcast(msk(w))[0])
            act = _mask(m)
            want = np.array([(mv >> i) & 1 for i in range(WARP)], bool)
            if (want & ~act).any():
                raise Fault("WARP_SYNC", f"bar.warp.sync {mv:#x}: lanes of the mask are not executing it",
                            line=ins.line, warp=w.wid)
        return fn
    kind = parts[1] if head == "bar" else parts[1]
    if kind not in ("sync", "arrive", "red"):
        raise unsupported(ins)
    if kind == "red":
        raise unsupported(ins)
    idr = reader(ctx, ops_[0], "u32", ins)
    cnt = reader(ctx, ops_[1], "u32", ins) if len(ops_) > 1 else None
    wait = kind == "sync"

    def fn(w, m):
        cta = w.cta
        if m is not None and not m.all():
            raise Fault("ALIGNED", f"{ins.opcode} executed by {int(m.sum())} of 32 lanes (the barrier counts whole warps)",
                        line=ins.line, warp=w.wid, text=ins.text)
        lanes = _lanes(m)
        bid = _uniform(_bcast(idr(w)), lanes, "barrier id", ins, w)
        count = (_uniform(_bcast(cnt(w)), lanes, "thread count", ins, w) if cnt is not None
                 else cta.nthreads)
        if not 0 <= bid < 16:
            raise Fault("NAMED_BARRIER", f"barrier id {bid} outside 0..15", line=ins.line, warp=w.wid)
        if count % WARP or count <= 0 or count > cta.nthreads:
            raise Fault("NAMED_BARRIER", f"barrier {bid}: thread count {count} is not a positive multiple of 32 "
                                         f"up to {cta.nthreads}", line=ins.line, warp=w.wid)
        nb = cta.named.get(bid)
        if nb is None:
            nb = cta.named[bid] = NamedBar(bid)
        if nb.arrived == 0:
            nb.count = count
        elif nb.count != count:
            raise Fault("NAMED_BARRIER", f"barrier {bid}: thread count {count} while this phase counts {nb.count}",
                        line=ins.line, warp=w.wid, text=ins.text)
        w.release_epoch()
        _join(nb.acc, w.know)
        nb.arrived += WARP
        gen = nb.generation
        if wait:
            nb.waiters.append(w)
        if nb.arrived > nb.count:
            raise Fault("NAMED_BARRIER", f"barrier {bid}: {nb.arrived} threads arrived for a count of {nb.count}",
                        line=ins.line, warp=w.wid)
        if nb.arrived == nb.count:
            acc = nb.acc
            for x in nb.waiters:
                _join(x.know, acc)
            nb.arrived, nb.waiters, nb.acc = 0, [], {}
            nb.generation += 1
        if wait:
            return Block(lambda: nb.generation != gen,
                         f"bar.sync {bid}, {count}: {nb.arrived}/{nb.count} threads arrived", on=bid)
        return None
    return fn


# ---- warp collectives ------------------------------------------------------------------------------
def compile_warp_coll(ctx, ins, parts):
    head = parts[0]
    ops_ = ins.operands
    if head == "elect":
        pp = ops_[0]
        if not isinstance(pp, PredPair):
            raise unsupported(ins)
        dr = writer(ctx, pp.first, "u32", ins)
        dp = writer(ctx, pp.pred, "pred", ins)
        msk = reader(ctx, ops_[1], "u32", ins)

        def fn(w, m):
            mv = int(_bcast(msk(w))[0])
            act = _mask(m)
            want = np.array([(mv >> i) & 1 for i in range(WARP)], bool)
            cand = np.flatnonzero(act & want)
            res = np.zeros(WARP, bool)
            leader = int(cand[0]) if cand.size else 0
            if cand.size:
                res[leader] = True
            dp(w, res, m)
            dr(w, np.full(WARP, leader, _U32), m)
        return fn
    if head == "vote":
        mode = parts[2]
        if mode == "ballot":
            d = writer(ctx, ops_[0], "b32", ins)
        else:
            d = writer(ctx, ops_[0], "pred", ins)
        a = reader(ctx, ops_[1], "pred", ins)
        members = _membermask(ctx, ins, ops_[2] if len(ops_) > 2 else None)

        def fn(w, m):
            act = _mask(m)
            members(w, act)
            v = _bcast(a(w)) & act
            if mode == "any":
                d(w, np.full(WARP, bool(v.any())), m)
            elif mode == "all":
                d(w, np.full(WARP, bool(v[act].all())), m)
            elif mode == "uni":
                d(w, np.full(WARP, bool(v[act].all() or not v[act].any())), m)
            else:
                bits = int(sum(1 << int(i) for i in np.flatnonzero(v)))
                d(w, np.full(WARP, bits, _U32), m)
        return fn
    if head == "shfl":
        mode = parts[2]
        d = writer(ctx, ops_[0], "b32", ins)
        a = reader(ctx, ops_[1], "b32", ins)
        b = reader(ctx, ops_[2], "u32", ins)
        c = reader(ctx, ops_[3], "u32", ins)
        lane = np.arange(WARP, dtype=np.int64)
        members = _membermask(ctx, ins, ops_[4] if len(ops_) > 4 else None)

        def fn(w, m):
            act = _mask(m)
            members(w, act)
            av = _bcast(a(w))
            bv = _bcast(b(w)).astype(np.int64)
            cv = _bcast(c(w)).astype(np.int64)
            clamp, seg = cv & 0x1F, (cv >> 8) & 0x1F
            maxl = (lane & seg) | (clamp & ~seg)
            minl = lane & seg
            if mode == "bfly":
                j = lane ^ bv
                ok = j <= maxl
            elif mode == "idx":
                j = minl | (bv & ~seg)
                ok = j <= maxl
            elif mode == "down":
                j = lane + bv
                ok = j <= maxl
            elif mode == "up":
                j = lane - bv
                ok = j >= maxl
            else:
                raise unsupported(ins)
            j = np.where(ok, j, lane) & 31
            if (~act[j] & act).any():
                raise Fault("SHFL", "shfl.sync reads a lane that is not executing it", line=ins.line, warp=w.wid)
            d(w, av[j], m)
        return fn
    raise unsupported(ins)


def _membermask(ctx, ins, op):
    """shfl.sync / vote.sync's membermask: a 32-bit value naming every lane that executes the
    instruction (PTX ISA: undefined when the executing thread is not in it). -> check(w, act)."""
    if op is None:
        raise unsupported(ins, "a .sync warp operation needs its membermask")
    if isinstance(op, Imm) and not -(1 << 31) <= op.value < 1 << 32:  # -1: every lane
        raise UnsupportedInstruction(f"membermask {op.value:#x} of {ins.opcode} at line {ins.line} is not 32 bits")
    r = reader(ctx, op, "u32", ins)
    bits = (np.uint32(1) << np.arange(WARP, dtype=np.uint32))

    def check(w, act):
        mv = _bcast(r(w)).astype(np.uint32)
        missing = act & ((mv & bits) == 0)
        if missing.any():
            raise Fault("SHFL", f"{ins.opcode.split('.')[0]}.sync executed by lane {int(np.flatnonzero(missing)[0])}, "
                                "which its membermask leaves out (undefined behaviour)", line=ins.line, warp=w.wid)
    return check


def compile_setmaxnreg(ctx, ins, parts):
    inc = parts[1] == "inc"
    n = reader(ctx, ins.operands[0], "u32", ins)

    def fn(w, m):
        cta = w.cta
        v = int(_bcast(n(w))[0])
        if v % 8 or not 24 <= v <= 256:
            raise Fault("SETMAXNREG", f"setmaxnreg {v}: must be a multiple of 8 in 24..256", line=ins.line, warp=w.wid)
        want = cta.emu.options.get("role_regs", {}).get(w.wid)
        if want is not None and v != want[1]:
            raise Fault("SETMAXNREG", f"setmaxnreg.{parts[1]} {v}, but the manifest gives role {want[0]} a budget of "
                                      f"{want[1]} registers per thread", line=ins.line, warp=w.wid, text=ins.text)
        cur = w.regbudget if w.regbudget is not None else cta.emu.entry_regs
        if cur is None:
            cur = v
        if inc and v < cur or (not inc and v > cur):
            raise Fault("SETMAXNREG", f"setmaxnreg.{parts[1]} {v} with a current budget of {cur} per thread",
                        line=ins.line, warp=w.wid)
        w.regbudget = v
        total = sum(32 * (x.regbudget if x.regbudget is not None else (cta.emu.entry_regs or 0))
                    for x in cta.warps if x.alive.any() or x.done)
        if total > REGS_PER_SM:
            # the hardware stalls an .inc until registers are free: model it as waiting for the .dec of others
            w.regbudget = cur

            def ready():
                tot = sum(32 * (x.regbudget if x.regbudget is not None else (cta.emu.entry_regs or 0))
                          for x in cta.warps if x is not w)
                return tot + 32 * v <= REGS_PER_SM

            def release():
                w.regbudget = v
            if not inc:
                raise Fault("SETMAXNREG", f"register budget over {REGS_PER_SM}", line=ins.line, warp=w.wid)
            return Block(ready, f"setmaxnreg.inc {v}: waiting for registers ({total} > {REGS_PER_SM} requested)",
                         release)
        return None
    return fn


def compile_fence(ctx, ins, parts):
    if parts[1] == "proxy" and parts[2] == "async":
        def fn(w, m):
            w.release_epoch()
            w.know[("wa", w.wid)] = w.epoch
        return fn
    if parts[1] in ("mbarrier_init",) or parts[1].startswith("acq_rel") or parts[1] in ("sc", "cta"):
        return lambda w, m: None
    raise unsupported(ins)


def compile_griddepcontrol(ctx, ins, parts):
    """griddepcontrol.launch_dependents / .wait (programmatic dependent launch): no-ops here. A
    launch (ptxemu/kvcache.py) runs fa4_fwd to its end before fa4_combine starts, which is what
    .wait guarantees on the device."""
    if len(parts) == 2 and parts[1] in ("launch_dependents", "wait") and not ins.operands:
        return lambda w, m: None
    raise unsupported(ins)


# ---- dispatch -----------------------------------------------------------------------------------
def init_registers(mod) -> dict:
    """Every declared register, zero (shared read-only arrays: writes always replace), as an unsigned
    vector of its width (a register's vector keeps the type it was last written as: writer)."""
    return {name: _ZERO[_STORE[_WIDTH[t[1:]]]] for name, t in mod.regs.items()}
