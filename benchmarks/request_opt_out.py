"""What a request that opts out of speculation pays (`custom_params.entropic.speculative: {"draft": "off"}`).

Servers (bf16, the bundled model, started per round in a rotated order, one warm-up request each):
  ours      `--entropic full` with speculative.draft 'off': the plugin without speculation
  default   `--entropic full` alone: NGRAM under the entropy rule
Cases, greedy, 96 tokens each (ignore_eos), every request streamed to time its decode (ms per token after the
first):
  alone     the opted-out request served alone. On `default` it runs plain steps, as on `ours`: the difference is
            the plugin's per-step work for a request that drafts nothing.
  mixed     the opted-out request sent together with three requests that draft (each asks for a function of
            SGLang's source back with a docstring added: copying work). On `default` the three draft and the
            opted-out one rides their verify steps; on `ours` the same four requests decode without speculation.
The opted-out request asks the same copying task: on `default` without the opt-out it would draft too.
With `--essay`, the alone case only, over a summary of two essays (5-7k tokens: `speculative_decoding.py`'s
`summary` prompts), where the entropy rule runs plain steps: their cost under speculation at a long context.

    .venv/bin/python benchmarks/request_opt_out.py        # 3 rounds, ~10 min on 2 cores
    .venv/bin/python benchmarks/request_opt_out.py --essay   # docs/data/request_opt_out_essay.json
With `--sync`, ours against ours with SGLang's overlap scheduler off (`--disable-overlap-schedule`), as SGLang runs
every speculative server on CPU: how much of the opted-out request's cost on `default` that accounts for.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import common

DATA = "request_opt_out"
TOKENS = 96
CONFIGS = ("ours", "default")


def prompts() -> list[str]:
    """Four copying tasks over SGLang's own source: the first is the one that opts out."""
    from sglang.srt.managers import schedule_policy
    from sglang.srt.speculative import ngram_worker, spec_utils

    functions = [
        ngram_worker.NGRAMWorker._efficient_concat_last_n,
        ngram_worker.NGRAMWorker._update_ngram_corpus,
        spec_utils.move_accept_tokens_to_target_kvcache,
        schedule_policy.SchedulePolicy.calc_priority,
    ]
    return [
        common.chat(
            f"```python\n{inspect.getsource(f)}```\nReturn this function with a one-line docstring "
            "added, unchanged otherwise."
        )
        for f in functions
    ]


def essay_prompt(model: str) -> str:
    """The first of `speculative_decoding.py`'s summary prompts, with the chat template applied."""
    import json
    import tempfile
    from pathlib import Path

    from speculative_decoding import SUMMARY, doc_questions
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = doc_questions(Path(tmp) / "summary.jsonl", 7, AutoTokenizer.from_pretrained(model), 2, SUMMARY, True)
        first = json.loads(path.read_text().splitlines()[0])
    return common.chat(first["conversations"][0]["value"])


def payload(text: str, opt_out: bool) -> dict:
    params = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    if opt_out:
        params["custom_params"] = {"entropic": {"speculative": {"draft": "off"}}}
    return {"text": text, "sampling_params": params, "stream": True}


def decode_ms(rec: dict) -> float:
    if rec["error"] or rec["completion_tokens"] < 2:
        raise RuntimeError(f"request failed: {rec['error']}")
    return (rec["finish"] - rec["first"]) / (rec["completion_tokens"] - 1) * 1e3


def run_case(url: str, texts: list[str], opt_out: bool) -> list[float]:
    """Decode ms per token of each request, all sent at once; the first opts out where `opt_out`."""
    with ThreadPoolExecutor(len(texts)) as pool:
        recs = list(
            pool.map(
                lambda i: common.stream_one(url, payload(texts[i], opt_out and i == 0), time.perf_counter(), 600),
                range(len(texts)),
            )
        )
    return [decode_ms(r) for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each case per round (their median is kept)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--essay", action="store_true", help="the alone case over a 5-7k-token summary prompt")
    ap.add_argument("--sync", action="store_true", help="ours against ours without the overlap scheduler")
    args = ap.parse_args()
    from sgl_entropic.model import prepare_bundled_model

    model = str(prepare_bundled_model())
    texts = [essay_prompt(model)] if args.essay else prompts()
    cases = ("alone",) if args.essay else ("alone", "mixed")
    name = DATA + ("_essay" if args.essay else "") + ("_sync" if args.sync else "")
    configs = ("ours", "ours-sync") if args.sync else CONFIGS
    other = configs[1]  # what each round's opted-out request is compared with ours
    common_args = common.sglang_common_args(model, "cpu", args.dtype)
    runs = []
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        for config in order:
            port = common.free_port()
            extra = {"speculative": {"draft": "off"}} if config.startswith("ours") else None
            sync = ["--disable-overlap-schedule"] if config == "ours-sync" else []
            cmd = common.ours_command(port, [*common_args, *sync], "full", extra)
            with common.start_server(config, cmd, port, common.server_env("cpu", stock=False)) as srv:
                run_case(srv.url, texts[:1], False)  # warm-up
                for case, batch in (("alone", texts[:1]), ("mixed", texts))[: len(cases)]:
                    reps = [run_case(srv.url, batch, opt_out=config == "default") for _ in range(args.repeats)]
                    opted = common.median(r[0] for r in reps)
                    others = common.median(common.median(r[1:]) for r in reps) if len(batch) > 1 else None
                    runs.append(
                        {"round": rnd, "config": config, "case": case, "opted_out_ms": opted, "others_ms": others}
                    )
                    common.log_line(
                        f"round {rnd} {config} {case}: opted-out {opted:.1f} ms/token"
                        + (f", the others {others:.1f}" if others else "")
                    )
    summary, rows = {}, []
    for case in cases:
        by = {c: {r["round"]: r for r in runs if (r["config"], r["case"]) == (c, case)} for c in configs}
        entry = {
            "ours_ms": spread([r["opted_out_ms"] for r in by["ours"].values()]),
            f"{other}_ms": spread([r["opted_out_ms"] for r in by[other].values()]),
            "vs_ours": spread([by[other][k]["opted_out_ms"] / by["ours"][k]["opted_out_ms"] for k in by["ours"]]),
        }
        if case == "mixed" and "default" in by:
            entry["others_vs_ours"] = spread(
                [by["default"][k]["others_ms"] / by["ours"][k]["others_ms"] for k in by["ours"]]
            )
        summary[case] = entry
        rows.append(
            [
                case,
                cell(entry["ours_ms"]),
                cell(entry[f"{other}_ms"]),
                cell(entry["vs_ours"], 2),
                cell(entry["others_vs_ours"], 2) if "others_vs_ours" in entry else "-",
            ]
        )
    text = common.markdown_table(
        [
            "case",
            "opted-out ms/token on ours",
            "on ours without overlap" if args.sync else "on default (opted out)",
            "x ours (per round)",
            "the drafting requests, x ours",
        ],
        rows,
    )
    print(text)
    common.write_json(
        name,
        {
            "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
            "environment": common.environment(),
            "args": vars(args),
            "tokens": TOKENS,
            "summary": summary,
            "runs": runs,
            "markdown": text,
        },
        publish=name,
    )


def spread(vals: list[float]) -> dict:
    return {"median": common.median(vals), "min": min(vals), "max": max(vals)}


def cell(e: dict, digits: int = 1) -> str:
    return f"{e['median']:.{digits}f} ({e['min']:.{digits}f}-{e['max']:.{digits}f})"


if __name__ == "__main__":
    main()
