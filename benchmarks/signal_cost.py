"""In-process cost of the plugin's whole per-step sampling hook, the per-row Python work included.

Times `sampling.controller.around_sampler_forward`, the Sampler.forward hook the scheduler runs every
step, around a stand-in sampler (argmax), on the bundled model's vocabulary: batch rows build
(`BatchRows`), the controllers on the device table, the logits snapshot, token_stats, the one
device -> host transfer, and every row's trace, customized_info and metrics bookkeeping. Rows are
plain (sampled at T = 0.8), greedy (the sampler leaves the logits alone, so no copy is taken) or mixed
(plain, greedy and entropic-sampling requests). The stand-in sampler's own argmax is timed apart and
subtracted. Compare the medians with a decode step's
duration (batch / decode tok/s from signal_overhead.py or attention_pruning.py).

    .venv/bin/python benchmarks/signal_cost.py [--vocab 49152] [--batch-sizes 1,8,32] [--iters 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from sgl_entropic.config import EntropicConfig, SamplingConfig  # noqa: E402
from sgl_entropic.costs import ModelDims  # noqa: E402
from sgl_entropic.plugin import runtime  # noqa: E402
from sgl_entropic.plugin.sampling import controller  # noqa: E402
from sgl_entropic.plugin.signal.traces import finish_steps  # noqa: E402
from sgl_entropic.plugin.step import BatchRows  # noqa: E402
from sgl_entropic.sampling import ControllerState  # noqa: E402


def measure(batch: int, vocab: int, iters: int, mix: str) -> dict:
    rt = runtime.install(EntropicConfig())
    rt.dims = ModelDims(30, 9, 3, 64, 2.7e8)
    rt.controllers = controller.ControllerTable(batch + 1, "cpu")
    cfg = SamplingConfig(target_entropy=2.0)
    reqs = []
    for i in range(batch):
        controlled = mix == "mixed" and i % 2 == 1
        state = rt.new_request_state(ControllerState.from_config(cfg, 0.8) if controlled else None, None)
        reqs.append(
            SimpleNamespace(
                entropic=state,
                customized_info=None,
                kv=SimpleNamespace(req_pool_idx=i + 1),
                origin_input_ids=[0] * 100,
                output_ids=[],
            )
        )
    greedy = [mix == "greedy" or (mix == "mixed" and i % 4 == 0) for i in range(batch)]
    info = SimpleNamespace(
        temperatures=torch.tensor([[1.0 if g else 0.8] for g in greedy]),
        top_ks=torch.tensor([1 if g else vocab for g in greedy]),
        is_all_greedy=all(greedy),
        has_custom_logit_processor=False,
    )
    fb = SimpleNamespace(
        batch_size=batch, req_pool_indices=torch.arange(1, batch + 1), seq_lens_cpu=torch.full((batch,), 1000)
    )
    logits = torch.randn(batch, vocab)

    sampler_times = []

    def sampler(_sampler, out, _info, *args, **kwargs):
        start = time.perf_counter()
        tokens = out.next_token_logits.argmax(dim=-1)
        sampler_times.append(time.perf_counter() - start)
        return tokens

    times = []
    for i in range(iters + 5):
        out = SimpleNamespace(next_token_logits=logits.clone())
        start = time.perf_counter()
        step = rt.steps.begin()  # what Scheduler.get_next_batch_to_run opens
        step.rows = BatchRows.of(reqs, [True] * batch)  # what ForwardBatch.init_new builds
        step.forward_batch = fb
        controller.around_sampler_forward(sampler, None, out, info)
        finish_steps(rt)  # the bookkeeping SGLang's result processing triggers
        if i >= 5:
            times.append(time.perf_counter() - start - sampler_times[-1])
        if i % 50 == 0:  # keep the traces from growing without bound, as finished requests would
            for r in reqs:
                r.customized_info = None
    times.sort()
    return {
        "batch": batch,
        "vocab": vocab,
        "mix": mix,
        "median_ms": 1e3 * times[len(times) // 2],
        "p90_ms": 1e3 * times[int(len(times) * 0.9)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    rows = [
        measure(int(b), args.vocab, args.iters, mix)
        for mix in ("plain", "greedy", "mixed")
        for b in args.batch_sizes.split(",")
    ]
    print(
        f"torch threads: {torch.get_num_threads()}\n\n| rows | batch | median ms/step | p90 ms/step |\n|---|---|---|---|"
    )
    for r in rows:
        print(f"| {r['mix']} | {r['batch']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} |")
    path = common.write_json(
        "signal_cost",
        {"args": vars(args), "torch_threads": torch.get_num_threads(), "rows": rows},
        publish="signal_cost",
    )
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
