"""The entropy sensor's per-row stats on CPU as compiled kernels (AOTInductor: torch code compiled to C++ once).

Must equal: sgl_entropic.signal.token_stats_reference (same outputs within float32 rounding, same validity
contract), and `entropy` must equal `entropy_exact`.

Why: eager torch passes over the rows about ten times (max, the softmax's three passes and its written
probabilities, max of p, p * x and its sum), each an op that finds the rows out of cache after the model's
forward; at a 262k vocabulary that was most of the plugin's time. Compiled, the temperature, the exponential and
both sums fuse into two read-only passes (the row max, then the sums).

Built ahead of time, not at run time: `python -m sgl_entropic.cpu kernels` (scripts/setup.sh) exports the two
functions with dynamic rows and vocabulary and compiles them into packages under `~/.cache/sgl-entropic`, keyed
by torch's version, the CPU capability torch dispatches to and this file's code. A process loads them in
milliseconds through AOTInductor's C++ loader (torch.compile at run time cost every server process seconds).
Without a package for this machine, `load()` is None and the signal runs eager torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("sgl_entropic")

NAMES = ("token_stats", "entropy")


def _entropy_lse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H, lse, m) of float32 rows x: H = ln s - sum_i e_i d_i / s, d = x - m, e = exp(d), s = sum e,
    lse = m + ln s. Summed as e * d, not e * x: the compiled sum runs in lanes, not pairwise as ATen's, and
    sum e x - m s would lose a few 1e-4 nats at V = 262k to cancellation (a flat row gives ln V exactly).
    A masked entry (x_i = -inf, e_i = 0) adds nothing; rows with NaN, +inf or nothing finite give NaN."""
    m = x.amax(dim=-1)
    d = x - m[:, None]
    e = torch.exp(d)
    s = e.sum(dim=-1)
    ed = torch.where(e > 0, e * d, 0.0).sum(dim=-1)
    log_s = s.log()
    return (log_s - ed / s).clamp_min(0.0), m + log_s, m


def _token_stats(logits: torch.Tensor, token_ids: torch.Tensor, inv_t: torch.Tensor):
    """`token_stats_reference` of float32 logits [B, V > 1], int64 tokens [B], float32 inv_t [B]."""
    vocab = logits.shape[1]
    x = logits * inv_t[:, None]
    token_in_range = (token_ids >= 0) & (token_ids < vocab)
    token_logit = x.gather(1, token_ids.clamp(0, vocab - 1)[:, None]).squeeze(1)
    entropy, lse, row_max = _entropy_lse(x)
    valid = (
        (inv_t > 0) & (inv_t < float("inf")) & token_in_range & torch.isfinite(row_max) & (token_logit > float("-inf"))
    )
    surprisal = lse - torch.where(valid, token_logit, 0.0)
    return (torch.where(valid, entropy, 0.0), torch.where(valid, surprisal, 0.0), torch.where(valid, lse, 0.0), valid)


def _entropy(logits: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """`entropy_exact` of float32 logits [B, V > 1] * inv_t[:, None]."""
    return _entropy_lse(logits * inv_t[:, None])[0]


class _TokenStats(torch.nn.Module):  # what torch.export takes
    def forward(self, logits, token_ids, inv_t):
        return _token_stats(logits, token_ids, inv_t)


class _Entropy(torch.nn.Module):
    def forward(self, logits, inv_t):
        return _entropy(logits, inv_t)


def package_dir() -> Path:
    """Where this machine's packages are: torch's version, its CPU capability and this file's code in the name."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    tag = f"torch{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{code}".replace("+", "_")
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sgl-entropic" / "kernels"
    return root / tag


def build() -> Path:
    """Export and compile both functions (about a minute on 2 cores); idempotent."""
    from torch.export import Dim, export

    out = package_dir()
    rows, vocab = Dim("rows", min=1, max=1 << 20), Dim("vocab", min=2, max=1 << 24)
    example = torch.randn(2, 64)
    args = {
        "token_stats": (example, torch.zeros(2, dtype=torch.long), torch.ones(2)),
        "entropy": (example, torch.ones(2)),
    }
    for name, module in (("token_stats", _TokenStats()), ("entropy", _Entropy())):
        path = out / f"{name}.pt2"
        if path.is_file():
            continue
        shapes = ({0: rows, 1: vocab},) + ({0: rows},) * (len(args[name]) - 1)
        program = export(module, args[name], dynamic_shapes=shapes)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"{name}.{os.getpid()}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        tmp.replace(path)  # whole or not at all, for servers starting meanwhile
    return out


class Compiled:
    """The loaded packages; callers pass contiguous float32 rows (at least one row, a vocabulary of at least 2)."""

    def __init__(self, directory: Path):
        # AOTInductor's C++ loader: milliseconds, where torch._inductor.aoti_load_package imports inductor (~1.5 s)
        load = torch._C._aoti.AOTIModelPackageLoader
        self._runners = {name: load(str(directory / f"{name}.pt2"), "model", False, 1, -1) for name in NAMES}

    def token_stats(self, logits, token_ids, inv_t):
        return self._runners["token_stats"].run([logits, token_ids, inv_t])

    def entropy(self, logits, inv_t):
        return self._runners["entropy"].run([logits, inv_t])[0]


@functools.cache
def load() -> Optional[Compiled]:
    """This machine's compiled kernels, or None (not built here, or they do not load: the reason is logged)."""
    directory = package_dir()
    if not all((directory / f"{name}.pt2").is_file() for name in NAMES):
        logger.info(
            "sgl-entropic: no compiled CPU entropy kernels in %s (python -m sgl_entropic.cpu kernels); "
            "eager torch is used",
            directory,
        )
        return None
    try:
        return Compiled(directory)
    except Exception as exc:  # an incompatible torch, a broken package: eager torch serves
        logger.warning(
            "sgl-entropic: compiled CPU entropy kernels do not load (%s: %s); eager torch is used",
            type(exc).__name__,
            exc,
        )
        return None
