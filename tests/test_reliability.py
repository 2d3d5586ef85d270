"""Reliability: numerical faults inside the loop, bad inputs at every edge, no remote-code path,
and a load test with client aborts that must leave no KV and no per-request state behind."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from sgl_entropic.config import SERVER_ONLY, PruningConfig, SamplingConfig, SchedulingConfig, SpeculativeConfig
from sgl_entropic.sampling import ControllerState, MirostatState, update_temperature
from sgl_entropic.signal import entropy_exact
from tests.load_client import (
    CHAT,
    F32,
    load_spec,
    nothing_held,
    run_round,
    serves,
    states_after_flush,
    wait_until_nothing_is_held,
)
from tests.stepping import Stepper

# ============================================================================ 3. numerical faults
# SamplingStep on real tensors, exactly as the Sampler.forward hook drives it: __init__ (controller
# and mirostat act on the logits), then record() on the logits the sampler saw.

V = 256


_stepper: Stepper | None = None


@pytest.fixture
def loop():
    """A fresh scheduler's state (runtime, controller table) for each test."""
    global _stepper
    _stepper = Stepper()
    yield _stepper
    _stepper = None


def _req(controller=None, mirostat=None):
    return _stepper.req(controller=controller, mirostat=mirostat)


def _controller(request_t=1.0, **cfg):
    return ControllerState.from_config(SamplingConfig(**{"warmup": 0, **cfg}), request_t)


def _mirostat(**cfg):
    return MirostatState.from_config(SamplingConfig(controller="mirostat_v2", **cfg))


def _run_step(reqs, logits, temps, top_ks=None, tokens=None):
    """One sampling step; returns (logits as the sampler got them, sampled tokens)."""
    return _stepper.step(reqs, logits, temps, top_ks, tokens)


def _last(req, key):
    return req.customized_info[key][-1]


def _fault_row(kind: str) -> tuple[torch.Tensor, int, float | None]:
    """(logits row, the token the sampler returns for it, the entropy that must be recorded)."""
    row = torch.randn(V, generator=torch.Generator().manual_seed(11))
    if kind == "nan":
        row[7] = float("nan")
        return row, 0, None
    if kind == "pos_inf":
        row[7] = float("inf")
        return row, 7, None
    if kind == "all_neg_inf":
        return torch.full((V,), float("-inf")), 0, None
    if kind == "one_token_left":  # a grammar mask that allows one token: a forced step, H = 0
        row.fill_(float("-inf"))
        row[42] = 3.0
        return row, 42, 0.0
    raise AssertionError(kind)


HEALTHY = ("controlled", "plain", "greedy")


