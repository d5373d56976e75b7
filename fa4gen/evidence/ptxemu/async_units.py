"""The asynchronous agents: TMA loads/stores (tensor maps, swizzle, OOB fill, complete_tx, bulk
groups), tcgen05 (alloc/dealloc, mma through the SMEM and instruction descriptors, commit, ld/st with
wait::ld/wait::st) and wgmma (descriptors, RS form, commit/wait groups, wgmma.fence).

Each issue records what the issuing warp knew; the work lands at a seeded random later time (MMAs in
issue order per pipe); guards on the bytes and cells they write say what a reader must observe.
"""
from __future__ import annotations

import functools
import re

import numpy as np

from . import fp, units
from .machine import PARAM_BASE, TMEM_ALLOC_MIN, TMEM_COLS, WARP, Block, Fault, _join, distinct_ids
from .ops import _bcast, _lanes, _uniform, addr_reader, reader, unsupported, writer
from .parse import Addr, Reg, TmaAddr, Vec
from .units import UnitError

_U32, _F32, _U64 = np.uint32, np.float32, np.uint64
_F32DT = np.dtype(_F32)
_cnz = np.count_nonzero
DEFAULT_MMA_MODEL = (16, 2, "rz")  # see mma_accumulate: fitted to the H200 (bench/emu_crosscheck/README.md)


def _unit(fn, ins, w):
    try:
        return fn()
    except UnitError as e:
        raise Fault("UNIT", str(e), line=ins.line, warp=w.wid, text=ins.text) from None


def _tensor_map(cta, gaddr: int, ins, w) -> tuple:
    off = gaddr - PARAM_BASE
    emu = cta.emu
    for name, o in emu.param_offsets.items():
        if o == off and emu.param_sizes.get(name, 0) >= units.TMAP_BYTES:
            raw = emu.params[o: o + units.TMAP_BYTES]
            return name, _unit(lambda: units.decode_tensor_map(raw), ins, w)
    raise Fault("TMAP", f"operand {gaddr:#x} is not the address of a tensor-map parameter", line=ins.line,
                warp=w.wid, text=ins.text)


def _gmem_for(cta, tm, ins, w):
    gm = cta.emu.gmem
    hit = gm.find(tm.address, 1)
    if hit is None:
        raise Fault("GMEM_OOB", f"tensor map points at {tm.address:#x}, outside every allocation",
                    line=ins.line, warp=w.wid)
    return hit


def _tmem_cols_ok(cta, col: int, n: int, ins, w, what: str):
    for c0, nc in cta.tmem_alloc.items():
        if c0 <= col and col + n <= c0 + nc:
            return
    raise Fault("TMEM_OOB", f"{what} touches TMEM columns [{col}, {col + n}) outside the allocation "
                            f"({cta.tmem_alloc or 'nothing allocated'})", line=ins.line, warp=w.wid, text=ins.text)


# ---- TMA ------------------------------------------------------------------------------------------
def _tma_box(cta, w, ins, rank, tmap_addr, coord_readers, smem_addr, lane, what):
    """One TMA copy's geometry, checked: (map name, TensorMap, in-bounds mask, physical SMEM element
    addresses, the GMEM buffer, byte offsets into it) for `lane`'s operands."""
    name, tm = _tensor_map(cta, tmap_addr, ins, w)
    if tm.rank != rank:
        raise Fault("TMAP", f"{rank}d copy through the rank-{tm.rank} map {name}", line=ins.line, warp=w.wid)
    coords = tuple(int(_bcast(c(w))[lane]) for c in coord_readers)
    if what == "load" and cta.emu.tma_loads is not None:
        cta.emu.tma_loads.append((name, coords))
    goff, valid, phys = _unit(lambda: units.tma_box_plan(tm, coords, smem_addr), ins, w)
    cta.smem_check(phys, tm.esize, ins.line, w.wid, f"TMA {what} SMEM side")
    base, buf, gname = _gmem_for(cta, tm, ins, w)
    rel = tm.address - base + goff
    if valid.any() and ((rel[valid] < 0).any() or (rel[valid] + tm.esize > buf.size).any()):
        raise Fault("GMEM_OOB", f"TMA {what} through {name} touches memory outside {gname}", line=ins.line, warp=w.wid)
    return name, tm, valid, phys, buf, gname, rel


