"""How the replicas of each embedding shard are kept equal (sparse 2D): torchrec's ``DMPCollection`` on CUDA,
``DistributedModelParallel`` over a ``ShardingEnv2D`` with :class:`~lightning_gem.strategies.sparse.ReplicaSync`
on any device.

Modes (``GEM5DStrategy(sparse_replication=...)``, :data:`SparseReplication`):

* ``"collection"``: torchrec's ``DMPCollection`` (``ShardingStrategy.DEFAULT``) shards the embedding modules in
  place and its ``sync()`` averages the tables and their fused-optimizer states over each replica group after
  every optimizer step. CUDA only (``DMPCollection`` asserts a CUDA device).
* ``"fully_sharded"``: ``DMPCollection`` with ``ShardingStrategy.FULLY_SHARDED``: between a training forward and
  its backward each replica holds ``1 / sparse_replicas`` of its tables (the forward reduce-scatters them,
  averaged, over the replica group; the backward all-gathers them before the fused update), so each step's
  update starts from the replicas' average, while the forward reads the tables as this replica's own last
  update left them (that average plus its own step). ``DMPCollection.sync`` is not called (torchrec's usage
  for this strategy); the fused-optimizer states, which the reduce-scatter does not touch, are averaged by
  ``ReplicaSync`` after each step. After a forward without grad (evaluation), which no backward follows, the
  tables are gathered before the next forward and when the evaluation ends (gem5d evaluates under
  ``torch.no_grad``, see :func:`evaluate_without_inference_mode`). Every training forward must be followed by a
  backward through the tables. A checkpoint written between training steps holds one replica's tables (the
  replicas differ by their last step); after an evaluation they are equal.
* ``"replica_sync"``: ``DistributedModelParallel`` over a ``ShardingEnv2D`` and ``ReplicaSync``, on any device.
* ``"auto"``: ``"collection"`` where :func:`choose_replication` finds nothing against it (CUDA, a torchrec with
  ``DMPCollection``, an optimizer whose state it syncs, the devices torchrec will place shards on), else
  ``"replica_sync"``, with the reason logged.

Rank layout: ``DMPCollection(use_inter_host_allreduce=True)`` builds the 2D mesh from the peer matrix
``[[0 .. S-1], [S .. 2S-1], ...]`` (``S = sparse_group_size``): its ``"shard"`` axis (rows) is the sharding
group ``rank // S`` and its ``"replicate"`` axis (columns) the replica group ``{j, j + S, ...}``, the layout of
``mesh.py``; :func:`shard_with_collection` checks the built mesh against ``mesh.sharding_group_ranks``. Without
that flag (or in torchrec versions lacking it) the groups are strided (``[j, j + W/S, ...]``), which equals ours
only for ``S = 1`` or ``S = W``.

Plan: ``DMPCollection`` takes the plan of one sharding group (group-local ranks ``0 .. S-1``, what
``sparse.plan_sharding(..., group_local=True)`` returns) and re-addresses it to this rank's group itself
(``_remap_sharding_plan``: rank ``r`` -> ``r + (rank // S) * S``, placement device ``cuda:(rank % local size)``
with torchrec's local size from ``LOCAL_WORLD_SIZE``); the plan must not be shifted before.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from .mesh import MeshLayout, sharding_group_ranks

__all__ = [
    "CollectionSupport",
    "ReplicationChoice",
    "SparseReplication",
    "check_replication",
    "choose_replication",
    "collection_support",
    "embedding_kernels",
    "evaluate_without_inference_mode",
    "gather_sharded_tables",
    "gather_tables_before_forward",
    "shard_with_collection",
]

SparseReplication = Literal["auto", "collection", "fully_sharded", "replica_sync"]
ReplicationMode = Literal["collection", "fully_sharded", "replica_sync"]
_COLLECTION_MODES = ("collection", "fully_sharded")


@dataclass(frozen=True, kw_only=True)
class CollectionSupport:
    """What the installed torchrec offers for ``DMPCollection`` (:func:`collection_support` asks it)."""

    version: str
    """torchrec's version."""
    collection: bool
    """``torchrec.distributed.model_parallel.DMPCollection`` exists."""
    contiguous_groups: bool
    """``DMPCollection`` takes ``use_inter_host_allreduce`` (contiguous sharding groups, as in ``mesh.py``)."""
    fully_sharded: bool
    """``ShardingStrategy.FULLY_SHARDED`` exists and ``DMPCollection`` takes ``sharding_strategy``."""


