"""Encodings against the PTX ISA tables, by hand-derived values, round trips and ptxas.

ptxas does not check descriptor field values, so the expected integers below, each derived by hand
from the cited table, are the real check; the ptxas test only proves the values are usable as
immediates/registers of the instructions they feed.
"""

import re

import pytest
from hypothesis import given, settings, strategies as st

from fa4gen.spec.encodings import (
    AccumType, DescArch, EncodingError, LboMode, Major, MmaType, SmemMatrixDesc, Swizzle,
    TcgenInstrDesc, TensorMapError, TensorMapSpec, TmaDtype, TmaInterleave, check_tmem_alloc,
    f16_col_to_phys, tmem_addr, tmem_addr_split, tmem_lane_base_for_warp,
)


# ---- tcgen05 instruction descriptor ---------------------------------------------------------

def test_idesc_bf16_m128_n128_kmajor_reference():
    """§9.7.16.4.2 Table 42, derived by hand for S = Q Kᵀ (bf16, f32 accumulate, A and B K-major):
    d_type F32=1 at bit 4 -> 0x10; a_type BF16=1 at bits 7-9 -> 0x80; b_type BF16=1 at bits 10-12
    -> 0x400; transpose bits 15/16 = 0; N>>3 = 16 at bits 17-22 -> 0x200000; M>>4 = 8 at bits
    24-28 -> 0x08000000. Sum 0x08200490."""
    d = TcgenInstrDesc(m=128, n=128, a_type=MmaType.BF16, b_type=MmaType.BF16, d_type=AccumType.F32)
    assert d.encode() == 0x08200490


def test_idesc_n64_and_pv_reference():
    """Table 42: N=64 -> N>>3 = 8 -> 0x100000 (instead of 0x200000); O += P V with V MN-major sets
    "transpose B" (bit 16) -> +0x10000."""
    assert TcgenInstrDesc(m=128, n=64).encode() == 0x08100490
    assert TcgenInstrDesc(m=128, n=128, b_major=Major.MN).encode() == 0x08210490
    assert TcgenInstrDesc.for_dtype("bf16", 128, 128, b_major=Major.MN).encode() == 0x08210490


def test_idesc_f16_references():
    """Table 42: F16 inputs have atype = btype = 0, so only d_type (F32 = 1 -> 0x10), N and M remain:
    M=128,N=128 -> 0x08200010. With an F16 accumulator (d_type 0), M=64 (4 << 24), N=8 (1 << 17)
    -> 0x04020000."""
    assert TcgenInstrDesc.for_dtype("fp16", 128, 128).encode() == 0x08200010
    d = TcgenInstrDesc(m=64, n=8, a_type=MmaType.F16, b_type=MmaType.F16, d_type=AccumType.F16)
    assert d.encode() == 0x04020000


@pytest.mark.parametrize("change, mask", [
    (dict(negate_a=True), 1 << 13),
    (dict(negate_b=True), 1 << 14),
    (dict(a_major=Major.MN), 1 << 15),
    (dict(b_major=Major.MN), 1 << 16),
    (dict(sparse=True), 1 << 2),
    (dict(sparse=True, sparsity_selector=3), (1 << 2) | 0b11),
    (dict(n=144), (16 ^ 18) << 17),  # N>>3: 16 -> 18
    (dict(m=64), (8 ^ 4) << 24),  # M>>4: 8 -> 4
    (dict(a_type=MmaType.F16, b_type=MmaType.F16), (1 << 7) | (1 << 10)),
])
def test_idesc_single_fields(change, mask):
    """Each Table 42 field toggles exactly its own bits (§9.7.16.4.2): bit 2 sparsity, 0-1 selector,
    13/14 negate, 15/16 transpose, 7-9/10-12 types, 17-22 N>>3, 24-28 M>>4."""
    base = TcgenInstrDesc(m=128, n=128)
    other = TcgenInstrDesc(**{"m": 128, "n": 128, **change})
    assert base.encode() ^ other.encode() == mask


