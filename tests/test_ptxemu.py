"""The PTX emulator: the emitted kernels of both targets executed as text, the PTX mutation corpus,
and the emulator's own semantics (exact rounding, descriptors against TMA layouts, SIMT control
flow, barriers, faults) on small handwritten kernels."""
from __future__ import annotations

import functools
import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fa4gen import codegen
from fa4gen.cli import main as cli_main
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.tiles import q_tile_rows
from fa4gen.spec.encodings import SmemMatrixDesc, Swizzle, TcgenInstrDesc, TmaDtype
from fa4gen.evidence.ptxemu import fp, units
from fa4gen.evidence.ptxemu.harness import Shape, default_shapes, emulate_file, run_once, run_raw
from fa4gen.evidence.ptxemu.machine import Fault
from fa4gen.evidence.ptxemu.mutations import CHECK_MUTATIONS, PTX_MUTATIONS
from fa4gen.evidence.ptxemu.parse import UnsupportedInstruction, parse

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "generated"
GOLDEN = sorted(p.stem for p in GEN.glob("*.ptx"))  # every checked-in kernel, both targets


def _golden_arch(name: str) -> str:
    return json.loads((GEN / f"{name}.json").read_text())["arch"]


SM100_GOLDEN = [n for n in GOLDEN if _golden_arch(n) == "sm_100a"]
SM90_GOLDEN = [n for n in GOLDEN if _golden_arch(n) == "sm_90a"]
# every sm_90a kernel the GPU tests run (tests/test_gpu.py): D x dtype x causal x GQA, both exp2 splits
# D = 64: the default exp2 split on the 192-row tile fa4gen.attention runs (three consumers), the
# seed's split on the 128-row one (two consumers), so both tiles and both splits execute
SM90_VARIANTS = [dict(arch="sm_90a", head_dim=d, dtype=dt, causal=c, gqa_ratio=g, emu_pairs=e,
                      block_m=q_tile_rows("sm_90a", d, g) if e is None else 128)
                 for d in (64, 128) for dt in ("bf16", "fp16") for c in (False, True) for g in (1, 2, 4, 8)
                 for e in (None, 2)]


@functools.lru_cache(maxsize=None)
def _emitted(items: tuple):
    res = codegen.build(KernelConfig(**dict(items)), emit=("ptx",), verify=False)
    return res.ptx, res.manifest


def emitted(**cfg):
    return _emitted(tuple(sorted(cfg.items())))


# ---- the kernels ------------------------------------------------------------------------------------
def test_golden_matrix_is_the_generated_matrix():
    """generated/ holds the default sm_100a matrix, the sm_90a review variant and its 192-row tile, and
    a varlen and a KV-cache variant of each target (scripts/regen_generated.py)."""
    assert GOLDEN == sorted(c.name for c in codegen.GENERATED_MATRIX)
    varlen = {c.arch: c.name for c in codegen.VARLEN_REVIEW_CONFIGS}
    kv = {c.arch: [c.name] for c in codegen.KVCACHE_REVIEW_CONFIGS}
    assert SM100_GOLDEN == sorted([c.name for c in codegen.DEFAULT_MATRIX] + [varlen["sm_100a"]] + kv["sm_100a"])
    assert SM90_GOLDEN == sorted([codegen.SM90_REVIEW_CONFIG.name, codegen.SM90_WIDE_REVIEW_CONFIG.name,
                                  varlen["sm_90a"]] + kv["sm_90a"]) == [
        "fa4_sm90a_d128_bf16_causal_gqa1", "fa4_sm90a_d128_bf16_causal_gqa4_kvcache_p64",
        "fa4_sm90a_d128_bf16_causal_gqa4_varlen", "fa4_sm90a_d64_bf16_causal_gqa4_m192"]
    for name in GOLDEN:  # the file name, the manifest and the PTX header agree on the target
        ptx = (GEN / f"{name}.ptx").read_text()
        arch = _golden_arch(name)
        assert f".target {arch}\n" in ptx and name.startswith(f"fa4_{arch.replace('_', '')}_")


@pytest.mark.parametrize("name", GOLDEN)
def test_generated_ptx_emulates(name):
    """The checked-in golden PTX of both targets (the text reviewers read) computes attention: two
    seeds on shapes with tails, a partial second task, GQA packing and (causal) Sq < Skv and Sq > Skv."""
    rep = emulate_file(GEN / f"{name}.ptx", seeds=2)
    assert rep.ok, rep.summary()
    # every run did real work (the API's default launch without LSE and the one-row launch over one
    # whole block are the smallest problems)
    assert all(r.warp_instructions > (10_000 if r.shape.with_lse and getattr(r.shape, "sq", 2) > 1 else 1_000)
               for r in rep.runs)
    assert_every_block_ran(rep)
    if name == "fa4_sm90a_d128_bf16_causal_gqa1":
        assert_mask_boundaries_met(rep, (GEN / f"{name}.ptx").read_text())


def assert_mask_boundaries_met(rep, ptx: str):
    """The 128-row causal tile over blocks of 128 keys: the default shapes meet every column's mask
    comparison (`setp.le %limH, c`) at equality on every path, but three no input can: half 0 of the
    first block at c = 121 (its last row, 119, sees at most 120 keys there) and half 1 of a later
    masked block at c = 0 and 1 (its rows see at least 9 keys of the lower block). The LSE store's
    row guard is met at row == Sq too."""
    lines = ptx.split("\n")
    cov = rep.coverage.entries["fa4_fwd"]
    first = {k for k, ln in enumerate(lines, 1) if re.match(r"\$L_consumer_masked\d+:", ln.strip())}
    first_masked, loop_masked = sorted(first)[:2]
    missed = set()
    for pc in cov.boundary_misses():
        ln = cov.lines[pc]
        m = re.match(r"\s*setp\.le\.s32 %pp\d+, %lim(\d), (\d+);", lines[ln - 1])
        assert m, f"PTX line {ln} never met at its boundary: {lines[ln - 1].strip()}"
        missed.add(("loop" if ln > loop_masked else "first", int(m.group(1)), int(m.group(2))))
    assert missed == {("first", 0, 121), ("loop", 1, 0), ("loop", 1, 1)}, missed


