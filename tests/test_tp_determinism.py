"""Tensor parallelism runs one scheduler and sampler per rank on the same inputs; every rank must
take the same decisions. Two independent copies of the per-step logic (controllers, admission
order, decode budget, page selection), fed identical inputs, must agree bit for bit, without
reading a clock or a random generator on the way."""

from __future__ import annotations

import random
import time

import pytest
import torch

from sgl_entropic.config import EntropicConfig, SamplingConfig, SchedulingConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.pruning import attend_layer
from sgl_entropic.sampling import ControllerState, MirostatState
from sgl_entropic.scheduling import RequestView, order_waiting, remaining_output, remaining_work, select_decode
from tests.stepping import Stepper
from tests.test_attention_backend import CFG, _setup

STEPS, ROWS, VOCAB = 12, 6, 300


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


def test_two_ranks_on_identical_inputs_decide_identically(no_clock_no_randomness):
    ranks = [_rank(), _rank()]
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        logits = torch.randn(ROWS, VOCAB, generator=gen) * 3.0
        sampled, hosts = [], []
        for stepper, reqs in ranks:
            given, tokens = stepper.step(reqs, logits.clone(), [0.9, 1.0, 1.0, 0.9, 1.0, 0.7])
            sampled.append((given, tokens))
            hosts.append([(r.entropic.trace.tau, r.entropic.gain.expected_gain,
                           r.entropic.controller.temperature if r.entropic.controller else None,
                           r.entropic.mirostat.mu if r.entropic.mirostat else None) for r in reqs])
        assert torch.equal(sampled[0][0], sampled[1][0]) and torch.equal(sampled[0][1], sampled[1][1])
        assert hosts[0] == hosts[1]
        assert torch.equal(ranks[0][0].table.entropic, ranks[1][0].table.entropic)
        assert torch.equal(ranks[0][0].table.mirostat, ranks[1][0].table.mirostat)

    # admission and the decode budget, from each rank's own request states and clock
    sched = SchedulingConfig(decode_budget=3)
    orders, masks = [], []
    for stepper, reqs in ranks:
        new = [stepper.req(prompt_ids=[i % 2] * 80 + [99]) for i in range(4)]
        stepper.rt.served += 1234.0
        views = [RequestView(rid=f"r{i}", arrival_seq=r.entropic.arrival_seq,
                             age=stepper.rt.served - r.entropic.arrival_work + 40.0 * i,
                             work=remaining_work(20 if i % 2 else 90, remaining_output(64, i, False, sched), sched),
                             expected_gain=r.entropic.gain.expected_gain, skips=i % 4)
                 for i, r in enumerate(reqs + new)]
        orders.append(order_waiting(views, sched))
        masks.append(select_decode(views, sched))
    assert orders[0] == orders[1] and masks[0] == masks[1]


@pytest.mark.parametrize("update", [{}, {"per_head": True}, {"shortlist_ratio": None}])
def test_two_ranks_select_the_same_pages(no_clock_no_randomness, update):
    """Each rank plans and selects from its own inputs alone (with --tp-size > 1 nothing is timed at
    start-up): identical inputs, identical pages on every layer."""
    cfg = CFG.model_copy(update=update)
    picks = []
    for _ in range(2):
        runner, backend, batch, q, _ = _setup(cfg, [900, 400, 700], entropies=[0.5, 3.0, float("nan")], seed=5,
                                              tp_size=2)
        runtime.current().rows = batch.rows
        plan = backend.planner.plan(batch, batch.rows)
        assert plan is not None
        queries = q.view(q.shape[0], -1, 16)
        pool, store = runner.token_to_kv_pool, backend.planner.store
        picks.append([attend_layer(queries, pool.k[layer], pool.v[layer], plan, store.kmin[layer], store.kmax[layer],
                                   0.25)[1] for layer in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*picks))