def compile_tma(ctx, ins, parts):
    ops_ = ins.operands
    m_rank = next((re.fullmatch(r"(\d)d", p) for p in parts if re.fullmatch(r"\dd", p)), None)
    if m_rank is None or "tile" not in parts:
        raise unsupported(ins, "only tiled tensor copies are modelled")
    rank = int(m_rank.group(1))
    load = parts.index("shared::cluster") < parts.index("global") if "shared::cluster" in parts else False
    if load:
        if "mbarrier::complete_tx::bytes" not in parts or len(ops_) != 3:
            raise unsupported(ins)
        dst, src, bar = ops_
        if not isinstance(src, TmaAddr) or len(src.coords) != rank:
            raise unsupported(ins, f"{rank}d copy needs [tmap, {{{rank} coordinates}}]")
        da = addr_reader(ctx, dst, ins)
        ba = addr_reader(ctx, bar, ins)
        ta = reader(ctx, src.tmap, "u64", ins)
        cs = [reader(ctx, c, "s32", ins) for c in src.coords]
        lo, hi = ctx.emu.delays["tma"]

        def fn(w, m):
            cta = w.cta
            for lane in _lanes(m):
                dst_a, bar_a = int(da(w)[lane]), int(ba(w)[lane])
                name, tm, valid, phys, buf, gname, rel = _tma_box(
                    cta, w, ins, rank, int(_bcast(ta(w))[lane]), cs, dst_a, lane, "load")
                es = tm.esize
                b = cta.mbar_at(bar_a, ins.line, w.wid, w.know)
                byt = np.zeros((valid.size, es), np.uint8)
                vi = np.flatnonzero(valid)
                byt[vi] = buf[rel[vi][:, None] + np.arange(es)[None, :]]
                idx = (phys[:, None] + np.arange(es)[None, :]).reshape(-1)
                g = cta.sguard[idx]
                if (g == 1).any() or (g == 2).any():
                    hit = int(idx[np.flatnonzero((g == 1) | (g == 2))[0]])
                    raise Fault("RACE", "TMA load writes SMEM that holds an mbarrier or another write in flight",
                                line=ins.line, warp=w.wid, addr=hit, text=ins.text)
                cta.check_war(cta.srguard[idx], w.know, f"the TMA load of {name} issued by warp {w.wid}",
                              line=ins.line, warp=w.wid, addrs=idx)
                cta.srguard[idx] = 0
                cta.sguard[idx] = 1
                know = dict(w.know)
                line = ins.line
                nbytes = tm.box_bytes

                def land(idx=idx, byt=byt, b=b, know=know, nbytes=nbytes, name=name, wid=w.wid):
                    cta.smem[idx] = byt.reshape(-1)
                    cta.sguard[idx] = cta.guard_id(("bar", b.addr), b.phase + 1,
                                                   f"the TMA load of {name} (PTX line {line}) completing on {b.name}")
                    cta.mbar_complete_tx(b, nbytes, know, line, wid)
                cta.at(cta.now + cta.delay(lo, hi, tail=True), land, ("TMA load", ins.line, w.wid, b, name))
        return fn
    # store: global <- shared::cta, bulk_group completion
    if "bulk_group" not in parts or len(ops_) != 2:
        raise unsupported(ins)
    dst, src = ops_
    if not isinstance(dst, TmaAddr) or len(dst.coords) != rank:
        raise unsupported(ins)
    sa = addr_reader(ctx, src, ins)
    ta = reader(ctx, dst.tmap, "u64", ins)
    cs = [reader(ctx, c, "s32", ins) for c in dst.coords]
    lo, hi = ctx.emu.delays["bulk_store"]

    def fn(w, m):
        cta = w.cta
        for lane in _lanes(m):
            src_a = int(sa(w)[lane])
            name, tm, valid, phys, buf, gname, rel = _tma_box(
                cta, w, ins, rank, int(_bcast(ta(w))[lane]), cs, src_a, lane, "store")
            es = tm.esize
            know = dict(w.know)
            w.bulk_seq += 1
            op = {"done": False, "seq": w.bulk_seq}
            w.bulk_open.append(op)
            idx = phys[:, None] + np.arange(es)[None, :]

            def land(idx=idx, rel=rel, valid=valid, know=know, op=op, wid=w.wid, buf=buf, es=es, gname=gname):
                cta.check_guards(cta.sguard[idx], know, f"the TMA store (PTX line {ins.line}) of warp {wid}",
                                 async_proxy=True, own=None, line=ins.line, warp=wid, addrs=idx)
                data = cta.smem[idx]
                cta.srguard[idx] = cta.guard_id(("bulkrd", wid), op["seq"], f"the TMA store (PTX line {ins.line}) of warp {wid}")
                vi = np.flatnonzero(valid)
                dst = rel[vi][:, None] + np.arange(es)[None, :]
                buf[dst] = data[vi]
                emu = cta.emu
                src_w = cta.swriter[idx[vi, 0]]
                ids = np.empty(src_w.shape, np.int32)
                for u in np.unique(src_w):
                    via = emu.writers[u] if u >= 0 else None
                    ids[src_w == u] = emu.writer_id(("TMA store", wid, ins.line, via))
                emu.mark_gmem(gname, buf.size, dst, ids[:, None], cta.ctaid)
                op["done"] = True
            cta.at(cta.now + cta.delay(lo, hi), land, ("TMA store", ins.line, w.wid))
    return fn


def compile_bulk_group(ctx, ins, parts):
    if parts[3] == "commit_group":
        def fn(w, m):
            w.bulk_groups.append(w.bulk_open)
            w.bulk_open = []
        return fn
    if parts[3] == "wait_group":
        n = reader(ctx, ins.operands[0], "u32", ins)

        def fn(w, m):
            k = int(_bcast(n(w))[0])

            def ready():
                w.bulk_groups = [g for g in w.bulk_groups if not all(o["done"] for o in g)]
                return len(w.bulk_groups) <= k

            def release():
                pend = [o["seq"] for g in w.bulk_groups + [w.bulk_open] for o in g if not o["done"]]
                done_upto = (min(pend) - 1) if pend else w.bulk_seq
                if w.know.get(("bulkrd", w.wid), 0) < done_upto:
                    w.know[("bulkrd", w.wid)] = done_upto
            return Block(ready, f"cp.async.bulk.wait_group {k}: {len(w.bulk_groups)} groups in flight", release)
        return fn
    raise unsupported(ins)


# ---- tcgen05 ---------------------------------------------------------------------------------------
def _taddr(v: int):
    return (v >> 16) & 0xFFFF, v & 0xFFFF


