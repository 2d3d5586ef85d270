"""The programs in programs/ end to end on the shared server: their control logic, recomputed here.

The model is tiny, so answers may be wrong; what is asserted is what the programs guarantee:
actions parse and tools run correctly, prefixes are reused, the join picks what it claims,
constrained JSON validates.
"""

import json
import re
import statistics

import jsonschema
import pytest

from programs import agent, chat, extract, fork_join
from programs._backend import endpoint
from tests.program_checks import assert_join_chose_the_lowest_mean_surprisal


@pytest.fixture(scope="module")
def backend(server):
    return endpoint(server.url)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("17*23+4", "395"),
        ("(120-36)/4", "21"),
        ("7/2", "3.5"),
        ("2.5*2", "5"),
        ("-3*(2+1)", "-9"),
        ("10 % 4 // 1", "2"),
        ("99999*99999*99999*99999", "99996000059999600001"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert agent.calculate(expression) == expected


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "2**10", "1/0", "2(3)", "", "x+1", "9" * 400 + "*1.5", "9" * 5000]
)
def test_calculator_refuses_everything_else(expression):
    assert agent.calculate(expression).startswith("error: ")


@pytest.mark.server
def test_agent_actions_parse_tools_run_and_success_is_the_answer_check(backend):
    result = agent.run(backend)
    assert len(result["tasks"]) == len(agent.TASKS)
    for task in result["tasks"]:
        steps = task["steps"]
        assert 2 <= len(steps) <= agent.MAX_STEPS
        assert steps[0]["tool"] in agent.TOOLS  # the first action must call a tool
        assert [s["tool"] == "finish" for s in steps] == [False] * (len(steps) - 1) + [True]
        for step in steps:
            assert re.fullmatch(agent.ARGUMENT_REGEX[step["tool"]], step["argument"] + "]")
            assert step["thought_trace"]["tokens"] > 0
        for step in steps[:-1]:
            if step["tool"] == "lookup":
                assert step["observation"] == agent.FACTS[step["argument"]]
            else:
                # Independent oracle: Python's own arithmetic on a string the grammar limited to it.
                try:
                    value = eval(step["argument"], {"__builtins__": {}})
                except (SyntaxError, TypeError, ZeroDivisionError):
                    assert step["observation"].startswith("error: ")
                else:
                    assert float(step["observation"]) == pytest.approx(value, rel=1e-5)
            # the observation was fed back to the model
            action = f"Action: {step['tool']}[{step['argument']}]"
            assert f"{action}\nObservation: {step['observation']}\n" in task["transcript"]
        assert task["answer"] == steps[-1]["argument"]
        assert task["success"] == (task["answer"].strip().rstrip(".").lower() == task["expected"].lower())
    assert result["success_rate"] == statistics.fmean(t["success"] for t in result["tasks"])


@pytest.mark.server
def test_chat_reuses_the_shared_manual_and_each_conversation(backend, server, model_path):
    import requests
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    manual_tokens = len(tokenizer(f"<|im_start|>system\n{chat.MANUAL}<|im_end|>\n").input_ids)
    assert 900 <= manual_tokens <= 1200  # the "long shared system prompt"
    # a paged radix cache reuses whole pages only
    page = requests.get(server.url + "/server_info", timeout=10).json()["page_size"]

    def whole_pages(n: int) -> int:
        return n // page * page

    turns = chat.run(backend)["turns"]
    assert len(turns) == sum(len(t) for t in chat.USERS.values())
    assert all(turn["trace"]["tokens"] > 0 for turn in turns)
    for previous, turn in zip(turns, turns[1:]):
        if turn["user"] == previous["user"]:  # a follow-up: the whole earlier conversation is cached
            assert turn["cached_tokens"] >= whole_pages(previous["prompt_tokens"]), (previous, turn)
        else:  # a new user: at least the manual is cached
            assert turn["cached_tokens"] >= whole_pages(manual_tokens), turn


@pytest.mark.server
def test_fork_join_chooses_the_branch_with_the_lowest_mean_surprisal(backend):
    questions = fork_join.run(backend)["questions"]
    assert len(questions) == len(fork_join.QUESTIONS)
    for item in questions:
        assert_join_chose_the_lowest_mean_surprisal(item)
    # Each branch ran its own controller: the highest target sampled at a clearly higher entropy.
    low, high = ([item["candidates"][i]["trace"]["entropy_mean"] for item in questions] for i in (0, -1))
    assert statistics.fmean(high) > statistics.fmean(low) + 0.5, (low, high)


@pytest.mark.server
def test_extract_outputs_parse_and_validate_against_the_schema(backend):
    result = extract.run(backend)
    for item in result["documents"]:
        record = json.loads(item["output"])
        jsonschema.validate(record, extract.PERSON_SCHEMA)
        assert item["valid"] and item["record"] == record
        assert item["fields_correct"] == sum(record[k] == v for k, v in item["expected"].items())
        assert len(item["entropy"]) == item["trace"]["tokens"] > 0
    assert result["valid_rate"] == 1.0


def test_gen_with_choices_is_a_plain_select_and_refuses_entropic_keywords():
    import sgl_entropic

    select = sgl_entropic.gen("pick", choices=["yes", "no"])
    assert select.choices == ["yes", "no"]  # scored by SGLang, not sampled: nothing to control
    with pytest.raises(ValueError, match="choices are scored"):
        sgl_entropic.gen("pick", choices=["yes", "no"], target_entropy=1.0)


def test_gen_does_not_take_server_only_settings():
    import sgl_entropic

    with pytest.raises(TypeError, match="every_request"):  # a server setting, passed on to sgl.gen, which refuses it
        sgl_entropic.gen("x", every_request=True)
