"""Micro loop: entropy-stabilised sampling, and Mirostat v2 as the anchor comparator.

Pure torch; nothing here imports sglang. Every batched function works on tensors that live on
the logits' device, loops over no rows in Python and never synchronises with the host.

Entropic controller
-------------------
Per request the temperature is a control variable (entropies in nats)::

    T_{t+1} = clip(T_t * exp(-eta * (H_t - H*)), t_min, t_max)

Entropy ABOVE the target lowers T (commit), entropy BELOW the target raises T (explore). (The
paper printed the opposite sign; that direction is unstable, see below.)

Zero-lag use at each decode step, for the rows that have the controller on (the plugin keeps every
request's state in a device table by request slot, `plugin/sampling/controller.ControllerTable`, and
gathers the step's rows from it)::

    batch = ControllerBatch(*table.index_select(1, slots))      # the rows' states, on the device
    temperature, probe = batch.step(logits)                     # probe at the state T, update
    ... sample this step from softmax(logits / temperature[:, None]) ...
    table[...] = batch.temperature, batch.steps_done            # the state, back in the table

`step` measures the probe entropy H(softmax(z / T_state)), computes T_new from it with
`update_temperature`, and returns T_new: this step is sampled at T_new, and T_new is the state
of the next step. Rules, all per row:

* warm-up: while ``steps_done < warmup`` T is held (at t_init) but the step still counts;
* entropy floor: when the probe H < floor the step is a forced token and T is held
  (anti-windup: a run of near-deterministic tokens must not ramp T to t_max and then blow up
  on the next uncertain token);
* invalid rows (``valid`` False: the logits had NaN/inf) and non-finite probes are held.

Stability (log domain)
----------------------
With u = ln T the update is u_{t+1} = u_t - eta * (H(e^{u_t}) - H*), clipped to
[ln t_min, ln t_max]. Its slope is 1 - eta * dH/du, so near the fixed point u* (H(u*) = H*) it is
a contraction iff ``0 < eta * dH/du < 2``; the error shrinks by |1 - eta * C| per step and
``eta = 1 / C`` is dead-beat. C = dH/du is the "heat capacity" of the softmax:

    dH/d ln T = Var_p(ln p)

One-line derivation: with b = 1/T, ln p_i = b z_i - ln Z, H = ln Z - b <z>, d ln Z/db = <z> and
d<z>/db = Var(z), so dH/db = -b Var(z) and dH/du = (dH/db)(db/du) = (-b Var(z))(-b)
= Var(b z) = Var(ln p) (ln p and b z differ by the constant ln Z). Hence H is non-decreasing in
T (C >= 0), and by the mean-value theorem the clipped map contracts globally on any interval
where 0 < eta * C < 2 (the clip is a projection onto an interval containing u*, which does not
expand distances). The flipped sign has slope 1 + eta * C > 1: it runs away from u* to a bound.

Choosing eta: C at the operating point sets the usable gain (stable below 2 / C, dead-beat at
1 / C). Measured on synthetic 49k-vocabulary logits (Gaussian, Gumbel, Zipf, head + tail) at
H* = 2 nats, C(T*) is 4 to 15, so eta <= ~0.13 for local stability everywhere and 0.1 is the
recommended value; eta = 0.5 oscillates there (eta * C = 2 to 7.5).

Mirostat v2
-----------
As llama.cpp's ``llama_sampler_mirostat_v2``: mu starts at 2 tau; at each step softmax the
candidates (temperature 1 unless the caller scaled the logits), drop the tokens whose surprise
-log2 p exceeds mu but always keep one (the most probable), renormalise, sample, measure the
observed surprise s = -log2 p_renormalised(token), and set mu <- mu - eta * (s - tau). tau and
mu are in bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from torch import Tensor

from sgl_entropic.signal import Scratch, entropy_exact
from sgl_entropic.transfer import to_device

if TYPE_CHECKING:  # config imports pydantic only; keep this module torch-only at run time
    from sgl_entropic.config import SamplingConfig

__all__ = [
    "ControllerBatch",
    "ControllerState",
    "MirostatBatch",
    "MirostatState",
    "entropy",
    "heat_capacity",
    "mirostat_v2_mask",
    "mirostat_v2_update",
    "update_temperature",
]

_LN2 = math.log(2.0)

Scalar = Union[float, Tensor]


# ---------------------------------------------------------------------------------------------
# Sensor: entropy and heat capacity of softmax(z / T)
# ---------------------------------------------------------------------------------------------


def _log_probs(logits: Tensor, temperature: Optional[Tensor]) -> Tensor:
    z = logits.float()
    if temperature is not None:
        z = z / temperature.float().unsqueeze(-1)
    return torch.log_softmax(z, dim=-1)


def entropy(logits: Tensor, temperature: Optional[Tensor] = None, scratch: Optional[Scratch] = None) -> Tensor:
    """[B] entropy in nats of softmax(logits / temperature[:, None]): the signal's `entropy_exact`.

    -inf logits are masked tokens (they contribute 0); computed in float32. A row with no
    distribution (NaN, +inf, nothing finite) gives NaN, which `update_temperature` holds.
    `scratch`: reused buffers (see `signal.Scratch`); the scaled logits are written into one of them.
    """
    z = logits.float()
    if temperature is not None:
        t = temperature.float().unsqueeze(-1)
        z = z / t if scratch is None else torch.div(z, t, out=scratch.get(*z.shape, z.device)[0])
    return entropy_exact(z, scratch)


def heat_capacity(logits: Tensor, temperature: Optional[Tensor] = None) -> Tensor:
    """[B] dH/d ln T = Var_p(ln p) of p = softmax(logits / temperature[:, None]), in nats.

    See the module docstring for the derivation. The gain eta is locally stable iff
    0 < eta * heat_capacity < 2 at the operating temperature, and dead-beat at eta = 1 / C.
    """
    logp = _log_probs(logits, temperature)
    p = logp.exp()
    dev = torch.where(p > 0, logp + entropy(logits, temperature).unsqueeze(-1), torch.zeros_like(p))
    return (p * dev * dev).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Entropic controller
# ---------------------------------------------------------------------------------------------


def _like(x: Scalar, ref: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(device=ref.device, dtype=torch.float32)
    return torch.full_like(ref, float(x), dtype=torch.float32)


def update_temperature(
    temperature: Tensor,
    probe_entropy: Tensor,
    target: Scalar,
    eta: Scalar,
    t_min: Scalar,
    t_max: Scalar,
    floor: Scalar,
    steps_done: Scalar,
    warmup: Scalar,
    valid: Optional[Tensor] = None,
) -> Tensor:
    """The new temperature [B] float32: clip(T * exp(-eta * (H - H*)), t_min, t_max) per row.

    ``probe_entropy`` is H(softmax(z / temperature)) at the state temperature (nats).
    ``steps_done`` counts the steps of the request before this one; the row is held (its
    temperature returned unchanged) when ``steps_done < warmup``, when ``probe_entropy < floor``
    (forced token, anti-windup), when ``valid`` is False, or when the probe is not finite.
    Every argument is a [B] tensor or a Python number; no host sync. The result always lies
    in [t_min, t_max] for updated rows, also for huge eta (exp overflows to inf / 0 and the
    clip takes it); held rows keep their temperature exactly.
    """
    t = temperature.float()
    h = probe_entropy.float()
    err = h - _like(target, h)
    warm = _like(steps_done, h) >= _like(warmup, h)
    update = torch.isfinite(h) & (h >= _like(floor, h)) & warm
    if valid is not None:
        update = update & valid.to(device=h.device, dtype=torch.bool)
    err = torch.where(update, err, torch.zeros_like(err))  # no NaN reaches the arithmetic
    proposed = t * torch.exp(-_like(eta, h) * err)
    proposed = torch.minimum(torch.maximum(proposed, _like(t_min, h)), _like(t_max, h))
    return torch.where(update, proposed, t)


@dataclass
class ControllerState:
    """Per-request controller state: plain Python numbers, lives on the request object."""

    temperature: float
    target: float
    eta: float
    t_min: float
    t_max: float
    floor: float
    warmup: int
    steps_done: int = 0

    @classmethod
    def from_config(cls, cfg: "SamplingConfig", request_temperature: float) -> "ControllerState":
        """The state at the request's first step.

        t_init is ``cfg.t_init``, or else the request's temperature, which must then lie in
        [t_min, t_max]: it is never clipped silently (ValueError naming it).
        """
        if cfg.t_init is not None:
            t_init = float(cfg.t_init)
        else:
            t_init = float(request_temperature)
            if not (math.isfinite(t_init) and cfg.t_min <= t_init <= cfg.t_max):
                raise ValueError(
                    f"request temperature ({request_temperature}) must lie in "
                    f"[t_min, t_max] = [{cfg.t_min}, {cfg.t_max}] when t_init is not set"
                )
        return cls(
            temperature=t_init,
            target=float(cfg.target_entropy),
            eta=float(cfg.gain),
            t_min=float(cfg.t_min),
            t_max=float(cfg.t_max),
            floor=float(cfg.entropy_floor),
            warmup=int(cfg.warmup),
        )


@dataclass
class ControllerBatch:
    """Per-row controller parameters as [B] float32 tensors on one device.

    ``warmup`` and ``steps_done`` are float32 too (exact up to 2**24 steps; beyond that the
    comparison steps_done >= warmup stays true).
    """

    temperature: Tensor
    target: Tensor
    eta: Tensor
    t_min: Tensor
    t_max: Tensor
    floor: Tensor
    warmup: Tensor
    steps_done: Tensor

    @classmethod
    def from_rows(
        cls, rows: Sequence[ControllerState], device: Union[str, torch.device, None] = None
    ) -> "ControllerBatch":
        """A batch of the rows' states (one [8, B] host tensor, one host-to-device copy): for callers that hold
        states one by one (tests, benchmarks); the plugin keeps them on the device (module docstring)."""
        return cls(*fields_on_device(rows, CONTROLLER_FIELDS, device).unbind(0))

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def update(self, probe_entropy: Tensor, valid: Optional[Tensor] = None) -> Tensor:
        """`update_temperature` with this batch's parameters (does not change the batch)."""
        return update_temperature(
            self.temperature,
            probe_entropy,
            self.target,
            self.eta,
            self.t_min,
            self.t_max,
            self.floor,
            self.steps_done,
            self.warmup,
            valid,
        )

    def step(
        self, logits: Tensor, valid: Optional[Tensor] = None, scratch: Optional[Scratch] = None
    ) -> tuple[Tensor, Tensor]:
        """One zero-lag decode step on logits [B, V] (after penalties and grammar masks).

        Returns (temperature, probe_entropy): sample THIS step at ``temperature``; the batch's
        state becomes that temperature and ``steps_done`` advances by one for every row
        (held rows included). Rows whose logits have no distribution (NaN, +inf, all masked)
        have a NaN probe and are held; ``valid`` can hold further rows. ``scratch``: see `signal.Scratch`.
        """
        probe = entropy(logits, self.temperature, scratch)
        new_t = self.update(probe, valid)
        self.temperature = new_t
        self.steps_done = self.steps_done + 1
        return new_t, probe


