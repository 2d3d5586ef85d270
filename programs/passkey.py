"""Passkey retrieval: a 5-digit key hidden at some depth in thousands of tokens of filler.

    python programs/passkey.py [--url URL | --engine]

The long-context probe of the meso loop: the filler is predictable (low surprisal, prunable),
the key is not. With `--entropic pruning|full` decode attends only the kept KV blocks, and each
token's `attended` trace says which fraction of the context it read. The same prompts serve the
tests (tests/test_pruning_runtime.py) and the benchmark (benchmarks/attention_pruning.py).
"""

from __future__ import annotations

import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import sglang as sgl

if __package__ in (None, ""):  # `python programs/passkey.py`: make the `programs` package importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sgl_entropic
from programs._backend import run_from_args

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"
# Tokens of FILLER and of the fixed parts for the bundled SmolLM2 tokenizer; other tokenizers
# differ by a few percent, which only shifts the context length a little.
FILLER_TOKENS = 24
FIXED_TOKENS = 60


@dataclass(frozen=True)
class Case:
    context_tokens: int  # the intended prompt length
    depth: float  # where the key sits, as a fraction of the filler
    key: int

    @property
    def prompt(self) -> str:
        repeats = max(1, (self.context_tokens - FIXED_TOKENS) // FILLER_TOKENS)
        before = int(repeats * self.depth)
        needle = f"The pass key is {self.key}. Remember it. {self.key} is the pass key. "
        return INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION


def make_cases(context_tokens: list[int], depths: list[float], seed: int = 0, repeats: int = 1) -> list[Case]:
    rng = random.Random(seed)
    return [Case(n, d, rng.randint(10000, 99999)) for _ in range(repeats) for n in context_tokens for d in depths]


def answered_key(text: str) -> int | None:
    """The first 5-digit number of the answer, if any."""
    match = re.search(r"\d{5}", text)
    return int(match.group()) if match else None


@sgl.function
def retrieve(s, prompt: str):
    s += prompt
    s += sgl_entropic.gen("answer", max_tokens=8, temperature=0.0)


def run(backend) -> dict:
    cases = make_cases([1000, 2000, 3000], [0.2, 0.8])
    correct, attended = 0, []
    for case in cases:
        state = retrieve.run(prompt=case.prompt, backend=backend)
        key = answered_key(state["answer"])
        correct += key == case.key
        decode_steps = state.get_meta_info("answer")["attended"][1:]  # element 0: the dense prefill
        attended.append(statistics.fmean(decode_steps) if decode_steps else 1.0)
        print(
            f"{case.context_tokens:>5} tok, depth {case.depth:.1f}: key {case.key} -> {state['answer']!r} "
            f"({'ok' if key == case.key else 'MISSED'}; attended {attended[-1]:.0%} of the context)"
        )
    summary = {"cases": len(cases), "correct": correct, "mean_attended": statistics.fmean(attended)}
    print(f"{correct}/{len(cases)} keys retrieved; decode attended {summary['mean_attended']:.0%} of the context")
    return summary


if __name__ == "__main__":
    run_from_args(__doc__.splitlines()[0], run)
