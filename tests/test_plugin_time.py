"""The plugin's own price (plugin/timing.py): per-hook time folded into decode steps, around handlers
without the original they wrap, and the real server's /server_info report."""

from __future__ import annotations

import sys

import pytest

from sgl_entropic.plugin.hooks import Hook
from sgl_entropic.plugin.timing import HookTimes, timed
from tests.conftest import ROOT


class Clock:
    """A nanosecond clock that moves only when told."""

    def __init__(self):
        self.t = 0

    def __call__(self) -> int:
        return self.t


def test_boundary_folds_only_decode_steps_into_totals():
    clock = Clock()
    times = HookTimes(now=clock)
    a, b = times.add("A.f:before"), times.add("B.g:around")
    assert times.boundary(decode=True) is None  # the first boundary only starts a step
    times.ns[a], times.calls[a], times.ns[b], times.calls[b] = 200, 2, 300, 1
    clock.t = 10_000
    assert times.boundary(decode=True) == (500, 10_000)
    times.ns[a], times.calls[a] = 7_000, 1  # a prefill step: not a decode step, not counted
    clock.t = 30_000
    assert times.boundary(decode=False) is None
    times.ns[a], times.calls[a] = 1_000, 1
    clock.t = 35_000
    assert times.boundary(decode=True) == (1_000, 5_000)
    s = times.summary()
    assert s["steps"] == 2
    assert s["hooks"]["A.f:before"] == {"calls": 3, "mean_us_per_step": pytest.approx(0.6)}
    assert s["hooks"]["B.g:around"] == {"calls": 1, "mean_us_per_step": pytest.approx(0.15)}
    assert s["mean_us_per_step"] == pytest.approx(0.75)
    assert s["mean_step_us"] == pytest.approx(7.5)
    assert s["mean_share"] == pytest.approx((0.05 + 0.2) / 2)  # the mean of per-step shares, not of sums
    assert times.ns == [0, 0] and times.calls == [0, 0]  # the next step starts from zero


def test_no_decode_step_reports_none():
    s = HookTimes(now=Clock()).summary()
    assert s["steps"] == 0 and s["mean_share"] is None and s["mean_us_per_step"] is None


def _table(handlers):
    return [Hook(f"pkg.mod.Cls.{name}", kind, fn, process) for name, kind, fn, process in handlers]


def test_around_handlers_exclude_the_original_and_nested_hooks_count_once():
    clock = Clock()
    times = HookTimes(now=clock)

    def inner_original(x):
        clock.t += 1_000  # SGLang's own work
        return x + 1

    def inner(original, x):
        clock.t += 30  # the inner handler's own work
        return original(x)

    def outer(original, x):
        clock.t += 50
        y = original(x)
        clock.t += 20
        return y

    def before(x):
        clock.t += 7

    def main_only(x):
        clock.t += 1_000_000  # another process's hook: not wrapped, not timed

    table = timed(
        _table(
            [
                ("inner", "around", inner, "scheduler"),
                ("outer", "around", outer, "scheduler"),
                ("before", "before", before, "scheduler"),
                ("main", "after", main_only, "main"),
            ]
        ),
        times,
    )
    t_inner, t_outer, t_before, t_main = (h.handler for h in table)
    assert t_main is main_only and times.names == ["Cls.inner:around", "Cls.outer:around", "Cls.before:before"]
    assert t_inner.__wrapped__ is inner and t_inner.__name__ == "inner"  # hooks.is_applied finds ours

    times.boundary(decode=True)
    for _ in range(2):
        t_before(0)
        # the outer hook's original runs the inner hook (as ModelRunner.sample runs Sampler.forward)
        assert t_outer(lambda x: t_inner(inner_original, x), 1) == 2
    assert times.ns == [60, 140, 14] and times.calls == [2, 2, 2]
    total = clock.t
    assert times.boundary(decode=True) == (214, total)  # everything else was "SGLang's"


def test_a_raising_handler_is_still_timed():
    clock = Clock()
    times = HookTimes(now=clock)

    def boom(x):
        clock.t += 5
        raise ValueError("x")

    (hook,) = timed(_table([("boom", "after", boom, "scheduler")]), times)
    with pytest.raises(ValueError):
        hook.handler(1)
    assert times.ns == [5] and times.calls == [1]


