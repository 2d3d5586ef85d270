"""The docs: the site builds strictly (every link and anchor resolves), the configuration table is the config's
own, the README stays a five-minute read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import config_table  # noqa: E402


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "speculative" / "index.html").is_file()


def test_the_configuration_tables_are_generated_from_the_config():
    table = config_table.table()
    for path in config_table.FILES:
        text = path.read_text()
        inside = text.split(config_table.START, 1)[1].split(config_table.END, 1)[0].strip()
        assert inside == table, f"{path.name}: run scripts/config_table.py --write"
    from sgl_entropic.config import EntropicConfig

    for section, info in EntropicConfig.model_fields.items():  # every field, each with a meaning
        for name in getattr(info.annotation, "model_fields", {}):
            assert f"| `{section}.{name}` |" in table
    assert "|  |" not in table


def test_the_readme_is_short_and_has_no_placeholder():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "TBD" not in text and "TBD" not in "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))


def test_the_step_tables_name_every_hook_and_nothing_else():
    """docs/architecture.md's "One step, hook by hook": every hook of the widest configuration (all loops, the
    decode budget, speculation), each row's kind and module those of the hook table."""
    import re

    from sgl_entropic.config import EntropicConfig
    from sgl_entropic.plugin import hook_table

    config = EntropicConfig.model_validate(
        {"mode": "full", "scheduling": {"decode_budget": 4}, "speculative": {"algorithm": "NGRAM", "draft": "entropy"}}
    )
    want = {
        (
            ".".join(h.target.split(".")[-2:]),
            h.kind,
            h.handler.__module__.removeprefix("sgl_entropic.plugin.").replace(".", "/"),
        )
        for h in hook_table(config)
    }
    section = (ROOT / "docs" / "architecture.md").read_text().split("## One step, hook by hook", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\|(?: [0-9a-e]+ \|)? `([\w.]+)` \| (\w+) \| `([\w/]+)` \|", section, re.M)
    assert len(rows) == len(set(rows)) and set(rows) == want
