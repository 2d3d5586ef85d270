"""The meso loop: entropic attention pruning over a paged KV cache (torch only, never sglang).

The context of a request is cut into blocks of `page_size` tokens (block b holds the tokens
[b * page_size, (b + 1) * page_size), the last block may be partial). Each block gets an
information score I_b from the surprisal s_i = -ln p(x_i) (nats) of its tokens: prompt tokens
scored at prefill, sampled tokens at decode. A decode step attends only to the blocks with
I_b >= theta_t, plus the guards: the first `sink_blocks` blocks (attention sinks) and the last
`recent_blocks` blocks (local context) are always kept. Prefill stays dense, and pruning is a
view: no KV is evicted, so a block pruned at step t can be attended again at step t + 1.

Block score (aggregate)
-----------------------
`block_scores(..., aggregate=)` supports "max", "mean" and "sum"; the default is **max**:

- max keeps a block that holds a single highly informative token (a passkey digit, a name,
  a number) however predictable its neighbours are. mean divides that token's surprisal by
  page_size; sum does not dilute it but ranks a full block of mildly surprising tokens above it.
- max needs no length correction for the partial last block (sum would penalise it, mean
  corrects it by normalising), and that block is a recent block anyway.
- max is exact in floating point (no summation order), so the Triton kernel equals the torch
  reference bit for bit, scores and masks.

Missing surprisals are conservative: a non-finite token surprisal (NaN: never computed,
+inf: p = 0, -inf: invalid) counts as +inf, so the block score is +inf for every aggregate and
the block is always kept, whatever the keep count (a +inf score ties with theta <= +inf).

Keep ratio and dynamic threshold theta_t
----------------------------------------
With H_t the request's current next-token entropy (nats), H_ref > 0 a reference entropy and
the config's `min_keep_ratio` r_min, `max_keep_ratio` r_max and `entropy_floor` H_floor:

    H_eff  = max(H_t, H_floor, 0)
    rho(H) = clip(r_min + (r_max - r_min) * min(H_eff / H_ref, 1), r_min, r_max)

rho is monotone non-decreasing in H_t: a confident model (low H) prunes more, an uncertain
one keeps more; rho reaches r_max at H_t >= H_ref. H_ref defaults to
`DEFAULT_REFERENCE_ENTROPY` = 5 nats, about ln(V) / 2 for the vocabularies in use (ln(49152) / 2
= 5.4 for SmolLM2, ln(32000) / 2 = 5.2, ln(152064) / 2 = 6.0); `reference_entropy_for_vocab(V)`
gives ln(V) / 2 for a given model. A NaN entropy (unknown) gives r_max.

The floor: below H_floor the model does not prune MORE than at H_floor, i.e. rho is constant
rho(H_floor) on [0, H_floor]. A miscalibrated, overconfident model (H_t ~ 0 while it is
wrong) therefore keeps rho(H_floor) of its blocks instead of collapsing to r_min.
H_floor = 0 (the config default) disables the guard, and H_floor >= H_ref means "never prune
below r_max".

Of the n blocks of a context, the g = min(n, sink + recent) guarded ones are always kept and
the m = n - g others (the candidates, blocks sink_blocks .. n - recent_blocks - 1) are ranked
by score. The keep count is k = ceil(rho * m), a fraction of the candidates (not of n), so
that the entropy signal always acts on the scored blocks and the kept fraction
(g + k) / n >= rho: min_keep_ratio stays a lower bound on the fraction of the context
attended. The threshold is data-adaptive:

    theta_t = the k-th largest candidate score  (+inf when k <= 0, -inf when k >= m)

and the kept candidates are exactly those with I_b >= theta_t, so ties at the threshold are
all kept (deterministic; more than k blocks may be kept, never fewer). When the context is
shorter than `min_context` tokens nothing is pruned (theta_t = -inf).

`dense_layers` (the first layers attend densely) is applied by the attention backend, not here;
`PruneStats.attended_tokens` accounts for it.

Batched form and kernel
-----------------------
`plan_decode(surprisal [B, T], lengths [B], entropies, cfg)` is what a decode step runs: keep
counts on the host, then `block_select` once for the batch, expanded to the kept token positions
(`DecodePlan`). `select_blocks_batched(scores [B, NB], n_blocks [B], keep_counts [B], sink, recent)`
is the batched selection; `block_select_reference` also aggregates a padded `[B, T]` surprisal
tensor with per-row lengths into scores first. The Triton kernel
`sgl_entropic.kernels.block_select.block_select_triton` must equal `block_select_reference`
(exactly for "max"; for "mean"/"sum" its scores agree up to fp32 summation order and its mask
equals `select_blocks_batched` of its own scores exactly). `block_select` dispatches to the
kernel on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sgl_entropic.kernels import triton_available

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


def num_blocks(context_len: int, page_size: int) -> int:
    """ceil(context_len / page_size): the blocks of a context, the last one possibly partial."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    return -(-context_len // page_size)