def test_idesc_max_shift_bits_30_31():
    """Table 42 bits 30-31: .ws B-reuse max shift (3 = 32)."""
    d = TcgenInstrDesc(m=128, n=128, ws=True, max_shift=3)
    assert d.encode() >> 30 == 3
    assert d.encode() & ((1 << 30) - 1) == 0x08200490


@pytest.mark.parametrize("kw, words", [
    (dict(m=128, n=100), "N in 16..256 step 16"),
    (dict(m=128, n=136), "N in 16..256 step 16"),  # a multiple of 8 is M = 64's step, not M = 128's
    (dict(m=64, n=100), "N in 8..256 step 8"),
    (dict(m=256, n=128), "cta_group::1"),
    (dict(m=128, n=264), "N in 16..256"),
    (dict(m=128, n=8, cta_group=2), "cta_group::2"),
    (dict(m=128, n=128, d_type=AccumType.F16), "bf16 inputs accumulate in f32"),
    (dict(m=128, n=128, a_type=MmaType.F16), "atype == btype"),
    (dict(m=128, n=128, saturate=True), "saturate"),
    (dict(m=128, n=128, max_shift=1), ".ws only"),
    (dict(m=128, n=128, sparsity_selector=1), "sparse=True"),
    (dict(m=128, n=128, a_type=7), "a_type"),
])
def test_idesc_rejects_what_table_39_and_42_forbid(kw, words):
    """Shapes of Table 39 (§9.7.16.2.1) and fixed values of Table 42."""
    with pytest.raises(EncodingError, match=words.replace(".", r"\.").replace("(", r"\(")):
        TcgenInstrDesc(**kw)


def test_idesc_decode_rejects_reserved_and_foreign_kinds():
    """Table 42: bits 6, 23, 29 reserved; atype 2 is TF32 (kind::tf32), not kind::f16."""
    for bit in (6, 23, 29):
        with pytest.raises(EncodingError, match="reserved"):
            TcgenInstrDesc.decode(0x08200490 | (1 << bit))
    with pytest.raises(EncodingError, match="kind::f16"):
        TcgenInstrDesc.decode(0x08200490 | (2 << 7) | (2 << 10))
    with pytest.raises(EncodingError):
        TcgenInstrDesc.decode(1 << 32)


def test_idesc_decode_reference():
    d = TcgenInstrDesc.decode(0x08210490)
    assert (d.m, d.n, d.a_type, d.b_type, d.d_type) == (128, 128, MmaType.BF16, MmaType.BF16, AccumType.F32)
    assert (d.a_major, d.b_major) == (Major.K, Major.MN)
    assert d.k == 16


