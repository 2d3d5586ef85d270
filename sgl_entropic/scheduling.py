"""Macro loop: entropy-aware scheduling, pure Python (never imports sglang).

The runtime builds one plain :class:`RequestView` per request and calls the functions here;
they return indices/masks and never touch SGLang objects.  Everything is a deterministic
function of its arguments -- no randomness, no wall clock, no dict/set iteration order -- so
every tensor-parallel rank computes the same schedule from the same views.

Priority (the paper's formula, read literally)
==============================================

    pi(s) = E[dH_s] / max(alpha*C_s + beta*M_s + gamma*L_s, MIN_DENOMINATOR)

expected entropy reduction per unit of compute, KV memory and latency risk.  The terms:

``E[dH_s]`` -- :class:`GainEstimator`, one per request, in nats per step.
    Observed gain of a step: the positive entropy drop ``d_t = max(0, H_{t-1} - H_t)``.
    ``E[dH]`` is an EMA with decay ``d = cfg.gain_ema``: ``g_k = d*g_{k-1} + (1-d)*d_k``,
    started at a prior ``g_0``.  The first ``observe`` only records ``H`` (there is no drop
    without a previous entropy), so the prior stands until the second observation.
    Prior (:func:`initial_gain`): the E[dH] last seen for the same first prompt tokens
    (:class:`GainMemory`: the previous turn of a conversation, or requests over the same
    system prompt); else :func:`prior_gain`, ``g_0 = 0.5 * mu`` where ``mu`` is the mean step
    entropy expected: the request's target H* when its sampling controller holds it there,
    or the mean surprisal of the prompt tokens in nats when a caller knows it, else
    ``DEFAULT_MEAN_ENTROPY_NATS = 2.0`` (the default target entropy H* of the sampling
    loop).  Why 0.5: for a calibrated model E[H_t] equals the expected surprisal, so ``mu``
    estimates the mean step entropy; if step entropies were i.i.d. exponential with mean
    ``mu`` (a fair first model of LM entropies: nonnegative, spread ~ mean), then
    ``H_{t-1} - H_t`` is Laplace(0, mu) and ``E[max(0, H_{t-1} - H_t)] = mu / 2``.  Real
    entropies are autocorrelated, so this over-estimates a little; it is only a prior and
    its weight decays as ``d**k`` after ``k`` observed drops.

``C_s`` -- compute of the next step: ``view.step_cost / scales.cost_ref_gflop``.
    ``step_cost`` is in GFLOP and computed by the runtime (one decode token for a running
    request, the prefill of the uncached prompt for a waiting one).  The runtime should set
    ``cost_ref_gflop`` to the GFLOP of one decode token of the served model, so that C is
    in "token equivalents" (a decode step has C ~ 1, a 500-token prefill C ~ 500).

``M_s`` -- KV memory: ``view.kv_pages / scales.kv_ref_pages``.
    ``kv_pages`` is what the request holds now (running: its pages; waiting: 0, or its
    cached prefix as the view reports it).  The runtime should set ``kv_ref_pages`` to the
    KV pool size in pages (identical on every TP rank), so M is the fraction of the pool.

``L_s`` -- latency term, defined as the request's remaining latency *slack*:

        L_s = max(0, 1 - w_s / A),     A = age_limit_steps(cfg, scales)
            = ceil(cfg.latency_target_s / scales.step_time_s)

    where ``w_s = view.waited_steps`` and ``step_time_s`` is a *nominal* (constant, not
    measured) step duration, so the key never reads a rank-local clock.  Honest note: the
    paper calls L "latency risk" and puts it in the denominator.  A risk that grows with
    waiting would, in the denominator, push the requests closest to missing their target
    to the back -- backwards for a latency SLO.  We therefore read L as the latency cost of
    serving ``s`` *now rather than the others*: a request with its whole budget left
    (L = 1) can be deferred at no SLO risk, so serving it spends budget of requests that
    are nearer their deadline; a request at its target (L = 0) costs nothing to serve
    early.  With this reading the formula is kept literally and the term is oriented the
    right way: as a request waits, L falls and pi rises.  For a running request
    ``waited_steps`` counts skipped decode steps, normally 0, so L = 1 is a constant there.

``MIN_DENOMINATOR = 1e-9`` keeps pi finite when every weighted term is 0 (e.g. gamma-only
weights and a request at its target); such requests simply sort first, ties by arrival.

Aging and the starvation bound
==============================

pi is bounded for a request that waits (at most gain / (alpha*C + beta*M)), so a stream of
higher-gain arrivals could starve it forever.  The ordering key therefore adds explicit
aging, in two layers (:func:`sort_key`):

1. soft: ``aged = pi * (1 + w / A)`` -- priority doubles by the time a request reaches its
   latency target (works even with gamma = 0);
2. hard: a request with ``w >= A`` is *overdue*.  All overdue requests sort before all
   others, and among themselves strictly FIFO by ``arrival_seq`` (then ``rid``).  Priority
   is ignored for them, so a zero-gain request ages exactly like any other.

Theorem (waiting queue).  Assume (W) a waiting request's ``waited_steps`` grows by one per
scheduler step and ``arrival_seq`` increases with admission time, and (P) each step the
runtime admits a non-empty prefix of ``order_waiting`` while the queue is non-empty.  Let
``s`` arrive at step ``a`` and let ``r_s`` be the number of requests with a smaller
``arrival_seq`` still waiting at step ``a + A``.  Then ``s`` is admitted no later than step
``a + A + r_s``, and from step ``a + A`` on its position in ``order_waiting`` is at most
the number of waiting requests with smaller ``arrival_seq`` (non-increasing).

Proof.  From step ``a + A`` on, ``s`` is overdue.  A request ahead of an overdue ``s`` must
itself be overdue with a smaller ``arrival_seq``: non-overdue requests sort after all
overdue ones, and overdue ones are FIFO.  Requests arriving after ``s`` have larger
``arrival_seq``, so the set ahead of ``s`` only loses members; by (P) each step admits at
least its head, so it is empty after at most ``r_s`` steps, and then ``s`` is the head and
is admitted.  The bound holds whatever the gains, costs and arrival rate.  (A request that
is retracted and re-queued with its old ``arrival_seq`` but reset ``waited_steps`` can
re-join the set ahead of ``s``; the bound then grows by one step per such re-entry.)
Without the hard layer the bound fails: see ``tests/test_scheduling.py``, where a request
of low gain is never admitted under pure-pi ordering.

Theorem (decode budget, :func:`select_decode`).  Assume a running request's
``waited_steps`` is the number of consecutive steps it was not decoded (reset to 0 when it
decodes).  Every row with ``waited_steps >= cfg.max_skip_steps - 1`` is selected, so a
request is skipped at most ``max_skip_steps - 1`` consecutive steps: it decodes at least
once in every window of ``max_skip_steps`` consecutive steps.  (If the runtime counts
"steps since the last decode", 1 right after a decode, the guarantee only gets tighter.)
The guarantee wins over the budget: if more rows are forced than ``decode_budget`` allows,
all forced rows are selected and the step exceeds the budget.  That can only persist when
``len(running) > decode_budget * max_skip_steps``, i.e. when the budget cannot serve
everyone within the window at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from sgl_entropic.config import SchedulingConfig
from sgl_entropic.costs import ModelDims, step_cost

__all__ = [
    "DEFAULT_MEAN_ENTROPY_NATS",
    "DEFAULT_STEP_TIME_S",
    "MIN_DENOMINATOR",
    "RequestView",
    "Scales",
    "DEFAULT_SCALES",
    "GainEstimator",
    "prior_gain",
    "initial_gain",
    "GainMemory",
    "age_limit_steps",
    "cost_terms",
    "priority",
    "aged_priority",
    "sort_key",
    "order_waiting",
    "retraction_order",
    "select_decode",
    "advance_skips",
    "model_scales",
    "waiting_view",
    "running_view",
]

DEFAULT_MEAN_ENTROPY_NATS = 2.0
DEFAULT_STEP_TIME_S = 0.02
MIN_DENOMINATOR = 1e-9


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class RequestView:
    """What the scheduler knows of one request; built by the runtime, identical on all ranks."""

    rid: str
    arrival_seq: int  # monotone admission counter, identical on every TP rank
    waited_steps: int  # waiting: steps since arrival; running: consecutive skipped decode steps
    prompt_len: int
    output_len: int
    kv_pages: int  # KV pages held now (0 while waiting, except cached prefix)
    expected_gain: float  # E[dH] from GainEstimator, nats
    step_cost: float  # C: compute of its next step, GFLOP

    def __post_init__(self) -> None:
        for name in ("arrival_seq", "waited_steps", "prompt_len", "output_len", "kv_pages"):
            _count(name, getattr(self, name))
        if _finite("expected_gain", self.expected_gain) < 0.0:
            raise ValueError(f"expected_gain must be >= 0, got {self.expected_gain}")
        if _finite("step_cost", self.step_cost) < 0.0:
            raise ValueError(f"step_cost must be >= 0, got {self.step_cost}")


@dataclass(frozen=True)
class Scales:
    """Units that make C, M and L comparable; constants, identical on every rank.

    cost_ref_gflop: GFLOP of one decode token of the model (C in token equivalents).
    kv_ref_pages:   KV pool size in pages (M as the fraction of the pool held).
    step_time_s:    nominal duration of one scheduler step; converts latency_target_s into
                    steps.  A constant on purpose: a measured step time is rank-local.
    """

    cost_ref_gflop: float = 1.0
    kv_ref_pages: float = 1.0
    step_time_s: float = DEFAULT_STEP_TIME_S

    def __post_init__(self) -> None:
        for name in ("cost_ref_gflop", "kv_ref_pages", "step_time_s"):
            if _finite(name, getattr(self, name)) <= 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


DEFAULT_SCALES = Scales()


# --------------------------------------------------------------------------- views from plain numbers


def model_scales(dims: ModelDims, pool_tokens: int, page_size: int) -> Scales:
    """The served model's units: C in decode-token equivalents, M as the fraction of the KV pool."""
    return Scales(cost_ref_gflop=step_cost(dims, 0) / 1e9, kv_ref_pages=max(1.0, pool_tokens / page_size))


