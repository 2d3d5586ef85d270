"""SGLang's NGRAM speculative decoding under the loops, in the scheduler process.

Four hooks on SGLang's NGRAM worker (`speculative/ngram_worker.py`):
  - `alloc_memory_pool` (start-up): the draft rule's cost table, kept per machine (`step_costs.py`);
  - `forward_batch_generation`: each decode step planned (the trie's drafts, the width the server's rule picks:
    `sgl_entropic.speculative.DraftSizer`); at width 1 the plain decode step (`plain_step`: what a server without
    speculation runs), else SGLang's verify step at that width, its output in SGLang's full-width layout;
  - `_prepare_for_speculative_decoding`: the same verify batch SGLang builds, at the planned width instead of
    always the maximum;
  - `eagle_sample` (NGRAM's verification): every node is sampled from the distribution sequential decoding
    would sample there (the request's temperature, top-k/top-p/min-p and seed; the zero-lag controller along
    the node's path), and the drafts that match are accepted (greedy: the argmax, as SGLang does). SGLang's
    own verify never applies the controller and on CPU always commits the argmax.
Every committed token then gets its entropy, surprisal and temperature from the verify logits, and its trace
the step's real work: a verify over W nodes costs W tokens' compute, charged on the step's first token.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from sgl_entropic.costs import step_cost
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.sampling_step import (
    _STEPS,
    _T,
    NO_DRAFT,
    BatchRows,
    ControllerTable,
    NullRecord,
    PendingRecord,
    StepTally,
    committed_tokens,
    record_token,
)
from sgl_entropic.sampling import ControllerBatch
from sgl_entropic.signal import token_stats
from sgl_entropic.transfer import to_device
from sgl_entropic.plugin.drafts import RequestTries
from sgl_entropic.plugin.step_costs import load_or_measure
from sgl_entropic.speculative import (
    DraftSizer,
    StepCosts,
    capped_candidates,
    draft_acceptance,
    draft_trials,
    offered_drafts,
    tree_parents,
    tree_temperatures,
)


@dataclass
class VerifyStep:
    """One decode step's plan, from the trie's drafts to the record of its result."""

    width: int  # nodes per row, the root included; 1 with `plain`: the plain decode step
    offers: list[int]  # drafts each row's trie match offered
    drafts: np.ndarray  # [bs, W] the trie's tree at the step's width (node 0: each row's last committed token)
    mask: np.ndarray  # [bs, W, W]
    first_draft: np.ndarray  # [bs] each row's first offered draft, verified or not (draft_trials)
    plain: bool = False  # width 1 on the plain decode path (plain_step)
    caps: Optional[list[int]] = None  # each row's most drafts where a row's is below W - 1 (penalties: 0)
    from_corpus: list[bool] = field(default_factory=list)  # rows whose drafts came from an external corpus
    source_firsts: Optional[list] = None  # with a corpus: each row's first draft from its trie and from the corpus
    parent: Optional[torch.Tensor] = None  # [bs, W] each node's parent (-1: the root), on the model's device

    @property
    def drafted(self) -> list[int]:
        return [min(self.width - 1, k) for k in self.offers]


@dataclass
class Speculation:
    """The server's speculative state: the rule's memory and what it reports."""

    sizer: DraftSizer
    tries: Optional[RequestTries] = None  # speculative.drafts 'request': each request's own trie; else SGLang's
    plain_steps_served: bool = False  # width 1 runs plain decode steps here (after_alloc_memory_pool)
    step: Optional[VerifyStep] = None  # the step being run (plan -> verify -> its end)
    sampler: object = None  # the model runner's Sampler, which samples every node
    steps: int = 0
    plain_steps: int = 0  # decode steps the rule ran plain (width 1, no verify forward)
    rows: int = 0  # row-steps
    verified: int = 0  # tokens the verify forwards ran (rows * W)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    corpus_drafted: int = 0  # of `drafted` and `accepted`, those from an external corpus (drafts.py)
    corpus_accepted: int = 0
    shadow_tried: int = 0  # rows that verified no drafts but whose trie offered one (draft_trials)
    shadow_right: int = 0

    def summary(self) -> dict:
        """`/server_info` -> internal_states[i].entropic.speculative."""
        per = lambda x, n: x / n if n else None  # noqa: E731
        return {
            "rule": self.sizer.rule,
            "drafts": "server" if self.tries is None else "request",
            "max_width": self.sizer.max_width,
            "verify_steps": self.steps,
            "plain_steps": self.plain_steps,
            "mean_width": per(self.verified, self.rows),
            "drafted_per_row_step": per(self.drafted, self.rows),
            "accepted_per_row_step": per(self.accepted, self.rows),
            "verified_per_committed_token": per(self.verified, self.committed),
            "step_costs": self.sizer.costs.table(),
            "totals": {
                "verify_steps": self.steps,
                "plain_steps": self.plain_steps,
                "rows": self.rows,
                "verified": self.verified,
                "drafted": self.drafted,
                "accepted": self.accepted,
                "committed": self.committed,
                "corpus_drafted": self.corpus_drafted,
                "corpus_accepted": self.corpus_accepted,
                "shadow_tried": self.shadow_tried,
                "shadow_right": self.shadow_right,
            },
        }


def after_alloc_memory_pool(result, worker, *args, **kwargs):
    """At start-up, once the model and its KV pool exist: the server's speculative state and its cost table."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    rt = runtime.current()
    rule, width = rt.config.speculative.draft, worker.speculative_num_draft_tokens
    costs = StepCosts()
    if rule == "entropy":
        try:
            costs = load_or_measure(worker.model_runner, width)
        except Exception:  # the server serves; without a table the rule verifies every draft offered
            rt.fault("the draft rule's cost table")
    tries = RequestTries() if rt.config.speculative.drafts == "request" else None
    # plain steps on CPU (on CUDA the verify forward keeps its graphs), for models without recurrent state
    plain = torch.device(worker.device).type == "cpu" and mambaish_config(worker.model_runner.model_config) is None
    rt.speculation = Speculation(DraftSizer(rule, width, costs), tries, plain, sampler=worker.model_runner.sampler)
    return result


