"""The docs' figures, drawn from the committed measurements in docs/data/: one command redraws them all.

    .venv/bin/python benchmarks/figures.py [--data docs/data] [--out docs/figures]

writes PNGs into docs/figures/:
  - entropy_traces.png    H_t per step, controller against a fixed temperature (docs/data/entropy_traces.json,
                          from benchmarks/entropy_traces.py)
  - plugin_time.png       the plugin's own time per decode step per mode, and each round's throughput
                          ratio to stock (docs/data/plugin_overhead.json, from benchmarks/full_system.py)
  - sparse_quality.png    kept share against KL to dense, per selection variant (docs/data/sparse_quality.json, from
                          benchmarks/sparse_quality.py)
  - attention_pruning.png decode tok/s of stock, our kernel over every page, and pruned (docs/data/attention_pruning.json,
                          from benchmarks/attention_pruning.py)
  - speculative_decoding.png output tok/s against stock per workload and batch size, per configuration
                          (docs/data/speculative_decoding.json, from benchmarks/speculative_decoding.py)
A figure whose input is absent is skipped with a message naming the file it needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA, FIGURES = ROOT / "docs" / "data", ROOT / "docs" / "figures"
MODES = ("sampling", "scheduling", "pruning", "full")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: same data, same bytes
    plt.close(fig)
    return path


def entropy_traces(data: dict, out: Path) -> Path:
    """One panel per prompt: H_t of the controlled request and of the fixed-temperature one, and H*."""
    prompts = list(dict.fromkeys(t["prompt"] for t in data["traces"]))
    fig, axes = plt.subplots(len(prompts), 1, figsize=(8, 2.4 * len(prompts)), sharex=True, squeeze=False)
    for ax, prompt in zip(axes[:, 0], prompts):
        for t in (t for t in data["traces"] if t["prompt"] == prompt):
            h = [float("nan") if v is None else v for v in t["entropy"]]
            label = (
                f"controller (H* = {data['target_entropy']:g})"
                if t["controller"]
                else f"fixed T = {data['fixed_temperature']:g}"
            )
            ax.plot(
                range(1, len(h) + 1),
                h,
                lw=1.1,
                color="tab:blue" if t["controller"] else "tab:gray",
                label=f"{label}: var {statistics.pvariance([v for v in h if v == v]):.2f}",
            )
        ax.axhline(data["target_entropy"], color="tab:red", ls="--", lw=1, label="target H*")
        ax.set_title(prompt if len(prompt) < 70 else prompt[:67] + "...", fontsize=9)
        ax.set_ylabel("H_t (nats)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("decode step")
    return _save(fig, out / "entropy_traces.png")


def plugin_time(data: dict, out: Path) -> Path:
    """Left: the plugin's time per decode step per mode, stacked by hook, its share on top.
    Right: each round's output throughput ratio to that round's stock server, per mode."""
    summary = data["plugin_time"]["short"]
    modes = [m for m in MODES if m in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    hooks = sorted(
        {h for m in modes for h in summary[m]["hooks_us_per_step"]},
        key=lambda h: -max(summary[m]["hooks_us_per_step"].get(h, 0.0) for m in modes),
    )
    shown, rest = hooks[:7], hooks[7:]
    cmap = plt.get_cmap("tab10")
    bottom = [0.0] * len(modes)
    for k, hook in enumerate(shown + (["other hooks"] if rest else [])):
        names = rest if hook == "other hooks" else [hook]
        vals = [sum(summary[m]["hooks_us_per_step"].get(n, 0.0) for n in names) for m in modes]
        left.bar(modes, vals, bottom=bottom, color=cmap(k % 10), label=hook)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, m in enumerate(modes):
        s = summary[m]
        left.text(
            i,
            bottom[i],
            f"{100 * s['mean_share']['median']:.2f} %\nof {s['mean_step_us']['median'] / 1e3:.0f} ms",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    left.set_ylim(0, max(bottom) * 1.75)  # room for the legend above the bars
    left.set_ylabel("plugin time per decode step (us, median over rounds)")
    left.legend(fontsize=6.5, loc="upper center", ncol=2)
    left.set_title("The plugin's own time (measured in each server)", fontsize=10)

    ratios = {
        m: [
            r["output_throughput"] / s["output_throughput"]
            for r in data["runs"]
            for s in data["runs"]
            if r["config"] == m
            and s["config"] == "stock"
            and r["round"] == s["round"]
            and r["workload"] == s["workload"] == "short"
        ]
        for m in modes
    }
    for i, m in enumerate(modes):
        right.scatter([i] * len(ratios[m]), ratios[m], color="tab:blue", s=18, zorder=3)
        if ratios[m]:
            right.hlines(statistics.median(ratios[m]), i - 0.25, i + 0.25, color="black")
    right.axhline(1.0, color="tab:red", ls="--", lw=1)
    right.set_xticks(range(len(modes)), modes)
    right.set_ylabel("output tok/s / stock's, same round")
    right.set_title("Per round against stock (bar: median)", fontsize=10)
    return _save(fig, out / "plugin_time.png")


def sparse_quality(data: dict, out: Path) -> Path:
    """Kept share of the context against KL to dense, one colour per selection variant, one marker per context."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    cmap, markers = plt.get_cmap("tab10"), "osD^v<>"
    contexts = sorted({int(c) for per in data["quality"].values() for c in per})
    for k, (variant, per) in enumerate(data["quality"].items()):
        for ctx, s in per.items():
            ax.scatter(
                s["kept_share"],
                max(s["kl_mean"], 1e-6),
                color=cmap(k % 10),
                marker=markers[contexts.index(int(ctx)) % len(markers)],
                s=36,
            )
        ax.scatter([], [], color=cmap(k % 10), label=variant)  # one legend entry per variant
    for j, ctx in enumerate(contexts):
        ax.scatter([], [], color="black", marker=markers[j % len(markers)], label=f"{ctx}k tokens")
    ax.set_yscale("log")
    ax.set_xlabel("kept share of the context")
    ax.set_ylabel("KL to dense, mean (nats)")
    ax.set_title("Sparse decode quality per selection variant (teacher-forced)", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, out / "sparse_quality.png")


