"""Fork / join: candidate answers in parallel at different target entropies, keep the most confident.

    python programs/fork_join.py [--url URL | --engine]

`s.fork(n)` copies the prompt into n branches that decode concurrently, each with its own
controller target H*. The join gathers them and chooses the one with the lowest mean surprisal
(the average -ln p of the tokens it sampled). Every candidate is reported with whether it
contains the expected answer, so the selection rule can be judged.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import sglang as sgl

if __package__ in (None, ""):  # `python programs/fork_join.py`: make the `programs` package importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sgl_entropic
from programs._backend import format_summary, run_from_args, trace_summary

TARGET_ENTROPIES = (0.5, 1.5, 3.0)
QUESTIONS = {  # question: the word a correct answer contains
    "What is the capital of France?": "Paris",
    "Which planet is known as the Red Planet?": "Mars",
}


def mean_surprisal(meta: dict) -> float:
    values = [x for x in meta["surprisal"] if x is not None]
    return statistics.fmean(values) if values else float("inf")


@sgl.function
def best_of(s, question: str, target_entropies: tuple[float, ...]):
    s += sgl.system("You are a concise assistant. Answer in one sentence.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    branches = s.fork(len(target_entropies))
    for branch, target in zip(branches, target_entropies):
        branch += sgl_entropic.gen("candidate", max_tokens=24, stop="\n", target_entropy=target)
    # The traces live in each branch's meta_info, which join() does not carry back: keep them here.
    s.set_var("candidate_meta", [branch.get_meta_info("candidate") for branch in branches])
    branches.join()  # s["candidate"] becomes the list of the branches' texts
    scores = [mean_surprisal(meta) for meta in s["candidate_meta"]]
    s.set_var("chosen", scores.index(min(scores)))


def run(backend, questions: dict[str, str] = QUESTIONS, target_entropies=TARGET_ENTROPIES) -> dict:
    """One fork per question, one branch per target entropy; `chosen` indexes the kept candidate."""
    results = []
    for question, expected in questions.items():
        start = time.perf_counter()
        state = best_of.run(question=question, target_entropies=target_entropies, backend=backend)
        candidates = [
            {
                "target_entropy": target,
                "text": text.strip(),
                "correct": expected.lower() in text.lower(),
                "entropy": meta["entropy"],
                "surprisal": meta["surprisal"],
                "trace": trace_summary(meta),
            }
            for target, text, meta in zip(target_entropies, state["candidate"], state["candidate_meta"])
        ]
        results.append(
            {
                "question": question,
                "expected": expected,
                "candidates": candidates,
                "chosen": state["chosen"],
                "seconds": time.perf_counter() - start,
            }
        )
    return {"questions": results}


def main() -> None:
    result = run_from_args(__doc__, run)
    for item in result["questions"]:
        print(f"\n{item['question']}  (expected {item['expected']!r}, {item['seconds']:.1f} s)")
        for i, cand in enumerate(item["candidates"]):
            mark = "=>" if i == item["chosen"] else "  "
            print(f" {mark} H*={cand['target_entropy']:.1f} correct={cand['correct']!s:5} {cand['text']!r}")
            print(f"    [{format_summary(cand['trace'])}]")
    chosen_correct = sum(item["candidates"][item["chosen"]]["correct"] for item in result["questions"])
    any_correct = sum(any(c["correct"] for c in item["candidates"]) for item in result["questions"])
    print(
        f"\nchosen answer correct for {chosen_correct} of {len(result['questions'])} questions"
        f" (some candidate correct for {any_correct})"
    )


if __name__ == "__main__":
    main()
