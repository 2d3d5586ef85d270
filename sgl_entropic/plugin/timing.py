"""The plugin's own price, measured in the scheduler process: each hook handler's wall time per step.

`plugin.hook_table` wraps every scheduler-process handler once (`timed`): two `perf_counter_ns`
reads and two list updates per call, no lock, nothing allocated beyond the call's own. An around
handler's time excludes the original it wraps (SGLang's work, or a nested hook's, which counts for
that hook), and a handler that replaces SGLang's code excludes the SGLang functions it calls through
`HookTimes.sglang` (`sglang_named` also reports them by label beside the plugin's time: SGLang's
n-gram matcher, which each request's own trie calls a row at a time). A step is one scheduler loop
iteration that runs a batch, from one `Scheduler.get_next_batch_to_run` to the next; its batch is
that call's `last_batch`, so an idle
iteration (no batch) is never counted, and neither is the sleep of `--sleep-on-idle` in it. Decode
steps are aggregated: the plugin's time in the step, the step's wall time, and their ratio.
What is not a hook is not timed: the `entropic` attention backend replaces SGLang's attention, so
its price shows in the decode speed against stock (benchmarks/full_system.py), not here.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

from sgl_entropic.plugin.hooks import Hook


class HookTimes:
    """Per-hook nanoseconds of the current step, folded into decode-step totals at each step boundary."""

    def __init__(self, now: Callable[[], int] = time.perf_counter_ns):
        self.names: list[str] = []
        self.ns: list[int] = []  # the current step, per hook (written by the wrappers)
        self.calls: list[int] = []
        self.now = now  # perf_counter_ns; the wrappers read it too
        self._start: Optional[int] = None  # the current step's start; None before the first boundary
        # over the decode steps closed so far
        self.steps = 0
        self.plugin_ns = 0
        self.wall_ns = 0
        self.share_sum = 0.0
        self.hook_ns: list[int] = []
        self.hook_calls: list[int] = []
        self.sglang_ns = [0]  # SGLang's own work run from inside a handler (`sglang`): not the handler's time
        self.named: dict[str, list[int]] = {}  # label -> [this step's ns, decode steps' ns] (`sglang_named`)

    def sglang(self, fn: Callable, *args, **kwargs):
        """Call SGLang's own work from inside a handler that replaces its caller: the time is not the plugin's."""
        t0 = self.now()
        try:
            return fn(*args, **kwargs)
        finally:
            self.sglang_ns[0] += self.now() - t0

    def sglang_named(self, label: str, fn: Callable, *args):
        """`sglang`, its time also reported under `label`: SGLang's work that the plugin calls, shown beside the
        plugin's own (the per-request tries call SGLang's n-gram matcher a row at a time)."""
        t0 = self.now()
        try:
            return self.sglang(fn, *args)
        finally:
            slot = self.named.get(label)
            if slot is None:
                slot = self.named[label] = [0, 0]
            slot[0] += self.now() - t0

    def add(self, name: str) -> int:
        """A slot for one hook; its index is what the wrapper writes to."""
        for column in (self.ns, self.calls, self.hook_ns, self.hook_calls):
            column.append(0)
        self.names.append(name)
        return len(self.names) - 1

    def boundary(self, decode: bool) -> Optional[tuple[int, int]]:
        """A new step starts; the one that ends was a decode step if `decode`. Returns its
        (plugin ns, wall ns) when a decode step was counted."""
        now = self.now()
        counted = None
        if decode and self._start is not None and now > self._start:
            plugin, wall = sum(self.ns), now - self._start
            self.steps += 1
            self.plugin_ns += plugin
            self.wall_ns += wall
            self.share_sum += plugin / wall
            for i, (ns, calls) in enumerate(zip(self.ns, self.calls)):
                self.hook_ns[i] += ns
                self.hook_calls[i] += calls
            counted = plugin, wall
            for ns in self.named.values():
                ns[1] += ns[0]
        for ns in self.named.values():
            ns[0] = 0
        for i in range(len(self.ns)):
            self.ns[i] = self.calls[i] = 0
        self._start = now
        return counted

    def summary(self) -> dict:
        """`/server_info` -> internal_states[i].entropic.plugin_time."""
        n = self.steps
        per_step = (lambda ns: ns / n / 1e3) if n else (lambda ns: None)
        return {
            "steps": n,  # decode steps counted
            "hooks": {
                name: {"calls": calls, "mean_us_per_step": per_step(ns)}
                for name, ns, calls in zip(self.names, self.hook_ns, self.hook_calls)
            },
            "mean_us_per_step": per_step(self.plugin_ns),
            "mean_step_us": per_step(self.wall_ns),
            "mean_share": self.share_sum / n if n else None,
            "sglang_us_per_step": {label: per_step(ns[1]) for label, ns in self.named.items()},  # not the plugin's
        }


def timed(table: Sequence[Hook], times: HookTimes) -> tuple[Hook, ...]:
    """The table with each scheduler-process handler timed into `times` (the others as they are)."""
    return tuple(replace(h, handler=_timed_handler(h, times)) if h.process == "scheduler" else h for h in table)


def _timed_handler(hook: Hook, times: HookTimes) -> Callable:
    i, handler, now = times.add(_name(hook)), hook.handler, times.now
    ns, calls = times.ns, times.calls  # the same lists for the process's life (boundary zeroes them in place)
    sglang_ns = times.sglang_ns

    if hook.kind != "around":

        @functools.wraps(handler)  # __wrapped__: hooks.is_applied still finds our handler
        def wrapper(*args, **kwargs):
            t0, s0 = now(), sglang_ns[0]
            try:
                return handler(*args, **kwargs)
            finally:
                ns[i] += now() - t0 - (sglang_ns[0] - s0)
                calls[i] += 1

        return wrapper

    memo: list = [None, None]  # SGLang passes the same original on every call: its timed twin is built once

    def timed_original(original):
        if memo[0] is not original:

            def run(*args, **kwargs):
                t0, s0 = now(), sglang_ns[0]
                try:
                    return original(*args, **kwargs)
                finally:
                    # not the plugin's time; what `sglang` excluded inside it is excluded once, below
                    ns[i] -= now() - t0 - (sglang_ns[0] - s0)

            memo[:] = original, run
        return memo[1]

    @functools.wraps(handler)
    def around(original, *args, **kwargs):
        t0, s0 = now(), sglang_ns[0]
        try:
            return handler(timed_original(original), *args, **kwargs)
        finally:
            ns[i] += now() - t0 - (sglang_ns[0] - s0)
            calls[i] += 1

    return around


def _name(hook: Hook) -> str:
    """`Class.method:kind`, as the table names the target."""
    return ".".join(hook.target.rsplit(".", 2)[-2:]) + ":" + hook.kind