def _check_aggregate(aggregate: str) -> None:
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")


def _sanitize_surprisal(x: torch.Tensor) -> torch.Tensor:
    """float32; non-finite -> +inf (unknown is kept); -0.0 -> +0.0 (one zero, for exact keys)."""
    x = x.float()
    x = torch.where(torch.isfinite(x), x, _INF)
    return torch.where(x == 0, 0.0, x)


def block_scores_batched(
    surprisal: torch.Tensor, lengths: torch.Tensor, page_size: int, aggregate: str = DEFAULT_AGGREGATE
) -> torch.Tensor:
    """Block scores of a padded batch: surprisal `[B, T]`, lengths `[B]` -> float32 `[B, NB]`.

    NB = ceil(T / page_size); row r has ceil(lengths[r] / page_size) blocks, the last one
    covering only its tokens below lengths[r]; entries past a row's blocks are -inf. Values
    past lengths[r] are ignored. See `block_scores` for the aggregate and the non-finite rule.
    """
    _check_aggregate(aggregate)
    if surprisal.dim() != 2:
        raise ValueError(f"surprisal must be [B, T], got shape {tuple(surprisal.shape)}")
    batch, width = surprisal.shape
    n_blocks_max = num_blocks(width, page_size)
    lengths = lengths.to(device=surprisal.device, dtype=torch.long).reshape(batch)
    if batch and (int(lengths.min()) < 0 or int(lengths.max()) > width):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths.tolist()}")
    padded_width = n_blocks_max * page_size
    x = _sanitize_surprisal(surprisal)
    x = torch.nn.functional.pad(x, (0, padded_width - width))
    valid = torch.arange(padded_width, device=x.device)[None, :] < lengths[:, None]
    x = x.view(batch, n_blocks_max, page_size)
    valid = valid.view(batch, n_blocks_max, page_size)
    counts = valid.sum(dim=-1)
    if aggregate == "max":
        scores = torch.where(valid, x, -_INF).amax(dim=-1)
    else:
        total = torch.where(valid, x, 0.0).sum(dim=-1)
        scores = total / counts.clamp_min(1) if aggregate == "mean" else total
    return torch.where(counts > 0, scores, -_INF)


def block_scores(token_surprisal: torch.Tensor, page_size: int, aggregate: str = DEFAULT_AGGREGATE) -> torch.Tensor:
    """I_b of one request: token surprisal `[T]` (nats) -> float32 `[ceil(T / page_size)]`.

    aggregate: "max" (default, see the module docstring), "mean" (over the tokens present, so
    the partial last block is length-normalised) or "sum". A non-finite surprisal counts as
    +inf, making its block's score +inf (always kept).
    """
    if token_surprisal.dim() != 1:
        raise ValueError(f"token_surprisal must be [T], got shape {tuple(token_surprisal.shape)}")
    length = torch.tensor([token_surprisal.shape[0]], device=token_surprisal.device)
    return block_scores_batched(token_surprisal[None, :], length, page_size, aggregate)[0]


def keep_ratio(
    entropy: float, cfg: PruningConfig, reference_entropy: float = DEFAULT_REFERENCE_ENTROPY
) -> float:
    """rho(H) in [min_keep_ratio, max_keep_ratio]: the fraction of non-guarded blocks kept.

    rho = clip(r_min + (r_max - r_min) * min(max(H, H_floor, 0) / H_ref, 1), r_min, r_max);
    monotone non-decreasing in H, constant on [0, H_floor]; NaN entropy -> r_max.
    """
    if not (math.isfinite(reference_entropy) and reference_entropy > 0):
        raise ValueError(f"reference_entropy must be finite and > 0, got {reference_entropy}")
    h = float(entropy)
    lo, hi = cfg.min_keep_ratio, cfg.max_keep_ratio
    if math.isnan(h):
        return hi
    h_eff = max(h, cfg.entropy_floor, 0.0)
    fraction = h_eff / reference_entropy
    if fraction >= 1.0:
        return hi  # exactly, not lo + (hi - lo) with its rounding
    return min(max(lo + (hi - lo) * fraction, lo), hi)


