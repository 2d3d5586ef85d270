"""SGLang's NGRAM speculative decoding under the plugin, on a real server (tests/conftest.py's `spec_server`, the
shared server's configuration plus NGRAM, and `entropy_spec_server`, the default): greedy output token-identical to
the shared server's, sampled output with its distribution, every committed token traced, what cannot stay exact
refused; one request's own speculation (`custom_params.entropic.speculative`: opt out, cap, rule), its counts in
`meta_info` and `sglext`, and drafts from an external corpus loaded, used, removed and loaded again while serving."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import requests
from scipy.stats import chi2_contingency

from tests.prompts import CHAT, real_prompts

pytestmark = pytest.mark.server

PROMPTS = real_prompts()


def _greedy(server, text: str, n: int = 48, **extra) -> dict:
    return server.generate(
        {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}
    )


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_output_is_token_identical_with_and_without_speculation(server, spec_server, i):
    plain, spec = _greedy(server, PROMPTS[i]), _greedy(spec_server, PROMPTS[i])
    assert spec["output_ids"] == plain["output_ids"]
    if i < 2:  # the copying prompts: drafts were accepted, so the identity is not that of plain decoding
        assert spec["meta_info"]["spec_num_correct_drafts"] > 0


def test_the_default_speculates_token_identically_and_runs_plain_steps_where_drafts_miss(server, entropy_spec_server):
    """`--entropic full` alone: NGRAM on, the entropy rule, each request's own trie; fp32 greedy output equal to
    decoding without speculation; steps at width 1 are plain decode steps (no verify forward), on which the rule
    still checks the trie's first draft against the committed token."""
    for text in PROMPTS:
        assert _greedy(entropy_spec_server, text)["output_ids"] == _greedy(server, text)["output_ids"]
    server_info = entropy_spec_server.get("/server_info").json()
    assert server_info["entropic"]["config"]["speculative"]["source"].startswith("on: the default of --entropic full")
    info = server_info["internal_states"][0]["entropic"]["speculative"]
    totals = info["totals"]
    assert info["rule"] == "entropy" and info["drafts"] == "request" and totals["accepted"] > 0
    assert totals["plain_steps"] > 0 and totals["verified"] <= 4 * totals["rows"] and totals["shadow_tried"] > 0
    assert 0 <= totals["shadow_right"] <= totals["shadow_tried"]
    assert info["step_costs"]["tokens"] and info["step_costs"]["gemm_ms"][0] > 0  # the machine's cost table
    off = server.get("/server_info").json()
    assert off["entropic"]["config"]["speculative"]["source"] == "off: speculative.draft 'off'"
    assert "speculative" not in off["internal_states"][0]["entropic"]


def test_a_plain_step_traces_its_tokens_like_a_verify_step_that_drafted_nothing(entropy_spec_server):
    """Every decode step, verify or plain, has its drafts on its first token (0 on a plain step), and SGLang counts
    both as its verify steps."""
    out = _greedy(entropy_spec_server, PROMPTS[2], return_entropy=True)  # an open question: few drafts
    meta = out["meta_info"]
    steps = [(d, a) for d, a in zip(meta["drafted"], meta["accepted"]) if d is not None]
    assert len(steps) == meta["spec_verify_ct"] and (0, 0) in steps
    assert sum(a + 1 for _, a in steps) >= meta["completion_tokens"] - 1


def test_every_committed_token_carries_its_trace_and_each_step_its_drafts(spec_server):
    out = _greedy(spec_server, PROMPTS[0], return_entropy=True)
    meta, n = out["meta_info"], out["meta_info"]["completion_tokens"]
    for key in ("entropy", "surprisal", "temperature", "attended", "drafted", "accepted"):
        assert len(meta[key]) == n, key
    assert all(isinstance(h, float) and h >= 0 for h in meta["entropy"] + meta["surprisal"])
    assert set(meta["temperature"]) == {0.0}  # greedy
    steps = [(d, a) for d, a in zip(meta["drafted"], meta["accepted"]) if d is not None]
    # one entry per verify step, on its first token; the first token comes from the prefill
    assert meta["drafted"][0] is None and len(steps) == meta["spec_verify_ct"]
    assert all(0 <= a <= d <= 3 for d, a in steps)
    assert sum(a for _, a in steps) == meta["spec_num_correct_drafts"]  # SGLang's own count
    # a step commits its accepted drafts plus the bonus token (the last step's run may pass max_new_tokens)
    assert n - 1 <= sum(a + 1 for _, a in steps) <= n - 1 + 3
    # tau and the efficiency count every committed token, the cost each verify's real work
    hs = meta["entropy"]
    assert meta["entropic_time"] == pytest.approx(sum(max(0.0, a - b) for a, b in zip(hs, hs[1:])), rel=1e-4)
    info = spec_server.get("/server_info").json()["internal_states"][0]["entropic"]["speculative"]
    assert info["rule"] == "matched" and info["max_width"] == 4 and info["verify_steps"] >= len(steps)
    assert 1.0 <= info["verified_per_committed_token"] <= 4.0


