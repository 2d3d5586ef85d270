"""The Triton block-select kernel equals sgl_entropic.pruning.block_select_reference.

With aggregate="max" (the default) scores and masks are equal bit for bit. With "mean"/"sum"
the scores agree up to fp32 summation order, and the mask equals select_blocks_batched of the
kernel's own scores exactly.

On CPU the kernel runs under the Triton interpreter. TRITON_INTERPRET=1 must be set before
triton is imported, and this pytest process may already have imported it, so the CPU test
runs this file as a script in a fresh interpreter process.
"""

import os
import subprocess
import sys

import pytest
import torch

from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import (
    AGGREGATES,
    block_select,
    block_select_reference,
    plan_keep_counts,
    select_blocks_batched,
)

NAN, INF = float("nan"), float("inf")


def edge_case_batch(width: int, page_size: int, device: str = "cpu"):
    """Rows that stress the kernel: non-finite surprisal, ties, -0.0, empty and partial rows."""
    generator = torch.Generator().manual_seed(width * 31 + page_size)
    s = torch.rand(7, width, generator=generator) * 8.0
    s[0, 3] = NAN  # unknown: its block must be kept at any keep count
    s[0, width // 2] = INF
    s[1] = torch.round(s[1])  # many ties at the threshold
    s[2, 5:] = -0.0  # negative zero next to +0.0
    s[2, : width // 2] = 0.0
    s[3, width // 3] = -INF
    s[3, -1] = NAN  # past its length: ignored
    s[5] = 1.0  # all equal
    lengths = torch.tensor([width, width - 1, width // 2 + 1, width - 2, 0, width, 1])
    n = -(-lengths // page_size)
    # 0 (keep only +inf), 1, a middle count, > candidates (keep all), negative.
    keep_counts = torch.tensor([1, 2, 3, 0, 2, 1, 5])
    keep_counts[3] = (n[3] // 2).item()
    keep_counts[5] = 10**6
    keep_counts[6] = -3
    return s.to(device), lengths.to(device), keep_counts.to(device)


def assert_matches_reference(surprisal, lengths, keep_counts, page_size, sink, recent, aggregate, **options):
    from sgl_entropic.kernels.block_select import block_select_triton

    scores, kept = block_select_triton(surprisal, lengths, keep_counts, page_size, sink, recent, aggregate, **options)
    want_scores, want_kept = block_select_reference(surprisal, lengths, keep_counts, page_size, sink, recent, aggregate)
    assert kept.dtype == torch.bool and kept.shape == want_kept.shape
    if aggregate == "max":
        assert torch.equal(scores, want_scores)
        assert torch.equal(kept, want_kept)
    else:
        torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-6)
        n = -(-lengths.long() // page_size)
        assert torch.equal(kept, select_blocks_batched(scores, n, keep_counts, sink, recent))
    return scores, kept


def check_under_interpreter() -> None:
    for width, page_size in ((29, 3), (40, 4), (33, 16), (12, 1)):
        surprisal, lengths, keep_counts = edge_case_batch(width, page_size)
        # Small tiles split every row into several score and selection iterations. The guards
        # only matter to the selection, which does not depend on the aggregate.
        cases = [(aggregate, 1, 2) for aggregate in AGGREGATES] + [("max", 0, 1), ("max", 3, 3)]
        for aggregate, sink, recent in cases:
            assert_matches_reference(
                surprisal, lengths, keep_counts, page_size, sink, recent, aggregate, block_nb=2, block_sel=8
            )
        # Default tiles, bf16 input, and a strided (non-contiguous) batch view.
        _, kept = assert_matches_reference(surprisal, lengths, keep_counts, page_size, 1, 2, "max")
        assert kept[0, 3 // page_size] and kept[0, (width // 2) // page_size]  # NaN and +inf blocks
        assert not kept[4].any()
        assert_matches_reference(surprisal.bfloat16(), lengths, keep_counts, page_size, 1, 2, "max")
        assert_matches_reference(surprisal[::2], lengths[::2], keep_counts[::2], page_size, 1, 1, "mean", block_sel=8)
    # The NaN and +inf blocks survive the tightest budget.
    surprisal, lengths, keep_counts = edge_case_batch(40, 4)
    _, kept = assert_matches_reference(surprisal, lengths, torch.zeros_like(keep_counts), 4, 0, 1, "max")
    assert kept[0].nonzero().flatten().tolist() == [0, 5, 9]
    # Empty batch and zero width.
    empty_scores, empty_kept = assert_matches_reference(
        torch.zeros(0, 10), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4, 1, 1, "max"
    )
    assert empty_scores.shape == (0, 3) and empty_kept.shape == (0, 3)
    assert_matches_reference(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), torch.ones(2), 4, 1, 1, "max")


def test_kernel_matches_reference_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kernel_rejects_bad_input():
    from sgl_entropic.kernels.block_select import block_select_triton

    with pytest.raises(ValueError, match="aggregate"):
        block_select_triton(torch.zeros(1, 4), torch.tensor([4]), torch.tensor([1]), 2, 1, 1, "median")
    with pytest.raises(ValueError, match="lengths"):
        block_select_triton(torch.zeros(1, 4), torch.tensor([5]), torch.tensor([1]), 2, 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("width", [1024, 8192])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_on_gpu(width, batch, aggregate, dtype):
    cfg = PruningConfig(page_size=16, sink_blocks=1, recent_blocks=2, min_keep_ratio=0.1, min_context=256)
    generator = torch.Generator(device="cuda").manual_seed(width + batch)
    surprisal = torch.rand(batch, width, device="cuda", generator=generator) * 10.0
    if batch > 1:
        surprisal[1] = torch.round(surprisal[1] * 2) / 2  # ties
        surprisal[2, 100] = NAN
    lengths = torch.randint(1, width + 1, (batch,), device="cuda", generator=generator)
    lengths[0] = width
    entropies = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 6.0
    _, keep_counts = plan_keep_counts(lengths.cpu(), entropies, cfg)
    surprisal = surprisal.to(dtype)
    scores, kept = assert_matches_reference(
        surprisal, lengths, keep_counts.cuda(), cfg.page_size, cfg.sink_blocks, cfg.recent_blocks, aggregate
    )
    # The public entry point dispatches to the kernel on CUDA.
    got_scores, got_kept = block_select(
        surprisal, lengths, keep_counts.cuda(), cfg.page_size, cfg.sink_blocks, cfg.recent_blocks, aggregate
    )
    assert torch.equal(got_scores, scores) and torch.equal(got_kept, kept)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
    check_under_interpreter()
