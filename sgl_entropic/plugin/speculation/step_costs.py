"""The draft rule's cost table (`speculative.StepCosts`), timed on the served model's own weights once per machine,
model and dtype, then kept (as the pruning crossovers are: `crossover.save_timings`), so that every later start and
restart prices steps, hence picks widths, exactly as the first did.

Timed at start-up, in the scheduler (`NGRAMWorker.alloc_memory_pool`, after the model and its KV pool exist):
  - the GEMMs of a forward over n tokens: every linear layer of the first decoder layer times the decoder's layer
    count, the LM head, and one log-softmax over the vocabulary (the signal's pass), n on a grid to 256 tokens;
  - one row's attention over synthetic KV of the model's shape at a grid of contexts, at width 1 and the widest,
    through the verify forward's own attention (`verify_attention.tree_verify_attention`).
Each the fastest of passes over its grid, counting only passes the machine's other processes left alone
(`crossover.fastest`). A model whose layers are not plain weight matrices (quantized) is not timed: the rule then
verifies every draft offered, as SGLang's `matched` does, and says so at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Optional

import torch

from sgl_entropic.crossover import fastest
from sgl_entropic.drafting import StepCosts

logger = logging.getLogger("sgl_entropic")

TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CONTEXTS = (256, 1024, 4096)
TIMED_CODE = ("crossover.py", "plugin/speculation/step_costs.py", "plugin/attention/verify_attention.py")


def costs_dir() -> Path:
    from sgl_entropic.model import cache_dir

    return cache_dir() / "step-costs"


def _layers(model: torch.nn.Module) -> tuple[list[torch.nn.Module], int]:
    """The first decoder layer's linear layers and the decoder's layer count."""
    from sglang.srt.layers.linear import LinearBase

    first, indices = [], set()
    for name, module in model.named_modules():
        found = re.search(r"\.layers\.(\d+)\.", name + ".")
        if found and isinstance(module, LinearBase):
            indices.add(int(found.group(1)))
            if found.group(1) == "0":
                first.append(module)
    return first, len(indices)


def key_of(model_runner, max_width: int) -> dict:
    from sgl_entropic.cpu import cpu_model

    root = Path(__file__).resolve().parents[2]  # sgl_entropic/
    code = hashlib.sha256(b"".join((root / f).read_bytes() for f in TIMED_CODE)).hexdigest()[:16]
    cfg = model_runner.model_config.hf_config
    device = torch.device(model_runner.device)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code,
        "model": type(model_runner.model).__name__,
        "config": json.loads(cfg.to_json_string()) if hasattr(cfg, "to_json_string") else str(cfg),
        "dtype": str(model_runner.dtype),
        "kv_dtype": str(model_runner.kv_cache_dtype),
        "max_width": max_width,
        "tokens": TOKENS,
        "contexts": CONTEXTS,
    }


def measure(model_runner, max_width: int) -> Optional[StepCosts]:
    """The table for this model and `max_width`; None where the model's layers are not plain weight matrices."""
    from sgl_entropic.plugin.attention.verify_attention import tree_verify_attention, verify_rows

    model, device = model_runner.model, torch.device(model_runner.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    linears, layers = _layers(model)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if (
        not linears
        or head is None
        or any(
            getattr(m, "weight", None) is None or m.weight.dim() != 2 or not m.weight.is_floating_point()
            for m in linears
        )
    ):
        return None
    inputs = {
        n: [torch.randn(n, m.weight.shape[1], dtype=m.weight.dtype, device=device) for m in linears] for n in TOKENS
    }
    hidden = {n: torch.randn(n, head.shape[1], dtype=head.dtype, device=device) for n in TOKENS}

    def forward(n: int):
        def run():
            with torch.inference_mode():
                for m, x in zip(linears, inputs[n]):
                    m(x)

        return run

    def head_pass(n: int):
        def run():
            with torch.inference_mode():
                torch.log_softmax((hidden[n] @ head.T).float(), dim=-1)

        return run

    timed = fastest([forward(n) for n in TOKENS] + [head_pass(n) for n in TOKENS], sync)
    gemm = tuple(layers * f + h for f, h in zip(timed[: len(TOKENS)], timed[len(TOKENS) :]))

    config = model_runner.model_config
    heads_q = config.num_attention_heads // model_runner.server_args.tp_size
    k0 = model_runner.token_to_kv_pool.get_key_buffer(0)
    heads_kv, dim, dtype = k0.shape[1], k0.shape[2], k0.dtype

    def verify_attention(width: int, n: int):
        k, v = (torch.randn(n + width, heads_kv, dim, device=device).to(dtype) for _ in range(2))
        q = torch.randn(width, heads_q, dim, device=device).to(model_runner.dtype)
        rows = verify_rows(
            torch.arange(n + width, device=device)[None],
            torch.zeros(1, dtype=torch.long, device=device),
            [n],
            torch.ones(width, width, dtype=torch.bool, device=device).tril()[None],
            torch.arange(n, n + width, device=device)[None],
        )
        return lambda: tree_verify_attention(q, k, v, rows, dim**-0.5)

    timed = fastest([verify_attention(w, n) for w in (1, max_width) for n in CONTEXTS], sync)
    narrow, wide = (tuple(layers * t for t in timed[i : i + len(CONTEXTS)]) for i in (0, len(CONTEXTS)))
    return StepCosts(TOKENS, gemm, CONTEXTS, (1, max_width), (narrow, wide))


def load_or_measure(model_runner, max_width: int) -> StepCosts:
    """The kept table for this machine, model and width, timed now if there is none."""
    from sgl_entropic.crossover import timings_file

    key = key_of(model_runner, max_width)
    path = timings_file(costs_dir(), key)
    try:
        kept = json.loads(path.read_text())["costs"]
        costs = StepCosts(
            tuple(kept["tokens"]),
            tuple(kept["gemm"]),
            tuple(kept["contexts"]),
            tuple(kept["widths"]),
            tuple(tuple(a) for a in kept["attention"]),
        )
        how = "as timed before, in"
    except (OSError, ValueError, KeyError, TypeError):
        measured = measure(model_runner, max_width)
        if measured is None:
            logger.warning(
                "sgl-entropic: the model's layers are not plain weight matrices; the entropy draft rule "
                "has no cost table and verifies every draft the trie offers"
            )
            return StepCosts()
        costs, how = measured, "timed now, kept in"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "key": key,
                    "costs": {
                        "tokens": costs.tokens,
                        "gemm": costs.gemm,
                        "contexts": costs.contexts,
                        "widths": costs.widths,
                        "attention": costs.attention,
                    },
                },
                indent=1,
            )
        )
        tmp.replace(path)  # atomic: servers starting together never read half a file
    logger.info(
        "sgl-entropic: draft widths priced by a cost table (%s %s): a forward over 1 / 4 / 16 tokens "
        "%.2f / %.2f / %.2f ms; one row's attention over %d tokens at width 1 / %d: %.2f / %.2f ms",
        how,
        path,
        *(costs.forward(n) * 1e3 for n in (1, 4, 16)),
        costs.contexts[1],
        costs.widths[1],
        costs.attention[0][1] * 1e3,
        costs.attention[1][1] * 1e3,
    )
    return costs
