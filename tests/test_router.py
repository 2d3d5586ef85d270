"""Two entropic workers behind SGLang's own router (sglang-router, `scripts/setup.sh --router`).

What passes through the router, per endpoint, is asserted here and tabled in the README ("Scaling
out"): the signal on /generate and /v1/completions (streaming included), custom_params on
/v1/completions, cache-aware routing that keeps a conversation on the worker holding its prefix, and
a load test with client aborts after which no worker holds any KV or request slot. What the router
drops (custom_params on /generate and chat) the workers supply with `sampling.every_request`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
import requests

from tests.conftest import COMMON_ARGS, start_server, stop_server
from tests.test_reliability import CHAT, LONG_PROMPT, _check_output, _nothing_held, _send

pytest.importorskip("sglang_router", reason="sglang-router is not installed (bash scripts/setup.sh --router)")

pytestmark = pytest.mark.server

WORKERS = 2
# A small KV pool each (the launcher's default, 65536 fp32 tokens, is ~3 GB): the suite's shared and
# stock servers are still up, and four full pools crowd a 24 GB machine.
# Completions through the router carry custom_params: bounds that exclude the request's own
# temperature (0.8), so a trace inside them proves the controller ran. The workers give the same
# controller to every sampled request (`sampling.every_request`): the router drops custom_params
# on /generate and chat.
T_MIN, T_MAX = 0.3, 0.6
CONTROLLER = {"entropic": {"target_entropy": 1.5, "t_min": T_MIN, "t_max": T_MAX, "t_init": 0.5}}
WORKER_CONFIG = {"sampling": {**CONTROLLER["entropic"], "every_request": True}}
WORKER_CMD = [sys.executable, "-m", "sgl_entropic.launch_server", "--entropic", "full", "--max-total-tokens", "16384",
              "--entropic-config", json.dumps(WORKER_CONFIG), "--enable-metrics", *COMMON_ARGS]


class Cluster:
    def __init__(self, router, workers):
        self.router, self.workers = router, workers

    def states(self) -> list[dict]:
        """Each worker's scheduler state (GET /server_info -> internal_states[0].entropic)."""
        return [w.get("/server_info", timeout=120).json()["internal_states"][0]["entropic"] for w in self.workers]

    def admitted(self) -> list[int]:
        return [s["requests_admitted"] for s in self.states()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    workers, router = [], None
    try:
        for i in range(WORKERS):
            workers.append(start_server(WORKER_CMD, logs / f"worker-{i}.log", timeout_s=600))  # 4 servers up: slow
        metrics_port = int(workers[0].url.rsplit(":", 1)[1]) + 1000  # the router's default 29000 may be taken
        router = start_server([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--worker-urls", *(w.url for w in workers), "--policy", "cache_aware",
                               "--prometheus-port", str(metrics_port)], logs / "router.log", timeout_s=600)
        _wait_for_workers(router)
        yield Cluster(router, workers)
    finally:
        for srv in [router, *workers]:
            if srv is not None:
                stop_server(srv.proc)


def _wait_for_workers(router, timeout_s: float = 120.0) -> None:
    """The router answers /health before it has registered its workers (in the background)."""
    deadline = time.monotonic() + timeout_s
    while (ready := router.get("/readiness").json()).get("healthy_workers") != WORKERS:
        assert time.monotonic() < deadline, f"router not ready: {ready}\n{router.log.read_text()[-3000:]}"
        time.sleep(1)


def _traces_ok(meta: dict) -> None:
    n = meta["completion_tokens"]
    assert len(meta["entropy"]) == len(meta["surprisal"]) == len(meta["temperature"]) == n
    assert all(h >= 0 for h in meta["entropy"]) and meta["entropic_time"] >= 0


def _stream(srv, path: str, body: dict) -> list[dict]:
    """The events of a streamed request, [DONE] checked and dropped."""
    with requests.post(srv.url + path, json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def test_generate_through_the_router_carries_the_traces_streaming_included(cluster):
    before = cluster.admitted()
    for i in range(4):
        body = {"text": CHAT.format(f"Name a colour, {i}."), "return_entropy": True,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.7}}
        out = cluster.router.post("/generate", body)
        assert out.status_code == 200, out.text
        _traces_ok(out.json()["meta_info"])
        _traces_ok(_stream(cluster.router, "/generate", body)[-1]["meta_info"])
    assert sum(cluster.admitted()) - sum(before) >= 8  # the router may retry one that a busy worker answered late


def _sglext(payload: dict, tokens: int) -> dict:
    (entry,) = payload["sglext"]["entropic"]
    assert len(entry["entropy"]) == len(entry["surprisal"]) == len(entry["temperature"]) == tokens
    assert entry["entropic_time"] >= 0
    return entry


def test_completions_carry_custom_params_and_the_signal_streaming_included(cluster):
    body = {"model": "default", "prompt": "The river bends", "max_tokens": 8, "temperature": 0.8,
            "ignore_eos": True, "return_entropy": True, "custom_params": CONTROLLER}
    out = cluster.router.post("/v1/completions", body)
    assert out.status_code == 200, out.text
    temps = _sglext(out.json(), 8)["temperature"]
    assert all(T_MIN - 1e-6 <= t <= T_MAX + 1e-6 for t in temps), temps  # the controller ran, not T = 0.8
    (last,) = [e for e in _stream(cluster.router, "/v1/completions", body) if e.get("sglext")]
    _sglext(last, 8)
    bad = cluster.router.post("/v1/completions", {**body, "custom_params": {"entropic": {"t_min": -1}}})
    assert bad.status_code == 400 and "t_min" in bad.text, bad.text


def test_what_router_0_3_2_drops_is_what_the_readme_says(cluster):
    """custom_params on /generate and return_entropy on chat do not reach the worker (README, Scaling
    out). If this fails, the router passes them now: update the README table."""
    bad = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"entropic": {"t_min": -1}}}}
    assert cluster.router.post("/generate", bad).status_code == 200  # a worker would answer 400
    assert cluster.workers[0].post("/generate", bad).status_code == 400
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "return_entropy": True}
    assert "sglext" not in cluster.router.post("/v1/chat/completions", chat).json()
    assert "sglext" in cluster.workers[0].post("/v1/chat/completions", chat).json()