# ---------------------------------------------------------------------------------------------- hooks


def around_forward_batch_generation(original, worker, batch, *args, **kwargs):
    """One NGRAM step: planned here (the trie's drafts, the rule's width); at width 1 the plain decode step, else
    SGLang's verify step at that width (`around_prepare_for_speculative_decoding`), its output in SGLang's
    full-width layout."""
    rt = runtime.current()
    spec = rt.speculation
    spec.step = None
    if batch.forward_mode.is_decode() and batch.reqs:
        try:
            spec.step = plan(rt, spec, worker, batch)
        except Exception:  # SGLang's own full-width step; its verification then records null values
            rt.fault("the draft rule's plan")
        if spec.step is not None and spec.step.plain:
            try:
                return plain_step(rt, spec, worker, batch, *args, **kwargs)
            finally:
                spec.step = None
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        worker.draft_token_num = spec.sizer.max_width
        step, spec.step = spec.step, None
        rt.rows = None  # a verify forward does not sample through ModelRunner.sample, which clears them
    if step is not None:
        widen(result, step.width, spec.sizer.max_width)
    return result


def around_update_ngram_corpus(original, worker, batch, *args, **kwargs):
    """SGLang feeds its shared trie each step; with each request's own trie (`speculative.drafts` 'request') it is
    never read, and it must stay empty: its corpus object also serves the external corpora (`drafts.py`)."""
    if runtime.current().speculation.tries is None:
        return original(worker, batch, *args, **kwargs)
    return None


def around_prepare_for_speculative_decoding(original, worker, batch, *args, **kwargs):
    """SGLang's verify batch (`NGRAMWorker._prepare_for_speculative_decoding`), at the planned width."""
    rt = runtime.current()
    spec = rt.speculation
    if not batch.forward_mode.is_decode() or spec.step is None:
        return original(worker, batch, *args, **kwargs)
    try:
        return build_verify(rt, spec.step, worker, batch)
    except Exception:  # SGLang's own full-width step; its verification then records null values (around_eagle_sample)
        rt.fault("the draft rule's verify batch")
        spec.step, worker.draft_token_num = None, spec.sizer.max_width
        return original(worker, batch, *args, **kwargs)


