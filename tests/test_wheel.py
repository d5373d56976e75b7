"""The wheel a user installs: built from this checkout, installed into a fresh virtual environment that
cannot see the checkout, and run as a user runs it (`fa4gen build`, `fa4gen check`, `fa4gen emulate`).
Every test before this one ran from an editable install, which hid a wheel without fa4gen.evidence.ptxemu.

The fresh environment gets its dependencies (jinja2, click, numpy, the CUDA wheels with ptxas) from the
test's own environment through a .pth line naming that site-packages folder; a .pth file inside a
folder named that way is not processed, so the checkout's editable-install hook never runs there. The
wheel is built with pip (`pip wheel . --no-deps`), which fetches setuptools into an isolated build
environment as any user's build does."""
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# what a clean clone would not have: earlier builds' output (a stale build/lib would fill the wheel
# with files the packaging no longer names), environments, caches
_NOT_SOURCE = shutil.ignore_patterns("build", "dist", "*.egg-info", ".venv*", ".git", "__pycache__", "fa4gen-out",
                                     ".hypothesis", ".pytest_cache", "*.cubin")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "fa4gen"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    (out / "build.log").write_text(r.stdout + r.stderr)
    (whl,) = out.glob("fa4gen-*.whl")
    return whl


def test_the_build_names_every_package_it_ships(wheel):
    """setup.py names each templates/<target>/ folder, so setuptools never warns that it would ignore one
    (it did for common, sm100 and sm90 while still shipping their files)."""
    log = (wheel.parent / "build.log").read_text()
    assert "running build_py" in log  # setuptools' own output was captured (pip -v)
    assert "would be ignored" not in log and "absent from the `packages` configuration" not in log


def test_the_wheel_holds_every_package_and_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in sorted((ROOT / "fa4gen").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} is not in the wheel"
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        rel = "fa4gen/templates/" + path.relative_to(ROOT / "templates").as_posix()
        assert rel in names, f"{rel} is not in the wheel"


@pytest.fixture(scope="module")
def wheel_env(wheel, tmp_path_factory) -> tuple[Path, dict]:
    """(the fresh environment's bin folder, the environment variables to run it with)."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False, symlinks=os.name != "nt")
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    deps = [p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                        *site.getsitepackages()} if Path(p).is_dir()]
    (purelib / "_fa4gen_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout}\n{r.stderr}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["FA4GEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return py.parent, env


def _run(args, env, cwd, timeout=300):
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def test_the_installed_package_is_the_wheel_not_the_checkout(wheel_env, tmp_path):
    bindir, env = wheel_env
    code, out = _run([str(bindir / "python"), "-c",
                      "import fa4gen, fa4gen.evidence.ptxemu.harness, fa4gen.evidence.check, fa4gen.render.jinja as r; "
                      "print(fa4gen.__file__); print(r.templates_dir())"], env, tmp_path)
    assert code == 0, out
    pkg_file, templates = out.split()[-2:]
    assert not Path(pkg_file).is_relative_to(ROOT), pkg_file
    assert not Path(templates).is_relative_to(ROOT), templates


def test_the_wheel_builds_checks_and_emulates_a_kernel(wheel_env, tmp_path):
    bindir, env = wheel_env
    fa4gen = str(bindir / "fa4gen")
    code, out = _run([fa4gen, "build", "--arch", "sm_100a", "--head-dim", "64", "--out", str(tmp_path / "out")],
                     env, tmp_path)
    assert code == 0, out
    (man,) = (tmp_path / "out").glob("*.json")
    ptx = man.with_suffix(".ptx")
    assert ptx.is_file() and json.loads(man.read_text())["verify"]["ok"], out
    code, out = _run([fa4gen, "check", str(ptx)], env, tmp_path)
    assert code == 0, out
    code, out = _run([fa4gen, "emulate", str(ptx), "--seeds", "1"], env, tmp_path, timeout=600)
    assert code == 0 and "PASS" in out, out
