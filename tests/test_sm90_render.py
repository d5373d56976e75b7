"""CPU tests of the sm_90a lowering: the rendered PTX assembles cleanly and says what the design says.

The assembler tests need ptxas (CUDA 13.0 here) and skip without it. What they hold to:
zero warnings (ptxas prints wgmma serialisation and C7508 "setmaxnreg ignored" as warnings),
no spills, no stack frame. The device results (correctness vs torch, TFLOP/s) come from
tests/test_gpu.py and `python3 -m bench.attention`; the first ones (from scripts/dev_sm90.py, since
removed) are recorded in bench/sm90_dev_notes.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from fa4gen.spec.config import KernelConfig
from fa4gen.spec.exp2 import hopper_emulated
from fa4gen.ir.sm90 import build_sm90_pipeline, sm90_stages
from fa4gen.lower.sm90 import Sm90LoweringError, Sm90Options, entry_regs_of, lower_sm90, manifest_sm90
from fa4gen.render.kernels import build_sm90
from fa4gen.lower.walk import smem_layout
from fa4gen.spec.plan import ARCH_LIMITS, q_tile_bytes, tile_bytes

SMEM_LIMIT = ARCH_LIMITS["sm_90a"].smem_per_cta

PTXAS = shutil.which("ptxas")
ABI_PARAMS = ["tmap_q", "tmap_k", "tmap_v", "tmap_o", "lse_ptr", "batch", "seqlen_q", "seqlen_k",
              "num_heads_kv", "scale_log2", "num_m_blocks", "num_tasks", "l2_group"]

MATRIX = [
    dict(head_dim=128), dict(head_dim=128, causal=True), dict(head_dim=64), dict(head_dim=64, causal=True),
    dict(gqa_ratio=4), dict(gqa_ratio=4, causal=True), dict(gqa_ratio=128), dict(gqa_ratio=2, causal=True),
    dict(dtype="fp16"), dict(dtype="fp16", causal=True, head_dim=64), dict(emu_pairs=0),
    dict(emu_pairs=8, emu_start=0, causal=True), dict(rescale_threshold=0.0), dict(kv_stages=4, head_dim=64),
]


def cfg(**kw) -> KernelConfig:
    return KernelConfig(arch="sm_90a", **kw)


def ptxas(ptx: str, tmp_path) -> str:
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.mark.skipif(PTXAS is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("kw", MATRIX, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_assembles_clean(kw, tmp_path):
    c = cfg(**kw)
    ptx, _ = build_sm90(c)
    log = ptxas(ptx, tmp_path)
    assert "warning" not in log.lower(), log  # includes C7508 (setmaxnreg ignored) and wgmma serialisation
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= entry_regs_of(c)  # the entry cap that the setmaxnreg budget is drawn from


@pytest.mark.skipif(PTXAS is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("opt", [Sm90Options(producer_regs=32, consumer_regs=232)], ids=["regs32_232"])
def test_options_assemble_clean(opt, tmp_path):
    ptx, man = build_sm90(cfg(), opt)
    log = ptxas(ptx, tmp_path)
    assert "warning" not in log.lower(), log
    assert man["name"] != cfg().name  # a variant never shares the default's name


def test_abi_signature_and_manifest():
    ptx, man = build_sm90(cfg(gqa_ratio=4))
    sig = ptx[ptx.index(".visible .entry fa4_fwd("):ptx.index(")\n.maxntid")]
    names = re.findall(r"\.param\s+(?:\.align 64 \.b8 |\.u64 |\.u32 |\.f32 )(\w+)", sig)
    assert names == ABI_PARAMS == man["params"]
    assert re.search(r"\.maxntid 384, 1, 1\n\.minnctapersm 1", ptx)
    assert man["threads_per_cta"] == 384 and man["entry"] == "fa4_fwd"
    assert man["tensor_maps"]["q"] == {"dims": ["D", "G", "Hkv", "Sq", "B"], "box": [64, 4, 1, 32, 1],
                                       "swizzle": "128B", "dtype": "bf16", "l2_promotion": "256B"}
    assert man["tensor_maps"]["k"]["box"] == [64, 1, 128, 1]
    # O is stored per consumer warpgroup: 64 rows = 16 positions x 4 heads
    assert man["tensor_maps"]["o"]["box"] == [64, 4, 1, 16, 1]
    assert manifest_sm90(cfg(gqa_ratio=128))["tensor_maps"]["o"]["box"] == [64, 64, 1, 1, 1]
    assert man["dynamic_smem_bytes"] <= SMEM_LIMIT


def test_stages_are_capped_to_fit():
    assert sm90_stages(cfg()) == (2, 2)  # config asks for 3 K/V stages: only 2 fit next to 2 Q slots at D = 128
    lay = smem_layout(build_sm90_pipeline(cfg()))  # the kernel's layout: derived from the Pipeline
    assert lay.total <= SMEM_LIMIT
    k, v, o = (lay.regions[r][0] for r in ("K", "V", "O_smem"))
    assert k == 2 * q_tile_bytes(cfg()) and v == k + 2 * tile_bytes(cfg()) and o == v + 2 * tile_bytes(cfg())
    for off, _, _ in lay.regions.values():
        assert off % 1024 == 0  # 128B-swizzle atoms start 1024-aligned (descriptor base_offset 0)
    assert lay.total + 2 * tile_bytes(cfg()) > SMEM_LIMIT  # a third K/V stage (a K and a V tile) would not fit
    assert sm90_stages(cfg(head_dim=64, kv_stages=4)) == (2, 4)
    # a 192-row tile at D = 128 keeps 2 K/V stages by dropping to one Q slot
    assert sm90_stages(cfg(block_m=192)) == (1, 2)


def test_an_explicit_ring_that_does_not_fit_is_refused():
    from fa4gen.spec.config import ConfigError
    from fa4gen.ir import refuse_ignored

    with pytest.raises(ConfigError, match="at most 2 K/V stages fit in sm_90a SMEM beside 2 Q slots"):
        refuse_ignored(cfg(kv_stages=4))
    assert refuse_ignored(cfg()) == cfg()  # the default depth is capped, not refused


def test_register_budget_is_checked():
    with pytest.raises(Sm90LoweringError, match="register budget"):
        Sm90Options(producer_regs=32, consumer_regs=240)  # 512 > 3 x 168: the inc would block forever
    with pytest.raises(Sm90LoweringError, match="multiple of 8"):
        Sm90Options(consumer_regs=236)
    with pytest.raises(ValueError, match="sm_90a"):
        build_sm90(KernelConfig(arch="sm_100a"))


def test_emulation_split_keeps_the_seed_fractions():
    for kw in (dict(), dict(causal=True), dict(emu_pairs=0), dict(emu_pairs=3, emu_start=2)):
        c = cfg(**kw)
        k = [hopper_emulated(c, ch, e) for ch in range(16) for e in range(2)]
        frac_seed = c.emu_pairs / 8 * max(0, 3 - c.emu_start) / 4  # 2*pairs of 16, fragments [start, 3)
        assert sum(k) / len(k) == frac_seed
        assert not any(k[24:])  # fragment 3 (columns 96..127) always on MUFU
    assert cfg().emu_pairs == 0  # sm_90a default: every exponential on MUFU (faster on the H200)
    n_emu = sum(e["emu"] for row in _item(cfg(emu_pairs=2), "softmax")["rows"] for e in row["elems"])
    assert n_emu == 8  # the seed's split: 12.5% of the thread's 64 scores


def _item(c: KernelConfig, m: str) -> dict:
    """The consumers' first lowered item of macro `m` (fa4gen/lower/sm90.py)."""
    ctx = lower_sm90(build_sm90_pipeline(c))
    role = next(r for r in ctx["roles"] if r["name"] == "consumer")
    return next(it for it in role["items"] if it["m"] == m)


