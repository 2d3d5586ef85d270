"""The meso loop: which KV pages a decode step attends (torch only, never sglang).

A request's context is cut into pages of `page_size` tokens, the same pages as SGLang's paged
KV cache (the launcher runs SGLang with `--page-size` = `pruning.page_size`, so logical page j
of a request is one physical page of the pool and radix-shared prefixes share pages). A decode
step attends the first `sink_blocks` pages (attention sinks), the last `recent_blocks` pages
(local context) and `keep` of the other pages, the candidates. Prefill stays dense, and pruning
is a view: nothing is evicted, each step and layer selects again over the whole context.

Which candidates (`PruningConfig.selector`)
-------------------------------------------
- "quest" (default): per layer, by an upper bound of the query's attention logit on the page.
  The store keeps, per page and KV head, the element-wise min and max of its keys (written as KV
  is written); for a query q the largest q.k over the page is at most
  b = sum_d max(q_d kmax_d, q_d kmin_d) = relu(q).kmax + min(q, 0).kmin (Quest, MLSys 2024).
  The grouped query heads of a KV head reduce by max (still an upper bound), the KV heads by sum
  (one page list per request and layer, as FlashInfer's paged decode needs).
- "quest_gated": "quest", but a request re-selects only when its last sampled token surprised
  the model (surprisal > `gate_surprisal` nats) or its selection is `gate_max_age` steps old;
  otherwise every layer reuses its last selection. Surprisal decides WHEN to look again.
- "surprisal": the paper's method: page score = max surprisal of its tokens, the same pages on
  every layer. Prompt tokens are scored from the model's own logits at prefill (an lm_head pass
  over the prompt), sampled tokens at decode.

Why "quest" is the default, measured (README "Pruning"; teacher-forced along the dense greedy
path, real essays and source code at 4k and 7k tokens): surprisal-only selection misses the
pages the current query needs (top-1 agreement ~75 %, KL ~0.5 nats), because a predictable
token can be exactly what a later query attends to. The bound, with the same budget, keeps KL
below 0.01 nats. Sharing one page list across heads (sum over KV heads) costs little against
per-head lists, and max over the query group beats SGLang's group-mean query slightly. Gating
re-selection by surprisal saves selection work but loses a little quality at equal budget.

How many (the entropy budget)
-----------------------------
keep = ceil(rho(H_t) * m) of the m candidates, with H_t the request's latest next-token
entropy (nats), H_ref > 0 a reference entropy and the config's `min_keep_ratio` r_min,
`max_keep_ratio` r_max and `entropy_floor` H_floor:

    rho(H) = r_min + (r_max - r_min) * min(max(H, H_floor, 0) / H_ref, 1)

A confident model (low H) attends less, an uncertain one more; a NaN entropy (unknown) keeps
r_max; below H_floor rho stays at rho(H_floor), so an overconfident model cannot collapse the
budget. H_ref defaults to ln(V) / 2 of the served model. Rows shorter than `min_context` tokens
are not pruned (None: the crossover measured by the server, `sgl_entropic.crossover`). The counts are fixed per step and the same on every layer, so one FlashInfer plan
serves all layers and only the page list changes per layer.

Layout of a step (`PageLayout`)
-------------------------------
Row r reads at most K = S + KC + R pages, columns [sink | selected candidates | recent]: sink
column j is page j (valid if j < sink_r), candidate column j is the j-th selected page in
ascending order (valid if j < keep_r), recent column j is page n_r - R + j (valid if
j >= R - recent_r). Valid pages are therefore in ascending page order, the last one being the
(possibly partial) last page.
"""

from __future__ import annotations

import dataclasses
import functools
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
    """One row's page counts at a decode step: n = sink + candidates + recent, keep <= candidates."""

    length: int
    page_size: int
    n: int
    sink: int
    recent: int
    keep: int

    @property
    def candidates(self) -> int:
        return self.n - self.sink - self.recent

    @property
    def kept_tokens(self) -> int:
        """Tokens read: the dropped pages are candidates, all full (the partial last page is recent)."""
        return self.length - (self.candidates - self.keep) * self.page_size

    @property
    def read_pages(self) -> int:
        """Pages one decode step reads: sink, kept candidates, recent."""
        return self.sink + self.keep + self.recent

    @property
    def prunes(self) -> bool:
        return self.keep < self.candidates

    def with_keep(self, keep: int) -> "RowPages":
        return dataclasses.replace(self, keep=min(keep, self.candidates))


