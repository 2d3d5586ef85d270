"""One request's speculation on plain data: its settings checked at the edge, the step's width when requests choose
their own rule or cap, verification within a cap, and the counts a request gets back from its traces."""

from __future__ import annotations

import pytest
import torch

from sgl_entropic._sgl_kernel_cpu.speculative import reconstruct_indices_from_tree_mask, verify_tree_greedy_cpu
from sgl_entropic.config import request_speculation
from sgl_entropic.drafting import DraftCounts, DraftSizer, StepCosts, capped_candidates, from_drafts

PREFIX = "custom_params.entropic.speculative"


@pytest.mark.parametrize(
    "value, field",
    [
        ({"draft": "sometimes"}, "draft"),
        ({"draft": "acceptance"}, "draft"),  # the server's EMA over every request: not a request's rule
        ({"max_draft_tokens": -1}, "max_draft_tokens"),
        ({"max_draft_tokens": 2.5}, "max_draft_tokens"),
        ({"max_draft_tokens": True}, "max_draft_tokens"),
        ({"max_draft_tokens": 12}, "max_draft_tokens"),  # the server verifies at most 11 drafts a step
        ({"width": 3}, "width"),
    ],
)
def test_a_bad_setting_is_an_error_naming_its_field(value, field):
    with pytest.raises(ValueError, match=f"{PREFIX}.{field}"):
        request_speculation(value, max_drafts=11, entropy_rule=True)


def test_what_a_server_cannot_give_is_refused_and_what_it_can_is_kept():
    with pytest.raises(ValueError, match="must be a JSON object"):
        request_speculation("off", 11, True)
    with pytest.raises(ValueError, match=f"{PREFIX}.draft: speculative decoding is off"):
        request_speculation({"draft": "fixed"}, None, False)
    with pytest.raises(ValueError, match=f"{PREFIX}.draft: 'entropy' needs the server's cost table"):
        request_speculation({"draft": "entropy"}, 11, False)
    assert request_speculation({"draft": "off"}, None, False).draft == "off"  # nothing to opt out of: fine
    spec = request_speculation({"draft": "matched", "max_draft_tokens": 11}, 11, False)
    assert (spec.draft, spec.max_draft_tokens) == ("matched", 11)


def costs(t0: float = 0.1, t_token: float = 0.02) -> StepCosts:
    tokens = (1, 2, 4, 8, 16, 32, 64)
    return StepCosts(
        tokens, tuple(t0 + t_token * (n - 1) for n in tokens), (256, 1024, 4096), (1, 12), ((0.0,) * 3, (0.0,) * 3)
    )


def test_rows_that_opt_out_never_widen_a_step_and_rows_on_the_server_s_rule_size_it_as_before():
    sizer = DraftSizer("matched", 12, costs())
    offers, sure, contexts = [5, 0, 3], [1.0] * 3, [100] * 3
    assert sizer.width(offers, sure, contexts, rules=["matched"] * 3) == sizer.width(offers, sure, contexts) == 6
    assert sizer.width([0, 0, 3], sure, contexts, rules=["off", "off", "matched"]) == 4
    assert sizer.width([0, 0], sure[:2], contexts[:2], rules=["off", "off"]) == 1  # plain steps


def test_each_rule_sizes_its_own_rows_and_the_step_takes_the_widest():
    sizer = DraftSizer("entropy", 12, costs(0.1, 0.05))
    contexts = [100, 100]
    # an unsure row under the entropy rule alone runs plain steps; a fixed row of the same batch widens the step to
    # its cap, and a matched row to what its trie offers
    unsure = [0.05, 0.05]
    assert sizer.width([6, 0], unsure, contexts) == 1
    assert sizer.width([6, 0], unsure, contexts, rules=["entropy", "fixed"], caps=[11, 3]) == 4
    assert sizer.width([6, 2], unsure, contexts, rules=["entropy", "matched"]) == 3
    assert DraftSizer("fixed", 12).width([0], [1.0], [10], caps=[2]) == 3  # a fixed row verifies up to its cap


