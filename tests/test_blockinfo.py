"""One BlockInfo (fa4gen/spec/plan.py): the K/V block range of a task, defined once.

- plan.BlockInfo equals a brute-force count from the mask itself (which blocks hold a visible
  (query, key) pair of the unit's rows, which hold only visible ones, how splits cut them) over
  many (Sq, Skv, causal, rows, m, splits), including Sq > Skv (units that see no key), Skv = 0
  and Skv a multiple of 128 and +-1.
- plan.block_info_ptx, the same definition as PTX instructions, interpreted with PTX's 32-bit
  semantics on those values, gives the same numbers.
- No template computes a block range itself: the rendered kernels of both targets hold the
  block_info_ptx lists wherever a block count is derived, and the templates hold none of it.
- The reference, schedule and simulator follow it: a unit or split that sees no key runs one
  fully masked block (O = 0, LSE = -inf).
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from fa4gen.spec.config import KernelConfig
from fa4gen.render.kernels import build_sm90, build_sm100
from fa4gen.spec.plan import BLOCK_N, BlockInfo, block_info_ptx
from fa4gen.evidence.reference import attention_exact, fa4_forward, round_to_dtype
from fa4gen.spec.schedule import tile_blocks
from fa4gen.evidence.simulate import schedule_tasks, simulate_kvcache

ROOT = Path(__file__).resolve().parent.parent
MASK = 0xFFFFFFFF

SQ = (1, 17, 127, 128, 129, 255, 256, 257, 300, 520)
SK = (0, 1, 17, 127, 128, 129, 255, 256, 257, 383, 384, 385, 1000)
ROWS = (32, 64, 128, 192, 256)  # units: P-packed tiles, 192-row sm_90a tiles, sm_100a pairs of 128
SPLITS = (1, 2, 3, 5, 8)


# ---- brute force from the mask --------------------------------------------------------------------------
def brute_unit(m: int, rows: int, sq: int, sk: int, causal: bool, bn: int = BLOCK_N):
    """(visible blocks, blocks every row sees whole, visibility) of the unit's rows, from the mask,
    over blocks of bn keys."""
    i = np.arange(m * rows, (m + 1) * rows)[:, None]
    nb = -(-sk // bn) + 2  # blocks past the keys too: they must come out invisible
    j = np.arange(nb * bn)[None, :]
    vis = (j < sk) & ((j <= i + sk - sq) if causal else np.ones_like(i, bool))
    per_block = vis.reshape(rows, nb, bn)
    visible = np.flatnonzero(per_block.any(axis=(0, 2))).tolist()
    whole = np.flatnonzero(per_block.all(axis=(0, 2))).tolist()
    return visible, whole, vis


def brute_split(visible: list, split: int, nsplit: int):
    """(lo, n) of split s of S: the visible blocks dealt in runs of ceil(len / S); a split with none
    runs one block past them."""
    bps = -(-len(visible) // nsplit)
    mine = [b for k, b in enumerate(visible) if k // bps == split] if bps else []
    return (mine[0], len(mine)) if mine else (len(visible), 1)


# ---- a tiny interpreter of the instruction tuples --------------------------------------------------------
def _s32(x: int) -> int:
    x &= MASK
    return x - (1 << 32) if x & 0x80000000 else x


def _div(a: int, b: int) -> int:
    assert b != 0
    return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)


# each operation as a Python expression of its converted operands (the result is then wrapped to 32 bits)
_OPS = {"add": "{0} + {1}", "sub": "{0} - {1}", "min": "min({0}, {1})", "max": "max({0}, {1})", "div": "_div({0}, {1})",
        "shr": "{0} >> ({1} & 31)", "mov": "{0}", "mul": "{0} * {1}"}


@functools.lru_cache(maxsize=None)
def _compiled(ins: tuple):
    """The instruction list compiled once into one Python function of the register dict: straight-line
    code, each instruction's operands converted (s32 sign-extended, u32 masked; literals converted
    here), the operation, the result wrapped, in order (the test runs each list tens of thousands of
    times: one call instead of an interpreted loop)."""
    body = []
    for op, dst, *src in ins:
        name, *mods = op.split(".")
        typ = mods[-1]
        assert typ in ("u32", "s32"), op
        assert name != "mul" or mods[0] == "lo", op
        assert len(src) == (1 if name == "mov" else 2), op
        conv = _s32 if typ == "s32" else (lambda x: x & MASK)
        args = [repr(conv(int(a))) if re.fullmatch(r"-?\d+", a) else
                (f"_s32(r[{a!r}])" if typ == "s32" else f"(r[{a!r}] & MASK)") for a in src]
        body.append(f"    r[{dst!r}] = ({_OPS[name].format(*args)}) & MASK")
    env = {"MASK": MASK, "_s32": _s32, "_div": _div}
    exec("def run(r):\n" + "".join(line + "\n" for line in body) + "    return r\n", env)
    return env["run"]


def run_ptx(ins, regs: dict) -> dict:
    """The instructions run with PTX's 32-bit semantics (s32 operands sign-extended, results wrapped)."""
    return _compiled(tuple(ins))(dict(regs))


