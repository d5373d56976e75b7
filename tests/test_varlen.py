"""Varlen (issue 12) on the CPU: the PTX task decode equals fa4gen.spec.schedule.varlen_task (executed by
the emulator, clamping included), the sm_90a varlen kernels' PTX passes `fa4gen emulate` on ragged
batches, the host-side input checks, the CLI, and the benchmark's mixes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fa4gen import codegen
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.plan import varlen_task_bound
from fa4gen.evidence.ptxemu import harness
from fa4gen.evidence.ptxemu.harness import run_raw
from fa4gen.lower.walk import exact_log2
from fa4gen.render.jinja import environment
from fa4gen.spec.schedule import varlen_spans, varlen_tasks
from fa4gen.runtime.validate import (DeviceError, Fa4genInputError, InputErrors, InputTypeError, InputValueError,
                                     TensorMeta, check_varlen_problem)

FIELDS = 8  # per task: found, b, head group, m, q_start, q_len, k_start, k_len


def _decode_kernel(ng: int, causal: bool, unit_rows: int) -> str:
    """Each of 32 threads decodes tasks lane, lane + 32, ... (increasing, as in the kernels) with the
    scheduler's own macro and stores what it found."""
    src = ('{% import "common/scheduler.ptx.j2" as sched with context %}'
           '{{ sched.varlen_init() }}{{ sched.load_varlen_params() }}'
           '$L_loop:\n    setp.ge.u32 %p0, %task, %ntasks;\n    @%p0 bra $L_end;\n'
           '    mul.wide.u32 %rdo, %task, ' + str(4 * FIELDS) + ';\n    add.s64 %rdo, %rdo, %out;\n'
           '{{ sched.decode_varlen("%task", "%mb", unit_rows, unit_shift, "$L_none", "%p1", "t") }}'
           '    mov.u32 %r0, 1;\n'
           '    st.global.v4.u32 [%rdo], { %r0, %b, %hkv, %mb };\n'
           '    st.global.v4.u32 [%rdo+16], { %qoff, %sq, %koff, %skv };\n'
           '    add.u32 %task, %task, 32;\n    bra.uni $L_loop;\n'
           '$L_none:\n    mov.u32 %r0, 2;\n    st.global.u32 [%rdo], %r0;\n$L_end:\n')
    body = environment().from_string(src).render(NG=ng, causal=causal, unit_rows=unit_rows,
                                                 unit_shift=exact_log2(unit_rows))
    params = ["cu_seqlens_q", "cu_seqlens_k", "seqused_k", "out"]
    decl = ",\n    ".join([f".param .u64 {p}" for p in params] + [f".param .u32 {p}" for p in
                                                                  ("total_q", "total_k", "batch", "hkv_n", "ntasks", "l2_group")])
    return f""".version 8.8
.target sm_90a
.address_size 64
.visible .entry k(
    {decl}
)
{{
    .reg .pred %p<4>;
    .reg .b32 %task, %ntasks, %batch, %hkv_n, %b, %hkv, %mb, %sq, %skv, %nmb, %tmp0, %tmp1, %r0, %bh;
    .reg .b32 %vb, %vbase, %qoff, %koff, %totq, %totk;
    .reg .b64 %cuq, %cuk, %sused, %rdv, %rdo, %out;
    mov.u32 %task, %tid.x;
    ld.param.u64 %out, [out];
    ld.param.u32 %ntasks, [ntasks];
    ld.param.u32 %batch, [batch];
    ld.param.u32 %hkv_n, [hkv_n];
{body}
    ret;
}}
"""


def _run_decode(cu_q, cu_k, total_q, total_k, hkv, ng, causal, unit_rows, seqused=None, ntasks=None, l2_rows=1):
    ptx = _decode_kernel(ng, causal, unit_rows)
    b = len(cu_q) - 1
    ntasks = ntasks or varlen_task_bound(b, total_q, hkv * ng, unit_rows) + 3
    out = np.zeros((ntasks, FIELDS), np.uint32)
    used = np.asarray(seqused if seqused is not None else [0], np.int32)
    args = (np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32), used, out, total_q, total_k, b, hkv, ntasks,
            l2_rows)
    if seqused is None:  # a null pointer: pass 0 for the parameter, not a buffer
        args = args[:2] + (0,) + args[3:]
    *_, got, _, _, _, _, _, _ = run_raw(ptx, threads=32, args=args, step_limit=5_000_000)
    return got