SAMPLED = CHAT.format("Count with me: one, two, three, one, two, three, one, two, three, one, two,")
CONTROLLER = {"target_entropy": 1.5, "eta": 0.3, "t_min": 0.5, "t_max": 1.8, "t_init": 1.0}


def _sampled(server, n: int, length: int, text: str = SAMPLED, speculative=None) -> list[dict]:
    entropic = {**CONTROLLER, **({"speculative": speculative} if speculative else {})}
    body = {
        "text": [text] * n,
        "sampling_params": {
            "max_new_tokens": length,
            "temperature": 1.0,
            "ignore_eos": True,
            "custom_params": {"entropic": entropic},
        },
    }
    r = requests.post(server.url + "/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def _same_distribution(plain: list[list[int]], spec: list[list[int]], length: int) -> int:
    """Chi-square per position from the second (the first comes from the prefill), rare tokens pooled; returns how
    many positions had more than one likely token (the others test nothing)."""
    tested = 0
    for position in range(1, length):
        counts = [Counter(o[position] for o in outs) for outs in (plain, spec)]
        common = [t for t in set(counts[0]) | set(counts[1]) if counts[0][t] + counts[1][t] >= 10]
        table = [[c[t] for t in common] + [sum(v for t, v in c.items() if t not in common)] for c in counts]
        table = [row for row in zip(*table) if sum(row) > 0]
        if len(table) >= 2:
            tested += 1
            p = chi2_contingency(list(zip(*table)))[1]
            assert p > 1e-3, (position, counts)
    return tested


def test_sampled_output_under_the_controller_has_the_distribution_of_plain_decoding(server, spec_server):
    """Token frequencies at each position, speculative against plain, under the same controller: a chi-square
    test per position (rare tokens pooled) that would fail a verifier that commits the argmax, as SGLang's own
    CPU verification does, or one that skips the controller."""
    n, length = 120, 4
    plain = [o["output_ids"] for o in _sampled(server, n, length)]
    spec = [o["output_ids"] for o in _sampled(spec_server, n, length)]
    accepted = spec_server.get("/server_info").json()["internal_states"][0]["entropic"]["speculative"]
    assert accepted["accepted_per_row_step"] > 0.2  # drafts were accepted: the test exercises verification
    assert _same_distribution(plain, spec, length) == length - 1  # every position has more than one likely token


OPEN = CHAT.format("Write a list of ten animals, in any order.")


def test_sampled_output_with_drafts_from_a_corpus_has_the_distribution_of_plain_decoding(server, entropy_spec_server):
    """The sampling check with drafts from an external corpus: the corpus holds continuations the plain server
    sampled for the same prompt (whose own trie, over a prompt that repeats nothing, offers little), each request
    verifying every draft offered (rule 'matched'); token frequencies at each position against plain decoding."""
    n, length, url = 120, 4, entropy_spec_server.url
    documents = [OPEN + o["text"] for o in _sampled(server, 48, 24, OPEN)]
    r = requests.post(url + "/add_external_corpus", json={"corpus_id": "samples", "documents": documents}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        spec = _sampled(entropy_spec_server, n, length, OPEN, {"draft": "matched"})
    finally:
        requests.post(url + "/remove_external_corpus", json={"corpus_id": "samples"}, timeout=60)
    counts = [o["meta_info"]["entropic_speculative"] for o in spec]
    assert sum(c["corpus_drafts_accepted"] for c in counts) >= n // 4  # the corpus's drafts were verified and taken
    plain = [o["output_ids"] for o in _sampled(server, n, length, OPEN)]
    assert _same_distribution(plain, [o["output_ids"] for o in spec], length) >= 2


def test_mirostat_which_verification_cannot_follow_is_http_400(spec_server):
    params = {"custom_params": {"entropic": {"controller": "mirostat_v2"}}}
    r = spec_server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, **params}})
    assert r.status_code == 400 and "mirostat_v2" in r.text
    assert math.isfinite(_greedy(spec_server, "hi", 2)["meta_info"]["entropic_time"])  # still serving