# ---------------------------------------------------------------------------------------------
# Mirostat v2
# ---------------------------------------------------------------------------------------------


def mirostat_v2_mask(logits: Tensor, mu: Tensor) -> Tensor:
    """Logits [B, V] with the tokens of surprise -log2 softmax(logits) > mu set to -inf.

    The most probable token (argmax) is always kept, so a row keeps >= 1 token even for tiny
    (or -inf) mu; a NaN mu drops nothing (no surprise compares > NaN, as in llama.cpp). The
    input is not modified; the result has the input's dtype. Surprises are computed in float32
    on the (already temperature-scaled, if any) logits.
    """
    surprise = -_log_probs(logits, None) / _LN2
    drop = surprise > mu.float().unsqueeze(-1)
    top = logits.argmax(dim=-1, keepdim=True)
    drop = drop.scatter(-1, top, False)
    return logits.masked_fill(drop, float("-inf"))


def mirostat_v2_update(
    mu: Tensor,
    masked_logits: Tensor,
    token_ids: Tensor,
    tau: Scalar,
    eta: Scalar,
    valid: Optional[Tensor] = None,
) -> Tensor:
    """New mu [B] = mu - eta * (s - tau), s = -log2 p_renormalised(token) in bits.

    ``masked_logits`` is the output of `mirostat_v2_mask` (the renormalised distribution is its
    softmax); ``token_ids`` [B] the sampled tokens. Rows with ``valid`` False, or whose observed
    surprise is not finite (e.g. a token outside the kept set), keep their mu.
    """
    logp = _log_probs(masked_logits, None)
    s = -logp.gather(-1, token_ids.long().view(-1, 1)).squeeze(-1) / _LN2
    m = mu.float()
    keep = ~torch.isfinite(s)
    if valid is not None:
        keep = keep | ~valid.to(device=m.device, dtype=torch.bool)
    err = torch.where(keep, torch.zeros_like(s), s - _like(tau, m))
    return torch.where(keep, m, m - _like(eta, m) * err)


