"""Where pruning starts to pay: the context length from which a sparse decode step beats a dense one.

Selecting pages costs work a dense step does not do (the page bounds, a top-k, a gather), so
below some context length a pruned step is slower than attending everything. That length
depends on the machine, the model's attention shape and the attention code, so the CPU server
measures it at start-up (the CPU attention backend times its own dense and sparse paths on
synthetic KV of the served model's shape) instead of trusting a fixed token count; an
explicit `pruning.min_context` overrides it.

The timings are measured once per machine and kept (`save_timings` / `load_timings`, keyed by the machine,
torch, the kernels' code, the model's attention shape and the pruning config): every later start, and every
restart, reads them, so the kernel a step runs never follows the load of the moment it started.

On CUDA a start-up probe cannot time what serving runs (a dense step replays a CUDA graph, a pruned
one runs eager), so the crossover there is a rule taken from a measurement on an H200
(`cuda_min_context`; docs/gpu.md, scripts/gpu_crossover.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

# The grid of context lengths timed at start-up (tokens; capped at the model's and the pool's).
# Past its end the sparse step's advantage only grows (dense reads every token, sparse a share);
# it reaches 8k because against our own kernel over every page a small model's crossover on a CPU
# can lie past 4k, and a grid ending there would then never prune at any context.
CONTEXTS = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# A sparse step must be this much faster to count as paying: timing noise must not flip it.
MARGIN = 0.1


# On an H200 (Llama-3-8B layer shape, bf16, scripts/gpu_crossover.py): with the bound alone choosing the
# pages (`shortlist_ratio` None) a pruned layer, eager, beat the dense layer replayed from its graph from
# 32k tokens at batch 8 (8k at batch 32, never up to 128k at batch 1); with the two stages (the default)
# it never did, up to 128k at batch 1-8 and 64k at batch 32: the exact rescoring reads half the
# candidates' keys and costs about as much as dense attention.
CUDA_BOUND_ONLY_MIN_CONTEXT = 32768


def cuda_can_prune(shortlist_ratio: Optional[float], min_context: Optional[int]) -> bool:
    """Whether the CUDA path prunes at any context: a given min_context, or the bound alone (from 32k tokens)."""
    return min_context is not None or shortlist_ratio is None


def cuda_min_context(shortlist_ratio: Optional[float], context_len: int) -> int:
    """The CUDA path's crossover when `pruning.min_context` is unset: 32k tokens with the bound alone,
    past the model's context (never) with the two stages."""
    return CUDA_BOUND_ONLY_MIN_CONTEXT if shortlist_ratio is None else context_len + 1


@dataclass(frozen=True)
class Timing:
    context: int
    dense_s: float  # one decode step's attention over every layer, attending everything
    sparse_s: float  # the same step planned, selected and attended over the kept pages


def crossover(timings: Sequence[Timing], margin: float = MARGIN) -> Optional[int]:
    """The shortest timed context from which on sparse beats dense by `margin` at every longer
    timed context; None when it never does (then nothing is pruned)."""
    found = None
    for t in sorted(timings, key=lambda t: t.context, reverse=True):
        if t.sparse_s > (1.0 - margin) * t.dense_s:
            break
        found = t.context
    return found


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    step: Callable[[int, bool], Callable[[], object]], contexts: Sequence[int], repeats: int = 3
) -> list[Timing]:
    """Time the step `step(context, sparse)` builds, dense and sparse, at each context: the fastest
    of `repeats` calls each after one untimed warm-up, alternating dense and sparse so that a burst
    of load on a shared machine slows both rather than one."""
    out = []
    for n in contexts:
        dense, sparse = step(n, False), step(n, True)
        dense(), sparse()
        d = s = float("inf")
        for _ in range(repeats):
            d, s = min(d, _timed(dense)), min(s, _timed(sparse))
        out.append(Timing(n, d, s))
    return out


def timings_file(directory: Path, key: dict) -> Path:
    """Where the timings measured under `key` (plain JSON data) are kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"{digest}.json"


def load_timings(path: Path) -> dict[str, list[Timing]]:
    """The timings kept at `path` by kind ("kernel": our kernel over every page, "pruned"); {} when none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {kind: [Timing(*row) for row in rows] for kind, rows in data.get("timings", {}).items()}


def save_timings(path: Path, key: dict, timings: dict[str, list[Timing]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = {kind: [[t.context, t.dense_s, t.sparse_s] for t in ts] for kind, ts in timings.items()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "timings": rows}, indent=1))
    tmp.replace(path)  # atomic: ranks or servers starting together never read half a file
