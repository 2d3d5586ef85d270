"""The macro loop on the real server (mode full, --schedule-policy entropic): an admission order that only the entropic policy
produces, and a mixed burst that all completes with valid output."""

import concurrent.futures as cf
import json
import threading
import time
import uuid

import pytest
import requests

pytestmark = pytest.mark.server


def _first_token_time(url: str, text: str, max_new: int, t0: float) -> float:
    payload = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    with requests.post(url + "/generate", json=payload, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                if chunk["meta_info"].get("completion_tokens", 0) >= 1:
                    return time.perf_counter() - t0
    raise AssertionError("no token streamed")


def _admission_scenario(url: str) -> tuple[float, list[float]]:
    """A long prompt queues up first, four short ones right after, while a blocker's chunked prefill
    keeps the scheduler busy; returns the first-token times of the long and the short requests."""
    nonce = uuid.uuid4().hex  # leading each prompt: no radix-cache hit from an earlier run
    filler = " ".join(f"Record {i}: nothing to report." for i in range(260))
    blocker, long_prompt = f"Blocker {nonce}. {filler}", f"Long {nonce}. {filler} Summarize."
    shorts = [f"Short question {i} ({nonce}): name a color." for i in range(4)]
    t0 = time.perf_counter()
    times: dict = {}

    def run(key, text, delay):
        time.sleep(delay)
        times[key] = _first_token_time(url, text, 2, t0)

    jobs = [("blocker", blocker, 0.0), ("long", long_prompt, 0.6)] + [(f"s{i}", s, 0.9) for i, s in enumerate(shorts)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times["long"], [times[f"s{i}"] for i in range(4)]


@pytest.mark.slow  # a timed load scenario on two servers (about a minute on 2 cores)
def test_waiting_short_prompts_overtake_a_long_one_only_under_the_entropic_policy(server, stock_server):
    long_t, short_t = _admission_scenario(server.url)
    # cheap prefills admitted first (pi, with aging): served well before the long prompt's ~12 chunks
    assert max(short_t) + 2.0 < long_t, (long_t, short_t)
    # The same arrivals on stock SGLang (fcfs): the long prompt, queued first, is served first (the
    # short ones at best join its last prefill chunk, so they come out with it, never well before).
    long_t, short_t = _admission_scenario(stock_server.url)
    assert min(short_t) > long_t - 1.0, (long_t, short_t)


def test_mixed_burst_completes(server):
    filler = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    jobs = []
    for i in range(12):
        prompt = (filler if i % 3 == 0 else "") + f"\nQuestion {i}: name a planet."
        params = {"max_new_tokens": 12, "ignore_eos": True}
        if i % 2:
            params["custom_params"] = {"entropic": {"target_entropy": 0.5 + i / 4}}
        elif i % 4 == 0:
            params["temperature"] = 0
        jobs.append({"text": prompt, "sampling_params": params, "return_entropy": True})
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(server.generate, jobs))
    for out in outs:
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 12 and len(meta["entropy"]) == 12
        assert meta["finish_reason"]["type"] == "length"
    assert server.get("/health").status_code == 200


def test_server_info_reports_the_order_that_runs(server):
    server.generate({"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    info = server.get("/server_info").json()
    scheduling = info["entropic"]["scheduling"]
    # the shared server asks for the entropic order (--schedule-policy entropic), over SGLang's fcfs
    assert info["entropic"]["config"]["scheduling"]["order"] == "entropic"
    assert scheduling["sglang_policy_under_it"] == "fcfs"
    assert info["schedule_policy"] == scheduling["waiting_order"] == scheduling["retraction_order"] == "entropic"
    assert info["internal_states"][0]["entropic"]["work_served"] > 0  # the clock runs
