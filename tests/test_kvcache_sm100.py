"""The sm_100a KV-cache (decode) kernel, lowered from the IR (fa4gen/spec/plan.py "KV-cache rules").

- The IR names what the PTX does: a launch-uniform branch on num_splits > 1 (Cond.SPLIT_KV) whose
  split path normalizes O in fp32 and stores it from the registers (StorePartial) and the LSE
  (store_lse_partial), while the store warp's TMA store runs only on the num_splits == 1 path; the
  verifier explores both paths (a hazard on the split path is found).
- `fa4gen check` reads the fa4_fwd entry back against the IR (paged K/V boxes, StorePartial rows).
- The PTX task decode (scheduler.ptx.j2 decode_kvcache_units) equals fa4gen.spec.schedule.kvcache_task /
  plan.BlockInfo / kvcache_k_len over m units of two Q tiles.
- The IR simulator (simulate_kvcache) matches the exact attention per sequence, contiguous and
  paged, with empty splits, lengths past the capacity and negative ones.
- ptxas accepts the variants without spills; the dense and varlen PTX are the golden files'.

No Blackwell GPU exists here: the sm_100a kernel is never executed.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import random
import re
from pathlib import Path

import numpy as np
import pytest

from fa4gen.assemble import assemble as asm
from fa4gen import codegen
from fa4gen.evidence.check import check_ptx
from fa4gen.spec.config import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Cond, If, Loop, PageLookup, StorePartial, TmaStore, Wait, WaitLd, walk_ops
from fa4gen.render.kernels import build_sm100
from fa4gen.verify.verify import verify
from fa4gen.spec.plan import COMBINE_ENTRY, BlockInfo
from fa4gen.evidence.reference import attention_exact, round_to_dtype
from fa4gen.spec.schedule import kvcache_k_len, kvcache_task
from fa4gen.evidence.simulate import simulate_kvcache

ROOT = Path(__file__).resolve().parent.parent
HAVE_PTXAS = asm.find_ptxas() is not None


def kv(**kw) -> KernelConfig:
    return KernelConfig(**{"arch": "sm_100a", "kvcache": True, **kw})


@functools.lru_cache(maxsize=None)
def built(cfg: KernelConfig):
    res = codegen.build(cfg, emit=("ptx",))  # verifies the IR: raises on a finding
    return res.ptx, res.manifest


def fwd_only(ptx: str) -> str:
    """The fa4_fwd entry of the two-entry module (the check reads one kernel)."""
    return ptx[:ptx.index(f".visible .entry {COMBINE_ENTRY}")]


# ---- the IR --------------------------------------------------------------------------------------------
def _ifs(stmts):
    for st in stmts:
        if isinstance(st, If):
            yield st
            yield from _ifs(st.then)
            yield from _ifs(st.orelse)
        elif isinstance(st, Loop):
            yield from _ifs(st.body)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_ir_names_the_split_kv_epilogue(causal):
    pipe = build_pipeline(kv(causal=causal, page_size=64))
    epi = "softmax0" if causal else "correction"  # the role that normalizes O
    split = [st for st in _ifs(pipe.role(epi).program) if st.cond is Cond.SPLIT_KV and st.orelse]
    stores = [op for st in split for op in walk_ops(st.then) if isinstance(op, StorePartial)]
    # every column of each O tile the role normalizes (causal: softmax0 its tile 0; else WG2 both)
    tiles = [0] if causal else [0, 1]
    assert sorted({op.qtile for op in stores}) == tiles
    assert sum(op.col_hi - op.col_lo for op in stores) == 128 * len(tiles)
    assert not any(isinstance(op, StorePartial) for st in split for op in walk_ops(st.orelse))
    # the store warp's TMA store sits on the num_splits == 1 path only
    st_if = [st for st in _ifs(pipe.role("store").program) if st.cond is Cond.SPLIT_KV]
    assert len(st_if) == 2 and all(not st.then and any(isinstance(o, TmaStore) for o in st.orelse) for st in st_if)
    # LSE: lse_partial on the split path, lse_ptr (if set) otherwise
    sm = [st for st in _ifs(pipe.role("softmax1").program) if st.cond is Cond.SPLIT_KV
          and any(getattr(o, "fn", "") == "store_lse" for o in walk_ops(st.orelse))]
    assert len(sm) == 1 and [op.fn for op in walk_ops(sm[0].then)] == ["store_lse_partial"]
    dense = build_pipeline(dataclasses.replace(pipe.config, kvcache=False, page_size=0))
    assert not any(isinstance(op, StorePartial) for r in dense.roles for op in walk_ops(r.program))
    assert not any(st.cond is Cond.SPLIT_KV for r in dense.roles for st in _ifs(r.program))


def _drop_wait_ld_in_split_path(stmts):
    """stmts with the first tcgen05.wait::ld of the first If(SPLIT_KV)'s split path removed."""
    out, done = [], False
    for st in stmts:
        if not done and isinstance(st, If) and st.cond is Cond.SPLIT_KV and any(isinstance(o, WaitLd) for o in st.then):
            k = next(i for i, o in enumerate(st.then) if isinstance(o, WaitLd))
            out.append(dataclasses.replace(st, then=st.then[:k] + st.then[k + 1:]))
            done = True
        elif not done and isinstance(st, Loop):
            body, done = _drop_wait_ld_in_split_path(st.body)
            out.append(dataclasses.replace(st, body=body))
        else:
            out.append(st)
    return tuple(out), done


