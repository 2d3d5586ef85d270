"""A ReAct agent: Thought / Action / Observation turns with two deterministic local tools.

    python programs/agent.py [--url URL | --engine]

Thoughts are free text under entropic sampling. Actions are constrained by regexes, so even a
135M model always emits one that parses: first the tool name, then an argument whose grammar
depends on the tool (numbers and operators for the calculator, one of the table's keys for the
lookup). The program, not the model, bounds the loop: the first action must call a tool (the
answer rests on an observation) and the last allowed step must finish. Each answer is checked
against ground truth.
"""

from __future__ import annotations

import ast
import operator
import re
import sys
import time
from typing import Optional
from dataclasses import dataclass
from pathlib import Path

import sglang as sgl

if __package__ in (None, ""):  # `python programs/agent.py`: make the `programs` package importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sgl_entropic
from programs._backend import format_summary, run_from_args, trace_summary

MAX_STEPS = 3
THOUGHT_PARAMS = {"target_entropy": 1.0}

FACTS = {
    "capital of France": "Paris",
    "capital of Japan": "Tokyo",
    "capital of Italy": "Rome",
    "capital of Canada": "Ottawa",
    "symbol of gold": "Au",
    "symbol of iron": "Fe",
    "symbol of silver": "Ag",
    "symbol of sodium": "Na",
}


@dataclass(frozen=True)
class Task:
    question: str
    expected: str


TASKS = [
    Task("What is 17*23+4?", "395"),
    Task("What is the capital of France?", "Paris"),
    Task("What is the chemical symbol of gold?", "Au"),
    Task("What is (120-36)/4?", "21"),
    Task("What is the capital of Japan?", "Tokyo"),
]

# --------------------------------------------------------------------------------------- tools

_ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic on int/float literals with + - * / // % and parentheses; walks the AST, never evals."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
            return _SIGNS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return f"{result:.6g}" if isinstance(result, float) else str(result)
    # ValueError also covers str() of an int over Python's 4300-digit limit
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as err:
        return f"error: {type(err).__name__}"


def lookup(key: str) -> str:
    return FACTS.get(key, "unknown key")


TOOLS = {"calculate": calculate, "lookup": lookup}
# The argument grammar of each action, closing bracket included (the regex ends the generation).
# Each is bounded: at most 58 characters, hence tokens, under max_tokens=64, so no action is cut
# off. A calculator argument is numbers joined by single operators; its parentheses may not balance.
_OPERAND = r"\({0,2}[0-9]{1,5}(\.[0-9]{1,2})?\){0,2}"
ARGUMENT_REGEX = {
    "calculate": rf"{_OPERAND}( ?[-+*/] ?{_OPERAND}){{0,3}}\]",
    "lookup": "(" + "|".join(re.escape(k) for k in FACTS) + r")\]",
    "finish": r"[A-Za-z0-9][A-Za-z0-9 .\-]{0,23}\]",
}


def action_regex(step: int) -> str:
    """The tools a step may call: a real tool first, any next, finish at the last step."""
    if step == 0:
        allowed = list(TOOLS)
    elif step == MAX_STEPS - 1:
        allowed = ["finish"]
    else:
        allowed = list(ARGUMENT_REGEX)
    return " (" + "|".join(allowed) + ")"  # the leading space belongs to the word in SmolLM2's tokens


SYSTEM = """You answer a question with tools, one step at a time.
Tools:
calculate[expression] computes arithmetic, for example calculate[2*(3+4)].
lookup[key] looks up a fact; keys are "capital of <country>" and "symbol of <element>".
finish[answer] gives the final answer, copied from the last observation.

Question: What is 6*7-2?
Thought: I need to compute 6*7-2.
Action: calculate[6*7-2]
Observation: 40
Thought: The calculator says 40.
Action: finish[40]

Question: What is the chemical symbol of sodium?
Thought: I should look up the symbol of sodium.
Action: lookup[symbol of sodium]
Observation: Na
Thought: The lookup says Na.
Action: finish[Na]"""


@sgl.function
def react(s, question: str, thought_params: Optional[dict]):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Question: {question}")
    s += sgl.assistant_begin()
    for step in range(MAX_STEPS):
        thought = (
            sgl.gen(f"thought_{step}", max_tokens=24, stop="\n")
            if thought_params is None
            else sgl_entropic.gen(f"thought_{step}", max_tokens=24, stop="\n", **thought_params)
        )
        s += "Thought:" + thought
        # Greedy under the grammar: the action must parse, so it is not where diversity is wanted.
        s += "\nAction:" + sgl.gen(f"tool_{step}", regex=action_regex(step), temperature=0, max_tokens=4)
        tool = s[f"tool_{step}"].strip()
        s += "[" + sgl.gen(f"argument_{step}", regex=ARGUMENT_REGEX[tool], temperature=0, max_tokens=64)
        if tool == "finish":
            break
        argument = s[f"argument_{step}"].removesuffix("]")
        s.set_var(f"observation_{step}", TOOLS[tool](argument))
        s += f"\nObservation: {s[f'observation_{step}']}\n"
    s += sgl.assistant_end()


def normalize(answer: str) -> str:
    return answer.strip().rstrip(".").lower()


def run(backend, tasks: list[Task] = TASKS, thought_params: Optional[dict] = THOUGHT_PARAMS) -> dict:
    """Run each task to its finish action; success means finish[...] equals the ground truth.

    `thought_params` are the entropic keywords of the thoughts (sgl_entropic.gen); None samples
    them with plain sgl.gen (servers without the sampling loop refuse entropic parameters).
    """
    results = []
    for task in tasks:
        start = time.perf_counter()
        state = react.run(question=task.question, thought_params=thought_params, backend=backend)
        steps = []
        for step in range(MAX_STEPS):
            if f"tool_{step}" not in state:
                break
            tool = state[f"tool_{step}"].strip()
            steps.append(
                {
                    "thought": state[f"thought_{step}"].strip(),
                    "tool": tool,
                    "argument": state[f"argument_{step}"].removesuffix("]"),
                    "observation": state[f"observation_{step}"] if tool in TOOLS else None,
                    "thought_trace": trace_summary(state.get_meta_info(f"thought_{step}")),
                }
            )
        answer = steps[-1]["argument"]  # the loop always ends on finish (forced at the last step)
        results.append(
            {
                "question": task.question,
                "expected": task.expected,
                "answer": answer,
                "success": normalize(answer) == normalize(task.expected),
                "steps": steps,
                "transcript": state.text(),
                "seconds": time.perf_counter() - start,
            }
        )
    return {"tasks": results, "success_rate": sum(r["success"] for r in results) / len(results)}


def main() -> None:
    result = run_from_args(__doc__, run)
    for task in result["tasks"]:
        verdict = "OK  " if task["success"] else "FAIL"
        print(
            f"\n{verdict} {task['question']}  expected {task['expected']!r}, answered {task['answer']!r}"
            f"  ({len(task['steps'])} steps, {task['seconds']:.1f} s)"
        )
        for step in task["steps"]:
            print(f"  Thought: {step['thought']}")
            print(
                f"  Action:  {step['tool']}[{step['argument']}]"
                + (f"  -> {step['observation']}" if step["observation"] is not None else "")
            )
            print(f"           [{format_summary(step['thought_trace'])}]")
    print(f"\nsuccess rate: {result['success_rate']:.0%} of {len(result['tasks'])} tasks")


if __name__ == "__main__":
    main()
