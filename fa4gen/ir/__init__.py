"""Pipeline IR: `build_pipeline(cfg)` returns the frozen Pipeline for the config's arch."""

from ..spec.config import KernelConfig
from .core import Pipeline


def build_pipeline(cfg: KernelConfig) -> Pipeline:
    if cfg.arch == "sm_100a":
        from .sm100 import build_sm100

        return build_sm100(cfg)
    from .sm90 import build_sm90_pipeline

    return build_sm90_pipeline(cfg)


def refuse_ignored(cfg: KernelConfig) -> KernelConfig:
    """cfg, unless it asks for an option its arch would ignore (ConfigError; sm_90a: ir/sm90.py)."""
    if cfg.arch != "sm_90a":
        return cfg
    from .sm90 import refuse_ignored as refuse_sm90

    return refuse_sm90(cfg)