def verified(tokens: torch.Tensor, target: torch.Tensor, caps=None) -> list[int]:
    """Drafts each row accepts on a chain tree (node v's parent v - 1), with `caps` on its candidates."""
    rows, width = tokens.shape
    mask = torch.tril(torch.ones(width, width, dtype=torch.long))
    positions = torch.empty(rows * width, dtype=torch.long)
    index, first, sibling = (torch.empty(rows, width, dtype=torch.long) for _ in range(3))
    reconstruct_indices_from_tree_mask(
        mask.repeat(rows, 1, 1).flatten(),
        torch.zeros(rows, dtype=torch.long),
        positions,
        index,
        first,
        sibling,
        rows,
        width,
    )
    candidates = tokens if caps is None else capped_candidates(tokens, caps)
    predict = torch.zeros(rows * width, dtype=torch.long)
    accept = torch.full((rows, width), -1, dtype=torch.long)
    correct = torch.zeros(rows, dtype=torch.long)
    verify_tree_greedy_cpu(predict, accept, correct, candidates, index, first, sibling, target)
    return correct.tolist()


def test_verification_accepts_no_draft_past_a_row_s_cap():
    # every draft is the model's next token: uncapped, all five are accepted
    tokens = torch.tensor([[7, 1, 2, 3, 4, 5]] * 3)
    target = torch.tensor([[1, 2, 3, 4, 5, 6]] * 3)
    assert verified(tokens, target) == [5, 5, 5]
    assert verified(tokens, target, caps=[0, 2, 5]) == [0, 2, 5]
    wrong = target.clone()
    wrong[:, 1] = 9  # the model departs after the first draft: the cap does not add anything
    assert verified(tokens, wrong, caps=[5, 2, 0]) == [1, 1, 0]


def test_a_request_s_counts_and_per_token_draft_flags_follow_its_traces():
    # prefill token; a verify step with 3 drafts, 2 accepted (3 tokens); a plain step whose trie offered 4; a
    # verify step from a corpus with 1 draft, 1 accepted (2 tokens)
    offered = [None, 5, None, None, 4, 1, None]
    drafted = [None, 3, None, None, 0, 1, None]
    accepted = [None, 2, None, None, 0, 1, None]
    source = [None, "trie", None, None, None, "corpus", None]
    assert from_drafts(drafted, accepted) == [False, True, True, False, False, True, False]
    counts = DraftCounts()
    for step in zip(offered, drafted, accepted, source):
        if step[1] is not None:  # a decode step's first token carries its counts
            counts.add(*step)
    assert counts.summary() == {
        "decode_steps": 3,
        "verify_steps": 2,
        "drafts_offered": 10,
        "drafts_verified": 4,
        "drafts_accepted": 3,
        "accepted_per_verify": 1.5,
        "corpus_verify_steps": 1,
        "corpus_drafts_accepted": 1,
    }


