"""KV-cache kernels through the CPU tools: the emitted PTX's decode_kvcache executed in the emulator
against fa4gen.spec.schedule (kvcache_task, kvcache_k_len; plan.BlockInfo), modules of two entries in the
parser and in `fa4gen check`, the KV-cache emulation end to end (paged with a shuffled page table
and contiguous, split-KV + fa4_combine, and a single split), its default batches and the CLI.
The KV-cache PTX mutations are in fa4gen/evidence/ptxemu/mutations.py and run with the corpus
(tests/test_ptxemu.py test_ptx_mutation_is_caught)."""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from fa4gen import codegen
from fa4gen.evidence.check import check_ptx
from fa4gen.spec.config import KernelConfig
from fa4gen.evidence.ptxemu import harness, kvcache
from fa4gen.evidence.ptxemu.harness import run_raw
from fa4gen.evidence.ptxemu.mutations import PTX_MUTATIONS
from fa4gen.evidence.ptxemu.parse import PtxSyntaxError, parse, parse_for_manifest
from fa4gen.spec.plan import BlockInfo
from fa4gen.spec.schedule import kvcache_k_len, kvcache_task

FIELDS = 8  # per task: split, m block, batch, head group, k_len, first block, blocks, unmasked blocks


@functools.lru_cache(maxsize=None)
def _built(items: tuple):
    r = codegen.build(KernelConfig(**dict(items)), emit=("ptx",), verify=False)
    return r.ptx, r.manifest


def built(**cfg):
    return _built(tuple(sorted(cfg.items())))


def sm100_kvcache_or_skip(**cfg):
    """The sm_100a KV-cache build, or a skip while its lowering has not landed (no "kvcache" record
    or no combine entry in the module)."""
    try:
        ptx, man = built(arch="sm_100a", kvcache=True, **cfg)
    except Exception as e:  # noqa: BLE001 (any lowering error means: not there yet)
        pytest.skip(f"sm_100a kvcache does not build yet: {type(e).__name__}: {e}")
    if "kvcache" not in man or ".entry fa4_combine(" not in ptx:
        pytest.skip("the sm_100a lowering does not emit a KV-cache module yet (no kvcache record / fa4_combine)")
    return ptx, man


# ---- the PTX's task decode, executed -----------------------------------------------------------------
def _decode_kernel(ptx: str, man: dict) -> str:
    """A kernel around the emitted fa4_fwd's own decode_kvcache (its first `// sched: kvcache` ..
    `// sched: end` section): 32 threads decode tasks lane, lane + 32, ... and store what they found."""
    fwd = parse_for_manifest(ptx, man)[man["entry"]]
    a = ptx.index("// sched: kvcache")
    body = ptx[a:ptx.index("// sched: end", a)]
    used = set(re.findall(r"%\w+", body)) | {"%task", "%nsplit", "%nmb", "%hkv_n", "%cap", "%sq", "%batch", "%slen",
                                             "%split", "%mb", "%b", "%hkv", "%skv", "%nlo", "%n", "%nunm"}
    decl = "\n".join(f"    .reg {fwd.regs[r]} {r};" for r in sorted(used))
    return f""".version 8.5
.target sm_90a
.address_size 64
.visible .entry k(
    .param .u64 cache_seqlens,
    .param .u64 out,
    .param .u32 ntasks,
    .param .u32 num_splits,
    .param .u32 nmb,
    .param .u32 hkv_n,
    .param .u32 cap,
    .param .u32 sq,
    .param .u32 batch
)
{{
{decl}
    .reg .pred %kt_p;
    .reg .b32 %kt_ntasks;
    .reg .b64 %kt_out, %kt_rd;
    mov.u32 %task, %tid.x;
    ld.param.u64 %kt_out, [out];
    ld.param.u64 %slen, [cache_seqlens];
    ld.param.u32 %kt_ntasks, [ntasks];
    ld.param.u32 %nsplit, [num_splits];
    max.u32 %nsplit, %nsplit, 1;
    ld.param.u32 %nmb, [nmb];
    ld.param.u32 %hkv_n, [hkv_n];
    ld.param.u32 %cap, [cap];
    ld.param.u32 %sq, [sq];
    ld.param.u32 %batch, [batch];
$L_kt_loop:
    setp.ge.u32 %kt_p, %task, %kt_ntasks;
    @%kt_p bra $L_kt_end;
{body}
    mul.wide.u32 %kt_rd, %task, {4 * FIELDS};
    add.s64 %kt_rd, %kt_rd, %kt_out;
    st.global.v4.u32 [%kt_rd], {{ %split, %mb, %b, %hkv }};
    st.global.v4.u32 [%kt_rd+16], {{ %skv, %nlo, %n, %nunm }};
    add.u32 %task, %task, 32;
    bra.uni $L_kt_loop;
$L_kt_end:
    ret;
}}
"""


