"""sm_90a and sm_100a (192, 128), D = 96 and D = 256 (docs/HEAD_DIMS.md): the IR's layout choice (O from the
registers where no ring fits beside O staging), the K and V rings' own tile bytes held by the verifier,
o_ptr in the dense ABI of such a kernel only, D = 96's 32-column 64B-swizzled panels in the manifest's
tensor maps, D = 256's 64-key K/V blocks (rings, boxes, wgmma shapes), and small emulations reaching
every basic block (one per pair; three for D = 256: dense with every score modifier, varlen, paged KV
cache; the rest of the variants are emulated by hand, `fa4gen emulate`, and run on the GPU by
tests/test_gpu_head_dims.py)."""
import dataclasses
from pathlib import Path

import pytest

from fa4gen import codegen
from fa4gen.evidence.ptxemu.harness import KvShape, Shape, VarShape, emulate_file
from fa4gen.ir.core import ExpectTx, Space, TmaLoad
from fa4gen.ir.layout import layout_of
from fa4gen.ir.sm90 import build_sm90_pipeline, sm90_o_staged, smem_pipeline
from fa4gen.lower.manifest import entry_params
from fa4gen.spec.config import KernelConfig, planning_head_dims
from fa4gen.spec.plan import ABI_PARAMS, tile_bytes
from fa4gen.verify.mutations import edit_program
from fa4gen.verify.verify import static_findings

DEEPSEEK = dict(arch="sm_90a", head_dim=192, head_dim_v=128)


@pytest.mark.parametrize("kw,staged", [(dict(head_dim=64, block_m=192), True), (dict(head_dim=128), True),
                                       (dict(head_dim=128, varlen=True), True), (dict(head_dim=128, kvcache=True), False),
                                       (dict(head_dim=192, head_dim_v=128), False),
                                       (dict(head_dim=192, head_dim_v=128, varlen=True), False),
                                       (dict(head_dim=96), True), (dict(head_dim=96, varlen=True), True),
                                       (dict(head_dim=96, kvcache=True), False),
                                       (dict(head_dim=256), False), (dict(head_dim=256, varlen=True), False)])
def test_o_staging_is_where_the_smallest_ring_fits_beside_it(kw, staged):
    cfg = KernelConfig(arch="sm_90a", **kw)
    assert sm90_o_staged(cfg) is staged
    assert ("O_smem" in {r.name for r in build_sm90_pipeline(cfg).regions}) is staged
    if not cfg.kvcache:  # the reason: 1 Q slot and 2 K/V stages with the staging slots fit the SMEM limit or not
        pipe = smem_pipeline(cfg, 1, 2, o_staged=True)
        assert (layout_of(pipe).total <= pipe.smem_limit) is staged


def test_deepseek_rings_one_q_slot_two_stages_of_their_own_tile_bytes():
    pipe = build_sm90_pipeline(KernelConfig(**DEEPSEEK))
    assert [(r.name, r.slots, r.bytes_per_slot) for r in pipe.regions if r.space is Space.SMEM] == [
        ("Q", 1, 128 * 192 * 2), ("K", 2, 128 * 192 * 2), ("V", 2, 128 * 128 * 2)]
    assert {b.name: b.tx_bytes for b in pipe.barriers if b.tx_bytes} == {
        "q_full": 128 * 192 * 2, "k_full": 128 * 192 * 2, "v_full": 128 * 128 * 2}
    assert layout_of(pipe).total == 214104 <= pipe.smem_limit
    assert not static_findings(pipe)


@pytest.mark.parametrize("what", ["expect_tx", "load"])
def test_a_v_load_counted_as_a_k_tile_is_a_tx_count_finding(what):
    """V's slot and tx count are 32 KiB, K's 48 KiB: a V load or expect_tx carrying K's bytes is flagged."""
    cfg = KernelConfig(**DEEPSEEK)
    pipe, kbytes = build_sm90_pipeline(cfg), tile_bytes(cfg)
    kind = ExpectTx if what == "expect_tx" else TmaLoad

    def wrong(op):
        return (dataclasses.replace(op, bytes=kbytes) if isinstance(op, kind) and op.barrier == "v_full" else op,)
    found = [f for f in static_findings(edit_program(pipe, "producer", wrong)) if f.code == "TX_COUNT"]
    assert found and all(f.subject == "v_full" for f in found), found


