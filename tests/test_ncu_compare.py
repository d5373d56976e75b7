"""bench/ncu_compare.py on small synthetic ncu exports (CPU): the warp-state ratios and pipes from the
raw page, the per-opcode stall samples from the SASS source page, and clear errors on other files."""
from pathlib import Path

from bench import ncu_compare as nc


def _raw(path: Path, wait: float, cycles: int) -> Path:
    hdr = ["ID", "Kernel Name", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
           "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "sm__cycles_elapsed.max",
           "smsp__inst_executed.sum"]
    units = ["", "", "", "", "%", "cycle", "inst"]
    vals = ["0", "fa4_fwd", str(wait), "1", "62.5", f"{cycles:,}", "1,000"]
    path.write_text("\n".join(",".join(f'"{x}"' for x in row) for row in (hdr, units, vals)) + "\n")
    return path


def _sass(path: Path) -> Path:
    rows = [["Kernel Name", "fa4_fwd"],
            ["Address", "Source", "# Samples", "Instructions Executed", "stall_wait", "stall_math",
             "stall_wait (Not Issued)"],
            ["0x10", "      MUFU.EX2 R1, R1", "10", "2,000", "6", "0", "99"],
            ["0x20", "  @P0 MUFU.EX2 R2, R2", "4", "1000", "1", "0", "99"],
            ["0x30", "      FADD R3, R1, R2", "7", "3000", "5", "2", "99"]]
    path.write_text("\n".join(",".join(f'"{x}"' for x in row) for row in rows) + "\n")
    return path


def test_raw_summary_and_the_side_by_side_report(tmp_path, capsys):
    a, b = _raw(tmp_path / "a.csv", 2.1, 1_846_295), _raw(tmp_path / "b.csv", 1.5, 1_743_314)
    s = nc.raw_summary(nc.read_raw(a))
    assert s["stalls"] == {"wait": 2.1, "selected": 1.0} and s["pipes"] == {"xu": 62.5}
    assert s["totals"] == {"elapsed cycles": 1846295.0, "instructions executed": 1000.0}
    out = tmp_path / "report.txt"
    assert nc.main([str(a), str(b), "--sass", str(_sass(tmp_path / "sa.csv")), str(_sass(tmp_path / "sb.csv")),
                    "--names", "fa4gen,fa4cute", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "wait" in text and "2.100        1.500" in text and "1846295      1743314" in text
    assert out.read_text().strip() == text.strip()


def test_per_opcode_samples_strip_guards_and_modifiers(tmp_path):
    table = nc.read_sass(_sass(tmp_path / "s.csv"))
    assert set(table) == {"MUFU", "FADD"}
    assert table["MUFU"]["samples"] == 14 and table["MUFU"]["inst"] == 3000 and table["MUFU"]["stall_wait"] == 7
    assert table["FADD"]["stall_math"] == 2 and "stall_wait (Not Issued)" not in table["FADD"]


def test_wrong_files_are_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "log.txt"
    bad.write_text("==PROF== Connected to process 1\n")
    assert nc.main([str(bad)]) == 2
    assert "not an `ncu --page raw --csv` export" in capsys.readouterr().err
    good = _raw(tmp_path / "a.csv", 2.0, 1)
    assert nc.main([str(good), "--sass", str(bad)]) == 2
    assert "no per-instruction table" in capsys.readouterr().err
    assert nc.main([str(tmp_path / "missing.csv")]) == 2