def test_p_fragment_is_the_accumulator_paired_in_order():
    # A-fragment register t of k-step j packs accumulator registers 8j+2t (low half) and 8j+2t+1
    for idx, (p, hi, lo) in enumerate(_item(cfg(), "pack_p")["p_pack"]):
        j, t = divmod(idx, 4)
        assert (p, hi, lo) == (f"%pk{4 * j + t}", f"%s{8 * j + 2 * t + 1}", f"%s{8 * j + 2 * t}")
    assert [s["a"] for s in _item(cfg(), "gemm_rs")["steps"]] == [[f"%pk{4 * j + t}" for t in range(4)] for j in range(8)]


def test_descriptors():
    setup = _item(cfg(), "consumer_setup")
    k_major, v = int(setup["desc_k_major"], 16), int(setup["desc_v"], 16)
    assert k_major >> 62 == v >> 62 == 1  # 128B swizzle
    assert (k_major >> 32) & 0x3FFF == 1024 >> 4 == (v >> 32) & 0x3FFF  # SBO: 8 rows x 128 B
    assert (v >> 16) & 0x3FFF == 16384 >> 4  # LBO of MN-major V: the next 64-column slab
    # k16 steps along K inside a 128-byte swizzle row advance 32 bytes; the 5th step starts slab 2
    assert [s["a"] for s in _item(cfg(), "gemm_ss")["steps"]] == [0, 2, 4, 6, 1024, 1026, 1028, 1030]
    assert [s["b"] for s in _item(cfg(), "gemm_rs")["steps"]] == [128 * j for j in range(8)]  # 16 keys x 128 B


