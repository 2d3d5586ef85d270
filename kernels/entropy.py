"""One-pass Triton kernel for the entropy sensor's per-row token stats.

Must equal: sgl_entropic.signal.token_stats_reference (same outputs, same validity contract).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


# Large enough to stream a 152k vocabulary in ~40 chunks, small enough to stay in registers.
_MAX_BLOCK_V = 4096


@triton.jit
def _token_stats_kernel(
    logits_ptr,
    row_stride,
    token_ptr,
    inv_temperature_ptr,
    entropy_ptr,
    surprisal_ptr,
    lse_ptr,
    valid_ptr,
    vocab,
    BLOCK_V: tl.constexpr,
):
    """One program per row, one pass over the vocabulary with online rescaling.

    With x = z * inv_temperature, a running max m, s = sum e^{x - m} and the centred
    t = sum e^{x - m} (x - m): lse = m + ln s and H = lse - sum p x = ln s - t / s.
    Moving the reference from m to m' (d = m - m' <= 0) rescales s' = e^d s and
    t' = e^d (t + d s). The centred t avoids the cancellation of lse - (sum e^{x-m} x) / s
    when logits are large.
    """
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    inv_t = tl.load(inv_temperature_ptr + row).to(tl.float32)
    offsets = tl.arange(0, BLOCK_V)

    # typed loop-carried values: Python scalars would fix their types from the literals
    running_max = tl.full([], -float("inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    bad_entries = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        in_row = start + offsets < vocab
        z = tl.load(row_ptr + start + offsets, mask=in_row, other=-float("inf"))
        x = z.to(tl.float32) * inv_t
        bad_entries += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), axis=0)

        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # While every entry so far is -inf, shift by 0: (-inf) - (-inf) would be NaN.
        reference = tl.where(new_max == -float("inf"), 0.0, new_max)
        shift = running_max - reference
        rescale = tl.exp(shift)
        shifted = x - reference
        weights = tl.exp(shifted)
        # A zero weight (masked entry, or an empty history) must add 0, not 0 * (-inf).
        t = tl.where(rescale > 0, rescale * (t + shift * s), 0.0) + tl.sum(
            tl.where(weights > 0, weights * shifted, 0.0), axis=0
        )
        s = s * rescale + tl.sum(weights, axis=0)
        running_max = new_max

    token = tl.load(token_ptr + row)
    token_in_row = (token >= 0) & (token < vocab)
    token_z = tl.load(row_ptr + token, mask=token_in_row, other=-float("inf"))
    token_logit = token_z.to(tl.float32) * inv_t
    valid = (inv_t > 0) & (inv_t < float("inf")) & token_in_row & (bad_entries == 0) & (token_logit > -float("inf"))

    log_s = tl.log(s)
    entropy = tl.maximum(log_s - t / s, 0.0)
    lse = running_max + log_s
    tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))
    tl.store(surprisal_ptr + row, tl.where(valid, lse - token_logit, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    tl.store(valid_ptr + row, valid.to(tl.int8))


def token_stats_triton(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    inv_temperature: Optional[torch.Tensor] = None,
    *,
    block_v: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_stats_reference` in one read of the logits; fp32/bf16/fp16 in, fp32 out: the fields of
    `sgl_entropic.signal.TokenStats` as a plain tuple (the kernel does not import the module that calls it).

    block_v (a power of two) overrides the vocabulary chunk, so that tests can exercise
    several chunks with a small vocabulary.
    """
    batch, vocab = logits.shape
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    inv_t = (
        torch.ones(batch, device=device)
        if inv_temperature is None
        else inv_temperature.to(device=device, dtype=torch.float32).contiguous()
    )
    tokens = token_ids.to(device=device, dtype=torch.int64).contiguous()
    entropy = torch.zeros(batch, device=device)
    surprisal = torch.zeros(batch, device=device)
    lse = torch.zeros(batch, device=device)
    valid = torch.zeros(batch, device=device, dtype=torch.int8)
    if batch > 0:
        block = block_v or min(_MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 1)))
        _token_stats_kernel[(batch,)](
            logits,
            logits.stride(0),
            tokens,
            inv_t,
            entropy,
            surprisal,
            lse,
            valid,
            vocab,
            BLOCK_V=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return entropy, surprisal, lse, valid.view(torch.bool)
