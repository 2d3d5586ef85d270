"""One real SGLang server (our launcher, bundled model, fp32) shared by the whole test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402  the benchmarks' server harness: one way to start, wait for and stop a server

STARTUP_TIMEOUT_S = 300


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def post(self, path: str, payload: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + path, json=payload, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def generate(self, payload: dict) -> dict:
        r = self.post("/generate", payload)
        assert r.status_code == 200, r.text
        return r.json()


# Shared by our server and the stock one: fp32 so that values compare with transformers to 1e-3,
# small prefill chunks so that long prompts exercise chunked prefill; an idle scheduler sleeps
# instead of spinning a core (two servers are up at once on a 2-core CI machine); a KV pool of 32k
# tokens (the tests' longest prompts are 7k), half the launcher's default, which takes ~6 s to allocate.
# The pool's size is fixed, so SGLang's free-memory profile is only a check, and a racy one: servers that load at
# once see each other's weights as used, and under a cgroup page cache counts as used too (CI, 7 GB "free": three
# Gemma servers failed it at the default fraction, 0.843). A 0.95 fraction keeps 5 % of the free memory as slack.
COMMON_ARGS = [
    "--dtype",
    "float32",
    "--chunked-prefill-size",
    "256",
    "--sleep-on-idle",
    "--max-total-tokens",
    "32768",
    "--mem-fraction-static",
    "0.95",
]


def start_server(cmd: list[str], log: Path, env: dict | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Server:
    port = common.free_port()
    srv = common.start_server(
        log.parent.name, [*cmd, "--port", str(port)], port, dict(os.environ) if env is None else env, timeout_s, log=log
    )
    return Server(srv.url, srv.proc, log)


def stop_server(proc: subprocess.Popen) -> None:
    common.stop_process(proc)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    if os.environ.get("SGLANG_ENTROPIC_TEST_URL"):  # reuse a running server while developing
        yield Server(os.environ["SGLANG_ENTROPIC_TEST_URL"], None, None)
        return
    log = tmp_path_factory.mktemp("server") / "server.log"
    # Pruning from 1024 tokens and our kernel over every page from 2048, whatever crossovers this (busy,
    # fp32) machine would time, and nothing timed at start-up: the runtime tests check pruned decode at 2-3k
    # tokens (tests/test_attention_backend.py tests the timing).
    # Compact JSON: xgrammar otherwise allows whitespace anywhere, and a sampled request (plain
    # T=0.8 as well as entropic) can fill any token budget with it (tests/test_reliability.py).
    # Every loop engaged: full leaves the queue order to SGLang unless --schedule-policy entropic asks.
    srv = start_server(shared_server_cmd(), log)
    yield srv
    stop_server(srv.proc)


PRUNING = {"min_context": 1024, "dense_kernel_from": 2048}
# The shared server decodes without speculation (the reference the speculative servers must match token for token);
# `--entropic full` would turn NGRAM on by default.
NO_SPECULATION = {"draft": "off"}


def shared_server_cmd(config: str = json.dumps({"pruning": PRUNING, "speculative": NO_SPECULATION})) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sgl_entropic.launch_server",
        "--entropic",
        "full",
        "--enable-metrics",
        "--entropic-config",
        config,
        "--constrained-json-disable-any-whitespace",
        "--schedule-policy",
        "entropic",
        *COMMON_ARGS,
    ]


# Up to 4 nodes a verified tree (3 drafts): wide enough to accept runs, narrow enough for a 2-core machine.
# Rule `matched`: every draft the trie offers is verified (the entropy rule would turn drafts off for the
# batches of sampled requests the tests send), so that verification itself is what the tests exercise.
SPECULATIVE_CMD = shared_server_cmd(json.dumps({"pruning": PRUNING, "speculative": {"draft": "matched"}})) + [
    "--speculative-algorithm",
    "NGRAM",
    "--speculative-num-draft-tokens",
    "4",
]


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory) -> Server:
    """The shared server's configuration with SGLang's NGRAM speculative decoding under the plugin: its greedy
    output must equal the shared server's, token for token."""
    log = tmp_path_factory.mktemp("spec") / "server.log"
    srv = start_server(SPECULATIVE_CMD, log)
    yield srv
    stop_server(srv.proc)


@pytest.fixture(scope="module")
def entropy_spec_server(tmp_path_factory) -> Server:
    """The default of `--entropic full`: NGRAM under the entropy rule, turned on without any SGLang flag (only its
    width capped at 4 nodes, as the other spec server's), which runs plain steps where it expects drafts to miss.
    Per module: two modules use it, and the tier's memory should not hold it in between."""
    # a SAM budget for the external corpora a test loads (none at start: the default's behaviour)
    cmd = shared_server_cmd(json.dumps({"pruning": PRUNING})) + [
        "--speculative-num-draft-tokens",
        "4",
        "--speculative-ngram-external-sam-budget",
        "3",
    ]
    srv = start_server(cmd, tmp_path_factory.mktemp("spec-entropy") / "server.log")
    yield srv
    stop_server(srv.proc)


@pytest.fixture(scope="session")
def stock_server(tmp_path_factory, model_path) -> Server:
    """Plain `sglang.launch_server` in the same venv: without our config the plugin registers nothing."""
    log = tmp_path_factory.mktemp("stock") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENTROPIC_CONFIG"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--chat-template",
        "chatml",
        *COMMON_ARGS,
        # as speculative decoding on CPU runs: the reference of penalized requests (test_speculative_penalties.py)
        "--disable-overlap-schedule",
    ]
    srv = start_server(cmd, log, env=env)
    yield srv
    stop_server(srv.proc)


@pytest.fixture(scope="session")
def model_path() -> Path:
    from sgl_entropic.model import prepare_bundled_model

    return prepare_bundled_model()


@pytest.fixture(scope="session")
def hf_model(model_path):
    """Plain transformers on the same fp32 weights: the reference for numerical checks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_path)
