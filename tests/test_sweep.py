"""The mutation sweep (fa4gen/evidence/sweep.py, scripts/mutation_sweep.py) and the evidence it made
grow: every class of edit it found passing both `fa4gen check` and `fa4gen emulate` is now seen
(the classes themselves are in the PTX corpus, mutations.SWEEP_MUTATIONS, run by test_ptxemu.py)."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from fa4gen.evidence import sweep
from fa4gen.evidence.check import check_ptx
from fa4gen.evidence.ptxemu import harness
from fa4gen.evidence.ptxemu.cases import HUGE_ROWS, make_inputs
from fa4gen.evidence.ptxemu.parse import parse_for_manifest

ROOT = Path(__file__).resolve().parent.parent
SM90 = ROOT / "generated" / "fa4_sm90a_d128_bf16_causal_gqa1.ptx"
SM100 = ROOT / "generated" / "fa4_sm100a_d128_bf16_causal_gqa1.ptx"


def _load(p: Path):
    return p.read_text(), harness.load_manifest(p, None)


def test_every_edit_class_has_sites_and_changes_one_place():
    text, man = _load(SM90)
    every = sweep.mutants(text, parse_for_manifest(text, man), random.Random(0))
    lines = text.split("\n")
    for op in sweep.OPS:
        assert every[op], op
        for m in random.Random(1).sample(every[op], min(20, len(every[op]))):
            out = m.apply(lines)
            assert out != text
            # the edit is local: everything before the edited line is untouched
            assert out.split("\n")[:m.line - 1] == lines[:m.line - 1]
    # swaps only where the order matters: two instructions that share no written register and
    # neither of which synchronises are not swapped (they would be equivalent edits)
    pairs = {(m.before.split("\n")[0].strip(), m.before.split("\n")[1].strip()) for m in every["swap"]}
    assert ("shr.u32 %wg, %tidx, 7;", "and.b32 %lane, %tidx, 31;") not in pairs
    assert not any(a.startswith("ld.param") and b.startswith("ld.param") for a, b in pairs)
    # repeating a store of the same value or a max with itself changes nothing: not a dup mutant
    assert not any(re.match(r"\s*(st\.|max\.)", m.before) for m in every["dup"])


def test_a_small_sweep_classifies_and_reports(tmp_path):
    """Two edits of each of two classes through the whole sweep: judged, counted, written back out."""
    res = sweep.run_sweep(SM90, ops=("neg", "dup"), per_op=2, seed=3, jobs=1, seeds=1, assemble=False)
    assert len(res["verdicts"]) == 4
    assert {v["result"].split(":")[0] for v in res["verdicts"]} <= {"check", "emulate", "survived", "crash", "unparsed"}
    text = sweep.summary(res)
    assert "neg" in text and "dup" in text and res["kernel"] in text
    sweep.dump(res, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["sites"]["neg"] > 2


def test_the_judge_names_the_tool_that_caught_an_edit():
    text, man = _load(SM90)
    lines = text.split("\n")
    sweep._init(text, man, 1, 2, 2_000_000, False)
    # an arrive dropped: a protocol edit, the read-back sees it first
    i = next(k for k, ln in enumerate(lines) if "mbarrier.arrive.shared::cta.b64" in ln)
    v = sweep.judge(sweep.Mutant("drop", i + 1, lines[i], ""))
    assert v.result == "check"
    # an exponential of the K/V loop's softmax dropped: data path, the emulator's
    i = next(k for k, ln in enumerate(lines) if k > 1500 and ln.strip().startswith("ex2.approx.ftz.f32 %s0,"))
    v = sweep.judge(sweep.Mutant("drop", i + 1, lines[i], ""))
    assert v.result.startswith("emulate:"), v


def test_replay_refuses_a_file_that_changed(tmp_path):
    ptx = tmp_path / "k.ptx"
    ptx.write_text(SM90.read_text())
    (tmp_path / "k.json").write_text(SM90.with_suffix(".json").read_text())
    lines = ptx.read_text().split("\n")
    res = {"file": str(ptx), "ops": ["drop"], "seeds": 1, "ctas": 2,
           "verdicts": [{"op": "drop", "line": 100, "before": lines[99] + " // not this", "after": "",
                         "result": "survived"}]}
    with pytest.raises(RuntimeError, match="changed since the sweep"):
        sweep.replay(res, jobs=1)


# ---- fa4gen check ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [SM90, SM100], ids=["sm_90a", "sm_100a"])
def test_check_wants_every_try_wait_looped_on(path):
    """A try_wait may return false before its phase completes (its time limit): a wait is the
    try_wait and the branch back to it. Each retry branch dropped is a difference."""
    text, man = _load(path)
    lines = text.split("\n")
    retries = [k for k, ln in enumerate(lines) if re.match(r"\s*@!%p_w bra \$Lwait\d+;", ln)]
    assert len(retries) >= 10
    for k in retries[::3]:
        rep = check_ptx("\n".join(lines[:k] + lines[k + 1:]), man)
        assert not rep.ok and "not retried" in rep.summary(), (path.name, k + 1)


def test_check_reads_the_ring_slot_stride():
    """slot * stride + %bar / %smem: the stride must be an mbarrier's 8 bytes, or the region's slot size."""
    text, man = _load(SM90)
    assert check_ptx(text, man).ok
    bar = re.sub(r"mad\.lo\.u32 %qb, %st_consumer_v, 8, %bar;", "mad.lo.u32 %qb, %st_consumer_v, 24, %bar;", text, count=1)
    rep = check_ptx(bar, man)
    assert not rep.ok and "steps 24 bytes per ring slot from %bar" in rep.summary()
    m = re.search(r"mad\.lo\.u32 %dst, %st_producer_k, (\d+), %smem;", text)
    smem = text.replace(m.group(0), m.group(0).replace(m.group(1), str(int(m.group(1)) // 2)), 1)
    rep = check_ptx(smem, man)
    assert not rep.ok and "per ring slot from %smem" in rep.summary()


# ---- fa4gen emulate --------------------------------------------------------------------------------------
def test_a_decode_like_tile_keeps_one_row_whose_softmax_is_spread():
    """Sq = 1: batch 0's row is N(0, 1) (a one-hot row hides a term dropped from its sums), the later
    batches' rows are huge (a row maximum over part of the row overflows there)."""
    q, _, _ = make_inputs(harness.Shape(2, 1, 128, 3, 3), "bf16", 128, seed=0, huge=True)
    assert np.abs(q[0]).max() < 8
    assert np.abs(q[1]).max() > HUGE_ROWS
    q, _, _ = make_inputs(harness.Shape(1, 1, 128, 1, 1), "bf16", 128, seed=0, huge=True)
    assert np.abs(q).max() < 8


def test_every_dense_launch_holds_huge_rows(monkeypatch):
    """Not only softcap kernels: a row of raw scores ~1e4 overflows its exponentials unless the
    maximum subtracted is the row's true one."""
    text, man = _load(SM90)
    seen = []
    real = harness.make_inputs

    def spy(shape, dtype, d, seed, huge=False, **kw):
        seen.append(huge)
        return real(shape, dtype, d, seed, huge=huge, **kw)
    monkeypatch.setattr(harness, "make_inputs", spy)
    sh = next(s for s in harness.default_shapes(man) if s.sq > 100)
    assert harness.run_once(text, man, sh, 0).ok
    assert seen == [True]
    q, _, _ = real(sh, "bf16", 128, seed=0, huge=True)
    row_max = np.abs(q).max(axis=(0, 2, 3))
    assert (row_max > HUGE_ROWS).any() and (row_max < 8).any()
