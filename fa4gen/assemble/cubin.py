"""What a cubin's ELF header says: is it one, and for which SM.

Read from cubins that ptxas 13.0 (V13.0.88) assembled here: ELF64 little-endian, e_ident[EI_OSABI]
0x41 (the CUDA ABI), e_machine EM_CUDA = 190, and the SM number in bits 8-15 of e_flags:

    -arch=sm_80    e_flags 0x06005004      -arch=sm_100a  e_flags 0x06006402
    -arch=sm_90a   e_flags 0x06005a04      -arch=sm_120a  e_flags 0x06007802

(sm_90 and sm_90a, sm_100 / sm_100a / sm_100f give the same e_flags: the header tells the SM
number, not the arch-specific suffix.) Older toolchains write EI_OSABI 0x33 with the SM in bits 0-7.
"""

from __future__ import annotations

import re
import struct

EM_CUDA = 190
ELFOSABI_CUDA_V1 = 0x33
ELFOSABI_CUDA_V2 = 0x41
_ARCH_RE = re.compile(r"^sm_(\d{2,3})[af]?$")


class NotACubin(ValueError):
    """Bytes that are not a CUDA ELF for the SM asked for."""


def cubin_sm(data: bytes) -> int:
    """The SM number a cubin's ELF header names (90, 100, ...); NotACubin when it is none."""
    data = bytes(data[:64])
    if len(data) < 64:
        raise NotACubin(f"{len(data)} bytes is shorter than an ELF64 header")
    if data[:4] != b"\x7fELF":
        raise NotACubin("no ELF magic")
    if data[4] != 2 or data[5] != 1:
        raise NotACubin("not a 64-bit little-endian ELF")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise NotACubin(f"ELF machine {machine}, not EM_CUDA ({EM_CUDA})")
    (flags,) = struct.unpack_from("<I", data, 48)
    osabi = data[7]
    if osabi == ELFOSABI_CUDA_V2:
        return (flags >> 8) & 0xFF
    if osabi == ELFOSABI_CUDA_V1:
        return flags & 0xFF
    raise NotACubin(f"ELF OS/ABI {osabi:#x} is not a CUDA one")


def arch_sm(arch: str) -> int:
    m = _ARCH_RE.match(str(arch))
    if not m:
        raise ValueError(f"arch {arch!r}: expected e.g. sm_90a")
    return int(m.group(1))


def cubin_problem(data: bytes, arch: str) -> str | None:
    """Why data is not a cubin for arch (None: it is, as far as the header tells)."""
    try:
        sm = cubin_sm(data)
    except NotACubin as e:
        return f"not a cubin ({e})"
    want = arch_sm(arch)
    if sm != want:
        return f"a cubin for sm_{sm}, not {arch}"
    return None


def fake_header(arch: str) -> bytes:
    """A 64-byte ELF header the way ptxas 13 writes it for arch (for tests of code that checks it)."""
    h = bytearray(64)
    h[:8] = b"\x7fELF\x02\x01\x01" + bytes([ELFOSABI_CUDA_V2])
    h[8] = 8
    struct.pack_into("<HH", h, 16, 2, EM_CUDA)
    struct.pack_into("<I", h, 48, 0x06000000 | (arch_sm(arch) << 8) | 0x02)
    return bytes(h)
