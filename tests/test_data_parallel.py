"""`--dp-size 2` inside one server: the plugin loads in both schedulers, each reports itself in
/server_info, requests spread over both ranks carry their traces, and validation still answers 400.

On CPU SGLang refuses more ranks than NUMA nodes unless SGLANG_CPU_OMP_THREADS_BIND gives each rank
its cores; the launcher sets it (sgl_entropic/cpu.py), so this runs on a 2-core, 1-node machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys

import pytest

from tests.conftest import COMMON_ARGS, PRUNING, start_server, stop_server
from tests.load_client import CHAT

pytestmark = pytest.mark.server

CONTROLLER = {"entropic": {"target_entropy": 1.5, "t_min": 0.3, "t_max": 0.6, "t_init": 0.5}}


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    # the crossovers given: each rank would otherwise time them at start-up (not under test)
    srv = start_server(
        [
            sys.executable,
            "-m",
            "sgl_entropic.launch_server",
            "--entropic",
            "full",
            "--dp-size",
            "2",
            "--entropic-config",
            json.dumps({"pruning": PRUNING}),
            *COMMON_ARGS,
        ],
        log,
    )
    yield srv
    stop_server(srv.proc)


def _states(srv) -> list[dict]:
    return [s["entropic"] for s in srv.get("/server_info", timeout=120).json()["internal_states"]]


def test_every_rank_loads_the_plugin_and_reports_itself(dp_server):
    info = dp_server.get("/server_info").json()
    assert info["dp_size"] == 2
    assert sorted(s["dp_rank"] for s in _states(dp_server)) == [0, 1]
    section = info["entropic"]  # merged over the ranks by our hook on SGLang's DP controller
    assert section["ranks"] == 2 and section["plugin_loaded_in_scheduler"] and section["hooks_applied"], section


def test_requests_spread_over_both_ranks_and_carry_their_traces(dp_server):
    before = {s["dp_rank"]: s["requests_admitted"] for s in _states(dp_server)}
    bodies = [
        {
            "text": CHAT.format(f"Describe item {i}."),
            "return_entropy": True,
            "sampling_params": {
                "max_new_tokens": 6,
                "ignore_eos": True,
                "temperature": 0.8,
                "custom_params": CONTROLLER,
            },
        }
        for i in range(8)
    ]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(dp_server.generate, bodies))
    for out in outs:
        meta = out["meta_info"]
        assert len(meta["entropy"]) == len(meta["temperature"]) == meta["completion_tokens"] == 6
        assert all(0.3 - 1e-6 <= t <= 0.6 + 1e-6 for t in meta["temperature"]), meta["temperature"]
    after = {s["dp_rank"]: s["requests_admitted"] for s in _states(dp_server)}
    served = {rank: after[rank] - before[rank] for rank in after}
    assert sum(served.values()) == 8 and all(n > 0 for n in served.values()), served


def test_validation_answers_400_with_two_ranks(dp_server):
    bad = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"entropic": {"t_min": -1}}}}
    r = dp_server.post("/generate", bad)
    assert r.status_code == 400 and "t_min" in r.text, r.text
