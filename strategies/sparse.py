"""Sparse 2D parallelism: torchrec embedding modules sharded inside a sharding group, replicated across groups.

Plain functions over a model and the sparse view of the mesh (see ``mesh.py`` for the rank layout):

* :func:`make_sharders` - torchrec sharders for ``EmbeddingCollection`` / ``EmbeddingBagCollection`` with
  a fused embedding optimizer, offering row-wise sharding on CPU too, never data-parallel (a table
  placed data-parallel would be trained by the dense optimizer, which the strategy does not give it);
* :func:`plan_sharding` - torchrec's planner for one sharding group, the same plan on every rank,
  re-addressed to this rank's group;
* :func:`shard_embeddings` - shards every torchrec embedding module of a model in place and says how the
  replicas are kept equal (``replication.py`` picks the way): on CUDA with torchrec's ``DMPCollection``
  (its ``sync()`` after each step, or its ``FULLY_SHARDED`` strategy on request); on any device with
  ``DistributedModelParallel`` over a ``ShardingEnv2D`` (torchrec's 2D environment) and :class:`ReplicaSync`,
  the same layout and the same weight + optimizer-state average as ``DMPCollection.sync``.

Gradient convention: every rank's loss is its batch mean. torchrec divides the embedding gradients
arriving through its all-to-all by the sharding group size (``comm_ops`` gradient division, on by
default and required here), so a group's update follows the mean gradient of its ranks; averaging the
replicas after each step then gives the mean over the global batch (exactly so with SGD; with stateful
optimizers the replica average of weights and optimizer states is torchrec's 2D semantics). The dense
side matches it: FSDP2 averages over the data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .mesh import MeshLayout
from .replication import (
    SparseReplication,
    choose_replication,
    embedding_kernels,
    gather_tables_before_forward,
    shard_with_collection,
)

log = logging.getLogger(__name__)

__all__ = [
    "COMM_PRECISIONS",
    "EmbeddingOptimizerConfig",
    "ReplicaSync",
    "SparseShardingResult",
    "TableConstraint",
    "check_comm_precision",
    "comm_codecs",
    "embedding_module_paths",
    "fused_optimizer",
    "local_shards",
    "make_sharders",
    "plan_sharding",
    "shard_embeddings",
    "sparse_parameter_ids",
    "table_names",
]

# The planner's default choices. Not table-column-wise: torchrec (1.6) cannot build the state of a rank holding
# no shard of such a table (it has no global shape for that sharding type); a constraint can still ask for it.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")
EC_TYPES = ("table_wise", "row_wise", "column_wise")  # what torchrec's sharded EmbeddingCollection implements
EmbeddingOptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]


@dataclass(frozen=True, kw_only=True)
class TableConstraint:
    """Planner constraints of one embedding table (torchrec's ``ParameterConstraints``, typed)."""

    sharding_types: tuple[str, ...] | None = None
    """Sharding types the planner may pick for the table, from ``table_wise``, ``row_wise``,
    ``column_wise``, ``table_row_wise``, ``table_column_wise``; None: any of them."""
    min_partition: int | None = None
    """Smallest column-wise shard width."""

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            if not self.sharding_types:
                raise ValueError("`sharding_types` must name at least one sharding type (or be None)")
            bad = [t for t in self.sharding_types if t not in SHARDING_TYPES]
            if bad:
                raise ValueError(f"`sharding_types` must be among {SHARDING_TYPES}, got {bad}")
        if self.min_partition is not None and self.min_partition < 1:
            raise ValueError(f"`min_partition` must be >= 1, got {self.min_partition}")


@dataclass(frozen=True, kw_only=True)
class EmbeddingOptimizerConfig:
    """The fused optimizer torchrec runs inside the embedding backward."""

    name: EmbeddingOptimizerName = "rowwise_adagrad"
    """``sgd``, ``adagrad``, ``rowwise_adagrad`` (one accumulator per row, torchrec's usual choice) or
    ``adam`` (CUDA only: fbgemm's CPU kernels offer the other three)."""
    lr: float = 1e-3
    """Learning rate."""
    eps: float = 1e-8
    """Epsilon of the adaptive optimizers."""
    weight_decay: float = 0.0
    """L2 weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decays."""

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            raise ValueError(f"`embedding_optimizer` must be sgd, adagrad, rowwise_adagrad or adam, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"`embedding_lr` must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"`embedding_weight_decay` must be >= 0, got {self.weight_decay}")

    def check_device(self, device: torch.device) -> None:
        """Raise if fbgemm has no kernel of this optimizer on ``device``."""
        if self.name == "adam" and device.type != "cuda":
            raise ValueError(
                f"`embedding_optimizer='adam'` runs on CUDA only; on {device.type} fbgemm offers sgd, adagrad "
                "and rowwise_adagrad"
            )

    def fused_params(self) -> dict[str, Any]:
        """torchrec ``fused_params`` of the sharders."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim

        optimizer = {
            "sgd": FbgemmOptim.EXACT_SGD,
            "adagrad": FbgemmOptim.EXACT_ADAGRAD,
            "rowwise_adagrad": FbgemmOptim.EXACT_ROWWISE_ADAGRAD,
            "adam": FbgemmOptim.ADAM,
        }[self.name]
        params: dict[str, Any] = {"optimizer": optimizer, "learning_rate": self.lr}
        if self.name != "sgd":
            params["eps"] = self.eps
            params["weight_decay"] = self.weight_decay
        if self.name == "adam":
            params["beta1"], params["beta2"] = self.betas
        return params


def _embedding_types() -> tuple[type, ...]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return (EmbeddingCollection, EmbeddingBagCollection)


def embedding_module_paths(module: nn.Module) -> list[str]:
    """Qualified names of the (unsharded) torchrec embedding modules of ``module``, outermost first."""
    types = _embedding_types()
    return [name for name, sub in module.named_modules() if isinstance(sub, types)]


COMM_PRECISIONS = ("fp32", "bf16", "fp16")


def check_comm_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`COMM_PRECISIONS`.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in COMM_PRECISIONS:
        raise ValueError(f"`embedding_comm_precision` must be one of {COMM_PRECISIONS}, got {precision!r}")
    return precision


def comm_codecs(precision: str) -> dict[str, Any] | None:
    """torchrec's quantized-comms codecs sending the embeddings' all-to-alls and reduce-scatters (forward and
    backward) in ``precision``: ``"bf16"`` or ``"fp16"`` halve their bytes; ``"fp32"``: None (no codec).

    Raises:
        ValueError: an unknown precision.
    """
    if check_comm_precision(precision) == "fp32":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    kind = CommType.BF16 if precision == "bf16" else CommType.FP16
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=kind, backward_precision=kind))


def make_sharders(device_type: str, optimizer: EmbeddingOptimizerConfig, comm_precision: str = "fp32") -> list[Any]:
    """Sharders of both torchrec collections with ``optimizer`` fused into the embedding backward.

    They offer every sharding type the collection implements (``EmbeddingCollection``: table-, row- and
    column-wise; ``EmbeddingBagCollection``: also table-row- and table-column-wise) on every device
    (torchrec lists row-wise for CUDA only, yet it runs over gloo) and never data-parallel. With
    ``comm_precision`` ``"bf16"`` / ``"fp16"`` their embedding collectives send that precision
    (:func:`comm_codecs`).
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    def _offering(types: tuple[str, ...]) -> Any:
        return lambda self, compute_device_type: list(types)

    fused = optimizer.fused_params()
    ec = type("GEMEmbeddingCollectionSharder", (EmbeddingCollectionSharder,), {"sharding_types": _offering(EC_TYPES)})
    ebc = type(
        "GEMEmbeddingBagCollectionSharder",
        (EmbeddingBagCollectionSharder,),
        {"sharding_types": _offering(SHARDING_TYPES)},
    )
    codecs = comm_codecs(comm_precision)
    return [
        ec(fused_params=dict(fused), qcomm_codecs_registry=codecs),
        ebc(fused_params=dict(fused), qcomm_codecs_registry=codecs),
    ]


def _configs(collection: nn.Module) -> list[Any]:
    if hasattr(collection, "embedding_configs"):
        return list(collection.embedding_configs())
    return list(collection.embedding_bag_configs())


def table_names(module: nn.Module) -> list[str]:
    """The names of every embedding table of ``module``'s torchrec embedding modules."""
    return [c.name for sub in module.modules() if isinstance(sub, _embedding_types()) for c in _configs(sub)]


def plan_sharding(
    module: nn.Module,
    layout: MeshLayout,
    rank: int,
    device: torch.device,
    sharders: list[Any],
    constraints: Mapping[str, TableConstraint] | None = None,
    node_group_size: int | None = None,
    local_world_size: int | None = None,
    *,
    group_local: bool = False,
) -> Any:
    """torchrec's sharding plan for one sharding group, addressed to the global ranks of ``rank``'s group
    (and their devices: ``local_world_size`` processes of one device each per host).

    The planner runs on rank 0 for a world of ``sparse_group_size`` ranks and is broadcast (every group
    gets the same plan, so replicas hold identical shards); its rank ``j`` is then rank
    ``group * sparse_group_size + j``. ``group_local=True`` leaves it on ranks ``0 .. sparse_group_size - 1``
    (``DMPCollection`` re-addresses the plan itself: shifting it here too would move it twice).

    Raises:
        ValueError: a constraint names a table the model does not have.
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    tables = table_names(module)
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - set(tables))
    if unknown:
        raise ValueError(f"`table_constraints` name tables {unknown} the model does not have (it has {tables})")
    planner_constraints = {}
    for table in tables:
        given = constraints.get(table, TableConstraint())
        planner_constraints[table] = ParameterConstraints(
            sharding_types=list(given.sharding_types or SHARDING_TYPES),
            compute_kernels=["fused"],
            min_partition=given.min_partition,
        )
    size = layout.sparse_group_size
    topology = Topology(world_size=size, local_world_size=node_group_size or size, compute_device=device.type)
    enumerator = _ordered_enumerator(topology, planner_constraints)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=planner_constraints, enumerator=enumerator)
    plan = planner.collective_plan(module, sharders, dist.group.WORLD) if dist.is_initialized() else None
    if plan is None:
        plan = planner.plan(module, sharders)
    if not group_local:
        offset = (rank // size) * size
        _readdress_plan(plan, offset=offset, device_type=device.type, local_world_size=local_world_size)
    return plan


def _ordered_enumerator(topology: Any, constraints: dict[str, Any]) -> Any:
    """torchrec's ``EmbeddingEnumerator`` that lists each table's sharding types in the constraints' order.

    torchrec intersects the allowed and the constrained types as sets, whose order follows the process's
    ``PYTHONHASHSEED``, and its proposer keeps that order among equally cheap options: the same job planned
    ``table_wise`` in one process and ``column_wise`` in the next, so a resumed run met a checkpoint of another
    embedding plan (whose optimizer state torchrec cannot reshard).
    """
    from torchrec.distributed.planner.constants import BATCH_SIZE
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    class _OrderedEnumerator(EmbeddingEnumerator):
        def _filter_sharding_types(self, name: str, allowed_sharding_types: list[str], sharder_key: str = "") -> Any:
            filtered = super()._filter_sharding_types(name, allowed_sharding_types, sharder_key)
            order = list(getattr(constraints.get(name), "sharding_types", None) or allowed_sharding_types)
            return sorted(filtered, key=lambda t: (order.index(t) if t in order else len(order), t))

    return _OrderedEnumerator(topology=topology, batch_size=BATCH_SIZE, constraints=constraints)


def _readdress_plan(plan: Any, offset: int, device_type: str, local_world_size: int | None = None) -> None:
    """Shift every rank of ``plan`` by ``offset`` (group-local ranks to global ranks), in place; a shard placed
    on an indexed device moves to its new rank's device, ``rank % local_world_size`` (one device a process)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torch.distributed.remote_device import _remote_device

    if offset == 0:
        return
    for module_plan in plan.plan.values():
        for param_sharding in module_plan.values():
            param_sharding.ranks = [r + offset for r in param_sharding.ranks]
            spec = param_sharding.sharding_spec
            if isinstance(spec, EnumerableShardingSpec):
                for shard in spec.shards:
                    moved = shard.placement.rank() + offset
                    index = shard.placement.device().index
                    if index is not None and local_world_size:
                        index = moved % local_world_size
                    device = device_type if index is None else f"{device_type}:{index}"
                    shard.placement = _remote_device(f"rank:{moved}/{device}")


def describe_plan(plan: Any, group_size: int) -> dict[str, str]:
    """``{"module.table": "sharding_type on group ranks [...]"}``: the plan in sharding-group-local ranks,
    the same on every rank (every group gets the same plan), for logs and checkpoint metadata."""
    out = {}
    for path, module_plan in sorted(plan.plan.items()):
        for table, param_sharding in sorted(module_plan.items()):
            ranks = [r % group_size for r in param_sharding.ranks]
            out[f"{path}.{table}"] = f"{param_sharding.sharding_type} on group ranks {ranks}"
    return out


@dataclass
class SparseShardingResult:
    """What :func:`shard_embeddings` did: the plan, the modules it replaced and how replicas are kept equal."""

    plan: Any
    paths: list[str]
    replica_sync: Callable[[], None] | None
    """Run after each optimizer step (collective over the replica groups); None without replicas to sync."""
    features: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    """The feature names (KJT keys) each sharded module looks up."""
    replication: str = "replica_sync"
    """``"collection"``, ``"fully_sharded"`` (torchrec's ``DMPCollection``) or ``"replica_sync"``."""
    collection: Any = None
    """The ``DMPCollection`` that sharded the modules (wrapping the model; not a submodule of it), or None."""


def shard_embeddings(
    module: nn.Module,
    layout: MeshLayout,
    sparse_mesh: Any,
    device: torch.device,
    optimizer: EmbeddingOptimizerConfig,
    constraints: Mapping[str, TableConstraint] | None = None,
    local_world_size: int | None = None,
    replication: SparseReplication = "auto",
    comm_precision: str = "fp32",
) -> SparseShardingResult:
    """Shard every torchrec embedding module of ``module`` in place (2D: sharded in a group, replicated across).

    Must run before the optimizers are built: the modules are replaced by torchrec's sharded ones,
    whose fused optimizer (:func:`fused_optimizer`) updates the tables inside the backward.

    Args:
        module: the model (its other parts are untouched).
        layout: the mesh sizes.
        sparse_mesh: the ``("sparse_replicate", "sparse_shard")`` view of the device mesh.
        device: this rank's device.
        optimizer: the fused embedding optimizer.
        constraints: per-table planner constraints (table name -> :class:`TableConstraint`).
        local_world_size: processes (one device each) per host.
        replication: how replicas are kept equal (see ``replication.py``): ``"auto"``, ``"collection"``,
            ``"fully_sharded"`` or ``"replica_sync"``.
        comm_precision: the precision the embedding collectives send (:func:`comm_codecs`).

    Raises:
        ValueError: torchrec's gradient division is off; ``replication`` names a way that cannot run here.
    """
    from torchrec.distributed.comm_ops import get_gradient_division

    if not get_gradient_division():
        raise ValueError(
            "torchrec's gradient division is off (torchrec.distributed.comm_ops.set_gradient_division(False)): "
            "gem5d needs it on so that embedding gradients are the mean over the sharding group"
        )
    paths = embedding_module_paths(module)
    if not paths:
        return SparseShardingResult(plan=None, paths=[], replica_sync=None)
    optimizer.check_device(device)
    choice = choose_replication(
        replication,
        device_type=device.type,
        layout=layout,
        optimizer=optimizer.name,
        local_world_size=local_world_size,
    )
    by_collection = choice.mode != "replica_sync"
    sharders = make_sharders(device.type, optimizer, comm_precision)
    rank = dist.get_rank()
    node_group_size = math.gcd(layout.sparse_group_size, local_world_size or layout.sparse_group_size)
    plan = plan_sharding(
        module,
        layout,
        rank,
        device,
        sharders,
        constraints,
        node_group_size,
        local_world_size,
        group_local=by_collection,
    )
    # The sharded modules get fresh tables (EmbeddingBagCollection's are re-initialised): keep the model's.
    initial = {path: module.get_submodule(path).state_dict() for path in paths}
    features = {
        path: frozenset(f for c in _configs(module.get_submodule(path)) for f in c.feature_names) for path in paths
    }
    collection = None
    if by_collection:
        collection = shard_with_collection(
            module,
            layout,
            plan,
            device,
            sharders,
            node_group_size=node_group_size,
            fully_sharded=choice.mode == "fully_sharded",
        )
    else:
        _shard_with_env(module, layout, sparse_mesh, device, plan, sharders, node_group_size)
    for path, state in initial.items():
        copy_full_into_shards(module.get_submodule(path), state)
    replica_group = sparse_mesh.get_group("sparse_replicate")
    sync: Callable[[], None] | None = None
    if layout.sparse_replicas > 1:
        if choice.mode == "collection":
            sync = collection.sync
        elif choice.mode == "fully_sharded":  # the tables are averaged in the forward; their optimizer states here
            sync = ReplicaSync(module, replica_group, weights=False)
        else:
            sync = ReplicaSync(module, replica_group)
    if choice.mode == "fully_sharded":
        if not gather_tables_before_forward(module):
            kernels = sorted({type(m).__name__ for m in embedding_kernels(module) if "Embedding" in type(m).__name__})
            compute = sorted({str(ps.compute_kernel) for mp in plan.plan.values() for ps in mp.values()})
            raise RuntimeError(
                f"sparse_replication='fully_sharded': torchrec built no fully sharded embedding kernel on rank {rank} "
                f"(its embedding modules: {kernels}; compute kernels {compute}; plan: "
                f"{describe_plan(plan, layout.sparse_group_size)})"
            )
    if rank == 0:
        log.info("gem5d embedding replicas: %s (%s)", choice.mode, choice.reason)
        log.info("gem5d embedding plan (%s): %s", layout.describe(), describe_plan(plan, layout.sparse_group_size))
    return SparseShardingResult(
        plan=plan,
        paths=paths,
        replica_sync=sync,
        features=features,
        replication=choice.mode,
        collection=collection,
    )


def _shard_with_env(
    module: nn.Module,
    layout: MeshLayout,
    sparse_mesh: Any,
    device: torch.device,
    plan: Any,
    sharders: list[Any],
    node_group_size: int,
) -> None:
    """Shard in place with ``DistributedModelParallel`` over a ``ShardingEnv2D`` of the sparse mesh (any device)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv2D

    env_kwargs: dict[str, Any] = {"node_group_size": node_group_size, "use_inter_host_allreduce": True}
    accepted = inspect.signature(ShardingEnv2D).parameters
    if "use_inter_host_allreduce" not in accepted and layout.sparse_replicas > 1 and layout.sparse_group_size > 1:
        raise ValueError(
            "this torchrec has no contiguous sharding groups (ShardingEnv2D(use_inter_host_allreduce=...)): "
            "use sparse_group_size 1 or the world size, or a newer torchrec"
        )
    env = ShardingEnv2D(
        sharding_pg=sparse_mesh.get_group("sparse_shard"),
        replica_pg=sparse_mesh.get_group("sparse_replicate"),
        global_pg=dist.group.WORLD,
        device_mesh=sparse_mesh,
        **{k: v for k, v in env_kwargs.items() if k in accepted},  # contiguous sharding groups (mesh.py)
    )
    DistributedModelParallel(
        module, env=env, device=device, plan=plan, sharders=sharders, init_data_parallel=False, init_parameters=True
    )


def local_shards(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(local shard, its offset in the full table)`` of a sharded state-dict entry (DTensor or ShardedTensor)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if hasattr(local, "local_shards"):  # torchrec's LocalShardsWrapper
            shards = local.local_shards()  # none on a rank without a shard (its offsets then list a dummy)
            offsets = local.local_offsets()[: len(shards)]
            return [(shard, tuple(offset)) for shard, offset in zip(shards, offsets, strict=True)]
        raise TypeError("expected a torchrec sharded table (a DTensor over LocalShardsWrapper)")
    return [(value, (0,) * value.dim())]


@torch.no_grad()
def copy_full_into_shards(sharded: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Write the full tables ``full_state`` (an unsharded collection's state dict) into ``sharded``'s local shards."""
    for name, value in sharded.state_dict().items():
        full = full_state[name]
        for shard, offset in local_shards(value):
            index = tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))
            shard.copy_(full[index])


