"""Macro loop (sgl_entropic.scheduling): ordering, aging bound, decode budget, gain estimator."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_entropic.config import SchedulingConfig
from sgl_entropic.scheduling import (
    DEFAULT_MEAN_ENTROPY_NATS,
    MIN_DENOMINATOR,
    GainEstimator,
    RequestView,
    Scales,
    age_limit_steps,
    aged_priority,
    cost_terms,
    order_waiting,
    prior_gain,
    priority,
    retraction_order,
    select_decode,
)

CFG = SchedulingConfig()
# A = ceil(1.0 / 0.1) = 10 steps: small enough for short simulations.
FAST = SchedulingConfig(latency_target_s=1.0)
SCALES = Scales(step_time_s=0.1)

FAST_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def view(rid="r", seq=0, waited=0, prompt=16, out=0, pages=0, gain=1.0, cost=1.0) -> RequestView:
    return RequestView(
        rid=rid,
        arrival_seq=seq,
        waited_steps=waited,
        prompt_len=prompt,
        output_len=out,
        kv_pages=pages,
        expected_gain=gain,
        step_cost=cost,
    )


def rids(views, order):
    return [views[i].rid for i in order]


# ----------------------------------------------------------------------------- priority


def test_priority_formula_by_hand():
    cfg = SchedulingConfig(alpha=1.0, beta=2.0, gamma=3.0, latency_target_s=1.0)
    scales = Scales(cost_ref_gflop=2.0, kv_ref_pages=4.0, step_time_s=0.1)
    v = view(waited=5, cost=4.0, pages=8, gain=3.0)
    assert age_limit_steps(cfg, scales) == 10
    assert cost_terms(v, cfg, scales) == (2.0, 2.0, 0.5)  # C, M, L = 1 - 5/10
    assert priority(v, cfg, scales) == pytest.approx(3.0 / (2.0 + 4.0 + 1.5))
    assert aged_priority(v, cfg, scales) == pytest.approx(3.0 / 7.5 * 1.5)


def test_age_limit_steps_rounding():
    assert age_limit_steps(CFG) == 500  # 10 s / 0.02 s
    assert age_limit_steps(SchedulingConfig(latency_target_s=0.3), Scales(step_time_s=0.1)) == 3
    assert age_limit_steps(SchedulingConfig(latency_target_s=0.7), Scales(step_time_s=0.1)) == 7
    assert age_limit_steps(SchedulingConfig(latency_target_s=0.25), Scales(step_time_s=0.1)) == 3
    assert age_limit_steps(SchedulingConfig(latency_target_s=0.01), Scales(step_time_s=1.0)) == 1


def test_latency_slack_falls_and_priority_rises_while_waiting():
    prev_l, prev_pi = math.inf, -math.inf
    for w in range(0, 15):
        _, _, lat = cost_terms(view(waited=w), FAST, SCALES)
        pi = priority(view(waited=w), FAST, SCALES)
        assert lat <= prev_l and pi >= prev_pi
        prev_l, prev_pi = lat, pi
    assert cost_terms(view(waited=10), FAST, SCALES)[2] == 0.0
    assert cost_terms(view(waited=0), FAST, SCALES)[2] == 1.0


def test_denominator_floor_keeps_priority_finite():
    cfg = SchedulingConfig(alpha=0.0, beta=0.0, gamma=1.0, latency_target_s=1.0)
    pi = priority(view(waited=50, gain=2.0), cfg, SCALES)
    assert pi == 2.0 / MIN_DENOMINATOR and math.isfinite(pi)
    assert priority(view(waited=50, gain=0.0), cfg, SCALES) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gain": math.nan},
        {"gain": -0.1},
        {"cost": math.inf},
        {"cost": -1.0},
        {"waited": -1},
        {"pages": -2},
        {"seq": 1.5},
    ],
)
def test_request_view_rejects_bad_values(kwargs):
    with pytest.raises((ValueError, TypeError)):
        view(**kwargs)


def test_scales_reject_nonpositive():
    with pytest.raises(ValueError):
        Scales(step_time_s=0.0)
    with pytest.raises(ValueError):
        Scales(kv_ref_pages=math.nan)


# ----------------------------------------------------------------------------- ordering


def test_higher_gain_first_at_equal_cost():
    vs = [view("lo", 0, gain=0.5), view("hi", 1, gain=2.0), view("mid", 2, gain=1.0)]
    assert rids(vs, order_waiting(vs, CFG)) == ["hi", "mid", "lo"]


def test_lower_cost_first_at_equal_gain():
    vs = [view("big", 0, cost=500.0), view("small", 1, cost=10.0), view("kv", 2, cost=10.0, pages=40)]
    assert rids(vs, order_waiting(vs, CFG)) == ["small", "kv", "big"]


def test_ties_broken_by_arrival_seq():
    vs = [view(f"r{s}", s) for s in (5, 2, 9, 0, 7)]
    assert rids(vs, order_waiting(vs, CFG)) == ["r0", "r2", "r5", "r7", "r9"]


def test_retraction_reverses_priority():
    vs = [view("a", 0, gain=1.0), view("b", 1, gain=3.0), view("c", 2, gain=1.0), view("d", 3, gain=0.1)]
    assert rids(vs, order_waiting(vs, CFG)) == ["b", "a", "c", "d"]
    assert rids(vs, retraction_order(vs, CFG)) == ["d", "c", "a", "b"]


def test_overdue_requests_go_first_fifo_regardless_of_priority():
    vs = [
        view("fresh_hot", 9, waited=0, gain=100.0),
        view("old_cold", 3, waited=10, gain=0.0),
        view("older_cold", 1, waited=12, gain=0.0),
    ]
    assert rids(vs, order_waiting(vs, FAST, SCALES)) == ["older_cold", "old_cold", "fresh_hot"]


views_st = st.lists(
    st.builds(
        lambda g, c, p, w: (g, c, p, w),
        st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]),
        st.sampled_from([0.0, 1.0, 4.0, 100.0]),
        st.integers(0, 8),
        st.integers(0, 15),
    ),
    min_size=0,
    max_size=12,
)


@FAST_SETTINGS
@given(views_st, st.randoms(use_true_random=False))
def test_order_is_deterministic_and_permutation_invariant(specs, rnd):
    vs = [view(f"r{i}", i, waited=w, pages=p, gain=g, cost=c) for i, (g, c, p, w) in enumerate(specs)]
    order = order_waiting(vs, FAST, SCALES)
    assert sorted(order) == list(range(len(vs)))
    shuffled = vs[:]
    rnd.shuffle(shuffled)
    assert rids(shuffled, order_waiting(shuffled, FAST, SCALES)) == rids(vs, order)
    assert retraction_order(vs, FAST, SCALES) == order[::-1]
    # Non-overdue rows are in non-increasing aged priority.
    fresh = [i for i in order if vs[i].waited_steps < 10]
    aged = [aged_priority(vs[i], FAST, SCALES) for i in fresh]
    assert aged == sorted(aged, reverse=True)


# ----------------------------------------------------------------------------- starvation


def pure_pi_order(views, cfg, scales):
    """The 'no aging' baseline: the paper's pi alone, ties by arrival."""
    return sorted(range(len(views)), key=lambda i: (-priority(views[i], cfg, scales), views[i].arrival_seq))


