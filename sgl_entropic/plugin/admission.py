"""A request enters the scheduler: its state is built from the same check the HTTP process ran.

Scheduler process. The first request also teaches the Runtime the served model: its shape
(the cost model), the scheduling scales and priority direction and, with --enable-metrics, the
Prometheus series.
"""

from __future__ import annotations

import logging

from sgl_entropic.config import TRACES_PARAMS_KEY
from sgl_entropic.costs import ModelDims
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.serving.validation import request_controllers, request_speculation_of
from sgl_entropic.scheduling import model_scales

logger = logging.getLogger("sgl_entropic")


def _learn_model(rt: Runtime, scheduler) -> None:
    kv_dtype = scheduler.tp_worker.model_runner.kv_cache_dtype
    rt.dims = ModelDims.from_hf_config(scheduler.model_config.hf_config, kv_bytes_per_element=kv_dtype.itemsize)
    rt.kv_page_size = scheduler.page_size
    rt.scales = model_scales(scheduler.max_total_num_tokens, scheduler.page_size)
    if scheduler.enable_priority_scheduling:
        rt.priority_sign = 1 if scheduler.schedule_low_priority_values_first else -1
    if scheduler.server_args.enable_metrics:
        from sgl_entropic.plugin.metrics import EntropicMetrics

        rt.metrics = EntropicMetrics(speculative=rt.config.speculative_on)


def after_create_generation_req(req, scheduler, *args, **kwargs):
    rt = runtime.current()
    if rt.dims is None:
        _learn_model(rt, scheduler)
    try:
        controllers = request_controllers(req.sampling_params, rt.config)
        speculation = request_speculation_of(req.sampling_params, rt.config)
    except ValueError as err:
        # Validated before in the tokenizer process; should a request get here unchecked, fail it, not the server.
        logger.warning("sgl-entropic: rejecting request %s: %s", req.rid, err)
        controllers, speculation = (None, None), None
        req.set_finish_with_abort(str(err))
    traced = (req.sampling_params.custom_params or {}).get(TRACES_PARAMS_KEY) is True
    req.entropic = rt.new_request_state(*controllers, speculation=speculation, traced=traced)
    return req
