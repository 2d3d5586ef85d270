"""What the scheduler reports about the plugin: `/server_info` sections (scheduler process).

`entropic` (from `Scheduler.get_init_info`, computed in the scheduler itself): the mode, the
config and the status of every hook in this process. `internal_states[i].entropic` (live):
request states and KV in use, for leak checks.
"""

from __future__ import annotations

import gc
import itertools

from sgl_entropic.plugin import hooks, runtime
from sgl_entropic.plugin.serving.validation import ENTROPIC_KEY


def after_get_init_info(result, scheduler, *args, **kwargs):
    rt = runtime.current()
    missing = hooks.report_missing("scheduler")
    result[ENTROPIC_KEY] = {
        "mode": rt.config.mode,
        "active_loops": rt.config.active_loops,
        "config": rt.config.model_dump(mode="json"),
        # Computed here, in the scheduler process: proof that the plugin loaded where it matters.
        "plugin_loaded_in_scheduler": True,
        "sglang_version": hooks.installed_sglang_version(),
        "hooks_applied": not missing,
        "hooks_missing": missing,
    }
    if rt.config.scheduling_on:
        result[ENTROPIC_KEY]["scheduling"] = applied_order(rt, scheduler)
        if rt.config.entropic_order:
            result["schedule_policy"] = (
                "entropic"  # /server_info reports the order that runs, not SGLang's fcfs under it
            )
    if rt.config.pruning_on and rt.probe is not None:
        probe = rt.probe
        result[ENTROPIC_KEY]["pruning"] = {
            "min_context": rt.pruning_from,  # rows shorter than this attend densely
            "dense_kernel_from": probe.dense_kernel_from,  # where our kernel serves steps that do not prune
            "self_check": probe.check.as_json(),
            # one decode step's attention over every layer, ms: SGLang's dense loop, our kernel over every
            # page, our pruned path (against the better dense one)
            "crossover_ms": [
                {
                    "context": k.context,
                    "dense": k.dense_s * 1e3,
                    "kernel_all_pages": k.sparse_s * 1e3,
                    "pruned": t.sparse_s * 1e3 if t else None,
                }
                for k, t in itertools.zip_longest(probe.kernel_timings, probe.timings)
            ],
            "page_store_bytes": rt.pages.nbytes if rt.pages is not None else 0,
        }
    return result


def applied_order(rt, scheduler) -> dict:
    """Which order each queue really runs under: the users' choices first (scheduling/policy.py)."""
    args, ours = scheduler.server_args, rt.config.entropic_order
    return {
        "waiting_order": "entropic" if ours else args.schedule_policy,
        "retraction_order": "entropic" if ours else args.retraction_policy,
        "sglang_policy_under_it": args.schedule_policy,
        "request_priority_first": bool(args.enable_priority_scheduling),
        "decode_budget": rt.config.scheduling.decode_budget,
    }


def after_dp_get_init_info(result, controller, *args, **kwargs):
    """With --dp-size N: every rank's section merged into the one /server_info shows."""
    infos = controller._scheduler_init_infos
    sections = [info[ENTROPIC_KEY] for info in infos if ENTROPIC_KEY in info]
    if sections:
        result[ENTROPIC_KEY] = {
            **sections[0],
            "plugin_loaded_in_scheduler": len(sections) == len(infos),
            "hooks_applied": all(s["hooks_applied"] for s in sections),
            "hooks_missing": sorted({t for s in sections for t in s["hooks_missing"]}),
            "ranks": len(infos),
        }
        if "schedule_policy" in infos[0]:
            result["schedule_policy"] = infos[0]["schedule_policy"]
    return result


def after_get_internal_state(result, scheduler, *args, **kwargs):
    rt = runtime.current()
    allocator, tree_cache = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    # SGLang keeps finished requests referenced until its next step (last_batch), so a live state
    # is a leak only when no request the scheduler still holds carries it.
    held = {id(getattr(r, "entropic", None)) for r in _requests_held_by(scheduler)}
    leaked = sum(1 for state in list(rt.live_states) if id(state) not in held)
    if leaked:  # may be garbage in a reference cycle, not yet collected: collect before calling it a leak
        gc.collect()
        leaked = sum(1 for state in list(rt.live_states) if id(state) not in held)
    result.internal_state[ENTROPIC_KEY] = {
        "dp_rank": _dp_rank(),  # with --dp-size N every scheduler reports its own (internal_states[i])
        "requests_admitted": rt.arrivals,
        "work_served": rt.served,  # the macro loop's clock (scheduling.batch_work; counted with scheduling on)
        "live_request_states": len(rt.live_states),
        "leaked_request_states": leaked,
        # KV held by requests (the radix cache's evictable prefix pages are not "held")
        "kv_tokens_in_use": scheduler.max_total_num_tokens - allocator.available_size() - tree_cache.evictable_size(),
        "request_slots_in_use": scheduler.req_to_token_pool.size - scheduler.req_to_token_pool.available_size(),
        "signal": {"tau_nats": rt.tau_total, "cost_flops": rt.cost_total},  # over every token: d tau/dC
        "plugin_time": rt.times.summary(),  # the hook handlers' own time per decode step (timing.py)
        "degraded_steps": dict(rt.degraded),  # faults in the plugin's step work, by where (Runtime.fault)
    }
    if rt.speculation is not None:  # the draft rule at work (plugin/speculation/)
        result.internal_state[ENTROPIC_KEY]["speculative"] = rt.speculation.summary()
    return result


def _dp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    rank = get_parallel().dp_rank
    return 0 if rank is None else rank


def _requests_held_by(scheduler) -> list:
    reqs = list(scheduler.waiting_queue) + [r for r in (scheduler.chunked_req,) if r is not None]
    batches = [scheduler.running_batch, scheduler.last_batch, scheduler.cur_batch_for_debug]
    # the overlap loop pins its last two launched batches, and a snapshot of their fields, until reused
    for entry in getattr(scheduler, "batch_record_buf", None) or []:
        if entry:
            batches.append(entry[0])
            reqs += [r for field in entry[1] if isinstance(field, list) for r in field if hasattr(r, "rid")]
    for batch in batches:
        if batch is not None:
            # a batch keeps the last chunked request merged into it (an emptied running batch too) until the next
            reqs += batch.reqs + [r for r in (getattr(batch, "chunked_req", None),) if r is not None]
    return reqs
