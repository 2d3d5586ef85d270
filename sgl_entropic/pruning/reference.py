"""The plain-math reference the kernels must equal."""

from __future__ import annotations

import math
from typing import Optional

import torch


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept_token_idx: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """The plain-math reference: one decode query attending only the kept tokens, `[H_q, D_v]`.

    q `[H_q, D]`, k `[T, H_kv, D]`, v `[T, H_kv, D_v]`; query head h reads KV head
    h // (H_q / H_kv). kept_token_idx: int positions in [0, T) (None: all, i.e. dense); scale
    defaults to 1 / sqrt(D). Computed in float32, returned in q's dtype; exactly
    softmax(q K_S^T * scale) V_S over the kept set S.
    """
    if q.dim() != 2 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"want q [H_q, D], k [T, H_kv, D], v [T, H_kv, D_v]; got {q.shape}, {k.shape}, {v.shape}")
    heads_q, dim = q.shape
    length, heads_kv, dim_k = k.shape
    if dim_k != dim or v.shape[:2] != k.shape[:2] or heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kept_token_idx is not None:
        idx = kept_token_idx.to(device=k.device, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= length):
            raise ValueError(f"kept_token_idx must lie in [0, {length})")
        k, v = k.index_select(0, idx), v.index_select(0, idx)
    if k.shape[0] == 0:
        raise ValueError("no token to attend (the recent guard keeps at least one)")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = heads_q // heads_kv
    qg = q.float().view(heads_kv, group, dim)
    logits = torch.einsum("hgd,thd->hgt", qg, k.float()) * scale
    out = torch.einsum("hgt,the->hge", torch.softmax(logits, dim=-1), v.float())
    return out.reshape(heads_q, v.shape[-1]).to(q.dtype)
