"""The two-stage selection as the CUDA path runs it: one layer's kept pages, without the attention.

The stages are passed in (`Stages`): the Triton kernels on CUDA (`sgl_entropic.kernels.page_scores`),
their torch references anywhere else, so that the same function runs on a GPU and in the CPU tests,
and its choice can be held against the CPU kernel's (`kernel.attend_rows`) on the same KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from sgl_entropic.pruning.kernel import fixed_lse
from sgl_entropic.pruning.plan import StepPlan
from sgl_entropic.pruning.scores import shortlist_mass


@dataclass(frozen=True)
class Stages:
    """bounds(q, kmin, kmax, page_table_i32, per_head) -> `[B, L, W]`;
    page_lse(q, k_cache, physical_pages `[B, L, S]`, page_size, scale) -> `[B, H_kv, G, S]`."""

    bounds: Callable[..., torch.Tensor]
    page_lse: Callable[..., torch.Tensor]


def select_pages(
    stages: Stages,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    plan: StepPlan,
    page_table_i32: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Logical kept pages `[B, L, K]` (row b's first keep_b columns are its pages): the bound ranks the
    candidates; with a shortlist, `shortlist_mass` (one softmax per query head over the fixed pages and the
    shortlist) keeps the heaviest. q `[B, H_q, D]`; caches `[slots, H_kv, D]`; kmin/kmax the layer's store."""
    if plan.chosen is not None:
        return plan.chosen
    bound = stages.bounds(q, kmin, kmax, page_table_i32, plan.per_head)
    bound = bound.masked_fill(~plan.candidate[:, None], -math.inf)
    k_cols = plan.keep_valid.shape[1]
    if not plan.two_stage:
        return bound.topk(k_cols, dim=-1).indices
    short = bound.topk(plan.shortlist_valid.shape[1], dim=-1).indices
    phys = plan.page_table.gather(1, short.flatten(1)).view_as(short)
    lse = stages.page_lse(q, k_cache, phys, plan.page_size, scale)
    mass = shortlist_mass(lse, fixed_lse(q, k_cache, plan, scale), plan.shortlist_valid, plan.per_head)
    pick = mass.masked_fill(~plan.shortlist_valid[:, None], -1.0).topk(k_cols, dim=-1).indices
    return short.gather(-1, pick)
