"""The entropy signal on the real runtime: exact against transformers, aligned, visible to clients."""

import json
import math
import re

import pytest
import requests
import torch

from sgl_entropic.signal import entropy_exact
from tests.conftest import ROOT

pytestmark = pytest.mark.server

PROMPT = "<|im_start|>user\nWhat is the tallest mountain on Earth?<|im_end|>\n<|im_start|>assistant\n"


def _reference_steps(hf_model, prompt_ids, output_ids):
    """Per output token: entropy of transformers' next-token distribution and the token's surprisal."""
    model, _ = hf_model
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    steps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]
    surprisal = -torch.log_softmax(steps, -1)[torch.arange(len(output_ids)), torch.tensor(output_ids)]
    return entropy_exact(steps).tolist(), surprisal.tolist()


def _greedy(server, text, n):
    return server.generate(
        {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "return_entropy": True}
    )


def test_greedy_entropy_and_surprisal_match_transformers(server, hf_model):
    _, tokenizer = hf_model
    out = _greedy(server, PROMPT, 16)
    meta = out["meta_info"]
    prompt_ids = tokenizer(PROMPT).input_ids
    entropy, surprisal = _reference_steps(hf_model, prompt_ids, out["output_ids"])
    assert len(meta["entropy"]) == len(meta["surprisal"]) == meta["completion_tokens"] == 16
    for served, ref in zip(meta["entropy"], entropy):
        assert abs(served - ref) < 1e-3
    for served, ref in zip(meta["surprisal"], surprisal):
        assert abs(served - ref) < 1e-3
    assert meta["temperature"] == [0.0] * 16  # greedy: measured at T = 1, sampled by argmax


def test_prompt_surprisal_on_request_matches_transformers(server, hf_model):
    model, tokenizer = hf_model
    out = server.generate(
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_entropy": True,
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )
    served = out["meta_info"]["prompt_surprisal"]
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    reference = (-logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)).tolist()
    assert len(served) == len(ids) and served[0] is None
    for s, r in zip(served[1:], reference):
        assert abs(s - r) < 1e-3


def test_entropic_time_is_the_sum_of_entropy_drops(server):
    meta = _greedy(server, PROMPT, 12)["meta_info"]
    h = meta["entropy"]
    tau = sum(max(0.0, a - b) for a, b in zip(h, h[1:]))
    assert meta["entropic_time"] == pytest.approx(tau, rel=1e-9, abs=1e-9)
    assert meta["entropic_efficiency"] > 0 or tau == 0


def test_without_the_flag_only_the_scalars_appear(server):
    meta = server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})["meta_info"]
    assert isinstance(meta["entropic_time"], float) and isinstance(meta["entropic_efficiency"], float)
    for key in ("entropy", "surprisal", "temperature"):
        assert key not in meta
    assert not [k for k in meta if k.startswith("_entropic")]  # the totals' carriers are not the client's


def test_chunked_prefill_keeps_one_value_per_output_token(server, hf_model):
    # The shared server prefills in chunks of 256 tokens: this prompt takes several chunks,
    # and the samples of the middle chunks must not be recorded.
    _, tokenizer = hf_model
    filler = " ".join(f"Item {i} is a small blue stone." for i in range(90))
    text = f"<|im_start|>user\n{filler}\nHow many items are there?<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tokenizer(text).input_ids
    assert len(prompt_ids) > 3 * 256
    out = _greedy(server, text, 4)
    entropy, _ = _reference_steps(hf_model, prompt_ids, out["output_ids"])
    assert len(out["meta_info"]["entropy"]) == 4
    for served, ref in zip(out["meta_info"]["entropy"], entropy):
        assert abs(served - ref) < 1e-3


@pytest.mark.parametrize("traced", [True, False])
def test_streaming_carries_the_cumulative_traces(server, traced):
    """Each chunk carries the totals as they stand (a stream's last: the request's), whether or not it asked for
    the per-token traces, and nothing of how they travel."""
    payload = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
        "return_entropy": traced,
        "stream": True,
    }
    chunks = []
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks.append(json.loads(line[5:])["meta_info"])
    meta = chunks[-1]
    assert meta["completion_tokens"] == 10
    assert len(meta["entropy"]) == 10 if traced else "entropy" not in meta
    taus = [c["entropic_time"] for c in chunks]
    assert taus == sorted(taus)  # tau never decreases
    assert meta["entropic_time"] == pytest.approx(_greedy(server, PROMPT, 10)["meta_info"]["entropic_time"], abs=1e-6)
    assert not [k for c in chunks for k in c if k.startswith("_entropic")]


def test_prometheus_series(server):
    server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    text = server.get("/metrics").text
    for series in (
        "sglang:entropic_step_entropy_nats_bucket",
        "sglang:entropic_time_nats_total",
        "sglang:entropic_cost_gflop_total",
        "sglang:entropic_efficiency",
    ):
        assert series in text, series
    lines = text.splitlines()
    count = [line for line in lines if line.startswith("sglang:entropic_step_entropy_nats_count")]
    assert count and float(count[0].split()[-1]) >= 4
    cost = [line for line in lines if line.startswith("sglang:entropic_cost_gflop_total")]
    assert not math.isnan(float(cost[0].split()[-1]))


def test_every_dashboard_query_names_a_series_the_server_exports(server):
    """monitoring/grafana/sgl-entropic.json: each panel's PromQL reads only series this server's
    /metrics has (after an entropic-sampling request, so that every loop has written)."""
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "sgl-entropic.json").read_text())
    server.generate(
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0.8,
                "custom_params": {"entropic": {"target_entropy": 1.5}},
            },
        }
    )
    exported = {
        line.split("{")[0].split()[0]
        for line in server.get("/metrics").text.splitlines()
        if line.startswith("sglang:entropic_")
    }
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"]]
    assert len(dashboard["panels"]) >= 6 and all(p["targets"] for p in dashboard["panels"])
    named = {name for q in queries for name in re.findall(r"sglang:[a-z_]+", q)}
    assert named and named <= exported, sorted(named - exported)
    for base in ("entropic_step_entropy_nats", "entropic_attended_fraction", "entropic_temperature"):
        assert f"sglang:{base}_bucket" in named  # the distributions are histograms