_valid_idesc = st.one_of(
    st.builds(lambda m, n8, t, acc, am, bm, na, nb, sp, sel: TcgenInstrDesc(
        m=m, n=8 * n8 if m == 64 else 16 * ((n8 + 1) // 2), a_type=t, b_type=t, d_type=AccumType.F32 if t == MmaType.BF16 else acc,
        a_major=am, b_major=bm, negate_a=na, negate_b=nb, sparse=sp, sparsity_selector=sel if sp else 0),
        st.sampled_from([64, 128]), st.integers(1, 32), st.sampled_from(list(MmaType)),
        st.sampled_from(list(AccumType)), st.sampled_from(list(Major)), st.sampled_from(list(Major)),
        st.booleans(), st.booleans(), st.booleans(), st.integers(0, 3)),
)


@settings(max_examples=200, deadline=None)
@given(_valid_idesc)
def test_idesc_round_trip(d):
    value = d.encode()
    assert 0 <= value < 1 << 32
    assert value & ((1 << 6) | (1 << 23) | (1 << 29)) == 0
    assert TcgenInstrDesc.decode(value) == d


# ---- shared memory matrix descriptors -------------------------------------------------------

def test_kmajor_sw128_wgmma_reference():
    """§9.7.15.5.1.2.2: start 0x400 -> 0x400>>4 = 64 (bits 0-13); LBO "assumed 1" (bits 16-29);
    SBO = 8 rows x 128 B = 1024 -> 64 (bits 32-45); 128B swizzle = code 1 at bits 62-63."""
    d = SmemMatrixDesc.k_major_sw128("sm_90a", 0x400)
    assert (d.lbo, d.sbo, d.base_offset) == (16, 1024, 0)
    assert d.encode() == 64 | (1 << 16) | (64 << 32) | (1 << 62) == 0x4000004000010040


def test_kmajor_sw128_tcgen05_reference():
    """§9.7.16.4.1 Table 40: same address/LBO/SBO fields as wgmma, plus the fixed 0b001 at bits
    46-48 and 128B swizzle = code 2 in bits 61-63 (wgmma's 1 << 62 and tcgen05's 2 << 61 are the
    same bit: only bit 46 tells the two encodings of this layout apart)."""
    d = SmemMatrixDesc.k_major_sw128(DescArch.SM100A, 0x400)
    assert d.encode() == 64 | (1 << 16) | (64 << 32) | (1 << 46) | (2 << 61) == 0x4000404000010040
    assert d.encode() ^ SmemMatrixDesc.k_major_sw128("sm_90a", 0x400).encode() == 1 << 46


def test_mnmajor_sw128_for_v_reference():
    """§9.7.15.5.1.2.1 / §9.7.16.3 (MN-major, swizzled): LBO = offset between 64-element (128 B)
    panels along N = 128 key rows x 128 B = 16384 -> 1024 in bits 16-29; SBO = offset between groups
    of 8 K rows = 1024 -> 64 in bits 32-45. Start 0x8000 -> 0x800."""
    d = SmemMatrixDesc.mn_major_sw128("sm_100a", 0x8000, panel_stride=128 * 128)
    assert d.encode() == 0x800 | (1024 << 16) | (64 << 32) | (1 << 46) | (2 << 61)
    w = SmemMatrixDesc.mn_major_sw128("sm_90a", 0x8000, panel_stride=128 * 128)
    assert w.encode() == 0x800 | (1024 << 16) | (64 << 32) | (1 << 62)


def test_kmajor_advance_along_k_keeps_base_offset_zero():
    """Table 41: the pattern still starts at the 1024 B tile base when the MMA moves 32 B along K,
    so base offset stays 0 and only the start field moves by 2 (32 >> 4)."""
    a = SmemMatrixDesc.k_major_sw128("sm_100a", 0x2000)
    b = SmemMatrixDesc.k_major_sw128("sm_100a", 0x2000 + 32)
    assert b.base_offset == 0 and b.encode() - a.encode() == 2


def test_base_offset_formula():
    """Table 41: a pattern starting off its 1024 B boundary needs (start >> 7) & 7:
    0x1180 >> 7 = 35, & 7 = 3, in bits 49-51."""
    d = SmemMatrixDesc.k_major_sw128("sm_100a", 0x1180, pattern_start=0x1180)
    assert d.base_offset == 3
    assert (d.encode() >> 49) & 7 == 3


@pytest.mark.parametrize("swz, wgmma, tcgen05", [
    (Swizzle.NONE, 0, 0), (Swizzle.B128, 1, 2), (Swizzle.B64, 2, 4), (Swizzle.B32, 3, 6),
])
def test_swizzle_codes(swz, wgmma, tcgen05):
    """wgmma bits 62-63 (§9.7.15.5.1.2.2) and tcgen05 bits 61-63 (Table 40) name the same modes
    with different numbers."""
    w = SmemMatrixDesc("sm_90a", 0, lbo=16, sbo=1024, swizzle=swz)
    t = SmemMatrixDesc("sm_100a", 0, lbo=16, sbo=1024, swizzle=swz)
    assert w.encode() >> 62 == wgmma
    assert t.encode() >> 61 == tcgen05


def test_tcgen05_lbo_mode_bit_52():
    d = SmemMatrixDesc("sm_100a", 0x400, lbo=0x800, sbo=1024, swizzle=Swizzle.B128, lbo_mode=LboMode.ABSOLUTE)
    assert (d.encode() >> 52) & 1 == 1


@pytest.mark.parametrize("kw, words", [
    (dict(arch="sm_100a", start_address=0x408, lbo=16, sbo=1024, swizzle=Swizzle.B128), "16-byte aligned"),
    (dict(arch="sm_100a", start_address=1 << 18, lbo=16, sbo=1024, swizzle=Swizzle.B128), "256 KiB"),
    (dict(arch="sm_90a", start_address=0, lbo=16, sbo=1024, swizzle=Swizzle.B128_ATOM_32B), "no such swizzle"),
    (dict(arch="sm_90a", start_address=0, lbo=16, sbo=1024, swizzle=Swizzle.NONE, base_offset=1), "no-swizzle"),
    (dict(arch="sm_80", start_address=0, lbo=16, sbo=1024, swizzle=Swizzle.B128), "arch"),
    (dict(arch="sm_100a", start_address=0, lbo=16, sbo=1024, swizzle=Swizzle.B128, base_offset=8), "3-bit"),
])
def test_smem_desc_rejects(kw, words):
    with pytest.raises(EncodingError, match=words):
        SmemMatrixDesc(**kw)


def test_smem_desc_decode_rejects_bad_fixed_bits():
    """Table 40: bits 46-48 must be 0b001 on sm_100; swizzle codes 3, 5, 7 are invalid."""
    good = SmemMatrixDesc.k_major_sw128("sm_100a", 0x400).encode()
    with pytest.raises(EncodingError, match="0b001"):
        SmemMatrixDesc.decode(good & ~(1 << 46), "sm_100a")
    with pytest.raises(EncodingError, match="invalid"):
        SmemMatrixDesc.decode((good & ~(7 << 61)) | (3 << 61), "sm_100a")
    with pytest.raises(EncodingError, match="bits outside"):
        SmemMatrixDesc.decode(good, "sm_90a")  # bit 46 is not a wgmma field


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["sm_90a", "sm_100a"]), st.integers(0, (1 << 14) - 1), st.integers(0, (1 << 14) - 1),
       st.integers(0, (1 << 14) - 1), st.sampled_from([Swizzle.NONE, Swizzle.B32, Swizzle.B64, Swizzle.B128]),
       st.integers(0, 7))
