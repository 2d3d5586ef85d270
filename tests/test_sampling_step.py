"""SamplingStep (the plugin's per-batch sampling logic) on plain tensors: rows without entropic
parameters reach the sampler bit-for-bit unchanged; controlled rows are rescaled as documented;
controller state lives on the device per request-pool slot and survives a move to another slot."""

from types import SimpleNamespace

import pytest
import torch

from sgl_entropic.config import EntropicConfig, SamplingConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.sampling import controller as sampling_hooks
from sgl_entropic.plugin.signal.traces import finish_steps
from sgl_entropic.plugin.step import BatchRows, current_step
from sgl_entropic.plugin.serving.validation import request_controllers
from sgl_entropic.sampling import ControllerState, MirostatState, update_temperature, entropy
from tests.stepping import HostReads, Stepper


def test_only_entropic_rows_are_touched():
    s = Stepper()
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[3, :10] = float("-inf")
    original = logits.clone()
    cfg = SamplingConfig(target_entropy=1.0, eta=0.5, warmup=0)
    reqs = [
        s.req(),
        s.req(controller=ControllerState.from_config(cfg, 0.8)),
        s.req(mirostat=MirostatState.from_config(SamplingConfig(controller="mirostat_v2", tau=2.0))),
        s.req(),
    ]
    step = s.begin(reqs, logits, [0.7, 0.8, 1.0, 1.0], top_ks=[50, 50, 50, 1])

    assert torch.equal(logits[0], original[0]) and torch.equal(logits[3], original[3])
    # the controlled row: T_new from this step's own logits, independently recomputed
    expected_t = update_temperature(
        torch.tensor([0.8]), entropy(original[1:2], torch.tensor([0.8])), 1.0, 0.5, 0.1, 2.0, 0.05, 0, 0
    )
    new_t = float(expected_t)
    assert new_t != pytest.approx(0.8)
    torch.testing.assert_close(logits[1], original[1] * (0.8 / new_t))  # the sampler then divides by 0.8
    assert (logits[2] == float("-inf")).sum() > 0  # mirostat truncated its row

    _, pending = step.record(logits.clone(), torch.tensor([1, 2, int(logits[2].argmax()), 20]), [10, 11, 12, 13])
    assert all(r.customized_info is None for r in reqs)  # nothing is read back until the batch's result
    pending.finish(s.rt)
    temps = [r.customized_info["temperature"][0] for r in reqs]
    assert abs(temps[0] - 0.7) < 1e-6
    assert temps[1] == pytest.approx(new_t) and temps[2] == 1.0 and temps[3] == 0.0  # greedy row
    # the host copy follows the device state (one transfer per step)
    assert reqs[1].entropic.controller.temperature == pytest.approx(new_t)
    assert reqs[1].entropic.controller.steps_done == 1
    assert reqs[2].entropic.mirostat.mu != 4.0


def test_controller_state_follows_a_request_into_another_slot():
    # A retracted request comes back in another request-pool slot: its state continues from the host copy.
    cfg = SamplingConfig(target_entropy=2.0, eta=0.2, warmup=0)
    moved, fresh = Stepper(), Stepper()
    a = moved.req(controller=ControllerState.from_config(cfg, 1.0))
    b = fresh.req(controller=ControllerState.from_config(cfg, 1.0))
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, 64, generator=gen) * 3 for _ in range(4)]
    for i, row in enumerate(rows):
        if i == 2:
            a.kv.req_pool_idx = 17  # retracted and re-admitted elsewhere
        moved.step([a], row.clone(), [1.0])
        fresh.step([b], row.clone(), [1.0])
    assert a.customized_info["temperature"] == b.customized_info["temperature"]
    assert len(set(a.customized_info["temperature"])) == 4  # it really moved every step


def test_rows_that_produce_no_token_are_not_recorded():
    s = Stepper()
    cfg = SamplingConfig(target_entropy=1.0, warmup=0)
    chunked = s.req(controller=ControllerState.from_config(cfg, 1.0))
    logits = torch.randn(1, 20)
    original = logits.clone()
    s.step([chunked], logits, [1.0], tokens=torch.tensor([3]), produces=[False])
    assert torch.equal(logits, original)
    assert chunked.customized_info is None and chunked.entropic.controller.steps_done == 0