def _healthy_batch():
    """Controlled, plain-sampled and greedy rows, with fixed logits: the rows a fault must not touch."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen) * 2.0
    reqs = [_req(controller=_controller(0.9, target_entropy=1.5, eta=0.3)), _req(), _req()]
    return reqs, logits, [0.9, 0.8, 1.0], [V, V, 1]


@pytest.mark.parametrize("kind", ["nan", "pos_inf", "all_neg_inf", "one_token_left"])
def test_a_faulty_row_is_recorded_as_defined_and_leaves_its_neighbours_alone(loop, kind):
    fault, fault_token, expected_entropy = _fault_row(kind)

    ref_reqs, ref_logits, temps, top_ks = _healthy_batch()
    ref_out, ref_tokens = _run_step(ref_reqs, ref_logits.clone(), temps, top_ks)

    # The same healthy rows, with a controlled and a mirostat row carrying the fault in between.
    reqs, logits, temps, top_ks = _healthy_batch()
    ctrl = _req(controller=_controller(0.8, target_entropy=1.0, eta=0.5))
    miro = _req(mirostat=_mirostat(tau=3.0))
    batch = torch.stack([logits[0], fault, logits[1], fault.clone(), logits[2]])
    rows = [reqs[0], ctrl, reqs[1], miro, reqs[2]]
    tokens = torch.tensor([int(ref_tokens[0]), fault_token, int(ref_tokens[1]), fault_token, int(ref_tokens[2])])
    out, _ = _run_step(rows, batch, [temps[0], 0.8, temps[1], 1.0, temps[2]], [V, V, V, V, 1], tokens)

    # neighbours: bit-identical logits to the sampler, identical records and controller state
    for i, j in zip((0, 2, 4), range(3)):
        assert torch.equal(out[i], ref_out[j]), HEALTHY[j]
        assert rows[i].customized_info == ref_reqs[j].customized_info, HEALTHY[j]
    assert reqs[0].entropic.controller == ref_reqs[0].entropic.controller

    # the faulty controlled row: entropy as defined (null when nothing is measurable), T held, state finite
    assert _last(ctrl, "entropy") == expected_entropy
    assert _last(ctrl, "surprisal") == (None if expected_entropy is None else pytest.approx(0.0, abs=1e-6))
    c = ctrl.entropic.controller
    assert c.temperature == F32(0.8) and c.steps_done == 1  # held: NaN/inf and forced steps do not move T
    assert _last(ctrl, "temperature") == F32(0.8)
    assert math.isfinite(ctrl.entropic.trace.tau) and math.isfinite(ctrl.entropic.gain.expected_gain)
    if expected_entropy is None:  # nothing was measured: tau, cost and the last entropy are untouched
        assert (ctrl.entropic.trace.tau, ctrl.entropic.trace.cost, ctrl.entropic.trace.last_entropy) == (0.0, 0.0, None)
    # the faulty mirostat row: mu held when nothing is measurable; a forced token (surprise 0 bits)
    # is an ordinary Mirostat step: mu <- mu - eta * (0 - tau)
    assert miro.entropic.mirostat.mu == (6.0 if expected_entropy is None else pytest.approx(6.0 + 0.1 * 3.0))
    mu_before = miro.entropic.mirostat.mu
    assert _last(miro, "entropy") == expected_entropy

    # the next, healthy step updates both as if the fault had never happened
    good = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 2.0
    probe = entropy_exact(good[:1] / F32(0.8))
    want = update_temperature(torch.tensor([F32(0.8)]), probe, 1.0, 0.5, 0.1, 2.0, 0.05, 1, 0).item()
    _run_step([ctrl, miro], good, [0.8, 1.0])
    assert ctrl.entropic.controller.temperature == pytest.approx(want, rel=1e-6)
    assert ctrl.entropic.controller.temperature != F32(0.8)
    assert math.isfinite(miro.entropic.mirostat.mu) and miro.entropic.mirostat.mu != mu_before
    assert _last(ctrl, "entropy") is not None and _last(miro, "entropy") is not None


def test_a_batch_of_only_faulty_rows_raises_nothing(loop):
    kinds = ["nan", "pos_inf", "all_neg_inf"]
    rows = (
        [_req(controller=_controller(1.0)) for _ in kinds]
        + [_req(mirostat=_mirostat()) for _ in kinds]
        + [_req() for _ in kinds]
    )
    faults = [_fault_row(k) for k in kinds] * 3
    logits = torch.stack([f[0] for f in faults])
    _run_step(rows, logits, [1.0] * len(rows), tokens=torch.tensor([f[1] for f in faults]))
    assert all(r.customized_info["entropy"] == [None] and r.customized_info["surprisal"] == [None] for r in rows)
    assert all(r.entropic.controller.temperature == 1.0 for r in rows[:3])
    assert all(r.entropic.mirostat.mu == 10.0 for r in rows[3:6])


@pytest.mark.parametrize("vocab", [2, 50, 49152])
@pytest.mark.parametrize("request_t", [0.3, 1.0, 1.7])
def test_vocabulary_wide_ties_measure_ln_v(loop, vocab, request_t):
    logits = torch.full((2, vocab), 3.25)
    rows = [_req(), _req(controller=_controller(request_t, t_min=0.1, t_max=2.0))]
    _run_step(rows, logits, [request_t, request_t], tokens=torch.tensor([0, vocab - 1]))
    for r in rows:
        assert _last(r, "entropy") == pytest.approx(math.log(vocab), rel=1e-5)
        assert _last(r, "surprisal") == pytest.approx(math.log(vocab), rel=1e-5)


@pytest.mark.parametrize(
    "target, bound, eta",
    [
        (0.0, "t_min", 0.5),  # ties: H = ln V > H*, the controller cools without end
        (0.0, "t_min", 10.0),  # exp(-eta * err) underflows to 0: the clip still gives t_min, never T = 0
        (20.0, "t_max", 0.5),  # H = ln V < H*: it heats without end
    ],
)
def test_a_controller_that_wants_past_its_bounds_stays_clipped(loop, target, bound, eta):
    cfg = dict(target_entropy=target, eta=eta, t_min=0.25, t_max=1.5)
    row = _req(controller=_controller(0.9, **cfg))
    temps = []
    for _ in range(30):
        _run_step([row], torch.full((1, 49152), -1.0), [0.9])
        temps.append(_last(row, "temperature"))
    assert all(0.25 <= F32(t) <= F32(1.5) for t in temps)
    assert temps[-1] == F32(cfg[bound]) and temps.count(temps[-1]) >= 10  # reached, and held there
    assert all(math.isfinite(h) for h in row.customized_info["entropy"])


def test_exp_overflow_towards_t_max_is_clipped(loop):
    # H just above the floor against H* = 20 at the largest gain: exp(10 * ~19.9) is inf in float32.
    logits = torch.full((1, V), float("-inf"))
    logits[0, :2] = torch.tensor([0.0, -4.0])
    row = _req(controller=_controller(1.0, target_entropy=20.0, eta=10.0, t_min=0.1, t_max=2.0))
    assert entropy_exact(logits).item() > 0.05  # the probe at T = 1 is above the floor: a real update
    _run_step([row], logits, [1.0], tokens=torch.tensor([0]))
    assert row.entropic.controller.temperature == 2.0 and _last(row, "temperature") == 2.0


def test_pinned_temperature_is_constant(loop):
    row = _req(controller=_controller(1.3, t_min=0.7, t_max=0.7, t_init=0.7, eta=10.0))
    gen = torch.Generator().manual_seed(1)
    for scale in (0.1, 1.0, 5.0, 30.0, 1.0):  # entropies from ~0 to ~ln V: the controller wants to move
        logits = torch.randn(1, V, generator=gen) * scale
        original = logits.clone()
        out, _ = _run_step([row], logits, [1.3])
        torch.testing.assert_close(out, original * (1.3 / F32(0.7)))  # the sampler divides by 1.3 again
    assert row.customized_info["temperature"] == [F32(0.7)] * 5
    assert row.entropic.controller.temperature == F32(0.7) and row.entropic.controller.steps_done == 5


# ============================================================================ 2. bad inputs at the edges
# The matrix is generated from SamplingConfig itself, so a new field cannot go untested.

NUMERIC = [name for name in SamplingConfig.model_fields if name != "controller" and name not in SERVER_ONLY]
RAW = "__raw__"  # placeholder for a literal that standard JSON cannot carry (NaN, Infinity)


def _limits(model, name):
    """(lo, lo_open, hi, hi_open) from the field's annotated_types constraints."""
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[name].metadata:
        for attr, is_lo, is_open in (
            ("ge", True, False),
            ("gt", True, True),
            ("le", False, False),
            ("lt", False, True),
        ):
            if getattr(m, attr, None) is not None:
                if is_lo:
                    lo, lo_open = getattr(m, attr), is_open
                else:
                    hi, hi_open = getattr(m, attr), is_open
    return lo, lo_open, hi, hi_open


