"""The meso loop's SGLang attention backend, `--attention-backend entropic` (scheduler process).

Prefill and extend stay dense and fold the keys they write into the page store's min/max
(`page_store.py`); every decode step plans once (`page_planner.PagePlanner.plan`: which rows prune,
how many pages each shortlists and keeps, a `pruning.StepPlan` of device tensors) and every layer selects and
attends (`pruning.attend_layer`):
  - CPU: a subclass of SGLang's TorchNativeAttnBackend. A step that prunes runs the batched kernel
    of `pruning.attend_layer`; a step that does not runs the same kernel over every page where the
    start-up probe timed it faster than SGLang's own per-request loop, else SGLang's loop, untouched.
  - CUDA (`attention_flashinfer.py`): FlashInfer, its CUDA graphs kept for steps that do not prune.
`sgl_entropic.pruning` decides; this module adapts it to SGLang's pools and batches. The page store's layout
follows `sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm` (per page, per KV head key
min/max), which is not reused as code: it re-gathers every page's keys per layer from
req_to_token, keeps fp32 copies per layer in dicts, syncs with the host (.item(), nonzero) on every
call, and averages a query group, which is not an upper bound. Here the metadata is written once, as
KV is written.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import platform
from pathlib import Path
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_entropic.config import ATTENTION_BACKEND as BACKEND_NAME, PruningConfig
from sgl_entropic.crossover import (
    CONTEXTS,
    crossover,
    load_timings,
    measure,
    plain_step_seconds,
    save_timings,
    timings_file,
)
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.attention.page_planner import UNMEASURED_MIN_CONTEXT, PagePlanner, Probe
from sgl_entropic.plugin.attention.page_store import PageStore
from sgl_entropic.plugin.attention.self_check import run_self_check
from sgl_entropic.plugin.attention.verify_attention import TreeVerifyAttnBackend
from sgl_entropic.cpu import cpu_model
from sgl_entropic.pruning import (
    StepPlan,
    all_pages,
    attend_layer,
    row_pages,
)

logger = logging.getLogger("sgl_entropic")

# CPU: a step's rows are attended in groups of about this many gathered tokens, which bounds the
# gathered copies a large batch materialises per layer (memory); timed here, its speed effect was
# inside this machine's noise.
CPU_GROUP_TOKENS = 4096


def timings_dir() -> Path:
    from sgl_entropic.model import cache_dir

    return cache_dir() / "crossovers"


# the code whose speed the start-up probe times: a change to it is a new measurement
TIMED_CODE = (
    "crossover.py",
    "plugin/attention/backend.py",
    "plugin/attention/page_planner.py",
    "plugin/attention/page_store.py",
    "pruning/kernel.py",
    "pruning/plan.py",
    "pruning/select.py",
    "pruning/scores.py",
    "pruning/budget.py",
)


def probe_key(shape, layers: int, contexts: list[int], cfg: PruningConfig) -> dict:
    """What the start-up timings depend on: the machine, torch, the timed code, the attention shape, the config."""
    root = Path(__file__).resolve().parents[2]  # sgl_entropic/
    code = hashlib.sha256(b"".join((root / f).read_bytes() for f in TIMED_CODE)).hexdigest()[:16]
    heads_q, heads_kv, dim, dtype = shape
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code,
        "shape": [heads_q, heads_kv, dim, str(dtype), layers],
        "contexts": contexts,
        "pruning": cfg.model_dump(mode="json", exclude={"min_context", "engaged"}),
    }


class EntropicTorchNativeAttnBackend(TreeVerifyAttnBackend):
    """torch_native with page-sparse decode (CPU); speculative verify steps attend densely."""

    def __init__(self, model_runner, cfg: PruningConfig):
        super().__init__(model_runner)
        self.planner = PagePlanner(model_runner, cfg)
        self.planner.group_tokens = CPU_GROUP_TOKENS
        self.probe = self._start_up(model_runner, cfg)
        self.plan: Optional[StepPlan] = None
        self._dense_plan: Optional[StepPlan] = None
        self._batch = None
        self._layer = None

    # ------------------------------------------------------------------ start-up: self-check, crossover

    def _start_up(self, model_runner, cfg: PruningConfig) -> Probe:
        k0 = model_runner.token_to_kv_pool.get_key_buffer(0)
        config = model_runner.model_config
        heads_q = config.num_attention_heads // model_runner.server_args.tp_size
        shape = (heads_q, k0.shape[1], k0.shape[2], k0.dtype)
        check = run_self_check(attend_layer, *shape, cfg)
        if not check.ok:
            self.planner.disable(check.error)
            return Probe([], [], None, check)
        timings, kernel_timings, from_ = [], [], None
        if model_runner.server_args.tp_size > 1:
            # each rank would time its own crossovers; their decisions must be identical
            if cfg.min_context is None:
                self.planner.cfg = cfg.model_copy(update={"min_context": UNMEASURED_MIN_CONTEXT})
            return Probe(timings, kernel_timings, from_, check)
        # where our kernels pay on this machine and model: over every page, then pruned (unless given);
        # measured once per machine, model shape and config, then read from the cache (crossover.py)
        cap = min(config.context_len, model_runner.token_to_kv_pool.size)
        contexts = [n for n in CONTEXTS if n <= cap]
        layers = len(self.planner.full_layers)  # sliding-window layers run SGLang's code either way
        key = probe_key(shape, layers, contexts, cfg)
        path = timings_file(timings_dir(), key)
        kept = load_timings(path)
        measured = dict(kept)
        if cfg.dense_kernel_from is None:
            if "kernel" not in kept:
                measured["kernel"] = measure(
                    lambda n, ours: self._timed_step(shape, layers, cfg, n, ours, prune=False), contexts
                )
            kernel_timings = measured["kernel"]
            from_ = crossover(kernel_timings)
        else:
            from_ = cfg.dense_kernel_from
        if cfg.min_context is None:
            if "pruned" not in kept:
                measured["pruned"] = measure(
                    lambda n, ours: self._timed_step(
                        shape, layers, cfg, n, ours, prune=True, dense_kernel=from_ is not None and n >= from_
                    ),
                    contexts,
                )
            timings = measured["pruned"]
            found = crossover(timings)
            self.planner.cfg = cfg.model_copy(
                update={"min_context": found if found is not None else config.context_len + 1}
            )
        timed_now = measured.keys() != kept.keys()
        if timed_now:
            save_timings(path, key, measured)
        logger.info(
            "sgl-entropic: pruning from %s tokens, our kernel over every page from %s (%s %s; ms per step, "
            "context: SGLang's loop / ours over every page / ours pruned: %s)",
            self.planner.cfg.min_context,
            from_ if from_ is not None else "no measured context",
            "timed now, kept in" if timed_now else "as timed before, in",
            path,
            ", ".join(
                f"{k.context}: {k.dense_s * 1e3:.1f}/{k.sparse_s * 1e3:.1f}/"
                + (f"{t.sparse_s * 1e3:.1f}" if t else "-")
                for k, t in itertools.zip_longest(kernel_timings, timings)
            ),
        )
        return Probe(timings, kernel_timings, from_, check)

    def _timed_step(
        self, shape, layers: int, cfg: PruningConfig, n: int, ours: bool, prune: bool, dense_kernel: bool = False
    ):
        """One decode step's attention over every layer, for one row of n tokens of synthetic KV: the
        dense reference (SGLang's own loop, or our kernel over every page where it is faster), or ours
        (the pruned path: plan, bounds, selection at the budget an unknown entropy gives, attention,
        the key fold a pruned step does; or, with prune=False, our kernel over every page)."""
        heads_q, heads_kv, dim, dtype = shape
        p = cfg.page_size
        pages = -(-n // p)
        k, v = (torch.randn(pages * p, heads_kv, dim).to(dtype) for _ in range(2))
        q, scale = torch.randn(1, heads_q, dim).to(dtype), dim**-0.5
        out = torch.empty_like(q)
        req_to_token = torch.arange(pages * p, dtype=torch.int32)[None]
        one, seq_lens = torch.zeros(1, dtype=torch.long), torch.tensor([n])
        page_table = torch.arange(pages)[None]
        if not ours and not dense_kernel:

            def dense():
                for _ in range(layers):
                    TorchNativeAttnBackend._run_sdpa_forward_decode(
                        self, q, out, k, v, req_to_token, one, seq_lens, scaling=scale, enable_gqa=heads_q != heads_kv
                    )

            return dense
        store = PageStore([0], pages * p, p, heads_kv, dim, dtype, k.device, 1, with_surprisal=False)
        store.write_keys(0, torch.arange(n), k[:n])
        loc = torch.tensor([n - 1])
        pruned = ours and prune

        def step():
            rows = [row_pages(n, math.nan, cfg) if pruned else all_pages(n, p)]  # unknown entropy: most pages
            plan = StepPlan.build(rows, page_table, per_head=cfg.per_head)
            for _ in range(layers):
                out.copy_(attend_layer(q, k, v, plan, store.kmin[0], store.kmax[0], scale)[0])
                if pruned:
                    store.write_keys(0, loc, k[loc])

        return step

    def plain_step_attention(self) -> Optional[tuple[tuple[int, ...], tuple[float, ...]]]:
        """One row's attention in a plain decode step, every layer, at each timed context, from the kept crossover
        timings (the draft rule prices width 1 with it); None where they do not cover every context."""
        probe = self.probe
        found = plain_step_seconds(
            probe.kernel_timings, probe.timings, probe.dense_kernel_from, self.planner.cfg.min_context
        )
        if found is None:
            return None
        # the timings cover the full-context layers; sliding-window ones run SGLang's loop, which reads the whole
        # context and masks (TorchNativeAttnBackend._run_sdpa_forward_decode)
        full = len(self.planner.full_layers)
        others = (self.planner.attention_layers - full) / full
        loop = {t.context: t.dense_s for t in probe.kernel_timings}
        return tuple(n for n, _ in found), tuple(s + others * loop[n] for n, s in found)

    # ------------------------------------------------------------------ per step, per layer

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._dense_plan = None
        if forward_batch.forward_mode.is_target_verify():  # a speculative step attends densely: its keys wait
            self.planner.note_dense_step(forward_batch)
            self.plan = None
            return
        if not forward_batch.forward_mode.is_decode():
            self.planner.fold_deferred()  # before this extend's writes, which may restart a reused page
            self.plan = None
            return
        from_ = self.probe.dense_kernel_from
        dense_kernel = from_ is not None and max(forward_batch.seq_lens_cpu.tolist()) >= from_
        self.plan = self.planner.plan(forward_batch, runtime.step_rows(forward_batch), dense_kernel)
        self._batch = forward_batch

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._layer = layer if self.plan is not None else None
        out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self.planner.write_keys(layer, forward_batch, self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        return out

    def _layer_plan(self, layer) -> Optional[StepPlan]:
        """This layer's plan: the step's, every page (the dense layers of a pruned step), or None (SGLang's loop)."""
        plan = self.plan
        if plan is None or not self.planner.plain_layer(layer):
            return None
        if self.planner.sparse_layer(layer) or not plan.keep_valid.shape[1]:
            return plan
        if self._dense_plan is None:
            rows = [all_pages(r.length, r.page_size) for r in plan.rows]
            self._dense_plan = StepPlan.build(rows, plan.page_table, group_tokens=CPU_GROUP_TOKENS)
        return self._dense_plan

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, *args, scaling=None, **kwargs):
        plan = self._layer_plan(self._layer) if self._layer is not None else None
        if plan is None:  # SGLang's own per-request loop
            return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, *args, scaling=scaling, **kwargs)
        out, _ = attend_layer(query, k_cache, v_cache, plan, *self.planner.store.bounds(self._layer.layer_id), scaling)
        output.copy_(out)
        return output