def _kv_loop(ptx: str) -> tuple[str, str]:
    """The consumers' steady-state K/V loop and what follows it up to the epilogue's normalize."""
    role = ptx[ptx.index("$L_role_consumer:"):]
    head = re.search(r"^(\$L_consumer_kv(\d+)):$", role, re.M)
    done = f"$L_consumer_kv_done{int(head.group(2)) + 1}:"
    return role[head.end():role.index(done)], role[role.index(done):role.index("normalize:")]


def test_pipeline_order_in_the_ptx():
    """The consumer loop issues S(n) before O += P V, waits for S only (wait_group 1), runs the
    softmax, then waits for PV: the intra-warpgroup overlap. Ping-pong brackets the issues; the
    conditional O rescale and the P repack run after the PV wait, outside the tensor-core turn (in the
    order plan.sm90_pack_first gives: the pack first on this 128-row kernel)."""
    from fa4gen.spec.plan import sm90_pack_first
    c = cfg()
    ptx, _ = build_sm90(c)
    loop, tail = _kv_loop(ptx)
    after = ["mul.f32 %o0, %o0, %acc0", "cvt.rn.bf16x2.f32 %pk0"]
    marks = ["bar.sync %nb_sched_0", "m64n128k16.f32.bf16.bf16 {%s0",
             "m64n128k16.f32.bf16.bf16 {%o0", "bar.arrive %nb_sched_1", "wgmma.wait_group.sync.aligned 1",
             "ex2.approx.ftz.f32 %s0", "wgmma.wait_group.sync.aligned 0",
             *(after[::-1] if sm90_pack_first(c) else after)]
    pos = [loop.find(m) for m in marks]
    assert -1 not in pos, dict(zip(marks, pos))
    assert pos == sorted(pos), dict(zip(marks, pos))
    turn = loop[loop.index("bar.sync %nb_sched_0"):loop.index("bar.arrive %nb_sched_1")]
    assert "%acc0" not in turn  # nothing but the GEMM issues holds the tensor core
    assert "mul.f32 %o0, %o0, %acc0" not in tail  # the last block's rescale already ran in the loop
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 240") == 1
    assert ptx.count("setmaxnreg.dec.sync.aligned.u32 24") == 1


def test_causal_and_tail_masks_only_where_needed():
    nc, _ = build_sm90(cfg(emu_pairs=2))  # the seed's split, so unmasked blocks emulate some exp2
    c, _ = build_sm90(cfg(causal=True, emu_pairs=2))
    # non-causal: only the Skv tail block is masked (nunm = Skv / 128); causal uses signed limits
    assert "shr.u32 %nunm, %skv, 7;" in nc and "min.s32 %climit0" not in nc
    assert "min.s32 %climit0, %climit0, %skv;" in c and "shr.s32 %nunm" in c
    # masked blocks keep every exponential on MUFU: no emulation between the masked label and done
    for ptx in (nc, c):
        for m in re.finditer(r"^\$L_consumer_masked(\d+):$", ptx, re.M):
            masked = ptx[m.end():ptx.index(f"$L_consumer_sm_done{int(m.group(1)) + 1}:")]
            # sm_90a compares each column (plan.MASK_AS_WORDS: the word form measured no faster there)
            assert "add.rm.f32" not in masked and "setp.le.s32" in masked and "ex2.approx.ftz.f32 %s0" in masked
            assert "%mw" not in masked
    # in the K/V loop (every block after the task's first): causal tests the mask; non-causal has no
    # masked path there (plan.later_blocks_need_mask: only the tail block, which runs first, needs one)
    for ptx, causal in ((nc, False), (c, True)):
        loop, _ = _kv_loop(ptx)
        m = re.search(r"bra\.uni \$L_consumer_masked(\d+);", loop)
        assert (m is not None) == causal and ("%p_mask" in loop) == causal
        unmasked = loop[m.end():loop.index(f"$L_consumer_masked{m.group(1)}:")] if causal else loop
        assert "add.rm.f32" in unmasked