def collection_support() -> CollectionSupport:
    """What the installed torchrec offers for ``DMPCollection``, asked now (imports torchrec)."""
    import torchrec

    version = str(getattr(torchrec, "__version__", "unknown"))
    try:
        from torchrec.distributed.model_parallel import DMPCollection
    except ImportError:
        return CollectionSupport(version=version, collection=False, contiguous_groups=False, fully_sharded=False)
    accepted = inspect.signature(DMPCollection.__init__).parameters
    try:
        from torchrec.distributed.types import ShardingStrategy
    except ImportError:
        strategy = False
    else:
        strategy = hasattr(ShardingStrategy, "FULLY_SHARDED")
    return CollectionSupport(
        version=version,
        collection=True,
        contiguous_groups="use_inter_host_allreduce" in accepted,
        fully_sharded=strategy and "sharding_strategy" in accepted,
    )


def check_replication(requested: object) -> SparseReplication:
    """``requested`` if it names a mode, else a ValueError listing them; for the ``DMPCollection`` modes, also a
    ValueError when the installed torchrec lacks what they need (the device is checked at setup)."""
    _check_name(requested)
    if requested in _COLLECTION_MODES:
        missing = _missing_in_torchrec(requested, collection_support())
        if missing is not None:
            raise ValueError(f"`sparse_replication={requested!r}` cannot be used: {missing}")
    return requested  # type: ignore[return-value]


def _check_name(requested: object) -> None:
    modes = get_args(SparseReplication)
    if requested not in modes:
        raise ValueError(f"`sparse_replication` must be one of {modes}, got {requested!r}")


@dataclass(frozen=True)
class ReplicationChoice:
    """The mode :func:`choose_replication` picked and why (for the logs)."""

    mode: ReplicationMode
    reason: str


def choose_replication(
    requested: SparseReplication,
    *,
    device_type: str,
    layout: MeshLayout,
    optimizer: str,
    local_world_size: int | None = None,
    support: CollectionSupport | None = None,
) -> ReplicationChoice:
    """The mode that keeps the embedding replicas equal for this job.

    Args:
        requested: the strategy's ``sparse_replication``.
        device_type: this rank's device type (``"cuda"``, ``"cpu"``).
        layout: the mesh sizes.
        optimizer: the fused embedding optimizer's name (``EmbeddingOptimizerConfig.name``).
        local_world_size: processes (devices) per host, checked against where torchrec places the shards it
            re-addresses; ``None``: not checked.
        support: what torchrec offers; ``None``: :func:`collection_support`.

    Raises:
        ValueError: ``"collection"`` or ``"fully_sharded"`` requested where it cannot run, saying why.

    Example:
        >>> from lightning_gem.strategies.mesh import resolve_layout
        >>> choose_replication("auto", device_type="cpu", layout=resolve_layout(2), optimizer="sgd").mode
        'replica_sync'
    """
    _check_name(requested)
    if requested == "replica_sync":
        return ReplicationChoice("replica_sync", "requested")
    blocker = _collection_blocker(
        requested, device_type, layout, optimizer, local_world_size, support or collection_support()
    )
    if blocker is None:
        mode: ReplicationMode = "fully_sharded" if requested == "fully_sharded" else "collection"
        return ReplicationChoice(mode, "requested" if requested != "auto" else "CUDA with torchrec's DMPCollection")
    if requested == "auto":
        return ReplicationChoice("replica_sync", blocker)
    raise ValueError(
        f"`sparse_replication={requested!r}` cannot be used: {blocker} (sparse_replication='replica_sync' runs "
        "anywhere; 'auto' picks it where DMPCollection cannot run)"
    )


