"""The macro loop's SGLang adapters on plain request objects: prefill order, retraction order,
the clock and the decode budget's per-step bookkeeping."""

from types import SimpleNamespace

import pytest

from sgl_entropic.config import EntropicConfig
from sgl_entropic.costs import ModelDims
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.scheduling import budget, policy
from sgl_entropic.plugin.step import current_step
from sgl_entropic.scheduling import Scales

NO_CACHE = SimpleNamespace(tree_cache=SimpleNamespace(disable=True))  # the SchedulePolicy, radix cache off


def _install(cfg: EntropicConfig):
    rt = runtime.install(cfg)
    rt.dims = ModelDims(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=4, dense_flops_per_token=1e9)
    rt.scales = Scales(kv_ref_pages=1000.0)
    rt.served = 1000.0
    return rt


@pytest.fixture
def scheduling_on():
    return _install(EntropicConfig(mode="scheduling"))


def _req(rt, rid, prompt_len, entropies=(), output_len=0, matched=0, max_new=16, ignore_eos=True, priority=None):
    state = rt.new_request_state(None, None)
    for h in entropies:
        state.gain.observe(h)
    return SimpleNamespace(
        rid=rid,
        entropic=state,
        origin_input_ids=[0] * prompt_len,
        output_ids=[0] * output_len,
        num_matched_prefix_tokens=matched,
        seqlen=prompt_len + output_len,
        to_finish=None,
        sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos),
        priority=priority,
    )


def order(queue):
    policy.after_calc_priority(None, NO_CACHE, queue)
    return [r.rid for r in queue]


def test_waiting_queue_prefers_less_remaining_work_and_ages(scheduling_on):
    rt = scheduling_on
    long_old = _req(rt, "long-old", 2000)
    short_new = _req(rt, "short-new", 20)
    cached = _req(rt, "cached", 2000, matched=1990)
    long_answer = _req(rt, "long-answer", 20, max_new=100)  # 84 decode tokens more than short-new
    queue = [long_old, short_new, cached, long_answer]
    assert order(queue) == ["cached", "short-new", "long-answer", "long-old"]
    # Once overdue (the server served max_wait work units since its arrival), arrival order wins.
    rt.served += rt.config.scheduling.max_wait
    late = _req(rt, "late-tiny", 1)
    assert order(queue + [late]) == ["long-old", "short-new", "cached", "long-answer", "late-tiny"]


def test_the_clock_counts_the_work_of_every_forward_batch_once(scheduling_on):
    rt = scheduling_on
    w = rt.config.scheduling.decode_weight

    def batch(mode, rows=0, extend=None):
        fm = SimpleNamespace(is_decode=lambda: mode == "decode", is_extend=lambda: mode == "extend")
        return SimpleNamespace(forward_mode=fm, batch_size=lambda: rows, extend_num_tokens=extend)

    policy.before_run_batch(None, batch("extend", extend=300))
    policy.before_run_batch(None, batch("decode", rows=4))
    policy.before_run_batch(None, batch("idle"))
    assert rt.served == 1000.0 + 300 + 4 * w
    assert rt.new_request_state(None, None).arrival_work == rt.served


def test_a_retracted_request_keeps_its_age(scheduling_on):
    rt = scheduling_on
    back = _req(rt, "retracted", 50, output_len=10)  # arrived at served = 1000, ran, was retracted
    rt.served += rt.config.scheduling.max_wait + 1
    fresh = _req(rt, "fresh", 5)
    assert order([fresh, back]) == ["retracted", "fresh"]  # overdue: ahead of a cheaper, younger one


