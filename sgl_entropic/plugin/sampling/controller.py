"""The micro loop and the signal's measurement on SGLang's sampler, in the scheduler process.

Hooks: `ForwardBatch.init_new` (the step's rows, built once), `ModelRunner.sample` (which forward batch
is being sampled) and `Sampler.forward` (where the distribution is actually sampled).

Controller state lives on the model's device in a `ControllerTable`, one column per
request-pool slot, read and written by index; a request's parameters are uploaded once, when
it first samples in a slot, from pinned memory without blocking. A step makes one device -> host
transfer, issued without blocking into pinned memory: the rows' entropy, surprisal, validity,
temperature (and Mirostat mu). It is read where SGLang processes that batch's result
(`signal/traces.py`), so under the overlap scheduler the host never waits for the step it just
launched; there the values feed the traces and refresh the host copy in `RequestState` (from which a
retracted request resumes in its next slot).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import RequestState
from sgl_entropic.plugin.signal.traces import NullRecord, PendingRecord
from sgl_entropic.plugin.step import BatchRows, current_step
from sgl_entropic.sampling import (
    CONTROLLER_FIELDS,
    MIROSTAT_FIELDS,
    ControllerBatch,
    MirostatBatch,
    fields_on_device,
)
from sgl_entropic.signal import Scratch, TokenStats, token_stats
from sgl_entropic.transfer import to_device

TEMPERATURE, STEPS_DONE = CONTROLLER_FIELDS.index("temperature"), CONTROLLER_FIELDS.index("steps_done")


class ControllerTable:
    """Controller parameters and state per request-pool slot, `[fields, slots]` on one device."""

    def __init__(self, slots: int, device):
        self.entropic = torch.zeros(len(CONTROLLER_FIELDS), slots, dtype=torch.float32, device=device)
        self.mirostat = torch.zeros(len(MIROSTAT_FIELDS), slots, dtype=torch.float32, device=device)
        self._holder = [0] * slots  # arrival_seq of the state whose values each slot holds (0: none)

    def load(self, slots: list[int], states: list[RequestState], kind: str) -> None:
        """Upload the states that are not in their slot yet (a new request, or a retracted one moved)."""
        todo = [(slot, s) for slot, s in zip(slots, states) if self._holder[slot] != s.arrival_seq]
        if not todo:
            return
        table, names = (self.entropic, CONTROLLER_FIELDS) if kind == "controller" else (self.mirostat, MIROSTAT_FIELDS)
        values = fields_on_device([getattr(s, kind) for _, s in todo], names, table.device)
        table[:, to_device([slot for slot, _ in todo], table.device)] = values
        for slot, s in todo:
            self._holder[slot] = s.arrival_seq

    def store(self, slots: torch.Tensor, temperature: torch.Tensor, steps: torch.Tensor, advance: bool) -> None:
        """A controlled step's result in the slots: the temperature after it, the steps done (`advance`: added)."""
        self.entropic[TEMPERATURE].index_copy_(0, slots, temperature)
        (self.entropic[STEPS_DONE].index_add_ if advance else self.entropic[STEPS_DONE].index_copy_)(0, slots, steps)


