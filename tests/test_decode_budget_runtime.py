"""The decode budget (token-level preemption) on the real runtime: a server whose budget is smaller
than the running batch parks rows, never longer than max_skip_steps - 1 steps in a row, and parking
changes nothing but timing: greedy outputs equal those of a server without a budget.

The server also runs SGLang's own retraction test mode (SGLANG_TEST_RETRACT: retract running
requests every few steps, as under KV pressure), so the entropic retraction order and the budget
are exercised together, and retracted requests must still produce the same tokens."""

import concurrent.futures as cf
import json
import os
import sys
import time

import pytest
import requests

from tests.conftest import COMMON_ARGS, start_server, stop_server

pytestmark = pytest.mark.server

BUDGET, MAX_SKIP = 2, 3
PROMPTS = [
    f"<|im_start|>user\nWrite a short poem about the number {i}.<|im_end|>\n<|im_start|>assistant\n" for i in range(6)
]


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("budget") / "server.log"
    config = {"scheduling": {"decode_budget": BUDGET, "max_skip_steps": MAX_SKIP}}
    cmd = [
        sys.executable,
        "-m",
        "sgl_entropic.launch_server",
        "--entropic",
        "scheduling",
        "--entropic-config",
        json.dumps(config),
        *COMMON_ARGS,
    ]
    srv = start_server(cmd, log, env={**os.environ, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "10"})
    yield srv
    stop_server(srv.proc)


def _greedy(srv, prompt, n=16):
    return srv.generate(
        {
            "text": prompt,
            "return_entropy": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
    )


def _burst(srv):
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _greedy(srv, p), PROMPTS))


def test_budget_parks_rows_within_the_bound_and_changes_no_token(budget_server, server):
    budgeted = _burst(budget_server)
    dense = [_greedy(server, p) for p in PROMPTS]
    parked = [out["meta_info"]["parked"] for out in budgeted]
    assert all(len(p) == 16 for p in parked)
    # the budget acted: 6 concurrent rows, 2 decode per step
    assert sum(map(sum, parked)) > 0, parked
    # starvation bound: at most max_skip_steps - 1 parked steps before any token
    assert max(map(max, parked)) <= MAX_SKIP - 1, parked
    assert [o["output_ids"] for o in budgeted] == [o["output_ids"] for o in dense]
    assert all(p == [0] * 16 for p in (o["meta_info"]["parked"] for o in dense))
    assert "Testing retraction" in budget_server.log.read_text()  # requests were retracted and resumed
    # the split ran on SGLang's real batches: a fault would have decoded them whole, counted here
    assert not _entropic_state(budget_server)["degraded_steps"]


def _entropic_state(srv):
    return srv.get("/server_info").json()["internal_states"][0]["entropic"]


def test_an_aborted_parked_request_frees_its_kv_and_state(budget_server):
    def stream_and_drop(prompt):
        payload = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with requests.post(budget_server.url + "/generate", json=payload, stream=True, timeout=120) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    return  # closing the connection aborts the request server-side

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(stream_and_drop, PROMPTS))
    freed = {"leaked_request_states": 0, "kv_tokens_in_use": 0, "request_slots_in_use": 0}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = _entropic_state(budget_server)
        if {k: state[k] for k in freed} == freed:
            break
        time.sleep(0.5)
    assert {k: state[k] for k in freed} == freed, state
    assert _greedy(budget_server, PROMPTS[0], n=4)["meta_info"]["completion_tokens"] == 4
    # what stays alive is what SGLang's last batch still references, never the aborted burst
    assert _entropic_state(budget_server)["live_request_states"] <= 1
