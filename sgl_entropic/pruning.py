"""The meso loop: which KV pages a decode step attends (torch only, never sglang).

A request's context is cut into pages of `page_size` tokens, the same pages as SGLang's paged
KV cache (the launcher runs SGLang with `--page-size` = `pruning.page_size`, so logical page j
of a request is one physical page of the pool and radix-shared prefixes share pages). A decode
step attends the first `sink_blocks` pages (attention sinks), the last `recent_blocks` pages
(local context) and `keep` of the other pages, the candidates. Prefill stays dense, and pruning
is a view: nothing is evicted, each step and layer selects again over the whole context.

Which candidates (`PruningConfig.selector`)
-------------------------------------------
- "quest" (default): per layer, in two stages.
  1. The bound. The store keeps, per page and KV head, the element-wise min and max of its keys
     (written as KV is written); for a query q the largest q.k over the page is at most
     b = sum_d max(q_d kmax_d, q_d kmin_d) = relu(q).kmax + min(q, 0).kmin (Quest, MLSys 2024).
     The grouped query heads of a KV head reduce by max (still an upper bound); with one page list
     per request (`per_head` off) the KV heads reduce by sum. The bound shortlists the
     `shortlist_ratio` share of the candidates with the highest bounds.
  2. Exact scores. The shortlisted pages' keys give the exact logits; each page's attention mass
     (softmax per query head over the shortlist, summed over the query heads the list serves)
     ranks them, and the `keep` heaviest are attended, their logits reused. Without a shortlist
     (`shortlist_ratio` None) the bound picks the kept pages itself.
- "surprisal": the paper's method: page score = max surprisal of its tokens, the same pages on
  every layer. Prompt tokens are scored from the model's own logits at prefill (an lm_head pass
  over the prompt), sampled tokens at decode.

Why two stages, measured (README "Pruning"; teacher-forced along the dense greedy path, real essays
and source code at 4k and 7k tokens): the bound is an upper bound, loose where a page's keys
spread, so at a third of the candidates it misses pages the query needs; an oracle that ranks by
the true attention mass keeps dense quality there. Rescoring the bound's shortlist on its own keys
comes close to the oracle for the price of reading the shortlist's keys (not its values). The
surprisal of a token does not tell which pages a later query needs: a predictable token can be
exactly what a later query attends to.

How many (the budget)
---------------------
keep = ceil(rho(H_t) * m) of the m candidates, with H_t the request's latest next-token
entropy (nats), H_ref > 0 a reference entropy and the config's `min_keep_ratio` r_min,
`max_keep_ratio` r_max and `entropy_floor` H_floor:

    rho(H) = r_min + (r_max - r_min) * min(max(H, H_floor, 0) / H_ref, 1)

A confident model (low H) attends less, an uncertain one more; a NaN entropy (unknown) keeps
r_max; below H_floor rho stays at rho(H_floor), so an overconfident model cannot collapse the
budget. H_ref defaults to ln(V) / 2 of the served model. With r_min = r_max (the default) the
budget is fixed: measured against it at the same mean share, the entropy-sized budget did not
do better (README "Pruning"). Rows shorter than `min_context` tokens are not pruned (None: the
crossover measured by the server, `sgl_entropic.crossover`). The counts are fixed per step and the
same on every layer, so every layer of a step gathers the same shapes (and one FlashInfer plan
serves all layers on CUDA).

A step's plan (`StepPlan`)
--------------------------
Row r attends its fixed pages (the first `sink_blocks` and the last `recent_blocks`, the last one
possibly partial) and its kept candidates; `attend_layer` gathers them for the whole batch at
once, padded to the widest row and masked.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sgl_entropic.config import PruningConfig

AGGREGATES: tuple[str, ...] = ("max", "mean", "sum")
DEFAULT_AGGREGATE = "max"
# H_ref in nats: rho reaches max_keep_ratio at this entropy. About ln(V) / 2 for V in 32k..152k.
DEFAULT_REFERENCE_ENTROPY = 5.0

_INF = float("inf")


def reference_entropy_for_vocab(vocab_size: int) -> float:
    """ln(V) / 2 nats: half the entropy of the uniform distribution over the vocabulary."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return math.log(vocab_size) / 2.0