def test_o_ptr_joins_the_dense_abi_of_a_kernel_storing_o_from_registers_only():
    dense = [n for n, _ in ABI_PARAMS]
    for kw, extra in ((dict(head_dim=128), []), (DEEPSEEK, ["o_ptr"])):
        pipe = build_sm90_pipeline(KernelConfig(**{"arch": "sm_90a", **kw}))
        assert [n for n, _ in entry_params(pipe)] == dense + extra
    for flag in ("varlen", "kvcache"):  # theirs have o_ptr already, once
        names = [n for n, _ in entry_params(build_sm90_pipeline(KernelConfig(**DEEPSEEK, **{flag: True})))]
        assert names == [n for n, _ in entry_params(build_sm90_pipeline(KernelConfig(arch="sm_90a", **{flag: True})))]
        assert names.count("o_ptr") == 1


def test_sm100a_d256_is_one_q_tile_per_task_with_s0_and_o0_in_tmem():
    """Two tiles' S and O need 2 * 128 + 2 * 256 columns of TMEM's 512 (spec.tiles.q_tiles_per_task):
    one Q tile per task, every per-tile barrier one slot, WG1 without a role, and the rest of the seed's
    roles as they are; 2 K/V stages of 64 KiB and O from the registers (198,256 bytes). Verified."""
    from fa4gen.ir.sm100 import build_sm100
    from fa4gen.verify import verify

    assert [KernelConfig(arch="sm_100a", head_dim=d).tiles_per_task for d in (64, 96, 128, 256)] == [2, 2, 2, 1]
    assert KernelConfig(arch="sm_100a", head_dim=192, head_dim_v=128).tiles_per_task == 2
    assert KernelConfig(arch="sm_90a", head_dim=128).tiles_per_task == 1
    pipe = build_sm100(KernelConfig(arch="sm_100a", head_dim=256, causal=True))
    tmem = {r.name: (r.col, r.cols) for r in pipe.regions if r.space is Space.TMEM}
    assert tmem == {"S0": (0, 128), "P0": (64, 64), "O0": (256, 256)}
    assert [(r.name, r.slots, r.bytes_per_slot) for r in pipe.regions if r.space is Space.SMEM] == [
        ("Q", 1, 65536), ("KV", 2, 65536), ("sScale", 1, 512)]
    per_tile = ("q_full", "q_empty", "s_ready", "p_o_rescale", "p_ready_2", "o_ready", "softmax_corr_empty",
                "corr_epi_full", "corr_epi_empty")
    assert {b.name: b.slots for b in pipe.barriers if b.name in per_tile} == dict.fromkeys(per_tile, 1)
    assert [r.name for r in pipe.roles] == ["softmax0", "idle_wg1", "correction", "mma", "load", "store", "idle"]
    assert pipe.role("idle_wg1").warps == (4, 5, 6, 7) and not pipe.role("idle_wg1").program
    assert layout_of(pipe).total == 198256 <= pipe.smem_limit
    assert verify(pipe).ok


def test_sm100a_d256_causal_gqa_kernel_emulates_with_every_block_reached():
    """fp16, causal, GQA 2, one Q tile per task: the MMA warp's P V of block j - 1 before S of block j in
    the same TMEM columns, the correction's 16 O chunks of 16 columns and the causal epilogue's 8 StoreO
    chunks of 32; a tile crossing the diagonal over three K/V blocks, Sq > Skv without LSE, a decode-like
    tile. About 2 s of CPU."""
    cfg = KernelConfig(arch="sm_100a", head_dim=256, causal=True, gqa_ratio=2, dtype="fp16")
    _emulate_every_block(cfg, [Shape.parse(s) for s in ("1,70,260,2,1", "1,140,50,2,1,nolse", "1,1,128,2,1")])