def compile_tcgen05(ctx, ins, parts):
    op = parts[1]
    ops_ = ins.operands
    emu = ctx.emu
    if op == "fence::before_thread_sync":
        def fn(w, m):
            _join(w.know, w.tc_unpublished)
            w.tc_unpublished = {}
        return fn
    if op == "fence::after_thread_sync":
        def fn(w, m):
            w.tc_view = dict(w.know)
        return fn
    if op == "alloc":
        ar = addr_reader(ctx, ops_[0], ins)
        nr = reader(ctx, ops_[1], "u32", ins)

        def fn(w, m):
            cta = w.cta
            n = int(_bcast(nr(w))[0])
            if n < TMEM_ALLOC_MIN or n > TMEM_COLS or n & (n - 1):
                raise Fault("TMEM_ALLOC", f"tcgen05.alloc of {n} columns: a power of two in {TMEM_ALLOC_MIN}..{TMEM_COLS}",
                            line=ins.line, warp=w.wid)
            if cta.tmem_relinquished:
                raise Fault("TMEM_ALLOC", "tcgen05.alloc after relinquish_alloc_permit", line=ins.line, warp=w.wid)
            col = None
            for c in range(0, TMEM_COLS, n):
                if all(c + n <= c0 or c0 + nc <= c for c0, nc in cta.tmem_alloc.items()):
                    col = c
                    break
            if col is None:
                raise Fault("TMEM_ALLOC", f"tcgen05.alloc of {n} columns cannot be satisfied "
                                          f"({cta.tmem_alloc} allocated): the hardware would block forever",
                            line=ins.line, warp=w.wid)
            cta.tmem_alloc[col] = n
            a = int(ar(w)[0])
            cta.smem_check(np.array([a]), 4, ins.line, w.wid, "tcgen05.alloc result")
            cta.smem[a: a + 4] = np.array([col], np.uint32).view(np.uint8)
            cta.sguard[a: a + 4] = cta.guard_id(("w", w.wid), w.epoch + 1, f"tcgen05.alloc of warp {w.wid}")
        return fn
    if op == "dealloc":
        tr = reader(ctx, ops_[0], "u32", ins)
        nr = reader(ctx, ops_[1], "u32", ins)

        def fn(w, m):
            cta = w.cta
            lane, col = _taddr(int(_bcast(tr(w))[0]))
            n = int(_bcast(nr(w))[0])
            if cta.tmem_alloc.get(col) != n or lane != 0:
                # not fatal to the data: recorded, and the run goes on so O is still judged
                cta.emu.findings.append(Fault("TMEM_ALLOC", f"tcgen05.dealloc of {n} columns at lane {lane} column "
                                                            f"{col} matches no allocation ({cta.tmem_alloc or 'none left'})",
                                              line=ins.line, warp=w.wid, text=ins.text))
                return
            del cta.tmem_alloc[col]
        return fn
    if op == "relinquish_alloc_permit":
        def fn(w, m):
            w.cta.tmem_relinquished = True
        return fn
    if op in ("wait::ld", "wait::st"):
        is_ld = op == "wait::ld"

        def fn(w, m):
            if is_ld:
                def ready():
                    return w.tc_pending == 0

                def release():
                    for r in w.tc_ld_regs:
                        w.poison.pop(r, None)
                    w.tc_ld_regs = []
                    n = w.ld_seq
                    w.own_tc[("ld", w.wid)] = n
                    w.tc_unpublished[("ld", w.wid)] = n
                return Block(ready, f"tcgen05.wait::ld: {w.tc_pending} loads in flight", release)

            def ready():
                return w.st_landed >= w.st_seq

            def release():
                w.own_tc[("st", w.wid)] = w.st_seq
                w.tc_unpublished[("st", w.wid)] = w.st_seq  # others see it after fence::before_thread_sync
            return Block(ready, f"tcgen05.wait::st: {w.st_seq - w.st_landed} stores in flight", release)
        return fn
    if op in ("ld", "st"):
        shape = parts[4] if len(parts) > 4 else ""
        mm = re.fullmatch(r"x(\d+)", parts[5]) if len(parts) > 5 else None
        if shape != "32x32b" or mm is None or parts[-1] != "b32" or len(parts) != 7:
            raise unsupported(ins, "only tcgen05.ld/st .sync.aligned.32x32b.xN.b32 is modelled")
        nrep = int(mm.group(1))
        if op == "ld":
            regs, addr = ops_
        else:
            addr, regs = ops_
        if not isinstance(regs, Vec) or len(regs.items) != nrep:
            raise unsupported(ins, f".x{nrep} needs {nrep} registers")
        ar = addr_reader(ctx, addr, ins)
        names = [r.name for r in regs.items]
        lo, hi = emu.delays["tmem"]
        if op == "ld":
            ws = [writer(ctx, r, "b32", ins) for r in regs.items]
        else:
            rs = [reader(ctx, r, "b32", ins) for r in regs.items]

        def fn(w, m):
            cta = w.cta
            a = _uniform(ar(w).astype(np.int64) & 0xFFFFFFFF, np.arange(WARP), "TMEM address", ins, w)
            lane0, col = _taddr(a)
            q = 32 * (w.wid % 4)
            if lane0 != q:
                raise Fault("TMEM_LANE", f"warp {w.wid} may access TMEM lanes [{q}, {q + 32}) only; the address "
                                         f"names lane {lane0}", line=ins.line, warp=w.wid, addr=a, text=ins.text)
            _tmem_cols_ok(cta, col, nrep, ins, w, f"tcgen05.{op}")
            rows = slice(lane0, lane0 + 32)
            cols = slice(col, col + nrep)
            if op == "ld":
                know = w.tmem_knowledge()
                for r in names:
                    w.poison[r] = ("rw", "its tcgen05.ld", ins.line)
                w.tc_ld_regs.extend(names)
                w.tc_pending += 1
                w.ld_seq += 1
                rg = cta.guard_id(("ld", w.wid), w.ld_seq, f"tcgen05.ld of warp {w.wid} (PTX line {ins.line})")

                def land():
                    cta.check_guards(cta.tguard[rows, cols], know, f"tcgen05.ld of warp {w.wid}", async_proxy=False,
                                     own=None, line=ins.line, warp=w.wid, space="TMEM",
                                     addrs=_tmem_addr_grid(lane0, col, nrep))
                    vals = cta.tmem[rows, cols]
                    cta.trguard[rows, cols] = rg
                    for j, wr in enumerate(ws):
                        wr(w, vals[:, j].copy(), None)
                    w.tc_pending -= 1
                cta.at(cta.now + cta.delay(lo, hi), land, ("tcgen05.ld", ins.line, w.wid))
                return None
            vals = np.stack([_bcast(r(w)) for r in rs], axis=1).astype(np.uint32)
            g = cta.tguard[rows, cols]
            if (g == 1).any():
                raise Fault("RACE", "tcgen05.st to TMEM cells another store is still writing", line=ins.line, warp=w.wid)
            cta.check_war(cta.trguard[rows, cols], w.tmem_knowledge(), f"tcgen05.st of warp {w.wid}", line=ins.line,
                          warp=w.wid, addrs=_tmem_addr_grid(lane0, col, nrep), space="TMEM")
            cta.trguard[rows, cols] = 0
            cta.tguard[rows, cols] = 1
            w.st_seq += 1
            seq = w.st_seq
            t = max(cta.now, w.st_tail) + cta.delay(lo, hi)
            w.st_tail = t

            def land():
                cta.tmem[rows, cols] = vals
                cta.tguard[rows, cols] = cta.guard_id(("st", w.wid), seq, f"tcgen05.st of warp {w.wid} (PTX line {ins.line})")
                w.st_landed = max(w.st_landed, seq)
            cta.at(t, land, ("tcgen05.st", ins.line, w.wid))
            return None
        return fn
    if op == "mma":
        return compile_tcgen05_mma(ctx, ins, parts)
    if op == "commit":
        if "mbarrier::arrive::one" not in parts or "multicast::cluster" in parts:
            raise unsupported(ins)
        ba = addr_reader(ctx, ops_[0], ins)
        lo, hi = emu.delays["commit"]

        def fn(w, m):
            cta = w.cta
            for lane in _lanes(m):
                b = cta.mbar_at(int(ba(w)[lane]), ins.line, w.wid, w.know)
                know = dict(w.know)
                know[("mma", w.wid)] = w.mma_seq
                t = max(cta.now, w.mma_tail) + cta.delay(lo, hi)
                cta.at(t, lambda b=b, know=know, wid=w.wid: cta.mbar_arrive(b, 1, know, ins.line, wid),
                      ("tcgen05.commit arrive", ins.line, w.wid, b))
        return fn
    raise unsupported(ins)