def test_verifier_explores_the_split_path():
    """The split path's tcgen05.wait::ld removed: only a run with num_splits > 1 reads O's registers
    before they arrived. The verifier reports it (so it runs that path), the intact IR passes."""
    pipe = build_pipeline(kv(head_dim=64))
    assert verify(pipe).ok
    role = pipe.role("correction")
    prog, hit = _drop_wait_ld_in_split_path(role.program)
    assert hit
    bad = dataclasses.replace(pipe, roles=tuple(dataclasses.replace(r, program=prog) if r is role else r
                                                for r in pipe.roles))
    rep = verify(bad, scenarios=((1,), (2,)), random_schedules=1)
    assert "HAZARD_REG" in rep.codes(), rep.text()


# ---- the PTX read back ----------------------------------------------------------------------------------
CHECKED = [kv(head_dim=64), kv(causal=True, gqa_ratio=4, page_size=16), kv(page_size=256, gqa_ratio=8),
           kv(causal=True, gqa_ratio=3, page_size=64, dtype="fp16")]


@pytest.mark.parametrize("cfg", CHECKED, ids=lambda c: c.name)
def test_check_reads_the_kernel_back(cfg):
    ptx, man = built(cfg)
    assert ptx.count(".visible .entry ") == 2 and f".visible .entry {COMBINE_ENTRY}(" in ptx
    rep = check_ptx(ptx, man)  # the module: fa4_fwd against the IR, fa4_combine's static checks
    assert rep.ok, rep.summary()


@pytest.mark.parametrize("old, new", [
    ("@%p_row st.global.v4.f32", "st.global.v4.f32"),  # a partial row store without its row predicate
    ("setp.le.u32 %p_c, %tmp0, 1;\n    @%p_c bra", "setp.le.u32 %p_c, %tmp0, 1;\n    @!%p_c bra"),
])
def test_check_fails_a_mutated_partial_store(old, new):
    ptx, man = built(kv(causal=True, page_size=64))
    assert old in fwd_only(ptx)
    rep = check_ptx(ptx.replace(old, new, 1), man)
    if old.startswith("@%p_row"):
        assert not rep.ok, "the unpredicated partial store was not noticed"
    else:
        # the inverted branch is no protocol difference the read-back sees: the simulator and the
        # emulator catch that one; here only its text must still be there to be mutated
        assert rep.ok


def test_paged_load_reads_the_page_table_per_box():
    """A paged K/V block is 128 / min(page_size, 128) TMA boxes per 64 columns, box i from page
    register %pg<i>; the block's PageLookup reads each entry once for K and V, clamped to
    max_pages - 1 and num_pages - 1 (plan "KV-cache rules"), before the block's first wait."""
    for ps, boxes in ((16, 8), (64, 2), (256, 1)):
        cfg = kv(page_size=ps)
        ptx, man = built(cfg)
        load = ptx[ptx.index("// role load"):ptx.index("// end role load")]
        per_block = 2 * boxes  # D = 128: two 64-column halves per box
        assert load.count("cp.async.bulk.tensor.4d") == 4 * per_block  # K, V x (first block, steady state)
        for i in range(boxes):
            assert load.count(f"ld.global.nc.u32 %pg{i}, [%rdt];") == 2  # the first block and the steady state
            assert len(re.findall(rf"cp\.async\.bulk\.tensor\.4d.*%prow, %pg{i}\}}\]", load)) == 4 * 2
        assert load.count("[max_pages]") == load.count("[num_pages]") == 2 * boxes
        ops = [op for op in walk_ops(build_pipeline(cfg).role("load").program)]
        look = [i for i, op in enumerate(ops) if isinstance(op, PageLookup)]
        assert len(look) == 2 and all(isinstance(ops[i + 1], Wait) for i in look)
        assert man["tensor_maps"]["k"]["dims"] == ["D", "Hkv", "Page", "Pages"]
        assert man["tensor_maps"]["k"]["box"] == [64, 1, min(ps, 128), 1]
        assert man["kvcache"]["box_rows"] == min(ps, 128)


