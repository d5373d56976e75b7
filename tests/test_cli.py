"""First contact with the command line (issue 10, items 1-4 and 6): the default output folder, bad
--out folders, mutations filtered and refused by arch, the README's test command, atomic outputs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4gen import codegen
from fa4gen.cli import main
from fa4gen.spec.config import KernelConfig
from fa4gen.verify.mutations import CORPUS, DYNAMIC_CORPUS, SM90_CORPUS, SM90_KV_CORPUS, SM100_DV_CORPUS

REPO = Path(__file__).resolve().parent.parent


def _one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and len(err.splitlines()) == 1, err
    return err


# ---- item 1: the default output folder is ./fa4gen-out, not the checked-in generated/ ----------
def test_build_defaults_to_fa4gen_out_in_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--emit", "ptx"])
    assert r.exit_code == 0, r.output
    name = KernelConfig(arch="sm_90a").name
    assert (tmp_path / "fa4gen-out" / f"{name}.json").is_file()
    assert (tmp_path / "fa4gen-out" / f"{name}.ptx").is_file()
    assert not (tmp_path / "generated").exists()


def test_build_help_names_the_default_out():
    r = CliRunner().invoke(main, ["build", "--help"])
    assert r.exit_code == 0 and "fa4gen-out" in r.output and "[default: generated]" not in r.output


def test_fa4gen_out_is_git_ignored():
    assert "/fa4gen-out/" in (REPO / ".gitignore").read_text().splitlines()


# ---- item 2: an unusable --out is a one-line usage error before anything is built --------------
@pytest.mark.parametrize("out", ["/dev/null", "/proc/x", "/dev/null/sub"])
def test_bad_out_is_a_usage_error(out, monkeypatch):
    called = []
    monkeypatch.setattr(codegen, "build", lambda *a, **k: called.append(1))
    err = _one_line_error(CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--out", out]))
    assert out in err and err.startswith("fa4gen: error:")
    assert not called  # checked before verify / assembly ran


def test_out_that_is_a_file_is_a_usage_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    err = _one_line_error(CliRunner().invoke(main, ["build", "--out", str(f)]))
    assert "not a directory" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_is_a_usage_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        err = _one_line_error(CliRunner().invoke(main, ["build", "--out", str(ro)]))
        assert "writable" in err
    finally:
        ro.chmod(0o755)


# ---- item 3: mutations are per arch ------------------------------------------------------------
@pytest.mark.parametrize("arch,mine,theirs", [("sm_100a", CORPUS + SM100_DV_CORPUS + DYNAMIC_CORPUS, SM90_CORPUS),
                                              ("sm_90a", SM90_CORPUS + SM90_KV_CORPUS + DYNAMIC_CORPUS,
                                               CORPUS + SM100_DV_CORPUS)])
def test_list_mutations_is_filtered_by_arch(arch, mine, theirs):
    r = CliRunner().invoke(main, ["verify", "--arch", arch, "--list-mutations"])
    assert r.exit_code == 0
    names = [line.split()[0] for line in r.output.splitlines() if line.strip()]
    assert names == [m.name for m in mine]
    assert not set(names) & {m.name for m in theirs}


@pytest.mark.parametrize("arch,mutation,owner", [("sm_90a", CORPUS[0].name, "sm_100a"),
                                                 ("sm_100a", SM90_CORPUS[-1].name, "sm_90a")])
def test_mutation_of_the_other_arch_is_refused(arch, mutation, owner):
    err = _one_line_error(CliRunner().invoke(main, ["verify", "--arch", arch, "--mutation", mutation]))
    assert mutation in err and owner in err and "no role" not in err


def test_a_mutation_that_changes_nothing_is_refused_and_the_dv_corpus_bites_on_192_128():
    name = SM100_DV_CORPUS[0].name
    err = _one_line_error(CliRunner().invoke(main, ["verify", "--arch", "sm_100a", "--mutation", name]))
    assert f"{name!r} changes nothing" in err and "--head-dim 192,128" in err
    r = CliRunner().invoke(main, ["verify", "--arch", "sm_100a", "--head-dim", "192,128", "--mutation", name])
    assert r.exit_code == 1 and "TX_COUNT" in r.output, r.output


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_a_dynamic_deal_mutation_needs_varlen_and_bites_there(arch):
    name = DYNAMIC_CORPUS[0].name
    err = _one_line_error(CliRunner().invoke(main, ["verify", "--arch", arch, "--mutation", name]))
    assert f"{name!r} changes nothing" in err and "--varlen" in err
    r = CliRunner().invoke(main, ["verify", "--arch", arch, "--varlen", "--mutation", name])
    assert r.exit_code == 1 and "HAZARD_RAW" in r.output, r.output


def test_unknown_mutation_lists_the_arch_corpus():
    err = _one_line_error(CliRunner().invoke(main, ["verify", "--arch", "sm_90a", "--mutation", "nope"]))
    assert "nope" in err and SM90_CORPUS[0].name in err and CORPUS[0].name not in err


# ---- item 4: the README's test command prints the summary line ---------------------------------
@pytest.mark.parametrize("extra", [[], ["-q"]], ids=["plain", "-q"])
def test_readme_pytest_command_prints_n_passed(extra):
    readme = (REPO / "README.md").read_text()
    assert "python3 -m pytest" in readme
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "pytest", *extra, "-p", "no:cacheprovider",
                           "tests/test_config.py", "-k", "test_frozen"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b1 passed\b", proc.stdout), proc.stdout


# ---- item 6: every output file is written atomically -------------------------------------------
def test_build_outputs_are_replaced_atomically(tmp_path, monkeypatch):
    cfg = KernelConfig(arch="sm_90a")
    old = {s: tmp_path / f"{cfg.name}{s}" for s in (".json", ".ptx")}
    for p in old.values():
        p.write_text("OLD")

    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(OSError):
        codegen.build(cfg, out_dir=tmp_path, emit=("ptx",))
    monkeypatch.undo()
    # a failed (or in-flight) write never shows a reader a torn or half-new file
    assert all(p.read_text() == "OLD" for p in old.values())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    res = codegen.build(cfg, out_dir=tmp_path, emit=("ptx",))
    assert old[".ptx"].read_text() == res.ptx



# ---- --head-dim D[,DV] (issue 26 groundwork) ---------------------------------------------------------
@pytest.mark.parametrize("arg,dims", [("128", (128, 128)), ("64", (64, 64)), ("64,64", (64, 64)), ("128,128", (128, 128)),
                                      ("192,128", (192, 128)), ("256", (256, 256))])
def test_head_dim_takes_d_or_d_comma_dv(arg, dims, tmp_path, monkeypatch):
    seen = []

    def fake_build(cfg, **kw):
        seen.append(cfg)
        raise RuntimeError("stop here")
    monkeypatch.setattr(codegen, "build", fake_build)
    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--head-dim", arg, "--out", str(tmp_path)])
    assert r.exit_code == 1 and "stop here" in r.stderr
    from fa4gen.spec.tiles import q_tile_rows

    assert seen[0].head_dims == dims
    assert seen[0] == KernelConfig(arch="sm_90a", head_dim=dims[0], head_dim_v=dims[1],
                                   block_m=q_tile_rows("sm_90a", dims[0], 1))


@pytest.mark.parametrize("arch,arg,field", [("sm_100a", "192,64", "head_dim_v"), ("sm_90a", "192,64", "head_dim_v"),
                                            *((a, "128,64", "head_dim_v") for a in ("sm_100a", "sm_90a")),
                                            ("sm_100a", "512", "head_dim"), ("sm_90a", "256,128", "head_dim_v")])
def test_head_dim_pairs_not_generated_are_refused_naming_the_generated_ones(arch, arg, field, monkeypatch):
    monkeypatch.setattr(codegen, "build", lambda *a, **k: pytest.fail("built a refused config"))
    err = _one_line_error(CliRunner().invoke(main, ["build", "--arch", arch, "--head-dim", arg]))
    d, _, dv = arg.partition(",")
    assert err.startswith(f"fa4gen: error: invalid {field}=")
    pairs = "(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)"
    assert f"({d}, {dv or d}) is not generated for {arch}" in err and err.endswith(f"it generates {pairs}")


@pytest.mark.parametrize("arg", ["12x", "1,2,3", ",128", ""])
def test_head_dim_that_is_not_d_or_d_comma_dv_is_a_usage_error(arg):
    r = CliRunner().invoke(main, ["verify", "--head-dim", arg])
    assert r.exit_code == 2 and "is not D or D,DV" in r.output
