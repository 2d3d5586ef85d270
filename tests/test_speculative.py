"""The speculative loop's core (sgl_entropic/drafting.py) on plain tensors: the controller along a draft tree
equals sequential decoding, verification is lossless (a statistical check that a wrong verifier fails), and each
width rule does what it states."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from sgl_entropic._sgl_kernel_cpu.speculative import reconstruct_indices_from_tree_mask, verify_tree_greedy_cpu
from sgl_entropic.sampling import ControllerBatch, ControllerState
from sgl_entropic.drafting import (
    PLAIN_MARGIN,
    DraftHits,
    DraftSizer,
    StepCosts,
    draft_acceptance,
    draft_trials,
    entropy_width,
    offered_drafts,
    tree_depths,
    tree_parents,
    tree_temperatures,
)

STATE = dict(target=1.2, eta=0.4, t_min=0.3, t_max=2.5, floor=0.05, warmup=1)


def controllers(temps, steps_done):
    return ControllerBatch.from_rows(
        [ControllerState(temperature=t, steps_done=s, **STATE) for t, s in zip(temps, steps_done)]
    )


def path_to(parent: list[int], v: int) -> list[int]:
    path = [v]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_tree_temperatures_are_what_sequential_decoding_computes_along_each_path(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width, vocab = 3, 7, 40
    parent = torch.tensor(
        [[-1] + [int(torch.randint(0, v, (1,), generator=gen)) for v in range(1, width)] for _ in range(rows)]
    )
    logits = torch.randn(rows, width, vocab, generator=gen) * 3
    temps, steps = [0.7, 1.0, 1.6], [0, 4, 9]
    got = tree_temperatures(logits, parent, controllers(temps, steps))
    for r in range(rows):
        for v in range(width):
            batch = controllers([temps[r]], [steps[r]])
            for node in path_to(parent[r].tolist(), v):  # the decoding of the node's ancestors, then the node
                t, _ = batch.step(logits[r, node][None])
            assert torch.allclose(got[r, v], t[0], rtol=1e-6), (r, v)


def test_tree_depths():
    assert tree_depths(torch.tensor([[-1, 0, 1, 0, 3, 2]])).tolist() == [[0, 1, 2, 1, 2, 3]]


# ---------------------------------------------------------------------------------- lossless verification

VOCAB, LENGTH = 5, 6
# A Markov "model" over 5 tokens: the next-token logits depend on the last token only.
TABLE = torch.tensor(
    [
        [2.0, 1.0, 0.0, -1.0, 0.5],
        [0.0, 2.5, 1.0, 0.0, -1.0],
        [1.0, 0.0, 0.5, 2.0, 0.0],
        [0.3, 0.3, 0.3, 0.3, 2.0],
        [1.5, -0.5, 0.0, 1.0, 0.2],
    ]
)


def sequential(samples: int, gen: torch.Generator) -> torch.Tensor:
    """[samples, LENGTH] tokens sampled one by one at the controller's zero-lag temperature."""
    batch = controllers([1.0] * samples, [0] * samples)
    last = torch.zeros(samples, dtype=torch.long)
    out = []
    for _ in range(LENGTH):
        z = TABLE[last]
        t, _ = batch.step(z)
        last = torch.multinomial(torch.softmax(z / t[:, None], -1), 1, generator=gen).squeeze(1)
        out.append(last)
    return torch.stack(out, 1)