def test_smem_desc_round_trip(arch, start, lbo, sbo, swz, base):
    if swz == Swizzle.NONE and arch == "sm_90a":
        base = 0
    d = SmemMatrixDesc(arch, start << 4, lbo=lbo << 4, sbo=sbo << 4, swizzle=swz, base_offset=base)
    v = d.encode()
    assert 0 <= v < 1 << 64
    assert SmemMatrixDesc.decode(v, arch) == d


# ---- Tensor Memory --------------------------------------------------------------------------

def test_tmem_addr_layout():
    """§9.7.16.1.1: lane in bits 31-16, column in bits 15-0; 128 lanes x 512 columns."""
    assert tmem_addr(0, 0) == 0
    assert tmem_addr(1, 0) == 0x10000
    assert tmem_addr(32, 256) == 0x200100
    assert tmem_addr(127, 511) == 0x7F01FF
    assert tmem_addr_split(0x7F01FF) == (127, 511)
    for lane, col in ((128, 0), (0, 512), (-1, 0), (0, True)):
        with pytest.raises(EncodingError):
            tmem_addr(lane, col)


def test_f16_view_maps_p_into_upper_half_of_s():
    """FA4 spec TMEM table: P0's 128 fp16 columns live in physical [64, 128), S0's upper half."""
    assert f16_col_to_phys(128) == 64
    assert f16_col_to_phys(255) == 127
    assert f16_col_to_phys(0) == f16_col_to_phys(1) == 0
    with pytest.raises(EncodingError):
        f16_col_to_phys(1024)


def test_tmem_alloc_and_lane_ownership():
    """§9.7.16.1.2: alloc a power of two in [32, 512]; warp w accesses lanes 32*(w%4) onwards."""
    assert check_tmem_alloc(512) == 512
    for bad in (16, 96, 1024, 0):
        with pytest.raises(EncodingError):
            check_tmem_alloc(bad)
    assert [tmem_lane_base_for_warp(w) for w in (0, 1, 2, 3, 4, 7, 8, 11)] == [0, 32, 64, 96, 0, 96, 0, 96]


