"""What every program shares: `--url` / `--engine`, the backend behind them, and trace summaries."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Callable, Iterator, Optional

import sglang as sgl
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import get_chat_template

import sgl_entropic

DEFAULT_URL = os.environ.get("SGLANG_ENTROPIC_URL", "http://127.0.0.1:30000")


def parser(description: Optional[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--url", default=DEFAULT_URL, help="our server (default: %(default)s, from $SGLANG_ENTROPIC_URL if set)"
    )
    p.add_argument("--engine", action="store_true", help="run on an in-process sgl_entropic.Engine instead")
    return p


def run_from_args(description: Optional[str], run: Callable[[BaseBackend], dict]) -> dict:
    """A program's command line: parse --url / --engine, then run it on that backend."""
    args = parser(description).parse_args()
    with backend_from_args(args) as backend:
        return run(backend)


def endpoint(url: str) -> sgl.RuntimeEndpoint:
    backend = sgl.RuntimeEndpoint(url)
    backend.chat_template = get_chat_template("chatml")  # not auto-detected for a local model folder
    return backend


@contextlib.contextmanager
def backend_from_args(args: argparse.Namespace) -> Iterator[BaseBackend]:
    if not args.engine:
        yield endpoint(args.url)
        return
    engine = sgl_entropic.Engine()
    try:
        yield sgl_entropic.EngineBackend(engine)
    finally:
        engine.shutdown()


def trace_summary(meta: dict) -> Optional[dict]:
    """Per-generation scalars from the entropic meta_info (null steps had non-finite logits);
    None from a stock SGLang server, which has no signal."""
    if "entropy" not in meta:
        return None
    entropy = [h for h in meta["entropy"] if h is not None]
    surprisal = [x for x in meta["surprisal"] if x is not None]
    return {
        "tokens": meta["completion_tokens"],
        "entropy_mean": statistics.fmean(entropy) if entropy else float("nan"),
        "surprisal_mean": statistics.fmean(surprisal) if surprisal else float("nan"),
        "temperature_min": min(meta["temperature"]),
        "temperature_max": max(meta["temperature"]),
        "entropic_time": meta["entropic_time"],
        "entropic_efficiency": meta["entropic_efficiency"],
    }


def format_summary(summary: Optional[dict]) -> str:
    if summary is None:
        return "no entropic traces (stock server)"
    return (
        f"{summary['tokens']} tok | H {summary['entropy_mean']:.2f} nats | surprisal {summary['surprisal_mean']:.2f}"
        f" | T {summary['temperature_min']:.2f}..{summary['temperature_max']:.2f}"
        f" | tau {summary['entropic_time']:.2f} | dtau/dC {summary['entropic_efficiency']:.3f}"
    )
