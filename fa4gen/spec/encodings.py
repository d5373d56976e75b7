"""Bit-exact encodings the kernels hand to the hardware: pure data and pure functions.

ptxas accepts any 32/64-bit value as a tcgen05 instruction descriptor or a matrix descriptor: a
wrong bit is found only by wrong numbers on the GPU (or never, on the Blackwell path we cannot run
here). So every field below is written down once, with the PTX ISA table it comes from, and each
encoding has a decoder that rebuilds the same object (the tests check the round trip and values
derived by hand from those tables).

Sections are cited with PTX ISA 9.0 numbering (later ISA versions renumber tcgen05 to 9.7.17):
- 9.7.16.4.2, Table 42  tcgen05 instruction descriptor (kind::f16)
- 9.7.16.2.1, Table 39  tcgen05.mma shapes
- 9.7.16.4.1, Tables 40-41  tcgen05 shared memory descriptor
- 9.7.16.3     tcgen05 leading/stride dimension byte offsets
- 9.7.15.5.1.2.1-2  wgmma leading/stride byte offsets, canonical layouts, matrix descriptor format
- 9.7.16.1.1   Tensor Memory addressing
- CUDA driver API 6.30, cuTensorMapEncodeTiled: tensor map constraints
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, IntEnum


class EncodingError(ValueError):
    """A field value the hardware format cannot hold, or a combination the ISA forbids."""


def _field(value: int, lo: int, width: int) -> int:
    return (value >> lo) & ((1 << width) - 1)


def _check_uint(name: str, value: int, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise EncodingError(f"{name}={value!r} does not fit an unsigned {bits}-bit field")


# ---------------------------------------------------------------------------------------------
# tcgen05.mma instruction descriptor, kind::f16 (PTX ISA 9.0 §9.7.16.4.2, Table 42)
# ---------------------------------------------------------------------------------------------

class MmaType(IntEnum):
    """Operand element types of kind::f16. Values are the Table 42 codes of atype/btype."""

    F16 = 0
    BF16 = 1


class AccumType(IntEnum):
    """Accumulator (D) types of kind::f16. Values are the Table 42 codes of dtype (bits 4-5)."""

    F16 = 0
    F32 = 1


class Major(IntEnum):
    """Which dimension of an operand is contiguous in shared memory.

    K-major is the ISA's "no transpose" (A is MxK row-major, B is KxN column-major); MN-major is
    "transpose" (wgmma §9.7.15.5.1.2: imm-trans-a/b; tcgen05 Table 42: bits 15/16).
    """

    K = 0
    MN = 1


_MAJOR_WORD = {Major.K: "K-major", Major.MN: "MN-major"}

# (lo bit, width) of each Table 42 field; bits 6, 23 and 29 are reserved and must be 0.
_IDESC_FIELDS = {
    "sparsity_selector": (0, 2),
    "sparse": (2, 1),
    "saturate": (3, 1),
    "d_type": (4, 2),
    "a_type": (7, 3),
    "b_type": (10, 3),
    "negate_a": (13, 1),
    "negate_b": (14, 1),
    "a_major": (15, 1),
    "b_major": (16, 1),
    "n_shr3": (17, 6),
    "m_shr4": (24, 5),
    "max_shift": (30, 2),
}
_IDESC_RESERVED_MASK = (1 << 6) | (1 << 23) | (1 << 29)


@dataclass(frozen=True)
class TcgenInstrDesc:
    """The 32-bit instruction descriptor of `tcgen05.mma.cta_group::N.kind::f16`.

    Fields (PTX ISA 9.0 §9.7.16.4.2, Table 42, column .kind::f16):
      bits 0-1  sparsity_selector  which metadata selector, only with sparse
      bit  2    sparse             dense 0 / sparse 1
      bit  3    saturate           integer kinds only: must be 0 for kind::f16
      bits 4-5  d_type             F16 = 0, F32 = 1
      bits 7-9  a_type             F16 = 0, BF16 = 1
      bits 10-12 b_type            F16 = 0, BF16 = 1
      bit  13/14 negate_a/negate_b
      bit  15/16 a_major/b_major   "transpose A/B": K-major = 0, MN-major = 1
      bits 17-22 N >> 3
      bits 24-28 M >> 4
      bits 30-31 max_shift         B-reuse shift of the .ws variant (0 = none, 1/2/3 = 8/16/32)
    `cta_group` and `ws` are not encoded: they select which shapes are legal (Table 39).
    """

    m: int
    n: int
    a_type: MmaType = MmaType.BF16
    b_type: MmaType = MmaType.BF16
    d_type: AccumType = AccumType.F32
    a_major: Major = Major.K
    b_major: Major = Major.K
    negate_a: bool = False
    negate_b: bool = False
    sparse: bool = False
    sparsity_selector: int = 0
    saturate: bool = False
    max_shift: int = 0
    cta_group: int = 1
    ws: bool = False

    def __post_init__(self):
        for name, enum in (("a_type", MmaType), ("b_type", MmaType), ("d_type", AccumType),
                           ("a_major", Major), ("b_major", Major)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(value))
                except ValueError:
                    raise EncodingError(f"{name}={value!r}: not one of {[e.name for e in enum]}") from None
        if self.a_type != self.b_type:
            raise EncodingError("kind::f16 needs atype == btype (Table 39 lists f16xf16 and bf16xbf16 only)")
        if self.d_type == AccumType.F16 and self.a_type == MmaType.BF16:
            raise EncodingError("bf16 inputs accumulate in f32 only (Table 39: dtype .f16 needs atype .f16)")
        if self.saturate:
            raise EncodingError("saturate is for integer kinds; Table 42 fixes it to 0 for kind::f16")
        _check_uint("sparsity_selector", self.sparsity_selector, 2)
        if self.sparsity_selector and not self.sparse:
            raise EncodingError("sparsity_selector is only meaningful with sparse=True")
        _check_uint("max_shift", self.max_shift, 2)
        if self.max_shift and not self.ws:
            raise EncodingError("max_shift applies to tcgen05.mma.ws only (Table 42 bits 30-31)")
        self._check_shape()

    def _check_shape(self) -> None:
        # Table 39 (§9.7.16.2.1), kind::f16: K is implied (16 dense, 32 sparse), M/N are encoded.
        m, n = self.m, self.n
        for name, v in (("m", m), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise EncodingError(f"{name}={v!r} must be an int")
        if self.ws:
            if self.cta_group != 1:
                raise EncodingError("tcgen05.mma.ws exists for cta_group::1 only (Table 39)")
            ok_m, ok_n = (32, 64, 128), ((64, 128) if self.sparse else (64, 128, 256))
            if m not in ok_m or n not in ok_n:
                raise EncodingError(f"M={m}, N={n}: .ws kind::f16 needs M in {ok_m}, N in {ok_n}")
        elif self.cta_group == 1:
            # M = 64: N in 8..256 step 8; M = 128: N in 16..256 step 16 (CUTLASS's SM100_MMA_F16BF16_SS
            # asserts the same)
            step = 8 if m == 64 else 16
            if m not in (64, 128) or not (step <= n <= 256 and n % step == 0):
                raise EncodingError(f"M={m}, N={n}: cta_group::1 kind::f16 needs M in (64, 128), "
                                    f"N in {step}..256 step {step} (Table 39)")
        elif self.cta_group == 2:
            if m not in (128, 256) or not (16 <= n <= 256 and n % 16 == 0):
                raise EncodingError(f"M={m}, N={n}: cta_group::2 kind::f16 needs M in (128, 256), "
                                    "N in 16..256 step 16 (Table 39)")
        else:
            raise EncodingError(f"cta_group={self.cta_group!r}: 1 or 2")

    @property
    def k(self) -> int:
        """Reduction positions per instruction (Table 39: 16 dense, 32 sparse for 16-bit types)."""
        return 32 if self.sparse else 16

    def fields(self) -> dict[str, int]:
        return {
            "sparsity_selector": self.sparsity_selector,
            "sparse": int(self.sparse),
            "saturate": int(self.saturate),
            "d_type": int(self.d_type),
            "a_type": int(self.a_type),
            "b_type": int(self.b_type),
            "negate_a": int(self.negate_a),
            "negate_b": int(self.negate_b),
            "a_major": int(self.a_major),
            "b_major": int(self.b_major),
            "n_shr3": self.n >> 3,
            "m_shr4": self.m >> 4,
            "max_shift": self.max_shift,
        }

    def encode(self) -> int:
        value = 0
        for name, v in self.fields().items():
            lo, width = _IDESC_FIELDS[name]
            _check_uint(name, v, width)
            value |= v << lo
        return value

    @classmethod
    def decode(cls, value: int, *, cta_group: int = 1, ws: bool = False) -> "TcgenInstrDesc":
        _check_uint("instruction descriptor", value, 32)
        if value & _IDESC_RESERVED_MASK:
            raise EncodingError(f"{value:#010x}: reserved bits 6/23/29 are set (Table 42)")
        f = {name: _field(value, lo, w) for name, (lo, w) in _IDESC_FIELDS.items()}
        try:
            a_type, b_type = MmaType(f["a_type"]), MmaType(f["b_type"])
            d_type = AccumType(f["d_type"])
        except ValueError as e:
            raise EncodingError(f"{value:#010x}: not a kind::f16 descriptor ({e})") from None
        return cls(m=f["m_shr4"] << 4, n=f["n_shr3"] << 3, a_type=a_type, b_type=b_type,
                   d_type=d_type, a_major=Major(f["a_major"]), b_major=Major(f["b_major"]),
                   negate_a=bool(f["negate_a"]), negate_b=bool(f["negate_b"]),
                   sparse=bool(f["sparse"]), sparsity_selector=f["sparsity_selector"],
                   saturate=bool(f["saturate"]), max_shift=f["max_shift"],
                   cta_group=cta_group, ws=ws)

    def describe(self) -> str:
        """The fields in words, for a PTX comment beside the descriptor: "D f32, A bf16 K-major,
        B bf16 MN-major, M 128, N 128" (plus negate/sparse/max_shift when set). `decode(v).describe()`
        is what the lowering prints next to each tcgen05.mma, so the comment is the value's decoding."""
        parts = [f"D {self.d_type.name.lower()}",
                 f"A {self.a_type.name.lower()} {_MAJOR_WORD[self.a_major]}",
                 f"B {self.b_type.name.lower()} {_MAJOR_WORD[self.b_major]}",
                 f"M {self.m}", f"N {self.n}"]
        if self.negate_a or self.negate_b:
            parts.append("negate " + "+".join(x for x, f in (("A", self.negate_a), ("B", self.negate_b)) if f))
        if self.sparse:
            parts.append(f"sparse (selector {self.sparsity_selector})")
        if self.max_shift:
            parts.append(f"max_shift {self.max_shift}")
        return ", ".join(parts)

    @classmethod
    def for_dtype(cls, dtype: str, m: int, n: int, *, b_major: Major = Major.K, **kw) -> "TcgenInstrDesc":
        """fp16/bf16 inputs (KernelConfig.dtype spelling), fp32 accumulation."""
        types = {"fp16": MmaType.F16, "f16": MmaType.F16, "bf16": MmaType.BF16}
        if dtype not in types:
            raise EncodingError(f"dtype={dtype!r}: one of fp16, bf16")
        t = types[dtype]
        return cls(m=m, n=n, a_type=t, b_type=t, b_major=b_major, **kw)


