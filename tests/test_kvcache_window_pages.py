"""A windowed decode over a paged KV cache reads only the window's pages: the emulator runs the real
sm_100a and sm_90a PTX and records every TMA load (Emulator.tma_loads); the K and V boxes loaded are
exactly those of the 128-key blocks that hold the window's keys (i + k_len - Sq - W .. i + k_len - Sq
for a (W, 0) window), each box's page looked up as the KV-cache rules say (schedule.kvcache_page).
The blocks are the window's from first principles here, not plan.BlockInfo's."""
import functools

import pytest

from fa4gen.spec.config import KernelConfig
from fa4gen.spec.plan import BLOCK_N, kv_box_rows
from fa4gen.spec.schedule import kvcache_page
from fa4gen.render.kernels import build_sm90, build_sm100
from fa4gen.evidence.ptxemu.cases import ScoreMods
from fa4gen.evidence.ptxemu.kvcache import KvShape, make_kv_inputs, run_kvcache_once
from fa4gen.evidence.ptxemu.parse import parse_for_manifest

W = 150  # the window's left side: 151 keys, 2 of a sequence's blocks


@functools.lru_cache(maxsize=None)
def _kernel(cfg: KernelConfig):
    ptx, man = (build_sm100 if cfg.arch == "sm_100a" else build_sm90)(cfg)
    return parse_for_manifest(ptx, man), man


@pytest.mark.parametrize("arch, page_size", [("sm_100a", 64), ("sm_90a", 128)])
def test_windowed_decode_loads_only_the_windows_pages(arch, page_size):
    cfg = KernelConfig(arch=arch, head_dim=64, kvcache=True, page_size=page_size, window=True)
    mods, man = _kernel(cfg)
    # 1000 and 300 keys of a 1024-key cache, two splits over the window's blocks
    shape = KvShape((1000, 300), 1, 1, 1, num_splits=2, capacity=1024, mods=ScoreMods(window=(W, 0)))
    inp = make_kv_inputs(shape, cfg.dtype, cfg.head_dim, page_size, seed=0)
    loads = []
    res = run_kvcache_once(mods, man, shape, 0, inputs=inp, tma_loads=loads)
    assert res.ok, res.report
    rows = kv_box_rows(cfg)
    want, pages_seen = set(), set()
    for b, kl in enumerate(inp.k_lens):
        table = inp.page_table[b * inp.stride: b * inp.stride + inp.max_pages]
        first, last = max(kl - 1 - W, 0), kl - 1  # the one query's window (Sq = 1): keys [first, last]
        for key in range(first // BLOCK_N * BLOCK_N, (last // BLOCK_N + 1) * BLOCK_N, rows):
            want.add(kvcache_page(table, key, page_size, inp.max_pages, inp.num_pages))
        pages_seen |= {kvcache_page(table, key, page_size, inp.max_pages, inp.num_pages)[0] for key in range(kl)}
    for t in ("tmap_k", "tmap_v"):
        got = {(c[3], c[2]) for name, c in loads if name == t}  # coordinates (d, head, row in page, page)
        assert got == want, (t, sorted(got ^ want))
    # most of the sequences' pages (those of the blocks before each window) are never touched
    assert len({p for p, _ in want}) <= len(pages_seen) // 2
