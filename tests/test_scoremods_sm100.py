"""sm_100a score modifiers (sliding windows, logit softcap, attention sinks), lowered from the IR.

- The IR: a window / softcap needs no new op (the block range and the score path are the walker's);
  sinks are one Compute("apply_sink") per softmax role, on the path that normalises O itself and
  before the LSE; a KV-cache split's partial leaves it out (fa4_combine adds it once).
- The PTX: every window block range is a plan.block_info_ptx list (the task's over the pair of Q
  tiles in every role with a task loop, the unmasked range [%unmlo, %nunm) over each softmax role's
  tile) and the row limits plan.key_limits_ptx's, with the sides read from the parameters and
  clamped; masked blocks are b >= %nunm or b < %unmlo; the block base %nlo is added to the K/V
  coordinates; softcap's tanh.approx.f32 runs on all 128 scores before the mask branch and the row
  max; the sink joins the divisor and the LSE.
What the code computes is judged by `fa4gen emulate`: the dense kernel and the corpus mutations
window_begin_word_dropped, window_unmasked_lo_ignored, sink_dropped_from_divisor in tests/test_ptxemu.py,
the KV-cache kernel with all three modifiers here.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from fa4gen.spec.config import KernelConfig
from fa4gen.ir import build_pipeline
from fa4gen.ir.core import Compute, Cond, If, Loop, walk_ops
from fa4gen.render.kernels import build_sm100
from fa4gen.evidence.ptxemu.harness import emulate_file
from fa4gen.spec.plan import WINDOW_UNBOUNDED, block_info_ptx, key_limits_ptx

from test_ptxemu import assert_every_block_ran

DENSE = KernelConfig(arch="sm_100a", head_dim=64, causal=True, window=True, softcap=True, sinks=True)
KV = KernelConfig(arch="sm_100a", kvcache=True, page_size=16, gqa_ratio=4, window=True, sinks=True)


@functools.lru_cache(maxsize=None)
def built(cfg: KernelConfig) -> tuple[str, dict]:
    return build_sm100(cfg)


def ptx(cfg: KernelConfig) -> str:
    return built(cfg)[0]


def _text(ins) -> str:
    return "\n".join(f"    {i[0]} {', '.join(i[1:])};" for i in ins) + "\n"


def _sides(causal: bool) -> list[tuple]:
    out = []
    for reg, name in (("%wl", "window_left"),) + (() if causal else (("%wr", "window_right"),)):
        out += [("ld.param.s32", reg, f"[{name}]"), ("max.s32", reg, reg, "0"),
                ("min.s32", reg, reg, str(WINDOW_UNBOUNDED))]
    return out


def _tail(role):
    """The softmax role's statements after its K/V loop, inside the task loop."""
    task = next(s for s in role.program if isinstance(s, Loop))
    return [s for s in task.body if not isinstance(s, Loop)]


def test_sinks_are_one_compute_before_the_lse_and_outside_a_split():
    for cfg in (DENSE, KV):
        pipe = build_pipeline(cfg)
        for i in (0, 1):
            tail = _tail(pipe.role(f"softmax{i}"))
            if cfg.kvcache:
                split = tail[0]
                assert isinstance(split, If) and split.cond is Cond.SPLIT_KV
                assert [c.fn for c in walk_ops(split.then) if isinstance(c, Compute)] == ["store_lse_partial"]
                path = split.orelse
            else:
                path = tail
            fns = [c.fn for c in walk_ops(path) if isinstance(c, Compute)]
            assert fns[:2] == ["apply_sink", "store_lse"], fns
    plain = build_pipeline(DENSE.replace(sinks=False))
    assert not [c for c in walk_ops(plain.role("softmax0").program) if isinstance(c, Compute) and c.fn == "apply_sink"]


