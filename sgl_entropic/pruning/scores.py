"""Page scores: the query-aware key bound and the paper's surprisal score."""

from __future__ import annotations

import torch

from sgl_entropic.pruning.budget import AGGREGATES, DEFAULT_AGGREGATE, num_pages

_INF = float("inf")


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The bound (package doc) `[B, L, NP]` float32: per KV head the max over its query group of
    relu(q).kmax + min(q, 0).kmin (L = H_kv), or that summed over the KV heads (L = 1).

    q `[B, H_q, D]`; kmin, kmax `[B, NP, H_kv, D]` (each row's pages gathered); query head h reads
    KV head h // (H_q / H_kv).
    """
    batch, heads_q, dim = q.shape
    heads_kv = kmin.shape[2]
    qg = q.float().view(batch, heads_kv, heads_q // heads_kv, dim)
    to_cols = lambda k: k.float().permute(0, 2, 3, 1)  # noqa: E731  [B, H_kv, D, NP]
    bound = (qg.clamp(min=0) @ to_cols(kmax) + qg.clamp(max=0) @ to_cols(kmin)).amax(dim=2)  # [B, H_kv, NP]
    return bound if per_head else bound.sum(dim=1, keepdim=True)


def shortlist_mass(
    lse_pages: torch.Tensor, lse_fixed: torch.Tensor, shortlist_valid: torch.Tensor, per_head: bool
) -> torch.Tensor:
    """The second stage's ranking (package doc), one definition for every device: `[B, L, S]`, each
    shortlisted page's attention mass under one softmax per query head over the fixed pages' tokens and the
    shortlist's, summed over the query heads a list serves (L = H_kv per head, else 1, all heads).

    lse_pages `[B, H_kv, G, S]`: per page and query head, logsumexp of its tokens' logits; lse_fixed
    `[B, H_kv, G]`: the same over the fixed pages' real tokens. The CPU kernel (`kernel.attend_rows`) reads
    the same masses off the softmax weights it reuses for the attention; the CUDA path computes them here.
    """
    lse_pages = lse_pages.masked_fill(~shortlist_valid[:, None, None], -_INF)
    total = torch.logaddexp(lse_fixed, torch.logsumexp(lse_pages, dim=-1))  # [B, H_kv, G]
    mass = torch.exp(lse_pages - total[..., None]).sum(dim=2)  # [B, H_kv, S]
    return mass if per_head else mass.sum(dim=1, keepdim=True)


def _check_aggregate(aggregate: str) -> None:
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")


def surprisal_scores(
    surprisal: torch.Tensor, lengths: torch.Tensor, page_size: int, aggregate: str = DEFAULT_AGGREGATE
) -> torch.Tensor:
    """The "surprisal" page score `[B, NP]` float32 from token surprisal `[B, T]` (nats).

    NP = ceil(T / page_size); row r's pages cover its tokens below lengths[r], the rest is -inf.
    aggregate: "max" (default: a page holding one informative token, a passkey digit or a name,
    scores as that token), "mean" or "sum". A non-finite surprisal (NaN: never scored) counts as
    +inf, so an unscored page is always kept.
    """
    _check_aggregate(aggregate)
    if surprisal.dim() != 2:
        raise ValueError(f"surprisal must be [B, T], got shape {tuple(surprisal.shape)}")
    batch, width = surprisal.shape
    pages = num_pages(width, page_size)
    lengths = lengths.to(device=surprisal.device, dtype=torch.long).reshape(batch)
    x = surprisal.float()
    x = torch.where(torch.isfinite(x), x, _INF)
    x = torch.nn.functional.pad(x, (0, pages * page_size - width)).view(batch, pages, page_size)
    valid = (torch.arange(pages * page_size, device=x.device)[None, :] < lengths[:, None]).view(batch, pages, page_size)
    counts = valid.sum(dim=-1)
    if aggregate == "max":
        scores = torch.where(valid, x, -_INF).amax(dim=-1)
    else:
        total = torch.where(valid, x, 0.0).sum(dim=-1)
        scores = total / counts.clamp_min(1) if aggregate == "mean" else total
    return torch.where(counts > 0, scores, -_INF)
