"""Prebuilt kernels: a cubin and the manifest `fa4gen build` writes beside it, read and checked
against each other before torch or the GPU is touched (`fa4gen.load`, kernel bundles)."""

from __future__ import annotations

from ..spec.config import KernelConfig
from .validate import RUNTIME_ARCH


class KernelLoadError(ValueError):
    """fa4gen.load was given files that are not a loadable fa4gen kernel (missing or mismatched)."""


_MANIFEST_KEYS = ("name", "config", "arch", "entry", "params", "dynamic_smem_bytes", "grid", "tensor_maps",
                  "threads_per_cta")


def read_prebuilt(cubin_path) -> tuple[bytes, dict, KernelConfig]:
    """(cubin, manifest, config) of a prebuilt kernel: `<stem>.cubin` and the `<stem>.json` manifest
    that `fa4gen build` writes beside it, checked against each other. Needs neither torch nor a GPU."""
    import hashlib
    import json
    from pathlib import Path

    from ..spec.config import ConfigError
    from ..assemble.cubin import cubin_problem

    path = Path(cubin_path)
    if not path.is_file():
        raise KernelLoadError(f"{path}: no such cubin file")
    mpath = path.with_suffix(".json")
    if not mpath.is_file():
        raise KernelLoadError(f"{path}: no manifest {mpath.name} beside it (fa4gen build writes DIR/<name>.json "
                              "next to DIR/<name>.cubin; ship both)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise KernelLoadError(f"{mpath}: not a readable JSON manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise KernelLoadError(f"{mpath}: not a JSON object")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise KernelLoadError(f"{mpath}: not an fa4gen build manifest (no {', '.join(missing)})")
    try:
        cfg = KernelConfig.from_dict(manifest["config"])
    except (ConfigError, TypeError) as e:
        raise KernelLoadError(f"{mpath}: its config is not valid here ({e})") from None
    if manifest["arch"] != cfg.arch or manifest["name"] != cfg.name:
        raise KernelLoadError(f"{mpath}: says {manifest['name']} ({manifest['arch']}) but its config is "
                              f"{cfg.name} ({cfg.arch})")
    from ..spec.plan import score_mods_record

    want_mods = score_mods_record(cfg)
    if manifest.get("score_mods") != want_mods:
        raise KernelLoadError(f"{mpath}: its score_mods record {manifest.get('score_mods')!r} is not its config's "
                              f"({want_mods!r})")
    cubin = path.read_bytes()
    bad = cubin_problem(cubin, cfg.arch)
    if bad:
        raise KernelLoadError(f"{path} is {bad}, but its manifest {mpath.name} describes {cfg.name} ({cfg.arch})")
    want = manifest.get("cubin_sha256")
    if want is not None and hashlib.sha256(cubin).hexdigest() != want:
        raise KernelLoadError(f"{path}: its sha256 is not the one {mpath.name} names (a different cubin)")
    if str(manifest["entry"]).encode() not in cubin:
        raise KernelLoadError(f"{path} has no entry {manifest['entry']!r}, which {mpath.name} names")
    if cfg.arch != RUNTIME_ARCH:
        raise KernelLoadError(f"{path} is an {cfg.arch} kernel; fa4gen launches {RUNTIME_ARCH} (H100/H200) kernels "
                              "only (sm_100a kernels have never run on a Blackwell GPU)")
    return cubin, manifest, cfg
