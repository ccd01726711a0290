"""Activation checkpointing for gem5d: plan it on a real training step, the same plan on every rank.

Glue between the strategy and :mod:`~lightning_gem.strategies.activation_checkpointing.planner`. The planner
runs the step several times; :func:`traceless_step` makes those runs leave the model as it found it:
the fused embedding optimizer updates the tables inside the backward, so the tables and their optimizer
state are restored afterwards, gradients are dropped and the RNG state is put back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["plan_on_training_step", "traceless_step"]


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    kind = type(output).__name__
    raise TypeError(f"training_step must return a loss tensor or a dict with 'loss' to plan checkpointing, got {kind}")


@contextlib.contextmanager
def traceless_step(module: nn.Module, state: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside: steps may run freely; on exit ``state`` (tensors updated in place, e.g. the tables), the RNG
    and the gradients are as they were on entry (gradients: dropped)."""
    saved = [t.detach().clone() for t in state]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, copy in zip(state, saved, strict=True):
                tensor.copy_(copy)
        module.zero_grad(set_to_none=True)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def plan_on_training_step(
    module: Any,
    batch: Any,
    budget: int | float,
    state: Sequence[torch.Tensor],
    *,
    candidates: Sequence[str] | None = None,
) -> Any:
    """Plan activation checkpointing of ``module`` (a LightningModule) on ``training_step(batch, 0)`` + backward.

    Every rank measures (the step may run collectives), rank 0's plan is broadcast and applied on every
    rank, so recomputation (and any collective it triggers) is the same everywhere.

    Args:
        module: the model, on its device, before FSDP2 is applied.
        batch: one training batch on the device.
        budget: bytes, or a fraction in ``(0, 1]`` of the measured unconstrained peak.
        state: tensors the step updates in place (embedding tables and their optimizer state), restored after.
        candidates: submodules that may be checkpointed; default: the planner's.

    Returns:
        The applied :class:`~lightning_gem.strategies.activation_checkpointing.ActivationCheckpointPlan`.
    """
    from .planner import apply_activation_checkpointing, plan_activation_checkpointing

    trainer = getattr(module, "_trainer", None)

    def run_step() -> None:
        module.zero_grad(set_to_none=True)
        _loss_of(module.training_step(batch, 0)).backward()

    with traceless_step(module, state), warnings.catch_warnings():
        # Outside Lightning's loop `self.log` has nowhere to go: detach the Trainer so it only warns.
        warnings.simplefilter("ignore")
        module._trainer = None
        try:
            plan = plan_activation_checkpointing(module, run_step, budget, candidates=candidates)
        finally:
            module._trainer = trainer
    plan = _broadcast(plan)
    apply_activation_checkpointing(module, plan)
    return plan


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
