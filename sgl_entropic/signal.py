"""The entropy sensor: per-row Shannon entropy of next-token logits, and entropic time.

Every entropy here is in nats and computed in float32 whatever the logits dtype. A batch of
logits is a tensor `[B, V]`; masked vocabulary entries are `-inf` and carry probability 0.

This module imports torch only (never sglang), so every loop of the plugin and every test can
read the sensor without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from sgl_entropic.kernels import entropy_cpu, triton_available


class TopKEntropy(NamedTuple):
    """Truncated top-k entropy and the interval that must contain the exact entropy, each `[B]`."""

    truncated: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor


class TokenStats(NamedTuple):
    """Per-row stats of softmax(logits * inv_temperature) and of the row's token, each `[B]`."""

    entropy: torch.Tensor
    surprisal: torch.Tensor
    lse: torch.Tensor
    valid: torch.Tensor


ROWS_KEPT = 1 << 24  # elements (64 MB of float32): Scratch.rows' buffer at most


class Scratch:
    """Two [B, V] float32 buffers the per-step signal reuses. On CPU, fresh multi-megabyte temporaries every
    step cost more than the arithmetic (at a 262k vocabulary and batch 8, 5.5 ms against 1.1 ms: new memory
    from the OS, page by page), so the sampler hook computes into these."""

    def __init__(self) -> None:
        self._buf: Optional[torch.Tensor] = None
        self._copy: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None

    def snapshot(self, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 `logits * scale[:, None]` in a reused buffer (the sampler turns logits into probabilities
        in place): the copy the step needs anyway, with the temperature applied in the same pass."""
        n, buf = logits.numel(), self._copy
        if buf is None or buf.device != logits.device or buf.numel() < n:
            buf = self._copy = torch.empty(n, dtype=torch.float32, device=logits.device)
        return torch.mul(logits, scale[:, None], out=buf[:n].view(logits.shape))

    def rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`x.index_select(0, index)` in a reused buffer (a verify step measures its committed nodes' rows of the
        logits), kept up to ROWS_KEPT elements; a larger gather gets new memory, as index_select would."""
        n = index.numel() * x.shape[1]
        if n > ROWS_KEPT:
            return x.index_select(0, index)
        buf = self._rows
        if buf is None or buf.device != x.device or buf.dtype != x.dtype or buf.numel() < n:
            buf = self._rows = torch.empty(n, dtype=x.dtype, device=x.device)
        return torch.index_select(x, 0, index, out=buf[:n].view(index.numel(), x.shape[1]))

    def get(self, rows: int, vocab: int, device) -> torch.Tensor:
        """A [2, rows, vocab] float32 view, grown (never shrunk) as batches grow."""
        n = rows * vocab
        if self._buf is None or self._buf.device != torch.device(device) or self._buf.shape[1] < n:
            self._buf = torch.empty(2, n, dtype=torch.float32, device=device)
        return self._buf[:, :n].view(2, rows, vocab)


def _entropy_and_lse(
    x: torch.Tensor, row_max: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and log-sum-exp of rows `x` (float32 or float64), with m the row max: the one eager definition.

    With d = x - m, e = e^d and s = sum_i e_i: lse = m + ln s and H = ln s - sum_i e_i d_i / s. Summed as e d,
    not e x: sum e x - m s loses up to 7e-4 nats to cancellation at V = 262k in float32 (a flat row gives ln V
    exactly here). A masked entry (x_i = -inf, e_i = 0, d_i = -inf) gives 0 * (-inf) = NaN in that sum, which
    nansum drops: its contribution is 0. The compiled CPU kernel and the Triton kernel compute the same sums
    (`sgl_entropic.kernels`), and are tested against this in float64 (`token_stats_reference(..., float64)`).
    `out`: a [2, B, V] scratch of x's dtype (x itself may be out[0]); no new memory.
    """
    row_max = x.amax(dim=-1) if row_max is None else row_max
    d = x - row_max[:, None] if out is None else torch.sub(x, row_max[:, None], out=out[0])
    e = torch.exp(d) if out is None else torch.exp(d, out=out[1])
    total = e.sum(dim=-1)
    log_s = total.log()
    ed = e.mul_(d).nansum(dim=-1)
    # H >= 0 exactly; rounding of ln s - ed / s may dip a few ulps below.
    return (log_s - ed / total).clamp_min(0.0), row_max + log_s


def entropy_exact(logits: torch.Tensor, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Exact Shannon entropy H = -sum_i p_i ln p_i of softmax(logits) per row, `[B]` float32.

    Computed in the streaming form H = lse - sum_i p_i z_i, so ln p of a masked entry is never
    formed: `-inf` entries contribute 0, and a row with exactly one finite entry has H = 0.
    A row with no finite entry, or with NaN or +inf, has no distribution and gives NaN;
    `token_stats` is the guarded variant that flags such rows instead. `scratch`: see `Scratch`.
    """
    compiled = _compiled_for(logits)
    if compiled is not None:
        return compiled.entropy(logits.float().contiguous(), torch.ones(logits.shape[0]))
    if logits.numel() == 0:
        return logits.float().new_zeros(logits.shape[0])
    x = logits.float()
    out = scratch.get(*logits.shape, logits.device) if scratch is not None else None
    return _entropy_and_lse(x, out=out)[0]


def entropy_topk(logits: torch.Tensor, k: int) -> TopKEntropy:
    """Entropy from the k most likely tokens only, with bounds on the exact entropy.

    Let p_1 >= ... >= p_k be the top-k probabilities (normalised over the whole vocabulary),
    r = 1 - sum_{i<=k} p_i the tail mass, and n = V - k the tail size, V counting only the
    finite entries of the row. Splitting H = H_k + T with H_k = -sum_{i<=k} p_i ln p_i and the
    tail term T = sum_{tail} p_i ln(1/p_i):
      - every tail p_i <= p_k, so T >= sum_{tail} p_i ln(1/p_k) = r ln(1/p_k)   (lower);
      - T = r ln(1/r) + r * H(tail / r) and H(tail / r) <= ln n, so T <= r ln(n / r)  (upper).
    Hence H_k + r ln(1/p_k) <= H <= H_k + r ln(n / r). When r = 0 or n <= 0 both bounds are
    H_k, which is then exact (k >= V gives equality). `k` larger than V is clamped to V;
    rows without a distribution give NaN, as in `entropy_exact`.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    top_logits, top_index = x.topk(min(k, x.shape[-1]), dim=-1)
    top_log_probs = top_logits - lse[:, None]
    top_probs = top_log_probs.exp()
    # Masked top entries (fewer finite entries than k) add 0; NaN still propagates.
    truncated = torch.where(top_log_probs == float("-inf"), 0.0, -top_probs * top_log_probs).sum(dim=-1)

    # The tail's own log-sum-exp gives ln r without the cancellation of 1 - sum(top_probs).
    tail_lse = torch.logsumexp(x.scatter(-1, top_index, float("-inf")), dim=-1)
    log_tail_mass = tail_lse - lse
    tail_mass = log_tail_mass.exp()
    tail_size = torch.isfinite(x).sum(dim=-1) - top_logits.shape[-1]
    has_tail = (tail_mass > 0) & (tail_size > 0)

    log_inv_pk = lse - top_logits[:, -1]
    lower = truncated + torch.where(has_tail, tail_mass * log_inv_pk, 0.0)
    upper = truncated + torch.where(has_tail, tail_mass * (tail_size.float().log() - log_tail_mass), 0.0)
    return TopKEntropy(truncated, lower, upper)


def token_stats_reference(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    inv_temperature: Optional[torch.Tensor] = None,
    scratch: Optional[Scratch] = None,
    dtype: torch.dtype = torch.float32,
) -> TokenStats:
    """Pure-torch stats of softmax(x), x = logits * inv_temperature[:, None], and of each token.

    entropy = H(softmax(x)), lse = ln sum_i e^{x_i}, surprisal = lse - x[token] = -ln p(token),
    all float32 `[B]`; `inv_temperature` is `[B]` (default all 1).

    Robustness contract: a row is valid=False, and gets entropy = surprisal = lse = 0.0, when
    x contains NaN or +inf, when it has no finite entry, when its inverse temperature is not
    finite and > 0, or when its token is out of range or masked (-inf): a sampled token is
    never masked in practice, and an infinite surprisal would not survive JSON. No input
    raises and no output is NaN. With `scratch` the same values are computed in its buffers (no per-call [B, V]
    allocation). `dtype`: what it computes in (float32 serving; float64 is the reference every kernel, and the
    controller's probe, is tested against); the outputs are float32.
    """
    batch, vocab = logits.shape
    inv_t = (
        torch.ones(batch, device=logits.device)
        if inv_temperature is None
        else inv_temperature.to(device=logits.device, dtype=torch.float32)
    )
    out = None if scratch is None or vocab == 0 or dtype != torch.float32 else scratch.get(batch, vocab, logits.device)
    x = logits.to(dtype)
    # A CPU tensor's check costs no device sync; all ones (greedy rows, verification) needs no scaled copy.
    if inv_temperature is not None and not (inv_t.is_cpu and bool((inv_t == 1).all())):
        x = x * inv_t[:, None].to(dtype) if out is None else torch.mul(x, inv_t[:, None], out=out[0])
    tokens = token_ids.to(device=logits.device, dtype=torch.long)
    token_in_range = (tokens >= 0) & (tokens < vocab)
    if vocab == 0:
        zeros = torch.zeros(batch, device=logits.device)
        return TokenStats(zeros, zeros.clone(), zeros.clone(), torch.zeros_like(token_in_range))
    token_logit = x.gather(1, tokens.clamp(0, vocab - 1)[:, None]).squeeze(1)
    # amax propagates NaN, so one reduction finds NaN, +inf and rows with no finite entry.
    row_max = x.amax(dim=-1)
    valid = (
        (inv_t > 0) & (inv_t < float("inf")) & token_in_range & torch.isfinite(row_max) & (token_logit > float("-inf"))
    )
    # Invalid rows may come out NaN here; the masks below replace them (no host check, no sync).
    entropy, lse = _entropy_and_lse(x, row_max, out)
    surprisal = lse - torch.where(valid, token_logit, 0.0)
    entropy, surprisal, lse = entropy.float(), surprisal.float(), lse.float()
    return TokenStats(
        torch.where(valid, entropy, 0.0),
        torch.where(valid, surprisal, 0.0),
        torch.where(valid, lse, 0.0),
        valid,
    )


def token_stats(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    inv_temperature: Optional[torch.Tensor] = None,
    scratch: Optional[Scratch] = None,
) -> TokenStats:
    """`token_stats_reference`'s result: by the one-pass Triton kernel on CUDA, by the compiled kernel on CPU where
    it is built (`sgl_entropic.kernels.entropy_cpu`), else by eager torch (in `scratch`)."""
    if logits.is_cuda and triton_available():
        from sgl_entropic.kernels.entropy import token_stats_triton

        return TokenStats(*token_stats_triton(logits, token_ids, inv_temperature))
    compiled = _compiled_for(logits)
    if compiled is not None:
        inv_t = torch.ones(logits.shape[0]) if inv_temperature is None else inv_temperature.float().contiguous()
        return TokenStats(*compiled.token_stats(logits.float().contiguous(), token_ids.long(), inv_t))
    return token_stats_reference(logits, token_ids, inv_temperature, scratch)


def _compiled_for(logits: torch.Tensor) -> Optional[entropy_cpu.Compiled]:
    """The compiled CPU kernels where they serve these rows (2-D, a row or more, a vocabulary of two or more)."""
    if not logits.is_cpu or logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 2:
        return None
    return entropy_cpu.load()


@dataclass
class EntropyTrace:
    """Per-request record of the sensor, one `record` per decode step.

    Entropic time is the uncertainty resolved so far, tau = sum_t max(0, H_{t-1} - H_t),
    and cost is the summed step cost in FLOPs. With keep_lists=False only tau, cost and
    last_entropy are kept (cheap mode for long generations).
    """

    entropy: list[float] = field(default_factory=list)
    surprisal: list[float] = field(default_factory=list)
    tau: float = 0.0
    cost: float = 0.0
    last_entropy: Optional[float] = None
    keep_lists: bool = True

    def record(self, h: float, s: float, cost: float) -> float:
        """Add one step's entropy h, surprisal s and cost; return its tau increment."""
        d_tau = 0.0 if self.last_entropy is None else max(0.0, self.last_entropy - h)
        self.tau += d_tau
        self.cost += cost
        self.last_entropy = h
        if self.keep_lists:
            self.entropy.append(h)
            self.surprisal.append(s)
        return d_tau

    @property
    def efficiency(self) -> float:
        """Entropic time per compute, tau / (cost / 1e9), in nats per GFLOP; 0.0 before any cost."""
        return self.tau / (self.cost / 1e9) if self.cost > 0 else 0.0
