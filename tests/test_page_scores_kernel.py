"""The Triton kernels of the two selection stages (kernels/page_scores.py) equal their torch references:
the page bounds (per KV head and summed) and the per-page log-sum-exp of the shortlist's logits, up to
fp32 summation order.

On CPU the kernels run under the Triton interpreter. TRITON_INTERPRET=1 must be set before triton is
imported, and this pytest process may already have imported it, so the CPU test runs this file as a
script in a fresh interpreter process. The GPU tests run at real sizes; `--time` (scripts/gpu_check.sh)
times them against the device's memory bandwidth."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch


def make_case(
    batch,
    heads_q,
    heads_kv,
    dim,
    context,
    lists=1,
    shortlist_share=0.5,
    page_size=16,
    device="cpu",
    dtype=torch.float32,
    seed=0,
):
    """Rows of `context` tokens on scattered pages of one pool: q, the store's min/max, the KV cache, page
    tables, and a shortlist of pages per list."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // page_size)
    pool = batch * pages + 1
    kmin = torch.randn(pool, heads_kv, dim, generator=gen)
    kmax = kmin + torch.rand(pool, heads_kv, dim, generator=gen)
    k_cache = torch.randn(pool * page_size, heads_kv, dim, generator=gen)
    q = torch.randn(batch, heads_q, dim, generator=gen)
    order = torch.randperm(pool, generator=gen)
    table = order[: batch * pages].view(batch, pages)
    short = max(1, int(shortlist_share * pages))
    shortlist = torch.stack(
        [
            torch.stack([table[b, torch.randperm(pages, generator=gen)[:short]] for _ in range(lists)])
            for b in range(batch)
        ]
    )  # each list (row, or row and KV head) its own pages
    move = lambda t, dt=None: t.to(device=device, dtype=dt or t.dtype)  # noqa: E731
    return (
        move(q, dtype),
        move(kmin, dtype),
        move(kmax, dtype),
        move(k_cache, dtype),
        move(table, torch.int32),
        move(shortlist),
    )


def check(case, page_size=16, scale=0.125):
    from sgl_entropic.kernels.page_scores import (
        page_bounds_reference,
        page_bounds_triton,
        page_lse_reference,
        page_lse_triton,
    )

    q, kmin, kmax, k_cache, table, shortlist = case
    for per_head in (False, True):
        got = page_bounds_triton(q, kmin, kmax, table, per_head)
        want = page_bounds_reference(q.float(), kmin.float(), kmax.float(), table, per_head)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(
        page_lse_triton(q, k_cache, shortlist, page_size, scale),
        page_lse_reference(q.float(), k_cache.float(), shortlist, page_size, scale),
        atol=2e-3,
        rtol=1e-4,
    )


def check_strided_tables() -> None:
    """Page tables whose rows are strided (a slice of a wider table) or whose entries are (a transpose)."""
    from sgl_entropic.kernels.page_scores import page_bounds_reference, page_bounds_triton

    q, kmin, kmax, _, table, _ = make_case(3, 6, 2, 16, 300)
    width = table.shape[1]
    sliced = torch.cat([table, table.flip(1)], dim=1)[:, :width]
    transposed = table.t().contiguous().t()
    for t in (sliced, transposed):
        assert not t.is_contiguous()
        torch.testing.assert_close(
            page_bounds_triton(q, kmin, kmax, t, False),
            page_bounds_reference(q, kmin, kmax, table, False),
            atol=2e-3,
            rtol=1e-4,
        )


def selection_case(lengths, heads_q, heads_kv, dim, per_head, page_size=16, seed=7):
    """tests/test_gpu_path.py's parity case at any size: peaky queries (logits of std 3), rows of the given
    lengths on scattered pages of one pool, the store's key min/max per page."""
    from sgl_entropic.config import PruningConfig
    from sgl_entropic.pruning import StepPlan, row_pages

    cfg = PruningConfig(
        min_context=0,
        per_head=per_head,
        page_size=page_size,
        max_keep_ratio=0.2,
        min_keep_ratio=0.2,
        shortlist_ratio=0.5,
    )
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // page_size)
    pool = len(lengths) * width + 1
    k = torch.randn(pool * page_size, heads_kv, dim, generator=gen)
    v = torch.randn(pool * page_size, heads_kv, dim, generator=gen)
    pages = k.view(pool, page_size, heads_kv, dim)
    rows = [row_pages(n, math.nan, cfg) for n in lengths]
    table = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in rows])
    q = 3.0 * torch.randn(len(rows), heads_q, dim, generator=gen)
    plan = StepPlan.build(rows, table, per_head=per_head)
    assert plan.two_stage
    return plan, q, k, v, pages.amin(dim=1), pages.amax(dim=1)


