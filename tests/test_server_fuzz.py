"""Fuzzing live servers (one with speculation, one pruning long prompts): no request body may stop them.

Generated with hypothesis, not schemathesis: SGLang's OpenAPI schema leaves `sampling_params` and
`custom_params` as free objects and `input_ids` untyped, so schema-driven bodies rarely reach the values
that end a scheduler, and it fills the multimodal fields with URLs the server would try to fetch. The
strategies below mix valid and invalid values of the fields that reach the scheduler, over every
generation endpoint, single and batch, streamed (some aborted after the first event) or not.

It holds when every answer is 2xx or 4xx, the server answers after every body and /health at the end, a fixed greedy
request gives the same tokens before and after, no KV or request slot stays held, the plugin's step work
never faulted (`degraded_steps`), and every answer that carries traces has one value per output token.
The default tier sends the known killers and FUZZ_BODIES generated bodies (derandomized: the same ones
on every run); the slow tier SLOW_FUZZ_BODIES fresh ones.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sgl_entropic.config import EntropicConfig
from tests.load_client import CHAT, LONG_PROMPT, nothing_held, serves, wait_until_nothing_is_held

pytestmark = pytest.mark.server

FUZZ_BODIES = 40
SPEC_FUZZ_BODIES = 28
SLOW_FUZZ_BODIES = 400
TIMEOUT_S = 60  # a body still running then is abandoned (SGLang aborts a request whose client left)

# Bodies that ended stock SGLang's scheduler (and the plugin's before its prompt check).
KILLERS = [
    ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"input_ids": [1000000000, -1], "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"text": ["fine", ""], "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"input_ids": [[1, 2], [49152]], "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/completions", {"model": "default", "prompt": [5, 99999999], "max_tokens": 4}),
]

GREEDY = {"text": CHAT.format("Name three rivers."), "sampling_params": {"max_new_tokens": 24, "temperature": 0}}

# ------------------------------------------------------------------------------------------- strategies

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3),
    st.just({"a": {"b": 1}}),
)


def bodies(junky: bool) -> st.SearchStrategy:
    """(endpoint, body): every field valid (edge values included), or any field possibly anything."""

    def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(valid, junk) if junky else valid

    texts = st.one_of(
        st.sampled_from(
            [
                "Hello",
                "The capital of France is",
                CHAT.format("Write a haiku."),
                "",
                " ",
                "\n\n",
                '{"a": ',
                "ÿþ\ud800 lone surrogate",
                "\u0000\u0001 control",
                "🙂" * 20,
                CHAT.format(LONG_PROMPT * 5 + "\nSummarize the notes."),
            ]
        ),  # ~1.3k tokens: pruned decode
        st.text(max_size=64),
    )
    token_ids = st.one_of(
        st.lists(st.integers(0, 49151), max_size=24),
        st.lists(st.integers(0, 49151), max_size=24),
        st.lists(st.integers(-3, 2**40), max_size=4),
    )  # a third with ids out of range
    max_new = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 8, 2, 3, 4, 64, -1, 10**9])
    entropic = st.fixed_dictionaries(
        {},
        optional={
            "target_entropy": maybe(st.floats(0, 20)),
            "eta": maybe(st.floats(0.01, 10)),
            "t_min": maybe(st.floats(0.1, 1)),
            "t_max": maybe(st.floats(1, 3)),
            "controller": maybe(st.sampled_from(["entropic", "mirostat_v2"])),
            "warmup": maybe(st.integers(0, 5)),
            "bogus": junk,
        },
    )
    sampling_params = st.fixed_dictionaries(
        {"max_new_tokens": maybe(max_new)},
        optional={
            "temperature": maybe(st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7])),
            "top_p": maybe(st.floats(0.01, 1)),
            "top_k": maybe(st.sampled_from([-1, 1, 5, 50])),
            "min_p": maybe(st.floats(0, 1)),
            "repetition_penalty": maybe(st.sampled_from([1.0, 1.0, 1.0, 1.3])),
            "frequency_penalty": maybe(st.sampled_from([0.0, 0.0, 0.0, 0.5])),
            "presence_penalty": maybe(st.sampled_from([0.0, 0.0, 0.0, -0.5])),
            "stop": maybe(st.lists(st.sampled_from([".", "\n", "the", ""]), max_size=3)),
            "stop_token_ids": maybe(st.lists(st.integers(-1, 60000), max_size=3)),
            "ignore_eos": st.booleans(),
            "n": maybe(st.integers(1, 3)),
            "regex": maybe(st.sampled_from(["[0-9]{1,4}", "(yes|no)", "[", "a*"])),
            "json_schema": maybe(
                st.sampled_from(
                    [
                        json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
                        "{not json",
                        "{}",
                    ]
                )
            ),
            "logit_bias": maybe(
                st.dictionaries(st.sampled_from(["0", "5", "49151", "60000", "x"]), st.floats(-100, 100), max_size=2)
            ),
            "custom_params": maybe(st.fixed_dictionaries({}, optional={"entropic": maybe(entropic)})),
            "min_new_tokens": maybe(st.integers(0, 4)),
        },
    )
    generate_single = st.fixed_dictionaries(
        {"sampling_params": maybe(sampling_params)},
        optional={
            "return_entropy": st.booleans(),
            "return_logprob": st.booleans(),
            "top_logprobs_num": maybe(st.integers(0, 5)),
            "logprob_start_len": maybe(st.integers(-1, 4)),
            "stream": st.booleans(),
        },
    )
    generate = st.one_of(
        generate_single.flatmap(lambda b: st.fixed_dictionaries({"text": texts}).map(lambda t: {**b, **t})),
        generate_single.flatmap(
            lambda b: st.fixed_dictionaries({"input_ids": maybe(token_ids)}).map(lambda t: {**b, **t})
        ),
        generate_single.flatmap(
            lambda b: st.fixed_dictionaries({"text": st.lists(texts, min_size=1, max_size=3)}).map(lambda t: {**b, **t})
        ),
        generate_single.flatmap(
            lambda b: st.fixed_dictionaries({"input_ids": st.lists(token_ids, min_size=1, max_size=3)}).map(
                lambda t: {**b, **t}
            )
        ),
    )
    openai_common = {
        "model": st.just("default"),
        "max_tokens": maybe(max_new),
    }
    openai_optional = {
        "temperature": maybe(st.sampled_from([0.0, 0.7, 1.0, 2.0])),
        "top_p": maybe(st.floats(0.01, 1)),
        "n": maybe(st.integers(1, 3)),
        "stop": maybe(st.sampled_from([".", ["\n", "the"], ""])),
        "stream": st.booleans(),
        "logprobs": maybe(st.booleans()),
        "frequency_penalty": maybe(st.sampled_from([0.0, 0.0, 0.0, 0.5])),
        "presence_penalty": maybe(st.sampled_from([0.0, 0.0, 0.0, -0.5])),
        "repetition_penalty": maybe(st.sampled_from([1.0, 1.0, 1.0, 1.3])),
        "seed": maybe(st.integers(0, 2**31)),
        "return_entropy": st.booleans(),
        "regex": maybe(st.sampled_from(["[0-9]{1,4}", "("])),
        "custom_params": maybe(st.fixed_dictionaries({}, optional={"entropic": maybe(entropic)})),
    }
    completions = st.fixed_dictionaries(
        {**openai_common, "prompt": st.one_of(texts, token_ids, st.lists(texts, min_size=1, max_size=2))},
        optional={**openai_optional, "echo": st.booleans()},
    )
    messages = st.lists(
        st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["user", "assistant", "system"])), "content": maybe(texts)}
        ),
        max_size=3,
    )
    chat = st.fixed_dictionaries(
        {**openai_common, "messages": maybe(messages)},
        optional={
            **openai_optional,
            "top_logprobs": maybe(st.integers(0, 5)),
            "response_format": maybe(
                st.sampled_from(
                    [
                        {"type": "json_object"},
                        {"type": "text"},
                        {
                            "type": "json_schema",
                            "json_schema": {
                                "name": "r",
                                "schema": {
                                    "type": "object",
                                    "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"],
                                },
                            },
                        },
                    ]
                )
            ),
        },
    )
    return st.one_of(
        st.tuples(st.just("/generate"), generate),
        st.tuples(st.just("/v1/completions"), completions),
        st.tuples(st.just("/v1/chat/completions"), chat),
    )


# non-UTF-8 bytes where JSON text belongs
raw = st.tuples(
    st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]),
    st.sampled_from(
        [
            b'{"text": "\xff\xfe", "sampling_params": {"max_new_tokens": 2}}',
            b'{"model": "default", "prompt": "\xc3\x28", "max_tokens": 2}',
            b'{"text": "unterminated',
            b"[1, 2",
            b"null",
            b"[1]",
            b'"text"',
        ]
    ),
)
requests_ = st.one_of(bodies(junky=False), bodies(junky=True), raw)

# ------------------------------------------------------------------------------------------- the check


def send(url: str, path: str, body) -> None:
    """One body: 2xx or 4xx (a stream is read to its end or left after its first event), the server still up."""
    stream = isinstance(body, dict) and body.get("stream") is True
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with requests.post(
            url + path, data=data, headers={"Content-Type": "application/json"}, stream=stream, timeout=TIMEOUT_S
        ) as r:
            assert r.status_code < 500, f"{path} {body!r}: HTTP {r.status_code} {r.text[:300]}"
            if stream and r.status_code == 200:
                for i, line in enumerate(r.iter_lines()):
                    if i == 0 and len(data) % 3 == 0:  # a third of the streams: the client leaves (an abort)
                        break
                    assert b'"code": 5' not in line and b'"code":5' not in line, f"{path} {body!r}: {line[:300]!r}"
            elif (
                r.status_code == 200
                and path == "/generate"
                and isinstance(body, dict)
                and body.get("return_entropy") is True
            ):
                check_traces(r.json())
    except requests.Timeout:
        pass  # a long generation, abandoned
    # the HTTP process's own answer (SGLang ends it when its scheduler dies); /health (a generation) runs at the end
    alive = requests.get(url + "/model_info", timeout=30)
    assert alive.status_code == 200, f"after {path} {body!r}: /model_info {alive.status_code}"


def check_traces(out) -> None:
    """One trace value per output token (SGLang slices them by output offset)."""
    for item in out if isinstance(out, list) else [out]:
        meta = item["meta_info"]
        for key in ("entropy", "surprisal", "temperature"):
            assert len(meta[key]) == meta["completion_tokens"], (key, len(meta[key]), meta["completion_tokens"])


def fuzz(server, examples: int, derandomize: bool) -> None:
    before = server.generate(GREEDY)["output_ids"]

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as sent
        suppress_health_check=list(HealthCheck),
    )
    @given(requests_)
    def one(request):
        send(server.url, *request)

    for path, body in KILLERS:
        send(server.url, path, body)
    one()
    assert requests.get(server.url + "/health", timeout=120).status_code == 200
    states = wait_until_nothing_is_held(server)
    assert all(nothing_held(s) for s in states), states
    assert all(not s["degraded_steps"] for s in states), [s["degraded_steps"] for s in states]
    assert server.generate(GREEDY)["output_ids"] == before


# speculation (NGRAM, whose verify steps attend densely), and pruning decoding long prompts sparsely: both
# session servers of the tier
SERVERS = ["spec_server", "server"]


@pytest.mark.parametrize("which", SERVERS)
def test_no_request_body_stops_the_server(which, request):
    srv = request.getfixturevalue(which)
    assert serves(srv, timeout_s=5)
    # the speculative server's bodies decode at several times the cost: fewer of them in this tier, 400 in the slow
    fuzz(srv, FUZZ_BODIES if which == "server" else SPEC_FUZZ_BODIES, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("which", SERVERS)
def test_no_request_body_stops_the_server_long(which, request):
    fuzz(request.getfixturevalue(which), SLOW_FUZZ_BODIES, derandomize=False)


def test_the_hook_table_has_the_prompt_check_on_every_endpoint():
    """The checks above run in the main process (the HTTP server and the Engine)."""
    from sgl_entropic.plugin import hook_table
    from sgl_entropic.plugin.serving import validation

    handlers = {h.handler for h in hook_table(EntropicConfig()) if h.process == "main"}
    assert {
        validation.before_validate_one_request,
        validation.around_request_json,
        validation.around_normalize_batch_and_arguments,
    } <= handlers
