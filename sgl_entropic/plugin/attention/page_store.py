"""What the meso loop keeps beside SGLang's KV pool, written as the KV is written.

Per KV page, layer and KV head: the element-wise min and max of its keys (the "quest" bound's
metadata, 2 vectors per page: 1/8 of the K bytes at 16 tokens a page), for the layers that attend the
whole context only (a sliding-window layer attends its window as SGLang does and needs none). Per KV
slot, for the "surprisal" selector only: the token's surprisal. Both are indexed like the pool itself, so a
RadixAttention prefix shared by a later request brings them along.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sgl_entropic.transfer import to_device


class PageStore:
    def __init__(
        self,
        layer_ids: Sequence[int],
        kv_slots: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
        num_req_slots: int,
        with_surprisal: bool,
    ):
        self.page_size = page_size
        self.layer_ids = list(layer_ids)
        self._row = {layer_id: i for i, layer_id in enumerate(self.layer_ids)}
        pages = -(-kv_slots // page_size)
        self.scratch = pages  # one extra page row, the target of writes that must go nowhere
        shape = (len(self.layer_ids), pages + 1, kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_surprisal = self.next_surprisal = None
        if with_surprisal:
            # NaN: unknown, so its page is always kept (a prompt's first token, a cached prefix's edge)
            self.slot_surprisal = torch.full((kv_slots,), math.nan, dtype=torch.float32, device=device)
            # written when a request samples, read when that token enters the KV cache next step
            self.next_surprisal = torch.full((num_req_slots,), math.nan, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        """What the store holds beside the KV pool (taken out of its budget: around_config_from_budget)."""
        extra = [t for t in (self.slot_surprisal, self.next_surprisal) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.kmin, self.kmax, *extra))

    def bounds(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's per-page key min and max, [pages + 1, kv_heads, head_dim] each."""
        row = self._row[layer_id]
        return self.kmin[row], self.kmax[row]

    def write_keys(self, layer_id: int, locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold the keys just written at KV slots `locs` into their pages' min and max.

        A page's first token (slot offset 0) restarts its min/max: pages are allocated to one
        request and filled from offset 0, so that token is the first write of the page's new
        content. No host sync: restarts are written through a scratch row, not a masked index.
        """
        if locs.numel() == 0:
            return
        locs = locs.to(self.kmin.device).long()
        keys = keys.to(self.kmin.dtype)
        pages = locs // self.page_size
        restart = torch.where(locs % self.page_size == 0, pages, self.scratch)
        index = pages[:, None, None].expand_as(keys)
        for table, reduce in zip(self.bounds(layer_id), ("amin", "amax")):
            table.index_copy_(0, restart, keys)
            table.scatter_reduce_(0, index, keys, reduce, include_self=True)

    def record_sampled(self, req_pool_indices: torch.Tensor, produces: list[bool], stats) -> None:
        """surprisal selector: the sampled token's surprisal scores its KV slot at the next step."""
        if self.next_surprisal is None:
            return
        rows = [i for i, p in enumerate(produces) if p]  # a middle prefill chunk's token is thrown away
        if not rows:
            return
        idx = to_device(rows, stats.surprisal.device)  # through pinned memory, without blocking
        slots = req_pool_indices.to(self.next_surprisal.device)[idx.to(self.next_surprisal.device)]
        value = torch.where(stats.valid[idx], stats.surprisal[idx].float(), math.nan)
        self.next_surprisal[slots] = value.to(self.next_surprisal.device)

    def write_decode_inputs(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """surprisal selector: the token a decode step feeds in was sampled last step."""
        if self.slot_surprisal is not None:
            self.slot_surprisal[out_cache_loc] = self.next_surprisal[req_pool_indices]

    def record_prompt(self, processor, hidden_states: torch.Tensor, lm_head, forward_batch) -> None:
        """surprisal selector: -ln p(x_i | x_<i) of the extend tokens under the model's own logits.

        Token i of a request's extend segment is scored from the logits at i - 1; the segment's
        first token has no predecessor in this forward and stays NaN (always kept).
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
        self.slot_surprisal[slots] = surprisal.to(self.slot_surprisal.device)


# Rows of prompt logits computed at once when scoring a prefill (bounds the [rows, vocab] buffer).
_PROMPT_LOGITS_ROWS = 512


def reads_whole_context(layer) -> bool:
    """Self-attention without a sliding window: the layers that prune and hold page bounds."""
    window = getattr(layer, "sliding_window_size", None)
    return not layer.is_cross_attention and (window is None or window < 0)


def full_context_layers(model) -> tuple[list[int], int]:
    """The ids of the model's attention layers that read the whole context, and how many layers attend."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = {m.layer_id: m for m in model.modules() if isinstance(m, RadixAttention)}
    return sorted(i for i, m in layers.items() if reads_whole_context(m)), len(layers)


def store_share(page_size: int, full_layer_share: float = 1.0) -> float:
    """The page store's bytes per KV-pool byte: key min and max per page (2 vectors) against K and V
    per token (2 vectors a token), so 1 / page_size, for the share of layers that hold bounds."""
    return full_layer_share / page_size


def around_config_from_budget(original, configurator, budget_bytes, *args, **kwargs):
    """The KV pool is sized from a memory budget: the page store comes out of the same budget, so the
    pool shrinks by the store's bytes (an explicit --max-total-tokens below the budget still stands)."""
    from sgl_entropic.plugin import runtime

    model = getattr(configurator, "model", None)
    full, total = full_context_layers(model) if model is not None else ([], 0)
    share = store_share(runtime.current().config.pruning.page_size, len(full) / total if total else 1.0)
    return original(configurator, int(budget_bytes / (1.0 + share)), *args, **kwargs)