# ---------------------------------------------------------------------------------------------
# Shared memory matrix descriptors: tcgen05 (sm_100a) and wgmma (sm_90a)
# ---------------------------------------------------------------------------------------------

class Swizzle(Enum):
    """Shared-memory swizzle modes, and their codes in each format that names them.

    value: (span bytes, TMA CUtensorMapSwizzle, wgmma 2-bit code, tcgen05 3-bit code).
    wgmma: §9.7.15.5.1.2.2 bits 62-63 (0 none, 1 128B, 2 64B, 3 32B).
    tcgen05: §9.7.16.4.1 Table 40 bits 61-63 (0 none, 1 128B with 32B atoms, 2 128B, 4 64B, 6 32B).
    TMA: CUDA driver API CUtensorMapSwizzle (0 none, 1 32B, 2 64B, 3 128B, 4 128B_ATOM_32B,
    5 128B_ATOM_32B_FLIP_8B, 6 128B_ATOM_64B). None: that format has no such mode.
    """

    NONE = (0, 0, 0, 0)
    B32 = (32, 1, 3, 6)
    B64 = (64, 2, 2, 4)
    B128 = (128, 3, 1, 2)
    B128_ATOM_32B = (128, 4, None, 1)
    B128_ATOM_32B_FLIP_8B = (128, 5, None, None)
    B128_ATOM_64B = (128, 6, None, None)

    @property
    def span_bytes(self) -> int:
        """Bytes of one swizzled row (0 = no swizzle)."""
        return self.value[0]

    @property
    def tma_code(self) -> int:
        return self.value[1]

    @property
    def wgmma_code(self) -> int:
        if self.value[2] is None:
            raise EncodingError(f"{self.name}: wgmma descriptors have no such swizzle mode")
        return self.value[2]

    @property
    def tcgen05_code(self) -> int:
        if self.value[3] is None:
            raise EncodingError(f"{self.name}: tcgen05 descriptors have no such swizzle mode")
        return self.value[3]

    @property
    def pattern_bytes(self) -> int:
        """Bytes after which the swizzle pattern repeats (Table 41): 8 rows of span_bytes."""
        return 8 * self.span_bytes

    @classmethod
    def from_wgmma_code(cls, code: int) -> "Swizzle":
        for s in cls:
            if s.value[2] == code:
                return s
        raise EncodingError(f"wgmma swizzle code {code}: not one of 0..3")

    @classmethod
    def from_tcgen05_code(cls, code: int) -> "Swizzle":
        for s in cls:
            if s.value[3] == code:
                return s
        raise EncodingError(f"tcgen05 swizzle code {code}: 3, 5 and 7 are invalid (Table 40)")

    @classmethod
    def from_tma_code(cls, code: int) -> "Swizzle":
        for s in cls:
            if s.value[1] == code:
                return s
        raise EncodingError(f"CUtensorMapSwizzle {code}: not one of 0..6")


