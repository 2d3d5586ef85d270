"""Entropy-stabilised sampling: fixed temperature vs Mirostat v2 vs the entropic controller.

Claim tested: at the same mean per-step entropy, the entropic temperature controller
T_{t+1} = clip(T_t exp(-eta (H_t - H*)), T_min, T_max) lowers the variance of the per-step
entropy H_t by 15-20 % relative to a fixed temperature, without losing diversity.

One server of ours (`--entropic sampling`), the same prompts and the same per-prompt
sampling_seed for every configuration, in one run:
  (c) entropic controller at H* = --target nats (start temperature 1.0);
  (b) Mirostat v2 (tau in bits, eta);
  (a) fixed temperature, calibrated: a sweep of fixed temperatures, then the temperature whose
      mean per-step entropy matches (c)'s, found by interpolation (and refined by secant steps).
Entropies are those the server records: of the distribution actually sampled (after the
controller's temperature, after Mirostat's truncation), in nats. No ignore_eos, so requests stop
at EOS; "hit max" is the fraction that stopped on --max-tokens instead.

With deterministic inference (--deterministic auto: on with CUDA) the server runs
--enable-deterministic-inference so that sampling_seed really seeds each request's sampler: the
configurations then share their random numbers per prompt (common random numbers). SGLang ignores
sampling_seed otherwise, and refuses deterministic inference for its CPU attention backends, so
on CPU the seeds are sent but not enforced (the comparison is then unpaired, noisier).

    .venv/bin/python benchmarks/sampling_controllers.py                 # 32 prompts, 256 tokens
    .venv/bin/python benchmarks/sampling_controllers.py --quick         # tiny smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Batch,
    chat,
    data_name,
    default_device,
    environment,
    free_port,
    log_line,
    markdown_table,
    mean,
    ours_command,
    pvariance,
    require_ok,
    run_batch,
    server_env,
    sglang_common_args,
    start_server,
    write_json,
)

from sgl_entropic.model import MODELS, prepare_model  # noqa: E402

PROMPTS = [
    # stories
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Tell me a bedtime story about a brave little turtle.",
    "Write a story that begins with the sentence: The train never arrived.",
    "Write a fable about a fox and a crow, with a moral at the end.",
    "Describe a day in the life of a robot that works in a bakery.",
    "Write a poem about the ocean at night.",
    "Write a haiku sequence about the four seasons.",
    # explanations
    "Explain how photosynthesis works to a ten-year-old.",
    "Why is the sky blue? Explain briefly.",
    "Explain the difference between weather and climate.",
    "How does a refrigerator keep food cold?",
    "Explain what inflation is and why it matters.",
    "What causes the seasons on Earth?",
    "Explain how vaccines train the immune system.",
    "What is the difference between a virus and a bacterium?",
    # lists
    "List ten ideas for a rainy weekend at home.",
    "Give me a list of healthy snacks for work.",
    "List the planets of the solar system with one fact about each.",
    "What are five tips for learning a new language?",
    "Name some famous inventions of the 20th century and their inventors.",
    "List the steps to plant a tree.",
    # advice
    "How can I get better at waking up early?",
    "I have a job interview tomorrow. How should I prepare?",
    "What should I consider when adopting a dog?",
    "How can I save money on groceries?",
    "Give me advice on how to stay focused while studying.",
    "How do I politely decline an invitation from a friend?",
    # code
    "Write a Python function that checks whether a string is a palindrome.",
    "How do I reverse a list in Python?",
    "Explain what a for loop is, with an example in JavaScript.",
    "Write a SQL query that counts the orders per customer.",
    "What is the difference between a list and a tuple in Python?",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    # misc / open
    "Describe your ideal vacation.",
    "What would happen if humans could photosynthesize?",
    "Write a product description for a reusable water bottle.",
    "Compare cats and dogs as pets.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Write a friendly email inviting colleagues to a team lunch.",
    "What are the pros and cons of working from home?",
]


# ---------------------------------------------------------------------------- requests


def prompt(args, question: str) -> str:
    """An instruct model's chat wrapping; a base model gets plain question-answer text."""
    return chat(question) if MODELS[args.model].chat else f"Question: {question}\nAnswer:"


def payloads(args, temperature: float, entropic: dict | None) -> list[dict]:
    out = []
    for i, q in enumerate(PROMPTS[: args.prompts]):
        sp = {"max_new_tokens": args.max_tokens, "temperature": temperature, "sampling_seed": args.seed + i}
        if entropic is not None:
            sp["custom_params"] = {"entropic": entropic}
        out.append({"text": prompt(args, q), "sampling_params": sp, "return_entropy": True})
    return out


