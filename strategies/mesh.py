"""Mesh arithmetic of the 5D layout (sparse 2D x dense 3D): plain functions and a checked dataclass.

Rank layout over ``W`` ranks (``rank = 0 .. W - 1``), two factorisations of the same ranks:

* dense, ``W = dense_replicate x dense_shard x tensor_parallel``, row-major with tensor parallel
  innermost: ``rank = (replicate_index * dense_shard + shard_index) * tensor_parallel + tp_index``.
  Tensor-parallel groups are contiguous (the chattiest collectives stay inside a node), FSDP shards
  over ``dense_shard`` and HSDP replicates over ``dense_replicate``.
* sparse, ``W = sparse_replicas x sparse_group_size``: sharding groups are contiguous,
  ``group = rank // sparse_group_size``; tables are sharded inside a group (the embedding all-to-all
  stays inside it) and the same shard is replicated on rank ``rank % sparse_group_size`` of every
  other group (the replica group, whose all-reduce keeps the copies equal). This is torchrec's 2D
  layout with contiguous sharding groups (``DMPCollection(use_inter_host_allreduce=True)``).

Example with ``W = 8``, ``sparse_group_size = 4``, ``dense_replicate = 2``, ``dense_shard = 2``,
``tensor_parallel = 2``::

    sharding groups [0 1 2 3] [4 5 6 7]          replica groups [0 4] [1 5] [2 6] [3 7]
    tensor-parallel [0 1] [2 3] [4 5] [6 7]      FSDP shard groups [0 2] [1 3] [4 6] [5 7]
    HSDP replicas   [0 4] [1 5] [2 6] [3 7]

Every rank trains on its own batch: the data-parallel world is ``W / tensor_parallel`` distinct
batches only when tensor parallelism gathers its group's batches (see ``dense.py``); with
``tensor_parallel = 1`` it is ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MeshLayout",
    "build_device_mesh",
    "check_size",
    "replica_group_ranks",
    "resolve_layout",
    "sharding_group_ranks",
]

DENSE_AXES = ("dense_replicate", "dense_shard", "tensor_parallel")
SPARSE_AXES = ("sparse_replicate", "sparse_shard")


def check_size(value: object, name: str) -> int:
    """``value`` if it is an int >= 1, else a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """The sizes of the 5D layout over ``world_size`` ranks (see the module docstring for the rank order)."""

    world_size: int
    """Ranks in the job."""
    sparse_group_size: int
    """Ranks a table is sharded over; ``world_size / sparse_group_size`` replicas of each shard."""
    dense_replicate: int
    """HSDP replicas of the dense parameters."""
    dense_shard: int
    """Ranks each dense parameter is sharded over (FSDP2)."""
    tensor_parallel: int
    """Ranks each tensor-parallel linear is split over."""

    def __post_init__(self) -> None:
        for name in ("world_size", "sparse_group_size", "dense_replicate", "dense_shard", "tensor_parallel"):
            check_size(getattr(self, name), name)
        if self.world_size % self.sparse_group_size:
            raise ValueError(
                f"`sparse_group_size` ({self.sparse_group_size}) must divide the world size ({self.world_size}): "
                "tables are sharded inside groups of that many ranks and replicated across the groups"
            )
        dense = self.dense_replicate * self.dense_shard * self.tensor_parallel
        if dense != self.world_size:
            raise ValueError(
                f"dense_replicate x dense_shard x tensor_parallel = {self.dense_replicate} x {self.dense_shard} x "
                f"{self.tensor_parallel} = {dense} must equal the world size ({self.world_size})"
            )

    @property
    def sparse_replicas(self) -> int:
        """Copies of each embedding shard (the size of a replica group)."""
        return self.world_size // self.sparse_group_size

    @property
    def data_parallel(self) -> int:
        """Ranks holding distinct copies of the dense activations: ``dense_replicate x dense_shard``."""
        return self.dense_replicate * self.dense_shard

    def dense_coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replicate_index, shard_index, tp_index)`` of ``rank`` on the dense mesh."""
        self._check_rank(rank)
        tp = rank % self.tensor_parallel
        shard = (rank // self.tensor_parallel) % self.dense_shard
        return rank // (self.tensor_parallel * self.dense_shard), shard, tp

    def sparse_coordinates(self, rank: int) -> tuple[int, int]:
        """``(group_index, rank_in_group)`` of ``rank`` on the sparse mesh."""
        self._check_rank(rank)
        return rank // self.sparse_group_size, rank % self.sparse_group_size

    def describe(self) -> str:
        """One line naming every axis size, for logs and error messages."""
        return (
            f"world {self.world_size} = sparse {self.sparse_replicas} replicas x {self.sparse_group_size} shards"
            f" = dense {self.dense_replicate} replicate x {self.dense_shard} shard x {self.tensor_parallel} tensor"
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"`rank` must lie in [0, {self.world_size}), got {rank}")


def resolve_layout(
    world_size: int,
    *,
    sparse_group_size: int | None = None,
    dense_replicate_size: int = 1,
    dense_shard_size: int | None = None,
    tensor_parallel_size: int = 1,
) -> MeshLayout:
    """The layout for ``world_size`` ranks with defaults filled in and every size checked.

    Args:
        world_size: ranks in the job.
        sparse_group_size: ranks a table is sharded over; ``None``: all ranks (one group, plain torchrec
            sharding); ``1``: every rank holds every table (pure replication).
        dense_replicate_size: HSDP replicas.
        dense_shard_size: FSDP shard size; ``None``: ``world_size / (dense_replicate_size x tensor_parallel_size)``.
        tensor_parallel_size: tensor-parallel size.

    Raises:
        ValueError: a size that does not divide or multiply up to ``world_size``, naming the argument.

    Example:
        >>> resolve_layout(4, sparse_group_size=2, dense_replicate_size=2).describe()
        'world 4 = sparse 2 replicas x 2 shards = dense 2 replicate x 2 shard x 1 tensor'
    """
    check_size(world_size, "world_size")
    check_size(dense_replicate_size, "dense_replicate_size")
    check_size(tensor_parallel_size, "tensor_parallel_size")
    if sparse_group_size is None:
        sparse_group_size = world_size
    check_size(sparse_group_size, "sparse_group_size")
    if sparse_group_size > world_size:
        raise ValueError(f"`sparse_group_size` ({sparse_group_size}) must be <= the world size ({world_size})")
    if dense_shard_size is None:
        fixed = dense_replicate_size * tensor_parallel_size
        if world_size % fixed:
            raise ValueError(
                f"dense_replicate_size x tensor_parallel_size = {dense_replicate_size} x {tensor_parallel_size} must "
                f"divide the world size ({world_size}) to leave a whole `dense_shard_size`"
            )
        dense_shard_size = world_size // fixed
    check_size(dense_shard_size, "dense_shard_size")
    return MeshLayout(
        world_size=world_size,
        sparse_group_size=sparse_group_size,
        dense_replicate=dense_replicate_size,
        dense_shard=dense_shard_size,
        tensor_parallel=tensor_parallel_size,
    )


def sharding_group_ranks(layout: MeshLayout) -> list[list[int]]:
    """The ranks of each sparse sharding group (contiguous blocks of ``sparse_group_size``)."""
    size = layout.sparse_group_size
    return [list(range(start, start + size)) for start in range(0, layout.world_size, size)]


def replica_group_ranks(layout: MeshLayout) -> list[list[int]]:
    """The ranks holding copies of the same embedding shard: ``[j, j + S, j + 2S, ...]`` for ``j < S``."""
    size = layout.sparse_group_size
    return [list(range(j, layout.world_size, size)) for j in range(size)]


def build_device_mesh(layout: MeshLayout, device_type: str):  # -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]
    """One root ``DeviceMesh`` over all ranks and its two views: ``(root, dense, sparse)``.

    ``dense`` has axes :data:`DENSE_AXES` (shape ``(dense_replicate, dense_shard, tensor_parallel)``),
    ``sparse`` has axes :data:`SPARSE_AXES` (shape ``(sparse_replicas, sparse_group_size)``, the
    layout torchrec's ``ShardingEnv2D`` expects). Both are unflattened from the root, so they share
    its process groups. Needs an initialised default process group.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dense_shape = (layout.dense_replicate, layout.dense_shard, layout.tensor_parallel)
    sparse_shape = (layout.sparse_replicas, layout.sparse_group_size)
    if not hasattr(DeviceMesh, "_unflatten"):  # older torch: two meshes over the same ranks, the dense one as root
        dense = init_device_mesh(device_type, dense_shape, mesh_dim_names=DENSE_AXES)
        ranks = torch.arange(layout.world_size).reshape(sparse_shape)
        return dense, dense, DeviceMesh(device_type, ranks, mesh_dim_names=SPARSE_AXES)
    root = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("world",))
    dense = root._unflatten(0, dense_shape, DENSE_AXES)
    sparse = root._unflatten(0, sparse_shape, SPARSE_AXES)
    return root, dense, sparse
