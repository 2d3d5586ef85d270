"""Hooks that prove themselves: registration through SGLang's HookRegistry, and a check that
each target really runs OUR handler.

SGLang's `apply_hooks` logs a failed target and goes on, and SGLang itself wraps some targets
with `functools.wraps` (e.g. `Scheduler.run_batch`), so "the target has a `__wrapped__`" proves
nothing. A hook counts as applied only if the target's wrapper chain holds a wrapper whose
closure is our handler (HookRegistry builds one such wrapper per registered handler).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Iterable, Literal

from sgl_entropic.plugin import runtime

logger = logging.getLogger("sgl_entropic")

Process = Literal["main", "scheduler", "dp_controller", "client"]


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path, as HookRegistry takes it
    kind: Literal["before", "after", "around"]
    handler: Callable
    process: Process = "client"  # where it acts: the check reports a process's own hooks


def register(hooks: Iterable[Hook]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in hooks:
        HookRegistry.register(hook.target, hook.handler, HookType(hook.kind))


def apply(hooks: Iterable[Hook]) -> None:
    """Register and apply now (outside load_plugins, e.g. the frontend's hooks in a client)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = tuple(hooks)
    register(hooks)
    HookRegistry.apply_hooks()
    for hook in hooks:
        if not is_applied(hook):
            logger.error("sgl-entropic: hook on %s did not apply; its feature is off in this process", hook.target)


def is_applied(hook: Hook) -> bool:
    """Whether `hook.target` currently runs `hook.handler` (somewhere in its wrapper chain)."""
    owner_path, attr = hook.target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
        fn = inspect.getattr_static(owner, attr)
    except (ImportError, AttributeError, ValueError):
        return False
    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
    seen = 0
    while fn is not None and seen < 64:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                ours = cell.cell_contents
                # our handler, or plugin.timing's wrapper around it (functools.wraps sets __wrapped__)
                if ours is hook.handler or getattr(ours, "__wrapped__", None) is hook.handler:
                    return True
            except ValueError:  # an empty cell
                continue
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def missing(hooks: Iterable[Hook], process: Process) -> list[str]:
    return [h.target for h in hooks if h.process == process and not is_applied(h)]


def report_missing(process: Process) -> list[str]:
    """The targets of this process's hooks that do not run our handler, each logged as an error."""
    rt = runtime.installed()
    targets = missing(rt.hooks, process) if rt is not None else []
    for target in targets:
        logger.error(
            "sgl-entropic: hook on %s is NOT applied in the %s process; the feature it carries is off", target, process
        )
    return targets


SUPPORTED_SGLANG = "0.5.23"


def installed_sglang_version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "not installed"