def test_retraction_keeps_uncertain_requests_and_retracts_resolved_ones_first(scheduling_on):
    rt = scheduling_on
    uncertain = _req(rt, "uncertain", 100, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req(rt, "resolved", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    order = policy.around_retraction_order(lambda reqs: pytest.fail("stock order used"), [resolved, uncertain])
    # SGLang retracts from the end of the list: the resolved request goes first.
    assert order == [1, 0]


def test_stock_order_when_scheduling_is_off_or_left_to_sglang():
    for cfg in (EntropicConfig(mode="sampling"), EntropicConfig(mode="scheduling", scheduling={"order": "sglang"})):
        rt = _install(cfg)
        queue = [_req(rt, "a", 2000), _req(rt, "b", 10)]
        assert order(queue) == ["a", "b"]
        assert policy.around_retraction_order(lambda reqs: "stock", queue) == "stock"


def test_request_priorities_come_first_in_both_orders(scheduling_on):
    rt = scheduling_on
    rt.priority_sign = -1  # --enable-priority-scheduling, higher values first (SGLang's default)
    vip = _req(rt, "vip", 3000, priority=10)
    plain = _req(rt, "plain", 10)  # no priority: SGLang's lowest
    mid = _req(rt, "mid", 500, priority=1)
    assert order([plain, mid, vip]) == ["vip", "mid", "plain"]
    keep = policy.around_retraction_order(lambda reqs: pytest.fail("stock"), [plain, vip, mid])
    assert keep == [1, 2, 0]  # SGLang retracts from the end: the request without a priority first
    rt.priority_sign = 1  # --schedule-low-priority-values-first
    assert order([plain, mid, vip]) == ["mid", "vip", "plain"]


def test_decode_budget_keeps_uncertain_rows_then_forces_parked_and_aborting_ones():
    rt = _install(EntropicConfig(mode="scheduling", scheduling={"decode_budget": 1, "max_skip_steps": 3}))
    uncertain = _req(rt, "uncertain", 100, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req(rt, "resolved", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    aborting = _req(rt, "aborting", 100, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    batch = SimpleNamespace(reqs=[uncertain, resolved, aborting])
    assert budget.decode_mask(rt, batch) == [True, False, False]

    aborting.to_finish = "abort"  # an aborted row decodes at once, so its KV is freed
    resolved.entropic.decode_skips = 2  # parked max_skip_steps - 1 steps: must decode now
    assert budget.decode_mask(rt, batch) == [False, True, True]


class _Batch:
    """Just enough of a ScheduleBatch for update_running_batch's decode-budget path."""

    def __init__(self, reqs):
        self.reqs = reqs
        self.prepared = 0
        self.spec_algorithm = SimpleNamespace(is_none=lambda: True)
        self.beam_tail = self.hisparse_coordinator = None
        self.sampling_info = SimpleNamespace(
            penalizer_orchestrator=SimpleNamespace(is_required=False),
            has_custom_logit_processor=False,
            watermark_candidates_host=None,
        )

    def is_empty(self):
        return not self.reqs

    def prepare_for_decode(self):
        self.prepared += 1

    def filter_batch(self, keep_indices):  # ScheduleBatch.filter_batch: the rows kept, in order
        self.reqs = [self.reqs[i] for i in keep_indices]

    def merge_batch(self, other):
        self.reqs = self.reqs + other.reqs


def test_parked_counts_are_cleared_once_the_batch_fits_the_budget_again():
    # A request parked in a busy period and then running alone must not report waits it never had.
    rt = _install(EntropicConfig(mode="scheduling", scheduling={"decode_budget": 1, "max_skip_steps": 4}))
    scheduler = SimpleNamespace(require_mlp_sync=False)
    busy = _req(rt, "busy", 100, entropies=[4.0, 2.5, 3.8], output_len=3)
    quiet = _req(rt, "quiet", 100, entropies=[0.3, 0.2, 0.1], output_len=3)
    decoding = budget.around_update_running_batch(lambda s, b: b, scheduler, _Batch([busy, quiet]))
    assert not rt.degraded  # the split ran (a fault would decode the whole batch and pass unseen)
    assert decoding.reqs == [busy] and decoding.prepared == 1 and current_step(rt).split.merged().reqs == [busy, quiet]
    current_step(rt).split = None
    assert quiet.entropic.decode_skips == 1  # parked this step
    # `busy` finished: `quiet` runs alone, the batch fits the budget, and it decodes every step.
    waits = []
    for _ in range(3):
        budget.around_update_running_batch(lambda s, b: b, scheduler, _Batch([quiet]))
        assert current_step(rt).split is None and quiet.entropic.decode_skips == 0
        waits.append(quiet.entropic.parked_before_token)
    assert waits == [1, 0, 0]  # the first lone token waited the one parked step; the later ones nothing


def test_request_priorities_come_first_under_the_users_own_policy_too():
    rt = _install(EntropicConfig(mode="scheduling", scheduling={"order": "sglang"}))
    rt.priority_sign = -1
    reqs = [_req(rt, "plain-a", 10), _req(rt, "vip", 3000, priority=10), _req(rt, "plain-b", 20)]
    assert order(list(reqs)) == ["vip", "plain-a", "plain-b"]  # tiers, then SGLang's order (kept: a stable sort)
    keep = policy.around_retraction_order(lambda rs: [2, 0, 1], reqs)  # SGLang's own keep order
    assert keep == [1, 2, 0]
