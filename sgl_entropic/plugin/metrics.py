"""Prometheus series of the loops (with --enable-metrics), written from the scheduler process.

Rates come from the counters: tau rate = rate(sglang:entropic_time_nats_total[1m]);
d tau/dC = rate(sglang:entropic_time_nats_total[1m]) / rate(sglang:entropic_cost_gflop_total[1m]).
`monitoring/grafana/sgl-entropic.json` is a Grafana dashboard over all of them.
"""

from __future__ import annotations


class EntropicMetrics:
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
        self.parked = Counter("sglang:entropic_parked_steps", "Decode steps running requests waited (decode budget).")

    def observe(self, entropies: list[float], step_tau: float, step_flops: float, attended: list[float] = (),
                temperatures: list[float] = (), parked: int = 0) -> None:
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