def plan(rt: Runtime, spec: "Speculation", worker, batch) -> VerifyStep:
    """This step's drafts (the trie's, as SGLang reads them) and the width the rule picks for them."""
    bs, full = len(batch.reqs), spec.sizer.max_width
    worker.draft_token_num = full  # the corpus returns full-width trees
    states = [getattr(r, "entropic", None) for r in batch.reqs]
    rules, caps = request_choices(states, spec.sizer.rule, full - 1)
    for i, p in enumerate(penalized(batch.reqs)):
        if p:  # they verify no drafts (verify(): the root only)
            caps[i] = 0
    if spec.tries is None:
        drafts, mask = rt.times.sglang(worker._prepare_draft_tokens, batch)
        from_corpus, firsts = [False] * bs, None  # SGLang's own match mixes its trie and the corpora
    else:
        drafts, mask, from_corpus, firsts = spec.tries.drafts(
            worker, batch, frozenset(i for i, r in enumerate(rules) if r == "off")
        )
        worker.prev_token_ids, worker.prev_accept_lens = [], [0] * bs  # SGLang's trie update reads them
    drafts, mask = drafts.reshape(bs, full), mask.reshape(bs, full, full)
    offers = [min(k, c) for k, c in zip(offered_drafts(drafts, mask).tolist(), caps)]
    acceptance = [1.0 if s is None else draft_acceptance(s.last_step_entropy, s.drafts) for s in states]
    # the plain step where it serves the batch as plain decoding would: no logprobs or grammar (SGLang returns and
    # constrains them per verified node)
    plain = spec.plain_steps_served and not batch.return_logprob and not batch.has_grammar
    own_rules = None if all(r == spec.sizer.rule for r in rules) else rules
    capped = None if all(c == full - 1 for c in caps) else caps
    width = spec.sizer.width(offers, acceptance, batch.seq_lens_cpu.tolist(), plain, own_rules, capped)
    first_draft = drafts[:, min(1, full - 1)].copy()  # read at the step's end; the corpus's arrays are its own
    return VerifyStep(
        width,
        offers,
        np.ascontiguousarray(drafts[:, :width]),
        np.ascontiguousarray(mask[:, :width, :width]),
        first_draft,
        plain and width == 1,
        None if capped is None or width == 1 else capped,
        from_corpus,
        firsts,
    )


def request_choices(states, rule: str, most: int) -> tuple[list[str], list[int]]:
    """Each row's draft rule and most drafts a step: its request's own (`custom_params.entropic.speculative`), else
    the server's; a cap of 0 is rule 'off' and rule 'off' a cap of 0."""
    rules, caps = [], []
    for state in states:
        own = state.speculation if state is not None else None
        r = (own.draft if own is not None else None) or rule
        c = most if own is None or own.max_draft_tokens is None else min(own.max_draft_tokens, most)
        rules.append("off" if c == 0 else r)
        caps.append(0 if r == "off" else c)
    return rules, caps