def assert_every_block_ran(rep):
    """The default shapes reach every basic block of every entry: no path of the shipped PTX goes
    unexecuted (a path no input can reach is dead code, which the generator must not emit)."""
    for entry, cov in rep.coverage.entries.items():
        hit, total = cov.block_fraction()
        assert hit == total, f"{entry}: {hit}/{total} basic blocks\n" + "\n".join(cov.summary())


# A variant whose kernel is a golden file is emulated there (the same PTX, default shapes and seeds:
# test_sm100_emit.py holds generated/ equal to a fresh build), not twice.
SM90_EMULATED_HERE = [c for c in SM90_VARIANTS if KernelConfig(**c).name not in GOLDEN]


def test_every_sm90_gpu_variant_is_emulated_once():
    golden = [c for c in SM90_VARIANTS if c not in SM90_EMULATED_HERE]
    assert len(golden) == 2 and len(SM90_EMULATED_HERE) == len(SM90_VARIANTS) - 2
    for c in golden:
        assert json.loads((GEN / f"{KernelConfig(**c).name}.json").read_text())["config"] == KernelConfig(**c).to_dict()


@pytest.mark.parametrize("cfg", SM90_EMULATED_HERE, ids=lambda c: KernelConfig(**c).name)
def test_sm90_gpu_variants_emulate(cfg):
    ptx, man = emitted(**cfg)
    rep = emulate_file(Path(man["name"] + ".ptx"), ptx_text=ptx, manifest=man, seeds=2)
    assert rep.ok, rep.summary()
    assert_every_block_ran(rep)


# GQA ratios that do not divide 128 (tiles.gqa_pack: one query head per tile, G head groups per kv
# head): (G, D, causal, dtype, shapes B,Sq,Skv,Hq,Hkv) with tails on both lengths, Sq != Skv both
# ways, two kv heads (the K/V head of head group hg is hg // G) and a batch of two.
ANY_RATIO_VARIANTS = [
    (3, 64, True, "bf16", ["1,150,97,6,2", "1,61,200,6,2"]),
    (5, 128, False, "bf16", ["1,195,203,10,2"]),
    (6, 128, True, "fp16", ["1,40,300,6,1", "2,70,129,12,2"]),
    (7, 64, True, "bf16", ["1,130,260,14,2"]),
    (12, 64, True, "bf16", ["1,70,129,12,1"]),
]


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
@pytest.mark.parametrize("variant", ANY_RATIO_VARIANTS, ids=lambda v: f"gqa{v[0]}_d{v[1]}_{'c' if v[2] else 'nc'}")
def test_any_gqa_ratio_emulates(variant, arch):
    g, d, causal, dtype, shapes = variant
    ptx, man = emitted(arch=arch, head_dim=d, dtype=dtype, causal=causal, gqa_ratio=g)
    assert man["gqa"]["pack"] == 1 and man["gqa"]["head_groups"] == g
    rep = emulate_file(Path(man["name"] + ".ptx"), ptx_text=ptx, manifest=man, seeds=1,
                       shapes=[Shape.parse(x) for x in shapes])
    assert rep.ok, rep.summary()


def test_a_wrong_kv_head_of_an_unpacked_ratio_is_caught():
    """The K/V head divide is what the emulator checks: dividing the head group by 4 instead of 3
    reads kv head 0 for query head 3 (of kv head 1)."""
    ptx, man = emitted(arch="sm_90a", head_dim=64, dtype="bf16", causal=True, gqa_ratio=3)
    assert "div.u32 %c1, %hkv, 3;" in ptx
    rep = emulate_file(Path("k.ptx"), ptx_text=ptx.replace("div.u32 %c1, %hkv, 3;", "div.u32 %c1, %hkv, 4;"),
                       manifest=man, seeds=1, shapes=[Shape.parse("1,61,200,6,2")])
    assert not rep.ok and {r.finding for r in rep.runs} == {"mismatch"}, rep.summary()


def test_default_shapes_of_unpacked_ratios():
    for arch in ("sm_100a", "sm_90a"):
        _, man = emitted(arch=arch, head_dim=64, dtype="bf16", causal=True, gqa_ratio=5)
        shapes = default_shapes(man)
        assert all(s.hq == 5 * s.hkv and s.sq % 128 for s in shapes)
        assert [s.skv % 128 for s in shapes].count(0) == 1  # the block-aligned one (Sq = 1, one block)


def test_default_shapes_exercise_tails_masking_and_the_persistent_loop():
    for name in GOLDEN:
        man = json.loads((GEN / f"{name}.json").read_text())
        if man["config"].get("varlen") or man["config"].get("kvcache"):  # ragged / decode defaults: checked in
            continue  # tests/test_varlen_sm100.py and tests/test_kvcache_tools.py
        rows = 128 // man["config"]["gqa_ratio"]
        shapes = default_shapes(man)
        assert all(s.sq % rows for s in shapes)  # a query tail everywhere
        # a key tail everywhere but on one shape: one query row before one whole block, the one launch
        # whose first block runs unmasked (a key tail masks the first block of every other)
        assert [(s.sq, s.skv) for s in shapes if not s.skv % 128] == [(1, 128)]
        if man["config"]["causal"]:
            assert any(s.sq > s.skv for s in default_shapes(man))  # rows that see no key