# ------------------------------------------------------------------ one request's speculation, corpora


def _own(server, text: str, spec=None, n: int = 48, **extra) -> dict:
    """A greedy request with its own `custom_params.entropic.speculative`."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if spec is not None:
        params["custom_params"] = {"entropic": {"speculative": spec}}
    return server.generate({"text": text, "sampling_params": params, **extra})


def _steps(meta) -> list[tuple[int, int, int]]:
    return [(o, d, a) for o, d, a in zip(meta["offered"], meta["drafted"], meta["accepted"]) if d is not None]


N = 32


def test_a_request_opts_out_caps_or_chooses_its_rule_and_its_output_stays_exact(server, entropy_spec_server):
    reference = _greedy(server, PROMPTS[0], N)["output_ids"]  # shorter than the others: the tier's time
    base = _greedy(entropy_spec_server, PROMPTS[0], N, return_entropy=True)
    assert base["output_ids"] == reference and base["meta_info"]["entropic_speculative"]["drafts_accepted"] > 0
    assert any(o > 0 and d == 0 for o, d, _ in _steps(base["meta_info"]))  # the entropy rule passes some offers up

    out = _own(entropy_spec_server, PROMPTS[0], {"draft": "off"}, N)
    counts = out["meta_info"]["entropic_speculative"]
    assert out["output_ids"] == reference
    assert counts["verify_steps"] == counts["drafts_offered"] == 0 and counts["decode_steps"] == N - 1
    assert "drafted" not in out["meta_info"]  # the per-token lists only when asked

    # beside a request that drafts, in one batch: both exact, and no step lost its plan
    params = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    pair = entropy_spec_server.generate(
        {
            "text": [PROMPTS[0]] * 2,
            "sampling_params": [{**params, "custom_params": {"entropic": {"speculative": {"draft": "off"}}}}, params],
        }
    )
    assert [o["output_ids"] for o in pair] == [reference] * 2
    assert pair[0]["meta_info"]["entropic_speculative"]["verify_steps"] == 0
    assert pair[1]["meta_info"]["entropic_speculative"]["drafts_accepted"] > 0
    info = entropy_spec_server.get("/server_info").json()["internal_states"][0]["entropic"]
    assert not info["degraded_steps"]

    capped = _own(entropy_spec_server, PROMPTS[0], {"max_draft_tokens": 1}, N, return_entropy=True)
    steps = _steps(capped["meta_info"])
    assert capped["output_ids"] == reference
    assert all(d <= 1 and o <= 1 for o, d, _ in steps) and sum(a for *_, a in steps) > 0

    fixed = _own(entropy_spec_server, PROMPTS[2], {"draft": "fixed", "max_draft_tokens": 2}, N, return_entropy=True)
    assert fixed["output_ids"] == _greedy(server, PROMPTS[2], N)["output_ids"]
    assert all(d == min(o, 2) for o, d, _ in _steps(fixed["meta_info"]))  # every offer verified, up to its cap


def test_a_request_s_counts_match_its_per_token_traces_and_sglang_s_own(entropy_spec_server):
    def signal():
        return entropy_spec_server.get("/server_info").json()["internal_states"][0]["entropic"]["signal"]

    before = signal()
    meta = _greedy(entropy_spec_server, PROMPTS[1], return_entropy=True)["meta_info"]
    after = signal()  # the server's totals (d tau/dC over a run) grow by the request's own
    assert after["tau_nats"] - before["tau_nats"] == pytest.approx(meta["entropic_time"], rel=1e-4, abs=1e-6)
    assert after["cost_flops"] > before["cost_flops"]
    counts, steps = meta["entropic_speculative"], _steps(meta)
    assert counts["decode_steps"] == len(steps) == meta["spec_verify_ct"]
    assert counts["drafts_accepted"] == sum(a for *_, a in steps) == meta["spec_num_correct_drafts"]
    assert sum(meta["from_draft"]) == counts["drafts_accepted"] and len(meta["from_draft"]) == 48
    assert counts["accepted_per_verify"] == pytest.approx(counts["drafts_accepted"] / counts["verify_steps"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"max_draft_tokens": 4}, ".max_draft_tokens: at most 3"),
        ({"draft": "acceptance"}, ".draft"),
        ("off", " must be a JSON object"),
        ({"draft": "off", "cap": 1}, ".cap"),
    ],
)
def test_a_bad_request_setting_is_http_400_naming_its_field(entropy_spec_server, spec, message):
    r = entropy_spec_server.post(
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"entropic": {"speculative": spec}}}},
    )
    assert r.status_code == 400 and "custom_params.entropic.speculative" + message in r.text


def test_a_server_without_speculation_refuses_a_rule_and_serves_an_opt_out(server):
    def post(spec):
        return server.post(
            "/generate",
            {
                "text": "Hi",
                "sampling_params": {
                    "max_new_tokens": 2,
                    "temperature": 0,
                    "custom_params": {"entropic": {"speculative": spec}},
                },
            },
        )

    r = post({"draft": "fixed"})
    assert r.status_code == 400 and "speculative decoding is off on this server" in r.text
    assert post({"draft": "off"}).status_code == 200  # greedy: `speculative` alone asks for no controller


def test_openai_responses_carry_the_request_s_counts_and_its_drafted_tokens(entropy_spec_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=entropy_spec_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    body = {"return_entropy": True, "custom_params": {"entropic": {"speculative": {"max_draft_tokens": 2}}}}
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=24,
        temperature=0,
        extra_body=body,
    )
    (entry,) = out.model_extra["sglext"]["entropic"]
    assert len(entry["from_draft"]) == out.usage.completion_tokens
    assert entry["speculative"]["decode_steps"] >= out.usage.completion_tokens // 3
    with pytest.raises(openai.BadRequestError, match="custom_params.entropic.speculative.draft"):
        client.completions.create(
            model="default",
            prompt="Hi",
            max_tokens=2,
            extra_body={"custom_params": {"entropic": {"speculative": {"draft": "?"}}}},
        )


def test_an_external_corpus_drafts_exactly_and_leaves_with_its_removal(server, entropy_spec_server):
    """SGLang's corpus endpoints under the plugin: an earlier answer loaded as a corpus drafts the same question's
    answer (accepted drafts from the corpus, output unchanged); removed, the request drafts exactly as before it was
    loaded; loaded again, as with it."""
    url, question = entropy_spec_server.url, PROMPTS[2]
    reference = _greedy(server, question)
    before = _greedy(entropy_spec_server, question, return_entropy=True)["meta_info"]["entropic_speculative"]
    assert before["corpus_verify_steps"] == 0

    def add():
        r = requests.post(
            url + "/add_external_corpus", json={"corpus_id": "answers", "documents": [reference["text"]]}, timeout=60
        )
        assert r.status_code == 200 and r.json()["loaded_token_count"] > 40, r.text

    try:
        add()
        assert requests.get(url + "/list_external_corpora", timeout=30).json()["corpus_token_counts"]["answers"] > 40
        with_corpus = _greedy(entropy_spec_server, question, return_entropy=True)
        counts = with_corpus["meta_info"]["entropic_speculative"]
        assert with_corpus["output_ids"] == reference["output_ids"]
        assert counts["corpus_drafts_accepted"] > 0 and counts["drafts_accepted"] > before["drafts_accepted"]
        r = requests.post(url + "/remove_external_corpus", json={"corpus_id": "answers"}, timeout=60)
        assert r.status_code == 200, r.text
        after = _greedy(entropy_spec_server, question, return_entropy=True)
        assert after["output_ids"] == reference["output_ids"]
        assert after["meta_info"]["entropic_speculative"] == before
        add()
        again = _greedy(entropy_spec_server, question, return_entropy=True)["meta_info"]["entropic_speculative"]
        assert again == counts
    finally:
        requests.post(url + "/remove_external_corpus", json={"corpus_id": "answers"}, timeout=60)
    totals = entropy_spec_server.get("/server_info").json()["internal_states"][0]["entropic"]["speculative"]["totals"]
    assert 0 < totals["corpus_accepted"] <= totals["corpus_drafted"]
