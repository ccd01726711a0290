"""The 5D parallelization of a model, in one function over the meshes, knowing nothing of the Trainer.

:func:`parallelize_model` shards the embeddings (``sparse.py``), moves the rest to the device, lets the
caller checkpoint activations (``before_dense``), applies tensor parallelism and FSDP2 (``dense.py``; not
where there is nothing to shard: one process, or only data parallelism, whose dense parameters stay plain
tensors averaged in one all-reduce), in that order, and returns :class:`ParallelModel`: what the training
step needs afterwards (the fused embedding optimizer, the gradient reductions to run before each optimizer
step, the replica sync to run after it, the prefetcher of the train pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import dense, sparse
from .mesh import MeshLayout
from .replication import SparseReplication

__all__ = ["ParallelModel", "compile_components", "parallelize_model"]

_ATTRIBUTE = "_gem5d_parallel"  # on the model: what parallelize_model did to it


@dataclass
class ParallelModel:
    """The state a parallelized model trains with (see :func:`parallelize_model`)."""

    layout: MeshLayout
    sparse: sparse.SparseShardingResult
    embedding_optimizer: Any
    """torchrec's combined fused optimizer of the tables (None without tables)."""
    replicated_grads: dense.ReplicatedGradients
    tensor_parallel_grads: dense.TensorParallelGradients | None
    prefetcher: Any
    """The train pipeline's :class:`~lightning_gem.strategies.pipeline.SparseDistPrefetcher`, or None."""

    def reduce_gradients(self) -> None:
        """After the last backward before an optimizer step: the gradients FSDP2 does not reduce."""
        if self.tensor_parallel_grads is not None:
            self.tensor_parallel_grads()
        self.replicated_grads()

    def after_step(self) -> None:
        """After an optimizer step: average the embedding replicas (2D: ``DMPCollection.sync`` or ``ReplicaSync``)."""
        if self.sparse.replica_sync is not None:
            self.sparse.replica_sync()

    def describe(self) -> dict[str, Any]:
        """The layout and the group-local embedding plan (checkpoint metadata: a resume needs the same)."""
        from dataclasses import asdict

        plan = self.sparse.plan
        return {
            "layout": asdict(self.layout),
            "plan": sparse.describe_plan(plan, self.layout.sparse_group_size) if plan is not None else {},
        }


def compile_components(module: nn.Module) -> list[str]:
    """Call ``compile_layers()`` of every submodule that declares it (e.g. the HSTU encoder, which compiles each of
    its layers in place with dynamic shapes, idempotently); returns those submodules' names.

    The components decide what a compiled unit is; this only chooses when (after activation checkpointing and
    tensor parallelism, before FSDP2), so the strategy imports no component.
    """
    names = [name for name, sub in module.named_modules() if callable(getattr(type(sub), "compile_layers", None))]
    for name in names:
        module.get_submodule(name).compile_layers()
    return names


