"""A decode step's plan: every tensor its layers need, built once from the rows' host counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sgl_entropic.pruning.budget import RowPages
from sgl_entropic.transfer import to_device


@dataclass
class StepPlan:
    """What every layer of one decode step needs, built once per step from host counts ("prepare").

    Fixed pages (sink, then recent) are gathered whole; candidate pages go through the selection:
    the bound picks `shortlist` per row (and per KV head with `per_head`), exact scores on the
    shortlist's keys keep `keep` (or the bound keeps `keep` directly when shortlist == keep).
    `chosen` (logical pages `[B, 1, K]`) replaces the per-layer selection when the pages are fixed for
    the step (the surprisal selector). All tensors live on the page table's device.
    """

    rows: list[RowPages]
    page_size: int
    page_table: torch.Tensor  # [B, W] int64: physical page of each logical page (padding: page 0)
    fixed_pages: torch.Tensor  # [B, F] int64 physical: the sink then the recent pages (padding: page 0)
    fixed_tokens: torch.Tensor  # [B, F, page_size] bool: the real tokens of the fixed pages
    candidate: torch.Tensor  # [B, W] bool
    shortlist_valid: torch.Tensor  # [B, S] bool: j < shortlist_r
    keep_valid: torch.Tensor  # [B, K] bool: j < keep_r
    per_head: bool = False
    chosen: Optional[torch.Tensor] = None
    # Row groups (start, end, plan of those rows) that `attend_layer` runs one after the other, so that
    # one group's gathered pages stay in the CPU's caches; empty: the whole batch at once
    parts: list = dataclasses.field(default_factory=list)

    @classmethod
    def build(
        cls,
        rows: Sequence[RowPages],
        page_table: torch.Tensor,
        per_head: bool = False,
        group_tokens: Optional[int] = None,
    ) -> "StepPlan":
        """The plan of `rows` (page_table `[B, W]`); with `group_tokens`, also the plans of row groups of
        at most that many tokens gathered (each row's attended tokens plus its shortlist's keys)."""
        plan = cls._build(rows, page_table, per_head)
        if group_tokens is not None and len(rows) > 1:
            bounds, start, load = [], 0, 0
            for i, r in enumerate(rows):
                weight = r.kept_tokens + r.shortlist * r.page_size
                if i > start and load + weight > group_tokens:
                    bounds.append((start, i))
                    start, load = i, 0
                load += weight
            bounds.append((start, len(rows)))
            if len(bounds) > 1:
                plan.parts = [
                    (a, b, cls._build(rows[a:b], page_table[a:b, : max(r.n for r in rows[a:b])], per_head))
                    for a, b in bounds
                ]
        return plan

    @classmethod
    def _build(cls, rows: Sequence[RowPages], page_table: torch.Tensor, per_head: bool) -> "StepPlan":
        device = page_table.device
        batch, width = page_table.shape
        p = rows[0].page_size if rows else 1
        f_cols = max((r.sink + r.recent for r in rows), default=0)
        fixed, tokens = [], []
        for r in rows:
            logical = list(range(r.sink)) + list(range(r.n - r.recent, r.n))
            fixed.append(logical + [0] * (f_cols - len(logical)))
            last = r.length - (r.n - 1) * p  # real tokens of the last page
            tokens.append(
                [p] * (len(logical) - 1) + [last] + [0] * (f_cols - len(logical)) if logical else [0] * f_cols
            )
        fixed_logical = to_device(fixed, device) if f_cols else torch.zeros(batch, 0, dtype=torch.long, device=device)
        counts = to_device(tokens, device) if f_cols else torch.zeros(batch, 0, dtype=torch.long, device=device)
        fixed_tokens = torch.arange(p, device=device) < counts[..., None]
        sink, n, recent = (to_device([getattr(r, f) for r in rows], device) for f in ("sink", "n", "recent"))
        j = torch.arange(width, device=device)[None, :]
        candidate = (j >= sink[:, None]) & (j < (n - recent)[:, None])
        s_cols = max((r.shortlist for r in rows), default=0)
        k_cols = max((r.keep for r in rows), default=0)
        shortlist = to_device([r.shortlist for r in rows], device)
        keep = to_device([r.keep for r in rows], device)
        return cls(
            list(rows),
            p,
            page_table,
            page_table.gather(1, fixed_logical),
            fixed_tokens,
            candidate,
            torch.arange(s_cols, device=device)[None, :] < shortlist[:, None],
            torch.arange(k_cols, device=device)[None, :] < keep[:, None],
            per_head,
        )

    @property
    def two_stage(self) -> bool:
        return self.shortlist_valid.shape[1] > self.keep_valid.shape[1]

    def attended_fractions(self, sparse_layer_share: float) -> list[float]:
        """Per row, the share of its context one decode step attends, averaged over layers: the sparse
        layers attend the kept pages, the others (dense_layers) everything."""
        return [1.0 - sparse_layer_share * (1.0 - r.kept_tokens / r.length) if r.length else 1.0 for r in self.rows]

    def read_fractions(self, sparse_layer_share: float) -> list[float]:
        """Per row, what one decode step reads of its context's KV (and computes of its attention FLOPs),
        as a share of dense: the attended tokens' keys and values, plus the keys the exact rescoring
        reads of the shortlisted pages it does not keep (half a token's K and V each)."""
        return [
            1.0 - sparse_layer_share * (1.0 - (r.kept_tokens + 0.5 * (r.shortlist - r.keep) * r.page_size) / r.length)
            if r.length
            else 1.0
            for r in self.rows
        ]
