"""sm_90a score modifiers (windows, softcap, sinks) in the lowering: the per-row key limits come from
plan.key_limits_ptx and equal plan.key_begin / key_end; a windowed kernel takes its block range from
block_info_ptx with the window (both roles) and adds the first block to the block index; the combine
of a KV-cache kernel with sinks takes sink_ptr. What the kernels compute is judged by the emulator
(fa4gen emulate; the corpus mutations sm90_window_unmasked_lo and sm90_sink_units)."""
from __future__ import annotations

import itertools
import re

from fa4gen.evidence.check import check_ptx
from fa4gen.spec.config import KernelConfig
from fa4gen.render.kernels import build_sm90
from fa4gen.spec.plan import (COMBINE_ABI_PARAMS, WINDOW_UNBOUNDED, block_info_ptx, combine_abi_params, key_begin,
                              key_end, key_limits_ptx)

MASK = (1 << 32) - 1


def _s32(x: int) -> int:
    x &= MASK
    return x - (1 << 32) if x >> 31 else x


def run(ins, regs: dict) -> dict:
    """The add / sub / min / max / mov instructions of a limit list on 32-bit registers (signed ops
    wrap as the hardware does)."""
    r = dict(regs)
    for op, dst, *src in ins:
        name, typ = op.split(".")[0], op.split(".")[-1]
        v = [int(a) if re.fullmatch(r"-?\d+", a) else r[a] for a in src]
        v = [_s32(x) if typ == "s32" else x & MASK for x in v]
        out = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "min": min, "max": max,
               "mov": lambda a: a}[name](*v)
        r[dst] = _s32(out)
    return r


def test_key_limits_ptx_equal_key_begin_and_key_end():
    lengths = (0, 1, 5, 128, 300, (1 << 30) - 1)
    sides = (0, 3, 128, WINDOW_UNBOUNDED)
    for sq, sk in itertools.product(lengths[1:], lengths):
        for q in sorted({0, 1 % sq, sq // 2, sq - 1}):  # the rows of the sequence (q < Sq)
            regs = {"%q": q, "%sq": sq, "%sk": sk, "%l": 0, "%r": 0}
            for causal in (False, True):
                got = run(key_limits_ptx(causal=causal, q="%q", sq="%sq", skv="%sk", end="%e"), regs)
                assert got["%e"] == key_end(q, sq, sk, causal), (q, sq, sk, causal)
            for left, right in itertools.product(sides, sides + ("causal",)):
                causal = right == "causal"
                window = ("%l", "0" if causal else "%r")
                regs.update({"%l": left, "%r": 0 if causal else right})
                got = run(key_limits_ptx(causal=causal, q="%q", sq="%sq", skv="%sk", end="%e", begin="%b",
                                         window=window), regs)
                r = 0 if causal else right
                assert got["%e"] == key_end(q, sq, sk, causal, r), (q, sq, sk, left, right)
                assert got["%b"] == key_begin(q, sq, sk, left), (q, sq, sk, left, right)


def _text(ins) -> str:
    return "\n".join(f"    {i[0]} {', '.join(i[1:])};" for i in ins) + "\n"


def test_windowed_kernels_take_the_window_block_range_and_limits():
    for extra in ({"causal": True}, {"kvcache": True, "page_size": 16}, {"varlen": True, "gqa_ratio": 4}):
        cfg = KernelConfig(arch="sm_90a", window=True, **extra)
        ptx, _ = build_sm90(cfg)
        window = ("%wl", "0" if cfg.causal else "%wr")
        blocks = block_info_ptx(causal=cfg.causal, rows=cfg.seq_q_per_tile, m="%mb", sq="%sq", skv="%skv",
                                tmp="%tmp0", n="%n", n_unmasked="%nunm", window=window, lo="%nlo",
                                unmasked_lo="%unlo",
                                split=("%split", "%nsplit", "%nlo", "%tmp1") if cfg.kvcache else None)
        assert ptx.count(_text(blocks)) == 2, cfg.name  # the producer's task loop and the consumers'
        for r in range(2):
            lim = key_limits_ptx(causal=cfg.causal, q=f"%seq{r}", sq="%sq", skv="%skv", end=f"%climit{r}",
                                 begin=f"%cbeg{r}", window=window)
            assert ptx.count(_text(lim)) == 1, cfg.name
        # every K/V block index (loads, page lookups, the softmax's mask test) is relative to %nlo
        assert "setp.lt.or.s32 %p_mask, %nb, %unlo, %p_mask;" in ptx
        assert "mov.u32 %tmp4, %nlo;" in ptx and "add.u32 %nb, %nb, %nlo;" in ptx
        assert "ld.param.s32 %wr" in ptx if not cfg.causal else "window_right]" not in ptx.split(")")[1]


def test_softcap_precedes_the_mask_test_and_sinks_reach_the_combine():
    cfg = KernelConfig(arch="sm_90a", kvcache=True, softcap=True, sinks=True, head_dim=64, gqa_ratio=8)
    ptx, man = build_sm90(cfg)
    for block in re.findall(r"// op \d+ Compute: softmax.*?@%p_mask bra", ptx, re.S):
        assert block.count("tanh.approx.f32") == 64  # every score of the thread's 64, before the branch
    combine = ptx[ptx.index(".visible .entry fa4_combine"):]
    assert "ld.param.u64 %cad, [sink_ptr];" in combine
    assert [n for n, _ in combine_abi_params(cfg)] == [n for n, _ in COMBINE_ABI_PARAMS] + ["sink_ptr"]
    assert man["kvcache"]["combine"]["params"][-1] == "sink_ptr"
    # a split's partial leaves the sink to the combine: fa4_fwd drops it when num_splits > 1
    assert ptx.count("setp.gt.u32 %pp2, %nsplit, 1;") == 2
    rep = check_ptx(ptx, man)
    assert rep.ok, rep.summary()


def test_a_192_row_window_tile_of_one_head_reaches_every_block():
    """The default window shapes give a 192-row tile of one head (D 64, GQA 1) a block wholly visible
    to its second tile's first row (the fourth shape's keys, Sq - rows + bn; 203 left the steady
    loop's unmasked softmax unreached: 56 of 57 blocks). About 3 s of CPU."""
    from pathlib import Path

    from fa4gen import codegen
    from fa4gen.evidence.ptxemu.harness import emulate_file
    from test_ptxemu import assert_every_block_ran

    cfg = KernelConfig(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=1, window=True, block_m=192)
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    rep = emulate_file(Path(cfg.name + ".ptx"), ptx_text=res.ptx, manifest=res.manifest, seeds=1)
    assert rep.ok, rep.summary()
    assert_every_block_ran(rep)
