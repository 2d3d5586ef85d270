"""Logits that stress an entropy kernel, shared by the Triton kernel's tests and the compiled CPU kernel's."""

import torch

NEG_INF = float("-inf")


def edge_case_batch(vocab: int, dtype: torch.dtype, device: str = "cpu"):
    """Rows that stress the kernel: masks, NaN, +inf, one finite entry, large logits, bad tokens."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator) * 3.0
    logits[0, ::7] = NEG_INF  # masked entries, the row max in a late chunk
    logits[0, vocab - 2] = 12.0
    logits[1, vocab // 2] = float("nan")
    logits[2] = NEG_INF
    logits[2, vocab - 1] = 2.0  # a single allowed token, in the last (partial) chunk
    logits[3] *= 10.0  # large logits: cancellation would show here
    logits[4, 3] = float("inf")
    logits[5] = NEG_INF
    logits[6, 9] = NEG_INF  # the token itself is masked
    tokens = torch.tensor([1, 0, vocab - 1, 5, 0, 0, 9, vocab])  # the last is out of range
    inv_temperature = torch.tensor([1 / 0.7, 1.0, 1 / 1.3, 2.0, 1.0, 1.0, 1.0, 1.0])
    valid = [True, False, True, True, False, False, False, False]
    logits = logits.to(device=device, dtype=dtype)
    return logits, tokens.to(device), inv_temperature.to(device), valid
