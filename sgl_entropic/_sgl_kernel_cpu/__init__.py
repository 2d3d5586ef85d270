"""Pure-torch stand-in for `sgl_kernel`, served only where the real one cannot be found (CPU).

SGLang's CPU path imports a few `*_cpu` ops from `sgl_kernel` at module import time; the CPU
build of sgl_kernel is compiled from source only. A dense Llama model on CPU calls just
`assign_req_to_token_pool_cpu`; NGRAM speculative decoding calls `copy_all_layer_kv_cache_cpu` and
the ops of `speculative.py` (also served as `sgl_kernel.speculative`). No other name exists here (a
CPU server with and without NGRAM asks for none): `from sgl_kernel import x` raises ImportError and
`hasattr` answers False, so SGLang's own fallbacks run.
"""

import ctypes

import torch

from .speculative import (  # noqa: F401  (SGLang imports these from the top level)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the request's consecutive slice of out_cache_loc."""
    del pool_len  # the row length is implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Every KV buffer's slot tgt_loc[i] = its slot src_loc[i] (speculative decoding moves accepted drafts' KV).

    The buffers come as raw addresses with their slot strides in bytes (`MHATokenToKVPool.data_ptrs`); each is
    viewed in place as bytes up to the highest slot touched. Sources are read before any target is written,
    as the tiled Triton copy does.
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    slots = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        buffer[tgt] = buffer[src]