def test_a_request_drafts_from_a_corpus_where_its_trie_offers_nothing_or_the_corpus_guesses_better():
    from sgl_entropic.plugin.speculation.drafts import prefer_corpus
    from sgl_entropic.drafting import DraftHits

    fresh = DraftHits()
    assert not prefer_corpus(3, 3, fresh, DraftHits())  # no evidence: its own trie
    assert prefer_corpus(0, 2, fresh, DraftHits()) and not prefer_corpus(2, 0, fresh, DraftHits())
    mine, its = DraftHits(), DraftHits()
    for _ in range(4):  # the trie's first drafts keep missing the committed token, the corpus's keep hitting
        mine.observe(1, 0)
        its.observe(1, 1)
    assert prefer_corpus(3, 1, mine, its) and not prefer_corpus(3, 1, its, mine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_row_s_context_is_the_tail_of_its_whole_token_list(overlap):
    """The trie reads each row's last `depth` tokens and its length; only a new trie gets the whole list."""
    import array
    from types import SimpleNamespace

    from sgl_entropic.plugin.speculation.drafts import contexts_of

    depth, stride = 18, 4
    rows = [
        (array.array("q", range(100, 100 + n)), list(range(7, 7 + k)), a)
        for n, k, a in ((3000, 0, 1), (5, 3, 2), (40, 30, 1), (2, 0, 3))
    ]
    reqs = [SimpleNamespace(origin_input_ids_unpadded=p, output_ids=o) for p, o, _ in rows]
    accepted = [[900 + i * 10 + j for j in range(stride)] for i in range(len(rows))]
    info = SimpleNamespace(
        accept_tokens=torch.tensor(sum(accepted, [])), accept_lens=torch.tensor([a for *_, a in rows])
    )
    batch = SimpleNamespace(reqs=reqs, spec_info=info, grammar_needs_sync=lambda: False)
    worker = SimpleNamespace(enable_overlap=overlap, speculative_num_draft_tokens=stride)
    contexts = contexts_of(worker, batch, depth, whole={1})
    for (p, o, a), acc, ctx, i in zip(rows, accepted, contexts, range(len(rows))):
        every = list(p) + o + (acc[:a] if overlap else [])
        assert ctx.tail == every[-depth:] and ctx.length == len(every)
        assert ctx.full == (every if i == 1 else None)


def test_a_batch_mixing_opted_out_rows_with_drafting_ones_gets_one_tree_each():
    """Each running request's own trie (SGLang's C++ n-gram corpus) beside rows that opted out: one tree a row, in
    the corpus's layout, the opted-out rows' offering nothing (a mismatch here once cost every such step its plan)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    from sgl_entropic.plugin.speculation.drafts import RequestTries
    from sgl_entropic.drafting import offered_drafts

    width, depth = 6, 18
    args = SimpleNamespace(
        speculative_ngram_min_bfs_breadth=1,
        speculative_ngram_max_bfs_breadth=1,
        speculative_ngram_match_type="BFS",
        speculative_ngram_external_sam_budget=0,
    )
    worker = SimpleNamespace(
        server_args=args,
        max_trie_depth=depth,
        speculative_num_draft_tokens=width,
        enable_overlap=False,
        list_external_corpora=lambda: {},
        ngram_corpus=NgramCorpus(max_trie_depth=depth, draft_token_num=width, capacity=1000),
    )
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 4  # a repeated phrase: its own trie drafts its continuation
    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids_unpadded=text, output_ids=[5, 6, 7]) for i in range(3)]
    batch = SimpleNamespace(reqs=reqs, grammar_needs_sync=lambda: False)
    tries = RequestTries()
    for _ in range(2):  # a new trie's first step, then a step that feeds it
        drafts, masks, from_corpus, firsts = tries.drafts(worker, batch, skip=frozenset({1}))
        assert drafts.shape == (3, width) and masks.shape == (3, width, width) and firsts is None
        assert offered_drafts(drafts, masks).tolist() == [width - 1, 0, width - 1]
        assert drafts[1, 0] == 7 and set(tries.tries) == {"r0", "r2"} and from_corpus == [False] * 3


@pytest.mark.parametrize("prompt_len", [5, 300])
def test_a_row_trie_drafts_what_sglang_s_wrapper_drafts_step_by_step(prompt_len):
    """`RowTrie` calls the C++ corpus with its own buffers; SGLang's `NgramCorpus.batch_get` / `batch_put` (the
    wrapper, a second trie fed the same text) is the reference: the same drafts at every step of a decode, a prompt
    shorter than the trie's depth included (its tail is shorter too)."""
    import random

    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    from sgl_entropic.plugin.speculation.drafts import RowTrie

    depth, width = 18, 8
    make = lambda: NgramCorpus(max_trie_depth=depth, max_bfs_breadth=4, draft_token_num=width, capacity=50_000)  # noqa: E731
    rng = random.Random(prompt_len)
    phrases = [[rng.randrange(2, 60) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    text = []
    while len(text) < prompt_len + 120:  # phrases that repeat: the trie has drafts to offer, some of them right
        text += rng.choice(phrases)
    context, reference = text[:prompt_len], make()
    reference.batch_put([context])
    row = RowTrie(make(), depth, width)
    row.corpus.batch_put([context])
    offered = 0
    for step in range(60):
        tail = context[-depth:]
        want = reference.batch_get(["r"], [tail], [len(context)])
        reference.synchronize()
        mine = row.match(tail, len(context))
        assert [a.tolist() for a in mine] == [a.tolist() for a in want], f"step {step}"
        assert mine[0].dtype == want[0].dtype and mine[1].dtype == want[1].dtype
        offered += int(mine[0][1] != 0)
        if step:  # as RequestTries: a new trie took the whole prompt, later steps insert their tail
            reference.batch_put([tail])
            row.insert()
        reference.synchronize()
        context = context + text[len(context) : len(context) + 1 + step % 3]
    assert offered > 10  # the comparison covered steps that draft


def test_a_program_s_gen_carries_its_speculation_as_plain_json():
    import sgl_entropic

    expr = sgl_entropic.gen("answer", max_tokens=8, speculative={"max_draft_tokens": 2})
    kwargs = expr.sampling_params.to_srt_kwargs()  # what RuntimeEndpoint and EngineBackend send
    assert kwargs["custom_params"] == {"entropic": {"speculative": {"max_draft_tokens": 2}}}
    with pytest.raises(ValueError, match="sgl_entropic.gen.draft"):
        sgl_entropic.gen("answer", speculative={"draft": "sometimes"})
