"""Triton kernel of the meso loop on CUDA: one layer's page selection, bound and top-k fused.

Per request (one program): the "quest" score of every candidate page (sgl_entropic.pruning.
quest_scores), the `keep` best of them (higher score first, the lower page among equal scores),
and the row's page list written compactly, in ascending page order, into a flat buffer at
indptr[r]: [sink pages | selected | recent pages], the layout FlashInfer's paged decode reads.

Must equal: `page_select_reference` below: scores up to fp32 summation order, the page list
exactly that of the reference selection applied to the kernel's own scores.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_entropic.pruning import quest_scores

_BLOCK_N = 64  # pages per tile


@triton.jit
def _order_key(score):
    """float32 -> int64 in [0, 2^32) with the same order (no NaN, no -0.0 in input)."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _page_select_kernel(
    q_ptr, kmin_ptr, kmax_ptr, table_ptr, table_stride, n_ptr, sink_ptr, recent_ptr, keep_ptr, indptr_ptr,
    scores_ptr, out_ptr, width,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.load(n_ptr + row)
    sink = tl.load(sink_ptr + row)
    recent = tl.load(recent_ptr + row)
    keep = tl.load(keep_ptr + row)
    start_out = tl.load(indptr_ptr + row)
    table_row = table_ptr + row.to(tl.int64) * table_stride
    score_row = scores_ptr + row.to(tl.int64) * width
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    cols = tl.arange(0, BLOCK_N)

    # Phase 1: scores of the candidates (sink <= j < n - recent); -inf elsewhere.
    for start in range(0, width, BLOCK_N):
        j = start + cols
        cand = (j >= sink) & (j < n - recent)
        page = tl.load(table_row + j, mask=cand, other=0).to(tl.int64)
        total = tl.zeros((BLOCK_N,), tl.float32)
        for h in tl.static_range(H_KV):
            meta = (page[:, None] * H_KV + h) * D + d[None, :]
            ok = cand[:, None] & d_ok[None, :]
            kmx = tl.load(kmax_ptr + meta, mask=ok, other=0.0).to(tl.float32)
            kmn = tl.load(kmin_ptr + meta, mask=ok, other=0.0).to(tl.float32)
            best = tl.full((BLOCK_N,), -float("inf"), tl.float32)
            for g in tl.static_range(GROUP):
                qv = tl.load(q_ptr + (row.to(tl.int64) * H_KV * GROUP + h * GROUP + g) * D + d, mask=d_ok,
                             other=0.0).to(tl.float32)
                bound = tl.sum(tl.maximum(qv[None, :] * kmx, qv[None, :] * kmn), axis=1)
                best = tl.maximum(best, bound)
            total += best
        total = tl.where(total == 0.0, 0.0, total)  # -0.0 -> +0.0: one zero for the order keys
        tl.store(score_row + j, tl.where(cand, total, -float("inf")), mask=j < width)
    tl.debug_barrier()

    # Phase 2: theta = the keep-th largest candidate key, built bit by bit (32 counting passes).
    candidates = tl.maximum(n - sink - recent, 0)
    searching = (keep > 0) & (keep < candidates)
    theta = tl.zeros((), tl.int64)
    step = tl.full((), 2147483648, tl.int64)
    for _ in range(tl.where(searching, 32, 0)):
        trial = theta + step
        hits = tl.zeros((), tl.int32)
        for start in range(0, width, BLOCK_N):
            j = start + cols
            cand = (j >= sink) & (j < n - recent)
            s = tl.load(score_row + j, mask=cand, other=-float("inf"))
            hits += tl.sum((cand & (_order_key(s) >= trial)).to(tl.int32), axis=0)
        theta = tl.where(hits >= keep, trial, theta)
        step = step // 2
    above = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK_N):
        j = start + cols
        cand = (j >= sink) & (j < n - recent)
        s = tl.load(score_row + j, mask=cand, other=-float("inf"))
        above += tl.sum((cand & (_order_key(s) > theta)).to(tl.int32), axis=0)
    ties_wanted = keep - above  # of the candidates AT theta, the lowest pages
    take_all = keep >= candidates

    # Phase 3: the row's list: sink, the selected candidates in page order, recent.
    for start in range(0, width, BLOCK_N):
        j = start + cols
        is_sink = j < sink
        tl.store(out_ptr + start_out + j, tl.load(table_row + j, mask=is_sink, other=0), mask=is_sink)
    written = tl.zeros((), tl.int32)
    ties_seen = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK_N):
        j = start + cols
        cand = (j >= sink) & (j < n - recent)
        s = tl.load(score_row + j, mask=cand, other=-float("inf"))
        key = _order_key(s)
        tie = cand & (key == theta)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        chosen = cand & (take_all | (searching & ((key > theta) | (tie & (tie_rank < ties_wanted)))))
        slot = written + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + start_out + sink + slot, tl.load(table_row + j, mask=chosen, other=0), mask=chosen)
        written += tl.sum(chosen.to(tl.int32), axis=0)
    for start in range(0, width, BLOCK_N):
        j = start + cols
        is_recent = j < recent
        page = tl.load(table_row + (n - recent + j), mask=is_recent, other=0)
        tl.store(out_ptr + start_out + sink + written + j, page, mask=is_recent)