def speculative(samples: int, gen: torch.Generator, path_temperatures: bool = True) -> torch.Tensor:
    """The same, through draft trees of 4 nodes (a chain of two drafts and a sibling), verified as the plugin does:
    each node sampled at its tree temperature, SGLang's greedy walk over the samples. With
    `path_temperatures=False`, every node is sampled at the row's incoming temperature (what a verifier that
    ignores the controller inside the tree would do): the check must catch it."""
    width = 4
    parent = torch.tensor([-1, 0, 1, 0]).repeat(samples, 1)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    temps, steps = torch.ones(samples), torch.zeros(samples)
    last = torch.zeros(samples, dtype=torch.long)
    out = [[] for _ in range(samples)]
    while min(len(o) for o in out) < LENGTH:
        # a chain of the model's likeliest tokens (often accepted, so paths run deep) and a random sibling
        first_guess = TABLE[last].argmax(-1)
        tokens = torch.stack(
            [last, first_guess, TABLE[first_guess].argmax(-1), torch.randint(0, VOCAB, (samples,), generator=gen)], 1
        )
        logits = TABLE[tokens]  # node v's logits follow its own token (the Markov model)
        batch = ControllerBatch(temps, *(torch.full((samples,), float(v)) for v in STATE.values()), steps)
        node_t = tree_temperatures(logits, parent, batch) if path_temperatures else temps[:, None].repeat(1, width)
        target = torch.multinomial(
            torch.softmax(logits / node_t[..., None], -1).view(-1, VOCAB), 1, generator=gen
        ).view(samples, width)
        positions = torch.empty(samples * width, dtype=torch.long)
        index, first, sibling = (torch.empty(samples, width, dtype=torch.long) for _ in range(3))
        reconstruct_indices_from_tree_mask(
            mask.repeat(samples, 1, 1).flatten(),
            torch.zeros(samples, dtype=torch.long),
            positions,
            index,
            first,
            sibling,
            samples,
            width,
        )
        predict = torch.zeros(samples * width, dtype=torch.long)
        accept = torch.full((samples, width), -1, dtype=torch.long)
        correct = torch.zeros(samples, dtype=torch.long)
        verify_tree_greedy_cpu(predict, accept, correct, tokens, index, first, sibling, target)
        for r in range(samples):
            nodes = accept[r, : int(correct[r]) + 1]
            out[r] += predict[nodes].tolist()
            v = int(nodes[-1]) - r * width
            temps[r], steps[r] = node_t[r, v], steps[r] + len(nodes)
            last[r] = predict[nodes[-1]]
    return torch.tensor([o[:LENGTH] for o in out])


def frequencies_differ(a: torch.Tensor, b: torch.Tensor, position: int) -> float:
    """p-value of a chi-square test that the token at `position` has one distribution in both samples."""
    counts = [[int((x[:, position] == v).sum()) for v in range(VOCAB)] for x in (a, b)]
    keep = [v for v in range(VOCAB) if counts[0][v] + counts[1][v] > 0]
    return chi2_contingency([[c[v] for v in keep] for c in counts])[1]


def test_speculative_sampling_under_the_controller_has_the_sequential_distribution():
    gen = torch.Generator().manual_seed(1)
    n = 8000
    plain, spec = sequential(n, gen), speculative(n, gen)
    p_values = [frequencies_differ(plain, spec, j) for j in range(1, LENGTH)]
    assert min(p_values) > 1e-3, p_values
    # the check has the power to fail: a verifier that samples the tree at the row's temperature is caught
    wrong = speculative(n, gen, path_temperatures=False)
    assert min(frequencies_differ(plain, wrong, j) for j in range(1, LENGTH)) < 1e-3


# ------------------------------------------------------------------------------------------- width rules


def test_the_padding_of_a_short_trie_match_is_not_a_draft():
    # NGRAM's corpus pads a match of 2 drafts to 5 nodes with token 0 children of the root
    tokens = np.array([[7, 11, 12, 0, 0], [7, 0, 0, 0, 0], [7, 0, 5, 6, 8]])
    parent = [[-1, 0, 1, 0, 0], [-1, 0, 0, 0, 0], [-1, 0, 1, 2, 3]]
    mask = np.zeros((3, 5, 5), dtype=np.int64)  # as the corpus returns it
    for r, ps in enumerate(parent):
        for v in range(5):
            for u in path_to(ps, v):
                mask[r, v, u] = 1
    # the last row's real chain starts with token 0: only trailing root-children of token 0 are padding
    assert offered_drafts(tokens, mask).tolist() == [2, 0, 4]
    assert tree_parents(mask).tolist() == parent


def table(t0: float, t_token: float, attention: tuple[float, float] = (0.0, 0.0), widest: int = 12) -> StepCosts:
    """A cost table: a forward over n tokens t0 + t_token (n - 1); one row's attention over 1024 tokens
    `attention` at width 1 and `widest` (proportional to the context)."""
    tokens = (1, 2, 4, 8, 16, 32, 64)
    contexts = (256, 1024, 4096)
    return StepCosts(
        tokens,
        tuple(t0 + t_token * (n - 1) for n in tokens),
        contexts,
        (1, widest),
        tuple(tuple(a * n / 1024 for n in contexts) for a in attention),
    )


def test_step_costs_price_forwards_by_tokens_and_attention_by_context_and_width():
    costs = StepCosts((1, 2, 4, 8), (0.10, 0.20, 0.22, 0.24), (256, 1024), (1, 5), ((0.01, 0.04), (0.02, 0.08)))
    assert costs.forward(3) == pytest.approx(0.21)  # between measured token counts
    assert costs.forward(12) == pytest.approx(0.24 + 0.005 * 4)  # past the grid: along its last segment
    assert costs.plain([1024]) == pytest.approx(0.10 + 0.04)
    assert costs.plain([1024, 256]) == costs.verify([1024, 256], 1) == pytest.approx(0.20 + 0.05)
    assert costs.verify([1024], 3) == pytest.approx(0.21 + 0.06)  # attention halfway between widths 1 and 5
    assert costs.verify([2048], 5) == pytest.approx(0.225 + 0.16)  # attention along the contexts' last segment
    assert costs.verify([256, 256], 4) == pytest.approx(0.24 + 2 * (0.25 * 0.01 + 0.75 * 0.02))
    assert costs.table()["gemm_ms"] == [100.0, 200.0, 220.0, 240.0]
    assert not StepCosts().measured