def _out_of_range(model, name):
    """Just past each documented bound, and plainly negative."""
    lo, lo_open, hi, hi_open = _limits(model, name)
    is_int = int in (model.model_fields[name].annotation, *getattr(model.model_fields[name].annotation, "__args__", ()))
    step = 1 if is_int else None
    values = {-1, lo if lo_open else (lo - step if step else math.nextafter(lo, -math.inf))}
    values.add(hi if hi_open else (hi + step if step else math.nextafter(hi, math.inf)))
    return sorted(values)


def _optional(name):
    return SamplingConfig.model_fields[name].default is None


def _bad_field_values():
    """(field, category, value): every field with wrong types, out-of-range, non-finite and huge values."""
    cases = []
    for name in NUMERIC:
        wrong = ["high", "0.5", True, False, [1.0], {"v": 1.0}] + ([] if _optional(name) else [None])
        cases += [(name, "wrong_type", v) for v in wrong]
        cases += [(name, "out_of_range", v) for v in _out_of_range(SamplingConfig, name)]
        cases += [(name, "non_finite", RAW + lit) for lit in ("NaN", "Infinity", "-Infinity", "1e999")]
        cases += [(name, "huge", v) for v in (1e308, -1e308, 10**30)]
        if SamplingConfig.model_fields[name].annotation is int:
            cases.append((name, "wrong_type", 1.5))
    cases += [("controller", "wrong_type", v) for v in (1, True, None, ["entropic"], {"v": "entropic"})]
    cases += [("controller", "out_of_range", v) for v in ("greedy", "Entropic", "mirostat", "", "mirostat_v1")]
    cases += [("controller", "non_finite", RAW + "NaN")]
    # server settings: refused in a request whatever their value
    cases += [(name, "server_only", v) for name in sorted(SERVER_ONLY) for v in (True, False, None, 1, "on")]
    return cases


BAD_FIELD_VALUES = _bad_field_values()
UNKNOWN_KEYS = ["Eta", "target-entropy", "temperature", "mode", "sampling", "surprise_bits"]
NOT_AN_OBJECT = [[], [1, 2], "on", "", 0, 1, 1.5, True, False]
CUSTOM_PARAMS_NOT_AN_OBJECT = ["x", [{"entropic": {}}], 1, True]
INCONSISTENT = [
    ({"t_min": 1.0, "t_max": 0.5}, "t_min"),
    ({"t_max": 0.05}, "t_max"),  # below the default t_min
    ({"t_init": 3.0}, "t_init"),  # above the default t_max
    ({"t_min": 0.5, "t_init": 0.2}, "t_init"),
    ({"t_max": 0.5}, "t_init"),  # the request's temperature 1.0 lies outside [t_min, t_max]
]
ACCEPTED = [
    {},  # missing fields: the server's values
    None,  # custom_params.entropic: null is the same as leaving it out
    {"eta": 10},
    {"eta": 1},  # an integer for a float
    {"warmup": 0},
    {"warmup": 10_000},
    {"target_entropy": 0},
    {"target_entropy": 20},
    {"entropy_floor": 20},
    {"t_min": 0.5, "t_max": 0.5, "t_init": 0.5},
    {"t_min": 100, "t_max": 100, "t_init": 100},
    {"controller": "mirostat_v2", "tau": 100, "eta": 10},
    {"controller": "mirostat_v2", "tau": 1e-300},
]