# Branches whose predicate may differ between the lanes of a warp: a wait loop's try_wait result,
# an elected lane's skip, the warpgroup/role dispatch and the one-thread producer, the varlen scan
# (a per-lane compare the scheduler macros share with sm_100a), a row beyond Sq (rows_in_sq, %p_idle).
_LANE_BRANCH = re.compile(r"\$L(wait|_consumer_noel|_init_done|_budget|_role_\w+_idle|_\w+_end|_vl[cp]_(found|used)"
                          r"|_\w+_tasks_done)\d*$")


@pytest.mark.parametrize("kw", [dict(head_dim=128), dict(head_dim=64, causal=True, block_m=128),
                                dict(gqa_ratio=4, causal=True, varlen=True),
                                dict(gqa_ratio=4, causal=True, kvcache=True, page_size=64)],
                         ids=["d128", "d64-causal", "varlen", "kvcache"])
def test_warp_uniform_branches_are_bra_uni(kw):
    """The K/V and task loops and the If statements branch on warp-uniform values (the task's block
    count, the instance index, the LSE pointer, num_splits), and say so with bra.uni: with a plain
    bra ptxas cannot prove the warp converged at the wgmma that follows and puts a WARPSYNC before
    it (cuobjdump on the H200: 6 against 2 in the D 64 causal varlen kernel; bench.ab measured
    +0.3% median, up to +2% on D 128 non-causal). The emulator faults on a bra.uni that some lanes
    take and others do not (BRA_UNI), so a wrong .uni is caught there."""
    ptx, _ = build_sm90(cfg(**kw))
    ptx = ptx.split(".entry fa4_combine")[0]  # the KV cache's combine kernel is one warp per row
    lane = [t for p, t in re.findall(r"^\s*@!?(%\w+) bra (\S+);", ptx, re.M)
            if not _LANE_BRANCH.match(t) and p != "%p_idle"]
    assert not lane, f"conditional branches without .uni to {lane}"
    uni = re.findall(r"^\s*@!?%\w+ bra\.uni (\$L_consumer_(?:kv|kv_done|task|else|endif)\d+);", ptx, re.M)
    assert any("_kv" in t for t in uni) and any("else" in t for t in uni)


def test_chain_reduction_links_each_source_once():
    from fa4gen.lower.walk import chain, pairwise
    ops, res = chain(["a", "b", "c", "d"], "%t")
    assert ops == [("%t0", "a", "b"), ("%t1", "%t0", "c"), ("%t2", "%t1", "d")] and res == "%t2"
    assert chain(["a"], "%t") == ([], "a")
    assert len(pairwise([f"r{i}" for i in range(32)], "%p")[0]) == len(chain([f"r{i}" for i in range(32)], "%t")[0])


@pytest.mark.parametrize("block_m, kw", [(192, dict(head_dim=64)), (192, dict(head_dim=64, causal=True)),
                                         (192, dict(head_dim=64, emu_pairs=8, emu_start=0)),
                                         (128, dict(head_dim=64, causal=True)), (128, dict(head_dim=128)),
                                         (192, dict(head_dim=64, causal=True, varlen=True))])
