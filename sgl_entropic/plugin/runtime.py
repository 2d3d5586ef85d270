"""The plugin's state in one SGLang process: one `Runtime` object, and one `RequestState` per request.

`register()` creates the Runtime (`install`); every hook reads it with `current()`. Nothing
else in the plugin keeps module-level state. In the scheduler the Runtime also holds what is
learnt from the served model at the first request (its shape, the scheduling scales) and the
scheduler's clock, which is the same on every tensor-parallel rank: the work each forward batch
serves and the admissions are counted, never timed (`sgl_entropic.scheduling`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from sgl_entropic.config import EntropicConfig, RequestSpeculation
from sgl_entropic.costs import ModelDims
from sgl_entropic.drafting import DraftCounts, DraftHits
from sgl_entropic.plugin.step import BatchRows, Steps
from sgl_entropic.sampling import ControllerState, MirostatState
from sgl_entropic.scheduling import GainEstimator, Scales
from sgl_entropic.signal import EntropyTrace, Scratch

if TYPE_CHECKING:  # the modules that fill these fields import this one
    from sgl_entropic.plugin.attention.page_planner import Probe
    from sgl_entropic.plugin.attention.page_store import PageStore
    from sgl_entropic.plugin.metrics import EntropicMetrics
    from sgl_entropic.plugin.sampling.controller import ControllerTable
    from sgl_entropic.plugin.speculation.worker import Speculation
    from sgl_entropic.plugin.timing import HookTimes

logger = logging.getLogger("sgl_entropic")


@dataclass(eq=False)  # identity semantics: tracked in a WeakSet
class RequestState:
    """What the loops keep per request; lives on SGLang's Req as `req.entropic`."""

    trace: EntropyTrace
    gain: GainEstimator
    arrival_seq: int  # admission counter, unique in the process and the same on every TP rank
    arrival_work: float  # the scheduler's clock (work served) at its first arrival: its age counts from here
    controller: Optional[ControllerState] = None
    mirostat: Optional[MirostatState] = None
    decode_skips: int = 0  # consecutive decode steps this running request is parked (decode budget)
    parked_before_token: int = 0  # decode steps it was parked right before the token being sampled
    last_step_entropy: Optional[float] = None  # mean entropy of the tokens its last step committed (draft sizing)
    drafts: DraftHits = field(default_factory=DraftHits)  # its verified drafts (draft sizing)
    speculation: Optional[RequestSpeculation] = None  # its own draft rule and cap (None: the server's)
    traced: bool = False  # it asked for per-token traces (return_entropy): only then are they kept
    draft_counts: DraftCounts = field(default_factory=DraftCounts)  # its speculation so far (meta_info)


@dataclass
class Runtime:
    config: EntropicConfig
    hooks: tuple = ()  # the hook table registered in this process (plugin.hook_table)
    times: Optional[HookTimes] = None  # what the table's scheduler handlers cost per step
    # Scheduler process, learnt at the first request.
    dims: Optional[ModelDims] = None
    scales: Optional[Scales] = None
    kv_page_size: int = 1
    priority_sign: int = 0  # --enable-priority-scheduling: 1 low values first, -1 high first; 0 off
    metrics: Optional[EntropicMetrics] = None
    controllers: Optional[ControllerTable] = None  # per request-pool slot, on the model's device
    pages: Optional[PageStore] = None  # the entropic attention backend's per-KV store (pruning on)
    pruning_from: Optional[int] = None  # the backend's min_context: given, or the measured crossover
    probe: Optional[Probe] = None  # its start-up pass: self-check, crossover timings
    speculation: Optional[Speculation] = None  # under NGRAM speculative decoding: the draft rule's state
    # The scheduler's clock: work served (scheduling.batch_work of every forward batch) and admissions so far.
    served: float = 0.0
    arrivals: int = 0
    # The signal over every committed token so far: tau (nats) and the cost model's work C (FLOPs).
    tau_total: float = 0.0
    cost_total: float = 0.0
    steps: Steps = field(default_factory=Steps)  # the forward steps open now (plugin/step.py); nothing else per step
    scratch: Scratch = field(default_factory=Scratch)  # the per-step signal's reused [B, V] buffers
    # HTTP process: OpenAI streams waiting for their traces, by request id (serving/openai_ext.py)
    openai_streams: dict = field(default_factory=dict)
    # Every RequestState alive, to prove that finished requests free theirs.
    live_states: "weakref.WeakSet[RequestState]" = field(default_factory=weakref.WeakSet)
    degraded: dict = field(default_factory=dict)  # faults in the plugin's own step work, by where (fault())

    def fault(self, where: str) -> None:
        """A fault in the plugin's own work on a step (called in its `except`): the step goes on without it and its
        tokens get null trace values. The first fault at each place is logged with its traceback, all are counted
        (/server_info entropic.degraded_steps, /metrics sglang:entropic_degraded_steps_total)."""
        n = self.degraded[where] = self.degraded.get(where, 0) + 1
        if n == 1:
            logger.error(
                "sgl-entropic: %s failed; the step runs without it and its trace values are null (logged "
                "once; later faults here are only counted)",
                where,
                exc_info=sys.exc_info()[0] is not None,
            )
        if self.metrics is not None:
            self.metrics.degraded.labels(where=where).inc()

    def new_request_state(
        self,
        controller: Optional[ControllerState],
        mirostat: Optional[MirostatState],
        speculation: Optional[RequestSpeculation] = None,
        traced: bool = False,
    ) -> RequestState:
        self.arrivals += 1
        state = RequestState(
            trace=EntropyTrace(keep_lists=False),
            gain=GainEstimator(self.config.scheduling),
            arrival_seq=self.arrivals,
            arrival_work=self.served,
            controller=controller,
            mirostat=mirostat,
            speculation=speculation,
            traced=traced,
        )
        self.live_states.add(state)
        return state


_runtime: Optional[Runtime] = None


def install(config: EntropicConfig, hooks: tuple = (), times: Optional[HookTimes] = None) -> Runtime:
    """The process's Runtime for `config` (a new one, replacing any before it)."""
    global _runtime
    _runtime = Runtime(config, hooks, times)
    return _runtime


def current() -> Runtime:
    if _runtime is None:
        raise RuntimeError("sgl-entropic: no runtime in this process (register() did not run with a config)")
    return _runtime


def installed() -> Optional[Runtime]:
    return _runtime


def step_rows(
    forward_batch, where: str = "the attention backend's rows (attended without them)"
) -> Optional[BatchRows]:
    """The rows of the step whose forward batch runs: None outside a step (the start-up probe) or where they are
    another batch's (a fault at `where`, counted: the reader goes on without them)."""
    step = _runtime.steps.current if _runtime is not None else None
    if step is None:
        return None
    try:
        return step.rows_for(forward_batch)
    except Exception:
        _runtime.fault(where)
        return None
