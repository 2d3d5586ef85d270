"""The meso loop's SGLang attention backends: decode attends only the blocks `pruning` keeps.

Registered as `--attention-backend entropic` (the launcher selects it for `--entropic
pruning|full`). Prefill and extend stay dense; a decode step plans once per batch (which token
positions each row keeps, `pruning.plan_decode`) and every layer runs on that plan:
  - CPU: TorchNativeAttnBackend's own decode loop, given the kept slots instead of the whole
    `req_to_token` row (with everything kept the gathered slots, hence the outputs, are stock).
  - CUDA: FlashInfer's BatchDecodeWithPagedKVCacheWrapper planned over only the kept slots
    (SGLang's FlashInfer layout has one token per page, so kept blocks list their slots).
Pruning is a view: nothing is evicted, the next step plans again over the whole context.

Scores live beside the KV pool in `SurprisalStore.slot`, one float per KV slot. RadixAttention
shares slots between requests with a common prefix, so a reused prefix brings its scores
along without recomputation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch

from sgl_entropic.config import ATTENTION_BACKEND as BACKEND_NAME, PruningConfig
from sgl_entropic.pruning import DecodePlan, plan_decode, reference_entropy_for_vocab

logger = logging.getLogger("sgl_entropic")

# Rows of prompt logits computed at once when scoring a prefill (bounds the [rows, vocab] buffer).
_PROMPT_LOGITS_ROWS = 512


class SurprisalStore:
    """Token surprisal per KV slot, plus each request slot's latest sampled surprisal and entropy.

    NaN means unknown and makes its block always kept (see `pruning`): the first token of a
    prompt, the first token of an extend chunk whose predecessor is not in the same forward
    (chunked prefill boundary, cached prefix), and slots never written.
    """

    def __init__(self, num_kv_slots: int, num_req_slots: int, device):
        self.slot = torch.full((num_kv_slots,), math.nan, dtype=torch.float32, device=device)
        # Written when a request samples, read when that token enters the KV cache next step.
        self.next_surprisal = torch.full((num_req_slots,), math.nan, dtype=torch.float32, device=device)
        self.entropy = torch.full((num_req_slots,), math.nan, dtype=torch.float32, device=device)

    def record_sampled(self, req_pool_indices: torch.Tensor, surprisal: torch.Tensor, entropy: torch.Tensor,
                       valid: torch.Tensor) -> None:
        nan = torch.tensor(math.nan, device=surprisal.device)
        idx = req_pool_indices.to(self.entropy.device)
        self.next_surprisal[idx] = torch.where(valid, surprisal.float(), nan).to(self.slot.device)
        self.entropy[idx] = torch.where(valid, entropy.float(), nan).to(self.slot.device)

    def write_decode_inputs(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """The token a decode step feeds in was sampled last step: its surprisal goes to its slot."""
        self.slot[out_cache_loc] = self.next_surprisal[req_pool_indices]

    def record_prompt(self, processor, hidden_states: torch.Tensor, lm_head, forward_batch) -> None:
        """Surprisal of the extend tokens under the model's own next-token distribution (T = 1).

        Token i of a request's extend segment gets -ln p(x_i | x_<i) from the logits at i - 1;
        the segment's first token has no predecessor in this forward and stays NaN.
        """
        from sglang.srt.layers.logits_processor import LogitsMetadata

        input_ids, slots = forward_batch.input_ids, forward_batch.out_cache_loc
        n = input_ids.shape[0]
        if n == 0 or hidden_states.shape[0] != n:
            return
        metadata = LogitsMetadata.from_forward_batch(forward_batch)
        vocab = processor.config.vocab_size
        surprisal = torch.full((n,), math.nan, dtype=torch.float32, device=hidden_states.device)
        for start in range(0, n - 1, _PROMPT_LOGITS_ROWS):
            stop = min(start + _PROMPT_LOGITS_ROWS, n - 1)
            logits = processor._get_logits(hidden_states[start:stop], lm_head, metadata, use_logits_buffer=False)
            logp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
            nxt = input_ids[start + 1 : stop + 1].long()
            surprisal[start + 1 : stop + 1] = -logp.gather(1, nxt[:, None]).squeeze(1)
        surprisal[forward_batch.extend_start_loc.to(surprisal.device).long()] = math.nan
        self.slot[slots] = surprisal.to(self.slot.device)


@dataclasses.dataclass
class SparseDecode:
    """A decode batch's plan in the layout TorchNativeAttnBackend's loop reads: row r attends
    slots[r, :lens[r]] (the kept KV slots, ascending positions); flat_slots is the same list
    row after row, as FlashInfer's page list wants it."""

    plan: DecodePlan
    flat_slots: torch.Tensor  # [sum(lens)] int
    slots: torch.Tensor  # [B, max kept] int
    rows: torch.Tensor  # [B] arange: row r reads slots[r]
    lens: torch.Tensor  # [B] kept tokens


