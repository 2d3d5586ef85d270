"""The per-step page plan shared by the CPU and the CUDA attention backend (scheduler process).

`PagePlanner.plan` decides once per decode step which rows prune and builds a `pruning.StepPlan`;
extend steps fold the keys they write into the page store (`page_store.py`). `Probe` is what the
backends' start-up pass found.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_entropic.config import PruningConfig
from sgl_entropic.plugin.attention.page_store import PageStore, full_context_layers, reads_whole_context
from sgl_entropic.plugin.attention.self_check import SelfCheck
from sgl_entropic.pruning import StepPlan, all_pages, reference_entropy_for_vocab, row_pages, surprisal_scores

logger = logging.getLogger("sgl_entropic")

# Where the crossover is not measured (tensor parallelism: every rank must decide alike) and
# min_context is unset, rows shorter than this attend densely.
UNMEASURED_MIN_CONTEXT = 1024
# Dense decode steps defer at most this many KV slots before folding them (one fold per layer).
_MAX_DEFERRED_SLOTS = 4096


class PagePlanner:
    """The per-step decision shared by the CPU and the CUDA backend."""

    def __init__(self, model_runner, cfg: PruningConfig):
        if model_runner.page_size != cfg.page_size:
            raise ValueError(
                f"--attention-backend entropic: pruning.page_size ({cfg.page_size}) must equal the KV "
                f"--page-size ({model_runner.page_size}); the launcher sets it"
            )
        self.cfg = cfg
        config = model_runner.model_config
        self.reference_entropy = cfg.reference_entropy or reference_entropy_for_vocab(config.vocab_size)
        # Only layers that attend the whole context prune; sliding-window ones run SGLang's code untouched.
        self.full_layers, self.attention_layers = full_context_layers(model_runner.model)
        sparse = [i for i in self.full_layers if i >= cfg.dense_layers]  # the first dense_layers read everything
        self.sparse_share = len(sparse) / max(1, len(self.full_layers))  # of the layers that read the context
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.group_tokens: Optional[int] = None  # the CPU backend's row groups (pruning.StepPlan.build)
        self.kv_pool = model_runner.token_to_kv_pool
        k0 = self.kv_pool.get_key_buffer(0)
        self.store = PageStore(
            self.full_layers,
            k0.shape[0],
            cfg.page_size,
            k0.shape[1],
            k0.shape[2],
            k0.dtype,
            k0.device,
            self.req_to_token.shape[0],
            with_surprisal=cfg.selector == "surprisal",
        )
        # KV slots written by dense decode steps whose keys are not folded into the page bounds yet
        self._deferred: list[torch.Tensor] = []
        self._deferred_slots = 0
        self._fold_decode = False
        if not sparse:
            self.disable("no layer past pruning.dense_layers attends the whole context (all sliding-window)")

    def disable(self, reason: str) -> None:
        """Pruning off for this server's life (the self-check failed): every step attends densely."""
        self.cfg = self.cfg.model_copy(update={"min_context": 10**9})
        logger.error("sgl-entropic: pruning is OFF, every decode step attends densely: %s", reason)

    def rows(self, forward_batch, batch_rows) -> Optional[list]:
        """Each row's page counts when this decode step prunes, else None (host values only: no device read)."""
        lengths = forward_batch.seq_lens_cpu.tolist()  # a host tensor
        if forward_batch.encoder_lens is not None or forward_batch.spec_info is not None or not lengths:
            return None
        if max(lengths) < (self.cfg.min_context or 0):
            return None
        states = _row_states(batch_rows, len(lengths))
        entropies = [math.nan if s is None or s.trace.last_entropy is None else s.trace.last_entropy for s in states]
        rows = [row_pages(n, h, self.cfg, self.reference_entropy) for n, h in zip(lengths, entropies)]
        return rows if any(r.prunes for r in rows) else None

    def plan(self, forward_batch, batch_rows, dense_kernel: bool = False) -> Optional[StepPlan]:
        """The step's plan: pruned, or every page for the dense kernel (`dense_kernel`), or None (SGLang's loop).

        batch_rows: the step's `BatchRows` (the requests' host state: latest entropy). A step that does
        not prune folds no keys: its slots wait (`_deferred`) until a step prunes, an extend comes, or
        they pile up, so contexts below the crossover pay nothing per layer.
        """
        self.store.write_decode_inputs(forward_batch.out_cache_loc, forward_batch.req_pool_indices)
        rows = self.rows(forward_batch, batch_rows)
        self._fold_decode = rows is not None
        if rows is not None:
            self.fold_deferred()
        else:
            self.note_dense_step(forward_batch)
            if not dense_kernel or forward_batch.encoder_lens is not None or forward_batch.spec_info is not None:
                return None
            rows = [all_pages(n, self.cfg.page_size) for n in forward_batch.seq_lens_cpu.tolist()]
        plan = self._build(rows, forward_batch.req_pool_indices)
        if self._fold_decode and batch_rows is not None:  # the per-token `attended` trace and the cost C
            batch_rows.attended = plan.attended_fractions(self.sparse_share)
            batch_rows.read = plan.read_fractions(self.sparse_share)
        if self._fold_decode and self.cfg.selector == "surprisal":
            p = self.cfg.page_size
            slots = self.req_to_token[forward_batch.req_pool_indices, : max(r.length for r in rows)].long()
            lengths = torch.tensor([r.length for r in rows], device=slots.device)
            scores = surprisal_scores(self.store.slot_surprisal[slots], lengths, p, self.cfg.aggregate)
            width = plan.page_table.shape[1]
            scores = scores[:, :width].masked_fill(~plan.candidate, -math.inf)
            plan.chosen = scores.topk(plan.keep_valid.shape[1], dim=-1).indices[:, None]
        return plan

    def _build(self, rows: list, req_pool_indices: torch.Tensor) -> StepPlan:
        p = self.cfg.page_size
        width = max(r.n for r in rows)
        page_table = self.req_to_token[req_pool_indices, : width * p : p].long() // p
        return StepPlan.build(rows, page_table, per_head=self.cfg.per_head, group_tokens=self.group_tokens)

    def note_dense_step(self, forward_batch) -> None:
        """A decode (or speculative verify) step that does not prune folds no keys: its KV slots wait for the
        next fold, which reads the keys they hold then (a rejected draft's slot is rewritten first, or folds
        a key the page's bound may include: a looser bound, never a wrong one)."""
        self._fold_decode = False
        locs = forward_batch.out_cache_loc
        self._deferred.append(locs)
        self._deferred_slots += locs.numel()
        if self._deferred_slots >= _MAX_DEFERRED_SLOTS:
            self.fold_deferred()

    def fold_deferred(self) -> None:
        """Fold the deferred decode slots' keys, every layer; before any newer write, to keep write order."""
        if not self._deferred:
            return
        locs = torch.cat(self._deferred)
        self._deferred, self._deferred_slots = [], 0
        for layer_id in self.store.layer_ids:
            self.store.write_keys(layer_id, locs, self.kv_pool.get_key_buffer(layer_id)[locs])

    # Layers our kernels serve: self-attention without a sliding window (others run SGLang's code).
    plain_layer = staticmethod(reads_whole_context)

    def sparse_layer(self, layer) -> bool:
        """Layers that attend a pruned plan: plain ones past the first `dense_layers`."""
        return self.plain_layer(layer) and layer.layer_id >= self.cfg.dense_layers

    def write_keys(self, layer, forward_batch, k_cache: torch.Tensor) -> None:
        """After a layer wrote its KV: fold the keys into the page bounds (a dense decode step defers)."""
        mode = forward_batch.forward_mode
        if not self.plain_layer(layer) or ((mode.is_decode() or mode.is_target_verify()) and not self._fold_decode):
            return
        locs = forward_batch.out_cache_loc
        self.store.write_keys(layer.layer_id, locs, k_cache[locs])


def _row_states(rows, batch: int) -> list:
    """Each row's RequestState (host copy of its latest entropy), None if unknown."""
    if rows is None or len(rows.reqs) != batch:
        return [None] * batch
    return [getattr(r, "entropic", None) for r in rows.reqs]


@dataclass
class Probe:
    """What the start-up pass found: where our kernels pay on this machine and model, and the self-check."""

    timings: list  # crossover.Timing per context: SGLang's dense loop against our pruned path
    kernel_timings: list  # crossover.Timing per context: SGLang's dense loop against our kernel over every page
    dense_kernel_from: Optional[int]  # steps that do not prune run our kernel from this context on
    check: SelfCheck
