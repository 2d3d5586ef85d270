"""The meso loop's SGLang attention backend, `--attention-backend entropic` (scheduler process).

Prefill and extend stay dense and fold the keys they write into the page store's min/max
(`page_store.py`); every decode step plans once (`PagePlanner.plan`: which rows prune, how many
pages each keeps, from its latest entropy) and every layer selects its pages and attends them:
  - CPU: a subclass of SGLang's TorchNativeAttnBackend; a sparse layer gathers the kept pages
    of the whole batch and runs one batched SDPA (`pruning.paged_decode_attention`); a step that
    prunes nothing runs SGLang's own loop, untouched.
  - CUDA (`attention_flashinfer.py`): FlashInfer paged decode, one plan per step, the page list
    rewritten per layer by the Triton page-select kernel.
`pruning.py` decides; this module adapts it to SGLang's pools and batches. The layouts follow
`sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm` (per page, per KV head key min/max),
which is not reused as code: it re-gathers every page's keys per layer from req_to_token, keeps
fp32 copies per layer in dicts, syncs with the host (.item(), nonzero) on every call, and averages
a query group, which is not an upper bound. Here the metadata is written once, as KV is written.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_entropic.config import ATTENTION_BACKEND as BACKEND_NAME, PruningConfig
from sgl_entropic.crossover import CONTEXTS, Timing, crossover, measure
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.page_store import PageStore
from sgl_entropic.pruning import (
    PageLayout,
    paged_decode_attention,
    quest_scores,
    reference_entropy_for_vocab,
    row_pages,
    surprisal_scores,
)

logger = logging.getLogger("sgl_entropic")

# Where the crossover is not measured (the CUDA backend, tensor parallelism) and min_context is
# unset, rows shorter than this attend densely.
UNMEASURED_MIN_CONTEXT = 1024
# Dense decode steps defer at most this many KV slots before folding them (one fold per layer).
_MAX_DEFERRED_SLOTS = 4096


@dataclass
class DecodeStep:
    """A decode batch's plan: the layout, and for layer-independent selections the pages."""

    layout: PageLayout
    fixed: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (logical, valid) for every layer
    reuse: bool = False  # quest_gated: every layer reuses its last selection


