"""The plugin: the only package that touches SGLang internals (this module and `attention`).

SGLang's `load_plugins()` calls `register()` in every SGLang process (HTTP server, scheduler,
detokenizer, sgl.Engine). All hooks are listed in `_hooks()`; with them, the `entropic` attention
backend (`attention.py`, registered when pruning is on) is the whole surface between sgl-entropic
and SGLang. Without our launcher's config in the environment the plugin
registers nothing, so a plain `python -m sglang.launch_server` stays stock SGLang.
"""

from __future__ import annotations

import contextvars
import gc
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sgl_entropic.config import EntropicConfig, request_sampling_config
from sgl_entropic.sampling import ControllerBatch, ControllerState, MirostatBatch, MirostatState
from sgl_entropic.scheduling import GainEstimator, RequestView, Scales, order_waiting, select_decode
from sgl_entropic.signal import EntropyTrace, ModelDims, step_cost, token_stats

logger = logging.getLogger("sgl_entropic")

_config: Optional[EntropicConfig] = None

ENTROPIC_KEY = "entropic"  # in custom_params, and the section name in /server_info


def register() -> None:
    global _config
    _config = EntropicConfig.from_env()
    if _config is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, hook_type in _hooks():
        HookRegistry.register(target, hook, hook_type)
    if _config.pruning_on:
        _register_attention_backend()
    logger.info("sgl-entropic registered (mode=%s)", _config.mode)


