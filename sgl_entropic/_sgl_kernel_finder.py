"""Serves `sgl_entropic._sgl_kernel_cpu` as `sgl_kernel` when no real sgl_kernel is found.

Imported from a .pth at interpreter start (see sgl_entropic.cpu), so it stays tiny: no torch.
"""

import importlib.abc
import importlib.util
import sys


class SglKernelFallback(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sgl_kernel":
            return None
        stand_in = importlib.util.find_spec("sgl_entropic._sgl_kernel_cpu")
        # a package, so that `sgl_kernel.speculative` resolves inside it
        return importlib.util.spec_from_file_location(
            "sgl_kernel", stand_in.origin, submodule_search_locations=stand_in.submodule_search_locations
        )


def install() -> None:
    # Appended last: every normal finder (a real sgl_kernel) is asked first.
    if not any(isinstance(f, SglKernelFallback) for f in sys.meta_path):
        sys.meta_path.append(SglKernelFallback())