# ---- TMA tensor maps ------------------------------------------------------------------------

def _q_map(**kw):
    args = dict(dtype="bf16", dims=("D", "G", "Hkv", "Sq", "B"), box=(64, 4, 1, 32, 1), swizzle="128B")
    args.update(kw)
    return TensorMapSpec(**args)


def test_tensor_map_q_gqa4_args():
    """cuTensorMapEncodeTiled: rank 5, box <= 256, inner box 64 x 2 B = 128 B = 128B swizzle span,
    strides of dims 1..4 multiples of 16 B. Q [B=2, Sq=1000, Hq=32, D=128] viewed as (D, G=4, Hkv=8, Sq, B)."""
    spec = _q_map()
    args = spec.validate((128, 4, 8, 1000, 2), (256, 1024, 8192, 8192 * 1000), address=0x7F0000000000)
    assert args.rank == 5 and args.dtype == TmaDtype.BFLOAT16.code == 9
    assert args.swizzle == 3 and args.interleave == 0 and args.l2_promotion == 2 and args.oob_fill == 0
    assert args.box_dim == (64, 4, 1, 32, 1) and args.element_strides == (1, 1, 1, 1, 1)
    assert spec.box_bytes == 64 * 4 * 32 * 2


@pytest.mark.parametrize("kw, words", [
    (dict(box=(128, 4, 1, 32, 1)), "exceeds the B128 swizzle span"),
    (dict(box=(64, 4, 1, 300, 1)), "boxDim"),
    (dict(box=(4, 4, 1, 32, 1), swizzle="none"), "multiple of 16"),
    (dict(dims=("D", "G", "Hkv", "Sq", "B", "X"), box=(64, 4, 1, 32, 1, 1)), "tensorRank"),
    (dict(dims=("D", "S"), box=(64, 32), interleave=TmaInterleave.B16), ">= 3"),
    (dict(elem_strides=(1, 1, 1, 9, 1)), "elem_strides"),
    (dict(dims=("D", "G", "Hkv")), "one entry per dimension"),
    (dict(dtype="int8"), "dtype"),
    (dict(swizzle="256B"), "swizzle"),
    (dict(dtype=TmaDtype.INT32, oob_fill=1, box=(32, 4, 1, 32, 1)), "floating-point"),
])
def test_tensor_map_static_errors(kw, words):
    with pytest.raises(TensorMapError, match=words):
        _q_map(**kw)


@pytest.mark.parametrize("shape, strides, addr, words", [
    ((128, 4, 8, 1000, 2), (256, 1024, 8200, 8200 * 1000), None, "multiple of 16"),
    ((128, 4, 8, 1000), (256, 1024, 8192), None, "has 4 dims"),
    ((128, 4, 8, 1000, 2), (256, 1024, 8192, 8192 * 1000, 1), None, "need the 4 byte strides"),
    ((128, 4, 8, 0, 2), (256, 1024, 8192, 8192), None, "1..2"),
    ((128, 4, 8, 1000, 2), (256, 1024, 8192, 1 << 41), None, "2\\^40"),
    ((128, 4, 8, 1000, 2), (256, 1024, 8192, 8192 * 1000), 0x1008, "16-byte aligned"),
])
def test_tensor_map_runtime_errors(shape, strides, addr, words):
    with pytest.raises(TensorMapError, match=words):
        _q_map().validate(shape, strides, address=addr)


def test_tensor_map_rank1_passes_one_stride():
    """A rank-1 map has no strides, but an empty list reaches driver r580 as NULL and is rejected
    (seen on the H200): validate() hands over one padded-row stride instead."""
    args = TensorMapSpec(dtype="fp32", dims=("N",), box=(64,), swizzle="none").validate((1001,), ())
    assert args.global_strides == (4016,)


