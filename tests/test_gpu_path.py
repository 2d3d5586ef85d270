"""What a GPU user gets, checked without a GPU: CUDA graphs are never switched off for the whole
server, pruned decode steps leave the captured graphs to SGLang's own decision, KV paths that bypass
the page store are refused, and the page store is paid for out of the KV pool's budget."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sgl_entropic.config import KV_PATHS_PRUNING_CANNOT_SEE, EntropicConfig
from sgl_entropic.engine import _engine_kwargs
from sgl_entropic.launch_server import map_pruning_flags
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention import page_store


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # noqa: D401 - argparse's hook; raise instead of exiting
        raise ValueError(message)


# One process: SGLang's own parser turns the launcher's and the Engine's arguments into the ServerArgs a CUDA server
# would run with (its run_server replaced by a capture), for the default `full` (which cannot prune on CUDA: the
# two stages never beat a graph-replayed dense step) and for `full` with a min_context (which prunes from there).
_SERVER_ARGS_ON_CUDA = r"""
import json, sys
import sglang.launch_server
import sglang.srt.utils
from sglang.srt.server_args import ServerArgs
from sgl_entropic import launch_server, plugin
from sgl_entropic.config import EntropicConfig
from sgl_entropic.engine import _engine_kwargs
from sgl_entropic.model import bundled_model_path
from sgl_entropic.server_args import speculative_args, spell_kwarg

seen = []
sglang.launch_server.run_server = lambda args: seen.append(args)
sglang.srt.utils.kill_process_tree = lambda *a, **k: None
model = str(bundled_model_path())
fields = ("disable_cuda_graph", "disable_prefill_cuda_graph", "attention_backend", "page_size", "speculative_algorithm",
          "speculative_num_draft_tokens", "speculative_ngram_max_bfs_breadth", "max_running_requests")
out = {}
if sys.argv[1] == "default":  # stock first (no plugin), then ours: SGLang loads the plugin once per process
    from sglang.srt.server_args import prepare_server_args
    # stock with SGLang's NGRAM: the default speculates (--entropic full), with SGLang's own NGRAM settings
    stock = {"launcher": prepare_server_args(["--model-path", model, "--device", "cuda", "--speculative-algorithm",
                                              "NGRAM"]),
             "engine": ServerArgs(model_path=model, device="cuda", speculative_algorithm="NGRAM")}
    out["stock"] = {who: {k: getattr(a, k) for k in fields} for who, a in stock.items()}
extra = {"default": {}, "prunes": {"pruning": {"min_context": 8192}}}[sys.argv[1]]
launch_server.main(["--model-path", model, "--device", "cuda", "--entropic-config", json.dumps(extra)])
config, kwargs = _engine_kwargs(EntropicConfig.model_validate({"mode": "full", **extra}),
                                {"model_path": model, "device": "cuda"})
config, updates = speculative_args(config, kwargs, "cuda", spell_kwarg)
kwargs = {**kwargs, **updates}
out[sys.argv[1]] = {who: {k: getattr(a, k) for k in fields}
                    for who, a in (("launcher", seen[-1]), ("engine", ServerArgs(**kwargs)))}
