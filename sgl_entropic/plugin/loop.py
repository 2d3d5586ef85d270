"""The scheduler loop's step boundaries, in the scheduler process: where a step opens and where its forward ends.

A step (`step.Step`) opens when SGLang picks the next batch and takes its number when that batch runs; it
is closed where SGLang processes the batch's result (`signal/traces.py`). The plugin's clock (`timing.py`)
counts its own time per loop iteration from the same boundary.
"""

from __future__ import annotations

from sgl_entropic.plugin import runtime


def before_get_next_batch_to_run(scheduler, running_batch=None, last_batch=None, *args, **kwargs):
    """The iteration that ends ran `last_batch` (None: it was idle); the next step opens."""
    rt = runtime.current()
    counted = rt.times.boundary(last_batch is not None and last_batch.forward_mode.is_decode())
    if counted is not None and rt.metrics is not None:
        rt.metrics.observe_plugin_step(*counted)
    rt.steps.begin()


def after_run_batch(result, scheduler, batch, *args, **kwargs):
    """The step's forward is over (its result is processed later: at once, or after the next step's launch)."""
    rt = runtime.current()
    if not rt.steps.ran(getattr(batch, "forward_iter", None)):
        rt.fault("the step's number (a step closed by another batch)")
    return result