def test_d96_rings_and_staging_are_the_design_budget():
    """The 128-row tile, 2 Q slots, 3 K/V stages and O staged: 222,344 bytes (docs/HEAD_DIMS.md)."""
    pipe = build_sm90_pipeline(KernelConfig(arch="sm_90a", head_dim=96))
    assert [(r.name, r.slots, r.bytes_per_slot) for r in pipe.regions if r.space is Space.SMEM] == [
        ("Q", 2, 128 * 96 * 2), ("K", 3, 128 * 96 * 2), ("V", 3, 128 * 96 * 2), ("O_smem", 2, 64 * 96 * 2)]
    assert layout_of(pipe).total == 222344 <= pipe.smem_limit
    assert not static_findings(pipe)


@pytest.mark.parametrize("kw,cols,swizzle", [(dict(head_dim=96), (32, 32, 32, 32), "64B"),
                                            (dict(head_dim=96, kvcache=True, page_size=16), (32, 32, 32, 32), "64B"),
                                            (dict(head_dim=128), (64, 64, 64, 64), "128B"),
                                            (DEEPSEEK, (64, 64, 64, 64), "128B"),
                                            (dict(head_dim=256), (64, 64, 64, 64), "128B"),
                                            (dict(arch="sm_100a", head_dim=96), (32, 32, 32, 32), "64B"),
                                            (dict(arch="sm_100a", head_dim=96, varlen=True), (32, 32, 32, 32), "64B"),
                                            (dict(arch="sm_100a", head_dim=64), (64, 64, 64, 64), "128B")])
def test_tensor_maps_take_one_panel_per_box_with_its_swizzle(kw, cols, swizzle):
    """D = 96 is cut into three 32-column panels of 64B swizzle (plan.Panels): every box is one panel
    wide, with the swizzle whose row it fills; the PTX issues one box per panel."""
    from fa4gen.lower.sm90 import manifest_sm90
    from fa4gen.lower.sm100 import lowered_sm100
    cfg = KernelConfig(**{"arch": "sm_90a", **kw})
    maps = (manifest_sm90(cfg) if cfg.arch == "sm_90a" else lowered_sm100(cfg)[1])["tensor_maps"]
    assert tuple(maps[t]["box"][0] for t in "qkvo") == cols
    assert {maps[t]["swizzle"] for t in "qkvo"} == {swizzle}


def test_deepseek_causal_kernel_emulates_with_every_block_reached():
    """fp16, causal, GQA 2 (two heads per tile): a tile crossing the diagonal over three K/V blocks (masked
    and unmasked), Sq > Skv without LSE (tiles whose rows see no key; a second round of the persistent
    loop), and a decode-like tile whose first block runs unmasked. About 2 s of CPU."""
    cfg = KernelConfig(**DEEPSEEK, causal=True, gqa_ratio=2, dtype="fp16")
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    assert "o_ptr" in res.manifest["params"]
    shapes = [Shape.parse(s) for s in ("1,70,260,2,1", "1,140,50,2,1,nolse", "1,1,128,2,1")]
    rep = emulate_file(Path(cfg.name + ".ptx"), ptx_text=res.ptx, manifest=res.manifest, seeds=1, shapes=shapes)
    assert rep.ok, rep.summary()
    cov = rep.coverage.entries["fa4_fwd"]
    hit, total = cov.block_fraction()
    assert hit == total, cov


