"""The signal for OpenAI-API users, in the HTTP process: `sglext.entropic` on chat and completion responses.

Asked for with `"return_entropy": true` in the body (the OpenAI client's `extra_body`) or the header
`x-sglext-return-entropy: 1` (SGLang's own x-sglext-* opt-in style). The request then runs with
GenerateReqInput.return_entropy, and the response carries, in SGLang's response-level extension
object, one entry per choice: {"index", "entropy", "surprisal", "temperature", "entropic_time"}, and under
speculative decoding "speculative" (the request's counts) and "from_draft" (per token).
Streaming responses (n = 1; SGLang gives parallel samples fresh request ids, which a stream cannot
match) carry it in one chunk with no choices right before `data: [DONE]`, the way SGLang streams
its other sglext fields. Requests that do not ask are left alone: the original
response object, the original stream.
"""

from __future__ import annotations

import json
import uuid

import orjson

from sgl_entropic.plugin import runtime

HEADER = "x-sglext-return-entropy"
CHOICE_KEYS = ("entropy", "surprisal", "temperature")
_DONE = "data: [DONE]\n\n"


def _asked(raw_request) -> bool:
    if raw_request is None:
        return False
    if raw_request.headers.get(HEADER) == "1":
        return True
    # The OpenAI request models drop unknown fields: read the field from the body FastAPI already
    # read (Starlette caches it on the request).
    body = getattr(raw_request, "_body", None)
    if not body or b"return_entropy" not in body:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("return_entropy") is True


def after_convert_request(result, serving, request, raw_request=None, *args, **kwargs):
    """`_convert_to_internal_request` of chat and completions: switch the traces on when asked."""
    adapted = result[0]
    if not _asked(raw_request):
        return result
    adapted.return_entropy = True
    if getattr(request, "stream", False) and adapted.rid is None:
        # a stream is matched with its traces by request id: give it one we know
        adapted.rid = f"entropic-{uuid.uuid4().hex}"
    return result


def _choice(index: int, meta: dict) -> dict:
    entry = {"index": index, **{k: meta.get(k) for k in CHOICE_KEYS}}
    entry["entropic_time"] = meta.get("entropic_time")
    if "entropic_speculative" in meta:  # under speculative decoding
        entry["speculative"] = meta["entropic_speculative"]
        entry["from_draft"] = meta.get("from_draft")
    return entry


def after_build_response(result, serving, request, ret, *args, **kwargs):
    """`_build_chat_response` / `_build_completion_response`: add sglext.entropic for traced requests."""
    metas = [item.get("meta_info", {}) for item in ret]
    if not any("entropy" in m for m in metas) or not hasattr(result, "model_dump"):
        return result  # not asked (the traces were dropped), or an error response
    from fastapi.responses import ORJSONResponse

    data = orjson.loads(result.model_dump_json(by_alias=True))  # as SGLang serializes it (model_json_response)
    data.setdefault("sglext", {})["entropic"] = [_choice(i, m) for i, m in enumerate(metas)]
    return ORJSONResponse(content=data)


def around_stream(original, serving, adapted_request, request, raw_request, *args, **kwargs):
    """`_generate_chat_stream` / `_generate_completion_stream`: untouched unless traced."""
    stream = original(serving, adapted_request, request, raw_request, *args, **kwargs)
    if (
        not getattr(adapted_request, "return_entropy", False)
        or not isinstance(adapted_request.rid, str)
        or getattr(request, "n", 1) != 1
    ):
        return stream
    return _with_traces(stream, adapted_request.rid, request)


async def _with_traces(stream, rid: str, request):
    streams = runtime.current().openai_streams
    box = streams[rid] = {}  # choice index -> its latest meta_info (filled by record_stream_meta)
    try:
        async for chunk in stream:
            if chunk == _DONE and box:
                extra = {
                    "id": rid,
                    "object": _chunk_object(request),
                    "model": request.model,
                    "choices": [],
                    "sglext": {"entropic": [_choice(i, box[i]) for i in sorted(box)]},
                }
                yield f"data: {orjson.dumps(extra).decode()}\n\n"
            yield chunk
    finally:
        streams.pop(rid, None)


def _chunk_object(request) -> str:
    return "chat.completion.chunk" if hasattr(request, "messages") else "text_completion"


def record_stream_meta(meta_info: dict) -> None:
    """Called for every meta_info of a traced request: keep the latest of the streams waiting for it."""
    streams = runtime.current().openai_streams
    rid = meta_info.get("id")
    if not streams or not isinstance(rid, str):
        return
    if rid in streams:
        streams[rid][0] = meta_info
        return
    base, _, index = rid.rpartition("_")  # a batch of prompts: SGLang names them rid_0, rid_1, ...
    if base in streams and index.isdigit():
        streams[base][int(index)] = meta_info
