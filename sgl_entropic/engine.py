"""`sgl_entropic.Engine(...)`: an in-process `sgl.Engine` with entropic decoding.

    engine = sgl_entropic.Engine(entropic="full", entropic_config={"sampling": {...}})
    engine.generate("Hi", {"custom_params": {"entropic": {"target_entropy": 1.5}}}, return_entropy=True)

Without model_path it serves the bundled model with the launcher's CPU defaults.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from sgl_entropic.config import ATTENTION_BACKEND, CONFIG_ENV, EntropicConfig


def Engine(entropic: str = "full", entropic_config: Optional[dict[str, Any]] = None, **engine_kwargs: Any):
    """Validate our config (pydantic ValidationError on bad values), then start `sgl.Engine`."""
    config = EntropicConfig.model_validate({**(entropic_config or {}), "mode": entropic})
    # sgl.Engine loads plugins in this process and spawns the scheduler: both read the environment.
    os.environ[CONFIG_ENV] = config.to_env()
    if "model_path" not in engine_kwargs:
        from sgl_entropic.model import prepare_bundled_model

        engine_kwargs = {"model_path": str(prepare_bundled_model()), "dtype": "bfloat16",
                         "max_total_tokens": 65536, **engine_kwargs}
    if "device" not in engine_kwargs:
        import torch

        if not torch.cuda.is_available():
            engine_kwargs["device"] = "cpu"
    if config.pruning_on:
        chosen = engine_kwargs.setdefault("attention_backend", ATTENTION_BACKEND)
        if chosen != ATTENTION_BACKEND:
            raise ValueError(f"entropic={entropic!r} prunes attention in the {ATTENTION_BACKEND!r} backend, "
                             f"not {chosen!r}")
        engine_kwargs.setdefault("disable_cuda_graph", True)  # the decode plan changes every step
    from sgl_entropic.cpu import apply_cpu_environment

    apply_cpu_environment(engine_kwargs.get("device", "cuda"))
    import sglang as sgl

    return sgl.Engine(**engine_kwargs)
