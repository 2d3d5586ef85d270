"""The only module that touches SGLang internals.

SGLang's `load_plugins()` calls `register()` in every SGLang process (HTTP server, scheduler,
detokenizer, sgl.Engine). All hooks are listed in `_hooks()`: that list is the whole surface
between sgl-entropic and SGLang. Without our launcher's config in the environment the plugin
registers nothing, so a plain `python -m sglang.launch_server` stays stock SGLang.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

from sgl_entropic.config import EntropicConfig, request_sampling_config

logger = logging.getLogger("sgl_entropic")

_config: Optional[EntropicConfig] = None

ENTROPIC_KEY = "entropic"  # in custom_params, and the section name in /server_info


def register() -> None:
    global _config
    _config = EntropicConfig.from_env()
    if _config is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, hook_type in _hooks():
        HookRegistry.register(target, hook, hook_type)
    logger.info("sgl-entropic registered (mode=%s)", _config.mode)


def _hooks() -> list[tuple[str, Callable, Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    return [
        # main process: request validation becomes HTTP 400
        ("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, HookType.AFTER),
        # scheduler process
        ("sglang.srt.managers.scheduler.Scheduler.get_init_info", _after_get_init_info, HookType.AFTER),
    ]


def hooked_targets_applied() -> dict[str, bool]:
    """Whether each hook target really is wrapped in this process (apply_hooks is not fatal on failure)."""
    import importlib

    applied = {}
    for target, _, _ in _hooks():
        module_name, cls_name, attr = target.rsplit(".", 2)
        try:
            obj = getattr(getattr(importlib.import_module(module_name), cls_name), attr)
            applied[target] = hasattr(obj, "__wrapped__")
        except (ImportError, AttributeError):
            applied[target] = False
    return applied


# ---------------------------------------------------------------------------- validation


def _check_custom_params_shape(custom_params: Any) -> None:
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


def _after_verify(result, sampling_params, *args, **kwargs):
    custom = sampling_params.custom_params
    _check_custom_params_shape(custom)
    if not custom or ENTROPIC_KEY not in custom:
        return
    if not _config.sampling_on:
        raise ValueError(
            f"custom_params.entropic: entropic sampling is not enabled on this server (mode={_config.mode})"
        )
    cfg = request_sampling_config(_config.sampling, custom[ENTROPIC_KEY])
    if sampling_params.top_k == 1:
        raise ValueError("custom_params.entropic: needs sampling; temperature 0 (greedy) leaves nothing to control")
    if cfg.controller == "entropic" and cfg.t_init is None:
        temp = sampling_params.temperature
        if not cfg.t_min <= temp <= cfg.t_max:
            raise ValueError(
                f"temperature ({temp}) is the controller's start and must lie in "
                f"[t_min, t_max] = [{cfg.t_min}, {cfg.t_max}]; set custom_params.entropic.t_init"
            )


# ---------------------------------------------------------------------------- server info


def _after_get_init_info(result, scheduler, *args, **kwargs):
    applied = hooked_targets_applied()
    result[ENTROPIC_KEY] = {
        "mode": _config.mode,
        "config": _config.model_dump(mode="json"),
        # Computed here, in the scheduler process: proof that the plugin loaded where it matters.
        "plugin_loaded_in_scheduler": True,
        "hooks_applied": all(applied.values()),
        "hooks_missing": [t for t, ok in applied.items() if not ok],
    }
    return result
