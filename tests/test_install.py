"""A GPU user's install resolves: `pip install` of this project with its dependencies (what
`scripts/setup.sh --gpu` runs) brings one consistent SGLang + FlashInfer + sgl_kernel + torch set,
checked with pip's resolver (--dry-run --report: nothing is installed). Slow: pip reads the metadata of
about 200 packages (1-2 minutes), and it needs the package index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_the_project_with_its_dependencies_resolves_to_sglang_s_cuda_set(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            "-r",
            str(ROOT / "requirements" / "gpu.txt"),
        ],
        cwd=ROOT,
        check=True,
        timeout=900,
    )
    versions = {
        p["metadata"]["name"].lower(): p["metadata"]["version"] for p in json.loads(report.read_text())["install"]
    }
    assert versions["sgl-entropic"] == "0.1.0"
    assert (versions["sglang"], versions["torch"], versions["flashinfer-python"], versions["sglang-kernel"]) == (
        "0.5.23",
        "2.14.1",
        "0.7.2",
        "0.4.10",
    )
