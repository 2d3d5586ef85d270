"""The macro loop on SGLang's scheduler, in the scheduler process: prefill order, retraction order
and the scheduler's clock (the decode budget: `budget.py`). `sgl_entropic.scheduling` decides; this module only
builds its plain views from SGLang requests and applies the answer.

Users' choices first: unless the entropic order is on (mode scheduling, or --schedule-policy
entropic; EntropicConfig.entropic_order) SGLang orders both queues by the user's policies; with
--enable-priority-scheduling every request's `priority` is the first sort key of both orders.
"""

from __future__ import annotations

import sys
from typing import Optional

from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.scheduling import (
    RequestView,
    batch_work,
    order_waiting,
    remaining_output,
    remaining_work,
)


# Matching every waiting request against the radix cache costs a tree walk each; SGLang's own
# cache-aware policies stop matching above this queue length (schedule_policy.py), and so do we.
MATCH_MAX_QUEUE = 128


def priority_tiers(rt: Runtime, reqs) -> list[int]:
    """SGLang's priority as a tier, lower first, under --enable-priority-scheduling; else all 0."""
    if not rt.priority_sign:
        return [0] * len(reqs)
    default = sys.maxsize if rt.priority_sign > 0 else -sys.maxsize - 1  # SGLang's for a request without one
    return [rt.priority_sign * (default if r.priority is None else r.priority) for r in reqs]


def output_left(r, cfg) -> float:
    sp = r.sampling_params
    return remaining_output(sp.max_new_tokens, len(r.output_ids), bool(sp.ignore_eos), cfg)


def request_views(rt: Runtime, reqs, running: bool) -> Optional[list[RequestView]]:
    """Plain views of SGLang requests; None when the loop is off or a request has no state."""
    if not rt.config.scheduling_on or rt.scales is None or any(getattr(r, "entropic", None) is None for r in reqs):
        return None
    cfg = rt.config.scheduling
    views = []
    for r, tier in zip(reqs, priority_tiers(rt, reqs)):
        s = r.entropic
        if running:
            work = remaining_work(0, output_left(r, cfg), cfg)
            pages, skips = -(-r.seqlen // rt.kv_page_size), s.decode_skips
        else:  # a retracted request re-prefills its output too
            uncached = max(0, len(r.origin_input_ids) + len(r.output_ids) - r.num_matched_prefix_tokens)
            work = remaining_work(uncached, output_left(r, cfg), cfg)
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
            tiers = dict(zip(map(id, waiting_queue), priority_tiers(rt, waiting_queue)))
            waiting_queue.sort(key=lambda r: tiers[id(r)])
        return
    if len(waiting_queue) <= MATCH_MAX_QUEUE and not getattr(policy.tree_cache, "disable", True):
        # SGLang matches the radix cache only for its cache-aware policies; C needs the uncached length
        from sglang.srt.mem_cache.common import match_kv_cache

        for r in waiting_queue:
            match_kv_cache(r, policy.tree_cache)
    views = request_views(rt, waiting_queue, running=False)
    if views:
        order = order_waiting(views, rt.config.scheduling, rt.scales)
        waiting_queue[:] = [waiting_queue[i] for i in order]


def around_retraction_order(original, reqs):
    rt = runtime.current()
    if not rt.config.entropic_order:
        order = original(reqs)
        if rt.config.scheduling_on and rt.priority_sign:  # tiers first, SGLang's order inside (a stable sort)
            tiers = priority_tiers(rt, reqs)
            order = sorted(order, key=lambda i: tiers[i])
        return order
    views = request_views(rt, reqs, running=True)
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
