"""Where pruning could pay on a CUDA device, without SGLang or FlashInfer (the `device` tool's machine).

One decoder layer of a Llama-3-8B shape (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, bf16):
- dense, as SGLang serves a decode batch that does not prune: the whole layer (norms, projections, MLP and
  attention over every token, torch SDPA) replayed from a CUDA graph;
- pruned, as it serves one that prunes: the same layer eager, the two selection stages of the CUDA path
  (`pruning.select_pages` on the Triton kernels, page size 16, shortlist half the candidates) and attention
  over the kept tokens only (SDPA over a context of the kept length: FlashInfer reads the kept slots in
  place, so a gather's copy is not charged).
A proxy for the start-up probe's answer (point 1 of docs/gpu.md's review): it prints per batch and context
the two times and the smallest context where the pruned layer is faster. Usage: python3 scripts/gpu_crossover.py
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from sgl_entropic.config import PruningConfig
from sgl_entropic.kernels.page_scores import TRITON_STAGES
from sgl_entropic.pruning import StepPlan, row_pages, select_pages

HIDDEN, HEADS_Q, HEADS_KV, DIM, MLP, PAGE = 4096, 32, 8, 128, 14336, 16
DEV, DT = "cuda", torch.bfloat16


def weights():
    w = lambda *s: torch.randn(*s, device=DEV, dtype=DT) * 0.02  # noqa: E731
    return {"qkv": w((HEADS_Q + 2 * HEADS_KV) * DIM, HIDDEN), "o": w(HIDDEN, HEADS_Q * DIM),
            "up": w(2 * MLP, HIDDEN), "down": w(HIDDEN, MLP)}


def layer(x, w, attend):
    h = F.rms_norm(x, (HIDDEN,))
    q = (h @ w["qkv"].t())[:, : HEADS_Q * DIM].view(-1, HEADS_Q, DIM)
    x = x + attend(q).reshape(x.shape[0], -1) @ w["o"].t()
    gate, up = (F.rms_norm(x, (HIDDEN,)) @ w["up"].t()).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ w["down"].t()


def sdpa(k, v):
    return lambda q: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def measure(batch: int, context: int, w) -> tuple[float, float, int]:
    """(dense ms from graph replay, pruned ms eager, kept tokens per row)."""
    cfg = PruningConfig(min_context=0, page_size=PAGE)
    rows = [row_pages(context, math.nan, cfg) for _ in range(batch)]
    kept = rows[0].kept_tokens
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=DT)
    k, v = (torch.randn(batch, HEADS_KV, context, DIM, device=DEV, dtype=DT) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, w, sdpa(k, v))  # warm-up outside the capture
        with torch.cuda.graph(graph):
            layer(x, w, sdpa(k, v))
    torch.cuda.current_stream().wait_stream(stream)
    dense = timed(graph.replay)
    del k, v, graph
    pages = -(-context // PAGE)
    k_cache = torch.randn(batch * pages * PAGE, HEADS_KV, DIM, device=DEV, dtype=DT)
    view = k_cache.view(-1, PAGE, HEADS_KV, DIM)
    kmin, kmax = view.amin(dim=1), view.amax(dim=1)
    table = torch.arange(batch * pages, device=DEV).view(batch, pages)
    k_kept, v_kept = (torch.randn(batch, HEADS_KV, kept, DIM, device=DEV, dtype=DT) for _ in range(2))
    attend_kept = sdpa(k_kept, v_kept)

    def pruned():
        plan = StepPlan.build(rows, table)  # once per step in serving; charged to every layer here
        table_i32 = plan.page_table.to(torch.int32)

        def attend(q):
            select_pages(TRITON_STAGES, q, k_cache, kmin, kmax, plan, table_i32, DIM ** -0.5)
            return attend_kept(q)
        layer(x, w, attend)
    return dense, timed(pruned), kept


def main() -> None:
    w = weights()
    print("| batch | context | kept tokens | dense layer, graph (ms) | pruned layer, eager (ms) | pruned / dense |")
    print("|---|---|---|---|---|---|")
    found = {}
    for batch in (1, 8, 32):
        for context in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
            if batch * context > 2 ** 21:
                continue
            dense, pruned, kept = measure(batch, context, w)
            print(f"| {batch} | {context} | {kept} | {dense:.3f} | {pruned:.3f} | {pruned / dense:.2f} |", flush=True)
            if pruned < dense:
                found.setdefault(batch, context)
            torch.cuda.empty_cache()
    for batch in (1, 8, 32):
        print(f"batch {batch}: the pruned layer is faster from {found.get(batch, 'no measured')} tokens")


if __name__ == "__main__":
    main()
