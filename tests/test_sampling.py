"""Tests of sgl_entropic.sampling: the entropic temperature controller and Mirostat v2.

Stated convergence bounds (tolerance |H - H*| < TOL = 0.05 nats, t in [t_min, t_max]):

1. Derived (rigorous), `test_converges_within_derived_bound_analytic`: with u = ln T and
   C(u) = dH/du = Var_p(ln p) >= 0 (the heat capacity), the H-error obeys
   e_{k+1} = e_k * (1 - eta * C(xi_k)) for some xi_k on the step (mean-value theorem).
   * if eta * C <= 1 on the range there is no overshoot and no clip, so
     n <= N1 = ceil(ln(|e_0| / TOL) / -ln(1 - eta * C_lo)), C_lo = min C between u_0 and u*;
   * if 1 < eta * C < 2 on the range, |u - u*| shrinks by q = max|1 - eta * C| per step (the
     clip is a projection onto an interval that holds u*), and |e| <= C_hi * |u - u*|, so
     n <= N2 = ceil(ln(C_hi * |u_0 - u*| / TOL) / -ln q).
   * if eta * C > 2 near u*, the fixed point repels (`test_deadbeat_gain_and_instability_beyond_two_over_c`).
2. Measured (stated with margin), `test_converges_on_softmax_family`: softmax(z / T) for fixed
   random logits z (Gaussian, Gumbel or Zipf, scale 0.5..3, V in 50..5000), t in [0.1, 2],
   eta = 0.1, H* in [max(H(t_min), 1) + 0.05, H(t_max) - 0.1] with loop gain eta * C(T*) >= 0.1:
   from ANY start in [t_min, t_max] the controller is within TOL after at most N_MAX = 100
   steps and stays there. Offline sweep over 551 such curves (starts 0.1, 0.2, 0.45, 1, 2): worst
   65 steps (a Gumbel curve, scale 3, H* = 1.05, start t_min: 30 steps to climb out of the frozen
   region at <= eta * H* = 0.1 in ln T per step, then the approach at loop gain ~0.1). Near u*
   the error shrinks by (1 - eta * C*) per step, i.e. ~ ln(ln V / TOL) / (eta * C*) steps; targets
   at low loop gain (H* near ln V, or near 0) converge proportionally slower, which is why the
   family is stated with eta * C* >= 0.1.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sgl_entropic.config import SamplingConfig
from sgl_entropic.sampling import (
    ControllerBatch,
    ControllerState,
    MirostatBatch,
    MirostatState,
    entropy,
    heat_capacity,
    mirostat_v2_mask,
    mirostat_v2_update,
    update_temperature,
)

torch.set_num_threads(1)

TOL = 0.05
T_MIN, T_MAX = 0.1, 2.0
N_MAX = 100  # stated bound of test_converges_on_softmax_family (measured worst: 65)
FAST = settings(max_examples=30, deadline=None, derandomize=True)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def make_logits(kind: int, v: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == 0:  # Gaussian: random-energy model
        return scale * torch.randn(v, generator=g)
    if kind == 1:  # Gumbel: heavy upper tail, a few clear candidates
        u = torch.rand(v, generator=g).clamp_min(1e-12)
        return scale * -torch.log(-torch.log(u))
    ranks = torch.arange(1, v + 1, dtype=torch.float32)  # Zipf with noise
    return -scale * ranks.log() + 0.3 * torch.randn(v, generator=g)


def h_at(z: torch.Tensor, t: float) -> float:
    return entropy(z[None], torch.tensor([t])).item()


def solve_temperature(z: torch.Tensor, target: float, lo: float = T_MIN, hi: float = T_MAX) -> float:
    a, b = math.log(lo), math.log(hi)
    for _ in range(50):
        m = 0.5 * (a + b)
        if h_at(z, math.exp(m)) < target:
            a = m
        else:
            b = m
    return math.exp(0.5 * (a + b))


def run_loop(z_rows, target, eta, starts, steps, t_min=T_MIN, t_max=T_MAX, sign=1.0):
    """Closed loop on fixed logits; returns (entropy history [steps+1, B], final T).

    sign=-1 runs the FLIPPED controller: it feeds the reflected probe 2H* - H, which turns the
    error H - H* into H* - H, i.e. T * exp(+eta * (H - H*)).
    """
    b = len(starts)
    z = z_rows.expand(b, -1) if z_rows.dim() == 1 else z_rows
    t = torch.tensor(starts, dtype=torch.float32)
    hist = []
    for _ in range(steps):
        h = entropy(z, t)
        hist.append(h)
        probe = h if sign > 0 else 2.0 * target - h
        t = update_temperature(t, probe, target, eta, t_min, t_max, -1e9, 1, 0)
    hist.append(entropy(z, t))
    return torch.stack(hist), t


def steps_to_converge(hist: torch.Tensor, target: float) -> int:
    """The first step k after which |H - H*| < TOL holds for good (len(hist) if never)."""
    bad = ((hist - target).abs() >= TOL).any(dim=1)
    idx = torch.nonzero(bad)
    return 0 if idx.numel() == 0 else int(idx[-1]) + 1


# ---------------------------------------------------------------------------------------------
# Sensor
# ---------------------------------------------------------------------------------------------


def test_entropy_matches_scipy_and_ignores_masked_tokens():
    from scipy.stats import entropy as sp_entropy

    z = make_logits(0, 300, 2.0, 1)
    t = torch.tensor([0.7])
    p = torch.softmax(z.double() / 0.7, -1).numpy()
    assert entropy(z[None], t).item() == pytest.approx(sp_entropy(p), abs=1e-4)
    masked = z.clone()
    masked[100:] = float("-inf")
    p_sub = torch.softmax(z[:100].double() / 0.7, -1).numpy()
    assert entropy(masked[None], t).item() == pytest.approx(sp_entropy(p_sub), abs=1e-4)
    assert torch.isfinite(heat_capacity(masked[None], t)).all()


@FAST
@given(
    kind=st.integers(0, 2),
    v=st.integers(50, 5000),
    scale=st.floats(0.5, 3.0),
    seed=st.integers(0, 2**20),
    t=st.floats(0.15, 1.8),
)
def test_heat_capacity_is_dh_dlnt(kind, v, scale, seed, t):
    """dH/d ln T = Var_p(ln p) = Var_p(z / T): against a central difference and the z form."""
    z = make_logits(kind, v, scale, seed).double()
    c = heat_capacity(z[None], torch.tensor([t], dtype=torch.float64)).item()
    d = 1e-3
    num = (h_at(z, t * math.exp(d)) - h_at(z, t * math.exp(-d))) / (2 * d)
    p = torch.softmax(z / t, -1)
    var_z = (p * (z / t) ** 2).sum() - (p * (z / t)).sum() ** 2
    assert c >= 0.0
    assert c == pytest.approx(var_z.item(), rel=2e-3, abs=2e-3)
    assert c == pytest.approx(num, rel=2e-2, abs=2e-2)


def test_step_holds_rows_without_a_distribution():
    z = torch.zeros(5, 4)
    z[1, 2] = float("nan")
    z[2, 0] = float("inf")
    z[3, :] = float("-inf")
    z[4, 1:] = float("-inf")  # masked but one token left: a distribution with H = 0
    state = ControllerState(temperature=1.0, target=0.5, eta=0.5, t_min=0.1, t_max=2.0, floor=0.0, warmup=0)
    batch = ControllerBatch.from_rows([state] * 5)
    new_t, _ = batch.step(z)
    held = (new_t == 1.0).tolist()
    assert held == [False, True, True, True, False]


# ---------------------------------------------------------------------------------------------
# Closed loop: convergence
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    kind=st.integers(0, 2),
    v=st.integers(50, 5000),
    scale=st.floats(0.5, 3.0),
    seed=st.integers(0, 2**20),
    frac=st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0),
)
def test_converges_on_softmax_family(kind, v, scale, seed, frac):
    """Stated: within N_MAX = 100 steps from any start (see the module docstring)."""
    eta = 0.1
    z = make_logits(kind, v, scale, seed)
    lo, hi = max(h_at(z, T_MIN), 1.0) + 0.05, h_at(z, T_MAX) - 0.1
    assume(lo < hi)
    target = lo + frac * (hi - lo)
    t_star = solve_temperature(z, target)
    assume(eta * heat_capacity(z[None], torch.tensor([t_star])).item() >= 0.1)
    starts = [T_MIN, 0.2, 0.45, 1.0, T_MAX, t_star]
    hist, _ = run_loop(z, target, eta, starts, N_MAX + 30)
    n = steps_to_converge(hist, target)
    assert n <= N_MAX, f"took {n} steps (stated bound {N_MAX})"


def derived_bound(h_fn, c_fn, u0, u_star, target, eta, lo, hi):
    """N1 / N2 of the module docstring; None when eta * C reaches 2 on the range."""
    e0 = abs(h_fn(torch.tensor([u0], dtype=torch.float64)).item() - target)
    if e0 < TOL:
        return 0
    d0 = abs(u0 - u_star)
    span = torch.linspace(max(lo, u_star - d0), min(hi, u_star + d0), 2001, dtype=torch.float64)
    c_hi = c_fn(span).max().item() * 1.001
    if eta * c_hi <= 1.0:
        path = torch.linspace(min(u0, u_star), max(u0, u_star), 2001, dtype=torch.float64)
        c_lo = c_fn(path).min().item() * 0.999
        return math.ceil(math.log(e0 / TOL) / -math.log1p(-eta * c_lo))
    c_lo = c_fn(span).min().item() * 0.999
    q = max(1.0 - eta * c_lo, eta * c_hi - 1.0)
    if q >= 1.0:
        return None
    return max(0, math.ceil(math.log(c_hi * d0 / TOL) / -math.log(q)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    h_max=st.floats(2.0, 11.0),
    k=st.floats(0.5, 3.0),
    mid=st.floats(-2.0, 0.5),
    frac=st.floats(0.05, 0.95),
    gain=st.floats(0.2, 1.9),
    start=st.floats(0.0, 1.0),
)
def test_converges_within_derived_bound_analytic(h_max, k, mid, frac, gain, start):
    """Analytic H(ln T) = h_max * sigmoid(k (ln T - mid)), C = k H (1 - H / h_max).

    eta = gain / max C on the range; asserts the derived bound N1 (gain <= 1) or N2 (gain < 2).
    """
    lo, hi = math.log(T_MIN), math.log(T_MAX)

    def h_fn(u):
        return h_max * torch.sigmoid(k * (u - mid))

    def c_fn(u):
        h = h_fn(u)
        return k * h * (1 - h / h_max)

    grid = torch.linspace(lo, hi, 2001, dtype=torch.float64)
    h_lo, h_hi = h_fn(grid[:1]).item(), h_fn(grid[-1:]).item()
    target = h_lo + frac * (h_hi - h_lo)
    assume(h_lo + TOL < target < h_hi - TOL)
    u_star = mid + math.log(target / (h_max - target)) / k
    eta = gain / c_fn(grid).max().item()
    u0 = lo + start * (hi - lo)
    bound = derived_bound(h_fn, c_fn, u0, u_star, target, eta, lo, hi)
    assert bound is not None
    assume(bound <= 3000)
    t = torch.tensor([math.exp(u0)], dtype=torch.float32)
    hist = []
    for _ in range(bound + 20):
        h = h_fn(t.double().log()).float()
        hist.append(h)
        t = update_temperature(t, h, target, eta, T_MIN, T_MAX, 0.0, 1, 0)
    hist = torch.stack(hist)
    assert steps_to_converge(hist, target) <= bound


def test_deadbeat_gain_and_instability_beyond_two_over_c():
    """Locally linear H = H* + C (u - u*): eta = 1/C lands in one step; eta = 2.5/C repels."""
    c, target, u_star = 4.0, 2.0, math.log(0.5)

    def h_of(t):
        return target + c * (t.log() - u_star)

    for eta, converge in ((1.0 / c, True), (2.5 / c, False)):
        t = torch.tensor([0.3, 1.2])
        seen = []
        for _ in range(40):
            t = update_temperature(t, h_of(t), target, eta, T_MIN, T_MAX, -1e9, 1, 0)
            seen.append(t.clone())
        err = (h_of(t) - target).abs()
        if converge:
            assert (h_of(seen[0]) - target).abs().max() < 1e-4  # one step
            assert err.max() < 1e-4
        else:
            # a 2-cycle between the bounds: T never settles
            assert set(torch.stack(seen[-4:]).flatten().tolist()) == {f32(T_MIN), f32(T_MAX)}


@pytest.mark.parametrize("side", ["above", "below"])
def test_unreachable_target_pins_at_the_right_bound(side):
    z = make_logits(0, 2000, 0.3, 3)  # not frozen at t_min: H(t_min) ~ 3 nats
    h_lo, h_hi = h_at(z, T_MIN), h_at(z, T_MAX)
    target = h_hi + 0.5 if side == "above" else h_lo - 0.3
    assert target > 0.0
    starts = [T_MIN, 0.3, 1.0, T_MAX]
    _, t = run_loop(z, target, 0.1, starts, 300)
    want = f32(T_MAX) if side == "above" else f32(T_MIN)
    assert t.tolist() == [want] * len(starts)


# ---------------------------------------------------------------------------------------------
# Sign
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    t=st.floats(T_MIN, T_MAX),
    h=st.floats(0.1, 10.0),
    target=st.floats(0.1, 10.0),
    eta=st.floats(1e-3, 10.0),
)
def test_entropy_above_target_lowers_temperature(t, h, target, eta):
    assume(abs(h - target) > 1e-3)
    t_in = torch.tensor([t], dtype=torch.float32)
    new = update_temperature(t_in, torch.tensor([h]), target, eta, T_MIN, T_MAX, 0.0, 1, 0).item()
    if h > target:
        assert new <= t_in.item()
        assert new < t_in.item() or t_in.item() == f32(T_MIN)
    else:
        assert new >= t_in.item()
        assert new > t_in.item() or t_in.item() == f32(T_MAX)
    # exact law inside the bounds
    want = t_in.item() * math.exp(-eta * (h - target))
    if f32(T_MIN) < want < f32(T_MAX):
        assert new == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_flipped_sign_runs_away_to_the_wrong_bound(sign):
    """The real controller converges; the flipped one (sign=-1) pins every start at a bound.

    Starts above T* see H > H* and the flipped law raises T further -> t_max; starts below
    T* -> t_min. If update_temperature's direction were flipped, sign=+1 would fail.
    """
    z = make_logits(0, 3000, 2.0, 5)
    target = 0.5 * (h_at(z, 0.3) + h_at(z, 1.2))
    t_star = solve_temperature(z, target)
    starts = [0.15, t_star * 0.8, t_star * 1.25, 1.8]
    hist, t = run_loop(z, target, 0.1, starts, 150, sign=sign)
    if sign > 0:
        assert steps_to_converge(hist, target) <= N_MAX
    else:
        assert t.tolist() == [f32(T_MIN), f32(T_MIN), f32(T_MAX), f32(T_MAX)]
        assert ((hist[-1] - target).abs() > 1.0).all()


# ---------------------------------------------------------------------------------------------
# Rules: floor, warm-up, validity, bounds
# ---------------------------------------------------------------------------------------------


def _upd(t, h, **kw):
    args = dict(target=2.0, eta=0.5, t_min=T_MIN, t_max=T_MAX, floor=0.05, steps_done=5, warmup=1, valid=None)
    args.update(kw)
    return update_temperature(torch.tensor(t), torch.tensor(h), **args)


def test_floor_holds_temperature():
    t = [0.7, 0.7, 0.7, 0.7]
    new = _upd(t, [0.0, 0.049, 0.05, 1.0], floor=torch.tensor([0.05] * 4))
    assert new[0].item() == f32(0.7) and new[1].item() == f32(0.7)
    assert new[2].item() > f32(0.7) and new[3].item() > f32(0.7)


def test_floor_is_anti_windup():
    """A run of forced tokens leaves T alone; without the floor T winds up to t_max."""
    forced = torch.tensor([30.0] + [0.0] * 999)  # H ~ 0 at every T in range
    uncertain = make_logits(0, 1000, 1.0, 7)
    rows = [ControllerState(0.7, 2.0, 0.1, T_MIN, T_MAX, floor, 0) for floor in (0.05, 0.0)]
    batch = ControllerBatch.from_rows(rows, "cpu")
    for _ in range(60):
        batch.step(forced.expand(2, -1))
    assert batch.temperature[0].item() == f32(0.7)
    assert batch.temperature[1].item() == f32(T_MAX)
    t, _ = batch.step(uncertain.expand(2, -1))
    h = entropy(uncertain.expand(2, -1), t)
    assert h[0] < h[1] - 1.0  # the wound-up row samples a much flatter distribution


def test_warmup_holds_then_updates_and_counts_steps():
    z = make_logits(0, 500, 2.0, 2)
    rows = [ControllerState(1.0, 2.0, 0.3, T_MIN, T_MAX, 0.0, 3)]
    batch = ControllerBatch.from_rows(rows, "cpu")
    for k in range(3):
        t, _ = batch.step(z[None])
        assert t.item() == 1.0
        assert batch.steps_done.item() == k + 1
    probe = entropy(z[None], batch.temperature)
    t, p = batch.step(z[None])
    assert p.item() == pytest.approx(probe.item())
    want = math.exp(-0.3 * (probe.item() - 2.0))
    assert t.item() == pytest.approx(min(max(want, T_MIN), T_MAX), rel=1e-5)
    assert batch.steps_done.item() == 4 and batch.temperature.item() == pytest.approx(t.item())
    assert _upd([0.7], [9.0], steps_done=0, warmup=1).item() == f32(0.7)
    assert _upd([0.7], [9.0], steps_done=1, warmup=1).item() < f32(0.7)
    assert _upd([0.7], [9.0], steps_done=0, warmup=0).item() < f32(0.7)


def test_invalid_rows_untouched_and_isolated():
    z = make_logits(0, 400, 2.0, 4).expand(3, -1).clone()
    z[1, 7] = float("nan")
    z[2, 0] = float("inf")
    rows = [ControllerState(0.9, 0.5, 0.5, T_MIN, T_MAX, 0.0, 0) for _ in range(3)]
    batch = ControllerBatch.from_rows(rows, "cpu")
    t, _ = batch.step(z)
    assert t[1].item() == f32(0.9) and t[2].item() == f32(0.9)
    assert t[0].item() < f32(0.9) and torch.isfinite(t).all()
    new = _upd([0.7, 0.7], [float("nan"), 9.0], valid=torch.tensor([True, False]))
    assert new.tolist() == [f32(0.7), f32(0.7)]


@FAST
@given(
    t=st.lists(st.floats(0.01, 50.0), min_size=1, max_size=8),
    h=st.floats(-5.0, 50.0),
    eta=st.sampled_from([1e-6, 0.5, 10.0, 1e6, 1e30, float("inf")]),
    t_min=st.floats(0.01, 5.0),
    width=st.floats(0.0, 5.0),
)
def test_bounds_respected_even_for_huge_eta(t, h, eta, t_min, width):
    t_max = t_min + width
    t_in = torch.tensor(t).clamp(t_min, t_max)
    new = _upd(t_in.tolist(), [h] * len(t), eta=eta, t_min=t_min, t_max=t_max, floor=-10.0)
    assert torch.isfinite(new).all()
    assert (new >= f32(t_min)).all() and (new <= f32(t_max)).all()


def test_step_is_zero_lag_batched():
    """Each row's temperature this step, from this step's own logits at the row's incoming temperature, against
    plain math per row (Python floats): H of softmax(z / T), then T * exp(-eta (H - H*)) clipped."""
    zs = torch.stack([make_logits(k, 800, 1.5, k) for k in range(3)])
    incoming = (0.3, 1.0, 1.7)
    batch = ControllerBatch.from_rows([ControllerState(t, 2.0, 0.2, T_MIN, T_MAX, 0.05, 0) for t in incoming], "cpu")
    t, probe = batch.step(zs)
    for row, t_in in enumerate(incoming):
        x = [float(v) / t_in for v in zs[row]]
        m = max(x)
        w = [math.exp(v - m) for v in x]
        total = sum(w)
        h = -sum(wi / total * math.log(wi / total) for wi in w if wi > 0)
        assert probe[row].item() == pytest.approx(h, rel=1e-5)
        want = min(max(t_in * math.exp(-0.2 * (h - 2.0)), T_MIN), T_MAX)
        assert t[row].item() == pytest.approx(want, rel=1e-5)
    assert len(set(t.tolist())) == 3 and torch.equal(batch.temperature, t)  # each row its own; the state moved


# ---------------------------------------------------------------------------------------------
# Per-request state
# ---------------------------------------------------------------------------------------------


def test_controller_state_from_config():
    cfg = SamplingConfig()
    s = ControllerState.from_config(cfg, 0.8)
    assert s == ControllerState(0.8, 2.0, cfg.gain, 0.1, 2.0, 0.05, 1, 0)
    s = ControllerState.from_config(SamplingConfig(t_init=1.5, eta=0.2), 0.8)
    assert s.temperature == 1.5 and s.eta == 0.2
    ControllerState.from_config(SamplingConfig(t_init=1.0), 0.0)  # t_init set: request T unused
    for bad in (0.0, 0.05, 2.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="request temperature"):
            ControllerState.from_config(cfg, bad)


def test_batch_from_rows_roundtrip():
    rows = [ControllerState(0.5 + 0.1 * i, 2.0, 0.1, 0.1, 2.0, 0.05, 2, i) for i in range(5)]
    b = ControllerBatch.from_rows(rows, torch.device("cpu"))
    assert len(b) == 5 and b.temperature.dtype == torch.float32
    assert b.steps_done.tolist() == [0, 1, 2, 3, 4] and b.warmup.tolist() == [2] * 5
    assert len(ControllerBatch.from_rows([], "cpu")) == 0


# ---------------------------------------------------------------------------------------------
# Mirostat v2
# ---------------------------------------------------------------------------------------------


def mirostat_reference(logits: list[float], mu: float):
    """llama.cpp llama_sampler_mirostat_v2_apply, one row, float64, before sampling.

    Returns {token: renormalised p} of the kept candidates.
    """
    order = sorted(range(len(logits)), key=lambda i: -logits[i])  # softmax sorts descending
    m = logits[order[0]]
    w = [math.exp(logits[i] - m) for i in order]
    s = sum(w)
    p = [x / s for x in w]
    size = len(order)
    for j, pj in enumerate(p):  # find_if(-log2f(p) > mu)
        if -math.log2(pj) > mu:
            size = j
            break
    size = max(size, 1)
    kept = order[:size]
    z = sum(p[:size])
    return {tok: p[j] / z for j, tok in enumerate(kept)}


def mirostat_reference_update(mu, probs, token, tau, eta):
    return mu - eta * (-math.log2(probs[token]) - tau)


def test_mirostat_matches_llama_cpp_reference():
    g = torch.Generator().manual_seed(11)
    logits = 2.0 * torch.randn(6, 64, generator=g)
    surprise = -torch.log_softmax(logits.double(), -1) / math.log(2)
    srt = surprise.sort(-1).values
    # mu between two surprises (never on a threshold), plus below-all and above-all
    mu = torch.stack(
        [
            0.5 * (srt[0, 0] + srt[0, 1]) - 5.0,
            0.5 * (srt[1, 3] + srt[1, 4]),
            0.5 * (srt[2, 10] + srt[2, 11]),
            0.5 * (srt[3, 30] + srt[3, 31]),
            0.5 * (srt[4, 62] + srt[4, 63]),
            srt[5, -1] + 1.0,
        ]
    ).float()
    masked = mirostat_v2_mask(logits, mu)
    tau, eta = 3.0, 0.1
    probs_all = torch.softmax(masked.double(), -1)
    for r in range(6):
        ref = mirostat_reference(logits[r].tolist(), mu[r].item())
        kept = torch.isfinite(masked[r]).nonzero().flatten().tolist()
        assert sorted(ref) == kept
        for tok, p in ref.items():
            assert probs_all[r, tok].item() == pytest.approx(p, rel=1e-5)
    # update: every kept token as the sampled one, against the reference
    for r in range(6):
        ref = mirostat_reference(logits[r].tolist(), mu[r].item())
        for tok in list(ref)[:5]:
            toks = torch.full((6,), tok)
            new = mirostat_v2_update(mu, masked, toks, tau, eta)[r].item()
            want = mirostat_reference_update(mu[r].item(), ref, tok, tau, eta)
            assert new == pytest.approx(want, abs=1e-4)


@FAST
@given(seed=st.integers(0, 2**20), v=st.integers(2, 3000), scale=st.floats(0.1, 10.0))
def test_mirostat_mask_keeps_argmax_or_all(seed, v, scale):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(3, v, generator=g)
    before = logits.clone()
    tiny = mirostat_v2_mask(logits, torch.tensor([-1e9, 0.0, float("-inf")]))
    assert torch.equal(logits, before)  # input untouched
    assert (torch.isfinite(tiny).sum(-1) == 1).all()
    assert torch.equal(tiny.argmax(-1), logits.argmax(-1))
    assert torch.equal(mirostat_v2_mask(logits, torch.full((3,), 1e9)), logits)
    # NaN mu: every comparison -log2 p > NaN is false, so (as in llama.cpp) nothing is dropped
    assert torch.equal(mirostat_v2_mask(logits, torch.full((3,), float("nan"))), logits)


def test_mirostat_update_rules_and_telescoping():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    mu = torch.tensor([10.0])
    masked = mirostat_v2_mask(logits, mu)
    s = -torch.log_softmax(logits, -1)[0, 2].item() / math.log(2)
    new = mirostat_v2_update(mu, masked, torch.tensor([2]), 3.0, 0.5)
    assert new.item() == pytest.approx(10.0 - 0.5 * (s - 3.0), rel=1e-6)
    # invalid row, and a token outside the kept set, keep mu
    kept_one = mirostat_v2_mask(logits, torch.tensor([0.0]))
    outside = mirostat_v2_update(torch.tensor([0.0]), kept_one, torch.tensor([3]), 3.0, 0.5)
    assert outside.item() == 0.0
    invalid = mirostat_v2_update(mu, masked, torch.tensor([2]), 3.0, 0.5, valid=torch.tensor([False]))
    assert invalid.item() == 10.0


def test_mirostat_converges_to_tau_on_fixed_distribution():
    """Mean observed surprise = tau + (mu_0 - mu_N) / (eta N): it tends to tau, mu stays bounded."""
    g = torch.Generator().manual_seed(3)
    v, b, n, tau, eta = 1000, 16, 1500, 4.0, 0.1
    logits = (2.0 * torch.randn(v, generator=g)).expand(b, -1)
    h_bits = entropy(logits[:1]).item() / math.log(2)
    assert h_bits > tau + 1.0  # tau is reachable
    cfg = SamplingConfig(controller="mirostat_v2", tau=tau)
    state = MirostatBatch.from_rows([MirostatState.from_config(cfg)] * b)
    assert state.mu[0].item() == 2 * tau and state.eta[0].item() == pytest.approx(eta)
    mu0 = state.mu.clone()
    s_sum = torch.zeros(b)
    mus = []
    for k in range(n):
        masked = state.mask(logits)
        tok = torch.multinomial(torch.softmax(masked, -1), 1, generator=g).squeeze(-1)
        s_sum += -torch.log_softmax(masked, -1).gather(-1, tok[:, None]).squeeze(-1) / math.log(2)
        state.update(masked, tok)
        if k >= n // 2:
            mus.append(state.mu.clone())
    mean_s = s_sum / n
    assert torch.allclose(mean_s, tau + (mu0 - state.mu) / (eta * n), atol=1e-3)  # telescoping
    assert (mean_s - tau).abs().max() < 0.05
    # mu itself does NOT settle at tau: it is the largest kept surprise, and E[s] <= mu. It
    # settles at mu*, the threshold whose kept set has renormalised entropy tau (bits).
    surprise = (-torch.log_softmax(logits[0].double(), -1) / math.log(2)).sort().values
    p = torch.exp2(-surprise)
    h_prefix = []
    for k in range(1, v + 1):
        q = p[:k] / p[:k].sum()
        h_prefix.append(-(q * q.log2()).sum().item())
    k_star = next(k for k, h in enumerate(h_prefix, start=1) if h >= tau)
    mu_star = surprise[k_star - 1].item()
    mu_avg = torch.stack(mus).mean(0)
    assert mu_star > tau + 1.0
    assert ((mu_avg - mu_star).abs() < 0.5).all(), (mu_avg, mu_star)


def test_mirostat_state_from_config():
    cfg = SamplingConfig(controller="mirostat_v2", tau=5.0)
    assert MirostatState.from_config(cfg) == MirostatState(10.0, 5.0, 0.1)
    assert MirostatState.from_config(SamplingConfig(controller="mirostat_v2", eta=0.3)).eta == 0.3
