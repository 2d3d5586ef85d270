"""Multi-turn chat of several users over one long shared system prompt (a product manual).

    python programs/chat.py [--url URL | --engine]

Every conversation starts with the same ~1k-token manual, so RadixAttention should prefill it
once: `cached_tokens` in each reply's meta_info shows how much of the prompt came from the cache.
After the very first turn it should cover at least the manual. Replies use entropic sampling;
`grounded` says whether a reply contains the fact from the manual that answers the question.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import sglang as sgl

if __package__ in (None, ""):  # `python programs/chat.py`: make the `programs` package importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sgl_entropic
from programs._backend import format_summary, run_from_args, trace_summary

REPLY_PARAMS = {"target_entropy": 1.5}

ERROR_CODES = {
    "E01": ("the water tank is empty", "refill the tank up to the MAX line"),
    "E02": ("the bean hopper is empty", "add beans and press Start again"),
    "E03": ("the grounds drawer is full", "empty the drawer and wait five seconds before closing it"),
    "E04": ("the brew unit is blocked", "remove the brew unit and rinse it under warm water"),
    "E05": ("the water temperature is too low", "let the machine warm up for three minutes"),
    "E06": ("the milk line is clogged", "run the milk cleaning program"),
    "E07": ("the drip tray is missing", "slide the drip tray back until it clicks"),
    "E08": ("the water filter is expired", "replace the filter cartridge"),
    "E09": ("the grinder is jammed", "switch off the machine and call service"),
    "E10": ("the pump pressure is too low", "descale the machine"),
}
PROGRAMS = {  # name: (millilitres of water, brewing temperature in Celsius, grams of coffee)
    "Ristretto": (20, 93, 9),
    "Espresso": (40, 92, 9),
    "Lungo": (110, 90, 11),
    "Americano": (180, 90, 10),
    "Cappuccino": (60, 91, 10),
    "Latte": (50, 91, 9),
    "Flat White": (70, 91, 12),
    "Hot Water": (200, 85, 0),
}
MAINTENANCE = [
    ("Rinse the milk line", "after every milk drink"),
    ("Empty the grounds drawer", "every day"),
    ("Clean the brew unit", "every week"),
    ("Replace the water filter", "every 2 months"),
    ("Descale the machine", "every 3 months"),
    ("Lubricate the brew unit", "every 6 months"),
]


def build_manual() -> str:
    """A deterministic manual of about 1k tokens, built from the tables above."""
    lines = [
        "You are the support assistant for the Brewmaster 3000 coffee machine. Answer briefly, using only this manual.",
        "",
        "BREWMASTER 3000 USER MANUAL",
        "",
        "1. Programs. Each program uses a fixed amount of water, temperature and coffee:",
    ]
    for name, (ml, celsius, grams) in PROGRAMS.items():
        coffee = f"{grams} grams of coffee" if grams else "no coffee"
        lines.append(f"- {name}: {ml} ml of water at {celsius} degrees Celsius with {coffee}.")
    lines += ["", "2. Maintenance schedule:"]
    lines += [f"- {task}: {when}." for task, when in MAINTENANCE]
    lines += ["", "3. Error codes. The display shows a code; its meaning and the fix are:"]
    for code, (meaning, fix) in ERROR_CODES.items():
        lines.append(f"- {code} means {meaning}. To fix it, {fix}.")
    lines += [
        "",
        "4. Safety. Never open the housing while the machine is plugged in. Never put the water tank,",
        "the brew unit or the grounds drawer in a dishwasher. Keep children away from the steam wand.",
        "Place the machine on a flat, dry surface at least 10 cm from the wall. Use only cold, fresh",
        "water in the tank; never milk, sparkling water or hot water.",
        "",
        "5. Warranty. The warranty lasts 2 years from the date of purchase and covers defects of",
        "materials and workmanship. It does not cover damage from scale, wrong voltage, dropping the",
        "machine, or opening the housing. Keep the receipt; service is arranged through the retailer.",
        "",
        "6. Settings. The grind size has five steps, from 1 (finest) to 5 (coarsest); change it only",
        "while the grinder runs. The water hardness can be set from 1 (soft) to 4 (very hard), and",
        "the standby timer from 15 minutes to 3 hours. The cup light can be switched off in the menu.",
        "",
        "7. Milk. Use cold milk straight from the fridge; whole milk gives the firmest foam, oat milk the",
        "sweetest. Dip the milk tube at least 2 cm into the milk. After the last milk drink of the day,",
        "put the tube in a glass of water and run the milk cleaning program, which takes 90 seconds.",
        "",
        "8. Energy. In standby the machine uses 0.5 watts; while heating it uses 1450 watts. The eco mode",
        "lowers the boiler temperature by 5 degrees between drinks and switches off after 15 minutes.",
    ]
    return "\n".join(lines)


MANUAL = build_manual()


@dataclass(frozen=True)
class Turn:
    question: str
    facts: tuple[str, ...]  # lower-case phrases of the manual, one of which a correct reply contains


USERS = {
    "ana": [Turn("What does error code E04 mean?", ("blocked",)), Turn("How do I fix it?", ("rinse",))],
    "ben": [Turn("How much water does the Lungo program use?", ("110",)), Turn("At what temperature?", ("90",))],
    "chloe": [
        Turn("How often should I descale the machine?", ("3 months", "three months")),
        Turn("How long is the warranty?", ("2 years", "two years")),
    ],
}


@sgl.function
def conversation(s, turns: list[Turn], reply_params: dict):
    s += sgl.system(MANUAL)
    for i, turn in enumerate(turns):
        s += sgl.user(turn.question)
        s += sgl.assistant(sgl_entropic.gen(f"reply_{i}", max_tokens=24, **reply_params))


def run(backend, users: dict[str, list[Turn]] = USERS, reply_params: dict = REPLY_PARAMS) -> dict:
    """Users one after the other, so that every turn after the first can find the manual cached.

    `reply_params` are the entropic keywords of the replies (sgl_entropic.gen).
    """
    start = time.perf_counter()
    turns = []
    for user, user_turns in users.items():
        state = conversation.run(turns=user_turns, reply_params=reply_params, backend=backend)
        for i, turn in enumerate(user_turns):
            meta = state.get_meta_info(f"reply_{i}")
            reply = state[f"reply_{i}"].strip()
            turns.append(
                {
                    "user": user,
                    "question": turn.question,
                    "reply": reply,
                    "grounded": any(fact in reply.lower() for fact in turn.facts),
                    "prompt_tokens": meta["prompt_tokens"],
                    "cached_tokens": meta["cached_tokens"],
                    "trace": trace_summary(meta),
                }
            )
    return {"turns": turns, "seconds": time.perf_counter() - start}


def main() -> None:
    result = run_from_args(__doc__, run)
    for turn in result["turns"]:
        print(f"\n[{turn['user']}] {turn['question']}\n  -> {turn['reply']}")
        print(
            f"  prompt {turn['prompt_tokens']} tok, cached {turn['cached_tokens']}"
            f" ({turn['cached_tokens'] / turn['prompt_tokens']:.0%}) | grounded: {turn['grounded']}"
        )
        print(f"  [{format_summary(turn['trace'])}]")
    grounded = sum(t["grounded"] for t in result["turns"])
    print(f"\n{len(result['turns'])} turns in {result['seconds']:.1f} s, {grounded} grounded in the manual")


if __name__ == "__main__":
    main()