def test_a_fault_in_the_step_falls_back_to_plain_sampling(monkeypatch, caplog):
    rt = runtime.install(EntropicConfig())
    s = Stepper()
    step = current_step(rt)
    step.rows = BatchRows.of([s.req()], [True])
    step.forward_batch = SimpleNamespace(batch_size=1, req_pool_indices=None)
    logits_output = SimpleNamespace(next_token_logits=torch.randn(1, 8))
    result = sampling_hooks.around_sampler_forward(lambda *a, **k: "sampled", None, logits_output, None)
    assert result == "sampled"
    assert "sampled without control" in caplog.text


def test_request_controllers_is_the_one_check():
    cfg = EntropicConfig()

    def params(entropic, temperature=1.0, top_k=50):
        return SimpleNamespace(custom_params={"entropic": entropic}, temperature=temperature, top_k=top_k)

    assert request_controllers(SimpleNamespace(custom_params=None), cfg) == (None, None)
    controller, mirostat = request_controllers(params({"target_entropy": 1.0}, temperature=0.7), cfg)
    assert controller.temperature == 0.7 and mirostat is None
    assert request_controllers(params({"controller": "mirostat_v2"}), cfg)[1].mu == 10.0
    with pytest.raises(ValueError, match="t_init"):
        request_controllers(params({"t_max": 1.5}, temperature=1.8), cfg)
    with pytest.raises(ValueError, match="greedy"):
        request_controllers(params({}, top_k=1), cfg)
    with pytest.raises(ValueError, match="not enabled"):
        request_controllers(params({}), EntropicConfig(mode="scheduling"))


def test_every_request_gives_the_servers_controller_to_requests_that_ask_for_none():
    cfg = EntropicConfig.model_validate({"sampling": {"every_request": True, "t_min": 0.3, "t_max": 1.2}})

    def plain(temperature=1.0, top_k=50):  # no custom_params: what a router forwards
        return SimpleNamespace(custom_params=None, temperature=temperature, top_k=top_k)

    controller, mirostat = request_controllers(plain(0.7), cfg)
    assert controller.temperature == 0.7 and controller.target == 2.0 and mirostat is None
    assert request_controllers(plain(top_k=1), cfg) == (None, None)  # greedy stays greedy
    assert request_controllers(plain(1.5), cfg) == (None, None)  # outside the bounds: as sent, not clipped
    pinned = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"t_init": 0.5})})
    assert request_controllers(plain(1.5), pinned)[0].temperature == 0.5
    miro = EntropicConfig.model_validate({"sampling": {"every_request": True, "controller": "mirostat_v2", "tau": 3.0}})
    assert request_controllers(plain(), miro)[1].mu == 6.0
    assert request_controllers(plain(0.7), EntropicConfig()) == (None, None)  # off by default


def test_a_step_never_waits_for_the_device_and_hands_its_values_over_once():
    """Inside the sampler a step reads nothing back; its one non-blocking transfer is read where
    SGLang processes the batch's result, so the overlap scheduler is not held up."""
    s = Stepper()
    cfg = SamplingConfig(target_entropy=1.0, warmup=0)
    reqs = [
        s.req(controller=ControllerState.from_config(cfg, 0.8))
        if i % 3 == 1
        else s.req(mirostat=MirostatState.from_config(SamplingConfig(controller="mirostat_v2", tau=2.0)))
        if i % 3 == 2
        else s.req()
        for i in range(8)
    ]
    for step_no in range(3):  # the first steps too, and a warmed-up one
        logits = torch.randn(8, 50)
        with HostReads() as mode:
            step = s.begin(reqs, logits, [0.8] * 8)
            _, pending = step.record(logits.clone(), logits.argmax(dim=-1), [32] * 8)
        assert mode.reads == [] and mode.transfers == [(5, 8)], (mode.reads, mode.transfers)
        pending.finish(s.rt)
        assert all(len(r.customized_info["entropy"]) == step_no + 1 for r in reqs)