def test_a_timing_above_a_later_one_is_load_not_cost():
    """Timed at start-up beside SGLang's other processes, a forward over 1 token once took 35 ms and over 4 tokens
    17 ms: one burst would make a plain step look dear, and the table is kept for the machine's life."""
    costs = StepCosts(
        (1, 2, 4), (0.035, 0.018, 0.017), (256, 1024), (1, 4), ((0.05, 0.02), (0.03, 0.04)), (256, 1024), (0.9, 0.1)
    )
    assert costs.gemm == (0.017, 0.017, 0.017)
    assert costs.attention == ((0.02, 0.02), (0.03, 0.04))
    assert costs.plain_attention == (0.1, 0.1)
    assert costs.plain([1024]) == pytest.approx(0.017 + 0.1)


def test_the_entropy_rule_stops_drafting_where_a_draft_costs_a_row_and_drafts_where_it_is_free():
    """The measured case of docs/speculative.md: the same chat-like acceptance on two machines' prices."""
    tokens = tuple(range(1, 13))
    fp32 = StepCosts(tokens, tuple(0.1 * min(n, 3) for n in tokens), (1024,), (1, 12), ((0.0,), (0.0,)))
    bf16 = StepCosts(tokens, tuple(0.1 * (1 + 0.01 * (n - 1)) for n in tokens), (1024,), (1, 12), ((0.0,), (0.0,)))
    chat = sure_and_right(0.1, hits=6, misses=14)  # a sure model, a trie mostly wrong
    assert entropy_width([5], [chat], fp32, [100]) == 1
    assert entropy_width([5], [chat], bf16, [100]) > 1
    agent = sure_and_right(0.1, hits=45, misses=5)
    assert entropy_width([11], [agent], fp32, [100]) == 12  # past 3 rows the step costs no more: every draft


def sure_and_right(entropy: float, hits: float = 50.0, misses: float = 0.0) -> float:
    """a_r of a request whose tokens had `entropy` and whose drafts were right `hits` times, wrong `misses`."""
    return draft_acceptance(entropy, DraftHits(hits=hits, trials=hits + misses))


def test_the_entropy_rule_drafts_long_when_the_model_is_sure_and_not_at_all_when_it_is_not():
    costly = table(0.1, 0.01)  # a verified token costs 10 % of a step
    assert entropy_width([7], [sure_and_right(0.02)], costly, [50]) == 8  # sure: every draft the match offers
    assert entropy_width([7], [sure_and_right(4.0)], costly, [50]) == 1  # unsure: exp(-4) = 0.018, no drafts
    middle = entropy_width([7], [sure_and_right(0.7)], costly, [50])
    assert 1 < middle < 8
    # the width maximises the expected tokens per second, by brute force over the widths
    a = math.exp(-0.7)  # below the hit rate, 51 / 51
    best = max(range(1, 9), key=lambda w: sum(a**j for j in range(w)) / (0.1 + 0.01 * (w - 1)))
    assert middle == best
    # a batch: the rows' expected tokens share one step's cost
    assert entropy_width([7, 7], [sure_and_right(0.02), sure_and_right(6.0)], costly, [50, 50]) > entropy_width(
        [7, 7], [sure_and_right(6.0)] * 2, costly, [50, 50]
    )


def test_without_a_cost_table_every_offered_draft_is_verified():
    assert entropy_width([3, 5], [sure_and_right(3.0)] * 2, StepCosts(), [10, 10]) == 6


def test_a_width_must_beat_the_plain_step_by_the_margin():
    """Drafts that promise a few per cent more tokens per second than the plain step do not get a verify step: the
    table leaves the verify step's host work out (PLAIN_MARGIN)."""
    costs = table(0.1, 0.0)  # verification free in the table
    slight = 0.05  # 5 % more tokens at width 2, the best width when a = 0.05 (deeper drafts add 0.25 %)
    a = draft_acceptance(-math.log(slight), DraftHits())
    assert entropy_width([1], [a], costs, [50], margin=0.0) == 2
    assert entropy_width([1], [a], costs, [50]) == 1
    assert PLAIN_MARGIN > slight
    # without the plain step (logprobs, grammar, a GPU), width 1 is a verify step with the same host work: no margin
    assert entropy_width([1], [a], costs, [50], plain=False) == 2