def simulate_admission(arrivals, capacity, steps, order_fn, cfg=FAST, scales=SCALES):
    """Each step: new arrivals join; the first `capacity` of order_fn(waiting) are admitted.

    arrivals[t] is a list of (rid, gain, cost).  Returns (admitted {rid: step},
    arrived {rid: (step, seq)}, r {rid: #earlier-arrived waiting when it became overdue},
    and a list of violations of the position claim).
    """
    a_lim = age_limit_steps(cfg, scales)
    waiting: list[tuple[str, int, int, float, float]] = []  # rid, seq, arrival step, gain, cost
    admitted, arrived, r_at_overdue, bad_positions = {}, {}, {}, []
    seq = 0
    for t in range(steps):
        for rid, gain, cost in arrivals[t] if t < len(arrivals) else ():
            waiting.append((rid, seq, t, gain, cost))
            arrived[rid] = (t, seq)
            seq += 1
        views = [view(rid, s, waited=t - a, gain=g, cost=c) for rid, s, a, g, c in waiting]
        order = order_fn(views, cfg, scales)
        for pos, i in enumerate(order):
            rid, s, a, _, _ = waiting[i]
            if t - a >= a_lim:
                earlier = sum(1 for w in waiting if w[1] < s)
                if t - a == a_lim:
                    r_at_overdue[rid] = earlier
                if pos > earlier:
                    bad_positions.append((t, rid, pos, earlier))
        take = set(order[:capacity])
        for i in take:
            admitted[waiting[i][0]] = t
        waiting = [w for i, w in enumerate(waiting) if i not in take]
    return admitted, arrived, r_at_overdue, bad_positions


