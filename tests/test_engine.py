"""sgl.Engine in-process: entropic decoding, return_entropy, @sgl.function programs through EngineBackend
(fork/join's concurrent branches included), one entropic config per process, and nothing left in the
environment, and prompts that would end the scheduler refused. One script, two engine loads, in a fresh interpreter (hooks patch SGLang process-wide)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.program_checks import assert_join_chose_the_lowest_mean_surprisal

pytestmark = pytest.mark.server

SCRIPT = r"""
import json, os
import sglang as sgl
import sgl_entropic
from programs import fork_join

engine = sgl_entropic.Engine(entropic="sampling", dtype="float32")
out = {"env_after_start": os.environ.get("SGLANG_ENTROPIC_CONFIG")}
out["raw"] = engine.generate(
    "The weather today is",
    {"max_new_tokens": 8, "custom_params": {"entropic": {"target_entropy": 1.5}}},
    return_entropy=True,
)["meta_info"]
out["plain"] = engine.generate("The weather today is", {"max_new_tokens": 4, "temperature": 0})["meta_info"]
out["refused_prompts"] = []
for bad in ({"prompt": ""}, {"input_ids": [1000000000, -1]}):  # each ended stock SGLang's scheduler
    try:
        engine.generate(**bad, sampling_params={"max_new_tokens": 2})
        out["refused_prompts"].append(None)
    except ValueError as err:
        out["refused_prompts"].append(str(err))
out["after_refusals"] = engine.generate("The weather today is", {"max_new_tokens": 4, "temperature": 0})["meta_info"]

@sgl.function
def answer(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl_entropic.gen("answer", max_tokens=12, target_entropy=1.0))

backend = sgl_entropic.EngineBackend(engine)
out["program"] = answer.run(question="Name a color.", backend=backend).get_meta_info("answer")
question = next(iter(fork_join.QUESTIONS))  # branches from concurrent threads: EngineBackend serialises them
out["fork_join"] = fork_join.run(backend, questions={question: fork_join.QUESTIONS[question]})
try:
    sgl_entropic.Engine(entropic="signal", dtype="float32")
    out["refused"] = None
except ValueError as err:
    out["refused"] = str(err)
engine.shutdown()
# once the first is shut down, another config in the same process works, with its own behaviour
second = sgl_entropic.Engine(entropic="signal", dtype="float32")
out["signal_only"] = second.generate("Hi", {"max_new_tokens": 3, "temperature": 0}, return_entropy=True)["meta_info"]
try:
    second.generate("Hi", {"max_new_tokens": 2, "custom_params": {"entropic": {"target_entropy": 1.0}}})
    out["sampling_refused"] = False
except ValueError:
    out["sampling_refused"] = True
second.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT ") :])


def test_engine_and_engine_backend(result):
    raw, plain, program = result["raw"], result["plain"], result["program"]
    assert len(raw["entropy"]) == len(raw["temperature"]) == raw["completion_tokens"] == 8
    assert "entropy" not in plain and isinstance(plain["entropic_time"], float)
    assert len(program["temperature"]) == program["completion_tokens"] > 0
    (item,) = result["fork_join"]["questions"]
    assert_join_chose_the_lowest_mean_surprisal(item)


def test_the_engine_refuses_what_would_end_its_scheduler_and_keeps_serving(result):
    empty, out_of_vocabulary = result["refused_prompts"]
    assert "prompt is empty" in empty and "1000000000 is not a token id" in out_of_vocabulary
    assert result["after_refusals"]["completion_tokens"] == 4


def test_one_config_per_process_and_no_config_left_in_the_environment(result):
    assert result["env_after_start"] is None
    assert "another engine with a different entropic config is alive" in result["refused"]
    assert len(result["signal_only"]["entropy"]) == 3 and result["sampling_refused"]
