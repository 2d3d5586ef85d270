"""One sampling step, in the scheduler process: the signal and the micro loop on SGLang's sampler.

Hooks: `ForwardBatch.init_new` (the batch's rows, prepared once), `ModelRunner.sample` (which
batch is being sampled) and `Sampler.forward` (where the distribution is actually sampled).

Controller state lives on the model's device in a `ControllerTable`, one column per
request-pool slot, read and written by index; a request's parameters are uploaded once, when
it first samples in a slot, from pinned memory without blocking. A step makes one device -> host
transfer, issued without blocking into pinned memory: the rows' entropy, surprisal, validity,
temperature (and Mirostat mu). It is read where SGLang processes that batch's result
(`Scheduler.process_batch_result`, `before_process_batch_result`), so under the overlap scheduler
the host never waits for the step it just launched; there the values feed the traces and refresh
the host copy in `RequestState` (from which a retracted request resumes in its next slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

from sgl_entropic.costs import step_cost
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.meta_info import TRACE_KEYS
from sgl_entropic.plugin.runtime import RequestState, Runtime
from sgl_entropic.sampling import ControllerBatch, MirostatBatch
from sgl_entropic.signal import Scratch, TokenStats, token_stats
from sgl_entropic.transfer import to_device

# The batches' fields, in their order; ControllerState and MirostatState carry the same names.
CONTROLLER_FIELDS = tuple(f.name for f in fields(ControllerBatch))
MIROSTAT_FIELDS = tuple(f.name for f in fields(MirostatBatch))
_T, _STEPS = CONTROLLER_FIELDS.index("temperature"), CONTROLLER_FIELDS.index("steps_done")
# Under speculative decoding every token carries its step's draft counts (on the step's first token): a
# token sampled outside verification carries none, so that the per-token lists stay aligned.
# Under speculation, each decode step's drafts on its first token (null on the others and on a prefill's token):
# offered (its trie's match, within its cap), drafted (verified), accepted, and where they came from.
NO_DRAFT = {"offered": None, "drafted": None, "accepted": None, "draft_source": None}


@dataclass
class BatchRows:
    """A forward batch's requests as the loops see them, built once per batch.

    produces[i] is False for a middle chunk of a chunked prefill: it is sampled, but its token
    is thrown away. states[i] is the request's state, None where the row produces nothing.
    """

    reqs: list
    produces: list[bool]
    states: list[Optional[RequestState]]
    decode: bool = True  # a decode step (else prefill/extend: no decode-budget wait precedes its token)
    attended: Optional[list[float]] = None  # share of its context each row attended, set by a pruned plan
    read: Optional[list[float]] = None  # share of its context's KV each row read (with the rescored keys)
    forward_iter: Optional[int] = None  # SGLang's number of the batch: its result is processed by it

    @classmethod
    def of(
        cls, reqs: Sequence, produces: Sequence[bool], decode: bool = True, forward_iter: Optional[int] = None
    ) -> "BatchRows":
        states = [getattr(r, "entropic", None) if p else None for r, p in zip(reqs, produces)]
        return cls(list(reqs), list(produces), states, decode, forward_iter=forward_iter)

    def drop_released(self) -> None:
        """Under the overlap scheduler a request can finish, and SGLang free its request slot, while
        its last (discarded) step is being sampled: such rows are not controlled or recorded."""
        self.states = [
            s if s is not None and r.kv.req_pool_idx is not None else None for r, s in zip(self.reqs, self.states)
        ]

    def positions(self, kind: str) -> list[int]:
        """Rows whose state has a `controller` or a `mirostat`."""
        return [i for i, s in enumerate(self.states) if s is not None and getattr(s, kind) is not None]


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
        values = to_device(
            [[float(getattr(getattr(s, kind), n)) for n in names] for _, s in todo], table.device, torch.float32
        )
        table[:, to_device([slot for slot, _ in todo], table.device)] = values.t()
        for slot, s in todo:
            self._holder[slot] = s.arrival_seq


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
            table.entropic[_T].index_copy_(0, slots, batch.temperature)
            table.entropic[_STEPS].index_copy_(0, slots, batch.steps_done)
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


@dataclass
class PendingRecord:
    """A sampled step's values on their way to the host, and what its bookkeeping needs."""

    rows: BatchRows
    host: torch.Tensor  # [columns, B] (pinned on a GPU), filled by a non-blocking copy
    ready: Optional[object]  # the CUDA event after the copy (None on CPU: the copy is done)
    seq_lens: list[int]
    parked: list[int]  # each row's decode-budget wait before this token, as it was when sampled
    offers: Optional[list[int]] = None  # a plain step's: the drafts each row's trie offered (speculation.plain_step)

    def tokens(self) -> list[int]:
        """Tokens each row commits: one where it is recorded."""
        return [int(s is not None) for s in self.rows.states]

    def finish(self, rt: Runtime) -> None:
        """Traces, host state, gain memory and metrics of the step, once its values are on the host."""
        if self.ready is not None:
            self.ready.synchronize()  # already done where SGLang has read the batch's tokens
        host = self.host.tolist()  # a host tensor: no device read
        entropy, surprisal, valid, used_t = host[:4]
        attended, read = self.rows.attended, self.rows.read
        tally = StepTally()
        for i, state in enumerate(self.rows.states):
            if state is None:
                continue
            if state.controller is not None:
                state.controller.temperature = used_t[i]
                state.controller.steps_done += 1
            if state.mirostat is not None and len(host) > 4:
                state.mirostat.mu = host[4][i]
            if not self.rows.decode:  # a (re)prefilled request starts its decode-budget counts afresh
                state.decode_skips = state.parked_before_token = 0
            fraction = attended[i] if attended is not None else 1.0
            cost = step_cost(rt.dims, self.seq_lens[i] * (read[i] if read is not None else fraction), self.seq_lens[i])
            record_token(
                rt,
                self.rows.reqs[i],
                state,
                tally,
                entropy[i],
                surprisal[i],
                valid[i] > 0,
                used_t[i],
                cost,
                parked=self.parked[i],
                attended=fraction,
                decode=self.rows.decode,
                **(self.plain_drafts(i) if rt.config.speculative_on else {}),
            )
            state.last_step_entropy = entropy[i] if valid[i] > 0 else None
        tally.report(rt)

    def plain_drafts(self, i: int) -> dict:
        if not self.rows.decode:
            return NO_DRAFT
        return {**NO_DRAFT, "offered": self.offers[i] if self.offers is not None else 0, "drafted": 0, "accepted": 0}