class EntropicDecodePlanner:
    """The per-batch decision shared by both backends: store writes, plan, traces."""

    def __init__(self, model_runner, cfg: PruningConfig):
        self.cfg = cfg
        self.reference_entropy = cfg.reference_entropy or reference_entropy_for_vocab(model_runner.model_config.vocab_size)
        layers = model_runner.model_config.num_hidden_layers
        # the share of layers that read the plan; the first dense_layers read everything
        self.sparse_share = max(0, layers - cfg.dense_layers) / layers
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        kv_slots = model_runner.token_to_kv_pool.get_key_buffer(0).shape[0]
        self.store = SurprisalStore(kv_slots, self.req_to_token.shape[0], self.req_to_token.device)
        # (req_pool_indices, attended fraction per row) of the last decode plan, for the token traces
        self.attended: Optional[tuple[list[int], list[float]]] = None

    def attended_fractions(self, forward_batch) -> Optional[list[float]]:
        """The fractions of the context the rows of this (just run) batch attended; None: all."""
        if self.attended is None or not forward_batch.forward_mode.is_decode():
            return None
        rows, fractions = self.attended
        return fractions if rows == forward_batch.req_pool_indices.tolist() else None

    def plan(self, forward_batch) -> Optional[SparseDecode]:
        """None when this batch attends densely (nothing to prune, or a batch shape we do not prune)."""
        self.store.write_decode_inputs(forward_batch.out_cache_loc, forward_batch.req_pool_indices)
        lens_cpu = forward_batch.seq_lens_cpu
        self.attended = None
        if forward_batch.encoder_lens is not None or forward_batch.spec_info is not None:
            return None
        if lens_cpu.numel() == 0 or int(lens_cpu.max()) < self.cfg.min_context:
            return None
        width = int(lens_cpu.max())
        slots = self.req_to_token[forward_batch.req_pool_indices, :width]
        surprisal = self.store.slot[slots.long()]
        entropies = self.store.entropy[forward_batch.req_pool_indices].tolist()
        plan = plan_decode(surprisal, lens_cpu, entropies, self.cfg, self.reference_entropy)
        share = self.sparse_share
        self.attended = (forward_batch.req_pool_indices.tolist(),
                         [1.0 - share * (1.0 - k / c) if c else 1.0 for k, c in zip(plan.kept_tokens, plan.context_lens)])
        if not plan.prunes:
            return None
        batch = len(plan.kept_tokens)
        counts = torch.tensor(plan.kept_tokens, device=slots.device)
        rows = torch.repeat_interleave(torch.arange(batch, device=slots.device), counts)
        cols = torch.arange(rows.numel(), device=slots.device) - plan.indptr[:-1].to(slots.device)[rows]
        kept = torch.zeros(batch, max(plan.kept_tokens), dtype=slots.dtype, device=slots.device)
        flat = slots[rows, plan.positions.to(slots.device)]
        kept[rows, cols] = flat
        return SparseDecode(plan, flat, kept, torch.arange(batch, device=slots.device), counts)

    def sparse_layer(self, layer) -> bool:
        """Layers that attend the plan: past the dense ones, self-attention without a sliding window."""
        window = getattr(layer, "sliding_window_size", None)
        return (layer.layer_id >= self.cfg.dense_layers and not layer.is_cross_attention
                and (window is None or window < 0))


