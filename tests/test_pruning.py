"""The meso loop: block scores, keep ratio, dynamic threshold with guards, sparse decode attention."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import (
    AGGREGATES,
    DEFAULT_AGGREGATE,
    DEFAULT_REFERENCE_ENTROPY,
    PruneStats,
    block_scores,
    block_scores_batched,
    block_select,
    block_select_reference,
    blocks_at_or_above,
    decode_threshold,
    keep_count,
    keep_ratio,
    kept_token_indices,
    num_blocks,
    plan_keep_counts,
    reference_entropy_for_vocab,
    select_blocks,
    select_blocks_batched,
    sparse_decode_attention,
)

INF = float("inf")
NAN = float("nan")
# Local, not a loaded profile: a profile would change every other module's hypothesis settings.
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


# ---------------------------------------------------------------------------- block scores


def test_block_scores_hand_examples():
    s = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # blocks [1 2 3] [4 5 6] [7]
    assert block_scores(s, 3, "max").tolist() == [3.0, 6.0, 7.0]
    assert block_scores(s, 3, "mean").tolist() == [2.0, 5.0, 7.0]  # partial block: over 1 token
    assert block_scores(s, 3, "sum").tolist() == [6.0, 15.0, 7.0]
    assert DEFAULT_AGGREGATE == "max"
    assert torch.equal(block_scores(s, 3), block_scores(s, 3, "max"))
    assert block_scores(s, 1).tolist() == s.tolist()
    assert block_scores(s, 100, "mean").tolist() == [4.0]
    # One surprising token (a passkey digit) among predictable ones: max keeps it visible.
    passkey = torch.tensor([0.01, 0.01, 9.0, 0.01, 0.5, 0.5, 0.5, 0.5])
    assert block_scores(passkey, 4, "max").tolist() == pytest.approx([9.0, 0.5])
    assert block_scores(passkey, 4, "mean").tolist() == pytest.approx([2.2575, 0.5])


def test_block_scores_partial_last_block_and_dtypes():
    s = torch.arange(10, dtype=torch.bfloat16)
    for aggregate in AGGREGATES:
        scores = block_scores(s, 4, aggregate)
        assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert block_scores(s, 4, "mean")[-1].item() == 8.5  # tokens 8, 9
    assert block_scores(s, 4, "sum")[-1].item() == 17.0
    assert block_scores(torch.zeros(0), 4).shape == (0,)


@pytest.mark.parametrize("aggregate", AGGREGATES)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_surprisal_scores_inf(aggregate, bad):
    s = torch.tensor([1.0, bad, 0.5, 0.2, 0.1, 0.3, 0.7])
    scores = block_scores(s, 3, aggregate)
    assert scores[0].item() == INF
    assert torch.isfinite(scores[1:]).all()
    # ... so the block is kept at every budget, ahead of a block of high known surprisal.
    many = block_scores(torch.tensor([0.1] * 3 + [bad, 0.1, 0.1] + [5.0] * 3 + [0.2] * 6), 3, aggregate)
    n = torch.tensor([5])
    cases = [
        (0, [True, True, False, False, True]),
        (1, [True, True, False, False, True]),
        (2, [True, True, True, False, True]),
    ]
    for k, want in cases:
        assert select_blocks_batched(many[None], n, torch.tensor([k]), 1, 1)[0].tolist() == want


def test_block_scores_rejects_bad_input():
    with pytest.raises(ValueError, match="aggregate"):
        block_scores(torch.ones(4), 2, "median")
    with pytest.raises(ValueError, match="page_size"):
        block_scores(torch.ones(4), 0)
    with pytest.raises(ValueError, match=r"\[T\]"):
        block_scores(torch.ones(2, 4), 2)
    with pytest.raises(ValueError, match="lengths"):
        block_scores_batched(torch.ones(2, 4), torch.tensor([4, 5]), 2)


@PROPERTY
@given(
    st.integers(1, 4),
    st.integers(0, 40),
    st.integers(1, 9),
    st.sampled_from(AGGREGATES),
    st.data(),
)
def test_batched_scores_equal_per_request_scores(batch, width, page, aggregate, data):
    values = data.draw(arrays(np.float32, (batch, width), elements=st.floats(0, 30, width=32)))
    lengths = data.draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    s = torch.from_numpy(values)
    got = block_scores_batched(s, torch.tensor(lengths), page, aggregate)
    assert got.shape == (batch, num_blocks(width, page))
    for r, length in enumerate(lengths):
        n = num_blocks(length, page)
        assert torch.equal(got[r, :n], block_scores(s[r, :length], page, aggregate))
        assert (got[r, n:] == -INF).all()


# ---------------------------------------------------------------------------- keep ratio


@st.composite
def pruning_configs(draw, page_size=None, min_context=None):
    lo = draw(st.floats(0.01, 1.0))
    hi = draw(st.floats(lo, 1.0))
    return PruningConfig(
        page_size=page_size or draw(st.integers(1, 8)),
        sink_blocks=draw(st.integers(0, 4)),
        recent_blocks=draw(st.integers(1, 4)),
        min_keep_ratio=lo,
        max_keep_ratio=hi,
        entropy_floor=draw(st.sampled_from([0.0, 0.3, 1.0, 4.0, 7.0])),
        min_context=draw(st.integers(0, 64)) if min_context is None else min_context,
    )


ENTROPIES = st.floats(0.0, 15.0) | st.sampled_from([0.0, 1e-9, DEFAULT_REFERENCE_ENTROPY, INF])


@PROPERTY
@given(pruning_configs(), ENTROPIES, ENTROPIES, st.floats(0.5, 12.0))
def test_keep_ratio_is_monotone_and_bounded(cfg, h1, h2, h_ref):
    lo, hi = sorted((h1, h2))
    r_lo, r_hi = keep_ratio(lo, cfg, h_ref), keep_ratio(hi, cfg, h_ref)
    assert cfg.min_keep_ratio <= r_lo <= r_hi <= cfg.max_keep_ratio


@PROPERTY
@given(pruning_configs(), st.floats(0.0, 1.0), st.floats(1.0, 12.0))
def test_entropy_floor_stops_pruning_more(cfg, fraction, h_ref):
    floor = cfg.entropy_floor
    at_floor = keep_ratio(floor, cfg, h_ref)
    # Below the floor: exactly the floor's ratio, never less (no collapse for H ~ 0).
    assert keep_ratio(fraction * floor, cfg, h_ref) == at_floor
    assert keep_ratio(0.0, cfg, h_ref) == at_floor
    assert keep_ratio(-1.0, cfg, h_ref) == at_floor
    if floor > 0 and cfg.max_keep_ratio > cfg.min_keep_ratio:
        assert keep_ratio(0.0, cfg, h_ref) > cfg.min_keep_ratio
    # Above the floor the ratio follows H again.
    assert keep_ratio(floor + h_ref, cfg, h_ref) == cfg.max_keep_ratio


def test_keep_ratio_formula_and_edges():
    cfg = PruningConfig(min_keep_ratio=0.2, max_keep_ratio=0.8, entropy_floor=0.0)
    assert keep_ratio(0.0, cfg, 4.0) == pytest.approx(0.2)  # floor 0: the guard is off
    assert keep_ratio(1.0, cfg, 4.0) == pytest.approx(0.35)
    assert keep_ratio(2.0, cfg, 4.0) == pytest.approx(0.5)
    assert keep_ratio(4.0, cfg, 4.0) == 0.8
    assert keep_ratio(40.0, cfg, 4.0) == 0.8
    assert keep_ratio(INF, cfg, 4.0) == 0.8
    assert keep_ratio(NAN, cfg, 4.0) == 0.8  # unknown entropy: conservative
    floored = PruningConfig(min_keep_ratio=0.2, max_keep_ratio=0.8, entropy_floor=1.0)
    assert keep_ratio(0.0, floored, 4.0) == keep_ratio(1.0, floored, 4.0) == pytest.approx(0.35)
    assert keep_ratio(2.0, floored, 4.0) == pytest.approx(0.5)
    assert keep_ratio(0.5, PruningConfig(), DEFAULT_REFERENCE_ENTROPY) == keep_ratio(0.5, PruningConfig())
    assert reference_entropy_for_vocab(49152) == pytest.approx(math.log(49152) / 2)
    for bad in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match="reference_entropy"):
            keep_ratio(1.0, cfg, bad)


# ---------------------------------------------------------------------------- selection


@st.composite
def decode_cases(draw):
    """(scores, context_len, entropy, cfg): scores with ties, NaN and +-inf sprinkled in."""
    cfg = draw(pruning_configs())
    context_len = draw(st.integers(1, 120))
    n = num_blocks(context_len, cfg.page_size)
    pool = st.sampled_from([0.0, 0.5, 1.0, 3.0]) | st.floats(-5.0, 30.0, width=32)
    pool = pool | st.sampled_from([NAN, INF, -INF]) if draw(st.booleans()) else pool
    scores = torch.tensor(draw(st.lists(pool, min_size=n, max_size=n)), dtype=torch.float32)
    return scores, context_len, draw(ENTROPIES), cfg


def _kept_property(scores, kept, n, k, sink, recent):
    """The guards, the non-finite-unknown rule, at least k kept, and a clean threshold cut."""
    j = torch.arange(n)
    guard = (j < sink) | (j >= n - recent)
    assert kept[guard].all()
    s = torch.where(torch.isnan(scores), INF, scores)
    assert kept[s == INF].all()
    candidate = ~guard
    kept_c, pruned_c = s[candidate & kept], s[candidate & ~kept]
    assert kept_c.numel() >= min(k, int(candidate.sum()))
    if kept_c.numel() and pruned_c.numel():
        assert kept_c.min() > pruned_c.max()  # ties at the threshold are all kept
    if kept_c.numel() > k and pruned_c.numel():
        # More than k kept only through ties at theta.
        assert (kept_c == kept_c.min()).sum() > 1 or kept_c.min() == INF


@PROPERTY
@given(decode_cases())
def test_guards_and_threshold(case):
    scores, context_len, entropy, cfg = case
    n = scores.shape[0]
    kept = select_blocks(scores, context_len, entropy, cfg)
    assert kept.dtype == torch.bool and kept.shape == (n,)
    k = keep_count(context_len, entropy, cfg)
    _kept_property(scores, kept, n, k, cfg.sink_blocks, cfg.recent_blocks)
    # The same mask as the threshold form: I_b >= theta_t plus the guards.
    theta = decode_threshold(scores, context_len, entropy, cfg)
    assert torch.equal(kept, blocks_at_or_above(scores, theta, cfg.sink_blocks, cfg.recent_blocks))
    if context_len < cfg.min_context:
        assert kept.all() and theta == -INF
    # Without ties, exactly the guards plus k candidates.
    finite_distinct = torch.isfinite(scores).all() and scores.unique().numel() == n
    if finite_distinct:
        guards = min(n, cfg.sink_blocks + cfg.recent_blocks)
        assert int(kept.sum()) == guards + k


@PROPERTY
@given(pruning_configs(min_context=0), st.integers(1, 200), st.floats(0.0, 4.0), st.data())
def test_keep_count_respects_ratios(cfg, context_len, entropy, data):
    n = num_blocks(context_len, cfg.page_size)
    m = max(0, n - cfg.sink_blocks - cfg.recent_blocks)
    k = keep_count(context_len, entropy, cfg)
    assert math.ceil(cfg.min_keep_ratio * m) <= k <= math.ceil(cfg.max_keep_ratio * m) <= m
    if m:
        assert k >= 1  # min_keep_ratio > 0
    values = data.draw(arrays(np.float32, (n,), elements=st.floats(0, 30, width=32), unique=True))
    kept = select_blocks(torch.from_numpy(values), context_len, entropy, cfg)
    # The kept fraction of the whole context is at least rho (guards come on top of it).
    assert int(kept.sum()) >= keep_ratio(entropy, cfg) * n - 1e-9


def test_no_pruning_below_min_context():
    cfg = PruningConfig(
        page_size=4, sink_blocks=1, recent_blocks=1, min_keep_ratio=0.1, max_keep_ratio=0.1, min_context=64
    )
    scores = torch.arange(16, dtype=torch.float32)
    assert select_blocks(scores, 63, 0.0, cfg).all()  # 63 tokens < 64: dense
    assert decode_threshold(scores, 63, 0.0, cfg) == -INF
    kept = select_blocks(scores, 64, 0.0, cfg)  # 64 tokens: pruned, k = ceil(0.1 * 14) = 2
    assert kept.tolist() == [True] + [False] * 12 + [True] * 3
    assert decode_threshold(scores, 64, 0.0, cfg) == 13.0


def test_full_keep_ratio_or_infinite_threshold_keeps_everything():
    scores = torch.tensor([3.0, -INF, 0.0, NAN, 1.0, -2.0, 7.0, 0.5])
    keep_all = PruningConfig(page_size=2, min_keep_ratio=1.0, max_keep_ratio=1.0, min_context=0)
    assert select_blocks(scores, 16, 0.0, keep_all).all()
    assert decode_threshold(scores, 16, 0.0, keep_all) == -INF
    high = PruningConfig(page_size=2, min_keep_ratio=0.1, max_keep_ratio=1.0, min_context=0)
    assert select_blocks(scores, 16, 50.0, high).all()  # H >= H_ref reaches max_keep_ratio = 1
    assert not select_blocks(scores, 16, 0.0, high).all()
    assert blocks_at_or_above(scores, -INF, 0, 0).all()
    assert select_blocks_batched(scores[None], torch.tensor([8]), torch.tensor([99]), 0, 0).all()


def test_ties_at_threshold_are_all_kept():
    cfg = PruningConfig(
        page_size=1, sink_blocks=1, recent_blocks=1, min_keep_ratio=0.25, max_keep_ratio=0.25, min_context=0
    )
    scores = torch.tensor([0.0, 1.0, 2.0, 2.0, 2.0, 1.0, 0.5, 0.0, 2.0, 0.0])  # 8 candidates, k = 2
    kept = select_blocks(scores, 10, 0.0, cfg)
    assert kept.tolist() == [True, False, True, True, True, False, False, False, True, True]
    assert torch.equal(select_blocks(torch.ones(10), 10, 0.0, cfg), torch.ones(10, dtype=torch.bool))


@PROPERTY
@given(st.lists(decode_cases(), min_size=1, max_size=4), st.sampled_from([1, 2, 4]))
def test_batched_selection_equals_per_request(cases, page):
    cfg = cases[0][3].model_copy(update={"page_size": page})
    rows = []
    for s, c, _, _ in cases:
        n = num_blocks(c, page)
        rows.append(s.repeat(n // s.numel() + 1)[:n])
    contexts = [c for _, c, _, _ in cases]
    entropies = [h for _, _, h, _ in cases]
    n_blocks, counts = plan_keep_counts(contexts, entropies, cfg)
    width = int(n_blocks.max()) + 3
    padded = torch.full((len(rows), width), -INF)
    for r, s in enumerate(rows):
        padded[r, : s.numel()] = s
    kept = select_blocks_batched(padded, n_blocks, counts, cfg.sink_blocks, cfg.recent_blocks)
    for r, (s, c, h) in enumerate(zip(rows, contexts, entropies)):
        n = int(n_blocks[r])
        assert counts[r] == keep_count(c, h, cfg)
        assert torch.equal(kept[r, :n], select_blocks(s, c, h, cfg))
        assert not kept[r, n:].any()


def test_select_blocks_rejects_wrong_score_length():
    with pytest.raises(ValueError, match="scores must be"):
        select_blocks(torch.ones(3), 100, 1.0, PruningConfig())


def test_block_select_reference_and_dispatch_on_cpu():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, 40, generator=g) * 8
    lengths, counts = torch.tensor([40, 17, 0]), torch.tensor([2, 1, 0])
    scores, kept = block_select_reference(s, lengths, counts, 4, 1, 1)
    assert torch.equal(scores, block_scores_batched(s, lengths, 4))
    assert torch.equal(kept, select_blocks_batched(scores, torch.tensor([10, 5, 0]), counts, 1, 1))
    got_scores, got_kept = block_select(s, lengths, counts, 4, 1, 1)
    assert torch.equal(got_scores, scores) and torch.equal(got_kept, kept)
    assert kept[0].sum() == 4 and kept[1].sum() == 3 and not kept[2].any()


# ---------------------------------------------------------------------------- tokens and stats


def test_kept_token_indices_and_stats():
    kept = torch.tensor([True, False, True, True])
    idx = kept_token_indices(kept, 14, 4)  # blocks of 4, the last holds tokens 12, 13
    assert idx.dtype == torch.long
    assert idx.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    stats = PruneStats.from_mask(kept, 14, 4)
    assert stats == PruneStats(kept_blocks=3, total_blocks=4, kept_tokens=10, total_tokens=14)
    assert stats.keep_ratio == pytest.approx(10 / 14) and stats.block_keep_ratio == 0.75
    assert PruneStats.from_mask(torch.tensor([True, True, False, False]), 14, 4).kept_tokens == 8
    total = stats + PruneStats(1, 1, 3, 3)
    assert total == PruneStats(4, 5, 13, 17)
    # 30 layers, 2 of them dense: per-layer average of 14 and 10 attended tokens.
    assert stats.attended_tokens(30, dense_layers=2) == pytest.approx((2 * 14 + 28 * 10) / 30)
    assert stats.kv_bytes(30, 3, 64, 2) == 10 * 30 * 2 * 3 * 64 * 2
    assert PruneStats(0, 0, 0, 0).keep_ratio == 1.0
    assert kept_token_indices(torch.zeros(0, dtype=torch.bool), 0, 4).numel() == 0
    with pytest.raises(ValueError, match="kept must be"):
        kept_token_indices(kept, 20, 4)


@PROPERTY
@given(st.integers(1, 80), st.integers(1, 9), st.data())
def test_kept_token_indices_match_blocks(context_len, page, data):
    n = num_blocks(context_len, page)
    kept = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    idx = kept_token_indices(kept, context_len, page)
    want = [t for t in range(context_len) if kept[t // page]]
    assert idx.tolist() == want
    assert PruneStats.from_mask(kept, context_len, page).kept_tokens == len(want)


# ---------------------------------------------------------------------------- attention

# SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64.
H_Q, H_KV, HEAD_DIM = 9, 3, 64


def _dense_attention(q, k, v, scale):
    """Independent reference: SDPA with the KV heads repeated for GQA."""
    group = q.shape[0] // k.shape[1]
    kr = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # [1, H_q, T, D]
    vr = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q[None, :, None, :], kr, vr, scale=scale)
    return out[0, :, 0, :]


def _qkv(length, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H_Q, HEAD_DIM, generator=g)
    k = torch.randn(length, H_KV, HEAD_DIM, generator=g)
    v = torch.randn(length, H_KV, HEAD_DIM, generator=g)
    return q, k, v


def test_sparse_attention_all_kept_equals_dense():
    q, k, v = _qkv(97, seed=1)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    dense = _dense_attention(q, k, v, scale)
    torch.testing.assert_close(sparse_decode_attention(q, k, v, None, scale), dense, atol=1e-5, rtol=1e-5)
    all_idx = kept_token_indices(torch.ones(num_blocks(97, 16), dtype=torch.bool), 97, 16)
    torch.testing.assert_close(sparse_decode_attention(q, k, v, all_idx, scale), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse_decode_attention(q, k, v), dense, atol=1e-5, rtol=1e-5)  # default scale


@pytest.mark.parametrize("seed", [2, 3])
def test_sparse_attention_equals_dense_on_gathered_tokens(seed):
    context_len, cfg = 203, PruningConfig(page_size=16, sink_blocks=1, recent_blocks=2, min_context=0)
    q, k, v = _qkv(context_len, seed)
    surprisal = torch.rand(context_len, generator=torch.Generator().manual_seed(seed)) * 6
    kept = select_blocks(block_scores(surprisal, cfg.page_size), context_len, 0.5, cfg)
    assert not kept.all()
    idx = kept_token_indices(kept, context_len, cfg.page_size)
    got = sparse_decode_attention(q, k, v, idx, 0.125)
    want = _dense_attention(q, k[idx], v[idx], 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Query head h reads KV head h // 3: changing KV head 0 moves only query heads 0..2.
    k2 = k.clone()
    k2[:, 0] += torch.randn(context_len, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    moved = (sparse_decode_attention(q, k2, v, idx, 0.125) - got).abs().amax(dim=1) > 1e-6
    assert moved.tolist() == [True] * 3 + [False] * 6


def test_sparse_attention_rejects_bad_shapes():
    q, k, v = _qkv(8, seed=4)
    with pytest.raises(ValueError, match="incompatible"):
        sparse_decode_attention(q[:8], k, v)
    with pytest.raises(ValueError, match="kept_token_idx"):
        sparse_decode_attention(q, k, v, torch.tensor([8]))
    with pytest.raises(ValueError, match="no token"):
        sparse_decode_attention(q, k, v, torch.tensor([], dtype=torch.long))