def _missing_in_torchrec(requested: str, support: CollectionSupport) -> str | None:
    if not support.collection:
        return f"torchrec {support.version} has no DMPCollection (torchrec.distributed.model_parallel)"
    if requested == "fully_sharded" and not support.fully_sharded:
        return f"torchrec {support.version} has no ShardingStrategy.FULLY_SHARDED for DMPCollection"
    return None


def _collection_blocker(
    requested: str,
    device_type: str,
    layout: MeshLayout,
    optimizer: str,
    local_world_size: int | None,
    support: CollectionSupport,
) -> str | None:
    """Why ``DMPCollection`` cannot run this job (None: it can)."""
    if device_type != "cuda":
        return f"torchrec's DMPCollection runs on CUDA only and this rank's device is {device_type}"
    missing = _missing_in_torchrec("fully_sharded" if requested == "fully_sharded" else "collection", support)
    if missing is not None:
        return missing
    if not support.contiguous_groups and 1 < layout.sparse_group_size < layout.world_size:
        return (
            f"torchrec {support.version}'s DMPCollection has no contiguous sharding groups "
            "(use_inter_host_allreduce): its groups would be strided, not rank // sparse_group_size"
        )
    if optimizer == "adam":
        # DMPCollection caches state["sum"] of every table's fused optimizer at construction (a KeyError for Adam)
        return "DMPCollection syncs Adagrad's optimizer state (`sum`) only: embedding_optimizer='adam' has none"
    if local_world_size is not None:
        from torchrec.distributed.comm import get_local_size

        torchrec_local = get_local_size(layout.world_size)
        if torchrec_local != local_world_size:
            return (
                f"DMPCollection places each re-addressed shard on device `rank % {torchrec_local}` (torchrec's local "
                f"size: LOCAL_WORLD_SIZE, else 8 or the world size) but this job runs {local_world_size} processes a "
                f"host: set LOCAL_WORLD_SIZE={local_world_size}"
            )
    return None


def shard_with_collection(
    module: nn.Module,
    layout: MeshLayout,
    plan: Any,
    device: torch.device,
    sharders: list[Any],
    *,
    node_group_size: int | None,
    fully_sharded: bool = False,
) -> Any:
    """Shard the embedding modules of ``module`` in place with torchrec's ``DMPCollection``; the collection.

    ``plan`` is one sharding group's plan in group-local ranks (``DMPCollection`` re-addresses it in place).
    The collection wraps ``module`` (``init_data_parallel=False``: the dense part is left alone) and is
    kept only for ``sync()``; ``module`` keeps the sharded modules in place of its own.

    Raises:
        RuntimeError: the collection's sharding groups are not ``mesh.py``'s (see the module docstring).
    """
    from torchrec.distributed.model_parallel import DMPCollection

    accepted = inspect.signature(DMPCollection.__init__).parameters
    kwargs: dict[str, Any] = {}
    if "use_inter_host_allreduce" in accepted:
        kwargs["use_inter_host_allreduce"] = True  # contiguous sharding groups (mesh.py)
    if fully_sharded:
        from torchrec.distributed.types import ShardingStrategy

        kwargs["sharding_strategy"] = ShardingStrategy.FULLY_SHARDED
    collection = DMPCollection(
        module=module,
        device=device,
        plan=plan,
        world_size=layout.world_size,
        sharding_group_size=layout.sparse_group_size,
        global_pg=dist.group.WORLD,
        node_group_size=node_group_size,
        sharders=sharders,
        init_data_parallel=False,
        init_parameters=True,
        **kwargs,
    )
    groups = collection.device_mesh.mesh.tolist()
    if groups != sharding_group_ranks(layout):
        raise RuntimeError(
            f"DMPCollection built sharding groups {groups}, not gem5d's {sharding_group_ranks(layout)} "
            f"({layout.describe()})"
        )
    return collection