@dataclass
class MirostatState:
    """Per-request Mirostat v2 state (bits)."""

    mu: float
    tau: float
    eta: float

    @classmethod
    def from_config(cls, cfg: "SamplingConfig") -> "MirostatState":
        return cls(mu=2.0 * float(cfg.tau), tau=float(cfg.tau), eta=float(cfg.gain))


@dataclass
class MirostatBatch:
    """Per-row Mirostat v2 state as [B] float32 tensors on one device."""

    mu: Tensor
    tau: Tensor
    eta: Tensor

    @classmethod
    def from_rows(cls, rows: Sequence[MirostatState], device: Union[str, torch.device, None] = None) -> "MirostatBatch":
        return cls(*fields_on_device(rows, MIROSTAT_FIELDS, device).unbind(0))

    def mask(self, logits: Tensor) -> Tensor:
        return mirostat_v2_mask(logits, self.mu)

    def update(self, masked_logits: Tensor, token_ids: Tensor, valid: Optional[Tensor] = None) -> Tensor:
        """Advance mu after sampling ``token_ids`` from ``masked_logits``; returns the new mu."""
        self.mu = mirostat_v2_update(self.mu, masked_logits, token_ids, self.tau, self.eta, valid)
        return self.mu


# The batches' fields, in their order; ControllerState and MirostatState carry the same names.
CONTROLLER_FIELDS = tuple(f.name for f in fields(ControllerBatch))
MIROSTAT_FIELDS = tuple(f.name for f in fields(MirostatBatch))


def fields_on_device(states: Sequence, names: Sequence[str], device: Union[str, torch.device, None]) -> Tensor:
    """[fields, rows] float32 of the states' `names`, in one host-to-device copy (pinned for a GPU)."""
    values = [[float(getattr(s, n)) for s in states] for n in names]
    return to_device(values, device if device is not None else "cpu", torch.float32).reshape(len(names), len(states))
