"""SamplingStep (the plugin's per-batch sampling logic) on plain tensors: rows without entropic
parameters reach the sampler bit-for-bit unchanged; controlled rows are rescaled as documented."""

from types import SimpleNamespace

import pytest
import torch

from sgl_entropic import plugin
from sgl_entropic.config import EntropicConfig, SamplingConfig, SchedulingConfig
from sgl_entropic.sampling import ControllerState, MirostatState
from sgl_entropic.scheduling import GainEstimator
from sgl_entropic.signal import EntropyTrace, ModelDims


def _req(controller=None, mirostat=None):
    state = plugin.RequestState(
        trace=EntropyTrace(keep_lists=False),
        gain=GainEstimator(SchedulingConfig()),
        arrival_seq=0,
        arrival_step=0,
        controller=controller,
        mirostat=mirostat,
    )
    return SimpleNamespace(entropic=state, customized_info=None)


def test_only_entropic_rows_are_touched(monkeypatch):
    monkeypatch.setattr(plugin, "_config", EntropicConfig())
    monkeypatch.setattr(plugin, "_dims", ModelDims(2, 2, 1, 4, 100.0))
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[3, :10] = float("-inf")
    original = logits.clone()
    cfg = SamplingConfig(target_entropy=1.0, eta=0.5, warmup=0)
    reqs = [
        _req(),
        _req(controller=ControllerState.from_config(cfg, 0.8)),
        _req(mirostat=MirostatState.from_config(SamplingConfig(controller="mirostat_v2", tau=2.0))),
        _req(),
    ]
    info = SimpleNamespace(temperatures=torch.tensor([[0.7], [0.8], [1.0], [1.0]]), top_ks=torch.tensor([50, 50, 50, 1]))
    step = plugin.SamplingStep(reqs, [True] * 4, [10, 11, 12, 13], info, logits)

    assert torch.equal(logits[0], original[0]) and torch.equal(logits[3], original[3])
    new_t = reqs[1].entropic.controller.temperature
    assert new_t != 0.8
    torch.testing.assert_close(logits[1], original[1] * (0.8 / new_t))  # the sampler then divides by 0.8
    assert (logits[2] == float("-inf")).sum() > 0  # mirostat truncated its row

    step.record(logits.clone(), torch.tensor([1, 2, int(logits[2].argmax()), 20]))
    temps = [r.customized_info["temperature"][0] for r in reqs]
    assert abs(temps[0] - 0.7) < 1e-6
    assert abs(temps[1] - new_t) < 1e-6 and temps[2] == 1.0 and temps[3] == 0.0  # greedy row


def test_rows_that_produce_no_token_are_not_recorded(monkeypatch):
    monkeypatch.setattr(plugin, "_config", EntropicConfig())
    monkeypatch.setattr(plugin, "_dims", ModelDims(2, 2, 1, 4, 100.0))
    cfg = SamplingConfig(target_entropy=1.0, warmup=0)
    chunked = _req(controller=ControllerState.from_config(cfg, 1.0))
    logits = torch.randn(1, 20)
    original = logits.clone()
    info = SimpleNamespace(temperatures=torch.ones(1, 1), top_ks=torch.tensor([20]))
    step = plugin.SamplingStep([chunked], [False], [256], info, logits)
    step.record(logits.clone(), torch.tensor([3]))
    assert torch.equal(logits, original)
    assert chunked.customized_info is None and chunked.entropic.controller.steps_done == 0


def test_a_fault_in_the_step_falls_back_to_plain_sampling(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_config", EntropicConfig())
    broken_batch = SimpleNamespace(entropic_rows=([_req()], [True]), seq_lens_cpu=None)  # .tolist() fails
    monkeypatch.setattr(plugin, "_forward_batch", broken_batch)
    logits_output = SimpleNamespace(next_token_logits=torch.randn(1, 8))
    result = plugin._around_sampler_forward(lambda *a, **k: "sampled", None, logits_output, None)
    assert result == "sampled"
    assert "sampled without control" in caplog.text


def test_request_controllers_is_the_one_check(monkeypatch):
    monkeypatch.setattr(plugin, "_config", EntropicConfig())

    def params(entropic, temperature=1.0, top_k=50):
        return SimpleNamespace(custom_params={"entropic": entropic}, temperature=temperature, top_k=top_k)

    assert plugin.request_controllers(SimpleNamespace(custom_params=None)) == (None, None)
    controller, mirostat = plugin.request_controllers(params({"target_entropy": 1.0}, temperature=0.7))
    assert controller.temperature == 0.7 and mirostat is None
    assert plugin.request_controllers(params({"controller": "mirostat_v2"}))[1].mu == 10.0
    with pytest.raises(ValueError, match="t_init"):
        plugin.request_controllers(params({"t_max": 1.5}, temperature=1.8))
    with pytest.raises(ValueError, match="greedy"):
        plugin.request_controllers(params({}, top_k=1))
    monkeypatch.setattr(plugin, "_config", EntropicConfig(mode="scheduling"))
    with pytest.raises(ValueError, match="not enabled"):
        plugin.request_controllers(params({}))
