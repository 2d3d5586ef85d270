"""The macro loop's SGLang adapters on plain request objects: prefill order, retraction order and
the decode budget's per-step bookkeeping."""

from types import SimpleNamespace

import pytest

from sgl_entropic.config import EntropicConfig
from sgl_entropic.costs import ModelDims
from sgl_entropic.plugin import runtime, scheduling_hooks
from sgl_entropic.scheduling import GainEstimator, Scales


def _install(cfg: EntropicConfig):
    rt = runtime.install(cfg)
    rt.dims = ModelDims(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=4, dense_flops_per_token=1e9)
    rt.scales = Scales(cost_ref_gflop=1.0, kv_ref_pages=1000.0)
    rt.steps = 100
    return rt


@pytest.fixture
def scheduling_on():
    return _install(EntropicConfig(mode="scheduling"))


def _req(rt, rid, prompt_len, entropies=(), arrival_step=100, output_len=0, matched=0):
    state = rt.new_request_state(None, None)
    state.arrival_step = arrival_step
    state.gain = GainEstimator(rt.config.scheduling)
    for h in entropies:
        state.gain.observe(h)
    return SimpleNamespace(rid=rid, entropic=state, origin_input_ids=[0] * prompt_len, output_ids=[0] * output_len,
                           num_matched_prefix_tokens=matched, seqlen=prompt_len + output_len, to_finish=None)


def test_waiting_queue_prefers_cheap_prefill_and_ages(scheduling_on):
    rt = scheduling_on
    long_old = _req(rt, "long-old", 2000)
    short_new = _req(rt, "short-new", 20)
    cached = _req(rt, "cached", 2000, matched=1990)
    queue = [long_old, short_new, cached]
    scheduling_hooks.after_calc_priority(None, None, queue)
    assert [r.rid for r in queue] == ["cached", "short-new", "long-old"]

    # Once overdue (waited past the latency target in scheduler steps), arrival order wins.
    long_old.entropic.arrival_step = 100 - 10_000
    scheduling_hooks.after_calc_priority(None, None, queue)
    assert queue[0].rid == "long-old"


def test_retraction_keeps_uncertain_requests_and_retracts_resolved_ones_first(scheduling_on):
    rt = scheduling_on
    uncertain = _req(rt, "uncertain", 100, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req(rt, "resolved", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    order = scheduling_hooks.around_retraction_order(lambda reqs: pytest.fail("stock order used"), [resolved, uncertain])
    # SGLang retracts from the end of the list: the resolved request goes first.
    assert order == [1, 0]


def test_stock_order_when_scheduling_is_off():
    rt = _install(EntropicConfig(mode="sampling"))
    queue = [_req(rt, "a", 2000), _req(rt, "b", 10)]
    scheduling_hooks.after_calc_priority(None, None, queue)
    assert [r.rid for r in queue] == ["a", "b"]
    assert scheduling_hooks.around_retraction_order(lambda reqs: "stock", queue) == "stock"


def test_decode_budget_keeps_uncertain_rows_then_forces_parked_and_aborting_ones():
    rt = _install(EntropicConfig(mode="scheduling", scheduling={"decode_budget": 1, "max_skip_steps": 3}))
    uncertain = _req(rt, "uncertain", 100, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req(rt, "resolved", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    aborting = _req(rt, "aborting", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    batch = SimpleNamespace(reqs=[uncertain, resolved, aborting])
    assert scheduling_hooks.decode_mask(rt, batch) == [True, False, False]

    aborting.to_finish = "abort"  # an aborted row decodes at once, so its KV is freed
    resolved.entropic.decode_skips = 2  # parked max_skip_steps - 1 steps: must decode now
    assert scheduling_hooks.decode_mask(rt, batch) == [False, True, True]


class _Batch:
    """Just enough of a ScheduleBatch for update_running_batch's decode-budget path."""

    def __init__(self, reqs):
        self.reqs = reqs
        self.prepared = 0
        self.spec_algorithm = SimpleNamespace(is_none=lambda: True)
        self.beam_tail = self.hisparse_coordinator = None
        self.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False),
                                             has_custom_logit_processor=False, watermark_candidates_host=None)

    def is_empty(self):
        return not self.reqs

    def prepare_for_decode(self):
        self.prepared += 1


def test_parked_counts_are_cleared_once_the_batch_fits_the_budget_again():
    # A request parked in a busy period and then running alone must not report waits it never had.
    rt = _install(EntropicConfig(mode="scheduling", scheduling={"decode_budget": 1, "max_skip_steps": 4}))
    scheduler = SimpleNamespace(require_mlp_sync=False)
    busy = _req(rt, "busy", 100, entropies=[4.0, 2.5, 3.8], output_len=3)
    quiet = _req(rt, "quiet", 100, entropies=[0.3, 0.2, 0.1], output_len=3)
    scheduling_hooks.around_update_running_batch(lambda s, b: b, scheduler, _Batch([busy, quiet]))
    rt.split = None
    assert quiet.entropic.decode_skips == 1  # parked this step
    # `busy` finished: `quiet` runs alone, the batch fits the budget, and it decodes every step.
    waits = []
    for _ in range(3):
        scheduling_hooks.around_update_running_batch(lambda s, b: b, scheduler, _Batch([quiet]))
        assert rt.split is None and quiet.entropic.decode_skips == 0
        waits.append(quiet.entropic.parked_before_token)
    assert waits == [1, 0, 0]  # the first lone token waited the one parked step; the later ones nothing