def _expected(cfg: KernelConfig, seqlens, cap, sq, hkv, splits):
    nmb = -(-sq // cfg.seq_q_per_tile)
    groups = hkv * cfg.head_groups
    out = []
    for t in range(len(seqlens) * groups * nmb * splits):
        s, m, b, hg = kvcache_task(t, splits, nmb, groups)
        k_len = kvcache_k_len(seqlens[b] & 0xFFFFFFFF, cap)
        info = BlockInfo.of(m, cfg.seq_q_per_tile, sq, k_len, cfg.causal, s, splits)
        out.append((s, m, b, hg, k_len, info.lo, info.n, info.n_unmasked))
    return out


def _run_decode(ptx_kernel, seqlens, cap, sq, hkv, splits, nmb, ng=1, extra=3):
    ntasks = len(seqlens) * hkv * ng * nmb * splits
    out = np.zeros((ntasks + extra, FIELDS), np.uint32)
    args = (np.asarray(seqlens, np.int64).astype(np.int32), out, ntasks, splits, nmb, hkv, cap, sq, len(seqlens))
    *_, got = run_raw(ptx_kernel, threads=32, args=args, step_limit=5_000_000)[:2]
    return got


SEQLENS = [129, 1, -3, 1000, 0, 600, 2**31 - 1, -2**31, 128, 257]


@pytest.mark.parametrize("causal,gqa,sq,splits,hkv", [
    (True, 4, 3, 3, 2),  # P = 4: one m block
    (True, 4, 40, 5, 1),  # two m blocks (32 positions per tile), more splits than blocks
    (False, 4, 1, 1, 2),  # one split
    (True, 3, 130, 2, 2),  # P = 1, 3 head groups per kv head, two m blocks
    (False, 8, 17, 4, 1),
])
def test_sm90_ptx_decode_equals_the_python_rules(causal, gqa, sq, splits, hkv):
    cfg = KernelConfig(arch="sm_90a", kvcache=True, page_size=16, causal=causal, gqa_ratio=gqa)
    ptx, man = built(**{k: getattr(cfg, k) for k in ("arch", "kvcache", "page_size", "causal", "gqa_ratio")})
    cap = 600
    nmb = -(-sq // cfg.seq_q_per_tile)
    want = _expected(cfg, SEQLENS, cap, sq, hkv, splits)
    got = _run_decode(_decode_kernel(ptx, man), SEQLENS, cap, sq, hkv, splits, nmb, cfg.head_groups)
    assert len(want) == len(SEQLENS) * hkv * cfg.head_groups * nmb * splits
    for t, row in enumerate(want):
        assert tuple(int(x) for x in got[t]) == row, f"task {t}: PTX {tuple(got[t])}, schedule {row}"
    assert not got[len(want):].any()  # nothing past num_tasks


def test_sm100_ptx_decode_equals_the_python_rules():
    ptx, man = sm100_kvcache_or_skip(page_size=16, causal=True, gqa_ratio=4)
    at = ptx.find("// sched: kvcache")
    section = ptx[at:ptx.find("// sched: end", at)] if at >= 0 else ""
    if not all(r in section for r in ("%mb,", "%n,", "%nunm,")):
        pytest.skip("the sm_100a decode has its own interface (m units of two tiles): its lowering's tests "
                    "(tests/test_kvcache_sm100.py) run it against fa4gen.spec.schedule")
    cfg = KernelConfig(arch="sm_100a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    want = _expected(cfg, SEQLENS, 600, 40, 1, 3)
    got = _run_decode(_decode_kernel(ptx, man), SEQLENS, 600, 40, 1, 3, -(-40 // cfg.seq_q_per_tile))
    assert [tuple(int(x) for x in r) for r in got[:len(want)]] == want


def test_a_mutated_decode_fails_the_comparison():
    """The comparison can fail: the capacity clamp of cache_seqlens dropped."""
    cfg = KernelConfig(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    good = _decode_kernel(ptx, man)
    bad = good.replace("    min.u32 %skv, %skv, %cap;\n", "", 1)
    assert bad != good
    got = _run_decode(bad, SEQLENS, 600, 3, 1, 3, 1)
    want = _expected(cfg, SEQLENS, 600, 3, 1, 3)
    assert [tuple(int(x) for x in r) for r in got[:len(want)]] != want


# ---- modules of two entries -------------------------------------------------------------------------
def test_parse_selects_one_entry_of_a_kvcache_module():
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    with pytest.raises(PtxSyntaxError, match="fa4_fwd, fa4_combine"):
        parse(ptx)  # two entries: the caller must say which
    fwd, comb = parse(ptx, entry="fa4_fwd"), parse(ptx, entry="fa4_combine")
    assert fwd.entry == "fa4_fwd" and comb.entry == "fa4_combine" and comb.maxntid == 128
    assert fwd.lines[1] < comb.lines[0] and not set(comb.labels) & set(fwd.labels)
    assert [p.name for p in comb.params] == man["kvcache"]["combine"]["params"]
    with pytest.raises(PtxSyntaxError, match="no .entry nope"):
        parse(ptx, entry="nope")
    assert list(parse_for_manifest(ptx, man)) == ["fa4_fwd", "fa4_combine"]


def _combine_at(ptx):
    return ptx.index(".visible .entry fa4_combine(")


def test_parse_for_manifest_holds_the_file_to_the_manifest_entries():
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=0, causal=False, gqa_ratio=4)
    extra = ptx + "\n.visible .entry stray(\n)\n{\n    ret;\n}\n"
    with pytest.raises(PtxSyntaxError, match="does not declare: stray"):
        parse_for_manifest(extra, man)
    with pytest.raises(PtxSyntaxError, match="no .entry fa4_combine"):
        parse_for_manifest(ptx[:_combine_at(ptx)], man)
    twice = ptx + ptx[_combine_at(ptx):]
    with pytest.raises(PtxSyntaxError, match="second .entry named fa4_combine"):
        parse_for_manifest(twice, man)
    dense = dict(man)
    dense.pop("kvcache")
    with pytest.raises(PtxSyntaxError, match="does not declare: fa4_combine"):
        parse_for_manifest(ptx, dense)


@pytest.mark.parametrize("page_size", [16, 0])
def test_check_passes_and_says_what_it_did_not_check(page_size):
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=page_size, causal=True, gqa_ratio=4)
    rep = check_ptx(ptx, man)
    assert rep.ok, rep.summary()
    assert any("fa4_combine: not checked against an IR" in n for n in rep.notes), rep.summary()
    # the roles it did check: the producer and each instance of the consumers' (replicated) program
    assert all(rep.events.get(f"consumer{i}", 0) > 20 for i in range(2)) and rep.events.get("producer", 0) > 10, \
        rep.summary()


@pytest.mark.parametrize("edit,what", [
    (lambda t, a: t[:a] + t[a:].replace(".maxntid 128, 1, 1", ".maxntid 256, 1, 1", 1), ".maxntid 256"),
    (lambda t, a: t[:a] + t[a:].replace("    ld.param.u32 %crows, [rows];\n",
                                        "    ld.param.u32 %crows, [rows];\n    bar.sync 0;\n", 1), "bar.sync 0"),
    (lambda t, a: t[:a] + t[a:].replace(".param .u32 num_heads_q", ".param .u32 heads_q", 1)
     .replace("[num_heads_q]", "[heads_q]"), "parameters"),
    (lambda t, a: t[:a] + t[a:].replace("st.global.f32 [%cad], %clse;", "st.shared.f32 [%cad], %clse;", 1),
     "st.shared"),
    (lambda t, a: t + "\n.visible .entry stray(\n)\n{\n    ret;\n}\n", "stray"),
    (lambda t, a: t[:a], "no .entry fa4_combine"),
])
def test_check_flags_a_broken_combine_entry(edit, what):
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    bad = edit(ptx, _combine_at(ptx))
    assert bad != ptx
    rep = check_ptx(bad, man)
    assert not rep.ok and what in rep.summary(), rep.summary()


def test_check_flags_a_kvcache_config_without_its_manifest_record():
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    man = dict(man)
    man.pop("kvcache")
    rep = check_ptx(ptx[:_combine_at(ptx)], man)
    assert not rep.ok and "without the manifest's \"kvcache\" record" in rep.summary()


# ---- the emulation ------------------------------------------------------------------------------------
def test_default_batches_cover_the_rules():
    _, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    shapes = harness.default_shapes(man)
    assert all(isinstance(s, harness.KvShape) for s in shapes)
    multi, single = shapes[0], shapes[1]
    assert multi.num_splits == 3 and single.num_splits == 1 and single.sq == 1 and multi.sq in (3, 4)
    lens = multi.k_lens(16)
    cap = multi.cap(16)
    assert 0 in lens and cap in lens and min(multi.seqlens) < 0 and max(multi.seqlens) > cap  # clamps both ways
    assert any(0 < n < multi.sq for n in lens)  # causal rows that see no key beside rows that do
    assert any(n % 128 for n in lens if n) and lens[-1] == max(lens) and cap % 128
    blocks = [-(-n // 128) for n in lens]
    assert any(b % multi.num_splits and b > multi.num_splits for b in blocks)  # uneven splits
    assert shapes[2].sq * 4 > 64  # the second consumer warpgroup has real rows
    # the API's default decode launch: one split (the kernel's direct O / LSE store) and no LSE (lse_ptr = 0)
    assert shapes[3].num_splits == 1 and not shapes[3].with_lse and shapes[1].with_lse
    inp = kvcache.make_kv_inputs(multi, "bf16", 128, 16, seed=0)
    used = {int(p) for b in range(multi.b) for p in inp.page_table[b * inp.stride: b * inp.stride + -(-lens[b] // 16)]}
    assert inp.stride > inp.max_pages and inp.num_pages > len(used) + 1  # row padding, unused pages
    first = inp.page_table[:-(-lens[0] // 16)]
    assert (np.diff(first[first < inp.num_pages]) != 1).any()  # scattered, not consecutive
    assert (inp.page_table >= inp.num_pages).any() and (inp.page_table < 0).any()  # out-of-range entries
    assert any(p >= inp.num_pages for p in used)  # one used entry the clamp sends to the last page
    k, v = inp.gather(0)
    assert k.shape == (lens[0], multi.hkv, 128)



def test_default_batches_rescale_in_both_row_groups():
    """Each row group's O rescale (the correction of a row whose maximum rose by more than the
    threshold) runs in the default batches, softcap and window or not: the rescale row (each
    sequence's last position, make_inputs) reaches block 0 after another block of its split and its
    (softcapped) maximum rises above the threshold with margin on every seed tried: the second batch
    in the first row group, the third batch's first split in the second (sm_90a's second consumer
    warpgroup, sm_100a's second Q tile). The emulation proves the blocks ran on its seeds
    (tests/test_scoremods_sm100.py, tests/test_ptxemu.py assert_every_block_ran); this holds the margin."""
    import math
    from fa4gen.evidence import reference
    from fa4gen.evidence.ptxemu.cases import shape_mods
    from fa4gen.spec.plan import window_sides
    threshold = KernelConfig(arch="sm_90a").rescale_threshold * math.log(2)  # natural-log units
    for g, tiles_per_task in [(1, 1), (1, 2), (4, 1), (4, 2)]:
        second = 128 if tiles_per_task == 2 else 64  # the second row group's first row
        unit = 128 // g * tiles_per_task  # a task's query positions
        cfgs = [KernelConfig(arch="sm_90a", causal=True, gqa_ratio=g, kvcache=True, softcap=True, window=w).to_dict()
                for w in (False, True)]
        shapes = [harness.default_shapes({"config": c, "grid": {"tiles_per_task": tiles_per_task},
                                          "gqa": {"pack": g}, "kvcache": {"page_size": 0}}) for c in cfgs]
        for bi, group in ((1, 0), (2, 1)):
            if bi == 1 and tiles_per_task == 2:
                continue  # Sq = 1: the same batch as sm_90a's
            sh = shapes[0][bi]
            assert ((sh.sq - 1) * g >= second) == bool(group)  # the last position is in that group
            k_len = sh.k_lens(0)[0]
            rises = {}
            for seed in range(4):
                inp = kvcache.make_kv_inputs(sh, "bf16", 128, 0, seed, huge=True)
                k = inp.gather(0)[0][:, np.arange(sh.hq) // g]
                raw = np.einsum("khd,hd->hk", k, inp.q[0, -1]) / math.sqrt(128)
                for cfg, shw in zip(cfgs, (shapes[0][bi], shapes[1][bi])):
                    mods = shape_mods(cfg, shw, seed)
                    info = BlockInfo.of(0, unit, sh.sq, k_len, True, 0, sh.num_splits,
                                        window=window_sides(mods.get("window"), True))
                    assert info.lo == 0 and info.n >= 2  # block 0 runs last, after another
                    seen = reference.visible_keys(sh.sq, k_len, True, mods.get("window"))[-1]
                    s = np.where(seen, mods["softcap"] * np.tanh(raw / mods["softcap"]), -np.inf)
                    before = np.max([s[:, b * 128:(b + 1) * 128].max(axis=1) for b in info.blocks() if b], axis=0)
                    rises.setdefault(cfg["window"], []).append(float((s[:, :128].max(axis=1) - before).max()))
            assert min(min(r) for r in rises.values()) > threshold + 1.0, (g, tiles_per_task, group, rises)

# (the corpus variants, d128 causal GQA 4 pages of 16, d128 contiguous and d64 pages of 256, are
# emulated by tests/test_ptxemu.py test_unmutated_kernels_of_the_corpus_pass: these are others)
@pytest.mark.parametrize("cfg", [
    dict(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=8, dtype="bf16", kvcache=True, page_size=128),
    dict(arch="sm_90a", head_dim=64, causal=False, gqa_ratio=2, dtype="fp16", kvcache=True, page_size=0),
], ids=lambda c: KernelConfig(**c).name)
def test_sm90_kvcache_emulates(cfg):
    ptx, man = built(**cfg)
    rep = harness.emulate_file("k.ptx", ptx_text=ptx, manifest=man, seeds=1)
    assert rep.ok, rep.summary()
    assert [(r.shape.num_splits, r.shape.with_lse) for r in rep.runs] == [(3, True), (1, True), (2, False), (1, False)]


def test_sm100_kvcache_build_is_the_review_variant_emulated_and_checked_in_test_ptxemu():
    """The sm_100a KV-cache module (D 128, causal, GQA 4, pages of 64) is generated/'s review variant,
    which tests/test_ptxemu.py emulates (two seeds, every default decode batch) and checks: this build
    is that file byte for byte, so its runs are shared rather than repeated here."""
    from pathlib import Path

    ptx, man = sm100_kvcache_or_skip(page_size=64, causal=True, gqa_ratio=4)
    golden = Path(__file__).resolve().parent.parent / "generated" / f"{man['name']}.ptx"
    assert golden.is_file() and golden.read_text() == ptx


def test_unwritten_partials_are_reported():
    """An LSE partial that fa4_fwd never writes is a NaN the combine's max would drop silently: the
    harness reports it (here: the rows of the second half of each quad skip their LSE store)."""
    ptx, man = built(arch="sm_90a", kvcache=True, page_size=16, causal=True, gqa_ratio=4)
    # the second row's store of the split's LSE partial (`ld.param.u64 %db, [lse_partial]` .. its
    # predicated st.global.f32 of %lsev1), dropped
    bad, n = re.subn(r"(ld\.param\.u64 (%\w+), \[lse_partial\];\n(?:    (?!st\.)[^\n]*\n)*?)"
                     r"    @%\w+ st\.global\.f32 \[\2\], %lsev1;\n", r"\1", ptx, count=1)
    assert n == 1 and bad != ptx
    r = harness.run_once(bad, man, harness.default_shapes(man)[0], 0)
    assert not r.ok and r.finding == "PARTIALS" and "lse_partial never written" in r.report.replace(" bytes of", ""), \
        r.report


def test_kvshape_parse_and_errors():
    s = harness.KvShape.parse("129,1,-3,1000;3;4,1;3;600")
    assert s.seqlens == (129, 1, -3, 1000) and (s.sq, s.hq, s.hkv, s.num_splits, s.capacity) == (3, 4, 1, 3, 600)
    assert s.k_lens(0) == (129, 1, 0, 600) and s.k_lens(256) == (129, 1, 0, 768)
    assert harness.KvShape.parse("7;1;4,1;1").capacity == 7 and harness.KvShape.parse("7;1;4,1;1").with_lse
    assert not harness.KvShape.parse("7;1;4,1;2;9;nolse").with_lse
    for bad in ("1,2;3;4,1", "1;0;4,1;1", "1;1;4,1;0", "x;1;1,1;1", f"{2**31};1;1,1;1"):
        with pytest.raises(kvcache.KvUsageError):
            harness.KvShape.parse(bad)


def test_kvcache_mutations_are_in_the_corpus():
    names = {m.name for m in PTX_MUTATIONS if m.config.get("kvcache")}
    for needed in ("kv_page_index_clamp", "kv_page_clamp", "kv_page_table_row", "kv_split_lo", "kv_split_floor",
                   "kv_partial_row", "kv_lse_partial", "kv_single_split_branch", "combine_weight", "combine_max",
                   "combine_store_offset", "kv_seqlen_clamp", "combine_split_step", "combine_weight_lane",
                   "combine_first_chunk_lse"):
        assert needed in names


# ---- CLI -------------------------------------------------------------------------------------------------
def test_cli_builds_and_emulates_a_kvcache_variant(tmp_path):
    from click.testing import CliRunner

    from fa4gen.cli import main

    run = CliRunner().invoke
    r = run(main, ["build", "--arch", "sm_90a", "--kvcache", "--page-size", "32", "--gqa", "4", "--head-dim", "64",
                   "--out", str(tmp_path), "--emit", "ptx"])
    assert r.exit_code == 0, r.output
    ptx = tmp_path / "fa4_sm90a_d64_bf16_noncausal_gqa4_kvcache_p32.ptx"
    assert ptx.exists() and ptx.read_text().count(".visible .entry") == 2
    r = run(main, ["emulate", str(ptx), "--seeds", "1", "--quiet", "--kv", "40,0,300;2;4,1;2;320"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    r = run(main, ["check", str(ptx)])
    assert r.exit_code == 0 and "fa4_combine: not checked against an IR" in r.output, r.output
    r = run(main, ["emulate", str(ptx), "--shape", "1,20,40,4,1"])
    assert r.exit_code == 2 and "--kv" in r.output
    r = run(main, ["emulate", str(ptx), "--kv", "1;1;4"])
    assert r.exit_code == 2 and "LENS;SQ" in r.output
    r = run(main, ["build", "--arch", "sm_90a", "--page-size", "16", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "page_size" in r.output
    for cmd in ("build", "verify"):
        r = run(main, [cmd, "--help"])
        assert "--kvcache" in r.output and "--page-size" in r.output and "fa4_combine" in r.output
    assert "--kv " in run(main, ["emulate", "--help"]).output


def test_review_configs_include_the_kvcache_variants():
    names = {c.name for c in codegen.KVCACHE_REVIEW_CONFIGS}
    assert names == {"fa4_sm90a_d128_bf16_causal_gqa4_kvcache_p64", "fa4_sm100a_d128_bf16_causal_gqa4_kvcache_p64"}
    assert set(codegen.KVCACHE_REVIEW_CONFIGS) <= set(codegen.GENERATED_MATRIX)
    for c in codegen.KVCACHE_REVIEW_CONFIGS:
        assert c.kvcache and c.page_size == 64 and c.causal and c.gqa_ratio == 4 and c.head_dim == 128


# ---- fa4_combine: one entry per (head_dim_v, sinks, dtype), every one assembled without a spill ------
def _combine_alone(ptx: str) -> str:
    """The module's header and its fa4_combine entry alone (ptxas compiles each entry apart)."""
    head = "".join(line + "\n" for line in ptx.splitlines() if line.startswith((".version", ".target", ".address_size")))
    return head + ptx[ptx.index(".visible .entry fa4_combine("):]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_combine_variant_assembles_without_spills(arch):
    """ptxas spilled fa4_combine on some variants of its unrolled merge (8 live predicates; 16 splits
    of D 64 a round; an LSE kept across pass 1): the build refuses spills, so each distinct combine
    (it depends on DV, sinks and the dtype only) is assembled here. About 2 s per arch."""
    from fa4gen import codegen
    from fa4gen.assemble.assemble import AssemblePolicy, assemble, available_backends

    if not available_backends():
        pytest.skip("no assembler (ptxas or nvJitLink)")
    seen = []
    for hd in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
        for dtype in ("bf16", "fp16"):
            for sinks in (False, True):
                cfg = KernelConfig(arch=arch, head_dim=hd[0], head_dim_v=hd[1], dtype=dtype, sinks=sinks, kvcache=True)
                key = (hd[1], dtype, sinks)
                if key in seen:
                    continue
                seen.append(key)
                ptx = codegen.build(cfg, emit=("ptx",), verify=False).ptx
                res = assemble(_combine_alone(ptx), arch, name=f"combine_{hd[1]}_{dtype}_{int(sinks)}",
                               policy=AssemblePolicy(allow_spills=True))  # reported, judged below
                (comb,) = [r for r in res.resources if r.name == "fa4_combine"]
                assert comb.spills == 0 and comb.stack_frame == 0, (key, comb)
    assert len(seen) == 16
