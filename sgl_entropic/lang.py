"""Frontend primitives: entropic generation inside `@sgl.function` programs.

    s += sgl_entropic.gen("answer", max_tokens=128, target_entropy=2.0)
    s.get_meta_info("answer")["entropy"], ["temperature"], ["entropic_time"], ...

Works with `sgl.RuntimeEndpoint` (our server) and with an in-process `sgl.Engine` through
`EngineBackend`. The entropic keywords are validated here already (ValueError naming the
field); the server validates them again, merged over its own defaults.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import sglang as sgl
from pydantic import ValidationError
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import get_chat_template

from sgl_entropic.plugin.serving import frontend
from sgl_entropic.config import REQUEST_SPECULATIVE_KEY, SERVER_ONLY, RequestSpeculation, SamplingConfig, format_error

ENTROPIC_FIELDS = frozenset(SamplingConfig.model_fields) - SERVER_ONLY


def gen(name: Optional[str] = None, speculative: Optional[dict] = None, **kwargs: Any):
    """`sgl.gen` plus the entropic sampling keywords of `SamplingConfig`, and `speculative`, this call's speculative
    decoding (`RequestSpeculation`: {"draft": "off"}, {"max_draft_tokens": 2}, ...).

    With no entropic keyword, the server's defaults apply (the controller still runs); with `speculative` alone
    the controller is the server's choice, as for any request without sampling keywords (`every_request`).
    The per-step traces (`entropy`, `surprisal`, `temperature`) and the scalars
    (`entropic_time`, `entropic_efficiency`, `entropic_speculative`) come back in `s.get_meta_info(name)`.
    """
    entropic = {k: kwargs.pop(k) for k in list(kwargs) if k in ENTROPIC_FIELDS}
    try:
        SamplingConfig.model_validate(entropic)
        if speculative is not None:
            RequestSpeculation.model_validate(speculative)
    except ValidationError as err:
        raise ValueError(format_error(err, prefix="sgl_entropic.gen")) from None
    if speculative is not None:
        entropic[REQUEST_SPECULATIVE_KEY] = dict(speculative)
    if kwargs.get("choices") is not None:
        # sgl.gen(choices=...) scores each choice instead of sampling: there is no T to control.
        if entropic:
            raise ValueError("sgl_entropic.gen: choices are scored, not sampled; entropic keywords do not apply")
        return sgl.gen(name, **kwargs)
    frontend.install_frontend_hooks()
    expr = sgl.gen(name, **kwargs)
    expr.sampling_params.entropic = entropic
    return expr


class EngineBackend(BaseBackend):
    """Runs `@sgl.function` programs on an in-process `sgl.Engine` (see `sgl_entropic.Engine`)."""

    def __init__(self, engine, chat_template: str = "chatml"):
        super().__init__()
        self.engine = engine
        self.chat_template = get_chat_template(chat_template)
        # sgl.Engine.generate drives the engine's one event loop with run_until_complete, which
        # fails ("already running") if two threads call it at once, as fork branches and
        # run_batch do: their calls take turns here.
        self._engine_lock = threading.Lock()
        frontend.install_frontend_hooks()

    def get_chat_template(self):
        return self.chat_template

    def generate(self, s, sampling_params):
        with self._engine_lock:
            out = self.engine.generate(
                prompt=s.text_,
                sampling_params=sampling_params.to_srt_kwargs(),
                return_entropy=frontend.is_entropic(sampling_params),
            )
        return out["text"], out["meta_info"]

    def generate_stream(self, s, sampling_params):
        # One chunk: the engine's own streaming is a blocking iterator over cumulative outputs.
        yield self.generate(s, sampling_params)
