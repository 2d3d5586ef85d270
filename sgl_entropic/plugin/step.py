"""One forward step in the scheduler process: what its hooks hand each other, in one object.

A `Step` is opened when SGLang picks a batch (`Scheduler.get_next_batch_to_run`), takes SGLang's number
for it (`forward_iter`) when the batch runs, and is closed when SGLang processes that batch's result
(`Scheduler.process_batch_result`), where its record (the sampled values, on their way to the host) is
finished. Under the overlap scheduler the next step is opened and run before the last one's result is
processed, so the runtime keeps the open steps in order (`Steps`), the newest being the one that runs.
The order of the hooks within a step is written down in docs/architecture.md ("One step, hook by hook").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sgl_entropic.plugin.runtime import RequestState, Runtime
    from sgl_entropic.plugin.scheduling.budget import DecodeSplit
    from sgl_entropic.plugin.signal.traces import NullRecord, PendingRecord
    from sgl_entropic.plugin.speculation.verification import VerifyRecord
    from sgl_entropic.plugin.speculation.worker import DraftPlan

    Record = Union[PendingRecord, NullRecord, VerifyRecord]


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


@dataclass
class Step:
    """One step's state, each field with the hooks that write -> read it."""

    forward_iter: Optional[int] = None  # SGLang's number of the batch, once it runs (ForwardBatch.init_new)
    split: Optional[DecodeSplit] = None  # the decode budget: update_running_batch -> the end of run_batch
    defer_prepare: bool = False  # inside update_running_batch: its prepare_for_decode waits for the split
    rows: Optional[BatchRows] = None  # ForwardBatch.init_new -> the attention backend, the sampler
    forward_batch: Optional[ForwardBatch] = None  # ModelRunner.sample -> Sampler.forward (cleared after sampling)
    plan: Optional[DraftPlan] = None  # speculation: forward_batch_generation -> its verify batch, verification
    records: list[Record] = field(default_factory=list)  # the sampler or the verification -> process_batch_result

    def rows_for(self, forward_batch) -> Optional[BatchRows]:
        """The rows of the forward batch being run, checked to be this step's (None: no rows of ours)."""
        rows = self.rows
        if rows is None:
            return None
        if rows.forward_iter != self.forward_iter or len(rows.reqs) != forward_batch.batch_size:
            raise RuntimeError(
                f"step {self.forward_iter}: rows of batch {rows.forward_iter} ({len(rows.reqs)} rows) "
                f"read for a forward batch of {forward_batch.batch_size}"
            )
        return rows

    def ran_by(self, forward_iter: int) -> bool:
        """Whether this step's batch ran before or as batch `forward_iter` (a step not yet run did not)."""
        return self.forward_iter is not None and self.forward_iter <= forward_iter

    def set_rows(self, rows: BatchRows) -> bool:
        """ForwardBatch.init_new: the batch the model runs next. False where the step had another batch's
        number (a fault to report: the rows given are still the truth for the forward that follows)."""
        same = self.forward_iter is None or rows.forward_iter == self.forward_iter
        self.forward_iter, self.rows = rows.forward_iter, rows
        return same


@dataclass
class Steps:
    """The steps opened and not yet processed, oldest first; the newest is the one that runs."""

    open: deque = field(default_factory=deque)

    @property
    def current(self) -> Optional[Step]:
        return self.open[-1] if self.open else None

    def begin(self) -> Step:
        """SGLang picks the next batch. A step that never ran (SGLang picked nothing) is replaced."""
        if self.open and self.open[-1].forward_iter is None and not self.open[-1].records:
            self.open.pop()
        self.open.append(Step())
        return self.open[-1]

    def ran(self, forward_iter: Optional[int]) -> bool:
        """Scheduler.run_batch returned: the step's forward is over; what it holds for the model is dropped.
        False where the step had another batch's number (a fault to report; it takes the batch's)."""
        step = self.current
        if step is None:
            return True
        same = step.forward_iter is None or forward_iter is None or step.forward_iter == forward_iter
        step.forward_iter = forward_iter if forward_iter is not None else step.forward_iter
        step.forward_batch = step.plan = None
        return same

    def done(self, forward_iter: Optional[int]) -> list[Step]:
        """Scheduler.process_batch_result(batch): the steps up to it (None: all), taken out in order."""
        out = []
        while self.open and (forward_iter is None or self.open[0].ran_by(forward_iter)):
            out.append(self.open.popleft())
        return out


def current_step(rt: Runtime) -> Step:
    """The step that runs; one is opened for a hook that runs outside SGLang's loop (a test, a tool)."""
    return rt.steps.current or rt.steps.begin()
