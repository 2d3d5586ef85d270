"""`python -m sgl_entropic.launch_server`: sglang.launch_server plus entropic decoding.

Every `sglang.launch_server` flag passes through unchanged. Our own flags:
  --entropic {signal,sampling,scheduling,pruning,full}  which loops run (default: full; signal: none,
                                                        the signal only; `off` is its old name)
  --entropic-config JSON_OR_PATH                      values for the EntropicConfig model
With no --model-path it serves the bundled SmolLM2-135M-Instruct with CPU-friendly defaults.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional

from pydantic import ValidationError

from sgl_entropic.config import CONFIG_ENV, MODE_ALIASES, MODES, EntropicConfig, format_error, parse_config_arg
from sgl_entropic.server_args import (
    PRUNING_FIELDS,
    SPECULATIVE_FIELDS,
    flag,
    pruning_args,
    speculative_args,
    spell_flag,
)

# Applied only when the user did not pass the flag themselves.
BUNDLED_MODEL_DEFAULTS = {
    "--dtype": "bfloat16",
    "--max-total-tokens": "65536",  # the default KV pool takes ~17 GB of RAM on CPU
    "--chat-template": "chatml",  # not auto-detected for a local folder
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_entropic.launch_server",
        description="SGLang server with entropic-time decoding. All sglang.launch_server flags are accepted.",
        add_help=False,  # --help falls through to SGLang's parser after ours is shown
    )
    parser.add_argument(
        "--entropic",
        choices=(*MODES, *MODE_ALIASES),
        default=None,
        help="which control loops run (default: full; signal: none, the signal only; off: signal)",
    )
    parser.add_argument(
        "--entropic-config", default=None, metavar="JSON_OR_PATH", help="EntropicConfig as JSON or a JSON file"
    )
    return parser


def build_config(mode: Optional[str], config_arg: Optional[str], parser: argparse.ArgumentParser) -> EntropicConfig:
    """Validate our flags; any problem exits with code 2 and names the flag."""
    data: dict = {}
    if config_arg is not None:
        try:
            data = parse_config_arg(config_arg)
        except ValueError as err:
            parser.error(f"--entropic-config: {err}")
    if mode is not None:
        if "mode" in data and MODE_ALIASES.get(data["mode"], data["mode"]) != MODE_ALIASES.get(mode, mode):
            parser.error(f"--entropic {mode} contradicts --entropic-config mode {data['mode']!r}")
        data["mode"] = mode
    try:
        config = EntropicConfig.model_validate(data)
    except ValidationError as err:
        parser.error(f"--entropic-config: {format_error(err)}")
    return config


def check_sglang_version(parser: argparse.ArgumentParser) -> None:
    """The plugin's hooks are written against one SGLang version (see sgl_entropic.plugin)."""
    from sgl_entropic.plugin import ALLOW_UNSUPPORTED_ENV, SUPPORTED_SGLANG, hooks, sglang_supported

    if not sglang_supported() and os.environ.get(ALLOW_UNSUPPORTED_ENV) != "1":
        parser.error(
            f"sgl-entropic supports sglang {SUPPORTED_SGLANG}, found {hooks.installed_sglang_version()}; "
            f"install sglang=={SUPPORTED_SGLANG}, or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway"
        )


def map_schedule_policy(
    rest: list[str], config: EntropicConfig, parser: argparse.ArgumentParser
) -> tuple[list[str], EntropicConfig]:
    """Who orders the queues (EntropicConfig.with_queue_policies); a conflict exits with code 2."""
    policy = _flag_value(rest, "--schedule-policy")
    try:
        chosen, config = config.with_queue_policies(policy, _flag_value(rest, "--retraction-policy"))
    except ValueError as e:
        parser.error(str(e))
    if chosen != policy:
        rest = _drop_flag(rest, "--schedule-policy") + ["--schedule-policy", chosen]
    return rest, config


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


_UNSET = object()