def _guard_counts(n_blocks: int, sink: int, recent: int) -> int:
    """m: the number of candidate (non-guarded) blocks among n_blocks."""
    return max(0, n_blocks - sink - recent)


def keep_count(
    context_len: int, entropy: float, cfg: PruningConfig, reference_entropy: float = DEFAULT_REFERENCE_ENTROPY
) -> int:
    """k: how many non-guarded blocks to keep; all m of them below min_context, else ceil(rho * m)."""
    n = num_blocks(context_len, cfg.page_size)
    m = _guard_counts(n, cfg.sink_blocks, cfg.recent_blocks)
    if context_len < cfg.min_context:
        return m
    return min(m, math.ceil(keep_ratio(entropy, cfg, reference_entropy) * m))


def plan_keep_counts(
    context_lens: Sequence[int],
    entropies: Sequence[float],
    cfg: PruningConfig,
    reference_entropy: float = DEFAULT_REFERENCE_ENTROPY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side plan of a decode batch: (n_blocks, keep_counts), int64 `[B]` each.

    Row r is `num_blocks(context_lens[r])` and `keep_count(context_lens[r], entropies[r])`, the
    inputs of `select_blocks_batched` / `block_select`. Computed with Python floats, so it
    equals the per-request `select_blocks` exactly.
    """
    lens = [int(c) for c in (context_lens.tolist() if torch.is_tensor(context_lens) else context_lens)]
    ents = [float(h) for h in (entropies.tolist() if torch.is_tensor(entropies) else entropies)]
    if len(lens) != len(ents):
        raise ValueError(f"{len(lens)} context lengths but {len(ents)} entropies")
    n = [num_blocks(c, cfg.page_size) for c in lens]
    k = [keep_count(c, h, cfg, reference_entropy) for c, h in zip(lens, ents)]
    return torch.tensor(n, dtype=torch.long), torch.tensor(k, dtype=torch.long)


def guard_mask(n_blocks: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """bool `[n_blocks]`: True on the first `sink` and the last `recent` blocks."""
    j = torch.arange(n_blocks, device=device)
    return (j < sink) | (j >= n_blocks - recent)


def select_blocks_batched(
    scores: torch.Tensor,
    n_blocks: torch.Tensor,
    keep_counts: torch.Tensor,
    sink: int,
    recent: int,
) -> torch.Tensor:
    """Kept-block mask `[B, NB]` bool from padded scores `[B, NB]` (the kernel's reference).

    Row r has n = n_blocks[r] <= NB blocks; entries j >= n are padding (any value, -inf by
    convention) and come out False. Guards j < sink and n - recent <= j < n are kept. The
    candidates sink <= j < n - recent are kept when score >= theta_r, theta_r being the
    keep_counts[r]-th largest candidate score, +inf when keep_counts[r] <= 0 and -inf when
    keep_counts[r] >= the number of candidates. NaN scores count as +inf (always kept).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, NB], got shape {tuple(scores.shape)}")
    if sink < 0 or recent < 0:
        raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
    batch, width = scores.shape
    device = scores.device
    n = n_blocks.to(device=device, dtype=torch.long).reshape(batch)
    k = keep_counts.to(device=device, dtype=torch.long).reshape(batch)
    if batch and (int(n.min()) < 0 or int(n.max()) > width):
        raise ValueError(f"n_blocks must lie in [0, {width}], got {n.tolist()}")
    s = scores.float()
    s = torch.where(torch.isnan(s), _INF, s)
    j = torch.arange(width, device=device)[None, :]
    in_row = j < n[:, None]
    guard = in_row & ((j < sink) | (j >= (n - recent)[:, None]))
    candidate = in_row & ~guard
    m = candidate.sum(dim=1)
    if width == 0:
        return candidate
    ranked = torch.where(candidate, s, -_INF).sort(dim=1, descending=True).values
    kth = ranked.gather(1, (k - 1).clamp(0, width - 1)[:, None]).squeeze(1)
    theta = torch.where(k <= 0, _INF, torch.where(k >= m, -_INF, kth))
    return guard | (candidate & (s >= theta[:, None]))


def block_select_reference(
    surprisal: torch.Tensor,
    lengths: torch.Tensor,
    keep_counts: torch.Tensor,
    page_size: int,
    sink: int,
    recent: int,
    aggregate: str = DEFAULT_AGGREGATE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores `[B, NB]` float32, kept `[B, NB]` bool) of a padded surprisal batch `[B, T]`.

    scores = block_scores_batched(surprisal, lengths, page_size, aggregate) and
    kept = select_blocks_batched(scores, ceil(lengths / page_size), keep_counts, sink, recent).
    The Triton kernel `block_select_triton` must equal this.
    """
    scores = block_scores_batched(surprisal, lengths, page_size, aggregate)
    n = -(-lengths.to(device=scores.device, dtype=torch.long) // page_size)
    return scores, select_blocks_batched(scores, n, keep_counts, sink, recent)


def block_select(
    surprisal: torch.Tensor,
    lengths: torch.Tensor,
    keep_counts: torch.Tensor,
    page_size: int,
    sink: int,
    recent: int,
    aggregate: str = DEFAULT_AGGREGATE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_select_reference`'s result: by the Triton kernel on CUDA, else by torch."""
    if surprisal.is_cuda and triton_available():
        from sgl_entropic.kernels.block_select import block_select_triton

        return block_select_triton(surprisal, lengths, keep_counts, page_size, sink, recent, aggregate)
    return block_select_reference(surprisal, lengths, keep_counts, page_size, sink, recent, aggregate)


@dataclass(frozen=True)
class DecodePlan:
    """What each row of a decode batch attends: row r reads positions[indptr[r]:indptr[r + 1]].

    positions are ascending token positions of the row's context; kept_tokens[r] and
    context_lens[r] are their count and the context length (host ints, for accounting).
    """

    indptr: torch.Tensor  # int64 [B + 1]
    positions: torch.Tensor  # int64 [sum(kept_tokens)]
    kept_tokens: list[int]
    context_lens: list[int]

    @property
    def prunes(self) -> bool:
        return any(k < c for k, c in zip(self.kept_tokens, self.context_lens))


def plan_decode(
    surprisal: torch.Tensor,
    lengths: torch.Tensor,
    entropies: Sequence[float],
    cfg: PruningConfig,
    reference_entropy: float = DEFAULT_REFERENCE_ENTROPY,
) -> DecodePlan:
    """The kept token positions of a decode batch, one launch of `block_select` for all rows.

    surprisal `[B, T]` holds each row's token surprisals (values past lengths[r] ignored),
    entropies the rows' current H_t. Equals, row by row, `kept_token_indices(select_blocks(...))`.
    """
    batch, width = surprisal.shape
    lens_host = [int(x) for x in lengths.tolist()]
    _, keep = plan_keep_counts(lens_host, entropies, cfg, reference_entropy)
    _, kept = block_select(
        surprisal, lengths, keep.to(surprisal.device), cfg.page_size, cfg.sink_blocks, cfg.recent_blocks, cfg.aggregate
    )
    device = surprisal.device
    token_kept = kept.repeat_interleave(cfg.page_size, dim=1)[:, :width]
    token_kept &= torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]
    counts = token_kept.sum(dim=1)
    indptr = torch.zeros(batch + 1, dtype=torch.long, device=device)
    indptr[1:] = counts.cumsum(0)
    positions = token_kept.nonzero()[:, 1]  # row-major: grouped by row, ascending within a row
    return DecodePlan(indptr, positions, counts.tolist(), lens_host)


