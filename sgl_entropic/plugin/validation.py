"""Request validation, in the HTTP process: a ValueError in `after_verify` becomes HTTP 400.

`request_controllers` is the one check of a request's `custom_params.entropic`: the HTTP
process calls it to validate, the scheduler calls it again to build the request's state
(`admission.py`), so both check exactly the same things.
"""

from __future__ import annotations

from typing import Any, Optional

from sgl_entropic.config import EntropicConfig, SamplingConfig, request_sampling_config
from sgl_entropic.plugin import runtime
from sgl_entropic.sampling import ControllerState, MirostatState

ENTROPIC_KEY = "entropic"  # in custom_params, and the section name in /server_info

# Beyond this a bias (divided by a temperature below 1) overflows float32 to +inf; SGLang's sampler
# then raises on the row (torch.multinomial) and takes the scheduler down. Refused up front instead.
LOGIT_BIAS_LIMIT = 1e30


def check_custom_params_shape(custom_params: Any) -> None:
    """custom_params crosses a msgspec IPC boundary: more than one level of nesting kills the scheduler."""
    if custom_params is None:
        return
    if not isinstance(custom_params, dict):
        raise ValueError("custom_params must be a JSON object")
    scalar = (type(None), bool, int, float, str)
    for key, value in custom_params.items():
        if isinstance(value, dict):
            bad = [k for k, v in value.items() if not isinstance(v, scalar)]
        elif isinstance(value, list):
            bad = [str(i) for i, v in enumerate(value) if not isinstance(v, scalar)]
        else:
            bad = []
        if bad:
            raise ValueError(f"custom_params.{key}.{bad[0]}: nested objects or lists are not allowed here")


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
        raise ValueError(f"custom_params.entropic: entropic sampling is not enabled on this server (mode={config.mode})")
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


def after_verify(result, sampling_params, *args, **kwargs):
    """SamplingParams.verify, in the tokenizer manager: ValueError -> HTTP 400 / OpenAI BadRequest."""
    check_custom_params_shape(sampling_params.custom_params)
    check_logit_bias(sampling_params.logit_bias)
    config = runtime.current().config
    _, mirostat = request_controllers(sampling_params, config)
    if config.speculative_on:
        from sgl_entropic.plugin.speculation import refuse_request

        refuse_request(sampling_params, mirostat is not None)
