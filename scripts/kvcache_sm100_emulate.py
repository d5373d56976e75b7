#!/usr/bin/env python3
"""Interim evidence: emulate the sm_100a KV-cache module (fa4_fwd, then fa4_combine when
num_splits > 1) in fa4gen's PTX emulator, launched with the parameters fa4gen/runtime.py
Kernel.kvcache passes, and judge each sequence's O / LSE against the exact attention over its
k_len = min(max(cache_seqlens[b], 0), capacity) keys (harness.judge).

    python scripts/kvcache_sm100_emulate.py            # the variant matrix, 2 seeds
    python scripts/kvcache_sm100_emulate.py mutations  # PTX mutations of the KV-cache lines: each must fail

Until fa4gen/ptxemu (parse, harness: `fa4gen emulate`) reads a two-entry module and launches
KV-cache kernels, this script splits the module into its two entries and builds the launch from
the harness's and the runtime's own pieces (tensor-map geometry and encoding, parameter packing).
"""
import math
import re
import struct
import sys
import time

import numpy as np
from fa4gen.config import KernelConfig
from fa4gen import codegen
from fa4gen.encodings import TensorMapSpec
from fa4gen.runtime import launch_geometry, tensor_map_geometry
from fa4gen.ptxemu import units
from fa4gen.ptxemu.machine import SMEM_BASE, Emulator, GlobalMemory, Fault
from fa4gen.ptxemu.parse import parse
from fa4gen.ptxemu.harness import _np_dtype_bytes, _from_dtype_bytes, entry_registers, role_budgets, judge, run_raw
from fa4gen.reference import round_to_dtype
from fa4gen.schedule import kvcache_k_len, kvcache_page
from fa4gen.simulate import combine_partials

def split_module(ptx):
    i = ptx.index(".visible .entry fa4_combine")
    head = ptx[:ptx.index(".extern")]
    return ptx[:i], head + ptx[i:]