class PagePlanner:
    """The per-step decision shared by the CPU and the CUDA backend."""

    def __init__(self, model_runner, cfg: PruningConfig):
        if model_runner.page_size != cfg.page_size:
            raise ValueError(f"--attention-backend entropic: pruning.page_size ({cfg.page_size}) must equal the KV "
                             f"--page-size ({model_runner.page_size}); the launcher sets it")
        self.cfg = cfg
        config = model_runner.model_config
        self.reference_entropy = cfg.reference_entropy or reference_entropy_for_vocab(config.vocab_size)
        layers = config.num_hidden_layers
        self.sparse_share = max(0, layers - cfg.dense_layers) / layers  # the first dense_layers read everything
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.kv_pool = model_runner.token_to_kv_pool
        k0 = self.kv_pool.get_key_buffer(0)
        self.store = PageStore(layers, k0.shape[0], cfg.page_size, k0.shape[1], k0.shape[2], k0.dtype, k0.device,
                               self.req_to_token.shape[0], with_surprisal=cfg.selector == "surprisal")
        # quest_gated: the rows (arrival seqs) and keep counts of the last selection, its age, and per layer its pages
        self._gate: tuple[tuple, tuple, int] = ((), (), 0)
        self._chosen: dict[int, torch.Tensor] = {}
        # KV slots written by dense decode steps whose keys are not folded into the page bounds yet
        self._deferred: list[torch.Tensor] = []
        self._deferred_slots = 0
        self._fold_decode = False

    def plan(self, forward_batch, batch_rows) -> Optional[DecodeStep]:
        """None when this decode step attends densely (nothing to prune, or a batch shape we do not prune).

        batch_rows: the step's `BatchRows` (the requests' host state: latest entropy and surprisal).
        A dense step folds no keys: its slots wait (`_deferred`) until a step prunes, an extend
        comes, or they pile up, so contexts below the crossover pay nothing per layer.
        """
        step = self._plan(forward_batch, batch_rows)
        self._fold_decode = step is not None
        if step is not None:
            self.fold_deferred()
        else:
            locs = forward_batch.out_cache_loc
            self._deferred.append(locs)
            self._deferred_slots += locs.numel()
            if self._deferred_slots >= _MAX_DEFERRED_SLOTS:
                self.fold_deferred()
        return step

    def fold_deferred(self) -> None:
        """Fold the deferred decode slots' keys, every layer; before any newer write, to keep write order."""
        if not self._deferred:
            return
        locs = torch.cat(self._deferred)
        self._deferred, self._deferred_slots = [], 0
        for layer_id in range(self.store.kmin.shape[0]):
            self.store.write_keys(layer_id, locs, self.kv_pool.get_key_buffer(layer_id)[locs])

    def _plan(self, forward_batch, batch_rows) -> Optional[DecodeStep]:
        self.store.write_decode_inputs(forward_batch.out_cache_loc, forward_batch.req_pool_indices)
        lengths = forward_batch.seq_lens_cpu.tolist()  # a host tensor: no device sync
        if forward_batch.encoder_lens is not None or forward_batch.spec_info is not None or not lengths:
            return None
        if max(lengths) < (self.cfg.min_context or 0):
            return None
        states = _row_states(batch_rows, len(lengths))
        entropies = [math.nan if s is None or s.trace.last_entropy is None else s.trace.last_entropy for s in states]
        rows = [row_pages(n, h, self.cfg, self.reference_entropy) for n, h in zip(lengths, entropies)]
        reuse = self.cfg.selector == "quest_gated" and self._can_reuse(states)
        if reuse:
            rows = [r.with_keep(k) for r, k in zip(rows, self._gate[1])]
        if not any(r.prunes for r in rows):
            return None
        p = self.cfg.page_size
        width = -(-max(lengths) // p)
        page_table = self.req_to_token[forward_batch.req_pool_indices, : width * p : p].long() // p
        layout = PageLayout.build(rows, page_table)
        if batch_rows is not None:  # the per-token `attended` trace and the cost C of this step
            batch_rows.attended = layout.attended_fractions(self.sparse_share)
        step = DecodeStep(layout, reuse=reuse)
        if self.cfg.selector == "surprisal":
            slots = self.req_to_token[forward_batch.req_pool_indices, : max(lengths)].long()
            scores = surprisal_scores(self.store.slot_surprisal[slots], layout.lengths, p, self.cfg.aggregate)
            step.fixed = layout.select(scores)
        elif self.cfg.selector == "quest_gated":
            keys = tuple(s.arrival_seq if s is not None else None for s in states)
            self._gate = (keys, tuple(r.keep for r in rows), self._gate[2] + 1 if reuse else 1)
        return step

    def _can_reuse(self, states) -> bool:
        """quest_gated: the same requests as last step, none surprised, the selection young enough."""
        keys, _, age = self._gate
        if any(s is None for s in states) or keys != tuple(s.arrival_seq for s in states):
            return False
        if age >= self.cfg.gate_max_age:
            return False
        return all(s.last_surprisal <= self.cfg.gate_surprisal for s in states)

    def pages(self, step: DecodeStep, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical, valid) pages of this layer: fixed per step, reused, or selected by the bound."""
        if step.fixed is not None:
            return step.fixed
        layout = step.layout
        if step.reuse and layer_id in self._chosen:
            return layout.assemble(self._chosen[layer_id])
        pt = layout.page_table
        scores = quest_scores(q, self.store.kmin[layer_id][pt], self.store.kmax[layer_id][pt])
        logical, valid = layout.select(scores)
        if self.cfg.selector == "quest_gated":
            self._chosen[layer_id] = logical[:, layout.sink_cols : layout.sink_cols + layout.keep_cols]
        return logical, valid

    def sparse_layer(self, layer) -> bool:
        """Layers that attend the plan: past the dense ones, self-attention without a sliding window."""
        window = getattr(layer, "sliding_window_size", None)
        return (layer.layer_id >= self.cfg.dense_layers and not layer.is_cross_attention
                and (window is None or window < 0))

    def write_keys(self, layer, forward_batch, k_cache: torch.Tensor) -> None:
        """After a layer wrote its KV: fold the keys into the page bounds (a dense decode step defers)."""
        if layer.is_cross_attention or (forward_batch.forward_mode.is_decode() and not self._fold_decode):
            return
        locs = forward_batch.out_cache_loc
        self.store.write_keys(layer.layer_id, locs, k_cache[locs])


def _row_states(rows, batch: int) -> list:
    """Each row's RequestState (host copy of its latest entropy and surprisal), None if unknown."""
    if rows is None or len(rows.reqs) != batch:
        return [None] * batch
    return [getattr(r, "entropic", None) for r in rows.reqs]


class EntropicTorchNativeAttnBackend(TorchNativeAttnBackend):
    """torch_native with page-sparse decode (CPU)."""

    def __init__(self, model_runner, cfg: PruningConfig):
        super().__init__(model_runner)
        self.timings: list[Timing] = []
        if cfg.min_context is None and model_runner.server_args.tp_size > 1:
            # each rank would time its own crossover; their decisions must be identical
            cfg = cfg.model_copy(update={"min_context": UNMEASURED_MIN_CONTEXT})
        if cfg.min_context is None:  # measure where pruning pays on this machine and model
            config = model_runner.model_config
            cap = min(config.context_len, model_runner.token_to_kv_pool.size)
            self.timings = measure(functools.partial(self._timed_step, model_runner, cfg),
                                   [n for n in CONTEXTS if n <= cap])
            found = crossover(self.timings)
            cfg = cfg.model_copy(update={"min_context": found if found is not None else config.context_len + 1})
            logger.info("sgl-entropic: pruning pays from %s tokens (dense/sparse ms per step: %s)",
                        found if found is not None else "no measured context",
                        ", ".join(f"{t.context}: {t.dense_s * 1e3:.2f}/{t.sparse_s * 1e3:.2f}" for t in self.timings))
        self.planner = PagePlanner(model_runner, cfg)
        self.step: Optional[DecodeStep] = None
        self._layer = None

    def _timed_step(self, model_runner, cfg: PruningConfig, n: int, sparse: bool):
        """One decode step's attention over every layer, for one row of n tokens of synthetic KV:
        SGLang's own dense loop, or the pruned path (plan, page bounds, selection at the
        largest budget, kept-page attention, the key fold a pruned step does)."""
        config, p = model_runner.model_config, cfg.page_size
        k0 = model_runner.token_to_kv_pool.get_key_buffer(0)
        heads_kv, dim, dtype = k0.shape[1], k0.shape[2], k0.dtype
        heads_q, layers = config.num_attention_heads // model_runner.server_args.tp_size, config.num_hidden_layers
        pages = -(-n // p)
        k, v = (torch.randn(pages * p, heads_kv, dim).to(dtype) for _ in range(2))
        q, scale = torch.randn(1, heads_q, dim).to(dtype), dim ** -0.5
        out = torch.empty_like(q)
        req_to_token = torch.arange(pages * p, dtype=torch.int32)[None]
        one, seq_lens = torch.zeros(1, dtype=torch.long), torch.tensor([n])
        if not sparse:
            def dense():
                for _ in range(layers):
                    TorchNativeAttnBackend._run_sdpa_forward_decode(
                        self, q, out, k, v, req_to_token, one, seq_lens, scaling=scale, enable_gqa=heads_q != heads_kv)
            return dense
        store = PageStore(1, pages * p, p, heads_kv, dim, dtype, k.device, 1, with_surprisal=False)
        store.write_keys(0, torch.arange(n), k[:n])
        loc = torch.tensor([n - 1])

        def pruned():
            page_table = req_to_token[one, : pages * p : p].long() // p
            row = row_pages(n, math.nan, cfg)  # an unknown entropy keeps the most pages
            layout = PageLayout.build([row], page_table)
            for _ in range(layers):
                scores = quest_scores(q, store.kmin[0][page_table], store.kmax[0][page_table])
                logical, _ = layout.select(scores)
                out.copy_(paged_decode_attention(q, k, v, layout.kept_pages(logical), [row.kept_tokens], p, scale))
                store.write_keys(0, loc, k[loc])
        return pruned

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        decode = forward_batch.forward_mode.is_decode()
        if not decode:
            self.planner.fold_deferred()  # before this extend's writes, which may restart a reused page
        self.step = self.planner.plan(forward_batch, runtime.current_rows()) if decode else None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._layer = layer if self.step is not None and self.planner.sparse_layer(layer) else None
        out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, *args, scaling=None, **kwargs):
        layer = self._layer
        if layer is None:  # SGLang's own per-request loop
            return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, *args, scaling=scaling, **kwargs)
        layout = self.step.layout
        logical, _ = self.planner.pages(self.step, layer.layer_id, query)
        pages = layout.kept_pages(logical)
        kept = [r.kept_tokens for r in layout.rows]
        output.copy_(paged_decode_attention(query, k_cache, v_cache, pages, kept, layout.page_size, scaling))
        return output


