"""The default (`--entropic full`, speculation on) against stock and against the plugin without speculation, every
workload and batch size measured, as one table read from the runs' data files (benchmarks/speculative_decoding.py
with `--configs stock@float32,...,ours,default`). Nothing is measured here: each cell is a file's medians over its
rounds, with min-max, and the ratios are per round, as that file's own table gives them.

    .venv/bin/python benchmarks/speculative_grid.py            # the table, markdown, to stdout

A cell fails the issue's target ("never a loss") when the median ratio to stock or to ours is below 1.0 or the
worst round below 0.95; such cells are marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

DATA = Path(__file__).resolve().parents[1] / "docs" / "data"
FILES = (  # the runs with stock in fp32 (its best dtype here), ours and the default in bf16, 3 rounds each
    "speculative_corpus.json",
    "speculative_agent_b4_b16.json",
    "speculative_default.json",
    "speculative_default_b16.json",
    "speculative_summary_priced.json",
    "speculative_random.json",
    "speculative_mix.json",
)
STOCK, OURS, DEFAULT = "stock@float32", "ours", "default"


def ratio(cell: dict, key: str) -> str:
    r = cell.get(key)
    return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def loses(cell: dict) -> bool:
    return any(
        cell.get(key) is not None and (cell[key]["median"] < 1.0 or cell[key]["min"] < 0.95)
        for key in ("vs_stock_float32", "vs_ours")
    )


def tpot_ms(runs: list[dict], config: str, workload: str, batch: int) -> float | None:
    values = [
        r["median_tpot_ms"]
        for r in runs
        if (r["config"], r["workload"], r["concurrency"]) == (config, workload, batch) and r.get("median_tpot_ms")
    ]
    return median(values) if values else None


def rows(files: tuple[str, ...] = FILES, data: Path = DATA) -> list[dict]:
    """One row a (workload, batch) of every file present: workloads in the order `files` first give them, each by
    batch size."""
    out = []
    for name in files:
        path = data / name
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        for key, cells in run["summary"].items():
            if not {STOCK, OURS, DEFAULT} <= cells.keys():
                continue
            workload, batch = key.rsplit("-B", 1)
            tok, p50 = cells[DEFAULT]["tok_s"], cells[DEFAULT]["p50_e2e_s"]
            out.append(
                {
                    "workload": workload,
                    "batch": int(batch),
                    "stock": cells[STOCK]["tok_s"]["median"],
                    "ours": cells[OURS]["tok_s"]["median"],
                    "default": tok["median"],
                    "x_stock": ratio(tok, "vs_stock_float32"),
                    "x_ours": ratio(tok, "vs_ours"),
                    "p50_x_stock": ratio(p50, "vs_stock_float32"),
                    "tpot": [tpot_ms(run["runs"], c, workload, int(batch)) for c in (STOCK, OURS, DEFAULT)],
                    "accepted": cells[DEFAULT].get("accepted_per_verify", {}).get("median"),
                    "loses": loses(tok),
                    "file": name,
                }
            )
    first = {}
    for r in out:
        first.setdefault(r["workload"], len(first))
    return sorted(out, key=lambda r: (first[r["workload"]], r["batch"]))  # stable: files in order within a cell


def markdown(table: list[dict]) -> str:
    lines = [
        "| workload | batch | out tok/s: stock / ours / default | default x stock | default x ours | p50 E2E x stock "
        "| TPOT ms: stock / ours / default | accepted per verify | data |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    for r in table:
        mark = " **below target**" if r["loses"] else ""
        lines.append(
            f"| {r['workload']} | {r['batch']} | {fmt(r['stock'])} / {fmt(r['ours'])} / {fmt(r['default'])} "
            f"| {r['x_stock']}{mark} | {r['x_ours']} | {r['p50_x_stock']} | {' / '.join(fmt(t) for t in r['tpot'])} "
            f"| {fmt(r['accepted'])} | [{r['file']}](data/{r['file']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(markdown(rows()))


if __name__ == "__main__":
    main()