def _check_scores(scores: torch.Tensor, context_len: int, page_size: int) -> int:
    n = num_blocks(context_len, page_size)
    if scores.dim() != 1 or scores.shape[0] != n:
        raise ValueError(
            f"scores must be [{n}] for context_len={context_len}, page_size={page_size}, "
            f"got shape {tuple(scores.shape)}"
        )
    return n


def decode_threshold(
    scores: torch.Tensor,
    context_len: int,
    entropy: float,
    cfg: PruningConfig,
    reference_entropy: float = DEFAULT_REFERENCE_ENTROPY,
) -> float:
    """theta_t: the keep_count-th largest candidate score (-inf: keep all, +inf: keep none)."""
    n = _check_scores(scores, context_len, cfg.page_size)
    k = keep_count(context_len, entropy, cfg, reference_entropy)
    candidate = ~guard_mask(n, cfg.sink_blocks, cfg.recent_blocks, scores.device)
    m = int(candidate.sum())
    if k >= m:
        return -_INF
    if k <= 0:
        return _INF
    s = scores.float()
    s = torch.where(torch.isnan(s), _INF, s)[candidate]
    return float(s.sort(descending=True).values[k - 1])


def blocks_at_or_above(scores: torch.Tensor, theta: float, sink: int, recent: int) -> torch.Tensor:
    """bool `[n]`: guards, plus the blocks with score >= theta (NaN counts as +inf)."""
    s = scores.float()
    s = torch.where(torch.isnan(s), _INF, s)
    return guard_mask(s.shape[0], sink, recent, s.device) | (s >= theta)


