"""The FlashInfer path of the `entropic` backend, on a CUDA GPU only: the sparse wrapper planned
over the kept slots must equal dense attention restricted to them, keep-all must be stock
FlashInfer, and the real server must keep passkey retrieval. Skipped without CUDA."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from programs.passkey import answered_key, make_cases
from tests.conftest import start_server, stop_server

pytestmark = [pytest.mark.gpu, pytest.mark.server,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_ARGS = ["--dtype", "bfloat16", "--max-total-tokens", "65536", "--sleep-on-idle"]


@pytest.fixture(scope="module")
def gpu_servers(tmp_path_factory, model_path):
    """Stock FlashInfer, ours with the default config, ours keeping everything (theta = -inf)."""
    base = ["--model-path", str(model_path), "--chat-template", "chatml", "--device", "cuda", *GPU_ARGS]
    keep_all = json.dumps({"pruning": {"min_keep_ratio": 1.0, "max_keep_ratio": 1.0, "min_context": 0}})
    commands = {
        "stock": [sys.executable, "-m", "sglang.launch_server", "--attention-backend", "flashinfer",
                  "--disable-cuda-graph", "--mem-fraction-static", "0.2", *base],
        "ours": [sys.executable, "-m", "sgl_entropic.launch_server", "--entropic", "pruning",
                 "--mem-fraction-static", "0.2", *base],
        "keep_all": [sys.executable, "-m", "sgl_entropic.launch_server", "--entropic", "pruning",
                     "--entropic-config", keep_all, "--mem-fraction-static", "0.2", *base],
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


def test_sparse_wrapper_equals_dense_attention_over_the_kept_slots():
    """FlashInfer's decode planned over a slot list is exact attention over those slots."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    from sgl_entropic.pruning import sparse_decode_attention

    torch.manual_seed(0)
    heads_q, heads_kv, dim, slots_total = 8, 2, 64, 4096
    k = torch.randn(slots_total, 1, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots_total, 1, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    kept = [torch.randperm(slots_total, device="cuda")[:n].sort().values for n in (700, 33, 1500)]
    indptr = torch.tensor([0] + [int(x.numel()) for x in kept], device="cuda").cumsum(0).int()
    indices = torch.cat(kept).int()
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    wrapper.plan(indptr, indices, torch.ones(3, dtype=torch.int32, device="cuda"), heads_q, heads_kv, dim, 1,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(3, heads_q, dim, device="cuda", dtype=torch.bfloat16)
    out = wrapper.run(q, (k, v))
    for r, slots in enumerate(kept):
        want = sparse_decode_attention(q[r], k[slots.long(), 0], v[slots.long(), 0])
        torch.testing.assert_close(out[r].float(), want.float(), rtol=2e-2, atol=2e-2)


def test_one_plan_serves_every_layer_when_only_the_slot_list_changes():
    """The backend plans once per step and rewrites the plan's index buffer per layer (the counts per
    row stay fixed): a run after the rewrite must attend the new slots."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    from sgl_entropic.pruning import sparse_decode_attention

    torch.manual_seed(1)
    heads_q, heads_kv, dim, slots_total, n = 8, 2, 64, 4096, 300
    k = torch.randn(slots_total, 1, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots_total, 1, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    first, second = (torch.randperm(slots_total, device="cuda")[:n].int() for _ in range(2))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    indices = first.clone()
    wrapper.plan(torch.tensor([0, n], dtype=torch.int32, device="cuda"), indices,
                 torch.ones(1, dtype=torch.int32, device="cuda"), heads_q, heads_kv, dim, 1,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(1, heads_q, dim, device="cuda", dtype=torch.bfloat16)
    wrapper._paged_kv_indices_buf[:n].copy_(second)  # what the backend does between layers
    out = wrapper.run(q, (k, v))
    want = sparse_decode_attention(q[0], k[second.long(), 0], v[second.long(), 0])
    torch.testing.assert_close(out[0].float(), want.float(), rtol=2e-2, atol=2e-2)
