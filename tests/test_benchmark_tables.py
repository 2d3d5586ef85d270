"""The grid table of the default (benchmarks/speculative_grid.py) over small data files of the benchmark's shape."""

from __future__ import annotations

import json

import speculative_grid  # tests/conftest.py puts benchmarks/ on the path


def _cell(median: float, low: float, high: float, vs_ours=None) -> dict:
    ratios = {"vs_stock_float32": {"median": median, "min": low, "max": high}}
    if vs_ours is not None:
        ratios["vs_ours"] = {"median": vs_ours, "min": vs_ours, "max": vs_ours}
    return {"tok_s": {"median": 10.0 * median, "min": 0, "max": 0, **ratios}, "p50_e2e_s": {"median": 1.0}}


def test_a_cell_whose_worst_round_is_below_0_95_is_marked_and_a_file_not_run_is_left_out(tmp_path):
    plain = {"tok_s": {"median": 10.0}, "p50_e2e_s": {"median": 1.0}}
    summary = {
        "doc-B1": {"stock@float32": plain, "ours": plain, "default": _cell(1.2, 1.1, 1.3, vs_ours=1.1)},
        "doc-B4": {"stock@float32": plain, "ours": plain, "default": _cell(1.2, 0.9, 1.3, vs_ours=1.1)},
        "chat-B1": {"stock@float32": plain, "ours": plain, "default": _cell(1.2, 1.1, 1.3, vs_ours=0.98)},
        "chat-B4": {"stock@float32": plain, "default": _cell(1.2, 1.1, 1.3)},  # no `ours`: not a grid cell
    }
    runs = [{"config": "default", "workload": "doc", "concurrency": 1, "median_tpot_ms": t} for t in (30.0, 50.0, 40.0)]
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps({"summary": summary, "runs": runs}))
    table = speculative_grid.rows(("a.json", "missing.json", "b.json"), tmp_path)
    assert [(r["workload"], r["batch"], r["loses"], r["file"]) for r in table] == [
        (w, b, loses, f)
        for w, b, loses in (("doc", 1, False), ("doc", 4, True), ("chat", 1, True))
        for f in ("a.json", "b.json")  # workloads as first given, each by batch
    ]
    assert table[0]["tpot"] == [None, None, 40.0] and table[0]["x_stock"] == "1.20x (1.10-1.30)"
    assert "below target" in speculative_grid.markdown(table).splitlines()[4]  # doc at batch 4


def test_a_long_essay_is_cut_at_line_breaks_into_parts_of_the_asked_size_counting_the_breaks():
    from speculative_decoding import essay_parts

    class Words:  # one token a word, one a line break: the count the parts are checked against
        def encode(self, text):
            return text.replace("\n", " \n ").split(" ")

    lines = [" ".join(f"w{i}.{j}" for j in range(99)) for i in range(70)]  # 70 lines of 100 tokens with the break
    parts = essay_parts("\n".join(lines), Words(), 2500)
    assert [len(Words().encode(p)) for p in parts] == [2499, 2499]  # 25 lines each; the last 20 lines are too few
    assert parts[0] == "\n".join(lines[:25]) and parts[1] == "\n".join(lines[25:50])


def test_widths_by_price_read_the_server_s_table_and_mark_where_the_plain_price_changes_the_width():
    import width_by_price

    t = {  # /server_info's table, ms: a plain step's attention half the verify forward's at width 1 from 4k tokens
        "tokens": [1, 2, 4, 8, 16],
        "gemm_ms": [20.0, 20.5, 21.0, 22.0, 24.0],
        "contexts": [256, 1024, 4096],
        "attention_widths": [1, 12],
        "attention_ms": [[2.0, 8.0, 40.0], [4.0, 16.0, 80.0]],
        "plain_contexts": [256, 1024, 4096],
        "plain_attention_ms": [2.0, 8.0, 20.0],
    }
    cells = width_by_price.widths(t, rows=1, most=12)
    short = [c for c in cells if c["context"] == 256]
    assert all(c["before"] == c["now"] for c in short)  # the same price there: the same widths
    long = [c for c in cells if c["context"] == 8000]
    assert any(c["now"] < c["before"] for c in long) and all(c["now"] <= c["before"] for c in long)
    assert "**" in width_by_price.markdown(cells)