def _body(entropic, raw: str | None = None, custom_params=None) -> bytes:
    params = {"max_new_tokens": 1, "temperature": 1.0}
    params["custom_params"] = {"entropic": entropic} if custom_params is None else custom_params
    text = json.dumps({"text": "Hi", "sampling_params": params})
    if raw is not None:
        text = text.replace(json.dumps(RAW + raw), raw)
    return text.encode()


def _post_raw(server, body: bytes):
    return requests.post(server.url + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=120)


def _assert_refused(r, needle):
    # (no /health per case: SGLang's /health runs a forward, ~1 s here; the matrix ends with one check)
    assert r.status_code == 400, (r.status_code, r.text)
    assert needle in r.text, r.text


@pytest.mark.server
@pytest.mark.parametrize(
    "field, category, value", BAD_FIELD_VALUES, ids=[f"{f}-{c}-{v!r}"[:60] for f, c, v in BAD_FIELD_VALUES]
)
def test_bad_field_value_is_http_400_naming_the_field(server, field, category, value):
    raw = value[len(RAW) :] if isinstance(value, str) and value.startswith(RAW) else None
    r = _post_raw(server, _body({field: value}, raw=raw))
    if raw is not None and "JSON decode error" in r.text:
        # SGLang's own JSON parser refuses NaN/Infinity/1e999 before any plugin code runs: a 400 that
        # points at the byte offset of the literal. Had it accepted them, ours must name the field.
        assert r.status_code == 400 and "json_invalid" in r.text, r.text
        return
    _assert_refused(r, f"custom_params.entropic.{field}")


@pytest.mark.server
@pytest.mark.parametrize("key", UNKNOWN_KEYS)
def test_unknown_key_is_http_400_naming_it(server, key):
    _assert_refused(_post_raw(server, _body({key: 1.0})), f"custom_params.entropic.{key}")


@pytest.mark.server
@pytest.mark.parametrize("value", NOT_AN_OBJECT, ids=repr)
def test_entropic_not_an_object_is_http_400(server, value):
    _assert_refused(_post_raw(server, _body(value)), "custom_params.entropic must be a JSON object")


@pytest.mark.server
@pytest.mark.parametrize("value", CUSTOM_PARAMS_NOT_AN_OBJECT, ids=repr)
def test_custom_params_not_an_object_is_http_400(server, value):
    _assert_refused(_post_raw(server, _body(None, custom_params=value)), "custom_params must be a JSON object")


@pytest.mark.server
@pytest.mark.parametrize("entropic, needle", INCONSISTENT, ids=[repr(e) for e, _ in INCONSISTENT])
def test_inconsistent_bounds_are_http_400_naming_them(server, entropic, needle):
    r = _post_raw(server, _body(entropic))
    _assert_refused(r, "custom_params.entropic")
    assert needle in r.text


@pytest.mark.server
@pytest.mark.parametrize("entropic", ACCEPTED, ids=repr)
def test_edge_values_inside_the_documented_ranges_are_accepted(server, entropic):
    r = _post_raw(server, _body(entropic))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


@pytest.mark.server
def test_a_bad_streaming_request_gets_an_error_event_naming_the_field(server):
    # SGLang starts the SSE response before validating: status 200, one error event, then [DONE].
    body = {
        "text": "Hi",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"entropic": {"eta": -1}}},
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]" and len(events) == 2, events
    error = json.loads(events[0][len(b"data: ") :])["error"]
    assert error["code"] == 400 and "custom_params.entropic.eta" in error["message"]


@pytest.mark.server
def test_the_server_still_serves_after_the_bad_input_matrix(server):
    assert serves(server)
    out = server.generate({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "custom_params": {"entropic": {}}}})
    assert out["meta_info"]["completion_tokens"] == 4
    states = [s["entropic"] for s in server.get("/server_info").json()["internal_states"]]
    assert all(nothing_held(s) for s in states), states


def test_the_bad_input_matrix_covers_every_field_and_category():
    per_field = {}
    for field, category, _ in BAD_FIELD_VALUES:
        per_field.setdefault(field, set()).add(category)
    assert set(per_field) == set(SamplingConfig.model_fields)
    for field in NUMERIC:
        assert per_field[field] == {"wrong_type", "out_of_range", "non_finite", "huge"}, field
    total = (
        len(BAD_FIELD_VALUES)
        + len(UNKNOWN_KEYS)
        + len(NOT_AN_OBJECT)
        + len(CUSTOM_PARAMS_NOT_AN_OBJECT)
        + len(INCONSISTENT)
        + 1
    )  # + the streaming case
    print(
        f"\nbad-input matrix: {total} refused cases ({len(BAD_FIELD_VALUES)} field values), {len(ACCEPTED)} accepted edges"
    )