def attention_pruning(data: dict, out: Path) -> Path:
    """Decode tok/s per context and batch: stock, our kernel over every page, pruned; medians, min-max whiskers."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.2))
    width, colors = 0.27, {"stock": "tab:gray", "kernel": "tab:orange", "ours": "tab:blue"}
    labels = {"stock": "stock SGLang", "kernel": "our kernel, every page", "ours": "ours, pruned"}
    for j, cfg in enumerate(("stock", "kernel", "ours")):
        vals = [r["decode_tok_s"][cfg] for r in rows]
        med = [statistics.median(v) for v in vals]
        err = [[m - min(v) for m, v in zip(med, vals)], [max(v) - m for m, v in zip(med, vals)]]
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=colors[cfg], label=labels[cfg])
    for i, r in enumerate(rows):
        top = max(max(r["decode_tok_s"][c]) for c in colors)
        ax.text(
            i,
            top,
            f"x{statistics.median(r['decode_speedup']):.2f}\n(kernel x{statistics.median(r['kernel_speedup']):.2f},"
            f"\npruning x{statistics.median(r['pruning_speedup']):.2f})",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(rows)), [f"{r['context'] / 1000:g}k, batch {r['batch']}" for r in rows])
    ax.set_ylim(0, max(max(max(r["decode_tok_s"][c]) for c in colors) for r in rows) * 1.45)
    ax.set_ylabel("decode tok/s (median over rounds)")
    ax.set_title("Decode speed: what the kernel buys and what pruning buys", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, out / "attention_pruning.png")


def speculative_decoding(data: dict, out: Path) -> Path:
    """Per workload and batch size, each configuration's output tok/s over stock's in the same round: medians with
    min-max whiskers; the dashed line is stock."""
    configs = [c for c in data["configs"] if c != "stock"]
    keys = list(data["summary"])
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(keys)), 4.2))
    width = 0.8 / len(configs)
    cmap = plt.get_cmap("tab10")
    for j, config in enumerate(configs):
        cells = [data["summary"][k].get(config, {}).get("tok_s", {}).get("vs_stock") for k in keys]
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(keys))]
        med = [c["median"] if c else 0.0 for c in cells]
        err = [
            [c["median"] - c["min"] if c else 0.0 for c in cells],
            [c["max"] - c["median"] if c else 0.0 for c in cells],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=cmap(j), label=config)
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_xticks(range(len(keys)), [k.replace("-B", ", batch ") for k in keys])
    ax.set_ylabel("output tok/s / stock's (same round)")
    ax.set_title("Speculative decoding under the plugin against stock SGLang", fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    return _save(fig, out / "speculative_decoding.png")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="the folder of the benchmarks' JSON files")
    ap.add_argument("--out", type=Path, default=FIGURES)
    args = ap.parse_args(argv)
    jobs: list[tuple[Callable[[dict, Path], Path], Path]] = [
        (draw, args.data / f"{name}.json")
        for draw, name in (
            (entropy_traces, "entropy_traces"),
            (plugin_time, "plugin_overhead"),
            (sparse_quality, "sparse_quality"),
            (attention_pruning, "attention_pruning"),
            (speculative_decoding, "speculative_decoding"),
        )
    ]
    for draw, path in jobs:
        if not path.exists():
            print(f"skipped {draw.__name__}.png: no input ({path})", file=sys.stderr)
            continue
        print(f"wrote {draw(json.loads(path.read_text()), args.out)} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