# ---- the task decode against schedule.py ---------------------------------------------------------------
def _sched_interp():
    spec = importlib.util.spec_from_file_location("_sched_test", ROOT / "tests" / "test_schedule.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Ptx


def _decode_segment(ptx: str):
    text = re.search(r"// sched: kvcache\n(.*?)\n\s*// sched: end", ptx, re.S).group(1)
    # the memory reads become inputs: cache_seqlens[b] -> %slen_b (set per task), seqlen_k -> %cap
    lines = []
    for ln in text.splitlines():
        s = ln.strip()
        if s.startswith(("ld.param.u64", "mul.wide.u32", "add.s64")):
            continue
        if s.startswith("ld.global.nc.u32 %skv"):
            lines.append("mov.u32 %skv, %slen_b;")
        elif s == "ld.param.u32 %tmp0, [seqlen_k];":
            lines.append("mov.u32 %tmp0, %cap;")
        else:
            lines.append(s)
    return "\n".join(lines)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("gqa", [1, 3])
def test_decode_equals_kvcache_task_and_split(causal, gqa):
    Ptx = _sched_interp()
    cfg = kv(causal=causal, gqa_ratio=gqa)
    text = _decode_segment(build_sm100(cfg)[0])
    seg = Ptx(text)
    sqt, ng = cfg.seq_q_per_tile, cfg.head_groups
    rng = random.Random(7)
    n = 0
    for _ in range(60):
        batch, hkv, sq = rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 2, 3, 130, 300, 700])
        cap, S = rng.choice([1, 128, 300, 1024, 5000]), rng.choice([1, 2, 3, 7, 16])
        lens = [rng.choice([-5, 0, 1, 127, 129, cap, cap + 40, rng.randint(0, cap)]) for _ in range(batch)]
        nmb = -(-sq // sqt)
        npairs = (nmb + 1) // 2
        for t in range(min(batch * hkv * ng * npairs * S, 400)):
            split, m, b, hg = kvcache_task(t, S, npairs, hkv * ng)
            kl = kvcache_k_len(lens[b], cap)
            info = BlockInfo.of(m, 2 * sqt, sq, kl, causal, split, S)
            out = seg.run({"%task": t, "%nsplit": S, "%batch": batch, "%hkv_n": hkv, "%sq": sq, "%cap": cap,
                           "%slen_b": lens[b] & 0xFFFFFFFF, "%tmp0": 0, "%tmp1": 0, "%npairs": npairs})
            got = (out["%split"], out["%mpair"], out["%b"], out["%hkv"], out["%skv"], out["%nlo"], out["%n"])
            assert got == (split, m, b, hg, kl, info.lo, info.n), (batch, hkv, sq, cap, S, lens, t)
            n += 1
    assert n > 1000


# ---- the simulator ---------------------------------------------------------------------------------------
def _problem(cfg, B, sq, hkv, cap, seed):
    rng = np.random.default_rng(seed)
    hq, d = hkv * cfg.gqa_ratio, cfg.head_dim
    q = round_to_dtype(rng.standard_normal((B, sq, hq, d)), cfg.dtype)
    kc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), cfg.dtype)
    vc = round_to_dtype(rng.standard_normal((B, cap, hkv, d)), cfg.dtype)
    if not cfg.page_size:
        return q, kc, vc, kc, vc, None
    ps, mp = cfg.page_size, cap // cfg.page_size
    pt = rng.permutation(B * mp).reshape(B, mp) + 1  # page 0 is never used; the last entry is clamped
    kp = np.zeros((B * mp + 1, ps, hkv, d), kc.dtype)
    vp = np.zeros_like(kp)
    for b in range(B):
        for i in range(mp):
            kp[pt[b, i]], vp[pt[b, i]] = kc[b, i * ps:(i + 1) * ps], vc[b, i * ps:(i + 1) * ps]
    return q, kc, vc, kp, vp, pt


