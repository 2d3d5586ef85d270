"""Triton kernels of sgl-entropic, each beside the pure-torch reference it must equal."""