def create_backend(model_runner):
    """`--attention-backend entropic`: with pruning, FlashInfer on CUDA and torch_native elsewhere; without
    (speculative decoding on CPU), torch_native with the verify forward it lacks."""
    rt = runtime.current()
    cfg = rt.config.pruning
    cuda = str(model_runner.device).startswith("cuda")
    if not rt.config.pruning_on:
        if cuda:
            raise ValueError(
                f"--attention-backend {BACKEND_NAME} without pruning serves CPU verification only; "
                "on CUDA keep SGLang's own backend"
            )
        return TreeVerifyAttnBackend(model_runner)
    if cuda:
        if model_runner.use_mla_backend:
            raise ValueError("--attention-backend entropic: MLA models are not supported (their KV layout differs)")
        from sgl_entropic.plugin.attention.flashinfer import EntropicFlashInferAttnBackend

        backend = EntropicFlashInferAttnBackend(model_runner, cfg)
    else:
        backend = EntropicTorchNativeAttnBackend(model_runner, cfg)
    rt.pages = backend.planner.store  # the prompt-scoring hook (surprisal selector) writes into it
    rt.pruning_from, rt.probe = backend.planner.cfg.min_context, backend.probe
    spec = rt.speculation  # the memory pools, and with them the draft rule's cost table, come first
    if spec is not None and spec.plain_steps_served and spec.sizer.costs.measured:
        from sgl_entropic.plugin.speculation.worker import with_plain_prices

        spec.sizer.costs = with_plain_prices(spec.sizer.costs, backend)
    return backend


