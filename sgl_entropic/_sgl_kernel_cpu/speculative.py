"""Speculative-decoding ops of sgl_kernel's CPU build, in torch (served as `sgl_kernel.speculative`; the
`*_cpu` names are re-exported by the stand-in's top level, where SGLang imports them).

Each op follows the contract of the call site in SGLang 0.5.23 (`sglang/kernels/ops/speculative/`), which
documents its Triton twin for other devices; tensors are modified in place, as there. Trees are tiny (a
request has at most `speculative_num_draft_tokens` nodes), so the tree walks loop in Python over host
lists; everything else is one vectorised torch expression.
"""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM's verify metadata from its tree mask (`reconstruct_tree.py`'s contract).

    `tree_mask[b, i, j]` (flat, row-major) marks node j as an ancestor of node i (the diagonal is set).
    positions[b, i] = #strict ancestors of i + verified_seq_len[b]; retrieve_index[b, i] = b * n + i;
    retrieve_next_token[b, t] = t's first child (the smallest k > t with t among k's ancestors), else -1;
    retrieve_next_sibling[b, t] = the smallest k > t with k's parent = t's parent, else -1 (and -1 for a
    node without a parent), the parent being the largest strict ancestor.
    """
    bs, n = batch_size, draft_token_num
    device = retrieve_index.device
    mask = tree_mask.reshape(bs, n, n).to(device=device, dtype=torch.bool)
    node = torch.arange(n, device=device)
    ancestors = mask & (node[None, :] < node[:, None])[None]  # [b, i, j]: j a strict ancestor of i
    positions.view(bs, n).copy_(ancestors.sum(-1) + verified_seq_len.to(device).view(bs, 1))
    retrieve_index.view(bs, n).copy_(torch.arange(bs, device=device)[:, None] * n + node)
    parent = torch.where(ancestors, node, -1).amax(-1)  # [b, i]
    first_child = torch.where(ancestors, node[None, :, None], n).amin(1)  # over i, for each column t
    retrieve_next_token.view(bs, n).copy_(torch.where(first_child < n, first_child, -1))
    same_parent = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])  # [b, k, t]
    sibling = torch.where(same_parent, node[None, :, None], n).amin(1)
    retrieve_next_sibling.view(bs, n).copy_(torch.where((parent >= 0) & (sibling < n), sibling, -1))


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy tree verification (`spec_tree.verify_tree_greedy_kernel_triton`'s contract).

    From each request's root, follow the child (then its siblings, in list order) whose draft token equals
    the target's argmax at the current node; stop at the first node with no such child. predicts[flat node]
    gets the target's token at every accepted node, accept_index[b] the accepted nodes' flat indices from
    the root on (untouched beyond them), accept_token_num[b] the number of accepted drafts.
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(bs, n).tolist()
    flat_pred, flat_accept, counts = {}, [], []
    for b in range(bs):
        last = index[b][0]
        accepted = [last]
        node = 0
        for _ in range(1, steps):
            token = target[last // n][last % n]
            child = next_token[b][node]
            while child != -1 and cand[b][child] != token:
                child = next_sibling[b][child]
            if child == -1:
                break
            flat_pred[last] = token
            last, node = index[b][child], child
            accepted.append(last)
        flat_pred[last] = target[last // n][last % n]
        flat_accept.append(accepted)
        counts.append(len(accepted) - 1)
    for b, accepted in enumerate(flat_accept):
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
    where = torch.tensor(list(flat_pred), dtype=torch.long)
    predicts.view(-1)[where] = torch.tensor(list(flat_pred.values()), dtype=predicts.dtype)
    accept_token_num.copy_(torch.tensor(counts, dtype=accept_token_num.dtype))


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """EAGLE's verify tree from its draft steps' top-k choices (`spec_tree.sgl_build_tree_kernel_efficient_triton`).

    Node i > 0 is the draft token `selected_index[b, i - 1]`; its parent is the node whose selected index
    equals `parent_list[b, selected_index[b, i - 1] // topk]`, or the root when that quotient is 0.
    tree_mask gets each node's ancestors and itself, positions the root's seq_len plus the node's depth; the
    retrieve lists link first children and next siblings (a later node first, as the kernel's reverse scan
    leaves them). Mode 0 writes the FULL mask (each node's row spans seq_len + n columns; the prefix columns
    stay as the caller set them), modes 1 and 2 the QLEN_ONLY mask (n columns per node).
    """
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError(f"tree_mask_mode {tree_mask_mode} (bit packing) is not served on CPU")
    bs, n = verified_seq_len.shape[0], draft_token_num
    seq_lens = verified_seq_len.tolist()
    parents, selected = parent_list.reshape(bs, -1).tolist(), selected_index.reshape(bs, -1).tolist()
    mask = tree_mask.view(-1)
    prefix = 0
    for b in range(bs):
        seq_len, sel, par = seq_lens[b], selected[b], parents[b]

        def parent_node(i: int) -> int:
            """Node i's parent (0: the root), -1 when its parent was not selected."""
            q = sel[i - 1] // topk
            return 0 if q == 0 else next((p + 1 for p in range(n - 1) if sel[p] == par[q]), -1)

        next_token, next_sibling = [-1] * n, [-1] * n
        for i in range(n - 1, 0, -1):
            p = parent_node(i)
            if p >= 0:
                next_sibling[i], next_token[p] = next_token[p], i
        for i in range(n):
            row = prefix * n + b * n * n + (seq_len + n) * i + seq_len if tree_mask_mode == 0 else b * n * n + n * i
            mask[row : row + n] = False
            mask[row] = True
            node, level = i, 0
            while node > 0 and level < depth:
                mask[row + node] = True
                level += 1
                node = parent_node(node)
            positions[b * n + i] = seq_len + level
        retrive_index.view(bs, n)[b] = torch.arange(b * n, (b + 1) * n)
        retrive_next_token.view(bs, n)[b] = torch.tensor(next_token)
        retrive_next_sibling.view(bs, n)[b] = torch.tensor(next_sibling)
        prefix += seq_len


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Pack out_cache_loc[accept_index] for the accepted entries (not -1) of the flat accept_index, in order."""
    flat = accept_index.reshape(-1).long()
    kept = flat[flat != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """bonus_tokens[b] = the last accepted token of request b (accept_lens counts the bonus)."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    bonus_tokens.copy_(accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1])


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len: int
) -> None:
    """out_cache_loc = the requests' req_to_token[row, start:end] slices, packed in request order."""
    del pool_len  # the row length is req_to_token's
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[offset : offset + end - start] = req_to_token[row, start:end].to(out_cache_loc.dtype)
        offset += end - start


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len: int, topk: int, num_cols: int
) -> None:
    """Each request's topk * num_cols slots from its seq_len on, at out_cache_loc[b * topk * num_cols:]."""
    width = topk * num_cols
    ends = seq_lens + width
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, seq_lens, ends, out_cache_loc, pool_len)