def test_cache_aware_routing_keeps_each_conversation_on_the_worker_with_its_prefix(cluster):
    """Turn 2 of each conversation finds turn 1's prompt and answer cached: it went to the same worker."""
    cached = []
    for c in range(4):
        history = CHAT.format(f"Conversation {c}. " + LONG_PROMPT + " Summarise the notes.")
        first = cluster.router.generate({"text": history, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        history += first["text"] + "<|im_end|>\n" + CHAT.format("And in one word?")
        second = cluster.router.generate({"text": history, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        cached.append((first["meta_info"]["prompt_tokens"], second["meta_info"]["cached_tokens"]))
    assert all(hit >= prompt for prompt, hit in cached), cached


def _controlled_tokens(worker) -> float:
    """Tokens the worker's controller has sampled (the sglang:entropic_temperature histogram's count)."""
    lines = worker.get("/metrics").text.splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("sglang:entropic_temperature_count"))


def test_every_request_puts_the_workers_controller_on_generate_and_chat_through_the_router(cluster):
    """What the router drops (custom_params on /generate and chat) the workers' default supplies."""
    body = {"text": CHAT.format("Name a river."), "return_entropy": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.9}}
    temps = cluster.router.generate(body)["meta_info"]["temperature"]
    assert len(temps) == 6 and all(T_MIN - 1e-6 <= t <= T_MAX + 1e-6 for t in temps), temps  # not 0.9
    greedy = cluster.router.generate({**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    assert greedy["meta_info"]["temperature"] == [0.0] * 6  # greedy stays greedy
    before = sum(_controlled_tokens(w) for w in cluster.workers)
    chat = {"model": "default", "messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 6,
            "temperature": 0.9, "ignore_eos": True}
    assert cluster.router.post("/v1/chat/completions", chat).status_code == 200
    assert sum(_controlled_tokens(w) for w in cluster.workers) - before == 6  # every chat token was controlled


# ---------------------------------------------------------------- load through the router
# 200 requests at once over both workers, mixed lengths, half /generate (traces) and half
# /v1/completions (custom_params controller + sglext), a quarter cut off mid-stream by the client.

LOAD_REQUESTS = 200


def _router_spec(i: int) -> dict:
    abort = i % 4 == 3
    prompt = (LONG_PROMPT + "\n" if i % 10 == 0 else "") + f"Question {i}: describe item number {i} in one line."
    tokens = 64 if abort else 4 + (7 * i) % 9  # an aborted one is still generating when the client goes
    if i % 2 == 0:  # /generate, in the shape tests/test_reliability.py checks
        greedy = i % 5 == 0
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0 if greedy else 0.8}
        return {"i": i, "abort": abort, "stream": abort or i % 4 == 0, "entropic": "off", "greedy": greedy,
                "json": False, "endpoint": "/generate",
                "body": {"text": CHAT.format(prompt), "sampling_params": params, "return_entropy": True}}
    return {"i": i, "abort": abort, "stream": abort or i % 4 == 1, "endpoint": "/v1/completions", "tokens": tokens,
            "body": {"model": "default", "prompt": CHAT.format(prompt), "max_tokens": tokens, "temperature": 0.8,
                     "ignore_eos": True, "return_entropy": True, "custom_params": CONTROLLER}}


def _completion_problem(spec: dict, out: dict) -> str | None:
    choice, n = out["choices"][0], spec["tokens"]
    if choice["finish_reason"] != "length" or out["usage"]["completion_tokens"] != n:
        return f"finish {choice['finish_reason']} after {out['usage']['completion_tokens']} tokens, expected {n}"
    return _sglext_problem(out, n)


def _sglext_problem(payload: dict, n: int) -> str | None:
    entries = (payload.get("sglext") or {}).get("entropic") or []
    if len(entries) != 1 or len(entries[0]["entropy"]) != n:
        return f"sglext {payload.get('sglext')!r} for {n} tokens"
    temps = entries[0]["temperature"]
    if not all(T_MIN - 1e-6 <= t <= T_MAX + 1e-6 for t in temps):
        return f"controller temperatures {temps}"
    return None


async def _send_completion(session, url: str, spec: dict) -> tuple[str, str]:
    import aiohttp

    body = {**spec["body"], "stream": spec["stream"]}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return "lost", f"HTTP {resp.status}: {(await resp.text())[:300]}"
            if not spec["stream"]:
                problem = _completion_problem(spec, await resp.json())
                return ("lost", problem) if problem else ("completed", "")
            chunks, ext, done = 0, None, False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return "lost", f"error event {event['error']}"
                ext = event if event.get("sglext") else ext
                chunks += 1
                if spec["abort"] and chunks == 1 + (spec["i"] // 4) % 2:
                    resp.close()
                    return "aborted", ""
            if not done or ext is None:
                return "lost", f"stream ended after {chunks} chunks, done={done}, sglext={ext is not None}"
            problem = _sglext_problem(ext, spec["tokens"])
            return ("lost", problem) if problem else ("completed", "")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        return "lost", f"{type(err).__name__}: {err}"


async def _burst(url: str, specs: list[dict]) -> list[tuple[str, str]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await asyncio.gather(*(
            _send(session, url, s) if s["endpoint"] == "/generate" else _send_completion(session, url, s) for s in specs))


def _wait_until_nothing_is_held(cluster, timeout_s: float = 180.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = cluster.states()
        if all(_nothing_held(s) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


@pytest.mark.slow
def test_load_through_the_router_loses_nothing_and_every_worker_frees_everything(cluster):
    pytest.importorskip("aiohttp")
    specs = [_router_spec(i) for i in range(LOAD_REQUESTS)]
    before = cluster.admitted()
    start = time.monotonic()
    results = asyncio.run(_burst(cluster.router.url, specs))
    wall = time.monotonic() - start
    held = _wait_until_nothing_is_held(cluster)
    per_worker = [a - b for a, b in zip(cluster.admitted(), before)]
    counts = {k: sum(1 for o, _ in results if o == k) for k in ("completed", "aborted", "lost")}
    lost = [(s["i"], s["endpoint"], d) for s, (o, d) in zip(specs, results) if o == "lost"]
    report = {"sent": len(specs), **counts, "wall_s": round(wall, 1), "admitted_per_worker": per_worker,
              "held_after": [{k: s[k] for k in ("kv_tokens_in_use", "request_slots_in_use")} for s in held]}
    print("\nrouter load:", json.dumps(report))
    if os.environ.get("SGLANG_ENTROPIC_ROUTER_REPORT"):
        with open(os.environ["SGLANG_ENTROPIC_ROUTER_REPORT"], "w") as f:
            json.dump({**report, "lost_details": lost}, f, indent=1)

    assert counts["lost"] == 0, lost[:10]
    assert counts["aborted"] == sum(s["abort"] for s in specs) and counts["completed"] + counts["aborted"] == len(specs)
    assert all(_nothing_held(s) for s in held), report
    assert all(n > 0 for n in per_worker), report  # both workers served
    assert sum(per_worker) >= len(specs), report