@pytest.mark.parametrize("lens_q,lens_k,hkv,ng,causal,unit_rows,seqused,l2_rows", [
    ([70, 0, 129, 5, 300], [10, 3, 0, 200, 300], 2, 1, False, 128, None, 1),
    ([70, 0, 129, 5, 300], [10, 3, 0, 200, 300], 2, 1, True, 128, None, 1),
    ([300, 0, 700, 129], [300, 3, 700, 129], 7, 1, True, 128, None, 2000),  # sections of 6, 2 and 7 groups
    ([1, 64, 65, 0, 0, 200], [9, 9, 9, 9, 9, 9], 1, 3, True, 256, None, 20),  # sm_100a pairs, 3 head groups
    ([33, 17, 0, 100], [50, 0, 20, 100], 3, 1, False, 32, [40, 5, 30, 0], 1),  # GQA 4 tiles, seqused_k
    ([33, 17, 0, 100], [50, 0, 20, 100], 3, 1, True, 32, [40, 5, 30, 0], 0),
    ([], [], 1, 1, False, 128, None, 1),
    # the sm_90a 192-row tile: 192 positions a unit (GQA 1, 3, ...) or 48 (4 packed heads): a division, not a shift
    ([70, 0, 192, 193, 5, 385, 1], [10, 3, 0, 200, 300, 400, 128], 2, 1, False, 192, None, 1),
    ([70, 0, 192, 193, 5, 385, 1], [70, 3, 192, 200, 300, 400, 128], 2, 3, True, 192, None, 300),
    ([33, 48, 49, 0, 100], [50, 48, 20, 7, 100], 3, 1, True, 48, [40, 5, 30, 0, 90], 1),
])
def test_ptx_decode_equals_the_python_order(lens_q, lens_k, hkv, ng, causal, unit_rows, seqused, l2_rows):
    cu_q = [0, *itertools.accumulate(lens_q)]
    cu_k = [0, *itertools.accumulate(lens_k)]
    tq, tk = cu_q[-1], cu_k[-1]
    got = _run_decode(cu_q, cu_k, tq, tk, hkv, ng, causal, unit_rows, seqused, l2_rows=l2_rows)
    want = varlen_tasks(cu_q, cu_k, tq, tk, hkv * ng, unit_rows, causal, seqused, l2_rows)
    assert sum(-(-lq // unit_rows) for lq in lens_q) * hkv * ng == len(want)
    for t, row in enumerate(got):
        if t < len(want):
            assert row[0] == 1 and tuple(int(x) for x in row[1:]) == want[t], f"task {t}"
        else:
            assert row[0] == 2, f"task {t} is past the last one: the decode must say so"


def test_ptx_decode_clamps_offsets_it_cannot_trust():
    """Non-monotonic, past-the-end and negative offsets: both decoders clamp them alike, and no span
    leaves [0, total)."""
    cu_q = [0, 500, 100, 2**31 - 1, -5 & 0xFFFFFFFF, 650]
    cu_k = [-100 & 0xFFFFFFFF, 50, 2**31 - 1, 0, 900, 10]
    cu_q = np.asarray(cu_q, np.uint32).view(np.int32).tolist()
    cu_k = np.asarray(cu_k, np.uint32).view(np.int32).tolist()
    for s, n in varlen_spans(cu_q, 700) + varlen_spans(cu_k, 900):
        assert 0 <= s and s + n <= 900 and n >= 0
    got = _run_decode(cu_q, cu_k, 700, 900, 1, 1, True, 128, ntasks=40)
    want = varlen_tasks(cu_q, cu_k, 700, 900, 1, 128, True)
    assert [tuple(int(x) for x in r[1:]) for r in got[:len(want)]] == want
    assert all(r[0] == 2 for r in got[len(want):])


def test_decode_mutation_is_caught():
    """The comparison can fail: drop the clamp of the end offset."""
    import fa4gen.render.jinja as render_mod

    cu_q, cu_k = [0, 500, 100, 700], [0, 900, 10, 900]
    good = _decode_kernel(1, False, 128)
    bad = good.replace("    max.u32 %tmp1, %tmp1, %qoff;\n", "", 1)
    assert bad != good
    out = np.zeros((12, FIELDS), np.uint32)
    *_, got, _, _, _, _, _, _ = run_raw(bad, threads=32, args=(np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32),
                                                               0, out, 700, 900, 3, 1, 12, 1), step_limit=5_000_000)
    want = varlen_tasks(cu_q, cu_k, 700, 900, 1, 128, False)
    assert [tuple(int(x) for x in r[1:]) for r in got[:len(want)]] != want
    assert render_mod  # (the module the kernels render with)


def test_task_bound_covers_every_real_task():
    rng = np.random.default_rng(3)
    for _ in range(200):
        b = int(rng.integers(0, 20))
        lens = rng.integers(0, 700, size=b).tolist()
        unit = int(rng.choice([16, 64, 128, 256]))
        groups = int(rng.integers(1, 5))
        real = groups * sum(-(-x // unit) for x in lens)
        assert real <= varlen_task_bound(b, sum(lens), groups, unit)


# ---- the emitted sm_90a varlen kernels, executed ----------------------------------------------------
@pytest.mark.parametrize("d,causal,g,dtype,rows", [(128, False, 1, "bf16", 128), (128, True, 4, "fp16", 128),
                                                   (64, True, 3, "bf16", 128), (64, False, 8, "fp16", 128),
                                                   # the 192-row tile fa4gen.attention_varlen runs at D 64 / 96
                                                   (64, False, 1, "bf16", 192), (64, True, 4, "fp16", 192),
                                                   (96, True, 3, "bf16", 192)])
def test_sm90_varlen_ptx_passes_emulate_and_check(d, causal, g, dtype, rows):
    from fa4gen.evidence.check import check_ptx

    cfg = KernelConfig(arch="sm_90a", head_dim=d, causal=causal, gqa_ratio=g, dtype=dtype, varlen=True, block_m=rows)
    r = codegen.build(cfg, emit=("ptx",))
    rep = harness.emulate_file("x.ptx", ptx_text=r.ptx, manifest=r.manifest, seeds=1)
    assert rep.ok, rep.summary()
    if rows == 192:  # the default shapes reach every basic block of the new tile's kernel
        for entry, cov in rep.coverage.entries.items():
            hit, total = cov.block_fraction()
            assert hit == total, f"{entry}: {hit}/{total} basic blocks\n" + "\n".join(cov.summary())
    assert any(0 in s.lens_q for s in harness.default_shapes(r.manifest))  # a zero-length sequence ran
    chk = check_ptx(r.ptx, r.manifest)
    assert chk.ok, chk.summary() if hasattr(chk, "summary") else chk


def test_varlen_row_predicate_matters():
    """Without the per-row predicate the O store writes past the sequence (here: past the tensor)."""
    cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=False, gqa_ratio=1, varlen=True)
    r = codegen.build(cfg, emit=("ptx",))
    bad = r.ptx.replace("    @%pp3 st.global.v4.b32", "    st.global.v4.b32")
    assert bad != r.ptx
    rep = harness.emulate_file("x.ptx", ptx_text=bad, manifest=r.manifest, seeds=1,
                               shapes=[harness.VarShape((70, 20), (64, 64), 1, 1)])
    assert not rep.ok and any(x.finding in ("GMEM_OOB", "WRITTEN_TWICE") for x in rep.runs), rep.summary()


def test_varshape_parse_and_errors():
    s = harness.VarShape.parse("131:200,0:17,40:0;4,1")
    assert s.lens_q == (131, 0, 40) and s.lens_k == (200, 17, 0) and (s.hq, s.hkv) == (4, 1)
    for bad in ("131:200;4", "1:2:3;4,1", "-1:2;1,1", "x"):
        with pytest.raises(harness.UsageError):
            harness.VarShape.parse(bad)


# ---- host-side input checks (no torch, no GPU) ----------------------------------------------------------
def _m(name, shape, dtype="bfloat16", device="cuda:0", ptr=1 << 20):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.insert(0, acc)
        acc *= max(s, 1)
    return TensorMeta(name, tuple(shape), tuple(strides), dtype, device, ptr, 4 if dtype == "int32" else 2)


def _call(**over):
    args = dict(q=_m("q", (100, 4, 64)), k=_m("k", (120, 2, 64)), v=_m("v", (120, 2, 64)),
                cu_q=_m("cu_seqlens_q", (3,), "int32"), cu_k=_m("cu_seqlens_k", (3,), "int32"),
                max_seqlen_q=60, max_seqlen_k=60)
    kw = {k: over.pop(k) for k in list(over) if k in ("seqused_k", "causal", "softmax_scale", "return_lse")}
    args.update(over)
    return check_varlen_problem(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_seqlen_q"],
                                args["max_seqlen_k"], **kw)


def test_valid_varlen_problem():
    p = _call(causal=True, return_lse=True, seqused_k=_m("seqused_k", (2,), "int32"))
    assert (p.batch, p.total_q, p.total_k, p.heads_q, p.heads_kv, p.head_dim, p.gqa_ratio) == (2, 100, 120, 4, 2, 64, 2)
    assert p.out_shape == (100, 4, 64) and p.lse_shape == (4, 100) and p.has_seqused_k


@pytest.mark.parametrize("over,err,match", [
    (dict(cu_q=_m("cu_seqlens_q", (3,), "int64")), InputTypeError, "int32"),
    (dict(cu_k=_m("cu_seqlens_k", (3,), "int32", device="cpu")), DeviceError, "cu_seqlens_k must be on cuda:0"),
    (dict(cu_k=_m("cu_seqlens_k", (4,), "int32")), InputValueError, "3 entries"),
    (dict(cu_q=_m("cu_seqlens_q", (3, 1), "int32")), InputValueError, "1-D"),
    (dict(cu_q=_m("cu_seqlens_q", (0,), "int32")), InputValueError, "B \\+ 1 >= 1"),
    (dict(max_seqlen_q=49), InputValueError, "smaller than a real sequence length"),
    (dict(max_seqlen_k=59), InputValueError, "max_seqlen_k=59 is smaller"),
    (dict(max_seqlen_q=50.0), InputTypeError, "must be an int"),
    (dict(max_seqlen_q=-1), InputValueError, "\\[0, 2\\^31\\)"),
    (dict(q=_m("q", (1, 100, 4, 64))), InputValueError, "3 dims"),
    (dict(q=_m("q", (100, 3, 64))), InputValueError, "multiple"),
    (dict(q=_m("q", (100, 4, 80)), k=_m("k", (120, 2, 80)), v=_m("v", (120, 2, 80))), InputValueError, "head_dim 80"),
    (dict(seqused_k=_m("seqused_k", (3,), "int32")), InputValueError, "seqused_k must have 2 entries"),
    (dict(cu_q=_m("cu_seqlens_q", (1,), "int32"), cu_k=_m("cu_seqlens_k", (1,), "int32")), InputValueError,
     "no sequence but q has 100 rows"),
    (dict(q=_m("q", (2**30, 512, 64)), k=_m("k", (120, 1, 64)), v=_m("v", (120, 1, 64)), max_seqlen_q=2**30),
     InputValueError, "32-bit task index"),
])
def test_varlen_input_errors(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_varlen_errors_are_reported_together():
    with pytest.raises(InputErrors) as e:
        _call(q=_m("q", (100, 4, 64), "float32"), cu_q=_m("cu_seqlens_q", (3,), "int64"), max_seqlen_q=1)
    assert isinstance(e.value, Fa4genInputError) and len(e.value.errors) >= 2


def test_seqused_k_relaxes_the_key_length_check():
    """With seqused_k, cu_seqlens_k may include unused (padded) keys: max_seqlen_k bounds the used ones."""
    assert _call(max_seqlen_k=10, seqused_k=_m("seqused_k", (2,), "int32")).max_seqlen_k == 10


# ---- CLI and benchmark helpers -------------------------------------------------------------------------
def test_cli_builds_and_emulates_a_varlen_variant(tmp_path):
    from click.testing import CliRunner

    from fa4gen.cli import main

    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--varlen", "--gqa", "4", "--head-dim", "64",
                                  "--out", str(tmp_path), "--emit", "ptx"])
    assert r.exit_code == 0, r.output
    ptx = tmp_path / "fa4_sm90a_d64_bf16_noncausal_gqa4_varlen_m192.ptx"  # block-m auto: the 192-row tile
    assert ptx.exists()
    r = CliRunner().invoke(main, ["emulate", str(ptx), "--seeds", "1", "--quiet", "--lens", "20:40,0:5,9:0;4,1"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    r = CliRunner().invoke(main, ["emulate", str(ptx), "--shape", "1,20,40,4,1"])
    assert r.exit_code == 2 and "--lens" in r.output


def test_bench_mixes_hold_their_tokens_and_equal_work():
    from bench.varlen import MIXES, TOKENS, equal_work_dense, mix_lengths, real_flop

    for kind in ("uniform", "heavy"):
        lens = mix_lengths(kind)
        assert sum(lens) == TOKENS and min(lens) >= 1 and max(lens) <= 8192
        assert lens == mix_lengths(kind)  # deterministic
        b, s = equal_work_dense(lens)
        assert abs(b * s - TOKENS) <= s and abs(b * s * s / sum(x * x for x in lens) - 1) < 0.15
    assert real_flop([4], 1, 1, True) == 4 * 10 and real_flop([4], 1, 1, False) == 4 * 16
    assert len(MIXES) == 8