out[sys.argv[1]]["hooks"] = sorted({h.target.rsplit(".", 2)[-2] for h in plugin.hook_table(config)})
print(json.dumps(out))
"""


def test_on_cuda_full_changes_nothing_where_pruning_cannot_engage_and_keeps_decode_graphs_where_it_can(model_path):
    received, stderr = {}, {}
    for case in ("default", "prunes"):
        proc = subprocess.run(
            [sys.executable, "-c", _SERVER_ARGS_ON_CUDA, case],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "SGLANG_ENTROPIC_CONFIG"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        received.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        stderr[case] = proc.stderr
    assert "pruning does not engage on CUDA" in stderr["default"]
    for who in ("launcher", "engine"):
        # the default: exactly what stock SGLang runs with NGRAM (its backend, its prefill graphs, its page size,
        # its draft settings) ...
        assert received["default"][who] == received["stock"][who], who
        assert received["default"][who]["speculative_algorithm"] == "NGRAM"
        # ... and where pruning engages: decode graphs stay, prefill graphs go (a replayed extend would skip the
        # page store's fold), and drafts are chains (pages of pruning.page_size tokens)
        prunes = {
            k: received["prunes"][who][k]
            for k in (
                "disable_cuda_graph",
                "disable_prefill_cuda_graph",
                "attention_backend",
                "page_size",
                "speculative_ngram_max_bfs_breadth",
            )
        }
        assert prunes == {
            "disable_cuda_graph": False,
            "disable_prefill_cuda_graph": True,
            "attention_backend": "entropic",
            "page_size": 16,
            "speculative_ngram_max_bfs_breadth": 1,
        }, who
    # the KV pool: only an engaged pruning loop takes the page store's bytes out of it (config_from_budget)
    assert "KVCacheConfigurator" not in received["default"]["hooks"]
    assert "KVCacheConfigurator" in received["prunes"]["hooks"]


# `full` with pruning that engages on CUDA (a min_context), for the refusals below
PRUNES_ON_CUDA = EntropicConfig.model_validate({"mode": "full", "pruning": {"min_context": 4096}})


@pytest.mark.parametrize("field", sorted(KV_PATHS_PRUNING_CANNOT_SEE))
def test_kv_paths_the_page_store_does_not_see_are_refused_only_with_pruning(field):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        map_pruning_flags([flag], EntropicConfig(mode="pruning"), _Parser())
    map_pruning_flags([flag], EntropicConfig(mode="sampling"), _Parser())  # no pruning: nothing to go stale
    with pytest.raises(ValueError, match=field):
        _engine_kwargs(PRUNES_ON_CUDA, {"model_path": "m", "device": "cuda", field: True})
    _engine_kwargs(EntropicConfig(mode="scheduling"), {"model_path": "m", "device": "cuda", field: True})
    _engine_kwargs(EntropicConfig(mode="full"), {"model_path": "m", "device": "cuda", field: True})  # cannot prune


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"dcp_size": 2}, "dcp_size=2"),
        ({"attn_dp_size": 2}, "attn_dp_size=2"),
        ({"enable_dp_attention": True}, "enable_dp_attention=True"),
        ({"pp_size": 2}, "pp_size=2"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype='fp8_e5m2'"),
        ({"cuda_graph_backend_prefill": "full"}, "cuda_graph_backend_prefill='full'"),
    ],
)
def test_what_splits_the_page_plan_or_hides_the_keys_is_refused_with_pruning(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _engine_kwargs(PRUNES_ON_CUDA, {"model_path": "m", "device": "cuda", **kwargs})
    _engine_kwargs(EntropicConfig(mode="sampling"), {"model_path": "m", "device": "cuda", **kwargs})  # no pruning


def test_pruning_on_cuda_needs_a_power_of_two_page_and_no_prefill_graphs():
    config = EntropicConfig.model_validate({"mode": "full", "pruning": {"page_size": 24, "min_context": 4096}})
    with pytest.raises(ValueError, match="power of two"):
        _engine_kwargs(config, {"model_path": "m", "device": "cuda"})
    assert _engine_kwargs(config, {"model_path": "m", "device": "cpu"})[1]["page_size"] == 24  # the CPU kernel: any
    assert _engine_kwargs(PRUNES_ON_CUDA, {"model_path": "m", "device": "cuda"})[1]["disable_prefill_cuda_graph"]
    assert "disable_prefill_cuda_graph" not in _engine_kwargs(EntropicConfig(), {"model_path": "m", "device": "cpu"})[1]


@pytest.mark.parametrize(
    "pruning, engaged", [({}, False), ({"min_context": 4096}, True), ({"shortlist_ratio": None}, True)]
)
def test_full_on_cuda_engages_pruning_only_where_the_crossover_rule_can_prune(pruning, engaged):
    config = EntropicConfig.model_validate({"mode": "full", "pruning": pruning})
    config_cuda, kwargs = _engine_kwargs(config, {"model_path": "m", "device": "cuda"})
    assert config_cuda.pruning_on is engaged and ("attention_backend" in kwargs) is engaged
    assert _engine_kwargs(config, {"model_path": "m", "device": "cpu"})[0].pruning_on  # CPU: timed, may prune
    # an explicit `--entropic pruning` keeps today's behaviour: the user asked for the loop
    assert _engine_kwargs(config.model_copy(update={"mode": "pruning"}), {"model_path": "m", "device": "cuda"})[
        0
    ].pruning_on


def test_engaged_is_the_launcher_s_not_a_setting():
    with pytest.raises(ValueError, match="pruning.engaged is set by the launcher"):
        _engine_kwargs(EntropicConfig.model_validate({"pruning": {"engaged": False}}), {"model_path": "m"})


def test_pd_disaggregation_is_refused_with_pruning():
    with pytest.raises(ValueError, match="--disaggregation-mode decode"):
        map_pruning_flags(["--disaggregation-mode", "decode"], EntropicConfig(mode="full"), _Parser())
    map_pruning_flags(["--disaggregation-mode", "null"], EntropicConfig(mode="full"), _Parser())
    with pytest.raises(ValueError, match="disaggregation_mode='prefill'"):
        _engine_kwargs(EntropicConfig(mode="pruning"), {"model_path": "m", "disaggregation_mode": "prefill"})


def test_the_page_store_comes_out_of_the_kv_pools_budget():
    """The pool SGLang sizes from what the budget leaves, plus a real page store over that pool, fit the budget."""
    layers, heads, dim, page = 30, 3, 64, 16
    kv_bytes_per_token = 2 * layers * heads * dim * 4  # K and V, fp32
    budget = 1000 * page * kv_bytes_per_token
    runtime.install(EntropicConfig(mode="pruning"))
    seen = []
    page_store.around_config_from_budget(
        lambda conf, pool_budget, **kw: seen.append((pool_budget, kw)), None, budget, cap_tokens=5
    )
    ((pool_budget, passed),) = seen
    assert passed == {"cap_tokens": 5}  # SGLang's other arguments go through untouched
    tokens = pool_budget // kv_bytes_per_token
    store = page_store.PageStore(range(layers), tokens, page, heads, dim, torch.float32, "cpu", 4, with_surprisal=False)
    scratch_row = 2 * layers * heads * dim * 4  # the store's one page row beyond the pool's pages (46 KB here)
    assert tokens * kv_bytes_per_token + store.nbytes <= budget + scratch_row
    assert tokens * kv_bytes_per_token + store.nbytes > 0.99 * budget  # and the pool keeps the rest


def test_a_model_with_sliding_window_layers_gives_the_pool_what_their_missing_bounds_leave():
    """Gemma 3 270M's shape: 3 of 18 layers read the whole context; only they hold page bounds."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layers, heads, dim, page = 18, 1, 256, 16
    model = torch.nn.ModuleList(
        RadixAttention(4, dim, 1.0, heads, i, sliding_window_size=-1 if i % 6 == 5 else 511) for i in range(layers)
    )
    kv_bytes_per_token = 2 * layers * heads * dim * 4
    budget = 1000 * page * kv_bytes_per_token
    runtime.install(EntropicConfig(mode="pruning"))
    seen = []
    page_store.around_config_from_budget(
        lambda conf, pool_budget: seen.append(pool_budget), SimpleNamespace(model=model), budget
    )
    tokens = seen[0] // kv_bytes_per_token
    full, total = page_store.full_context_layers(model)
    assert full == [5, 11, 17] and total == 18
    store = page_store.PageStore(full, tokens, page, heads, dim, torch.float32, "cpu", 4, with_surprisal=False)
    assert store.kmin.shape[0] == 3
    assert 0.99 * budget < tokens * kv_bytes_per_token + store.nbytes <= budget + 2 * 3 * heads * dim * 4


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
        out = [
            sparse_decode_attention(q[r], k[self.indices[a:b].long()], v[self.indices[a:b].long()], scale=sm_scale)
            for r, (a, b) in enumerate(zip(self.indptr[:-1].tolist(), self.indptr[1:].tolist()))
        ]
        return torch.stack(out)


