"""The signal's record of each step, in the scheduler process: per-token traces, the request's totals, metrics.

A step's sampled values reach the host as a record (`PendingRecord` for a sampled step, `VerifyRecord` for a
verify step, `NullRecord` for a step whose plugin work failed), kept on its `Step` until SGLang processes the
batch's result (`Scheduler.process_batch_result`); there `finish` turns them into each request's trace (tau,
cost), its gain memory, the metrics and, only for requests that asked, per-token values for the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sgl_entropic.costs import step_cost
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import RequestState, Runtime
from sgl_entropic.plugin.serving.meta_info import RUNNING_KEY, TOTALS_KEY, TRACE_KEYS
from sgl_entropic.plugin.step import BatchRows

# Under speculation, each decode step's drafts on its first token (null on the others and on a prefill's token):
# offered (its trie's match, within its cap), drafted (verified), accepted, and where they came from.
NO_DRAFT = {"offered": None, "drafted": None, "accepted": None, "draft_source": None}


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
            end = token_count(self.rows.reqs[i]) + 1
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
            send_totals(rt, self.rows.reqs[i], state, end)
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
    """Tokens of `req` that have values: in its traces, or on a stream in its running totals."""
    info = req.customized_info or {}
    return len(info.get("entropy") or info.get(RUNNING_KEY) or ())


def pad_tokens(rt: Runtime, req, state: RequestState, length: int) -> None:
    """A traced request's per-token lists filled up to `length` values (null where a value could not be computed),
    and every request's totals as they stand after them (`send_totals`)."""
    info = req.customized_info = req.customized_info if req.customized_info is not None else {}
    if state.traced:
        for key in TRACE_KEYS + (tuple(NO_DRAFT) if rt.config.speculative_on else ()):
            values = info.setdefault(key, [])
            values.extend([None] * (length - len(values)))
    send_totals(rt, req, state, length)


def send_totals(rt: Runtime, req, state: RequestState, length: int) -> None:
    """The request's cumulative values (tau, its efficiency, its speculation counts) after a step, `length` its
    tokens with values so far.

    A stream's chunks each carry the latest (`RUNNING_KEY`: SGLang slices it per chunk, so it holds one entry a
    token, the step's totals on each of its tokens); any other request's are sent once, when it finishes
    (`TOTALS_KEY`, one of SGLang's request-level keys)."""
    totals = {"entropic_time": state.trace.tau, "entropic_efficiency": state.trace.efficiency}
    if rt.config.speculative_on:
        totals["entropic_speculative"] = state.draft_counts.summary()
    info = req.customized_info = req.customized_info if req.customized_info is not None else {}
    if req.stream:
        running = info.setdefault(RUNNING_KEY, [])
        running.extend([totals] * (length - len(running)))
    else:
        info[TOTALS_KEY] = [totals]


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
    """One committed token: its trace (tau, cost), the gain memory and, where it asked, its per-token values for
    the client (its totals follow once per step: `send_totals`)."""
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
    if extra.get("drafted") is not None:  # a decode step's first token under speculation: the step's counts
        state.draft_counts.add(extra["offered"], extra["drafted"], extra["accepted"], extra["draft_source"])
    if state.traced:  # null marks a step whose logits were not finite (nothing measured, tau unchanged)
        append_customized(
            req,
            entropy=entropy if ok else None,
            surprisal=surprisal if ok else None,
            temperature=temperature,
            parked=parked,
            attended=attended,
            **extra,
        )


def append_customized(req, **values) -> None:
    """Per-token values travel to the client through SGLang's `req.customized_info` -> meta_info."""
    if req.customized_info is None:
        req.customized_info = {}
    for key, value in values.items():
        req.customized_info.setdefault(key, []).append(value)


# ---------------------------------------------------------------------------------------- hooks


def after_is_request_level_key(result, streamer, key, *args, **kwargs):
    """SGLang's `SchedulerOutputStreamer.is_request_level_customized_info_key`: a finished request's totals are
    sent once, not sliced per token."""
    return result or key == TOTALS_KEY


def before_process_batch_result(scheduler, batch, *args, **kwargs):
    """Finish the steps up to this batch (the overlap scheduler has launched the next one already: it stays
    open), before SGLang sends the batch's tokens with their traces."""
    finish_steps(runtime.current(), getattr(batch, "forward_iter", None))


def finish_steps(rt: Runtime, forward_iter: Optional[int] = None) -> None:
    """Close the steps of batches up to `forward_iter` (None: all) in order, finishing their records. A record
    that fails leaves each of its rows with exactly the tokens it committed, null where a value is missing."""
    for record in (r for step in rt.steps.done(forward_iter) for r in step.records):
        try:
            counts = record.tokens()
            ends = [token_count(req) + n for req, n in zip(record.rows.reqs, counts)]
        except Exception:  # nothing to align the traces by
            rt.fault("counting a step's committed tokens")
            continue
        try:
            record.finish(rt)
        except Exception:
            rt.fault("recording a step's trace values")
            for req, state, n, end in zip(record.rows.reqs, record.rows.states, counts, ends):
                if n:
                    pad_tokens(rt, req, state, end)
