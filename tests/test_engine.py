"""sgl.Engine in-process: entropic decoding, return_entropy, and @sgl.function programs through EngineBackend."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.server

SCRIPT = r"""
import json
import sglang as sgl
import sgl_entropic

engine = sgl_entropic.Engine(entropic="sampling", dtype="float32")
raw = engine.generate(
    "The weather today is",
    {"max_new_tokens": 8, "custom_params": {"entropic": {"target_entropy": 1.5}}},
    return_entropy=True,
)
plain = engine.generate("The weather today is", {"max_new_tokens": 4, "temperature": 0})

@sgl.function
def answer(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl_entropic.gen("answer", max_tokens=12, target_entropy=1.0))

state = answer.run(question="Name a color.", backend=sgl_entropic.EngineBackend(engine))
print("RESULT " + json.dumps({"raw": raw["meta_info"], "plain": plain["meta_info"], "program": state.get_meta_info("answer")}))
engine.shutdown()
"""


def test_engine_and_engine_backend():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT ") :])
    raw, plain, program = result["raw"], result["plain"], result["program"]
    assert len(raw["entropy"]) == len(raw["temperature"]) == raw["completion_tokens"] == 8
    assert "entropy" not in plain and isinstance(plain["entropic_time"], float)
    assert len(program["temperature"]) == program["completion_tokens"] > 0


HYGIENE = r"""
import json, os
import sgl_entropic

first = sgl_entropic.Engine(entropic="sampling", dtype="float32")
env_after_start = os.environ.get("SGLANG_ENTROPIC_CONFIG")
try:
    sgl_entropic.Engine(entropic="off", dtype="float32")
    refused = None
except ValueError as err:
    refused = str(err)
first.shutdown()
# once the first is shut down, another config in the same process works, with its own behaviour
second = sgl_entropic.Engine(entropic="off", dtype="float32")
signal_only = second.generate("Hi", {"max_new_tokens": 3, "temperature": 0}, return_entropy=True)["meta_info"]
try:
    second.generate("Hi", {"max_new_tokens": 2, "custom_params": {"entropic": {"target_entropy": 1.0}}})
    sampling_refused = False
except ValueError:
    sampling_refused = True
second.shutdown()
print("RESULT " + json.dumps({"env_after_start": env_after_start, "refused": refused,
                              "signal_only": signal_only, "sampling_refused": sampling_refused}))
"""


def test_one_config_per_process_and_no_config_left_in_the_environment():
    proc = subprocess.run([sys.executable, "-c", HYGIENE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["env_after_start"] is None
    assert "another engine with a different entropic config is alive" in result["refused"]
    assert len(result["signal_only"]["entropy"]) == 3 and result["sampling_refused"]
