"""The PTX emulator's global atomic, atom{.sem}{.scope}.global.add.{u32,s32,u64}: a fetch-and-add per
lane in lane order (lanes of one address see each other's additions), modulo 2^width, the old value
in the destination, updated by every CTA without the written-once finding of outputs; other atomics
refused when the program is compiled."""
from __future__ import annotations

import numpy as np
import pytest

from fa4gen.evidence.ptxemu.harness import run_raw
from fa4gen.evidence.ptxemu.machine import Fault
from fa4gen.evidence.ptxemu.parse import UnsupportedInstruction


def _kernel(atom: str, t: str = "b32", src: str = "1", regs: str = "") -> str:
    """Thread g = %ctaid.x * %ntid.x + %tid.x runs `atom %v, [ctr], src` and stores %v at out[g]."""
    w = 8 if t == "b64" else 4
    return f""".version 8.5
.target sm_90a
.address_size 64
.visible .entry k(
    .param .u64 ctr,
    .param .u64 out
)
{{
    .reg .b64 %rd<4>; .reg .b32 %r<4>; .reg .{t} %v; {regs}
    ld.param.u64 %rd0, [ctr];
    ld.param.u64 %rd1, [out];
    mov.u32 %r0, %tid.x;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mad.lo.u32 %r3, %r1, %r2, %r0;
    {atom} %v, [%rd0], {src};
    mul.wide.u32 %rd2, %r3, {w};
    add.s64 %rd3, %rd1, %rd2;
    st.global.{"u64" if w == 8 else "u32"} [%rd3], %v;
    ret;
}}
"""


@pytest.mark.parametrize("atom", ["atom.global.add.u32", "atom.relaxed.gpu.global.add.u32"])
def test_counter_hands_every_thread_of_every_cta_a_distinct_ticket(atom):
    ctr, out = run_raw(_kernel(atom), threads=64, ctas=2,
                       args=(np.zeros(1, np.uint32), np.full(128, 0xDEAD, np.uint32)))
    assert ctr[0] == 128
    assert sorted(out.tolist()) == list(range(128))
    # the lanes of a warp take consecutive tickets in lane order; the CTAs run one after another
    assert (np.diff(out.reshape(4, 32).astype(np.int64), axis=1) == 1).all()
    assert sorted(out[:64].tolist()) == list(range(64))


def test_register_source_and_lane_order_within_a_warp():
    ptx = _kernel("atom.global.add.u32", src="%r0")  # thread t adds t
    ctr, out = run_raw(ptx, threads=32, args=(np.full(1, 5, np.uint32), np.zeros(32, np.uint32)))
    want = 5 + np.concatenate([[0], np.cumsum(np.arange(31))])
    assert np.array_equal(out, want.astype(np.uint32))
    assert ctr[0] == 5 + sum(range(32))


def test_s32_add_of_minus_one_counts_down_through_zero():
    ctr, out = run_raw(_kernel("atom.global.add.s32", src="-1"), threads=64, ctas=2,
                       args=(np.full(1, 10, np.int32), np.zeros(128, np.int32)))
    assert ctr[0] == 10 - 128
    assert sorted(out.tolist()) == list(range(10 - 127, 11))


def test_u32_wraps_modulo_two_to_the_32():
    ctr, out = run_raw(_kernel("atom.global.add.u32"), threads=32,
                       args=(np.full(1, 0xFFFFFFF0, np.uint32), np.zeros(32, np.uint32)))
    assert ctr[0] == 16
    assert out.tolist() == [(0xFFFFFFF0 + i) & 0xFFFFFFFF for i in range(32)]


def test_u64_add():
    ctr, out = run_raw(_kernel("atom.global.add.u64", t="b64", src="3"), threads=32, ctas=2,
                       args=(np.full(1, (1 << 40) - 5, np.uint64), np.zeros(64, np.uint64)))
    assert ctr[0] == (1 << 40) - 5 + 3 * 64
    assert sorted(out.tolist()) == [(1 << 40) - 5 + 3 * i for i in range(64)]


def test_only_active_lanes_add():
    ptx = _kernel("@%p atom.global.add.u32", regs=".reg .pred %p; setp.lt.u32 %p, %tid.x, 10;")
    ctr, out = run_raw(ptx, threads=32, args=(np.zeros(1, np.uint32), np.zeros(32, np.uint32)))
    assert ctr[0] == 10
    assert out[:10].tolist() == list(range(10))


def test_out_of_bounds_and_misaligned_atomics_fault():
    oob = _kernel("atom.global.add.u32").replace("[%rd0]", "[%rd0+4]")
    with pytest.raises(Fault) as e:
        run_raw(oob, threads=32, args=(np.zeros(1, np.uint32), np.zeros(32, np.uint32)))
    assert e.value.kind == "GMEM_OOB"
    mis = _kernel("atom.global.add.u32").replace("[%rd0]", "[%rd0+2]")
    with pytest.raises(Fault) as e:
        run_raw(mis, threads=32, args=(np.zeros(2, np.uint32), np.zeros(32, np.uint32)))
    assert e.value.kind == "GMEM_MISALIGNED"


@pytest.mark.parametrize("atom,src", [
    ("atom.global.cas.b32", "1, 2"),
    ("atom.global.add.f32", "0f3F800000"),
    ("atom.global.exch.b32", "1"),
    ("atom.shared.add.u32", "1"),
    ("atom.add.u32", "1"),  # generic addressing
])
def test_other_atomics_are_refused(atom, src):
    t = "f32" if atom.endswith("f32") else "b32"
    refused = r"unsupported instruction atom\.\S+ at line \d+: atom is modelled as"
    with pytest.raises(UnsupportedInstruction, match=refused):
        run_raw(_kernel(atom, t=t, src=src), threads=32, args=(np.zeros(1, np.uint32), np.zeros(32, np.uint32)))
