"""The plugin's own time per decode step, as the server measures it, on each shipped model.

One server of ours per model (`--entropic full`, the default mode), and per batch size B, `--repeats`
batches of B concurrent requests, greedy or sampled at `--temperature` (short distinct prompts, `--tokens`
new tokens each, ignore_eos).
Between the first and the last batch the server's own account (`/server_info` -> plugin_time,
plugin/timing.py: the hook handlers' time against the decode step's wall time) gives the plugin's time
per decode step, the step's time and their ratio (the target: <= 2 %), with every hook's share, and beside them
the time of SGLang's n-gram matcher called from the plugin's handlers (each request's own trie, a call a row;
with `speculative.drafts` 'server' SGLang's one call a batch), which is SGLang's work, not counted as the plugin's.

    flock /tmp/sgl-heavy.lock .venv/bin/python benchmarks/plugin_share.py      # docs/data/plugin_share.json
    ... --dtype bfloat16 [--temperature 0.8] --publish plugin_share_bf16[_sampled]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from full_system import plugin_time, plugin_time_during  # noqa: E402

from sgl_entropic.model import prepare_model  # noqa: E402

TOPICS = ("rivers", "bridges", "volcanoes", "libraries", "orchards", "glaciers", "harbors", "deserts")


def measure(key: str, args) -> list[dict]:
    model = str(prepare_model(key))
    port = common.free_port()
    config = json.loads(args.entropic_config) if args.entropic_config else None
    common_args = common.sglang_common_args(model, "cpu", args.dtype, ["--max-total-tokens", "16384"])
    cmd = common.ours_command(port, common_args, "full", config)
    rows = []
    with common.start_server(f"plugin-share-{key}", cmd, port, common.server_env("cpu", stock=False)) as srv:
        for b in args.batch_sizes:
            payloads = [
                {
                    "text": f"Tell me about {TOPICS[i % len(TOPICS)]} number {i}.",
                    "sampling_params": {
                        "max_new_tokens": args.tokens,
                        "temperature": args.temperature,
                        "ignore_eos": True,
                    },
                }
                for i in range(b)
            ]
            common.require_ok(common.run_batch(srv.url, payloads, b), f"{key} warm-up")
            before = plugin_time(srv.info())
            for _ in range(args.repeats):
                common.require_ok(common.run_batch(srv.url, payloads, b), f"{key} B={b}")
            during = plugin_time_during(before, plugin_time(srv.info()))
            rows.append({"model": key, "batch": b, **during})
            common.log_line(
                f"{key} B={b}: plugin {during['mean_us_per_step'] / 1e3:.2f} ms of a "
                f"{during['mean_step_us'] / 1e3:.1f} ms step ({during['mean_share']:.2%})"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the sampler keeps the logits)")
    ap.add_argument("--entropic-config", default=None, help="JSON for the servers")
    ap.add_argument("--publish", default="plugin_share", help="docs/data/<name>.json")
    args = ap.parse_args()
    rows = [r for key in args.models.split(",") for r in measure(key, args)]
    print(
        "\n| model | batch | decode steps | plugin ms/step | step ms | share | SGLang's n-gram calls ms/step (not "
        "counted) | top hooks (ms/step) |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        top = sorted(((h["mean_us_per_step"] or 0.0, name) for name, h in r["hooks"].items()), reverse=True)[:3]
        print(
            f"| {r['model']} | {r['batch']} | {r['steps']} | {r['mean_us_per_step'] / 1e3:.2f} | "
            f"{r['mean_step_us'] / 1e3:.1f} | {r['mean_share']:.2%} | "
            f"{(r['sglang_us_per_step'].get('ngram') or 0.0) / 1e3:.2f} | "
            + ", ".join(f"{name} {us / 1e3:.2f}" for us, name in top)
            + " |"
        )
    path = common.write_json(
        "plugin_share",
        {"args": {**vars(args)}, "environment": common.environment(), "rows": rows},
        publish=args.publish,
    )
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
