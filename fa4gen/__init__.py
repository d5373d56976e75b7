"""fa4gen: a code generator for FlashAttention-4-style attention forward kernels.

The chain (each stage a pure function whose output can be dumped):

    KernelConfig --build_pipeline--> Pipeline --verify--> Report --lower--> context
        --render--> PTX --assemble--> cubin --load--> Kernel
"""

from .spec.config import ConfigError, KernelConfig, GENERATOR_VERSION

__all__ = ["ConfigError", "KernelConfig", "GENERATOR_VERSION", "attention", "attention_varlen", "attention_with_kvcache",
           "load", "load_bundle"]
__version__ = "0.1.0"

_LAZY = {"attention", "attention_varlen", "attention_with_kvcache", "load", "load_bundle"}  # the torch-facing API: imported on first use, the generator needs no torch


def __getattr__(name):
    if name == "distributed":  # fa4gen.distributed.ring_attention (context parallelism; imports torch lazily too)
        import importlib

        return importlib.import_module(".runtime.distributed", __name__)
    if name in _LAZY:
        from .runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'fa4gen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY | {"distributed"})
