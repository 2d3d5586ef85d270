"""Entropic-time inference for SGLang."""

__version__ = "0.1.0"
