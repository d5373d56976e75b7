"""scripts/head_dim_budgets.py, the tables of docs/HEAD_DIMS.md: it runs, and its rows for the pairs
fa4gen generates today are the kernels that build today (the checked-in generated/ manifests)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fa4gen.spec.config import HEAD_DIM_PAIRS, HEAD_DIM_PLANNED, KernelConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def budgets():
    spec = importlib.util.spec_from_file_location("head_dim_budgets", ROOT / "scripts" / "head_dim_budgets.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows(budgets):
    return {arch: budgets.budget_rows(arch) for arch in ("sm_100a", "sm_90a")}


def test_the_script_prints_every_table(budgets, capsys):
    assert budgets.main() == 0
    out = capsys.readouterr().out
    for head in ("## sm_100a", "## sm_90a", "## Throughput model"):
        assert head in out
    for d, dv in HEAD_DIM_PLANNED:
        assert f"| {d}, {dv} |" in out
    doc = (ROOT / "docs" / "HEAD_DIMS.md").read_text()
    stale = [line for line in out.splitlines() if line.startswith("| ") and line not in doc]
    assert not stale, f"docs/HEAD_DIMS.md's tables are not the script's output: {stale[:3]}"


def _golden(arch: str, d: int):
    """The checked-in manifests of dense (not varlen, not KV-cache) kernels of arch and head_dim d."""
    for p in sorted((ROOT / "generated").glob(f"fa4_{arch.replace('_', '')}_d{d}_*.json")):
        m = json.loads(p.read_text())
        if not (m["config"]["varlen"] or m["config"]["kvcache"]):
            yield m


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_rows_of_todays_pairs_are_the_kernels_that_build(arch, rows, budgets):
    seen = 0
    for d, dv in HEAD_DIM_PAIRS[arch]:
        pair_rows = [r for r in rows[arch] if (r.d, r.dv) == (d, dv)]
        ir = [r for r in pair_rows if r.design.startswith("IR")]
        assert len(ir) == 1 and ir[0].fits and pair_rows[0] is ir[0], pair_rows
        # no options for built pairs, but the K/V block sizes weighed for one whose blocks are not 128
        # keys, and the designs weighed for one sm_100a builds with one Q tile per task
        cfg = KernelConfig(arch=arch, head_dim=d, head_dim_v=dv)
        assert (len(pair_rows) == 1 or (cfg.block_n != 128 and all("-key K/V blocks" in r.design for r in pair_rows[1:]))
                or (arch == "sm_100a" and cfg.tiles_per_task == 1)), pair_rows
        for m in _golden(arch, d):
            if arch == "sm_90a" and f"{m['config']['block_m']}-row" not in ir[0].design:
                continue  # the table's sm_90a row is the tile fa4gen.attention chooses
            seen += 1
            # a dynamically dealt kernel (plan.dynamic_tasks: the sm_90a causal goldens) adds its task ring
            # to the pair's design: region T and a task_full / task_empty mbarrier (8 bytes) per slot
            ring = [s for s in m["smem_map"] if s["region"] == "T"]
            assert bool(ring) == ("task_counter" in m["params"]), m["name"]
            ring_bytes = sum(s["slots"] * (s["bytes_per_slot"] + 2 * 8) for s in ring)
            assert ir[0].smem + ring_bytes == m["dynamic_smem_bytes"], m["name"]
            assert ir[0].regions == ", ".join(f"{s['region']} {s['slots']}x{budgets._bytes(s['bytes_per_slot'])}"
                                              for s in m["smem_map"] if s["region"] != "T"), m["name"]
            if arch == "sm_100a":
                tmem = " ".join(f"{t['region']}[{t['cols'][0]},{t['cols'][1]})" for t in m["tmem_map"]
                                if not t["alias_of"])
                assert ir[0].tmem == tmem, m["name"]
    assert seen >= 2  # both head dims of sm_100a; sm_90a's D = 128 and the 192-row D = 64


def test_planned_pairs_each_have_a_design_that_fits_and_d256_breaks_the_two_tile_tmem_map(rows):
    for arch in rows:
        for pair in HEAD_DIM_PLANNED:
            assert any(r.fits for r in rows[arch] if (r.d, r.dv) == pair), (arch, pair)
    d256 = [r for r in rows["sm_100a"] if (r.d, r.dv) == (256, 256)]
    # the kernel sm_100a builds: one Q tile per task, S0 and O0 in TMEM, O from the registers
    assert d256[0].design == "IR: 1 Q tile/CTA, one S, 2 K/V stages, O from registers" and d256[0].fits
    assert d256[0].tmem == "S0[0,128) O0[256,512)"
    two = next(r for r in d256 if r.design.startswith("2 Q tiles/CTA"))
    codes = " ".join(two.problems)
    assert "[TMEM_BUDGET] O1" in codes and "[TMEM_OVERLAP] O0/O1" in codes
    assert [r.fits for r in d256 if r.design.startswith(("1 Q tile/CTA, S double", "cta_group::2"))] == [True, True]


def test_sm90_register_floor_and_todays_headroom(budgets):
    # 64-row warpgroup fragments: O dv/2, S block_n/2, P block_n/4 registers per thread
    assert budgets.sm90_reg_floor(128, 128) == 64 + 64 + 32
    assert budgets.sm90_headroom_today() == 160 - budgets.sm90_reg_floor(64, 128)  # D = 64's 192-row tile


def test_sm90_d256_row_is_the_64_key_kernel_and_128_keys_do_not_fit(rows, budgets):
    """The sm_90a D = 256 IR row is the generated kernel's layout (64-key blocks, 1 Q slot, 2 stages,
    O from the registers, floor 128 + 32 + 16 = 176 of 240); 128-key blocks exceed SMEM."""
    d256 = [r for r in rows["sm_90a"] if (r.d, r.dv) == (256, 256)]
    assert d256[0].design.startswith("IR (128-row tile, 64-key K/V blocks, O from registers)") and d256[0].fits
    assert d256[0].smem == 197720 and d256[0].regs.startswith(f"{budgets.sm90_reg_floor(256, 64)} / 240")
    assert budgets.sm90_reg_floor(256, 64) == 176
    k128 = next(r for r in d256 if r.design.startswith("128-key"))
    assert not k128.fits and any("SMEM_BUDGET" in p for p in k128.problems)
