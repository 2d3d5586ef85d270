"""The CPU entropic attention backend on hand-built paged KV pools: the page store's min/max equal
the pages' keys, selected pages are the best by an independently computed bound, sparse decode is
exact attention over the kept pages, and a step that prunes nothing is stock torch_native."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention import backend as attention
from sgl_entropic.plugin.attention.backend import EntropicTorchNativeAttnBackend
from sgl_entropic.plugin.attention.page_store import PageStore
from sgl_entropic.pruning import num_pages, row_pages, sparse_decode_attention

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from tests.backend_stubs import (
    CFG,
    DIM,
    HEADS_KV,
    HEADS_Q,
    LAYERS,
    MAX_CONTEXT,
    P,
    setup,  # noqa: E402
    stub_layer,
    stub_runner,
)


def _decode(backend, batch, q, layer_id):
    backend.init_forward_metadata(batch)
    return backend.forward_decode(q, None, None, stub_layer(layer_id), batch, save_kv_cache=False)


def _true_bound(q_row, keys):
    """Per page the bound from the page's own keys, computed plainly: min/max over its tokens, then
    sum_d max(q_d kmax_d, q_d kmin_d), max over each KV head's query group, sum over KV heads."""
    kmin, kmax = keys.amin(dim=0), keys.amax(dim=0)  # [H_kv, D]
    group = HEADS_Q // HEADS_KV
    total = 0.0
    for h in range(HEADS_KV):
        per_query = []
        for g in range(group):
            qv = q_row[h * group + g]
            per_query.append(float(torch.maximum(qv * kmax[h], qv * kmin[h]).sum()))
        total += max(per_query)
    return total