def test_window_ranges_and_limits_come_from_the_plan():
    for cfg in (DENSE, KV):
        text = ptx(cfg)
        win = ("%wl", "0" if cfg.causal else "%wr")
        split = ("%split", "%nsplit", "%nlo", "%tmp1") if cfg.kvcache else None
        task = _sides(cfg.causal) + block_info_ptx(causal=cfg.causal, rows=2 * cfg.seq_q_per_tile, m="%mpair",
                                                   sq="%sq", skv="%skv", tmp="%tmp0", n="%n", split=split,
                                                   window=win, lo="%nlo")
        tile = block_info_ptx(causal=cfg.causal, rows=cfg.seq_q_per_tile, m="%tmp1", sq="%sq", skv="%skv",
                              tmp="%tmp0", n_unmasked="%nunm", unmasked_lo="%unmlo", window=win)
        limits = _sides(cfg.causal) + key_limits_ptx(causal=cfg.causal, q="%seq", sq="%sq", skv="%skv",
                                                     end="%climit", begin="%cbegin", window=win)
        roles = len(re.findall(r"^\$L_\w+_task\d+:$", text, re.M))
        assert roles >= 5 and text.count(_text(task)) == roles
        assert text.count(_text(limits) + _text(tile)) == 2  # each softmax role, per task
        # masked: b >= %nunm or b < %unmlo, both softmax roles; K/V coordinates from %nlo + relative block
        assert text.count("setp.lt.or.s32 %p_mask, %nb, %unmlo, %p_mask;") == 2
        assert text.count("add.u32 %nb, %nb, %nlo;") == 2
        assert re.search(r"add\.u32 %c2, %c2, %nlo;\n\s*shl\.b32 %c2, %c2, 7;", text) or \
            re.search(r"add\.u32 %pkey, %pkey, %nlo;\n\s*shl\.b32 %pkey, %pkey, 7;", text)
        # both limits in every mask word: 4 words per softmax role
        assert len(re.findall(r"and\.b32 %mw\d, %mw\d, %mbw;", text)) == 8


def test_softcap_runs_on_every_score_before_the_mask_and_the_max():
    text = ptx(DENSE)
    assert "ld.param.f32 %capin, [softcap_in];" in text
    for body in re.findall(r"// op \d+ Compute: softmax_max[^\n]*\n([\s\S]*?)// op \d+ ", text):
        tanh = [m.start() for m in re.finditer(r"tanh\.approx\.f32 %s(\d+), %s\1;", body)]
        assert len(tanh) == 128
        assert max(tanh) < body.index("@!%p_mask bra") < body.index("max.f32")


def test_sink_joins_the_divisor_and_the_lse():
    text = ptx(DENSE)
    sink = re.findall(r"// op \d+ Compute: apply_sink[^\n]*\n([\s\S]*?)// op \d+ ", text)
    assert len(sink) == 2
    for body in sink:
        assert "ld.param.u64 %rdt, [sink_ptr];" in body and "add.f32 %sum, %sum, %snke;" in body
        assert "fma.rn.f32 %snkf, %sum, %snkf, %snke;" in body and "lg2.approx.ftz.f32 %lsev, %snkf;" in body
    # store_lse stores the apply_sink's LSE (no second computation from row_sum)
    for body in re.findall(r"// op \d+ Compute: store_lse\b[^\n]*\n([\s\S]*?)st\.global\.f32", text):
        assert "lg2.approx" not in body



def test_kv_cache_kernel_with_every_score_mod_emulates():
    """Window, softcap and sinks over a paged KV cache: fa4_fwd's partials leave the sink out, its direct
    store (one split) and fa4_combine count it once; the default decode batches, one seed, reach every
    basic block of both entries (both Q tiles' O rescales under a softcap and a window among them)."""
    text, man = built(KV.replace(softcap=True))
    rep = emulate_file(Path("k.ptx"), ptx_text=text, manifest=man, seeds=1)
    assert rep.ok, rep.summary()
    assert len(rep.runs) == 4 and all(r.warp_instructions > 10_000 for r in rep.runs)
    assert_every_block_ran(rep)
