"""`fa4gen draw` (issue 28, item 4): the emulator's trace recorder, the memory map's geometry and the
pictures. The trace is one small emulated CTA of a golden sm_100a kernel (with the same run untraced
beside it); the maps come from golden manifests; the SVGs are read as text."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fa4gen.cli import main
from fa4gen.evidence import draw, reference
from fa4gen.evidence.ptxemu import harness
from fa4gen.evidence.ptxemu.cases import make_inputs, manifest_smem_layout, role_of
from fa4gen.evidence.ptxemu.trace import EXIT, ISSUE, WAIT
from fa4gen.spec.config import KernelConfig

GEN = Path(__file__).resolve().parent.parent / "generated"
SM100 = GEN / "fa4_sm100a_d64_bf16_noncausal_gqa1.ptx"
SM100_D128 = GEN / "fa4_sm100a_d128_bf16_noncausal_gqa1.json"
SM90 = GEN / "fa4_sm90a_d128_bf16_causal_gqa1.json"
INSTRUCTION_WAITS = ("tcgen05.wait::ld", "tcgen05.wait::st", "setmaxnreg.inc", "cp.async.bulk.wait_group",
                     "wgmma.wait_group")


def _man(p: Path) -> dict:
    return json.loads(p.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def traced():
    """(manifest, traced RunResult, events, the same run untraced)."""
    man, text = _man(SM100), SM100.read_text()
    res, rec = draw.trace_run(text, man)
    plain = harness.run_once(text, man, draw.default_trace_shape(man), 0, ctas=1)
    return man, res, rec.events, plain


# ---- the recorder -------------------------------------------------------------------------------
def test_the_default_case_is_one_cta_of_two_kv_blocks(traced):
    man, res, events, _ = traced
    assert res.ok and {e.cta for e in events} == {0}
    shape = draw.default_trace_shape(man)
    assert (shape.b, shape.hkv, shape.skv) == (1, 1, 256)
    # both of a task's Q tiles (two softmax warpgroups) and two K/V blocks: K and V of each block loaded
    loads = [e for e in events if e.kind == "TMA load"]
    assert sum(e.detail.startswith("tmap_k") for e in loads) == 2 and sum(e.detail.startswith("tmap_v") for e in loads) == 2
    # and the run's inputs (the seed's, make_inputs) rescale O: the kernel's reference model counts them
    cfg = KernelConfig.from_dict(man["config"])
    stats = {}
    reference.fa4_forward(*make_inputs(shape, cfg.dtype, cfg.head_dim, 0), cfg, stats=stats)
    assert stats["blocks"] == 4 and stats["warp_rescales"] > 0, stats


def test_recorder_off_is_the_same_run(traced):
    """Recording changes nothing the run does: same outputs, bit for bit, same instruction count."""
    _, res, _, plain = traced
    assert plain.ok and plain.warp_instructions == res.warp_instructions
    assert np.array_equal(plain.o, res.o, equal_nan=True) and np.array_equal(plain.lse, res.lse, equal_nan=True)
    assert harness.run_once.__kwdefaults__["trace"] is None  # off unless asked for


def test_every_wait_names_a_barrier_the_manifest_declares(traced):
    man, _, events, _ = traced
    slots = {b["name"]: b["slots"] for b in man["barriers"] if b["kind"] != "named"}
    named = draw.named_barrier_names(man)
    waits = [e for e in events if e.kind == WAIT]
    on_mbarriers = [e for e in waits if e.barrier is not None]
    assert len(on_mbarriers) > 10
    for e in waits:
        if e.barrier is not None:
            name, slot = e.detail[:-1].split("[")
            assert name in slots and int(slot) < slots[name], e
        elif e.detail.startswith("bar.sync "):
            assert int(e.detail.split()[1]) in named, e
        else:
            assert e.detail.startswith(INSTRUCTION_WAITS), e
    # the warps wait on a load's barrier, the tensor core's and the softmax's (which ones: the seed's timing)
    fams = {e.detail.split("[")[0] for e in on_mbarriers}
    kinds = {b["kind"] for b in man["barriers"] if b["name"] in fams}
    assert kinds >= {"tma", "tcgen05", "mbarrier"}, fams


def test_tma_loads_precede_the_waits_they_satisfy(traced):
    """Every wait on a TMA barrier ends after a TMA load (issued by another role, the loader) that
    completes that barrier slot has landed; every TMA barrier wait has one."""
    man, _, events, _ = traced
    tma = {b["name"] for b in man["barriers"] if b["kind"] == "tma"}
    loads = [e for e in events if e.kind == "TMA load"]
    assert {role_of(man, e.warp) for e in loads} == {"load"}
    waits = [e for e in events if e.kind == WAIT and e.detail.split("[")[0] in tma]
    assert waits
    for w in waits:
        feeding = [ld for ld in loads if ld.barrier == w.barrier and ld.end <= w.end]
        assert feeding, w
        assert all(ld.time < ld.end for ld in feeding) and role_of(man, w.warp) != "load"
        assert feeding[-1].detail.endswith(w.detail)


def test_issue_bursts_waits_and_exits_are_consistent(traced):
    man, res, events, _ = traced
    warps = {w for r in man["roles"] for w in r["warps"]}
    assert {e.warp for e in events if e.kind == EXIT} == warps
    issues = sorted((e for e in events if e.kind == ISSUE), key=lambda e: e.time)
    assert {e.warp for e in issues} == warps
    # one warp issues at a time (the machine's bursts): the CTA's bursts never overlap, and a warp waits
    # only between its bursts
    assert all(a.end <= b.time for a, b in zip(issues, issues[1:]))
    assert sum(e.count for e in issues) <= res.warp_instructions  # the run counts whole scheduling quanta
    for w in warps:
        mine = sorted((e for e in events if e.warp == w and e.kind in (ISSUE, WAIT)), key=lambda e: (e.time, e.end))
        assert all(a.end <= b.time for a, b in zip(mine, mine[1:])), w


# ---- the timeline ---------------------------------------------------------------------------------
def test_timeline_lanes_are_the_manifest_roles_then_the_units(traced):
    man, _, events, _ = traced
    tl = draw.timeline(man, events)
    roles = [(r["role"], len(r["warps"]), r["warps"]) for r in man["roles"]]
    assert tl.bands[: len(roles)] == roles
    assert [b[0] for b in tl.bands[len(roles):]] == ["TMA", "tensor core", "TMEM ld/st"]
    rows = {b[0]: b[1] for b in tl.bands}
    for bar in tl.bars:
        assert 0 <= bar.row < rows[bar.band], bar
        if bar.kind in (ISSUE, WAIT, EXIT):
            assert bar.band == role_of(man, bar.warp)
    labels = {b.label for b in tl.bars if b.kind == WAIT}
    assert not any(lb.startswith("bar.sync") for lb in labels)  # named barriers by the manifest's names
    assert any(lb.startswith("stats[") for lb in labels)


def test_timeline_svg_names_roles_and_barriers(traced, tmp_path):
    man, _, events, _ = traced
    out = draw.render(draw.timeline(man, events), tmp_path / "t.svg")
    svg = out.read_text()
    for word in ("softmax0", "correction", "mma", "load", "kv_full", "tcgen05.mma"):
        assert word in svg, word


# ---- the memory map -------------------------------------------------------------------------------
def test_memory_map_rects_are_the_manifest_regions():
    man = _man(SM100_D128)
    mm = draw.memory_map(man)
    assert [(r.name, [r.x0, r.x1], r.alias_of, r.dtype) for r in mm.of("TMEM")] == \
        [(t["region"], t["cols"], t["alias_of"], t["dtype"]) for t in man["tmem_map"]]
    assert all((r.y0, r.y1) == (0, 128) for r in mm.of("TMEM")) and mm.tmem_cols == man["tmem_alloc_cols"]
    p0 = next(r for r in mm.of("TMEM") if r.name == "P0")
    s0 = next(r for r in mm.of("TMEM") if r.name == "S0")
    assert p0.kind == "alias" and s0.x0 <= p0.x0 < p0.x1 <= s0.x1
    assert mm.lane_owners[0] == ["softmax0 w0", "softmax1 w4", "correction w8"]
    assert mm.lane_owners[96] == ["softmax0 w3", "softmax1 w7", "correction w11"]
    lay = man["smem_layout"]
    for name, reg in lay["regions"].items():
        got = [(r.x0, r.x1) for r in mm.of("SMEM", "region") if r.name == name]
        want = [(reg["offset"] + s * reg["bytes_per_slot"], reg["offset"] + (s + 1) * reg["bytes_per_slot"])
                for s in range(reg["slots"])]
        assert got == want, name
    assert len([r for r in mm.of("SMEM", "region") if r.name == "KV"]) == man["config"]["kv_stages"]
    for b in man["barriers"]:
        got = [r.x0 for r in mm.of("SMEM", "barrier") if r.name == b["name"]]
        assert got == ([lay["barriers"][b["name"]] + 8 * s for s in range(b["slots"])] if b["kind"] != "named" else [])
    _tiles(mm, man["dynamic_smem_bytes"])


def _tiles(mm, total):
    """The SMEM rectangles never overlap and end at the bytes the launch requests."""
    spans = sorted((r.x0, r.x1) for r in mm.of("SMEM"))
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_sm90_memory_map_has_no_tmem_and_its_layout_from_the_pipeline():
    man = _man(SM90)
    # the sm_90a manifest publishes the layout the pipeline derives (the one drawn)
    from fa4gen.evidence.ptxemu.cases import _layout_of_config
    assert man["smem_layout"] == _layout_of_config(json.dumps(man["config"], sort_keys=True))
    mm = draw.memory_map(man)
    assert mm.tmem_cols == 0 and not mm.of("TMEM")
    regions = [(r.name, r.x1 - r.x0) for r in mm.of("SMEM", "region")]
    assert regions == [(m["region"], m["bytes_per_slot"]) for m in man["smem_map"] for _ in range(m["slots"])]
    assert sorted({r.name for r in mm.of("SMEM", "barrier")}) == sorted(
        b["name"] for b in man["barriers"] if b["kind"] != "named")
    assert manifest_smem_layout(man)["barriers"]  # the emulator names sm_90a mbarriers from the same layout
    assert "k_full[1]" in harness.barrier_names(man).values()
    _tiles(mm, man["dynamic_smem_bytes"])


# ---- the command line -----------------------------------------------------------------------------
def test_cli_draw_memory_writes_an_svg_with_the_region_names(tmp_path):
    out = tmp_path / "m.svg"
    r = CliRunner().invoke(main, ["draw", "memory", str(SM100_D128), "--out", str(out)])
    assert r.exit_code == 0, r.output
    svg = out.read_text()
    for word in ("S0", "S1", "O0", "O1", "P0", "aliases S0", "Q[1]", "KV[2]", "O_smem[0]", "sScale[1]",
                 "kv_full[2]", "TMEM address"):
        assert word in svg, word


def test_cli_draw_refuses_a_file_with_build_options_and_an_unknown_suffix(tmp_path):
    r = CliRunner().invoke(main, ["draw", "memory", str(SM100_D128), "--gqa", "4", "--out", str(tmp_path / "m.svg")])
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(main, ["draw", "memory", str(SM100_D128), "--out", str(tmp_path / "m.pdf")])
    assert r.exit_code == 2 and ".svg" in r.stderr


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = CliRunner().invoke(main, ["draw", "memory", str(SM100_D128), "--out", str(tmp_path / "m.svg")])
    assert r.exit_code == 2 and "fa4gen[draw]" in r.stderr and not (tmp_path / "m.svg").exists()


def test_the_readme_pictures_are_committed_small_and_current():
    """docs/img holds the README's two pictures (< 200 KB each), drawn from the kernel as it is now:
    every rectangle of the golden sm_100a D 128 kernel's memory map is labelled in the committed map."""
    root = SM100_D128.parent.parent
    readme = (root / "README.md").read_text()
    mm = draw.memory_map(_man(SM100_D128))
    for name in ("memory_sm100a_d128.svg", "timeline_sm100a_d128.svg"):
        p = root / "docs" / "img" / name
        assert f"docs/img/{name}" in readme and 0 < p.stat().st_size < 200_000
    svg = (root / "docs" / "img" / "memory_sm100a_d128.svg").read_text()
    assert mm.name in svg
    for r in mm.rects:
        if r.kind in ("region", "alias", "barrier"):
            assert r.label in svg, r.label
            assert f"@{r.x0}" in svg or r.space == "TMEM", r
