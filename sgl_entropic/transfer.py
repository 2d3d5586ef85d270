"""Host lists onto the device, written once for the page planner and the sampling step."""

from __future__ import annotations

import torch


def to_device(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A host list on `device` without blocking: through pinned memory when the device is a GPU."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