def _register_attention_backend() -> None:
    """`--attention-backend entropic` (the launcher passes it for pruning|full)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sgl_entropic.plugin import attention

    if attention.BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:  # the list SGLang's argparse reads
        ATTENTION_BACKEND_CHOICES.append(attention.BACKEND_NAME)

    @register_attention_backend(attention.BACKEND_NAME)
    def _create(model_runner):
        global _surprisal_store
        backend = attention.create_backend(model_runner, _config.pruning)
        _surprisal_store = backend.planner.store
        return backend


def _hooks() -> list[tuple[str, Callable, Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    return [
        # --- main process (HTTP server / tokenizer manager)
        # request validation: a ValueError here becomes HTTP 400
        ("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, HookType.AFTER),
        # per-token traces -> the public meta_info keys
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
         _after_update_request_meta_info, HookType.AFTER),
        # sgl.Engine.generate(..., return_entropy=True), like the HTTP field
        ("sglang.srt.entrypoints.engine.Engine.generate", _around_engine_generate, HookType.AROUND),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
         _before_generate_request, HookType.BEFORE),
        # --- scheduler process
        ("sglang.srt.managers.scheduler.Scheduler.get_init_info", _after_get_init_info, HookType.AFTER),
        # live per-request state and KV in use, for leak checks (GET /server_info -> internal_states)
        ("sglang.srt.managers.scheduler.Scheduler.get_internal_state", _after_get_internal_state, HookType.AFTER),
        ("sglang.srt.managers.scheduler.Scheduler._create_generation_req", _after_create_generation_req, HookType.AFTER),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", _after_forward_batch_init, HookType.AFTER),
        ("sglang.srt.model_executor.model_runner.ModelRunner.sample", _around_model_runner_sample, HookType.AROUND),
        ("sglang.srt.layers.sampler.Sampler.forward", _around_sampler_forward, HookType.AROUND),
        # macro loop: prefill order and decode retraction order (inert unless scheduling is on)
        ("sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority", _after_calc_priority, HookType.AFTER),
        ("sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order",
         _around_retraction_order, HookType.AROUND),
    ] + (_decode_budget_hooks() if _config.scheduling_on and _config.scheduling.decode_budget else []) + (
        # meso loop: prompt-token surprisal, the block scores of the prefilled KV
        [("sglang.srt.layers.logits_processor.LogitsProcessor.forward", _around_logits_forward, HookType.AROUND)]
        if _config.pruning_on else []
    )


def _decode_budget_hooks() -> list[tuple[str, Callable, Any]]:
    """Token-level preemption: only the top-pi running requests decode a step (see DecodeSplit)."""
    from sglang.srt.plugins.hook_registry import HookType

    return [
        ("sglang.srt.managers.scheduler.Scheduler.update_running_batch", _around_update_running_batch, HookType.AROUND),
        ("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", _around_prepare_for_decode,
         HookType.AROUND),
        ("sglang.srt.managers.scheduler.Scheduler.run_batch", _after_run_batch, HookType.AFTER),
    ]


def _frontend_hooks() -> list[tuple[str, Callable, Any]]:
    """Client-side hooks of the SGLang frontend language (sgl_entropic.gen)."""
    from sglang.srt.plugins.hook_registry import HookType

    return [
        # SglSamplingParams has a fixed field list: carry our params across its clone ...
        ("sglang.lang.interpreter.StreamExecutor._resolve_sampling_params", _around_resolve_sampling_params,
         HookType.AROUND),
        # ... into the request as plain JSON custom_params ...
        ("sglang.lang.ir.SglSamplingParams.to_srt_kwargs", _after_to_srt_kwargs, HookType.AFTER),
        # ... and ask for the traces (the last hook RuntimeEndpoint offers before it posts).
        ("sglang.lang.backend.runtime_endpoint.RuntimeEndpoint._add_images", _after_add_images, HookType.AFTER),
    ]


_frontend_installed = False
_frontend_lock = threading.Lock()  # programs may call sgl_entropic.gen from several threads at once


def install_frontend_hooks() -> None:
    global _frontend_installed
    with _frontend_lock:
        if _frontend_installed:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry

        for target, hook, hook_type in _frontend_hooks():
            HookRegistry.register(target, hook, hook_type)
        HookRegistry.apply_hooks()
        _frontend_installed = True


def hooked_targets_applied() -> dict[str, bool]:
    """Whether each hook target really is wrapped in this process (apply_hooks is not fatal on failure)."""
    import importlib

    applied = {}
    for target, _, _ in _hooks():
        module_name, cls_name, attr = target.rsplit(".", 2)
        try:
            obj = getattr(getattr(importlib.import_module(module_name), cls_name), attr)
            applied[target] = hasattr(obj, "__wrapped__")
        except (ImportError, AttributeError):
            applied[target] = False
    return applied


# ---------------------------------------------------------------------------- validation


def _check_custom_params_shape(custom_params: Any) -> None:
    """custom_params crosses a msgspec IPC boundary: more than one level of nesting kills the scheduler."""
    if custom_params is None:
        return
    if not isinstance(custom_params, dict):
        raise ValueError("custom_params must be a JSON object")
    scalar = (type(None), bool, int, float, str)
    for key, value in custom_params.items():
        if isinstance(value, dict):
            bad = [k for k, v in value.items() if not isinstance(v, scalar)]
        elif isinstance(value, list):
            bad = [str(i) for i, v in enumerate(value) if not isinstance(v, scalar)]
        else:
            bad = []
        if bad:
            raise ValueError(f"custom_params.{key}.{bad[0]}: nested objects or lists are not allowed here")


def request_controllers(sampling_params) -> tuple[Optional[ControllerState], Optional[MirostatState]]:
    """The request's controller from `custom_params.entropic` (or none), or ValueError naming the field.

    The HTTP process calls it to validate (HTTP 400); the scheduler calls it again to build the
    state, so both check exactly the same things.
    """
    overrides = (sampling_params.custom_params or {}).get(ENTROPIC_KEY)
    if overrides is None:
        return None, None
    if not _config.sampling_on:
        raise ValueError(
            f"custom_params.entropic: entropic sampling is not enabled on this server (mode={_config.mode})"
        )
    cfg = request_sampling_config(_config.sampling, overrides)
    if sampling_params.top_k == 1:
        raise ValueError("custom_params.entropic: needs sampling; temperature 0 (greedy) leaves nothing to control")
    if cfg.controller == "mirostat_v2":
        return None, MirostatState.from_config(cfg)
    try:
        return ControllerState.from_config(cfg, sampling_params.temperature), None
    except ValueError as err:
        raise ValueError(f"custom_params.entropic: {err}; or set custom_params.entropic.t_init") from None


# Beyond this a bias (divided by a temperature below 1) overflows float32 to +inf; SGLang's sampler
# then raises on the row (torch.multinomial) and takes the scheduler down. Refused up front instead.
LOGIT_BIAS_LIMIT = 1e30


def _check_logit_bias(logit_bias: Any) -> None:
    for token, bias in (logit_bias or {}).items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias.{token}: must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")


def _after_verify(result, sampling_params, *args, **kwargs):
    _check_custom_params_shape(sampling_params.custom_params)
    _check_logit_bias(sampling_params.logit_bias)
    request_controllers(sampling_params)


# ---------------------------------------------------------------------------- server info


def _after_get_init_info(result, scheduler, *args, **kwargs):
    applied = hooked_targets_applied()
    result[ENTROPIC_KEY] = {
        "mode": _config.mode,
        "active_loops": _config.active_loops,
        "config": _config.model_dump(mode="json"),
        # Computed here, in the scheduler process: proof that the plugin loaded where it matters.
        "plugin_loaded_in_scheduler": True,
        "hooks_applied": all(applied.values()),
        "hooks_missing": [t for t, ok in applied.items() if not ok],
    }
    return result


def _after_get_internal_state(result, scheduler, *args, **kwargs):
    gc.collect()  # a finished Req may sit in a reference cycle until the next collection
    allocator, tree_cache = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    # SGLang keeps finished requests referenced until its next step (last_batch), so a live state
    # is a leak only when no request the scheduler still holds carries it.
    held = {id(getattr(r, "entropic", None)) for r in _requests_held_by(scheduler)}
    live = list(_live_states)
    result.internal_state[ENTROPIC_KEY] = {
        "live_request_states": len(live),
        "leaked_request_states": sum(1 for state in live if id(state) not in held),
        # KV held by requests (the radix cache's evictable prefix pages are not "held")
        "kv_tokens_in_use": scheduler.max_total_num_tokens - allocator.available_size() - tree_cache.evictable_size(),
        "request_slots_in_use": scheduler.req_to_token_pool.size - scheduler.req_to_token_pool.available_size(),
    }
    return result


def _requests_held_by(scheduler) -> list:
    reqs = list(scheduler.waiting_queue) + [r for r in (scheduler.chunked_req,) if r is not None]
    batches = [scheduler.running_batch, scheduler.last_batch, scheduler.cur_batch_for_debug]
    # the overlap loop pins its last two launched batches, and a snapshot of their fields, until reused
    for entry in getattr(scheduler, "batch_record_buf", None) or []:
        if entry:
            batches.append(entry[0])
            reqs += [r for field in entry[1] if isinstance(field, list) for r in field if hasattr(r, "rid")]
    for batch in batches:
        reqs += batch.reqs if batch is not None else []
    return reqs


# ---------------------------------------------------------------------------- per-request state


@dataclass(eq=False)  # identity semantics: tracked in a WeakSet
class RequestState:
    """What the loops keep per request; lives on SGLang's Req as `req.entropic`."""

    trace: EntropyTrace
    gain: GainEstimator
    arrival_seq: int
    arrival_step: int
    controller: Optional[ControllerState] = None
    mirostat: Optional[MirostatState] = None
    decode_skips: int = 0  # consecutive decode steps this running request is parked (decode budget)
    parked_before_token: int = 0  # decode steps it was parked right before the token being sampled