def run_config(url: str, args, name: str, temperature: float, entropic: dict | None) -> dict:
    batch = require_ok(run_batch(url, payloads(args, temperature, entropic), args.concurrency, args.timeout), name)
    stats = config_stats(batch)
    stats.update(name=name, request_temperature=temperature, entropic=entropic)
    log_line(
        f"{name}: mean H {stats['mean_entropy']:.3f}, var {stats['var_entropy']:.3f}, "
        f"{stats['tokens_per_s']:.1f} tok/s, {stats['completion_tokens']} tokens"
    )
    return stats


# ---------------------------------------------------------------------------- statistics


def distinct_n(ids: list[int], n: int) -> float | None:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def config_stats(batch: Batch) -> dict:
    per_request = []
    pooled: list[float] = []
    temps: list[float] = []
    for r in batch.results:
        h = [x for x in (r.meta.get("entropy") or []) if x is not None]
        if len(h) != r.completion_tokens:
            log_line(f"warning: {len(h)} finite entropies for {r.completion_tokens} tokens")
        pooled += h
        temps += [t for t in (r.meta.get("temperature") or []) if t is not None]
        ids = r.output_ids
        finish = r.meta.get("finish_reason") or {}
        per_request.append(
            {
                "tokens": r.completion_tokens,
                "mean_entropy": mean(h),
                "var_entropy": pvariance(h),
                "distinct_2": distinct_n(ids, 2),
                "distinct_3": distinct_n(ids, 3),
                "finish": finish.get("type") if isinstance(finish, dict) else finish,
                "mean_temperature": mean(r.meta.get("temperature") or []),
                "entropic_time": r.meta.get("entropic_time"),
            }
        )
    var_req = [p["var_entropy"] for p in per_request if p["tokens"] >= 2]
    return {
        "n_requests": len(per_request),
        "completion_tokens": batch.completion_tokens,
        "mean_tokens": mean(p["tokens"] for p in per_request),
        "wall_s": batch.wall_s,
        "tokens_per_s": batch.tokens_per_s,
        "mean_entropy": mean(pooled),
        "var_entropy": pvariance(pooled),
        "mean_request_var_entropy": mean(var_req),
        "distinct_2": mean(p["distinct_2"] for p in per_request if p["distinct_2"] is not None),
        "distinct_3": mean(p["distinct_3"] for p in per_request if p["distinct_3"] is not None),
        "frac_hit_max": mean(1.0 if p["finish"] == "length" else 0.0 for p in per_request),
        "mean_temperature": mean(temps),
        "std_temperature": pvariance(temps) ** 0.5 if len(temps) > 1 else float("nan"),
        "per_request": per_request,
    }


# ---------------------------------------------------------------------------- calibration


def interpolate_temperature(points: list[tuple[float, float]], target_h: float, t_lo: float, t_hi: float):
    """T with mean entropy target_h, linear between the bracketing (T, H) points (else extrapolated)."""
    pts = sorted(points)
    for (t0, h0), (t1, h1) in zip(pts, pts[1:]):
        if min(h0, h1) <= target_h <= max(h0, h1) and h1 != h0:
            return t0 + (target_h - h0) * (t1 - t0) / (h1 - h0), True
    # outside the sweep: extrapolate from the two points nearest in entropy
    (t0, h0), (t1, h1) = sorted(pts, key=lambda p: abs(p[1] - target_h))[:2]
    if h1 == h0:
        return t0, False
    t = t0 + (target_h - h0) * (t1 - t0) / (h1 - h0)
    return min(max(t, t_lo), t_hi), False


def interpolate_at_entropy(runs: list[dict], target_h: float, key: str) -> float:
    """A fixed-temperature statistic at exactly the target mean entropy, linear in mean entropy."""
    pts = sorted((r["mean_entropy"], r[key]) for r in runs)
    for (h0, v0), (h1, v1) in zip(pts, pts[1:]):
        if h0 <= target_h <= h1 and h1 > h0:
            return v0 + (target_h - h0) * (v1 - v0) / (h1 - h0)
    return float("nan")  # not bracketed: no extrapolation of a variance


def rel(x: float, ref: float) -> float:
    return x / ref - 1 if ref and ref == ref and x == x else float("nan")


# ---------------------------------------------------------------------------- run


