"""The plugin's shell, each case in a fresh interpreter (hooks patch SGLang classes process-wide):
hooks prove themselves, a broken target is reported, the SGLang version is guarded."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


BREAK_ONE_TARGET = r"""
import json
from types import SimpleNamespace
from sglang.srt.managers import schedule_policy
from sglang.srt.managers.scheduler import Scheduler
from sgl_entropic import plugin
from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin import hooks, server_info
from sgl_entropic.plugin import loop
from sgl_entropic.plugin.hooks import Hook

run_batch = Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "after", loop.after_run_batch,
                 "scheduler")
before = {"sglang_wraps_run_batch": hasattr(Scheduler.run_batch, "__wrapped__"),
          "counted_as_ours": hooks.is_applied(run_batch)}
del schedule_policy.SchedulePolicy.calc_priority  # a target gone, as after an SGLang refactor
plugin.activate(EntropicConfig(mode="full", scheduling={"decode_budget": 2}), apply=True)
args = SimpleNamespace(schedule_policy="fcfs", retraction_policy="length", enable_priority_scheduling=False)
section = server_info.after_get_init_info({}, SimpleNamespace(server_args=args))["entropic"]
table = plugin.hook_table(EntropicConfig(mode="full", scheduling={"decode_budget": 2}))
print("RESULT " + json.dumps({**before, "section": section, "run_batch_after": hooks.is_applied(run_batch),
                              "scheduler_hooks": sum(h.process == "scheduler" for h in table)}))
"""


def test_a_hook_that_did_not_apply_is_reported_by_target():
    proc = _run(BREAK_ONE_TARGET)
    out = _result(proc)
    # SGLang wraps Scheduler.run_batch itself (functools.wraps): that is not our hook
    assert out["sglang_wraps_run_batch"] and not out["counted_as_ours"]
    assert out["run_batch_after"]  # ... and once ours is applied, it is recognised
    section = out["section"]
    target = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
    assert section["hooks_applied"] is False and section["hooks_missing"] == [target]
    assert f"hook on {target} is NOT applied in the scheduler process" in proc.stderr
    assert out["scheduler_hooks"] >= 10


def test_all_hooks_apply_on_the_supported_sglang():
    proc = _run(BREAK_ONE_TARGET.replace("del schedule_policy.SchedulePolicy.calc_priority", "pass"))
    section = _result(proc)["section"]
    assert section["hooks_applied"] is True and section["hooks_missing"] == []
    assert section["sglang_version"] == "0.5.23"


OTHER_VERSION = r"""
import json, logging, os
from sglang.srt.plugins.hook_registry import HookRegistry
from sgl_entropic import plugin
from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin import hooks, runtime
hooks.installed_sglang_version = lambda: "0.6.0"
plugin.activate(EntropicConfig(mode="full"))
refused = {"runtime": runtime.installed() is not None, "registered": len(HookRegistry._hooks)}
os.environ[plugin.ALLOW_UNSUPPORTED_ENV] = "1"
plugin.activate(EntropicConfig(mode="full"))
print("RESULT " + json.dumps({"refused": refused, "forced_runtime": runtime.installed() is not None,
                              "forced_registered": len(HookRegistry._hooks)}))
"""


def test_another_sglang_version_refuses_the_loops_unless_forced():
    proc = _run(OTHER_VERSION)
    out = _result(proc)
    assert out["refused"] == {"runtime": False, "registered": 0}
    assert "sgl-entropic supports sglang 0.5.23, found 0.6.0: the entropic loops are NOT loaded" in proc.stderr
    assert out["forced_runtime"] and out["forced_registered"] > 10
    assert "loading the loops anyway" in proc.stderr


def test_the_launcher_exits_2_on_another_sglang_version():
    proc = _run(
        "import sgl_entropic.plugin.hooks as h; h.installed_sglang_version = lambda: '0.6.0'\n"
        "from sgl_entropic.launch_server import main; main(['--entropic', 'sampling'])"
    )
    assert proc.returncode == 2
    assert "sgl-entropic supports sglang 0.5.23, found 0.6.0" in proc.stderr
