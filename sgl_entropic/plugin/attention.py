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

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_entropic.config import ATTENTION_BACKEND as BACKEND_NAME, PruningConfig
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
        k0 = model_runner.token_to_kv_pool.get_key_buffer(0)
        self.store = PageStore(layers, k0.shape[0], cfg.page_size, k0.shape[1], k0.shape[2], k0.dtype, k0.device,
                               self.req_to_token.shape[0], with_surprisal=cfg.selector == "surprisal")
        # quest_gated: the rows (arrival seqs) and keep counts of the last selection, its age, and per layer its pages
        self._gate: tuple[tuple, tuple, int] = ((), (), 0)
        self._chosen: dict[int, torch.Tensor] = {}

    def plan(self, forward_batch, batch_rows) -> Optional[DecodeStep]:
        """None when this decode step attends densely (nothing to prune, or a batch shape we do not prune).

        batch_rows: the step's `BatchRows` (the requests' host state: latest entropy and surprisal).
        """
        self.store.write_decode_inputs(forward_batch.out_cache_loc, forward_batch.req_pool_indices)
        lengths = forward_batch.seq_lens_cpu.tolist()  # a host tensor: no device sync
        if forward_batch.encoder_lens is not None or forward_batch.spec_info is not None or not lengths:
            return None
        if max(lengths) < self.cfg.min_context:
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
        if not layer.is_cross_attention:
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
        self.planner = PagePlanner(model_runner, cfg)
        self.step: Optional[DecodeStep] = None
        self._layer = None

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        decode = forward_batch.forward_mode.is_decode()
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
