"""The signal's record: each step's values become the requests' traces where SGLang processes its result; a
request's totals are sent once."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    from sgl_entropic.plugin.signal import traces

    S = "sglang.srt.managers."
    # fmt: off
    return [
        Hook(S + "scheduler.Scheduler.process_batch_result", "before", traces.before_process_batch_result,
             "scheduler"),
        Hook(S + "scheduler_components.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key",
             "after", traces.after_is_request_level_key, "scheduler"),
    ]
    # fmt: on
