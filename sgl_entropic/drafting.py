"""Speculative decoding under the loops: how wide each verify step is, and the controller along a draft tree.

Torch and numpy (for the host's small per-step arrays); nothing here imports sglang (the plugin's
`plugin/speculation/` adapts it to SGLang's NGRAM worker).

Width. SGLang's NGRAM verifies a tree of `speculative_num_draft_tokens` nodes per request every decode step
(node 0 is the request's last committed token, the others the trie's drafts, padded when it matched fewer).
All rows of a verify batch share one width W (SGLang's layout), so a step costs T(rows x W) and commits, per row,
its bonus token plus the drafts accepted in a row; a step at width 1 runs the plain decode step instead, as
without speculation (`plugin/speculation/worker.py`). A rule picks W per step:

* ``fixed``: the server's maximum, every step (SGLang's own behaviour);
* ``matched``: 1 + the most drafts any row's trie match offers (never verifies padding);
* ``acceptance``: SGLang's adaptive rule (`adaptive_spec_params.AdaptiveStepSlot`) on NGRAM: an EMA of the
  accepted drafts per row and step, W - 1 = round(EMA) + 1 (probe one beyond what was accepted);
* ``entropy``: the W that maximises the expected committed tokens per second,
  sum_rows E_r(W) / T(W), with E_r(W) = sum_{j < min(W, 1 + offer_r)} a_r^j, a_r = min(exp(-H_r), q_r).
  exp(-H_r) is a lower bound on the probability of the model's most likely token (Shannon entropy >=
  min-entropy), H_r the mean entropy of the tokens row r committed in its last step: where the drafts copy
  what the model would say, each is accepted with at least that chance. q_r, the request's own rate of
  accepted drafts (`DraftHits`), caps it where they do not (open chat: a sure model, a trie guessing wrong). A
  row that verifies no drafts still checks its trie's first draft against the token it committed
  (`draft_trials`), so its rate keeps following the text. Where the model is unsure its drafts are short or
  none, whatever the trie offers. T is a step's price in this machine's cost table (`StepCosts`, measured once
  and kept), W = 1 the plain decode step, which a wider step must beat by `PLAIN_MARGIN`. Nothing in the rule
  follows the wall clock or other requests: a request served alone gets the same widths, hence the same
  forwards and the same output, on every run. Nothing in it is tuned to a prompt.

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


def capped_candidates(candidates: Tensor, caps: Sequence[int]) -> Tensor:
    """[B, W] draft tokens with every node past its row's cap (node index > caps[b], BFS order) set to -1, which
    matches no sample: verification accepts at most caps[b] drafts of row b, and stays exact (a rejected draft
    commits the node's own sample, as decoding without it would)."""
    width = candidates.shape[1]
    beyond = torch.arange(width)[None, :] > torch.tensor(list(caps))[:, None]
    return candidates.masked_fill(beyond.to(candidates.device), -1)


def tree_parents(mask: np.ndarray) -> np.ndarray:
    """[B, W] each node's parent, the largest strict ancestor in `mask` [B, W, W] (-1: none)."""
    node = np.arange(mask.shape[1])
    ancestors = mask.astype(bool) & (node[None, :] < node[:, None])
    return np.where(ancestors, node, -1).max(-1)


# A verify step must promise this much more committed tokens per second than the plain decode step it replaces:
# the cost table prices the forwards' GEMMs and attention, not the verify step's host work (tree, verification).
PLAIN_MARGIN = 0.1


def _interp(x, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Piecewise-linear in `xs` at each of `x`, extended past the last point along the last segment (GEMMs and
    attention grow linearly once compute-bound)."""
    x = np.asarray(x, dtype=float)
    y = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


def _nondecreasing(ys: Sequence[float]) -> tuple[float, ...]:
    """Each value capped by every later one (the running minimum from the end)."""
    return tuple(np.minimum.accumulate(np.asarray(ys, dtype=float)[::-1])[::-1].tolist()) if len(ys) else ()


@dataclass(frozen=True)
class StepCosts:
    """What a decode step costs on this machine, in seconds: a table measured once per machine, model and dtype and
    kept (`plugin/speculation/step_costs.py`), so that the draft width never follows the load of the moment.

    A forward over n tokens costs the model's GEMMs at n rows (its linear layers, the LM head, one pass over the
    vocabulary: `tokens` -> `gemm`), plus each row's attention over its context at the step's width (`attention`,
    timed at `widths` (1 and the widest), linear between, through the verify forward's attention). A plain decode
    step's attention is what the attention backend runs at each context (`plain_attention` at `plain_contexts`: SGLang's
    loop, our kernel over every page, or the pruned kernel, from the backend's kept crossover timings); without those,
    width 1's. Measured, not modelled from FLOPs: on a CPU, fp32 GEMMs over 2-3 rows cost 2-3x one row's while bf16
    ones with AVX-512 stay within 1.3x up to 8 rows (benchmarks/small_gemm.py).
    """

    tokens: tuple[int, ...] = ()
    gemm: tuple[float, ...] = ()
    contexts: tuple[int, ...] = ()
    widths: tuple[int, int] = (1, 1)
    attention: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # [width][context], one row, every layer
    plain_contexts: tuple[int, ...] = ()
    plain_attention: tuple[float, ...] = ()  # [context] one row's on the plain decode path, every layer
    _gemm_prices: dict = field(default_factory=dict, compare=False, repr=False)  # (rows, widths) -> prices

    def __post_init__(self):
        # A forward over more tokens, or attention over a longer context, never costs less: a timing above a later
        # one is a burst of load (the table is timed at start-up, beside SGLang's other processes on two cores).
        object.__setattr__(self, "gemm", _nondecreasing(self.gemm))
        object.__setattr__(self, "attention", tuple(_nondecreasing(a) for a in self.attention))
        object.__setattr__(self, "plain_attention", _nondecreasing(self.plain_attention))

    @property
    def measured(self) -> bool:
        return bool(self.tokens)

    def forward(self, tokens: int) -> float:
        return float(_interp(tokens, self.tokens, self.gemm))

    def plain(self, contexts: Sequence[int]) -> float:
        """A plain decode step of rows at these context lengths."""
        return float(self.prices(contexts, [1], plain=True)[0])

    def verify(self, contexts: Sequence[int], width: int) -> float:
        """A verify step of rows at these context lengths, `width` nodes each."""
        return float(self.prices(contexts, [width])[0])

    def prices(self, contexts: Sequence[int], widths: Sequence[int], plain: bool = False) -> np.ndarray:
        """A verify step's price at each of `widths` for rows at these context lengths, width 1 the plain decode
        step's where `plain` (the rule prices every width each step: the GEMMs' part is kept per row count and
        widths, the attention's is two or three interpolations)."""
        key = (len(contexts), tuple(widths))
        fixed = self._gemm_prices.get(key)
        if fixed is None:
            w = np.asarray(widths, dtype=float)
            lo, hi = self.widths
            share = np.zeros_like(w) if hi == lo else (w - lo) / (hi - lo)
            fixed = self._gemm_prices[key] = (_interp(len(contexts) * w, self.tokens, self.gemm), share)
        gemm, share = fixed
        narrow, wide = (float(_interp(contexts, self.contexts, a).sum()) for a in self.attention)
        out = gemm + narrow + share * (wide - narrow)
        if plain and self.plain_attention:
            ones = np.asarray(widths) == 1
            out[ones] = gemm[ones] + float(_interp(contexts, self.plain_contexts, self.plain_attention).sum())
        return out

    def table(self) -> dict:
        """`/server_info`: the table, in milliseconds."""
        ms = lambda xs: [round(x * 1e3, 4) for x in xs]  # noqa: E731
        return {
            "tokens": list(self.tokens),
            "gemm_ms": ms(self.gemm),
            "contexts": list(self.contexts),
            "attention_widths": list(self.widths),
            "attention_ms": [ms(v) for v in self.attention],
            "plain_contexts": list(self.plain_contexts),
            "plain_attention_ms": ms(self.plain_attention),
        }

    @classmethod
    def from_table(cls, table: dict) -> "StepCosts":
        """The costs `table()` reported (milliseconds back to seconds)."""
        s = lambda xs: tuple(x / 1e3 for x in xs)  # noqa: E731
        return cls(
            tuple(table["tokens"]),
            s(table["gemm_ms"]),
            tuple(table["contexts"]),
            tuple(table["attention_widths"]),
            tuple(s(a) for a in table["attention_ms"]),
            tuple(table.get("plain_contexts", ())),
            s(table.get("plain_attention_ms", ())),
        )


@dataclass
class DraftHits:
    """A request's verified drafts: every draft position verification tried is a trial (a row's run ends at its
    first rejection; positions past it are not tried), decayed per step so that the rate follows the text. Its
    own record only: a width that followed other requests' drafts would give the same request different output
    depending on what the server served before it."""

    hits: float = 0.0
    trials: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.hits = HITS_DECAY * self.hits + accepted
            self.trials = HITS_DECAY * self.trials + accepted + (accepted < drafted)

    def rate(self) -> float:
        """Accepted per tried, with one optimistic trial to start from: a few of the request's own misses or hits
        outweigh it, so short drafts, which try little, do not keep the rate low by themselves."""
        return (self.hits + 1.0) / (self.trials + 1.0)


def draft_trials(
    drafted: Sequence[int],
    accepted: Sequence[int],
    offers: Sequence[int],
    first_draft: Sequence[int],
    root_sample: Sequence[int],
) -> tuple[list[int], list[int]]:
    """Each row's (tried, right) for its draft record: the drafts it verified, or, for a row whose trie offered
    drafts but that verified none, its first draft checked against the token the root sampled. Verification
    accepts a draft iff it is the node's sample, so that shadow trial is exactly what a one-draft step would
    have learned, at no cost: a request that stopped drafting sees when its trie starts guessing right."""
    tried, right = list(drafted), list(accepted)
    for i, (d, k) in enumerate(zip(drafted, offers)):
        if d == 0 and k > 0:
            tried[i], right[i] = 1, int(first_draft[i] == root_sample[i])
    return tried, right


def draft_acceptance(entropy: Optional[float], hits: DraftHits) -> float:
    """a_r = min(exp(-H_r), q_r) (module docstring); a row with no measured entropy yet counts as sure."""
    sure = 1.0 if entropy is None or not math.isfinite(entropy) else math.exp(-max(entropy, 0.0))
    return min(sure, hits.rate())


def entropy_width(
    offers: Sequence[int],
    acceptance: Sequence[float],
    costs: StepCosts,
    contexts: Sequence[int],
    plain: bool = True,
    margin: float = PLAIN_MARGIN,
) -> int:
    """The `entropy` rule's width: argmax over W of sum_r E_r(W) / T(W) (ties: the narrower), with
    E_r(W) = 1 + a_r + ... + a_r^min(W - 1, offer_r), a_r a row's `acceptance` (`draft_acceptance`) and T the
    step's price in `costs` for rows at `contexts`. Width 1 is the plain decode step where `plain`, which a wider
    one must beat by `margin` (else a verify over one token, priced alike). Without a cost table: every draft offered."""
    most = max(offers, default=0)
    if most == 0:
        return 1
    acceptance = np.asarray(acceptance, dtype=float)
    depth = np.arange(1 + most)[:, None]  # a width W verifies depths 0 .. W - 1
    terms = np.where(depth <= np.asarray(offers)[None, :], acceptance[None, :] ** depth, 0.0)  # [widths, rows]
    committed = terms.cumsum(0).sum(1)
    widths = depth[:, 0] + 1
    if not costs.measured:
        return int(widths[np.flatnonzero(committed >= committed.max() * (1 - 1e-9))[0]])
    cost = costs.prices(contexts, widths, plain)
    rate = committed / cost
    best = 1 + int(np.flatnonzero(rate[1:] >= rate[1:].max() * (1 - 1e-9))[0])
    margin = margin if plain else 0.0  # a verify at width 1 does the host work a wider one does
    return int(widths[best]) if rate[best] >= (1 + margin) * rate[0] else 1


@dataclass
class DraftSizer:
    """Picks each verify step's width under one rule (module docstring); its state is the server's."""

    rule: Rule
    max_width: int  # SGLang's speculative_num_draft_tokens: nodes per row, the root included
    costs: StepCosts = field(default_factory=StepCosts)
    accepted_ema: Optional[float] = None  # acceptance rule: accepted drafts per row and step

    def width(
        self,
        offers: Sequence[int],
        acceptance: Sequence[float],
        contexts: Sequence[int],
        plain: bool = True,
        rules: Optional[Sequence[str]] = None,
        caps: Optional[Sequence[int]] = None,
    ) -> int:
        """Nodes per row this step, in [1, max_width]; `offers` the drafts each row's match offers (within its
        cap), `acceptance` each row's expected chance per draft (the entropy rule's a_r), `contexts` the rows'
        lengths, `plain` whether width 1 runs the plain decode step. Where requests chose their own rule
        (`rules`, one a row; 'off' wants no drafts), each rule picks a width for its own rows' drafts, the others'
        rows priced in, and the step takes the widest; `caps` each row's most drafts (a fixed row verifies up to
        its cap)."""
        if rules is None:
            return self._width(self.rule, offers, acceptance, contexts, plain, caps)
        wants = [1]
        for rule in set(rules) - {"off"}:
            mine = [r == rule for r in rules]
            wants.append(
                self._width(
                    rule,
                    [k if m else 0 for k, m in zip(offers, mine)],
                    acceptance,
                    contexts,
                    plain,
                    None if caps is None else [c if m else 0 for c, m in zip(caps, mine)],
                )
            )
        return max(wants)

    def _width(
        self,
        rule: str,
        offers: Sequence[int],
        acceptance: Sequence[float],
        contexts: Sequence[int],
        plain: bool,
        caps: Optional[Sequence[int]],
    ) -> int:
        most = 1 + max(offers, default=0)
        if rule == "fixed":
            return self.max_width if caps is None else min(self.max_width, 1 + max(caps, default=0))
        if rule == "matched":
            return min(most, self.max_width)
        if rule == "acceptance":
            ema = self.max_width - 2 if self.accepted_ema is None else self.accepted_ema  # SGLang: steps - 1
            return min(most, self.max_width, 2 + round(max(ema, 0.0)))
        return min(entropy_width(offers, acceptance, self.costs, contexts, plain), self.max_width)

    def observe(self, width: int, accepted: Sequence[int]) -> None:
        """A verify step's outcome: the drafts each row accepted (the acceptance rule's EMA, SGLang's: the
        server's, over every request)."""
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
        node = ControllerBatch(
            incoming,
            batch.target,
            batch.eta,
            batch.t_min,
            batch.t_max,
            batch.floor,
            batch.warmup,
            batch.steps_done + depth[:, v].float(),
        )
        temps[:, v] = node.update(entropy(logits[:, v], incoming))
    return temps


def from_drafts(drafted: Sequence[Optional[int]], accepted: Sequence[Optional[int]]) -> list[bool]:
    """Per committed token, whether it was a draft the model confirmed, from the per-token traces (a step's counts on
    its first token, null on its others): a step that accepted k drafts commits them first, then its own token."""
    out, left = [], 0
    for d, a in zip(drafted, accepted):
        if d is not None:
            left = a or 0
        out.append(left > 0)
        left = max(left - 1, 0)
    return out


@dataclass
class DraftCounts:
    """One request's speculation so far, counted step by step in the scheduler: its decode steps, the steps that
    verified drafts of its own, drafts its trie (or a corpus) offered, verified and accepted."""

    decode_steps: int = 0
    verify_steps: int = 0
    offered: int = 0
    verified: int = 0
    accepted: int = 0
    corpus_verify_steps: int = 0
    corpus_accepted: int = 0

    def add(self, offered: Optional[int], drafted: int, accepted: int, source: Optional[str]) -> None:
        """A decode step (its counts, as its first token carries them)."""
        self.decode_steps += 1
        self.offered += offered or 0
        self.verified += drafted
        self.accepted += accepted
        if drafted > 0:
            self.verify_steps += 1
            if source == "corpus":
                self.corpus_verify_steps += 1
                self.corpus_accepted += accepted

    def summary(self) -> dict:
        """`meta_info.entropic_speculative`."""
        return {
            "decode_steps": self.decode_steps,
            "verify_steps": self.verify_steps,
            "drafts_offered": self.offered,
            "drafts_verified": self.verified,
            "drafts_accepted": self.accepted,
            "accepted_per_verify": self.accepted / self.verify_steps if self.verify_steps else None,
            "corpus_verify_steps": self.corpus_verify_steps,
            "corpus_drafts_accepted": self.corpus_accepted,
        }
