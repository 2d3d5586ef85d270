"""The plugin: the only package that touches SGLang internals.

SGLang's `load_plugins()` calls `register()` in every SGLang process (HTTP server, scheduler, DP controller,
detokenizer, sgl.Engine). `hook_table()` below lists every hook, in one screen; with the
`entropic` attention backend (`attention.py`, registered when pruning is on) it is the whole
surface between sgl-entropic and SGLang. Without our launcher's config in the environment the
plugin registers nothing, so a plain `python -m sglang.launch_server` stays stock SGLang.

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
    """Every hook of `config`; with `times`, each scheduler-process handler records its own time there."""
    from sgl_entropic.plugin import (
        admission,
        meta_info,
        openai_ext,
        sampling_step,
        scheduling_hooks,
        server_info,
        validation,
    )

    S, budget = "sglang.srt.", config.scheduling_on and config.scheduling.decode_budget is not None
    table = [
        # target                                                                    kind      handler
        # --- main process: HTTP server / tokenizer manager / sgl.Engine
        Hook(S + "sampling.sampling_params.SamplingParams.verify", "after", validation.after_verify, "main"),
        Hook(
            S + "managers.tokenizer_manager.TokenizerManager._validate_one_request",
            "before",
            validation.before_validate_one_request,
            "main",
        ),
        Hook(S + "entrypoints.http_server.ORJSONRequest.json", "around", validation.around_request_json, "main"),
        Hook(
            S + "managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
            "around",
            validation.around_normalize_batch_and_arguments,
            "main",
        ),
        Hook(
            S + "managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
            "after",
            meta_info.after_update_request_meta_info,
            "main",
        ),
        Hook(S + "entrypoints.engine.Engine.generate", "around", meta_info.around_engine_generate, "main"),
        Hook(
            S + "managers.tokenizer_manager.TokenizerManager.generate_request",
            "before",
            meta_info.before_generate_request,
            "main",
        ),
        # the OpenAI endpoints: sglext.entropic when asked (openai_ext.py)
        *(
            Hook(S + f"entrypoints.openai.{module}.{cls}.{fn}", kind, handler, "main")
            for module, cls, build, stream in (
                ("serving_chat", "OpenAIServingChat", "_build_chat_response", "_generate_chat_stream"),
                (
                    "serving_completions",
                    "OpenAIServingCompletion",
                    "_build_completion_response",
                    "_generate_completion_stream",
                ),
            )
            for fn, kind, handler in (
                ("_convert_to_internal_request", "after", openai_ext.after_convert_request),
                (build, "after", openai_ext.after_build_response),
                (stream, "around", openai_ext.around_stream),
            )
        ),
        # --- scheduler process (the first hook closes a step of the plugin's own clock: timing.py)
        Hook(
            S + "managers.scheduler.Scheduler.get_next_batch_to_run",
            "before",
            timing.before_get_next_batch_to_run,
            "scheduler",
        ),
        Hook(S + "managers.scheduler.Scheduler.get_init_info", "after", server_info.after_get_init_info, "scheduler"),
        Hook(
            S + "managers.scheduler.Scheduler.get_internal_state",
            "after",
            server_info.after_get_internal_state,
            "scheduler",
        ),
        Hook(
            S + "managers.scheduler.Scheduler._create_generation_req",
            "after",
            admission.after_create_generation_req,
            "scheduler",
        ),
        Hook(
            S + "model_executor.forward_batch_info.ForwardBatch.init_new",
            "after",
            sampling_step.after_forward_batch_init,
            "scheduler",
        ),
        Hook(
            S + "model_executor.model_runner.ModelRunner.sample",
            "around",
            sampling_step.around_model_runner_sample,
            "scheduler",
        ),
        Hook(S + "layers.sampler.Sampler.forward", "around", sampling_step.around_sampler_forward, "scheduler"),
        Hook(
            S + "managers.scheduler.Scheduler.process_batch_result",
            "before",
            sampling_step.before_process_batch_result,
            "scheduler",
        ),
        # --- with --dp-size N: the DP controller forwards only its own keys of the schedulers' init info
        Hook(
            S + "managers.data_parallel_controller.DataParallelController.get_init_info",
            "after",
            server_info.after_dp_get_init_info,
            "dp_controller",
        ),
    ]
    if config.scheduling_on:  # macro loop: its clock, prefill order and retraction order
        table += [
            Hook(
                S + "managers.scheduler.Scheduler.run_batch", "before", scheduling_hooks.before_run_batch, "scheduler"
            ),
            Hook(
                S + "managers.schedule_policy.SchedulePolicy.calc_priority",
                "after",
                scheduling_hooks.after_calc_priority,
                "scheduler",
            ),
            Hook(
                S + "managers.schedule_batch.ScheduleBatch._get_decode_retraction_order",
                "around",
                scheduling_hooks.around_retraction_order,
                "scheduler",
            ),
        ]
    if budget:  # token-level preemption: only the top-pi running requests decode a step
        table += [
            Hook(
                S + "managers.scheduler.Scheduler.update_running_batch",
                "around",
                scheduling_hooks.around_update_running_batch,
                "scheduler",
            ),
            Hook(
                S + "managers.schedule_batch.ScheduleBatch.prepare_for_decode",
                "around",
                scheduling_hooks.around_prepare_for_decode,
                "scheduler",
            ),
            Hook(S + "managers.scheduler.Scheduler.run_batch", "after", scheduling_hooks.after_run_batch, "scheduler"),
        ]
    if config.pruning_on:  # the page store comes out of the KV budget; pruned steps leave CUDA graphs
        from sgl_entropic.plugin import attention, page_store

        table += [
            Hook(
                S + "mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget",
                "around",
                page_store.around_config_from_budget,
                "scheduler",
            ),
            Hook(
                S + "model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
                "around",
                attention.around_can_run_graph,
                "scheduler",
            ),
        ]
        if config.pruning.selector == "surprisal":  # its prompt scores, from the model's logits
            table.append(
                Hook(
                    S + "layers.logits_processor.LogitsProcessor.forward",
                    "around",
                    attention.around_logits_forward,
                    "scheduler",
                )
            )
    if config.speculative_on:  # NGRAM: its cost table, the step's width (plain at 1), verification (speculation.py)
        from sgl_entropic.plugin import speculation

        worker = S + "speculative.ngram_worker.NGRAMWorker."
        table += [
            Hook(worker + "alloc_memory_pool", "after", speculation.after_alloc_memory_pool, "scheduler"),
            Hook(
                worker + "_prepare_for_speculative_decoding",
                "around",
                speculation.around_prepare_for_speculative_decoding,
                "scheduler",
            ),
            Hook(
                worker + "forward_batch_generation", "around", speculation.around_forward_batch_generation, "scheduler"
            ),
            Hook(worker + "_update_ngram_corpus", "around", speculation.around_update_ngram_corpus, "scheduler"),
            Hook(S + "speculative.eagle_utils.eagle_sample", "around", speculation.around_eagle_sample, "scheduler"),
            # SGLang's draft-slot allocation picks a Triton kernel unless the backend is named torch_native
            Hook(S + "mem_cache.allocation.get_last_loc", "around", speculation.around_get_last_loc, "scheduler"),
        ]
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
        from sgl_entropic.plugin import attention

        attention.register_backend()
    if apply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
        hooks.report_missing("main")
    logger.info(
        "sgl-entropic registered (mode=%s; speculative decoding %s)", config.mode, config.speculative.source or "off"
    )
