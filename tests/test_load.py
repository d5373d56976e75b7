"""fa4gen.load(cubin_path) for someone who ships a prebuilt cubin (issue 10, item 5): the manifest
beside it is required and must match the cubin and its arch; the public names are listed."""
import importlib.util
import json
import shutil

import pytest

import fa4gen
from fa4gen.assemble.assemble import available_backends

needs_assembler = pytest.mark.skipif(not available_backends(), reason="no PTX assembler")


def test_public_api_is_listed():
    for name in ("attention", "load", "KernelConfig"):
        assert name in dir(fa4gen) and name in fa4gen.__all__
    assert callable(fa4gen.load) and callable(fa4gen.attention)
    with pytest.raises(AttributeError, match="nope"):
        fa4gen.nope


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not available_backends():
        pytest.skip("no PTX assembler")
    from fa4gen import codegen
    from fa4gen.spec.config import KernelConfig

    out = tmp_path_factory.mktemp("prebuilt")
    for cfg in (KernelConfig(arch="sm_90a", head_dim=64), KernelConfig(arch="sm_100a", head_dim=64)):
        codegen.build(cfg, out_dir=out, emit=("cubin",))
    return out, KernelConfig(arch="sm_90a", head_dim=64).name, KernelConfig(arch="sm_100a", head_dim=64).name


def _copy(built, tmp_path, name):
    out = built[0]
    shutil.copy(out / f"{name}.cubin", tmp_path / f"{name}.cubin")
    shutil.copy(out / f"{name}.json", tmp_path / f"{name}.json")
    return tmp_path / f"{name}.cubin", tmp_path / f"{name}.json"


def test_missing_cubin_or_manifest(tmp_path, built):
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="no such cubin"):
        fa4gen.load(tmp_path / "absent.cubin")
    cubin, manifest = _copy(built, tmp_path, built[1])
    manifest.unlink()
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match=f"no manifest {manifest.name} beside it"):
        fa4gen.load(cubin)


def test_manifest_must_match_the_cubin(tmp_path, built):
    cubin, manifest = _copy(built, tmp_path, built[1])
    # the sm_100a cubin under the sm_90a manifest: the ELF header says sm_100
    shutil.copy(built[0] / f"{built[2]}.cubin", cubin)
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="a cubin for sm_100, not sm_90a"):
        fa4gen.load(cubin)
    cubin.write_bytes(b"not an ELF at all" * 8)
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="not a cubin"):
        fa4gen.load(cubin)
    _copy(built, tmp_path, built[1])
    m = json.loads(manifest.read_text())
    m["arch"] = "sm_100a"
    manifest.write_text(json.dumps(m))
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="but its config is"):
        fa4gen.load(cubin)
    manifest.write_text("{}")
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="not an fa4gen build manifest"):
        fa4gen.load(cubin)


def test_manifest_head_dim_v_is_checked(tmp_path, built):
    """The manifest's config carries head_dim_v where it differs from head_dim: a pair this fa4gen
    does not generate, or another kernel's name, is refused before the cubin is read."""
    cubin, manifest = _copy(built, tmp_path, built[1])
    m = json.loads(manifest.read_text())
    assert "head_dim_v" not in m["config"]  # a dv == d kernel's manifest, as before head_dim_v existed
    m["config"]["head_dim_v"] = 128
    manifest.write_text(json.dumps(m))
    with pytest.raises(fa4gen.runtime.api.KernelLoadError,
                       match=r"its config is not valid here \(invalid head_dim_v=128: \(head_dim, head_dim_v\) = "
                             r"\(64, 128\) is not generated for sm_90a; it generates \(64, 64\), \(96, 96\), "
                             r"\(128, 128\), \(192, 128\), \(256, 256\)\)"):
        fa4gen.load(cubin)
    m["config"]["head_dim_v"] = 64
    manifest.write_text(json.dumps(m))
    assert fa4gen.runtime.api.read_prebuilt(cubin)[2].head_dims == (64, 64)


def test_sm100a_kernels_are_not_launched(tmp_path, built):
    cubin, _ = _copy(built, tmp_path, built[2])
    with pytest.raises(fa4gen.runtime.api.KernelLoadError, match="fa4gen launches sm_90a"):
        fa4gen.load(cubin)


def test_matching_files_pass_the_checks_and_then_need_torch(tmp_path, built):
    cubin, _ = _copy(built, tmp_path, built[1])
    data, manifest, cfg = fa4gen.runtime.api.read_prebuilt(cubin)
    assert cfg.arch == "sm_90a" and cfg.head_dim == 64 and manifest["name"] == cfg.name
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch installed: loading itself is the GPU tests' (needs an sm_90 GPU)")
    with pytest.raises(fa4gen.runtime.api.validate.InputTypeError, match="needs torch"):
        fa4gen.load(cubin)
