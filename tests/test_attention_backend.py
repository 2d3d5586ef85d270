"""The CPU entropic attention backend on hand-built KV pools: sparse decode is exact dense
attention over the kept tokens, keeping everything is bit-identical to stock torch_native, and
the prompt scores are the model's own -ln p(x_i | x_<i)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sgl_entropic.config import PruningConfig
from sgl_entropic.plugin.attention import SurprisalStore, torch_native_backend
from sgl_entropic.pruning import kept_token_indices, select_blocks, block_scores, sparse_decode_attention

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

HEADS_Q, HEADS_KV, DIM, LAYERS = 6, 2, 16, 3
POOL_SLOTS, REQ_SLOTS, MAX_CONTEXT = 4096, 8, 1024


class _KVPool:
    def __init__(self, gen):
        self.k = [torch.randn(POOL_SLOTS, HEADS_KV, DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(POOL_SLOTS, HEADS_KV, DIM, generator=gen) for _ in range(LAYERS)]

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


def _runner(gen):
    return SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(REQ_SLOTS, MAX_CONTEXT, dtype=torch.int32)),
        token_to_kv_pool=_KVPool(gen),
        model_config=SimpleNamespace(vocab_size=49152, num_hidden_layers=LAYERS),
    )


def _layer(layer_id):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HEADS_Q, tp_k_head_num=HEADS_KV, qk_head_dim=DIM,
                           v_head_dim=DIM, scaling=1 / math.sqrt(DIM), is_cross_attention=False,
                           sliding_window_size=-1)


def _decode_batch(runner, gen, context_lens, req_slots):
    """Requests with scattered KV slots (like a fragmented pool) at their decode step."""
    perm = torch.randperm(POOL_SLOTS, generator=gen)
    used = 0
    for slot, n in zip(req_slots, context_lens):
        runner.req_to_token_pool.req_to_token[slot, :n] = perm[used : used + n].int()
        used += n
    lens = torch.tensor(context_lens)
    idx = torch.tensor(req_slots)
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=idx,
        seq_lens=lens,
        seq_lens_cpu=lens,
        out_cache_loc=runner.req_to_token_pool.req_to_token[idx, lens - 1].long(),
        encoder_lens=None,
        spec_info=None,
    )


def _setup(cfg, context_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    runner = _runner(gen)
    backend = torch_native_backend(runner, cfg)
    req_slots = list(range(1, len(context_lens) + 1))
    batch = _decode_batch(runner, gen, context_lens, req_slots)
    store = backend.planner.store
    # skewed surprisal: a few informative tokens in mostly predictable text
    store.slot.copy_(torch.distributions.Exponential(2.0).sample((POOL_SLOTS,)))
    store.slot[torch.randint(0, POOL_SLOTS, (60,), generator=gen)] = 9.0
    entropies = torch.tensor([0.3, 1.5, 4.0, 0.05][: len(context_lens)])
    store.entropy[torch.tensor(req_slots)] = entropies
    store.next_surprisal[torch.tensor(req_slots)] = 1.0  # the fed-in token's score
    q = torch.randn(len(context_lens), HEADS_Q * DIM, generator=gen)
    return runner, backend, batch, q, entropies


def _decode(backend, batch, q, layer_id):
    backend.init_forward_metadata(batch)
    return backend.forward_decode(q, None, None, _layer(layer_id), batch, save_kv_cache=False)


CFG = PruningConfig(min_context=64, page_size=16, sink_blocks=1, recent_blocks=2)


def test_sparse_decode_equals_dense_attention_restricted_to_the_kept_tokens():
    context_lens = [700, 300, 1000, 129]
    runner, backend, batch, q, entropies = _setup(CFG, context_lens)
    out = _decode(backend, batch, q, layer_id=1)
    store, table = backend.planner.store, runner.req_to_token_pool.req_to_token
    pruned_any = False
    for r, n in enumerate(context_lens):
        slots = table[batch.req_pool_indices[r], :n].long()
        scores = block_scores(store.slot[slots], CFG.page_size)
        kept = select_blocks(scores, n, float(entropies[r]), CFG, backend.planner.reference_entropy)
        positions = kept_token_indices(kept, n, CFG.page_size)
        pruned_any |= positions.numel() < n
        k = runner.token_to_kv_pool.k[1][slots]
        v = runner.token_to_kv_pool.v[1][slots]
        want = sparse_decode_attention(q[r].view(HEADS_Q, DIM), k, v, positions)
        torch.testing.assert_close(out[r].view(HEADS_Q, DIM), want, rtol=1e-5, atol=1e-5)
        # the guards: sink block and the two most recent blocks are always attended
        assert set(range(CFG.page_size)) <= set(positions.tolist())
        assert set(range((math.ceil(n / 16) - 2) * 16, n)) <= set(positions.tolist())
    assert pruned_any
    # the fed-in token's surprisal landed in its slot before planning
    assert torch.equal(store.slot[batch.out_cache_loc], torch.ones(len(context_lens)))


def test_keeping_everything_is_bit_identical_to_stock_torch_native():
    cfg = PruningConfig(min_context=0, min_keep_ratio=1.0, max_keep_ratio=1.0)
    runner, backend, batch, q, _ = _setup(cfg, [700, 300, 1000])
    out = _decode(backend, batch, q, layer_id=2)
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    want = stock.forward_decode(q, None, None, _layer(2), batch, save_kv_cache=False)
    assert torch.equal(out, want)
    assert backend.planner.attended_fractions(batch) == [1.0, 1.0, 1.0]


def test_dense_layers_and_short_contexts_attend_everything():
    cfg = CFG.model_copy(update={"dense_layers": 1})
    runner, backend, batch, q, _ = _setup(cfg, [700, 900])
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    dense0 = stock.forward_decode(q, None, None, _layer(0), batch, save_kv_cache=False)
    dense1 = stock.forward_decode(q, None, None, _layer(1), batch, save_kv_cache=False)
    assert torch.equal(_decode(backend, batch, q, layer_id=0), dense0)  # a dense layer
    assert not torch.allclose(_decode(backend, batch, q, layer_id=1), dense1)  # a pruned one
    fractions = backend.planner.attended_fractions(batch)
    assert all(f < 1.0 for f in fractions)

    short = CFG.model_copy(update={"min_context": 1000})
    runner, backend, batch, q, _ = _setup(short, [700, 900])
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    assert torch.equal(_decode(backend, batch, q, layer_id=1),
                       stock.forward_decode(q, None, None, _layer(1), batch, save_kv_cache=False))
    assert backend.planner.attended_fractions(batch) is None


def test_unknown_scores_are_always_attended():
    runner, backend, batch, q, _ = _setup(CFG, [800])
    slots = runner.req_to_token_pool.req_to_token[1, :800].long()
    backend.planner.store.slot[slots[400:416]] = math.nan  # e.g. a chunk boundary: never scored
    backend.planner.store.slot[slots[416:800 - 32]] = 0.0
    _decode(backend, batch, q, layer_id=1)
    kept = set(backend.sparse.slots[0, : int(backend.sparse.lens[0])].tolist())
    assert set(slots[400:416].tolist()) <= kept


def test_prompt_scores_are_the_models_next_token_surprisal(monkeypatch):
    from sglang.srt.layers.logits_processor import LogitsMetadata

    monkeypatch.setattr(LogitsMetadata, "from_forward_batch", lambda forward_batch: None)
    gen = torch.Generator().manual_seed(3)
    vocab, hidden = 50, 8
    weight = torch.randn(vocab, hidden, generator=gen)
    processor = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab),
                                _get_logits=lambda h, lm_head, meta, use_logits_buffer: h @ weight.T)
    # two requests in one extend batch: 5 and 3 new tokens
    ids = torch.randint(0, vocab, (8,), generator=gen)
    hidden_states = torch.randn(8, hidden, generator=gen)
    slots = torch.tensor([10, 11, 12, 13, 14, 30, 31, 32])
    batch = SimpleNamespace(input_ids=ids, out_cache_loc=slots, extend_start_loc=torch.tensor([0, 5]))
    store = SurprisalStore(64, 4, "cpu")
    store.record_prompt(processor, hidden_states, None, batch)
    logp = torch.log_softmax(hidden_states @ weight.T, dim=-1)
    for seg_start, seg_end in ((0, 5), (5, 8)):
        assert math.isnan(store.slot[slots[seg_start]])  # no predecessor in this forward
        for i in range(seg_start + 1, seg_end):
            assert store.slot[slots[i]].item() == pytest.approx(-logp[i - 1, ids[i]].item(), rel=1e-5)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(store.slot[untouched]).all()
