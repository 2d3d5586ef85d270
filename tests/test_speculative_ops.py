"""The stand-in's speculative-decoding ops (sgl_entropic/_sgl_kernel_cpu/speculative.py) against plain-Python
references written from SGLang's documented contracts, on random trees, and against SGLang's own Triton
versions of them (run under the Triton interpreter)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from sgl_entropic._sgl_kernel_cpu import speculative as ops


def random_tree(rng: random.Random, n: int) -> list[int]:
    """parent[i] < i for every node i > 0 (as NGRAM's BFS and EAGLE's trees order them); parent[0] = -1."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def ancestors_mask(parent: list[int]) -> list[list[int]]:
    n = len(parent)
    mask = [[0] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = 1
            j = parent[j]
    return mask


def children(parent: list[int], node: int) -> list[int]:
    return [k for k in range(len(parent)) if parent[k] == node]


@pytest.mark.parametrize("seed", range(20))
def test_reconstruct_indices_from_tree_mask_matches_the_tree(seed):
    rng = random.Random(seed)
    bs, n = rng.randint(1, 5), rng.randint(1, 12)
    trees = [random_tree(rng, n) for _ in range(bs)]
    seq_lens = [rng.randint(1, 500) for _ in range(bs)]
    mask = torch.tensor([ancestors_mask(t) for t in trees], dtype=torch.bool).flatten()
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, next_token, next_sibling = (torch.empty(bs, n, dtype=torch.int64) for _ in range(3))
    ops.reconstruct_indices_from_tree_mask(
        mask, torch.tensor(seq_lens), positions, index, next_token, next_sibling, bs, n
    )
    for b, parent in enumerate(trees):
        for i in range(n):
            depth, j = 0, parent[i]
            while j >= 0:
                depth, j = depth + 1, parent[j]
            assert positions[b * n + i] == seq_lens[b] + depth
            assert index[b, i] == b * n + i
            kids = children(parent, i)
            assert next_token[b, i] == (kids[0] if kids else -1)
            later = [k for k in children(parent, parent[i]) if k > i] if parent[i] >= 0 else []
            assert next_sibling[b, i] == (later[0] if later else -1)


def reference_greedy(parent, tokens, target, root_flat):
    """Walk from the root: accept the first child (lowest index) whose token is the target's at this node."""
    node, accepted, predicts = 0, [root_flat], {}
    while True:
        token = target[node]
        match = next((k for k in children(parent, node) if tokens[k] == token), None)
        predicts[root_flat + node] = token
        if match is None:
            return accepted, predicts
        node = match
        accepted.append(root_flat + node)


@pytest.mark.parametrize("seed", range(30))
def test_verify_tree_greedy_accepts_the_path_of_target_tokens(seed):
    rng = random.Random(seed)
    bs, n = rng.randint(1, 4), rng.randint(1, 10)
    vocab = rng.choice([2, 3, 50])  # a small vocabulary makes long accepted paths likely
    trees = [random_tree(rng, n) for _ in range(bs)]
    tokens = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
    target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
    mask = torch.tensor([ancestors_mask(t) for t in trees], dtype=torch.bool).flatten()
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, next_token, next_sibling = (torch.empty(bs, n, dtype=torch.int64) for _ in range(3))
    ops.reconstruct_indices_from_tree_mask(
        mask, torch.zeros(bs, dtype=torch.int64), positions, index, next_token, next_sibling, bs, n
    )
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(
        predicts, accept_index, accept_num, torch.tensor(tokens), index, next_token, next_sibling, torch.tensor(target)
    )
    expected_predicts = [0] * (bs * n)
    for b in range(bs):
        accepted, pred = reference_greedy(trees[b], tokens[b], target[b], b * n)
        assert accept_num[b] == len(accepted) - 1
        assert accept_index[b].tolist() == accepted + [-1] * (n - len(accepted))
        for flat, token in pred.items():
            expected_predicts[flat] = token
    assert predicts.tolist() == expected_predicts


def test_the_accept_and_bonus_helpers_pack_the_accepted_run():
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1], [6, 8, 7]])
    out_cache_loc = torch.arange(100, 109)
    packed = torch.full((9,), -7)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, packed)
    assert packed.tolist() == [100, 101, 103, 106, 108, 107, -7, -7, -7]
    accept_tokens = torch.tensor([5, 6, 0, 7, 0, 0, 8, 9, 10])
    bonus = torch.empty(3, dtype=torch.long)
    ops.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 1, 3]), bonus, 3)
    assert bonus.tolist() == [6, 7, 10]