REGS = dict(m="%m", sq="%sq", skv="%skv", tmp="%t")


def ptx_values(causal, rows, m, sq, sk, split, nsplit, bn: int = BLOCK_N):
    """(n_unmasked, lo, n) from the instruction lists, as the kernels use them (blocks of bn keys)."""
    base = {"%m": m, "%sq": sq, "%skv": sk, "%t": 0xDEADBEEF, "%t2": 0xDEADBEEF, "%s": split, "%S": nsplit}
    if nsplit == 1:  # unsplit: [0, n) (sm_90a dense / varlen, sm_100a dense / varlen)
        out = run_ptx(block_info_ptx(causal=causal, rows=rows, n="%n", n_unmasked="%nu", block_n=bn, **REGS), base)
        lo = 0
    else:  # split: sm_90a reuses %tmp0 for both temporaries, sm_100a has two
        t2 = "%t" if split % 2 else "%t2"
        out = run_ptx(block_info_ptx(causal=causal, rows=rows, n="%n", n_unmasked="%nu",
                                     split=("%s", "%S", "%lo", t2), block_n=bn, **REGS), base)
        lo = out["%lo"]
    # n_unmasked alone with tmp = m (sm_100a's softmax roles, %tmp1 holding the tile index)
    alone = run_ptx(block_info_ptx(causal=causal, rows=rows, m="%m", sq="%sq", skv="%skv", tmp="%m",
                                   n_unmasked="%nu", block_n=bn), base)
    assert alone["%nu"] == out["%nu"]
    return out["%nu"], lo, out["%n"]


