"""The Triton kernels of the two selection stages (kernels/page_scores.py) equal their torch references:
the page bounds (per KV head and summed) and the per-page log-sum-exp of the shortlist's logits, up to
fp32 summation order.

On CPU the kernels run under the Triton interpreter. TRITON_INTERPRET=1 must be set before triton is
imported, and this pytest process may already have imported it, so the CPU test runs this file as a
script in a fresh interpreter process. The GPU tests run at real sizes; `--time` (scripts/gpu_check.sh)
times them against the device's memory bandwidth."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch


def make_case(batch, heads_q, heads_kv, dim, context, lists=1, shortlist_share=0.5, page_size=16, device="cpu",
              dtype=torch.float32, seed=0):
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
    shortlist = torch.stack([torch.stack([table[b, torch.randperm(pages, generator=gen)[:short]] for _ in range(lists)])
                             for b in range(batch)])  # each list (row, or row and KV head) its own pages
    move = lambda t, dt=None: t.to(device=device, dtype=dt or t.dtype)  # noqa: E731
    return (move(q, dtype), move(kmin, dtype), move(kmax, dtype), move(k_cache, dtype), move(table, torch.int32),
            move(shortlist))


def check(case, page_size=16, scale=0.125):
    from sgl_entropic.kernels.page_scores import (page_bounds_reference, page_bounds_triton, page_lse_reference,
                                                  page_lse_triton)

    q, kmin, kmax, k_cache, table, shortlist = case
    for per_head in (False, True):
        got = page_bounds_triton(q, kmin, kmax, table, per_head)
        want = page_bounds_reference(q.float(), kmin.float(), kmax.float(), table, per_head)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(page_lse_triton(q, k_cache, shortlist, page_size, scale),
                               page_lse_reference(q.float(), k_cache.float(), shortlist, page_size, scale),
                               atol=2e-3, rtol=1e-4)


def check_under_interpreter() -> None:
    for heads in ((6, 2), (9, 3), (4, 4)):
        for lists in (1, heads[1]):
            check(make_case(3, *heads, 16, 300, lists=lists))
    check(make_case(2, 6, 2, 16, 200, dtype=torch.bfloat16))


def test_kernels_match_their_references_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,context", [(1, 32768), (64, 4096), (16, 32768)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_their_references_on_gpu_at_real_sizes(batch, context, dtype):
    check(make_case(batch, 32, 8, 128, context, lists=8, shortlist_share=0.1, device="cuda", dtype=dtype, seed=batch),
          scale=128 ** -0.5)


def time_kernels(batch: int, context: int, heads_q: int = 32, heads_kv: int = 8, dim: int = 128, reps: int = 20):
    """Per kernel: (ms per call, GB/s of what it must read, max |kernel - reference|) on CUDA, bf16."""
    from sgl_entropic.kernels.page_scores import (page_bounds_reference, page_bounds_triton, page_lse_reference,
                                                  page_lse_triton)

    q, kmin, kmax, k_cache, table, shortlist = make_case(batch, heads_q, heads_kv, dim, context, lists=1,
                                                         shortlist_share=0.5, device="cuda", dtype=torch.bfloat16)
    pages = table.shape[1]
    runs = {
        "bounds": (lambda: page_bounds_triton(q, kmin, kmax, table, False),
                   lambda: page_bounds_reference(q.float(), kmin.float(), kmax.float(), table, False),
                   batch * pages * heads_kv * dim * 2 * 2),  # kmin + kmax, bf16
        "page_lse": (lambda: page_lse_triton(q, k_cache, shortlist, 16, dim ** -0.5),
                     lambda: page_lse_reference(q.float(), k_cache.float(), shortlist, 16, dim ** -0.5),
                     batch * shortlist.shape[2] * 16 * heads_kv * dim * 2),  # the shortlist's keys, bf16
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
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
        check_under_interpreter()
