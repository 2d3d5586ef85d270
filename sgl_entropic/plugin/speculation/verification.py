"""NGRAM's verification under the loops (`eagle_sample`), in the scheduler process.

Every node of the verify tree is sampled from the distribution sequential decoding would sample there (the
request's temperature, top-k/top-p/min-p and seed; the zero-lag controller along the node's path), and the
drafts that match are accepted (greedy: the argmax, as SGLang does). SGLang's own verify never applies the
controller and on CPU always commits the argmax. Every committed token then gets its entropy, surprisal and
temperature from the verify logits, and its trace the step's real work: a verify over W nodes costs W tokens'
compute, charged on the step's first token (`VerifyRecord`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from sgl_entropic.costs import step_cost
from sgl_entropic.drafting import capped_candidates, draft_trials, tree_temperatures
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.sampling.controller import ControllerTable
from sgl_entropic.plugin.signal.traces import (
    NO_DRAFT,
    NullRecord,
    StepTally,
    committed_tokens,
    send_totals,
    record_token,
    token_count,
)
from sgl_entropic.plugin.speculation.worker import DraftPlan
from sgl_entropic.plugin.step import BatchRows, current_step
from sgl_entropic.sampling import ControllerBatch
from sgl_entropic.signal import token_stats
from sgl_entropic.transfer import to_device


def around_eagle_sample(original, verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
    """NGRAM's verification, lossless under the request's sampling and the controller (module docstring)."""
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    rt = runtime.current()
    if not isinstance(verify_input, NgramVerifyInput) or batch.forward_mode.is_idle():
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    # A fault in our work costs the step its control or its trace, never the scheduler; without a plan of ours
    # (the draft rule's verify batch failed) SGLang's verification serves the step. Either way its committed
    # tokens get null trace values.
    step = current_step(rt)
    plan, result = step.plan if rt.speculation is not None else None, None
    if plan is not None:
        try:
            result, make_record = verify(rt, plan, verify_input, batch, logits_output.next_token_logits, grammar_mask)
        except Exception:
            rt.fault("verification under the controller (SGLang's verification served the step)")
        else:
            try:
                step.records.append(make_record())
                return result
            except Exception:
                rt.fault("the verify step's signal")
    if result is None:
        result = original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    step.records.append(NullRecord(verify_rows(batch), committed=result[1]))  # (predict, accept_lens, accept_index)
    return result


def verify_rows(batch) -> BatchRows:
    rows = BatchRows.of(
        batch.reqs, [True] * len(batch.reqs), decode=True, forward_iter=getattr(batch, "forward_iter", None)
    )
    rows.drop_released()
    return rows


def verify(rt: Runtime, plan: DraftPlan, verify_input, batch, logits: torch.Tensor, grammar_mask):
    """SGLang's steps of verification (timed as SGLang's), with the node temperatures ours; returns eagle_sample's
    result and what makes the step's record."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    info, sglang = batch.sampling_info, rt.times.sglang
    bs, width = len(batch.reqs), verify_input.draft_token_num

    def prepare():  # as eagle_sample does: the penalties as of the step's start, on every node
        sanitize_nan_logits(logits, "verify: target model logits")
        if info.acc_additive_penalties is not None:
            logits.add_(info.acc_additive_penalties.repeat_interleave(width, dim=0))
        if info.acc_scaling_penalties is not None:
            apply_scaling_penalties(logits, info.acc_scaling_penalties.repeat_interleave(width, dim=0))
        if info.logit_bias is not None:
            logits.add_(info.logit_bias.repeat_interleave(width, dim=0))
        if grammar_mask is not None:
            grammar_mask.apply(logits)

    sglang(prepare)
    rows = verify_rows(batch)
    table: ControllerTable = rt.controllers
    greedy = info.top_ks.view(-1) == 1
    node_t = info.temperatures.view(-1).float()[:, None].repeat(1, width)  # [bs, W]
    ctrl = rows.positions("controller")
    if ctrl:
        pos = to_device(ctrl, logits.device)
        slots = batch.req_pool_indices.index_select(0, pos).long()
        table.load([rows.reqs[i].kv.req_pool_idx for i in ctrl], [rows.states[i] for i in ctrl], "controller")
        controllers = ControllerBatch(*table.entropic.index_select(1, slots))
        node_t.index_copy_(
            0,
            pos,
            tree_temperatures(
                logits.view(bs, width, -1).index_select(0, pos), plan.parent.index_select(0, pos), controllers
            ),
        )

    def sample():  # every node from its own distribution, by SGLang's sampler; then SGLang's walk
        if info.is_all_greedy:
            target = logits.argmax(dim=-1)
        else:  # softmax at the node's temperature, then the request's top-k/top-p/min-p and seed
            probs = torch.softmax(logits.float() / node_t.view(-1, 1), dim=-1)
            per_node = {
                name: getattr(info, name).repeat_interleave(width, dim=0)
                for name in ("temperatures", "top_ps", "top_ks", "min_ps")
            }
            if info.sampling_seed is not None:
                per_node["sampling_seed"] = info.sampling_seed.repeat_interleave(width, dim=0)
            node_info = dataclasses.replace(info, sampling_mask_batch_indices=None, **per_node)
            simple = not (info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling)
            target, _ = rt.speculation.sampler._sample_from_probs(probs, node_info, verify_input.positions, simple)
        candidates = verify_input.draft_token.view(bs, width)
        if plan.caps is not None:  # requests' own caps, penalized rows' 0
            candidates = capped_candidates(candidates, plan.caps)
        predict = torch.zeros(bs * width, dtype=torch.int32, device=logits.device)
        accept_index = torch.full((bs, width), -1, dtype=torch.int32, device=logits.device)
        num_correct = torch.empty((bs,), dtype=torch.int32, device=logits.device)
        verify_tree_greedy_func(
            predicts=predict,
            accept_index=accept_index,
            accept_token_num=num_correct,
            candidates=candidates,
            retrieve_index=verify_input.retrieve_index,
            retrieve_next_token=verify_input.retrieve_next_token,
            retrieve_next_sibling=verify_input.retrieve_next_sibling,
            target_predict=target.view(bs, width),
            topk=verify_input.tree_topk,
        )
        tp_group = get_parallel().tp_group
        if tp_group.world_size > 1:  # ranks may sample differently: rank 0's verdict stands, as in eagle_sample
            for t in (predict, accept_index, num_correct, target):
                tp_group.broadcast(t, src=0)
        return target.view(-1), predict, accept_index, num_correct + 1

    target, predict, accept_index, accept_lens = sglang(sample)
    return (predict, accept_lens, accept_index), functools.partial(
        record, rt, plan, rows, logits, node_t, greedy, target, accept_index, accept_lens, ctrl, batch
    )


