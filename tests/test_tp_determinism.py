"""Tensor parallelism runs one scheduler and sampler per rank on the same inputs; every rank must take the same
decisions. The per-step logic (controllers, admission order, decode budget, page selection) run in two processes,
as two ranks are, with different hash seeds and thread counts, must agree bit for bit, and it reads no clock and
no random generator on the way."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sgl_entropic.config import EntropicConfig, SamplingConfig, SchedulingConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.step import current_step
from sgl_entropic.pruning import attend_layer
from sgl_entropic.sampling import ControllerState, MirostatState
from sgl_entropic.scheduling import RequestView, order_waiting, remaining_output, remaining_work, select_decode
from tests.stepping import Stepper
from tests.backend_stubs import CFG, setup

STEPS, ROWS, VOCAB = 12, 6, 300
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_clock_no_randomness(monkeypatch):
    """A decision that read the wall clock or Python's generator could differ between ranks."""

    def forbidden(*args, **kwargs):
        raise AssertionError("per-step logic read a clock or a random generator")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, forbidden)
    for name in ("random", "randint", "choice", "shuffle", "uniform"):
        monkeypatch.setattr(random, name, forbidden)


def _rank():
    """One rank's sampler state: mixed rows (entropic controller, Mirostat, plain), prompts that
    share prefixes (the admission memory), in their request-pool slots."""
    stepper = Stepper(EntropicConfig(mode="full"))
    cfg = SamplingConfig(target_entropy=2.0, eta=0.3, warmup=0)
    mirostat = SamplingConfig(controller="mirostat_v2", tau=3.0)
    reqs = []
    for i in range(ROWS):
        controller = ControllerState.from_config(cfg, 0.9) if i % 3 == 0 else None
        miro = MirostatState.from_config(mirostat) if i % 3 == 1 else None
        reqs.append(stepper.req(controller=controller, mirostat=miro, prompt_ids=[i % 2] * 80 + [i]))
    return stepper, reqs


def rank_decisions() -> dict:
    """What one rank decides over STEPS sampling steps (controllers, Mirostat, traces, the controller table), then
    in the admission order and the decode budget, then in the pages it selects on every layer: plain lists."""
    stepper, reqs = _rank()
    gen = torch.Generator().manual_seed(3)
    out = {"steps": []}
    for _ in range(STEPS):
        logits = torch.randn(ROWS, VOCAB, generator=gen) * 3.0
        given, tokens = stepper.step(reqs, logits, [0.9, 1.0, 1.0, 0.9, 1.0, 0.7])
        out["steps"].append(
            {
                "temperatures": given.tolist(),
                "tokens": tokens.tolist(),
                "host": [
                    (
                        r.entropic.trace.tau,
                        r.entropic.gain.expected_gain,
                        r.entropic.controller.temperature if r.entropic.controller else None,
                        r.entropic.mirostat.mu if r.entropic.mirostat else None,
                    )
                    for r in reqs
                ],
            }
        )
    out["tables"] = [stepper.table.entropic.tolist(), stepper.table.mirostat.tolist()]
    sched = SchedulingConfig(decode_budget=3)
    new = [stepper.req(prompt_ids=[i % 2] * 80 + [99]) for i in range(4)]
    stepper.rt.served += 1234.0
    views = [
        RequestView(
            rid=f"r{i}",
            arrival_seq=r.entropic.arrival_seq,
            age=stepper.rt.served - r.entropic.arrival_work + 40.0 * i,
            work=remaining_work(20 if i % 2 else 90, remaining_output(64, i, False, sched), sched),
            expected_gain=r.entropic.gain.expected_gain,
            skips=i % 4,
        )
        for i, r in enumerate(reqs + new)
    ]
    out["order"], out["decode"] = order_waiting(views, sched), select_decode(views, sched)
    out["pages"] = {}
    for name, update in (("two-stage", {}), ("per-head", {"per_head": True}), ("bound", {"shortlist_ratio": None})):
        runner, backend, batch, q, _ = setup(
            CFG.model_copy(update=update), [900, 400, 700], entropies=[0.5, 3.0, float("nan")], seed=5, tp_size=2
        )
        current_step(runtime.current()).rows = batch.rows
        plan = backend.planner.plan(batch, batch.rows)  # with --tp-size > 1 nothing is timed at start-up
        queries = q.view(q.shape[0], -1, 16)
        pool, store = runner.token_to_kv_pool, backend.planner.store
        out["pages"][name] = [
            attend_layer(queries, pool.k[layer], pool.v[layer], plan, store.kmin[layer], store.kmax[layer], 0.25)[
                1
            ].tolist()
            for layer in range(3)
        ]
    return out


def test_a_rank_reads_no_clock_and_no_random_generator(no_clock_no_randomness):
    decided = rank_decisions()
    assert len(decided["steps"]) == STEPS and all(decided["pages"].values())


def test_two_rank_processes_decide_identically():
    """Two processes, as two ranks are, with another hash seed (set and dict orders) and another thread count
    (a rank's share of the cores): their decisions must be equal, bit for bit."""
    script = "import json; from tests.test_tp_determinism import rank_decisions; print(json.dumps(rank_decisions()))"
    outputs = []
    for extra in ({"PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "2"}, {"PYTHONHASHSEED": "2", "OMP_NUM_THREADS": "1"}):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "OMP_NUM_THREADS")}
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout.strip().splitlines()[-1])
    assert json.loads(outputs[0]) == json.loads(outputs[1])