def test_long_contexts_make_drafts_dear_where_a_verify_step_s_attention_grows_with_its_width():
    """Summarization: a 4k-token article in the prompt, drafts that hit one time in three. Where a verify step's
    extra queries cost attention over the whole article, the plain step wins; over a short context they draft."""
    costs = table(0.1, 0.002, attention=(0.02, 0.2))  # over 1k tokens: a fifth of a step, 10x that at width 12
    a = sure_and_right(0.1, hits=10, misses=20)
    assert entropy_width([4], [a], costs, [200]) > 1
    assert entropy_width([4], [a], costs, [4000]) == 1


def test_the_plain_step_is_priced_by_the_kernel_it_runs_not_by_the_verify_forward_s_attention():
    """Summarization at 4k tokens on this CPU: the verify forward's attention at width 1 costs about twice what the
    plain step's kernel does. Priced by the verify kernel, a verify step that only breaks even looks like a gain."""
    verify_priced = table(0.1, 0.002, attention=(0.04, 0.08))  # at width 1 / 12, over 1k tokens
    plain_priced = replace(verify_priced, plain_contexts=(256, 4096), plain_attention=(0.005, 0.08))
    assert plain_priced.plain([4096]) == pytest.approx(0.1 + 0.08)
    assert verify_priced.plain([4096]) == pytest.approx(0.1 + 0.16)
    # a width-1 verify (no plain step: logprobs, grammar, a GPU) keeps the verify forward's price
    assert plain_priced.prices([4096], [1, 2])[0] == pytest.approx(0.1 + 0.16)
    assert plain_priced.prices([4096], [1, 2], plain=True)[1] == pytest.approx(verify_priced.verify([4096], 2))
    a = sure_and_right(0.3, hits=4, misses=8)
    assert entropy_width([3], [a], verify_priced, [4096]) > 1
    assert entropy_width([3], [a], plain_priced, [4096]) == 1
    assert entropy_width([3], [a], plain_priced, [4096], plain=False) > 1


def test_a_request_s_width_does_not_depend_on_what_the_server_served_before():
    """Determinism: the rule reads the request's own record, the step's rows and the fixed table; a server that
    verified many other requests' drafts picks exactly what a fresh one does."""
    fresh, busy = DraftSizer("entropy", 12, table(0.1, 0.02)), DraftSizer("entropy", 12, table(0.1, 0.02))
    for accepted in ([0, 0, 1, 0], [5, 5, 5, 5], [0, 0, 0, 0]):
        for _ in range(20):
            busy.observe(12, accepted)
    for record in (DraftHits(), DraftHits(hits=3, trials=4), DraftHits(hits=0, trials=5)):
        for entropy in (None, 0.05, 0.6, 3.0):
            acceptance = [draft_acceptance(entropy, record)]
            assert busy.width([9], acceptance, [300]) == fresh.width([9], acceptance, [300])


def test_a_request_s_own_misses_and_hits_move_its_rate():
    """Open chat: the model is sure of its next token, but the trie's guesses are not it."""
    costly = table(0.1, 0.01)
    assert entropy_width([7], [sure_and_right(0.1, hits=0, misses=20)], costly, [50]) == 1
    hits = DraftHits()
    assert hits.rate() == 1.0  # no evidence yet: as sure as the model
    for _ in range(30):
        hits.observe(drafted=4, accepted=0)  # one trial a step: the run ends at its first draft
    assert hits.rate() < 0.2
    for _ in range(30):
        hits.observe(drafted=4, accepted=4)  # a copy: every draft tried and right
    assert hits.rate() > 0.9


def test_a_row_that_verified_no_drafts_checks_its_first_draft_against_the_token_it_committed():
    drafted, accepted = [3, 0, 0, 0], [2, 0, 0, 0]
    offers, first, root = [5, 4, 2, 0], [11, 12, 13, 14], [11, 12, 99, 14]
    # row 0 verified drafts (its own trials stand); 1 and 2 shadow-tried their first draft (12 right, 13 wrong);
    # row 3's trie offered nothing: no trial, even though its padding token equals its sample
    assert draft_trials(drafted, accepted, offers, first, root) == ([3, 1, 1, 0], [2, 1, 0, 0])


