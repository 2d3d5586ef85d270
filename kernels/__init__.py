"""Triton kernels of sgl-entropic, each beside the pure-torch reference it must equal."""

import functools


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here; callers use a kernel only for CUDA tensors and this."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
