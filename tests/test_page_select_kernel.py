"""The Triton page-select kernel equals its torch reference (kernels/page_select.py): the scores up
to fp32 summation order, the compact page lists exactly those the reference selection makes from
the kernel's own scores, and the planner's compact layout (the FlashInfer slot list) agrees.

On CPU the kernel runs under the Triton interpreter. TRITON_INTERPRET=1 must be set before triton
is imported, and this pytest process may already have imported it, so the CPU test runs this file
as a script in a fresh interpreter process. The GPU tests run at real sizes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import PageLayout, row_pages


def make_case(batch, heads_q, heads_kv, dim, pool_pages, lengths, entropies, cfg, device="cpu", dtype=torch.float32,
              seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    kmin = torch.randn(pool_pages, heads_kv, dim, generator=gen)
    kmax = kmin + torch.rand(pool_pages, heads_kv, dim, generator=gen)
    if ties:  # pages with identical metadata: equal scores, the lower page must win
        kmin[1::2], kmax[1::2] = kmin[0], kmax[0]
    q = torch.randn(batch, heads_q, dim, generator=gen)
    rows = [row_pages(n, h, cfg) for n, h in zip(lengths, entropies)]
    width = max(r.n for r in rows)
    table = torch.stack([torch.randperm(pool_pages, generator=gen)[:width] for _ in range(batch)])
    host = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    counts = [host([getattr(r, f) for r in rows]) for f in ("n", "sink", "recent", "keep")]
    indptr = torch.cat([host([0]), host([r.sink + r.keep + r.recent for r in rows]).cumsum(0)])
    move = lambda t, dt=None: t.to(device=device, dtype=dt or t.dtype)  # noqa: E731
    return (move(q, dtype), move(kmin, dtype), move(kmax, dtype), move(table), *(move(c) for c in counts),
            move(indptr)), rows


def check(args, rows):
    from sgl_entropic.kernels.page_select import page_select_from_scores, page_select_reference, page_select_triton

    q, kmin, kmax, table, n, sink, recent, keep, indptr = args
    scores, pages = page_select_triton(*args, block_n=16)
    want_scores, want_pages = page_select_reference(q.float(), kmin.float(), kmax.float(), table, n, sink, recent, keep)
    torch.testing.assert_close(scores.cpu(), want_scores.cpu(), atol=1e-4, rtol=1e-5)
    assert torch.equal(pages.cpu(), page_select_from_scores(scores.cpu(), table.cpu(), n.cpu(), sink.cpu(),
                                                            recent.cpu(), keep.cpu()))
    # the planner's layout on the same scores yields the same compact list (the FlashInfer page list)
    layout = PageLayout.build(rows, table.long().cpu())
    logical, _ = layout.select(scores.cpu())
    assert torch.equal(layout.physical(logical).flatten()[layout.compact_cells].int(), pages.cpu())
    return pages


def check_under_interpreter() -> None:
    cfg = PruningConfig(page_size=16, min_context=64, min_keep_ratio=0.2, max_keep_ratio=0.7)
    # rows: long and pruned, short (keeps all), tiny (guards only), empty-candidate
    lengths, entropies = [1500, 300, 20, 40], [0.5, 3.0, 1.0, float("nan")]
    for heads in ((6, 2), (9, 3), (4, 4)):
        args, rows = make_case(4, *heads, 16, 400, lengths, entropies, cfg)
        check(args, rows)
    args, rows = make_case(2, 6, 2, 16, 300, [1200, 900], [0.1, 0.1], cfg, ties=True)
    check(args, rows)
    args, rows = make_case(2, 6, 2, 16, 300, [1200, 900], [0.1, 0.1], cfg, dtype=torch.bfloat16)
    check(args, rows)


def test_kernel_matches_reference_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compact_tokens_are_the_slots_the_cpu_path_reads():
    # The FlashInfer plan's slot list (compact pages, expanded, the last page cut to its length)
    # must be exactly the slots the CPU path's token mask admits.
    cfg = PruningConfig(page_size=16, min_context=64, min_keep_ratio=0.3, max_keep_ratio=0.3)
    rows = [row_pages(n, 1.0, cfg) for n in (1000, 333, 70)]
    width = max(r.n for r in rows)
    table = torch.stack([torch.randperm(200, generator=torch.Generator().manual_seed(i))[:width] for i in range(3)])
    layout = PageLayout.build(rows, table)
    logical, valid = layout.select(torch.randn(3, width, generator=torch.Generator().manual_seed(5)))
    compact_pages = layout.physical(logical).flatten()[layout.compact_cells]
    flat = (compact_pages[:, None] * 16 + torch.arange(16)).flatten()[layout.compact_tokens]
    # independently: each row's valid cells, expanded, the row cut to its length
    want = []
    for b, r in enumerate(rows):
        pages = [int(table[b, j]) for j, ok in zip(logical[b].tolist(), valid[b].tolist()) if ok]
        want += [p * 16 + o for p in pages for o in range(16)][: r.kept_tokens]
    assert flat.tolist() == want
    assert [len(p) for p in layout.kept_pages(logical)] == [r.sink + r.keep + r.recent for r in rows]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,context", [(1, 32768), (64, 32768), (64, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_gpu_at_real_sizes(batch, context, dtype):
    cfg = PruningConfig(page_size=16, min_context=1024, min_keep_ratio=0.2, max_keep_ratio=0.6)
    lengths = [context - 37 * i for i in range(batch)]
    entropies = [(i % 7) * 0.8 for i in range(batch)]
    pool = batch * (context // 16 + 1) + 16
    args, rows = make_case(batch, 32, 8, 128, pool, lengths, entropies, cfg, device="cuda", dtype=dtype, seed=batch)
    pages = check(args, rows)
    assert pages.numel() == int(args[-1][-1])


def time_kernel(batch: int, context: int, heads_q: int = 32, heads_kv: int = 8, dim: int = 128, reps: int = 50):
    """(ms per call, GB/s of page metadata read) on CUDA; the metadata is what the kernel must read."""
    from sgl_entropic.kernels.page_select import page_select_triton

    cfg = PruningConfig(page_size=16, min_context=1024, min_keep_ratio=0.3, max_keep_ratio=0.3)
    pool = batch * (context // 16 + 1) + 16
    args, rows = make_case(batch, heads_q, heads_kv, dim, pool, [context] * batch, [1.0] * batch, cfg,
                           device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        page_select_triton(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        page_select_triton(*args)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    meta_bytes = batch * (context // 16) * heads_kv * dim * 2 * 2  # kmin + kmax, bf16
    return ms, meta_bytes / (ms / 1e3) / 1e9


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        for b, c in ((1, 32768), (64, 4096), (64, 32768)):
            ms, gbs = time_kernel(b, c)
            print(f"page_select B={b} context={c} H_q=32 H_kv=8 D=128: {ms:.3f} ms, {gbs:.0f} GB/s of metadata")
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
        check_under_interpreter()
