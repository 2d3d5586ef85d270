"""Speed of sparse decode (the meso loop) against stock SGLang, end to end, in the same run, each
speedup split into what our attention kernel buys and what pruning buys.

Three servers, ONE AT A TIME, same model, dtype, KV pool and chunked prefill: stock
`python -m sglang.launch_server` (torch_native attention, its default page size); `kernel`, ours with
`--entropic pruning` keeping every page (no step prunes: steps run our batched kernel over every page
where its start-up probe timed it faster than SGLang's loop, else SGLang's loop, as /server_info's
`dense_kernel_from` says); and `ours`, `--entropic pruning` with the default config (or
--entropic-config). --rounds rounds, the order rotated every round, each server warmed up first. For
every context L in --contexts and batch B in --batches, B concurrent greedy requests continue B distinct
windows of real text (Python source and essays) for --tokens new tokens (ignore_eos), streamed:
  - decode tok/s = B * (N - 1) / (end of the last stream - latest first-token time)
  - TTFT         = mean first streamed token (the prefill; ours also folds keys into page bounds)
  - kept share   = ours' per-token `attended` traces (what the plan attended); KV bytes read and
                   attention FLOPs per decode token add the keys of the shortlist the exact rescoring
                   reads (sgl_entropic.pruning.row_pages at the mid context)
Reported: medians over rounds with min-max of ours/stock (the total), kernel/stock (the kernel) and
ours/kernel (pruning) per round; total = kernel x pruning within a round.

    .venv/bin/python benchmarks/attention_pruning.py                  # full run (~80 min, 2 cores)
    .venv/bin/python benchmarks/attention_pruning.py --quick          # smoke run
    .venv/bin/python benchmarks/attention_pruning.py --model gemma3-270m --contexts 8000,16000 --batches 1
                                                  # the second model (docs/data/attention_pruning_gemma3-270m.json)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    data_name,
    default_device,
    environment,
    free_port,
    log_line,
    markdown_table,
    ours_command,
    server_env,
    sglang_common_args,
    start_server,
    stock_command,
    stream_one,
    write_json,
)
import requests  # noqa: E402

from sgl_entropic.config import PruningConfig  # noqa: E402
from sgl_entropic.model import prepare_model  # noqa: E402
from sgl_entropic.pruning import row_pages  # noqa: E402


def code_corpus() -> str:
    import sglang.srt.managers.scheduler as scheduler

    return Path(scheduler.__file__).read_text()


def code_windows(corpus_ids: list[int], tokens: int, count: int, seed: int) -> list[list[int]]:
    """`count` distinct windows of `tokens` corpus tokens (distinct starts: no radix sharing)."""
    rng = random.Random(seed)
    span = len(corpus_ids) - tokens
    if span <= count:
        raise ValueError(f"corpus of {len(corpus_ids)} tokens is too short for {count} windows of {tokens}")
    starts = rng.sample(range(span), count)
    return [corpus_ids[s : s + tokens] for s in starts]


def text_windows(tokenizer, tokens: int, count: int, seed: int) -> list[list[int]]:
    """Half source code, half essays (when the essays are installed: setup.sh --bench)."""
    from sparse_quality import essay_dir

    corpora = [tokenizer(code_corpus()).input_ids]
    essays = essay_dir()
    if essays is not None:
        corpora.append(
            tokenizer("\n\n".join(p.read_text(errors="ignore") for p in sorted(essays.glob("*.txt")))).input_ids
        )
    out = []
    for i in range(count):
        out += code_windows(corpora[i % len(corpora)], tokens, 1, seed + i)
    return out


def rouge_l(a: list[int], b: list[int]) -> float:
    from sparse_quality import lcs_ratio

    return lcs_ratio(a, b)


def speed_run(url: str, windows: list[list[int]], tokens: int, traces: bool) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    payloads = [{"input_ids": w, "sampling_params": params, "return_entropy": traces, "stream": True} for w in windows]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(payloads)) as pool:
        outs = list(pool.map(lambda p: stream_one(url, p, start, 3600), payloads))
    errors = [o["error"] for o in outs if o["error"]]
    if errors:
        raise RuntimeError(f"speed run failed: {errors[0]}")
    decode_s = max(o["finish"] for o in outs) - max(o["first"] for o in outs)
    result = {
        "decode_tok_s": len(outs) * (tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        "ttft_s": statistics.fmean(o["first"] - o["send"] for o in outs),
        "output_ids": [o["output_ids"] for o in outs],
    }
    if traces:
        result["attended"] = statistics.fmean(a for o in outs for a in o["meta"]["attended"][1:])
    return result


def warm_up(url: str) -> None:
    stream_one(url, {"text": "Hello", "sampling_params": {"max_new_tokens": 4}, "stream": True}, 0.0, 600)


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


KEEP_ALL = {"pruning": {"min_keep_ratio": 1.0, "max_keep_ratio": 1.0, "shortlist_ratio": 1.0}}


def read_share(cfg: PruningConfig, context: float) -> float:
    """KV bytes (and attention FLOPs) one pruned decode step reads, as a share of dense: the kept pages' keys
    and values, plus the keys of the shortlist that the exact rescoring reads beyond them."""
    rows = row_pages(int(context), float("nan"), cfg.model_copy(update={"min_context": 0}))
    return (rows.kept_tokens + 0.5 * (rows.shortlist - rows.keep) * cfg.page_size) / rows.length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="a shipped model (sgl_entropic.model.MODELS); another "
        "than the bundled one publishes docs/data/attention_pruning_<model>.json",
    )
    ap.add_argument("--contexts", default="4000,7000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--entropic-config", default="{}", help="ours' EntropicConfig JSON")
    ap.add_argument("--quick", action="store_true", help="2k, batch 1 and 2, 16 tokens, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches, args.tokens, args.rounds = "2000", "1,2", 16, 1
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    entropic_config = json.loads(args.entropic_config)
    cfg = PruningConfig(**entropic_config.get("pruning", {}))

    from transformers import AutoTokenizer

    model, device = str(prepare_model(args.model)), default_device()
    tokenizer = AutoTokenizer.from_pretrained(model)
    pool = ["--max-total-tokens", str(max(65536, max(b * (n + args.tokens) for n in contexts for b in batches)))]
    common = sglang_common_args(model, device, args.dtype, ["--sleep-on-idle"] + pool)
    commands = {
        "stock": lambda port: stock_command(port, common),
        "kernel": lambda port: ours_command(port, common, "pruning", KEEP_ALL),
        "ours": lambda port: ours_command(port, common, "pruning", entropic_config),
    }
    runs: dict = {name: [] for name in commands}
    probes: dict = {name: [] for name in commands if name != "stock"}
    order = list(commands)
    for r in range(args.rounds):
        order = order[1:] + order[:1]  # rotated every round
        # fresh windows per round (no radix-cache hits across rounds), the same for every server
        windows = {(n, b): text_windows(tokenizer, n, b, seed=1000 * r + 10 * n + b) for n in contexts for b in batches}
        for name in order:
            port = free_port()
            with start_server(
                f"speed-{name}", commands[name](port), port, server_env(device, stock=name == "stock")
            ) as srv:
                if name in probes:
                    pruning = requests.get(srv.url + "/server_info", timeout=60).json()["entropic"]["pruning"]
                    probes[name].append({k: pruning[k] for k in ("min_context", "dense_kernel_from", "crossover_ms")})
                warm_up(srv.url)
                cells = {}
                for key, ws in windows.items():
                    cells[key] = speed_run(srv.url, ws, args.tokens, traces=name != "stock")
                    c = cells[key]
                    log_line(
                        f"round {r + 1} {name} L={key[0]} B={key[1]}: decode {c['decode_tok_s']:.1f} tok/s, "
                        f"TTFT {c['ttft_s']:.2f} s" + (f", attended {c['attended']:.0%}" if "attended" in c else "")
                    )
            runs[name].append(cells)

    rows, table = [], []
    for n in contexts:
        for b in batches:
            key = (n, b)
            stock, kernel, ours = ([run[key] for run in runs[name]] for name in ("stock", "kernel", "ours"))
            tok = lambda xs: [x["decode_tok_s"] for x in xs]  # noqa: E731
            total = [o / s for o, s in zip(tok(ours), tok(stock))]
            kernel_part = [k / s for k, s in zip(tok(kernel), tok(stock))]
            pruning_part = [o / k for o, k in zip(tok(ours), tok(kernel))]
            ttft = [o["ttft_s"] / s["ttft_s"] for o, s in zip(ours, stock)]
            kept = [o["attended"] for o in ours]
            rouge = [
                statistics.fmean(rouge_l(a, c) for a, c in zip(o["output_ids"], s["output_ids"]))
                for o, s in zip(ours, stock)
            ]
            read = read_share(cfg, n + args.tokens / 2)
            row = {
                "context": n,
                "batch": b,
                "decode_tok_s": {"stock": tok(stock), "kernel": tok(kernel), "ours": tok(ours)},
                "decode_speedup": total,
                "kernel_speedup": kernel_part,
                "pruning_speedup": pruning_part,
                "ttft_s": {"stock": [s["ttft_s"] for s in stock], "ours": [o["ttft_s"] for o in ours]},
                "ttft_ratio": ttft,
                "kept_share": kept,
                "kv_read_share": read,
                "rouge_l_vs_stock": rouge,
            }
            rows.append(row)
            table.append(
                [
                    f"{n // 1000}k",
                    b,
                    spread(tok(stock), ".1f"),
                    spread(tok(kernel), ".1f"),
                    spread(tok(ours), ".1f"),
                    spread(total, ".2f") + "x",
                    spread(kernel_part, ".2f") + "x",
                    spread(pruning_part, ".2f") + "x",
                    spread(ttft, ".3f") + "x",
                    spread(kept, ".0%"),
                    f"{read:.0%}",
                    spread(rouge, ".2f"),
                ]
            )
    headers = [
        "context",
        "batch",
        "decode tok/s stock",
        "kernel (every page)",
        "ours (pruned)",
        "speedup ours/stock",
        "kernel part",
        "pruning part",
        "TTFT ours/stock",
        "kept share",
        "KV bytes & attn FLOPs read",
        "ROUGE-L vs stock",
    ]
    md = markdown_table(headers, table)
    name = data_name("attention_pruning", args.model)
    path = write_json(
        name,
        {"environment": environment(), "args": vars(args), "rows": rows, "probes": probes, "markdown": md},
        publish=None if args.quick else name,
    )
    print(md)
    log_line(f"results: {path} (median over {args.rounds} rounds, min-max in parentheses)")


if __name__ == "__main__":
    main()