def test_sglang_s_work_called_by_label_is_not_the_plugin_s_and_is_reported_over_decode_steps():
    clock = Clock()
    times = HookTimes(now=clock)

    def match(x):
        clock.t += 400  # SGLang's n-gram matcher, called a row at a time by the plugin
        return x * 2

    def handler(x):
        clock.t += 25
        return times.sglang_named("ngram", match, x) + times.sglang_named("ngram", match, x)

    (hook,) = timed(_table([("plan", "before", handler, "scheduler")]), times)
    times.boundary(decode=True)
    assert hook.handler(3) == 12 and times.ns == [25]
    clock.t += 1_000
    times.boundary(decode=True)
    hook.handler(1)  # a step that is not a decode step: neither counted
    clock.t += 1_000
    times.boundary(decode=False)
    s = times.summary()
    assert s["steps"] == 1 and s["mean_us_per_step"] == pytest.approx(0.025)
    assert s["sglang_us_per_step"] == {"ngram": pytest.approx(0.8)}


@pytest.mark.server
def test_server_reports_the_plugins_time_per_decode_step(server):
    for _ in range(3):
        server.generate(
            {
                "text": "Count: one, two,",
                "return_entropy": True,
                "sampling_params": {
                    "max_new_tokens": 16,
                    "temperature": 0.8,
                    "ignore_eos": True,
                    "custom_params": {"entropic": {"target_entropy": 2.0}},
                },
            }
        )
    info = server.get("/server_info").json()
    pt = info["internal_states"][0]["entropic"]["plugin_time"]
    assert pt["steps"] > 0
    hooks = pt["hooks"]
    for name in (
        "Scheduler.get_next_batch_to_run:before",
        "ForwardBatch.init_new:after",
        "ModelRunner.sample:around",
        "Sampler.forward:around",
        "Scheduler.process_batch_result:before",
        "Scheduler.run_batch:before",
        "SchedulePolicy.calc_priority:after",
    ):
        assert name in hooks, sorted(hooks)
    for name in ("ForwardBatch.init_new:after", "Sampler.forward:around", "Scheduler.process_batch_result:before"):
        assert hooks[name]["calls"] >= pt["steps"] and hooks[name]["mean_us_per_step"] > 0
    assert not any(name.startswith(("TokenizerManager.", "SamplingParams.")) for name in hooks)  # main process
    assert 0 < pt["mean_share"] < 1
    assert 0 < pt["mean_us_per_step"] < pt["mean_step_us"]
    metrics = server.get("/metrics").text
    assert "sglang:entropic_plugin_seconds_per_decode_step_count" in metrics
    assert "sglang:entropic_plugin_share_of_decode_step_bucket" in metrics


def _run_steps(times: HookTimes, clock: Clock, steps) -> None:
    for plugin, wall in steps:
        times.ns[0] += plugin
        times.calls[0] += 1
        clock.t += wall
        times.boundary(decode=True)


def test_the_benchmark_reads_what_a_server_measured_between_two_reports():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from full_system import plugin_time_during

    steps = [(100, 1_000), (400, 2_000), (50, 4_000), (900, 3_000)]  # (plugin ns, step ns)
    clock, later_clock = Clock(), Clock()
    whole, later = HookTimes(now=clock), HookTimes(now=later_clock)
    for times in (whole, later):
        times.add("A.f:before")
        times.boundary(decode=False)
    _run_steps(whole, clock, steps[:2])
    before = whole.summary()
    _run_steps(whole, clock, steps[2:])
    _run_steps(later, later_clock, steps[2:])  # a server that saw only the later steps
    delta, expected = plugin_time_during(before, whole.summary()), later.summary()
    assert delta["steps"] == expected["steps"] == 2
    for key in ("mean_us_per_step", "mean_step_us", "mean_share"):
        assert delta[key] == pytest.approx(expected[key])
    assert delta["hooks"]["A.f:before"] == {"calls": 2, "mean_us_per_step": pytest.approx(0.475)}
    assert delta["sglang_us_per_step"] == {}
