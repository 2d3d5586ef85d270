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
import os
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


def plain_step_seconds(
    kernel: Sequence[Timing], pruned: Sequence[Timing], dense_kernel_from: Optional[int], min_context: Optional[int]
) -> Optional[list[tuple[int, float]]]:
    """(context, seconds) of a decode step's attention as the CPU backend runs it at each timed context: SGLang's
    loop below `dense_kernel_from`, our kernel over every page from there, the pruned path from `min_context`.
    None where a regime the step would run was not timed (a crossover given instead of measured)."""
    over_all = {t.context: t for t in kernel}
    pruned_at = {t.context: t.sparse_s for t in pruned}
    out = []
    for n in sorted(over_all):
        if min_context is not None and n >= min_context:
            if n not in pruned_at:
                return None
            out.append((n, pruned_at[n]))
        else:
            t = over_all[n]
            out.append((n, t.sparse_s if dense_kernel_from is not None and n >= dense_kernel_from else t.dense_s))
    return out or None


def others_cpu() -> float:
    """CPU seconds the machine's other processes have used so far (Linux: /proc/stat's busy time less this process's
    own); 0 where /proc/stat cannot be read, which counts every pass as quiet."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait; steal counts
    return busy - time.process_time()


def fastest(
    fns: Sequence[Callable[[], object]],
    sync: Callable[[], None] = lambda: None,
    settled: int = 3,
    most: int = 6,
    others: Callable[[], float] = others_cpu,
) -> list[float]:
    """Each call's fastest time over passes through the whole list after one untimed pass, counting only quiet
    passes (the machine's other processes used under a tenth of a core meanwhile), until `settled` quiet passes,
    at most `most` (then the fastest of every pass: a start beside other loading servers, as in a test run, must
    not wait long). At start-up SGLang's other processes load beside the scheduler for seconds; timings taken inside
    that burst would be kept for the machine's life."""
    quiet, loud = [float("inf")] * len(fns), [float("inf")] * len(fns)
    calm = 0
    for r in range(most + 1):
        start, wall = others(), time.perf_counter()
        times = []
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        if not r:
            continue
        loud = [min(a, b) for a, b in zip(loud, times)]
        if others() - start < 0.1 * (time.perf_counter() - wall):
            quiet, calm = [min(a, b) for a, b in zip(quiet, times)], calm + 1
            if calm >= settled:
                break
    return quiet if calm else loud


def measure(
    step: Callable[[int, bool], Callable[[], object]],
    contexts: Sequence[int],
    settled: int = 3,
    others: Callable[[], float] = others_cpu,
) -> list[Timing]:
    """Time the step `step(context, sparse)` builds, dense and sparse, at each context (`fastest`: dense and sparse
    alternate, so that load slows both rather than one)."""
    fns = [f for n in contexts for f in (step(n, False), step(n, True))]
    times = fastest(fns, settled=settled, others=others)
    return [Timing(n, times[2 * i], times[2 * i + 1]) for i, n in enumerate(contexts)]


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