_dims: Optional[ModelDims] = None  # the served model's shape, for the cost model
_scales: Optional[Scales] = None  # rank-independent units of the scheduling terms
_kv_page_size = 1  # SGLang's KV page size (tokens per page)
_arrivals = 0  # admission counter: the same on every TP rank (all ranks get the same requests)
_steps = 0  # forward batches so far: the scheduler's clock, identical on every rank
_metrics: Optional["EntropicMetrics"] = None  # scheduler process, with --enable-metrics
_live_states: "weakref.WeakSet[RequestState]" = weakref.WeakSet()  # proof that finished requests free their state


def _new_request_state(controller: Optional[ControllerState], mirostat: Optional[MirostatState]) -> RequestState:
    global _arrivals
    _arrivals += 1
    state = RequestState(
        trace=EntropyTrace(keep_lists=False),
        gain=GainEstimator(_config.scheduling),
        arrival_seq=_arrivals,
        arrival_step=_steps,
        controller=controller,
        mirostat=mirostat,
    )
    _live_states.add(state)
    return state


def _after_create_generation_req(req, scheduler, *args, **kwargs):
    global _dims, _metrics, _scales, _kv_page_size
    if _dims is None:
        _dims = ModelDims.from_hf_config(scheduler.model_config.hf_config)
        _kv_page_size = scheduler.page_size
        _scales = Scales(
            cost_ref_gflop=step_cost(_dims, 0) / 1e9,  # C in decode-token equivalents
            kv_ref_pages=max(1.0, scheduler.max_total_num_tokens / scheduler.page_size),  # M: fraction of the pool
        )
        if scheduler.server_args.enable_metrics:
            _metrics = EntropicMetrics()
    try:
        controllers = request_controllers(req.sampling_params)
    except ValueError as err:
        # Validated before in the tokenizer process; should a request get here unchecked, fail it, not the server.
        logger.warning("sgl-entropic: rejecting request %s: %s", req.rid, err)
        controllers = (None, None)
        req.set_finish_with_abort(str(err))
    req.entropic = _new_request_state(*controllers)
    return req


