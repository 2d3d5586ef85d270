"""The decode budget on SGLang's scheduler, in the scheduler process: only the top-pi running requests decode
a step (token-level preemption); the others are parked for it and merged back once its forward is launched.
`sgl_entropic.scheduling.select_decode` decides; the split lives on the step (`plugin/step.py`).
"""

from __future__ import annotations

import copy
from typing import Optional

from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.scheduling.policy import request_views
from sgl_entropic.plugin.step import current_step
from sgl_entropic.scheduling import advance_skips, select_decode


class DecodeSplit:
    """The decode budget: when more than `decode_budget` requests are running, only the rows that
    `select_decode` picks (top pi, plus every row parked for max_skip_steps - 1 steps) decode.

    SGLang's own update_running_batch still filters and retracts on the whole running batch;
    only its final prepare_for_decode is deferred, so that KV slots are allocated and sequence
    lengths advanced for the decoding rows alone. Parked rows keep their KV and their last token
    (SGLang relays it per request slot), and are merged back right after the forward is launched,
    so SGLang sees one running batch again before it processes results or admits new requests.
    Rows being aborted always decode, so their KV is freed at once.
    """

    def __init__(self, batch, mask: list[bool]):
        self.decoding = _batch_subset(batch, [i for i, m in enumerate(mask) if m])
        self.parked = _batch_subset(batch, [i for i, m in enumerate(mask) if not m])

    def merged(self):
        running = _batch_subset(self.decoding, None)
        running.merge_batch(self.parked)
        return running


def _batch_subset(batch, keep: Optional[list[int]]):
    """A new ScheduleBatch over some rows; filter/merge rebind tensors, so the source is unchanged."""
    subset = copy.copy(batch)
    subset.sampling_info = copy.copy(batch.sampling_info)
    if keep is not None:
        subset.filter_batch(keep_indices=keep)
    return subset


def _budget_supported(scheduler, batch) -> bool:
    """Batches whose per-row state SGLang keeps outside the split-safe tensors are decoded whole."""
    info = batch.sampling_info
    return (
        batch.spec_algorithm.is_none()
        and batch.beam_tail is None
        and batch.hisparse_coordinator is None
        and not scheduler.require_mlp_sync
        and not info.penalizer_orchestrator.is_required  # frequency/presence/min-tokens state is shared
        and not info.has_custom_logit_processor
        and info.watermark_candidates_host is None
    )


def decode_mask(rt: Runtime, batch) -> list[bool]:
    """Which running rows decode this step: all while the batch fits the budget."""
    reqs = batch.reqs
    if len(reqs) <= rt.config.scheduling.decode_budget:
        return [True] * len(reqs)  # everyone decodes: no need to price the rows
    views = request_views(rt, reqs, running=True)
    if views is None:
        return [True] * len(reqs)
    mask = select_decode(views, rt.config.scheduling, rt.scales)
    return [m or r.to_finish is not None for m, r in zip(mask, reqs)]


def around_prepare_for_decode(original, batch):
    if current_step(runtime.current()).defer_prepare:
        return None
    return original(batch)


def around_update_running_batch(original, scheduler, batch):
    rt = runtime.current()
    step = current_step(rt)
    step.defer_prepare = True
    try:
        ret = original(scheduler, batch)
    finally:
        step.defer_prepare = False
    if ret is None or ret.is_empty():
        return ret
    split = None
    try:
        states = [getattr(r, "entropic", None) for r in ret.reqs]
        if _budget_supported(scheduler, ret) and all(s is not None for s in states):
            mask = decode_mask(rt, ret)
            # every decode step, also when all rows decode: the counts must never go stale
            skips, parked = advance_skips([s.decode_skips for s in states], mask)
            for s, skip, wait in zip(states, skips, parked):
                s.decode_skips, s.parked_before_token = skip, wait
            if not all(mask):
                split = DecodeSplit(ret, mask)
    except Exception:
        rt.fault("the decode budget (the step decodes the whole batch)")
        split = None
    if split is None:
        ret.prepare_for_decode()
        return ret
    split.decoding.prepare_for_decode()
    step.split = split
    return split.decoding


def after_run_batch(result, scheduler, batch, *args, **kwargs):
    step = current_step(runtime.current())
    split, step.split = step.split, None
    if split is not None:
        scheduler.running_batch = split.merged()
    return result
