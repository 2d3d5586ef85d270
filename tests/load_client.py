"""The load client of the reliability and router tests: the shared chat prompt, a mix of requests that covers
every combination (streamed or not, aborted by the client mid-stream or not, entropic controller, Mirostat,
greedy, JSON mode), the checks each completion must pass, and the server's held state afterwards."""

from __future__ import annotations

import asyncio
import json
import math
import time

import requests
import torch

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def F32(x: float) -> float:
    """x rounded to float32: the controller computes temperatures in float32."""
    return torch.tensor(x, dtype=torch.float32).item()


T_MIN, T_MAX = 0.2, 1.8
LONG_PROMPT = " ".join(
    f"Note {i}: the river bends past the old mill, under the stone bridge." for i in range(16)
)  # ~260 tokens
JSON_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def load_spec(i: int, speculative: bool = False) -> dict:
    """The i-th request of a round: every combination of the mix recurs (coprime periods). Under speculative
    decoding Mirostat is refused (HTTP 400): its requests ask for the entropic controller instead."""
    abort = i % 4 == 3
    entropic = ("off", "controller", "controller" if speculative else "mirostat")[i % 3]
    greedy = entropic == "off" and i % 5 == 0
    json_mode = not abort and i % 8 == 2
    params = {"max_new_tokens": 4 + (7 * i) % 9, "ignore_eos": not json_mode}
    if abort:  # long enough that the client's close (after 1 or 2 events) always lands mid-generation
        params.update(max_new_tokens=64, ignore_eos=True)
    if json_mode:  # the server fixture allows no JSON whitespace, so any sampler must close the object
        params.update(json_schema=json.dumps(JSON_SCHEMA), max_new_tokens=64)
    if greedy:
        params["temperature"] = 0
    elif entropic == "controller":
        params["custom_params"] = {
            "entropic": {"target_entropy": 1.0 + (i % 7) / 3, "t_min": T_MIN, "t_max": T_MAX, "t_init": 1.0}
        }
    elif entropic == "mirostat":
        params["custom_params"] = {"entropic": {"controller": "mirostat_v2", "tau": 2.0 + i % 3}}
    else:
        params["temperature"] = 0.8
    question = f"Question {i}: describe item number {i} in one line."
    text = CHAT.format((LONG_PROMPT + "\n" if i % 10 == 0 else "") + question)
    return {
        "i": i,
        "abort": abort,
        "stream": abort or i % 2 == 0,
        "entropic": entropic,
        "greedy": greedy,
        "json": json_mode,
        "body": {"text": text, "sampling_params": params, "return_entropy": i % 2 == 1 or entropic != "off"},
    }


def check_output(spec: dict, out: dict) -> str | None:
    """None if `out` is a valid completion of `spec`, else what is wrong."""
    meta, params = out["meta_info"], spec["body"]["sampling_params"]
    n, reason = meta["completion_tokens"], (meta.get("finish_reason") or {}).get("type")
    if spec["json"]:
        if reason != "stop":
            return f"json request finished by {reason}"
        try:
            value = json.loads(out["text"])
        except ValueError:
            return f"json request gave {out['text']!r}"
        if not (isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)):
            return f"json request gave {value!r}"
    elif reason != "length" or n != params["max_new_tokens"]:
        return f"finish {reason} after {n} tokens, expected length after {params['max_new_tokens']}"
    if len(out["output_ids"]) != n or not isinstance(out["text"], str):
        return f"{len(out['output_ids'])} output ids for {n} tokens"
    if not (
        isinstance(meta.get("entropic_time"), float)
        and math.isfinite(meta["entropic_time"])
        and meta["entropic_time"] >= 0
    ):
        return f"entropic_time {meta.get('entropic_time')!r}"
    if spec["body"]["return_entropy"]:
        temps, hs = meta.get("temperature"), meta.get("entropy")
        if not (isinstance(temps, list) and isinstance(hs, list) and len(temps) == len(hs) == n):
            return f"traces of length {len(temps or [])}/{len(hs or [])} for {n} tokens"
        if any(h is None or h < 0 for h in hs):
            return f"entropy trace {hs}"
        if spec["greedy"] and set(temps) != {0.0}:
            return f"greedy temperatures {temps}"
        if spec["entropic"] == "controller" and not all(F32(T_MIN) <= t <= F32(T_MAX) for t in temps):
            return f"controller temperatures {temps}"
        if spec["entropic"] == "mirostat" and set(temps) != {1.0}:
            return f"mirostat temperatures {temps}"
    return None


async def sse_events(resp):
    """The JSON payloads of a streamed response, then None for `data: [DONE]`. SSE comment lines (a router's
    keep-alive `: ping`) are skipped; any other line that is not `data: ...` is a ValueError: a lost request."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data: "):
            raise ValueError(f"not an SSE data line: {line[:200]}")
        yield None if line == "data: [DONE]" else json.loads(line[len("data: ") :])


async def send(session, url: str, spec: dict) -> tuple[str, str]:
    """('completed' | 'aborted' | 'lost', detail)."""
    import aiohttp

    body = {**spec["body"], "stream": spec["stream"]}
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                return "lost", f"HTTP {resp.status}: {(await resp.text())[:300]}"
            if not spec["stream"]:
                out = await resp.json()
                problem = check_output(spec, out)
                return ("lost", problem) if problem else ("completed", "")
            events, last, done = 0, None, False
            async for event in sse_events(resp):
                if event is None:
                    done = True
                    break
                last = event
                if "error" in last:
                    return "lost", f"error event {last['error']}"
                events += 1
                if spec["abort"] and events == 1 + (spec["i"] // 4) % 2 and not last["meta_info"]["finish_reason"]:
                    resp.close()  # the client goes away mid-stream: drops the connection
                    return "aborted", ""
            if not done or last is None:
                return "lost", f"stream ended without [DONE] after {events} events"
            problem = check_output(spec, last)
            return ("lost", problem) if problem else ("completed", "")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        return "lost", f"{type(err).__name__}: {err}"


async def run_round(url: str, specs: list[dict]) -> list[tuple[str, str]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request, all at once
    # ~30 s a round on an idle machine; the limit only catches a hang (a busy shared box can be 5x slower)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(send(session, url, s) for s in specs))


def entropic_states(server) -> list[dict]:
    return [s["entropic"] for s in server.get("/server_info", timeout=120).json()["internal_states"]]


def wait_until_nothing_is_held(server, timeout_s: float = 120.0) -> list[dict]:
    """Aborts are processed asynchronously: poll until no KV and no request slot is held, on every rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = entropic_states(server)
        if all(nothing_held(s) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def nothing_held(state: dict) -> bool:
    return state["kv_tokens_in_use"] == state["request_slots_in_use"] == 0


def serves(server, timeout_s: float = 120.0) -> bool:
    """The server process is alive and /health answers 200 (it may answer 503 while still busy)."""
    deadline = time.monotonic() + timeout_s
    while server.proc is None or server.proc.poll() is None:
        try:
            if server.get("/health", timeout=60).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return False


def states_after_flush(server) -> dict:
    """Plugin states once two trivial requests have gone through one after the other.

    SGLang's overlap scheduler pins its last two batches (Scheduler.batch_record_buf) until newer
    ones replace them, so the states of the last requests stay reachable at idle. After two
    sequential one-token requests, only those two can be pinned: more live states is a leak, and
    none may be outside what the scheduler references (`leaked_request_states`).
    """
    for _ in range(2):
        server.generate({"text": "flush", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    states = entropic_states(server)
    return {k: sum(s[k] for s in states) for k in ("live_request_states", "leaked_request_states")}
