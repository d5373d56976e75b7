"""bench/sass_loop_sm90.py: finding the consumers' steady-state K/V loop in a disassembly and the
distance from the wait for S to the wait for the PV (CPU; the kernel build needs ptxas + nvdisasm)."""
import shutil

import pytest

from bench import sass_loop_sm90 as sl

# a task loop (.L_x_1) around a K/V loop (.L_x_2) whose body holds a QK (A from a descriptor) and a PV
# (A from registers), the wait for S, two exponentials, the wait for the PV; a retry loop (.L_x_3)
# without wgmma; a first-block QK outside the K/V loop
SASS = """\
.L_x_1:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
.L_x_2:
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING R2, 0x100 ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR24].tnspB, R88, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/                   FMNMX R1, R24, R25, !PT ;
        /*0060*/                   MUFU.EX2 R24, R24 ;
        /*0070*/              @P0  MUFU.EX2 R25, R25 ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0090*/                   F2FP.BF16.F32.PACK_AB R152, R25, R24 ;
        /*00a0*/              @P1  BRA `(.L_x_2) ;
.L_x_3:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR9+0x38040], R6 ;
        /*00c0*/              @!P1 BRA `(.L_x_3) ;
        /*00d0*/                   BRA `(.L_x_1) ;
"""


def test_the_steady_loop_and_the_pv_wait_gap():
    rep = sl.loop_report(SASS)
    assert rep["loop"]["first"] == "0x10" and rep["loop"]["last"] == "0xa0" and rep["loop"]["instructions"] == 10
    fam = rep["loop"]["families"]
    assert fam["HGMMA"] == 2 and fam["MUFU"] == 2 and fam["WARPGROUP"] == 2 and fam["F2FP"] == 1
    assert rep["pv_wait_gap"] == {"instructions": 4, "mufu_ex2": 2}


def test_the_loop_in_program_order(capsys, tmp_path, monkeypatch):
    assert sl.loop_order(SASS) == ["BAR", "HGMMA", "HGMMA", "WAIT_S", "FMNMX", "MUFU", "MUFU", "WAIT_PV", "F2FP", "BRA"]
    assert sl.loop_order(".L_x_1:\n") == []
    f = tmp_path / "peer.sass"
    f.write_text(SASS)
    # (the generated kernel's report stubbed: this test needs no ptxas)
    monkeypatch.setattr(sl, "kernel_report", lambda *a: {"kernel": "k", "loop": None, "why": "stub", "order": []})
    assert sl.main(["--sass", str(f), "--order"]) == 0
    assert "order: BAR HGMMA HGMMA WAIT_S FMNMX MUFU MUFU WAIT_PV F2FP BRA" in capsys.readouterr().out


def test_wgmma_kinds_and_a_disassembly_without_the_loop():
    assert sl.wgmma_kind("R24, gdesc[UR20], RZ, !UPT") == "ss"
    assert sl.wgmma_kind("R88, R152, gdesc[UR24].tnspB, R88, gsb0") == "rs"
    only_qk = "\n".join(ln for ln in SASS.splitlines() if "R152, gdesc" not in ln)
    assert sl.loop_report(only_qk)["loop"] is None


@pytest.mark.skipif(not (shutil.which("ptxas") and (shutil.which("nvdisasm") or shutil.which("cuobjdump"))),
                    reason="needs ptxas and a disassembler on PATH")
def test_the_generated_d64_kernel_has_its_loop(capsys):
    rep = sl.kernel_report(64, False, "auto", 1)
    assert rep["kernel"].endswith("_m192") and rep["loop"]["families"]["HGMMA"] == 12  # 4 QK + 8 PV k-steps
    assert rep["pv_wait_gap"] is not None
    # plan.sm90_row_reduction: chains on the 192-row tile, each row-sum FADD beside an exponential
    order = rep["order"]
    assert order.count("FADD") == 64 and sum(a == "MUFU" and b == "FADD" for a, b in zip(order, order[1:])) >= 48