def cases():
    for sq, sk, causal, rows in itertools.product(SQ, SK, (False, True), ROWS):
        for m in range(-(-sq // rows)):
            yield sq, sk, causal, rows, m


def test_blockinfo_equals_the_mask_and_its_ptx():
    checked = empty_units = empty_splits = 0
    for sq, sk, causal, rows, m in cases():
        visible, whole, vis = brute_unit(m, rows, sq, sk, causal)
        end = len(visible)
        assert visible == list(range(end)) and whole == list(range(len(whole)))  # prefixes (no window)
        for nsplit in SPLITS:
            covered = []
            for split in range(nsplit):
                lo, n = brute_split(visible, split, nsplit)
                info = BlockInfo.of(m, rows, sq, sk, causal, split, nsplit)
                key = (sq, sk, causal, rows, m, split, nsplit)
                assert (info.first, info.end, info.n_unmasked, info.lo, info.n) == (0, end, len(whole), lo, n), key
                if info.empty:  # the one block run: every row's mask hides it, and it takes the mask path
                    assert info.n == 1 and info.needs_mask(info.lo), key
                    assert not vis[:, info.lo * BLOCK_N:(info.lo + 1) * BLOCK_N].any(), key
                    empty_splits += nsplit > 1 and end > 0
                    empty_units += end == 0 and split == 0
                else:
                    covered += list(range(info.lo, info.lo + info.n))
                if split in (0, 1, nsplit - 1) or info.empty:  # the PTX: every kind of split, fewer repeats
                    assert ptx_values(causal, rows, m, sq, sk, split, nsplit) == (info.n_unmasked, info.lo, info.n), key
                checked += 1
            assert covered == visible  # the splits cut the visible blocks, each once
    assert checked > 30000 and empty_units > 100 and empty_splits > 1000, (checked, empty_units, empty_splits)


BIG = 2**31 - 2 * BLOCK_N  # block_info_ptx's limit on Sq and Skv (its causal limits are signed 32-bit)


def test_large_lengths_keep_32_bit_arithmetic_exact():
    for sq, sk, causal, rows, m, split, nsplit in [(2**20, BIG, True, 128, 5, 0, 1),
                                                   (BIG, BIG, True, 256, BIG // 256 - 1, 3, 7),
                                                   (BIG, BIG - 1, True, 128, BIG // 128 - 1, 0, 1),
                                                   (5, BIG, False, 64, 0, 6, 7),
                                                   (2**30, 3, True, 128, 2**22, 0, 2)]:
        info = BlockInfo.of(m, rows, sq, sk, causal, split, nsplit)
        assert ptx_values(causal, rows, m, sq, sk, split, nsplit) == (info.n_unmasked, info.lo, info.n)


def test_bad_arguments_are_refused():
    for kw in (dict(rows=0), dict(split=2, num_splits=2), dict(num_splits=0), dict(m=-1)):
        args = dict(m=0, rows=128, seqlen_q=5, seqlen_k=5, causal=True) | kw
        with pytest.raises(ValueError):
            BlockInfo.of(**args)
    for window in ((-1, 0), (4, True), (4, -2)):  # sides are ints >= 0 or None (window_sides maps -1)
        with pytest.raises(ValueError):
            BlockInfo.of(0, 128, 5, 5, True, window=window)
    with pytest.raises(ValueError):
        block_info_ptx(causal=True, rows=128, m="%t", sq="%sq", skv="%skv", tmp="%t", n="%n", n_unmasked="%nu")


# ---- the templates print the list, and only it ------------------------------------------------------------
# Block-range arithmetic: rounding keys up to a block (+ 127), keys to blocks (>> 7; the thread
# index's >> 7 is the warpgroup), the split cut (blocks + num_splits), the at-least-one-block clamp.
BLOCK_ARITH = [re.compile(p) for p in (r"\badd\.[usb]32\s+[^;]*,\s*127\s*;",
                                        r"\bshr\.[usb]32\s+[^;,]*,\s*(?!\s|%tidx\b)[^;,]*,\s*7\s*;",
                                        r"\badd\.u32\s+[^;]*,\s*%nsplit\s*;",
                                        r"\bmax\.[us]32\s+%(n|nblk|tmp0)\s*,\s*%(n|nblk|tmp0)\s*,\s*1\s*;")]


def test_no_template_computes_a_block_range():
    found = []
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in BLOCK_ARITH):
                found.append(f"{path.relative_to(ROOT)}:{k}: {line.strip()}")
    assert not found, "\n".join(found)


def _text(ins) -> str:
    return "\n".join(f"    {i[0]} {', '.join(i[1:])};" for i in ins) + "\n"


def _kernels():
    for causal in (False, True):
        for var in ({}, {"varlen": True}, {"kvcache": True, "page_size": 64}):
            gqa = 1 if not var else 4
            for arch in ("sm_90a", "sm_100a"):
                cfg = KernelConfig(arch=arch, causal=causal, gqa_ratio=gqa, **var)
                yield cfg, (build_sm90 if arch == "sm_90a" else build_sm100)(cfg)[0]
    for causal in (False, True):  # 64-key blocks (sm_90a D = 256): the lists of block_n = 64
        cfg = KernelConfig(arch="sm_90a", head_dim=256, causal=causal, gqa_ratio=4, kvcache=causal, page_size=16 * causal)
        yield cfg, build_sm90(cfg)[0]


@pytest.mark.parametrize("cfg,ptx", list(_kernels()), ids=lambda x: x.name if isinstance(x, KernelConfig) else "")
def test_rendered_kernels_derive_blocks_only_through_block_info_ptx(cfg, ptx):
    """Every block-range instruction of the kernel sits inside one of the lists block_info_ptx
    returns for it (the task's count, and sm_100a's per-tile %nunm), and those lists are there."""
    sqt = cfg.seq_q_per_tile
    split = cfg.kvcache
    if cfg.arch == "sm_90a":
        lists = {"task": (block_info_ptx(causal=cfg.causal, rows=sqt, m="%mb", sq="%sq", skv="%skv", tmp="%tmp0",
                                         n="%n", n_unmasked="%nunm", block_n=cfg.block_n,
                                         split=("%split", "%nsplit", "%nlo", "%tmp0") if split else None), 2)}
    else:
        roles = len(re.findall(r"^\$L_\w+_task\d+:$", ptx, re.M))  # the roles with a task loop
        assert roles >= 5
        lists = {"task": (block_info_ptx(causal=cfg.causal, rows=2 * sqt, m="%mpair", sq="%sq", skv="%skv",
                                         tmp="%tmp0", n="%n",
                                         split=("%split", "%nsplit", "%nlo", "%tmp1") if split else None), roles),
                 "tile": (block_info_ptx(causal=cfg.causal, rows=sqt, m="%tmp1", sq="%sq", skv="%skv", tmp="%tmp1",
                                         n_unmasked="%nunm"), 2)}
    rest = ptx
    for what, (ins, count) in lists.items():
        assert rest.count(_text(ins)) == count, (what, count)
        rest = rest.replace(_text(ins), "")
    left = [ln for ln in rest.splitlines() if any(p.search(ln) for p in BLOCK_ARITH)]
    assert not left, left


# ---- the reference, the schedule and the simulator follow it ------------------------------------------------
def test_schedule_and_simulator_counts_are_blockinfo():
    for sq, sk in ((300, 17), (129, 0), (1000, 1000), (520, 128)):
        for causal in (False, True):
            for arch, rows in (("sm_90a", 128), ("sm_100a", 256)):
                cfg = KernelConfig(arch=arch, causal=causal)
                for t in schedule_tasks(cfg, 1, 1, sq, sk):
                    assert t.n_blocks == BlockInfo.of(t.m_block, rows, sq, sk, causal).n
            for m in range(-(-sq // 128)):
                assert tile_blocks(m, sq, sk, 128, causal) == BlockInfo.of(m, 128, sq, sk, causal).n
            ms = np.arange(-(-sq // 128))
            assert list(tile_blocks(ms, sq, sk, 128, causal)) == [BlockInfo.of(m, 128, sq, sk, causal).n for m in ms]


def test_reference_runs_one_masked_block_for_a_tile_that_sees_no_key():
    rng = np.random.default_rng(11)
    sq, sk, d = 300, 40, 64
    q, k, v = (round_to_dtype(rng.standard_normal(s), "bf16") for s in ((1, sq, 1, d), (1, sk, 1, d), (1, sk, 1, d)))
    cfg = KernelConfig(head_dim=d, causal=True)
    stats = {}
    o, lse = fa4_forward(q, k, v, cfg, stats=stats)
    # tiles 0 and 1 (queries 0..255 see keys <= i - 260) see no key: one block each, masked
    assert stats["tiles_without_blocks"] == 2 and stats["blocks"] == 3 and stats["masked_blocks"] == 3
    assert np.all(o[0, :260] == 0) and np.all(lse[0, 0, :260] == -np.inf)
    o_ref, lse_ref = attention_exact(q, k, v, causal=True)
    assert np.allclose(o[0, 260:], o_ref[0, 260:], atol=2e-2) and np.allclose(lse[0, 0, 260:], lse_ref[0, 0, 260:], atol=1e-3)


def test_simulator_empty_splits_run_one_masked_block():
    """(simulate_kvcache runs the sm_100a KV-cache pipeline; the sm_90a one is emulated only.)"""
    cfg = KernelConfig(arch="sm_100a", kvcache=True, causal=True, gqa_ratio=4, head_dim=64)
    rng = np.random.default_rng(3)
    B, sq, hkv, cap, S = 3, 3, 1, 300, 4
    q = round_to_dtype(rng.standard_normal((B, sq, 4 * hkv, 64)), "bf16")
    kc, vc = (round_to_dtype(rng.standard_normal((B, cap, hkv, 64)), "bf16") for _ in range(2))
    lens = np.array([129, 0, 2], np.int32)  # splits of 1, 1, 0, 0 blocks; all empty; rows 0 with no key
    res = simulate_kvcache(cfg, q, kc, vc, lens, num_splits=S)
    assert not res.findings
    for b, n in enumerate(lens):
        o_ref, lse_ref = attention_exact(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True)
        assert np.allclose(np.nan_to_num(res.o[b]), np.nan_to_num(o_ref[0]), atol=2e-2)
        seen = np.isfinite(lse_ref[0])
        assert np.array_equal(np.isfinite(res.lse[b]), seen) and np.allclose(res.lse[b][seen], lse_ref[0][seen], atol=1e-3)
    assert np.all(res.lse_partial[2:, :] == -np.inf)  # splits 2 and 3 see no key in any sequence


# ---- sliding windows -------------------------------------------------------------------------------------
WINDOWS = ((None, None), (0, 0), (1, None), (None, 3), (127, 0), (128, None), (129, 5), (300, 300), (5, 1000),
           (1000, None), (None, 0), (0, None))


def brute_window(m: int, rows: int, sq: int, sk: int, left, right, bn: int = BLOCK_N):
    i = np.arange(m * rows, (m + 1) * rows)[:, None]
    nb = -(-sk // bn) + 2
    j = np.arange(nb * bn)[None, :]
    vis = np.broadcast_to(j < sk, (rows, nb * bn))
    if right is not None:
        vis = vis & (j <= i + sk - sq + right)
    if left is not None:
        vis = vis & (j >= i + sk - sq - left)
    per_block = vis.reshape(rows, nb, bn)
    return (np.flatnonzero(per_block.any(axis=(0, 2))).tolist(), np.flatnonzero(per_block.all(axis=(0, 2))).tolist(),
            vis)


def window_ptx_values(rows, m, sq, sk, left, right, split, nsplit, bn: int = BLOCK_N):
    """(n_unmasked, unmasked_lo, lo, n) from the window's instruction lists (blocks of bn keys)."""
    from fa4gen.spec.plan import WINDOW_UNBOUNDED
    wl = WINDOW_UNBOUNDED if left is None else left
    wr = WINDOW_UNBOUNDED if right is None else right
    base = {"%m": m, "%sq": sq, "%skv": sk, "%t": 0xDEADBEEF, "%t2": 0xDEADBEEF, "%s": split, "%S": nsplit,
            "%wl": wl, "%wr": wr}
    kw = dict(causal=False, rows=rows, window=("%wl", "0" if right == 0 else "%wr"), block_n=bn, **REGS)
    out = run_ptx(block_info_ptx(n="%n", lo="%lo", n_unmasked="%nu", unmasked_lo="%ul",
                                 split=("%s", "%S", "%lo", "%t2") if nsplit > 1 else None, **kw), base)
    alone = run_ptx(block_info_ptx(**{**kw, "tmp": "%m"}, unmasked_lo="%ul"), base)
    assert alone["%ul"] == out["%ul"]
    return out["%nu"], out["%ul"], out["%lo"], out["%n"]


def test_window_blockinfo_equals_the_mask_and_its_ptx():
    """Windows smaller than a block, crossing blocks, one side unbounded, Sq != Skv: the blocks a
    unit runs are exactly those holding a visible pair, the unmasked ones exactly those every row
    sees whole, the splits cut them once each, and the PTX computes the same numbers."""
    checked = empty = 0
    for sq, sk, rows, (left, right) in itertools.product((1, 128, 257, 520), (0, 129, 256, 1000), (64, 192),
                                                         WINDOWS):
        for m in range(-(-sq // rows)):
            visible, whole, vis = brute_window(m, rows, sq, sk, left, right)
            assert visible == list(range(visible[0], visible[-1] + 1)) if visible else True
            for nsplit in (1, 2, 3):
                covered = []
                for split in range(nsplit):
                    info = BlockInfo.of(m, rows, sq, sk, False, split, nsplit, window=(left, right))
                    key = (sq, sk, rows, m, left, right, split, nsplit)
                    assert set(whole) == set(range(info.unmasked_lo, info.n_unmasked)), key
                    if info.empty or not vis[:, info.lo * BLOCK_N:(info.lo + info.n) * BLOCK_N].any():
                        assert info.n == 1 and info.needs_mask(info.lo), key
                        assert not vis[:, info.lo * BLOCK_N:(info.lo + 1) * BLOCK_N].any(), key
                        empty += 1
                    else:
                        covered += list(range(info.lo, info.lo + info.n))
                    if nsplit != 2 or info.empty:  # the PTX: unsplit, every split of 3, the empty ones
                        assert window_ptx_values(rows, m, sq, sk, left, right, split, nsplit) == \
                            (info.n_unmasked, info.unmasked_lo, info.lo, info.n), key
                    checked += 1
                assert covered == visible, (sq, sk, rows, m, left, right, nsplit)
    assert checked > 1000 and empty > 50, (checked, empty)


def test_window_sides_follow_flash_attn():
    from fa4gen.spec.plan import window_sides
    assert window_sides(None, False) == (None, None) and window_sides(None, True) == (None, 0)
    assert window_sides((-1, -1), False) == (None, None) and window_sides((128, -1), True) == (128, 0)
    assert window_sides((4096, 0), False) == (4096, 0) and window_sides((3, 5), False) == (3, 5)


def test_causal_window_equals_the_plain_causal_range_when_left_is_unbounded():
    for sq, sk, rows in itertools.product(SQ, SK, (64, 128, 192)):
        for m in range(-(-sq // rows)):
            a, b = BlockInfo.of(m, rows, sq, sk, True), BlockInfo.of(m, rows, sq, sk, True, window=(None, 0))
            assert (a.first, a.end, a.n_unmasked, a.lo, a.n, a.unmasked_lo) == \
                (b.first, b.end, b.n_unmasked, b.lo, b.n, b.unmasked_lo), (sq, sk, rows, m)


def test_key_limits_ptx_equal_key_begin_and_key_end():
    """plan.key_limits_ptx (a masked block's per-row column limits) interpreted with PTX's
    32-bit semantics: the visible columns [begin, end) of every row are the mask's, for windows,
    causal, Sq != Skv, rows that see no key and unbounded sides; without a window the list is the
    kernels' old key_end (causal: min(Skv, q + 1 + Skv - Sq); else Skv)."""
    from fa4gen.spec.plan import WINDOW_UNBOUNDED, key_begin, key_end, key_limits_ptx
    assert key_limits_ptx(causal=False, q="%q", sq="%sq", skv="%skv", end="%e") == [("mov.u32", "%e", "%skv")]
    assert key_limits_ptx(causal=True, q="%q", sq="%sq", skv="%skv", end="%e") == [
        ("sub.s32", "%e", "%skv", "%sq"), ("add.s32", "%e", "%e", "%q"), ("add.s32", "%e", "%e", "1"),
        ("min.s32", "%e", "%e", "%skv")]
    with pytest.raises(ValueError):
        key_limits_ptx(causal=False, q="%q", sq="%sq", skv="%skv", end="%e", begin="%b")
    checked = 0
    for sq, sk, causal, (left, right) in itertools.product((1, 129, 520), (0, 129, 1000), (False, True), WINDOWS):
        if causal:
            right = 0
        wl = WINDOW_UNBOUNDED if left is None else left
        wr = WINDOW_UNBOUNDED if right is None else right
        ins = key_limits_ptx(causal=causal, q="%q", sq="%sq", skv="%skv", end="%e", begin="%b",
                                 window=("%wl", "0" if causal else "%wr"))
        for q in sorted({0, 1, sq // 2, sq - 1, sq, sq + 1, sq + 127}):  # tile padding past Sq too
            out = run_ptx(ins, {"%q": q, "%sq": sq, "%skv": sk, "%wl": wl, "%wr": wr})
            b, e = _s32(out["%b"]), _s32(out["%e"])
            cols = np.arange(sk + 2)
            want = (cols >= key_begin(q, sq, sk, left)) & (cols < key_end(q, sq, sk, causal, right))
            assert np.array_equal((cols >= b) & (cols < e), want), (sq, sk, causal, left, right, q)
            checked += 1
    assert checked > 500


def test_later_blocks_need_a_mask_only_with_causal_or_a_window():
    """plan.later_blocks_need_mask: the sm_90a kernels emit no masked path for a task's later blocks
    without causal or a window. Every block after a range's first (any split) is then unmasked; with
    causal or a window some later block needs the mask (the flag is not vacuous)."""
    from fa4gen.spec.plan import later_blocks_need_mask

    seen = {(False, False): False, (True, False): False, (False, True): False, (True, True): False}
    for rows, sq, skv, splits in itertools.product((64, 128), (1, 70, 128, 300), (1, 127, 128, 129, 300, 700),
                                                    (1, 3)):
        for causal, window in seen:
            for m in range(-(-sq // rows)):
                for split in range(splits):
                    w = (100, 20 if not causal else 0) if window else None
                    bi = BlockInfo.of(m, rows, sq, skv, causal, split, splits, window=w)
                    later = [b for b in list(bi.blocks())[1:] if b < bi.end and bi.needs_mask(b)]
                    if later:
                        seen[(causal, window)] = True
                        assert later_blocks_need_mask(causal, window), (rows, sq, skv, m, split, causal, window)
    assert seen == {(False, False): False, (True, False): True, (False, True): True, (True, True): True}


# ---- 64-key blocks (sm_90a D = 256: tiles.kv_block_keys) ------------------------------------------------
def test_blockinfo_of_64_key_blocks_equals_the_mask_and_its_ptx():
    """BlockInfo and block_info_ptx over 64-key blocks, on the boundaries that move with the block:
    Skv and the causal diagonal at multiples of 64 and +-1, Sq != Skv both ways (units that see no
    key), windows smaller than a block and crossing 64-key boundaries, and KV-cache splits."""
    bn, checked = 64, 0
    for sq, sk, causal, rows in itertools.product((1, 63, 64, 65, 129, 200), (0, 1, 63, 64, 65, 127, 128, 129, 320),
                                                  (False, True), (32, 128)):
        for m in range(-(-sq // rows)):
            visible, whole, vis = brute_unit(m, rows, sq, sk, causal, bn)
            for nsplit in (1, 3):
                for split in range(nsplit):
                    lo, n = brute_split(visible, split, nsplit)
                    info = BlockInfo.of(m, rows, sq, sk, causal, split, nsplit, block_n=bn)
                    key = (sq, sk, causal, rows, m, split, nsplit)
                    assert (info.end, info.n_unmasked, info.lo, info.n) == (len(visible), len(whole), lo, n), key
                    if info.empty:
                        assert not vis[:, info.lo * bn:(info.lo + 1) * bn].any(), key
                    assert ptx_values(causal, rows, m, sq, sk, split, nsplit, bn) == \
                        (info.n_unmasked, info.lo, info.n), key
                    checked += 1
    for sq, sk, (left, right) in itertools.product((1, 65, 200), (64, 129, 320),
                                                   ((0, 0), (63, 0), (64, None), (65, 5), (None, 64), (100, 30))):
        for m in range(-(-sq // 128)):
            visible, whole, vis = brute_window(m, 128, sq, sk, left, right, bn)
            info = BlockInfo.of(m, 128, sq, sk, False, window=(left, right), block_n=bn)
            key = (sq, sk, m, left, right)
            assert set(whole) == set(range(info.unmasked_lo, info.n_unmasked)), key
            if visible:
                assert (info.lo, info.n) == (visible[0], len(visible)), key
            assert window_ptx_values(128, m, sq, sk, left, right, 0, 1, bn) == \
                (info.n_unmasked, info.unmasked_lo, info.lo, info.n), key
            checked += 1
    assert checked > 900, checked
    # the block rules are shifts and whole 32-bit mask words: other sizes are refused
    for bad in (48, 80, 16):
        with pytest.raises(ValueError):
            BlockInfo.of(0, 128, 5, 5, True, block_n=bad)


def test_the_reference_runs_64_key_blocks():
    """fa4_forward over 64-key blocks (a D = 256 sm_90a config) visits BlockInfo's blocks and masks on
    the causal diagonal with Sq != Skv; its output is attention's."""
    from fa4gen.spec.config import planning_head_dims

    with planning_head_dims():
        cfg = KernelConfig(arch="sm_90a", head_dim=256, causal=True)
    assert cfg.block_n == 64
    rng = np.random.default_rng(5)
    sq, sk, d = 70, 200, 256
    q, k, v = (round_to_dtype(rng.standard_normal(s), "bf16") for s in ((1, sq, 1, d), (1, sk, 1, d), (1, sk, 1, d)))
    stats = {}
    o, lse = fa4_forward(q, k, v, cfg, stats=stats)
    # one tile, keys < 200: blocks 3 (the tail) .. 0; queries 0..69 see keys <= i + 130, so blocks 2 and 3
    # cross the diagonal (masked), 0 and 1 are whole for every row
    assert stats["blocks"] == 4 and stats["masked_blocks"] == 2
    o_ref, lse_ref = attention_exact(q, k, v, causal=True)
    assert np.allclose(o, o_ref, atol=2e-2) and np.allclose(lse, lse_ref, atol=1e-3)