def record(
    rt: Runtime,
    plan: DraftPlan,
    rows: BatchRows,
    logits,
    node_t,
    greedy,
    target,
    accept_index,
    accept_lens,
    ctrl: list[int],
    batch,
) -> "VerifyRecord":
    """The committed nodes' signal, the controllers' state after the step, one host transfer.

    A committed node's token is its sample (`target`). On CPU only the committed nodes are measured and the rest
    is host bookkeeping in numpy (torch's per-op cost on small tensors was most of the plugin's time in a verify
    plan); on a GPU every node is measured on the device, which needs no device read.
    """
    bs, width = accept_index.shape
    if ctrl:  # the controller's state is the one after the request's last committed token
        pos = to_device(ctrl, logits.device)
        slots = batch.req_pool_indices.index_select(0, pos).long()
        last_node = accept_index.long().gather(1, (accept_lens.long() - 1)[:, None]).squeeze(1).index_select(0, pos)
        temperature, taken = node_t.view(-1).index_select(0, last_node), accept_lens.float().index_select(0, pos)
        rt.controllers.store(slots, temperature, taken, advance=True)
    if logits.is_cpu:
        nodes = accept_index.numpy()
        committed = nodes >= 0
        keep = torch.from_numpy(nodes[committed].astype(np.int64))
        row_greedy = greedy.numpy()[np.nonzero(committed)[0]]
        temps = node_t.view(-1).index_select(0, keep)
        inv_t = torch.where(torch.from_numpy(row_greedy), 1.0, 1.0 / temps)  # greedy: measured at T = 1
        at = logits.narrow(0, int(keep[0]), len(keep)) if contiguous(keep) else rt.scratch.rows(logits, keep)
        measured = token_stats(at, target.index_select(0, keep), inv_t, rt.scratch)
        host = np.zeros((6, bs, width), dtype=np.float32)
        host[:, committed] = np.stack(
            [
                measured.entropy.numpy(),
                measured.surprisal.numpy(),
                measured.valid.numpy(),
                np.where(row_greedy, 0.0, temps.numpy()),
                np.ones(len(keep)),
                target.index_select(0, keep).numpy(),
            ]
        )
        return VerifyRecord(rows, host, None, batch.seq_lens_cpu.tolist(), plan)
    committed = accept_index >= 0
    nodes = accept_index.long().clamp_min(0).view(-1)  # flat node index per committed position (0 beyond)
    inv_t = torch.where(greedy[:, None], 1.0, 1.0 / node_t).view(-1)
    measured = token_stats(logits, target, inv_t)
    used_t = torch.where(greedy[:, None], 0.0, node_t).view(-1)
    values = torch.stack(
        [x.float().gather(0, nodes) for x in (measured.entropy, measured.surprisal, measured.valid, used_t)]
        + [committed.float().view(-1), target.float().gather(0, nodes)]
    )
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
    host.copy_(values, non_blocking=True)
    ready = None
    if values.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return VerifyRecord(rows, host.view(6, bs, width), ready, batch.seq_lens_cpu.tolist(), plan)


