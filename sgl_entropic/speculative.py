"""Speculative decoding under the loops: how wide each verify step is, and the controller along a draft tree.

Torch and numpy (for the host's small per-step arrays); nothing here imports sglang (the plugin's
`speculation.py` adapts it to SGLang's NGRAM worker).

Width. SGLang's NGRAM verifies a tree of `speculative_num_draft_tokens` nodes per request every decode step
(node 0 is the request's last committed token, the others the trie's drafts, padded when it matched fewer).
All rows of a verify batch share one width W (SGLang's layout), so a step costs T(rows x W) and commits, per row,
its bonus token plus the drafts accepted in a row. A rule picks W per step:

* ``fixed``: the server's maximum, every step (SGLang's own behaviour);
* ``matched``: 1 + the most drafts any row's trie match offers (never verifies padding);
* ``acceptance``: SGLang's adaptive rule (`adaptive_spec_params.AdaptiveStepSlot`) on NGRAM: an EMA of the
  accepted drafts per row and step, W - 1 = round(EMA) + 1 (probe one beyond what was accepted);
* ``entropy``: the W that maximises the expected committed tokens per second,
  sum_rows E_r(W) / T(rows x W), with E_r(W) = sum_{j < min(W, 1 + offer_r)} a_r^j, a_r = min(exp(-H_r), q_r).
  exp(-H_r) is a lower bound on the probability of the model's most likely token (Shannon entropy >=
  min-entropy), H_r the mean entropy of the tokens row r committed in its last step: where the drafts copy
  what the model would say, each is accepted with at least that chance. q_r, the request's own rate of
  accepted drafts (`DraftHits`, starting from the server's recent rate), caps it where they do not (open chat:
  a sure model, a trie guessing wrong). A row that verifies no drafts still checks its trie's first draft
  against the token it committed (`draft_trials`), so its rate keeps following the text.
  Where the model is unsure its drafts are short or none, whatever the trie offers. T is this server's own
  measured verify-step time for a forward over that many tokens (`StepTimes`). Nothing in the rule is tuned to a
  prompt.

Every rule caps a row's drafts at what its trie match offers, and rows fill the step's width with their own
drafts (a shorter row would cost the same padded slots).

Controller. The zero-lag temperature at a tree node depends on the logits along its path: node v is sampled
at T_v = update(T_parent(v), H(z_v / T_parent(v))), exactly what sequential decoding computes had it committed
v's ancestors (`tree_temperatures`). Verification then samples every node from its own distribution and
follows the drafts that match (lossless for drafts that are single tokens, as n-gram drafts are: accepting
draft x with probability p(x) and resampling from p without x on rejection commits a token distributed as p,
and that is what sampling from p and comparing does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from sgl_entropic.sampling import ControllerBatch, entropy

Rule = Literal["fixed", "matched", "acceptance", "entropy"]
RULES: tuple[str, ...] = ("fixed", "matched", "acceptance", "entropy")
# SGLang's adaptive slot: EMA weight of a new observation (AdaptiveStepSlot.ema_alpha).
ACCEPTANCE_EMA_ALPHA = 0.2
# A request's draft record (DraftHits) keeps this much of itself per verify step: about its last five steps.
HITS_DECAY = 0.8


def offered_drafts(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[B] drafts each row's trie match really offers, from NGRAM's padded tree (`tokens` [B, W], `mask` [B, W, W];
    host arrays, as the corpus returns them).

    The corpus pads a short match with token 0 nodes hanging off the root (`ngram_corpus/result.cpp`); the
    padding is the run of such nodes at the end of the BFS order.
    """
    width = tokens.shape[1]
    root_only = np.eye(width, dtype=bool)
    root_only[:, 0] = True  # a node whose ancestors are the root and itself
    pad = (tokens == 0) & (mask.astype(bool) == root_only).all(-1)
    pad[:, 0] = False
    trailing = np.flip(np.cumprod(np.flip(pad, 1), 1), 1)  # a node is padding when it and every later node are
    return (width - 1) - trailing.sum(1)


def tree_parents(mask: np.ndarray) -> np.ndarray:
    """[B, W] each node's parent, the largest strict ancestor in `mask` [B, W, W] (-1: none)."""
    node = np.arange(mask.shape[1])
    ancestors = mask.astype(bool) & (node[None, :] < node[:, None])
    return np.where(ancestors, node, -1).max(-1)


