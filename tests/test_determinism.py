"""The default (`--entropic full`: NGRAM under the entropy rule) in bf16, the launcher's dtype: a request served alone
gets the same greedy output on every run and after a restart. Before the draft widths followed the server's live
step times and the drafts SGLang's trie shared by every request, so the verify forwards' shapes, and with them bf16
rounding, changed from run to run (the second run drafts from the first one's output)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import COMMON_ARGS, PRUNING, start_server, stop_server
from tests.prompts import real_prompts

pytestmark = pytest.mark.server

RUNS = 3
TOKENS = 48  # the bf16 partings this test guards against came within the first 20 tokens (issue #47)
BF16_ARGS = [a if a != "float32" else "bfloat16" for a in COMMON_ARGS]


def outputs(srv) -> list[list[list[int]]]:
    """RUNS rounds of every prompt, one request at a time, without flushing anything in between."""
    return [
        [
            srv.generate({"text": text, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}})["output_ids"]
            for text in real_prompts()
        ]
        for _ in range(RUNS)
    ]


def capped(srv, drafts: int):
    return srv.post(
        "/generate",
        {
            "text": "Hi",
            "sampling_params": {
                "max_new_tokens": 2,
                "custom_params": {"entropic": {"speculative": {"max_draft_tokens": drafts}}},
            },
        },
    )


def test_bf16_greedy_output_is_the_same_on_every_run_and_after_a_restart(tmp_path):
    """The default as a user launches it (SGLang's NGRAM width left to its default, 12 nodes)."""
    cmd = [
        sys.executable,
        "-m",
        "sgl_entropic.launch_server",
        "--entropic",
        "full",
        "--entropic-config",
        json.dumps({"pruning": PRUNING}),
        *BF16_ARGS,
    ]
    launches, logs = [], []
    for i in range(2):
        log = tmp_path / f"launch{i}" / "server.log"
        log.parent.mkdir()
        srv = start_server(cmd, log)
        try:
            launches.append(outputs(srv))
            if i == 0:  # a request's cap is checked against the width SGLang resolved (its flag left unset)
                assert capped(srv, 11).status_code == 200
                r = capped(srv, 12)
                assert r.status_code == 400 and "max_draft_tokens: at most 11" in r.text
            totals = srv.get("/server_info").json()["internal_states"][0]["entropic"]["speculative"]["totals"]
        finally:
            stop_server(srv.proc)
        assert totals["accepted"] > 0 and totals["plain_steps"] > 0  # both kinds of step ran
        logs.append(log.read_text())
    first = launches[0][0]
    for launch in launches:
        for run in launch:
            assert run == first
    assert "draft widths priced by a cost table (as timed before" in logs[1]  # the restart read the kept table