def _hot_stream_with_one_cold(steps, cold_at=3):
    arrivals = []
    for t in range(steps):
        row = [(f"hot{t}a", 10.0, 1.0), (f"hot{t}b", 10.0, 1.0)]  # 2 arrivals/step, 1 slot/step
        if t == cold_at:
            row.append(("cold", 0.01, 1.0))
        arrivals.append(row)
    return arrivals


def test_low_priority_request_is_admitted_within_the_bound():
    steps = 120
    a_lim = age_limit_steps(FAST, SCALES)
    admitted, arrived, r, bad = simulate_admission(_hot_stream_with_one_cold(steps), 1, steps, order_waiting)
    assert not bad
    a_cold = arrived["cold"][0]
    assert "cold" in admitted
    assert admitted["cold"] <= a_cold + a_lim + r["cold"]
    # Any request that reached its age limit obeyed the same bound.
    for rid, r_s in r.items():
        if rid in admitted:
            assert admitted[rid] <= arrived[rid][0] + a_lim + r_s
        else:
            assert steps - 1 < arrived[rid][0] + a_lim + r_s


def test_same_simulation_without_aging_starves_the_low_priority_request():
    steps = 120
    admitted, _, _, _ = simulate_admission(_hot_stream_with_one_cold(steps), 1, steps, pure_pi_order)
    assert "cold" not in admitted  # 117 steps, > 10x the age limit, and still waiting


arrival_st = st.lists(
    st.lists(st.tuples(st.sampled_from([0.0, 0.01, 1.0, 10.0]), st.sampled_from([0.5, 1.0, 50.0])), max_size=3),
    min_size=1,
    max_size=30,
)


@FAST_SETTINGS
@given(
    arrival_st,
    st.integers(1, 3),
    st.sampled_from([(1.0, 1.0, 1.0), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (5.0, 1.0, 0.2)]),
    st.sampled_from([(0.5, 0.1), (1.0, 0.1), (0.1, 1.0)]),
)
def test_starvation_bound_holds_for_any_stream(raw, capacity, weights, timing):
    alpha, beta, gamma = weights
    target, step = timing
    cfg = SchedulingConfig(alpha=alpha, beta=beta, gamma=gamma, latency_target_s=target)
    scales = Scales(step_time_s=step)
    a_lim = age_limit_steps(cfg, scales)
    arrivals = [[(f"t{t}n{k}", g, c) for k, (g, c) in enumerate(row)] for t, row in enumerate(raw)]
    steps = 40
    admitted, arrived, r, bad = simulate_admission(arrivals, capacity, steps, order_waiting, cfg, scales)
    assert not bad
    for rid, (a, _) in arrived.items():
        # Admitted by a + A + r_s (r_s = 0 if admitted before it became overdue); a request
        # still waiting at the end must not have passed that step yet.
        deadline = a + a_lim + r.get(rid, 0)
        assert admitted.get(rid, steps) <= deadline or (rid not in admitted and steps <= deadline)


# ----------------------------------------------------------------------------- decode budget


def test_select_decode_all_rows_without_budget_or_within_it():
    vs = [view(f"r{i}", i, gain=float(i)) for i in range(5)]
    assert select_decode(vs, CFG) == [True] * 5
    assert select_decode(vs, SchedulingConfig(decode_budget=5)) == [True] * 5
    assert select_decode([], SchedulingConfig(decode_budget=1)) == []


