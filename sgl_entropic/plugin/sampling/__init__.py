"""The micro loop and the signal's measurement, on SGLang's sampler (scheduler process)."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    from sgl_entropic.plugin.sampling import controller

    S = "sglang.srt."
    # fmt: off
    return [
        Hook(S + "model_executor.forward_batch_info.ForwardBatch.init_new", "after",
             controller.after_forward_batch_init, "scheduler"),
        Hook(S + "model_executor.model_runner.ModelRunner.sample", "around", controller.around_model_runner_sample,
             "scheduler"),
        Hook(S + "layers.sampler.Sampler.forward", "around", controller.around_sampler_forward, "scheduler"),
    ]
    # fmt: on