# ---------------------------------------------------------------------------- the launcher's flags
# Beyond tests/test_foundation.py's cases: every field of every section, wrong type and past its
# bounds, plus malformed JSON and files. Each must exit 2 before SGLang (and the model) is touched.

SECTIONS = {
    "sampling": SamplingConfig,
    "scheduling": SchedulingConfig,
    "pruning": PruningConfig,
    "speculative": SpeculativeConfig,
}
ALREADY_IN_FOUNDATION = {("sampling", "eta", -1)}


def _launcher_cases():
    cases = []
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            wrong = 1 if "Literal" in str(info.annotation) else "x"  # a Literal (mode) takes strings
            if info.annotation is bool:  # strict: neither 1 nor "true" is a bool
                values = [wrong, 1, "true"]
            elif str in getattr(info.annotation, "__args__", ()):  # text the launcher sets: any value refused
                values = [wrong, 1]
            else:
                values = [wrong] + ([] if "Literal" in str(info.annotation) else _out_of_range(model, name))
            for v in values:
                if (section, name, v) not in ALREADY_IN_FOUNDATION:
                    cases.append((["--entropic-config", json.dumps({section: {name: v}})], f"{section}.{name}"))
        cases.append((["--entropic-config", json.dumps({section: 3})], section))  # section not an object
        cases.append((["--entropic-config", json.dumps({section: {"no_such_field": 1}})], f"{section}.no_such_field"))
    cases += [
        (["--entropic", ""], "--entropic"),
        (["--entropic", "FULL"], "--entropic"),
        (["--entropic", "sampling,scheduling"], "--entropic"),
        (["--entropic"], "--entropic"),  # no value
        (["--entropic-config"], "--entropic-config"),
        (["--entropic-config", '{"mode": 1}'], "mode"),
        (["--entropic-config", '{"sampling": {"t_init": 5}}'], "t_init"),
        (["--entropic-config", '{"scheduling": {"alpha": 0, "beta": 0, "gamma": 0}}'], "scheduling"),
        (["--entropic-config", '{"pruning": {"min_keep_ratio": 0.9, "max_keep_ratio": 0.5}}'], "min_keep_ratio"),
        (["--entropic-config", "{not json"], "--entropic-config"),
        (["--entropic-config", "{'mode': 'full'}"], "--entropic-config"),
        (["--entropic-config", '{"sampling": {"eta": }}'], "--entropic-config"),
        (["--entropic-config", '{"sampling": {"eta": Infinity}}'], "Infinity"),
        (["--entropic-config", '{"sampling": {"eta": -Infinity}}'], "-Infinity"),
        (["--entropic-config", '{"sampling": {"eta": 1e999}}'], "sampling.eta"),  # overflows to inf
        (["--entropic-config", '{"sampling": {"warmup": true}}'], "sampling.warmup"),
        (["--entropic-config", "[1]"], "--entropic-config"),
        # KV paths that bypass the page store's bounds, refused only with pruning (tests/test_gpu_path.py)
        (["--entropic", "pruning", "--enable-hisparse"], "--enable-hisparse"),
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),  # the default mode, full, prunes
        (["--entropic", "full", "--disaggregation-mode=prefill"], "--disaggregation-mode prefill"),
        # what splits the page plan, or bounds keys it cannot see (server_args.pruning_args), in any spelling
        # SGLang's parser accepts
        (["--decode-context-parallel-size", "2"], "--dcp-size 2"),
        (["--attn-dp-size", "2"], "--attn-dp-size 2"),
        (["--enable-dp-attention", "--dp-size", "2"], "--enable-dp-attention"),
        (["--pipeline-parallel-size", "2"], "--pp-size 2"),
        (["--kv-cache-dtype=fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
        # on CUDA pruning engages under `full` with a min_context (the default two stages never prune there)
        (
            [
                "--device",
                "cuda",
                "--cuda-graph-backend-prefill",
                "breakable",
                "--entropic-config",
                '{"pruning": {"min_context": 4096}}',
            ],
            "--cuda-graph-backend-prefill breakable",
        ),
        (
            [
                "--device",
                "cuda",
                "--page-size",
                "12",
                "--entropic-config",
                '{"pruning": {"page_size": 12, "min_context": 4096}}',
            ],
            "power of two",
        ),
        (["--entropic-config", '{"pruning": {"engaged": false}}'], "pruning.engaged is set by the launcher"),
        # speculative decoding: only what the plugin verifies exactly (server_args.speculative_args)
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
        (["--speculative-algorithm", "STANDALONE"], "--speculative-algorithm STANDALONE"),
        (["--speculative-algorithm", "NGRAM", "--speculative-adaptive"], "--speculative-adaptive"),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-accept-threshold-single", "0.5"],
            "--speculative-accept-threshold-single 0.5",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-use-rejection-sampling"],
            "--speculative-use-rejection-sampling",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "3"],
            "--speculative-ngram-max-bfs-breadth 3",
        ),  # full prunes: KV pages of 16 tokens take chains only
        (
            [
                "--entropic",
                "sampling",
                "--speculative-algorithm",
                "NGRAM",
                "--attention-backend",
                "torch_native",
                "--device",
                "cpu",
            ],
            "--attention-backend torch_native",
        ),
        (
            [
                "--speculative-algorithm",
                "NGRAM",
                "--tp-size",
                "2",
                "--entropic-config",
                '{"speculative": {"draft": "entropy"}}',
            ],
            "--tp-size 2",
        ),
        (["--speculative-algorithm", "NGRAM", "--pp-size", "2"], "--pp-size 2"),
        (
            ["--speculative-algorithm", "NGRAM", "--entropic-config", '{"sampling": {"controller": "mirostat_v2"}}'],
            "mirostat_v2",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--entropic-config", '{"pruning": {"selector": "surprisal"}}'],
            "pruning.selector",
        ),
        (["--entropic-config", '{"speculative": {"algorithm": "NGRAM"}}'], "speculative.algorithm"),
        (["--entropic-config", '{"speculative": {"draft": "longest"}}'], "speculative.draft"),
    ]
    return cases


