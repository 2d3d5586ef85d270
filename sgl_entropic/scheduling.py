"""Macro loop: entropy-aware scheduling, pure Python (never imports sglang).

The runtime builds one plain :class:`RequestView` per request and calls the functions here;
they return indices/masks and never touch SGLang objects.  Everything is a deterministic
function of its arguments -- no randomness, no wall clock, no dict/set iteration order -- so
every tensor-parallel rank computes the same schedule from the same views.

Priority
========

    pi(s) = min(E[dH_s], g_max) / max(alpha*C_s + beta*M_s + gamma*L_s, MIN_DENOMINATOR)

expected entropy reduction per unit of remaining work, KV memory and latency slack.

``E[dH_s]`` -- :class:`GainEstimator`: an EMA (decay ``cfg.gain_ema``) of the positive entropy
    drops ``max(0, H_{t-1} - H_t)`` of the request's own decode steps, started at
    ``g_max = cfg.max_gain``.  A waiting request has no decode steps, so every waiting request
    has ``E[dH] = g_max``: nothing a request sends (its target entropy, its temperature) and
    nothing other requests over the same prompt did sets its priority.  The cap ``g_max`` means
    a request's own entropy can only lower its priority (a resolved request, with small
    drops, yields to the others), never raise it above what the server's config allows.

``C_s`` -- expected remaining work, in *work units* (one unit = one prefill token):
    ``view.work = uncached prompt tokens + decode_weight * expected remaining output tokens``
    (:func:`remaining_work`).  ``decode_weight`` is what one decode token costs the server in
    prefill-token equivalents (a config constant, so all ranks agree).  The remaining output is
    exact under ``ignore_eos`` (``max_new_tokens`` minus what is generated); otherwise
    ``min(tokens left under max_new_tokens, cfg.expected_output_tokens)``.  Serving the
    smallest remaining work first is the SRPT rule, latency-optimal when work is known.

``M_s`` -- KV memory: ``view.kv_pages / scales.kv_ref_pages``, the fraction of the KV pool the
    request holds (0 while waiting).

``L_s`` -- remaining latency slack, ``max(0, 1 - age_s / A)`` with ``A = cfg.max_wait``.  As a
    request ages, L falls and pi rises.  (The paper puts a "latency risk" here; a risk that
    grows with waiting would, in the denominator, push the requests nearest their deadline
    back, so the slack is the term oriented the right way.)

Age: the scheduler's clock is *work served*
===========================================

``age_s`` is the work the server has served (prefill tokens, plus ``decode_weight`` per decode
token) since the request *first* arrived.  Why not wall time: every tensor-parallel rank must
take identical decisions, and each rank's clock differs; the tokens of each forward batch are
the same on every rank.  Why not forward steps: a step may carry one decode token or a
thousand-token prefill.  Work served tracks wall time as well as the cost weights do
(``benchmarks/scheduling_policies.py`` reports the units served per second), and it is counted
from the first arrival, so a request retracted and re-queued keeps its age: it comes back
overdue or nearly so, and its total wait stays bounded.

Ordering key (:func:`sort_key`), best first:

1. priority tier (SGLang's per-request ``priority`` under ``--enable-priority-scheduling``,
   lower tier first; 0 for every request otherwise): the user's priorities always come first;
2. overdue (``age >= A``) before the rest, overdue ones strictly FIFO by ``arrival_seq``;
3. soft aging: ``pi * (1 + age / A)``, highest first; ties by ``arrival_seq``, then ``rid``.

Theorem (waiting queue, one tier).  Let ``s`` arrive (first) when the server has served ``a``
work units, and let ``arrival_seq`` increase with first arrival.  From the moment the server has
served ``a + A`` units on, every request admitted before ``s`` arrived before ``s``: ``s`` is
overdue, non-overdue requests sort after every overdue one, and overdue ones are FIFO.  So after
``A`` units of work, ``s`` waits only for older requests, exactly as under FCFS; in all, ``s``
waits at most ``A`` units plus the admission of the requests older than it that are still
waiting then.  This holds whatever the gains, costs and arrival rate.  A request retracted and
re-queued keeps its ``arrival_seq`` and its age, so it re-joins the older requests and counts
among them.  Without the overdue layer the bound fails: a request of high cost waits forever
behind a stream of cheap ones (tested).

Theorem (decode budget, :func:`select_decode`).  A running request's ``skips`` is the number
of consecutive decode steps it was parked.  Every row with ``skips >= cfg.max_skip_steps - 1``
is selected, so a request is parked at most ``max_skip_steps - 1`` consecutive steps.  The
guarantee wins over the budget: if more rows are forced than ``decode_budget`` allows, all
forced rows decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from sgl_entropic.config import SchedulingConfig

__all__ = [
    "MIN_DENOMINATOR",
    "RequestView",
    "Scales",
    "DEFAULT_SCALES",
    "GainEstimator",
    "remaining_output",
    "remaining_work",
    "batch_work",
    "cost_terms",
    "priority",
    "aged_priority",
    "sort_key",
    "order_waiting",
    "select_decode",
    "advance_skips",
    "model_scales",
]

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
    arrival_seq: int  # monotone first-arrival counter, identical on every TP rank
    age: float  # work units served by the server since the request first arrived
    work: float  # C: expected remaining work, work units (remaining_work)
    expected_gain: float  # E[dH] from GainEstimator, nats
    kv_pages: int = 0  # KV pages held now (0 while waiting)
    skips: int = 0  # running: consecutive decode steps parked by the decode budget
    tier: int = 0  # user priority, lower first (SGLang's priority * sign); 0 without priorities

    def __post_init__(self) -> None:
        for name in ("arrival_seq", "kv_pages", "skips"):
            _count(name, getattr(self, name))
        if isinstance(self.tier, bool) or not isinstance(self.tier, int):
            raise TypeError(f"tier must be an int, got {type(self.tier).__name__}")
        for name in ("age", "work", "expected_gain"):
            if _finite(name, getattr(self, name)) < 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Scales:
    """kv_ref_pages: the KV pool size in pages (M is the fraction of the pool held); a constant."""

    kv_ref_pages: float = 1.0

    def __post_init__(self) -> None:
        if _finite("kv_ref_pages", self.kv_ref_pages) <= 0.0:
            raise ValueError(f"kv_ref_pages must be > 0, got {self.kv_ref_pages}")


DEFAULT_SCALES = Scales()


def model_scales(pool_tokens: int, page_size: int) -> Scales:
    return Scales(kv_ref_pages=max(1.0, pool_tokens / page_size))


# --------------------------------------------------------------------------- remaining work


def remaining_output(max_new_tokens: Optional[int], generated: int, ignore_eos: bool, cfg: SchedulingConfig) -> float:
    """Expected output tokens still to come: exact under ignore_eos, else capped by the typical answer."""
    left = math.inf if max_new_tokens is None else max(0, max_new_tokens - generated)
    if ignore_eos and left != math.inf:
        return float(left)
    return float(min(left, cfg.expected_output_tokens))


def remaining_work(uncached_tokens: int, output_tokens: float, cfg: SchedulingConfig) -> float:
    """C in work units: the prefill still to do plus the expected decode tokens at decode_weight each."""
    return uncached_tokens + cfg.decode_weight * output_tokens


def batch_work(extend_tokens: int, decode_rows: int, cfg: SchedulingConfig) -> float:
    """Work units one forward batch serves: what the scheduler's clock advances by."""
    return extend_tokens + cfg.decode_weight * decode_rows


