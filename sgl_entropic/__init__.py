"""Entropic-time inference for SGLang.

Kept import-light: a .pth imports this package at every interpreter start (sgl_kernel stand-in),
so the public helpers load lazily.
"""

__version__ = "0.1.0"

_LAZY = {"gen": "sgl_entropic.lang", "EngineBackend": "sgl_entropic.lang", "Engine": "sgl_entropic.engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sgl_entropic' has no attribute {name!r}")