def register_backend() -> None:
    """`--attention-backend entropic` (the launcher passes it for pruning|full, and for speculation on CPU)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:  # the list SGLang's argparse reads
        ATTENTION_BACKEND_CHOICES.append(BACKEND_NAME)
    register_attention_backend(BACKEND_NAME)(create_backend)


def around_can_run_graph(original, graph_runner, forward_batch, *args, **kwargs):
    """CUDA graphs: a decode batch that prunes runs eager (its page counts change every step); every
    other batch is SGLang's own decision, so steps that do not prune replay the captured graphs."""
    planner = getattr(graph_runner.attn_backend, "planner", None)
    if planner is not None and planner.rows(forward_batch, runtime.step_rows(forward_batch)) is not None:
        return False
    return original(graph_runner, forward_batch, *args, **kwargs)


def around_logits_forward(original, processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    """surprisal selector: prompt tokens' surprisal from the model's own logits, beside their KV slots."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    rt = runtime.current()
    store = rt.pages
    if (
        store is not None
        and store.slot_surprisal is not None
        and isinstance(logits_metadata, ForwardBatch)
        and logits_metadata.forward_mode.is_extend()
        and not logits_metadata.forward_mode.is_target_verify()
    ):
        try:
            store.record_prompt(processor, hidden_states, lm_head, logits_metadata)
        except Exception:  # unscored slots stay NaN, i.e. always attended
            rt.fault("scoring the prompt tokens (their pages stay attended)")
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