# ---------------------------------------------------------------------------- one sampling step


def _after_forward_batch_init(forward_batch, cls, batch, *args, **kwargs):
    global _steps
    _steps += 1
    reqs = list(batch.reqs or ())
    if forward_batch.forward_mode.is_decode():
        produces = [True] * len(reqs)
    else:
        # A middle chunk of a chunked prefill is sampled too, but its token is thrown away.
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        produces = [n >= len(r.origin_input_ids) + len(r.output_ids) for n, r in zip(seq_lens, reqs)]
    forward_batch.entropic_rows = (reqs, produces)
    return forward_batch


_forward_batch = None  # the batch being sampled: ModelRunner.sample -> Sampler.forward
_surprisal_store = None  # the entropic attention backend's per-KV-slot scores (pruning on)


def _around_logits_forward(original, processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    store = _surprisal_store
    if store is not None and isinstance(logits_metadata, ForwardBatch) and logits_metadata.forward_mode.is_extend() \
            and not logits_metadata.forward_mode.is_target_verify():
        try:
            store.record_prompt(processor, hidden_states, lm_head, logits_metadata)
        except Exception:  # unscored slots stay NaN, i.e. always attended
            logger.exception("sgl-entropic: scoring the prompt tokens failed; their blocks stay dense")
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)


def _around_model_runner_sample(original, runner, logits_output, forward_batch, *args, **kwargs):
    global _forward_batch
    _forward_batch = forward_batch
    planner = getattr(runner.attn_backend, "planner", None)
    forward_batch.entropic_attended = planner.attended_fractions(forward_batch) if planner is not None else None
    try:
        return original(runner, logits_output, forward_batch, *args, **kwargs)
    finally:
        _forward_batch = None
        forward_batch.entropic_rows = None  # SGLang may keep the batch; it must not keep finished requests


def _around_sampler_forward(original, sampler, logits_output, sampling_info, *args, **kwargs):
    rows = getattr(_forward_batch, "entropic_rows", None)
    logits = logits_output.next_token_logits
    if rows is None or logits is None or logits.shape[0] != len(rows[0]):
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    # A fault in our per-step work must cost the step its entropic control, never the scheduler.
    try:
        step = SamplingStep(*rows, _forward_batch.seq_lens_cpu.tolist(), sampling_info, logits,
                            getattr(_forward_batch, "entropic_attended", None))
        snapshot = logits.clone()  # the sampler turns logits into probabilities in place
    except Exception:
        logger.exception("sgl-entropic: sampling step setup failed; this step is sampled without control")
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    token_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    try:
        stats = step.record(snapshot, token_ids)
        if _surprisal_store is not None:
            _record_for_pruning(_surprisal_store, _forward_batch.req_pool_indices, rows[1], stats)
    except Exception:
        logger.exception("sgl-entropic: recording the sampling step failed; its trace values are missing")
    return token_ids