def test_tensor_map_interleave32_needs_swizzle32_and_32b_strides():
    spec = TensorMapSpec(dtype="fp16", dims=("C", "W", "H"), box=(16, 8, 8), swizzle=Swizzle.B32,
                         interleave=TmaInterleave.B32)
    with pytest.raises(TensorMapError, match="multiple of 32"):
        spec.validate((16, 64, 64), (48, 48 * 64))
    with pytest.raises(TensorMapError, match="requires swizzle 32B"):
        TensorMapSpec(dtype="fp16", dims=("C", "W", "H"), box=(16, 8, 8), swizzle=Swizzle.B64,
                      interleave=TmaInterleave.B32)


# ---- ptxas accepts the encodings as the instructions' operands ------------------------------

def _tcgen05_ptx(idesc: int, adesc: int, bdesc: int) -> str:
    from fa4gen.spec.plan import PTX_VERSION_FOR_ARCH
    return f"""\
.version {PTX_VERSION_FOR_ARCH["sm_100a"]}
.target sm_100a
.address_size 64

.visible .entry enc_mma(.param .u32 dtmem, .param .u32 flag)
{{
  .reg .b32 %r<4>;
  .reg .b64 %rd<3>;
  .reg .pred %p<2>;
  ld.param.u32 %r1, [dtmem];
  ld.param.u32 %r3, [flag];
  setp.ne.b32 %p1, %r3, 0;
  mov.b64 %rd1, {adesc:#x};
  mov.b64 %rd2, {bdesc:#x};
  mov.b32 %r2, {idesc:#x};
  tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, %p1;
  tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, {idesc:#x}, %p1;
  ret;
}}
"""


def test_tcgen05_mma_with_encoded_operands_assembles(tmp_path):
    """ptxas (sm_100a) accepts the descriptor for S = Q Kᵀ both as a register and as an immediate;
    when a disassembler is present, the 32-bit value reaches the UTCHMMA idesc operand unchanged."""
    from fa4gen.assemble.assemble import assemble, available_backends, disassemble, find_disassembler
    if not available_backends():
        pytest.skip("neither ptxas nor nvJitLink found")
    idesc = TcgenInstrDesc.for_dtype("bf16", 128, 128).encode()
    a = SmemMatrixDesc.k_major_sw128("sm_100a", 0x400).encode()
    b = SmemMatrixDesc.k_major_sw128("sm_100a", 0x8400).encode()
    res = assemble(_tcgen05_ptx(idesc, a, b), "sm_100a", name="enc_mma", keep_dir=tmp_path)
    assert res.cubin[:4] == b"\x7fELF"
    assert res.kernel("enc_mma").registers > 0
    if find_disassembler() is not None:
        sass = disassemble(res.cubin)
        assert sass.count("UTCHMMA") == 2
        assert f"{idesc:#x}" in sass


def test_wgmma_with_encoded_descriptors_assembles(tmp_path):
    """ptxas (sm_90a) accepts wgmma descriptors made by SmemMatrixDesc (K-major A, MN-major B)."""
    from fa4gen.spec.plan import PTX_VERSION_FOR_ARCH
    from fa4gen.assemble.assemble import assemble, available_backends
    if not available_backends():
        pytest.skip("neither ptxas nor nvJitLink found")
    a = SmemMatrixDesc.k_major_sw128("sm_90a", 0x0).encode()
    b = SmemMatrixDesc.mn_major_sw128("sm_90a", 0x4000, panel_stride=64 * 128).encode()
    acc = ", ".join(f"%f{i}" for i in range(32))
    stores = "\n".join(f"  st.global.f32 [%rd3+{4 * i}], %f{i};" for i in range(32))
    ptx = f"""\
.version {PTX_VERSION_FOR_ARCH["sm_90a"]}
.target sm_90a
.address_size 64

.visible .entry enc_wgmma(.param .u64 out)
{{
  .reg .b64 %rd<4>;
  .reg .f32 %f<32>;
  .reg .pred %p<2>;
  ld.param.u64 %rd3, [out];
  cvta.to.global.u64 %rd3, %rd3;
  mov.b64 %rd1, {a:#x};
  mov.b64 %rd2, {b:#x};
  setp.ne.b64 %p1, %rd3, 0;
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{acc}}}, %rd1, %rd2, 0, 1, 1, 0, 1;
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 0;
{stores}
  ret;
}}
"""
    res = assemble(ptx, "sm_90a", name="enc_wgmma", keep_dir=tmp_path)
    assert res.kernel("enc_wgmma").spills == 0


