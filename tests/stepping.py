"""Drive the plugin's SamplingStep on plain tensors, as the Sampler.forward hook does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from sgl_entropic.config import EntropicConfig
from sgl_entropic.costs import ModelDims
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.sampling.controller import ControllerTable, SamplingStep
from sgl_entropic.plugin.step import BatchRows


class Stepper:
    """One scheduler's worth of state: a Runtime, a controller table, request-pool slots."""

    def __init__(self, config: Optional[EntropicConfig] = None, slots: int = 64):
        self.rt = Runtime(config or EntropicConfig())
        self.rt.dims = ModelDims(2, 2, 1, 4, 100.0)
        self.table = ControllerTable(slots, "cpu")
        self._next_slot = 1

    def req(self, controller=None, mirostat=None, prompt_ids=(), traced=True, stream=False):
        """A request as SamplingStep sees it, in its own request-pool slot (`traced`: it asked for its traces)."""
        state = self.rt.new_request_state(controller, mirostat, traced=traced)
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return SimpleNamespace(
            entropic=state,
            customized_info=None,
            stream=stream,
            kv=SimpleNamespace(req_pool_idx=slot),
            origin_input_ids=list(prompt_ids),
        )

    def begin(self, reqs, logits, temps, top_ks=None, produces=None) -> SamplingStep:
        n = len(reqs)
        info = SimpleNamespace(
            temperatures=torch.tensor(temps, dtype=torch.float32).view(-1, 1),
            top_ks=torch.tensor(top_ks or [logits.shape[1]] * n),
        )
        rows = BatchRows.of(reqs, produces or [True] * n)
        return SamplingStep(rows, torch.tensor([r.kv.req_pool_idx for r in reqs]), info, logits, self.table)

    def step(self, reqs, logits, temps, top_ks=None, tokens=None, produces=None):
        """One sampling step; returns (logits as the sampler got them, sampled tokens)."""
        step = self.begin(reqs, logits, temps, top_ks, produces)
        if tokens is None:  # a stand-in for the sampler: the argmax of what it was given
            tokens = torch.nan_to_num(logits, nan=0.0).argmax(dim=-1)
        _, pending = step.record(logits.clone(), tokens, [32] * len(reqs))
        pending.finish(self.rt)
        return logits, tokens


class HostReads(torch.overrides.TorchFunctionMode):
    """Records the tensor calls that would wait for a GPU (device -> host reads), except on `host`
    tensors (those SGLang already keeps on the host, such as seq_lens_cpu), and the non-blocking
    copies (`transfers`: what a step hands to the host, or the device, without waiting)."""

    READS = {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.Tensor.repeat_interleave,
        torch.repeat_interleave,
        torch.masked_select,
        torch.Tensor.masked_select,
        torch.Tensor.unique,
        torch.unique,
    }

    def __init__(self, host=()):
        super().__init__()
        self.host = [id(t) for t in host]
        self.reads: list[str] = []
        self.transfers: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS and not (args and id(args[0]) in self.host):
            self.reads.append(getattr(func, "__name__", str(func)))
        if func in (torch.Tensor.copy_, torch.Tensor.to) and kwargs.get("non_blocking"):
            self.transfers.append(tuple(args[0].shape))
        return func(*args, **kwargs)
