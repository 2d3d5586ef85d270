"""Client-side hooks of SGLang's frontend language, for `sgl_entropic.gen` (the program's process).

Installed on first use of `sgl_entropic.gen` / `EngineBackend`, not by `register()`: a client
needs no server config.
"""

from __future__ import annotations

import threading

from sgl_entropic.plugin.hooks import Hook, apply

ENTROPIC_KEY = "entropic"


def is_entropic(sampling_params) -> bool:
    return getattr(sampling_params, "entropic", None) is not None


def around_resolve_sampling_params(original, executor, sampling_params):
    clone = original(executor, sampling_params)
    if is_entropic(sampling_params):
        clone.entropic = dict(sampling_params.entropic)
    return clone


def after_to_srt_kwargs(result, sampling_params):
    if is_entropic(sampling_params):
        result["custom_params"] = {**(result.get("custom_params") or {}), ENTROPIC_KEY: sampling_params.entropic}
    return result


def ask_for_the_traces(result, endpoint, executor, data):
    """After RuntimeEndpoint._add_images, the last hook it offers before it posts the request."""
    if ENTROPIC_KEY in (data["sampling_params"].get("custom_params") or {}):
        data["return_entropy"] = True


HOOKS = (
    # SglSamplingParams has a fixed field list: carry our params across its clone ...
    Hook("sglang.lang.interpreter.StreamExecutor._resolve_sampling_params", "around", around_resolve_sampling_params),
    # ... into the request as plain JSON custom_params ...
    Hook("sglang.lang.ir.SglSamplingParams.to_srt_kwargs", "after", after_to_srt_kwargs),
    # ... and ask for the traces (the last hook RuntimeEndpoint offers before it posts).
    Hook("sglang.lang.backend.runtime_endpoint.RuntimeEndpoint._add_images", "after", ask_for_the_traces),
)


class _Installer:
    """Programs may call sgl_entropic.gen from several threads at once: install exactly once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done = False

    def __call__(self) -> None:
        with self.lock:
            if not self.done:
                apply(HOOKS)
                self.done = True


install_frontend_hooks = _Installer()
