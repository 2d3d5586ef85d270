"""The signal on the OpenAI endpoints, through the `openai` client: with `return_entropy` (extra_body)
or the `x-sglext-return-entropy` header, chat and completion responses carry sglext.entropic, one
entry per choice, streaming included; without it they are what stock SGLang returns."""

from __future__ import annotations

import json

import pytest
import requests

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Name three colours."}]
ASK = {"return_entropy": True}


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _check(entry, tokens: int, index: int = 0):
    assert entry["index"] == index
    assert len(entry["entropy"]) == len(entry["surprisal"]) == len(entry["temperature"]) == tokens
    assert all(h >= 0.0 for h in entry["entropy"]) and entry["entropic_time"] >= 0.0


def test_chat_carries_the_traces_when_asked(server):
    out = _client(server).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=0, extra_body=ASK
    )
    (entry,) = out.model_extra["sglext"]["entropic"]
    _check(entry, out.usage.completion_tokens)
    assert entry["temperature"] == [0.0] * out.usage.completion_tokens  # greedy


def test_a_chat_stream_ends_with_the_traces(server):
    stream = _client(server).chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.7,
        stream=True,
        extra_body=ASK,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    tokens = next(c.usage.completion_tokens for c in chunks if c.usage is not None)
    ext = [c for c in chunks if (c.model_extra or {}).get("sglext", {}).get("entropic")]
    assert len(ext) == 1 and ext[0].choices == []
    _check(ext[0].model_extra["sglext"]["entropic"][0], tokens)


def test_completions_two_choices_and_a_stream(server):
    client = _client(server)
    body = dict(
        model="default", prompt="The sky is", max_tokens=6, temperature=0.8, n=2, extra_body={**ASK, "ignore_eos": True}
    )
    out = client.completions.create(**body)
    entries = out.model_extra["sglext"]["entropic"]
    assert [e["index"] for e in entries] == [0, 1]
    for e in entries:
        _check(e, 6, e["index"])
    chunks = list(client.completions.create(stream=True, **{**body, "n": 1}))
    (ext,) = [c for c in chunks if (c.model_extra or {}).get("sglext")]
    _check(ext.model_extra["sglext"]["entropic"][0], 6)


def test_the_header_asks_too(server):
    r = requests.post(
        server.url + "/v1/completions",
        headers={"x-sglext-return-entropy": "1"},
        timeout=300,
        json={"model": "default", "prompt": "The sky is", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    _check(r.json()["sglext"]["entropic"][0], 4)


def _strip(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("id", "created")}


def test_without_asking_responses_are_stock(server, stock_server):
    """Greedy on a short prompt: the same JSON as stock SGLang's but for the id and the time; streams too."""
    payload = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    ours, stock = (
        requests.post(s.url + "/v1/chat/completions", json=payload, timeout=300).json() for s in (server, stock_server)
    )
    assert "sglext" not in ours and _strip(ours) == _strip(stock)

    def stream(s):
        """The streamed text, and each chunk's shape (how tokens split into chunks depends on timing)."""
        with requests.post(
            s.url + "/v1/chat/completions", json={**payload, "stream": True}, stream=True, timeout=300
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == b"data: [DONE]"
        chunks = [_strip(json.loads(line[len(b"data: ") :])) for line in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        shapes = {(tuple(sorted(c)), tuple(sorted(c["choices"][0])) if c["choices"] else ()) for c in chunks}
        return text, shapes, chunks[-1]["choices"][0]["finish_reason"] if chunks[-1]["choices"] else None

    assert stream(server) == stream(stock_server)