def test_d96_varlen_causal_kernel_emulates_with_every_block_reached():
    """D = 96 (three 32-column 64B panels per tile), varlen, causal, GQA 2: the 64B TMA boxes and wgmma
    descriptors, the O staging's 64B chunk swizzle and the row copies of 12 of 16 chunk threads with
    192-byte rows; a sequence crossing two K/V blocks, one without keys, one without queries, a decode
    row whose first block runs unmasked, and a batch with seqused_k and without LSE. About 4 s of CPU."""
    cfg = KernelConfig(arch="sm_90a", head_dim=96, causal=True, varlen=True, gqa_ratio=2)
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    shapes = [VarShape.parse("130:200,0:17,40:0,1:128;2,1"), VarShape((3, 0), (70, 5), 2, 1, seqused_k=(40, 3),
                                                                       with_lse=False)]
    rep = emulate_file(Path(cfg.name + ".ptx"), ptx_text=res.ptx, manifest=res.manifest, seeds=1, shapes=shapes)
    assert rep.ok, rep.summary()
    cov = rep.coverage.entries["fa4_fwd"]
    hit, total = cov.block_fraction()
    assert hit == total, cov


D256 = dict(arch="sm_90a", head_dim=256)


def test_d256_rings_are_64_key_blocks_one_q_slot_two_stages():
    """No 128-key ring fits at D = 256 (Q 64 KiB + 2 x (64 + 64) KiB): 64-key K/V blocks (tiles.kv_block_keys),
    1 Q slot, 2 stages, O from the registers: 197,720 bytes; the tx counts are the 64-key tiles'."""
    cfg = KernelConfig(**D256)
    pipe = build_sm90_pipeline(cfg)
    assert cfg.block_n == 64 and tile_bytes(cfg) == 64 * 256 * 2
    assert [(r.name, r.slots, r.rows, r.bytes_per_slot) for r in pipe.regions if r.space is Space.SMEM] == [
        ("Q", 1, 128, 128 * 256 * 2), ("K", 2, 64, 64 * 256 * 2), ("V", 2, 64, 64 * 256 * 2)]
    assert {b.name: b.tx_bytes for b in pipe.barriers if b.tx_bytes} == {
        "q_full": 128 * 256 * 2, "k_full": 64 * 256 * 2, "v_full": 64 * 256 * 2}
    assert layout_of(pipe).total == 197720 <= pipe.smem_limit
    assert not static_findings(pipe)


@pytest.mark.parametrize("kw,rows", [(dict(), 64), (dict(kvcache=True, page_size=16), 16),
                                     (dict(kvcache=True, page_size=64), 64), (dict(kvcache=True, page_size=256), 64)])