@dataclass
class StepTimes:
    """This server's verify-step time by the tokens the forward runs (rows x width): an EMA per token count.

    Measured, not modelled: on a CPU, fp32 GEMMs over 2-3 rows cost 2-3x one row's (a matrix-vector pass per
    row) and more than 4-8 rows' (a real GEMM), while bf16 ones with AVX-512 stay within 1.3x up to 8 rows; a line
    through the steps priced drafts wrongly on one or the other. Keyed by tokens, the GEMMs' M, so that every row
    count shares what any measured (4 rows at width 2 and 8 rows at width 1 run the same GEMMs; per-row attention
    differs little next to them): under load the batch's row count keeps changing, and a price per (rows, width)
    left most row counts unmeasured, hence free. Between measured counts the price is interpolated; past the
    largest it is that one's (a wider step is free until a step shows its price, so the rule tries it once). A count
    not measured in the last `horizon` steps is forgotten: the context grows, and a count priced long ago is tried
    again.
    """

    alpha: float = 0.3
    horizon: int = 256
    cells: dict[int, tuple[float, int]] = field(default_factory=dict)  # tokens -> (seconds, step measured)
    steps: int = 0

    def observe(self, rows: int, width: int, seconds: float) -> None:
        self.steps += 1
        tokens = rows * width
        old = self.cells.get(tokens)
        ema = seconds if old is None or self.steps - old[1] > self.horizon else \
            (1 - self.alpha) * old[0] + self.alpha * seconds
        self.cells[tokens] = (ema, self.steps)

    def measured(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seconds) measured within the horizon, fewest first."""
        fresh = sorted((n, t) for n, (t, at) in self.cells.items() if self.steps - at <= self.horizon)
        return np.array([n for n, _ in fresh], dtype=float), np.array([t for _, t in fresh])

    def seconds(self, rows: int, widths: np.ndarray) -> np.ndarray:
        """A step's price at each width for `rows` rows; zeros while nothing is measured."""
        xs, ys = self.measured()
        if len(xs) == 0:
            return np.zeros(len(widths))
        return np.interp(rows * np.asarray(widths, dtype=float), xs, ys)

    def table(self) -> dict[str, float]:
        """`/server_info`: the fresh prices, tokens per verify forward -> seconds."""
        return {str(int(n)): float(t) for n, t in zip(*self.measured())}


