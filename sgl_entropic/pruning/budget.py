"""How many pages a row attends: the guards, then keep = ceil(rho(H) * candidates) (package doc)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sgl_entropic.config import PruningConfig

AGGREGATES: tuple[str, ...] = ("max", "mean", "sum")
DEFAULT_AGGREGATE = "max"
# H_ref in nats: rho reaches max_keep_ratio at this entropy. About ln(V) / 2 for V in 32k..152k.
DEFAULT_REFERENCE_ENTROPY = 5.0


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
    def prunes(self) -> bool:
        return self.keep < self.candidates


def row_pages(
    length: int, entropy: float, cfg: PruningConfig, reference_entropy: float = DEFAULT_REFERENCE_ENTROPY
) -> RowPages:
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
