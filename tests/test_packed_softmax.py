"""The sm_100a softmax at the seed's instruction level: packed f32x2 arithmetic (FFMA2/FADD2/FMUL2)
for the scale FMA, the emulated exp2 (two per instruction, as ex2_emulation_2) and the O scaling,
and causal/tail masks as 32-bit column words with bit tests (ptxas: R2P, the seed's mask_r2p).

The template macros are executed by the PTX emulator and compared bit for bit with the reference
arithmetic (fa4gen/spec/exp2.py, the compare rule col < lim); the SASS test reads what ptxas made."""

from __future__ import annotations

import numpy as np
import pytest

from fa4gen import codegen
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.exp2 import EXP2_POLY, ROUND_MAGIC, emulated_mask, exp2_emulated, fma_f32
from fa4gen.spec.plan import MASK_WORD_BITS, mask_words
from fa4gen.evidence.ptxemu import fp
from fa4gen.evidence.ptxemu.harness import run_raw
from fa4gen.render.jinja import environment

NEG_INF = "0fFF800000"


def _kernel(params: str, regs: str, body: str) -> str:
    return f""".version 8.8
.target sm_100a
.address_size 64
.visible .entry k(
    {params}
)
{{
    .reg .b32 %tid, %r<8>;
    .reg .b64 %rd<8>;
    .reg .pred %p<4>;
{regs}
    mov.u32 %tid, %tid.x;
    mul.wide.u32 %rd7, %tid, 4;
{body}
    ret;
}}
"""


def _macro(call: str, **ctx) -> str:
    env = environment()
    src = '{% import "common/softmax.ptx.j2" as sm with context %}' + call
    return env.from_string(src).render(neg_inf=NEG_INF, **ctx)


def _f32_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


