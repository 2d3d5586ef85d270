"""The macro loop's SGLang adapters on plain request objects: prefill order and retraction order."""

from types import SimpleNamespace

import pytest

from sgl_entropic import plugin
from sgl_entropic.config import EntropicConfig
from sgl_entropic.scheduling import GainEstimator, Scales
from sgl_entropic.signal import EntropyTrace, ModelDims


@pytest.fixture
def scheduling_on(monkeypatch):
    cfg = EntropicConfig(mode="scheduling")
    dims = ModelDims(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=4, dense_flops_per_token=1e9)
    monkeypatch.setattr(plugin, "_config", cfg)
    monkeypatch.setattr(plugin, "_dims", dims)
    monkeypatch.setattr(plugin, "_scales", Scales(cost_ref_gflop=1.0, kv_ref_pages=1000.0))
    monkeypatch.setattr(plugin, "_steps", 100)
    return cfg


def _req(rid, prompt_len, arrival_seq, entropies=(), arrival_step=100, output_len=0, matched=0):
    gain = GainEstimator(EntropicConfig().scheduling)
    for h in entropies:
        gain.observe(h)
    state = plugin.RequestState(EntropyTrace(keep_lists=False), gain, arrival_seq, arrival_step)
    return SimpleNamespace(
        rid=rid,
        entropic=state,
        origin_input_ids=[0] * prompt_len,
        output_ids=[0] * output_len,
        num_matched_prefix_tokens=matched,
        seqlen=prompt_len + output_len,
    )


def test_waiting_queue_prefers_cheap_prefill_and_ages(scheduling_on):
    long_old = _req("long-old", 2000, arrival_seq=1, arrival_step=100)
    short_new = _req("short-new", 20, arrival_seq=2, arrival_step=100)
    cached = _req("cached", 2000, arrival_seq=3, arrival_step=100, matched=1990)
    queue = [long_old, short_new, cached]
    plugin._after_calc_priority(None, None, queue)
    assert [r.rid for r in queue] == ["cached", "short-new", "long-old"]

    # Once overdue (waited past the latency target in scheduler steps), arrival order wins.
    long_old.entropic.arrival_step = 100 - 10_000
    plugin._after_calc_priority(None, None, queue)
    assert queue[0].rid == "long-old"


def test_retraction_keeps_uncertain_requests_and_retracts_resolved_ones_first(scheduling_on):
    uncertain = _req("uncertain", 100, 1, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req("resolved", 100, 2, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    order = plugin._around_retraction_order(lambda reqs: pytest.fail("stock order used"), [resolved, uncertain])
    # SGLang retracts from the end of the list: the resolved request goes first.
    assert order == [1, 0]


def test_stock_order_when_scheduling_is_off(monkeypatch):
    monkeypatch.setattr(plugin, "_config", EntropicConfig(mode="sampling"))
    queue = [_req("a", 2000, 1), _req("b", 10, 2)]
    plugin._after_calc_priority(None, None, queue)
    assert [r.rid for r in queue] == ["a", "b"]
    assert plugin._around_retraction_order(lambda reqs: "stock", queue) == "stock"


def test_decode_budget_keeps_uncertain_rows_then_forces_parked_and_aborting_ones(monkeypatch, scheduling_on):
    cfg = EntropicConfig(mode="scheduling", scheduling={"decode_budget": 1, "max_skip_steps": 3})
    monkeypatch.setattr(plugin, "_config", cfg)
    uncertain = _req("uncertain", 100, 1, entropies=[4.0, 2.5, 3.8, 1.9, 3.5], output_len=5)
    resolved = _req("resolved", 100, 2, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    aborting = _req("aborting", 100, 3, entropies=[0.3, 0.2, 0.1, 0.05, 0.01], output_len=5)
    for r in (uncertain, resolved, aborting):
        r.to_finish = None
    batch = SimpleNamespace(reqs=[uncertain, resolved, aborting])
    assert plugin._decode_mask(batch) == [True, False, False]

    aborting.to_finish = "abort"  # an aborted row decodes at once, so its KV is freed
    resolved.entropic.decode_skips = 2  # parked max_skip_steps - 1 steps: must decode now
    assert plugin._decode_mask(batch) == [False, True, True]