def num_pages(context_len: int, page_size: int) -> int:
    """ceil(context_len / page_size): the pages of a context, the last one possibly partial."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    return -(-context_len // page_size)


# ---------------------------------------------------------------------------- the budget


def keep_ratio(entropy: float, cfg: PruningConfig, reference_entropy: float = DEFAULT_REFERENCE_ENTROPY) -> float:
    """rho(H) in [min_keep_ratio, max_keep_ratio]: the share of candidate pages kept (see module doc)."""
    if not (math.isfinite(reference_entropy) and reference_entropy > 0):
        raise ValueError(f"reference_entropy must be finite and > 0, got {reference_entropy}")
    h = float(entropy)
    lo, hi = cfg.min_keep_ratio, cfg.max_keep_ratio
    if math.isnan(h):
        return hi
    fraction = max(h, cfg.entropy_floor, 0.0) / reference_entropy
    if fraction >= 1.0:
        return hi  # exactly, not lo + (hi - lo) with its rounding
    return min(max(lo + (hi - lo) * fraction, lo), hi)


@dataclass(frozen=True)
class RowPages:
    """One row's page counts at a decode step: n = sink + candidates + recent; of the candidates the
    bound shortlists `shortlist` (whose keys the exact rescoring reads) and `keep` are attended."""

    length: int
    page_size: int
    n: int
    sink: int
    recent: int
    keep: int
    shortlist: int

    @property
    def candidates(self) -> int:
        return self.n - self.sink - self.recent

    @property
    def kept_tokens(self) -> int:
        """Tokens read: the dropped pages are candidates, all full (the partial last page is recent)."""
        return self.length - (self.candidates - self.keep) * self.page_size

    @property
    def read_pages(self) -> int:
        """Pages one decode step attends: sink, kept candidates, recent."""
        return self.sink + self.keep + self.recent

    @property
    def prunes(self) -> bool:
        return self.keep < self.candidates

    def with_keep(self, keep: int) -> "RowPages":
        keep = min(keep, self.candidates)
        return dataclasses.replace(self, keep=keep, shortlist=max(keep, min(self.shortlist, self.candidates)))


def row_pages(length: int, entropy: float, cfg: PruningConfig,
              reference_entropy: float = DEFAULT_REFERENCE_ENTROPY) -> RowPages:
    """The page counts of one row: guards first, then keep = ceil(rho(H) * candidates), and a shortlist
    of ceil(shortlist_ratio * candidates) (at least keep) when the exact rescoring is on."""
    n = num_pages(length, cfg.page_size)
    recent = min(cfg.recent_blocks, n)
    sink = min(cfg.sink_blocks, n - recent)
    m = n - sink - recent
    if length < (cfg.min_context or 0):
        return RowPages(length, cfg.page_size, n, sink, recent, m, m)
    keep = min(m, math.ceil(keep_ratio(entropy, cfg, reference_entropy) * m))
    shortlist = keep if cfg.shortlist_ratio is None else max(keep, min(m, math.ceil(cfg.shortlist_ratio * m)))
    return RowPages(length, cfg.page_size, n, sink, recent, keep, shortlist)


def all_pages(length: int, page_size: int) -> RowPages:
    """A row that attends every page (the dense kernel): all of them fixed, no candidates."""
    n = num_pages(length, page_size)
    return RowPages(length, page_size, n, n, 0, 0, 0)


# ---------------------------------------------------------------------------- a step's plan


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
    def build(cls, rows: Sequence[RowPages], page_table: torch.Tensor, per_head: bool = False,
              group_tokens: Optional[int] = None) -> "StepPlan":
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
                plan.parts = [(a, b, cls._build(rows[a:b], page_table[a:b, : max(r.n for r in rows[a:b])], per_head))
                              for a, b in bounds]
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
            tokens.append([p] * (len(logical) - 1) + [last] + [0] * (f_cols - len(logical)) if logical else [0] * f_cols)
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
        return cls(list(rows), p, page_table, page_table.gather(1, fixed_logical), fixed_tokens, candidate,
                   torch.arange(s_cols, device=device)[None, :] < shortlist[:, None],
                   torch.arange(k_cols, device=device)[None, :] < keep[:, None], per_head)

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
        return [1.0 - sparse_layer_share * (1.0 - (r.kept_tokens + 0.5 * (r.shortlist - r.keep) * r.page_size)
                                            / r.length) if r.length else 1.0 for r in self.rows]


def to_device(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A host list on `device` without blocking: through pinned memory when the device is a GPU."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# ---------------------------------------------------------------------------- page scores


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The bound summed over KV heads `[B, NP]` float32 (module doc): per KV head the max over its query
    group of relu(q).kmax + min(q, 0).kmin, summed over the KV heads.

    q `[B, H_q, D]`; kmin, kmax `[B, NP, H_kv, D]` (each row's pages gathered); query head h reads
    KV head h // (H_q / H_kv).
    """
    heads_q, dim = q.shape[1:]
    heads_kv = kmin.shape[2]
    if heads_q % heads_kv or kmin.shape != kmax.shape or kmin.shape[3] != dim:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    return quest_bounds(q, kmin, kmax, per_head=False)[:, 0]


