"""The plugin: the only package that touches SGLang internals.

SGLang's `load_plugins()` calls `register()` in every SGLang process (HTTP server, scheduler, DP controller,
detokenizer, sgl.Engine). `hook_table()` below gathers every hook: the scheduler loop's own here, then each
loop's table from its package (`serving/` the HTTP side, `sampling/` the controller on SGLang's sampler,
`signal/` the traces, `scheduling/`, `attention/` pruning, `speculation/` NGRAM); with the `entropic`
attention backend (`attention/backend.py`, registered when pruning or speculation is on) it is the whole
surface between sgl-entropic and SGLang. A step's state is one `step.Step` (`step.py`, `loop.py`). Without
our launcher's config in the environment the plugin registers nothing, so a plain
`python -m sglang.launch_server` stays stock SGLang.

Version guard: the hooks rely on private SGLang internals (`SchedulePolicy._uncached_len`,
`LogitsProcessor._get_logits`, `TorchNativeAttnBackend._run_sdpa_forward_decode`,
`RuntimeEndpoint._add_images`, ...) as they are in SGLang `SUPPORTED_SGLANG`. On any other
version `register()` refuses to load the loops (an error in the log, the server stays stock)
unless SGLANG_ENTROPIC_ALLOW_UNSUPPORTED_SGLANG=1, which loads them with a warning; then the
hook check (`/server_info` -> entropic.hooks_missing) tells which targets no longer exist.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin import hooks, runtime, timing
from sgl_entropic.plugin.hooks import SUPPORTED_SGLANG, Hook

logger = logging.getLogger("sgl_entropic")

ALLOW_UNSUPPORTED_ENV = "SGLANG_ENTROPIC_ALLOW_UNSUPPORTED_SGLANG"


def hook_table(config: EntropicConfig, times: Optional[timing.HookTimes] = None) -> tuple[Hook, ...]:
    """Every hook of `config`, each loop's from its own table; with `times`, each scheduler-process handler
    records its own time there."""
    from sgl_entropic.plugin import admission, attention, loop, sampling, scheduling, server_info, serving, signal
    from sgl_entropic.plugin import speculation

    S, M = "sglang.srt.", "sglang.srt.managers.scheduler.Scheduler."
    # fmt: off
    table = [  # the scheduler process's own: a step's boundaries (step.py), admission, what /server_info reports
        Hook(M + "get_next_batch_to_run", "before", loop.before_get_next_batch_to_run, "scheduler"),
        Hook(M + "run_batch", "after", loop.after_run_batch, "scheduler"),
        Hook(M + "_create_generation_req", "after", admission.after_create_generation_req, "scheduler"),
        Hook(M + "get_init_info", "after", server_info.after_get_init_info, "scheduler"),
        Hook(M + "get_internal_state", "after", server_info.after_get_internal_state, "scheduler"),
        # with --dp-size N: the DP controller forwards only its own keys of the schedulers' init info
        Hook(S + "managers.data_parallel_controller.DataParallelController.get_init_info", "after",
             server_info.after_dp_get_init_info, "dp_controller"),
    ]
    # fmt: on
    for package in (serving, sampling, signal, scheduling, attention, speculation):
        table += package.hooks(config)
    return timing.timed(table, times) if times is not None else tuple(table)


def sglang_supported() -> bool:
    return hooks.installed_sglang_version() == SUPPORTED_SGLANG


def register() -> None:
    """SGLang's plugin entry point: the loops of the config our launcher put in the environment."""
    config = EntropicConfig.from_env()
    if config is not None:
        activate(config)


def activate(config: EntropicConfig, apply: bool = False) -> None:
    """Register the hooks of `config` and make it this process's Runtime.

    `apply` applies them at once, for callers outside SGLang's load_plugins (sgl_entropic.Engine
    switching an engine process to a new config); load_plugins applies them itself.
    """
    if not sglang_supported():
        found = hooks.installed_sglang_version()
        if os.environ.get(ALLOW_UNSUPPORTED_ENV) != "1":
            logger.error(
                "sgl-entropic supports sglang %s, found %s: the entropic loops are NOT loaded "
                "(set %s=1 to try them anyway)",
                SUPPORTED_SGLANG,
                found,
                ALLOW_UNSUPPORTED_ENV,
            )
            return
        logger.warning(
            "sgl-entropic supports sglang %s, found %s: loading the loops anyway (%s=1); "
            "check /server_info entropic.hooks_missing",
            SUPPORTED_SGLANG,
            found,
            ALLOW_UNSUPPORTED_ENV,
        )
    times = timing.HookTimes()
    table = hook_table(config, times)
    runtime.install(config, table, times)
    hooks.register(table)
    if config.pruning_on or config.speculative_on:
        from sgl_entropic.plugin.attention import backend

        backend.register_backend()
    if apply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
        hooks.report_missing("main")
    logger.info(
        "sgl-entropic registered (mode=%s; speculative decoding %s)", config.mode, config.speculative.source or "off"
    )
