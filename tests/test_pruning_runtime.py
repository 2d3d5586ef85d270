"""The meso loop on the real server: pruned decode keeps passkey retrieval, every step attends the share
its budget sets, and a reused radix prefix is selected from too. (Our kernel over every page against
SGLang's own decode loop: tests/test_attention_backend.py, in-process.)"""

from __future__ import annotations

import random
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from programs.passkey import Case, answered_key, make_cases
from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import reference_entropy_for_vocab, row_pages

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
LONG_PROMPT_TIMEOUT_S = 900  # a 4k-token fp32 prefill in 256-token chunks on a busy 2-core machine


def _generate(srv, payload: dict) -> dict:
    r = srv.post("/generate", payload, timeout=LONG_PROMPT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _decode_attended(meta: dict) -> float:
    steps = meta["attended"][1:]  # element 0 comes from the (dense) prefill forward
    return statistics.fmean(steps)


@pytest.fixture(scope="module")
def passkey_results(server, stock_server):
    """Passkeys at 2k and 3k tokens: pruned (our full-mode server) and dense (stock)."""
    rng = random.Random(7)
    cases = [Case(n, depth, rng.randint(10000, 99999)) for n, depth in ((2000, 0.7), (3000, 0.3))]

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
    assert all(dense_ok), f"the dense model itself fails this probe: {[d['text'] for d in dense]}"
    assert all(p for p, d in zip(pruned_ok, dense_ok) if d), [p["text"] for p in pruned]


def test_every_step_attends_the_pages_its_budget_keeps(server, passkey_results):
    """Decode step t (context = prompt + t tokens) keeps the pages row_pages gives for the entropy of
    token t - 1 (the request's latest H when the step was planned), under the server's own config."""
    _, pruned, _ = passkey_results
    info = server.get("/server_info").json()["entropic"]
    # the server's own pruning config with the min_context it runs with, SmolLM2's vocabulary
    cfg = PruningConfig(**{**info["config"]["pruning"], "min_context": info["pruning"]["min_context"]})
    h_ref = reference_entropy_for_vocab(49152)
    for out in pruned:
        meta = out["meta_info"]
        prompt, attended, entropy = meta["prompt_tokens"], meta["attended"], meta["entropy"]
        assert attended[0] == 1.0  # the first token is sampled from the dense prefill
        for t in range(1, len(attended)):
            rows = row_pages(prompt + t, entropy[t - 1], cfg, h_ref)
            assert attended[t] == pytest.approx(rows.kept_tokens / (prompt + t), rel=1e-9), (t, entropy[t - 1])
        assert max(attended[1:]) < 0.45  # it really prunes: a third of the context or so


def test_a_reused_prefix_is_selected_from(server):
    """Turn 2 extends turn 1's cached prompt (its pages and their key bounds are shared, not
    recomputed): the key, in the cached part, is still found while decode attends a fraction."""
    case = make_cases([3000], [0.5], seed=11)[0]
    first = _generate(server, {"text": case.prompt, "sampling_params": GREEDY, "return_entropy": True})
    second = _generate(
        server,
        {
            "text": case.prompt + first["text"] + "\nRepeat the pass key. The pass key is",
            "sampling_params": GREEDY,
            "return_entropy": True,
        },
    )
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 16
    assert answered_key(first["text"]) == case.key and answered_key(second["text"]) == case.key
    assert _decode_attended(second["meta_info"]) < 0.45