def parallelize_model(
    module: nn.Module,
    layout: MeshLayout,
    dense_mesh: Any,
    sparse_mesh: Any,
    device: torch.device,
    *,
    embedding_optimizer: sparse.EmbeddingOptimizerConfig,
    table_constraints: Mapping[str, sparse.TableConstraint] | None = None,
    local_world_size: int | None = None,
    reshard_after_forward: bool = True,
    sequence_parallel: bool = False,
    train_pipeline: bool = False,
    compile_layers: bool = False,
    sparse_replication: SparseReplication = "auto",
    embedding_comm_precision: str = "fp32",
    move: Callable[[Any], Any] | None = None,
    before_dense: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """Parallelize ``module`` in place over the meshes of ``layout`` (see ``mesh.py``).

    Args:
        module: the model, built (unsharded) on any device.
        layout: the sizes; ``dense_mesh`` / ``sparse_mesh`` its views of the device mesh.
        device: this rank's device.
        embedding_optimizer: the fused optimizer of the tables.
        table_constraints: per-table planner constraints.
        local_world_size: ranks per machine (torchrec's node groups).
        reshard_after_forward: FSDP2's ZeRO-3 (True) or ZeRO-2 (False).
        sequence_parallel: under tensor parallelism, run the components that can shard their tokens on
            token shards (see ``dense.py``); no effect when ``layout.tensor_parallel == 1``.
        train_pipeline: start each batch's embedding input all-to-all one batch ahead (needs ``move``).
        compile_layers: ``torch.compile`` the components' layers (:func:`compile_components`) after tensor parallelism,
            before FSDP2.
        sparse_replication: how the embedding replicas are kept equal (``replication.py``).
        embedding_comm_precision: the precision of the embedding all-to-alls (``sparse.comm_codecs``).
        move: moves a batch to ``device`` (the train pipeline's prefetch).
        before_dense: called with the model once it is on the device with its tables sharded, before
            tensor parallelism and FSDP2 (where activation checkpointing is applied).

    A model is parallelized once: called again on it (``Trainer.test`` after ``fit``), this returns what
    the first call did, and raises ``ValueError`` if ``layout`` differs.
    """
    existing = getattr(module, _ATTRIBUTE, None)
    if existing is not None:  # Trainer.test/validate after fit, or a second fit: parallelized already
        if existing.layout != layout:
            raise ValueError(
                f"this model is parallelized for {existing.layout.describe()}; a model is parallelized once, so "
                f"for {layout.describe()} build a new one (GEM5DStrategy(weights_from=...) carries its weights)"
            )
        if existing.prefetcher is not None:
            existing.prefetcher.install()
        return existing
    sharded = sparse.shard_embeddings(
        module,
        layout,
        sparse_mesh,
        device,
        embedding_optimizer,
        table_constraints,
        local_world_size,
        replication=sparse_replication,
        comm_precision=embedding_comm_precision,
    )
    module.to(device)
    prefetcher = None
    if train_pipeline and sharded.paths:
        from .pipeline import SparseDistPrefetcher

        if move is None:
            raise ValueError("`train_pipeline` needs `move` (a function moving a batch to the device)")
        # High priority, as torchrec's pipeline streams: the side stream's small kernels (the ids' all-to-alls, whose
        # results the host waits for) go first when the compute stream's kernels free an SM.
        stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        prefetcher = SparseDistPrefetcher(module, sharded.features, move, stream)
    if before_dense is not None:
        before_dense(module)
    partial_grads: list[str] = []
    if layout.tensor_parallel > 1:
        partial_grads = dense.apply_tensor_parallel(
            module, dense_mesh["tensor_parallel"], sequence_parallel=sequence_parallel
        )
    if compile_layers:
        compile_components(module)
    # Gradients of the mean loss over the global batch: the mean over the data-parallel ranks (sparse.py).
    if layout.dense_shard == 1 and layout.tensor_parallel == 1:
        # Nothing to shard (pure data parallelism, or one process): the dense parameters stay plain tensors,
        # replicated, their gradients averaged in one all-reduce before each step (as DDP), without FSDP2's
        # per-unit gathers and hooks.
        tables = sparse.sparse_parameter_ids(module)
        replicated = [(name, p) for name, p in module.named_parameters() if id(p) not in tables]
    else:
        units, replicated = dense.dense_units(module)
        replicate = layout.dense_replicate > 1
        dp_mesh = dense_mesh["dense_replicate", "dense_shard"] if replicate else dense_mesh["dense_shard"]
        dense.apply_fsdp(
            units,
            dp_mesh,
            reshard_after_forward=reshard_after_forward,
            sum_reductions=dist.get_backend() == "gloo",
        )
    if layout.tensor_parallel == 1:
        dp_group = dist.group.WORLD
    else:
        dp_group = dense_mesh["dense_replicate", "dense_shard"]._flatten("data_parallel").get_group()
    tensor_parallel_grads = None
    if partial_grads:  # resolved after fully_shard, which replaces the parameters
        params = [module.get_parameter(name) for name in partial_grads]
        tensor_parallel_grads = dense.TensorParallelGradients(params, dense_mesh["tensor_parallel"].get_group())
    parallel = ParallelModel(
        layout=layout,
        sparse=sharded,
        embedding_optimizer=sparse.fused_optimizer(module),
        replicated_grads=dense.ReplicatedGradients([p for _, p in replicated], dp_group, float(layout.data_parallel)),
        tensor_parallel_grads=tensor_parallel_grads,
        prefetcher=prefetcher,
    )
    setattr(module, _ATTRIBUTE, parallel)
    return parallel