@dataclass
class DraftHits:
    """Verified drafts: every draft position verification tried is a trial (a row's run ends at its first
    rejection; positions past it are not tried), decayed per step so that the rate follows the text. One per
    request, and one for the server, pooled over its requests."""

    hits: float = 0.0
    trials: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        self.observe_step([drafted], [accepted])

    def observe_step(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """One verify step's rows (the server's record: one decay a step, whatever the batch)."""
        tried = [(d, a) for d, a in zip(drafted, accepted) if d > 0]
        if tried:
            self.hits = HITS_DECAY * self.hits + sum(a for _, a in tried)
            self.trials = HITS_DECAY * self.trials + sum(a + (a < d) for d, a in tried)

    def rate(self, prior: float = 1.0) -> float:
        """Accepted per tried, with one trial's worth of `prior`: a request starts at what the server's
        requests have lately seen (1, optimistic, for the server's own record), and a few of its own misses
        or hits outweigh it, so short drafts, which try little, do not keep the rate low by themselves."""
        return (self.hits + prior) / (self.trials + 1.0)


def draft_trials(drafted: Sequence[int], accepted: Sequence[int], offers: Sequence[int],
                 first_draft: Sequence[int], root_sample: Sequence[int]) -> tuple[list[int], list[int]]:
    """Each row's (tried, right) for its draft record: the drafts it verified, or, for a row whose trie offered
    drafts but that verified none, its first draft checked against the token the root sampled. Verification
    accepts a draft iff it is the node's sample, so that shadow trial is exactly what a one-draft step would
    have learned, at no cost: a request that stopped drafting sees when its trie starts guessing right."""
    tried, right = list(drafted), list(accepted)
    for i, (d, k) in enumerate(zip(drafted, offers)):
        if d == 0 and k > 0:
            tried[i], right[i] = 1, int(first_draft[i] == root_sample[i])
    return tried, right


def draft_acceptance(entropy: Optional[float], hits: DraftHits, prior: float = 1.0) -> float:
    """a_r = min(exp(-H_r), q_r) (module docstring), q_r the request's rate with `prior` (the server's rate,
    `DraftSizer.hits.rate()`) as its start; a row with no measured entropy yet counts as sure."""
    sure = 1.0 if entropy is None or not math.isfinite(entropy) else math.exp(-max(entropy, 0.0))
    return min(sure, hits.rate(prior))


def entropy_width(offers: Sequence[int], acceptance: Sequence[float], times: StepTimes) -> int:
    """The `entropy` rule's width: argmax over W of sum_r E_r(W) / T(rows x W) (ties: the narrower), with
    E_r(W) = 1 + a_r + ... + a_r^min(W - 1, offer_r), a_r a row's `acceptance` (`draft_acceptance`)."""
    rows = len(offers)
    acceptance = np.asarray(acceptance, dtype=float)
    depth = np.arange(1 + max(offers, default=0))[:, None]  # a width W verifies depths 0 .. W - 1
    terms = np.where(depth <= np.asarray(offers)[None, :], acceptance[None, :] ** depth, 0.0)  # [widths, rows]
    committed = terms.cumsum(0).sum(1)
    widths = depth[:, 0] + 1
    cost = times.seconds(rows, widths)
    rate = committed / cost if cost[0] > 0 else committed  # no timing yet: the most tokens
    return int(widths[np.flatnonzero(rate >= rate.max() * (1 - 1e-9))[0]])


@dataclass
class DraftSizer:
    """Picks each verify step's width under one rule (module docstring); its state is the server's."""

    rule: Rule
    max_width: int  # SGLang's speculative_num_draft_tokens: nodes per row, the root included
    times: StepTimes
    accepted_ema: Optional[float] = None  # acceptance rule: accepted drafts per row and step
    hits: DraftHits = field(default_factory=DraftHits)  # entropy rule: the server's drafts, every request's

    def width(self, offers: Sequence[int], acceptance: Sequence[float]) -> int:
        """Nodes per row this step, in [1, max_width]; `offers` the drafts each row's match offers, `acceptance`
        each row's expected chance per draft (the entropy rule's a_r)."""
        most = 1 + max(offers, default=0)
        if self.rule == "fixed":
            return self.max_width
        if self.rule == "matched":
            return min(most, self.max_width)
        if self.rule == "acceptance":
            ema = self.max_width - 2 if self.accepted_ema is None else self.accepted_ema  # SGLang: steps - 1
            return min(most, self.max_width, 2 + round(max(ema, 0.0)))
        return min(entropy_width(offers, acceptance, self.times), self.max_width)

    def observe(self, width: int, rows: int, seconds: float, drafted: Sequence[int], accepted: Sequence[int],
                trials: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> None:
        """A verify step's outcome: its time, the drafts each row verified and accepted, and the draft record's
        trials (`draft_trials`; default: the verified drafts)."""
        self.times.observe(rows, width, seconds)
        self.hits.observe_step(*(trials or (drafted, accepted)))
        if accepted and width > 1:
            mean = sum(accepted) / len(accepted)
            a = ACCEPTANCE_EMA_ALPHA
            self.accepted_ema = mean if self.accepted_ema is None else (1 - a) * self.accepted_ema + a * mean


def tree_depths(parent: Tensor) -> Tensor:
    """[B, W] depth of each node (root 0) from `parent` [B, W] (-1 at the root; parent[v] < v)."""
    depth = torch.zeros_like(parent)
    for v in range(1, parent.shape[1]):
        p = parent[:, v]
        depth[:, v] = torch.where(p >= 0, depth.gather(1, p.clamp_min(0)[:, None]).squeeze(1) + 1, 0)
    return depth


def tree_temperatures(logits: Tensor, parent: Tensor, batch: ControllerBatch) -> Tensor:
    """[B, W] temperature each node is sampled at: the zero-lag controller along every path of the tree.

    `logits` [B, W, V] (after penalties and masks), `parent` [B, W] with parent[v] < v (NGRAM's BFS order),
    `batch` the rows' controllers as they stand before the step. Node v's controller state is its parent's
    output (the root's: the row's), its steps_done the row's plus v's depth; no host sync.
    """
    rows, width = parent.shape
    depth = tree_depths(parent)
    temps = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    for v in range(width):
        p = parent[:, v]
        incoming = torch.where(p >= 0, temps.gather(1, p.clamp_min(0)[:, None]).squeeze(1), batch.temperature)
        node = ControllerBatch(incoming, batch.target, batch.eta, batch.t_min, batch.t_max, batch.floor,
                               batch.warmup, batch.steps_done + depth[:, v].float())
        temps[:, v] = node.update(entropy(logits[:, v], incoming))
    return temps
