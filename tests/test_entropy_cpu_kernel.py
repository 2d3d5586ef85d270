"""The compiled CPU kernels (kernels/entropy_cpu.py) equal sgl_entropic.signal's eager references, and the
signal's entry points use them on CPU. scripts/setup.sh builds them; a machine without them skips this module."""

import math
import os

import pytest
import torch

from sgl_entropic.kernels import entropy_cpu
from sgl_entropic.signal import TokenStats, entropy_exact, token_stats, token_stats_reference
from tests.logit_cases import edge_case_batch

COMPILED = entropy_cpu.load()
# scripts/setup.sh builds them, so CI (which runs it) fails rather than skips when they are missing
pytestmark = pytest.mark.skipif(
    COMPILED is None and not os.environ.get("CI"), reason="not built here: python -m sgl_entropic.cpu kernels"
)


@pytest.mark.parametrize("vocab", [1000, 49152, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_stats_equal_the_reference_on_edge_rows(vocab, dtype):
    logits, tokens, inv_temperature, valid = edge_case_batch(vocab, dtype)
    for rows in (slice(0, 8), slice(0, 1), slice(3, 4)):  # a batch, and one row (compiled apart)
        got = TokenStats(*COMPILED.token_stats(logits[rows].float().contiguous(), tokens[rows], inv_temperature[rows]))
        want = token_stats_reference(logits[rows], tokens[rows], inv_temperature[rows], dtype=torch.float64)
        assert got.valid.tolist() == want.valid.tolist() == valid[rows]
        for name in ("entropy", "surprisal", "lse"):
            torch.testing.assert_close(
                getattr(got, name), getattr(want, name), atol=1e-4, rtol=1e-5, msg=lambda m: f"{name}: {m}"
            )
            assert torch.isfinite(getattr(got, name)).all()


def test_the_signal_uses_the_compiled_kernel_on_cpu_and_it_matches_float64():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 262144, generator=gen) * 4
    logits[1, :1000] = -math.inf  # a grammar mask
    tokens = torch.tensor([11, 2000, int(logits[2].argmax())])
    inv_t = torch.tensor([1.0, 1 / 0.7, 1 / 1.3])
    stats = token_stats(logits, tokens, inv_t)
    assert torch.equal(stats.entropy, COMPILED.token_stats(logits, tokens, inv_t)[0])
    dist = torch.distributions.Categorical(logits=logits.double() * inv_t.double()[:, None])
    torch.testing.assert_close(stats.entropy.double(), dist.entropy(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats.surprisal.double(), -dist.log_prob(tokens), atol=1e-4, rtol=1e-5)


def test_the_compiled_entropy_keeps_nan_for_rows_without_a_distribution():
    # The controller holds its temperature on a NaN probe (sampling.update_temperature).
    logits = torch.tensor(
        [
            [float("nan"), 1.0, 0.0],
            [float("inf"), 1.0, 0.0],
            [-math.inf] * 3,
            [0.0, -math.inf, 0.0],
            [3.0, -math.inf, -math.inf],
        ]
    )
    h = entropy_exact(logits)
    assert torch.equal(h.nan_to_num(), COMPILED.entropy(logits, torch.ones(5)).nan_to_num())
    assert torch.isnan(h[:3]).all()
    torch.testing.assert_close(h[3:], torch.tensor([math.log(2.0), 0.0]))


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_a_flat_row_at_any_temperature_measures_ln_v(vocab):
    # A sum of e * x less m * s cancels to a few 1e-4 nats at 262k in the kernel's lane-wise sum; e * (x - m) not.
    logits = torch.full((2, vocab), 3.25)
    inv_t = torch.tensor([1 / 1.7, 1 / 0.3])
    stats = COMPILED.token_stats(logits, torch.tensor([0, vocab - 1]), inv_t)
    assert stats[0].tolist() == pytest.approx([math.log(vocab)] * 2, rel=1e-6)
    assert COMPILED.entropy(logits / 1.7, torch.ones(2)).tolist() == pytest.approx([math.log(vocab)] * 2, rel=1e-6)