@pytest.fixture
def flashinfer_sparse(monkeypatch):
    """The CUDA path's FlashInferSparse with a stub FlashInfer and the Triton kernels' torch references
    (this machine has neither FlashInfer nor a GPU; tests/test_page_scores_kernel.py checks the kernels)."""
    import sys
    import types

    monkeypatch.setitem(
        sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_StubDecodeWrapper)
    )
    import sgl_entropic.plugin.attention.flashinfer as fi
    from sgl_entropic.kernels import page_scores

    monkeypatch.setattr(fi, "TRITON_STAGES", page_scores.REFERENCE_STAGES)
    return fi


@pytest.mark.parametrize("per_head", [False, True])
def test_the_cuda_path_passes_the_self_check_and_plans_once_without_reading_the_device(flashinfer_sparse, per_head):
    """One pruned step on the CUDA path's logic: FlashInfer planned once from host counts, every layer's
    two selection stages and slot writes on the device, nothing read back; its attention is exact
    attention over the pages it reports kept (the start-up self-check, which a GPU runs too)."""
    import math

    import torch

    from sgl_entropic.config import PruningConfig
    from sgl_entropic.plugin.attention.page_store import PageStore
    from sgl_entropic.plugin.attention.self_check import run_self_check
    from sgl_entropic.pruning import StepPlan, row_pages
    from tests.stepping import HostReads

    cfg = PruningConfig(min_context=0, per_head=per_head)
    sparse = flashinfer_sparse.FlashInferSparse(None, (9, 3, 64), (torch.float32, torch.float32), 16, per_head)
    assert run_self_check(sparse.attend, 9, 3, 64, torch.float32, cfg).ok

    gen = torch.Generator().manual_seed(1)
    k = torch.randn(400 * 16, 3, 64, generator=gen)
    store = PageStore(range(4), 400 * 16, 16, 3, 64, torch.float32, "cpu", 1, with_surprisal=False)
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
    assert indptr.tolist()[-1] == sum(r.kept_tokens for r in rows) * lists and (qo_heads, kv_heads) == (
        9 // lists,
        3 // lists,
    )


