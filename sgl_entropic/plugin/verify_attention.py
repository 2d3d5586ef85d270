"""The verify forward of speculative decoding (ForwardMode.TARGET_VERIFY) on CPU, which SGLang's torch_native
backend lacks: each request's draft tree attends its whole prefix plus, per node, the node's tree ancestors
and itself (`spec_info.custom_mask`, [bs, W, W] per request, as SGLang's CPU NGRAM path builds it).

One SDPA call per layer for the whole batch, the rows padded to the longest context and masked, where
torch_native's extend loops over requests. A chain (breadth 1) is the lower-triangular case of the mask.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention


def tree_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          prefix: torch.Tensor, tree: torch.Tensor, positions: torch.Tensor, scale: float,
                          window: Optional[int] = None) -> torch.Tensor:
    """Attention of `q` [bs * W, Hq, d] (W draft nodes per row) over each row's KV slots.

    slots [bs, L]: row b's KV slots by position, its prefix then its W nodes (entries past prefix[b] + W are
    ignored); prefix [bs] the committed lengths; tree [bs, W, W] node i sees node j; positions [bs, W] the
    nodes' positions; window: a sliding window (keys more than `window` positions behind the query are
    masked, as SGLang's torch_native does). Returns [bs * W, Hq, d].
    """
    bs, width = tree.shape[:2]
    length = slots.shape[1]
    heads_q, dim = q.shape[1], q.shape[2]
    column = torch.arange(length, device=slots.device)
    visible = (column[None, :] < prefix[:, None])[:, None, :].expand(bs, width, length).clone()
    draft_columns = prefix[:, None] + torch.arange(width, device=slots.device)  # [bs, W]
    visible.scatter_(2, draft_columns[:, None, :].expand(bs, width, width), tree.bool())
    if window is not None and window > -1:
        key_pos = column[None, :].expand(bs, length).clone()
        key_pos.scatter_(1, draft_columns, positions.to(key_pos.dtype))
        visible &= key_pos[:, None, :] >= positions[:, :, None] - window
    k = k_cache[slots].transpose(1, 2)  # [bs, Hkv, L, d]
    v = v_cache[slots].transpose(1, 2)
    query = q.view(bs, width, heads_q, dim).transpose(1, 2)  # [bs, Hq, W, d]
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    out = scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None], scale=scale,
                                       enable_gqa=heads_q != k.shape[1])
    return out.transpose(1, 2).reshape(bs * width, heads_q, v.shape[-1])


class TreeVerifyAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch_native backend plus the TARGET_VERIFY forward (`--attention-backend entropic` without
    pruning; the pruning backend derives from it)."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention:
            raise NotImplementedError("speculative verification with cross-attention layers")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        spec = forward_batch.spec_info
        width = spec.draft_token_num
        bs = forward_batch.batch_size
        prefix = forward_batch.seq_lens.long()
        length = int(forward_batch.seq_lens_cpu.max()) + width
        slots = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :length].long()
        window = layer.sliding_window_size if layer.sliding_window_size is not None else None
        out = tree_verify_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            slots, prefix, spec.custom_mask.view(bs, width, width), spec.positions.view(bs, width), layer.scaling,
            window)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
