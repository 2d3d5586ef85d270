"""Request validation, in the HTTP process: a ValueError here becomes HTTP 400 (OpenAI: BadRequest).

`after_verify` checks a request's sampling parameters, `before_validate_one_request` its tokenized
prompt: what would end the scheduler (an empty prompt, a token id outside the embedding) is refused
before it leaves this process, for every endpoint, the Engine included (docs/reliability.md).

`request_controllers` is the one check of a request's `custom_params.entropic`: the HTTP
process calls it to validate, the scheduler calls it again to build the request's state
(`admission.py`), so both check exactly the same things.
"""

from __future__ import annotations

from typing import Any, Optional

from sgl_entropic.config import (
    REQUEST_SPECULATIVE_KEY,
    SPECULATIVE_PARAMS_KEY,
    EntropicConfig,
    RequestSpeculation,
    SamplingConfig,
    request_sampling_config,
    request_speculation,
)
from sgl_entropic.plugin import runtime
from sgl_entropic.sampling import ControllerState, MirostatState

ENTROPIC_KEY = "entropic"  # in custom_params, and the section name in /server_info

# Beyond this a bias (divided by a temperature below 1) overflows float32 to +inf; SGLang's sampler
# then raises on the row (torch.multinomial) and takes the scheduler down. Refused up front instead.
LOGIT_BIAS_LIMIT = 1e30


def check_custom_params_shape(custom_params: Any) -> None:
    """custom_params crosses a msgspec IPC boundary: more than one level of nesting kills the scheduler. The one
    exception, custom_params.entropic.speculative, travels one level up (`carry_speculation`)."""
    if custom_params is None:
        return
    if not isinstance(custom_params, dict):
        raise ValueError("custom_params must be a JSON object")
    scalar = (type(None), bool, int, float, str)
    for key, value in custom_params.items():
        if isinstance(value, dict):
            bad = [
                k
                for k, v in value.items()
                if not isinstance(v, scalar)
                and not (
                    key == ENTROPIC_KEY
                    and k == REQUEST_SPECULATIVE_KEY
                    and isinstance(v, dict)
                    and all(isinstance(x, scalar) for x in v.values())
                )
            ]
        elif isinstance(value, list):
            bad = [str(i) for i, v in enumerate(value) if not isinstance(v, scalar)]
        else:
            bad = []
        if bad:
            raise ValueError(f"custom_params.{key}.{bad[0]}: nested objects or lists are not allowed here")


def carry_speculation(sampling_params) -> None:
    """custom_params.entropic.speculative moves to custom_params.entropic_speculative, which SGLang's IPC carries; an
    `entropic` object that held nothing else goes (it asked for no controller)."""
    params = sampling_params.custom_params
    entropic = (params or {}).get(ENTROPIC_KEY)
    if not isinstance(entropic, dict) or REQUEST_SPECULATIVE_KEY not in entropic:
        return
    params = {k: v for k, v in params.items() if k != ENTROPIC_KEY}
    rest = {k: v for k, v in entropic.items() if k != REQUEST_SPECULATIVE_KEY}
    if rest:
        params[ENTROPIC_KEY] = rest
    if entropic[REQUEST_SPECULATIVE_KEY] is not None:  # null: as if left out
        params[SPECULATIVE_PARAMS_KEY] = entropic[REQUEST_SPECULATIVE_KEY]
    sampling_params.custom_params = params


def request_speculation_of(sampling_params, config: EntropicConfig) -> Optional[RequestSpeculation]:
    """The request's own speculation (None: the server's), or ValueError naming the field."""
    value = (sampling_params.custom_params or {}).get(SPECULATIVE_PARAMS_KEY)
    if value is None:
        return None
    max_drafts = None
    if config.speculative_on:  # SGLang's resolved value (the server argument stays None when left to NGRAM's default)
        from sglang.srt.runtime_context import get_spec

        max_drafts = get_spec().speculative_num_draft_tokens - 1
    return request_speculation(value, max_drafts, config.speculative_on and config.speculative.draft == "entropy")


def check_logit_bias(logit_bias: Any) -> None:
    for token, bias in (logit_bias or {}).items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias.{token}: must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")


def request_controllers(
    sampling_params, config: EntropicConfig
) -> tuple[Optional[ControllerState], Optional[MirostatState]]:
    """The request's controller from `custom_params.entropic` (or none), or ValueError naming the field."""
    overrides = (sampling_params.custom_params or {}).get(ENTROPIC_KEY)
    if overrides is None:
        return _server_controller(sampling_params, config)
    if not config.sampling_on:
        raise ValueError(
            f"custom_params.entropic: entropic sampling is not enabled on this server (mode={config.mode})"
        )
    cfg = request_sampling_config(config.sampling, overrides)
    if sampling_params.top_k == 1:
        raise ValueError("custom_params.entropic: needs sampling; temperature 0 (greedy) leaves nothing to control")
    try:
        return _controllers(cfg, sampling_params.temperature)
    except ValueError as err:
        raise ValueError(f"custom_params.entropic: {err}; or set custom_params.entropic.t_init") from None


def _controllers(cfg: SamplingConfig, temperature: float) -> tuple[Optional[ControllerState], Optional[MirostatState]]:
    """The state `cfg` selects; ValueError when the controller's t_init would be out of bounds."""
    if cfg.controller == "mirostat_v2":
        return None, MirostatState.from_config(cfg)
    return ControllerState.from_config(cfg, temperature), None