def _sharded_modules(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    from torchrec.distributed.types import ShardedModule

    for name, sub in module.named_modules():
        if isinstance(sub, ShardedModule):
            yield name, sub


def fused_optimizer(module: nn.Module) -> Any:
    """torchrec's ``CombinedOptimizer`` over the fused optimizers of the sharded modules of ``module`` (or None)."""
    from torchrec.optim.keyed import CombinedOptimizer

    parts = [(name, sub.fused_optimizer) for name, sub in _sharded_modules(module) if hasattr(sub, "fused_optimizer")]
    return CombinedOptimizer(parts) if parts else None


def sparse_parameter_ids(module: nn.Module) -> set[int]:
    """``id`` of every parameter owned by a sharded torchrec module (trained by the fused optimizer)."""
    return {id(p) for _, sub in _sharded_modules(module) for p in sub.parameters()}


def local_state_tensors(module: nn.Module, *, weights: bool = True) -> list[torch.Tensor]:
    """This rank's part of every table (``weights=False``: left out) and of its fused optimizer state: views of
    the kernels' storage, updated in place by the backward."""
    tensors: list[torch.Tensor] = []
    for _, sharded in _sharded_modules(module):
        if weights:
            for value in sharded.state_dict().values():
                tensors.extend(shard for shard, _ in local_shards(value))
        optimizer = getattr(sharded, "fused_optimizer", None)
        if optimizer is not None:
            for state in optimizer.state_dict()["state"].values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        tensors.extend(shard for shard, _ in local_shards(value))
    return [t for t in tensors if t.numel()]


class ReplicaSync:
    """Averages the embedding weights and fused-optimizer states of each shard over its replica group.

    The all-reduce torchrec's ``DMPCollection.sync`` runs, here over the local shards of the sharded
    modules' state dicts and of their fused optimizers' states (views of the embedding kernels' storage),
    so it also runs on CPU/gloo where ``DMPCollection`` is not available. ``weights=False``: the optimizer
    states only (under ``DMPCollection``'s fully sharded strategy, which averages the tables itself).
    """

    def __init__(self, module: nn.Module, replica_group: dist.ProcessGroup, *, weights: bool = True) -> None:
        self.group = replica_group
        self.size = dist.get_world_size(replica_group)
        self.tensors = local_state_tensors(module, weights=weights)

    @torch.no_grad()
    def __call__(self) -> None:
        """Average every tensor over the replica group (one all-reduce per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat, group=self.group)  # SUM: gloo has no AVG
            flat /= self.size
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
