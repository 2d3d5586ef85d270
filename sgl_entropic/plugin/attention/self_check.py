"""The start-up self-check of the sparse decode path, on every device, before the server serves.

One pruned and one keep-all decode step of the backend's own attention path run on synthetic KV of
the served model's shape (two rows on scattered pages of a small pool), and are compared with exact
attention over the same tokens computed plainly (`pruning.sparse_decode_attention`): the pruned step
over the fixed pages plus the pages it reports kept (each a distinct candidate, as many as the
budget), the keep-all step over every token. A mismatch beyond the dtype's tolerance, or any error,
turns pruning off for the server's life (the backend then attends densely) with an error in the log
and in `/server_info` (`entropic.pruning.self_check`): a path that has never run on this device
(the CUDA one, here) cannot silently serve wrong attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from sgl_entropic.config import PruningConfig
from sgl_entropic.pruning import StepPlan, all_pages, row_pages, sparse_decode_attention

# Largest |ours - exact| accepted, by the KV dtype (outputs are averages of unit-scale values).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
LOW_PRECISION_TOLERANCE = 1e-2


@dataclass(frozen=True)
class SelfCheck:
    ok: bool
    error: Optional[str] = None
    max_abs_error: dict = field(default_factory=dict)  # per step: "pruned", "keep_all"

    def as_json(self) -> dict:
        return {"ok": self.ok, "error": self.error, "max_abs_error": self.max_abs_error}


def run_self_check(
    attend: Callable,
    heads_q: int,
    heads_kv: int,
    dim: int,
    dtype,
    cfg: PruningConfig,
    device="cpu",
    lengths: tuple[int, ...] = (1000, 701),
    seed: int = 0,
) -> SelfCheck:
    """Run `attend(q, k_cache, v_cache, plan, kmin, kmax, scale) -> (out, kept)` (the backend's path)
    on synthetic KV and compare (module doc)."""
    from sgl_entropic.plugin.attention.page_store import PageStore

    try:
        gen = torch.Generator().manual_seed(seed)
        p = cfg.page_size
        pool_pages = sum(-(-n // p) for n in lengths) * 2 + 1
        k = torch.randn(pool_pages * p, heads_kv, dim, generator=gen).to(device, dtype)
        v = torch.randn(pool_pages * p, heads_kv, dim, generator=gen).to(device, dtype)
        q = torch.randn(len(lengths), heads_q, dim, generator=gen).to(device, dtype)
        width = max(-(-n // p) for n in lengths)
        order = torch.randperm(pool_pages, generator=gen)
        page_table = torch.stack([order[i * width : (i + 1) * width] for i in range(len(lengths))]).to(device)
        store = PageStore([0], pool_pages * p, p, heads_kv, dim, dtype, device, 1, with_surprisal=False)
        for b, n in enumerate(lengths):
            slots = (page_table[b, :, None] * p + torch.arange(p, device=device)).flatten()[:n]
            store.write_keys(0, slots, k[slots])
        scale = dim**-0.5
        # the pruned step at the budget an unknown entropy gives, from any length
        pruned_cfg = cfg.model_copy(update={"min_context": 0})
        errors = {}
        for name, rows in (
            ("pruned", [row_pages(n, math.nan, pruned_cfg) for n in lengths]),
            ("keep_all", [all_pages(n, p) for n in lengths]),
        ):
            plan = StepPlan.build(rows, page_table, per_head=cfg.per_head)
            out, kept = attend(q, k, v, plan, store.kmin[0], store.kmax[0], scale)
            errors[name] = _max_error(q, k, v, plan, kept, out, scale)
        limit = TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
        worst = max(errors.values())
        if not worst <= limit:  # NaN fails too
            return SelfCheck(
                False,
                f"sparse decode differs from exact attention by {worst:.3g} (> {limit:g} for {dtype}) on synthetic KV",
                errors,
            )
        return SelfCheck(True, None, errors)
    except Exception as err:  # whatever broke, the server must not serve this path
        return SelfCheck(False, f"sparse decode failed on synthetic KV: {type(err).__name__}: {err}")


def _max_error(q, k, v, plan: StepPlan, kept: Optional[torch.Tensor], out: torch.Tensor, scale: float) -> float:
    """Largest |out - exact attention over the row's fixed pages and the pages `kept` reports| (per KV head)."""
    p = plan.page_size
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    worst = 0.0
    for b, row in enumerate(plan.rows):
        fixed = list(range(row.sink)) + list(range(row.n - row.recent, row.n))
        for h in range(heads_kv):
            pages = list(fixed)
            if row.keep:
                chosen = kept[b, h if kept.shape[1] > 1 else 0, : row.keep].tolist()
                if len(set(chosen)) != row.keep or not all(row.sink <= j < row.n - row.recent for j in chosen):
                    raise ValueError(f"row {b} kept pages {chosen}: not {row.keep} distinct candidates")
                pages += chosen
            physical = plan.page_table[b, sorted(pages)]
            tokens = (physical[:, None] * p + torch.arange(p, device=physical.device)).flatten()
            logical = (torch.tensor(sorted(pages))[:, None] * p + torch.arange(p)).flatten()
            tokens = tokens[(logical < row.length).to(tokens.device)]
            heads = slice(h * group, (h + 1) * group)
            want = sparse_decode_attention(q[b, heads], k[tokens][:, h : h + 1], v[tokens][:, h : h + 1], scale=scale)
            worst = max(worst, float((out[b, heads].float() - want.float()).abs().max()))
    return worst