def torch_native_backend(model_runner, cfg: PruningConfig):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class EntropicTorchNativeAttnBackend(TorchNativeAttnBackend):
        """torch_native with pruned decode (CPU)."""

        def __init__(self, runner):
            super().__init__(runner)
            self.planner = EntropicDecodePlanner(runner, cfg)
            self.sparse: Optional[SparseDecode] = None
            self._sparse_layer = False

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self.planner.attended = None
            self.sparse = self.planner.plan(forward_batch) if forward_batch.forward_mode.is_decode() else None

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            self._sparse_layer = self.sparse is not None and self.planner.sparse_layer(layer)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, *args, **kwargs):
            if self._sparse_layer:  # the stock loop, reading the kept slots of each row
                req_to_token, req_pool_indices, seq_lens = self.sparse.slots, self.sparse.rows, self.sparse.lens
            return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token,
                                                    req_pool_indices, seq_lens, *args, **kwargs)

    return EntropicTorchNativeAttnBackend(model_runner)


def flashinfer_backend(model_runner, cfg: PruningConfig):
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    class EntropicFlashInferAttnBackend(FlashInferAttnBackend):
        """FlashInfer with pruned decode (CUDA, without CUDA graphs: the plan changes every step)."""

        def __init__(self, runner, *args, **kwargs):
            super().__init__(runner, *args, **kwargs)
            self.planner = EntropicDecodePlanner(runner, cfg)
            updater = self.indices_updater_decode
            self.sparse_wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self.workspace_buffer, "NHD", backend=self.decode_backend, use_tensor_cores=self.decode_use_tensor_cores
            )
            self._heads = (updater.num_qo_heads, updater.num_kv_heads, updater.head_dim)
            self.dense_metadata = self.sparse_metadata = None

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self.sparse_metadata = None
            self.planner.attended = None
            if not forward_batch.forward_mode.is_decode() or len(self.decode_wrappers) != 1:
                return  # prefill, and cross-attention / SWA layouts (own wrappers): dense
            sparse = self.planner.plan(forward_batch)
            if sparse is None:
                return
            plan = sparse.plan
            indptr = plan.indptr.to(device="cuda", dtype=torch.int32)
            indices = sparse.flat_slots.to(torch.int32)
            batch = len(plan.kept_tokens)
            num_qo, num_kv, head_dim = self._heads
            self.sparse_wrapper.begin_forward(
                indptr, indices, self.indices_updater_decode.kv_last_page_len[:batch], num_qo, num_kv, head_dim, 1,
                data_type=self.indices_updater_decode.data_type, q_data_type=self.indices_updater_decode.q_data_type,
            )
            self.dense_metadata = self.forward_metadata
            self.sparse_metadata = dataclasses.replace(self.forward_metadata, decode_wrappers=[self.sparse_wrapper])

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if self.sparse_metadata is not None:
                self.forward_metadata = (
                    self.sparse_metadata if self.planner.sparse_layer(layer) else self.dense_metadata
                )
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    if model_runner.use_mla_backend:
        raise ValueError("--attention-backend entropic: MLA models are not supported (their KV layout differs)")
    return EntropicFlashInferAttnBackend(model_runner, init_new_workspace=model_runner.init_new_workspace)


def create_backend(model_runner, cfg: PruningConfig):
    """`--attention-backend entropic`: FlashInfer on CUDA, torch_native elsewhere."""
    if str(model_runner.device).startswith("cuda"):
        return flashinfer_backend(model_runner, cfg)
    return torch_native_backend(model_runner, cfg)