LAUNCHER_CASES = _launcher_cases()
LAUNCHER_FILES = [  # file content, needle
    ("", "--entropic-config"),
    ("{not json", "--entropic-config"),
    ("[1, 2]", "must be a JSON object"),
    ('{"sampling": {"eta": NaN}}', "NaN"),
    ('{"pruning": {"page_size": 0}}', "pruning.page_size"),
]


def _refused(args, capsys) -> str:
    """The launcher's refusal, in-process: exit code 2 and what it printed (test_foundation.py runs a few
    of these as real subprocesses, and checks there that nothing of SGLang's starts)."""
    from sgl_entropic.launch_server import main

    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args, needle", LAUNCHER_CASES, ids=[" ".join(a)[:70] for a, _ in LAUNCHER_CASES])
def test_launcher_refuses_bad_flags_with_exit_2(args, needle, capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_ENTROPIC_CONFIG", raising=False)
    assert needle in _refused(args, capsys)
    assert "SGLANG_ENTROPIC_CONFIG" not in os.environ  # refused before the config reaches any process


@pytest.mark.parametrize("content, needle", LAUNCHER_FILES, ids=repr)
def test_launcher_refuses_bad_config_files_with_exit_2(tmp_path, content, needle, capsys):
    path = tmp_path / "entropic.json"
    path.write_text(content)
    assert needle in _refused(["--entropic-config", str(path)], capsys)


def test_help_lists_ours_and_sglangs_flags_without_preparing_a_model(capsys, monkeypatch):
    import sgl_entropic.model
    from sgl_entropic.launch_server import main

    monkeypatch.setattr(sgl_entropic.model, "prepare_bundled_model", lambda: pytest.fail("--help prepared the model"))
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "--entropic-config" in out and "--speculative-algorithm" in out


def test_launcher_refuses_a_directory_as_config_file(tmp_path, capsys):
    assert "not inline JSON and not a file" in _refused(["--entropic-config", str(tmp_path)], capsys)


# ============================================================================ 3. faults on the real server


def _generate(server, text, params, **extra):
    return server.generate({"text": text, "sampling_params": params, "return_entropy": True, **extra})


@pytest.mark.server
def test_a_regex_that_forces_every_token_gives_zero_entropy_and_holds_the_temperature(server):
    # "12345": this tokenizer splits digits, so each step has exactly one allowed token, then EOS.
    # ("yes" is not forced: y / ye / yes are three tokenizations.)
    entropic = {"t_min": 0.3, "t_max": 1.5, "t_init": 1.2, "warmup": 0, "target_entropy": 2.0}
    out = _generate(
        server,
        CHAT.format("Count to five."),
        {"max_new_tokens": 16, "regex": "12345", "custom_params": {"entropic": entropic}},
    )
    meta = out["meta_info"]
    assert out["text"] == "12345" and meta["finish_reason"]["type"] == "stop"
    assert len(meta["entropy"]) == len(meta["temperature"]) == meta["completion_tokens"] == 6
    assert all(h is not None and abs(h) < 1e-5 for h in meta["entropy"]), meta["entropy"]
    # every step is forced (H < floor): the controller holds T at t_init, inside [t_min, t_max]
    assert meta["temperature"] == [pytest.approx(1.2, rel=1e-6)] * 6


@pytest.mark.server
def test_a_partly_forced_regex_stays_within_the_temperature_bounds(server):
    entropic = {"t_min": 0.3, "t_max": 1.5, "t_init": 1.0, "warmup": 0, "target_entropy": 3.0, "eta": 2.0}
    out = _generate(
        server,
        CHAT.format("Pick a number."),
        {"max_new_tokens": 16, "regex": "[0-9]{3}(yes|no)", "custom_params": {"entropic": entropic}},
    )
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and len(meta["temperature"]) == meta["completion_tokens"]
    assert all(F32(0.3) <= t <= F32(1.5) for t in meta["temperature"]), meta["temperature"]
    assert meta["entropy"][-1] == pytest.approx(0.0, abs=1e-5)  # EOS after the grammar completes is forced


@pytest.mark.server
def test_pinned_bounds_give_a_constant_temperature_trace(server):
    entropic = {"t_min": 0.8, "t_max": 0.8, "t_init": 0.8, "eta": 10, "warmup": 0, "target_entropy": 0.5}
    out = _generate(
        server,
        CHAT.format("Write a poem about rain."),
        {"max_new_tokens": 16, "ignore_eos": True, "custom_params": {"entropic": entropic}},
    )
    temps = out["meta_info"]["temperature"]
    assert temps == [F32(0.8)] * 16


@pytest.mark.server
@pytest.mark.parametrize("target, bound", [(0.0, 0.25), (20.0, 1.5)])
def test_a_controller_driven_past_a_bound_is_clipped_on_the_server(server, target, bound):
    entropic = {"t_min": 0.25, "t_max": 1.5, "t_init": 1.0, "eta": 10, "warmup": 0, "target_entropy": target}
    out = _generate(
        server,
        CHAT.format("Tell me about the sea."),
        {"max_new_tokens": 12, "ignore_eos": True, "custom_params": {"entropic": entropic}},
    )
    temps = out["meta_info"]["temperature"]
    assert all(F32(0.25) <= t <= F32(1.5) for t in temps), temps
    assert temps[-1] == F32(bound), temps


@pytest.mark.server
@pytest.mark.parametrize("bias", [1e308, -1e31, 1e300])
def test_a_logit_bias_that_would_overflow_is_http_400_not_a_scheduler_crash(server, bias):
    # Stock SGLang turns it into a +inf logit, and its top-k/top-p sampler then raises
    # (torch.multinomial) and the scheduler exits; the +inf row itself is covered by the unit tests.
    params = {"logit_bias": {"29": bias}, "max_new_tokens": 2, "temperature": 0.5}
    r = server.post("/generate", {"text": "Hi", "sampling_params": params})
    _assert_refused(r, "logit_bias.29")
    ok = _generate(server, "Hi", {"logit_bias": {"29": 1e30}, "max_new_tokens": 2, "temperature": 0.5})
    assert ok["meta_info"]["completion_tokens"] == 2
    assert serves(server)


# ============================================================================ 4. no remote-code path


@pytest.mark.server
def test_every_entropic_feature_works_without_custom_logit_processors(server):
    info = server.get("/server_info").json()
    assert info["enable_custom_logit_processor"] is False

    # SGLang refuses a serialized (dill) processor outright on this server: it never reaches the scheduler.
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    r = server.post(
        "/generate",
        {
            "text": "Hi",
            "custom_logit_processor": DisallowedTokensLogitsProcessor().to_str(),
            "sampling_params": {"max_new_tokens": 2, "custom_params": {"token_ids": [29]}},
        },
    )
    assert r.status_code == 400 and "custom logit processor" in r.text, r.text

    # ... while the controller, Mirostat v2 and the traces are plain JSON on the same server.
    prompt = CHAT.format("Describe a forest.")
    ctrl = _generate(
        server,
        prompt,
        {
            "max_new_tokens": 12,
            "ignore_eos": True,
            "custom_params": {"entropic": {"target_entropy": 1.0, "eta": 0.3, "t_min": 0.3, "t_max": 1.7}},
        },
    )
    miro = _generate(
        server,
        prompt,
        {
            "max_new_tokens": 12,
            "ignore_eos": True,
            "custom_params": {"entropic": {"controller": "mirostat_v2", "tau": 2.0}},
        },
    )
    for out in (ctrl, miro):
        meta = out["meta_info"]
        assert len(meta["entropy"]) == len(meta["surprisal"]) == len(meta["temperature"]) == 12
        assert all(isinstance(h, float) and h >= 0 for h in meta["entropy"])
        assert math.isfinite(meta["entropic_time"]) and "entropic_efficiency" in meta
    assert all(F32(0.3) <= t <= F32(1.7) for t in ctrl["meta_info"]["temperature"])
    assert len(set(ctrl["meta_info"]["temperature"])) > 1  # the controller acted
    assert miro["meta_info"]["temperature"] == [1.0] * 12  # mirostat truncates; T is the request's


# ============================================================================ 1. load with client aborts
# Mixed requests all in flight at once, a quarter of them cut off mid-stream by the client. Every
# other one must complete with valid output, and afterwards nothing may be left held: no KV, no
# request slot, no per-request plugin state (GET /server_info -> internal_states[*].entropic).

LOAD_ROUNDS = 2
# 100 in flight at once per round: 200 requests in all, 50 of them aborted, ~30 s a round on an idle
# 2-core machine. SGLANG_ENTROPIC_LOAD_PER_ROUND=200 puts 200 in flight at once.
LOAD_PER_ROUND = int(os.environ.get("SGLANG_ENTROPIC_LOAD_PER_ROUND", "100"))
PLUGIN_FAULT_LINES = (
    "sgl-entropic: sampling step setup failed",
    "sgl-entropic: recording the sampling step failed",
    "sgl-entropic: verification under the controller failed",
    "sgl-entropic: recording the verify step failed",
    "sgl-entropic: decode budget failed",
    "Scheduler hit an exception",
    "Traceback",
)


def test_a_finished_request_an_emptied_running_batch_still_names_is_the_schedulers_not_a_leak():
    """SGLang's running batch keeps the last chunked request merged into it after it empties (seen after client
    aborts under NGRAM): /server_info must count that state as held by the scheduler, and a state no scheduler
    structure names as leaked."""
    from sgl_entropic.plugin.server_info import _requests_held_by

    stale, waiting, gone = (SimpleNamespace(rid=rid) for rid in ("stale", "waiting", "gone"))
    scheduler = SimpleNamespace(
        waiting_queue=[waiting],
        chunked_req=None,
        last_batch=None,
        cur_batch_for_debug=None,
        running_batch=SimpleNamespace(reqs=[], chunked_req=stale),
        batch_record_buf=[None, None],
    )
    held = _requests_held_by(scheduler)
    assert any(r is stale for r in held) and any(r is waiting for r in held)
    assert not any(r is gone for r in held)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("which", ["server", "spec_server", "entropy_spec_server"])
def test_load_with_client_aborts_completes_everything_else_and_frees_everything(which, request):
    """The mix below, in flight at once on the shared server and on its twins with NGRAM speculative decoding
    (every offered draft verified; the entropy rule's widths)."""
    pytest.importorskip("aiohttp")
    server, speculative = request.getfixturevalue(which), which != "server"
    report = {"sent": 0, "completed": 0, "aborted": 0, "lost": 0, "crashes": 0, "rounds": []}
    baseline = states_after_flush(server)
    log_offset = server.log.stat().st_size if server.log else 0
    lost_details = []
    start = time.monotonic()
    for r in range(LOAD_ROUNDS):
        specs = [load_spec(i, speculative) for i in range(r * LOAD_PER_ROUND, (r + 1) * LOAD_PER_ROUND)]
        t0 = time.monotonic()
        results = asyncio.run(run_round(server.url, specs))
        wall = time.monotonic() - t0
        held = wait_until_nothing_is_held(server)
        healthy = serves(server)
        after_flush = states_after_flush(server) if healthy else None
        counts = {k: sum(1 for o, _ in results if o == k) for k in ("completed", "aborted", "lost")}
        lost_details += [(spec["i"], d) for spec, (o, d) in zip(specs, results) if o == "lost"]
        report["rounds"].append(
            {
                "sent": len(specs),
                **counts,
                "wall_s": round(wall, 1),
                "held_after": held,
                "after_flush": after_flush,
                "healthy_after": healthy,
            }
        )
        report["sent"] += len(specs)
        for k in counts:
            report[k] += counts[k]
        report["crashes"] += 0 if healthy else 1
        if not healthy:
            break
    report["wall_s"] = round(time.monotonic() - start, 1)
    report["after_flush_baseline"] = baseline
    if server.log:  # a fault our hooks swallowed would not show in any response: read the log
        with open(server.log, errors="replace") as f:
            f.seek(log_offset)
            report["plugin_faults"] = sum(1 for line in f if any(m in line for m in PLUGIN_FAULT_LINES))
    print("\nreliability load:", json.dumps(report))
    if os.environ.get("SGLANG_ENTROPIC_RELIABILITY_REPORT"):
        with open(os.environ["SGLANG_ENTROPIC_RELIABILITY_REPORT"], "w") as f:
            json.dump({**report, "lost_details": lost_details}, f, indent=1)

    assert report["crashes"] == 0, report
    assert report["lost"] == 0, lost_details[:10]
    assert report["aborted"] == sum(1 for i in range(report["sent"]) if load_spec(i, speculative)["abort"]), report
    assert report["completed"] + report["aborted"] == report["sent"]
    assert report.get("plugin_faults", 0) == 0, report
    for rnd in report["rounds"]:
        assert all(nothing_held(s) for s in rnd["held_after"]), rnd
        # no state the scheduler does not reference, and two at most: the flush requests the overlap loop pins,
        # or a finished request an emptied running batch still names as its last chunked one
        flushed = rnd["after_flush"]
        assert flushed["live_request_states"] <= 2 and flushed["leaked_request_states"] == 0, rnd
    # and the server still does ordinary work
    out = server.generate(
        {
            "text": CHAT.format("Say hi."),
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "custom_params": {"entropic": {}}},
        }
    )
    assert out["meta_info"]["completion_tokens"] == 6