@pytest.mark.parametrize("cfg, sq, S", [
    (kv(head_dim=64, gqa_ratio=4), 2, 3),
    (kv(head_dim=64, gqa_ratio=4), 2, 1),
    (kv(head_dim=64, causal=True, page_size=64), 3, 5),
    (kv(head_dim=64, causal=True, gqa_ratio=8, page_size=16), 1, 2),
    (kv(head_dim=64, page_size=256, gqa_ratio=3), 1, 4),
], ids=lambda x: x.name if isinstance(x, KernelConfig) else str(x))
def test_simulator_matches_the_exact_attention(cfg, sq, S):
    B, hkv, cap = 4, 1, 512
    lens = (0, 300, 512 + 77, -3)  # no keys, a partial block, past the capacity, negative
    q, kc, vc, kin, vin, pt = _problem(cfg, B, sq, hkv, cap, 1)
    res = simulate_kvcache(cfg, q, kin, vin, np.array(lens, np.int64), pt, num_splits=S, num_ctas=3, seed=2)
    assert not res.findings, res.findings
    if S > 1:
        assert not np.isnan(res.o_partial).any() and not np.isnan(res.lse_partial).any()
    for b, ln in enumerate(lens):
        kl = kvcache_k_len(ln, cap)
        if kl == 0:
            assert np.all(res.o[b] == 0) and np.all(np.isneginf(res.lse[b]))
            continue
        o, lse = (np.asarray(x)[0] for x in attention_exact(q[b:b + 1], kc[b:b + 1, :kl], vc[b:b + 1, :kl],
                                                              cfg.causal))
        fin = np.isfinite(lse)
        assert np.array_equal(np.isfinite(res.lse[b]), fin)
        assert np.max(np.abs(res.lse[b][fin] - lse[fin]), initial=0) < 1e-3
        assert np.max(np.abs(res.o[b] - o)) < 2e-2


# ---- ptxas and the dense kernels -------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")
@pytest.mark.parametrize("cfg", [kv(), kv(causal=True, page_size=16), kv(head_dim=64, gqa_ratio=8, page_size=256,
                                                                        dtype="fp16"),
                                 kv(causal=True, gqa_ratio=4, page_size=64)], ids=lambda c: c.name)
def test_ptxas_accepts_without_spills(cfg):
    ptx, man = built(cfg)
    res = asm.assemble(ptx, "sm_100a", name=man["name"], backend="ptxas")  # strict policy: spills are errors
    for entry in (man["entry"], COMBINE_ENTRY):
        kern = res.kernel(entry)
        assert kern.spills == 0 and kern.stack_frame == 0


@pytest.mark.parametrize("name", ["fa4_sm100a_d128_bf16_causal_gqa1", "fa4_sm100a_d64_bf16_noncausal_gqa4",
                                  "fa4_sm100a_d128_bf16_causal_gqa4_varlen"])
def test_dense_and_varlen_ptx_unchanged(name):
    """The golden files under generated/ (dense and varlen) are what the generator still emits, and
    carry none of the KV-cache text."""
    import json
    man = json.loads((ROOT / "generated" / f"{name}.json").read_text())
    cfg = KernelConfig.from_dict(man["config"])
    ptx = build_sm100(cfg)[0]
    assert ptx == (ROOT / "generated" / f"{name}.ptx").read_text()
    for word in ("num_splits", "o_partial", "cache_seqlens", COMBINE_ENTRY, "%nlo"):
        assert word not in ptx


# ---- emulation (a small set; bench/README.md "Removed probes" has the whole matrix's run) -------------
def _first_batch(man):
    from fa4gen.evidence.ptxemu.kvcache import default_kv_shapes
    return default_kv_shapes(man)[:1]  # Sq = 3, 3 splits (uneven and empty), no keys, past the capacity


@pytest.mark.parametrize("cfg", [kv(head_dim=64, gqa_ratio=4), kv(head_dim=64, causal=True, gqa_ratio=8, page_size=16)],
                         ids=lambda c: c.name)
def test_emulated_module_matches_the_exact_attention(cfg):
    """fa4_fwd then fa4_combine in the PTX emulator (fa4gen emulate), judged per sequence."""
    from fa4gen.evidence.ptxemu import harness
    ptx, man = built(cfg)
    rep = harness.emulate_file("k.ptx", ptx_text=ptx, manifest=man, shapes=_first_batch(man), seeds=1)
    assert rep.ok, rep.summary()


@pytest.mark.parametrize("name, edit", [
    ("every box from page 0", lambda t: re.sub(r"%prow, %pg[1-9]\}", "%prow, %pg0}", t)),
    ("softmax block offset dropped", lambda t: t.replace("    add.u32 %nb, %nb, %nlo;\n", "", 1)),
])
def test_emulation_fails_a_mutated_kvcache_line(name, edit):
    from fa4gen.evidence.ptxemu import harness
    ptx, man = built(kv(head_dim=64, causal=True, gqa_ratio=8, page_size=16))
    bad = edit(ptx)
    assert bad != ptx
    rep = harness.emulate_file("k.ptx", ptx_text=bad, manifest=man, shapes=_first_batch(man), seeds=1,
                               stop_on_failure=True)
    assert not rep.ok, name
