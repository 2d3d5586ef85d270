"""Where pruning could pay on a CUDA device, without SGLang or FlashInfer (the `device` tool's machine).

One decoder layer of a Llama-3-8B shape (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, bf16):
- dense, as SGLang serves a decode batch that does not prune: the whole layer (norms, projections, MLP and
  attention over every token, torch SDPA) replayed from a CUDA graph;
- pruned, as it serves one that prunes: the same layer eager, the selection of the CUDA path
  (`pruning.select_pages` on the Triton kernels, page size 16; the default two stages, then the bound alone)
  and attention over the kept tokens only (SDPA over a context of the kept length: FlashInfer reads the
  kept slots in place, so a gather's copy is not charged); and the same captured in a graph, as a
  graph-safe pruned step would run.
A proxy for the start-up probe's answer (point 1 of docs/gpu.md's review): it prints per batch and context
each part's time and the smallest context where the pruned layer is faster. Usage: python3 scripts/gpu_crossover.py
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
    return {
        "qkv": w((HEADS_Q + 2 * HEADS_KV) * DIM, HIDDEN),
        "o": w(HIDDEN, HEADS_Q * DIM),
        "up": w(2 * MLP, HIDDEN),
        "down": w(HIDDEN, MLP),
    }


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


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles its kernels): its replay."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def measure(batch: int, context: int, w, shortlist_ratio) -> dict:
    """One layer's ms: dense from a graph and eager, eager over the kept tokens alone, the selection alone
    (eager and from a graph), and the pruned layer (selection + attention over the kept tokens; the step's
    plan built once) eager, as served, and from a graph, as a graph-safe pruned step would run."""
    cfg = PruningConfig(min_context=0, page_size=PAGE, shortlist_ratio=shortlist_ratio)
    rows = [row_pages(context, math.nan, cfg) for _ in range(batch)]
    kept = rows[0].kept_tokens
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=DT)
    k, v = (torch.randn(batch, HEADS_KV, context, DIM, device=DEV, dtype=DT) for _ in range(2))
    dense = lambda: layer(x, w, sdpa(k, v))  # noqa: E731
    out = {"kept": kept, "dense_graph": timed(graphed(dense)), "dense_eager": timed(dense)}
    pages = -(-context // PAGE)
    k_cache = torch.randn(batch * pages * PAGE, HEADS_KV, DIM, device=DEV, dtype=DT)
    view = k_cache.view(-1, PAGE, HEADS_KV, DIM)
    kmin, kmax = view.amin(dim=1), view.amax(dim=1)
    plan = StepPlan.build(rows, torch.arange(batch * pages, device=DEV).view(batch, pages))
    table_i32 = plan.page_table.to(torch.int32)
    q = torch.randn(batch, HEADS_Q, DIM, device=DEV, dtype=DT)
    select = lambda q: select_pages(TRITON_STAGES, q, k_cache, kmin, kmax, plan, table_i32, DIM**-0.5)  # noqa: E731
    attend_kept = sdpa(*(torch.randn(batch, HEADS_KV, kept, DIM, device=DEV, dtype=DT) for _ in range(2)))

    def pruned(q):
        select(q)
        return attend_kept(q)

    out["kept_eager"] = timed(lambda: layer(x, w, attend_kept))
    out["selection"] = timed(lambda: select(q))
    out["selection_graph"] = timed(graphed(lambda: select(q)))
    out["pruned"] = timed(lambda: layer(x, w, pruned))
    out["pruned_graph"] = timed(graphed(lambda: layer(x, w, pruned)))
    return out


def table(w, shortlist_ratio) -> None:
    print(
        f"\nOne layer, ms; shortlist_ratio {shortlist_ratio}\n\n| batch | context | kept tokens | dense, graph | "
        "dense, eager | eager over the kept tokens | selection, eager | selection, graph | pruned, eager | "
        "pruned, graph | pruned eager / dense graph | pruned graph / dense graph |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    found = {}
    for batch in (1, 8, 32):
        for context in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
            if batch * context > 2**21:
                continue
            m = measure(batch, context, w, shortlist_ratio)
            print(
                f"| {batch} | {context} | {m['kept']} | {m['dense_graph']:.3f} | {m['dense_eager']:.3f} | "
                f"{m['kept_eager']:.3f} | {m['selection']:.3f} | {m['selection_graph']:.3f} | {m['pruned']:.3f} | "
                f"{m['pruned_graph']:.3f} | {m['pruned'] / m['dense_graph']:.2f} | "
                f"{m['pruned_graph'] / m['dense_graph']:.2f} |",
                flush=True,
            )
            for name in ("pruned", "pruned_graph"):
                if m[name] < m["dense_graph"]:
                    found.setdefault((batch, name), context)
            torch.cuda.empty_cache()
    for batch in (1, 8, 32):
        print(
            f"batch {batch}: faster than the dense graph from {found.get((batch, 'pruned'), 'no measured')} tokens "
            f"eager, from {found.get((batch, 'pruned_graph'), 'no measured')} tokens from a graph"
        )


def main() -> None:
    """The default two stages (shortlist half the candidates), then the bound alone (no exact rescoring)."""
    w = weights()
    for shortlist_ratio in (PruningConfig().shortlist_ratio, None):
        table(w, shortlist_ratio)


if __name__ == "__main__":
    main()
