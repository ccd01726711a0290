"""Activation checkpointing: recompute the cheapest set of blocks that fits a memory budget.

- :mod:`~lightning_gem.strategies.activation_checkpointing.measure`: one training step's memory and, per
  candidate block, what its forward saves and costs (:func:`measure_step_memory`, :class:`CandidateStats`).
- :mod:`~lightning_gem.strategies.activation_checkpointing.planner`: the peak model and the knapsack over
  those measurements (:func:`plan_activation_checkpointing`), the checkpoint regions applied in place
  (:func:`apply_activation_checkpointing`) and the compiler's budget (:func:`compile_memory_budget`).
- :mod:`~lightning_gem.strategies.activation_checkpointing.training_step`: gem5d's glue, planning on a
  LightningModule's real training step with the same plan on every rank (:func:`plan_on_training_step`).
"""

from lightning_gem.strategies.activation_checkpointing.measure import CandidateStats, StepMemory, measure_step_memory
from lightning_gem.strategies.activation_checkpointing.planner import (
    ActivationCheckpointPlan,
    apply_activation_checkpointing,
    checkpointed_modules,
    compile_memory_budget,
    default_checkpoint_candidates,
    plan_activation_checkpointing,
    remove_activation_checkpointing,
)
from lightning_gem.strategies.activation_checkpointing.training_step import plan_on_training_step, traceless_step

__all__ = [
    "ActivationCheckpointPlan",
    "CandidateStats",
    "StepMemory",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "compile_memory_budget",
    "default_checkpoint_candidates",
    "measure_step_memory",
    "plan_activation_checkpointing",
    "plan_on_training_step",
    "remove_activation_checkpointing",
    "traceless_step",
]