class DescArch(Enum):
    SM100A = "sm_100a"  # tcgen05 shared memory descriptor
    SM90A = "sm_90a"  # wgmma matrix descriptor


class LboMode(IntEnum):
    """tcgen05 descriptor bit 52 (Table 40): how bits 16-29 are read. ABSOLUTE is sm_103a only."""

    RELATIVE = 0
    ABSOLUTE = 1


SMEM_DESC_ADDR_BITS = 18  # matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4: 256 KiB addressable
_TCGEN05_VERSION = 0b001  # Table 40 bits 46-48: "fixed constant value of 0b001"


def _desc_encode(name: str, x: int) -> int:
    """matrix-descriptor-encode (§9.7.15.5.1.2.2, Table 40): (x & 0x3FFFF) >> 4, x 16B aligned."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise EncodingError(f"{name}={x!r} must be a non-negative int (bytes)")
    if x % 16:
        raise EncodingError(f"{name}={x} must be 16-byte aligned: descriptors drop the 4 low bits")
    if x >= 1 << SMEM_DESC_ADDR_BITS:
        raise EncodingError(f"{name}={x} does not fit the descriptor's 14-bit (x >> 4) field (< 256 KiB)")
    return x >> 4


@dataclass(frozen=True)
class SmemMatrixDesc:
    """A 64-bit shared-memory matrix descriptor for tcgen05.mma (sm_100a) or wgmma (sm_90a).

    Byte quantities are stored unencoded; `encode()` applies (x & 0x3FFFF) >> 4.

    sm_90a wgmma (§9.7.15.5.1.2.2): bits 0-13 start>>4, 16-29 LBO>>4, 32-45 SBO>>4,
      49-51 base offset, 62-63 swizzle (2-bit code).
    sm_100a tcgen05 (§9.7.16.4.1, Table 40): bits 0-13 start>>4, 16-29 LBO>>4 (or absolute
      address), 32-45 SBO>>4, 46-48 fixed 0b001 (the descriptor version sm_100 requires: without it
      the MMA reads garbage), 49-51 base offset, 52 LBO mode, 53-60 fixed 0, 61-63 swizzle (3-bit).

    LBO / SBO meaning (§9.7.15.5.1.2.1, §9.7.16.3; rows/columns of the 128-bit-normalised matrix):
      K-major, swizzled:   LBO unused ("assumed 1"); SBO = offset between consecutive 8-row groups.
      K-major, no swizzle: LBO = offset between the two 8x16B core matrices along K; SBO as above.
      MN-major, swizzled:  LBO = offset between consecutive swizzle-span-wide panels along M/N;
                           SBO = offset between consecutive groups of 8 K positions.
      MN-major, interleave: LBO = offset between 8-column groups; SBO = offset between rows.
    base_offset (Table 41): 0 when the swizzle pattern starts on its natural boundary (1024 B for
      128B swizzle); otherwise (pattern start address >> 7) & 7.
    """

    arch: DescArch
    start_address: int
    lbo: int
    sbo: int
    swizzle: Swizzle
    base_offset: int = 0
    lbo_mode: LboMode = LboMode.RELATIVE

    def __post_init__(self):
        if not isinstance(self.arch, DescArch):
            try:
                object.__setattr__(self, "arch", DescArch(self.arch))
            except ValueError:
                raise EncodingError(f"arch={self.arch!r}: one of sm_100a, sm_90a") from None
        if not isinstance(self.swizzle, Swizzle):
            raise EncodingError(f"swizzle={self.swizzle!r}: a Swizzle member")
        object.__setattr__(self, "lbo_mode", LboMode(self.lbo_mode))
        _desc_encode("start_address", self.start_address)
        _desc_encode("lbo", self.lbo)
        _desc_encode("sbo", self.sbo)
        _check_uint("base_offset", self.base_offset, 3)
        if self.arch == DescArch.SM90A:
            self.swizzle.wgmma_code  # raises for modes wgmma lacks
            if self.lbo_mode != LboMode.RELATIVE:
                raise EncodingError("wgmma descriptors have no LBO mode bit")
            if self.base_offset and self.swizzle == Swizzle.NONE:
                raise EncodingError("base offset is not valid in no-swizzle mode (§9.7.15.5.1.2.2)")
        else:
            self.swizzle.tcgen05_code

    def encode(self) -> int:
        start = _desc_encode("start_address", self.start_address)
        lbo = _desc_encode("lbo", self.lbo)
        sbo = _desc_encode("sbo", self.sbo)
        value = start | (lbo << 16) | (sbo << 32) | (self.base_offset << 49)
        if self.arch == DescArch.SM90A:
            return value | (self.swizzle.wgmma_code << 62)
        return (value | (_TCGEN05_VERSION << 46) | (int(self.lbo_mode) << 52)
                | (self.swizzle.tcgen05_code << 61))

    @classmethod
    def decode(cls, value: int, arch: DescArch | str) -> "SmemMatrixDesc":
        _check_uint("matrix descriptor", value, 64)
        arch = DescArch(arch)
        common = dict(start_address=_field(value, 0, 14) << 4, lbo=_field(value, 16, 14) << 4,
                      sbo=_field(value, 32, 14) << 4, base_offset=_field(value, 49, 3))
        if arch == DescArch.SM90A:
            stray = value & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (0x7 << 49) | (0x3 << 62))
            if stray:
                raise EncodingError(f"{value:#018x}: bits outside the wgmma fields are set ({stray:#x})")
            return cls(arch, swizzle=Swizzle.from_wgmma_code(_field(value, 62, 2)), **common)
        if _field(value, 46, 3) != _TCGEN05_VERSION:
            raise EncodingError(f"{value:#018x}: bits 46-48 must be 0b001 for sm_100 (Table 40)")
        stray = value & ((0x3 << 14) | (0x3 << 30) | (0xFF << 53))
        if stray:
            raise EncodingError(f"{value:#018x}: reserved/fixed-zero bits are set ({stray:#x})")
        return cls(arch, swizzle=Swizzle.from_tcgen05_code(_field(value, 61, 3)),
                   lbo_mode=LboMode(_field(value, 52, 1)), **common)

    def describe(self) -> str:
        """The fields in words, for a PTX comment: "128B swizzle, LBO 16 B, SBO 1024 B, base offset 0"
        (start address first when nonzero; the sm_100a LBO mode when absolute). The lowering prints
        `decode(v, arch).describe()` beside each descriptor constant it materialises."""
        swz = {Swizzle.NONE: "no swizzle", Swizzle.B32: "32B swizzle", Swizzle.B64: "64B swizzle",
               Swizzle.B128: "128B swizzle"}.get(self.swizzle, f"{self.swizzle.name[1:]} swizzle")
        parts = [f"start {self.start_address:#x}"] if self.start_address else []
        parts += [swz, f"LBO {self.lbo} B", f"SBO {self.sbo} B", f"base offset {self.base_offset}"]
        if self.lbo_mode != LboMode.RELATIVE:
            parts.append("LBO absolute")
        return ", ".join(parts)

    # ---- the layouts the kernels use -------------------------------------------------------
    @classmethod
    def k_major_sw128(cls, arch: DescArch | str, start_address: int, *,
                      pattern_start: int | None = None) -> "SmemMatrixDesc":
        """Q or K (A or B operand of S = Q Kᵀ), K-major, written by TMA with 128B swizzle.

        Each row holds 64 16-bit elements (128 B) of the reduction dimension; 8 rows form one
        1024 B swizzle pattern, and the next 8 rows follow immediately: SBO = 8 x 128 B = 1024.
        LBO is unused for swizzled K-major layouts; the ISA says it is "assumed 1", so it is
        encoded as 1 (16 B). Advancing along K inside the 128 B row (16 elements = 32 B per MMA)
        moves only start_address; the pattern start stays the tile base, so base_offset is
        computed from `pattern_start` (default: start_address rounded down to 1024 B).
        """
        return cls.k_major(arch, start_address, Swizzle.B128, pattern_start=pattern_start)

    @classmethod
    def k_major(cls, arch: DescArch | str, start_address: int, swizzle: Swizzle, *,
                pattern_start: int | None = None) -> "SmemMatrixDesc":
        """K-major, TMA-written with a swizzle of span S bytes (128B: 64 16-bit elements per row; 64B:
        32): the canonical layout ((8, m), (T, 2k)) : ((S/16, SBO), (1, T)) in 16-byte units
        (§9.7.15.5.1.2.1), 8 rows of S bytes per pattern and the next 8 rows right after: SBO = 8 S.
        LBO unused (encoded 1). A k16 step inside the row advances start_address by 32 bytes."""
        return cls(arch, start_address, lbo=16, sbo=8 * swizzle.span_bytes, swizzle=swizzle,
                   base_offset=_base_offset(start_address, pattern_start, swizzle))

    @classmethod
    def mn_major_sw128(cls, arch: DescArch | str, start_address: int, *, panel_stride: int,
                       pattern_start: int | None = None) -> "SmemMatrixDesc":
        """V as the B operand of O = P V (N = head dim contiguous: MN-major), 128B swizzle.

        TMA writes V as panels of 64 head-dim elements (128 B) x block_n key rows. Inside a panel
        8 key rows make one 1024 B pattern: SBO = 1024 (offset between groups of 8 K positions).
        LBO = panel_stride, the offset between consecutive 64-element panels along N
        (block_n x 128 B for panels stored back to back), used when N spans several panels.
        """
        return cls.mn_major(arch, start_address, Swizzle.B128, panel_stride=panel_stride, pattern_start=pattern_start)

    @classmethod
    def mn_major(cls, arch: DescArch | str, start_address: int, swizzle: Swizzle, *, panel_stride: int,
                 pattern_start: int | None = None) -> "SmemMatrixDesc":
        """MN-major with a swizzle of span S bytes: the canonical layout ((T, S/16, m), (8, k)) :
        ((1, T, LBO), (S/16, SBO)) in 16-byte units (§9.7.15.5.1.2.1): S/2 16-bit elements of N per
        row, 8 K rows per pattern, SBO = 8 S; LBO = panel_stride between S-byte-wide panels along N."""
        return cls(arch, start_address, lbo=panel_stride, sbo=8 * swizzle.span_bytes, swizzle=swizzle,
                   base_offset=_base_offset(start_address, pattern_start, swizzle))


def _base_offset(start: int, pattern_start: int | None, swizzle: Swizzle) -> int:
    # Table 41: 0 when the repeating pattern starts on its natural boundary.
    if pattern_start is None:
        pattern_start = start - start % swizzle.pattern_bytes
    if pattern_start % swizzle.pattern_bytes == 0:
        return 0
    return (pattern_start >> 7) & 0x7


# ---------------------------------------------------------------------------------------------
# Tensor Memory (PTX ISA 9.0 §9.7.16.1)
# ---------------------------------------------------------------------------------------------

TMEM_LANES = 128  # rows per CTA on sm_100a (§9.7.16.1)
TMEM_COLUMNS = 512  # 32-bit columns per CTA (§9.7.16.1)
TMEM_ALLOC_MIN_COLUMNS = 32  # §9.7.16.1.2: allocation unit, a power of two in [32, 512]


def tmem_addr(lane: int, column: int) -> int:
    """32-bit Tensor Memory address: lane in bits 31-16, column in bits 15-0 (§9.7.16.1.1)."""
    for name, v, limit in (("lane", lane, TMEM_LANES), ("column", column, TMEM_COLUMNS)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < limit:
            raise EncodingError(f"TMEM {name}={v!r} outside [0, {limit})")
    return (lane << 16) | column


def tmem_addr_split(addr: int) -> tuple[int, int]:
    """(lane, column) of a TMEM address; inverse of tmem_addr."""
    _check_uint("TMEM address", addr, 32)
    lane, column = addr >> 16, addr & 0xFFFF
    tmem_addr(lane, column)  # bounds
    return lane, column


def f16_col_to_phys(col: int) -> int:
    """Physical 32-bit TMEM column holding 16-bit column `col` of a packed fp16/bf16 view.

    tcgen05.st/ld of 16-bit data pack two values per 32-bit cell, so P (128 fp16 columns) occupies
    64 physical columns: the FA4 P-over-S aliasing (P at [64, 128) inside S's [0, 128)).
    """
    if isinstance(col, bool) or not isinstance(col, int) or not 0 <= col < 2 * TMEM_COLUMNS:
        raise EncodingError(f"fp16 TMEM column {col!r} outside [0, {2 * TMEM_COLUMNS})")
    return col // 2


def check_tmem_alloc(ncols: int) -> int:
    """tcgen05.alloc column count: a power of two in [32, 512] (§9.7.16.1.2)."""
    if (isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < TMEM_ALLOC_MIN_COLUMNS
            or ncols > TMEM_COLUMNS or ncols & (ncols - 1)):
        raise EncodingError(f"tcgen05.alloc of {ncols!r} columns: a power of two in [32, 512]")
    return ncols


def tmem_lane_base_for_warp(warp_id: int) -> int:
    """First TMEM lane a warp may tcgen05.ld/st: warp w of a warpgroup owns lanes
    32*(w%4) .. 32*(w%4)+31 (§9.7.16.8.1 access restrictions), whatever the warpgroup."""
    if isinstance(warp_id, bool) or not isinstance(warp_id, int) or warp_id < 0:
        raise EncodingError(f"warp_id={warp_id!r} must be a non-negative int")
    return 32 * (warp_id % 4)


# ---------------------------------------------------------------------------------------------
# TMA tensor maps (CUDA driver API 6.30, cuTensorMapEncodeTiled)
# ---------------------------------------------------------------------------------------------

class TmaDtype(Enum):
    """CUtensorMapDataType: (driver code, element bytes, floating point)."""

    UINT8 = (0, 1, False)
    UINT16 = (1, 2, False)
    UINT32 = (2, 4, False)
    INT32 = (3, 4, False)
    UINT64 = (4, 8, False)
    INT64 = (5, 8, False)
    FLOAT16 = (6, 2, True)
    FLOAT32 = (7, 4, True)
    FLOAT64 = (8, 8, True)
    BFLOAT16 = (9, 2, True)
    FLOAT32_FTZ = (10, 4, True)
    TFLOAT32 = (11, 4, True)
    TFLOAT32_FTZ = (12, 4, True)

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def is_float(self) -> bool:
        return self.value[2]

    @classmethod
    def from_name(cls, name: str) -> "TmaDtype":
        """Accepts the manifest's spelling (fp16, bf16, fp32) as well as the enum names."""
        aliases = {"fp16": cls.FLOAT16, "f16": cls.FLOAT16, "bf16": cls.BFLOAT16,
                   "fp32": cls.FLOAT32, "f32": cls.FLOAT32}
        if name in aliases:
            return aliases[name]
        try:
            return cls[name.upper()]
        except KeyError:
            raise TensorMapError(f"tensor map dtype {name!r}: one of fp16, bf16, fp32 or a "
                                f"CUtensorMapDataType name") from None


class TmaInterleave(IntEnum):
    NONE = 0
    B16 = 1
    B32 = 2


class TmaL2Promotion(IntEnum):
    NONE = 0
    L2_64B = 1
    L2_128B = 2
    L2_256B = 3

    @property
    def label(self) -> str:
        """The manifest's name of the mode: "none", "64B", "128B", "256B"."""
        return "none" if self is TmaL2Promotion.NONE else self.name[len("L2_"):]

    @classmethod
    def from_label(cls, label: str) -> "TmaL2Promotion":
        for mode in cls:
            if mode.label == label:
                return mode
        raise EncodingError(f"L2 promotion {label!r}: one of {', '.join(m.label for m in cls)}")


class TmaOobFill(IntEnum):
    NONE = 0  # out-of-bound elements read as zero
    NAN_REQUEST_ZERO_FMA = 1


TMA_MAX_RANK = 5
TMA_MAX_BOX = 256
TMA_MAX_ELEM_STRIDE = 8
TMA_MAX_GLOBAL_DIM = 1 << 32
TMA_MAX_GLOBAL_STRIDE = 1 << 40


class TensorMapError(EncodingError):
    """A tensor map the driver would reject (CUDA_ERROR_INVALID_VALUE), said in words."""


@dataclass(frozen=True)
class TensorMapArgs:
    """Exactly the arguments of cuTensorMapEncodeTiled after validation (enum codes as ints).

    global_strides has rank - 1 entries, except for rank 1 where it holds one unused entry.
    """

    dtype: int
    rank: int
    global_dim: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dim: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


@dataclass(frozen=True)
class TensorMapSpec:
    """A tiled TMA tensor map, innermost dimension first (the driver's order).

    `dims` names each dimension (the manifest's "D", "G", "Hkv", ...); `box` is the elements per
    dimension of one copy; `elem_strides` the traversal step (all 1 here). The global sizes and
    byte strides come from the tensor at run time: `validate(shape, strides_bytes)` checks them
    and the static fields against the constraints documented for cuTensorMapEncodeTiled, so a bad
    view fails with a sentence, not with CUDA_ERROR_INVALID_VALUE.
    """

    dtype: TmaDtype
    dims: tuple[str, ...]
    box: tuple[int, ...]
    swizzle: Swizzle = Swizzle.B128
    elem_strides: tuple[int, ...] | None = None
    interleave: TmaInterleave = TmaInterleave.NONE
    l2_promotion: TmaL2Promotion = TmaL2Promotion.L2_128B
    oob_fill: TmaOobFill = TmaOobFill.NONE

    def __post_init__(self):
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", TmaDtype.from_name(self.dtype))
        if not isinstance(self.dtype, TmaDtype):
            raise TensorMapError(f"dtype={self.dtype!r}: a TmaDtype")
        if isinstance(self.swizzle, str):
            object.__setattr__(self, "swizzle", swizzle_from_name(self.swizzle))
        object.__setattr__(self, "dims", tuple(self.dims))
        object.__setattr__(self, "box", tuple(self.box))
        rank = len(self.box)
        es = (1,) * rank if self.elem_strides is None else tuple(self.elem_strides)
        object.__setattr__(self, "elem_strides", es)
        object.__setattr__(self, "interleave", TmaInterleave(self.interleave))
        object.__setattr__(self, "l2_promotion", TmaL2Promotion(self.l2_promotion))
        object.__setattr__(self, "oob_fill", TmaOobFill(self.oob_fill))
        self._check_static()

    @property
    def rank(self) -> int:
        return len(self.box)

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (the mbarrier expect_tx count per box)."""
        n = 1
        for b, s in zip(self.box, self.elem_strides):
            n *= math.ceil(b / s)
        return n * self.dtype.itemsize

    def _check_static(self) -> None:
        rank, esize = self.rank, self.dtype.itemsize
        if not 1 <= rank <= TMA_MAX_RANK:
            raise TensorMapError(f"rank {rank}: tensorRank must be 1..{TMA_MAX_RANK}")
        if len(self.dims) != rank or len(self.elem_strides) != rank:
            raise TensorMapError(f"dims {self.dims}, box {self.box}, elem_strides {self.elem_strides}: "
                                 "need one entry per dimension")
        if self.interleave != TmaInterleave.NONE and rank < 3:
            raise TensorMapError(f"interleave {self.interleave.name} needs tensorRank >= 3 (rank {rank})")
        for name, b in zip(self.dims, self.box):
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= TMA_MAX_BOX:
                raise TensorMapError(f"box[{name}]={b!r}: boxDim must be in 1..{TMA_MAX_BOX}")
        for name, s in zip(self.dims, self.elem_strides):
            if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= TMA_MAX_ELEM_STRIDE:
                raise TensorMapError(f"elem_strides[{name}]={s!r}: must be in 1..{TMA_MAX_ELEM_STRIDE}")
        inner = self.box[0] * esize
        if self.interleave == TmaInterleave.NONE:
            if inner % 16:
                raise TensorMapError(f"box inner dimension {self.dims[0]} = {self.box[0]} x {esize} B "
                                     f"= {inner} B: must be a multiple of 16 B without interleave")
            if self.swizzle != Swizzle.NONE and inner > self.swizzle.span_bytes:
                raise TensorMapError(f"box inner dimension {self.dims[0]} = {inner} B exceeds the "
                                     f"{self.swizzle.name} swizzle span of {self.swizzle.span_bytes} B: "
                                     f"split it into boxes of {self.swizzle.span_bytes // esize} elements")
        if self.interleave == TmaInterleave.B32 and self.swizzle != Swizzle.B32:
            # Documented for cuTensorMapEncodeTiled; driver r580 was seen to accept it anyway.
            raise TensorMapError("interleave 32B requires swizzle 32B")
        if self.oob_fill == TmaOobFill.NAN_REQUEST_ZERO_FMA and not self.dtype.is_float:
            raise TensorMapError("oob fill NAN_REQUEST_ZERO_FMA needs a floating-point dtype")

    def validate(self, shape, strides_bytes, address: int | None = None) -> TensorMapArgs:
        """Check a concrete tensor view and return the driver call's arguments.

        shape: global sizes in elements, innermost first (len == rank).
        strides_bytes: byte strides of dimensions 1..rank-1 (the driver's globalStrides; the
          innermost dimension must be contiguous, TMA has no stride for it).
        address: the global base address, if known (must be 16 B aligned; 32 B for interleave 32B).
        """
        shape, strides = tuple(shape), tuple(strides_bytes)
        rank = self.rank
        if len(shape) != rank:
            raise TensorMapError(f"shape {shape} has {len(shape)} dims, the map {self.dims} has {rank}")
        if len(strides) != rank - 1:
            raise TensorMapError(f"strides_bytes {strides}: need the {rank - 1} byte strides of "
                                 f"dims {self.dims[1:]} (the innermost dim is contiguous)")
        for name, n in zip(self.dims, shape):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= TMA_MAX_GLOBAL_DIM:
                raise TensorMapError(f"global dim {name}={n!r}: must be in 1..2^32")
        align = 32 if self.interleave == TmaInterleave.B32 else 16
        for name, s in zip(self.dims[1:], strides):
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise TensorMapError(f"stride of {name}={s!r}: a positive byte count")
            if s % align:
                raise TensorMapError(f"stride of {name} = {s} B is not a multiple of {align} B: TMA needs "
                                     f"{align}-byte aligned rows (pad or make the tensor contiguous)")
            if s >= TMA_MAX_GLOBAL_STRIDE:
                raise TensorMapError(f"stride of {name} = {s} B: must be < 2^40")
        if address is not None:
            if address % align:
                raise TensorMapError(f"global address {address:#x} is not {align}-byte aligned")
        if rank == 1:
            # cuda-bindings passes an empty list as NULL, which driver r580 rejects
            # (CUDA_ERROR_INVALID_VALUE, seen on the H200 with cuda-bindings 13.3.1); one stride
            # of the padded row, which a rank-1 map never reads, is accepted.
            row = shape[0] * self.dtype.itemsize
            strides = (-(-row // 16) * 16,)
        return TensorMapArgs(dtype=self.dtype.code, rank=rank, global_dim=shape, global_strides=strides,
                             box_dim=self.box, element_strides=self.elem_strides,
                             interleave=int(self.interleave), swizzle=self.swizzle.tma_code,
                             l2_promotion=int(self.l2_promotion), oob_fill=int(self.oob_fill))


def swizzle_from_name(name: str) -> Swizzle:
    """The manifest's spelling: "none", "32B", "64B", "128B"."""
    table = {"none": Swizzle.NONE, "32b": Swizzle.B32, "64b": Swizzle.B64, "128b": Swizzle.B128}
    key = name.lower()
    if key in table:
        return table[key]
    try:
        return Swizzle[name.upper()]
    except KeyError:
        raise TensorMapError(f"swizzle {name!r}: one of none, 32B, 64B, 128B") from None
