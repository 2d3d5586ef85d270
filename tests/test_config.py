"""The one config model: validated at the edge, errors name the field, nothing silently clamped."""

import json

import pytest
from pydantic import ValidationError

from sgl_entropic.config import (
    EntropicConfig,
    SamplingConfig,
    format_error,
    parse_config_arg,
    request_sampling_config,
)


def test_defaults_round_trip_through_the_environment(monkeypatch):
    cfg = EntropicConfig.model_validate({"mode": "sampling", "sampling": {"target_entropy": 1.5}})
    monkeypatch.setenv("SGLANG_ENTROPIC_CONFIG", cfg.to_env())
    assert EntropicConfig.from_env() == cfg
    assert cfg.sampling_on and not cfg.pruning_on and not cfg.scheduling_on


def test_the_mode_that_runs_no_loop_is_named_signal_and_off_still_means_it():
    from sgl_entropic.launch_server import build_config

    old = EntropicConfig.model_validate({"mode": "off"})
    assert old.mode == "signal" and old == EntropicConfig(mode="signal")
    assert not (old.sampling_on or old.scheduling_on or old.pruning_on)

    class Parser:
        def error(self, message):
            raise ValueError(message)

    assert build_config("off", '{"mode": "signal"}', Parser()).mode == "signal"  # the same mode, not a contradiction
    with pytest.raises(ValueError, match="contradicts"):
        build_config("off", '{"mode": "full"}', Parser())
    with pytest.raises(ValidationError):
        EntropicConfig.model_validate({"mode": "none"})


def test_from_env_is_none_without_our_launcher(monkeypatch):
    monkeypatch.delenv("SGLANG_ENTROPIC_CONFIG", raising=False)
    assert EntropicConfig.from_env() is None


@pytest.mark.parametrize(
    "data, field",
    [
        ({"sampling": {"eta": 0}}, "sampling.eta"),
        ({"sampling": {"eta": float("inf")}}, "sampling.eta"),
        ({"sampling": {"target_entropy": "high"}}, "sampling.target_entropy"),
        ({"sampling": {"t_min": 2.0, "t_max": 1.0}}, "sampling"),
        ({"pruning": {"min_keep_ratio": 0.9, "max_keep_ratio": 0.5}}, "pruning"),
        ({"scheduling": {"alpha": 0, "beta": 0, "gamma": 0}}, "scheduling"),
        ({"mode": "turbo"}, "mode"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ValidationError) as err:
        EntropicConfig.model_validate(data)
    assert format_error(err.value).startswith(field)


def test_request_overrides_merge_over_server_values():
    server = SamplingConfig(target_entropy=1.0, t_max=3.0)
    merged = request_sampling_config(server, {"eta": 0.2})
    assert (merged.target_entropy, merged.t_max, merged.eta) == (1.0, 3.0, 0.2)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"eta": -1}, "custom_params.entropic.eta"),
        ({"eta": float("nan")}, "custom_params.entropic.eta"),
        ({"t_init": 5.0}, "t_init"),
        ({"unknown": 1}, "custom_params.entropic.unknown"),
        ({"controller": "greedy"}, "custom_params.entropic.controller"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_request_overrides_raise_value_error(overrides, needle):
    with pytest.raises(ValueError) as err:
        request_sampling_config(SamplingConfig(), overrides)
    assert needle in str(err.value)


def test_every_request_is_a_server_setting_that_needs_the_sampling_loop():
    assert EntropicConfig.model_validate(
        {"mode": "sampling", "sampling": {"every_request": True}}
    ).sampling.every_request
    with pytest.raises(ValidationError, match="needs mode sampling or full"):
        EntropicConfig.model_validate({"mode": "pruning", "sampling": {"every_request": True}})
    with pytest.raises(ValueError, match="custom_params.entropic.every_request"):
        request_sampling_config(SamplingConfig(), {"every_request": True})


def test_config_arg_takes_inline_json_or_a_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"mode": "off"}))
    assert parse_config_arg(str(path)) == {"mode": "off"}
    assert parse_config_arg('{"mode": "full"}') == {"mode": "full"}
    with pytest.raises(ValueError):
        parse_config_arg('{"x": Infinity}')


