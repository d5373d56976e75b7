"""Data paths of the asynchronous units, bit by bit: tensor maps, TMA boxes with swizzle, the
shared-memory matrix descriptors of tcgen05.mma / wgmma and their canonical layouts, and the wgmma
register fragments. Pure functions over NumPy arrays; the machine (machine.py) decides when they run.

Field positions come from the PTX ISA (tcgen05 shared memory descriptor, Table 40; instruction
descriptor, Table 42; wgmma matrix descriptor; canonical layouts in units of 16 bytes) and the CUDA
driver's cuTensorMapEncodeTiled arguments. Decoding never trusts the generator: every field the PTX
hands over is read from the instruction's operands.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np

from ...runtime.runtime import map_l2_promotion, tensor_map_geometry
from ...spec.encodings import EncodingError, Swizzle, TcgenInstrDesc, TensorMapArgs, TensorMapSpec, TmaDtype, TmaL2Promotion


class UnitError(Exception):
    """A unit rejected what the PTX handed it (the machine turns it into a Fault)."""


# ---- tensor maps: the emulator's 128-byte image of cuTensorMapEncodeTiled's arguments ------------
TMAP_MAGIC = 0x54344146  # "FA4T"
TMAP_BYTES = 128


def manifest_tensor_map(man: dict, role: str, shape: tuple, pack: int, global_address: int) -> bytes:
    """The encoded tensor map of `role` (the manifest's map: dims, box, swizzle, dtype, L2 promotion) over
    a contiguous 2-byte tensor of `shape` at global_address, validated as the runtime's would be."""
    from ...runtime.runtime import map_l2_promotion, tensor_map_geometry

    spec = man["tensor_maps"][role]
    strides = tuple(int(s) for s in np.cumprod((1,) + tuple(shape)[::-1][:-1])[::-1])
    geo = tensor_map_geometry(role, spec, tuple(shape), strides, 2, pack)
    tms = TensorMapSpec(dtype=spec["dtype"], dims=tuple(spec["dims"]), box=geo.box, swizzle=spec["swizzle"],
                        l2_promotion=TmaL2Promotion.from_label(map_l2_promotion(role, spec, "kvcache" in man)))
    return encode_tensor_map(tms.validate(geo.dims, geo.strides, global_address), global_address)


def encode_tensor_map(args: TensorMapArgs, global_address: int) -> bytes:
    """128 bytes: the same arguments the runtime passes to cuTensorMapEncodeTiled, in a layout of
    ours (the driver's CUtensorMap is opaque): magic, dtype, rank, swizzle, address, dims, strides,
    box, element strides, interleave, oob fill."""
    rank = args.rank
    dims = list(args.global_dim) + [1] * (5 - rank)
    strides = list(args.global_strides[: max(rank - 1, 0)]) + [0] * (4 - max(rank - 1, 0))
    box = list(args.box_dim) + [1] * (5 - rank)
    es = list(args.element_strides) + [1] * (5 - rank)
    raw = struct.pack("<IIII", TMAP_MAGIC, args.dtype, rank, args.swizzle)
    raw += struct.pack("<Q", global_address)
    raw += struct.pack("<5Q", *dims)
    raw += struct.pack("<4Q", *strides)
    raw += struct.pack("<5I", *box)
    raw += struct.pack("<5B", *es)
    raw += struct.pack("<BB", args.interleave, args.oob_fill)
    return raw + bytes(TMAP_BYTES - len(raw))


@dataclass(frozen=True)
class TensorMap:
    dtype: TmaDtype
    rank: int
    swizzle: Swizzle
    address: int
    dims: tuple
    strides: tuple  # bytes of dims 1..rank-1
    box: tuple
    elem_strides: tuple
    interleave: int
    oob_fill: int

    @property
    def esize(self) -> int:
        return self.dtype.itemsize

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * self.esize


def decode_tensor_map(raw: bytes) -> TensorMap:
    if len(raw) < TMAP_BYTES:
        raise UnitError("tensor map: fewer than 128 bytes")
    magic, dtype, rank, swz = struct.unpack_from("<IIII", raw, 0)
    if magic != TMAP_MAGIC:
        raise UnitError(f"not a tensor map (magic {magic:#x}): the operand does not point at a CUtensorMap")
    (addr,) = struct.unpack_from("<Q", raw, 16)
    dims = struct.unpack_from("<5Q", raw, 24)
    strides = struct.unpack_from("<4Q", raw, 64)
    box = struct.unpack_from("<5I", raw, 96)
    es = struct.unpack_from("<5B", raw, 116)
    inter, oob = struct.unpack_from("<BB", raw, 121)
    try:
        dt = next(d for d in TmaDtype if d.code == dtype)
        sw = Swizzle.from_tma_code(swz)
    except (StopIteration, EncodingError) as e:
        raise UnitError(f"tensor map: bad dtype/swizzle code ({e})") from None
    if not 1 <= rank <= 5:
        raise UnitError(f"tensor map: rank {rank}")
    return TensorMap(dt, rank, sw, addr, dims[:rank], strides[: rank - 1], box[:rank], es[:rank], inter, oob)


def swizzle_addr(addr: np.ndarray, swizzle: Swizzle) -> np.ndarray:
    """Physical shared-memory byte address of a logical one: bits [4, 4+b) ^= bits [7, 7+b)."""
    span = swizzle.span_bytes
    if span == 0:
        return addr
    bits = {32: 1, 64: 2, 128: 3}[span]
    if swizzle is not Swizzle.B32 and swizzle is not Swizzle.B64 and swizzle is not Swizzle.B128:
        raise UnitError(f"swizzle mode {swizzle.name} is not modelled")
    mask = (1 << bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def tma_box_plan(tm: TensorMap, coords: tuple, smem_addr: int):
    """Where each element of one box goes: (gmem byte offsets from the map's base, in-bounds mask,
    physical SMEM byte addresses), all flattened with dim 0 fastest."""
    if tm.interleave != 0:
        raise UnitError("interleaved tensor maps are not modelled")
    if any(e != 1 for e in tm.elem_strides):
        raise UnitError("element strides other than 1 are not modelled")
    if len(coords) != tm.rank:
        raise UnitError(f"{len(coords)} coordinates for a rank-{tm.rank} tensor map")
    es = tm.esize
    row_bytes = tm.box[0] * es
    span = tm.swizzle.span_bytes
    if span and row_bytes != span:
        raise UnitError(f"box inner extent {row_bytes} B with {tm.swizzle.name}: only full-span rows are modelled")
    if smem_addr % 128:
        raise UnitError(f"TMA shared-memory address {smem_addr:#x} is not 128-byte aligned")
    if span and smem_addr % (8 * span):
        raise UnitError(f"TMA shared-memory address {smem_addr:#x} is not aligned to the "
                        f"{8 * span}-byte {tm.swizzle.name} pattern")
    strides = (es,) + tuple(tm.strides)
    idx = [np.asarray(coords[i], np.int64) + np.arange(tm.box[i], dtype=np.int64) for i in range(tm.rank)]
    grids = np.meshgrid(*idx[::-1], indexing="ij")  # outermost first -> C order = dim0 fastest
    grids = grids[::-1]
    valid = np.ones(grids[0].shape, bool)
    off = np.zeros(grids[0].shape, np.int64)
    for i in range(tm.rank):
        valid &= (grids[i] >= 0) & (grids[i] < tm.dims[i])
        off += grids[i] * strides[i]
    n = valid.size
    logical = smem_addr + np.arange(n, dtype=np.int64) * es
    phys = swizzle_addr(logical, tm.swizzle)
    return off.reshape(-1), valid.reshape(-1), phys


# ---- matrix descriptors ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MatDesc:
    start: int
    lbo: int
    sbo: int
    base_offset: int
    swizzle: Swizzle
    lbo_mode: int = 0


def decode_desc(value: int, arch: str) -> MatDesc:
    value &= (1 << 64) - 1
    f = lambda lo, w: (value >> lo) & ((1 << w) - 1)  # noqa: E731
    start, lbo, sbo, base = f(0, 14) << 4, f(16, 14) << 4, f(32, 14) << 4, f(49, 3)
    try:
        if arch == "sm_90a":
            stray = value & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (0x7 << 49) | (0x3 << 62))
            if stray:
                raise UnitError(f"wgmma descriptor {value:#018x}: bits outside its fields are set ({stray:#x})")
            return MatDesc(start, lbo, sbo, base, Swizzle.from_wgmma_code(f(62, 2)))
        if f(46, 3) != 0b001:
            raise UnitError(f"tcgen05 descriptor {value:#018x}: bits 46-48 must be 0b001 (Table 40)")
        stray = value & ((0x3 << 14) | (0x3 << 30) | (0xFF << 53))
        if stray:
            raise UnitError(f"tcgen05 descriptor {value:#018x}: fixed-zero bits are set ({stray:#x})")
        return MatDesc(start, lbo, sbo, base, Swizzle.from_tcgen05_code(f(61, 3)), f(52, 1))
    except EncodingError as e:
        raise UnitError(str(e)) from None


def operand_addresses(d: MatDesc, mn_major: bool, rows: int, k: int, esize: int) -> np.ndarray:
    """Physical SMEM byte address of element (mn, k) of one MMA operand, shape [rows, k], from the
    canonical layouts (units of 16 bytes, T = 16 / esize elements):
      K-major, swizzle span S: ((8, m), (T, 2k)) : ((S/16 units, SBO), (1, T)) -> row r at (r%8)*S +
        (r//8)*SBO, element k at k*esize inside the row (LBO unused);
      K-major, no swizzle: core matrices of 8 rows x 16 B: (r%8)*16 + (r//8)*SBO + (k%T)*esize + (k//T)*LBO;
      MN-major, swizzle span S: ((T, S/16, m), (8, k)) : ((1, T, LBO), (S/16 units, SBO)) -> element
        mn at (mn % (S/esize))*esize + (mn // (S/esize))*LBO, k at (k%8)*S + (k//8)*SBO.
    The swizzle is a function of the address bits (patterns start on 8*S-byte boundaries)."""
    if d.lbo_mode:
        raise UnitError("descriptor LBO mode 1 (absolute) is not modelled")
    if d.base_offset:
        raise UnitError(f"descriptor base offset {d.base_offset}: only patterns on their natural boundary are modelled")
    r = np.arange(rows, dtype=np.int64)[:, None]
    kk = np.arange(k, dtype=np.int64)[None, :]
    span = d.swizzle.span_bytes
    T = 16 // esize
    if not mn_major:
        if span:
            if k * esize > span:
                raise UnitError(f"K extent {k * esize} B exceeds the {span} B swizzle row")
            logical = d.start + (r % 8) * span + (r // 8) * d.sbo + kk * esize
        else:
            logical = d.start + (r % 8) * 16 + (r // 8) * d.sbo + (kk % T) * esize + (kk // T) * d.lbo
    else:
        if not span:
            raise UnitError("MN-major operands without swizzle are not modelled")
        per = span // esize
        logical = d.start + (r % per) * esize + (r // per) * d.lbo + (kk % 8) * span + (kk // 8) * d.sbo
    return swizzle_addr(logical, d.swizzle)


def decode_idesc(value: int) -> TcgenInstrDesc:
    try:
        return TcgenInstrDesc.decode(value & 0xFFFFFFFF)
    except EncodingError as e:
        raise UnitError(f"instruction descriptor {value:#010x}: {e}") from None


# ---- wgmma register fragments (m64nNk16, 16-bit A/B, f32 accumulators) --------------------------
# Memoised (every wgmma instruction of a kernel compiles them for its four warps, a large part of
# compiling an sm_90a kernel) and read-only, as the cached arrays are shared.
def _frozen(*arrays):
    for a in arrays:
        a.flags.writeable = False
    return arrays


@functools.lru_cache(maxsize=None)
def wgmma_d_index(n: int, warp_in_group: int):
    """(rows, cols) of accumulator register j for each lane: arrays of shape [n//2, 32].
    Thread lane l of warp w holds rows 16w + l//4 (+8) and columns 8i + 2(l%4) (+1):
    d[4i + 0..3] = (r, c), (r, c+1), (r+8, c), (r+8, c+1)."""
    lane = np.arange(32)
    r0 = 16 * warp_in_group + lane // 4
    c0 = 2 * (lane % 4)
    rows, cols = [], []
    for i in range(n // 8):
        for j in range(4):
            rows.append(r0 + (8 if j >= 2 else 0))
            cols.append(8 * i + c0 + (j & 1))
    return _frozen(np.array(rows), np.array(cols))


@functools.lru_cache(maxsize=None)
def wgmma_a_index(warp_in_group: int):
    """(rows, k) of the two 16-bit halves (low, high) of A register j in 0..3 per lane, shape
    [4, 2, 32]: a0 = (r, 2(l%4) + {0,1}), a1 = (r+8, ...), a2 = (r, 8 + ...), a3 = (r+8, 8 + ...)."""
    lane = np.arange(32)
    r0 = 16 * warp_in_group + lane // 4
    k0 = 2 * (lane % 4)
    rows = np.zeros((4, 2, 32), np.int64)
    ks = np.zeros((4, 2, 32), np.int64)
    for j in range(4):
        for h in range(2):
            rows[j, h] = r0 + (8 if j in (1, 3) else 0)
            ks[j, h] = k0 + (8 if j >= 2 else 0) + h
    return _frozen(rows, ks)