@pytest.mark.parametrize("per_head", [False, True])
def test_the_cuda_path_keeps_the_pages_the_cpu_kernel_keeps(flashinfer_sparse, per_head):
    """Parity of the page choice on the same KV: the CUDA path's selection (its Triton kernels' torch
    references, the shared second-stage ranking `pruning.shortlist_mass`) against the CPU kernel's
    `attend_rows`, row by row and list by list, on peaky attention where the fixed pages' share of each
    head's mass differs between heads (a ranking by a softmax over the shortlist alone picks other pages)."""
    import math

    import torch

    from sgl_entropic.config import PruningConfig
    from sgl_entropic.plugin.attention.page_store import PageStore
    from sgl_entropic.pruning import StepPlan, attend_rows, row_pages

    cfg = PruningConfig(min_context=0, per_head=per_head, max_keep_ratio=0.2, min_keep_ratio=0.2, shortlist_ratio=0.5)
    gen = torch.Generator().manual_seed(7)
    pages, p, heads_kv, dim = 600, 16, 3, 64
    k = torch.randn(pages * p, heads_kv, dim, generator=gen)
    v = torch.randn(pages * p, heads_kv, dim, generator=gen)
    store = PageStore([0], pages * p, p, heads_kv, dim, torch.float32, "cpu", 1, with_surprisal=False)
    store.write_keys(0, torch.arange(pages * p), k)
    lengths = (3000, 1700, 2400, 900, 2600, 1333)
    rows = [row_pages(n, math.nan, cfg) for n in lengths]
    table = torch.stack([torch.randperm(pages, generator=gen)[:188] for _ in rows])
    q = 3.0 * torch.randn(len(rows), 9, dim, generator=gen)
    plan = StepPlan.build(rows, table, per_head=per_head)
    assert plan.two_stage
    _, cpu_kept = attend_rows(q, k, v, plan, store.kmin[0], store.kmax[0], 0.125)
    sparse = flashinfer_sparse.FlashInferSparse(None, (9, heads_kv, dim), (torch.float32,) * 2, p, per_head)
    sparse.begin(plan)
    gpu_kept = sparse.select(q, k, store.kmin[0], store.kmax[0], 0.125)
    assert cpu_kept.shape == gpu_kept.shape
    for b, r in enumerate(rows):
        for lst in range(cpu_kept.shape[1]):
            assert sorted(cpu_kept[b, lst, : r.keep].tolist()) == sorted(gpu_kept[b, lst, : r.keep].tolist()), (b, lst)