def test_a_request_that_stopped_drafting_drafts_again_once_its_trie_guesses_right():
    """The document answer that starts to quote: its first drafts missed, so the rule ran plain steps; the shadow
    trials (draft_trials) see the trie's first drafts come right, and the rule drafts again. With only the
    verified drafts as evidence (the record before shadow trials) it would never draft again."""
    sizer = DraftSizer("entropy", 12, table(0.1, 0.05))
    shadowed, blind = DraftHits(), DraftHits()
    for record in (shadowed, blind):
        for _ in range(10):
            record.observe(drafted=4, accepted=0)
        assert sizer.width([4], [draft_acceptance(0.05, record)], [100]) == 1
    for _ in range(8):  # plain steps; the root's token is the trie's first draft
        tried, right = draft_trials([0], [0], [4], [7], [7])
        shadowed.observe(tried[0], right[0])
        blind.observe(drafted=0, accepted=0)
    assert sizer.width([4], [draft_acceptance(0.05, shadowed)], [100]) > 1
    assert sizer.width([4], [draft_acceptance(0.05, blind)], [100]) == 1


def test_each_rule_caps_at_the_server_maximum_and_the_matches():
    for rule in ("matched", "acceptance", "entropy"):
        sizer = DraftSizer(rule, 6, table(0.1, 0.0))
        assert sizer.width([2, 1], [1.0, 1.0], [10, 10]) <= 3
        assert sizer.width([9, 9], [1.0, 1.0], [10, 10]) <= 6
    assert DraftSizer("fixed", 6).width([0, 0], [1.0, 1.0], [10, 10]) == 6  # SGLang's: always the maximum
    assert DraftSizer("matched", 6).width([2, 4], [0.0, 0.0], [10, 10]) == 5


def test_the_acceptance_rule_is_sglang_s_adaptive_formula():
    sizer = DraftSizer("acceptance", 12)
    assert sizer.width([11], [1.0], [10]) == 12  # SGLang starts its EMA at steps - 1: the maximum
    for _ in range(40):
        width = sizer.width([11], [1.0], [10])
        sizer.observe(width, [1])  # one draft accepted every step
    assert sizer.accepted_ema == pytest.approx(1.0, abs=1e-3)
    assert sizer.width([11], [1.0], [10]) == 1 + round(1.0) + 1  # round(EMA) + 1 drafts, the root besides


def test_a_narrow_step_s_draft_input_merges_and_filters_with_full_width_ones():
    """The plugin verifies at a step's own width but hands SGLang its output `full` columns a row (speculation.widen):
    SGLang merges the running batch's draft input with a new extend's (always full width) and filters it by row."""
    from types import SimpleNamespace

    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    from sgl_entropic.plugin.speculation.worker import widen

    full, width = 12, 5
    tokens = torch.arange(1, 3 * width + 1)  # 3 rows of the narrow step, as the worker returns them
    narrow = NgramVerifyInput(
        draft_token_num=width,
        new_seq_lens=torch.tensor([10, 20, 30]),
        accept_tokens=tokens,
        accept_lens=torch.tensor([2, 5, 1]),
    )
    result = SimpleNamespace(next_token_ids=tokens, next_draft_input=narrow)
    widen(result, width, full)
    assert result.next_token_ids.view(3, full)[:, :width].tolist() == tokens.view(3, width).tolist()
    extend = NgramVerifyInput(
        draft_token_num=full,
        new_seq_lens=torch.tensor([7]),
        accept_tokens=torch.full((full,), 99),
        accept_lens=torch.tensor([1]),
    )
    narrow.merge_batch(extend)
    narrow.filter_batch(torch.tensor([1, 3]))  # the second narrow row and the extend's row stay
    rows = narrow.accept_tokens.view(2, full)
    assert rows[0, :width].tolist() == list(range(width + 1, 2 * width + 1)) and rows[1].tolist() == [99] * full
    assert narrow.accept_lens.tolist() == [5, 1]


def test_a_table_reported_in_server_info_reads_back_as_the_same_costs():
    costs = replace(table(0.1, 0.002, attention=(0.02, 0.2)), plain_contexts=(256, 4096), plain_attention=(0.005, 0.04))
    back = StepCosts.from_table(costs.table())
    for field_ in ("tokens", "contexts", "widths", "plain_contexts"):
        assert getattr(back, field_) == getattr(costs, field_)
    for field_ in ("gemm", "plain_attention"):
        assert getattr(back, field_) == pytest.approx(getattr(costs, field_), abs=1e-7)
    assert [list(a) for a in back.attention] == [pytest.approx(a, abs=1e-7) for a in costs.attention]
    assert back.prices([1000, 3000], [1, 4], plain=True) == pytest.approx(
        costs.prices([1000, 3000], [1, 4], plain=True), abs=1e-6
    )
