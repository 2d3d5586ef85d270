"""Users' choices first, at the launcher, in sgl_entropic.Engine and in /server_info: a --schedule-policy
the user names is kept (the macro loop leaves the queue orders to SGLang), asking for both orders exits
with code 2 naming both flags (a ValueError in the Engine), and /server_info reports the order that
actually runs. In-process: the launcher refuses before it starts anything."""

import argparse
from types import SimpleNamespace

import pytest

from sgl_entropic import launch_server
from sgl_entropic.config import EntropicConfig
from sgl_entropic.engine import _queue_policies
from sgl_entropic.plugin import runtime, server_info


def _exit_message(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        launch_server.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, names",
    [
        (
            ["--schedule-policy", "lpm", "--entropic-config", '{"scheduling": {"order": "entropic"}}'],
            ["--schedule-policy lpm", "scheduling.order"],
        ),
        (
            [
                "--entropic",
                "scheduling",
                "--retraction-policy=length",
                "--entropic-config",
                '{"scheduling": {"order": "entropic"}}',
            ],
            ["--retraction-policy length", "scheduling.order"],
        ),
        (
            ["--schedule-policy", "entropic", "--entropic-config", '{"scheduling": {"order": "sglang"}}'],
            ["--schedule-policy entropic", "scheduling.order"],
        ),
        (
            ["--schedule-policy", "entropic", "--retraction-policy", "priority"],
            ["--schedule-policy entropic", "--retraction-policy priority"],
        ),
        (["--entropic", "pruning", "--schedule-policy", "entropic"], ["--schedule-policy entropic", "pruning"]),
    ],
)
def test_two_orders_at_once_exit_2_naming_both(capsys, argv, names):
    err = _exit_message(capsys, argv)
    for name in names:
        assert name in err, err


def _resolve(argv: list[str], config: dict | None = None):
    parser = argparse.ArgumentParser()
    return launch_server.map_schedule_policy(argv, EntropicConfig.model_validate(config or {}), parser)


def test_a_named_policy_is_kept_and_the_loop_leaves_the_order_to_sglang():
    for flags in (["--schedule-policy", "lpm"], ["--schedule-policy=hrrn"], ["--retraction-policy", "priority"]):
        rest, config = _resolve(flags)
        assert rest == flags and config.scheduling.order == "sglang" and config.mode == "full"
    rest, config = _resolve(["--schedule-policy", "lpm"], {"mode": "sampling"})  # no scheduling loop: untouched
    assert config.scheduling.order is None and not config.scheduling_on and not config.entropic_order
    # nothing named: full leaves the order to SGLang (the entropic order did not beat its policies),
    # mode scheduling runs the entropic order over SGLang's fcfs
    rest, config = _resolve(["--tp-size", "1"])
    assert rest == ["--tp-size", "1"] and config.scheduling_on and not config.entropic_order
    rest, config = _resolve(["--tp-size", "1"], {"mode": "scheduling"})
    assert rest == ["--tp-size", "1"] and config.entropic_order
    for mode in ("full", "scheduling"):  # asked by name: the entropic order in either mode
        rest, config = _resolve(["--schedule-policy", "entropic", "--tp-size", "1"], {"mode": mode})
        assert rest == ["--tp-size", "1", "--schedule-policy", "fcfs"] and config.entropic_order
    rest, config = _resolve(["--schedule-policy", "lpm"], {"mode": "scheduling"})
    assert config.scheduling.order == "sglang" and not config.entropic_order
    # the choice travels to the scheduler process in the environment, validated again there
    assert (
        EntropicConfig.model_validate_json(_resolve(["--schedule-policy", "lpm"])[1].to_env()).scheduling.order
        == "sglang"
    )


def test_the_engine_follows_the_launchers_rules_in_its_own_spelling():
    config, kwargs = _queue_policies(EntropicConfig(mode="full"), {"schedule_policy": "entropic", "dtype": "float32"})
    assert kwargs == {"schedule_policy": "fcfs", "dtype": "float32"} and config.entropic_order
    config, kwargs = _queue_policies(EntropicConfig(mode="scheduling"), {"schedule_policy": "lpm"})
    assert kwargs == {"schedule_policy": "lpm"} and config.scheduling.order == "sglang" and not config.entropic_order
    config, kwargs = _queue_policies(EntropicConfig(mode="scheduling"), {})
    assert kwargs == {} and config.entropic_order
    for mode, kwargs, names in [
        ("pruning", {"schedule_policy": "entropic"}, ["schedule_policy='entropic'", "pruning"]),
        (
            "full",
            {"schedule_policy": "entropic", "retraction_policy": "priority"},
            ["schedule_policy='entropic'", "retraction_policy='priority'"],
        ),
    ]:
        with pytest.raises(ValueError) as err:
            _queue_policies(EntropicConfig(mode=mode), kwargs)
        assert all(name in str(err.value) for name in names), err.value
    with pytest.raises(ValueError, match="schedule_policy='lpm' and scheduling.order"):
        _queue_policies(EntropicConfig(mode="full", scheduling={"order": "entropic"}), {"schedule_policy": "lpm"})


def _scheduler(policy="fcfs", retraction="length", priority=False):
    args = SimpleNamespace(schedule_policy=policy, retraction_policy=retraction, enable_priority_scheduling=priority)
    return SimpleNamespace(server_args=args)


def test_server_info_reports_the_order_that_runs(monkeypatch):
    monkeypatch.setattr(server_info.hooks, "report_missing", lambda process: [])
    runtime.install(EntropicConfig(mode="scheduling"))
    info = server_info.after_get_init_info({"status": "ready"}, _scheduler(priority=True))
    assert info["schedule_policy"] == "entropic"
    assert info["entropic"]["scheduling"] == {
        "waiting_order": "entropic",
        "retraction_order": "entropic",
        "sglang_policy_under_it": "fcfs",
        "request_priority_first": True,
        "decode_budget": None,
    }

    runtime.install(EntropicConfig(mode="full", scheduling={"order": "sglang", "decode_budget": 2}))
    info = server_info.after_get_init_info({"status": "ready"}, _scheduler("lpm", "priority"))
    assert "schedule_policy" not in info  # SGLang's own value (lpm) stands
    assert info["entropic"]["scheduling"]["waiting_order"] == "lpm"
    assert info["entropic"]["scheduling"]["retraction_order"] == "priority"
    assert info["entropic"]["scheduling"]["decode_budget"] == 2

    runtime.install(EntropicConfig(mode="full"))  # the default: SGLang's policy orders, the loop's clock runs
    info = server_info.after_get_init_info({"status": "ready"}, _scheduler())
    assert "schedule_policy" not in info and info["entropic"]["scheduling"]["waiting_order"] == "fcfs"

    runtime.install(EntropicConfig(mode="sampling"))
    info = server_info.after_get_init_info({"status": "ready"}, _scheduler())
    assert "schedule_policy" not in info and "scheduling" not in info["entropic"]
