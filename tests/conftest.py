"""Skips tests marked `gpu` unless torch sees a GPU that fa4gen has a kernel for (sm_90), and holds the
GPU tests' shared fixture (exact_fp32).

Only decides when gpu-marked tests were collected, so CPU runs never import torch because of it."""

import functools
import os

import pytest

# One BLAS / OpenMP thread per test process (unless the caller chose): `-n auto` already runs one
# worker per core, and each worker's OpenBLAS threads would spin against the other worker's (the
# emulator's small matrix products): measured 5-7% less CPU on the emulation tests on 2 cores. Set
# before numpy / torch load their thread pools; xdist's workers inherit it from this process.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        return f"GPU 0 is sm_{major}{minor}; fa4gen's runnable kernels are sm_90a (H100/H200)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def exact_fp32():
    """The GPU tests' fp32 reference must be real fp32: TF32 matmuls would round the logits to 10 bits."""
    import torch

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)
