"""Where pricing the plain step by its own kernel changes the entropy rule's widths: the served model's kept cost
table (`/server_info`), its plain step priced by the verify forward's attention at width 1 (before) and by the
attention backend's kernels (now), and the width `drafting.entropy_width` picks under each, for one row (or
`--rows` alike) offering every draft, at each context and draft acceptance. Nothing is timed here: the widths are
the rule's function of the kept table, so the same table gives the same answer on every run.

    .venv/bin/python benchmarks/width_by_price.py                    # starts `--entropic full` in bf16
    ... --url http://127.0.0.1:30000                                  # or reads a running server's table
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from sgl_entropic.drafting import StepCosts, entropy_width  # noqa: E402

CONTEXTS = (256, 512, 1024, 2048, 3072, 4096, 6144, 8000)
ACCEPTANCE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def table(url: str) -> dict:
    info = json.load(urllib.request.urlopen(f"{url}/server_info", timeout=30))
    return info["internal_states"][0]["entropic"]["speculative"]["step_costs"]


def costs_of(t: dict) -> tuple[StepCosts, StepCosts]:
    """(priced as before: width 1 by the verify forward, priced now) from `/server_info`'s table."""
    now = StepCosts.from_table(t)
    return replace(now, plain_contexts=(), plain_attention=()), now


def widths(t: dict, rows: int, most: int) -> list[dict]:
    before, now = costs_of(t)
    out = []
    for n in CONTEXTS:
        for a in ACCEPTANCE:
            pick = lambda c: min(most, entropy_width([most - 1] * rows, [a] * rows, c, [n] * rows))  # noqa: E731
            out.append({"context": n, "acceptance": a, "before": pick(before), "now": pick(now)})
    return out


def markdown(cells: list[dict]) -> str:
    head = "| context | " + " | ".join(f"a={a}" for a in ACCEPTANCE) + " |"
    lines = [head, "|" + "---|" * (len(ACCEPTANCE) + 1)]
    for n in CONTEXTS:
        row = [c for c in cells if c["context"] == n]
        lines.append(
            f"| {n} | "
            + " | ".join(str(c["now"]) if c["now"] == c["before"] else f"**{c['before']} -> {c['now']}**" for c in row)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server of ours (else one is started: --entropic full, bf16)")
    ap.add_argument("--rows", default="1,4", help="rows alike in the step")
    args = ap.parse_args()
    if args.url:
        t = table(args.url)
    else:
        from sgl_entropic.model import prepare_model

        model, port = str(prepare_model("smollm2-135m")), common.free_port()
        cmd = common.ours_command(port, common.sglang_common_args(model, "cpu", "bfloat16", []), "full", None)
        with common.start_server("width-by-price", cmd, port, common.server_env("cpu", stock=False)) as srv:
            t = table(srv.url)
    if not t.get("plain_attention_ms"):
        sys.exit("this server prices its plain step with the verify forward's attention (no crossover timings)")
    most = t["attention_widths"][1]
    print(f"nodes per row (bold: changed, before -> now); plain attention ms {t['plain_attention_ms']}")
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"\n{rows} row(s)\n\n" + markdown(widths(t, rows, most)))


if __name__ == "__main__":
    main()
