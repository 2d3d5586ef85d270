"""The second shipped model, Gemma 3 270M (15 of 18 layers sliding-window, 512 tokens; a 262k vocabulary),
on the real server against stock SGLang: traces and the controller work, decode that prunes the three
global layers past the window answers a passkey placed far outside the window as stock does, and NGRAM
speculative decoding (whose verify forward applies the sliding windows itself) is token-identical to stock."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from programs.passkey import Case, answered_key
from tests.conftest import COMMON_ARGS, PRUNING, start_server, stop_server

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
# Larger prefill chunks than the shared servers' (fewer forwards over 1.6k-token prompts) and a KV pool sized
# for them: 36 KB a token in fp32.
ARGS = [*COMMON_ARGS, "--chunked-prefill-size", "1024", "--max-total-tokens", "8192"]


@pytest.fixture(scope="module")
def gemma_servers(tmp_path_factory):
    from sgl_entropic.model import prepare_model

    model = str(prepare_model("gemma3-270m"))

    def entropic(config: dict) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sgl_entropic.launch_server",
            "--model-path",
            model,
            "--entropic",
            "full",
            "--entropic-config",
            json.dumps({"pruning": PRUNING, **config}),
            *ARGS,
        ]

    stock = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu", *ARGS]
    stock_env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENTROPIC_CONFIG"}
    stock_env["SGLANG_USE_CPU_ENGINE"] = "1"
    # One server of ours: speculation for the identity test (`matched` verifies every draft the trie offers: the
    # test must not hang on the entropy rule's timing); the other tests' requests opt out (OURS), so that every
    # decode step of theirs is a plain step, pruned.
    spec = [
        *entropic({"speculative": {"draft": "matched"}}),
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "4",
    ]
    logs = [tmp_path_factory.mktemp(name) / "server.log" for name in ("gemma-stock", "gemma")]
    with ThreadPoolExecutor(2) as pool:  # both load at once
        started = [pool.submit(start_server, stock, logs[0], stock_env), pool.submit(start_server, spec, logs[1])]
        servers = [f.result() for f in started]
    yield servers
    with ThreadPoolExecutor(2) as pool:  # each takes seconds to shut down
        list(pool.map(lambda srv: stop_server(srv.proc), servers))


# a request that opts out of speculation: plain (pruned) decode steps on the speculative server
OURS = {"custom_params": {"entropic": {"speculative": {"draft": "off"}}}}


@pytest.fixture(scope="module")
def passkeys(gemma_servers):
    """Keys far outside the 512-token window (1.3k and 0.8k tokens back in ~1.6k): only the three global
    layers can see them. Pruned (ours) and dense (stock), greedy."""
    stock, ours = gemma_servers
    rng = random.Random(5)
    cases = [Case(1600, depth, rng.randint(10000, 99999)) for depth in (0.2, 0.5)]

    def ask(srv, case):
        if srv is stock:
            return srv.generate({"text": case.prompt, "sampling_params": GREEDY})
        return srv.generate({"text": case.prompt, "sampling_params": {**GREEDY, **OURS}, "return_entropy": True})

    with ThreadPoolExecutor(2) as pool:
        pruned = list(pool.map(lambda c: ask(ours, c), cases))
        dense = list(pool.map(lambda c: ask(stock, c), cases))
    return cases, pruned, dense


def test_gemma_decode_prunes_the_global_layers_and_keeps_the_passkey(passkeys):
    cases, pruned, dense = passkeys
    for case, p, d in zip(cases, pruned, dense):
        assert answered_key(d["text"]) == case.key, f"stock Gemma itself misses this probe: {d['text']!r}"
        assert answered_key(p["text"]) == case.key, (p["text"], d["text"])
        meta = p["meta_info"]
        assert meta["prompt_tokens"] > 1500
        attended = meta["attended"][1:]  # element 0: the dense prefill
        assert attended and max(attended) < 0.45  # the global layers really prune: about a third of the context


def test_gemma_traces_cover_every_token_over_its_262k_vocabulary(passkeys):
    _, pruned, _ = passkeys
    for p in pruned:
        meta = p["meta_info"]
        n = meta["completion_tokens"]
        assert len(meta["entropy"]) == len(meta["surprisal"]) == len(meta["attended"]) == n
        assert all(0.0 <= h <= math.log(262144) for h in meta["entropy"])
        assert meta["temperature"] == [0.0] * n  # greedy


def test_gemma_controller_steers_the_temperature(gemma_servers):
    ours = gemma_servers[1]
    out = ours.generate(
        {
            "text": "The history of the lighthouse begins",
            "return_entropy": True,
            "sampling_params": {
                "max_new_tokens": 24,
                "temperature": 1.0,
                "ignore_eos": True,
                "custom_params": {"entropic": {"target_entropy": 1.0, **OURS["custom_params"]["entropic"]}},
            },
        }
    )
    temps = out["meta_info"]["temperature"]
    assert len(temps) == 24 and len(set(temps)) > 1  # the controller moved T
    assert all(0.0 < t <= 2.0 for t in temps)


def test_gemma_speculative_decoding_is_token_identical_to_stock(gemma_servers, passkeys):
    """Greedy, dense verify steps against stock's dense decode: the passkey prompts put every verified node
    ~1.6k tokens in, where the sliding layers must see only their last 512; the copying prompt gets drafts accepted."""
    import sglang

    stock, spec = gemma_servers
    cases, _, _ = passkeys
    readme = open(sglang.__file__.replace("__init__.py", "README.md")).read()
    copying = readme.split("## Files")[0] + "\n\nThe same list of folders, copied exactly:\n"
    params = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    texts = [case.prompt for case in cases] + [copying]
    with ThreadPoolExecutor(2) as pool:
        dense = list(pool.map(lambda t: stock.generate({"text": t, "sampling_params": params}), texts))
        drafted = list(pool.map(lambda t: spec.generate({"text": t, "sampling_params": params}), texts))
    for d, s in zip(dense, drafted):
        assert s["output_ids"] == d["output_ids"], (s["text"], d["text"])
    assert drafted[-1]["meta_info"]["spec_num_correct_drafts"] > 0  # drafts were accepted, not only verified
