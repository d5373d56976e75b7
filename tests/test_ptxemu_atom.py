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
    # the lanes of a warp take consecutive tickets in lane order (a warp's 32 from one fetch)
    assert (np.diff(out.reshape(4, 32).astype(np.int64), axis=1) == 1).all()
    assert sorted(int(x) % 32 for x in out.reshape(4, 32)[:, 0]) == [0] * 4


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


_DEAL = """.version 8.5
.target sm_90a
.address_size 64
.visible .entry k(
    .param .u64 ctr,
    .param .u64 out,
    .param .u32 n
)
{
    .reg .pred %p<2>; .reg .b32 %t, %n, %c, %i; .reg .b64 %rc, %ro, %ra;
    ld.param.u64 %rc, [ctr];
    ld.param.u64 %ro, [out];
    ld.param.u32 %n, [n];
    mov.u32 %c, %ctaid.x;
    mov.u32 %i, %tid.x;
    setp.ne.u32 %p0, %i, 0;
    @%p0 bra $L_end;
$L_loop:
    atom.global.add.u32 %t, [%rc], 1;
    setp.ge.u32 %p1, %t, %n;
    @%p1 bra $L_end;
    mul.wide.u32 %ra, %t, 4;
    add.s64 %ra, %ra, %ro;
    st.global.u32 [%ra], %c;
    bra.uni $L_loop;
$L_end:
    ret;
}
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resident_ctas_share_a_dynamic_deal(seed):
    """The dynamic deal's shape (one thread of each CTA takes task indices from a counter until they run
    out): the two resident CTAs run interleaved, so each takes a share, every task exactly once and
    each CTA's in increasing order. (CTAs used to run one after another: CTA 0 took every task.)"""
    ctr, out, _ = run_raw(_DEAL, threads=32, ctas=2, seed=seed,
                          args=(np.zeros(1, np.uint32), np.full(200, 7, np.uint32), 200))
    assert ctr[0] == 200 + 2  # every task, then one fetch per CTA that ends its loop
    assert set(out.tolist()) == {0, 1} and 20 <= int((out == 1).sum()) <= 180
