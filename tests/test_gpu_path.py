"""What a GPU user gets, checked without a GPU: CUDA graphs are never switched off for the whole
server, pruned decode steps leave the captured graphs to SGLang's own decision, KV paths that bypass
the page store are refused, and the page store is paid for out of the KV pool's budget."""

from __future__ import annotations

import argparse

import pytest

from sgl_entropic.config import KV_PATHS_PRUNING_CANNOT_SEE, EntropicConfig
from sgl_entropic.engine import _engine_kwargs
from sgl_entropic.launch_server import refuse_unsafe_kv_paths, select_attention_backend
from sgl_entropic.plugin import page_store, runtime


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # noqa: D401 - argparse's hook; raise instead of exiting
        raise ValueError(message)


@pytest.mark.parametrize("mode", ["pruning", "full"])
def test_the_launcher_and_the_engine_keep_cuda_graphs(mode):
    config = EntropicConfig(mode=mode)
    argv = select_attention_backend(["--model-path", "m"], config, _Parser())
    assert "--disable-cuda-graph" not in argv
    assert argv[-4:] == ["--attention-backend", "entropic", "--page-size", "16"]
    kwargs = _engine_kwargs(config, {"model_path": "m", "device": "cuda"})
    assert "disable_cuda_graph" not in kwargs and kwargs["attention_backend"] == "entropic"


@pytest.mark.parametrize("field", sorted(KV_PATHS_PRUNING_CANNOT_SEE))
def test_kv_paths_the_page_store_does_not_see_are_refused_only_with_pruning(field):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        refuse_unsafe_kv_paths([flag], EntropicConfig(mode="pruning"), _Parser())
    refuse_unsafe_kv_paths([flag], EntropicConfig(mode="sampling"), _Parser())  # no pruning: nothing to go stale
    with pytest.raises(ValueError, match=field):
        _engine_kwargs(EntropicConfig(mode="full"), {"model_path": "m", "device": "cuda", field: True})
    _engine_kwargs(EntropicConfig(mode="scheduling"), {"model_path": "m", "device": "cuda", field: True})


def test_pd_disaggregation_is_refused_with_pruning():
    with pytest.raises(ValueError, match="--disaggregation-mode decode"):
        refuse_unsafe_kv_paths(["--disaggregation-mode", "decode"], EntropicConfig(mode="full"), _Parser())
    refuse_unsafe_kv_paths(["--disaggregation-mode", "null"], EntropicConfig(mode="full"), _Parser())
    with pytest.raises(ValueError, match="disaggregation_mode='prefill'"):
        _engine_kwargs(EntropicConfig(mode="pruning"), {"model_path": "m", "disaggregation_mode": "prefill"})


def test_the_page_store_comes_out_of_the_kv_pools_budget():
    """A budget B sizes a pool of B / (1 + 1/page_size) bytes: pool plus store fit in B."""
    runtime.install(EntropicConfig(mode="pruning"))
    seen = []
    page_store.around_config_from_budget(lambda conf, budget, **kw: seen.append((budget, kw)), None, 17_000,
                                         cap_tokens=5)
    assert seen == [(16_000, {"cap_tokens": 5})]
    assert 16_000 * (1 + page_store.store_share(16)) == 17_000


# ---------------------------------------------------------------------------- the CUDA path, on a stub FlashInfer

class _StubDecodeWrapper:
    """FlashInfer's decode wrapper as the backend drives it: plan() records what it was given (host
    tensors expected: FlashInfer plans from host copies), forward() is exact attention over each list's
    page ids (page size 1: one slot per id), in torch."""

    def __init__(self, *args, **kwargs):
        self.plans = []

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        self.plans.append((indptr, last_page_len, num_qo_heads, num_kv_heads, page_size))
        self.indptr, self.indices = indptr, indices

    def forward(self, q, kv_cache, sm_scale, **kwargs):
        import torch

        from sgl_entropic.pruning import sparse_decode_attention

        k, v = kv_cache
        out = [sparse_decode_attention(q[r], k[self.indices[a:b].long()], v[self.indices[a:b].long()], scale=sm_scale)
               for r, (a, b) in enumerate(zip(self.indptr[:-1].tolist(), self.indptr[1:].tolist()))]
        return torch.stack(out)


@pytest.fixture
def flashinfer_sparse(monkeypatch):
    """The CUDA path's FlashInferSparse with a stub FlashInfer and the Triton kernels' torch references
    (this machine has neither FlashInfer nor a GPU; tests/test_page_scores_kernel.py checks the kernels)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_StubDecodeWrapper))
    import sgl_entropic.plugin.attention_flashinfer as fi
    from sgl_entropic.kernels import page_scores

    monkeypatch.setattr(fi, "page_bounds_triton", page_scores.page_bounds_reference)
    monkeypatch.setattr(fi, "page_lse_triton", page_scores.page_lse_reference)
    return fi


@pytest.mark.parametrize("per_head", [False, True])
def test_the_cuda_path_passes_the_self_check_and_plans_once_without_reading_the_device(flashinfer_sparse, per_head):
    """One pruned step on the CUDA path's logic: FlashInfer planned once from host counts, every layer's
    two selection stages and slot writes on the device, nothing read back; its attention is exact
    attention over the pages it reports kept (the start-up self-check, which a GPU runs too)."""
    import math

    import torch

    from sgl_entropic.config import PruningConfig
    from sgl_entropic.plugin.page_store import PageStore
    from sgl_entropic.plugin.self_check import run_self_check
    from sgl_entropic.pruning import StepPlan, row_pages
    from tests.stepping import HostReads

    cfg = PruningConfig(min_context=0, per_head=per_head)
    sparse = flashinfer_sparse.FlashInferSparse(None, (9, 3, 64), (torch.float32, torch.float32), 16, per_head)
    assert run_self_check(sparse.attend, 9, 3, 64, torch.float32, cfg).ok

    gen = torch.Generator().manual_seed(1)
    k = torch.randn(400 * 16, 3, 64, generator=gen)
    store = PageStore(4, 400 * 16, 16, 3, 64, torch.float32, "cpu", 1, with_surprisal=False)
    for layer in range(4):
        store.write_keys(layer, torch.arange(400 * 16), k)
    rows = [row_pages(n, math.nan, cfg) for n in (3000, 1700)]
    table = torch.stack([torch.randperm(400, generator=gen)[:188] for _ in rows])
    q = torch.randn(2, 9, 64, generator=gen)
    with HostReads() as mode:
        plan = StepPlan.build(rows, table, per_head=per_head)
        sparse.begin(plan)
        for layer in range(4):
            sparse.select(q, k, store.kmin[layer], store.kmax[layer], 0.125)
    assert mode.reads == [], mode.reads
    indptr, last_page_len, qo_heads, kv_heads, page_size = sparse.wrapper.plans[-1]
    assert indptr.device.type == last_page_len.device.type == "cpu" and page_size == 1
    lists = 3 if per_head else 1
    assert indptr.tolist()[-1] == sum(r.kept_tokens for r in rows) * lists and (qo_heads, kv_heads) == (9 // lists, 3 // lists)
