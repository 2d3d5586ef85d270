"""The meso loop: decode attends the KV pages that matter, through the `entropic` attention backend
(`backend.py` on CPU, `flashinfer.py` on CUDA), registered with SGLang when pruning or speculation is on."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    if not config.pruning_on:
        return []
    from sgl_entropic.plugin.attention import backend, page_store

    S = "sglang.srt."
    # fmt: off
    table = [  # the page store comes out of the KV budget; pruned steps leave CUDA graphs
        Hook(S + "mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget", "around",
             page_store.around_config_from_budget, "scheduler"),
        Hook(S + "model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph", "around",
             backend.around_can_run_graph, "scheduler"),
    ]
    if config.pruning.selector == "surprisal":  # its prompt scores, from the model's logits
        table.append(Hook(S + "layers.logits_processor.LogitsProcessor.forward", "around",
                          backend.around_logits_forward, "scheduler"))
    # fmt: on
    return table