def _record_for_pruning(store, req_pool_indices, produces: list[bool], stats) -> None:
    """The sampled token's surprisal scores its KV slot next step; H_t sets the next keep ratio."""
    rows = [i for i, p in enumerate(produces) if p]  # a middle prefill chunk's token is thrown away
    if not rows:
        return
    idx = torch.tensor(rows, device=stats.entropy.device)
    store.record_sampled(req_pool_indices[idx.to(req_pool_indices.device)], stats.surprisal[idx],
                         stats.entropy[idx], stats.valid[idx])


class SamplingStep:
    """One sampling step of a batch, at the point where the distribution is actually sampled.

    Logits arrive after penalties and grammar masks. Controlled rows get this step's temperature
    from this step's logits (zero lag): the row is pre-scaled by T_request / T_new because the
    sampler then divides by the request temperature. Mirostat rows get their truncation mask.
    After sampling, every row's entropy and token surprisal are measured on that same
    distribution (full, before top-k/top-p/min-p) and recorded.
    """

    def __init__(self, reqs, produces, seq_lens, sampling_info, logits, attended: Optional[list[float]] = None):
        self.reqs, self.seq_lens = reqs, seq_lens
        # fraction of the context each row attended in this forward (pruned decode), else all of it
        self.attended = attended or [1.0] * len(reqs)
        self.states = [getattr(r, "entropic", None) if p else None for r, p in zip(reqs, produces)]
        request_t = sampling_info.temperatures.view(-1).float()
        self.inv_request_t = 1.0 / request_t
        greedy = (sampling_info.top_ks.view(-1) == 1).tolist()
        self.used_t = [0.0 if g else t for g, t in zip(greedy, request_t.tolist())]

        ctrl = [i for i, s in enumerate(self.states) if s is not None and s.controller is not None]
        if ctrl:
            idx = torch.tensor(ctrl, device=logits.device)
            z = logits.index_select(0, idx)
            controllers = [self.states[i].controller for i in ctrl]
            batch = ControllerBatch.from_rows(controllers, logits.device)
            new_t, _ = batch.step(z)
            batch.write_back(controllers)
            logits.index_copy_(0, idx, z * (request_t[idx] / new_t).to(z.dtype)[:, None])
            for i, t in zip(ctrl, new_t.tolist()):
                self.used_t[i] = t

        self.mirostat_rows = [i for i, s in enumerate(self.states) if s is not None and s.mirostat is not None]
        if self.mirostat_rows:
            idx = torch.tensor(self.mirostat_rows, device=logits.device)
            z = logits.index_select(0, idx)
            self.mirostat = MirostatBatch.from_rows([self.states[i].mirostat for i in self.mirostat_rows], logits.device)
            self.mirostat_logits = self.mirostat.mask(z * self.inv_request_t[idx][:, None])
            logits.index_copy_(0, idx, z.masked_fill(self.mirostat_logits == float("-inf"), float("-inf")))

    def record(self, snapshot: torch.Tensor, token_ids: torch.Tensor) -> None:
        if self.mirostat_rows:
            idx = torch.tensor(self.mirostat_rows, device=token_ids.device)
            self.mirostat.update(self.mirostat_logits, token_ids.index_select(0, idx))
            self.mirostat.write_back([self.states[i].mirostat for i in self.mirostat_rows])
        stats = token_stats(snapshot, token_ids, self.inv_request_t)
        entropy, surprisal, valid = (t.tolist() for t in (stats.entropy, stats.surprisal, stats.valid))
        step_tau = step_flops = 0.0
        for i, state in enumerate(self.states):
            if state is None:
                continue
            trace = state.trace
            if valid[i]:
                cost = step_cost(_dims, self.seq_lens[i] * self.attended[i])
                step_tau += trace.record(entropy[i], surprisal[i], cost)
                step_flops += cost
                state.gain.observe(entropy[i])
            # null marks a step whose logits were not finite (nothing measured, tau unchanged)
            _append_customized(
                self.reqs[i],
                entropy=entropy[i] if valid[i] else None,
                surprisal=surprisal[i] if valid[i] else None,
                temperature=self.used_t[i],
                parked=state.parked_before_token,
                attended=self.attended[i],
                _entropic_time=trace.tau,
                _entropic_efficiency=trace.efficiency,
            )
        if _metrics is not None:
            _metrics.observe([h for h, ok in zip(entropy, valid) if ok], step_tau, step_flops)
        return stats