def gather_tables_before_forward(module: nn.Module) -> int:
    """Make every fully sharded embedding kernel of ``module`` gather its table before a forward if a forward
    without backward (evaluation) left it sharded; the number of kernels hooked.

    torchrec's fully sharded kernels reduce-scatter the table after every forward and gather it in the backward.
    A forward with no backward after it leaves the table sharded. Gathering in a hook after that forward would
    clear the reduce-scatter awaitable that torchrec's output awaitable still holds (on 2 H200s: "'NoneType'
    object has no attribute 'wait'"), so the gather waits for the next forward, or for
    :func:`gather_sharded_tables` (the strategy calls it when an evaluation ends, before checkpoints read the
    tables).
    """
    hooked = 0
    for kernel in _fully_sharded_kernels(module):
        kernel.register_forward_pre_hook(_gather_if_sharded)
        hooked += 1
    return hooked


def gather_sharded_tables(module: nn.Module) -> None:
    """All-gather every fully sharded table of ``module`` that a forward without backward left sharded
    (collective over the replica groups: every rank calls it at the same point)."""
    for kernel in _fully_sharded_kernels(module):
        _gather_if_sharded(kernel, ())


def _fully_sharded_kernels(module: nn.Module) -> list[nn.Module]:
    from torchrec.distributed import batched_embedding_kernel as kernels

    names = ("ShardedBatchedFusedEmbedding", "ShardedBatchedFusedEmbeddingBag")
    types = tuple(getattr(kernels, name) for name in names if hasattr(kernels, name))
    if not types:
        raise RuntimeError(f"this torchrec has no fully sharded embedding kernels ({', '.join(names)})")
    found = [sub for sub in embedding_kernels(module) if isinstance(sub, types)]
    for sub in found:
        if not hasattr(sub, "_all_gather_table_weights"):
            raise RuntimeError(f"this torchrec's {type(sub).__name__} has no table gather (_all_gather_table_weights)")
    return found


def embedding_kernels(module: nn.Module) -> list[nn.Module]:
    """Every module of ``module``, with the embedding kernels of its torchrec sharded modules, which hold their
    lookups in a plain list (``_lookups``), out of ``module.modules()``."""
    found: dict[int, nn.Module] = {}
    for sub in module.modules():
        found.setdefault(id(sub), sub)
        for lookup in getattr(sub, "_lookups", None) or []:
            lookup = getattr(lookup, "module", lookup)  # a lookup wrapped in DistributedDataParallel
            if isinstance(lookup, nn.Module):
                for kernel in lookup.modules():
                    found.setdefault(id(kernel), kernel)
    return list(found.values())


def _gather_if_sharded(kernel: nn.Module, inputs: Any) -> None:
    if getattr(kernel, "weights_sharded", False):
        kernel._all_gather_table_weights()  # torchrec's own backward pre-hook (no public equivalent)


def evaluate_without_inference_mode(trainer: Any) -> list[str]:
    """Make ``trainer``'s evaluation loops run under ``torch.no_grad`` instead of ``torch.inference_mode``; the
    names of the loops that changed.

    Lightning does the same for its FSDP strategy. FSDP2 reads the version counters of the parameters it gathers
    for a forward, which inference tensors lack ("Inference tensors do not track version counter" in
    ``Trainer.validate`` after a checkpoint load, on 2 H200s), and a fully sharded embedding kernel's shard
    buffer, allocated in its first forward, must stay writable by training. Lightning already evaluates under
    ``no_grad`` on gloo, so this matters on NCCL.
    """
    names = ("validate_loop", "test_loop", "predict_loop")
    loops = [(name, getattr(trainer, name, None)) for name in names]
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is not None:
        loops.append(("fit_loop.epoch_loop.val_loop", fit_loop.epoch_loop.val_loop))
    changed = []
    for name, loop in loops:
        if loop is not None and getattr(loop, "inference_mode", False):
            loop.inference_mode = False
            changed.append(name)
    return changed
