"""Host batches to the training device: through pinned memory when they go to a GPU."""

from __future__ import annotations

import torch


def pin_batches(device_type: str, pin_memory: bool, on_device: bool) -> bool:
    """Host batches are copied through pinned memory (so `non_blocking=True` really overlaps)
    when they go to a GPU from host memory and data.pin_memory is on."""
    return device_type == "cuda" and pin_memory and not on_device


def to_device(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory when `pin` (an asynchronous copy)."""
    if pin and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