def test_select_decode_exactly_budget_by_priority_when_none_overdue():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=4)
    vs = [view(f"r{i}", i, gain=g, waited=w) for i, (g, w) in enumerate([(1.0, 0), (3.0, 2), (0.5, 1), (2.0, 0)])]
    assert select_decode(vs, cfg) == [False, True, False, True]


def test_select_decode_forced_rows_take_slots_first():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=4)
    vs = [view("cold", 0, gain=0.0, waited=3), view("a", 1, gain=3.0), view("b", 2, gain=2.0)]
    assert select_decode(vs, cfg) == [True, True, False]


def test_select_decode_guarantee_wins_over_budget():
    cfg = SchedulingConfig(decode_budget=2, max_skip_steps=3)
    vs = [view(f"r{i}", i, waited=2 + i % 2) for i in range(5)] + [view("x", 9, gain=9.0)]
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
            view(f"r{i}", i, waited=skipped[i], out=t, pages=t // 8, gain=g * (1 + (3 * i + t) % 5))
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


def test_prior_gain():
    assert prior_gain(None) == 0.5 * DEFAULT_MEAN_ENTROPY_NATS == 1.0
    assert prior_gain(3.0) == 1.5
    assert prior_gain(0.0) == 0.0
    assert GainEstimator.prior_gain(4.0) == 2.0
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError):
            prior_gain(bad)


def test_gain_estimator_ema_hand_sequence():
    est = GainEstimator(SchedulingConfig(gain_ema=0.5), prompt_mean_surprisal=3.0)
    assert est.expected_gain == 1.5 and est.num_drops == 0 and est.last_entropy is None
    expected = [
        (4.0, 1.5),  # first observation: no previous H, the prior stands
        (3.0, 1.25),  # drop 1.0: 0.5*1.5 + 0.5*1.0
        (3.5, 0.625),  # rise: drop 0
        (1.5, 1.3125),  # drop 2.0: 0.5*0.625 + 0.5*2.0
    ]
    for h, g in expected:
        est.observe(h)
        assert est.expected_gain == g
    assert est.num_drops == 3 and est.last_entropy == 1.5


def test_gain_estimator_default_prior_and_decay_zero():
    est = GainEstimator(SchedulingConfig(gain_ema=0.0))
    assert est.expected_gain == 1.0
    est.observe(2.0)
    est.observe(1.25)
    assert est.expected_gain == 0.75  # decay 0: the last drop
    with pytest.raises(ValueError):
        est.observe(math.nan)


def test_gain_estimator_forgets_prior_geometrically():
    est = GainEstimator(SchedulingConfig(gain_ema=0.8), prompt_mean_surprisal=10.0)
    est.observe(1.0)
    for _ in range(50):
        est.observe(1.0)  # constant entropy: no drops
    assert est.expected_gain == pytest.approx(5.0 * 0.8**50)


def test_gain_memory_keeps_the_latest_gain_per_prompt_prefix_and_forgets_the_oldest():
    from sgl_entropic.scheduling import GainMemory, initial_gain

    memory = GainMemory(prefix_tokens=4, capacity=2)
    a, b, c = memory.key([1, 2, 3, 4, 5]), memory.key([1, 2, 3, 9]), memory.key([7])
    assert a == memory.key([1, 2, 3, 4, 99])  # only the first 4 tokens count
    memory.put(a, 0.5)
    memory.put(b, 0.2)
    memory.put(a, 0.7)  # a is now the most recent
    memory.put(c, 0.1)  # over capacity: b, the least recently written, goes
    assert (memory.get(a), memory.get(b), memory.get(c), len(memory)) == (0.7, None, 0.1, 2)
    assert initial_gain(0.7, 3.0) == 0.7  # what was seen beats any prior
    assert initial_gain(None, 3.0) == 1.5 and initial_gain(None, None) == 1.0
    with pytest.raises(ValueError):
        memory.put(a, float("nan"))
