"""Prometheus series of the loops (with --enable-metrics), written from the scheduler process.

Rates come from the counters: tau rate = rate(sglang:entropic_time_nats_total[1m]);
d tau/dC = rate(sglang:entropic_time_nats_total[1m]) / rate(sglang:entropic_cost_gflop_total[1m]).
`monitoring/grafana/sgl-entropic.json` is a Grafana dashboard over all of them.
"""

from __future__ import annotations


class EntropicMetrics:
    def __init__(self, speculative: bool = False):
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

        self.attended = Histogram(
            "sglang:entropic_attended_fraction",
            "Share of its context each decode token attended (1 where the step was dense).",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0),
        )
        self.temperature = Histogram(
            "sglang:entropic_temperature",
            "Temperature the entropic controller sampled each token of its requests at.",
            buckets=(0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0),
        )
        self.degraded = Counter(
            "sglang:entropic_degraded_steps",
            "Steps whose plugin work failed (their tokens' trace values are null), by where it failed.",
            labelnames=("where",),
        )
        self.parked = Counter("sglang:entropic_parked_steps", "Decode steps running requests waited (decode budget).")
        # the plugin's own price (timing.py): its hook handlers' time in each decode step, and that time's share
        self.plugin_time = Histogram(
            "sglang:entropic_plugin_seconds_per_decode_step",
            "Wall time of the plugin's hook handlers in one decode step of the scheduler (seconds).",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2),
        )
        self.plugin_share = Histogram(
            "sglang:entropic_plugin_share_of_decode_step",
            "Share of a decode step's wall time spent in the plugin's hook handlers.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        )
        if speculative:  # NGRAM under the draft rule (plugin/speculation/): per request and verify step
            drafts = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
            self.drafted = Histogram(
                "sglang:entropic_drafted_tokens", "Draft tokens a request verified in a step.", buckets=drafts
            )
            self.accepted = Histogram(
                "sglang:entropic_accepted_tokens", "Draft tokens a request accepted in a step.", buckets=drafts
            )
            self.width = Histogram(
                "sglang:entropic_verify_width",
                "Nodes per request of each verify step (the draft rule's width).",
                buckets=tuple(d + 1 for d in drafts),
            )

    def observe(
        self,
        entropies: list[float],
        step_tau: float,
        step_flops: float,
        attended: list[float] = (),
        temperatures: list[float] = (),
        parked: int = 0,
    ) -> None:
        for h in entropies:
            self.entropy.observe(h)
        for a in attended:
            self.attended.observe(a)
        for t in temperatures:
            self.temperature.observe(t)
        if parked:
            self.parked.inc(parked)
        self.tau.inc(step_tau)
        self.cost.inc(step_flops / 1e9)
        if step_flops > 0:
            self.efficiency.set(step_tau / (step_flops / 1e9))

    def observe_verify(self, drafted: list[int], accepted: list[int], width: int) -> None:
        for d, a in zip(drafted, accepted):
            self.drafted.observe(d)
            self.accepted.observe(a)
        self.width.observe(width)

    def observe_plugin_step(self, plugin_ns: int, wall_ns: int) -> None:
        self.plugin_time.observe(plugin_ns / 1e9)
        self.plugin_share.observe(plugin_ns / wall_ns)