# ---- describe(): the decoded fields in words (the comments beside descriptors in the PTX) ----------

def test_idesc_describe_reference():
    """The two sm_100a instruction descriptors, read off Table 42 by hand."""
    assert TcgenInstrDesc.decode(0x08200490).describe() == "D f32, A bf16 K-major, B bf16 K-major, M 128, N 128"
    assert TcgenInstrDesc.decode(0x08210490).describe() == "D f32, A bf16 K-major, B bf16 MN-major, M 128, N 128"
    assert TcgenInstrDesc.decode(0x08110010).describe() == "D f32, A f16 K-major, B f16 MN-major, M 128, N 64"


@settings(max_examples=200, deadline=None)
@given(_valid_idesc)
def test_idesc_describe_round_trips_encode(d):
    text = TcgenInstrDesc.decode(d.encode()).describe()
    assert text == d.describe()
    m = re.fullmatch(r"D (f16|f32), A (b?f16) (K|MN)-major, B (b?f16) (K|MN)-major, M (\d+), N (\d+)(, .*)?", text)
    assert m, text
    assert (AccumType[m.group(1).upper()], MmaType[m.group(2).upper()], Major[m.group(3)], MmaType[m.group(4).upper()],
            Major[m.group(5)], int(m.group(6)), int(m.group(7))) == (d.d_type, d.a_type, d.a_major, d.b_type, d.b_major,
                                                                     d.m, d.n)
    assert ("negate" in text) == (d.negate_a or d.negate_b) and ("sparse" in text) == d.sparse


def test_smem_desc_describe_reference():
    k = SmemMatrixDesc.k_major_sw128("sm_100a", 0).encode()
    v = SmemMatrixDesc.mn_major_sw128("sm_100a", 0, panel_stride=128 * 128).encode()
    assert (k, v) == (0x4000404000010000, 0x4000404004000000)
    assert SmemMatrixDesc.decode(k, "sm_100a").describe() == "128B swizzle, LBO 16 B, SBO 1024 B, base offset 0"
    assert SmemMatrixDesc.decode(v, "sm_100a").describe() == "128B swizzle, LBO 16384 B, SBO 1024 B, base offset 0"
    assert SmemMatrixDesc("sm_90a", 0x400, 16, 1024, Swizzle.NONE).describe() == \
        "start 0x400, no swizzle, LBO 16 B, SBO 1024 B, base offset 0"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["sm_90a", "sm_100a"]), st.integers(0, (1 << 14) - 1), st.integers(0, (1 << 14) - 1),
       st.integers(0, (1 << 14) - 1), st.sampled_from([Swizzle.NONE, Swizzle.B32, Swizzle.B64, Swizzle.B128]),
       st.integers(0, 7))
def test_smem_desc_describe_round_trips_encode(arch, start, lbo, sbo, swz, base):
    if swz == Swizzle.NONE and arch == "sm_90a":
        base = 0
    d = SmemMatrixDesc(arch, start << 4, lbo=lbo << 4, sbo=sbo << 4, swizzle=swz, base_offset=base)
    text = SmemMatrixDesc.decode(d.encode(), arch).describe()
    assert text == d.describe()
    m = re.fullmatch(r"(start (0x[0-9a-f]+), )?(no|32B|64B|128B) swizzle, LBO (\d+) B, SBO (\d+) B, base offset (\d)",
                     text)
    assert m, text
    assert int(m.group(2) or "0", 16) == d.start_address
    assert {"no": 0, "32B": 32, "64B": 64, "128B": 128}[m.group(3)] == swz.span_bytes
    assert (int(m.group(4)), int(m.group(5)), int(m.group(6))) == (d.lbo, d.sbo, d.base_offset)
