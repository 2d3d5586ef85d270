"""Entropic attention pruning (the meso loop) against stock torch_native, in one run.

Claims tested: at least 1.5x decode-attention speedup at 4k context with unchanged passkey
accuracy; the paper's -20..30 % attention FLOPs and -15..25 % KV bandwidth.

Two servers, ONE AT A TIME (ours first, then stock, which also judges both outputs), same model, dtype, KV pool, chunked prefill and radix cache:
stock `sglang.launch_server` (torch_native attention) and ours with `--entropic pruning`
(default PruningConfig). For every context L in --contexts and batch B in --batches, B
concurrent greedy requests continue B distinct windows of real source code (SGLang's own
scheduler) for --tokens new tokens (ignore_eos), streamed:
  - decode tok/s   = B * (N - 1) / (end of the last stream - latest first-token time)
  - TTFT           = first streamed token (prefill; ours also scores the prompt tokens)
  - keep ratio     = mean of ours' per-token `attended` traces over decode steps
  - attention FLOPs and KV bytes read per decode step follow from the attended tokens:
    4 * layers * q_heads * head_dim FLOPs and 2 * layers * kv_heads * head_dim * bytes per token
  - quality: ROUGE-L (token LCS) of ours' continuation against stock's; the dense (stock)
    model's perplexity of both continuations (teacher-forced prefill with logprobs)
Passkey: the same --passkey-cases prompts (programs/passkey.py) on both servers.

Decode-attention time is measured in-process after the servers are gone, on the real code
path: `EntropicTorchNativeAttnBackend` (plan + every layer) against `TorchNativeAttnBackend`,
SmolLM2-135M's attention shape (30 layers, 9 q / 3 kv heads, dim 64, bf16) and KV pool, with the
token surprisals the dense model gives the benchmark's own contexts and the decode entropies
measured on ours. Median of --attn-repeats steps.

    .venv/bin/python benchmarks/attention_pruning.py                  # full run (about 40 min, 2 cores)
    .venv/bin/python benchmarks/attention_pruning.py --quick          # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from common import (  # noqa: E402
    bundled_model,
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
from programs.passkey import answered_key, make_cases  # noqa: E402

TARGET_SPEEDUP_4K = 1.5
# SmolLM2-135M attention shape (the bundled model)
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, KV_BYTES = 30, 9, 3, 64, 2


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


def speed_run(url: str, windows: list[list[int]], tokens: int, traces: bool) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    payloads = [{"input_ids": w, "sampling_params": params, "return_entropy": traces, "stream": True}
                for w in windows]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(payloads)) as pool:
        outs = list(pool.map(lambda p: stream_one(url, p, start, 1800), payloads))
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
        metas = [o["meta"] for o in outs]
        result["attended"] = statistics.fmean(a for m in metas for a in m["attended"][1:])
        result["entropy"] = statistics.fmean(h for m in metas for h in m["entropy"] if h is not None)
    return result


def dense_perplexity(url: str, prompt_ids: list[int], output_ids: list[int]) -> float:
    """exp(mean -ln p) of output_ids under the dense server, teacher-forced in one prefill."""
    payload = {"input_ids": prompt_ids + output_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
               "return_logprob": True, "logprob_start_len": len(prompt_ids)}
    r = requests.post(url + "/generate", json=payload, timeout=1800)
    r.raise_for_status()
    logprobs = [lp for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"] if lp is not None]
    return math.exp(-statistics.fmean(logprobs[-len(output_ids):]))


def rouge_l(a: list[int], b: list[int]) -> float:
    """F1 of the longest common subsequence of two token lists."""
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    return 2 * lcs / (len(a) + len(b))


def passkey_run(url: str, cases, traces: bool) -> list[dict]:
    out = []
    for case in cases:
        payload = {"text": case.prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
                   "return_entropy": traces}
        r = requests.post(url + "/generate", json=payload, timeout=1800)
        r.raise_for_status()
        body = r.json()
        row = {"context": case.context_tokens, "depth": case.depth, "key": case.key, "answer": body["text"],
               "correct": answered_key(body["text"]) == case.key}
        if traces:
            row["attended"] = statistics.fmean(body["meta_info"]["attended"][1:])
        out.append(row)
    return out


def prompt_surprisal(url: str, ids: list[int]) -> list[float]:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
               "logprob_start_len": 0}
    r = requests.post(url + "/generate", json=payload, timeout=1800)
    r.raise_for_status()
    return [float("nan") if lp is None else -lp for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"]]


def attention_timing(contexts, batches, surprisal: dict, entropy: dict, repeats: int, cfg) -> list[dict]:
    """Decode-attention time per step (all layers), stock torch_native vs ours, same KV and queries."""
    import torch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_entropic.plugin.attention import torch_native_backend

    torch.manual_seed(0)
    rows = []
    for length in contexts:
        for batch in batches:
            slots_needed = batch * (length + 1) + 1
            k = [torch.randn(slots_needed, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
            v = [torch.randn(slots_needed, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
            pool = SimpleNamespace(get_key_buffer=lambda i: k[i], get_value_buffer=lambda i: v[i])
            table = torch.zeros(batch + 1, length + 1, dtype=torch.int32)
            perm = torch.randperm(slots_needed - 1) + 1  # a fragmented pool: slots in random order
            for r in range(batch):
                table[r + 1, : length + 1] = perm[r * (length + 1) : (r + 1) * (length + 1)].int()
            runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=table),
                                     token_to_kv_pool=pool, model_config=SimpleNamespace(vocab_size=49152, num_hidden_layers=LAYERS))
            ours = torch_native_backend(runner, cfg)
            stock = TorchNativeAttnBackend(runner)
            idx = torch.arange(1, batch + 1)
            lens = torch.full((batch,), length + 1)
            fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=idx, seq_lens=lens,
                                 seq_lens_cpu=lens, out_cache_loc=table[idx, length].long(), encoder_lens=None,
                                 spec_info=None)
            scores = surprisal[(length, batch)]
            for r in range(batch):
                ours.planner.store.slot[table[r + 1, :length].long()] = torch.tensor(scores[r][:length])
            ours.planner.store.next_surprisal[idx] = 1.0
            ours.planner.store.entropy[idx] = entropy[(length, batch)]
            q = torch.randn(batch, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)
            layers = [SimpleNamespace(layer_id=i, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=HEAD_DIM,
                                      v_head_dim=HEAD_DIM, scaling=HEAD_DIM ** -0.5, is_cross_attention=False,
                                      sliding_window_size=-1) for i in range(LAYERS)]

            def step(backend):
                t0 = time.perf_counter()
                backend.init_forward_metadata(fb)
                for layer in layers:
                    backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
                return time.perf_counter() - t0

            times = {"stock": [], "ours": []}
            for i in range(repeats + 1):  # the first pair warms up
                for name, backend in (("stock", stock), ("ours", ours)) if i % 2 else (("ours", ours), ("stock", stock)):
                    t = step(backend)
                    if i:
                        times[name].append(t)
            stock_ms, ours_ms = (statistics.median(times[n]) * 1e3 for n in ("stock", "ours"))
            kept = ours.planner.attended_fractions(fb) or [1.0] * batch
            rows.append({"context": length, "batch": batch, "stock_ms": stock_ms, "ours_ms": ours_ms,
                         "speedup": stock_ms / ours_ms, "keep_ratio": statistics.fmean(kept)})
            log_line(f"attention L={length} B={batch}: stock {stock_ms:.1f} ms, ours {ours_ms:.1f} ms "
                     f"({stock_ms / ours_ms:.2f}x, keep {statistics.fmean(kept):.0%})")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1000,2000,4000,7000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per speed request")
    ap.add_argument("--passkey-cases", type=int, default=52)
    ap.add_argument("--attn-repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--entropic-config", default="{}", help="ours' EntropicConfig JSON, e.g. '{\"pruning\": {\"dense_layers\": 2}}'")
    ap.add_argument("--quick", action="store_true", help="1k/2k, batch 1 and 2, 8 passkeys")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches, args.tokens, args.passkey_cases, args.attn_repeats = "1000,2000", "1,2", 16, 8, 3
    contexts = [int(x) for x in args.contexts.split(",")]
    entropic_config = json.loads(args.entropic_config)
    batches = [int(x) for x in args.batches.split(",")]

    from transformers import AutoTokenizer

    from sgl_entropic.config import EntropicConfig

    model = bundled_model()
    device = default_device()
    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus_ids = tokenizer(code_corpus()).input_ids
    windows = {(n, b): code_windows(corpus_ids, n, b, seed=n * 10 + b) for n in contexts for b in batches}
    depths = [i / 12 for i in range(13)]
    cases = make_cases(contexts, depths, seed=1)
    while len(cases) < args.passkey_cases:
        cases += make_cases(contexts, depths, seed=len(cases))
    cases = sorted(cases, key=lambda c: (c.depth, c.context_tokens))[: args.passkey_cases]  # truncation keeps every L

    common = sglang_common_args(model, device, args.dtype, ["--sleep-on-idle"])
    results: dict = {"stock": {}, "ours": {}}
    ppl: dict = {}
    for name in ("ours", "stock"):  # stock last: it then judges both continuations
        port = free_port()
        cmd = stock_command(port, common) if name == "stock" else ours_command(port, common, "pruning", entropic_config)
        with start_server(f"attn-{name}", cmd, port, server_env(device, stock=name == "stock")) as srv:
            traces = name == "ours"
            for key, ws in windows.items():
                results[name][key] = speed_run(srv.url, ws, args.tokens, traces)
                r = results[name][key]
                log_line(f"{name} L={key[0]} B={key[1]}: decode {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s']:.1f}s"
                         + (f", attended {r['attended']:.0%}" if traces else ""))
            results[name]["passkey"] = passkey_run(srv.url, cases, traces)
            log_line(f"{name}: passkey {sum(c['correct'] for c in results[name]['passkey'])}/{len(cases)}")
            if name == "stock":  # the dense model's judgements
                results["surprisal"] = {key: [prompt_surprisal(srv.url, w) for w in ws] for key, ws in windows.items()}
                for key, ws in windows.items():
                    ppl[key] = {n: dense_perplexity(srv.url, ws[0], results[n][key]["output_ids"][0])
                                for n in ("stock", "ours")}

    timing = attention_timing(contexts, batches, results["surprisal"],
                              {k: results["ours"][k]["entropy"] for k in windows}, args.attn_repeats,
                              EntropicConfig.model_validate(entropic_config).pruning)

    rows, table = [], []
    for t in timing:
        key = (t["context"], t["batch"])
        s, o = results["stock"][key], results["ours"][key]
        keep = o["attended"]
        context_mid = t["context"] + args.tokens / 2
        flops_dense = 4 * LAYERS * Q_HEADS * HEAD_DIM * context_mid
        kv_dense = 2 * LAYERS * KV_HEADS * HEAD_DIM * KV_BYTES * context_mid
        rouge = statistics.fmean(rouge_l(a, b) for a, b in zip(o["output_ids"], s["output_ids"]))
        row = {**t, "server_keep_ratio": keep, "decode_tok_s_stock": s["decode_tok_s"],
               "decode_tok_s_ours": o["decode_tok_s"], "e2e_decode_speedup": o["decode_tok_s"] / s["decode_tok_s"],
               "ttft_stock_s": s["ttft_s"], "ttft_ours_s": o["ttft_s"],
               "attn_mflop_per_token_stock": flops_dense / 1e6, "attn_mflop_per_token_ours": flops_dense * keep / 1e6,
               "kv_mb_per_token_stock": kv_dense / 1e6, "kv_mb_per_token_ours": kv_dense * keep / 1e6,
               "rouge_l_vs_dense": rouge, "dense_ppl_stock_output": ppl[key]["stock"],
               "dense_ppl_ours_output": ppl[key]["ours"]}
        rows.append(row)
        table.append([t["context"], t["batch"], f"{keep:.0%}", f"{t['stock_ms']:.1f}", f"{t['ours_ms']:.1f}",
                      f"{t['speedup']:.2f}x", f"{s['decode_tok_s']:.1f}", f"{o['decode_tok_s']:.1f}",
                      f"{row['e2e_decode_speedup']:.2f}x", f"{-(1 - keep):+.0%}", f"{s['ttft_s']:.1f} / {o['ttft_s']:.1f}",
                      f"{rouge:.2f}", f"{ppl[key]['stock']:.2f} / {ppl[key]['ours']:.2f}"])

    def accuracy(name, length=None):
        sel = [c for c in results[name]["passkey"] if length is None or c["context"] == length]
        return sum(c["correct"] for c in sel), len(sel)

    passkey_rows = []
    for n in contexts:
        attended = [c["attended"] for c in results["ours"]["passkey"] if c["context"] == n]
        passkey_rows.append([n, *(f"{accuracy(name, n)[0]}/{accuracy(name, n)[1]}" for name in ("stock", "ours")),
                             f"{statistics.fmean(attended):.0%}" if attended else "-"])
    headers = ["context", "batch", "keep", "attn ms stock", "attn ms ours", "attn speedup", "decode tok/s stock",
               "decode tok/s ours", "e2e decode", "attn FLOPs & KV bytes", "TTFT s stock / ours", "ROUGE-L",
               "dense ppl stock / ours"]
    md = markdown_table(headers, table) + "\n\n" + markdown_table(
        ["context", "passkey stock", "passkey ours", "attended (ours)"], passkey_rows)
    four_k = [r for r in rows if r["context"] == 4000]
    verdict = {
        "attention_speedup_at_4k": [r["speedup"] for r in four_k],
        "target_speedup_at_4k": TARGET_SPEEDUP_4K,
        "passkey_stock": accuracy("stock"),
        "passkey_ours": accuracy("ours"),
    }
    path = write_json("attention_pruning", {
        "environment": environment(), "args": vars(args), "rows": rows, "verdict": verdict,
        "passkey": {n: results[n]["passkey"] for n in ("stock", "ours")}, "markdown": md,
    })
    print(md)
    print(json.dumps(verdict, indent=1))
    log_line(f"results: {path}")


if __name__ == "__main__":
    main()