def test_d256_kv_boxes_and_wgmma_shapes_are_the_64_key_block(kw, rows):
    """K/V TMA boxes hold a 64-key block (or a smaller page: four 16-key boxes per block); QK^T is
    m64n64k16 over 16 k-steps, PV m64n256k16 over the block's 4 k-steps of 16 keys."""
    from fa4gen.lower.sm90 import manifest_sm90
    from fa4gen.render.kernels import build_sm90
    cfg = KernelConfig(**D256, **kw)
    maps = manifest_sm90(cfg)["tensor_maps"]
    assert maps["k"]["box"][-2 if cfg.page_size else 2] == rows and maps["v"]["box"] == maps["k"]["box"]
    ptx = build_sm90(cfg)[0]
    assert "m64n128k16" not in ptx
    qk, pv = ptx.count("wgmma.mma_async.sync.aligned.m64n64k16"), ptx.count("wgmma.mma_async.sync.aligned.m64n256k16")
    assert qk == 2 * 16 and pv == 2 * 4  # the first block's QK^T and the loop's, the loop's PV and the last
    loads = ptx.count("cp.async.bulk.tensor.4d")  # K and V loads: 4 panels x the boxes of a block, 4 sites
    assert loads == 4 * 4 * (64 // rows)


def _emulate_covering(cfg, shapes):
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    rep = emulate_file(Path(cfg.name + ".ptx"), ptx_text=res.ptx, manifest=res.manifest, seeds=1, shapes=shapes)
    assert rep.ok, rep.summary()
    for entry in ("fa4_fwd", "fa4_combine") if cfg.kvcache else ("fa4_fwd",):
        hit, total = rep.coverage.entries[entry].block_fraction()
        assert hit == total, (entry, hit, total)


def test_d256_dense_score_modifiers_kernel_emulates_with_every_block_reached():
    """fp16, causal, GQA 2, window + softcap + sinks over 64-key blocks: a tile whose window cuts its
    first block and leaves the next whole (unmasked), masked diagonal blocks, Sq > Skv without LSE
    (rows that see no key; a -inf sink), a decode-like tile whose one block runs unmasked; O from the
    registers through o_ptr. About 3 s of CPU."""
    cfg = KernelConfig(**D256, causal=True, gqa_ratio=2, dtype="fp16", window=True, softcap=True, sinks=True)
    _emulate_covering(cfg, [Shape.parse(s) for s in ("1,70,260,2,1 w=200,0 cap=30 sink=50",
                                                     "1,140,50,2,1,nolse w=20,0 cap=5 sink=-inf",
                                                     "1,1,64,2,1 w=-1,0 cap=50 sink=0.5")])


def test_d256_varlen_causal_kernel_emulates_with_every_block_reached():
    """Varlen, causal, GQA 4: sequences over three 64-key blocks, without keys, without queries, a
    decode row over one whole block, and a batch with seqused_k and no LSE. About 3 s of CPU."""
    cfg = KernelConfig(**D256, causal=True, varlen=True, gqa_ratio=4)
    _emulate_covering(cfg, [VarShape.parse("100:150,0:17,40:0,1:64;4,1"),
                            VarShape((3, 0), (70, 5), 4, 1, seqused_k=(40, 3), with_lse=False)])


def test_d256_paged_kvcache_kernel_emulates_with_every_block_reached():
    """16-key pages (four boxes per 64-key block), causal, GQA 4: three splits over short, empty, negative
    and clamped sequences (the combine kernel's 8 columns per lane), then one split storing O and LSE
    itself, with a 65-key sequence whose two blocks both cross the diagonal (a later masked block).
    About 3 s of CPU."""
    cfg = KernelConfig(**D256, causal=True, kvcache=True, page_size=16, gqa_ratio=4)
    _emulate_covering(cfg, [KvShape((129, 1, -3, 1000), 3, 4, 1, num_splits=3, capacity=200),
                            KvShape((65, 300), 3, 4, 1, num_splits=1, capacity=310)])


# ---- sm_100a D = 96: the same 32-column 64B panels through tcgen05 (three small emulations) -------------
def _emulate_every_block(cfg, shapes, entries=("fa4_fwd",)):
    """Emulate cfg's kernel on shapes (or shapes(manifest)): it matches the reference and every entry
    reaches all its basic blocks."""
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    shapes = shapes(res.manifest) if callable(shapes) else shapes
    rep = emulate_file(Path(cfg.name + ".ptx"), ptx_text=res.ptx, manifest=res.manifest, seeds=1, shapes=shapes)
    assert rep.ok, rep.summary()
    assert set(rep.coverage.entries) == set(entries)
    for entry, cov in rep.coverage.entries.items():
        hit, total = cov.block_fraction()
        assert hit == total, (entry, cov)


def test_sm100a_d96_causal_gqa_kernel_emulates_with_every_block_reached():
    """fp16, causal, GQA 2: the 64B TMA boxes, the tcgen05 K-major descriptors' two k16 steps per 32-column
    panel row, V's MN-major descriptor over N = 96 and the O staging's 64B chunk swizzle under the TMA
    store; a tile crossing the diagonal over three K/V blocks, Sq > Skv without LSE, a decode-like tile.
    About 2 s of CPU."""
    cfg = KernelConfig(arch="sm_100a", head_dim=96, causal=True, gqa_ratio=2, dtype="fp16")
    _emulate_every_block(cfg, [Shape.parse(s) for s in ("1,70,260,2,1", "1,140,50,2,1,nolse", "1,1,128,2,1")])


def test_sm100a_d96_varlen_causal_kernel_emulates_with_every_block_reached():
    """Varlen, causal, GQA 2: the store warp's row copies over 12 of 16 chunk lanes with 192-byte rows
    from the 64B-swizzled staging; the ragged batches of the sm_90a D = 96 test. About 2.5 s of CPU."""
    cfg = KernelConfig(arch="sm_100a", head_dim=96, causal=True, varlen=True, gqa_ratio=2)
    _emulate_every_block(cfg, [VarShape.parse("130:200,0:17,40:0,1:128;2,1"),
                               VarShape((3, 0), (70, 5), 2, 1, seqused_k=(40, 3), with_lse=False)])


@pytest.mark.parametrize("d", [96, 256])
def test_sm100a_paged_kv_kernel_with_every_score_mod_emulates_with_every_block_reached(d):
    """A paged KV cache (16-key pages: 8 boxes per panel and block) with window, softcap and sinks, GQA 4:
    fa4_fwd's split partials over d fp32 columns and fa4_combine. The default decode batches, each cut
    to the sequences that reach a block the others do not (a sequence without keys in the 3-split batch,
    the 390-key one whose second Q tile holds rows); about 5 s of CPU each. D = 96: 32-column 64B
    panels; D = 256: one Q tile per task, WG2's partials of 256 columns in 16-column chunks and its
    StoreO of one split."""
    import dataclasses

    from fa4gen.evidence.ptxemu.kvcache import default_kv_shapes

    cfg = KernelConfig(arch="sm_100a", head_dim=d, kvcache=True, page_size=16, window=True, softcap=True,
                       sinks=True, gqa_ratio=4)

    def shapes(man):
        b = default_kv_shapes(man)
        return [dataclasses.replace(b[0], seqlens=(-3,)), b[1], dataclasses.replace(b[2], seqlens=(390,)), b[3]]
    _emulate_every_block(cfg, shapes, entries=("fa4_fwd", "fa4_combine"))


# ---- sm_100a (192, 128): 2 K/V stages of the larger tile, O from the registers (the IR) --------------
DEEPSEEK_100 = dict(arch="sm_100a", head_dim=192, head_dim_v=128)


@pytest.mark.parametrize("kw,staged,stages", [(dict(head_dim=64), True, 3), (dict(head_dim=96), True, 3),
                                              (dict(head_dim=128), True, 3), (dict(head_dim=128, kvcache=True), True, 3),
                                              (dict(head_dim=192, head_dim_v=128), False, 2),
                                              (dict(head_dim=192, head_dim_v=128, varlen=True), False, 2),
                                              (dict(head_dim=192, head_dim_v=128, kvcache=True), False, 2)])
def test_sm100a_o_staging_and_ring_depth_follow_the_one_rule(kw, staged, stages):
    """sm_90a's rule (ir/layout.o_staged): O is staged where the smallest ring (2 Q tiles, 2 K/V stages)
    fits beside the staging slots; the default ring is the deepest that then fits."""
    from fa4gen.ir.sm100 import build_sm100, sm100_kv_stages, sm100_o_staged
    from fa4gen.ir.sm100 import smem_pipeline as smem100

    with planning_head_dims():
        cfg = KernelConfig(arch="sm_100a", **kw)
        pipe = build_sm100(cfg)
    assert sm100_o_staged(cfg) is staged and sm100_kv_stages(cfg) == stages
    assert ("O_smem" in {r.name for r in pipe.regions}) is staged
    assert pipe.region("KV").slots == stages
    two = smem100(cfg, 2, True)
    assert (layout_of(two).total <= two.smem_limit) is staged
    deeper = smem100(cfg, stages + 1, staged)
    assert layout_of(deeper).total > deeper.smem_limit or stages == 3


def test_sm100a_deepseek_ir_fits_with_o_stored_from_the_registers():
    from fa4gen.ir.core import StoreO, TmaStore, walk_ops
    from fa4gen.ir.sm100 import build_sm100
    from fa4gen.verify import verify

    with planning_head_dims():
        pipe = build_sm100(KernelConfig(**DEEPSEEK_100, causal=True, gqa_ratio=2))
    assert [(r.name, r.slots, r.bytes_per_slot) for r in pipe.regions if r.space is Space.SMEM] == [
        ("Q", 2, 128 * 192 * 2), ("KV", 2, 128 * 192 * 2), ("sScale", 2, 512)]
    assert [(r.name, r.col, r.cols) for r in pipe.regions if r.name in ("O0", "O1")] == [("O0", 256, 128), ("O1", 384, 128)]
    assert layout_of(pipe).total == 198840 <= pipe.smem_limit
    assert not static_findings(pipe)
    # each load announces its own tile: K 48 KiB, V 32 KiB, the ring's barrier no single count
    loads = [op for op in walk_ops(pipe.role("load").program) if isinstance(op, (ExpectTx, TmaLoad))]
    assert {(type(op).__name__, getattr(op, "tensor", None), op.bytes) for op in loads if op.barrier == "kv_full"} == {
        ("ExpectTx", None, 128 * 192 * 2), ("ExpectTx", None, 128 * 128 * 2),
        ("TmaLoad", "k", 128 * 192 * 2), ("TmaLoad", "v", 128 * 128 * 2)}
    assert pipe.barrier("kv_full").tx_bytes == 0
    # the epilogue (causal: the softmax warpgroups) stores O in four 32-column chunks; the store warp none
    for i in (0, 1):
        assert [(op.col_lo, op.col_hi, op.qtile) for op in walk_ops(pipe.role(f"softmax{i}").program)
                if isinstance(op, StoreO)] == [(c, c + 32, i) for c in range(0, 128, 32)]
    assert not any(isinstance(op, TmaStore) for op in walk_ops(pipe.role("store").program))
    assert verify(pipe, random_schedules=2).ok


def test_sm100a_deepseek_v_load_with_k_count_is_rejected():
    from fa4gen.ir.sm100 import build_sm100
    from fa4gen.verify import verify
    from fa4gen.verify.mutations import SM100_DV_CORPUS

    with planning_head_dims():
        pipe = build_sm100(KernelConfig(**DEEPSEEK_100))
    for mut in SM100_DV_CORPUS:
        rep = verify(mut.apply(pipe), random_schedules=1)
        assert any(f.code == mut.code and mut.culprit in f.subject.split(", ") for f in rep.findings), rep.text()
        # a dv == d pipeline: K's and V's counts are one, the mutation is no change
        same = build_sm100(KernelConfig(arch="sm_100a", head_dim=128))
        assert mut.apply(same) == same


def test_sm100a_deepseek_varlen_causal_kernel_emulates_with_every_block_reached():
    """Varlen, causal, GQA 2: the softmax warpgroups' StoreO of 256-byte O rows of the sequence only
    (no staging, no store), K's three and V's two 128B panels in a 48 KiB ring slot, QK^T over 192
    columns and PV with N = 128; ragged batches with empty sequences and a decode-like one."""
    cfg = KernelConfig(**DEEPSEEK_100, causal=True, varlen=True, gqa_ratio=2)
    _emulate_every_block(cfg, [VarShape.parse("130:200,0:17,40:0,1:128;2,1"),
                               VarShape((3, 0), (70, 5), 2, 1, seqused_k=(40, 3), with_lse=False)])


def test_sm100a_deepseek_paged_kv_kernel_emulates_with_every_block_reached():
    """A paged KV cache (16-key pages), non-causal: WG2's StoreO (one split) and its fp32 partials of
    128 columns (several), K and V boxes of their own tiles, and fa4_combine; the first three default
    decode batches cut as for D = 96 (the fourth reaches no other block). With the varlen one above,
    about 9 s of CPU."""
    import dataclasses

    from fa4gen.evidence.ptxemu.kvcache import default_kv_shapes

    cfg = KernelConfig(**DEEPSEEK_100, kvcache=True, page_size=16, gqa_ratio=4)

    def shapes(man):
        b = default_kv_shapes(man)
        return [dataclasses.replace(b[0], seqlens=(-3,)), b[1], dataclasses.replace(b[2], seqlens=(390,))]
    _emulate_every_block(cfg, shapes, entries=("fa4_fwd", "fa4_combine"))
