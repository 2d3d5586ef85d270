"""Two entropic workers behind SGLang's model gateway (smg, `scripts/setup.sh --router`).

What passes through the gateway, per endpoint, is asserted here and tabled in the README ("Scaling
out"): on /generate, /v1/completions and /v1/chat/completions, streamed or not, `return_entropy`
brings the worker's traces back and a per-request `custom_params.entropic` (in `sampling_params` on
/generate, top level on the OpenAI endpoints) reaches the worker: its controller's temperatures come
back, and a bad value comes back as the worker's 400. Each is checked by what only the worker can
produce. Also: `sampling.every_request` (for routers that drop custom_params) through the gateway,
cache-aware routing that keeps a conversation on the worker holding its prefix, and a load test with
client aborts after which no worker holds any KV or request slot.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import COMMON_ARGS, PRUNING, start_server, stop_server
from tests.load_client import CHAT, LONG_PROMPT, nothing_held, send, sse_events

try:  # the distribution, not the `smg` console script (sglang-router's wheel installs one too)
    importlib.metadata.version("smg")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("smg is not installed (bash scripts/setup.sh --router)", allow_module_level=True)

pytestmark = pytest.mark.server

WORKERS = 2
ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions"]
TOKENS = 6
# Requests sample at T = 0.8. The workers give every sampled request without custom_params their own
# controller (`sampling.every_request`), bounded to [0.3, 0.6]; a request's custom_params asks for
# [1.1, 1.4]. So a trace says which controller ran: 0.8 none, [0.3, 0.6] the workers', [1.1, 1.4]
# the request's (it reached the worker).
T_MIN, T_MAX = 0.3, 0.6
R_MIN, R_MAX = 1.1, 1.4
# the crossovers given: pruning is not under test here, so nothing is timed at start-up
WORKER_CONFIG = {
    "sampling": {"target_entropy": 1.5, "t_min": T_MIN, "t_max": T_MAX, "t_init": 0.5, "every_request": True},
    "pruning": PRUNING,
}
CONTROLLER = {"entropic": {"target_entropy": 1.5, "t_min": R_MIN, "t_max": R_MAX, "t_init": 1.2}}
# A small KV pool each (the launcher's default, 65536 fp32 tokens, is ~3 GB).
WORKER_CMD = [
    sys.executable,
    "-m",
    "sgl_entropic.launch_server",
    "--entropic",
    "full",
    "--max-total-tokens",
    "16384",
    "--entropic-config",
    json.dumps(WORKER_CONFIG),
    "--enable-metrics",
    *COMMON_ARGS,
]


class Cluster:
    def __init__(self, router, workers):
        self.router, self.workers = router, workers
        # smg routes the OpenAI endpoints by model: "default" (which a worker takes) is a 404 there
        (self.model,) = [m["id"] for m in router.get("/v1/models").json()["data"]]

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
        with ThreadPoolExecutor(WORKERS) as pool:  # side by side: most of a start is Python importing
            starts = [
                pool.submit(start_server, WORKER_CMD, logs / f"worker-{i}.log", timeout_s=600) for i in range(WORKERS)
            ]
            for start in starts:
                workers.append(start.result())
        metrics_port = int(workers[0].url.rsplit(":", 1)[1]) + 1000  # smg's default 29000 may be taken
        router = start_server(
            [
                sys.executable,
                "-m",
                "smg",
                "launch",
                "--host",
                "127.0.0.1",
                "--worker-urls",
                *(w.url for w in workers),
                "--policy",
                "cache_aware",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(metrics_port),
            ],
            logs / "router.log",
            timeout_s=600,
        )
        _wait_for_workers(router)
        yield Cluster(router, workers)
    finally:
        for srv in [router, *workers]:
            if srv is not None:
                stop_server(srv.proc)


def _wait_for_workers(router, timeout_s: float = 120.0) -> None:
    """smg answers /health before it has registered its workers (in the background); /readiness counts them."""
    deadline = time.monotonic() + timeout_s
    while (ready := router.get("/readiness").json()).get("healthy_workers") != WORKERS:
        assert time.monotonic() < deadline, f"gateway not ready: {ready}\n{router.log.read_text()[-3000:]}"
        time.sleep(1)


def _body(endpoint: str, model: str, prompt: str, controller: dict | None = None, temperature: float = 0.8) -> dict:
    """A request for TOKENS tokens with the traces asked for, custom_params where the endpoint takes them."""
    if endpoint == "/generate":
        params = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": temperature}
        if controller is not None:
            params["custom_params"] = controller
        return {"text": CHAT.format(prompt), "sampling_params": params, "return_entropy": True}
    body = {
        "model": model,
        "max_tokens": TOKENS,
        "temperature": temperature,
        "ignore_eos": True,
        "return_entropy": True,
    }
    if endpoint == "/v1/completions":
        body["prompt"] = CHAT.format(prompt)
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if controller is not None:
        body["custom_params"] = controller
    return body


def _stream(srv, path: str, body: dict) -> list[dict]:
    """The events of a streamed request, [DONE] checked and dropped."""
    with requests.post(srv.url + path, json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


def _trace(srv, endpoint: str, body: dict, stream: bool) -> dict:
    """The worker's traces of one request: meta_info on /generate, the one sglext.entropic entry on the
    OpenAI endpoints (streamed: the last /generate event, the one event that carries sglext)."""
    if stream:
        events = _stream(srv, endpoint, body)
        payload = events[-1] if endpoint == "/generate" else [e for e in events if e.get("sglext")][-1]
    else:
        out = srv.post(endpoint, body)
        assert out.status_code == 200, out.text
        payload = out.json()
    if endpoint == "/generate":
        trace = payload["meta_info"]
        assert trace["completion_tokens"] == TOKENS
    else:
        (trace,) = payload["sglext"]["entropic"]
    assert len(trace["entropy"]) == len(trace["surprisal"]) == len(trace["temperature"]) == TOKENS, trace
    assert all(h >= 0 for h in trace["entropy"]) and trace["entropic_time"] >= 0, trace
    return trace


def _within(temps: list[float], lo: float, hi: float) -> bool:
    return all(lo - 1e-6 <= t <= hi + 1e-6 for t in temps)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_return_entropy_brings_the_workers_traces_through_the_gateway(cluster, endpoint, stream):
    before = sum(cluster.admitted())
    temps = _trace(cluster.router, endpoint, _body(endpoint, cluster.model, "Name a colour."), stream)["temperature"]
    assert _within(temps, T_MIN, T_MAX), temps  # no custom_params: the workers' every_request controller
    assert sum(cluster.admitted()) - before >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_per_request_custom_params_reach_the_worker_through_the_gateway(cluster, endpoint, stream):
    body = _body(endpoint, cluster.model, "Name a river.", CONTROLLER)
    temps = _trace(cluster.router, endpoint, body, stream)["temperature"]
    assert _within(temps, R_MIN, R_MAX), temps  # the request's controller, not T = 0.8 nor the workers'


def _answer(srv, endpoint: str, body: dict, stream: bool) -> tuple[int, dict]:
    """HTTP status and error object; a streamed /generate reports a bad request as an error event (HTTP 200)."""
    with requests.post(srv.url + endpoint, json={**body, "stream": stream}, stream=stream, timeout=300) as r:
        text = r.text
    if text.startswith("data: "):
        text = text.splitlines()[0][len("data: ") :]
    return r.status_code, json.loads(text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bad_custom_params_come_back_as_the_workers_400(cluster, endpoint, stream):
    """The gateway answers what the worker answers: its 400 (an error event on streamed /generate)."""
    bad = _body(endpoint, cluster.model, "Hi", {"entropic": {"t_min": -1}})
    direct, through = _answer(cluster.workers[0], endpoint, bad, stream), _answer(cluster.router, endpoint, bad, stream)
    assert direct[0] == (200 if stream and endpoint == "/generate" else 400), direct
    for status, error in (direct, through):
        assert status == direct[0] and "custom_params.entropic.t_min" in json.dumps(error), (direct, through)


def test_top_level_custom_params_on_generate_are_ignored_by_the_worker_itself(cluster):
    """SGLang's /generate reads custom_params from sampling_params only: a top-level object is ignored
    (a bad one is no 400), straight to a worker and through the gateway alike."""
    body = _body("/generate", cluster.model, "Name a river.")
    for srv in (cluster.workers[0], cluster.router):
        temps = _trace(srv, "/generate", {**body, "custom_params": CONTROLLER}, stream=False)["temperature"]
        assert _within(temps, T_MIN, T_MAX), temps  # the workers' controller, not the request's
        assert srv.post("/generate", {**body, "custom_params": {"entropic": {"t_min": -1}}}).status_code == 200


def test_every_request_leaves_greedy_alone_through_the_gateway(cluster):
    """`sampling.every_request` (for routers that drop custom_params) controls sampled requests only."""
    body = _body("/generate", cluster.model, "Name a river.", temperature=0)
    assert _trace(cluster.router, "/generate", body, stream=False)["temperature"] == [0.0] * TOKENS


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


# ---------------------------------------------------------------- load through the gateway
# 200 requests at once over both workers, mixed lengths, half /generate (traces, the workers'
# every_request controller) and half /v1/completions (custom_params controller + sglext), a quarter
# cut off mid-stream by the client.

LOAD_REQUESTS = 200


def _router_spec(i: int, model: str) -> dict:
    abort = i % 4 == 3
    prompt = (LONG_PROMPT + "\n" if i % 10 == 0 else "") + f"Question {i}: describe item number {i} in one line."
    tokens = 64 if abort else 4 + (7 * i) % 9  # an aborted one is still generating when the client goes
    if i % 2 == 0:  # /generate, in the shape tests/test_reliability.py checks
        greedy = i % 5 == 0
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0 if greedy else 0.8}
        return {
            "i": i,
            "abort": abort,
            "stream": abort or i % 4 == 0,
            "entropic": "off",
            "greedy": greedy,
            "json": False,
            "endpoint": "/generate",
            "body": {"text": CHAT.format(prompt), "sampling_params": params, "return_entropy": True},
        }
    return {
        "i": i,
        "abort": abort,
        "stream": abort or i % 4 == 1,
        "endpoint": "/v1/completions",
        "tokens": tokens,
        "body": {
            "model": model,
            "prompt": CHAT.format(prompt),
            "max_tokens": tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "return_entropy": True,
            "custom_params": CONTROLLER,
        },
    }


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
    if not _within(temps, R_MIN, R_MAX):
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
            async for event in sse_events(resp):
                if event is None:
                    done = True
                    break
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
        return await asyncio.gather(
            *(
                send(session, url, s) if s["endpoint"] == "/generate" else _send_completion(session, url, s)
                for s in specs
            )
        )


def _wait_until_nothing_is_held(cluster, timeout_s: float = 180.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = cluster.states()
        if all(nothing_held(s) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


@pytest.mark.slow
def test_load_through_the_router_loses_nothing_and_every_worker_frees_everything(cluster):
    pytest.importorskip("aiohttp")
    specs = [_router_spec(i, cluster.model) for i in range(LOAD_REQUESTS)]
    before = cluster.admitted()
    start = time.monotonic()
    results = asyncio.run(_burst(cluster.router.url, specs))
    wall = time.monotonic() - start
    held = _wait_until_nothing_is_held(cluster)
    per_worker = [a - b for a, b in zip(cluster.admitted(), before)]
    counts = {k: sum(1 for o, _ in results if o == k) for k in ("completed", "aborted", "lost")}
    lost = [(s["i"], s["endpoint"], d) for s, (o, d) in zip(specs, results) if o == "lost"]
    report = {
        "sent": len(specs),
        **counts,
        "wall_s": round(wall, 1),
        "admitted_per_worker": per_worker,
        "held_after": [{k: s[k] for k in ("kv_tokens_in_use", "request_slots_in_use")} for s in held],
    }
    print("\ngateway load:", json.dumps(report))
    if os.environ.get("SGLANG_ENTROPIC_ROUTER_REPORT"):
        with open(os.environ["SGLANG_ENTROPIC_ROUTER_REPORT"], "w") as f:
            json.dump({**report, "lost_details": lost}, f, indent=1)

    assert counts["lost"] == 0, lost[:10]
    assert counts["aborted"] == sum(s["abort"] for s in specs) and counts["completed"] + counts["aborted"] == len(specs)
    assert all(nothing_held(s) for s in held), report
    assert all(n > 0 for n in per_worker), report  # both workers served
    assert sum(per_worker) >= len(specs), report