def build_verify(rt: Runtime, step: VerifyStep, worker, batch) -> None:
    """The verify batch SGLang's `_prepare_for_speculative_decoding` builds, at the step's width."""
    from sglang.srt.speculative import ngram_worker as nw

    bs, width, device = len(batch.reqs), step.width, worker.device
    drafts, mask = torch.from_numpy(step.drafts), torch.from_numpy(step.mask)
    parents = torch.from_numpy(tree_parents(step.mask))
    step.parent = parents if torch.device(device).type == "cpu" else parents.pin_memory().to(device, non_blocking=True)

    def build():  # SGLang's own steps, at `width`
        tree_mask = mask.reshape(-1).to(device=device, dtype=torch.bool)
        draft_tokens = drafts.reshape(-1).to(device)
        positions = torch.empty(bs * width, dtype=torch.int64, device=device)
        links = [torch.empty((bs, width), dtype=torch.int64, device=device) for _ in range(3)]
        nw.reconstruct_indices_from_tree_mask_func(tree_mask, batch.seq_lens, positions, *links, bs, width)
        if nw.USE_FULL_MASK and not nw._is_cpu:  # FlashInfer reads each row's prefix columns too
            tree_mask = torch.cat(
                [
                    torch.cat(
                        (
                            torch.ones(width, int(n), device=device, dtype=torch.bool),
                            mask[b].to(device=device, dtype=torch.bool),
                        ),
                        dim=1,
                    ).flatten()
                    for b, n in enumerate(batch.seq_lens_cpu.tolist())
                ]
            )
        batch.forward_mode = nw.ForwardMode.TARGET_VERIFY
        batch.input_ids = draft_tokens
        batch.out_cache_loc = nw.assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens,
            end_offset=batch.seq_lens + width,
            batch_size=bs,
            draft_token_num=width,
            device=device,
        )
        nw.prepare_mamba_track_for_verify(batch)
        batch.spec_info = nw.NgramVerifyInput(
            draft_token=draft_tokens,
            custom_mask=tree_mask,
            positions=positions,
            retrieve_index=links[0],
            retrieve_next_token=links[1],
            retrieve_next_sibling=links[2],
            draft_token_num=width,
        )
        worker.grammar_tree_host = (mask.reshape(-1).numpy(), drafts.reshape(-1).numpy()) if batch.has_grammar else None

    rt.times.sglang(build)
    worker.draft_token_num = width  # the rest of the step reads it (the mamba commit, the next draft input)


def plain_step(rt: Runtime, spec: "Speculation", worker, batch, on_publish=None, pp_proxy_tensors=None):
    """The step a server without speculation runs: one token a row through the decode forward (the same
    attention, pruning included, and sampling hooks), in the NGRAM worker's result layout. Where SGLang's NGRAM
    step verifies node 0 alone it pays a verify forward, its tree bookkeeping and its verification instead."""
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative import ngram_worker as nw

    step, bs, full, device = spec.step, len(batch.reqs), spec.sizer.max_width, worker.device
    committed = batch.seq_lens  # SGLang's spec batches keep the committed length; decode counts the new token
    kept = (batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens, batch.seq_lens_sum)

    def prepare():  # node 0 of every row at its slot, as plain decoding's prepare_for_decode leaves the batch
        batch.out_cache_loc = nw.assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=committed,
            end_offset=committed + 1,
            batch_size=bs,
            draft_token_num=1,
            device=device,
        )
        batch.input_ids = torch.from_numpy(step.drafts[:, 0].astype(np.int64)).to(device)
        batch.seq_lens, batch.seq_lens_cpu = committed + 1, batch.seq_lens_cpu + 1
        batch.orig_seq_lens, batch.seq_lens_sum = batch.orig_seq_lens + 1, None
        batch.spec_info = None

    rt.times.sglang(prepare)
    try:
        result = rt.times.sglang(
            worker.target_worker.forward_batch_generation, batch, pp_proxy_tensors=pp_proxy_tensors
        )
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens, batch.seq_lens_sum = kept
    if rt.pending and isinstance(rt.pending[-1], PendingRecord):  # this step's, queued by the sampler
        rt.pending[-1].offers = step.offers
    predict = result.next_token_ids
    new_seq_lens = committed + 1
    accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
    accept_tokens = torch.zeros(bs, full, dtype=torch.int32, device=device)
    accept_tokens[:, 0] = predict
    accept_tokens = accept_tokens.flatten()
    if on_publish is not None:
        on_publish(new_seq_lens)

    def bookkeeping():  # SGLang's trie and its match state, as its step leaves them
        worker._update_ngram_corpus(batch)
        current = {req.rid for req in batch.reqs}
        departed = worker._prev_decode_rids - current
        if departed:
            worker.ngram_corpus.erase_match_state(list(departed))
        worker._prev_decode_rids = current

    if spec.tries is None:
        rt.times.sglang(bookkeeping)
    try:  # each row's first offered draft against its token: the draft record follows the text (draft_trials)
        roots = predict.tolist()
        tried, right = draft_trials([0] * bs, [0] * bs, step.offers, step.first_draft.tolist(), roots)
        if step.source_firsts is not None:
            spec.tries.observe([r.rid for r in batch.reqs], step.source_firsts, roots)
        for req, t, r in zip(batch.reqs, tried, right):
            state = getattr(req, "entropic", None)
            if state is not None:
                state.drafts.observe(t, r)
        spec.plain_steps += 1
        spec.shadow_tried += sum(tried)
        spec.shadow_right += sum(right)
    except Exception:
        rt.fault("the plain step's draft record")
    return GenerationBatchResult(
        logits_output=result.logits_output,
        next_token_ids=accept_tokens,
        can_run_cuda_graph=result.can_run_cuda_graph,
        accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=nw.NgramVerifyInput(
            draft_token_num=full, new_seq_lens=new_seq_lens, accept_tokens=accept_tokens, accept_lens=accept_lens
        ),
        speculative_num_draft_tokens=worker.speculative_num_draft_tokens,
    )


