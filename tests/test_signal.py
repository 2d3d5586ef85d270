"""The entropy sensor: exact and top-k entropies, guarded token stats, entropic time and cost."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sgl_entropic.costs import ModelDims, attention_cost, step_cost
from sgl_entropic.sampling import entropy as controller_entropy
from sgl_entropic.signal import (
    EntropyTrace,
    Scratch,
    entropy_exact,
    entropy_topk,
    token_stats,
    token_stats_reference,
)

TOL = 1e-4
NEG_INF = float("-inf")
# Local, not a loaded profile: a profile would change every other module's hypothesis settings.
PROPERTY = settings(max_examples=60, deadline=None)


@st.composite
def masked_logits(draw, max_batch=4, max_vocab=40):
    """float32 logits `[B, V]` with some -inf entries, every row keeping >= 1 finite entry."""
    batch = draw(st.integers(1, max_batch))
    vocab = draw(st.integers(1, max_vocab))
    values = draw(arrays(np.float32, (batch, vocab), elements=st.floats(-30, 30, width=32)))
    masked = draw(arrays(np.bool_, (batch, vocab)))
    kept = draw(arrays(np.int64, (batch,), elements=st.integers(0, vocab - 1)))
    masked[np.arange(batch), kept] = False
    return torch.from_numpy(np.where(masked, np.float32(NEG_INF), values))


def scipy_entropy(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits.double(), dim=-1).numpy()
    return torch.from_numpy(scipy.stats.entropy(probs, axis=-1))


@PROPERTY
@given(masked_logits(), st.integers(1, 42))
def test_topk_bounds_bracket_exact_entropy(logits, k):
    exact = entropy_exact(logits)
    truncated, lower, upper = entropy_topk(logits, k)
    assert (truncated <= lower + TOL).all()
    assert (lower <= exact + TOL).all()
    assert (exact <= upper + TOL).all()


@PROPERTY
@given(masked_logits())
def test_topk_is_exact_when_k_covers_vocabulary(logits):
    exact = entropy_exact(logits)
    for k in (logits.shape[-1], logits.shape[-1] + 3):
        for estimate in entropy_topk(logits, k):
            torch.testing.assert_close(estimate, exact, atol=TOL, rtol=0)


def test_topk_bounds_ignore_masked_entries_in_tail_size():
    # Two finite tail tokens: r ln((V - k) / r) must use V = 3 finite entries, not 6.
    logits = torch.tensor([[2.0, 0.0, 0.0, NEG_INF, NEG_INF, NEG_INF]])
    probs = torch.softmax(logits[:, :3].double(), dim=-1)[0]
    tail_mass = probs[1:].sum()
    expected_upper = -probs[0] * probs[0].log() + tail_mass * torch.log(2 / tail_mass)
    torch.testing.assert_close(entropy_topk(logits, 1).upper, expected_upper[None].float())
    # A uniform tail attains the upper bound.
    torch.testing.assert_close(entropy_topk(logits, 1).upper, entropy_exact(logits))


def test_topk_rejects_nonpositive_k():
    with pytest.raises(ValueError, match="k must be >= 1"):
        entropy_topk(torch.zeros(1, 4), 0)


@PROPERTY
@given(masked_logits(), st.floats(-100, 100))
def test_exact_entropy_is_shift_invariant(logits, shift):
    shifted = entropy_exact(logits + shift)
    torch.testing.assert_close(shifted, entropy_exact(logits), atol=TOL, rtol=0)


@PROPERTY
@given(masked_logits())
def test_exact_entropy_matches_scipy(logits):
    exact = entropy_exact(logits).double()
    torch.testing.assert_close(exact, scipy_entropy(logits), atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_entropy_computes_in_float32(dtype):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)).to(dtype)
    entropy = entropy_exact(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, entropy_exact(logits.float()))


def test_masked_entries_contribute_nothing_and_single_token_rows_are_certain():
    logits = torch.tensor(
        [
            [1.0, NEG_INF, 1.0, NEG_INF],
            [NEG_INF, 5.0, NEG_INF, NEG_INF],
        ]
    )
    expected = torch.tensor([math.log(2.0), 0.0])
    torch.testing.assert_close(entropy_exact(logits), expected)
    stats = token_stats_reference(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(stats.entropy, expected)
    torch.testing.assert_close(stats.surprisal, torch.tensor([math.log(2.0), 0.0]))
    assert stats.valid.all()
    assert not torch.isnan(stats.entropy).any()


def test_unguarded_entropies_give_nan_without_a_distribution():
    logits = torch.tensor([[float("nan"), 1.0], [float("inf"), 1.0], [NEG_INF, NEG_INF]])
    assert torch.isnan(entropy_exact(logits)).all()
    for estimate in entropy_topk(logits, 1):
        assert torch.isnan(estimate).all()


def test_invalid_rows_are_flagged_and_zeroed():
    good = torch.tensor([0.5, 1.5, -1.0, 0.0])
    rows = {
        "nan": torch.tensor([0.5, float("nan"), -1.0, 0.0]),
        "pos_inf": torch.tensor([0.5, float("inf"), -1.0, 0.0]),
        "all_masked": torch.full((4,), NEG_INF),
        "masked_token": torch.tensor([NEG_INF, 1.5, -1.0, 0.0]),
        "token_out_of_range": good,
        "zero_inv_temperature": good,
        "good": good,
    }
    tokens = torch.tensor([0, 0, 0, 0, 4, 1, 1])
    inv_t = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    stats = token_stats_reference(torch.stack(list(rows.values())), tokens, inv_t)
    assert stats.valid.tolist() == [False] * 6 + [True]
    for field in (stats.entropy, stats.surprisal, stats.lse):
        assert torch.isfinite(field).all()
        assert (field[:6] == 0).all()
    torch.testing.assert_close(stats.entropy[6:], entropy_exact(good[None]))
    torch.testing.assert_close(stats.surprisal[6], -torch.log_softmax(good, dim=-1)[1])


def test_empty_vocabulary_is_invalid_not_an_error():
    stats = token_stats_reference(torch.zeros(2, 0), torch.tensor([0, 0]))
    assert not stats.valid.any()
    assert (stats.entropy == 0).all()


@PROPERTY
@given(masked_logits(), st.data())
def test_token_stats_temperature_matches_scaled_logits(logits, data):
    batch, vocab = logits.shape
    temperature = torch.tensor(
        data.draw(st.lists(st.floats(0.1, 5.0), min_size=batch, max_size=batch)),
        dtype=torch.float32,
    )
    # Tokens are drawn among each row's finite entries: the argmax always is one.
    tokens = logits.argmax(dim=-1)
    stats = token_stats(logits, tokens, 1.0 / temperature)
    # Independent of the implementation: float64 torch.distributions over the scaled logits.
    dist = torch.distributions.Categorical(logits=logits.double() / temperature.double()[:, None])
    assert stats.valid.all()
    torch.testing.assert_close(stats.entropy.double(), dist.entropy(), atol=TOL, rtol=1e-5)
    torch.testing.assert_close(stats.surprisal.double(), -dist.log_prob(tokens), atol=TOL, rtol=1e-5)
    scaled = logits.double() / temperature.double()[:, None]
    torch.testing.assert_close(stats.lse.double(), torch.logsumexp(scaled, dim=-1), atol=TOL, rtol=1e-5)


def test_token_stats_on_a_vocabulary_sized_row_match_float64():
    # The dispatching entry point on a real vocabulary size, against an independent float64 computation.
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1)) * 4
    tokens = torch.tensor([3, 7, int(logits[2].argmax())])
    inv_t = torch.tensor([1.0, 1.0 / 0.7, 1.0 / 1.3])
    stats = token_stats(logits, tokens, inv_t)
    dist = torch.distributions.Categorical(logits=logits.double() * inv_t.double()[:, None])
    torch.testing.assert_close(stats.entropy.double(), dist.entropy(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats.surprisal.double(), -dist.log_prob(tokens), atol=1e-4, rtol=1e-5)


def test_the_scratch_gathers_rows_as_index_select_does_and_gives_back_fresh_memory_past_its_cap(monkeypatch):
    """A verify step's committed rows of the logits, gathered into the reused buffer: equal to index_select for
    gathers that grow and shrink and for another dtype; past the cap, new memory (the buffer is not grown)."""
    import sgl_entropic.signal as signal

    gen = torch.Generator().manual_seed(5)
    scratch = Scratch()
    for rows, index in ((12, [0, 3, 4, 9]), (30, [2, 7, 8, 9, 10, 11, 20, 29]), (6, [5, 1]), (12, [0, 3, 4, 9])):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, 700, generator=gen) * 4).to(dtype)
            picked = torch.tensor(index)
            got = scratch.rows(x, picked)
            assert got.dtype == dtype and torch.equal(got, x.index_select(0, picked))
    kept = scratch._rows
    monkeypatch.setattr(signal, "ROWS_KEPT", 700 * 3)
    x = torch.randn(12, 700, generator=gen)
    big = scratch.rows(x, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(big, x[:4]) and scratch._rows is kept and big.data_ptr() != kept.data_ptr()


def test_the_reused_scratch_gives_the_values_of_fresh_memory():
    """The sampler hook computes into reused buffers (signal.Scratch); batches of every shape, masked and
    broken rows included, must come out as from freshly allocated temporaries, however the buffers were left."""
    gen = torch.Generator().manual_seed(3)
    scratch = Scratch()
    for batch, vocab in ((4, 1000), (2, 3000), (7, 500), (4, 1000)):  # grows, then shorter rows in a larger buffer
        logits = torch.randn(batch, vocab, generator=gen) * 5
        logits[0, : vocab // 2] = -math.inf  # a grammar mask
        logits[1, 3] = math.nan  # no distribution: flagged invalid
        tokens = torch.randint(vocab // 2, vocab, (batch,), generator=gen)
        inv_t = torch.rand(batch, generator=gen) + 0.5
        for inv in (inv_t, None):
            fresh, reused = token_stats(logits, tokens, inv), token_stats(logits, tokens, inv, scratch)
            for a, b in zip(fresh, reused):
                assert torch.equal(a, b)
        torch.testing.assert_close(
            entropy_exact(logits, scratch), entropy_exact(logits), equal_nan=True, rtol=0, atol=0
        )
        temperature = 1.0 / inv_t  # the controller's probe at each row's temperature
        torch.testing.assert_close(
            controller_entropy(logits, temperature, scratch),
            controller_entropy(logits, temperature),
            equal_nan=True,
            rtol=0,
            atol=0,
        )
    copy = scratch.snapshot(logits, inv_t)  # the sampler hook's scaled copy: token_stats' x
    assert torch.equal(copy.nan_to_num(), (logits * inv_t[:, None]).nan_to_num())
    scaled, unscaled = token_stats(copy, tokens, None, scratch), token_stats(logits, tokens, inv_t)
    assert all(torch.equal(a, b) for a, b in zip(scaled, unscaled))
    again = scratch.snapshot(logits.bfloat16(), inv_t)
    assert again.data_ptr() == copy.data_ptr()  # the same memory, step after step, whatever the logits' dtype
    assert torch.equal(again.nan_to_num(), (logits.bfloat16().float() * inv_t[:, None]).nan_to_num())


def test_entropy_trace_accumulates_entropic_time_and_cost():
    trace = EntropyTrace()
    increments = [trace.record(h, s, 1e9) for h, s in [(3, 0.1), (2, 0.2), (2.5, 0.3), (1, 0.4)]]
    assert increments == [0.0, 1.0, 0.0, 1.5]
    assert trace.tau == 2.5
    assert trace.cost == 4e9
    assert trace.efficiency == pytest.approx(2.5 / 4)
    assert trace.entropy == [3, 2, 2.5, 1]
    assert trace.surprisal == [0.1, 0.2, 0.3, 0.4]
    assert trace.last_entropy == 1


def test_entropy_trace_cheap_mode_keeps_totals_only():
    trace = EntropyTrace(keep_lists=False)
    for h in [3, 2, 2.5, 1]:
        trace.record(h, 0.0, 2e9)
    assert (trace.entropy, trace.surprisal) == ([], [])
    assert trace.tau == 2.5
    assert trace.efficiency == pytest.approx(2.5 / 8)


def test_entropy_trace_without_cost_has_zero_efficiency():
    assert EntropyTrace().efficiency == 0.0


def test_step_cost_adds_attention_over_attended_tokens():
    dims = ModelDims(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, dense_flops_per_token=1000.0)
    assert step_cost(dims, 0) == 1000.0
    assert step_cost(dims, 100) == 1000.0 + 4 * 2 * 4 * 8 * 100


def test_attention_cost_counts_qk_pv_flops_and_kv_bytes():
    dims = ModelDims(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, dense_flops_per_token=0.0)
    cost = attention_cost(dims, 4096)
    # SmolLM2-135M at 4k: one sequence's K and V in bf16 are 30 x 3 x 64 x 2 x 2 B x 4096 = 94.4 MB
    assert cost.kv_bytes == 94_371_840
    assert cost.flops == 4 * 30 * 9 * 64 * 4096
    assert attention_cost(ModelDims(30, 9, 3, 64, 0.0, kv_bytes_per_element=4), 4096).kv_bytes == 2 * 94_371_840


def test_model_dims_from_llama_style_config():
    cfg = SimpleNamespace(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
    )
    dims = ModelDims.from_hf_config(cfg)
    assert (dims.num_layers, dims.num_q_heads, dims.num_kv_heads, dims.head_dim) == (2, 4, 2, 8)
    # q, o: 32*32 each; k, v: 32*16 each; MLP: 3*32*64; lm head: 32*100.
    per_layer = 2 * 1024 + 2 * 512 + 6144
    assert dims.dense_flops_per_token == 2 * (2 * per_layer + 3200)


def test_model_dims_explicit_head_dim_and_missing_kv_heads():
    cfg = SimpleNamespace(
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=16,
        hidden_size=32,
        intermediate_size=8,
        vocab_size=10,
    )
    dims = ModelDims.from_hf_config(cfg)
    assert (dims.num_kv_heads, dims.head_dim) == (4, 16)
    assert dims.dense_flops_per_token == 2 * (4 * 32 * 64 + 3 * 32 * 8 + 32 * 10)


def test_sliding_window_layers_read_at_most_their_window():
    """Gemma 3 270M's shape: 15 of 18 layers slide over 512 tokens; a pruned step prunes only the other 3."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = SimpleNamespace(
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_size=640,
        intermediate_size=2048,
        vocab_size=262144,
        layer_types=types * 3,
        sliding_window=512,
    )
    dims = ModelDims.from_hf_config(cfg, kv_bytes_per_element=4)
    assert (dims.sliding_layers, dims.sliding_window) == (15, 512)
    per_token = 4 * 4 * 256
    assert attention_cost(dims, 4096).flops == per_token * (3 * 4096 + 15 * 512)
    assert attention_cost(dims, 100).flops == per_token * 18 * 100  # inside the window every layer reads it all
    pruned = attention_cost(dims, 0.3 * 4096, context=4096)  # the 3 global layers read 30 %
    assert pruned.flops == per_token * (3 * 0.3 * 4096 + 15 * 512)
    assert pruned.kv_bytes == 2 * 256 * 4 * (3 * 0.3 * 4096 + 15 * 512)
    assert step_cost(dims, 4096) == dims.dense_flops_per_token + per_token * (3 * 4096 + 15 * 512)


