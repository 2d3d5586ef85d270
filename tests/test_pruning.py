"""The meso loop's core: the entropy budget, page counts with guards, the page scores (query bound and
surprisal), the canonical selection and layout, and attention over gathered pages."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import (
    DEFAULT_REFERENCE_ENTROPY,
    StepPlan,
    all_pages,
    attend_layer,
    keep_ratio,
    num_pages,
    quest_bounds,
    reference_entropy_for_vocab,
    row_pages,
    sparse_decode_attention,
    surprisal_scores,
)

INF = float("inf")
NAN = float("nan")
# Local, not a loaded profile: a profile would change every other module's hypothesis settings.
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


# ---------------------------------------------------------------------------- the entropy budget


@st.composite
def pruning_configs(draw, page_size=None, min_context=None):
    lo = draw(st.floats(0.01, 1.0))
    hi = draw(st.floats(lo, 1.0))
    return PruningConfig(
        shortlist_ratio=draw(st.none() | st.floats(hi, 1.0)),
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
    cfg = PruningConfig(min_keep_ratio=0.2, max_keep_ratio=0.8, shortlist_ratio=None, entropy_floor=0.0)
    assert keep_ratio(0.0, cfg, 4.0) == pytest.approx(0.2)  # floor 0: the guard is off
    assert keep_ratio(1.0, cfg, 4.0) == pytest.approx(0.35)
    assert keep_ratio(2.0, cfg, 4.0) == pytest.approx(0.5)
    assert keep_ratio(4.0, cfg, 4.0) == 0.8
    assert keep_ratio(40.0, cfg, 4.0) == 0.8
    assert keep_ratio(INF, cfg, 4.0) == 0.8
    assert keep_ratio(NAN, cfg, 4.0) == 0.8  # unknown entropy: conservative
    floored = PruningConfig(min_keep_ratio=0.2, max_keep_ratio=0.8, shortlist_ratio=None, entropy_floor=1.0)
    assert keep_ratio(0.0, floored, 4.0) == keep_ratio(1.0, floored, 4.0) == pytest.approx(0.35)
    assert keep_ratio(2.0, floored, 4.0) == pytest.approx(0.5)
    assert keep_ratio(0.5, PruningConfig(), DEFAULT_REFERENCE_ENTROPY) == keep_ratio(0.5, PruningConfig())
    assert reference_entropy_for_vocab(49152) == pytest.approx(math.log(49152) / 2)
    for bad in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match="reference_entropy"):
            keep_ratio(1.0, cfg, bad)


# ---------------------------------------------------------------------------- page counts


@PROPERTY
@given(pruning_configs(), st.integers(1, 400), ENTROPIES)
def test_row_pages_guards_and_budget(cfg, length, entropy):
    r = row_pages(length, entropy, cfg)
    assert r.n == num_pages(length, cfg.page_size) == r.sink + r.candidates + r.recent
    assert r.recent == min(cfg.recent_blocks, r.n) >= 1 and r.sink <= cfg.sink_blocks
    if length < cfg.min_context:
        assert r.keep == r.shortlist == r.candidates and not r.prunes
    else:
        assert r.keep == min(r.candidates, math.ceil(keep_ratio(entropy, cfg) * r.candidates))
        ratio = cfg.shortlist_ratio
        assert r.shortlist == (
            r.keep if ratio is None else max(r.keep, min(r.candidates, math.ceil(ratio * r.candidates)))
        )
    assert r.keep <= r.shortlist <= r.candidates
    # dropped pages are whole candidate pages; the partial last page is never dropped
    assert r.kept_tokens == length - (r.candidates - r.keep) * cfg.page_size


def test_row_pages_by_hand():
    cfg = PruningConfig(
        page_size=16, sink_blocks=1, recent_blocks=2, min_keep_ratio=0.25, max_keep_ratio=0.25, min_context=1024
    )
    r = row_pages(4000, 1.0, cfg)  # 250 pages: 1 sink, 2 recent, 247 candidates, keep ceil(61.75) = 62
    assert (r.n, r.sink, r.recent, r.candidates, r.keep) == (250, 1, 2, 247, 62)
    assert r.shortlist == 124  # the default shortlist: ceil(0.5 * 247)
    assert r.kept_tokens == 4000 - 185 * 16
    assert not row_pages(1000, 1.0, cfg).prunes  # below min_context
    tiny = row_pages(20, 1.0, cfg.model_copy(update={"min_context": 0}))  # 2 pages: both recent
    assert (tiny.sink, tiny.recent, tiny.keep, tiny.kept_tokens) == (0, 2, 0, 20)


# ---------------------------------------------------------------------------- page scores


def test_the_bound_by_hand_and_upper_bound():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 8, generator=g)  # 6 query heads over 2 KV heads
    keys = torch.randn(2, 5, 16, 2, 8, generator=g)  # [B, pages, tokens, H_kv, D]
    kmin, kmax = keys.amin(dim=2), keys.amax(dim=2)
    got = quest_bounds(q, kmin, kmax, per_head=False)[:, 0]
    for b in range(2):
        for p in range(5):
            want = sum(
                max(
                    float(
                        sum(
                            max(q[b, h * 3 + g_, d] * kmax[b, p, h, d], q[b, h * 3 + g_, d] * kmin[b, p, h, d])
                            for d in range(8)
                        )
                    )
                    for g_ in range(3)
                )
                for h in range(2)
            )
            assert float(got[b, p]) == pytest.approx(want, rel=1e-5, abs=1e-5)
            # the bound of each KV head is at least every true logit of its query group on the page
            logits = torch.einsum("hgd,thd->hgt", q[b].view(2, 3, 8), keys[b, p])
            assert float(logits.amax(dim=(1, 2)).sum()) <= float(got[b, p]) + 1e-5


def test_surprisal_scores_hand_examples():
    s = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    lens = torch.tensor([7])
    assert surprisal_scores(s, lens, 3, "max").tolist() == [[3.0, 6.0, 7.0]]
    assert surprisal_scores(s, lens, 3, "mean").tolist() == [[2.0, 5.0, 7.0]]  # partial page: its own tokens
    assert surprisal_scores(s, lens, 3, "sum").tolist() == [[6.0, 15.0, 7.0]]
    assert surprisal_scores(s, torch.tensor([4]), 3, "max").tolist() == [[3.0, 4.0, -INF]]  # past the length
    for bad in (NAN, INF, -INF):
        assert surprisal_scores(torch.tensor([[1.0, bad, 0.5, 0.2]]), torch.tensor([4]), 2)[0, 0] == INF
    with pytest.raises(ValueError, match="aggregate"):
        surprisal_scores(s, lens, 2, "median")


# ---------------------------------------------------------------------------- selection and layout


@PROPERTY
@given(pruning_configs(page_size=4), st.lists(st.integers(1, 120), min_size=1, max_size=4), ENTROPIES)
def test_a_step_plan_fixes_the_sink_and_recent_pages_and_masks_the_rest(cfg, lengths, entropy):
    rows = [row_pages(n, entropy, cfg) for n in lengths]
    width = max(r.n for r in rows)
    table = torch.stack(
        [torch.randperm(1000, generator=torch.Generator().manual_seed(i))[:width] for i in range(len(rows))]
    )
    plan = StepPlan.build(rows, table)
    for b, r in enumerate(rows):
        fixed = list(range(r.sink)) + list(range(r.n - r.recent, r.n))
        assert plan.fixed_pages[b, : len(fixed)].tolist() == [int(table[b, j]) for j in fixed]
        tokens = plan.fixed_tokens[b].sum(dim=-1).tolist()
        assert sum(tokens) == sum(min(4, r.length - 4 * j) for j in fixed)  # the last page: its real tokens
        assert plan.candidate[b].nonzero().flatten().tolist() == list(range(r.sink, r.n - r.recent))
        assert plan.shortlist_valid[b].sum() == r.shortlist and plan.keep_valid[b].sum() == r.keep


def test_attended_fractions_count_dense_layers():
    cfg = PruningConfig(page_size=16, min_keep_ratio=0.25, max_keep_ratio=0.25, min_context=0)
    rows = [row_pages(4000, 1.0, cfg), row_pages(500, 1.0, cfg)]
    plan = StepPlan.build(rows, torch.zeros(2, 250, dtype=torch.long))
    kept = [r.kept_tokens / r.length for r in rows]
    assert plan.attended_fractions(1.0) == pytest.approx(kept)
    assert plan.attended_fractions(28 / 30) == pytest.approx([1 - 28 / 30 * (1 - k) for k in kept])


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
    torch.testing.assert_close(sparse_decode_attention(q, k, v, torch.arange(97), scale), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse_decode_attention(q, k, v), dense, atol=1e-5, rtol=1e-5)  # default scale


def test_attention_over_a_plan_equals_dense_attention_over_its_pages():
    """attend_layer over given pages (the surprisal selector's `chosen`) and over every page (the dense
    kernel) is exact attention over those pages' tokens, row by row, ragged rows padded and masked."""
    g = torch.Generator().manual_seed(7)
    p, pool_pages = 16, 64
    k_cache = torch.randn(pool_pages * p, H_KV, HEAD_DIM, generator=g)
    v_cache = torch.randn(pool_pages * p, H_KV, HEAD_DIM, generator=g)
    cfg = PruningConfig(page_size=p, min_keep_ratio=0.4, max_keep_ratio=0.4, min_context=0)
    q = torch.randn(3, H_Q, HEAD_DIM, generator=g)
    table = torch.stack([torch.randperm(pool_pages, generator=g)[:19] for _ in range(3)])
    for rows in ([row_pages(n, 1.0, cfg) for n in (300, 170, 45)], [all_pages(n, p) for n in (300, 170, 45)]):
        plan = StepPlan.build(rows, table)
        chosen = []
        for r in rows:
            pages = torch.randperm(r.candidates, generator=g)[: r.keep] + r.sink
            chosen.append(pages.tolist() + [0] * (plan.keep_valid.shape[1] - r.keep))
        plan.chosen = torch.tensor(chosen, dtype=torch.long)[:, None]
        out, kept = attend_layer(q, k_cache, v_cache, plan, None, None, 0.125)
        for b, r in enumerate(rows):
            logical = list(range(r.sink)) + plan.chosen[b, 0, : r.keep].tolist() + list(range(r.n - r.recent, r.n))
            slots = (table[b, : r.n, None] * p + torch.arange(p)).flatten()[: r.length]  # the row's context
            tokens = [t for j in sorted(logical) for t in range(j * p, min(r.length, (j + 1) * p))]
            want = _dense_attention(q[b], k_cache[slots][tokens], v_cache[slots][tokens], 0.125)
            torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)


def test_sparse_attention_rejects_bad_shapes():
    q, k, v = _qkv(8, seed=4)
    with pytest.raises(ValueError, match="incompatible"):
        sparse_decode_attention(q[:8], k, v)
    with pytest.raises(ValueError, match="kept_token_idx"):
        sparse_decode_attention(q, k, v, torch.tensor([8]))
    with pytest.raises(ValueError, match="no token"):
        sparse_decode_attention(q, k, v, torch.tensor([], dtype=torch.long))
