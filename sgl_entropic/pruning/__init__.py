"""The meso loop: which KV pages a decode step attends (torch only, never sglang).

Modules: `budget` (how many pages a row keeps), `plan` (a step's tensors, built once), `scores`
(the bound and the surprisal score), `kernel` (the batched CPU attention over the selected pages),
`select` (the same selection without the attention, as the CUDA path runs it), `reference` (plain
math it must equal).

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
     (softmax per query head over the fixed pages and the shortlist, summed over the query heads the
     list serves)
     ranks them, and the `keep` heaviest are attended, their logits reused. Without a shortlist
     (`shortlist_ratio` None) the bound picks the kept pages itself.
- "surprisal": the paper's method: page score = max surprisal of its tokens, the same pages on
  every layer. Prompt tokens are scored from the model's own logits at prefill (an lm_head pass
  over the prompt), sampled tokens at decode.

Why two stages, measured (docs/pruning.md; teacher-forced along the dense greedy path, real essays
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
do better (docs/pruning.md). Rows shorter than `min_context` tokens are not pruned (None: the
crossover: timed by the CPU server, a measured rule on CUDA, `sgl_entropic.crossover`). The counts are fixed per step and the
same on every layer, so every layer of a step gathers the same shapes (and one FlashInfer plan
serves all layers on CUDA).

A step's plan (`StepPlan`)
--------------------------
Row r attends its fixed pages (the first `sink_blocks` and the last `recent_blocks`, the last one
possibly partial) and its kept candidates; `attend_layer` gathers them for the whole batch at
once, padded to the widest row and masked.
"""

from sgl_entropic.pruning.budget import (
    AGGREGATES,
    DEFAULT_AGGREGATE,
    DEFAULT_REFERENCE_ENTROPY,
    RowPages,
    all_pages,
    keep_ratio,
    num_pages,
    reference_entropy_for_vocab,
    row_pages,
)
from sgl_entropic.pruning.kernel import attend_layer, attend_rows, fixed_lse, gather_pages, take_rows
from sgl_entropic.pruning.plan import StepPlan
from sgl_entropic.pruning.reference import sparse_decode_attention
from sgl_entropic.pruning.scores import quest_bounds, shortlist_mass, surprisal_scores
from sgl_entropic.pruning.select import Stages, select_pages

__all__ = [
    "AGGREGATES",
    "DEFAULT_AGGREGATE",
    "DEFAULT_REFERENCE_ENTROPY",
    "RowPages",
    "Stages",
    "StepPlan",
    "all_pages",
    "attend_layer",
    "attend_rows",
    "fixed_lse",
    "gather_pages",
    "keep_ratio",
    "num_pages",
    "quest_bounds",
    "reference_entropy_for_vocab",
    "row_pages",
    "select_pages",
    "shortlist_mass",
    "sparse_decode_attention",
    "surprisal_scores",
    "take_rows",
]