def test_model_dims_match_llama_3_8b_parameter_count():
    cfg = SimpleNamespace(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    )
    # 8.03e9 parameters, less the 4096 * 128256 input embedding (a lookup, not a matmul).
    matmul_params = 8.03e9 - 4096 * 128256
    flops = ModelDims.from_hf_config(cfg).dense_flops_per_token
    assert flops == pytest.approx(2 * matmul_params, rel=1e-3)


@pytest.mark.parametrize("vocab", [1000, 262144])
def test_the_float32_paths_and_the_controller_s_probe_equal_the_float64_reference(vocab):
    """One reference (signal.token_stats_reference in float64): the eager float32 path, entropy_exact and the
    controller's probe (sampling.entropy at a temperature) stay within 1e-4 nats of it, a flat row included
    (ln V exactly, where the p x form lost up to 7e-4 nats to cancellation at V = 262k)."""
    from sgl_entropic.sampling import entropy as probe

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, vocab, generator=gen) * torch.tensor([[0.01], [1.0], [4.0], [12.0]])
    logits[0] = 0.0  # flat
    logits[2, : vocab // 3] = float("-inf")  # a grammar mask
    tokens = logits.argmax(dim=-1)
    inv_t = torch.tensor([1.0, 1 / 0.7, 1.0, 1 / 1.3])
    want = token_stats_reference(logits, tokens, inv_t, dtype=torch.float64)
    assert want.entropy[0].item() == pytest.approx(math.log(vocab), abs=1e-6)
    got = token_stats_reference(logits, tokens, inv_t)
    for name in ("entropy", "surprisal", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(probe(logits, 1 / inv_t), want.entropy, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(entropy_exact(logits * inv_t[:, None]), want.entropy, atol=1e-4, rtol=1e-6)
