"""Speculative decoding under the loops: how wide each verify step is, and the controller along a draft tree.

Torch and numpy (for the host's small per-step arrays); nothing here imports sglang (the plugin's
`speculation.py` adapts it to SGLang's NGRAM worker).

Width. SGLang's NGRAM verifies a tree of `speculative_num_draft_tokens` nodes per request every decode step
(node 0 is the request's last committed token, the others the trie's drafts, padded when it matched fewer).
All rows of a verify batch share one width W (SGLang's layout), so a step costs about
t0 + t_row * rows + t_draft * rows * (W - 1) and commits, per row, its bonus token plus the drafts accepted in a row. A rule picks W per step:

* ``fixed``: the server's maximum, every step (SGLang's own behaviour);
* ``matched``: 1 + the most drafts any row's trie match offers (never verifies padding);
* ``acceptance``: SGLang's adaptive rule (`adaptive_spec_params.AdaptiveStepSlot`) on NGRAM: an EMA of the
  accepted drafts per row and step, W - 1 = round(EMA) + 1 (probe one beyond what was accepted);
* ``entropy``: the W that maximises the expected committed tokens per second,
  sum_rows E_r(W) / T(rows, W), with E_r(W) = sum_{j < min(W, 1 + offer_r)} a_r^j, a_r = min(exp(-H_r), q_r).
  exp(-H_r) is a lower bound on the probability of the model's most likely token (Shannon entropy >=
  min-entropy), H_r the mean entropy of the tokens row r committed in its last step: where the drafts copy
  what the model would say, each is accepted with at least that chance. q_r, the request's own rate of
  accepted drafts (`DraftHits`), caps it where they do not (open chat: a sure model, a trie guessing wrong).
  Where the model is unsure its drafts are short or none, whatever the trie offers. T is a least-squares fit of this
  server's own verify steps, a fixed part, a part per row and a part per draft (`StepTimes`). Nothing in the
  rule is tuned to a prompt.

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
    """Least-squares fit t = t0 + t_row * rows + t_draft * rows * (W - 1) of this server's verify steps, recent
    steps weighted most (`decay` per step: a changing machine is followed).

    A row costs its prefix's attention whatever its width, a draft only its own token: one slope for both made a
    long context's rows look like expensive drafts. Ridge terms pull t_row and t_draft toward 0 (the prior: a
    draft is free until the steps show its price). On t_draft the pull is strong, `draft_ridge` step-weights of
    one row-draft: a batch of one, where a draft costs about 1 % of a step, measures its price below the steps'
    noise and must not stop drafting on noise; a batch of eight measures it over eight times the spread and
    outweighs the prior. A rule that stopped drafting learns the price again by drafting.
    """

    decay: float = 0.98
    row_ridge: float = 1e-3
    draft_ridge: float = 4.0
    xtx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _fit: Optional[tuple[float, float, float]] = None  # solved once per observation

    def observe(self, rows: int, width: int, seconds: float) -> None:
        x = np.array([1.0, rows, rows * (width - 1)])
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self._fit = None

    def fit(self) -> tuple[float, float, float]:
        """(t0, t_row, t_draft) in seconds; zeros before any step."""
        if self._fit is None:
            w = self.xtx[0, 0]
            if w == 0:
                return 0.0, 0.0, 0.0
            penalty = w * np.diag([0.0, self.row_ridge, self.draft_ridge])
            t0, t_row, t_draft = np.linalg.solve(self.xtx + penalty, self.xty)
            self._fit = max(float(t0), 0.0), max(float(t_row), 0.0), max(float(t_draft), 0.0)
        return self._fit

    def seconds(self, rows: int, widths: np.ndarray) -> np.ndarray:
        t0, t_row, t_draft = self.fit()
        return t0 + t_row * rows + t_draft * rows * (widths - 1)


@dataclass
class DraftHits:
    """A request's verified drafts: every draft position verification tried is a trial (a row's run ends at its
    first rejection; positions past it are not tried), decayed per step so that the rate follows the text."""

    hits: float = 0.0
    trials: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.hits = HITS_DECAY * self.hits + accepted
            self.trials = HITS_DECAY * self.trials + accepted + (accepted < drafted)

    @property
    def rate(self) -> float:
        """Accepted per tried, one hit assumed: optimistic (1 before any draft was tried), so that short drafts,
        which try little, do not keep the rate low by themselves; a few misses bring it down."""
        return (self.hits + 1.0) / (self.trials + 1.0)


def draft_acceptance(entropy: Optional[float], hits: DraftHits) -> float:
    """a_r = min(exp(-H_r), q_r) (module docstring); a row with no measured entropy yet counts as sure."""
    sure = 1.0 if entropy is None or not math.isfinite(entropy) else math.exp(-max(entropy, 0.0))
    return min(sure, hits.rate)


def entropy_width(offers: Sequence[int], acceptance: Sequence[float], times: StepTimes) -> int:
    """The `entropy` rule's width: argmax over W of sum_r E_r(W) / T(rows, W) (ties: the narrower), with
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

    def observe(self, width: int, rows: int, seconds: float, accepted: Sequence[int]) -> None:
        """A verify step's outcome: its time (the fit) and the drafts each row accepted (the EMA)."""
        self.times.observe(rows, width, seconds)
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