def test_default_shapes_run_tasks_that_see_no_key():
    """plan.BlockInfo's empty units and splits (one fully masked block, O = 0, LSE = -inf) are in the
    default launches test_generated_ptx_emulates runs: causal dense kernels get a first m unit (the
    task's tiles) above the diagonal, KV-cache kernels a split past a sequence's blocks and a
    sequence with no key."""
    from fa4gen.spec.plan import BlockInfo
    from fa4gen.runtime.runtime import manifest_gqa, manifest_tile_rows
    from fa4gen.spec.schedule import kvcache_k_len
    for name in GOLDEN:
        man = json.loads((GEN / f"{name}.json").read_text())
        cfg = man["config"]
        unit = manifest_tile_rows(man) // manifest_gqa(man)[1] * int(man["grid"]["tiles_per_task"])
        if cfg.get("kvcache"):
            found = set()
            for s in default_shapes(man):
                units = -(-s.sq // unit)
                for kl in (kvcache_k_len(x, s.capacity) for x in s.seqlens):
                    infos = [BlockInfo.of(m, unit, s.sq, kl, cfg["causal"], sp, s.num_splits)
                             for m in range(units) for sp in range(s.num_splits)]
                    found |= {"empty split" for i in infos if i.empty and i.end > 0}
                    found |= {"no key" for i in infos if i.end == 0}
            assert found == {"empty split", "no key"}, name
        elif cfg["causal"] and not cfg.get("varlen"):
            assert any(BlockInfo.of(0, unit, s.sq, s.skv, True).empty for s in default_shapes(man)), name


def test_default_shapes_end_with_the_apis_default_launch_without_lse():
    """fa4gen.attention without return_lse passes lse_ptr = 0: the first default launch of dense and varlen
    kernels does too (a store through it faults: GMEM_OOB), every other one asks for LSE; KV-cache kernels
    end with one split and no LSE."""
    for name in GOLDEN:
        man = json.loads((GEN / f"{name}.json").read_text())
        shapes = default_shapes(man)
        if man.get("kvcache"):
            assert not shapes[-1].with_lse and shapes[-1].num_splits == 1
        else:
            assert not shapes[0].with_lse and all(s.with_lse for s in shapes[1:])
    assert not Shape.parse("1,3,70,4,1,nolse").with_lse and Shape.parse("1,3,70,4,1").with_lse
    assert str(Shape.parse("1,3,70,4,1,nolse")).endswith("no-LSE")
    from fa4gen.evidence.ptxemu.harness import VarShape
    assert not VarShape.parse("3:70,0:5;4,1;nolse").with_lse and VarShape.parse("3:70,0:5;4,1").with_lse


# ---- the corpus ----------------------------------------------------------------------------------
def test_corpus_covers_the_bug_classes():
    names = {m.name for m in PTX_MUTATIONS}
    assert len(names) == len(PTX_MUTATIONS) >= 15
    for needed in ("init_count_s_ready", "tmem_lane_field", "idesc_transpose_b", "idesc_m_field", "v_desc_lbo",
                   "qk_kstep_panel_jump", "expect_tx_bytes", "dropped_commit_s_ready", "dropped_wait_ld",
                   "dropped_wait_st", "dropped_arrive_p_ready_2", "wait_parity_flipped", "wait_on_wrong_barrier",
                   "duplicated_scale", "dropped_normalisation", "sm90_wait_group_shallow",
                   "sm90_swap_kv_full_barriers", "dropped_fence_after_p_wait", "dropped_store_wait_read",
                   "dropped_setup_sync", "window_begin_word_dropped", "window_unmasked_lo_ignored",
                   "sink_dropped_from_divisor", "sm90_window_unmasked_lo", "sm90_sink_units"):
        assert needed in names


@pytest.mark.parametrize("mut", PTX_MUTATIONS, ids=lambda m: m.name)
def test_ptx_mutation_is_caught(mut):
    ptx, man = emitted(**mut.config)
    broken = mut.apply(ptx, man)
    ctas = 2
    if mut.persistent:
        man = json.loads(json.dumps(man))
        man["grid"]["policy"], ctas = "persistent", 1
    rep = emulate_file(Path(man["name"] + ".ptx"), ptx_text=broken, manifest=man, seeds=1, ctas=ctas,
                       stop_on_failure=True)
    assert not rep.ok, f"{mut.name} passed the emulator"
    found = {r.finding for r in rep.runs if not r.ok}
    assert found & set(mut.expect), f"{mut.name}: findings {found}, expected one of {mut.expect}\n{rep.summary()}"


# Every kernel the corpus edits passes unedited. One that a golden file or an sm_90a GPU variant
# already is (same config, hence same PTX, default shapes and seeds 0..1 there) is emulated by that
# test, not again here. One test per kernel (not one loop over all): each is minutes of emulation,
# and separate items let the test workers share them.
CORPUS_ONLY = [cfg for cfg in sorted({tuple(sorted(m.config.items())) for m in PTX_MUTATIONS})
               if KernelConfig(**dict(cfg)).name not in set(GOLDEN) | {KernelConfig(**c).name for c in SM90_EMULATED_HERE}]


def test_the_corpus_edits_kernels_beyond_the_golden_set_and_the_gpu_variants():
    assert len(CORPUS_ONLY) >= 1


@pytest.mark.parametrize("cfg", CORPUS_ONLY, ids=lambda c: KernelConfig(**dict(c)).name)
def test_unmutated_kernels_of_the_corpus_pass(cfg):
    ptx, man = _emitted(cfg)
    rep = emulate_file(Path("k.ptx"), ptx_text=ptx, manifest=man, seeds=1)
    assert rep.ok, rep.summary()
    assert_every_block_ran(rep)


# ---- exact arithmetic ------------------------------------------------------------------------------
def _round_f32(x: Fraction, mode: str) -> np.float32:
    f = np.float32(float(x))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    if mode == "rm":
        return max(c for c in cands if Fraction(float(c)) <= x)
    if mode == "rp":
        return min(c for c in cands if Fraction(float(c)) >= x)
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))
    return best