def waiting_view(
    *, rid: str, arrival_seq: int, waited_steps: int, prompt_len: int, output_len: int,
    uncached_tokens: int, expected_gain: float, scales: Scales,
) -> RequestView:
    """A waiting request: its next step is the prefill of its uncached tokens; it holds no KV yet."""
    return RequestView(
        rid=rid, arrival_seq=arrival_seq, waited_steps=max(0, waited_steps), prompt_len=prompt_len,
        output_len=output_len, kv_pages=0, expected_gain=expected_gain,
        step_cost=uncached_tokens * scales.cost_ref_gflop,
    )


def running_view(
    *, rid: str, arrival_seq: int, skipped_steps: int, prompt_len: int, output_len: int, seq_len: int,
    page_size: int, expected_gain: float, dims: ModelDims,
) -> RequestView:
    """A running request: its next step is one decode token over its context; it holds its pages."""
    return RequestView(
        rid=rid, arrival_seq=arrival_seq, waited_steps=max(0, skipped_steps), prompt_len=prompt_len,
        output_len=output_len, kv_pages=-(-seq_len // page_size), expected_gain=expected_gain,
        step_cost=step_cost(dims, seq_len) / 1e9,
    )


# --------------------------------------------------------------------------- gain estimator


def prior_gain(prompt_mean_surprisal: Optional[float] = None) -> float:
    """E[dH] before any observed drop: half the mean prompt surprisal (nats); see module doc."""
    if prompt_mean_surprisal is None:
        mu = DEFAULT_MEAN_ENTROPY_NATS
    else:
        mu = _finite("prompt_mean_surprisal", prompt_mean_surprisal)
        if mu < 0.0:
            raise ValueError(f"prompt_mean_surprisal must be >= 0, got {mu}")
    return 0.5 * mu


class GainMemory:
    """E[dH] last seen per prompt prefix, so a waiting request starts from what the runtime knows.

    The key is the request's first ``prefix_tokens`` prompt tokens: the next turn of a
    conversation repeats the previous turn's prompt, and requests over one system prompt share
    it, so both find the gain their predecessors showed. Least recently written entries go
    first past ``capacity``. Plain integers in, floats out: the same on every TP rank.
    """

    def __init__(self, prefix_tokens: int = 64, capacity: int = 4096) -> None:
        _count("prefix_tokens", prefix_tokens)
        _count("capacity", capacity)
        self.prefix_tokens, self.capacity = prefix_tokens, capacity
        self._gains: dict[tuple[int, ...], float] = {}

    def key(self, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(prompt_ids[: self.prefix_tokens])

    def get(self, key: tuple[int, ...]) -> Optional[float]:
        return self._gains.get(key)

    def put(self, key: tuple[int, ...], gain: float) -> None:
        self._gains.pop(key, None)  # re-insert: dicts keep insertion order, oldest first
        self._gains[key] = _finite("gain", gain)
        if len(self._gains) > self.capacity:
            del self._gains[next(iter(self._gains))]

    def __len__(self) -> int:
        return len(self._gains)


def initial_gain(remembered: Optional[float], target_entropy: Optional[float]) -> float:
    """A new request's E[dH]: the gain remembered for its prompt prefix; else, for a request whose
    entropy a controller holds near H*, :func:`prior_gain` with mu = H*; else the default prior."""
    if remembered is not None:
        return _finite("remembered gain", remembered)
    return prior_gain(target_entropy)


class GainEstimator:
    """Per-request EMA of positive entropy drops, started at a prior (:func:`initial_gain`)."""

    __slots__ = ("_decay", "_gain", "_last_entropy", "_drops")

    prior_gain = staticmethod(prior_gain)

    def __init__(self, cfg: SchedulingConfig, prompt_mean_surprisal: Optional[float] = None,
                 initial: Optional[float] = None) -> None:
        self._decay = float(cfg.gain_ema)
        self._gain = prior_gain(prompt_mean_surprisal) if initial is None else _finite("initial", initial)
        self._last_entropy: Optional[float] = None
        self._drops = 0

    def observe(self, entropy: float) -> None:
        """Record this step's entropy H_t (nats); from the second call on, update the EMA."""
        h = _finite("entropy", entropy)
        if self._last_entropy is not None:
            drop = max(0.0, self._last_entropy - h)
            self._gain = self._decay * self._gain + (1.0 - self._decay) * drop
            self._drops += 1
        self._last_entropy = h

    @property
    def expected_gain(self) -> float:
        return self._gain

    @property
    def last_entropy(self) -> Optional[float]:
        return self._last_entropy

    @property
    def num_drops(self) -> int:
        """Number of drops folded into the EMA (observations minus one, or 0)."""
        return self._drops


# --------------------------------------------------------------------------- priority


def age_limit_steps(cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> int:
    """A = ceil(latency_target_s / step_time_s) >= 1: the wait, in steps, that makes a request overdue."""
    ratio = cfg.latency_target_s / scales.step_time_s
    # The tolerance keeps e.g. 0.3 / 0.1 = 2.9999999999999996 and 3.0000000000000004 at 3.
    return max(1, math.ceil(ratio - 1e-9 * max(1.0, ratio)))


def _terms(view: RequestView, scales: Scales, a: int) -> tuple[float, float, float]:
    c = view.step_cost / scales.cost_ref_gflop
    m = view.kv_pages / scales.kv_ref_pages
    lat = max(0.0, 1.0 - view.waited_steps / a)
    return c, m, lat


def _priority(view: RequestView, cfg: SchedulingConfig, scales: Scales, a: int) -> float:
    c, m, lat = _terms(view, scales, a)
    denom = cfg.alpha * c + cfg.beta * m + cfg.gamma * lat
    return view.expected_gain / max(denom, MIN_DENOMINATOR)


def _key(view: RequestView, cfg: SchedulingConfig, scales: Scales, a: int) -> tuple:
    if view.waited_steps >= a:
        return (0, 0.0, view.arrival_seq, view.rid)
    aged = _priority(view, cfg, scales, a) * (1.0 + view.waited_steps / a)
    return (1, -aged, view.arrival_seq, view.rid)


def cost_terms(
    view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES
) -> tuple[float, float, float]:
    """(C, M, L) of the denominator, normalised as the module docstring defines them."""
    return _terms(view, scales, age_limit_steps(cfg, scales))


def priority(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> float:
    """The paper's pi(s) = E[dH] / (alpha*C + beta*M + gamma*L), without aging."""
    return _priority(view, cfg, scales, age_limit_steps(cfg, scales))


def aged_priority(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> float:
    """Soft aging: pi(s) * (1 + waited_steps / A)."""
    a = age_limit_steps(cfg, scales)
    return _priority(view, cfg, scales, a) * (1.0 + view.waited_steps / a)


def sort_key(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> tuple:
    """Ascending key = best first: overdue (FIFO) before the rest (by aged pi, then arrival)."""
    return _key(view, cfg, scales, age_limit_steps(cfg, scales))


def order_waiting(
    views: Sequence[RequestView], cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES
) -> list[int]:
    """Indices into ``views``, highest priority first (admit in this order)."""
    a = age_limit_steps(cfg, scales)
    keys = [_key(v, cfg, scales, a) for v in views]
    return sorted(range(len(views)), key=keys.__getitem__)


def retraction_order(
    views: Sequence[RequestView], cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES
) -> list[int]:
    """Indices into ``views``, lowest priority first (retract in this order).

    Exactly the reverse of :func:`order_waiting`, so among equal priorities the most
    recent arrival is retracted first.
    """
    return order_waiting(views, cfg, scales)[::-1]


def select_decode(
    views: Sequence[RequestView], cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES
) -> list[bool]:
    """Mask of the running rows to decode this step.

    All rows when ``cfg.decode_budget`` is None or not exceeded.  Otherwise every row with
    ``waited_steps >= cfg.max_skip_steps - 1`` is forced in (it would otherwise exceed
    ``max_skip_steps - 1`` consecutive skips), and the remaining ``budget - forced`` slots
    go to the other rows in :func:`sort_key` order.  If the forced rows alone exceed the
    budget, exactly the forced rows are selected: the guarantee wins over the budget.
    """
    n = len(views)
    budget = cfg.decode_budget
    if budget is None or n <= budget:
        return [True] * n
    threshold = cfg.max_skip_steps - 1
    mask = [v.waited_steps >= threshold for v in views]
    free = budget - sum(mask)
    if free > 0:
        a = age_limit_steps(cfg, scales)
        rest = [i for i in range(n) if not mask[i]]
        rest.sort(key=lambda i: _key(views[i], cfg, scales, a))
        for i in rest[:free]:
            mask[i] = True
    return mask


def advance_skips(skips: Sequence[int], decodes: Sequence[bool]) -> tuple[list[int], list[int]]:
    """The decode budget's bookkeeping for one decode step, run on EVERY decode step.

    skips[i] is row i's consecutive parked steps before this step. Returns (new skips, parked
    before token): a row that decodes waited skips[i] steps right before this token and starts
    again at 0; a parked row waits one step more and produces no token (0). A step on which the
    whole batch decodes clears every count, so no request carries a stale one into later tokens.
    """
    if len(skips) != len(decodes):
        raise ValueError(f"{len(skips)} skip counts but {len(decodes)} decode flags")
    new_skips = [0 if d else s + 1 for s, d in zip(skips, decodes)]
    parked = [s if d else 0 for s, d in zip(skips, decodes)]
    return new_skips, parked
