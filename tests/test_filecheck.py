"""FileCheck-style ordered checks on the emitted sm_100a PTX (LLVM FileCheck semantics, reduced).

Directives: `CHECK: re` finds the next line matching `re` after the previous match; `CHECK-NEXT: re`
must match the next instruction line; `CHECK-NOT: re` must not match any line between the previous
match and the next positive match (or the end). Patterns are regular expressions over one role's
section; comments are stripped first, so `// op` markers cannot satisfy a check. The offsets in the
patterns come from the manifest's SMEM layout and the IR's TMEM regions.
"""

from __future__ import annotations

import functools
import re

import pytest

from fa4gen.spec.config import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.render.kernels import build_sm100

CONFIGS = [KernelConfig(), KernelConfig(causal=True, gqa_ratio=4), KernelConfig(head_dim=64, gqa_ratio=4),
           KernelConfig(dtype="fp16", causal=True, head_dim=64)]


@functools.lru_cache(maxsize=None)
def emitted(cfg):
    pipe = build_pipeline(cfg)
    ptx, manifest = build_sm100(pipe)
    return pipe, ptx, manifest


def section(ptx: str, role: str) -> list[str]:
    lines = ptx.splitlines()
    a, b = lines.index(f"// role {role}"), lines.index(f"// end role {role}")
    out = []
    for line in lines[a + 1:b]:
        code = line.split("//")[0].rstrip()
        if code.strip():
            out.append(code.strip())
    return out


class CheckFailure(AssertionError):
    pass


def filecheck(lines: list[str], checks: list[str]) -> None:
    pos = 0
    nots: list[str] = []
    for chk in checks:
        kind, pat = chk.split(":", 1)
        rx = re.compile(pat.strip())
        if kind == "CHECK-NOT":
            nots.append(pat.strip())
            continue
        if kind == "CHECK-NEXT":
            if pos >= len(lines) or not rx.search(lines[pos]):
                got = lines[pos] if pos < len(lines) else "<end>"
                raise CheckFailure(f"CHECK-NEXT: {pat.strip()!r} does not match the next line {got!r}")
            pos += 1
            continue
        if kind != "CHECK":
            raise ValueError(f"unknown directive {kind}")
        hit = next((i for i in range(pos, len(lines)) if rx.search(lines[i])), None)
        if hit is None:
            raise CheckFailure(f"CHECK: {pat.strip()!r} not found after line {pos}")
        for n in nots:
            bad = next((i for i in range(pos, hit) if re.search(n, lines[i])), None)
            if bad is not None:
                raise CheckFailure(f"CHECK-NOT: {n!r} matched {lines[bad]!r} before {pat.strip()!r}")
        nots = []
        pos = hit + 1
    for n in nots:
        bad = next((i for i in range(pos, len(lines)) if re.search(n, lines[i])), None)
        if bad is not None:
            raise CheckFailure(f"CHECK-NOT: {n!r} matched {lines[bad]!r}")


def bar(manifest, name: str, slot: int) -> str:
    return re.escape(f"[%bar+{manifest['smem_layout']['barriers'][name] + 8 * slot}]")


def test_filecheck_helper_catches_order_and_absence():
    lines = ["a", "b", "c"]
    filecheck(lines, ["CHECK: a", "CHECK-NEXT: b", "CHECK-NOT: x", "CHECK: c"])
    with pytest.raises(CheckFailure):
        filecheck(lines, ["CHECK: b", "CHECK: a"])
    with pytest.raises(CheckFailure):
        filecheck(lines, ["CHECK: a", "CHECK-NOT: b", "CHECK: c"])
    with pytest.raises(CheckFailure):
        filecheck(lines, ["CHECK: a", "CHECK-NEXT: c"])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("i", [0, 1])
def test_softmax_reads_all_of_s_before_writing_p(cfg, i):
    pipe, ptx, man = emitted(cfg)
    s, p = pipe.region(f"S{i}"), pipe.region(f"P{i}")
    checks = [f"CHECK: mbarrier.try_wait.parity.* {bar(man, 's_ready', i)}",
              "CHECK-NEXT: bra",
              "CHECK-NEXT: tcgen05.fence::after_thread_sync"]
    for c in range(0, 128, 32):
        checks += ["CHECK-NOT: tcgen05.st", rf"CHECK: tcgen05.ld.sync.aligned.32x32b.x32.b32 .*\[%tml\+{s.col + c}\]"]
    checks += ["CHECK-NOT: tcgen05.st", "CHECK: tcgen05.wait::ld",
               "CHECK-NOT: tcgen05.(st|ld)", "CHECK: ex2.approx",
               rf"CHECK: tcgen05.st.sync.aligned.32x32b.x16.b32 \[%tml\+{p.col}\]"]
    filecheck(section(ptx, f"softmax{i}"), checks)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("i", [0, 1])
