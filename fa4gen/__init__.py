"""fa4gen: a code generator for FlashAttention-4-style attention forward kernels.

The chain (each stage a pure function whose output can be dumped):

    KernelConfig --build_pipeline--> Pipeline --verify--> Report --lower--> context
        --render--> PTX --assemble--> cubin --load--> Kernel
"""

from .config import ConfigError, KernelConfig, GENERATOR_VERSION

__all__ = ["ConfigError", "KernelConfig", "GENERATOR_VERSION"]
__version__ = "0.1.0"


def __getattr__(name):
    # torch-facing API is imported lazily: the generator and its tests need no torch.
    if name == "attention":
        from .api import attention

        return attention
    raise AttributeError(name)
