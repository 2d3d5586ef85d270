"""Overhead of recording the entropy signal: stock SGLang vs ours with `--entropic signal`.

Claim tested: recording H_t, surprisal, entropic time and the cost model at every decode step,
with the traces returned (`return_entropy: true`), slows decoding by at most 3 %.

Both servers run the same model, dtype, device, KV pool and chat template, ONE AT A TIME.
Drift (thermal, other tenants) is countered by ABBA rounds: round 0 runs stock then ours,
round 1 ours then stock, and so on; each server is restarted for every round.

Per server, per batch size B, each repeat sends B concurrent greedy requests (ignore_eos, short
distinct prompts) and times the batch:
  - tok/s          = B * N / wall(N)                         (N = --tokens; includes prefill)
  - decode tok/s   = B * (N - 1) / (median wall(N) - median wall(1))
    wall(1) is the same batch with max_new_tokens = 1 (prefill + first token + HTTP), so the
    difference is the time of the N - 1 decode steps only.
slowdown = 1 - ours / stock, from the medians pooled over rounds; per-round paired slowdowns
are reported too, which shows how much of the difference is drift.

    .venv/bin/python benchmarks/signal_overhead.py                    # 128 tokens, B in {1, 8}
    .venv/bin/python benchmarks/signal_overhead.py --quick            # tiny smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    bundled_model,
    chat,
    default_device,
    environment,
    free_port,
    log_line,
    markdown_table,
    median,
    ours_command,
    require_ok,
    run_batch,
    server_env,
    sglang_common_args,
    start_server,
    stock_command,
    write_json,
)

TOPICS = [
    "a lighthouse keeper",
    "a robot learning to paint",
    "the last tree on Mars",
    "a detective cat",
    "a time-travelling baker",
    "a city under the sea",
    "two rival chess players",
    "a dragon who hates gold",
    "a lost letter",
    "a village of clockmakers",
    "a pirate afraid of water",
    "the first day of winter",
    "a librarian ghost",
    "a storm chaser",
    "an astronaut's garden",
    "a talking river",
]
TARGET_SLOWDOWN = 0.03


def prompts(batch: int, repeat: int) -> list[str]:
    """Short distinct prompts; the same ones for both servers."""
    return [chat(f"Write a long story about {TOPICS[(repeat + i) % len(TOPICS)]}.") for i in range(batch)]


def payloads(texts: list[str], max_new_tokens: int, ours: bool) -> list[dict]:
    out = []
    for text in texts:
        p = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        if ours:
            p["return_entropy"] = True
        out.append(p)
    return out


def measure_server(kind: str, url: str, args) -> dict:
    """Warm up, then `repeats` x every batch size, at N tokens and at 1 token."""
    ours = kind == "ours"
    bmax = max(args.batch_sizes)
    # warm-up: the largest batch at full length, then a single short request; discarded
    require_ok(run_batch(url, payloads(prompts(bmax, 0), args.tokens, ours), bmax, args.timeout), f"{kind} warm-up")
    require_ok(run_batch(url, payloads(prompts(1, 0), 1, ours), 1, args.timeout), f"{kind} warm-up")

    # sanity: ours returns one entropy per token, stock returns none
    check = require_ok(run_batch(url, payloads(prompts(1, 0), 4, ours), 1, args.timeout), f"{kind} check").results[0]
    entropy = check.meta.get("entropy")
    if ours and (not isinstance(entropy, list) or len(entropy) != check.completion_tokens):
        raise RuntimeError(f"ours: expected {check.completion_tokens} entropies in meta_info, got {entropy!r}")
    if not ours and entropy is not None:
        raise RuntimeError("stock: meta_info has 'entropy'; the plugin is active in the stock server")

    per_b: dict[int, dict] = {b: {"wall_n": [], "wall_1": [], "tok_s": [], "tokens": []} for b in args.batch_sizes}
    for rep in range(args.repeats):
        for b in args.batch_sizes:
            texts = prompts(b, rep)
            batch = require_ok(run_batch(url, payloads(texts, args.tokens, ours), b, args.timeout), f"{kind} B={b}")
            if batch.completion_tokens != b * args.tokens:
                raise RuntimeError(f"{kind} B={b}: {batch.completion_tokens} tokens, expected {b * args.tokens}")
            short = require_ok(run_batch(url, payloads(texts, 1, ours), b, args.timeout), f"{kind} B={b} 1-token")
            d = per_b[b]
            d["wall_n"].append(batch.wall_s)
            d["wall_1"].append(short.wall_s)
            d["tok_s"].append(batch.tokens_per_s)
            d["tokens"].append(batch.completion_tokens)
            log_line(
                f"{kind} B={b} rep {rep}: {batch.tokens_per_s:.1f} tok/s "
                f"(wall {batch.wall_s:.2f}s, 1-token wall {short.wall_s:.2f}s)"
            )
    for b, d in per_b.items():
        d["decode_tok_s"] = _decode_rate(b, args.tokens, d["wall_n"], d["wall_1"])
    return {str(b): d for b, d in per_b.items()}


def _decode_rate(b: int, n: int, wall_n: list[float], wall_1: list[float]) -> float:
    dt = median(wall_n) - median(wall_1)
    return b * (n - 1) / dt if n > 1 and dt > 0 else float("nan")


def run(args) -> dict:
    model = args.model_path or bundled_model()
    common = sglang_common_args(model, args.device, args.dtype, args.server_arg)
    sessions = []
    for rnd in range(args.rounds):
        order = ["stock", "ours"] if rnd % 2 == 0 else ["ours", "stock"]
        for kind in order:
            port = free_port()
            if kind == "stock":
                cmd = stock_command(port, common)
            else:
                cmd = ours_command(port, common, mode="signal")
            log_line(f"round {rnd}: starting {kind}")
            with start_server(
                f"overhead-{kind}", cmd, port, server_env(args.device, stock=kind == "stock"), args.startup_timeout
            ) as srv:
                info = srv.info().get("entropic")
                if kind == "ours" and not (
                    info and info.get("plugin_loaded_in_scheduler") and info.get("hooks_applied")
                ):
                    raise RuntimeError(f"ours: plugin not active in the scheduler: {info!r}")
                if kind == "stock" and info is not None:
                    raise RuntimeError(f"stock: /server_info has an entropic section: {info!r}")
                result = measure_server(kind, srv.url, args)
                sessions.append(
                    {
                        "round": rnd,
                        "kind": kind,
                        "startup_s": srv.startup_s,
                        "command": cmd,
                        "log": str(srv.log),
                        "entropic_info": info,
                        "batch": result,
                    }
                )
    return {"sessions": sessions, "summary": summarize(sessions, args)}


def summarize(sessions: list[dict], args) -> dict:
    summary = {}
    for b in map(str, args.batch_sizes):
        row: dict = {}
        for kind in ("stock", "ours"):
            mine = [s["batch"][b] for s in sessions if s["kind"] == kind]
            tok_s = [x for d in mine for x in d["tok_s"]]
            wall_n = [x for d in mine for x in d["wall_n"]]
            wall_1 = [x for d in mine for x in d["wall_1"]]
            med = median(tok_s)
            row[kind] = {
                "tok_s_median": med,
                "tok_s_min": min(tok_s),
                "tok_s_max": max(tok_s),
                "spread": (max(tok_s) - min(tok_s)) / med if med else float("nan"),
                "decode_tok_s": _decode_rate(int(b), args.tokens, wall_n, wall_1),
                "n_measurements": len(tok_s),
            }
        row["slowdown"] = 1 - row["ours"]["tok_s_median"] / row["stock"]["tok_s_median"]
        row["decode_slowdown"] = 1 - row["ours"]["decode_tok_s"] / row["stock"]["decode_tok_s"]
        paired = []
        for rnd in sorted({s["round"] for s in sessions}):
            by = {s["kind"]: s["batch"][b] for s in sessions if s["round"] == rnd}
            if len(by) == 2:
                paired.append(1 - median(by["ours"]["tok_s"]) / median(by["stock"]["tok_s"]))
        row["per_round_slowdown"] = paired
        row["within_target"] = row["slowdown"] <= TARGET_SLOWDOWN
        summary[b] = row
    return summary


def table(summary: dict) -> str:
    headers = [
        "batch",
        "stock tok/s",
        "ours tok/s",
        "slowdown",
        "stock decode tok/s",
        "ours decode tok/s",
        "decode slowdown",
        "per-round slowdown",
        "spread stock/ours",
        f"<= {TARGET_SLOWDOWN:.0%}",
    ]
    rows = []
    for b, r in summary.items():
        rows.append(
            [
                b,
                r["stock"]["tok_s_median"],
                r["ours"]["tok_s_median"],
                f"{r['slowdown']:+.2%}",
                r["stock"]["decode_tok_s"],
                r["ours"]["decode_tok_s"],
                "n/a" if r["decode_slowdown"] != r["decode_slowdown"] else f"{r['decode_slowdown']:+.2%}",
                ", ".join(f"{x:+.1%}" for x in r["per_round_slowdown"]),
                f"{r['stock']['spread']:.1%} / {r['ours']['spread']:.1%}",
                "yes" if r["within_target"] else "NO",
            ]
        )
    return markdown_table(headers, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (greedy, ignore_eos)")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per batch size per server start")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated concurrent batch sizes")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds; each starts both servers once")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra sglang flag for both servers (repeatable; use --server-arg=--flag --server-arg=value)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 8 tokens, 1 repeat, B in {1, 2}, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.batch_sizes, args.rounds = 8, 1, "1,2", 1
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",") if x.strip()]
    args.device = args.device or default_device()
    if args.tokens < 2 or args.repeats < 1 or args.rounds < 1 or min(args.batch_sizes) < 1:
        ap.error("need --tokens >= 2, --repeats >= 1, --rounds >= 1, batch sizes >= 1")

    result = run(args)
    out = {"benchmark": "signal_overhead", "args": vars(args), "environment": environment(), **result}
    path = write_json("signal_overhead", out, publish=None if args.quick else "signal_overhead")
    print("## Signal recording overhead (stock SGLang vs `--entropic signal` + return_entropy)\n")
    print(
        f"{args.tokens} new tokens, greedy, ignore_eos, {args.dtype} on {args.device}, {args.repeats} repeats x "
        f"{args.rounds} round(s) (ABBA), medians.\n"
    )
    print(table(result["summary"]))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