def check_selection(lengths, heads_q, heads_kv, dim, per_head, device, dtype=torch.float32, page_size=16) -> int:
    """The CUDA path's selection (`pruning.select_pages` on the Triton kernels, on `device`) keeps, row by row
    and list by list, the pages the CPU kernel (`pruning.attend_rows`, on the CPU) keeps on the same KV.
    Returns the number of lists compared."""
    from sgl_entropic.kernels.page_scores import TRITON_STAGES
    from sgl_entropic.pruning import StepPlan, attend_rows, select_pages

    plan, q, k, v, kmin, kmax = selection_case(lengths, heads_q, heads_kv, dim, per_head, page_size)
    q, k, v, kmin, kmax = (t.to(dtype) for t in (q, k, v, kmin, kmax))
    scale = dim**-0.5
    _, cpu_kept = attend_rows(q, k, v, plan, kmin, kmax, scale)
    on = lambda t: t.to(device)  # noqa: E731
    device_plan = StepPlan.build(plan.rows, on(plan.page_table), per_head=per_head)
    kept = select_pages(
        TRITON_STAGES, on(q), on(k), on(kmin), on(kmax), device_plan, device_plan.page_table.to(torch.int32), scale
    ).cpu()
    assert kept.shape == cpu_kept.shape
    differ = [
        (b, lst)
        for b, r in enumerate(plan.rows)
        for lst in range(kept.shape[1])
        if sorted(kept[b, lst, : r.keep].tolist()) != sorted(cpu_kept[b, lst, : r.keep].tolist())
    ]
    assert not differ, f"lists whose kept pages differ (row, list): {differ}"
    return len(plan.rows) * kept.shape[1]


def check_under_interpreter() -> None:
    for heads in ((6, 2), (9, 3), (4, 4)):
        for lists in (1, heads[1]):
            check(make_case(3, *heads, 16, 300, lists=lists))
    check(make_case(2, 6, 2, 16, 200, dtype=torch.bfloat16))
    check(make_case(2, 6, 2, 16, 200, page_size=8), page_size=8)
    check_strided_tables()
    for per_head in (False, True):
        check_selection((900, 1700, 1333), 9, 3, 64, per_head, "cpu")


def test_a_page_size_that_is_not_a_power_of_two_is_refused_by_the_kernel():
    from sgl_entropic.kernels.page_scores import page_lse_triton

    q, _, _, k_cache, _, shortlist = make_case(1, 6, 2, 16, 300, page_size=12)
    with pytest.raises(ValueError, match="power of two"):
        page_lse_triton(q, k_cache, shortlist, 12, 0.25)


def test_kernels_match_their_references_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,context", [(1, 32768), (64, 4096), (16, 32768)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_their_references_on_gpu_at_real_sizes(batch, context, dtype):
    check(
        make_case(batch, 32, 8, 128, context, lists=8, shortlist_share=0.1, device="cuda", dtype=dtype, seed=batch),
        scale=128**-0.5,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gpu_keeps_the_pages_the_cpu_kernel_keeps_at_real_sizes(per_head, dtype):
    check_selection((4096, 9000, 16384, 32768, 2500, 12000, 20000, 7000), 32, 8, 128, per_head, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [1, 8, 32, 64])
def test_kernels_match_their_references_on_gpu_at_other_page_sizes(page_size):
    check(
        make_case(
            8, 32, 8, 128, 8192, lists=8, shortlist_share=0.1, device="cuda", dtype=torch.bfloat16, page_size=page_size
        ),
        page_size=page_size,
        scale=128**-0.5,
    )


def time_kernels(batch: int, context: int, heads_q: int = 32, heads_kv: int = 8, dim: int = 128, reps: int = 20):
    """Per kernel: (ms per call, GB/s of what it must read, max |kernel - reference|) on CUDA, bf16."""
    from sgl_entropic.kernels.page_scores import (
        page_bounds_reference,
        page_bounds_triton,
        page_lse_reference,
        page_lse_triton,
    )

    q, kmin, kmax, k_cache, table, shortlist = make_case(
        batch, heads_q, heads_kv, dim, context, lists=1, shortlist_share=0.5, device="cuda", dtype=torch.bfloat16
    )
    pages = table.shape[1]
    runs = {
        "bounds": (
            lambda: page_bounds_triton(q, kmin, kmax, table, False),
            lambda: page_bounds_reference(q.float(), kmin.float(), kmax.float(), table, False),
            batch * pages * heads_kv * dim * 2 * 2,
        ),  # kmin + kmax, bf16
        "page_lse": (
            lambda: page_lse_triton(q, k_cache, shortlist, 16, dim**-0.5),
            lambda: page_lse_reference(q.float(), k_cache.float(), shortlist, 16, dim**-0.5),
            batch * shortlist.shape[2] * 16 * heads_kv * dim * 2,
        ),  # the shortlist's keys, bf16
    }
    out = {}
    for name, (kernel, reference, nbytes) in runs.items():
        err = float((kernel() - reference()).abs().max())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            kernel()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / reps * 1e3
        out[name] = (ms, nbytes / (ms / 1e3) / 1e9, err)
    return out


def print_registers() -> None:
    """Registers and spills of every compiled variant of the two kernels (point 6 of docs/gpu.md's review)."""
    from sgl_entropic.kernels import page_scores

    for fn in (page_scores._page_bounds_kernel, page_scores._page_lse_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            for compiled in (entry[0] if isinstance(entry, tuple) else entry).values():
                constants = {
                    k: v for k, v in getattr(compiled.src, "constants", {}).items() if isinstance(v, (int, bool))
                }
                print(
                    f"{fn.__name__}: {getattr(compiled, 'n_regs', '?')} registers, "
                    f"{getattr(compiled, 'n_spills', '?')} spilled, constants {constants}"
                )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        print("| kernel | batch | context | ms | GB/s read | max abs err vs torch |")
        print("|---|---|---|---|---|---|")
        for b in (1, 8, 64):
            for c in (8192, 32768, 131072):
                if b * c > 64 * 32768:
                    continue  # the pool must fit the device with room to spare
                for name, (ms, gbs, err) in time_kernels(b, c).items():
                    print(f"| {name} | {b} | {c} | {ms:.3f} | {gbs:.0f} | {err:.2e} |", flush=True)
        print_registers()
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
        check_under_interpreter()