@dataclass
class NullRecord:
    """A step whose plugin work failed: each of its committed tokens gets null in every per-token trace, so that
    the request's later values stay at their tokens (SGLang slices the lists by output offset)."""

    rows: BatchRows
    committed: object = None  # tokens each row committed (a verify step's accept lengths); None: one a row

    def tokens(self) -> list[int]:
        self.rows.drop_released()
        n = [1] * len(self.rows.reqs) if self.committed is None else [int(k) for k in self.committed]
        return [committed_tokens(r, k) if s is not None else 0 for r, s, k in zip(self.rows.reqs, self.rows.states, n)]

    def finish(self, rt: Runtime) -> None:
        for req, state, n in zip(self.rows.reqs, self.rows.states, self.tokens()):
            if n:
                pad_tokens(rt, req, state, token_count(req) + n)


def committed_tokens(req, n: int) -> int:
    """Of `n` tokens a step produced for `req`, those that are its own (SGLang cuts what passes max_new_tokens)."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return max(1, min(n, left)) if left > 0 else n


def token_count(req) -> int:
    """Tokens of `req` that have trace values."""
    return len((req.customized_info or {}).get("entropy", ()))


def pad_tokens(rt: Runtime, req, state: RequestState, length: int) -> None:
    """Every per-token list of `req` filled up to `length` values: null where a value could not be computed, the
    cumulative ones at the trace's value."""
    info = req.customized_info = req.customized_info if req.customized_info is not None else {}
    keys = TRACE_KEYS + (tuple(NO_DRAFT) if rt.config.speculative_on else ())
    fill = {**dict.fromkeys(keys), "_entropic_time": state.trace.tau, "_entropic_efficiency": state.trace.efficiency}
    for key, value in fill.items():
        values = info.setdefault(key, [])
        values.extend([value] * (length - len(values)))


@dataclass
class StepTally:
    """A step's contribution to the metrics, summed over its tokens."""

    tau: float = 0.0
    flops: float = 0.0
    measured: list = field(default_factory=list)
    fractions: list = field(default_factory=list)
    temperatures: list = field(default_factory=list)
    parked: int = 0

    def report(self, rt: Runtime) -> None:
        rt.tau_total += self.tau
        rt.cost_total += self.flops
        if rt.metrics is not None:
            rt.metrics.observe(self.measured, self.tau, self.flops, self.fractions, self.temperatures, self.parked)