def run(args) -> dict:
    model = args.model_path or str(prepare_model(args.model))
    extra = list(args.server_arg)
    if args.deterministic:
        extra.append("--enable-deterministic-inference")
    common = sglang_common_args(model, args.device, args.dtype, extra)
    port = free_port()
    cmd = ours_command(port, common, mode="sampling")
    with start_server("sampling", cmd, port, server_env(args.device, stock=False), args.startup_timeout) as srv:
        info = srv.info().get("entropic") or {}
        if info.get("mode") != "sampling" or not info.get("plugin_loaded_in_scheduler"):
            raise RuntimeError(f"plugin not active in sampling mode: {info!r}")
        # warm-up, discarded
        require_ok(
            run_batch(
                srv.url, [{"text": prompt(args, "Hello!"), "sampling_params": {"max_new_tokens": 8}}], 1, args.timeout
            ),
            "warm-up",
        )

        entropic_params = {"target_entropy": args.target, "eta": args.eta}
        mirostat_params = {"controller": "mirostat_v2", "tau": args.tau, "eta": args.mirostat_eta}
        entropic = run_config(srv.url, args, "entropic", 1.0, entropic_params)
        mirostat = run_config(srv.url, args, "mirostat_v2", 1.0, mirostat_params)

        sweep = [run_config(srv.url, args, f"fixed T={t:g}", t, None) for t in args.temps]
        target_h = entropic["mean_entropy"]
        fixed_runs = list(sweep)
        calibration = []
        for it in range(args.calib_iters):
            t, bracketed = interpolate_temperature(
                [(r["request_temperature"], r["mean_entropy"]) for r in fixed_runs], target_h, 0.05, 3.0
            )
            t = round(t, 4)
            if any(abs(r["request_temperature"] - t) < 1e-4 for r in fixed_runs):
                break
            matched_run = run_config(srv.url, args, f"fixed T={t:g} (matched, iter {it})", t, None)
            fixed_runs.append(matched_run)
            calibration.append(
                {"iteration": it, "temperature": t, "bracketed": bracketed, "mean_entropy": matched_run["mean_entropy"]}
            )
        matched = min(fixed_runs, key=lambda r: abs(r["mean_entropy"] - target_h))

    ref_var, ref_req_var = matched["var_entropy"], matched["mean_request_var_entropy"]
    interp_var = interpolate_at_entropy(fixed_runs, target_h, "var_entropy")
    interp_req_var = interpolate_at_entropy(fixed_runs, target_h, "mean_request_var_entropy")
    rows = {"fixed (matched)": matched, "mirostat_v2": mirostat, "entropic": entropic}
    for r in rows.values():
        r["rel_var_vs_matched"] = rel(r["var_entropy"], ref_var)
        r["rel_request_var_vs_matched"] = rel(r["mean_request_var_entropy"], ref_req_var)
    return {
        "server_command": cmd,
        "server_log": str(srv.log),
        "entropic_info": info,
        "target_mean_entropy": target_h,
        "matched_temperature": matched["request_temperature"],
        "matched_entropy_gap": matched["mean_entropy"] - target_h,
        "calibration": calibration,
        "sweep": [_brief(r) for r in sweep],
        "fixed_runs": fixed_runs,
        "interpolated_fixed_at_target": {
            "var_entropy": interp_var,
            "mean_request_var_entropy": interp_req_var,
            "entropic_rel_var": rel(entropic["var_entropy"], interp_var),
            "entropic_rel_request_var": rel(entropic["mean_request_var_entropy"], interp_req_var),
        },
        "configs": rows,
    }


def _brief(r: dict) -> dict:
    return {
        k: r[k]
        for k in (
            "request_temperature",
            "mean_entropy",
            "var_entropy",
            "mean_request_var_entropy",
            "distinct_2",
            "distinct_3",
            "frac_hit_max",
            "mean_tokens",
            "tokens_per_s",
        )
    }


