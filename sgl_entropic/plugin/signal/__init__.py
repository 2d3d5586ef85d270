"""The signal's record: each step's values become the requests' traces where SGLang processes its result."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    from sgl_entropic.plugin.signal import traces

    target = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
    return [Hook(target, "before", traces.before_process_batch_result, "scheduler")]
