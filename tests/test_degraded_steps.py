"""Traces never out of step: each fallback of the step path forced, every committed token still has exactly one
value in every per-token trace (null where it could not be computed; SGLang slices the lists by output offset),
and each fault is counted by where it happened and logged once with its traceback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.sampling import controller
from sgl_entropic.plugin.serving.meta_info import TOTALS_KEY, TRACE_KEYS
from sgl_entropic.plugin.signal import traces
from sgl_entropic.plugin.signal.traces import finish_steps
from sgl_entropic.plugin.speculation import verification
from sgl_entropic.plugin.step import BatchRows, current_step
from tests.stepping import Stepper

V = 32
SPECULATIVE = EntropicConfig(speculative={"algorithm": "NGRAM"})


def setup(config: EntropicConfig = EntropicConfig(), rows: int = 2):
    """A scheduler's runtime with `rows` requests that have each committed 3 tokens with their values."""
    rt = runtime.install(config)
    s = Stepper(config)
    rt.dims, rt.controllers = s.rt.dims, s.table
    reqs = [s.req() for _ in range(rows)]
    for r in reqs:
        r.output_ids, r.sampling_params = [], SimpleNamespace(max_new_tokens=100)
    for _ in range(3):
        sample(rt, reqs, lambda *a, **k: torch.zeros(len(reqs), dtype=torch.long))
    assert not rt.degraded
    return rt, reqs


def sample(rt, reqs, sampler, logit_rows=None):
    """One sampling step through the Sampler.forward hook, then its record (and SGLang's commit of the tokens)."""
    step = current_step(rt)
    step.rows = BatchRows.of(reqs, [True] * len(reqs), forward_iter=None)
    step.forward_batch = SimpleNamespace(
        batch_size=len(reqs),
        req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs]),
        seq_lens_cpu=torch.full((len(reqs),), 10),
    )
    info = SimpleNamespace(
        temperatures=torch.ones(len(reqs), 1),
        top_ks=torch.ones(len(reqs), dtype=torch.long),
        is_all_greedy=True,
        has_custom_logit_processor=False,
    )
    logits = torch.randn(len(reqs) if logit_rows is None else logit_rows, V)
    tokens = controller.around_sampler_forward(sampler, None, SimpleNamespace(next_token_logits=logits), info)
    finish_steps(rt)
    for r in reqs:
        r.output_ids.append(0)
    return tokens


def assert_aligned(req, speculative: bool = False) -> None:
    keys = TRACE_KEYS + (("drafted", "accepted") if speculative else ())
    lengths = {k: len(req.customized_info[k]) for k in keys}
    assert set(lengths.values()) == {len(req.output_ids)}, (lengths, len(req.output_ids))
    assert len(req.customized_info[TOTALS_KEY]) == 1  # the totals as they stand, sent once


def faulty(*args, **kwargs):
    raise RuntimeError("forced fault")


@pytest.mark.parametrize("where", ["controller", "signal", "logits shape", "finish"])
def test_a_failed_sampling_step_gives_its_tokens_null_values_and_later_tokens_stay_in_step(where, monkeypatch, caplog):
    rt, reqs = setup()
    patches = {
        "controller": (controller.SamplingStep, "__init__"),
        "signal": (controller.SamplingStep, "record"),
        "finish": (traces, "record_token"),
    }
    with monkeypatch.context() as m:
        if where in patches:
            m.setattr(*patches[where], faulty)

        def sampler(*args, **kwargs):
            return torch.zeros(len(reqs), dtype=torch.long)

        rows = 1 if where == "logits shape" else None  # the batch's rows do not match its logits
        with caplog.at_level(logging.ERROR, logger="sgl_entropic"):
            sample(rt, reqs, sampler, rows)
            sample(rt, reqs, sampler, rows)
    sample(rt, reqs, lambda *a, **k: torch.zeros(len(reqs), dtype=torch.long))  # a healthy step after them
    for r in reqs:
        assert_aligned(r)
        entropy = r.customized_info["entropy"]
        assert entropy[3] is None and entropy[4] is None  # the two faulty steps
        assert None not in entropy[:3] and entropy[5] is not None
    assert sum(rt.degraded.values()) == 2 and len(rt.degraded) == 1, rt.degraded
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # logged once, with its traceback


def test_a_fault_in_the_middle_of_a_batch_s_record_pads_only_what_is_missing(monkeypatch):
    """The first row recorded, the second failed: the first keeps its values, the second gets nulls."""
    rt, reqs = setup()
    real, calls = traces.record_token, []

    def second_fails(rt_, req, *args, **kwargs):
        calls.append(req)
        if len(calls) == 2:
            raise RuntimeError("forced fault")
        return real(rt_, req, *args, **kwargs)

    monkeypatch.setattr(traces, "record_token", second_fails)
    sample(rt, reqs, lambda *a, **k: torch.zeros(2, dtype=torch.long))
    assert reqs[0].customized_info["entropy"][-1] is not None
    assert reqs[1].customized_info["entropy"][-1] is None
    for r in reqs:
        assert_aligned(r)


class VerifyInput:
    """Stands in for SGLang's NgramVerifyInput (the hook checks the type)."""


@pytest.mark.parametrize("where", ["verify batch", "verification", "record"])
def test_a_failed_verify_step_gives_each_committed_token_a_null_value(where, monkeypatch):
    """A verify step commits 1 + accepted tokens a row; a fault in the draft rule's verify batch (the step then
    has no plan of ours), in verification (SGLang's own verification serves the step) or in its record leaves
    exactly that many nulls, capped at max_new_tokens."""
    from sglang.srt.speculative import ngram_info

    monkeypatch.setattr(ngram_info, "NgramVerifyInput", VerifyInput)
    rt, reqs = setup(SPECULATIVE)
    reqs[1].sampling_params.max_new_tokens = 5  # 3 committed: 2 of its 4 accepted tokens are its own
    rt.speculation = SimpleNamespace()
    current_step(rt).plan = None if where == "verify batch" else object()
    accept_lens = torch.tensor([3, 4])
    served = ("predict", accept_lens, "accept_index")
    if where == "verify batch":
        monkeypatch.setattr(verification, "verify", faulty)  # not reached: the step has no plan of ours
    elif where == "verification":
        monkeypatch.setattr(verification, "verify", faulty)
    else:
        monkeypatch.setattr(verification, "verify", lambda *a, **k: (served, faulty))
    batch = SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_idle=lambda: False), forward_iter=None)
    result = verification.around_eagle_sample(
        lambda *a, **k: served, VerifyInput(), batch, SimpleNamespace(next_token_logits=None)
    )
    assert result is served
    finish_steps(rt)
    for r, n in zip(reqs, (3, 2)):
        r.output_ids.extend([0] * n)
        assert_aligned(r, speculative=True)
        assert r.customized_info["entropy"][-n:] == [None] * n
    assert list(rt.degraded.values()) == ([] if where == "verify batch" else [1])  # that one counts at its batch
