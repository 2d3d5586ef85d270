"""Requests with frequency, presence or repetition penalties under speculative decoding: served, and exactly, against
stock SGLang's plain decoding of the same requests (the session's stock server runs without the overlap scheduler,
as speculative decoding on CPU does: overlapped, SGLang feeds each step's token to the penalizer a step late,
`req.output_ids[-1]` when the next step is prepared)."""

from __future__ import annotations

import pytest

from tests.prompts import real_prompts

pytestmark = pytest.mark.server

PROMPTS = real_prompts()[1:]  # the code to rewrite and the open question (the shorter prompts: nothing prunes)


PENALTIES = [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.8}, {"presence_penalty": 1.5}]


def test_penalized_requests_are_served_exactly_beside_drafting_ones(stock_server, spec_server):
    """Each penalty beside an unpenalized request in one batch: greedy output token-identical to stock's plain
    decoding (penalized rows commit one token a step, speculation.penalized), and each penalty changes some output."""
    changed = [False] * len(PENALTIES)
    for prompt in PROMPTS:
        params = [{"max_new_tokens": 40, "temperature": 0, **p} for p in [*PENALTIES, {}]]
        outs = []
        for srv in (stock_server, spec_server):
            r = srv.post("/generate", {"text": [prompt] * len(params), "sampling_params": params})
            assert r.status_code == 200, r.text
            outs.append([o["output_ids"] for o in r.json()])
        assert outs[1] == outs[0]
        changed = [c or out != outs[0][-1] for c, out in zip(changed, outs[0])]
    assert all(changed)


def _plain_steps(srv) -> int:
    return srv.get("/server_info").json()["internal_states"][0]["entropic"]["speculative"]["totals"]["plain_steps"]


def test_a_penalized_request_alone_runs_plain_decode_steps_exactly(stock_server, spec_server):
    """Alone, a penalized request's steps verify no drafts: each is a plain decode step (the penalties applied as
    plain decoding applies them), token-identical to plain decoding."""
    before = _plain_steps(spec_server)
    for penalty in PENALTIES:
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 24, "temperature": 0, **penalty}}
        assert spec_server.generate(body)["output_ids"] == stock_server.generate(body)["output_ids"]
    assert _plain_steps(spec_server) - before >= len(PENALTIES) * 20  # every decode step but the last few plain
