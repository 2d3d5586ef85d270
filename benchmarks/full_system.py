"""Every entropic mode against stock SGLang, with load from SGLang's own client.

Each round starts one server per configuration (stock `sglang.launch_server`, then ours with
`--entropic <mode>`), in an order rotated per round, and drives each workload with
`python -m sglang.benchmark.serving` (its warm-up request first, `--flush-cache` before each
workload). Results per workload and configuration: output tok/s, p50/p99 end-to-end latency,
p50 TTFT, p50 inter-token latency; medians over rounds with min-max, and each round's ratio to
the stock server of the same round. For every entropic server, the plugin's own time per decode
step during each workload, as the server measured it (`/server_info` -> plugin_time, plugin/timing.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Optional

import common

# The bench client's own workloads (random token ids: exact lengths, no download).
WORKLOADS = {
    "short": [
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        "256",
        "--random-output-len",
        "128",
        "--random-range-ratio",
        "1.0",
        "--max-concurrency",
        "8",
    ],
    "long": [
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        "4096",
        "--random-output-len",
        "128",
        "--random-range-ratio",
        "1.0",
        "--max-concurrency",
        "4",
    ],
    "shared-prefix": [
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-system-prompt-len",
        "2048",
        "--gsp-question-len",
        "128",
        "--gsp-output-len",
        "128",
        "--gsp-range-ratio",
        "1.0",
        "--max-concurrency",
        "4",
    ],
}
METRICS = ("output_throughput", "median_e2e_latency_ms", "p99_e2e_latency_ms", "median_ttft_ms", "median_itl_ms")
CONFIGS = ("stock", "sampling", "scheduling", "pruning", "full")


def bench(url: str, model: str, workload: str, num_prompts: int, groups: int, seed: int) -> dict:
    """One run of SGLang's bench client; its JSON line."""
    args = [
        "--backend",
        "sglang",
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--warmup-requests",
        "1",
        "--flush-cache",
        "--disable-tqdm",
        *WORKLOADS[workload],
    ]
    if workload == "shared-prefix":
        args += ["--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(max(1, num_prompts // groups))]
    with tempfile.TemporaryDirectory() as tmp:
        result = common.bench_client(url, model, args, Path(tmp) / "bench.jsonl")
    if result["completed"] < num_prompts:
        raise RuntimeError(f"{workload}: only {result['completed']} of {num_prompts} requests completed")
    return {k: result[k] for k in (*METRICS, "completed", "total_output_tokens", "duration")}


def plugin_time(info: dict) -> Optional[dict]:
    """The scheduler's plugin_time section (None on stock)."""
    states = info.get("internal_states") or [{}]
    return (states[0].get("entropic") or {}).get("plugin_time")


def plugin_time_during(before: dict, after: dict) -> dict:
    """What the server measured between two plugin_time reports (they accumulate over its life)."""
    steps = after["steps"] - before["steps"]

    def total(section: dict, key: str, n: int) -> float:
        return (section[key] or 0.0) * n

    def per_step(key_before: float, key_after: float) -> Optional[float]:
        return (key_after - key_before) / steps if steps else None

    hooks = {}
    for name, h in after["hooks"].items():
        b = before["hooks"].get(name, {"calls": 0, "mean_us_per_step": 0.0})
        hooks[name] = {
            "calls": h["calls"] - b["calls"],
            "mean_us_per_step": per_step(
                total(b, "mean_us_per_step", before["steps"]), total(h, "mean_us_per_step", after["steps"])
            ),
        }
    named_before, named_after = before.get("sglang_us_per_step") or {}, after.get("sglang_us_per_step") or {}
    return {
        "steps": steps,
        "hooks": hooks,
        **{
            k: per_step(total(before, k, before["steps"]), total(after, k, after["steps"]))
            for k in ("mean_us_per_step", "mean_step_us", "mean_share")
        },
        # SGLang's work the plugin's handlers call (not the plugin's time), e.g. its n-gram matcher
        "sglang_us_per_step": {
            label: per_step((named_before.get(label) or 0.0) * before["steps"], (us or 0.0) * after["steps"])
            for label, us in named_after.items()
        },
    }


def summarize_plugin_time(runs: list[dict], configs: list[str], workloads: list[str]) -> tuple[dict, str]:
    """Per workload and mode: the plugin's time per decode step and its share, median (min-max) over rounds."""
    summary: dict = {}
    rows = []
    for w in workloads:
        for c in configs:
            mine = [r["plugin_time"] for r in runs if r["workload"] == w and r["config"] == c and r.get("plugin_time")]
            mine = [p for p in mine if p["steps"]]
            if not mine:
                continue
            entry = {
                k: {
                    "median": common.median([p[k] for p in mine]),
                    "min": min(p[k] for p in mine),
                    "max": max(p[k] for p in mine),
                }
                for k in ("mean_us_per_step", "mean_step_us", "mean_share")
            }
            names = sorted({n for p in mine for n in p["hooks"]})
            entry["hooks_us_per_step"] = {
                n: common.median([p["hooks"][n]["mean_us_per_step"] or 0.0 for p in mine if n in p["hooks"]])
                for n in names
            }
            entry["rounds"], entry["steps"] = len(mine), sum(p["steps"] for p in mine)
            summary.setdefault(w, {})[c] = entry
            top = sorted(entry["hooks_us_per_step"].items(), key=lambda kv: -kv[1])[:3]
            rows.append(
                [
                    w,
                    c,
                    len(mine),
                    entry["steps"],
                    _cell(entry["mean_us_per_step"]),
                    f"{entry['mean_step_us']['median'] / 1e3:.1f}",
                    f"{100 * entry['mean_share']['median']:.2f} % ({100 * entry['mean_share']['min']:.2f}-"
                    f"{100 * entry['mean_share']['max']:.2f})",
                    ", ".join(f"{n} {us:.0f}" for n, us in top),
                ]
            )
    return summary, common.markdown_table(
        [
            "workload",
            "config",
            "rounds",
            "decode steps",
            "plugin us/step",
            "step ms",
            "plugin share",
            "top hooks (us/step)",
        ],
        rows,
    )


def summarize(runs: list[dict], configs: list[str], workloads: list[str]) -> tuple[dict, str]:
    """Median and min-max per metric over rounds, and the per-round ratio to stock of that round."""
    summary: dict = {}
    text = []
    for w in workloads:
        rows = []
        summary[w] = {}
        for c in configs:
            mine = [r for r in runs if r["workload"] == w and r["config"] == c]
            if not mine:
                continue
            entry = {}
            for m in METRICS:
                vals = [r[m] for r in mine]
                ratios = [
                    r[m] / s[m]
                    for r in mine
                    for s in runs
                    if s["workload"] == w and s["config"] == "stock" and s["round"] == r["round"] and s[m]
                ]
                entry[m] = {"median": common.median(vals), "min": min(vals), "max": max(vals)}
                if ratios:
                    entry[m]["vs_stock"] = {"median": common.median(ratios), "min": min(ratios), "max": max(ratios)}
            summary[w][c] = entry
            rows.append([c, len(mine)] + [_cell(entry[m]) for m in METRICS])
        text.append(
            f"### {w}\n\n"
            + common.markdown_table(
                ["config", "rounds", "out tok/s", "p50 E2E ms", "p99 E2E ms", "p50 TTFT ms", "p50 ITL ms"], rows
            )
        )
    return summary, "\n\n".join(text)


def _cell(e: dict) -> str:
    f = (lambda v: f"{v:.0f}") if e["max"] >= 100 else (lambda v: f"{v:.1f}")
    s = f"{f(e['median'])} ({f(e['min'])}-{f(e['max'])})"
    r = e.get("vs_stock")
    if r and (r["min"], r["max"]) != (1.0, 1.0):  # stock against itself is 1
        s += f"; x{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="a shipped model (sgl_entropic.model.MODELS); another "
        "than the bundled one publishes docs/data/plugin_overhead_<model>.json",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="short,long,shared-prefix")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="stock is always run")
    ap.add_argument(
        "--once",
        default="",
        help="configurations that run in one round each (the i-th in round i mod rounds), e.g. to read "
        "each mode's plugin time without a server per mode per round",
    )
    ap.add_argument(
        "--long-configs",
        default="stock,full",
        help="configurations that run the long and shared-prefix workloads (slow on a CPU)",
    )
    ap.add_argument("--prompts", default="short:32,long:8,shared-prefix:16")
    ap.add_argument("--groups", type=int, default=4, help="shared-prefix: system prompts")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--entropic-config", default=None, help="JSON for every entropic server")
    ap.add_argument("--quick", action="store_true", help="1 round, few prompts, short workload only")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.workloads, args.prompts = 1, "short", "short:8"
    workloads = args.workloads.split(",")
    configs = ["stock"] + [c for c in args.configs.split(",") if c != "stock"]
    once = [c for c in args.once.split(",") if c and c not in configs]
    long_configs = set(args.long_configs.split(",")) | {"stock"}
    prompts = {k: int(v) for k, v in (p.split(":") for p in args.prompts.split(","))}
    extra = json.loads(args.entropic_config) if args.entropic_config else None

    device = common.default_device()
    from sgl_entropic.model import prepare_model

    model = str(prepare_model(args.model))
    common_args = common.sglang_common_args(model, device, args.dtype)
    runs, infos = [], {}
    for rnd in range(args.rounds):
        order = configs + [c for i, c in enumerate(once) if i % args.rounds == rnd]
        order = order[rnd % len(order) :] + order[: rnd % len(order)]
        for config in order:
            port = common.free_port()
            cmd = (
                common.stock_command(port, common_args)
                if config == "stock"
                else common.ours_command(port, common_args, config, extra)
            )
            with common.start_server(config, cmd, port, common.server_env(device, stock=config == "stock")) as srv:
                info = srv.info()
                if (config == "stock") != ("entropic" not in info):
                    raise RuntimeError(f"{config}: /server_info does not match the configuration")
                for w in workloads:
                    if w != "short" and config not in long_configs:
                        continue
                    before = plugin_time(srv.info())
                    r = bench(srv.url, model, w, prompts[w], args.groups, seed=1000 + rnd)
                    after = plugin_time(srv.info())
                    if before is not None and after is not None:
                        r["plugin_time"] = plugin_time_during(before, after)
                    runs.append({"round": rnd, "config": config, "workload": w, **r})
                    pt = r.get("plugin_time")
                    common.log_line(
                        f"round {rnd} {config} {w}: {r['output_throughput']:.1f} tok/s, "
                        f"p50 E2E {r['median_e2e_latency_ms']:.0f} ms"
                        + (
                            f", plugin {pt['mean_us_per_step']:.0f} us/decode step ({100 * pt['mean_share']:.2f} %)"
                            if pt and pt["steps"]
                            else ""
                        )
                    )
                infos[f"{config}/{rnd}"] = srv.info().get("entropic")
    configs += once
    summary, table = summarize(runs, configs, workloads)
    plugin_summary, plugin_table = summarize_plugin_time(runs, configs, workloads)
    print(table + "\n\n### the plugin's own time per decode step (measured in each server)\n\n" + plugin_table)
    name = common.data_name("plugin_overhead", args.model)
    path = common.write_json(
        "full_system",
        {
            "args": vars(args),
            "environment": common.environment(),
            "runs": runs,
            "summary": summary,
            "plugin_time": plugin_summary,
            "entropic_server_info": infos,
        },
        publish=None if args.quick else name,
    )
    common.log_line(f"wrote {path.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