def _check_aggregate(aggregate: str) -> None:
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")


def surprisal_scores(surprisal: torch.Tensor, lengths: torch.Tensor, page_size: int,
                     aggregate: str = DEFAULT_AGGREGATE) -> torch.Tensor:
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


# ---------------------------------------------------------------------------- attention over pages


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """`[B, L, NP]` float32: the bound per KV head (L = H_kv) or summed over them (L = 1); see quest_scores."""
    batch, heads_q, dim = q.shape
    heads_kv = kmin.shape[2]
    qg = q.float().view(batch, heads_kv, heads_q // heads_kv, dim)
    to_cols = lambda k: k.float().permute(0, 2, 3, 1)  # noqa: E731  [B, H_kv, D, NP]
    bound = (qg.clamp(min=0) @ to_cols(kmax) + qg.clamp(max=0) @ to_cols(kmin)).amax(dim=2)  # [B, H_kv, NP]
    return bound if per_head else bound.sum(dim=1, keepdim=True)


def take_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` through index_select: on CPU 4-8x faster than advanced indexing for these rows."""
    return table.index_select(0, index.flatten()).view(*index.shape, *table.shape[1:])


def gather_pages(cache_pages: torch.Tensor, physical: torch.Tensor) -> torch.Tensor:
    """`[B, H_kv, X, P, D]` from pages `[pages, P, H_kv, D]`: physical `[B, 1, X]` (every KV head reads the
    same pages) or `[B, H_kv, X]` (each head its own)."""
    if physical.shape[1] == 1:
        return take_rows(cache_pages, physical[:, 0]).permute(0, 3, 1, 2, 4)
    heads = torch.arange(physical.shape[1], device=physical.device)[None, :, None]
    return cache_pages[physical, :, heads]


def attend_layer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                 kmin: Optional[torch.Tensor], kmax: Optional[torch.Tensor], scale: float
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`attend_rows` over the whole batch, or over the plan's row groups one after the other."""
    if not plan.parts:
        return attend_rows(q, k_cache, v_cache, plan, kmin, kmax, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    kept = []
    for start, end, part in plan.parts:
        if plan.chosen is not None:
            part.chosen = plan.chosen[start:end, :, : part.keep_valid.shape[1]]
        out[start:end], part_kept = attend_rows(q[start:end], k_cache, v_cache, part, kmin, kmax, scale)
        kept.append(part_kept)
    present = [k for k in kept if k is not None]
    if not present:
        return out, None
    lists, width = present[0].shape[1], max(k.shape[2] for k in present)
    padded = [torch.nn.functional.pad(k, (0, width - k.shape[2])) if k is not None else
              torch.zeros(end - start, lists, width, dtype=torch.long, device=q.device)
              for k, (start, end, _) in zip(kept, plan.parts)]
    return out, torch.cat(padded)  # [B, L, K]: row b's first keep_b columns are its kept pages


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                kmin: Optional[torch.Tensor], kmax: Optional[torch.Tensor], scale: float
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One decode query per row over its fixed pages and its selected candidates, in one batched pass:
    q `[B, H_q, D]`, caches `[slots, H_kv, D]` (slot = page * page_size + offset), kmin/kmax the layer's
    page store `[pages, H_kv, D]` -> (`[B, H_q, D_v]` in q's dtype, the kept logical pages `[B, L, K]` or
    None).

    Selection (module doc): the bound ranks the candidates; with a shortlist longer than `keep`, the
    shortlisted pages' keys are read with the fixed pages' in one gather, one softmax over all of them
    gives each shortlisted page's attention mass (summed over the query heads a list serves), the
    `keep` heaviest are kept, and their weights, renormalised with the fixed pages', are the attention
    over exactly those pages (softmax restricted to a subset is the renormalised softmax). Logits and
    softmax in float32, values in the cache's dtype (weights rounded to it, as the output is); GQA:
    query head h reads KV head h // (H_q / H_kv). Rows are padded to the batch's widest row and masked.
    """
    batch, heads_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    group = heads_q // heads_kv
    p = plan.page_size
    k_pages = k_cache.view(-1, p, heads_kv, dim)
    v_pages = v_cache.view(-1, p, heads_kv, v_cache.shape[-1])
    fixed, cols = plan.fixed_pages[:, None], plan.fixed_pages.shape[1]
    kept = None
    if not plan.keep_valid.shape[1]:  # every page fixed, or nothing to choose
        candidates, valid = fixed[:, :, :0], plan.keep_valid
    elif plan.chosen is not None:
        kept, valid = plan.chosen, plan.keep_valid
    else:
        bound = quest_bounds(q, take_rows(kmin, plan.page_table), take_rows(kmax, plan.page_table), plan.per_head)
        bound = bound.masked_fill(~plan.candidate[:, None], -_INF)
        if plan.two_stage:
            candidates, valid = bound.topk(plan.shortlist_valid.shape[1], dim=-1).indices, plan.shortlist_valid
        else:
            kept, valid = bound.topk(plan.keep_valid.shape[1], dim=-1).indices, plan.keep_valid
    if kept is not None:
        candidates = kept
    lists = candidates.shape[1]
    physical = torch.cat([fixed.expand(-1, lists, -1), plan.page_table.gather(1, candidates.flatten(1)).view_as(candidates)],
                         dim=2)
    keys = gather_pages(k_pages, physical).float().flatten(2, 3)  # [B, H_kv, (F + X) * P, D]
    logits = (q.float().view(batch, heads_kv, group, dim) @ keys.transpose(-1, -2)) * scale
    tokens = torch.cat([plan.fixed_tokens, valid[:, :, None].expand(-1, -1, p)], dim=1)  # [B, F + X, P]
    logits = logits.masked_fill(~tokens.flatten(1)[:, None, None], -_INF)
    weights = torch.softmax(logits, dim=-1)  # [B, H_kv, G, (F + X) * P]
    if kept is None and plan.keep_valid.shape[1]:  # two stages: keep the heaviest shortlisted pages
        mass = weights.view(batch, heads_kv, group, -1, p)[:, :, :, cols:].sum(dim=-1)  # [B, H_kv, G, S]
        mass = mass.sum(dim=2) if lists > 1 else mass.sum(dim=(1, 2))[:, None]
        k_cols = plan.keep_valid.shape[1]
        pick = mass.masked_fill(~plan.shortlist_valid[:, None], -1.0).topk(k_cols, dim=-1).indices  # [B, L, K]
        kept = candidates.gather(-1, pick)
        index = torch.cat([torch.arange(cols, device=q.device).expand(batch, lists, -1), cols + pick], dim=2)
        index = index.expand(-1, heads_kv, -1) if lists == 1 else index
        weights = weights.view(batch, heads_kv, group, -1, p).gather(3, index[:, :, None, :, None].expand(
            -1, -1, group, -1, p))
        kept_tokens = torch.cat([plan.fixed_tokens, plan.keep_valid[:, :, None].expand(-1, -1, p)], dim=1)
        weights = weights.flatten(-2) * kept_tokens.flatten(1)[:, None, None]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        physical = torch.cat([physical[:, :, :cols], physical[:, :, cols:].gather(-1, pick)], dim=2)
    values = gather_pages(v_pages, physical).flatten(2, 3)  # [B, H_kv, T, D_v]
    out = weights.to(values.dtype) @ values
    return out.reshape(batch, heads_q, -1).to(q.dtype), kept


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept_token_idx: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """The plain-math reference: one decode query attending only the kept tokens, `[H_q, D_v]`.

    q `[H_q, D]`, k `[T, H_kv, D]`, v `[T, H_kv, D_v]`; query head h reads KV head
    h // (H_q / H_kv). kept_token_idx: int positions in [0, T) (None: all, i.e. dense); scale
    defaults to 1 / sqrt(D). Computed in float32, returned in q's dtype; exactly
    softmax(q K_S^T * scale) V_S over the kept set S.
    """
    if q.dim() != 2 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"want q [H_q, D], k [T, H_kv, D], v [T, H_kv, D_v]; got {q.shape}, {k.shape}, {v.shape}")
    heads_q, dim = q.shape
    length, heads_kv, dim_k = k.shape
    if dim_k != dim or v.shape[:2] != k.shape[:2] or heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kept_token_idx is not None:
        idx = kept_token_idx.to(device=k.device, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= length):
            raise ValueError(f"kept_token_idx must lie in [0, {length})")
        k, v = k.index_select(0, idx), v.index_select(0, idx)
    if k.shape[0] == 0:
        raise ValueError("no token to attend (the recent guard keeps at least one)")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = heads_q // heads_kv
    qg = q.float().view(heads_kv, group, dim)
    logits = torch.einsum("hgd,thd->hgt", qg, k.float()) * scale
    out = torch.einsum("hgt,the->hge", torch.softmax(logits, dim=-1), v.float())
    return out.reshape(heads_q, v.shape[-1]).to(q.dtype)
