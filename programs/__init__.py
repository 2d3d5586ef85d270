"""Runnable `@sgl.function` programs on entropic decoding; each module has `run(backend, ...) -> dict` and `main()`."""