class EntropicMetrics:
    """Prometheus series (with --enable-metrics), written from the scheduler process.

    Rates come from the counters: tau rate = rate(sglang:entropic_time_nats_total[1m]);
    d tau/dC = rate(sglang:entropic_time_nats_total[1m]) / rate(sglang:entropic_cost_gflop_total[1m]).
    """

    def __init__(self):
        # imported here: prometheus_client must see PROMETHEUS_MULTIPROC_DIR, set by SGLang at startup
        from prometheus_client import Counter, Gauge, Histogram

        self.entropy = Histogram(
            "sglang:entropic_step_entropy_nats",
            "Entropy of each sampled next-token distribution (nats).",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 11.0),
        )
        self.tau = Counter("sglang:entropic_time_nats", "Entropic time resolved: sum of max(0, H_{t-1} - H_t) (nats).")
        self.cost = Counter("sglang:entropic_cost_gflop", "Decode compute C of the recorded steps (GFLOP).")
        self.efficiency = Gauge(
            "sglang:entropic_efficiency",
            "d tau / dC of the last sampled batch (nats per GFLOP).",
            multiprocess_mode="mostrecent",
        )

    def observe(self, entropies: list[float], step_tau: float, step_flops: float) -> None:
        for h in entropies:
            self.entropy.observe(h)
        self.tau.inc(step_tau)
        self.cost.inc(step_flops / 1e9)
        if step_flops > 0:
            self.efficiency.set(step_tau / (step_flops / 1e9))


def _append_customized(req, **values) -> None:
    """Per-token values travel to the client through SGLang's `req.customized_info` -> meta_info."""
    if req.customized_info is None:
        req.customized_info = {}
    for key, value in values.items():
        req.customized_info.setdefault(key, []).append(value)


# ---------------------------------------------------------------------------- meta_info (main process)

TRACE_KEYS = ("entropy", "surprisal", "temperature", "parked", "attended")


def _after_update_request_meta_info(result, manager, meta_info, state, *args, **kwargs):
    """Cumulative per-token scalars become floats; traces stay only for `return_entropy` requests."""
    for internal, public in (("_entropic_time", "entropic_time"), ("_entropic_efficiency", "entropic_efficiency")):
        values = meta_info.pop(internal, None)
        if values:
            meta_info[public] = values[-1]
    if not getattr(state.obj, "return_entropy", False):
        for key in TRACE_KEYS:
            meta_info.pop(key, None)
    elif "input_token_logprobs" in meta_info:
        # Prompt surprisal on request (return_logprob + logprob_start_len=0): SGLang's own input
        # logprobs, at T = 1; the first prompt token has no prediction (null).
        meta_info["prompt_surprisal"] = [None if lp is None else -lp for lp, *_ in meta_info["input_token_logprobs"]]


# ---------------------------------------------------------------------------- sgl.Engine


_engine_return_entropy = contextvars.ContextVar("sgl_entropic_return_entropy", default=False)


def _around_engine_generate(original, engine, *args, return_entropy: bool = False, **kwargs):
    token = _engine_return_entropy.set(return_entropy)
    try:
        return original(engine, *args, **kwargs)
    finally:
        _engine_return_entropy.reset(token)


def _before_generate_request(manager, obj, *args, **kwargs):
    # Called synchronously inside Engine.generate (it only creates the async generator).
    if _engine_return_entropy.get():
        obj.return_entropy = True


# ---------------------------------------------------------------------------- frontend language


def is_entropic(sampling_params) -> bool:
    return getattr(sampling_params, "entropic", None) is not None


def _around_resolve_sampling_params(original, executor, sampling_params):
    clone = original(executor, sampling_params)
    if is_entropic(sampling_params):
        clone.entropic = dict(sampling_params.entropic)
    return clone