def test_row_reduction_follows_the_plan(block_m, kw):
    """plan.sm90_row_reduction: on the 192-row tile each row's max is a chain and its sum's k-th add
    comes right after element k + 1's exp (MUFU or the FMA cubic), in every softmax path (masked and
    not); on the 128-row tile both are pairwise trees after the exps."""
    from fa4gen.spec.plan import sm90_row_reduction
    c = cfg(block_m=block_m, **kw)
    want = sm90_row_reduction(c)
    assert want == ("chain" if block_m == 192 and not c.varlen else "tree")
    sm = _item(c, "softmax")
    for row in sm["rows"]:
        regs = [e["reg"] for e in row["elems"]]
        if want == "chain":
            assert row["sum_ops"] == [] and row["max_ops"][0][1:] == tuple(regs[:2])
            assert [e["sum_op"][2] for e in row["elems"][1:]] == regs[1:] and row["elems"][0]["sum_op"] is None
            assert row["sum_res"] == row["elems"][-1]["sum_op"][0]
        else:
            assert all(e["sum_op"] is None for e in row["elems"]) and len(row["sum_ops"]) == len(regs) - 1
    ptx, _ = build_sm90(c)
    r = row["idx"]
    adds = re.findall(rf"^\s*add\.f32 %sm{r}_\d+, [^;]+;", ptx, re.M)
    if want == "chain":
        # each add sits right after the exp that made its element (the element is its last operand)
        follows = re.findall(rf"(?:ex2\.approx\.ftz\.f32 (%s\d+), %x\d+;|mov\.b32 (%s\d+), %eb\d+;)\n\s*"
                             rf"add\.f32 %sm{r}_\d+, %\w+, (%s\d+);", ptx)
        assert follows and all((a or b) == e for a, b, e in follows) and len(follows) == len(adds)
    else:
        # the tree starts after the row's last exp: one add per softmax path (a copy of the row's
        # len(regs) - 1 adds) follows an exp
        paths, rest = divmod(len(adds), len(regs) - 1)
        assert paths >= 1 and rest == 0
        assert len(re.findall(rf"ex2\.approx\.ftz\.f32 %s\d+, %x\d+;\n\s*add\.f32 %sm{r}_", ptx)) == paths


@pytest.mark.parametrize("kw", [dict(head_dim=64), dict(head_dim=64, causal=True), dict(head_dim=96, causal=True, gqa_ratio=4),
                                dict(head_dim=64, causal=True, window=True, sinks=True)])
def test_varlen_bits_do_not_follow_the_tile(kw):
    """A varlen call's tile follows its batch (max_seqlen_q): every tile it may run reduces rows in
    the same order, so a sequence's output does not depend on the other sequences (the 192- and
    128-row kernels' softmax items are the same)."""
    from fa4gen.spec.plan import sm90_row_reduction
    a, b = cfg(varlen=True, block_m=128, **kw), cfg(varlen=True, block_m=192, **kw)
    assert sm90_row_reduction(a) == sm90_row_reduction(b)
    sa, sb = _item(a, "softmax"), _item(b, "softmax")
    assert [(r["max_ops"], r["sum_ops"], [e["sum_op"] for e in r["elems"]]) for r in sa["rows"]] == \
           [(r["max_ops"], r["sum_ops"], [e["sum_op"] for e in r["elems"]]) for r in sb["rows"]]


@pytest.mark.parametrize("block_m, kw", [(192, dict(head_dim=64)), (192, dict(head_dim=64, causal=True, gqa_ratio=4)),
                                         (128, dict(head_dim=64, causal=True)), (128, dict(head_dim=128)),
                                         (128, dict(head_dim=128, causal=True, kvcache=True, page_size=64)),
                                         (192, dict(head_dim=64, varlen=True)), (128, dict(head_dim=128, varlen=True))])
def test_pack_and_rescale_order_follows_the_plan(block_m, kw):
    """plan.sm90_pack_first: in the overlap loop's steady state, after the wait for PV(t-1), tree
    kernels pack P(t) before O *= acc(t), chain kernels (the 192-row dense tile) rescale first."""
    from fa4gen.spec.plan import sm90_overlap, sm90_pack_first, sm90_row_reduction
    c = cfg(block_m=block_m, **kw)
    assert sm90_overlap(c)
    first = sm90_pack_first(c)
    assert first == (sm90_row_reduction(c) == "tree") == (block_m == 128 or c.varlen)
    ptx, _ = build_sm90(c)
    tail = ptx[ptx.rindex("vote.sync.any.pred %p_rescale"):]
    wait = re.search(r"// op \d+ MmaWait\n\s*wgmma\.wait_group\.sync\.aligned 0;", tail)
    assert wait, "the steady state waits for PV(t-1) after the softmax"
    tail = tail[wait.end():]
    pack = re.search(r"cvt\.rn\.(?:bf16|f16)x2\.f32 %pk0,", tail).start()
    branch = tail.index("@!%p_rescale bra.uni")
    assert (pack < branch) == first