def test_store_min_max_are_the_pages_keys_and_bound_the_true_logits():
    runner, backend, batch, q, _ = setup(CFG, [700, 300])
    store, table = backend.planner.store, runner.req_to_token_pool.req_to_token
    for r, n in enumerate([700, 300]):
        for page in range(num_pages(n, P)):
            locs = table[r + 1, page * P : min(n, (page + 1) * P)].long()
            phys = int(locs[0]) // P
            keys = runner.token_to_kv_pool.k[1][locs]
            assert torch.equal(store.kmin[1][phys], keys.amin(dim=0)) and torch.equal(store.kmax[1][phys], keys.amax(0))
            # an upper bound of every query head's logit on the page
            qh = q[r].view(HEADS_Q, DIM)
            logits = torch.einsum("hd,thd->ht", qh, keys.repeat_interleave(HEADS_Q // HEADS_KV, dim=1))
            bound = (
                torch.maximum(
                    qh.view(HEADS_KV, -1, DIM) * store.kmax[1][phys][:, None],
                    qh.view(HEADS_KV, -1, DIM) * store.kmin[1][phys][:, None],
                )
                .sum(-1)
                .flatten()
            )
            assert (logits.amax(dim=1) <= bound + 1e-5).all()


def test_a_page_reused_by_another_request_restarts_its_min_max():
    store = PageStore([0], 4 * P, P, 1, 2, torch.float32, "cpu", 4, with_surprisal=False)
    store.write_keys(0, torch.arange(P, 2 * P), torch.full((P, 1, 2), 5.0))  # page 1: old content
    fresh = torch.tensor([[[1.0, -1.0]], [[2.0, -3.0]]])
    store.write_keys(0, torch.tensor([P, P + 1]), fresh)  # page 1 freed and reused: new content from offset 0
    assert store.kmin[0][1].tolist() == [[1.0, -3.0]] and store.kmax[0][1].tolist() == [[2.0, -1.0]]


def _expected(q_row, keys, values, counts, cfg, group_heads):
    """The row's output by hand: the bound ranks candidates (plain min/max per page), the shortlist is
    reranked by exact attention mass on its keys, attention over fixed + kept pages' tokens.
    group_heads: the KV heads one page list serves (all of them, or one with per_head)."""
    n = keys.shape[0]
    group = HEADS_Q // HEADS_KV
    candidates = list(range(counts.sink, counts.n - counts.recent))
    fixed = list(range(counts.sink)) + list(range(counts.n - counts.recent, counts.n))
    qh = q_row.view(HEADS_KV, group, DIM)

    def bound(page):
        k = keys[page * P : (page + 1) * P]
        kmin, kmax = k.amin(dim=0), k.amax(dim=0)
        return sum(float(torch.maximum(qh[h] * kmax[h], qh[h] * kmin[h]).sum(-1).max()) for h in group_heads)

    short = sorted(candidates, key=lambda j: -bound(j))[: counts.shortlist]
    if counts.shortlist > counts.keep:
        tokens = torch.tensor([t for j in short for t in range(j * P, (j + 1) * P)])
        mass = {j: 0.0 for j in short}
        for h in group_heads:
            probs = torch.softmax(qh[h] @ keys[tokens, h].T * (DIM**-0.5), dim=-1)  # [group, tokens]
            for i, j in enumerate(short):
                mass[j] += float(probs[:, i * P : (i + 1) * P].sum())
        short = sorted(short, key=lambda j: -mass[j])
    kept = fixed + short[: counts.keep]
    positions = torch.tensor(sorted(t for j in kept for t in range(j * P, min(n, (j + 1) * P))))
    out = sparse_decode_attention(q_row.view(HEADS_Q, DIM), keys, values, positions)
    heads = [h * group + g for h in group_heads for g in range(group)]
    return out[heads], heads


@pytest.mark.parametrize("shortlist, per_head", [(0.5, False), (None, False), (0.5, True), (None, True)])
def test_sparse_decode_attends_exactly_the_pages_its_selection_names(shortlist, per_head):
    cfg = CFG.model_copy(update={"shortlist_ratio": shortlist, "per_head": per_head})
    context_lens = [700, 300, 1000, 129]
    runner, backend, batch, q, states = setup(cfg, context_lens)
    out = _decode(backend, batch, q, layer_id=1).view(len(context_lens), HEADS_Q, DIM)
    table = runner.req_to_token_pool.req_to_token
    for r, n in enumerate(context_lens):
        slots = table[r + 1, :n].long()
        keys, values = runner.token_to_kv_pool.k[1][slots], runner.token_to_kv_pool.v[1][slots]
        counts = row_pages(n, 1.0, cfg, backend.planner.reference_entropy)
        assert counts.prunes and counts.shortlist == (
            counts.keep if shortlist is None else math.ceil(0.5 * counts.candidates)
        )
        for group_heads in [[h] for h in range(HEADS_KV)] if per_head else [list(range(HEADS_KV))]:
            want, heads = _expected(q[r], keys, values, counts, cfg, group_heads)
            torch.testing.assert_close(out[r, heads], want, rtol=1e-5, atol=1e-5)
    assert batch.rows.attended == pytest.approx([row_pages(n, 1.0, cfg).kept_tokens / n for n in context_lens])


def test_without_the_dense_kernel_a_step_that_prunes_nothing_is_stock_torch_native():
    everything = CFG.model_copy(
        update={"min_keep_ratio": 1.0, "max_keep_ratio": 1.0, "shortlist_ratio": 1.0, "min_context": 0}
    )
    runner, backend, batch, q, _ = setup(everything, [700, 300, 1000])
    backend.probe.dense_kernel_from = None
    out = _decode(backend, batch, q, layer_id=2)
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    assert torch.equal(out, stock.forward_decode(q, None, None, stub_layer(2), batch, save_kv_cache=False))
    assert backend.plan is None and batch.rows.attended is None


def test_the_dense_kernel_attends_every_page_as_sglang_does():
    """Where the probe timed it faster, a step that prunes nothing runs our batched kernel over every
    page: the same attention as SGLang's per-request loop, to float32 rounding."""
    runner, backend, batch, q, _ = setup(CFG.model_copy(update={"min_context": 10**6}), [700, 300, 1000])
    backend.probe.dense_kernel_from = 500  # rows of 700 and 1000 tokens: the batch's longest decides
    out = _decode(backend, batch, q, layer_id=2)
    assert backend.plan is not None and not backend.plan.keep_valid.shape[1]  # every page fixed, none selected
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    want = stock.forward_decode(q, None, None, stub_layer(2), batch, save_kv_cache=False)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert batch.rows.attended is None  # every token read: the trace's default 1.0


def test_rows_below_min_context_keep_every_page_in_a_pruned_step():
    cfg = CFG.model_copy(update={"min_context": 500})
    runner, backend, batch, q, _ = setup(cfg, [1000, 300])
    out = _decode(backend, batch, q, layer_id=0)
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    dense = stock.forward_decode(q, None, None, stub_layer(0), batch, save_kv_cache=False)
    assert backend.plan is not None and backend.plan.keep_valid.shape[1]
    torch.testing.assert_close(out[1], dense[1], rtol=1e-5, atol=1e-5)  # the short row: all of its pages
    assert not torch.allclose(out[0], dense[0])


def test_dense_layers_attend_everything():
    cfg = CFG.model_copy(update={"dense_layers": 1})
    runner, backend, batch, q, _ = setup(cfg, [700, 900])
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    torch.testing.assert_close(
        _decode(backend, batch, q, 0),
        stock.forward_decode(q, None, None, stub_layer(0), batch, False),
        rtol=1e-5,
        atol=1e-5,
    )
    assert not torch.allclose(
        _decode(backend, batch, q, 1), stock.forward_decode(q, None, None, stub_layer(1), batch, False)
    )
    assert all(f > 0.3 for f in batch.rows.attended)


def test_sliding_window_layers_have_no_page_bounds_and_attend_their_window_as_sglang_does():
    """Gemma 3 shape: only layers that read the whole context are pruning candidates and hold page bounds;
    a sliding-window layer attends exactly its window through SGLang's own code, also in a pruned step."""
    runner, backend, batch, q, _ = setup(CFG, [700, 900], sliding={0, 2})
    store = backend.planner.store
    assert store.layer_ids == [1] and store.kmin.shape[0] == 1 and backend.planner.sparse_share == 1.0
    stock = TorchNativeAttnBackend(runner)
    stock.init_forward_metadata(batch)
    backend.init_forward_metadata(batch)
    assert backend.plan is not None  # the step prunes
    for layer in (stub_layer(0, window=8), stub_layer(2, window=8)):
        out = backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False)
        assert torch.equal(out, stock.forward_decode(q, None, None, layer, batch, save_kv_cache=False))
    window_of_all = stock.forward_decode(q, None, None, stub_layer(0), batch, save_kv_cache=False)
    assert not torch.allclose(out, window_of_all)  # the window is really applied
    pruned = backend.forward_decode(q, None, None, stub_layer(1), batch, save_kv_cache=False)
    assert not torch.allclose(pruned, stock.forward_decode(q, None, None, stub_layer(1), batch, save_kv_cache=False))
    before = store.kmax.clone()
    backend.planner.write_keys(stub_layer(0, window=8), batch, runner.token_to_kv_pool.k[0])  # no bounds: no-op
    assert torch.equal(store.kmax, before)


def test_a_model_whose_every_layer_slides_turns_pruning_off(caplog):
    runner = stub_runner(sliding=set(range(LAYERS)))
    with caplog.at_level("ERROR", logger="sgl_entropic"):
        backend = EntropicTorchNativeAttnBackend(runner, CFG)
    assert backend.planner.store.layer_ids == [] and backend.planner.cfg.min_context == 10**9
    assert "sliding-window" in caplog.text


def test_the_entropy_sets_the_budget():
    cfg = CFG.model_copy(update={"min_keep_ratio": 0.2, "max_keep_ratio": 0.8, "shortlist_ratio": 0.9})
    _, backend, batch, q, _ = setup(cfg, [1000, 1000], entropies=[0.0, 20.0])
    _decode(backend, batch, q, 1)
    confident, uncertain = backend.plan.rows
    assert confident.keep == math.ceil(0.2 * confident.candidates) and uncertain.keep == uncertain.candidates * 8 // 10


def test_surprisal_selector_keeps_unscored_pages():
    cfg = CFG.model_copy(update={"selector": "surprisal"})
    runner, backend, batch, q, _ = setup(cfg, [800])
    slots = runner.req_to_token_pool.req_to_token[1, :800].long()
    store = backend.planner.store
    store.slot_surprisal[slots] = 0.0
    store.slot_surprisal[slots[400:416]] = math.nan  # never scored (a chunk edge): always kept
    store.slot_surprisal[slots[160:176]] = 9.0  # one informative page
    backend.init_forward_metadata(batch)
    kept = set(backend.plan.chosen[0, 0].tolist())
    assert {25, 10} <= kept  # pages 400 / 16 and 160 / 16


def test_prompt_scores_are_the_models_next_token_surprisal(monkeypatch):
    from sglang.srt.layers.logits_processor import LogitsMetadata

    monkeypatch.setattr(LogitsMetadata, "from_forward_batch", lambda forward_batch: None)
    gen = torch.Generator().manual_seed(3)
    vocab, hidden = 50, 8
    weight = torch.randn(vocab, hidden, generator=gen)
    processor = SimpleNamespace(
        config=SimpleNamespace(vocab_size=vocab), _get_logits=lambda h, lm_head, meta, use_logits_buffer: h @ weight.T
    )
    # two requests in one extend batch: 5 and 3 new tokens
    ids = torch.randint(0, vocab, (8,), generator=gen)
    hidden_states = torch.randn(8, hidden, generator=gen)
    slots = torch.tensor([10, 11, 12, 13, 14, 30, 31, 32])
    batch = SimpleNamespace(input_ids=ids, out_cache_loc=slots, extend_start_loc=torch.tensor([0, 5]))
    store = PageStore([0], 64, 16, 1, 2, torch.float32, "cpu", 4, with_surprisal=True)
    store.record_prompt(processor, hidden_states, None, batch)
    logp = torch.log_softmax(hidden_states @ weight.T, dim=-1)
    for seg_start, seg_end in ((0, 5), (5, 8)):
        assert math.isnan(store.slot_surprisal[slots[seg_start]])  # no predecessor in this forward
        for i in range(seg_start + 1, seg_end):
            assert store.slot_surprisal[slots[i]].item() == pytest.approx(-logp[i - 1, ids[i]].item(), rel=1e-5)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(store.slot_surprisal[untouched]).all()


@pytest.mark.parametrize("update", [{}, {"shortlist_ratio": None}, {"per_head": True}, {"selector": "surprisal"}])
def test_a_pruned_step_does_not_read_the_device(update):
    """Planning and every layer's selection and attention stay on the device: the only host values
    used are SGLang's own host copies (seq_lens_cpu) and the entropies the sampling step fetched."""
    from tests.stepping import HostReads

    runner, backend, batch, q, _ = setup(CFG.model_copy(update=update), [700, 300, 1000, 129])
    with HostReads(host=[batch.seq_lens_cpu]) as mode:
        for step in range(2):
            backend.init_forward_metadata(batch)
            for layer in range(LAYERS):
                backend.forward_decode(q, None, None, stub_layer(layer), batch, save_kv_cache=False)
    assert backend.plan is not None and mode.reads == [], mode.reads


def test_dense_decode_steps_defer_their_keys_until_a_step_prunes():
    """Below the crossover a decode step folds no keys (no per-layer work); the first step that
    prunes folds every deferred slot first, so its bounds cover every key written."""
    runner, backend, batch, q, _ = setup(CFG.model_copy(update={"min_context": 10**6}), [700, 300])
    store, pool, pages = backend.planner.store, runner.token_to_kv_pool, batch.out_cache_loc // P
    for layer in range(LAYERS):
        pool.k[layer][batch.out_cache_loc] = 50.0  # the decode token's key, above every prompt key
    backend.init_forward_metadata(batch)
    for layer in range(LAYERS):
        backend.forward_decode(q, None, None, stub_layer(layer), batch, save_kv_cache=False)
    assert backend.plan is None and (store.kmax[:, pages] < 50.0).all()
    backend.planner.cfg = CFG  # from here on the batch prunes
    backend.init_forward_metadata(batch)
    assert backend.plan is not None and (store.kmax[:, pages] == 50.0).all()


@pytest.fixture(autouse=True)
def timings_kept_here(tmp_path, monkeypatch):
    """Start-up timings are kept per machine (crossover.py); here in a folder of the test's own."""
    monkeypatch.setattr(attention, "timings_dir", lambda: tmp_path)
    return tmp_path


def test_start_up_timings_are_measured_once_per_machine_and_read_on_every_later_start(timings_kept_here, monkeypatch):
    """A restart times nothing and reaches the same decisions (the kernel a step runs never follows the load of
    the moment a server started); another config is another measurement."""
    cfg = CFG.model_copy(update={"min_context": None})
    first = EntropicTorchNativeAttnBackend(stub_runner(), cfg)
    assert len(list(timings_kept_here.glob("*.json"))) == 1

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    with monkeypatch.context() as m:
        m.setattr(attention, "measure", no_timing)
        again = EntropicTorchNativeAttnBackend(stub_runner(), cfg)
    assert (again.probe.timings, again.probe.kernel_timings) == (first.probe.timings, first.probe.kernel_timings)
    assert (again.probe.dense_kernel_from, again.planner.cfg.min_context) == (
        first.probe.dense_kernel_from,
        first.planner.cfg.min_context,
    )
    with pytest.raises(AssertionError, match="timed again"), monkeypatch.context() as m:
        m.setattr(attention, "measure", no_timing)
        EntropicTorchNativeAttnBackend(stub_runner(), cfg.model_copy(update={"shortlist_ratio": 0.7}))


def test_given_both_crossovers_the_backend_times_nothing():
    backend = EntropicTorchNativeAttnBackend(
        stub_runner(), CFG.model_copy(update={"min_context": 900, "dense_kernel_from": 700})
    )
    probe = backend.probe
    assert probe.check.ok and probe.timings == probe.kernel_timings == []
    assert (probe.dense_kernel_from, backend.planner.cfg.min_context) == (700, 900)


def test_without_min_context_the_backend_times_where_its_kernels_pay():
    """min_context unset: at start-up the backend times SGLang's dense loop, our kernel over every page
    and the pruned path; our kernel serves steps that do not prune from the shortest timed context past
    which it wins by 10 % at every longer one, and pruning starts where it beats the better dense path."""
    backend = EntropicTorchNativeAttnBackend(stub_runner(), CFG.model_copy(update={"min_context": None}))
    probe = backend.probe
    assert probe.check.ok
    assert (
        [t.context for t in probe.timings] == [t.context for t in probe.kernel_timings] == [256, 512, 1024, 1536, 2048]
    )
    for timings, chosen in (
        (probe.kernel_timings, probe.dense_kernel_from),
        (probe.timings, backend.planner.cfg.min_context),
    ):
        paying = [t.sparse_s <= 0.9 * t.dense_s for t in timings]
        if not paying[-1]:
            assert chosen in (None, MAX_CONTEXT + 1)  # never pays
        else:
            first = len(paying) - paying[::-1].index(False) if False in paying else 0
            assert chosen == timings[first].context


def test_a_broken_kernel_turns_pruning_off_at_start_up(monkeypatch, caplog):
    """The self-check runs the backend's own path on synthetic KV before serving: a kernel that is off
    by 2 % fails it, and the server stays up attending densely, the reason in the log and /server_info."""
    import sgl_entropic.plugin.attention.backend as attention
    from sgl_entropic.plugin import server_info

    good = attention.attend_layer
    monkeypatch.setattr(attention, "attend_layer", lambda *a: (lambda out, kept: (out * 1.02, kept))(*good(*a)))
    rt = runtime.install(EntropicConfig(mode="pruning", pruning=CFG.model_dump()))
    backend = attention.create_backend(stub_runner())
    assert not backend.probe.check.ok and "differs from exact attention" in backend.probe.check.error
    assert "pruning is OFF" in caplog.text
    section = server_info.after_get_init_info({}, None)["entropic"]["pruning"]
    assert section["self_check"]["ok"] is False and section["page_store_bytes"] == backend.planner.store.nbytes > 0
    _, _, batch, _, _ = setup(CFG, [1000, 700])
    backend.init_forward_metadata(batch)
    assert backend.plan is None  # the 1000-token row would prune: now it attends densely
    assert rt.pruning_from == backend.planner.cfg.min_context > 1000
