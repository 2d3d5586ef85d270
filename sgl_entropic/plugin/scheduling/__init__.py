"""The macro loop on SGLang's scheduler: its clock, the prefill and retraction orders, the decode budget."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    if not config.scheduling_on:
        return []
    from sgl_entropic.plugin.scheduling import budget, policy

    S, M = "sglang.srt.managers.", "sglang.srt.managers.scheduler.Scheduler."
    # fmt: off
    table = [
        Hook(M + "run_batch", "before", policy.before_run_batch, "scheduler"),
        Hook(S + "schedule_policy.SchedulePolicy.calc_priority", "after", policy.after_calc_priority, "scheduler"),
        Hook(S + "schedule_batch.ScheduleBatch._get_decode_retraction_order", "around",
             policy.around_retraction_order, "scheduler"),
    ]
    if config.scheduling.decode_budget is not None:  # token-level preemption: only the top-pi rows decode a step
        table += [
            Hook(M + "update_running_batch", "around", budget.around_update_running_batch, "scheduler"),
            Hook(S + "schedule_batch.ScheduleBatch.prepare_for_decode", "around", budget.around_prepare_for_decode,
                 "scheduler"),
            Hook(M + "run_batch", "after", budget.after_run_batch, "scheduler"),
        ]
    # fmt: on
    return table
