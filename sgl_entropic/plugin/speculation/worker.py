"""SGLang's NGRAM speculative decoding under the loops: each decode step planned, in the scheduler process.

Hooks on SGLang's NGRAM worker (`speculative/ngram_worker.py`):
  - `alloc_memory_pool` (start-up): the draft rule's cost table, kept per machine (`step_costs.py`); its plain
    step is priced once the attention backend exists (`with_plain_prices`, from the backend's crossover timings);
  - `forward_batch_generation`: each decode step planned (the trie's drafts, the width the server's rule picks:
    `sgl_entropic.drafting.DraftSizer`); at width 1 the plain decode step (`plain_step`: what a server without
    speculation runs), else SGLang's verify step at that width, its output in SGLang's full-width layout;
  - `_prepare_for_speculative_decoding`: the same verify batch SGLang builds, at the planned width instead of
    always the maximum;
  - `_update_ngram_corpus`: SGLang's shared trie, fed only when drafts come from it.
Verification, lossless under the request's sampling and the controller, is `verification.py`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from sgl_entropic.drafting import DraftSizer, StepCosts, draft_acceptance, draft_trials, offered_drafts, tree_parents
from sgl_entropic.plugin import runtime
from sgl_entropic.plugin.runtime import Runtime
from sgl_entropic.plugin.signal.traces import PendingRecord
from sgl_entropic.plugin.speculation.drafts import RequestTries
from sgl_entropic.plugin.speculation.step_costs import load_or_measure
from sgl_entropic.plugin.step import Step, current_step

logger = logging.getLogger("sgl_entropic")


@dataclass
class DraftPlan:
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
    step: Optional[DraftPlan] = None  # the step being run (plan -> verify -> its end)
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
    tries = (
        RequestTries(call=functools.partial(rt.times.sglang_named, "ngram"))
        if rt.config.speculative.drafts == "request"
        else None
    )
    # plain steps on CPU (on CUDA the verify forward keeps its graphs), for models without recurrent state
    plain = torch.device(worker.device).type == "cpu" and mambaish_config(worker.model_runner.model_config) is None
    rt.speculation = Speculation(DraftSizer(rule, width, costs), tries, plain, sampler=worker.model_runner.sampler)
    return result


def with_plain_prices(costs: StepCosts, backend) -> StepCosts:
    """The table with width 1 priced as the plain decode step runs: the attention backend's kernel at each context
    (its kept crossover timings), not the verify forward's attention, which costs about twice as much at 4k tokens
    on a CPU. Unchanged, and said, where the backend has no such timings (pruning off, a given crossover)."""
    found = getattr(backend, "plain_step_attention", lambda: None)()
    if found is None:
        logger.info("sgl-entropic: plain decode steps priced with the verify forward's attention at width 1")
        return costs
    contexts, seconds = found
    logger.info(
        "sgl-entropic: plain decode steps priced with the attention backend's kernels: one row over %s tokens: %s ms",
        "/".join(map(str, contexts)),
        "/".join(f"{s * 1e3:.1f}" for s in seconds),
    )
    return replace(costs, plain_contexts=contexts, plain_attention=seconds)


# ---------------------------------------------------------------------------------------------- hooks


def around_forward_batch_generation(original, worker, batch, *args, **kwargs):
    """One NGRAM step: planned here (the trie's drafts, the rule's width); at width 1 the plain decode step, else
    SGLang's verify step at that width (`around_prepare_for_speculative_decoding`), its output in SGLang's
    full-width layout."""
    rt = runtime.current()
    spec, step = rt.speculation, current_step(rt)
    step.plan = None
    if batch.forward_mode.is_decode() and batch.reqs:
        try:
            step.plan = plan_step(rt, spec, worker, batch)
        except Exception:  # SGLang's own full-width step; its verification then records null values
            rt.fault("the draft rule's plan")
        if step.plan is not None and step.plan.plain:
            return plain_step(rt, spec, step, worker, batch, *args, **kwargs)
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        worker.draft_token_num = spec.sizer.max_width
    if step.plan is not None:
        widen(result, step.plan.width, spec.sizer.max_width)
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
    step = current_step(rt)
    if not batch.forward_mode.is_decode() or step.plan is None:
        return original(worker, batch, *args, **kwargs)
    try:
        return build_verify(rt, step.plan, worker, batch)
    except Exception:  # SGLang's own full-width step; its verification then records null values (eagle_sample)
        rt.fault("the draft rule's verify batch")
        step.plan, worker.draft_token_num = None, rt.speculation.sizer.max_width
        return original(worker, batch, *args, **kwargs)


def plan_step(rt: Runtime, spec: "Speculation", worker, batch) -> DraftPlan:
    """This step's drafts (the trie's, as SGLang reads them) and the width the rule picks for them."""
    bs, full = len(batch.reqs), spec.sizer.max_width
    worker.draft_token_num = full  # the corpus returns full-width trees
    states = [getattr(r, "entropic", None) for r in batch.reqs]
    rules, caps = request_choices(states, spec.sizer.rule, full - 1)
    for i, p in enumerate(penalized(batch.reqs)):
        if p:  # they verify no drafts (verify(): the root only)
            caps[i] = 0
    if spec.tries is None:
        drafts, mask = rt.times.sglang_named("ngram", worker._prepare_draft_tokens, batch)
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
    return DraftPlan(
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


def build_verify(rt: Runtime, step: DraftPlan, worker, batch) -> None:
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


def plain_step(rt: Runtime, spec: "Speculation", step: Step, worker, batch, on_publish=None, pp_proxy_tensors=None):
    """The step a server without speculation runs: one token a row through the decode forward (the same
    attention, pruning included, and sampling hooks), in the NGRAM worker's result layout. Where SGLang's NGRAM
    step verifies node 0 alone it pays a verify forward, its tree bookkeeping and its verification instead."""
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative import ngram_worker as nw

    plan, bs, full, device = step.plan, len(batch.reqs), spec.sizer.max_width, worker.device
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
        batch.input_ids = torch.from_numpy(plan.drafts[:, 0].astype(np.int64)).to(device)
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
    if step.records and isinstance(step.records[-1], PendingRecord):  # queued by the sampler
        step.records[-1].offers = plan.offers
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
        tried, right = draft_trials([0] * bs, [0] * bs, plan.offers, plan.first_draft.tolist(), roots)
        if plan.source_firsts is not None:
            spec.tries.observe([r.rid for r in batch.reqs], plan.source_firsts, roots)
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


def around_get_last_loc(original, req_to_token, req_pool_indices, prefix_lens, *args, **kwargs):
    """On CPU, SGLang's torch version (its Triton one needs a GPU; it is chosen by backend name, and ours is
    not `torch_native`)."""
    if req_to_token.is_cpu:
        from sglang.srt.mem_cache.allocation import get_last_loc_torch

        return get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)
    return original(req_to_token, req_pool_indices, prefix_lens, *args, **kwargs)


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
