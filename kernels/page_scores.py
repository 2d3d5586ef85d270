"""Triton kernels of the meso loop's two selection stages on CUDA, reading the pools in place.

- `page_bounds_triton`: stage 1, the key bound of every page of each row's page table
  (sgl_entropic.pruning.quest_bounds), per KV head or summed over them, from the page store's
  min/max, without gathering them first.
- `page_lse_triton`: stage 2, per shortlisted page, KV head and query head, the log-sum-exp of the
  scaled logits of the page's tokens, read from the KV cache in place (the gather the CPU path makes
  would cost B x H x S x page x D elements of memory at long contexts and large batches).
The selection itself (top-k, mass) and the attention (FlashInfer) run outside: see
`plugin/attention/flashinfer.py`.

Must equal: `page_bounds_reference` and `page_lse_reference` below, up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_entropic.pruning import Stages, quest_bounds

_BLOCK_N = 32  # pages per program (stage 1): two [32, D] fp32 tiles stay in registers


@triton.jit
def _page_bounds_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    table_ptr,
    table_stride,
    width,
    out_ptr,
    H_KV: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (row, block of pages, KV head): the max over the head's query group."""
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    ok = j < width
    page = tl.load(table_ptr + row.to(tl.int64) * table_stride + j, mask=ok, other=0).to(tl.int64)
    meta = (page[:, None] * H_KV + h) * D + d[None, :]
    meta_ok = ok[:, None] & (d < D)[None, :]
    kmx = tl.load(kmax_ptr + meta, mask=meta_ok, other=0.0).to(tl.float32)
    kmn = tl.load(kmin_ptr + meta, mask=meta_ok, other=0.0).to(tl.float32)
    best = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    for g in tl.static_range(GROUP):
        qv = tl.load(q_ptr + (row.to(tl.int64) * H_KV * GROUP + h * GROUP + g) * D + d, mask=d < D, other=0.0).to(
            tl.float32
        )
        best = tl.maximum(best, tl.sum(tl.maximum(qv[None, :] * kmx, qv[None, :] * kmn), axis=1))
    tl.store(out_ptr + (row.to(tl.int64) * H_KV + h) * width + j, best, mask=ok)


def page_bounds_triton(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_table: torch.Tensor, per_head: bool
) -> torch.Tensor:
    """`[B, L, W]` float32: the bound of each row's pages (L = H_kv with per_head, else 1: summed over heads).

    q `[B, H_q, D]`; kmin, kmax `[pages, H_kv, D]` (the layer's store); page_table `[B, W]` int.
    """
    batch, heads_q, dim = q.shape
    heads_kv = kmin.shape[1]
    width = page_table.shape[1]
    out = torch.empty(batch, heads_kv, width, dtype=torch.float32, device=q.device)
    if page_table.stride(1) != 1:  # rows may be strided (a slice of a wider table); entries must be adjacent
        page_table = page_table.contiguous()
    if batch and width:
        _page_bounds_kernel[(batch, triton.cdiv(width, _BLOCK_N), heads_kv)](
            q.contiguous(),
            kmin.contiguous(),
            kmax.contiguous(),
            page_table,
            page_table.stride(0),
            width,
            out,
            H_KV=heads_kv,
            GROUP=heads_q // heads_kv,
            D=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_N=_BLOCK_N,
        )
    return out if per_head else out.sum(dim=1, keepdim=True)


def page_bounds_reference(q, kmin, kmax, page_table, per_head: bool) -> torch.Tensor:
    pages = page_table.long()
    return quest_bounds(q, kmin[pages], kmax[pages], per_head)


@triton.jit
def _page_lse_kernel(
    q_ptr,
    k_ptr,
    pages_ptr,
    shortlist,
    out_ptr,
    scale,
    H_KV: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    LISTS: tl.constexpr,
):
    """One program per (row, shortlisted page, KV head): the page's keys read once for the query group."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, P)
    lst = h if LISTS > 1 else 0
    page = tl.load(pages_ptr + (row.to(tl.int64) * LISTS + lst) * shortlist + s).to(tl.int64)
    slots = page * P + t
    keys = tl.load(k_ptr + (slots[:, None] * H_KV + h) * D + d[None, :], mask=(d < D)[None, :], other=0.0).to(
        tl.float32
    )
    for g in tl.static_range(GROUP):
        qv = tl.load(q_ptr + (row.to(tl.int64) * H_KV * GROUP + h * GROUP + g) * D + d, mask=d < D, other=0.0).to(
            tl.float32
        )
        logits = tl.sum(qv[None, :] * keys, axis=1) * scale
        top = tl.max(logits, axis=0)
        lse = top + tl.log(tl.sum(tl.exp(logits - top), axis=0))
        tl.store(out_ptr + ((row.to(tl.int64) * H_KV + h) * GROUP + g) * shortlist + s, lse)


def page_lse_triton(
    q: torch.Tensor, k_cache: torch.Tensor, pages: torch.Tensor, page_size: int, scale: float
) -> torch.Tensor:
    """`[B, H_kv, G, S]` float32: per shortlisted page (physical `pages` `[B, L, S]`, L = 1 or H_kv), per KV
    head h and query head g of its group, logsumexp over the page's tokens of scale * q.k (k_cache
    `[slots, H_kv, D]`, slot = page * page_size + offset; every token of a shortlisted page is real:
    candidates are full pages)."""
    if page_size & (page_size - 1):
        raise ValueError(f"page_lse_triton: page_size must be a power of two (tl.arange), got {page_size}")
    batch, heads_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    lists, shortlist = pages.shape[1], pages.shape[2]
    out = torch.empty(batch, heads_kv, heads_q // heads_kv, shortlist, dtype=torch.float32, device=q.device)
    if batch and shortlist:
        _page_lse_kernel[(batch, shortlist, heads_kv)](
            q.contiguous(),
            k_cache.contiguous(),
            pages.contiguous(),
            shortlist,
            out,
            scale,
            H_KV=heads_kv,
            GROUP=heads_q // heads_kv,
            D=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            P=page_size,
            LISTS=lists,
        )
    return out


def page_lse_reference(q, k_cache, pages, page_size: int, scale: float) -> torch.Tensor:
    from sgl_entropic.pruning import gather_pages

    batch, heads_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    keys = gather_pages(k_cache.view(-1, page_size, heads_kv, dim), pages.long()).float()  # [B, H_kv, S, P, D]
    qg = q.float().view(batch, heads_kv, heads_q // heads_kv, 1, 1, dim)
    logits = (qg * keys[:, :, None]).sum(-1) * scale  # [B, H_kv, G, S, P]
    return torch.logsumexp(logits, dim=-1)


TRITON_STAGES = Stages(page_bounds_triton, page_lse_triton)
REFERENCE_STAGES = Stages(page_bounds_reference, page_lse_reference)
