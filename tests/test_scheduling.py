"""Macro loop (sgl_entropic.scheduling): ordering, aging bound, decode budget, gain estimator."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_entropic.config import SchedulingConfig
from sgl_entropic.scheduling import (
    MIN_DENOMINATOR,
    GainEstimator,
    RequestView,
    Scales,
    aged_priority,
    batch_work,
    cost_terms,
    order_waiting,
    priority,
    remaining_output,
    remaining_work,
    select_decode,
)

CFG = SchedulingConfig()
FAST = SchedulingConfig(max_wait=10.0)  # overdue after 10 work units: small enough for short simulations
SCALES = Scales(kv_ref_pages=4.0)

FAST_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def view(rid="r", seq=0, age=0.0, work=1.0, pages=0, gain=1.0, skips=0, tier=0) -> RequestView:
    return RequestView(
        rid=rid, arrival_seq=seq, age=age, work=work, expected_gain=gain, kv_pages=pages, skips=skips, tier=tier
    )


def rids(views, order):
    return [views[i].rid for i in order]


# ----------------------------------------------------------------------------- priority


def test_priority_formula_by_hand():
    cfg = SchedulingConfig(alpha=1.0, beta=2.0, gamma=3.0, max_wait=10.0, max_gain=5.0)
    v = view(age=5.0, work=2.0, pages=8, gain=3.0)
    assert cost_terms(v, cfg, SCALES) == (2.0, 2.0, 0.5)  # C, M = 8/4, L = 1 - 5/10
    assert priority(v, cfg, SCALES) == pytest.approx(3.0 / (2.0 + 4.0 + 1.5))
    assert aged_priority(v, cfg, SCALES) == pytest.approx(3.0 / 7.5 * 1.5)


def test_gain_above_the_servers_cap_counts_as_the_cap():
    cfg = SchedulingConfig(max_gain=1.0)
    assert priority(view(gain=20.0, work=4.0), cfg) == priority(view(gain=1.0, work=4.0), cfg)
    assert priority(view(gain=0.5, work=4.0), cfg) < priority(view(gain=1.0, work=4.0), cfg)


def test_remaining_work_is_exact_under_ignore_eos_and_capped_otherwise():
    cfg = SchedulingConfig(decode_weight=10.0, expected_output_tokens=100)
    assert remaining_output(64, 14, True, cfg) == 50.0  # ignore_eos: max_new_tokens is the work
    assert remaining_output(64, 14, False, cfg) == 50.0  # may stop earlier, never later
    assert remaining_output(1000, 14, False, cfg) == 100.0  # the typical answer
    assert remaining_output(None, 0, True, cfg) == 100.0  # no cap known
    assert remaining_output(10, 30, True, cfg) == 0.0
    assert remaining_work(300, 5.0, cfg) == 350.0
    assert batch_work(300, 4, cfg) == 340.0


def test_latency_slack_falls_and_priority_rises_while_waiting():
    prev_l, prev_pi = math.inf, -math.inf
    for age in range(0, 15):
        _, _, lat = cost_terms(view(age=float(age)), FAST, SCALES)
        pi = priority(view(age=float(age)), FAST, SCALES)
        assert lat <= prev_l and pi >= prev_pi
        prev_l, prev_pi = lat, pi
    assert cost_terms(view(age=10.0), FAST, SCALES)[2] == 0.0
    assert cost_terms(view(age=0.0), FAST, SCALES)[2] == 1.0


def test_denominator_floor_keeps_priority_finite():
    cfg = SchedulingConfig(alpha=0.0, beta=0.0, gamma=1.0, max_wait=1.0)
    pi = priority(view(age=50.0, gain=1.0), cfg, SCALES)
    assert pi == 1.0 / MIN_DENOMINATOR and math.isfinite(pi)
    assert priority(view(age=50.0, gain=0.0), cfg, SCALES) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gain": math.nan},
        {"gain": -0.1},
        {"work": math.inf},
        {"work": -1.0},
        {"age": -1.0},
        {"pages": -2},
        {"skips": -1},
        {"seq": 1.5},
        {"tier": 0.5},
    ],
)
def test_request_view_rejects_bad_values(kwargs):
    with pytest.raises((ValueError, TypeError)):
        view(**kwargs)


def test_scales_reject_nonpositive():
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            Scales(kv_ref_pages=bad)


# ----------------------------------------------------------------------------- ordering


def test_less_remaining_work_first_at_equal_gain():
    vs = [view("big", 0, work=500.0), view("small", 1, work=10.0), view("kv", 2, work=10.0, pages=40)]
    assert rids(vs, order_waiting(vs, CFG)) == ["small", "kv", "big"]


def test_resolved_requests_yield_at_equal_work():
    vs = [view("resolved", 0, gain=0.1), view("open", 1, gain=1.0), view("half", 2, gain=0.5)]
    assert rids(vs, order_waiting(vs, CFG)) == ["open", "half", "resolved"]


def test_ties_broken_by_arrival_seq():
    vs = [view(f"r{s}", s) for s in (5, 2, 9, 0, 7)]
    assert rids(vs, order_waiting(vs, CFG)) == ["r0", "r2", "r5", "r7", "r9"]


def test_cheap_work_and_high_gain_go_first():
    vs = [view("a", 0, gain=1.0), view("b", 1, work=0.1), view("c", 2, gain=1.0), view("d", 3, gain=0.1)]
    assert rids(vs, order_waiting(vs, CFG)) == ["b", "a", "c", "d"]


def test_overdue_requests_go_first_fifo_regardless_of_priority():
    vs = [
        view("fresh_cheap", 9, age=0.0, work=1.0),
        view("old_costly", 3, age=10.0, work=1e6),
        view("older_resolved", 1, age=12.0, gain=0.0),
    ]
    assert rids(vs, order_waiting(vs, FAST, SCALES)) == ["older_resolved", "old_costly", "fresh_cheap"]


def test_user_priority_tiers_come_before_everything_else():
    vs = [
        view("low_overdue", 0, age=1e9, tier=5),
        view("high_costly", 1, work=1e6, tier=-5),
        view("low_cheap", 2, work=0.1, tier=5),
    ]
    assert rids(vs, order_waiting(vs, FAST, SCALES)) == ["high_costly", "low_overdue", "low_cheap"]


views_st = st.lists(
    st.builds(
        lambda g, c, p, w: (g, c, p, w),
        st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]),
        st.sampled_from([0.0, 1.0, 4.0, 100.0]),
        st.integers(0, 8),
        st.sampled_from([0.0, 3.0, 9.5, 10.0, 15.0]),
    ),
    min_size=0,
    max_size=12,
)


@FAST_SETTINGS
@given(views_st, st.randoms(use_true_random=False))
def test_order_is_deterministic_and_permutation_invariant(specs, rnd):
    vs = [view(f"r{i}", i, age=w, pages=p, gain=g, work=c) for i, (g, c, p, w) in enumerate(specs)]
    order = order_waiting(vs, FAST, SCALES)
    assert sorted(order) == list(range(len(vs)))
    shuffled = vs[:]
    rnd.shuffle(shuffled)
    assert rids(shuffled, order_waiting(shuffled, FAST, SCALES)) == rids(vs, order)
    # Non-overdue rows are in non-increasing aged priority.
    fresh = [i for i in order if vs[i].age < 10.0]
    aged = [aged_priority(vs[i], FAST, SCALES) for i in fresh]
    assert aged == sorted(aged, reverse=True)


# ----------------------------------------------------------------------------- starvation: see test_scheduling_aging.py


# ----------------------------------------------------------------------------- decode budget


def test_select_decode_all_rows_without_budget_or_within_it():
    vs = [view(f"r{i}", i, work=float(i)) for i in range(5)]
    assert select_decode(vs, CFG) == [True] * 5
    assert select_decode(vs, SchedulingConfig(decode_budget=5)) == [True] * 5
    assert select_decode([], SchedulingConfig(decode_budget=1)) == []


def test_select_decode_exactly_budget_by_priority_when_none_overdue():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=4)
    vs = [view(f"r{i}", i, work=c, skips=w) for i, (c, w) in enumerate([(3.0, 0), (1.0, 2), (6.0, 1), (2.0, 0)])]
    assert select_decode(vs, cfg) == [False, True, False, True]


def test_select_decode_forced_rows_take_slots_first():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=4)
    vs = [view("cold", 0, gain=0.0, skips=3), view("a", 1, work=0.3), view("b", 2, work=0.5)]
    assert select_decode(vs, cfg) == [True, True, False]


def test_select_decode_guarantee_wins_over_budget():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=3)
    vs = [view(f"r{i}", i, skips=2 + i % 2) for i in range(5)] + [view("x", 9, work=0.01)]
    assert select_decode(vs, cfg) == [True] * 5 + [False]
    # max_skip_steps = 1: every row is always forced.
    assert select_decode(vs, SchedulingConfig(decode_budget=1, max_skip_steps=1)) == [True] * 6


@FAST_SETTINGS
@given(
    st.lists(st.sampled_from([0.0, 0.1, 1.0, 5.0]), min_size=1, max_size=24),
    st.integers(1, 24),
    st.integers(1, 6),
)
def test_every_running_request_decodes_in_every_window(gains, budget, max_skip):
    cfg = SchedulingConfig(decode_budget=budget, max_skip_steps=max_skip)
    n, steps = len(gains), 60
    skipped = [0] * n
    history = []
    for t in range(steps):
        # Priorities drift deterministically so that the favourites change over time.
        vs = [
            view(f"r{i}", i, skips=skipped[i], pages=t // 8, gain=g, work=1.0 + (3 * i + t) % 5)
            for i, g in enumerate(gains)
        ]
        mask = select_decode(vs, cfg)
        forced = sum(s >= max_skip - 1 for s in skipped)
        assert sum(mask) == (n if n <= budget else max(budget, forced))
        if n > budget and forced == 0:
            assert sum(mask) == budget
        assert all(mask[i] for i in range(n) if skipped[i] >= max_skip - 1)
        history.append(mask)
        skipped = [0 if m else s + 1 for s, m in zip(skipped, mask)]
    for i in range(n):
        for start in range(steps - max_skip + 1):
            assert any(history[t][i] for t in range(start, start + max_skip)), (i, start)


# ----------------------------------------------------------------------------- gain estimator


def test_gain_estimator_starts_at_the_cap_and_follows_the_drops():
    est = GainEstimator(SchedulingConfig(gain_ema=0.5, max_gain=1.5))
    assert est.expected_gain == 1.5 and est.last_entropy is None
    expected = [
        (4.0, 1.5),  # first observation: no previous H, the start value stands
        (3.0, 1.25),  # drop 1.0: 0.5*1.5 + 0.5*1.0
        (3.5, 0.625),  # rise: drop 0
        (1.5, 1.3125),  # drop 2.0: 0.5*0.625 + 0.5*2.0
    ]
    for h, g in expected:
        est.observe(h)
        assert est.expected_gain == g
    assert est.last_entropy == 1.5


def test_gain_estimator_decay_zero_and_bad_entropy():
    est = GainEstimator(SchedulingConfig(gain_ema=0.0))
    assert est.expected_gain == 1.0
    est.observe(2.0)
    est.observe(1.25)
    assert est.expected_gain == 0.75  # decay 0: the last drop
    with pytest.raises(ValueError):
        est.observe(math.nan)


def test_gain_estimator_forgets_its_start_geometrically():
    est = GainEstimator(SchedulingConfig(gain_ema=0.8, max_gain=5.0))
    est.observe(1.0)
    for _ in range(50):
        est.observe(1.0)  # constant entropy: no drops
    assert est.expected_gain == pytest.approx(5.0 * 0.8**50)