def test_fma_rounds_once_even_where_float64_would_double_round():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = (rng.standard_normal(3000) * 1e-3).astype(np.float32)
    # constructed ties: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is an f32 midpoint; c = +-2^-60 decides it
    t = np.float32(1 + 2.0 ** -12)
    a = np.concatenate([a, [t, t, -t]]).astype(np.float32)
    b = np.concatenate([b, [t, t, t]]).astype(np.float32)
    c = np.concatenate([c, [2.0 ** -60, -(2.0 ** -60), 2.0 ** -60]]).astype(np.float32)
    got = fp.fma(a, b, c)
    for i in range(a.size):
        want = _round_f32(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])), "rn")
        assert got[i] == want, (i, a[i], b[i], c[i], got[i], want)
    naive = (a.astype(np.float64) * b + c).astype(np.float32)
    assert (naive[-3:] != got[-3:]).any()  # the naive float64 path gets a tie wrong


def test_add_rm_is_directed():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(2000) * 1e3).astype(np.float32)
    b = (rng.standard_normal(2000) * 1e-4).astype(np.float32)
    for mode in ("rm", "rp"):
        got = fp.add(a, b, mode)
        for i in range(0, a.size, 7):
            assert got[i] == _round_f32(Fraction(float(a[i])) + Fraction(float(b[i])), mode)


def test_bf16x2_pack_puts_the_first_source_high():
    ptx = _kernel(".param .u64 out", """
    .reg .b64 %rd<2>; .reg .b32 %r<2>; .reg .f32 %f<2>;
    ld.param.u64 %rd0, [out];
    mov.f32 %f0, 0f3F800000;
    mov.f32 %f1, 0fC0000000;
    cvt.rn.bf16x2.f32 %r0, %f0, %f1;
    st.global.u32 [%rd0], %r0;
    ret;""")
    out, = run_raw(ptx, threads=1, args=(np.zeros(1, np.uint32),))
    assert out[0] == (0x3F80 << 16 | 0xC000)


def test_bf16x2_pack_rounds_each_lane_like_the_scalar_conversion():
    """cvt.rn.bf16x2.f32 of 32 lanes (ties to even both ways, carries into the exponent, infinities,
    subnormals, a NaN in one warp and none in the other) equals fp.f32_to_bf16_bits of each source."""
    ptx = _kernel(".param .u64 src,\n    .param .u64 out", """
    .reg .b64 %rd<4>; .reg .b32 %r<3>; .reg .f32 %f<2>;
    ld.param.u64 %rd0, [src];
    ld.param.u64 %rd1, [out];
    mov.u32 %r0, %tid.x;
    mul.wide.u32 %rd2, %r0, 8;
    add.s64 %rd2, %rd0, %rd2;
    ld.global.f32 %f0, [%rd2];
    ld.global.f32 %f1, [%rd2+4];
    cvt.rn.bf16x2.f32 %r1, %f0, %f1;
    mul.wide.u32 %rd3, %r0, 4;
    add.s64 %rd3, %rd1, %rd3;
    st.global.u32 [%rd3], %r1;
    ret;""")
    rng = np.random.default_rng(4)
    special = np.array([0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                        0x80008000, 0x00018000, 0x3F800000, 0xBF808001, 0x477FE000], np.uint32)
    src = rng.integers(0, 1 << 32, (64, 2), dtype=np.uint64).astype(np.uint32)
    src[:12, 0], src[12:24, 1] = special, special
    src[src.view(np.float32) != src.view(np.float32)] = 0x3F808000  # no NaN in the first warp
    src[40, 1] = 0x7FC00001  # one in the second
    _, out = run_raw(ptx, threads=64, args=(src.view(np.float32).copy(), np.zeros(64, np.uint32)))
    f = src.view(np.float32)
    want = fp.f32_to_bf16_bits(f[:, 0]).astype(np.uint32) << 16 | fp.f32_to_bf16_bits(f[:, 1]).astype(np.uint32)
    assert np.array_equal(out, want)