@functools.cache
def _sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own argument parser, to read values only: every default replaced by a marker (what differs was
    given), no choices checked (SGLang's own parse checks them later, once the plugin registered its backend)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        action.choices = None
    parser.set_defaults(**{a.dest: _UNSET for a in parser._actions})
    return parser


def _given(rest: list[str], names) -> dict:
    """SGLang's arguments among `names` that the user set (field name -> value), read by SGLang's own parser, so
    that every spelling it accepts counts: aliases (--decode-context-parallel-size), --flag=value, deprecated
    flags (--enable-dp-attention)."""
    argv = rest if _has_flag(rest, "--model-path") else [*rest, "--model-path", "unused"]
    ns, _ = _sglang_parser().parse_known_args(argv)
    return {n: getattr(ns, n) for n in names if getattr(ns, n, _UNSET) is not _UNSET}


def _as_flags(updates: dict) -> list[str]:
    return [
        a for name, value in updates.items() for a in ((flag(name),) if value is True else (flag(name), str(value)))
    ]


def map_pruning_flags(
    rest: list[str], config: EntropicConfig, parser: argparse.ArgumentParser
) -> tuple[list[str], EntropicConfig]:
    """The flags pruning sets or refuses (server_args.pruning_args); a refusal exits with code 2. Decode CUDA
    graphs stay on (dense steps replay them, pruned ones run eager); prefill graphs go on CUDA (docs/gpu.md)."""
    try:
        config, updates = pruning_args(config, _given(rest, PRUNING_FIELDS), _device(rest), spell_flag)
    except ValueError as err:
        parser.error(str(err))
    if not config.pruning.engaged:  # pruning_args: mode full on CUDA, where the crossover rule never prunes
        print(
            "sgl-entropic: pruning does not engage on CUDA with the two-stage selection (docs/gpu.md); SGLang's "
            "attention backend, prefill CUDA graphs and KV pool stay as stock has them",
            file=sys.stderr,
        )
    return rest + _as_flags(updates), config


def map_speculative_flags(
    rest: list[str], config: EntropicConfig, parser: argparse.ArgumentParser
) -> tuple[list[str], EntropicConfig]:
    """SGLang's speculative flags under the plugin (server_args.speculative_args); a refusal exits with code 2."""
    try:
        config, updates = speculative_args(config, _given(rest, SPECULATIVE_FIELDS), _device(rest), spell_flag)
    except ValueError as err:
        parser.error(str(err))
    if config.speculative.source is not None:
        print(f"sgl-entropic: speculative decoding {config.speculative.source}", file=sys.stderr)
    return rest + _as_flags(updates), config


def _device(argv: list[str]) -> str:
    device = _flag_value(argv, "--device")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: list[str], flag: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def sglang_argv(rest: list[str]) -> list[str]:
    """Fill in the bundled model and the device; never override what the user passed."""
    argv = list(rest)
    if not _has_flag(argv, "--model-path"):
        from sgl_entropic.model import prepare_bundled_model

        argv += ["--model-path", str(prepare_bundled_model())]
        for name, value in BUNDLED_MODEL_DEFAULTS.items():
            if not _has_flag(argv, name):
                argv += [name, value]
    if not _has_flag(argv, "--device") and _device(argv) == "cpu":
        argv += ["--device", "cpu"]
    return argv


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if "-h" in argv or "--help" in argv:  # no model needed to read the flags
        parser.print_help()
        print("\nSGLang's own flags follow.\n")
        from sglang.srt.server_args import ServerArgs

        sglang_parser = argparse.ArgumentParser(prog="sglang.launch_server")
        ServerArgs.add_cli_args(sglang_parser)
        sglang_parser.print_help()
        sys.exit(0)
    own, rest = parser.parse_known_args(argv)
    config = build_config(own.entropic, own.entropic_config, parser)
    check_sglang_version(parser)
    rest, config = map_schedule_policy(rest, config, parser)
    rest, config = map_pruning_flags(rest, config, parser)
    rest, config = map_speculative_flags(rest, config, parser)
    # Spawned SGLang processes inherit the environment: this is how the scheduler gets the config.
    os.environ[CONFIG_ENV] = config.to_env()

    rest = sglang_argv(rest)
    from sgl_entropic.cpu import apply_cpu_environment, bind_rank_threads

    apply_cpu_environment(_flag_value(rest, "--device") or "cuda")

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # before SGLang's argparse, so plugin-registered choices are accepted
    from sgl_entropic.plugin import hooks

    hooks.report_missing("main")  # each hook that did not apply is logged as an error, by target
    server_args = prepare_server_args(rest)
    try:
        bind_rank_threads(server_args.device, server_args.dp_size * server_args.tp_size * server_args.pp_size)
    except ValueError as err:
        parser.error(str(err))
    print(
        f"sgl-entropic: mode={config.mode} (active: {', '.join(config.active_loops)}), "
        f"model={server_args.model_path}, listening on http://{server_args.host}:{server_args.port}",
        flush=True,
    )
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
