"""The meso loop on CUDA: FlashInfer decode over only the kept KV pages (see `attention.py`).

Imported only on CUDA machines, where FlashInfer is installed (scripts/setup.sh --gpu).
SGLang's FlashInfer layout lists KV slots (one token per FlashInfer page). A step plans one
sparse decode wrapper: each row's kept-token count is fixed for the step (the same pages per
layer, the last one partial), so only the slot list changes per layer: the Triton page-select
kernel writes the layer's pages, which expand in place into the wrapper's index buffer.
"""

from __future__ import annotations

import dataclasses

import torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

from sgl_entropic.config import PruningConfig
from sgl_entropic.kernels import triton_available
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention import UNMEASURED_MIN_CONTEXT, DecodeStep, PagePlanner


@dataclasses.dataclass
class _SparsePlan:
    step: DecodeStep
    page_indptr: torch.Tensor  # [B + 1] int32: each row's slice of the compact page list
    page_flat: torch.Tensor  # [sum pages] int64: the valid [B, K] layout cells, row by row
    token_flat: torch.Tensor  # [sum tokens] int64: the real tokens among the pages' expanded slots
    counts: tuple[torch.Tensor, ...]  # n, sink, recent, keep per row (int32, device)


class EntropicFlashInferAttnBackend(FlashInferAttnBackend):
    """FlashInfer with page-sparse decode (CUDA, without CUDA graphs: the plan changes every step)."""

    def __init__(self, model_runner, cfg: PruningConfig):
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        if cfg.min_context is None:
            cfg = cfg.model_copy(update={"min_context": UNMEASURED_MIN_CONTEXT})
        self.planner = PagePlanner(model_runner, cfg)
        self.timings = []
        self.sparse_wrapper = BatchDecodeWithPagedKVCacheWrapper(
            self.workspace_buffer, "NHD", backend=self.decode_backend, use_tensor_cores=self.decode_use_tensor_cores
        )
        updater = self.indices_updater_decode
        self._heads = (updater.num_qo_heads, updater.num_kv_heads, updater.head_dim)
        self.sparse: _SparsePlan | None = None
        self.dense_metadata = self.sparse_metadata = None

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.sparse = None
        if not forward_batch.forward_mode.is_decode():
            self.planner.fold_deferred()  # before this extend's writes, which may restart a reused page
            return
        if len(self.decode_wrappers) != 1:
            return  # cross-attention / SWA layouts (own wrappers): dense
        step = self.planner.plan(forward_batch, runtime.current_rows())
        if step is None:
            return
        layout, device = step.layout, forward_batch.seq_lens.device
        rows = layout.rows
        host = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        page_indptr, token_indptr = (torch.cat([host([0]), host(x).cumsum(0)]).to(device, torch.int32)
                                     for x in ([r.read_pages for r in rows], [r.kept_tokens for r in rows]))
        self.sparse = _SparsePlan(
            step, page_indptr, layout.compact_cells.to(device), layout.compact_tokens.to(device),
            tuple(host([getattr(r, f) for r in rows]).to(device) for f in ("n", "sink", "recent", "keep")),
        )
        # sized from the host counts: reading token_indptr[-1] back would sync with the device
        indices = torch.empty(sum(r.kept_tokens for r in rows), dtype=torch.int32, device=device)
        num_qo, num_kv, head_dim = self._heads
        self.sparse_wrapper.begin_forward(
            token_indptr, indices, torch.ones(len(rows), dtype=torch.int32, device=device),
            num_qo, num_kv, head_dim, 1,
            data_type=self.indices_updater_decode.data_type, q_data_type=self.indices_updater_decode.q_data_type,
        )
        self.dense_metadata = self.forward_metadata
        self.sparse_metadata = dataclasses.replace(self.forward_metadata, decode_wrappers=[self.sparse_wrapper])

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        sparse = self.sparse is not None and self.planner.sparse_layer(layer)
        if self.sparse is not None:
            self.forward_metadata = self.sparse_metadata if sparse else self.dense_metadata
        if sparse:
            self._write_layer_slots(layer, q)
        out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def _write_layer_slots(self, layer, q) -> None:
        """This layer's kept pages, expanded to KV slots, into the index buffer the plan reads."""
        plan, p = self.sparse, self.planner.cfg.page_size
        step, layout = plan.step, plan.step.layout
        queries = q.view(q.shape[0], self._heads[0], self._heads[2])
        if step.fixed is None and not step.reuse and triton_available():
            from sgl_entropic.kernels.page_select import page_select_triton

            store = self.planner.store
            _, pages = page_select_triton(queries, store.kmin[layer.layer_id], store.kmax[layer.layer_id],
                                          layout.page_table, *plan.counts, plan.page_indptr)
        else:
            logical, _ = self.planner.pages(step, layer.layer_id, queries)
            pages = layout.physical(logical).flatten()[plan.page_flat]
        slots = (pages.long()[:, None] * p + torch.arange(p, device=pages.device)).flatten()[plan.token_flat]
        self.sparse_wrapper._paged_kv_indices_buf[: slots.numel()].copy_(slots)