def select_blocks(
    scores: torch.Tensor,
    context_len: int,
    entropy: float,
    cfg: PruningConfig,
    reference_entropy: float = DEFAULT_REFERENCE_ENTROPY,
) -> torch.Tensor:
    """The kept mask bool `[n_blocks]` of one request at a decode step, guards included.

    Equals `blocks_at_or_above(scores, decode_threshold(...), sink, recent)` and the row of
    `select_blocks_batched` with this request's `keep_count`.
    """
    n = _check_scores(scores, context_len, cfg.page_size)
    k = keep_count(context_len, entropy, cfg, reference_entropy)
    device = scores.device
    return select_blocks_batched(
        scores[None, :],
        torch.tensor([n], device=device),
        torch.tensor([k], device=device),
        cfg.sink_blocks,
        cfg.recent_blocks,
    )[0]


def kept_token_indices(kept: torch.Tensor, context_len: int, page_size: int) -> torch.Tensor:
    """int64 token positions (ascending) of the kept blocks, the partial last block clipped."""
    n = num_blocks(context_len, page_size)
    if kept.dim() != 1 or kept.shape[0] != n:
        raise ValueError(f"kept must be [{n}], got shape {tuple(kept.shape)}")
    blocks = kept.bool().nonzero().squeeze(1)
    positions = (blocks[:, None] * page_size + torch.arange(page_size, device=kept.device)[None, :]).reshape(-1)
    return positions[positions < context_len]


@dataclass(frozen=True)
class PruneStats:
    """What one (or, summed with +, many) pruned decode step attends, for accounting."""

    kept_blocks: int
    total_blocks: int
    kept_tokens: int
    total_tokens: int

    @classmethod
    def from_mask(cls, kept: torch.Tensor, context_len: int, page_size: int) -> "PruneStats":
        n = num_blocks(context_len, page_size)
        if kept.dim() != 1 or kept.shape[0] != n:
            raise ValueError(f"kept must be [{n}], got shape {tuple(kept.shape)}")
        kept = kept.bool()
        kept_blocks = int(kept.sum())
        kept_tokens = kept_blocks * page_size
        if n and bool(kept[-1]):
            kept_tokens -= n * page_size - context_len
        return cls(kept_blocks, n, kept_tokens, context_len)

    def __add__(self, other: "PruneStats") -> "PruneStats":
        return PruneStats(
            self.kept_blocks + other.kept_blocks,
            self.total_blocks + other.total_blocks,
            self.kept_tokens + other.kept_tokens,
            self.total_tokens + other.total_tokens,
        )

    @property
    def keep_ratio(self) -> float:
        """Kept tokens / context tokens (1.0 for an empty context)."""
        return self.kept_tokens / self.total_tokens if self.total_tokens else 1.0

    @property
    def block_keep_ratio(self) -> float:
        return self.kept_blocks / self.total_blocks if self.total_blocks else 1.0

    def attended_tokens(self, num_layers: int, dense_layers: int = 0) -> float:
        """Tokens attended per layer on average: the `attended_tokens` of `signal.step_cost`.

        The first `dense_layers` layers attend the whole context, the others the kept tokens.
        """
        if num_layers <= 0:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        dense = min(max(dense_layers, 0), num_layers)
        return (dense * self.total_tokens + (num_layers - dense) * self.kept_tokens) / num_layers

    def kv_bytes(
        self, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, dense_layers: int = 0
    ) -> float:
        """KV-cache bytes read by attention: K and V of every attended token, in every layer."""
        per_token_layer = 2 * num_kv_heads * head_dim * bytes_per_element
        return self.attended_tokens(num_layers, dense_layers) * num_layers * per_token_layer


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept_token_idx: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """One decode query attending only the kept tokens (GQA torch reference), `[H_q, D_v]`.

    q `[H_q, D]`, k `[T, H_kv, D]`, v `[T, H_kv, D_v]`; query head h reads KV head
    h // (H_q / H_kv) (the repeat_interleave layout of Llama/SmolLM2). kept_token_idx: int
    positions in [0, T) (None: all, i.e. dense); scale defaults to 1 / sqrt(D). Computed in
    float32, returned in q's dtype; exactly softmax(q K_S^T * scale) V_S over the kept set S.
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