def page_select_triton(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_table: torch.Tensor, n_pages: torch.Tensor,
    sink: torch.Tensor, recent: torch.Tensor, keep: torch.Tensor, indptr: torch.Tensor,
    out: Optional[torch.Tensor] = None, block_n: int = _BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, W] float32, page lists [indptr[-1]] int32) of one layer; see the module doc.

    q `[B, H_q, D]`; kmin, kmax `[pages, H_kv, D]` (the layer's store); page_table `[B, W]` int
    (physical page of each logical page); n_pages, sink, recent, keep `[B]` int; indptr
    `[B + 1]`, indptr[r + 1] - indptr[r] = sink + min(keep, candidates) + recent. `out` (int32)
    is written in place when given, e.g. the page-index buffer of a FlashInfer plan.
    """
    batch, heads_q, dim = q.shape
    heads_kv = kmin.shape[1]
    width = page_table.shape[1]
    device = q.device
    scores = torch.empty(batch, width, dtype=torch.float32, device=device)
    if out is None:
        out = torch.empty(int(indptr[-1]), dtype=torch.int32, device=device)
    i32 = lambda t: t.to(device=device, dtype=torch.int32).contiguous()  # noqa: E731
    if batch and width:
        _page_select_kernel[(batch,)](
            q.contiguous(), kmin.contiguous(), kmax.contiguous(), i32(page_table), width, i32(n_pages), i32(sink),
            i32(recent), i32(keep), i32(indptr), scores, out, width,
            H_KV=heads_kv, GROUP=heads_q // heads_kv, D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=block_n,
        )
    return scores, out


def page_select_from_scores(scores: torch.Tensor, page_table: torch.Tensor, n_pages, sink, recent, keep) -> torch.Tensor:
    """The flat page lists of the reference selection over given scores (the part after scoring)."""
    out = []
    for r in range(scores.shape[0]):
        n, s, rc, k = (int(x[r]) for x in (n_pages, sink, recent, keep))
        cand = list(range(s, n - rc))
        best = sorted(cand, key=lambda j: (-float(scores[r, j]), j))[: max(0, min(k, len(cand)))]
        pages = list(range(s)) + sorted(best) + list(range(n - rc, n))
        out += [int(page_table[r, j]) for j in pages]
    return torch.tensor(out, dtype=torch.int32)


def page_select_reference(q, kmin, kmax, page_table, n_pages, sink, recent, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """`page_select_triton`'s result in plain torch: pruning.quest_scores, then the canonical top-k."""
    pages = page_table.long()
    scores = quest_scores(q, kmin[pages], kmax[pages])
    j = torch.arange(pages.shape[1], device=pages.device)[None, :]
    candidate = (j >= sink.long()[:, None]) & (j < (n_pages.long() - recent.long())[:, None])
    scores = scores.masked_fill(~candidate, float("-inf"))
    return scores, page_select_from_scores(scores.cpu(), page_table.cpu(), n_pages, sink, recent, keep)