def run(cfg, B, sq, hkv, cap, lens, S, seed=0, ctas=3, ps_pages_extra=1, lse=True, bad_table=False, mutate=None, quiet=False):
    res = codegen.build(cfg, emit=("ptx",))
    ptx, man = res.ptx, res.manifest
    fwd, cmb = split_module(ptx)
    if mutate:
        new = mutate(fwd); assert new != fwd, 'mutation missed'; fwd = new
    mod = parse(fwd)
    rng = np.random.default_rng(seed)
    G, d, dt = cfg.gqa_ratio, cfg.head_dim, cfg.dtype
    hq = hkv * G
    q = round_to_dtype(rng.standard_normal((B, sq, hq, d)), dt)
    kc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), dt)
    vc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), dt)
    gmem = GlobalMemory()
    if cfg.page_size:
        ps = cfg.page_size; mp = cap // ps
        npages = B * mp + ps_pages_extra
        pt = (rng.permutation(B * mp).reshape(B, mp)).astype(np.int32)
        if bad_table:  # garbage past the sequence: negative and huge entries (clamped, never read for keys < len)
            pt[:, -1] = -7
        kp = round_to_dtype(rng.standard_normal((npages, ps, hkv, d)), dt); vp = round_to_dtype(rng.standard_normal((npages, ps, hkv, d)), dt)
        for b in range(B):
            for i in range(mp):
                if bad_table and i == mp - 1:
                    continue
                kp[pt[b, i]] = kc[b, i*ps:(i+1)*ps]; vp[pt[b, i]] = vc[b, i*ps:(i+1)*ps]
        kin, vin = kp, vp
        capacity, stride, maxp = mp * ps, mp, mp
        # the keys as the rules read them (fa4gen/schedule.py kvcache_page: a bad entry reads the last page)
        for b in range(B):
            for j in range(capacity):
                pg, r = kvcache_page(pt[b], j, ps, maxp, npages)
                kc[b, j], vc[b, j] = kp[pg, r], vp[pg, r]
    else:
        kin, vin, pt, npages = kc, vc, None, 0
        capacity, stride, maxp = cap, 0, 0
    o_init = np.full(q.shape, np.nan)
    addr = {n: gmem.add(n, _np_dtype_bytes(dt, x)) for n, x in (("q", q), ("k", kin), ("v", vin), ("o", o_init))}
    lse_addr = gmem.add("lse", np.full((B, hq, sq), np.nan, np.float32)) if lse else 0
    R = B * sq * hq
    opart = gmem.add("o_partial", np.full((S, R, d), np.nan, np.float32))
    lpart = gmem.add("lse_partial", np.full((S, R), np.nan, np.float32))
    csl = gmem.add("cache_seqlens", np.asarray(lens, np.int32))
    pta = gmem.add("page_table", pt) if pt is not None else 0
    lg = launch_geometry(man, B, hkv, sq)
    num_tasks = lg.num_tasks * S
    scale = 1 / math.sqrt(d)
    scalars = {"lse_ptr": ("<Q", lse_addr), "batch": ("<I", B), "seqlen_q": ("<I", sq), "seqlen_k": ("<I", capacity),
               "num_heads_kv": ("<I", hkv), "scale_log2": ("<f", scale * math.log2(math.e)),
               "num_m_blocks": ("<I", lg.num_m_blocks), "num_tasks": ("<I", num_tasks), "l2_group": ("<I", 1),
               "cache_seqlens": ("<Q", csl), "page_table": ("<Q", pta), "page_table_stride": ("<I", stride),
               "max_pages": ("<I", maxp), "num_pages": ("<I", npages), "num_splits": ("<I", S),
               "o_partial": ("<Q", opart), "lse_partial": ("<Q", lpart)}
    tensors = {"q": q, "k": kin, "v": vin, "o": o_init}
    blob, offsets, sizes = bytearray(), {}, {}
    assert [p.name for p in mod.params] == list(man["params"])
    for p in mod.params:
        while len(blob) % max(p.align, 1):
            blob.append(0)
        offsets[p.name] = len(blob); sizes[p.name] = p.size
        if p.name.startswith("tmap_"):
            role = p.name[5:]; spec = man["tensor_maps"][role]; t = tensors[role]
            strides = tuple(int(s) for s in np.cumprod((1,) + t.shape[::-1][:-1])[::-1])
            geo = tensor_map_geometry(role, spec, t.shape, strides, 2, lg.pack)
            tms = TensorMapSpec(dtype=spec["dtype"], dims=tuple(spec["dims"]), box=geo.box, swizzle=spec["swizzle"])
            blob += units.encode_tensor_map(tms.validate(geo.dims, geo.strides, addr[role]), addr[role])
        else:
            fmt, val = scalars[p.name]; blob += struct.pack(fmt, val)
    nctas = max(min(num_tasks, ctas), 1)
    t0 = time.time()
    emu = Emulator(mod, arch="sm_100a", nthreads=int(man["threads_per_cta"]), nctas=nctas,
                   dyn_smem=int(man["dynamic_smem_bytes"]), params=bytes(blob), param_offsets=offsets, gmem=gmem,
                   seed=seed, entry_regs=entry_registers(mod, man, int(man["threads_per_cta"])),
                   options={"role_regs": role_budgets(man)})
    emu.param_sizes = sizes
    try:
        emu.run(60_000_000)
    except Fault as f:
        print('FAULT', str(f)[:300]); return False
    if emu.findings:
        print("FINDINGS", emu.findings[:3])
    if S > 1:
        op = gmem.buffer("o_partial").view(np.float32).reshape(S, R, d)
        lp = gmem.buffer("lse_partial").view(np.float32).reshape(S, R)
        if np.isnan(op).any() or np.isnan(lp).any():
            print(f"FAIL partials never written: o_partial NaN {np.isnan(op).sum()}, lse_partial NaN {np.isnan(lp).sum()}")
            return False
        # the combine entry through the emulator
        o_out = np.zeros((B, sq, hq, d), np.uint16)
        lse_out = np.full((B, hq, sq), np.nan, np.float32)
        outs = run_raw(cmb, threads=128, ctas=-(-R // 4), args=(op.copy(), lp.copy(), o_out, lse_out, R, S, sq, hq),
                       seed=seed, step_limit=5_000_000)
        o = _from_dtype_bytes(dt, outs[2].view(np.uint8).reshape(-1), (B, sq, hq, d))
        l = outs[3].astype(np.float64)
        o_np, l_np = combine_partials(op, lp)
    else:
        o = _from_dtype_bytes(dt, gmem.buffer("o"), q.shape)
        l = gmem.buffer("lse").view(np.float32).reshape(B, hq, sq).astype(np.float64) if lse else None
    ok_all = True
    for b in range(B):
        kl = kvcache_k_len(lens[b], capacity)
        if kl == 0:
            ok = np.all(o[b] == 0) and (l is None or np.all(np.isneginf(l[b])))
            msg = "" if ok else f"no-key seq: O max {np.nanmax(np.abs(o[b]))} lse {l[b] if l is not None else None}"
        else:
            ok, msg, _ = judge(o[b:b+1], None if l is None else l[b:b+1], q[b:b+1], kc[b:b+1, :kl], vc[b:b+1, :kl],
                               man["config"], scale)
        if not ok:
            ok_all = False
            print(f"  seq {b} (k_len {kl}):", msg[:800])
    if not quiet or not (ok_all and not emu.findings):
        print(("PASS " if ok_all and not emu.findings else "FAIL ") + cfg.name, f"B{B} sq{sq} hkv{hkv} cap{cap} lens{lens} S{S} seed{seed}",
              f"{time.time()-t0:.1f}s")
    return ok_all and not emu.findings

K = KernelConfig
# (config, B, Sq, Hkv, capacity, cache_seqlens, num_splits): no keys, partial blocks, lengths past
# the capacity and negative ones, more splits than blocks (empty splits), Sq past one tile pair
CASES = [
    (K(kvcache=True, head_dim=64, gqa_ratio=4), 3, 2, 1, 384, (0, 200, 384), 4),
    (K(kvcache=True, head_dim=64, gqa_ratio=4, causal=True), 3, 3, 1, 384, (2, 200, 500), 2),
    (K(kvcache=True, head_dim=64, gqa_ratio=1, page_size=64), 2, 1, 2, 512, (300, -4), 3),
    (K(kvcache=True, head_dim=64, gqa_ratio=8, page_size=16, causal=True), 2, 4, 1, 256, (256, 77), 5),
    (K(kvcache=True, head_dim=128, gqa_ratio=4, page_size=256), 2, 1, 1, 512, (511, 130), 2),
    (K(kvcache=True, head_dim=64, gqa_ratio=3, page_size=32, dtype="fp16"), 2, 2, 1, 256, (100, 256), 1),
    (K(kvcache=True, head_dim=128, gqa_ratio=1, page_size=128, causal=True), 1, 130, 1, 384, (300,), 2),
    (K(kvcache=True, head_dim=64, gqa_ratio=3, causal=True), 2, 1, 1, 300, (299, 1), 3),
    (K(kvcache=True, head_dim=128, gqa_ratio=8, dtype="fp16", causal=True), 2, 2, 1, 256, (256, 0), 1),
]
# edits of the KV-cache PTX lines, each of which the run must fail (wrong O/LSE, a fault, partials unwritten)
MUTATIONS = {
    "softmax block offset dropped": lambda t: t.replace("    add.u32 %nb, %nb, %nlo;\n", "", 1),
    "page lookup block offset dropped": lambda t: t.replace("    add.u32 %pkey, %pkey, %nlo;\n", "", 1),
    "split range not clamped": lambda t: t.replace("    min.u32 %nlo, %nlo, %tmp0;\n", "", 1),
    "every box from page 0": lambda t: re.sub(r"%prow, %pg[1-9]\}", "%prow, %pg0}", t),
    "page index not clamped to max_pages": lambda t: t.replace("    min.u32 %pg1, %pg1, %tmp0;\n    add.u32 %pg1",
                                                              "    add.u32 %pg1", 1),
    "partial row predicate dropped": lambda t: t.replace("@%p_row st.global.v4.f32", "st.global.v4.f32"),
    "partials of split 0 only": lambda t: t.replace("rem.u32 %kt2, %task, %kt2;", "mov.u32 %kt2, 0;"),
    "split path never taken": lambda t: t.replace("setp.le.u32 %p_c, %tmp0, 1;", "setp.le.u32 %p_c, %tmp0, 1000;"),
    "cache_seqlens not clamped to the capacity": lambda t: t.replace("    min.u32 %skv, %skv, %tmp0;\n", "", 1),
}
MUTATED = (K(kvcache=True, head_dim=64, gqa_ratio=4, page_size=64, causal=True), 2, 3, 1, 512, (300, 700), 5)


def main(argv) -> int:
    if argv[:1] == ["mutations"]:
        if not run(*MUTATED, seed=0, bad_table=True):
            print("the unmutated kernel fails: no mutation can be judged")
            return 1
        missed = []
        for name, m in MUTATIONS.items():
            print("==", name)
            if run(*MUTATED, seed=0, mutate=m, bad_table=True):
                missed.append(name)
        print(f"{len(MUTATIONS) - len(missed)} of {len(MUTATIONS)} mutations caught" + (f"; missed: {missed}" if missed else ""))
        return 1 if missed else 0
    ok = all([run(*c, seed=s) for s in (0, 1) for c in CASES])
    print("ALL PASS" if ok else "SOME FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
