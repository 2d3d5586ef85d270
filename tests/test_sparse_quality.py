"""The short version of the sparse-decode quality suite (benchmarks/sparse_quality.py): on SGLang's
own ModelRunner (fp32), dense and pruned decode side by side on two 4k windows of real source code,
teacher-forced along the dense greedy continuation (the dense pass made once per window). The default
selection must stay close to dense; the paper's surprisal-only selection, at the same budget, must
not, which shows that the check discriminates."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# slow tier: the one benchmark-like test left (6 prefills of 4k fp32 tokens, about 2.5 minutes on 2 cores)
pytestmark = [pytest.mark.server, pytest.mark.slow]

SCRIPT = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import sparse_quality as q
from sgl_entropic.config import PruningConfig

rt = q.Runtime("float32", max_total_tokens=8192)
# 4k tokens (the targets' range) from the middle of two SGLang source files: fixed, whatever else is installed
windows = []
for path in q.code_files()[:2]:
    ids = rt.tokenizer(path.read_text()).input_ids
    windows.append(q.Window(path.stem, ids[len(ids) // 2 - 2000 : len(ids) // 2 + 2000]))
cfgs = {"quest": PruningConfig(min_context=1024),
        "surprisal": PruningConfig(selector="surprisal", shortlist_ratio=None, min_context=1024)}
result = q.run_suite(rt, cfgs, windows, 12, lambda msg: None, free_running=set())
print("RESULT " + json.dumps(result))
"""


def test_default_selector_stays_close_to_dense_where_surprisal_does_not():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT ") :])
    quest, surprisal = result["quest"]["4"], result["surprisal"]["4"]
    assert quest["kept_share"] < 0.5  # it really pruned: about a third of the context
    assert quest["kl_mean"] < 0.01 and quest["top1_gap"] >= 0.9, quest  # the KL target
    assert surprisal["kl_mean"] > 3 * quest["kl_mean"], (quest, surprisal)
