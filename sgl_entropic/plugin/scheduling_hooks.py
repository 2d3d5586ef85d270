"""The macro loop on SGLang's scheduler, in the scheduler process: prefill order, retraction order,
the decode budget and the scheduler's clock. `sgl_entropic.scheduling` decides; this module only
builds its plain views from SGLang requests and applies the answer.

Users' choices first: unless the entropic order is on (mode scheduling, or --schedule-policy
entropic; EntropicConfig.entropic_order) SGLang orders both queues by the user's policies; with
--enable-priority-scheduling every request's `priority` is the first sort key of both orders.
"""

from __future__ import annotations

import copy
import sys
from typing import Optional

from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.scheduling import (
    RequestView,
    advance_skips,
    batch_work,
    order_waiting,
    remaining_output,
    remaining_work,
    select_decode,
)


# Matching every waiting request against the radix cache costs a tree walk each; SGLang's own
# cache-aware policies stop matching above this queue length (schedule_policy.py), and so do we.
MATCH_MAX_QUEUE = 128


def _tiers(rt: Runtime, reqs) -> list[int]:
    """SGLang's priority as a tier, lower first, under --enable-priority-scheduling; else all 0."""
    if not rt.priority_sign:
        return [0] * len(reqs)
    default = sys.maxsize if rt.priority_sign > 0 else -sys.maxsize - 1  # SGLang's for a request without one
    return [rt.priority_sign * (default if r.priority is None else r.priority) for r in reqs]


def _output(r, cfg) -> float:
    sp = r.sampling_params
    return remaining_output(sp.max_new_tokens, len(r.output_ids), bool(sp.ignore_eos), cfg)


def _views(rt: Runtime, reqs, running: bool) -> Optional[list[RequestView]]:
    """Plain views of SGLang requests; None when the loop is off or a request has no state."""
    if not rt.config.scheduling_on or rt.scales is None or any(getattr(r, "entropic", None) is None for r in reqs):
        return None
    cfg = rt.config.scheduling
    views = []
    for r, tier in zip(reqs, _tiers(rt, reqs)):
        s = r.entropic
        if running:
            work = remaining_work(0, _output(r, cfg), cfg)
            pages, skips = -(-r.seqlen // rt.kv_page_size), s.decode_skips
        else:  # a retracted request re-prefills its output too
            uncached = max(0, len(r.origin_input_ids) + len(r.output_ids) - r.num_matched_prefix_tokens)
            work = remaining_work(uncached, _output(r, cfg), cfg)
            pages, skips = 0, 0
        views.append(
            RequestView(
                rid=r.rid,
                arrival_seq=s.arrival_seq,
                age=max(0.0, rt.served - s.arrival_work),
                work=work,
                expected_gain=s.gain.expected_gain,
                kv_pages=pages,
                skips=skips,
                tier=tier,
            )
        )
    return views


def after_calc_priority(result, policy, waiting_queue, *args, **kwargs):
    rt = runtime.current()
    if not waiting_queue or not rt.config.scheduling_on:
        return
    if not rt.config.entropic_order:
        if rt.priority_sign:  # SGLang's cache-aware policies ignore request priorities: tiers first, its order inside
            tiers = dict(zip(map(id, waiting_queue), _tiers(rt, waiting_queue)))
            waiting_queue.sort(key=lambda r: tiers[id(r)])
        return
    if len(waiting_queue) <= MATCH_MAX_QUEUE and not getattr(policy.tree_cache, "disable", True):
        # SGLang matches the radix cache only for its cache-aware policies; C needs the uncached length
        from sglang.srt.mem_cache.common import match_kv_cache

        for r in waiting_queue:
            match_kv_cache(r, policy.tree_cache)
    views = _views(rt, waiting_queue, running=False)
    if views:
        order = order_waiting(views, rt.config.scheduling, rt.scales)
        waiting_queue[:] = [waiting_queue[i] for i in order]


def around_retraction_order(original, reqs):
    rt = runtime.current()
    if not rt.config.entropic_order:
        order = original(reqs)
        if rt.config.scheduling_on and rt.priority_sign:  # tiers first, SGLang's order inside (a stable sort)
            tiers = _tiers(rt, reqs)
            order = sorted(order, key=lambda i: tiers[i])
        return order
    views = _views(rt, reqs, running=True)
    if not views:
        return original(reqs)
    # SGLang retracts from the END of this list: most-preferred first, lowest pi last.
    return order_waiting(views, rt.config.scheduling, rt.scales)


def before_run_batch(scheduler, batch, *args, **kwargs):
    """The scheduler's clock: the work each forward batch serves, counted from the batch itself so
    that every tensor-parallel rank counts the same."""
    rt = runtime.current()
    mode = batch.forward_mode
    if mode.is_decode():
        rt.served += batch_work(0, batch.batch_size(), rt.config.scheduling)
    elif mode.is_extend():
        rt.served += batch_work(batch.extend_num_tokens or 0, 0, rt.config.scheduling)


# ---------------------------------------------------------------------------- decode budget


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
    views = _views(rt, reqs, running=True)
    if views is None:
        return [True] * len(reqs)
    mask = select_decode(views, rt.config.scheduling, rt.scales)
    return [m or r.to_finish is not None for m, r in zip(mask, reqs)]


def around_prepare_for_decode(original, batch):
    if runtime.current().defer_prepare:
        return None
    return original(batch)


def around_update_running_batch(original, scheduler, batch):
    rt = runtime.current()
    rt.defer_prepare = True
    try:
        ret = original(scheduler, batch)
    finally:
        rt.defer_prepare = False
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
    rt.split = split
    return split.decoding


def after_run_batch(result, scheduler, batch, *args, **kwargs):
    rt = runtime.current()
    split, rt.split = rt.split, None
    if split is not None:
        scheduler.running_batch = split.merged()
    return result