def _server_controller(
    sampling_params, config: EntropicConfig
) -> tuple[Optional[ControllerState], Optional[MirostatState]]:
    """With `sampling.every_request`, the server's controller for a request that asked for none.

    Greedy requests, and ones whose temperature lies outside [t_min, t_max] with no server t_init,
    stay as sent: a request that asked for nothing is never refused or clipped.
    """
    cfg = config.sampling
    if not (config.sampling_on and cfg.every_request) or sampling_params.top_k == 1:
        return None, None
    try:
        return _controllers(cfg, sampling_params.temperature)
    except ValueError:
        return None, None


def check_prompt(input_ids: Any, vocab_size: int) -> None:
    """A prompt the model can run: at least one token, every id an int in [0, vocab_size).

    Stock SGLang 0.5.23 hands both faults to the scheduler, whose forward then raises and exits:
    an empty prompt in the extend's reshape, an id outside the vocabulary in the embedding.
    """
    if input_ids is None:
        return  # input_embeds or a multimodal prompt: SGLang builds and checks its own
    if not isinstance(input_ids, list):
        raise ValueError("input_ids: must be a list of token ids")
    if not input_ids:
        raise ValueError("the prompt is empty (0 tokens): send at least one token of text or input_ids")
    bad = next((t for t in input_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids: {bad!r} is not a token id of this model (integers in [0, {vocab_size}))")


def before_validate_one_request(manager, obj, input_ids, *args, **kwargs):
    """TokenizerManager._validate_one_request, once per request (batch items too), before SGLang's own checks."""
    if getattr(obj, "input_embeds", None) is None and not obj.contains_mm_input():
        check_prompt(input_ids, manager.model_config.vocab_size)


# OpenAI bodies that SGLang's own pydantic validators read before their types are checked: a body that is not an
# object, or a `response_format` that is not one (ChatCompletionRequest.set_json_schema calls .get on it), is an
# AttributeError there, which FastAPI answers with HTTP 500.
OPENAI_OBJECT_FIELDS = {"/v1/chat/completions": ("response_format",), "/v1/completions": ()}


def check_openai_body(path: str, body: Any) -> None:
    fields = OPENAI_OBJECT_FIELDS.get(path)
    if fields is None:
        return
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    bad = next((f for f in fields if body.get(f) is not None and not isinstance(body[f], dict)), None)
    if bad is not None:
        raise ValueError(f"{bad}: must be a JSON object, not {type(body[bad]).__name__}")


async def around_request_json(original, request, *args, **kwargs):
    """SGLang's body parse (`ORJSONRequest.json`), before FastAPI validates the body: HTTP 400 naming the field."""
    from fastapi import HTTPException

    body = await original(request, *args, **kwargs)
    try:
        check_openai_body(request.url.path, body)
    except ValueError as err:
        raise HTTPException(status_code=400, detail=str(err)) from None
    return body


def check_sampling_params_shape(sampling_params: Any) -> None:
    if isinstance(sampling_params, list) and (
        not sampling_params or not all(isinstance(p, dict) for p in sampling_params)
    ):
        raise ValueError("sampling_params: an object, or a non-empty list of objects (one per prompt)")
    if sampling_params is not None and not isinstance(sampling_params, (dict, list)):
        raise ValueError(f"sampling_params: must be a JSON object, not {type(sampling_params).__name__}")


def around_normalize_batch_and_arguments(original, obj, *args, **kwargs):
    """GenerateReqInput.normalize_batch_and_arguments: it only reshapes the request's own fields, so what it
    raises on them (an IndexError on an empty list, ...) is the request's fault: HTTP 400, not 500."""
    try:  # SGLang's first, so that its fields (is_single) are set: a streamed request's abort reads them
        result = original(obj, *args, **kwargs)
    except (IndexError, KeyError, TypeError, AttributeError) as err:
        check_sampling_params_shape(obj.sampling_params)
        raise ValueError(f"the request's fields do not fit together ({type(err).__name__}: {err})") from None
    if not obj.is_single:  # SGLang splits a batch by index later, outside any 4xx path
        n = len(obj.rid)
        short = next((f for f in PER_PROMPT if isinstance(getattr(obj, f), list) and len(getattr(obj, f)) < n), None)
        if short is not None:
            raise ValueError(f"{short}: {len(getattr(obj, short))} values for a batch of {n} (prompts x n)")
    return result


# A batch's per-prompt lists, as GenerateReqInput.__getitem__ indexes them
PER_PROMPT = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num")


def after_verify(result, sampling_params, *args, **kwargs):
    """SamplingParams.verify, in the tokenizer manager: ValueError -> HTTP 400 / OpenAI BadRequest."""
    check_custom_params_shape(sampling_params.custom_params)
    check_logit_bias(sampling_params.logit_bias)
    config = runtime.current().config
    carry_speculation(sampling_params)
    request_speculation_of(sampling_params, config)
    _, mirostat = request_controllers(sampling_params, config)
    if config.speculative_on:
        from sgl_entropic.plugin.speculation.worker import refuse_request

        refuse_request(sampling_params, mirostat is not None)