def contiguous(nodes: torch.Tensor) -> bool:
    """Whether ascending node indices are a run (one row's chain: its rows of the logits are a view, not a copy)."""
    return int(nodes[-1]) - int(nodes[0]) + 1 == len(nodes)


@dataclass
class VerifyRecord:
    """A verify step's values on their way to the host; `finish` is `PendingRecord.finish` for k tokens a row."""

    rows: BatchRows
    host: object  # [6, bs, W] (numpy on CPU): entropy, surprisal, valid, temperature used, committed, token
    # (token ids < 2^24 are exact in float32)
    ready: Optional[object]
    seq_lens: list[int]
    plan: DraftPlan
    tally: StepTally = field(default_factory=StepTally)

    @functools.cached_property
    def accepted(self) -> list[int]:
        """Drafts each row accepted (its committed tokens, less the one the root always gives); read once."""
        if self.ready is not None:
            self.ready.synchronize()
        return [int(sum(c)) - 1 for c in self.host[4].tolist()]

    def tokens(self) -> list[int]:
        return [
            committed_tokens(r, a + 1) if s is not None else 0
            for r, s, a in zip(self.rows.reqs, self.rows.states, self.accepted)
        ]

    def finish(self, rt: Runtime) -> None:
        accepted, counts = self.accepted, self.tokens()
        entropy, surprisal, valid, used_t, _, token = self.host.tolist()
        plan, spec, drafted = self.plan, rt.speculation, self.plan.drafted
        roots = [int(t[0]) for t in token]
        tried, right = draft_trials(drafted, accepted, plan.offers, plan.first_draft.tolist(), roots)
        if plan.source_firsts is not None:
            spec.tries.observe([r.rid for r in self.rows.reqs], plan.source_firsts, roots)
        for i, state in enumerate(self.rows.states):
            req, n = self.rows.reqs[i], counts[i]
            if state is None:
                continue
            work = plan.width * step_cost(rt.dims, self.seq_lens[i] + plan.width)
            end, measured = token_count(req) + n, []
            for j in range(n):
                ok = valid[i][j] > 0
                record_token(
                    rt,
                    req,
                    state,
                    self.tally,
                    entropy[i][j],
                    surprisal[i][j],
                    ok,
                    used_t[i][j],
                    work if j == 0 else 0.0,
                    **(
                        NO_DRAFT
                        if j
                        else {
                            "offered": plan.offers[i],
                            "drafted": drafted[i],
                            "accepted": accepted[i],
                            "draft_source": source(plan, i, drafted[i]),
                        }
                    ),
                )
                if ok:
                    measured.append(entropy[i][j])
            if state.controller is not None:
                state.controller.temperature = used_t[i][n - 1]
                state.controller.steps_done += n
            state.last_step_entropy = sum(measured) / len(measured) if measured else None
            state.drafts.observe(tried[i], right[i])
            send_totals(rt, req, state, end)
        self.tally.report(rt)
        spec.sizer.observe(plan.width, accepted)
        spec.steps += 1
        spec.rows += len(accepted)
        spec.verified += plan.width * len(accepted)
        spec.drafted += sum(drafted)
        spec.accepted += sum(accepted)
        for i in (i for i, c in enumerate(plan.from_corpus) if c and drafted[i]):
            spec.corpus_drafted += drafted[i]
            spec.corpus_accepted += accepted[i]
        spec.committed += sum(a + 1 for a in accepted)
        shadow = [i for i, d in enumerate(drafted) if d == 0 and tried[i]]
        spec.shadow_tried += len(shadow)
        spec.shadow_right += sum(right[i] for i in shadow)
        if rt.metrics is not None:
            rt.metrics.observe_verify(drafted, accepted, plan.width)


def source(plan: DraftPlan, i: int, drafted: int) -> Optional[str]:
    """Where row i's verified drafts came from: its trie (SGLang's, or its own), or an external corpus."""
    if not drafted:
        return None
    return "corpus" if plan.from_corpus and plan.from_corpus[i] else "trie"