def tables(res: dict) -> str:
    headers = [
        "config",
        "params",
        "mean H",
        "var H (pooled)",
        "rel var vs fixed",
        "mean per-req var",
        "rel per-req var",
        "distinct-2",
        "distinct-3",
        "hit max",
        "mean tokens",
        "tok/s",
    ]
    rows = []
    for name, r in res["configs"].items():
        if name.startswith("fixed"):
            params = f"T={r['request_temperature']:g}"
        elif name == "entropic":
            params = f"H*={r['entropic']['target_entropy']:g}, eta={r['entropic']['eta']:g}"
        else:
            params = f"tau={r['entropic']['tau']:g} bits, eta={r['entropic']['eta']:g}"
        rows.append(
            [
                name,
                params,
                r["mean_entropy"],
                r["var_entropy"],
                f"{r['rel_var_vs_matched']:+.1%}",
                r["mean_request_var_entropy"],
                f"{r['rel_request_var_vs_matched']:+.1%}",
                r["distinct_2"],
                r["distinct_3"],
                f"{r['frac_hit_max']:.0%}",
                r["mean_tokens"],
                r["tokens_per_s"],
            ]
        )
    main = markdown_table(headers, rows)
    sweep = markdown_table(
        ["fixed T", "mean H", "var H", "mean per-req var", "distinct-2", "distinct-3", "hit max", "tok/s"],
        [
            [
                r["request_temperature"],
                r["mean_entropy"],
                r["var_entropy"],
                r["mean_request_var_entropy"],
                r["distinct_2"],
                r["distinct_3"],
                f"{r['frac_hit_max']:.0%}",
                r["tokens_per_s"],
            ]
            for r in sorted(res["fixed_runs"], key=lambda r: r["request_temperature"])
        ],
    )
    interp = res["interpolated_fixed_at_target"]
    lines = [
        main,
        "",
        f"Matched fixed temperature: T = {res['matched_temperature']:.4g} "
        f"(mean H gap to the controller: {res['matched_entropy_gap']:+.3f} nats).",
        f"Fixed temperature interpolated to exactly mean H = {res['target_mean_entropy']:.3f}: var {interp['var_entropy']:.4g}"
        f" -> entropic {interp['entropic_rel_var']:+.1%}; per-request var {interp['mean_request_var_entropy']:.4g}"
        f" -> entropic {interp['entropic_rel_request_var']:+.1%} (n/a when the sweep does not bracket it).",
        "",
        "Fixed-temperature runs (sweep + calibration):",
        "",
        sweep,
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32, help=f"number of prompts (max {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--target", type=float, default=2.0, help="entropic controller target H* (nats)")
    ap.add_argument("--eta", type=float, default=0.2, help="entropic controller gain")
    ap.add_argument("--tau", type=float, default=5.0, help="Mirostat v2 target surprise (bits)")
    ap.add_argument("--mirostat-eta", type=float, default=0.1)
    ap.add_argument("--temps", default="0.6,0.8,1.0,1.2", help="fixed-temperature sweep")
    ap.add_argument("--calib-iters", type=int, default=2, help="matched-temperature runs (interpolation, then secant)")
    ap.add_argument("--seed", type=int, default=1234, help="sampling_seed of prompt i is seed + i, in every config")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--deterministic",
        choices=("auto", "on", "off"),
        default="auto",
        help="pass --enable-deterministic-inference so that sampling_seed takes effect; auto = on with "
        "CUDA, off on CPU (SGLang 0.5.23 refuses it for the CPU attention backends)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="a shipped model (sgl_entropic.model.MODELS); another "
        "than the bundled one publishes docs/data/sampling_controllers_<model>.json; a base model "
        "gets each prompt as 'Question: ...\\nAnswer:' instead of the chat wrapping",
    )
    ap.add_argument("--model-path", default=None, help="any other model folder (overrides --model)")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra sglang flag (repeatable; use --server-arg=--flag --server-arg=value)",
    )
    ap.add_argument("--timeout", type=float, default=1200, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 2 prompts, 8 tokens, T in {0.7, 1.2}")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.temps, args.calib_iters, args.concurrency = 2, 8, "0.7,1.2", 1, 2
    args.temps = [float(t) for t in str(args.temps).split(",") if t.strip()]
    args.device = args.device or default_device()
    args.deterministic = args.deterministic == "on" or (args.deterministic == "auto" and args.device == "cuda")
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    if len(args.temps) < 2:
        ap.error("--temps needs at least two temperatures")

    res = run(args)
    out = {"benchmark": "sampling_controllers", "args": vars(args), "environment": environment(), **res}
    name = "sampling_controllers" if args.model_path else data_name("sampling_controllers", args.model)
    path = write_json(name, out, publish=None if args.quick else name)
    print("## Entropy-stabilised sampling: fixed T (matched mean entropy) vs Mirostat v2 vs entropic\n")
    print(
        f"{args.prompts} chat prompts, max {args.max_tokens} new tokens (no ignore_eos), same sampling_seed per "
        f"prompt in every config{'' if args.deterministic else ' (NOT enforced: no deterministic inference, SGLang ignores the seed)'}, "
        f"{args.dtype} on {args.device}. H in nats, per decoded step; variance relative to the matched fixed T.\n"
    )
    print(tables(res))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