def test_a_pruned_cuda_step_from_planning_to_sampling_reads_nothing_back(flashinfer_sparse, monkeypatch):
    """The CUDA backend's own per-step path, SGLang's FlashInfer parts stubbed (no GPU here): its
    init_forward_metadata (plan, FlashInfer plan), every layer's selection and slot writes as its
    forward_decode makes them, then the sampling step: no device read inside the step, and the step's
    one transfer of traces handed over without waiting."""
    import torch
    from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata, FlashInferAttnBackend

    from sgl_entropic.config import EntropicConfig, SamplingConfig
    from sgl_entropic.plugin.attention.page_planner import PagePlanner
    from sgl_entropic.sampling import ControllerState
    from tests.stepping import HostReads, Stepper
    from tests.backend_stubs import CFG, HEADS_KV, HEADS_Q, LAYERS, setup, stub_layer

    runner, _, batch, q, _ = setup(CFG, [700, 300, 1000, 129])
    monkeypatch.setattr(
        FlashInferAttnBackend,
        "init_forward_metadata",
        lambda self, fb: setattr(self, "forward_metadata", DecodeMetadata([object()])),
    )
    backend = object.__new__(flashinfer_sparse.EntropicFlashInferAttnBackend)  # SGLang's __init__ needs CUDA
    backend.planner = PagePlanner(runner, CFG)
    backend.sparse = flashinfer_sparse.FlashInferSparse(None, (HEADS_Q, HEADS_KV, 16), (torch.float32,) * 2, 16, False)
    backend.decode_wrappers = [object()]
    store, pool = backend.planner.store, runner.token_to_kv_pool
    for layer in range(LAYERS):  # the prompts' keys, as the extend steps fold them
        store.write_keys(layer, torch.arange(pool.k[layer].shape[0]), pool.k[layer])
    stepper = Stepper(EntropicConfig(mode="full"))
    reqs = [stepper.req(controller=ControllerState.from_config(SamplingConfig(), 0.8)) for _ in range(4)]
    logits = torch.randn(4, 50)
    with HostReads(host=[batch.seq_lens_cpu]) as mode:
        backend.init_forward_metadata(batch)
        for layer in range(LAYERS):  # what forward_decode does before FlashInfer runs the layer
            assert backend.planner.sparse_layer(stub_layer(layer))
            backend.sparse.select(q, pool.k[layer], store.kmin[layer], store.kmax[layer], 0.25)
        step = stepper.begin(reqs, logits, [0.8] * 4)
        _, pending = step.record(logits.clone(), logits.argmax(dim=-1), [700, 300, 1000, 129])
    assert backend.pruned and backend.sparse_metadata.decode_wrappers == [backend.sparse.decoder]
    assert mode.reads == [] and len(mode.transfers) == 1, (mode.reads, mode.transfers)
    pending.finish(stepper.rt)  # where SGLang processes the batch's result
    assert all(len(r.customized_info["entropy"]) == 1 for r in reqs)


@pytest.mark.parametrize("shortlist_ratio,expected", [(0.5, 4097), (None, 32768)])
def test_the_cuda_crossover_is_the_measured_rule_not_a_start_up_timing(flashinfer_sparse, shortlist_ratio, expected):
    """With min_context unset, the CUDA backend's start-up runs the self-check and takes the crossover from
    the rule measured on an H200 (never with the two stages, 32k tokens with the bound alone), timing
    nothing: an eager probe cannot time the graph replay a dense step runs as."""
    import types

    import torch

    from sgl_entropic.config import PruningConfig

    fi = flashinfer_sparse
    cfg = PruningConfig(shortlist_ratio=shortlist_ratio)
    assert cfg.min_context is None
    backend = object.__new__(fi.EntropicFlashInferAttnBackend)  # SGLang's __init__ needs CUDA
    backend._heads = (9, 3, 64)
    backend.indices_updater_decode = types.SimpleNamespace(data_type=torch.float32)
    backend.sparse = fi.FlashInferSparse(None, backend._heads, (torch.float32,) * 2, 16, False)
    backend.planner = types.SimpleNamespace(cfg=cfg)
    runner = types.SimpleNamespace(device="cpu", model_config=types.SimpleNamespace(context_len=4096))
    probe = backend._start_up(runner, cfg)
    assert probe.check.ok and probe.timings == []
    assert backend.planner.cfg.min_context == expected