# --------------------------------------------------------------------------- gain estimator


class GainEstimator:
    """Per-request EMA of positive entropy drops, started at (and credited up to) cfg.max_gain."""

    __slots__ = ("_decay", "_gain", "_last_entropy")

    def __init__(self, cfg: SchedulingConfig) -> None:
        self._decay = float(cfg.gain_ema)
        self._gain = float(cfg.max_gain)
        self._last_entropy: Optional[float] = None

    def observe(self, entropy: float) -> None:
        """Record this step's entropy H_t (nats); from the second call on, update the EMA."""
        h = _finite("entropy", entropy)
        if self._last_entropy is not None:
            drop = max(0.0, self._last_entropy - h)
            self._gain = self._decay * self._gain + (1.0 - self._decay) * drop
        self._last_entropy = h

    @property
    def expected_gain(self) -> float:
        return self._gain

    @property
    def last_entropy(self) -> Optional[float]:
        return self._last_entropy


# --------------------------------------------------------------------------- priority


def cost_terms(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> tuple[float, float, float]:
    """(C, M, L) of the denominator."""
    return view.work, view.kv_pages / scales.kv_ref_pages, max(0.0, 1.0 - view.age / cfg.max_wait)


def priority(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> float:
    """pi(s) = min(E[dH], g_max) / (alpha*C + beta*M + gamma*L), without aging."""
    c, m, lat = cost_terms(view, cfg, scales)
    denom = cfg.alpha * c + cfg.beta * m + cfg.gamma * lat
    return min(view.expected_gain, cfg.max_gain) / max(denom, MIN_DENOMINATOR)


def aged_priority(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> float:
    """Soft aging: pi(s) * (1 + age / A)."""
    return priority(view, cfg, scales) * (1.0 + view.age / cfg.max_wait)


def sort_key(view: RequestView, cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> tuple:
    """Ascending key = best first: tier, then overdue (FIFO) before the rest (by aged pi)."""
    if view.age >= cfg.max_wait:
        return (view.tier, 0, 0.0, view.arrival_seq, view.rid)
    return (view.tier, 1, -aged_priority(view, cfg, scales), view.arrival_seq, view.rid)


def order_waiting(views: Sequence[RequestView], cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> list[int]:
    """Indices into ``views``, best first (admit, or keep, in this order)."""
    keys = [sort_key(v, cfg, scales) for v in views]
    return sorted(range(len(views)), key=keys.__getitem__)


def select_decode(views: Sequence[RequestView], cfg: SchedulingConfig, scales: Scales = DEFAULT_SCALES) -> list[bool]:
    """Mask of the running rows to decode this step.

    All rows when ``cfg.decode_budget`` is None or not exceeded.  Otherwise every row with
    ``skips >= cfg.max_skip_steps - 1`` is forced in, and the remaining ``budget - forced``
    slots go to the other rows in :func:`sort_key` order.  If the forced rows alone exceed the
    budget, exactly the forced rows are selected: the guarantee wins over the budget.
    """
    n = len(views)
    budget = cfg.decode_budget
    if budget is None or n <= budget:
        return [True] * n
    mask = [v.skips >= cfg.max_skip_steps - 1 for v in views]
    free = budget - sum(mask)
    if free > 0:
        rest = [i for i in range(n) if not mask[i]]
        rest.sort(key=lambda i: sort_key(views[i], cfg, scales))
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