def _after_to_srt_kwargs(result, sampling_params):
    if is_entropic(sampling_params):
        result["custom_params"] = {**(result.get("custom_params") or {}), ENTROPIC_KEY: sampling_params.entropic}
    return result


def _after_add_images(result, endpoint, executor, data):
    if ENTROPIC_KEY in (data["sampling_params"].get("custom_params") or {}):
        data["return_entropy"] = True


# ---------------------------------------------------------------------------- macro loop (scheduler)


def _scheduling_views(reqs, running: bool) -> Optional[list[RequestView]]:
    """Plain views of SGLang requests for sgl_entropic.scheduling; None if any request has no state."""
    if not _config.scheduling_on or _scales is None or any(getattr(r, "entropic", None) is None for r in reqs):
        return None
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    decode_gflop = _scales.cost_ref_gflop
    views = []
    for r in reqs:
        st = r.entropic
        if running:
            # next step: one decode token over the whole context; KV: the pages it holds
            cost, pages, waited = step_cost(_dims, r.seqlen) / 1e9, -(-r.seqlen // _kv_page_size), st.decode_skips
        else:
            # next step: the prefill of its uncached tokens; waiting counted in scheduler steps
            cost, pages, waited = SchedulePolicy._uncached_len(r) * decode_gflop, 0, _steps - st.arrival_step
        views.append(
            RequestView(
                rid=r.rid,
                arrival_seq=st.arrival_seq,
                waited_steps=max(0, waited),
                prompt_len=len(r.origin_input_ids),
                output_len=len(r.output_ids),
                kv_pages=pages,
                expected_gain=st.gain.expected_gain,
                step_cost=cost,
            )
        )
    return views


def _after_calc_priority(result, policy, waiting_queue, *args, **kwargs):
    views = _scheduling_views(waiting_queue, running=False)
    if views:
        order = order_waiting(views, _config.scheduling, _scales)
        waiting_queue[:] = [waiting_queue[i] for i in order]


def _around_retraction_order(original, reqs):
    views = _scheduling_views(reqs, running=True)
    if not views:
        return original(reqs)
    # SGLang retracts from the END of this list: most-preferred first, lowest pi last.
    return order_waiting(views, _config.scheduling, _scales)


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
    import copy

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


def _decode_mask(batch) -> Optional[list[bool]]:
    if len(batch.reqs) <= _config.scheduling.decode_budget:
        return None  # everyone decodes: no need to price the rows every step
    views = _scheduling_views(batch.reqs, running=True)
    if views is None:
        return None
    mask = select_decode(views, _config.scheduling, _scales)
    return [m or r.to_finish is not None for m, r in zip(mask, batch.reqs)]


_defer_prepare = False  # set while SGLang's update_running_batch runs under the decode budget
_split: Optional[DecodeSplit] = None  # this step's split, until the forward is launched


def _around_prepare_for_decode(original, batch):
    if _defer_prepare:
        return None
    return original(batch)


def _around_update_running_batch(original, scheduler, batch):
    global _defer_prepare, _split
    _defer_prepare = True
    try:
        ret = original(scheduler, batch)
    finally:
        _defer_prepare = False
    if ret is None or ret.is_empty():
        return ret
    split = None
    try:
        mask = _decode_mask(ret) if _budget_supported(scheduler, ret) else None
        if mask is not None and not all(mask):
            split = DecodeSplit(ret, mask)
            for req, decodes in zip(ret.reqs, mask):
                st = req.entropic
                if decodes:
                    st.parked_before_token, st.decode_skips = st.decode_skips, 0
                else:
                    st.decode_skips += 1
    except Exception:
        logger.exception("sgl-entropic: decode budget failed; this step decodes the whole batch")
        split = None
    if split is None:
        ret.prepare_for_decode()
        return ret
    split.decoding.prepare_for_decode()
    _split = split
    return split.decoding


def _after_run_batch(result, scheduler, batch, *args, **kwargs):
    global _split
    split, _split = _split, None
    if split is not None:
        scheduler.running_batch = split.merged()
    return result
