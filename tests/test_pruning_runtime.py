"""The meso loop on real servers: pruned decode keeps passkey retrieval, keeping everything is
stock SGLang, and a reused radix prefix brings its block scores along."""

from __future__ import annotations

import json
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from programs.passkey import Case, answered_key, make_cases
from tests.conftest import COMMON_ARGS, start_server, stop_server

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
LONG_PROMPT_TIMEOUT_S = 1200  # a 6k-token fp32 prefill in 256-token chunks on a busy 2-core machine


def _generate(srv, payload: dict) -> dict:
    r = srv.post("/generate", payload, timeout=LONG_PROMPT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _decode_attended(meta: dict) -> float:
    steps = meta["attended"][1:]  # element 0 comes from the (dense) prefill forward
    return statistics.fmean(steps)


@pytest.fixture(scope="module")
def passkey_results(server, stock_server):
    """Passkeys in 2-6k tokens at four depths: pruned (our full-mode server) and dense (stock)."""
    rng = random.Random(7)
    cases = [Case(n, depth, rng.randint(10000, 99999)) for n, depth in ((2000, 0.1), (3000, 0.7), (4000, 0.5), (6000, 0.3))]

    def ask(srv, case):
        return _generate(srv, {"text": case.prompt, "sampling_params": GREEDY, "return_entropy": srv is server})

    with ThreadPoolExecutor(2) as pool:  # one request per server at a time: long prompts, 2 cores
        pruned = list(pool.map(lambda c: ask(server, c), cases))
        dense = list(pool.map(lambda c: ask(stock_server, c), cases))
    return cases, pruned, dense


def test_passkey_retrieval_survives_pruning(passkey_results):
    cases, pruned, dense = passkey_results
    dense_ok = [answered_key(d["text"]) == c.key for c, d in zip(cases, dense)]
    pruned_ok = [answered_key(p["text"]) == c.key for c, p in zip(cases, pruned)]
    assert sum(dense_ok) >= 3, f"the dense model itself fails this probe: {[d['text'] for d in dense]}"
    assert all(p for p, d in zip(pruned_ok, dense_ok) if d), [p["text"] for p in pruned]


def test_decode_really_attends_a_fraction_of_the_context(passkey_results):
    _, pruned, _ = passkey_results
    for out in pruned:
        meta = out["meta_info"]
        assert meta["attended"][0] == 1.0  # the first token is sampled from the dense prefill
        assert all(0.0 < a <= 1.0 for a in meta["attended"])
        # default config: at most about half the context once the model is confident
        assert min(meta["attended"][1:]) < 0.5, meta["attended"]


def test_no_step_attends_less_than_the_guards_and_the_minimum_keep_ratio(passkey_results):
    """Sink + recent blocks, plus min_keep_ratio of the other blocks, are a floor on every step."""
    cases, pruned, _ = passkey_results
    page, sink, recent, min_keep = 16, 1, 2, 0.25  # PruningConfig defaults
    for out in pruned:
        n = out["meta_info"]["prompt_tokens"]
        for step, fraction in enumerate(out["meta_info"]["attended"][1:]):
            context = n + step + 1
            blocks = -(-context // page)
            least = (sink + recent - 1) * page + (context - (blocks - 1) * page)  # guards, last block partial
            least += int(min_keep * (blocks - sink - recent)) * page
            assert fraction * context >= least - 1e-6 * context


@pytest.fixture(scope="module")
def keep_all_server(tmp_path_factory):
    """Pruning on, with min_keep_ratio = max_keep_ratio = 1 and no minimum context: theta = -inf."""
    log = tmp_path_factory.mktemp("keep_all") / "server.log"
    config = {"pruning": {"min_keep_ratio": 1.0, "max_keep_ratio": 1.0, "min_context": 0}}
    cmd = [sys.executable, "-m", "sgl_entropic.launch_server", "--entropic", "pruning",
           "--entropic-config", json.dumps(config), *COMMON_ARGS]
    srv = start_server(cmd, log)
    yield srv
    stop_server(srv.proc)


def test_threshold_minus_infinity_is_stock_sglang(keep_all_server, stock_server):
    prompts = [make_cases([1500], [0.3], seed=1)[0].prompt, "The capital of France is", "def fibonacci(n):"]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    for prompt in prompts:
        ours = _generate(keep_all_server, {"text": prompt, "sampling_params": params, "return_entropy": True})
        stock = _generate(stock_server, {"text": prompt, "sampling_params": params})
        assert ours["output_ids"] == stock["output_ids"]
        assert ours["meta_info"]["attended"] == [1.0] * 24


def test_a_reused_prefix_keeps_its_scores(server):
    """Turn 2 extends turn 1's cached prompt: its blocks are pruned, so they were scored in turn 1."""
    prompt = make_cases([3000], [0.5], seed=11)[0].prompt
    first = _generate(server, {"text": prompt, "sampling_params": GREEDY, "return_entropy": True})
    second = _generate(server, {"text": prompt + first["text"] + "\nRepeat the pass key:",
                                "sampling_params": GREEDY, "return_entropy": True})
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1
    # had the cached prefix come back unscored (NaN = always kept), decode would attend ~all of it
    assert _decode_attended(second["meta_info"]) < 0.6
