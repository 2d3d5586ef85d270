"""The meso loop on CUDA: FlashInfer, its CUDA graphs kept for every decode step that does not prune.

Imported only on CUDA machines, where FlashInfer is installed (scripts/setup.sh --gpu).
- A decode batch that does not prune is stock SGLang: `init_forward_metadata_out_graph` and the
  captured graphs replay as they do without the plugin (the step's KV slots are only noted, to be
  folded into the page bounds by the next step that prunes).
- A batch that prunes runs eager: `attention.around_can_run_graph` answers no in SGLang's own
  `can_run_graph`, since its page counts change every step. Its plan is made once, outside the
  layers (`FlashInferSparse.begin`): each list's token count is fixed for the step (fixed pages plus
  `keep` full candidate pages), so one FlashInfer decode plan serves every layer. Per layer, the two
  selection stages run as Triton kernels reading the store and the KV cache in place
  (`kernels/page_scores.py`), the top-k on the device, and the layer's kept slots are written into the
  plan's index buffer; nothing is read back to the host inside the step (the plan's indptr is built on
  the host from host counts and handed to FlashInfer as a host tensor).
- One page list per KV head (`per_head`): FlashInfer's decode over lists of one KV head each, the
  cache viewed as [slots * H_kv, 1, D] and each (row, head) a request of H_q / H_kv query heads.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Optional

import torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

from sgl_entropic.config import PruningConfig
from sgl_entropic.crossover import cuda_min_context
from sgl_entropic.kernels.page_scores import TRITON_STAGES
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention.page_planner import PagePlanner, Probe
from sgl_entropic.plugin.attention.self_check import run_self_check
from sgl_entropic.pruning import StepPlan, select_pages
from sgl_entropic.transfer import to_device

logger = logging.getLogger("sgl_entropic")


class _PerHeadLists:
    """A decode wrapper whose requests are (row, KV head) lists of one KV head each."""

    def __init__(self, inner, heads_kv: int):
        self.inner, self.heads_kv = inner, heads_kv

    def forward(self, q, kv_cache, **kwargs):
        batch, heads_q, dim = q.shape
        k, v = kv_cache
        flat = lambda t: t.view(-1, 1, t.shape[-1])  # noqa: E731  [slots * H_kv, 1, D]: slot * H_kv + h
        out = self.inner.forward(
            q.view(batch * self.heads_kv, heads_q // self.heads_kv, dim), (flat(k), flat(v)), **kwargs
        )
        return out.view(batch, heads_q, -1)


class FlashInferSparse:
    """One pruned decode step on FlashInfer: the plan (`begin`), each layer's selection (`select`)."""

    def __init__(
        self,
        workspace,
        heads: tuple[int, int, int],
        data_types: tuple,
        page_size: int,
        per_head: bool,
        backend: str = "auto",
        use_tensor_cores: bool = False,
    ):
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", backend=backend, use_tensor_cores=use_tensor_cores
        )
        self.heads_q, self.heads_kv, self.head_dim = heads
        self.q_type, self.kv_type = data_types
        self.page_size, self.per_head = page_size, per_head
        self.decoder = _PerHeadLists(self.wrapper, self.heads_kv) if per_head else self.wrapper
        self.plan: Optional[StepPlan] = None

    def begin(self, plan: StepPlan) -> None:
        """Plan FlashInfer once for the step: list (row, or row and KV head) r holds its fixed tokens, then
        its kept pages' tokens; the fixed part of the index buffer is written here, once per step."""
        p, rows = self.page_size, plan.rows
        lists = self.heads_kv if self.per_head else 1
        device = plan.page_table.device
        counts = [r.kept_tokens for r in rows for _ in range(lists)]  # host values: nothing read back
        offsets = [0, *itertools.accumulate(counts)]
        total = offsets[-1]
        # one scratch entry past the lists: the target of every padding write
        self.indices = torch.empty(total + 1, dtype=torch.int32, device=device)
        starts = to_device([offsets[b * lists : (b + 1) * lists] for b in range(len(rows))], device)  # [B, L]
        fixed = to_device([r.kept_tokens - r.keep * p for r in rows], device)[:, None, None]  # real fixed tokens
        keep = to_device([r.keep * p for r in rows], device)[:, None, None]
        # fixed token i of list (b, l) goes to start + i, kept token i to start + fixed + i; padding to scratch
        i = torch.arange(plan.fixed_tokens.shape[1] * p, device=device)
        f_dest = torch.where(i < fixed, starts[..., None] + i, total)
        i = torch.arange(plan.keep_valid.shape[1] * p, device=device)
        self.k_dest = torch.where(i < keep, starts[..., None] + fixed + i, total).flatten()
        fixed_slots = (plan.fixed_pages[:, :, None] * p + torch.arange(p, device=device)).flatten(1)  # [B, F * p]
        self.indices.index_put_(
            (f_dest.flatten(),), self._flat(fixed_slots[:, None].expand(-1, lists, -1)).flatten().to(torch.int32)
        )
        # indptr and last page lengths as host tensors: FlashInfer plans from host copies, no read back
        indptr = torch.tensor(offsets, dtype=torch.int32, pin_memory=device.type == "cuda")
        last_page_len = torch.ones(len(counts), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.wrapper.plan(
            indptr,
            self.indices[:total],
            last_page_len,
            self.heads_q // lists,
            self.heads_kv // lists,
            self.head_dim,
            1,
            q_data_type=self.q_type,
            kv_data_type=self.kv_type,
        )
        self.plan = plan
        self.page_table_i32 = plan.page_table.to(torch.int32)  # once per step, read by every layer

    def _flat(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots [B, L, X] -> FlashInfer page ids: the slot, or slot * H_kv + h for per-head lists."""
        if not self.per_head:
            return slots
        return slots * self.heads_kv + torch.arange(self.heads_kv, device=slots.device)[None, :, None]

    def select(
        self, q: torch.Tensor, k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """This layer's kept pages (logical `[B, L, K]`), their slots written into the plan's index buffer."""
        plan, p = self.plan, self.page_size
        q = q.view(q.shape[0], self.heads_q, self.head_dim)
        kept = select_pages(TRITON_STAGES, q, k_cache, kmin, kmax, plan, self.page_table_i32, scale)
        phys = plan.page_table.gather(1, kept.flatten(1)).view_as(kept)
        slots = (phys[..., None] * p + torch.arange(p, device=phys.device)).flatten(2)  # [B, L, K * p]
        lists = self.heads_kv if self.per_head else 1
        self.indices.index_put_((self.k_dest,), self._flat(slots.expand(-1, lists, -1)).flatten().to(torch.int32))
        return kept

    def attend(self, q, k_cache, v_cache, plan: StepPlan, kmin, kmax, scale: float):
        """The whole pruned layer on given tensors, as `pruning.attend_layer` (the self-check calls it)."""
        self.begin(plan)
        kept = self.select(q, k_cache, kmin, kmax, scale) if plan.keep_valid.shape[1] else None
        out = self.decoder.forward(q.contiguous(), (k_cache, v_cache), sm_scale=scale)
        return out.view(q.shape[0], self.heads_q, -1), kept


class EntropicFlashInferAttnBackend(FlashInferAttnBackend):
    """FlashInfer with page-sparse decode for the batches that prune (CUDA)."""

    def __init__(self, model_runner, cfg: PruningConfig):
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        self.planner = PagePlanner(model_runner, cfg)
        updater = self.indices_updater_decode
        self._heads = (updater.num_qo_heads, updater.num_kv_heads, updater.head_dim)
        self.sparse = FlashInferSparse(
            self.workspace_buffer,
            self._heads,
            (updater.q_data_type, updater.data_type),
            cfg.page_size,
            cfg.per_head,
            self.decode_backend,
            self.decode_use_tensor_cores,
        )
        self.pruned = False
        self.dense_metadata = self.sparse_metadata = None
        self.probe = self._start_up(model_runner, cfg)

    def _start_up(self, model_runner, cfg: PruningConfig) -> Probe:
        """The self-check; then, with `min_context` unset, the crossover from the measured CUDA rule
        (`crossover.cuda_min_context`): a probe here could not time a dense step as served (graph replay)."""
        dtype = self.indices_updater_decode.data_type
        check = run_self_check(self.sparse.attend, *self._heads, dtype, cfg, device=model_runner.device)
        if not check.ok:
            self.planner.disable(check.error)
        elif cfg.min_context is None:
            found = cuda_min_context(cfg.shortlist_ratio, model_runner.model_config.context_len)
            self.planner.cfg = cfg.model_copy(update={"min_context": found})
            logger.info(
                "sgl-entropic: on CUDA rows prune from %s tokens (the measured rule, docs/gpu.md; "
                "set pruning.min_context to override)",
                found,
            )
        return Probe([], [], None, check)

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.pruned = False
        if forward_batch.forward_mode.is_target_verify():  # a speculative step attends densely: its keys wait
            self.planner.note_dense_step(forward_batch)
            return
        if not forward_batch.forward_mode.is_decode():
            self.planner.fold_deferred()  # before this extend's writes, which may restart a reused page
            return
        if len(self.decode_wrappers) != 1:
            self.planner.note_dense_step(forward_batch)
            return  # cross-attention / SWA layouts (own wrappers): dense
        plan = self.planner.plan(forward_batch, runtime.step_rows(forward_batch))
        if plan is None:
            return
        self.sparse.begin(plan)
        self.pruned = True
        self.dense_metadata = self.forward_metadata
        self.sparse_metadata = dataclasses.replace(self.forward_metadata, decode_wrappers=[self.sparse.decoder])

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Graph capture and replay: only batches that do not prune get here (around_can_run_graph)."""
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self.pruned = False
        mode = forward_batch.forward_mode
        if (mode.is_decode() or mode.is_target_verify()) and not in_capture:  # replayed: its keys wait for a fold
            self.planner.note_dense_step(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        sparse = self.pruned and self.planner.sparse_layer(layer)
        if self.pruned:
            self.forward_metadata = self.sparse_metadata if sparse else self.dense_metadata
        if sparse:
            self.sparse.select(
                q,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                *self.planner.store.bounds(layer.layer_id),
                layer.scaling,
            )
        out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out
