"""The verify forward of speculative decoding (ForwardMode.TARGET_VERIFY) on CPU, which SGLang's torch_native
backend lacks: each request's draft tree attends its whole prefix plus, per node, the node's tree ancestors
and itself (`spec_info.custom_mask`, [bs, W, W] per request, as SGLang's CPU NGRAM path builds it).

A chain (breadth 1) is the lower-triangular case of the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class VerifyRows:
    """One verify step's keys and masks per row, built once for all layers (`verify_rows`)."""

    slots: list[torch.Tensor]  # row b: its KV slots by position, its prefix then its W nodes
    visible: list[torch.Tensor]  # row b: [W, prefix + W], node i sees key j
    key_positions: list[torch.Tensor]  # row b: each key's position (a node's is its depth past the prefix)
    node_positions: torch.Tensor  # [bs, W]
    windowed: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    def masks(self, window: Optional[int], group: int) -> list[torch.Tensor]:
        """The rows' masks for `group` query heads a KV head (rows g * W + i: head g's node i), under a sliding
        window (keys more than `window` positions behind the query are masked, as SGLang's torch_native does;
        None or -1: none)."""
        key = (-1 if window is None or window < 0 else window, group)
        if key not in self.windowed:
            masks = (
                self.visible
                if key[0] < 0
                else [
                    v & (k[None, :] >= p[:, None] - window)
                    for v, k, p in zip(self.visible, self.key_positions, self.node_positions)
                ]
            )
            self.windowed[key] = [m.repeat(group, 1) for m in masks]
        return self.windowed[key]


def verify_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix: Sequence[int],
    tree: torch.Tensor,
    positions: torch.Tensor,
) -> VerifyRows:
    """prefix: the rows' committed lengths (host ints); tree [bs, W, W] node i sees node j; positions [bs, W]."""
    width = tree.shape[1]
    table = req_to_token[:, : max(prefix) + width].index_select(0, req_pool_indices).long()
    slots, visible, key_pos = [], [], []
    for b, n in enumerate(prefix):
        slots.append(table[b, : n + width])
        mask = torch.ones(width, n + width, dtype=torch.bool, device=tree.device)
        mask[:, n:] = tree[b]
        visible.append(mask)
        key_pos.append(torch.cat([torch.arange(n, device=tree.device), positions[b].long()]))
    return VerifyRows(slots, visible, key_pos, positions.long())


def tree_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: VerifyRows,
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Attention of `q` [bs * W, Hq, d] (W draft nodes per row) over each row's prefix and tree ancestors.

    One SDPA call per row over exactly its own keys (padding the rows to the longest, one call for the batch,
    was 2-3x slower on this CPU at the uneven lengths of a real batch), each KV head's query heads folded into
    the query length: torch's CPU SDPA in bf16 took 5-7x longer for the few queries a verify has per head.
    Returns [bs * W, Hq, d_v].
    """
    bs, width = rows.node_positions.shape
    heads_q, dim = q.shape[1], q.shape[2]
    heads_kv = k_cache.shape[1]
    group = heads_q // heads_kv
    query = q.view(bs, width, heads_kv, group, dim).permute(0, 2, 3, 1, 4).reshape(bs, heads_kv, group * width, dim)
    out = q.new_empty(bs, width, heads_q, v_cache.shape[-1])
    for b, (slots, visible) in enumerate(zip(rows.slots, rows.masks(window, group))):
        k = k_cache.index_select(0, slots).transpose(0, 1)  # [Hkv, n + W, d]
        v = v_cache.index_select(0, slots).transpose(0, 1)
        if k.dtype != query.dtype:
            k, v = k.to(query.dtype), v.to(query.dtype)
        o = scaled_dot_product_attention(query[b], k, v, attn_mask=visible, scale=scale)  # [Hkv, G * W, d_v]
        out[b] = o.view(heads_kv, group, width, -1).permute(2, 0, 1, 3).reshape(width, heads_q, -1)
    return out.view(bs * width, heads_q, -1)


class TreeVerifyAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch_native backend plus the TARGET_VERIFY forward (`--attention-backend entropic` without
    pruning; the pruning backend derives from it)."""

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._verify = None
        if forward_batch.forward_mode.is_target_verify():
            spec, bs = forward_batch.spec_info, forward_batch.batch_size
            width = spec.draft_token_num
            self._verify = verify_rows(
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens_cpu.tolist(),  # a host tensor: no device read
                spec.custom_mask.view(bs, width, width),
                spec.positions.view(bs, width),
            )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention:
            raise NotImplementedError("speculative verification with cross-attention layers")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        out = tree_verify_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self._verify,
            layer.scaling,
            layer.sliding_window_size,
        )
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
