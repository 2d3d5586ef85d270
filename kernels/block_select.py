"""Triton kernel of the meso loop: block scores and the kept-block mask, one program per request.

Must equal: sgl_entropic.pruning.block_select_reference (bit for bit with aggregate="max";
with "mean"/"sum" the scores agree up to fp32 summation order and the mask equals
sgl_entropic.pruning.select_blocks_batched of the kernel's own scores, exactly).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_entropic.pruning import AGGREGATES, DEFAULT_AGGREGATE, num_blocks

# Score tile: BLOCK_NB blocks x BLOCK_P tokens per loop iteration, kept within registers.
_MAX_TILE = 4096
# Blocks per iteration of the selection passes.
_MAX_BLOCK_SEL = 1024
# The order-preserving key of +inf (see _order_key): the largest key of a canonical score.
_POS_INF_KEY = 0x7F800000 + 2**31


@triton.jit
def _order_key(score):
    """Map float32 to int64 in [0, 2^32) with the same order (no NaN or -0.0 in input).

    Non-negative floats keep their bits; negative ones get their magnitude bits flipped, so
    larger magnitudes sort lower; + 2^31 moves the signed int32 range to non-negatives.
    """
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _block_select_kernel(
    surprisal_ptr,
    row_stride,
    lengths_ptr,
    keep_ptr,
    scores_ptr,
    kept_ptr,
    n_blocks_max,
    page_size,
    sink,
    recent,
    AGGREGATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_SEL: tl.constexpr,
):
    """Phase 1 writes the row's block scores; phase 2 finds theta by bisection on the keys.

    theta's key is the largest t with #{candidates with key >= t} >= k, i.e. the k-th largest
    candidate key, built bit by bit from the top (32 counting passes over the row's scores).
    Keys are exact integers, so ties at theta are all kept and the result is deterministic.
    """
    row = tl.program_id(0)
    in_row_ptr = surprisal_ptr + row.to(tl.int64) * row_stride
    out_row = row.to(tl.int64) * n_blocks_max
    length = tl.load(lengths_ptr + row)
    n = (length + page_size - 1) // page_size
    k = tl.load(keep_ptr + row)

    # Phase 1: scores. Non-finite surprisal -> +inf, -0.0 -> +0.0; blocks past n -> -inf.
    blocks = tl.arange(0, BLOCK_NB)
    token_in_page = tl.arange(0, BLOCK_P)
    for start in range(0, n_blocks_max, BLOCK_NB):
        b = start + blocks
        token = b[:, None] * page_size + token_in_page[None, :]
        valid = (token_in_page[None, :] < page_size) & (token < length)
        x = tl.load(in_row_ptr + token, mask=valid, other=0.0).to(tl.float32)
        finite = (x == x) & (x != float("inf")) & (x != -float("inf"))
        x = tl.where(finite, x, float("inf"))
        count = tl.sum(valid.to(tl.int32), axis=1)
        if AGGREGATE == 0:
            score = tl.max(tl.where(valid, x, -float("inf")), axis=1)
        else:
            total = tl.sum(tl.where(valid, x, 0.0), axis=1)
            if AGGREGATE == 1:
                score = total / tl.maximum(count, 1).to(tl.float32)
            else:
                score = total
        score = tl.where(count > 0, score, -float("inf"))
        score = tl.where(score.to(tl.int32, bitcast=True) == -2147483648, 0.0, score)
        tl.store(scores_ptr + out_row + b, score, mask=b < n_blocks_max)

    # Make this program's score stores visible to all its threads before reading them back.
    tl.debug_barrier()

    # Phase 2: theta. Candidates are sink <= j < n - recent; keys of NaN-free scores.
    sel = tl.arange(0, BLOCK_SEL)
    candidates = tl.maximum(n - sink - recent, 0)
    # 0 <= k < m needs the search; k >= m keeps all (theta key 0), k <= 0 only +inf.
    searching = (k > 0) & (k < candidates)
    passes = tl.where(searching, 32, 0)
    theta = (k <= 0).to(tl.int64) * 4286578688  # _POS_INF_KEY: k <= 0 keeps +inf only
    step = tl.full((), 2147483648, tl.int64)
    for _ in range(passes):
        trial = theta + step
        hits = tl.zeros((), tl.int32)
        for start in range(0, n_blocks_max, BLOCK_SEL):
            b = start + sel
            is_candidate = (b >= sink) & (b < n - recent)
            score = tl.load(scores_ptr + out_row + b, mask=is_candidate, other=-float("inf"))
            hits += tl.sum((is_candidate & (_order_key(score) >= trial)).to(tl.int32), axis=0)
        theta = tl.where(hits >= k, trial, theta)
        step = step // 2

    # Phase 3: the mask.
    for start in range(0, n_blocks_max, BLOCK_SEL):
        b = start + sel
        in_row = b < n
        guard = in_row & ((b < sink) | (b >= n - recent))
        is_candidate = in_row & (b >= sink) & (b < n - recent)
        score = tl.load(scores_ptr + out_row + b, mask=in_row, other=-float("inf"))
        kept = guard | (is_candidate & (_order_key(score) >= theta))
        tl.store(kept_ptr + out_row + b, kept.to(tl.int8), mask=b < n_blocks_max)


def block_select_triton(
    surprisal: torch.Tensor,
    lengths: torch.Tensor,
    keep_counts: torch.Tensor,
    page_size: int,
    sink: int,
    recent: int,
    aggregate: str = DEFAULT_AGGREGATE,
    *,
    block_nb: Optional[int] = None,
    block_sel: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_select_reference` in one launch: (scores `[B, NB]` float32, kept `[B, NB]` bool).

    surprisal `[B, T]` fp32/bf16/fp16 (values past lengths[r] are ignored), lengths and
    keep_counts `[B]` int; NB = ceil(T / page_size). block_nb / block_sel (powers of two)
    override the blocks per iteration of the score and selection loops, so that tests can
    exercise several iterations with small sizes.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    if surprisal.dim() != 2:
        raise ValueError(f"surprisal must be [B, T], got shape {tuple(surprisal.shape)}")
    if page_size < 1 or sink < 0 or recent < 0:
        raise ValueError(f"need page_size >= 1, sink >= 0, recent >= 0; got {page_size}, {sink}, {recent}")
    batch, width = surprisal.shape
    device = surprisal.device
    if surprisal.stride(-1) != 1:
        surprisal = surprisal.contiguous()
    lens = lengths.to(device=device, dtype=torch.int32).reshape(batch).contiguous()
    if batch and (int(lens.min()) < 0 or int(lens.max()) > width):
        raise ValueError(f"lengths must lie in [0, {width}], got {lens.tolist()}")
    big = 2**31 - 1
    keep = keep_counts.to(device=device, dtype=torch.int64).clamp(-1, big).to(torch.int32).reshape(batch)
    n_max = num_blocks(width, page_size)
    scores = torch.empty(batch, n_max, device=device, dtype=torch.float32)
    kept = torch.empty(batch, n_max, device=device, dtype=torch.int8)
    if batch > 0 and n_max > 0:
        block_p = triton.next_power_of_2(page_size)
        block_nb_default = min(max(1, _MAX_TILE // block_p), triton.next_power_of_2(n_max))
        block_sel_default = min(_MAX_BLOCK_SEL, triton.next_power_of_2(n_max))
        _block_select_kernel[(batch,)](
            surprisal,
            surprisal.stride(0),
            lens,
            keep.contiguous(),
            scores,
            kept,
            n_max,
            page_size,
            sink,
            recent,
            AGGREGATE=AGGREGATES.index(aggregate),
            BLOCK_P=block_p,
            BLOCK_NB=block_nb or block_nb_default,
            BLOCK_SEL=block_sel or block_sel_default,
            num_warps=4,
        )
    return scores, kept.view(torch.bool)