@functools.lru_cache(maxsize=None)
def _tmem_addr_grid(lane0, col, n, lanes=32):
    """The TMEM addresses (lane << 16 | column) of a block of cells, for fault reports (read-only,
    memoised: the checks pass one on every access and read it only when they fail)."""
    g = ((np.arange(lanes)[:, None] + lane0) << 16) | (np.arange(n)[None, :] + col)
    g.flags.writeable = False
    return g


def compile_tcgen05_mma(ctx, ins, parts):
    if parts[2] != "cta_group::1" or parts[3] != "kind::f16" or len(parts) != 4:
        raise unsupported(ins, "only tcgen05.mma.cta_group::1.kind::f16 is modelled")
    ops_ = ins.operands
    if len(ops_) != 5:
        raise unsupported(ins, "expected [d], a, b, idesc, enable_input_d")
    d_op, a_op, b_op, i_op, e_op = ops_
    da = addr_reader(ctx, d_op, ins)
    a_tmem = isinstance(a_op, Addr)
    aa = addr_reader(ctx, a_op, ins) if a_tmem else reader(ctx, a_op, "b64", ins)
    bb = reader(ctx, b_op, "b64", ins)
    ii = reader(ctx, i_op, "u32", ins)
    ee = reader(ctx, e_op, "pred" if isinstance(e_op, Reg) else "u32", ins)
    emu = ctx.emu
    lo, hi = emu.delays["mma"]

    def fn(w, m):
        cta = w.cta
        for lane in _lanes(m):
            dv = int(da(w)[lane]) & 0xFFFFFFFF
            av = int(_bcast(aa(w))[lane])
            bv = int(_bcast(bb(w))[lane])
            iv = int(_bcast(ii(w))[lane])
            acc = bool(_bcast(ee(w))[lane])
            idesc = _unit(lambda: units.decode_idesc(iv), ins, w)
            if idesc.m != 128 or idesc.sparse or int(idesc.d_type) != 1:
                raise Fault("UNIT", f"tcgen05.mma with M={idesc.m}, sparse={idesc.sparse}, d_type={idesc.d_type.name}: "
                                    "only M=128 dense f32 accumulation is modelled", line=ins.line, warp=w.wid, text=ins.text)
            M, N, K = idesc.m, idesc.n, 16
            dl, dc = _taddr(dv)
            if dl != 0:
                raise Fault("TMEM_LANE", f"tcgen05.mma D at lane {dl}: M=128 uses lanes 0..127", line=ins.line, warp=w.wid)
            _tmem_cols_ok(cta, dc, N, ins, w, "tcgen05.mma D")
            esize = 2
            conv = fp.bf16_bits_to_f32 if int(idesc.a_type) == 1 else fp.f16_bits_to_f32
            if a_tmem:
                al, ac = _taddr(av & 0xFFFFFFFF)
                if al != 0 or int(idesc.a_major) != 0:
                    raise Fault("UNIT", f"A in TMEM at lane {al} (major {idesc.a_major.name}): lanes 0..127, K-major",
                                line=ins.line, warp=w.wid)
                _tmem_cols_ok(cta, ac, K // 2, ins, w, "tcgen05.mma A")
                a_src = ("tmem", ac)
            else:
                ad = _unit(lambda: units.decode_desc(av, "sm_100a"), ins, w)
                a_addr = _unit(lambda: units.operand_addresses(ad, int(idesc.a_major) == 1, M, K, esize), ins, w)
                cta.smem_check(a_addr.reshape(-1), esize, ins.line, w.wid, "tcgen05.mma A operand")
                a_src = ("smem", a_addr)
            bd = _unit(lambda: units.decode_desc(bv, "sm_100a"), ins, w)
            b_addr = _unit(lambda: units.operand_addresses(bd, int(idesc.b_major) == 1, N, K, esize), ins, w)
            cta.smem_check(b_addr.reshape(-1), esize, ins.line, w.wid, "tcgen05.mma B operand")
            w.mma_seq += 1
            seq = w.mma_seq
            know = dict(w.know)  # SMEM operands: ordered by the TMA's mbarrier (async proxy)
            tknow = w.tmem_knowledge()  # TMEM operands: through tcgen05.fence::after_thread_sync
            t = max(cta.now, w.mma_tail) + cta.delay(lo, hi)
            w.mma_tail = t
            neg_a, neg_b = idesc.negate_a, idesc.negate_b
            wid = w.wid

            def execute(a_src=a_src, b_addr=b_addr, know=know, tknow=tknow, seq=seq, dc=dc, N=N, acc=acc):
                with np.errstate(invalid="ignore", over="ignore"):
                    _execute(a_src, b_addr, know, tknow, seq, dc, N, acc)

            def _execute(a_src, b_addr, know, tknow, seq, dc, N, acc):
                own = ("mma", wid)
                rguard = cta.guard_id(own, seq, f"tcgen05.mma #{seq} of warp {wid} (PTX line {ins.line})")

                def chk(ids, addrs, space, what):
                    # the pipe's own earlier MMAs are ordered before this one
                    ids = np.where(_own_mask(cta, ids, own), 0, ids)
                    cta.check_guards(ids, tknow if space == "TMEM" else know, what, async_proxy=True, own=None,
                                     line=ins.line, warp=wid, addrs=addrs, space=space)
                if a_src[0] == "tmem":
                    ac = a_src[1]
                    chk(cta.tguard[0:M, ac: ac + K // 2], _tmem_addr_grid(0, ac, K // 2, M), "TMEM",
                        f"tcgen05.mma (PTX line {ins.line}) A operand")
                    cells = cta.tmem[0:M, ac: ac + K // 2]
                    cta.trguard[0:M, ac: ac + K // 2] = rguard
                    lo16 = (cells & 0xFFFF).astype(np.uint16)
                    hi16 = (cells >> 16).astype(np.uint16)
                    A = np.empty((M, K), np.float64)
                    A[:, 0::2] = conv(lo16)
                    A[:, 1::2] = conv(hi16)
                else:
                    addr = a_src[1]
                    chk(cta.sguard[addr], addr, "SMEM", f"tcgen05.mma (PTX line {ins.line}) A operand")
                    A = conv(cta.smem.view(np.uint16)[addr // 2]).astype(np.float64)
                    cta.srguard[addr] = rguard
                    cta.srguard[addr + 1] = rguard
                chk(cta.sguard[b_addr], b_addr, "SMEM", f"tcgen05.mma (PTX line {ins.line}) B operand")
                cta.srguard[b_addr] = rguard
                cta.srguard[b_addr + 1] = rguard
                B = conv(cta.smem.view(np.uint16)[b_addr // 2]).astype(np.float64)
                if neg_a:
                    A = -A
                if neg_b:
                    B = -B
                old = None
                if acc:
                    chk(cta.tguard[0:M, dc: dc + N], _tmem_addr_grid(0, dc, N, M), "TMEM",
                        f"tcgen05.mma (PTX line {ins.line}) accumulator")
                    old = cta.tmem[0:M, dc: dc + N].view(np.float32)
                cta.check_war(cta.trguard[0:M, dc: dc + N], tknow, f"tcgen05.mma (PTX line {ins.line})", skip=(own,),
                              line=ins.line, warp=wid, addrs=_tmem_addr_grid(0, dc, N, M), space="TMEM")
                cta.trguard[0:M, dc: dc + N] = 0
                with np.errstate(over="ignore", invalid="ignore"):
                    D = mma_accumulate(A, B, old, cta.emu.options.get("mma_model", DEFAULT_MMA_MODEL),
                                       sixteen_bit=True)
                cta.tmem[0:M, dc: dc + N] = D.view(np.uint32)
                cta.tguard[0:M, dc: dc + N] = cta.guard_id(own, seq, f"tcgen05.mma #{seq} of warp {wid} (PTX line {ins.line})")
            cta.at(t, execute, ("tcgen05.mma", ins.line, w.wid))
    return fn


def mma_accumulate(A: np.ndarray, B: np.ndarray, old: np.ndarray | None, model: tuple | None,
                   sixteen_bit: bool = False) -> np.ndarray:
    """D = old + A @ B.T for one MMA instruction (A [M, K], B [N, K] float64 holding 16-bit values,
    old [M, N] f32 or None), returned as f32.

    model None: the exact sum rounded once to nearest. model (G, E): the tensor-core adder as a
    sequence of fused group sums: the accumulator and the next G products (exact) are aligned to the
    largest exponent among them, each truncated to 24 + E bits below it, summed exactly and the sum
    truncated to f32.

    The group model runs in float32 where that gives the same bits as the float64 definition
    (_mma_accumulate_f64, which stays the fallback): the products of 16-bit floats (<= 22 significant
    bits) are exact in f32 while they stay in its normal range, a power-of-two scaling of an exact f32
    is exact, and the truncated terms are integers below 2^(24 + E) whose sum is exact in f64 in any
    order. A product below the normal range (tiny probabilities) is rounded in f32, which changes
    nothing where its quantum is at least 2^-125: it scales to at most 1/2 and truncates to a zero of
    its sign, exactly as the exact product does, and the largest term, hence the quantum, is then a
    normal product or the accumulator. The [K, M, N] layout makes the reductions over K element-wise
    passes over contiguous planes. About 2.5x faster than the float64 form.

    sixteen_bit: the caller's A and B are 16-bit floats by construction (converted from bf16/fp16
    bits, negated at most): _f32_exact need not count their significant bits."""
    if model is None:
        return _mma_accumulate_f64(A, B, old, model)
    G, E = model[:2]
    final = model[2] if len(model) > 2 else "rz"
    if not _f32_exact(A, B, G, E, sixteen_bit):
        return _mma_accumulate_f64(A, B, old, model)
    # [K, M], [K, N], exact (16-bit values); C order, so that the products are [K, M, N] planes
    # (A.T.astype would keep A's layout and put K innermost: the reductions 5x slower)
    a32, b32 = np.ascontiguousarray(A.T, np.float32), np.ascontiguousarray(B.T, np.float32)
    acc = np.zeros((A.shape[0], B.shape[0])) if old is None else old.astype(np.float64)
    K = A.shape[1]
    for k0 in range(0, K, G):
        part = a32[k0:k0 + G, :, None] * b32[k0:k0 + G, None, :]  # [g, M, N], exact (checked above)
        big = np.abs(part).max(axis=0).astype(np.float64)
        np.maximum(big, np.abs(acc), out=big)
        _, ex = np.frexp(big)
        sh = np.minimum(24 + E - ex, 1074)  # inv_q = 2^sh
        if sh.max() > 125 or sh.min() < -126:
            return _mma_accumulate_f64(A, B, old, model)  # a quantum below 2^-125 or an inv_q past f32
        zero = big == 0
        if _cnz(zero):  # all terms zero in f32: exact only if no product underflowed to zero
            nonzero = (a32[k0:k0 + G] != 0).T.astype(np.float32) @ (b32[k0:k0 + G] != 0).astype(np.float32)
            if _cnz(nonzero[zero]):
                return _mma_accumulate_f64(A, B, old, model)
        inv_q = ((sh.astype(np.int64) + 1023) << 52).view(np.float64)  # 2^sh by its bits (sh in [-126, 125])
        q = 1.0 / inv_q
        part *= inv_q.astype(np.float32)  # exact: a power of two, the result below 2^(24 + E)
        np.trunc(part, out=part)
        s = part.sum(axis=0, dtype=np.float64) * q + np.trunc(acc * inv_q) * q
        acc = s if final == "exact" else fp.round_pair(s, None, final).astype(np.float64)
    return acc.astype(np.float32)


def _f32_exact(A: np.ndarray, B: np.ndarray, G: int, E: int, sixteen_bit: bool = False) -> bool:
    """Whether mma_accumulate's float32 form may run on these operands: finite 16-bit values whose
    products do not overflow f32, and group sums that stay below 2^53 (the quanta are checked there)."""
    if 24 + E + int(G).bit_length() + 1 > 53 or 24 + E > 100:
        return False
    with np.errstate(invalid="ignore"):
        amax, bmax = np.abs(A).max(initial=0.0), np.abs(B).max(initial=0.0)
    if not (np.isfinite(amax) and np.isfinite(bmax)) or amax * bmax >= 2.0 ** 127:
        return False
    if sixteen_bit:
        return True
    # 16-bit values: at most 11 significant bits (the products then have <= 22)
    for x in (A, B):
        m, _ = np.frexp(x)
        if not np.array_equal(m * 2048.0, np.trunc(m * 2048.0)):
            return False
    return True


def _mma_accumulate_f64(A: np.ndarray, B: np.ndarray, old: np.ndarray | None, model: tuple | None) -> np.ndarray:
    """mma_accumulate by its definition, in float64 (the reference its float32 form must equal)."""
    prod = A[:, None, :] * B[None, :, :]  # [M, N, K], exact
    if model is None:
        tot = prod.sum(axis=2)
        if old is not None:
            tot = tot + old.astype(np.float64)
        return tot.astype(np.float32)
    G, E = model[:2]
    final = model[2] if len(model) > 2 else "rz"
    acc = np.zeros(prod.shape[:2]) if old is None else old.astype(np.float64)
    K = prod.shape[2]
    for k0 in range(0, K, G):
        part = prod[:, :, k0:k0 + G]
        big = np.maximum(np.maximum(part.max(axis=2), -part.min(axis=2)), np.abs(acc))
        _, ex = np.frexp(big)  # the largest exponent among the group's terms
        inv_q = np.ldexp(1.0, np.minimum(24 + E - ex, 1074))  # 1 / quantum, a power of two: exact
        q = 1.0 / inv_q
        scaled = part * inv_q[:, :, None]  # exact (a power of two), then truncated in place
        np.trunc(scaled, out=scaled)
        s = scaled.sum(axis=2) * q + np.trunc(acc * inv_q) * q
        acc = s if final == "exact" else fp.round_pair(s, None, final).astype(np.float64)
    return acc.astype(np.float32)


def _own_mask(cta, ids, own):
    mine = [g for g in distinct_ids(ids) if g > 2 and cta.guards[g][0] == "know" and cta.guards[g][1] == own]
    if not mine:
        return np.zeros(ids.shape, bool)
    if len(mine) == 1:  # the common case: np.isin's sort for one value is an equality
        return ids == mine[0]
    return np.isin(ids, mine)


# ---- wgmma -----------------------------------------------------------------------------------------
def compile_wgmma(ctx, ins, parts):
    op = parts[1]
    ops_ = ins.operands
    emu = ctx.emu
    if op == "fence":
        def fn(w, m):
            # the registers' vectors as of the fence (held, so compared by identity: writes replace them)
            w.wg_fence = dict(w.regs)
        return fn
    if op == "commit_group":
        def fn(w, m):
            w.wg_groups.append(w.wg_open)
            w.wg_open = []
        return fn
    if op == "wait_group":
        n = reader(ctx, ops_[0], "u32", ins)

        def fn(w, m):
            k = int(_bcast(n(w))[0])

            # The contract, not the timing: wait_group k completes every committed group but the k
            # most recent, and only those are known done afterwards. The k most recent stay in flight
            # for the program (their registers stay poisoned) even when the model already finished
            # them, so a wait one group too shallow is caught however fast the wgmma ran.
            def ready():
                older = w.wg_groups[:len(w.wg_groups) - k] if k else w.wg_groups
                return all(o["done"] for g in older for o in g)

            def release():
                w.wg_groups = w.wg_groups[len(w.wg_groups) - k:] if k else []
                live = set()
                pend = []
                for g in w.wg_groups + [w.wg_open]:  # not known done, finished or not
                    for o in g:
                        live.update(o["regs"][w.wid])
                        pend.append(o["seq"])
                done_upto = (min(pend) - 1) if pend else w.wg_seq
                key = ("wg", w.wid // 4)
                if w.know.get(key, 0) < done_upto:
                    w.know[key] = done_upto
                for r in [r for r, v in w.poison.items() if v[1].startswith("its wgmma")]:
                    if r not in live:
                        del w.poison[r]
            return Block(ready, f"wgmma.wait_group {k}: {len(w.wg_groups)} groups committed", release)
        return fn
    if op != "mma_async":
        raise unsupported(ins)
    shp = re.fullmatch(r"m64n(\d+)k16", parts[4])
    if shp is None or parts[5] != "f32" or parts[6] not in ("bf16", "f16") or parts[7] != parts[6] or len(parts) != 8:
        raise unsupported(ins, "only wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} is modelled")
    N = int(shp.group(1))
    conv = fp.bf16_bits_to_f32 if parts[6] == "bf16" else fp.f16_bits_to_f32
    d_op = ops_[0]
    if not isinstance(d_op, Vec) or len(d_op.items) != N // 2:
        raise unsupported(ins, f"m64n{N} needs {N // 2} accumulator registers")
    dnames = [r.name for r in d_op.items]
    for r in d_op.items:  # compiled only for their checks: every accumulator is a declared f32 register
        reader(ctx, r, "f32", ins), writer(ctx, r, "f32", ins)
    rs_form = isinstance(ops_[1], Vec)
    if rs_form:
        if len(ops_) != 7 or len(ops_[1].items) != 4:
            raise unsupported(ins, "RS form: d, {a0..a3}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b")
        anames = [r.name for r in ops_[1].items]
        a_readers = [reader(ctx, r, "b32", ins) for r in ops_[1].items]
        b_r = reader(ctx, ops_[2], "b64", ins)
        sd = reader(ctx, ops_[3], "pred", ins) if isinstance(ops_[3], Reg) else None
        sd_imm = None if sd else int(ops_[3].value)
        isa, isb, ita, itb = int(ops_[4].value), int(ops_[5].value), 0, int(ops_[6].value)
        a_r = None
    else:
        if len(ops_) != 8:
            raise unsupported(ins, "SS form: d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b")
        anames = []
        a_r = reader(ctx, ops_[1], "b64", ins)
        b_r = reader(ctx, ops_[2], "b64", ins)
        sd = reader(ctx, ops_[3], "pred", ins) if isinstance(ops_[3], Reg) else None
        sd_imm = None if sd else int(ops_[3].value)
        isa, isb, ita, itb = (int(o.value) for o in ops_[4:8])
    for v in (isa, isb):
        if v not in (1, -1):
            raise unsupported(ins, "imm-scale must be 1 or -1")
    lo, hi = emu.delays["wgmma"]
    d_idx = [units.wgmma_d_index(N, i) for i in range(4)]
    # RS form: A's (row, k) of every warp's register j, half h, lane l as [4, 4, 2, 32] index arrays
    # (each of the 64 x 16 elements once: the four warps' fragments are assembled in one assignment)
    a_rows = np.stack([units.wgmma_a_index(i)[0] for i in range(4)])
    a_ks = np.stack([units.wgmma_a_index(i)[1] for i in range(4)])
    assert len(set(zip(a_rows.reshape(-1).tolist(), a_ks.reshape(-1).tolist()))) == 64 * 16

    def fn(w, m):
        cta = w.cta
        wg, wi = divmod(w.wid, 4)
        fence = w.wg_fence or {}
        for r in dnames + anames:
            if fence.get(r) is not w.regs[r]:
                raise Fault("WGMMA_FENCE", f"wgmma uses {r}, written after the last wgmma.fence of warp {w.wid}",
                            line=ins.line, warp=w.wid, text=ins.text)
        bv = _uniform(_bcast(b_r(w)).astype(np.uint64), np.arange(WARP), "B descriptor", ins, w)
        av = (_uniform(_bcast(a_r(w)).astype(np.uint64), np.arange(WARP), "A descriptor", ins, w)
              if a_r is not None else None)
        scale_d = (bool(_uniform(_bcast(sd(w)), np.arange(WARP), "scale-d", ins, w))
                   if sd is not None else bool(sd_imm))
        seq = w.wg_seq
        w.wg_seq += 1
        key = (wg, seq)
        pend = cta.wg_pending.setdefault(key, {"contrib": {}, "done": False, "regs": {}, "seq": seq + 1})
        pend["contrib"][wi] = dict(warp=w, a=av, b=bv, scale_d=scale_d, know=dict(w.know),
                                   aregs=[np.array(r(w)) for r in a_readers] if rs_form else None)
        pend["regs"][w.wid] = dnames + anames
        for r in dnames:
            w.poison[r] = ("rw", "its wgmma", ins.line)
        for r in anames:
            if r not in w.poison:
                w.poison[r] = ("w", "its wgmma (A fragment)", ins.line)
        w.wg_open.append(pend)
        if len(pend["contrib"]) < 4:
            return None
        cs = pend["contrib"]
        first = cs[0]
        for c in cs.values():
            if c["b"] != first["b"] or c["a"] != first["a"] or c["scale_d"] != first["scale_d"]:
                raise Fault("WGMMA", "the warps of the warpgroup disagree on descriptors or scale-d", line=ins.line, warp=w.wid)
        del cta.wg_pending[key]
        t = max(cta.now, cta.wg_tail.get(wg, 0)) + cta.delay(lo, hi)
        cta.wg_tail[wg] = t
        esize = 2
        bd = _unit(lambda: units.decode_desc(first["b"], "sm_90a"), ins, w)
        b_addr = _unit(lambda: units.operand_addresses(bd, itb == 1, N, 16, esize), ins, w)
        cta.smem_check(b_addr.reshape(-1), esize, ins.line, w.wid, "wgmma B operand")
        if not rs_form:
            ad = _unit(lambda: units.decode_desc(first["a"], "sm_90a"), ins, w)
            a_addr = _unit(lambda: units.operand_addresses(ad, ita == 1, 64, 16, esize), ins, w)
            cta.smem_check(a_addr.reshape(-1), esize, ins.line, w.wid, "wgmma A operand")
        know = {}
        for c in cs.values():
            _join(know, c["know"])

        rg = cta.guard_id(("wg", wg), seq + 1, f"wgmma #{seq + 1} of warpgroup {wg} (PTX line {ins.line})")

        def execute():
            cta.check_guards(cta.sguard[b_addr], know, f"wgmma (PTX line {ins.line}) B operand", async_proxy=True,
                             own=None, line=ins.line, warp=w.wid, addrs=b_addr)
            cta.srguard[b_addr] = rg
            cta.srguard[b_addr + 1] = rg
            B = conv(cta.smem.view(np.uint16)[b_addr // 2]).astype(np.float64) * isb
            if rs_form:
                A = np.zeros((64, 16), np.float64)
                regs = np.array([cs[wi_]["aregs"][j] for wi_ in range(4) for j in range(4)], np.uint32)
                halves = regs.view(np.uint16).reshape(4, 4, WARP, 2).transpose(0, 1, 3, 2)  # (low, high)
                A[a_rows, a_ks] = conv(halves)
            else:
                cta.check_guards(cta.sguard[a_addr], know, f"wgmma (PTX line {ins.line}) A operand", async_proxy=True,
                                 own=None, line=ins.line, warp=w.wid, addrs=a_addr)
                A = conv(cta.smem.view(np.uint16)[a_addr // 2]).astype(np.float64)
                cta.srguard[a_addr] = rg
                cta.srguard[a_addr + 1] = rg
            A = A * isa
            D_old = None
            if first["scale_d"]:
                D_old = np.zeros((64, N), np.float32)
                for wi_, c in cs.items():
                    rows, cols = d_idx[wi_]
                    regs = c["warp"].regs
                    D_old[rows, cols] = np.array([v if v.dtype is _F32DT else v.view(np.float32)
                                                  for v in (regs[n] for n in dnames)])
            with np.errstate(over="ignore", invalid="ignore"):
                D = mma_accumulate(A, B, D_old, cta.emu.options.get("mma_model", DEFAULT_MMA_MODEL),
                                   sixteen_bit=True)
            for wi_, c in cs.items():
                ww = c["warp"]
                rows, cols = d_idx[wi_]
                f32 = D[rows, cols]  # a fresh array: its rows are the registers' new values (f32 vectors)
                fence_ = ww.wg_fence
                for j, n in enumerate(dnames):
                    arr = f32[j]
                    ww.regs[n] = arr
                    if fence_ is not None:
                        fence_[n] = arr
            pend["done"] = True
        cta.at(t, execute, ("wgmma.mma_async", ins.line, w.wid))
        return None
    return fn


def compile_async(ctx, ins, parts):
    head = parts[0]
    if head == "tcgen05":
        return compile_tcgen05(ctx, ins, parts)
    if head == "wgmma":
        return compile_wgmma(ctx, ins, parts)
    if head == "prefetch":
        if parts[1] != "tensormap":
            raise unsupported(ins)
        ar = addr_reader(ctx, ins.operands[0], ins, "u64")

        def fn(w, m):
            for lane in _lanes(m):
                _tensor_map(w.cta, int(ar(w)[lane]), ins, w)
        return fn
    if head == "cp" and parts[1] == "async" and parts[2] == "bulk":
        if len(parts) > 3 and parts[3] == "tensor":
            return compile_tma(ctx, ins, parts)
        if len(parts) > 3 and parts[3] in ("commit_group", "wait_group"):
            return compile_bulk_group(ctx, ins, parts)
    raise unsupported(ins)