def create_backend(model_runner):
    """`--attention-backend entropic`: FlashInfer on CUDA, torch_native elsewhere."""
    rt = runtime.current()
    cfg = rt.config.pruning
    if str(model_runner.device).startswith("cuda"):
        if model_runner.use_mla_backend:
            raise ValueError("--attention-backend entropic: MLA models are not supported (their KV layout differs)")
        from sgl_entropic.plugin.attention_flashinfer import EntropicFlashInferAttnBackend

        backend = EntropicFlashInferAttnBackend(model_runner, cfg)
    else:
        backend = EntropicTorchNativeAttnBackend(model_runner, cfg)
    rt.pages = backend.planner.store  # the prompt-scoring hook (surprisal selector) writes into it
    rt.pruning_from, rt.crossover = backend.planner.cfg.min_context, backend.timings
    return backend


def register_backend() -> None:
    """`--attention-backend entropic` (the launcher passes it for pruning|full)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:  # the list SGLang's argparse reads
        ATTENTION_BACKEND_CHOICES.append(BACKEND_NAME)
    register_attention_backend(BACKEND_NAME)(create_backend)


def around_logits_forward(original, processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    """surprisal selector: prompt tokens' surprisal from the model's own logits, beside their KV slots."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    store = runtime.current().pages
    if store is not None and store.slot_surprisal is not None and isinstance(logits_metadata, ForwardBatch) and logits_metadata.forward_mode.is_extend() \
            and not logits_metadata.forward_mode.is_target_verify():
        try:
            store.record_prompt(processor, hidden_states, lm_head, logits_metadata)
        except Exception:  # unscored slots stay NaN, i.e. always attended
            logger.exception("sgl-entropic: scoring the prompt tokens failed; their pages stay attended")
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
