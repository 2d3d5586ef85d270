"""Per-token traces to the client, in the HTTP / Engine process (tokenizer manager).

A request that asks for its traces (`return_entropy`, on HTTP or `sgl.Engine.generate`) is marked for the scheduler
(`custom_params.entropic_traces`: SGLang does not pass `return_entropy` on), which then appends its per-token values
to `req.customized_info`; SGLang ships them as `meta_info[key]` lists. Every request gets its totals
(`entropic_time`, `entropic_efficiency` and, under speculative decoding, `entropic_speculative`): sent once when it
finishes, or with each chunk of a stream. A traced request under speculation also gets the per-step draft lists
and `from_draft`, per token.
"""

from __future__ import annotations

import contextvars

from sgl_entropic.config import TRACES_PARAMS_KEY
from sgl_entropic.drafting import from_drafts
from sgl_entropic.plugin.serving import openai_ext

TRACE_KEYS = ("entropy", "surprisal", "temperature", "parked", "attended")
DRAFT_KEYS = ("offered", "drafted", "accepted", "draft_source")  # under speculation (signal/traces.NO_DRAFT)
TOTALS_KEY = "_entropic_totals"  # a finished request's totals, one of SGLang's request-level keys (sent once)
RUNNING_KEY = "_entropic_running"  # a stream's totals, per token (each chunk carries the latest)

_engine_return_entropy = contextvars.ContextVar("sgl_entropic_return_entropy", default=False)


def after_update_request_meta_info(result, manager, meta_info, state, *args, **kwargs):
    # SGLang keeps every chunk's values of a key and puts them back into a stream's last chunk: a stream's running
    # totals need only the latest, and neither key is the client's
    for key in (TOTALS_KEY, RUNNING_KEY):
        totals = meta_info.pop(key, None)
        if totals:
            meta_info.update(totals[-1])
            del totals[:-1]  # SGLang's accumulation of the key, which meta_info holds
        state.customized_info_reported_keys.discard(key)
    traced = getattr(state.obj, "return_entropy", False)
    if not traced:
        return
    if "drafted" in meta_info:  # speculation: per token, whether it came from a draft
        meta_info["from_draft"] = from_drafts(meta_info["drafted"], meta_info["accepted"])
    if "input_token_logprobs" in meta_info:
        # Prompt surprisal on request (return_logprob + logprob_start_len=0): SGLang's own input
        # logprobs, at T = 1; the first prompt token has no prediction (null).
        meta_info["prompt_surprisal"] = [None if lp is None else -lp for lp, *_ in meta_info["input_token_logprobs"]]
    openai_ext.record_stream_meta(meta_info)  # an OpenAI stream reads its traces from here


def after_create_tokenized_object(result, manager, obj, *args, **kwargs):
    """The scheduler keeps per-token traces only for a request that asked for them (the key is ours: set or
    removed here, whatever the client sent)."""
    params = getattr(result, "sampling_params", None)
    if params is None:
        return result
    custom = {k: v for k, v in (params.custom_params or {}).items() if k != TRACES_PARAMS_KEY}
    if getattr(obj, "return_entropy", False):
        custom[TRACES_PARAMS_KEY] = True
    params.custom_params = custom or None
    return result


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