def test_the_engine_spells_speculative_refusals_as_its_own_parameters():
    """One rule set for the launcher and sgl_entropic.Engine (server_args.speculative_args): the Engine's
    ValueError names its keyword argument, and what the plugin sets comes back as Engine arguments."""
    from sgl_entropic.server_args import speculative_args, spell_kwarg

    config = EntropicConfig()
    with pytest.raises(ValueError, match="speculative_algorithm='EAGLE3'"):
        speculative_args(config, {"speculative_algorithm": "EAGLE3"}, "cpu", spell_kwarg)
    with pytest.raises(ValueError, match="speculative_adaptive=True"):
        speculative_args(config, {"speculative_algorithm": "NGRAM", "speculative_adaptive": True}, "cpu", spell_kwarg)
    spec, updates = speculative_args(config, {"speculative_algorithm": "ngram"}, "cpu", spell_kwarg)
    assert spec.speculative_on and spec.speculative.algorithm == "NGRAM"
    # the default rule: entropy, or acceptance where ranks would time their steps apart; one asked for stands
    assert config.speculative.draft is None and spec.speculative.draft == "entropy"
    tp2 = {"speculative_algorithm": "NGRAM", "tp_size": 2}
    assert speculative_args(config, tp2, "cpu", spell_kwarg)[0].speculative.draft == "acceptance"
    with pytest.raises(ValueError, match="tp_size=2"):
        speculative_args(EntropicConfig.model_validate({"speculative": {"draft": "entropy"}}), tp2, "cpu", spell_kwarg)
    fixed = EntropicConfig.model_validate({"speculative": {"draft": "fixed"}})
    assert speculative_args(fixed, tp2, "cpu", spell_kwarg)[0].speculative.draft == "fixed"
    assert updates == {"speculative_ngram_max_bfs_breadth": 1, "attention_backend": "entropic"}
    # without pruning the KV pool keeps SGLang's pages: trees stay allowed; on CUDA SGLang's backend verifies
    sampling = EntropicConfig(mode="sampling")
    assert speculative_args(sampling, {"speculative_algorithm": "NGRAM"}, "cuda", spell_kwarg)[1] == {}
    assert speculative_args(sampling, {}, "cpu", spell_kwarg) == (sampling, {})  # other modes: only when asked


def test_full_speculates_by_default_unless_turned_off_or_ruled_out():
    """`--entropic full` runs NGRAM without any SGLang flag; speculative.draft 'off' turns it off; a flag of the
    user's that speculation would refuse keeps it off instead of failing the launch; the source says which."""
    from sgl_entropic.server_args import speculative_args, spell_flag

    spec, updates = speculative_args(EntropicConfig(), {}, "cpu", spell_flag)
    assert spec.speculative.algorithm == "NGRAM" and spec.speculative.draft == "entropy"
    assert spec.speculative.source.startswith("on: the default of --entropic full")
    assert updates == {
        "speculative_algorithm": "NGRAM",
        "speculative_ngram_max_bfs_breadth": 1,
        "attention_backend": "entropic",
    }
    # on CUDA where pruning does not engage: SGLang's NGRAM as stock runs it, nothing else
    full_cuda = EntropicConfig().model_copy(
        update={"pruning": EntropicConfig().pruning.model_copy(update={"engaged": False})}
    )  # as pruning_args leaves it
    assert speculative_args(full_cuda, {}, "cuda", spell_flag)[1] == {"speculative_algorithm": "NGRAM"}
    off = EntropicConfig.model_validate({"speculative": {"draft": "off"}})
    spec, updates = speculative_args(off, {}, "cpu", spell_flag)
    assert not spec.speculative_on and updates == {} and spec.speculative.source == "off: speculative.draft 'off'"
    with pytest.raises(ValueError, match="speculative.draft 'off'"):
        speculative_args(off, {"speculative_algorithm": "NGRAM"}, "cpu", spell_flag)
    explicit = speculative_args(EntropicConfig(), {"speculative_algorithm": "NGRAM"}, "cpu", spell_flag)[0]
    assert explicit.speculative.source == "on: --speculative-algorithm NGRAM"
    for args, config, named in (
        ({"pp_size": 2}, EntropicConfig(), "--pp-size 2"),
        ({"dp_size": 2}, EntropicConfig(), "--dp-size 2"),
        ({"speculative_adaptive": True}, EntropicConfig(), "--speculative-adaptive"),
        ({}, EntropicConfig.model_validate({"sampling": {"controller": "mirostat_v2"}}), "mirostat_v2"),
    ):
        spec, updates = speculative_args(config, args, "cpu", spell_flag)
        assert not spec.speculative_on and updates == {} and named in spec.speculative.source
    with pytest.raises(ValueError, match="set by the launcher"):
        speculative_args(spec, {}, "cpu", spell_flag)  # the source is the launcher's, not the user's