def test_a_batch_result_finishes_its_own_step_and_leaves_the_next_one_pending():
    """Under the overlap scheduler step N+1 is sampled before step N's result is processed: processing
    N finishes N's record only, so the host never waits for the step in flight."""

    s = Stepper()
    reqs = [s.req(), s.req()]
    for forward_iter in (7, 8):
        logits = torch.randn(2, 50)
        opened = s.rt.steps.begin()
        sampling = s.begin(reqs, logits, [0.8, 0.8])
        sampling.rows.forward_iter = opened.forward_iter = forward_iter
        opened.records.append(sampling.record(logits.clone(), logits.argmax(dim=-1), [32, 32])[1])
    finish_steps(s.rt, 7)
    assert [step.forward_iter for step in s.rt.steps.open] == [8]
    assert all(len(r.customized_info["entropy"]) == 1 for r in reqs)
    finish_steps(s.rt, 8)
    assert not s.rt.steps.open and all(len(r.customized_info["entropy"]) == 2 for r in reqs)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_hook_measures_the_logits_the_sampler_was_given_whether_or_not_it_copies_them(greedy):
    """An all-greedy batch is measured on the logits themselves (no copy); any other batch on a copy taken
    before the sampler, which overwrites its logits in place. Either way the trace is that of the given logits."""
    rt = runtime.install(EntropicConfig())
    s = Stepper()
    rt.dims, rt.controllers = s.rt.dims, s.table
    reqs = [s.req(), s.req()]
    for r in reqs:
        r.output_ids = []
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)) * 3
    given = logits.clone()
    info = SimpleNamespace(
        temperatures=torch.ones(2, 1),
        top_ks=torch.tensor([1, 1] if greedy else [64, 64]),
        is_all_greedy=greedy,
        has_custom_logit_processor=False,
    )
    assert sampling_hooks.keeps_logits(info, 1.0 / info.temperatures.view(-1)) == greedy

    def sampler(_sampler, out, _info, *args, **kwargs):
        tokens = out.next_token_logits.argmax(dim=-1)
        if not greedy:  # as SGLang's sampler does outside the all-greedy path
            torch.softmax(out.next_token_logits, dim=-1, out=out.next_token_logits)
        return tokens

    step = current_step(rt)
    step.rows = BatchRows.of(reqs, [True, True])
    step.forward_batch = SimpleNamespace(
        batch_size=2,
        req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs]),
        seq_lens_cpu=torch.tensor([10, 10]),
    )
    tokens = sampling_hooks.around_sampler_forward(sampler, None, SimpleNamespace(next_token_logits=logits), info)
    finish_steps(rt)
    dist = torch.distributions.Categorical(logits=given.double())
    for i, r in enumerate(reqs):
        assert r.customized_info["entropy"][0] == pytest.approx(float(dist.entropy()[i]), abs=1e-4)
        assert r.customized_info["surprisal"][0] == pytest.approx(-float(dist.log_prob(tokens)[i]), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_did_not_ask_keeps_no_per_token_trace_only_its_totals(stream):
    """Without return_entropy nothing per token is kept, except on a stream its running totals (each chunk carries
    the latest); the totals are the same as a traced request's."""
    from sgl_entropic.plugin.serving.meta_info import RUNNING_KEY, TOTALS_KEY

    s = Stepper()
    traced, plain = s.req(), s.req(traced=False, stream=stream)
    for _ in range(3):
        logits = torch.randn(2, 50)
        sampling = s.begin([traced, plain], logits, [1.0, 1.0])
        sampling.record(logits.clone(), logits.argmax(dim=-1), [32, 32])[1].finish(s.rt)
    assert len(traced.customized_info["entropy"]) == 3 and traced.customized_info[TOTALS_KEY][0]["entropic_time"] > 0
    key = RUNNING_KEY if stream else TOTALS_KEY
    assert set(plain.customized_info) == {key} and len(plain.customized_info[key]) == (3 if stream else 1)
    assert plain.customized_info[key][-1]["entropic_time"] == pytest.approx(plain.entropic.trace.tau)


def test_a_stream_s_running_totals_keep_one_entry_a_token_through_a_failed_step():
    """SGLang slices a stream's running totals per chunk by token: a step whose work failed still leaves one entry
    for each token it committed, as a recorded step does."""
    from sgl_entropic.plugin.serving.meta_info import RUNNING_KEY
    from sgl_entropic.plugin.signal.traces import NullRecord

    s = Stepper()
    req = s.req(traced=False, stream=True)
    req.output_ids, req.sampling_params = [], SimpleNamespace(max_new_tokens=100)
    logits = torch.randn(1, 50)
    s.begin([req], logits, [1.0]).record(logits.clone(), logits.argmax(dim=-1), [32])[1].finish(s.rt)
    NullRecord(BatchRows.of([req], [True]), committed=[3]).finish(s.rt)  # a verify step of 3 tokens that failed
    assert len(req.customized_info[RUNNING_KEY]) == 4