# ---- descriptors read what TMA wrote ---------------------------------------------------------------
def _tma_tile(rows: int, cols: int, base: int, swizzle: Swizzle = Swizzle.B128):
    """SMEM byte address of element (r, c) of a [rows, cols] bf16 tile written by TMA boxes one
    swizzle row wide (128B: 64 columns, 64B: 32), panels of rows x span bytes back to back (the
    kernels' Q/K/V layout, plan.Panels)."""
    span = swizzle.span_bytes
    w = span // 2
    tm = units.TensorMap(TmaDtype.BFLOAT16, 2, swizzle, 0, (cols, rows), (cols * 2,), (w, rows), (1, 1), 0, 0)
    addr = np.zeros((rows, cols), np.int64)
    for p in range(cols // w):
        _, _, phys = units.tma_box_plan(tm, (w * p, 0), base + p * rows * span)
        addr[:, w * p: w * p + w] = phys.reshape(rows, w)
    return addr


@pytest.mark.parametrize("swizzle", [Swizzle.B128, Swizzle.B64])
def test_tma_swizzle_is_the_isa_chunk_pattern(swizzle):
    """The swizzle as the PTX ISA's tensor-copy swizzling modes draw it, row by row (not as address
    bits): in a pattern of 8 rows of span bytes on its 8 * span boundary, 16-byte chunk c of row r
    lies at chunk c ^ (r % 8) of the row for 128B, and at c ^ ((r / 2) % 4) for 64B, whose 64-byte
    rows pair up into the 128-byte lines the pattern permutes (CuTe's Swizzle<3,4,3> and <2,4,3>)."""
    span, base, rows = swizzle.span_bytes, 8192, 16
    addr = _tma_tile(rows, span // 2, base, swizzle)
    for r in range(rows):
        for c in range(span // 16):
            line = r if swizzle is Swizzle.B128 else r // 2
            want = base + r * span + 16 * (c ^ (line % 8 if swizzle is Swizzle.B128 else line % 4))
            assert addr[r, 8 * c] == want and addr[r, 8 * c + 7] == want + 14


# The 64B swizzle mode's code in each descriptor format, as the PTX ISA's tables give it: the wgmma
# matrix descriptor's bits 62-63 (2 = 64B) and the tcgen05 shared memory descriptor's bits 61-63
# (0 none, 1 128B with 32B atoms, 2 128B, 4 64B, 6 32B: 4 = 64B).
SWIZZLE_64B_FIELD = {"sm_90a": (62, 2), "sm_100a": (61, 4)}


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_k_major_64b_descriptor_k_steps_read_the_d96_tile(arch):
    """D = 96: three 32-column panels with 64B swizzle; k16 step k reads panel k // 2, 32 bytes further
    along its rows per step (the QK^T steps of both lowerings), through SmemMatrixDesc.k_major (SBO 512),
    whose swizzle field holds the ISA's 64B code of its format."""
    base, rows = 4096, 128
    tile = _tma_tile(rows, 96, base, Swizzle.B64)
    lo, code = SWIZZLE_64B_FIELD[arch]
    for k0 in range(0, 96, 16):
        panel, within = divmod(k0, 32)
        value = SmemMatrixDesc.k_major(arch, base + panel * rows * 64 + within * 2, Swizzle.B64).encode()
        assert value >> lo == code
        d = units.decode_desc(value, arch)
        assert (d.sbo, d.swizzle) == (512, Swizzle.B64)
        assert np.array_equal(units.operand_addresses(d, False, 128, 16, 2), tile[:, k0:k0 + 16])


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_mn_major_64b_descriptor_reads_v96_with_its_panel_stride(arch):
    """D = 96's V (keys x 96, three 32-column 64B panels): one MN-major descriptor spans N = 96 through
    LBO = the panel stride, and k16 step j starts 16 key rows (1024 bytes) further."""
    base = 8192
    v = _tma_tile(128, 96, base, Swizzle.B64)
    lo, code = SWIZZLE_64B_FIELD[arch]
    for k0 in range(0, 128, 16):
        value = SmemMatrixDesc.mn_major(arch, base + k0 * 64, Swizzle.B64, panel_stride=128 * 64).encode()
        assert value >> lo == code
        d = units.decode_desc(value, arch)
        got = units.operand_addresses(d, True, 96, 16, 2)  # [n = d, k = key]
        assert np.array_equal(got, v[k0:k0 + 16, :].T)
        wrong = units.operand_addresses(units.MatDesc(d.start, d.lbo, d.sbo, 0, Swizzle.B128), True, 96, 16, 2)
        assert not np.array_equal(wrong, got)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_k_major_descriptor_k_steps_read_the_tma_tile(arch):
    base = 2048
    tile = _tma_tile(128, 128, base)
    for k0 in range(0, 128, 16):
        panel, within = divmod(k0, 64)
        start = base + panel * 128 * 128 + within * 2
        d = units.decode_desc(SmemMatrixDesc.k_major_sw128(arch, start, pattern_start=base + panel * 16384).encode(), arch)
        got = units.operand_addresses(d, False, 128, 16, 2)
        assert np.array_equal(got, tile[:, k0:k0 + 16])


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_mn_major_descriptor_reads_v_with_its_panel_stride(arch):
    base = 4096
    v = _tma_tile(128, 128, base)  # V[key, d]: d contiguous, 64-column panels of 128 keys
    for k0 in range(0, 128, 16):
        start = base + k0 * 128
        d = units.decode_desc(SmemMatrixDesc.mn_major_sw128(arch, start, panel_stride=128 * 128,
                                                            pattern_start=base).encode(), arch)
        got = units.operand_addresses(d, True, 128, 16, 2)  # [n = d, k = key]
        assert np.array_equal(got, v[k0:k0 + 16, :].T)
        wrong = units.operand_addresses(units.MatDesc(d.start, d.lbo // 2, d.sbo, 0, d.swizzle), True, 128, 16, 2)
        assert not np.array_equal(wrong, got)


def test_instruction_descriptor_fields_are_decoded():
    v = TcgenInstrDesc.for_dtype("bf16", 128, 256).encode()
    d = units.decode_idesc(v)
    assert (d.m, d.n, int(d.a_type), int(d.b_major)) == (128, 256, 1, 0)
    with pytest.raises(units.UnitError):
        units.decode_idesc(v | 1 << 6)  # a reserved bit


def test_tma_box_fills_out_of_bounds_and_swizzles_by_address():
    tm = units.TensorMap(TmaDtype.BFLOAT16, 2, Swizzle.B128, 0, (64, 10), (128,), (64, 16), (1, 1), 0, 0)
    off, valid, phys = units.tma_box_plan(tm, (0, 4), 1024)
    assert valid.reshape(16, 64)[:6].all() and not valid.reshape(16, 64)[6:].any()
    row1 = phys.reshape(16, 64)[1]
    assert row1[0] == 1024 + 128 + 16  # row 1's first 16-byte chunk moves to chunk 1
    with pytest.raises(units.UnitError):
        units.tma_box_plan(tm, (0, 0), 1024 + 128)  # not on the 1024-byte pattern boundary


# ---- the machine on small kernels -------------------------------------------------------------------
def _kernel(params: str, body: str, extra: str = "") -> str:
    return f""".version 8.5
.target sm_90a
.address_size 64
.extern .shared .align 1024 .b8 smem[];
.visible .entry k(
    {params}
)
{extra}{{
{body}
}}
"""


def test_divergent_branches_reconverge():
    ptx = _kernel(".param .u64 out", """
    .reg .pred %p; .reg .b32 %t, %v; .reg .b64 %a, %o;
    ld.param.u64 %o, [out];
    mov.u32 %t, %tid.x;
    and.b32 %v, %t, 1;
    setp.eq.u32 %p, %v, 1;
    @%p bra $odd;
    mov.u32 %v, 100;
    bra $join;
$odd:
    mov.u32 %v, 200;
$join:
    add.u32 %v, %v, %t;
    mul.wide.u32 %a, %t, 4;
    add.s64 %a, %o, %a;
    st.global.u32 [%a], %v;
    ret;""")
    out, = run_raw(ptx, threads=64, args=(np.zeros(64, np.uint32),))
    t = np.arange(64)
    assert np.array_equal(out, np.where(t % 2, 200, 100) + t)


def test_coverage_records_blocks_and_branch_directions():
    """Coverage (fa4gen/evidence/ptxemu/coverage.py): a guarded branch taken by some lanes is seen both ways,
    one no lane takes is reported "never taken" with its line, and the block only it leads to is not
    reached; the block split follows labels, branches and exits."""
    from fa4gen.evidence.ptxemu.coverage import Coverage, basic_blocks
    from fa4gen.evidence.ptxemu.parse import parse

    ptx = _kernel(".param .u64 out", """
    .reg .pred %p, %q; .reg .b32 %t, %v; .reg .b64 %a, %o;
    ld.param.u64 %o, [out];
    mov.u32 %t, %tid.x;
    and.b32 %v, %t, 1;
    setp.eq.u32 %p, %v, 1;
    setp.gt.u32 %q, %t, 1000;
    @%q bra $never;
    @%p bra $odd;
    mov.u32 %v, 100;
    bra $join;
$never:
    mov.u32 %v, 7;
$odd:
    mov.u32 %v, 200;
$join:
    mul.wide.u32 %a, %t, 4;
    add.s64 %a, %o, %a;
    st.global.u32 [%a], %v;
    ret;""")
    mod = parse(ptx)
    blocks = basic_blocks(mod)
    assert [b.label for b in blocks] == ["", "", "", "$never", "$odd", "$join"]
    cov = Coverage()
    run_raw(ptx, threads=64, args=(np.zeros(64, np.uint32),), coverage=cov)
    (entry,) = cov.entries.values()
    assert [b.label for b in entry.unreached_blocks()] == ["$never"]
    assert entry.block_fraction() == (5, 6) and entry.branch_fraction() == (1, 2)
    lines = ptx.splitlines()
    never_line = next(i + 1 for i, ln in enumerate(lines) if "@%q bra $never" in ln)
    assert [(entry.lines[pc], bits) for pc, bits in entry.one_way_branches()] == [(never_line, 2)]
    assert "never taken" in cov.summary() and not cov.complete
    run_raw(ptx.replace("setp.gt.u32 %q, %t, 1000", "setp.gt.u32 %q, %t, 40"), threads=64,
            args=(np.zeros(64, np.uint32),), coverage=cov)  # a second run merges: now both ways, all blocks
    assert cov.complete, cov.summary()


def test_a_default_emulation_reports_its_coverage_by_role():
    name = "fa4_sm100a_d64_bf16_noncausal_gqa1"
    rep = emulate_file(GEN / f"{name}.ptx", seeds=1, shapes=[Shape.parse("1,130,130,1,1")])
    cov = rep.coverage.entries["fa4_fwd"]
    roles = {r["role"] for r in json.loads((GEN / f"{name}.json").read_text())["roles"]}
    assert set(cov.hits) <= roles and {"load", "mma", "correction"} <= set(cov.hits)
    hit, total = cov.block_fraction()
    assert 0 < hit <= total == len(cov.blocks)
    assert rep.coverage.as_dict()["fa4_fwd"]["blocks"] == [hit, total]


def test_shfl_butterfly_reduces_a_warp():
    ptx = _kernel(".param .u64 out", """
    .reg .b32 %t, %v, %s; .reg .b64 %a, %o;
    ld.param.u64 %o, [out];
    mov.u32 %t, %tid.x;
    mov.u32 %v, %t;
    shfl.sync.bfly.b32 %s, %v, 16, 0x1f, 0xffffffff;  add.u32 %v, %v, %s;
    shfl.sync.bfly.b32 %s, %v, 8, 0x1f, 0xffffffff;  add.u32 %v, %v, %s;
    shfl.sync.bfly.b32 %s, %v, 4, 0x1f, 0xffffffff;  add.u32 %v, %v, %s;
    shfl.sync.bfly.b32 %s, %v, 2, 0x1f, 0xffffffff;  add.u32 %v, %v, %s;
    shfl.sync.bfly.b32 %s, %v, 1, 0x1f, 0xffffffff;  add.u32 %v, %v, %s;
    mul.wide.u32 %a, %t, 4;
    add.s64 %a, %o, %a;
    st.global.u32 [%a], %v;
    ret;""")
    out, = run_raw(ptx, threads=32, args=(np.zeros(32, np.uint32),))
    assert (out == sum(range(32))).all()


def test_a_wait_nobody_satisfies_is_a_deadlock_naming_the_barrier():
    ptx = _kernel(".param .u64 out", """
    .reg .pred %p, %w; .reg .b32 %t, %b;
    mov.u32 %t, %tid.x;
    mov.u32 %b, smem;
    setp.eq.u32 %p, %t, 0;
    @%p mbarrier.init.shared::cta.b64 [%b], 2;
    bar.sync 0;
    @%p mbarrier.arrive.shared::cta.b64 _, [%b];
$wait:
    mbarrier.try_wait.parity.shared::cta.b64 %w, [%b], 0;
    @!%w bra $wait;
    ret;""")
    with pytest.raises(Fault) as e:
        run_raw(ptx, threads=64, args=(np.zeros(1, np.uint32),), smem=64)
    assert e.value.kind == "DEADLOCK" and "1/2 arrivals outstanding" in str(e.value)


def test_named_barrier_counts_must_agree():
    ptx = _kernel(".param .u64 out", """
    .reg .pred %p; .reg .b32 %t;
    mov.u32 %t, %tid.x;
    setp.lt.u32 %p, %t, 32;
    @%p bra $a;
    bar.sync 1, 128;
    ret;
$a:
    bar.sync 1, 64;
    ret;""")
    with pytest.raises(Fault) as e:
        run_raw(ptx, threads=64, args=(np.zeros(1, np.uint32),))
    assert e.value.kind == "NAMED_BARRIER"


def test_shared_memory_out_of_bounds_names_line_and_address():
    ptx = _kernel(".param .u64 out", """
    .reg .b32 %b, %v;
    mov.u32 %b, smem;
    mov.u32 %v, 7;
    st.shared.u32 [%b+4096], %v;
    ret;""")
    with pytest.raises(Fault) as e:
        run_raw(ptx, threads=32, args=(np.zeros(1, np.uint32),), smem=1024)
    line = ptx.splitlines().index("    st.shared.u32 [%b+4096], %v;") + 1
    assert e.value.kind == "SMEM_OOB" and e.value.line == line and e.value.addr == 0x10 + 4096


def test_unsupported_instruction_names_itself_and_its_line():
    ptx = _kernel(".param .u64 out", """
    .reg .b32 %v;
    popc.b32 %v, %v;
    ret;""")
    line = ptx.splitlines().index("    popc.b32 %v, %v;") + 1
    with pytest.raises(UnsupportedInstruction, match=rf"unsupported instruction popc\.b32 at line {line}"):
        run_raw(ptx, threads=32, args=(np.zeros(1, np.uint32),))


def test_parser_reads_the_emitted_subset():
    ptx, _ = emitted(arch="sm_100a", head_dim=128, causal=True, gqa_ratio=1, dtype="bf16")
    mod = parse(ptx)
    body = ptx[ptx.index("{"):]
    stmts = [ln.split("//")[0].strip() for ln in body.splitlines()]
    n = sum(1 for ln in stmts if ln.endswith(";") and not ln.startswith("."))
    assert mod.entry == "fa4_fwd" and mod.maxntid == 512 and len(mod.instrs) == n > 4000
    assert {i.opcode.split(".")[0] for i in mod.instrs} >= {"tcgen05", "mbarrier", "cp", "bar", "ex2"}


# ---- the command ----------------------------------------------------------------------------------
def test_emulate_cli_exit_codes(tmp_path):
    runner = CliRunner()
    good = GEN / "fa4_sm100a_d64_bf16_noncausal_gqa4.ptx"
    cov_json = tmp_path / "cov.json"
    r = runner.invoke(cli_main, ["emulate", str(good), "--seeds", "1", "--quiet", "--coverage",
                                 "--coverage-json", str(cov_json)])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "warp-instructions/s" in r.output
    blocks = json.loads(cov_json.read_text())["fa4_fwd"]["blocks"]
    assert f"fa4_fwd: {blocks[0]}/{blocks[1]} basic blocks" in r.output and 0 < blocks[0] <= blocks[1]
    bad = tmp_path / good.name
    scale = "mul.rn.f32x2 %op2, %op2, %k_i2;"  # O columns 4, 5 normalised (packed f32x2)
    assert scale in good.read_text()  # the edit below must change something
    bad.write_text(good.read_text().replace(scale, f"{scale}\n    {scale}", 1))
    r = runner.invoke(cli_main, ["emulate", str(bad), "--manifest", str(good.with_suffix(".json")), "--seeds", "1",
                                 "--quiet"])
    assert r.exit_code == 1 and "MISMATCH" in r.output and "the first bad element was written by" in r.output
    r = runner.invoke(cli_main, ["emulate", str(tmp_path / "missing.ptx")])
    assert r.exit_code == 2
    r = runner.invoke(cli_main, ["emulate", str(good), "--shape", "1,2,3"])
    assert r.exit_code == 2 and "five" in r.output
    r = runner.invoke(cli_main, ["emulate", str(good), "--shape", "1,100,100,3,1"])  # Hq != G * Hkv
    assert r.exit_code == 2
    r = runner.invoke(cli_main, ["emulate", str(bad)])  # no manifest beside it
    assert r.exit_code == 2 and "manifest" in r.output


# ---- fa4gen check ---------------------------------------------------------------------------------
from fa4gen.evidence.check import check_ptx  # noqa: E402

SM90_PROTOCOL_VARIANTS = [c for c in SM90_VARIANTS if c["emu_pairs"] is None]  # the exp2 split is data path


@pytest.mark.parametrize("name", GOLDEN)
def test_check_passes_on_the_golden_ptx(name):
    rep = check_ptx((GEN / f"{name}.ptx").read_text(), json.loads((GEN / f"{name}.json").read_text()))
    assert rep.ok, rep.summary()
    assert sum(rep.events.values()) > (100 if _golden_arch(name) == "sm_100a" else 40)


@pytest.mark.parametrize("cfg", SM90_PROTOCOL_VARIANTS, ids=lambda c: KernelConfig(**c).name)
def test_check_passes_on_the_sm90_variants(cfg):
    ptx, man = emitted(**cfg)
    rep = check_ptx(ptx, man)
    assert rep.ok, rep.summary()


@pytest.mark.parametrize("mut", [m for m in PTX_MUTATIONS if m.protocol], ids=lambda m: m.name)
def test_check_flags_every_protocol_mutation(mut):
    ptx, man = emitted(**mut.config)
    rep = check_ptx(mut.apply(ptx, man), man)
    assert not rep.ok, f"{mut.name}: fa4gen check saw no difference"
    assert all(d.line is not None or "missing" in str(d) or "nothing" in d.got or d.role == "prologue"
               for d in rep.differences)


@pytest.mark.parametrize("mut", CHECK_MUTATIONS, ids=lambda m: m.name)
def test_check_flags_the_read_back_mutations(mut):
    """Edits only the read-back sees (the sm_90a instance and predicate reading, the sm_100a ring
    slot reduction; not emulated: see mutations.CHECK_MUTATIONS); each is reported at its PTX line
    or as what the PTX lacks."""
    ptx, man = emitted(**mut.config)
    rep = check_ptx(mut.apply(ptx, man), man)
    assert not rep.ok, f"{mut.name}: fa4gen check saw no difference"
    assert all(d.line is not None or "missing" in str(d) for d in rep.differences), rep.summary()


def test_check_cli_exit_codes(tmp_path):
    runner = CliRunner()
    good = GEN / "fa4_sm100a_d64_bf16_causal_gqa4.ptx"
    r = runner.invoke(cli_main, ["check", str(good)])
    assert r.exit_code == 0 and "PTX protocol == IR" in r.output, r.output
    bad = tmp_path / good.name
    text = good.read_text()
    bad.write_text(text.replace("tcgen05.wait::st.sync.aligned;\n", "", 1))
    r = runner.invoke(cli_main, ["check", str(bad), "--manifest", str(good.with_suffix(".json"))])
    assert r.exit_code == 1 and "WaitSt" in r.output, r.output
    r = runner.invoke(cli_main, ["check", str(tmp_path / "nope.ptx")])
    assert r.exit_code == 2
    r = runner.invoke(cli_main, ["check", str(bad)])
    assert r.exit_code == 2 and "manifest" in r.output


def test_check_cli_applies_the_read_back_corpus(tmp_path):
    """`fa4gen check --mutation` takes the read-back-only mutations (CHECK_MUTATIONS) too; `emulate`
    does not (they are not emulated)."""
    mut = CHECK_MUTATIONS[0]
    ptx, man = emitted(**mut.config)
    path = tmp_path / f"{man['name']}.ptx"
    path.write_text(ptx)
    path.with_suffix(".json").write_text(json.dumps(man))
    runner = CliRunner()
    assert runner.invoke(cli_main, ["check", str(path)]).exit_code == 0
    r = runner.invoke(cli_main, ["check", str(path), "--mutation", mut.name])
    assert r.exit_code == 1 and "the IR says" in r.output, r.output
    r = runner.invoke(cli_main, ["emulate", str(path), "--mutation", mut.name])
    assert r.exit_code == 2 and f"no PTX mutation {mut.name!r}" in r.output


# ---- found by the emulator ------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_one_cta_runs_several_tasks(causal):
    """Causal sm_100a grids are one CTA per task today, but the kernel has a persistent task loop
    and the IR was verified with several tasks per CTA. The emulator found the correction warps'
    per-task early p_o_rescale arrival landing in the previous task's last phase (the four
    correction warps drift apart; p_o_rescale counts arrivals, not who sends them), so the next
    PV MMA read O mid-rescale. Fixed in the IR: the causal correction waits the task's o_ready."""
    cfg = dict(arch="sm_100a", head_dim=128, causal=causal, gqa_ratio=1, dtype="bf16")
    ptx, man = emitted(**cfg)
    man = json.loads(json.dumps(man))
    man["grid"]["policy"] = "persistent"
    for seed in (0, 1):
        r = run_once(ptx, man, Shape.parse("1,323,393,2,2"), seed, ctas=1)
        assert r.ok, r.report


def test_the_machine_models_limits_agree_with_the_generators():
    """The emulator keeps its own numbers (a second opinion on the kernels): they must equal the
    generator's table and the ISA encodings, or one of the two is wrong."""
    from fa4gen.spec import encodings
    from fa4gen.spec.plan import ARCH_LIMITS
    from fa4gen.evidence.ptxemu import machine

    assert {lim.regs_per_sm for lim in ARCH_LIMITS.values()} == {machine.REGS_PER_SM}
    assert (machine.TMEM_LANES, machine.TMEM_COLS, machine.TMEM_ALLOC_MIN) == (
        encodings.TMEM_LANES, ARCH_LIMITS["sm_100a"].tmem_cols, encodings.TMEM_ALLOC_MIN_COLUMNS)
