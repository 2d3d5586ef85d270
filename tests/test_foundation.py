"""The foundation on the real runtime: plugin in the scheduler, /generate, fp32 parity, launcher flags."""

import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.server

PROMPT = "The three primary colors are"


def test_plugin_reports_itself_from_the_scheduler(server):
    info = server.get("/server_info").json()
    entropic = info["entropic"]
    assert entropic["plugin_loaded_in_scheduler"] is True
    assert entropic["hooks_applied"] is True, entropic["hooks_missing"]
    assert entropic["mode"] == "full"
    assert entropic["active_loops"] == ["signal", "sampling", "scheduling", "pruning"]
    assert entropic["config"]["sampling"]["target_entropy"] == 2.0
    # the pruning backend's start-up pass: its self-check on synthetic KV, and the page store's bytes
    # (budgeted out of the KV pool: 2 key vectors per page against 2 KV vectors per token, 1 / page size)
    pruning, pool_tokens = entropic["pruning"], info["max_total_num_tokens"]
    assert pruning["self_check"]["ok"], pruning["self_check"]
    kv_bytes = pool_tokens * 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads, dim 64, fp32
    assert pruning["page_store_bytes"] == pytest.approx(kv_bytes / 16, rel=0.01)


def test_greedy_generation_is_the_models_own(server, hf_model):
    """Eight greedy tokens through the plugin's server (full mode: its attention backend, its sampler hook) equal
    plain transformers' greedy decoding of the same fp32 weights, and the text is their detokenization."""
    model, tokenizer = hf_model
    out = server.generate(
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    )
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out["output_ids"] == reference
    assert out["text"] == tokenizer.decode(reference)


def test_top5_logprobs_match_transformers(server, hf_model):
    model, tokenizer = hf_model
    out = server.generate(
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 5,
        }
    )
    served = {tok: lp for lp, tok, _ in out["meta_info"]["output_top_logprobs"][0]}

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    top = torch.topk(logprobs, 5)
    reference = dict(zip(top.indices.tolist(), top.values.tolist()))

    assert served.keys() == reference.keys()
    for tok, lp in reference.items():
        assert abs(served[tok] - lp) < 1e-3, (tok, served[tok], lp)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--entropic", "fastest"], "--entropic"),
        (["--entropic-config", '{"sampling": {"eta": -1}}'], "sampling.eta"),
        (["--entropic-config", '{"sampling": {"t_min": 3, "t_max": 1}}'], "t_min"),
        (["--entropic-config", '{"bogus": 1}'], "bogus"),
        (["--entropic-config", '{"sampling": {"eta": NaN}}'], "NaN"),
        (["--entropic-config", "/no/such/file.json"], "not inline JSON and not a file"),
        (["--entropic", "off", "--entropic-config", '{"mode": "full"}'], "contradicts"),
        (
            ["--entropic", "pruning", "--entropic-config", '{"sampling": {"every_request": true}}'],
            "every_request needs",
        ),
        (["--entropic", "sampling", "--schedule-policy", "entropic"], "--schedule-policy entropic"),
        (["--entropic", "full", "--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
        (["--entropic", "pruning", "--disaggregation-mode", "decode"], "--disaggregation-mode decode"),
    ],
)
def test_launcher_rejects_bad_flags(args, needle):
    """Real subprocesses (tests/test_reliability.py runs the whole matrix in-process): exit code 2, the
    flag named, and nothing of SGLang's started (no banner), long before a model could load."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_entropic.launch_server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "sgl-entropic: mode=" not in proc.stdout
    assert time.monotonic() - start < 60