def record_token(
    rt: Runtime,
    req,
    state: RequestState,
    tally: StepTally,
    entropy: float,
    surprisal: float,
    ok: bool,
    temperature: float,
    cost: float,
    parked: int = 0,
    attended: float = 1.0,
    decode: bool = True,
    **extra,
) -> None:
    """One committed token: its trace (tau, cost), the gain memory, the per-token values for the client."""
    trace = state.trace
    if state.controller is not None:
        tally.temperatures.append(temperature)
    if decode:
        tally.fractions.append(attended)
        tally.parked += parked
    if ok:
        tally.tau += trace.record(entropy, surprisal, cost)
        tally.flops += cost
        state.gain.observe(entropy)
        tally.measured.append(entropy)
    # null marks a step whose logits were not finite (nothing measured, tau unchanged)
    append_customized(
        req,
        entropy=entropy if ok else None,
        surprisal=surprisal if ok else None,
        temperature=temperature,
        parked=parked,
        attended=attended,
        **extra,
        _entropic_time=trace.tau,
        _entropic_efficiency=trace.efficiency,
    )


def append_customized(req, **values) -> None:
    """Per-token values travel to the client through SGLang's `req.customized_info` -> meta_info."""
    if req.customized_info is None:
        req.customized_info = {}
    for key, value in values.items():
        req.customized_info.setdefault(key, []).append(value)


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
    # so the rows live in the Runtime, not on the batch object).
    rt.rows = BatchRows.of(reqs, produces, decode, getattr(batch, "forward_iter", None))
    return forward_batch


def around_model_runner_sample(original, runner, logits_output, forward_batch, *args, **kwargs):
    rt = runtime.current()
    rt.forward_batch = forward_batch
    if rt.controllers is None:
        rt.controllers = ControllerTable(runner.req_to_token_pool.req_to_token.shape[0], runner.device)
    try:
        return original(runner, logits_output, forward_batch, *args, **kwargs)
    finally:
        rt.forward_batch = rt.rows = None  # finished requests must not stay referenced


def around_sampler_forward(original, sampler, logits_output, sampling_info, *args, **kwargs):
    rt = runtime.current()
    fb = rt.forward_batch
    rows = rt.rows
    logits = logits_output.next_token_logits
    if rows is None or logits is None:  # not a batch of ours (an idle batch)
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    # A fault in our per-step work must cost the step its entropic control, never the scheduler.
    try:
        if logits.shape[0] != len(rows.reqs):
            raise RuntimeError(f"{logits.shape[0]} rows of logits for a batch of {len(rows.reqs)} requests")
        step = SamplingStep(rows, fb.req_pool_indices, sampling_info, logits, rt.controllers, rt.scratch)
        # The sampler turns logits into probabilities in place, except in an all-greedy batch without custom
        # processors (argmax; at most its NaN guard rewrites non-finite entries): there, no copy is needed.
        snapshot = (
            logits
            if keeps_logits(sampling_info, step.inv_request_t)
            else rt.scratch.snapshot(logits, step.inv_request_t)
        )
    except Exception:
        rt.fault("the sampling step's controller (sampled without control)")
        token_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
        rt.pending.append(NullRecord(rows))
        return token_ids
    token_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    try:
        stats, pending = step.record(snapshot, token_ids, fb.seq_lens_cpu.tolist(), rt.scratch)
    except Exception:
        rt.fault("the sampling step's signal")
        rt.pending.append(NullRecord(rows))
        return token_ids
    rt.pending.append(pending)
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


def before_process_batch_result(scheduler, batch, *args, **kwargs):
    """Finish the sampled steps up to this batch (the overlap scheduler has launched the next one
    already: its record stays pending), before SGLang sends the batch's tokens with their traces."""
    finish_pending(runtime.current(), getattr(batch, "forward_iter", None))


def finish_pending(rt: Runtime, forward_iter: Optional[int] = None) -> None:
    """Finish pending records in order, those of batches up to `forward_iter` (None: all). A record that fails
    leaves each of its rows with exactly the tokens it committed, null where a value is missing."""
    while rt.pending and (
        forward_iter is None
        or rt.pending[0].rows.forward_iter is None
        or rt.pending[0].rows.forward_iter <= forward_iter
    ):
        pending = rt.pending.popleft()
        try:
            counts = pending.tokens()
            ends = [token_count(req) + n for req, n in zip(pending.rows.reqs, counts)]
        except Exception:  # nothing to align the traces by
            rt.fault("counting a step's committed tokens")
            continue
        try:
            pending.finish(rt)
        except Exception:
            rt.fault("recording a step's trace values")
            for req, state, n, end in zip(pending.rows.reqs, pending.rows.states, counts, ends):
                if n:
                    pad_tokens(rt, req, state, end)
