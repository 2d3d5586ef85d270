"""The FlashInfer path of the `entropic` backend, on a CUDA GPU with SGLang and FlashInfer only: the
pruned path (real FlashInfer, real Triton kernels) passes the self-check, a server that prunes keeps
CUDA graphs and answers like stock SGLang (with its graphs) where nothing is pruned, and keeps passkey
retrieval. Skipped without CUDA (tests/test_gpu_path.py checks the same logic on a stub FlashInfer)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from programs.passkey import answered_key, make_cases
from tests.conftest import start_server, stop_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.server,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_ARGS = ["--dtype", "bfloat16", "--max-total-tokens", "65536", "--sleep-on-idle"]


@pytest.fixture(scope="module")
def gpu_servers(tmp_path_factory, model_path):
    """Stock FlashInfer with its CUDA graphs, ours (default config), ours keeping everything."""
    base = ["--model-path", str(model_path), "--chat-template", "chatml", "--device", "cuda", *GPU_ARGS]
    keep_all = json.dumps(
        {"pruning": {"min_keep_ratio": 1.0, "max_keep_ratio": 1.0, "shortlist_ratio": 1.0, "min_context": 0}}
    )
    commands = {
        "stock": [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--attention-backend",
            "flashinfer",
            "--mem-fraction-static",
            "0.2",
            *base,
        ],
        "ours": [
            sys.executable,
            "-m",
            "sgl_entropic.launch_server",
            "--entropic",
            "pruning",
            "--mem-fraction-static",
            "0.2",
            *base,
        ],
        "keep_all": [
            sys.executable,
            "-m",
            "sgl_entropic.launch_server",
            "--entropic",
            "pruning",
            "--entropic-config",
            keep_all,
            "--mem-fraction-static",
            "0.2",
            *base,
        ],
    }
    servers = {}
    try:
        for name, cmd in commands.items():
            servers[name] = start_server(cmd, tmp_path_factory.mktemp(name) / "server.log")
        yield servers
    finally:
        for srv in servers.values():
            stop_server(srv.proc)


def test_keep_all_equals_stock_flashinfer(gpu_servers):
    prompt = make_cases([1500], [0.4], seed=5)[0].prompt
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    ours = gpu_servers["keep_all"].generate({"text": prompt, "sampling_params": params, "return_entropy": True})
    stock = gpu_servers["stock"].generate({"text": prompt, "sampling_params": params})
    assert ours["output_ids"] == stock["output_ids"]
    assert ours["meta_info"]["attended"] == [1.0] * 16


def test_passkey_survives_flashinfer_pruning(gpu_servers):
    cases = make_cases([2000, 4000, 6000], [0.2, 0.6], seed=9)
    params = {"temperature": 0.0, "max_new_tokens": 8}
    dense_ok = pruned_ok = 0
    for case in cases:
        dense = gpu_servers["stock"].generate({"text": case.prompt, "sampling_params": params})
        pruned = gpu_servers["ours"].generate({"text": case.prompt, "sampling_params": params, "return_entropy": True})
        d, p = answered_key(dense["text"]) == case.key, answered_key(pruned["text"]) == case.key
        dense_ok += d
        pruned_ok += p
        assert p or not d, (case, pruned["text"])
        assert min(pruned["meta_info"]["attended"][1:]) < 0.6
    assert dense_ok >= 4


def test_the_servers_keep_cuda_graphs_and_pass_their_self_check(gpu_servers):
    for name in ("ours", "keep_all"):
        info = gpu_servers[name].get("/server_info").json()
        assert info["disable_cuda_graph"] is False, name
        assert info["entropic"]["pruning"]["self_check"]["ok"], info["entropic"]["pruning"]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pruned_path_equals_exact_attention_over_its_pages(per_head, dtype):
    """Real FlashInfer and the real Triton kernels, the start-up self-check's comparison."""
    from sgl_entropic.config import PruningConfig
    from sgl_entropic.plugin.attention.flashinfer import FlashInferSparse
    from sgl_entropic.plugin.attention.self_check import run_self_check

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for heads in ((32, 8, 128), (9, 3, 64)):
        sparse = FlashInferSparse(workspace, heads, (dtype, dtype), 16, per_head)
        check = run_self_check(
            sparse.attend, *heads, dtype, PruningConfig(per_head=per_head), device="cuda", lengths=(5000, 3001, 777)
        )
        assert check.ok, check