class SamplingStep:
    """One sampling step of a batch, at the point where the distribution is actually sampled.

    Logits arrive after penalties and grammar masks. Controlled rows get this step's temperature
    from this step's logits (zero lag): the row is pre-scaled by T_request / T_new because the
    sampler then divides by the request temperature. Mirostat rows get their truncation mask.
    After sampling, every row's entropy and token surprisal are measured on that same
    distribution (full, before top-k/top-p/min-p) and recorded.
    """

    def __init__(
        self,
        rows: BatchRows,
        req_pool_indices: torch.Tensor,
        sampling_info,
        logits: torch.Tensor,
        table: ControllerTable,
        scratch: Optional[Scratch] = None,
    ):
        rows.drop_released()
        self.rows = rows
        device = logits.device
        request_t = sampling_info.temperatures.view(-1).float()
        self.inv_request_t = 1.0 / request_t
        # the temperature each row is sampled at: 0 for greedy (SGLang encodes it as top_k = 1)
        self.used_t = torch.where(sampling_info.top_ks.view(-1) == 1, 0.0, request_t)
        self.table = table

        ctrl = rows.positions("controller")
        if ctrl:
            pos, slots = self._index(ctrl, req_pool_indices, device)
            table.load([rows.reqs[i].kv.req_pool_idx for i in ctrl], [rows.states[i] for i in ctrl], "controller")
            z = logits.index_select(0, pos)
            batch = ControllerBatch(*table.entropic.index_select(1, slots))
            new_t, _ = batch.step(z, scratch=scratch)
            table.store(slots, batch.temperature, batch.steps_done, advance=False)
            logits.index_copy_(0, pos, z.mul_((request_t[pos] / new_t).to(z.dtype)[:, None]))
            self.used_t = self.used_t.index_copy(0, pos, new_t)

        self.mirostat_rows = rows.positions("mirostat")
        if self.mirostat_rows:
            pos, slots = self._index(self.mirostat_rows, req_pool_indices, device)
            table.load(
                [rows.reqs[i].kv.req_pool_idx for i in self.mirostat_rows],
                [rows.states[i] for i in self.mirostat_rows],
                "mirostat",
            )
            z = logits.index_select(0, pos)
            self.mirostat = MirostatBatch(*table.mirostat.index_select(1, slots))
            self.mirostat_index = (pos, slots)
            self.mirostat_logits = self.mirostat.mask(z * self.inv_request_t[pos][:, None])
            logits.index_copy_(0, pos, z.masked_fill(self.mirostat_logits == float("-inf"), float("-inf")))

    @staticmethod
    def _index(positions: list[int], req_pool_indices: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = to_device(positions, device)
        return pos, req_pool_indices.to(device).index_select(0, pos).long()

    def record(
        self, snapshot: torch.Tensor, token_ids: torch.Tensor, seq_lens: list[int], scratch: Optional[Scratch] = None
    ) -> tuple[TokenStats, "PendingRecord"]:
        """Measure the sampled rows on the device and start their one transfer to the host (not waited for)."""
        stats = token_stats(snapshot, token_ids, None, scratch)  # the snapshot is scaled by inv_request_t
        columns = [stats.entropy, stats.surprisal, stats.valid.float(), self.used_t]
        if self.mirostat_rows:
            pos, slots = self.mirostat_index
            new_mu = self.mirostat.update(self.mirostat_logits, token_ids.index_select(0, pos))
            self.table.mirostat[0].index_copy_(0, slots, new_mu)
            columns.append(torch.full_like(stats.entropy, math.nan).index_copy(0, pos, new_mu))
        values = torch.stack(columns)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        host.copy_(values, non_blocking=True)  # the step's one device -> host transfer
        ready = None
        if values.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        # the decode budget sets the next step's counts before this one finishes (overlap scheduler)
        parked = [s.parked_before_token if s is not None else 0 for s in self.rows.states]
        return stats, PendingRecord(self.rows, host, ready, seq_lens, parked)


# ---------------------------------------------------------------------------------------- hooks


def after_forward_batch_init(forward_batch, cls, batch, *args, **kwargs):
    rt = runtime.current()
    reqs = list(batch.reqs or ())
    mode = forward_batch.forward_mode
    decode = mode.is_decode() or mode.is_target_verify()  # a verify step decodes every row
    if decode:
        produces = [True] * len(reqs)
    else:
        seq_lens = forward_batch.seq_lens_cpu.tolist()  # a host tensor: no device sync
        produces = [n >= len(r.origin_input_ids) + len(r.output_ids) for n, r in zip(seq_lens, reqs)]
    # The batch the model runs next (SGLang hands its attention backend a copy of the ForwardBatch,
    # so the rows live in the step, not on the batch object).
    if not current_step(rt).set_rows(BatchRows.of(reqs, produces, decode, getattr(batch, "forward_iter", None))):
        rt.fault("the step's rows (a step given another batch's)")
    return forward_batch


def around_model_runner_sample(original, runner, logits_output, forward_batch, *args, **kwargs):
    rt = runtime.current()
    step = current_step(rt)
    step.forward_batch = forward_batch
    if rt.controllers is None:
        rt.controllers = ControllerTable(runner.req_to_token_pool.req_to_token.shape[0], runner.device)
    try:
        return original(runner, logits_output, forward_batch, *args, **kwargs)
    finally:
        step.forward_batch = None


def around_sampler_forward(original, sampler, logits_output, sampling_info, *args, **kwargs):
    rt = runtime.current()
    step = current_step(rt)
    fb, logits = step.forward_batch, logits_output.next_token_logits
    if fb is None or logits is None:  # not a batch of ours (an idle batch)
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    rows = runtime.step_rows(fb, "the sampling step's rows (sampled without control)")
    if rows is None:
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    # A fault in our per-step work must cost the step its entropic control, never the scheduler.
    try:
        if logits.shape[0] != len(rows.reqs):
            raise RuntimeError(f"{logits.shape[0]} rows of logits for a batch of {len(rows.reqs)} requests")
        sampling = SamplingStep(rows, fb.req_pool_indices, sampling_info, logits, rt.controllers, rt.scratch)
        # The sampler turns logits into probabilities in place, except in an all-greedy batch without custom
        # processors (argmax; at most its NaN guard rewrites non-finite entries): there, no copy is needed.
        snapshot = (
            logits
            if keeps_logits(sampling_info, sampling.inv_request_t)
            else rt.scratch.snapshot(logits, sampling.inv_request_t)
        )
    except Exception:
        rt.fault("the sampling step's controller (sampled without control)")
        token_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
        step.records.append(NullRecord(rows))
        return token_ids
    token_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    try:
        stats, pending = sampling.record(snapshot, token_ids, fb.seq_lens_cpu.tolist(), rt.scratch)
    except Exception:
        rt.fault("the sampling step's signal")
        step.records.append(NullRecord(rows))
        return token_ids
    step.records.append(pending)
    if rt.pages is not None:
        try:
            rt.pages.record_sampled(fb.req_pool_indices, rows.produces, stats)
        except Exception:  # the surprisal selector's page scores miss this step; the trace is whole
            rt.fault("the surprisal selector's page scores")
    return token_ids


def keeps_logits(sampling_info, inv_request_t: torch.Tensor) -> bool:
    """Whether the sampler leaves this batch's logits as they are and every row is measured at T = 1 (a CPU
    batch only: the check reads the temperatures, a device sync on a GPU, where the copy is cheap anyway)."""
    return (
        inv_request_t.is_cpu
        and sampling_info.is_all_greedy
        and not sampling_info.has_custom_logit_processor
        and bool((inv_request_t == 1).all())
    )
