"""In-process cost of the per-step signal work the plugin adds to every sampling step.

What the Sampler hook does per step, on the bundled model's vocabulary: clone the logits
(the sampler overwrites them), token_stats (entropy, lse, surprisal) and one host transfer.
Compare the medians with a decode step's duration from signal_overhead.py
(batch / decode tok/s): the end-to-end A/B on a shared 2-core VM is noisier than 3 %.

    .venv/bin/python benchmarks/signal_cost.py [--vocab 49152] [--batch-sizes 1,8] [--iters 200]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from sgl_entropic.signal import token_stats


def measure(batch: int, vocab: int, iters: int) -> dict:
    logits = torch.randn(batch, vocab)
    tokens = torch.randint(0, vocab, (batch,))
    inv_t = torch.ones(batch)
    times = []
    for i in range(iters + 5):
        start = time.perf_counter()
        snapshot = logits.clone()
        stats = token_stats(snapshot, tokens, inv_t)
        stats.entropy.tolist(), stats.surprisal.tolist(), stats.valid.tolist()
        if i >= 5:
            times.append(time.perf_counter() - start)
    times.sort()
    return {"batch": batch, "vocab": vocab, "median_ms": 1e3 * times[len(times) // 2], "p90_ms": 1e3 * times[int(len(times) * 0.9)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    rows = [measure(int(b), args.vocab, args.iters) for b in args.batch_sizes.split(",")]
    print(f"torch threads: {torch.get_num_threads()}\n\n| batch | vocab | median ms/step | p90 ms/step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['vocab']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} |")
    out = Path(__file__).parent / "results" / "signal_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
