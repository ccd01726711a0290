"""What the ops ask of a device on every call, read once per device. Importing this module loads nothing beyond
torch (``lightning_gem.ops._launch`` loads torch._dynamo and Triton, which ``import lightning_gem.ops`` must not)."""

from __future__ import annotations

import functools

import torch

__all__ = ["device_capability"]


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, read once per device: launchers and the FP8 GEMM's dispatch
    ask on every call."""
    return torch.cuda.get_device_capability(device)