def row_pages(length: int, entropy: float, cfg: PruningConfig,
              reference_entropy: float = DEFAULT_REFERENCE_ENTROPY) -> RowPages:
    """The page counts of one row: guards first, then keep = ceil(rho(H) * candidates)."""
    n = num_pages(length, cfg.page_size)
    recent = min(cfg.recent_blocks, n)
    sink = min(cfg.sink_blocks, n - recent)
    m = n - sink - recent
    keep = m if length < (cfg.min_context or 0) else min(m, math.ceil(keep_ratio(entropy, cfg, reference_entropy) * m))
    return RowPages(length, cfg.page_size, n, sink, recent, keep)


# ---------------------------------------------------------------------------- a step's layout


@dataclass
class PageLayout:
    """The pages a decode batch may attend, and the fixed [sink | selected | recent] columns (module doc).

    Built once per decode step; every layer of the step fills the selected columns (`select`)
    and reads the same counts.
    """

    rows: list[RowPages]
    page_size: int
    page_table: torch.Tensor  # [B, NP] int64: physical page of each logical page (padding: page 0)
    lengths: torch.Tensor  # [B] int64, on the page table's device
    sink_cols: int
    keep_cols: int
    recent_cols: int
    candidate_mask: torch.Tensor  # [B, NP] bool
    fixed_logical: torch.Tensor  # [B, S + R] int64: the sink then the recent columns' pages
    fixed_valid: torch.Tensor  # [B, S + R] bool
    keep_valid: torch.Tensor  # [B, KC] bool: j < keep_r

    @classmethod
    def build(cls, rows: Sequence[RowPages], page_table: torch.Tensor) -> "PageLayout":
        device = page_table.device
        batch, width = page_table.shape
        page_size = rows[0].page_size if rows else 1
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        n, sink, recent, keep = (t([getattr(r, f) for r in rows]) for f in ("n", "sink", "recent", "keep"))
        s_cols = max((r.sink for r in rows), default=0)
        r_cols = max((r.recent for r in rows), default=0)
        k_cols = max((r.keep for r in rows), default=0)
        j = torch.arange(width, device=device)[None, :]
        candidate = (j >= sink[:, None]) & (j < (n - recent)[:, None])
        js, jr = torch.arange(s_cols, device=device)[None, :], torch.arange(r_cols, device=device)[None, :]
        recent_logical = n[:, None] - r_cols + jr
        fixed_logical = torch.cat([js.expand(batch, -1), recent_logical.clamp_min(0)], dim=1)
        fixed_valid = torch.cat([js < sink[:, None], jr >= (r_cols - recent)[:, None]], dim=1)
        keep_valid = torch.arange(k_cols, device=device)[None, :] < keep[:, None]
        return cls(list(rows), page_size, page_table, t([r.length for r in rows]), s_cols, k_cols, r_cols,
                   candidate, fixed_logical, fixed_valid, keep_valid)

    def attended_fractions(self, sparse_layer_share: float) -> list[float]:
        """Per row, the share of its context one decode step reads, averaged over layers: the sparse
        layers read the kept pages, the others (dense_layers) everything."""
        return [1.0 - sparse_layer_share * (1.0 - r.kept_tokens / r.length) if r.length else 1.0 for r in self.rows]

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical pages [B, K], valid [B, K]) keeping each row's `keep` best-scored candidates.

        Canonical: higher score first, the lower page among equal scores; the selected pages
        are listed in ascending order. NaN scores count as +inf (an unknown page is kept).
        """
        s = scores.float()
        s = torch.where(torch.isnan(s), _INF, s).masked_fill(~self.candidate_mask, -_INF)
        best = torch.sort(s, dim=1, descending=True, stable=True).indices[:, : self.keep_cols]
        width = self.page_table.shape[1]
        chosen = torch.where(self.keep_valid, best, width).sort(dim=1).values  # invalid ones last
        chosen = torch.where(self.keep_valid, chosen, 0)
        return self.assemble(chosen)

    def assemble(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full [sink | chosen | recent] columns around selected candidates `chosen` [B, KC]."""
        logical = torch.cat([self.fixed_logical[:, : self.sink_cols], chosen, self.fixed_logical[:, self.sink_cols:]], 1)
        valid = torch.cat([self.fixed_valid[:, : self.sink_cols], self.keep_valid,
                           self.fixed_valid[:, self.sink_cols:]], 1)
        return logical, valid

    @functools.cached_property
    def compact_cells(self) -> torch.Tensor:
        """Host int64: flat positions in the [B, K] layout of each row's valid cells, row by row, in
        page order (the compact list a paged-attention kernel reads; the row's last page comes last)."""
        width = self.sink_cols + self.keep_cols + self.recent_cols
        cells: list[int] = []
        for r, row in enumerate(self.rows):
            base = r * width
            cells += range(base, base + row.sink)
            cells += range(base + self.sink_cols, base + self.sink_cols + row.keep)
            cells += range(base + width - row.recent, base + width)
        return torch.tensor(cells, dtype=torch.long)

    @functools.cached_property
    def compact_tokens(self) -> torch.Tensor:
        """Host int64: among the compact pages expanded to page_size slots each, the positions of the
        real tokens (all of every page but the last, which holds length - (n - 1) * page_size)."""
        keep: list[int] = []
        start = 0
        for row in self.rows:
            count, p = row.read_pages, row.page_size
            keep += range(start, start + (count - 1) * p + row.length - (row.n - 1) * p)
            start += count * p
        return torch.tensor(keep, dtype=torch.long)

    def physical(self, logical: torch.Tensor) -> torch.Tensor:
        return self.page_table.gather(1, logical)

    def kept_pages(self, logical: torch.Tensor) -> list[torch.Tensor]:
        """Each row's kept physical pages in page order (its partial last page last)."""
        compact = self.physical(logical).flatten()[self.compact_cells.to(logical.device)]
        return list(torch.split(compact, [r.read_pages for r in self.rows]))