def test_softmax_waits_for_its_p_stores_before_each_arrive(cfg, i):
    pipe, ptx, man = emitted(cfg)
    p = pipe.region(f"P{i}")
    first = cfg.p_chunks_first
    checks = []
    for c in range(first):
        checks += [rf"CHECK: tcgen05.st.sync.aligned.32x32b.x16.b32 \[%tml\+{p.col + 16 * c}\]"]
    checks += ["CHECK-NOT: mbarrier.arrive", "CHECK: tcgen05.wait::st",
               "CHECK-NEXT: tcgen05.fence::before_thread_sync",
               f"CHECK-NEXT: mbarrier.arrive.shared::cta.b64 _, {bar(man, 'p_o_rescale', i)}"]
    for c in range(first, 4):
        checks += ["CHECK-NOT: mbarrier.arrive",
                   rf"CHECK: tcgen05.st.sync.aligned.32x32b.x16.b32 \[%tml\+{p.col + 16 * c}\]"]
    checks += ["CHECK-NOT: mbarrier.arrive", "CHECK: tcgen05.wait::st",
               "CHECK-NEXT: tcgen05.fence::before_thread_sync",
               f"CHECK-NEXT: mbarrier.arrive.shared::cta.b64 _, {bar(man, 'p_ready_2', i)}"]
    filecheck(section(ptx, f"softmax{i}"), checks)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_every_tmem_handoff_arrive_follows_a_wait_st(cfg):
    """Scan form of the rule: in the softmax and correction roles, an arrive on p_o_rescale or
    p_ready_2 is never preceded by a tcgen05.st without a tcgen05.wait::st in between."""
    _, ptx, man = emitted(cfg)
    targets = [bar(man, b, s) for b in ("p_o_rescale", "p_ready_2") for s in (0, 1)]
    for role in ("softmax0", "softmax1", "correction"):
        unwaited = False
        arrives = 0
        for line in section(ptx, role):
            if line.startswith("tcgen05.st"):
                unwaited = True
            elif line.startswith("tcgen05.wait::st"):
                unwaited = False
            elif line.startswith("mbarrier.arrive") and any(re.search(t, line) for t in targets):
                arrives += 1
                assert not unwaited, f"{role}: {line} issued with a tcgen05.st not yet waited"
        assert arrives >= 2, f"{role}: expected hand-off arrivals, found {arrives}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_pv_parts_wait_for_their_barriers(cfg):
    """PV part 1 (P[:, :K_SPLIT]) only after the p_o_rescale wait, part 2 only after p_ready_2,
    always accumulating; both into O_i from P_i."""
    pipe, ptx, man = emitted(cfg)
    lines = section(ptx, "mma")
    ks = cfg.k_split
    for i in (0, 1):
        o, p = pipe.region(f"O{i}"), pipe.region(f"P{i}")
        part1 = [rf"CHECK: @%p_el tcgen05.mma.cta_group::1.kind::f16 \[%tmem\+{o.col}\], "
                 rf"\[%tmem\+{p.col + k // 2}\], %dbk, 0x[0-9a-f]+, {'(0|1|%p_acc)' if k == 0 else '1'};$"
                 for k in range(0, ks, 16)]
        part2 = [rf"CHECK: @%p_el tcgen05.mma.cta_group::1.kind::f16 \[%tmem\+{o.col}\], "
                 rf"\[%tmem\+{p.col + k // 2}\], %dbk, 0x[0-9a-f]+, 1;$" for k in range(ks, 128, 16)]
        # every PV of stage i in the program: the prologue-free steady state and the tail
        n_pv = sum(1 for ln in lines if re.search(rf"\[%tmem\+{o.col}\], \[%tmem\+{p.col}\]", ln))
        assert n_pv == 2, f"stage {i}: expected the loop's and the tail's PV, found {n_pv}"
        pos_checks = []
        for _ in range(n_pv):
            pos_checks += [f"CHECK: mbarrier.try_wait.parity.* {bar(man, 'p_o_rescale', i)}",
                           "CHECK-NEXT: bra", "CHECK-NEXT: tcgen05.fence::after_thread_sync",
                           "CHECK-NOT: tcgen05.mma", *part1,
                           f"CHECK-NOT: {re.escape(f'[%tmem+{p.col + ks // 2}]')}",
                           f"CHECK: mbarrier.try_wait.parity.* {bar(man, 'p_ready_2', i)}",
                           "CHECK-NEXT: bra", "CHECK-NEXT: tcgen05.fence::after_thread_sync",
                           "CHECK-NOT: tcgen05.mma", *part2]
        filecheck(lines, pos_checks)


def test_pv_part1_accumulates_except_on_the_first_block():
    """enable-input-d of part 1: a predicate that is false on the task's first block (t - 1 == 0
    in the loop, n == 1 at the tail), set right before the MMA."""
    pipe, ptx, man = emitted(KernelConfig())
    lines = section(ptx, "mma")
    idx = [k for k, ln in enumerate(lines) if ln.endswith("%p_acc;")]
    assert len(idx) == 4
    for k in idx:
        setp = next(lines[j] for j in range(k - 1, k - 20, -1) if "%p_acc" in lines[j] and lines[j].startswith("setp"))
        assert setp in ("setp.ne.u32 %p_acc, %t, 1;", "setp.ne.u32 %p_acc, %n, 1;"), setp


