"""Per-token traces to the client, in the HTTP / Engine process (tokenizer manager).

The scheduler appends per-token values to `req.customized_info`; SGLang ships them as
`meta_info[key]` lists. Here the cumulative scalars become single floats, and the traces stay
only for requests that asked (`return_entropy`, on HTTP or `sgl.Engine.generate`). Under speculative decoding every
request gets its own counts (`entropic_speculative`); one that asked also gets the per-step draft lists and
`from_draft`, per token.
"""

from __future__ import annotations

import contextvars

from sgl_entropic.plugin.serving import openai_ext
from sgl_entropic.drafting import from_drafts, request_summary

TRACE_KEYS = ("entropy", "surprisal", "temperature", "parked", "attended")
DRAFT_KEYS = ("offered", "drafted", "accepted", "draft_source")  # under speculation (signal/traces.NO_DRAFT)

_engine_return_entropy = contextvars.ContextVar("sgl_entropic_return_entropy", default=False)


def after_update_request_meta_info(result, manager, meta_info, state, *args, **kwargs):
    for internal, public in (("_entropic_time", "entropic_time"), ("_entropic_efficiency", "entropic_efficiency")):
        values = meta_info.pop(internal, None)
        if values:
            meta_info[public] = values[-1]
    traced = getattr(state.obj, "return_entropy", False)
    if "drafted" in meta_info:  # speculation: the request's own counts always, per token when asked
        lists = [meta_info[k] if traced else meta_info.pop(k) for k in DRAFT_KEYS]
        meta_info["entropic_speculative"] = request_summary(*lists)
        if traced:
            meta_info["from_draft"] = from_drafts(lists[1], lists[2])
    if not traced:
        for key in TRACE_KEYS:
            meta_info.pop(key, None)
        return
    if "input_token_logprobs" in meta_info:
        # Prompt surprisal on request (return_logprob + logprob_start_len=0): SGLang's own input
        # logprobs, at T = 1; the first prompt token has no prediction (null).
        meta_info["prompt_surprisal"] = [None if lp is None else -lp for lp, *_ in meta_info["input_token_logprobs"]]
    openai_ext.record_stream_meta(meta_info)  # an OpenAI stream reads its traces from here


def around_engine_generate(original, engine, *args, return_entropy: bool = False, **kwargs):
    """`sgl.Engine.generate(..., return_entropy=True)`, like the HTTP field."""
    token = _engine_return_entropy.set(return_entropy)
    try:
        return original(engine, *args, **kwargs)
    finally:
        _engine_return_entropy.reset(token)


def before_generate_request(manager, obj, *args, **kwargs):
    # Called synchronously inside Engine.generate (it only creates the async generator).
    if _engine_return_entropy.get():
        obj.return_entropy = True
