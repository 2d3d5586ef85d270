"""benchmarks/figures.py draws every figure from small JSON fixtures in the committed schemas, and
skips one whose input is absent."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import figures  # noqa: E402 - matplotlib comes with scripts/setup.sh --docs, which the test command runs

PNG = b"\x89PNG\r\n\x1a\n"


def _traces() -> dict:
    return {
        "target_entropy": 2.0,
        "fixed_temperature": 1.0,
        "traces": [
            {"prompt": p, "controller": c, "entropy": [2.5, 1.0, None, 2.1], "temperature": [1.0, 0.9, 0.9, 1.1]}
            for p in ("a", "b")
            for c in (True, False)
        ],
    }


def _overhead() -> dict:
    runs = [
        {"round": r, "config": c, "workload": "short", "output_throughput": 40.0 + r + (c == "full")}
        for r in range(2)
        for c in ("stock", "full", "sampling")
    ]
    pt = lambda us: {"median": us, "min": us * 0.9, "max": us * 1.1}  # noqa: E731
    summary = {
        c: {
            "mean_us_per_step": pt(900.0),
            "mean_step_us": pt(150_000.0),
            "mean_share": pt(0.006),
            "hooks_us_per_step": {f"Hook{i}.f:around": 100.0 * i for i in range(10)},
        }
        for c in ("sampling", "full")
    }
    return {"runs": runs, "plugin_time": {"short": summary}}


def _sparse_quality() -> dict:
    row = lambda kept, kl: {"kept_share": kept, "kl_mean": kl, "kl_p95": 2 * kl, "top1": 0.99}  # noqa: E731
    return {
        "quality": {
            "default": {"2": row(0.5, 0.004), "4": row(0.45, 0.006)},
            "fixed 20%": {"2": row(0.2, 0.03), "4": row(0.2, 0.0)},
        }
    }


def _attention_pruning() -> dict:
    return {
        "rows": [
            {
                "context": n,
                "batch": b,
                "decode_tok_s": {"stock": [5.0, 6.0], "kernel": [7.0, 8.0], "ours": [10.0, 11.0]},
                "decode_speedup": [2.0, 1.8],
                "kernel_speedup": [1.4, 1.3],
                "pruning_speedup": [1.4, 1.4],
            }
            for n in (4000, 7000)
            for b in (1, 4)
        ]
    }


def _speculative() -> dict:
    ratio = {"median": 1.4, "min": 1.2, "max": 1.6}
    return {
        "configs": ["stock", "ours", "fixed-4", "entropy"],
        "summary": {
            f"{w}-B{b}": {
                c: {"tok_s": {"median": 10.0, "min": 9.0, "max": 11.0, "vs_stock": ratio}}
                for c in ("ours", "fixed-4", "entropy")
            }
            for w in ("agent", "chat")
            for b in (1, 8)
        },
    }


def test_every_figure_is_drawn_from_its_json(tmp_path):
    data, out = tmp_path / "data", tmp_path / "figures"
    data.mkdir()
    for name, content in (
        ("entropy_traces", _traces()),
        ("plugin_overhead", _overhead()),
        ("sparse_quality", _sparse_quality()),
        ("attention_pruning", _attention_pruning()),
        ("speculative_decoding", _speculative()),
    ):
        (data / f"{name}.json").write_text(json.dumps(content))
    assert figures.main(["--data", str(data), "--out", str(out)]) == 0
    for name in ("entropy_traces", "plugin_time", "sparse_quality", "attention_pruning", "speculative_decoding"):
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG) and len(png) > 5_000, name


def test_a_figure_without_its_input_is_skipped_with_a_message(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "figures"
    data.mkdir()
    (data / "entropy_traces.json").write_text(json.dumps(_traces()))
    assert figures.main(["--data", str(data), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["entropy_traces.png"]
    err = capsys.readouterr().err
    assert f"skipped plugin_time.png: no input ({data / 'plugin_overhead.json'})" in err
    assert f"skipped sparse_quality.png: no input ({data / 'sparse_quality.json'})" in err
    assert f"skipped speculative_decoding.png: no input ({data / 'speculative_decoding.json'})" in err