@pytest.mark.parametrize("seed", range(5))
def test_cache_loc_ops_copy_each_request_s_slice(seed):
    rng = random.Random(seed)
    bs, width = rng.randint(1, 6), 40
    req_to_token = torch.randint(0, 10_000, (8, width), dtype=torch.int32)
    rows = rng.sample(range(8), bs)
    starts = [rng.randint(0, 20) for _ in rows]
    ends = [s + rng.randint(0, 10) for s in starts]
    out = torch.empty(sum(e - s for s, e in zip(starts, ends)), dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(
        torch.tensor(rows), req_to_token, torch.tensor(starts), torch.tensor(ends), out, width
    )
    expected = [int(req_to_token[r, i]) for r, s, e in zip(rows, starts, ends) for i in range(s, e)]
    assert out.tolist() == expected
    topk, cols = 2, 3
    draft = torch.empty(bs * topk * cols, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor(rows), req_to_token, torch.tensor(starts), draft, width, topk, cols
    )
    assert draft.tolist() == [int(req_to_token[r, s + i]) for r, s in zip(rows, starts) for i in range(topk * cols)]


def eagle_case(rng: random.Random):
    """EAGLE's draft steps as it hands them over: topk candidates at step 0, topk * topk per later step;
    `selected` picks n - 1 of them (sorted), parent_list[q] names the candidate whose children form block q."""
    topk, depth = rng.randint(1, 3), rng.randint(1, 4)
    total = topk + (depth - 1) * topk * topk
    n, bs = rng.randint(2, min(8, total) + 1), rng.randint(1, 3)
    selected = torch.tensor([sorted(rng.sample(range(total), n - 1)) for _ in range(bs)])
    parent_list = torch.tensor([[-1] + [rng.randrange(total) for _ in range(total // topk)] for _ in range(bs)])
    return selected, parent_list, torch.tensor([rng.randint(1, 6) for _ in range(bs)]), topk, depth, n


def test_the_tree_ops_equal_sglang_s_triton_kernels():
    """SGLang's own Triton versions of the tree ops (its XPU path) are the contract; on CPU they run under the
    Triton interpreter, which must be switched on before triton is imported: this file runs as a script."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "checked 24 cases" in out.stdout


def _against_triton() -> int:
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton
    from sglang.kernels.ops.speculative.spec_tree import (
        TreeMaskMode,
        sgl_build_tree_kernel_triton,
        verify_tree_greedy_triton,
    )

    cases = 0
    for seed in range(8):
        rng = random.Random(seed)
        selected, parent_list, seq_lens, topk, depth, n = eagle_case(rng)
        bs = seq_lens.numel()
        for mode in (0, 1):
            size = int(sum(s * n + n * n for s in seq_lens.tolist())) if mode == 0 else bs * n * n
            outs = []
            for build, m in (
                (sgl_build_tree_kernel_triton, TreeMaskMode(mode)),
                (ops.build_tree_kernel_efficient_cpu, mode),
            ):
                mask, positions = torch.full((size,), True), torch.empty(bs * n, dtype=torch.int64)
                links = [torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3)]
                build(parent_list, selected, seq_lens, mask, positions, *links, topk, depth, n, m)
                outs.append([mask, positions, *links])
            assert all(torch.equal(a, b) for a, b in zip(*outs)), (seed, mode)
            cases += 1
        # NGRAM's trees: metadata from the mask, then greedy verification, both ways
        bs, n, vocab = rng.randint(1, 4), rng.randint(1, 10), rng.choice([2, 3, 50])
        mask = torch.tensor([ancestors_mask(random_tree(rng, n)) for _ in range(bs)], dtype=torch.bool).flatten()
        candidates = torch.randint(0, vocab, (bs, n))
        target = torch.randint(0, vocab, (bs, n))
        outs = []
        for reconstruct, verify in (
            (reconstruct_indices_from_tree_mask_triton, verify_tree_greedy_triton),
            (ops.reconstruct_indices_from_tree_mask, ops.verify_tree_greedy_cpu),
        ):
            positions = torch.empty(bs * n, dtype=torch.int64)
            index, first, sibling = (torch.empty(bs, n, dtype=torch.int64) for _ in range(3))
            reconstruct(mask, torch.arange(bs, dtype=torch.int64) * 7, positions, index, first, sibling, bs, n)
            predicts = torch.zeros(bs * n, dtype=torch.int64)
            accept_index = torch.full((bs, n), -1, dtype=torch.int64)
            accept_num = torch.zeros(bs, dtype=torch.int64)
            verify(predicts, accept_index, accept_num, candidates, index, first, sibling, target)
            outs.append([positions, index, first, sibling, predicts, accept_index, accept_num])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), seed
        cases += 1
    return cases


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
    print(f"checked {_against_triton()} cases")


@pytest.mark.parametrize("seed", range(6))
def test_the_verify_forward_attends_each_node_s_prefix_and_tree_ancestors(seed):
    """The CPU verify attention (plugin/attention/verify_attention.py) against plain math per node: softmax over the row's
    prefix keys and the node's ancestors (and itself) only, at uneven prefix lengths, scattered KV slots, random
    trees, GQA, with and without a sliding window."""
    from sgl_entropic.plugin.attention.verify_attention import tree_verify_attention, verify_rows
    from sgl_entropic.pruning import sparse_decode_attention

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, width, heads_q, heads_kv, dim = 3, 5, 6, 2, 8
    prefix = [rng.randrange(1, 40) for _ in range(bs)]
    parents = [random_tree(rng, width) for _ in range(bs)]
    tree = torch.tensor([ancestors_mask(p) for p in parents], dtype=torch.bool)
    depth = [
        [len([1 for j in range(width) if m[i][j]]) - 1 for i in range(width)]
        for m in (ancestors_mask(p) for p in parents)
    ]
    positions = torch.tensor([[n + d for d in depth[b]] for b, n in enumerate(prefix)])
    pool = 2 * bs * (max(prefix) + width) + 10
    k_cache, v_cache = torch.randn(pool, heads_kv, dim, generator=gen), torch.randn(pool, heads_kv, dim, generator=gen)
    req_to_token = torch.randperm(pool, generator=gen)[: 2 * bs * (max(prefix) + width)].view(2 * bs, -1)
    pool_rows = torch.tensor([2 * b + 1 for b in range(bs)])  # not the batch's own order
    q = torch.randn(bs * width, heads_q, dim, generator=gen)
    rows = verify_rows(req_to_token.int(), pool_rows, prefix, tree, positions)
    for window in (None, 6):
        got = tree_verify_attention(q, k_cache, v_cache, rows, 0.3, window)
        for b, n in enumerate(prefix):
            slots = req_to_token[pool_rows[b], : n + width]
            for i in range(width):
                keys = list(range(n)) + [n + j for j in range(width) if parents_see(parents[b], i, j)]
                key_pos = list(range(n)) + positions[b].tolist()
                if window is not None:
                    keys = [c for c in keys if key_pos[c] >= int(positions[b, i]) - window]
                want = sparse_decode_attention(
                    q[b * width + i], k_cache[slots], v_cache[slots], torch.tensor(keys), scale=0.3
                )
                torch.testing.assert_close(got[b * width + i], want, rtol=1e-5, atol=1e-5)


def parents_see(parent: list[int], node: int, key: int) -> bool:
    """Whether `key` is `node` or one of its ancestors."""
    while node >= 0:
        if node == key:
            return True
        node = parent[node]
    return False