def widen(result, width: int, full: int) -> None:
    """The step's accepted tokens in SGLang's layout, `full` columns a row whatever the step's width: the draft
    input is carried, filtered and merged with other batches' (an extend's is full-width) as one tensor."""
    if width == full:
        return
    tokens = result.next_token_ids.view(-1, width)
    padded = tokens.new_zeros(tokens.shape[0], full)
    padded[:, :width] = tokens
    result.next_token_ids = padded.view(-1)
    draft = result.next_draft_input
    draft.accept_tokens = result.next_token_ids
    draft.draft_token_num = draft.num_tokens_per_req = draft.num_tokens_for_logprob_per_req = full


def around_eagle_sample(original, verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
    """NGRAM's verification, lossless under the request's sampling and the controller (module docstring)."""
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    rt = runtime.current()
    if not isinstance(verify_input, NgramVerifyInput) or batch.forward_mode.is_idle():
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    # A fault in our work costs the step its control or its trace, never the scheduler; without a plan of ours
    # (the draft rule's verify batch failed) SGLang's verification serves the step. Either way its committed
    # tokens get null trace values.
    step = rt.speculation.step if rt.speculation is not None else None
    result = None
    if step is not None:
        try:
            result, make_record = verify(rt, step, verify_input, batch, logits_output.next_token_logits, grammar_mask)
        except Exception:
            rt.fault("verification under the controller (SGLang's verification served the step)")
        else:
            try:
                rt.pending.append(make_record())
                return result
            except Exception:
                rt.fault("the verify step's signal")
    if result is None:
        result = original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    rt.pending.append(NullRecord(verify_rows(batch), committed=result[1]))  # (predict, accept_lens, accept_index)
    return result


def verify_rows(batch) -> BatchRows:
    rows = BatchRows.of(
        batch.reqs, [True] * len(batch.reqs), decode=True, forward_iter=getattr(batch, "forward_iter", None)
    )
    rows.drop_released()
    return rows


def around_get_last_loc(original, req_to_token, req_pool_indices, prefix_lens, *args, **kwargs):
    """On CPU, SGLang's torch version (its Triton one needs a GPU; it is chosen by backend name, and ours is
    not `torch_native`)."""
    if req_to_token.is_cpu:
        from sglang.srt.mem_cache.allocation import get_last_loc_torch

        return get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)
    return original(req_to_token, req_pool_indices, prefix_lens, *args, **kwargs)


def verify(rt: Runtime, step: VerifyStep, verify_input, batch, logits: torch.Tensor, grammar_mask):
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
                logits.view(bs, width, -1).index_select(0, pos), step.parent.index_select(0, pos), controllers
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
        if step.caps is not None:  # requests' own caps, penalized rows' 0
            candidates = capped_candidates(candidates, step.caps)
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
        record, rt, step, rows, logits, node_t, greedy, target, accept_index, accept_lens, ctrl, batch
    )


