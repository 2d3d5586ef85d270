"""What a verify step's extra rows cost on this CPU: torch's linear layer over M rows, M = 1 .. 12, per dtype.

A verify step of W nodes runs every weight matrix over W rows where a decode step runs it over one; whether a
draft is nearly free (a GEMM reads the weights once) or costs a row (a matrix-vector pass per row) decides
whether drafting pays at batch 1. The shapes are SmolLM2-135M's MLP up/gate projection and its LM head.
The entropy rule measures this on the server itself (`speculative.StepTimes`); this shows why it has to.

    .venv/bin/python benchmarks/small_gemm.py          # docs/data/small_gemm.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SHAPES = {"mlp_up": (576, 3072), "lm_head": (576, 49152)}


def per_call_us(x: torch.Tensor, w: torch.Tensor, seconds: float) -> float:
    """Median of 5 timed runs of about `seconds` / 5 each, after a warm-up."""
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    runs = []
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            torch.nn.functional.linear(x, w)
            n += 1
        runs.append((time.perf_counter() - start) / n * 1e6)
    return common.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per cell")
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)
    results = []
    for dtype in args.dtypes.split(","):
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, dtype=getattr(torch, dtype))
            times = {m: per_call_us(torch.randn(m, k, dtype=w.dtype), w, args.seconds) for m in rows}
            results.append(
                {
                    "dtype": dtype,
                    "shape": name,
                    "k": k,
                    "n": n,
                    "us": times,
                    "x_one_row": {m: t / times[rows[0]] for m, t in times.items()},
                }
            )
            common.log_line(
                f"{dtype} {name}: " + " ".join(f"M={m} {t:.0f}us ({t / times[rows[0]]:.2f}x)" for m, t in times.items())
            )
    table = common.markdown_table(
        ["dtype", "weights", *[f"M={m}" for m in rows]],
        [
            [r["dtype"], f"{r['k']}x{r['n']}", *[f"{r['us'][m]:.0f} us ({r['x_one_row'][m]:.2f}x)" for m in rows]]
            for r in results
        ],
    )
    print(table)
    common.write_json(
        "small_gemm",
        {
            "args": vars(args),
            "environment": common.environment(),
            "threads": torch.get_num_threads(),
            "results": results,
            "markdown": table,
        },
        publish="small_gemm",
    )


if __name__ == "__main__":
    main()
