"""`sgl_entropic.Engine(...)`: an in-process `sgl.Engine` with entropic decoding.

    engine = sgl_entropic.Engine(entropic="full", entropic_config={"sampling": {...}})
    engine.generate("Hi", {"custom_params": {"entropic": {"target_entropy": 1.5}}}, return_entropy=True)

Without model_path it serves the bundled model with the launcher's CPU defaults. The config
reaches the spawned scheduler through the environment only while the engine starts; afterwards
`os.environ` is as it was. One process holds one entropic config at a time: a second engine with
another config is refused while the first is alive (shut it down first); the same config is fine.
Who orders the queues follows the launcher's rules: schedule_policy="entropic" asks for the macro
loop's order, a policy of SGLang's named with the scheduling loop on is kept.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Optional

from sglang.srt.entrypoints.engine import Engine as SGLangEngine

from sgl_entropic.config import CONFIG_ENV, EntropicConfig
from sgl_entropic.server_args import pruning_args, speculative_args, spell_kwarg


class Engine(SGLangEngine):
    _live: ClassVar[dict[int, EntropicConfig]] = {}  # id(engine) -> its config, until shutdown

    def __init__(self, entropic: str = "full", entropic_config: Optional[dict[str, Any]] = None, **kwargs: Any):
        """Validate our config (pydantic ValidationError on bad values), then start `sgl.Engine`."""
        config = EntropicConfig.model_validate({**(entropic_config or {}), "mode": entropic})
        config, kwargs = _queue_policies(config, kwargs)
        config, kwargs = _engine_kwargs(config, kwargs)
        config, updates = speculative_args(config, kwargs, kwargs.get("device", "cuda"), spell_kwarg)
        kwargs = {**kwargs, **updates}
        if any(c != config for c in Engine._live.values()):
            raise ValueError(
                "sgl_entropic.Engine: another engine with a different entropic config is alive in "
                "this process (the HTTP-side hooks hold one config per process); shut it down first"
            )
        from sgl_entropic.cpu import apply_cpu_environment

        apply_cpu_environment(kwargs.get("device", "cuda"))
        previous = os.environ.get(CONFIG_ENV)
        os.environ[CONFIG_ENV] = config.to_env()  # sgl.Engine spawns the scheduler, which reads it
        try:
            _activate_here(config)
            super().__init__(**kwargs)
        finally:
            if previous is None:
                os.environ.pop(CONFIG_ENV, None)
            else:
                os.environ[CONFIG_ENV] = previous
        Engine._live[id(self)] = config

    def shutdown(self):
        Engine._live.pop(id(self), None)
        super().shutdown()


def _queue_policies(config: EntropicConfig, kwargs: dict[str, Any]) -> tuple[EntropicConfig, dict[str, Any]]:
    """The launcher's rule for who orders the queues (EntropicConfig.with_queue_policies), spelled as
    sgl.Engine's parameters: schedule_policy="entropic" runs the macro loop's order over fcfs."""
    policy, config = config.with_queue_policies(
        kwargs.get("schedule_policy"), kwargs.get("retraction_policy"), spell=lambda name, value: f"{name}={value!r}"
    )
    return config, kwargs if policy is None else {**kwargs, "schedule_policy": policy}


def _engine_kwargs(config: EntropicConfig, kwargs: dict[str, Any]) -> tuple[EntropicConfig, dict[str, Any]]:
    if "model_path" not in kwargs:
        from sgl_entropic.model import prepare_bundled_model

        kwargs = {"model_path": str(prepare_bundled_model()), "dtype": "bfloat16", "max_total_tokens": 65536, **kwargs}
    if "device" not in kwargs:
        import torch

        if not torch.cuda.is_available():
            kwargs["device"] = "cpu"
    config, updates = pruning_args(config, kwargs, kwargs.get("device", "cuda"), spell_kwarg)
    return config, {**kwargs, **updates}


def _activate_here(config: EntropicConfig) -> None:
    """This process's hooks run with `config` (load_plugins registers the plugin once per process)."""
    from sglang.srt.plugins import load_plugins

    from sgl_entropic import plugin
    from sgl_entropic.plugin import runtime

    load_plugins()
    rt = runtime.installed()
    if rt is None or rt.config != config:
        plugin.activate(config, apply=True)
