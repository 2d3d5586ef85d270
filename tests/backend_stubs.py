"""Hand-built paged KV pools under the CPU entropic attention backend, for tests/test_attention_backend.py and
tests/test_tp_determinism.py: requests on scattered physical pages, their prompts' keys in the page store."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_entropic.config import EntropicConfig, PruningConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention.backend import EntropicTorchNativeAttnBackend
from sgl_entropic.plugin.step import BatchRows, current_step
from sgl_entropic.pruning import num_pages
from sgl_entropic.signal import EntropyTrace


HEADS_Q, HEADS_KV, DIM, LAYERS, P = 6, 2, 16, 3, 16
POOL_PAGES, REQ_SLOTS, MAX_CONTEXT = 512, 8, 2048
CFG = PruningConfig(min_context=64, page_size=P, sink_blocks=1, recent_blocks=2, min_keep_ratio=0.3, max_keep_ratio=0.3)


class KVPool:
    def __init__(self, gen):
        slots = POOL_PAGES * P
        self.k = [torch.randn(slots, HEADS_KV, DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(slots, HEADS_KV, DIM, generator=gen) for _ in range(LAYERS)]

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


def stub_layer(layer_id, window=-1):
    return SimpleNamespace(
        layer_id=layer_id,
        tp_q_head_num=HEADS_Q,
        tp_k_head_num=HEADS_KV,
        qk_head_dim=DIM,
        v_head_dim=DIM,
        scaling=1 / math.sqrt(DIM),
        is_cross_attention=False,
        sliding_window_size=window,
    )


def stub_runner(gen=None, tp_size=1, sliding=()):
    """`sliding`: layer ids with a sliding window (the others attend the whole context)."""
    pool = KVPool(gen or torch.Generator().manual_seed(0))
    pool.size = POOL_PAGES * P
    model = torch.nn.ModuleList(
        RadixAttention(HEADS_Q, DIM, 1 / math.sqrt(DIM), HEADS_KV, i, sliding_window_size=8 if i in sliding else -1)
        for i in range(LAYERS)
    )
    return SimpleNamespace(
        device="cpu",
        page_size=P,
        model=model,
        server_args=SimpleNamespace(tp_size=tp_size),
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(REQ_SLOTS, MAX_CONTEXT, dtype=torch.int32)),
        model_config=SimpleNamespace(
            vocab_size=49152, num_hidden_layers=LAYERS, num_attention_heads=HEADS_Q * tp_size, context_len=MAX_CONTEXT
        ),
    )


def setup(cfg, context_lens, entropies=None, seed=0, tp_size=1, sliding=()):
    """Requests on scattered physical pages (a fragmented pool), their prompts' keys in the store."""
    gen = torch.Generator().manual_seed(seed)
    runner = stub_runner(gen, tp_size, sliding)
    backend = EntropicTorchNativeAttnBackend(runner, cfg)
    table = runner.req_to_token_pool.req_to_token
    pages = torch.randperm(POOL_PAGES, generator=gen)
    used = 0
    req_slots = list(range(1, len(context_lens) + 1))
    for slot, n in zip(req_slots, context_lens):
        own = pages[used : used + num_pages(n, P)]
        used += own.numel()
        table[slot, :n] = (own[:, None] * P + torch.arange(P)).flatten()[:n].int()
        locs = table[slot, :n].long()
        for layer in backend.planner.store.layer_ids:  # the prompt's keys, in two chunks as a chunked prefill would
            half = n // 2
            backend.planner.store.write_keys(layer, locs[:half], runner.token_to_kv_pool.k[layer][locs[:half]])
            backend.planner.store.write_keys(layer, locs[half:], runner.token_to_kv_pool.k[layer][locs[half:]])
    lens = torch.tensor(context_lens)
    idx = torch.tensor(req_slots)
    states = [
        SimpleNamespace(trace=EntropyTrace(last_entropy=h), arrival_seq=i)
        for i, h in enumerate(entropies or [1.0] * len(context_lens))
    ]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=idx,
        seq_lens=lens,
        seq_lens_cpu=lens,
        out_cache_loc=table[idx, lens - 1].long(),
        encoder_lens=None,
        spec_info=None,
        batch_size=len(context_lens),
    )
    # the rows of the batch being run, as the ForwardBatch.init_new hook leaves them on the step
    batch.rows = current_step(runtime.install(EntropicConfig())).rows = BatchRows.of(
        [SimpleNamespace(entropic=s) for s in states], [True] * len(states)
    )
    q = torch.randn(len(context_lens), HEADS_Q * DIM, generator=gen)
    return runner, backend, batch, q, states