# ---- the emulator's f32x2 ----------------------------------------------------------------------
def test_f32x2_ops_round_each_element_like_the_scalar_op():
    """add.rm / sub.rn / mul.rn / fma.rn .f32x2 on 32 lanes = the scalar ops per element, and
    mov.b64 {lo, hi} puts its first register in bits 0-31 (PTX ISA: .f32x2 element 0 = a[0:31])."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((32, 2)) * 1e3).astype(np.float32)
    b = (rng.standard_normal((32, 2)) * 1e-4).astype(np.float32)
    c = rng.standard_normal((32, 2)).astype(np.float32)
    regs = "    .reg .f32 %f<8>;\n    .reg .b64 %x<8>;"
    body = "\n".join([f"    ld.param.u64 %rd{i}, [p{i}];" for i in range(4)]
                     + ["    mul.wide.u32 %rd6, %tid, 8;"] + [f"    add.s64 %rd{i}, %rd{i}, %rd6;" for i in range(3)]
                     + ["    mul.wide.u32 %rd6, %tid, 40;", "    add.s64 %rd3, %rd3, %rd6;",
                        "    ld.global.v2.f32 {%f0, %f1}, [%rd0];", "    ld.global.v2.f32 {%f2, %f3}, [%rd1];",
                        "    ld.global.v2.f32 {%f4, %f5}, [%rd2];",
                        "    mov.b64 %x0, {%f0, %f1};", "    mov.b64 %x1, {%f2, %f3};", "    mov.b64 %x2, {%f4, %f5};",
                        "    add.rm.f32x2 %x3, %x0, %x1;", "    sub.rn.f32x2 %x4, %x0, %x1;",
                        "    mul.rn.f32x2 %x5, %x0, %x1;", "    fma.rn.f32x2 %x6, %x0, %x1, %x2;",
                        "    st.global.b64 [%rd3], %x3;", "    st.global.b64 [%rd3+8], %x4;",
                        "    st.global.b64 [%rd3+16], %x5;", "    st.global.b64 [%rd3+24], %x6;",
                        "    mov.b64 {%f6, %f7}, %x0;", "    st.global.v2.f32 [%rd3+32], {%f7, %f6};"])
    ptx = _kernel(",\n    ".join(f".param .u64 p{i}" for i in range(4)), regs, body)
    out = np.zeros((32, 10), np.float32)
    *_, got = run_raw(ptx, threads=32, args=(a, b, c, out))
    want = np.stack([fp.add(a, b, "rm"), fp.add(a, -b, "rn"), fp.mul(a, b, "rn"), fp.fma(a, b, c, "rn")], axis=1)
    assert np.array_equal(_f32_bits(got[:, :8].reshape(32, 4, 2)), _f32_bits(want))
    assert np.array_equal(_f32_bits(got[:, 8:]), _f32_bits(a[:, ::-1]))  # {hi, lo} stored back in swapped order
    assert not np.array_equal(_f32_bits(fp.add(a, b, "rm")), _f32_bits(fp.add(a, b, "rn")))  # the mode matters here


# ---- packed exp2 = the reference's exp2_emulated, bit for bit ------------------------------------
def _exps_kernel(npairs: int, emu: list[bool], hw_only: bool) -> str:
    n = 2 * npairs
    elems = [{"reg": f"%s{j}", "i": j} for j in range(n)]
    row = {"elems": elems, "pairs": [{"lo": elems[2 * i], "hi": elems[2 * i + 1], "emu": emu[i], "i": i}
                                     for i in range(npairs)],
           "nrs": "%nrs", "magic2": "0x%08X%08X" % ((_f32_bits(ROUND_MAGIC),) * 2),
           "poly2": ["0x%08X%08X" % ((_f32_bits(c),) * 2) for c in EXP2_POLY]}
    code = _macro('{{ sm.exps_x2(row, "%scale", poly, hw_only) }}', row=row, poly=None, hw_only=hw_only)
    regs = (f"    .reg .f32 %s<{n}>, %x<{n}>, %ej<{n}>, %scale, %nrs;\n    .reg .b32 %ee<{n}>, %eb<{n}>;\n"
            f"    .reg .b64 %sp<{npairs}>, %xp<{npairs}>, %jp<{npairs}>, %fp<{npairs}>, %pp<{npairs}>, "
            "%k_s2, %k_n2, %k_mg2, %k_c02, %k_c12, %k_c22, %k_c32;")
    loads = ["    ld.param.u64 %rd0, [inp];", "    ld.param.u64 %rd1, [out];", "    ld.param.f32 %scale, [scale];",
             "    ld.param.f32 %nrs, [nrs];", f"    mul.wide.u32 %rd2, %tid, {4 * n};",
             "    add.s64 %rd0, %rd0, %rd2;", "    add.s64 %rd1, %rd1, %rd2;"]
    loads += [f"    ld.global.f32 %s{j}, [%rd0+{4 * j}];" for j in range(n)]
    stores = [f"    st.global.f32 [%rd1+{4 * j}], %s{j};" for j in range(n)]
    return _kernel(".param .u64 inp,\n    .param .u64 out,\n    .param .f32 scale,\n    .param .f32 nrs", regs,
                   "\n".join(loads) + "\n" + code + "\n" + "\n".join(stores))


def test_packed_exp2_is_the_reference_emulation_bit_for_bit():
    """The sm_100a exps_x2 macro as executed: emulated pairs equal exp2_emulated(fma(s, scale,
    nrs)) bit for bit over the interesting inputs (-inf, NaN, below the clamp, integers and their
    neighbours, the fraction's edges); hardware pairs go through ex2.approx (the emulator's model)."""
    rng = np.random.default_rng(3)
    special = np.array([-np.inf, np.nan, -1000.0, -127.0, -126.5, -126.0, -1.0, -2.0 ** -30, 0.0, 2.0 ** -30,
                        np.nextafter(np.float32(-3), np.float32(0)), -3.0, 3.0, 5.999999, 7.9],
                       np.float32)
    s = np.concatenate([special, rng.uniform(-140, 8, 32 * 8 - special.size).astype(np.float32)])
    s = s.reshape(32, 8)
    emu = [True, False, True, True]
    out = np.zeros_like(s)
    cols = np.repeat(emu, 2)
    # scale 1, shift 0: x = s exactly, so the special inputs reach the cubic as they are
    for scale, nrs in ((np.float32(1.0), np.float32(0.0)), (np.float32(0.18033688), np.float32(-1.25))):
        _, got, _, _ = run_raw(_exps_kernel(4, emu, False), threads=32, args=(s, out, float(scale), float(nrs)))
        x = fma_f32(s, np.full_like(s, scale), np.full_like(s, nrs))
        assert np.array_equal(_f32_bits(got[:, cols]), _f32_bits(exp2_emulated(x[:, cols])))
        assert np.array_equal(_f32_bits(got[:, ~cols]), _f32_bits(fp.ex2_approx(x[:, ~cols], True)))
        # hw_only (masked blocks): every pair on MUFU, none emulated
        _, got_hw, _, _ = run_raw(_exps_kernel(4, emu, True), threads=32, args=(s, out, float(scale), float(nrs)))
        assert np.array_equal(_f32_bits(got_hw), _f32_bits(fp.ex2_approx(x, True)))
    assert (exp2_emulated(s[:, cols]) != fp.ex2_approx(s[:, cols], True)).any()  # the two paths differ


def test_sm100_kernel_emulates_the_seeds_fraction_with_packed_instructions():
    """In the generated kernel every emulated pair is one add.rm.f32x2 and three fma.rn.f32x2, and
    every scale-and-shift is one fma.rn.f32x2 per pair: no scalar add.rm/fma.rn.f32 remains there."""
    for causal in (False, True):
        cfg = KernelConfig(causal=causal)
        ptx = codegen.build(cfg, emit=("ptx",)).ptx
        sm0 = ptx[ptx.index("// role softmax0"):ptx.index("// role softmax1")]
        n_emu = sum(int(emulated_mask(cfg, f, False).sum()) for f in range(4))
        assert sm0.count("add.rm.f32x2") == n_emu // 2
        assert sm0.count("fma.rn.f32x2 %pp") == 3 * (n_emu // 2)
        assert sm0.count("fma.rn.f32x2 %xp") == 2 * (cfg.block_n // 2)  # unmasked and masked paths
        assert "add.rm.f32 " not in sm0 and "ex2.approx" in sm0


# ---- masks as column words -------------------------------------------------------------------------
@pytest.mark.parametrize("cols", [list(range(128)), [8 * c + e for c in range(16) for e in (0, 1)]],
                         ids=["sm100_row", "sm90_fragment"])
def test_mask_words_equal_the_compare_rule(cols):
    """apply_mask as executed: element c is -inf iff c >= lim, for lim from far below 0 to far
    past the block (both targets' column sets; lane l uses lim = l * 7 - 40)."""
    words, where = mask_words(cols)
    elems = [{"reg": f"%s{i}", "mword": f"%mw{w}", "mbit": bit} for i, (w, bit) in enumerate(where)]
    row = {"elems": elems, "lim": "%lim", "mtmp": "%mt",
           "mask_words": [{"reg": f"%mw{w}", "base": w * MASK_WORD_BITS} for w in words]}
    n = len(cols)
    code = _macro('{{ sm.apply_mask(row, "%p0") }}', row=row)
    regs = f"    .reg .f32 %s<{n}>;\n    .reg .b32 %lim, %mt, %mw<{max(words) + 1}>;"
    body = ["    ld.param.u64 %rd1, [out];", f"    mul.wide.u32 %rd2, %tid, {4 * n};", "    add.s64 %rd1, %rd1, %rd2;",
            "    mad.lo.s32 %lim, %tid, 7, -40;"]
    body += [f"    mov.f32 %s{i}, 0f3F800000;" for i in range(n)]
    body += [code] + [f"    st.global.f32 [%rd1+{4 * i}], %s{i};" for i in range(n)]
    out = np.zeros((32, n), np.float32)
    got, = run_raw(_kernel(".param .u64 out", regs, "\n".join(body)), threads=32, args=(out,))
    lim = np.arange(32)[:, None] * 7 - 40
    want = np.where(np.asarray(cols)[None, :] < lim, np.float32(1), np.float32(-np.inf))
    assert np.array_equal(got, want)
    assert (want == 1).any() and (want == -np.inf).any() and (want == 1).all(axis=1).any()


def test_mask_words_refuse_negative_columns():
    from fa4gen.spec.tiles import PlanError
    with pytest.raises(PlanError, match="mask columns"):
        mask_words([3, -1])


# ---- what ptxas made of it ------------------------------------------------------------------------
def _sass_tools():
    from fa4gen.assemble.assemble import find_disassembler, find_ptxas
    return find_ptxas() is not None and find_disassembler() is not None and find_disassembler()[0] == "nvdisasm"


@pytest.mark.skipif(not _sass_tools(), reason="needs ptxas and nvdisasm (the cuda extra's wheels)")
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_sass_has_packed_exp2_and_r2p_masks_without_spills(causal):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / "sass_profile.py"
    spec = importlib.util.spec_from_file_location("sass_profile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = KernelConfig(causal=causal)
    prof = mod.profile(cfg)
    assert prof["spill_stores"] == 0 and prof["spill_loads"] == 0 and prof["stack"] == 0
    assert prof["totals"].get("LDL/STL", 0) == 0
    man = codegen.build(cfg, emit=("ptx",)).manifest
    assert prof["setmaxnreg"] == {r["role"]: r["setmaxnreg"] for r in man["roles"]}
    n_pairs = sum(int(emulated_mask(cfg, f, False).sum()) for f in range(4)) // 2
    for role in ("softmax0", "softmax1"):
        c = prof["per_role"][role]
        # scale FMA: 64 pairs on each path (unmasked, masked); the cubic: 3 per emulated pair
        assert c["FFMA2"] == 2 * 64 + 3 * n_pairs, c
        assert c["R2P"] >= 128 // MASK_WORD_BITS, c  # at least one per mask word
        assert c["MUFU.EX2"] >= 128
    assert prof["per_role"]["correction"]["FMUL2"] > 0  # O rescale (and normalise, non-causal)


# ---- three-input max and the packed row sum ----------------------------------------------------------
def test_three_input_max_takes_the_largest_and_ignores_nan():
    """max.f32 d, a, b, c (sm_100a, FMNMX3) as executed: the largest of three, a NaN operand loses."""
    vals = np.array([[1.0, -2.0, 3.0], [np.nan, -1.0, -5.0], [-np.inf, -np.inf, -7.0], [4.0, np.nan, np.nan]],
                    np.float32)
    regs = "    .reg .f32 %f<4>;"
    body = ["    ld.param.u64 %rd0, [inp];", "    ld.param.u64 %rd1, [out];", "    mul.wide.u32 %rd2, %tid, 12;",
            "    add.s64 %rd0, %rd0, %rd2;", "    add.s64 %rd1, %rd1, %rd7;",
            "    ld.global.f32 %f0, [%rd0];", "    ld.global.f32 %f1, [%rd0+4];", "    ld.global.f32 %f2, [%rd0+8];",
            "    max.f32 %f3, %f0, %f1, %f2;", "    st.global.f32 [%rd1], %f3;"]
    out = np.zeros(4, np.float32)
    _, got = run_raw(_kernel(".param .u64 inp,\n    .param .u64 out", regs, "\n".join(body)), threads=4,
                     args=(vals, out))
    assert np.array_equal(got, np.array([3.0, -1.0, -7.0, 4.0], np.float32))


def test_sm100_row_max_and_sum_use_the_packed_and_three_input_forms():
    ptx = codegen.build(KernelConfig(), emit=("ptx",)).ptx
    sm0 = ptx[ptx.index("// role softmax0"):ptx.index("// role softmax1")]
    three = [ln for ln in sm0.splitlines() if ln.strip().startswith("max.f32 %mx") and ln.count(",") == 3]
    assert len(three) >= 128 // 3  # one three-input max per three scores (a level's tail may take two)
    assert sm0.count("add.rn.f32x2 %sqt") == 63  # 64 pairs -> 1 pair: 63 packed adds, then one scalar
    _, _, row_sum_scalar = sm0.partition("add.rn.f32x2 %sqt62")
    assert "add.f32 %sm0, %sm0, %sm1;" in row_sum_scalar
