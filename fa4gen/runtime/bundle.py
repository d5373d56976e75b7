"""Kernel bundles: every kernel variant a model's attention calls need, assembled ahead of time, so a
serving process neither generates nor assembles (no CUDA toolkit, no nvJitLink at run time) and its
first call only loads a cubin.

    fa4gen bundle --model config.json [--arch sm_90a,sm_100a] [--page-size N] --out DIR [--wheel]

writes DIR/bundle.json (the index) and one <name>.cubin + <name>.json manifest per kernel (the files
`fa4gen build` writes); `--wheel` also writes a pip-installable wheel of them. A process uses bundles
that are

- loaded with `fa4gen.load_bundle(DIR)`, or named in FA4GEN_BUNDLE (directories, os.pathsep-separated;
  read at the first kernel lookup), or installed as a bundle wheel (entry point group "fa4gen.bundles",
  also read at the first lookup);
- consulted before the disk cache and the generator; FA4GEN_BUNDLE_ONLY=1 (or `load_bundle(DIR,
  only=True)`) turns a variant no bundle holds into a BundleMissError naming it, instead of a build.

A bundle is checked when it is loaded, before any kernel of it runs: its format, the fa4gen version
and GENERATOR_VERSION that built it (another one is a BundleError: its kernels' ABI may differ), each
file's sha256 and manifest (`api.read_prebuilt`'s checks: arch, entry, config), and, when a CUDA
driver is there, that the driver supports the CUDA release that assembled it. Bundle kernels are keyed
by their config, not by the generator's source fingerprint (hashing the sources costs a first call
~0.1 s): a bundle is a frozen build, like a prebuilt cubin.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..spec.config import GENERATOR_VERSION, KernelConfig

INDEX = "bundle.json"
FORMAT = 1
ENTRY_POINT_GROUP = "fa4gen.bundles"


class BundleError(ValueError):
    """A bundle that cannot be used here (missing or edited files, another fa4gen, arch or driver)."""


class BundleMissError(LookupError):
    """Only bundled kernels may run (FA4GEN_BUNDLE_ONLY / load_bundle(only=True)) and none holds this one."""


def config_key(cfg: KernelConfig) -> str:
    """The key a bundle (and this process's kernel table) files a kernel under: its config, every field."""
    return json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))


def _fa4gen_version() -> str:
    from .. import __version__

    return __version__


def _cuda_release(toolchain: str) -> tuple[int, int] | None:
    """(major, minor) of the CUDA release named in a toolchain id ('ptxas PATH 13.0.88', 'nvJitLink 13.5')."""
    m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?\s*$", toolchain)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---- writing ---------------------------------------------------------------------------------------
def write_bundle(configs, out_dir, *, model: str = "", progress=None, backend: str = "auto") -> Path:
    """Generate and assemble every config (codegen.build, verified like every build) into out_dir:
    <name>.cubin, <name>.json and the index bundle.json. progress(i, n, name) is called before each
    build. Returns the index's path."""
    from .. import codegen
    from ..assemble.assemble import toolchain_id

    configs = list(configs)
    if not configs:
        raise BundleError("a bundle needs at least one kernel config")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kernels = []
    for i, cfg in enumerate(configs):
        if progress is not None:
            progress(i, len(configs), cfg.name)
        res = codegen.build(cfg, emit=("cubin",), backend=backend)
        manifest = dict(res.manifest)
        manifest["cubin_sha256"] = hashlib.sha256(res.cubin).hexdigest()
        (out / f"{cfg.name}.cubin").write_bytes(res.cubin)
        (out / f"{cfg.name}.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        kernels.append({"name": cfg.name, "arch": cfg.arch, "config": cfg.to_dict(), "content_hash": cfg.content_hash,
                        "cubin": f"{cfg.name}.cubin", "manifest": f"{cfg.name}.json",
                        "cubin_sha256": manifest["cubin_sha256"]})
    tc = toolchain_id(backend)
    rel = _cuda_release(tc)
    index = {"format": FORMAT, "fa4gen": _fa4gen_version(), "generator_version": GENERATOR_VERSION,
             "toolchain": tc, "cuda_release": list(rel) if rel else None, "model": model,
             "archs": sorted({k["arch"] for k in kernels}), "kernels": kernels}
    path = out / INDEX
    path.write_text(json.dumps(index, indent=1) + "\n")
    return path


