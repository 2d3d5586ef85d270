"""The configuration table of the README and docs/configuration.md, generated from the pydantic config itself
(`sgl_entropic/config.py`) so that it cannot drift: every field of every section, its default, its range and one
line of meaning. tests/test_docs.py checks that both files hold exactly this table.

    .venv/bin/python scripts/config_table.py            # print it
    .venv/bin/python scripts/config_table.py --write    # rewrite it in README.md and docs/configuration.md
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt

from sgl_entropic.config import EntropicConfig

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
FILES = (ROOT / "README.md", ROOT / "docs" / "configuration.md")


def _range(field) -> str:
    """Choices of a Literal, or the numeric bounds, as the model validates them."""
    optional = typing.get_origin(field.annotation) is typing.Union
    inner = next(a for a in typing.get_args(field.annotation) if a is not type(None)) if optional else field.annotation
    if typing.get_origin(inner) is typing.Literal:
        return " / ".join(f"`{c}`" for c in typing.get_args(inner)) + (" / `null`" if optional else "")
    if inner is bool:
        return "true / false"
    low = high = ""
    for m in field.metadata:
        if isinstance(m, (Ge, Gt)):
            low = f"{'>=' if isinstance(m, Ge) else '>'} {getattr(m, 'ge', getattr(m, 'gt', None))}"
        if isinstance(m, (Le, Lt)):
            high = f"{'<=' if isinstance(m, Le) else '<'} {getattr(m, 'le', getattr(m, 'lt', None))}"
    bounds = ", ".join(b for b in (low, high) if b)
    return (bounds or inner.__name__) + (" or null" if optional else "")


def _default(value) -> str:
    return "`null`" if value is None else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def table() -> str:
    rows = [
        "| field | default | range | meaning |",
        "|---|---|---|---|",
        f"| `mode` | `{EntropicConfig.model_fields['mode'].default}` | "
        + " / ".join(f"`{m}`" for m in typing.get_args(EntropicConfig.model_fields["mode"].annotation))
        + " | which loops run (`--entropic`); `signal` (formerly `off`, still accepted) runs none and records "
        "the signal |",
    ]
    for section, info in EntropicConfig.model_fields.items():
        if section == "mode":
            continue
        for name, field in info.annotation.model_fields.items():
            meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{section}.{name}` | {_default(field.default)} | {_range(field)} | {meaning} |")
    return "\n".join(rows)


def rewrite(path: Path, generated: str) -> bool:
    """Put the table between the markers; True when the file changed."""
    text = path.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{generated}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    generated = table()
    if sys.argv[1:] == ["--write"]:
        for f in FILES:
            print(f"{f.relative_to(ROOT)}: {'rewritten' if rewrite(f, generated) else 'up to date'}")
    else:
        print(generated)