def record(
    rt: Runtime,
    step: VerifyStep,
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
    step); on a GPU every node is measured on the device, which needs no device read.
    """
    bs, width = accept_index.shape
    if ctrl:  # the controller's state is the one after the request's last committed token
        pos = to_device(ctrl, logits.device)
        slots = batch.req_pool_indices.index_select(0, pos).long()
        last_node = accept_index.long().gather(1, (accept_lens.long() - 1)[:, None]).squeeze(1).index_select(0, pos)
        rt.controllers.entropic[_T].index_copy_(0, slots, node_t.view(-1).index_select(0, last_node))
        rt.controllers.entropic[_STEPS].index_add_(0, slots, accept_lens.float().index_select(0, pos))
    if logits.is_cpu:
        nodes = accept_index.numpy()
        committed = nodes >= 0
        keep = torch.from_numpy(nodes[committed].astype(np.int64))
        row_greedy = greedy.numpy()[np.nonzero(committed)[0]]
        temps = node_t.view(-1).index_select(0, keep)
        inv_t = torch.where(torch.from_numpy(row_greedy), 1.0, 1.0 / temps)  # greedy: measured at T = 1
        at = logits.narrow(0, int(keep[0]), len(keep)) if contiguous(keep) else logits.index_select(0, keep)
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
        return VerifyRecord(rows, host, None, batch.seq_lens_cpu.tolist(), step)
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
    return VerifyRecord(rows, host.view(6, bs, width), ready, batch.seq_lens_cpu.tolist(), step)


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
    step: VerifyStep
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
        step, spec, drafted = self.step, rt.speculation, self.step.drafted
        roots = [int(t[0]) for t in token]
        tried, right = draft_trials(drafted, accepted, step.offers, step.first_draft.tolist(), roots)
        if step.source_firsts is not None:
            spec.tries.observe([r.rid for r in self.rows.reqs], step.source_firsts, roots)
        for i, state in enumerate(self.rows.states):
            req, n = self.rows.reqs[i], counts[i]
            if state is None:
                continue
            work = step.width * step_cost(rt.dims, self.seq_lens[i] + step.width)
            measured = []
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
                            "offered": step.offers[i],
                            "drafted": drafted[i],
                            "accepted": accepted[i],
                            "draft_source": source(step, i, drafted[i]),
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
        self.tally.report(rt)
        spec.sizer.observe(step.width, accepted)
        spec.steps += 1
        spec.rows += len(accepted)
        spec.verified += step.width * len(accepted)
        spec.drafted += sum(drafted)
        spec.accepted += sum(accepted)
        for i in (i for i, c in enumerate(step.from_corpus) if c and drafted[i]):
            spec.corpus_drafted += drafted[i]
            spec.corpus_accepted += accepted[i]
        spec.committed += sum(a + 1 for a in accepted)
        shadow = [i for i, d in enumerate(drafted) if d == 0 and tried[i]]
        spec.shadow_tried += len(shadow)
        spec.shadow_right += sum(right[i] for i in shadow)
        if rt.metrics is not None:
            rt.metrics.observe_verify(drafted, accepted, step.width)


def source(step: VerifyStep, i: int, drafted: int) -> Optional[str]:
    """Where row i's verified drafts came from: its trie (SGLang's, or its own), or an external corpus."""
    if not drafted:
        return None
    return "corpus" if step.from_corpus and step.from_corpus[i] else "trie"


PENALTIES = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0))


def penalized(reqs) -> list[bool]:
    """Rows with penalties. SGLang applies them to every node of a verify tree as of the step's start, and feeds
    each step's last token alone to the penalizer: exact for one committed token a step, so such rows commit
    their root's token only (what plain decoding would), and cost a verify row, not a decode row."""
    return [any(getattr(r.sampling_params, name, neutral) != neutral for name, neutral in PENALTIES) for r in reqs]


def refuse_request(sampling_params, mirostat: bool) -> None:
    """What verification cannot keep exact is refused (ValueError -> HTTP 400), never silently relaxed."""
    if mirostat:
        raise ValueError(
            "custom_params.entropic.controller: mirostat_v2 is not served under speculative decoding "
            "(the entropic controller is)"
        )