def write_wheel(bundle_dir, out_dir, name: str, version: str | None = None) -> Path:
    """A pip-installable wheel of a bundle: package `fa4gen_bundle_<name>` holding its files, with an
    entry point in group "fa4gen.bundles" by which fa4gen finds it once installed. Returns its path."""
    src = Path(bundle_dir)
    index = _read_index(src)
    slug = re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()
    if not slug:
        raise BundleError(f"wheel name {name!r} has no letters or digits")
    pkg = f"fa4gen_bundle_{slug}"
    dist = pkg
    ver = version or f"{index['fa4gen']}+g{index['generator_version']}".replace("-", ".")
    ver = re.sub(r"[^0-9a-zA-Z.+]", ".", ver)
    files: dict[str, bytes] = {
        f"{pkg}/__init__.py": (f'"""fa4gen kernel bundle: {index.get("model") or name}."""\n'
                               "from pathlib import Path\n\n\n"
                               "def path() -> str:\n"
                               "    \"\"\"The bundle's directory (its bundle.json).\"\"\"\n"
                               "    return str(Path(__file__).resolve().parent / 'bundle')\n").encode()}
    files[f"{pkg}/bundle/{INDEX}"] = (src / INDEX).read_bytes()
    for k in index["kernels"]:
        for f in (k["cubin"], k["manifest"]):
            files[f"{pkg}/bundle/{f}"] = (src / f).read_bytes()
    di = f"{dist}-{ver}.dist-info"
    files[f"{di}/METADATA"] = (f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {ver}\n"
                               f"Summary: fa4gen kernel bundle ({index.get('model') or name})\n"
                               f"Requires-Dist: fa4gen=={index['fa4gen']}\n").encode()
    files[f"{di}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fa4gen\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{di}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{slug} = {pkg}:path\n".encode()
    record = []
    for n, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={digest},{len(data)}")
    record.append(f"{di}/RECORD,,")
    files[f"{di}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    whl = out / f"{dist}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            z.writestr(n, data)
    return whl


# ---- reading and the process's table ----------------------------------------------------------------
@dataclass(frozen=True)
class BundledKernel:
    name: str
    content_hash: str  # the generator's hash of the build (LoadInfo reports it)
    cubin_path: Path
    manifest_path: Path
    bundle: Path


def _read_index(d: Path) -> dict:
    p = d / INDEX
    if not p.is_file():
        raise BundleError(f"{d}: no {INDEX} (not an fa4gen bundle: `fa4gen bundle --model config.json --out DIR` "
                          f"writes one)")
    try:
        index = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"{p}: not a readable JSON index ({e})") from None
    if not isinstance(index, dict) or not isinstance(index.get("kernels"), list):
        raise BundleError(f"{p}: not an fa4gen bundle index (no kernel list)")
    if index.get("format") != FORMAT:
        raise BundleError(f"{p}: bundle format {index.get('format')!r}; this fa4gen reads format {FORMAT}")
    return index


def _driver_release() -> tuple[int, int] | None:
    """(major, minor) of the CUDA release the installed driver supports, None without a driver."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return None
    try:
        err, v = drv.cuDriverGetVersion()
    except Exception:  # noqa: BLE001  (no libcuda: no driver to check against)
        return None
    if int(err) != 0:
        return None
    return v // 1000, (v % 1000) // 10


def read_bundle(bundle_dir, arch: str | None = None, driver_release=None) -> dict[str, BundledKernel]:
    """config_key -> BundledKernel for a bundle directory, every file checked (module docstring).
    arch: the arch kernels are wanted for (a bundle without one is a BundleError); driver_release
    ((major, minor), default: the installed driver's, if any)."""
    from .prebuilt import KernelLoadError, read_prebuilt

    d = Path(bundle_dir)
    index = _read_index(d)
    want = (_fa4gen_version(), GENERATOR_VERSION)
    got = (index.get("fa4gen"), index.get("generator_version"))
    if got != want:
        raise BundleError(f"{d}: built by fa4gen {got[0]} (generator {got[1]}); this is fa4gen {want[0]} (generator "
                          f"{want[1]}): rebuild it with this fa4gen (`fa4gen bundle`)")
    if arch is not None and arch not in index.get("archs", []):
        raise BundleError(f"{d}: holds {', '.join(index.get('archs', [])) or 'no'} kernels, none for {arch}")
    drv = _driver_release() if driver_release is None else tuple(driver_release)
    need = index.get("cuda_release")
    if drv is not None and need and tuple(drv) < tuple(need):
        raise BundleError(f"{d}: assembled by CUDA {need[0]}.{need[1]} ({index.get('toolchain')}), whose cubins need a "
                          f"driver of CUDA {need[0]}.{need[1]} or newer; this driver supports CUDA {drv[0]}.{drv[1]}")
    out = {}
    for k in index["kernels"]:
        if arch is not None and k.get("arch") != arch:
            continue
        cpath, mpath = d / str(k.get("cubin")), d / str(k.get("manifest"))
        if mpath.name != Path(k.get("cubin", "")).with_suffix(".json").name:
            raise BundleError(f"{d}: kernel {k.get('name')}: its manifest must sit beside its cubin as <stem>.json")
        if not cpath.is_file():
            raise BundleError(f"{d}: kernel {k.get('name')}: {cpath.name} is missing")
        try:
            if k.get("arch") == "sm_90a":  # read_prebuilt reads the cubin and holds it to its manifest's sha256
                _, manifest, cfg = read_prebuilt(cpath)
                sha = manifest.get("cubin_sha256")
            else:
                cfg, sha = _config_of(k, mpath), hashlib.sha256(cpath.read_bytes()).hexdigest()
        except KernelLoadError as e:
            raise BundleError(f"{d}: kernel {k.get('name')}: {e}") from None
        if sha != k.get("cubin_sha256"):
            raise BundleError(f"{d}: {cpath.name} is not the cubin the index names (sha256 differs)")
        if cfg.to_dict() != k.get("config"):
            raise BundleError(f"{d}: kernel {k.get('name')}: its manifest's config is not the index's")
        out[config_key(cfg)] = BundledKernel(name=cfg.name, content_hash=str(k.get("content_hash")), cubin_path=cpath,
                                             manifest_path=mpath, bundle=d)
    return out


def _config_of(k: dict, mpath: Path) -> KernelConfig:
    """The config of a kernel this runtime does not launch (sm_100a): its manifest read, not loaded."""
    from .prebuilt import KernelLoadError

    try:
        return KernelConfig.from_dict(json.loads(mpath.read_text())["config"])
    except Exception as e:  # noqa: BLE001
        raise KernelLoadError(f"{mpath}: not a readable fa4gen manifest ({e})") from None


class _Table:
    """The bundles this process uses (first loaded wins for a config)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.kernels: dict[str, BundledKernel] = {}
        self.dirs: list[Path] = []
        self.only = False
        self._auto_done = False

    def add(self, found: dict[str, BundledKernel], d: Path, only: bool) -> int:
        with self._lock:
            new = {k: v for k, v in found.items() if k not in self.kernels}
            self.kernels.update(new)
            self.dirs.append(d)
            self.only = self.only or only
            return len(new)

    def clear(self) -> None:
        with self._lock:
            self.kernels.clear()
            self.dirs.clear()
            self.only = False
            self._auto_done = False


TABLE = _Table()


def load_bundle(bundle_dir, only: bool = False, arch: str | None = None) -> int:
    """Use the kernels of a bundle directory (`fa4gen bundle` wrote it) from now on in this process:
    calls whose variant it holds load its cubin instead of building one. only=True: a variant no
    loaded bundle holds raises BundleMissError instead of being built. arch: the kernels to take
    (default: the runtime's, sm_90a). Returns how many kernels it added."""
    from .validate import RUNTIME_ARCH

    d = Path(bundle_dir).expanduser()
    return TABLE.add(read_bundle(d, arch or RUNTIME_ARCH), d, only)


def _load_automatic() -> None:
    """FA4GEN_BUNDLE directories and installed bundle wheels, once per process (at the first lookup)."""
    if TABLE._auto_done:
        return
    TABLE._auto_done = True
    only = os.environ.get("FA4GEN_BUNDLE_ONLY", "") not in ("", "0")
    for d in filter(None, os.environ.get("FA4GEN_BUNDLE", "").split(os.pathsep)):
        load_bundle(d, only=only)
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # noqa: BLE001
        eps = ()
    for ep in eps:
        try:
            d = ep.load()()
        except Exception as e:  # noqa: BLE001
            raise BundleError(f"installed bundle {ep.name!r} ({ep.value}) cannot be located: {e}") from None
        load_bundle(d, only=only)
    if only and not TABLE.kernels:
        raise BundleError("FA4GEN_BUNDLE_ONLY is set but no bundle is loaded (FA4GEN_BUNDLE is empty and no bundle "
                          "wheel is installed)")


def find(cfg: KernelConfig) -> BundledKernel | None:
    """The bundled kernel of cfg, or None (then the caller builds it); BundleMissError when only
    bundled kernels may run."""
    _load_automatic()
    hit = TABLE.kernels.get(config_key(cfg))
    if hit is None and TABLE.only:
        dirs = ", ".join(map(str, TABLE.dirs)) or "none"
        raise BundleMissError(f"kernel {cfg.name} is in no loaded bundle ({dirs}) and only bundled kernels may run "
                              f"(FA4GEN_BUNDLE_ONLY / load_bundle(only=True)): add it with `fa4gen bundle`, or let "
                              f"fa4gen build it")
    return hit