# ---------------------------------------------------------------------------- page scores


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The "quest" page score `[B, NP]` float32 (module doc): per KV head the max over its query
    group of the bound relu(q).kmax + min(q, 0).kmin, summed over the KV heads.

    q `[B, H_q, D]`; kmin, kmax `[B, NP, H_kv, D]` (each row's pages gathered); query head h reads
    KV head h // (H_q / H_kv).
    """
    batch, heads_q, dim = q.shape
    heads_kv = kmin.shape[2]
    if heads_q % heads_kv or kmin.shape != kmax.shape or kmin.shape[3] != dim:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    qg = q.float().view(batch, heads_kv, heads_q // heads_kv, dim)
    to_cols = lambda k: k.float().permute(0, 2, 3, 1)  # noqa: E731  [B, H_kv, D, NP]
    bound = qg.clamp(min=0) @ to_cols(kmax) + qg.clamp(max=0) @ to_cols(kmin)  # [B, H_kv, G, NP]
    return bound.amax(dim=2).sum(dim=1)


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


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: Sequence[torch.Tensor],
                           kept_tokens: Sequence[int], page_size: int, scale: float) -> torch.Tensor:
    """One decode query per row over its kept pages: q `[B, H_q, D]`, caches `[slots, H_kv, D]`
    (slot = page * page_size + offset), pages[r] the row's physical pages in page order (its
    partial last page last), kept_tokens[r] their real tokens -> `[B, H_q, D_v]` in q's dtype.

    Row by row in plain float32 matmuls: for one query row this is about ten times faster on
    CPU than torch's scaled_dot_product_attention (whose fused kernels target blocks of queries),
    needs no padding mask, and is at least as accurate as a bf16 kernel. GQA: query head h reads
    KV head h // (H_q / H_kv).
    """
    batch, heads_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    k_pages = k_cache.view(-1, page_size, heads_kv, dim)
    v_pages = v_cache.view(-1, page_size, heads_kv, v_cache.shape[-1])
    out = q.new_empty(batch, heads_q, v_cache.shape[-1])
    for r in range(batch):
        n = kept_tokens[r]
        k = k_pages[pages[r]].flatten(0, 1)[:n].float()  # [T, H_kv, D]
        v = v_pages[pages[r]].flatten(0, 1)[:n].float()
        logits = (q[r].float().view(heads_kv, -1, dim) @ k.permute(1, 2, 0)) * scale  # [H_kv, G, T]
        out[r] = (torch.softmax(logits, dim=-1) @ v.transpose(0, 1)).reshape(heads_q, -1)
    return out


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