def test_correction_rescales_under_a_warp_vote():
    """The If(ANY_RESCALE) is a vote.any-gated branch around the O load/multiply/store."""
    _, ptx, _ = emitted(KernelConfig())
    lines = section(ptx, "correction")
    filecheck(lines, [r"CHECK: ld.shared.f32 %acc", r"CHECK: setp.eq.u32 %p_c, %t, 0",
                      r"CHECK: setp.lt.f32 %p_v, %acc, 0f3F800000",
                      r"CHECK-NEXT: vote.sync.any.pred %p_c, %p_v, 0xffffffff",
                      r"CHECK-NEXT: @!%p_c bra", r"CHECK: tcgen05.ld.sync.aligned.32x32b.x16",
                      r"CHECK: tcgen05.wait::ld", r"CHECK: mov.b64 %k_a2, \{%acc, %acc\}",
                      r"CHECK: mov.b64 %op0, \{%o0, %o1\}", r"CHECK-NEXT: mul.rn.f32x2 %op0, %op0, %k_a2",
                      r"CHECK: tcgen05.st.sync.aligned.32x32b.x16"])


def test_setmaxnreg_is_one_chain_on_the_warpgroup_index():
    _, ptx, _ = emitted(KernelConfig())
    body = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    body = [ln for ln in body if ln]
    filecheck(body, [r"CHECK: ld.shared.u32 %tmem", r"CHECK-NOT: setmaxnreg", r"CHECK: setp.ge.u32 %p_t, %wg, 3",
                     r"CHECK: bra \$L_budget48", r"CHECK: setp.ge.u32 %p_t, %wg, 2", r"CHECK: bra \$L_budget64",
                     r"CHECK: bra.uni \$L_budget200", r"CHECK: \$L_budget48:",
                     r"CHECK-NEXT: setmaxnreg.dec.sync.aligned.u32 48", r"CHECK: \$L_budget64:",
                     r"CHECK-NEXT: setmaxnreg.dec.sync.aligned.u32 64", r"CHECK: \$L_budget200:",
                     r"CHECK-NEXT: setmaxnreg.inc.sync.aligned.u32 200"])
    assert sum("setmaxnreg" in ln for ln in body) == 3


def test_tmem_alloc_and_dealloc_bracket_the_roles():
    _, ptx, _ = emitted(KernelConfig())
    body = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    body = [ln for ln in body if ln]
    filecheck(body, [r"CHECK: mbarrier.init", r"CHECK: fence.mbarrier_init",
                     r"CHECK: tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 \[%smem\+\d+\], 512",
                     r"CHECK-NEXT: tcgen05.relinquish_alloc_permit", r"CHECK: bar.sync 0",
                     r"CHECK-NEXT: tcgen05.fence::after_thread_sync", r"CHECK-NEXT: ld.shared.u32 %tmem",
                     r"CHECK: \$L_mma_end:", r"CHECK: bar.sync 0", r"CHECK-NEXT: tcgen05.fence::after_thread_sync",
                     r"CHECK-NEXT: tcgen05.dealloc.cta_group::1.sync.aligned.b32 %tmem, 512"])
    # One dealloc line is not enough: it must sit in a one-warp role (the allocating MMA warp).
    # It used to end softmax0, where all four of its warps freed the same 512 columns.
    assert sum(ln.startswith("tcgen05.dealloc") for ln in body) == 1


def test_ordered_checks_reject_an_arrive_before_its_wait_st():
    """The same checks on a copy of the PTX whose first wait::st was moved below its arrive."""
    cfg = KernelConfig()
    pipe, ptx, man = emitted(cfg)
    lines = section(ptx, "softmax0")
    k = lines.index("tcgen05.wait::st.sync.aligned;")
    assert lines[k + 2].startswith("mbarrier.arrive")
    swapped = lines[:k] + lines[k + 1:k + 3] + [lines[k]] + lines[k + 3:]
    p = pipe.region("P0")
    checks = [rf"CHECK: tcgen05.st.sync.aligned.32x32b.x16.b32 \[%tml\+{p.col + 16 * (cfg.p_chunks_first - 1)}\]",
              "CHECK-NOT: mbarrier.arrive", "CHECK: tcgen05.wait::st",
              "CHECK-NEXT: tcgen05.fence::before_thread_sync",
              f"CHECK-NEXT: mbarrier.arrive.shared::cta.b64 _, {bar(man, 'p_o_rescale', 0)}"]
    filecheck(lines, checks)
    with pytest.raises(CheckFailure):
        filecheck(swapped, checks)
