"""Load balancing across data-parallel ranks: Base Batch Shuffling.

Sequence models cost ``a * len + b * len**2`` per sample (linear layers plus attention), so with
heavy-tailed history lengths a plain ``DistributedSampler`` leaves most ranks waiting for the one that
drew the longest users. :class:`BalancedDistributedSampler` keeps the *global* batches of a plain
``DistributedSampler`` (same seed, same sets of samples per step) and only changes which rank gets
which sample of a global batch, by cost (:func:`partition_by_cost`): heavy samples are paired with
light ones. Every rank computes the same partition from the same seed and lengths, so no communication
is needed.

Pieces:

- :func:`partition_by_cost`: the pure partitioner (greedy LPT with a per-part capacity, plus swaps).
- :class:`AttentionCostModel`: ``cost(len) = a * len + b * len**2``; any callable ``lengths -> costs``
  can replace it.
- :class:`BalancedDistributedSampler`: the ``DistributedSampler`` subclass, resumable mid-epoch.
- :func:`imbalance`: max/mean rank cost of each global batch, to measure any sampler.

Example:
    >>> import numpy as np
    >>> lengths = np.array([1000, 10, 20, 900, 30, 800, 40, 50])
    >>> ranks = [list(BalancedDistributedSampler(lengths, batch_size=2, num_replicas=2, rank=r,
    ...                                         shuffle=False)) for r in range(2)]
    >>> sorted(ranks[0] + ranks[1]) == list(range(8))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler
from typing_extensions import override

__all__ = [
    "AttentionCostModel",
    "BalancedDistributedSampler",
    "ResumableEpochSampler",
    "imbalance",
    "partition_by_cost",
]

CostModel = Callable[[np.ndarray], np.ndarray]


def _check_int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value}")
    return int(value)


def _lengths_and_costs(lengths: np.ndarray, cost_model: CostModel | None) -> tuple[np.ndarray, np.ndarray]:
    """``[N]`` lengths (N >= 1) and their ``[N]`` float64 costs (``cost_model`` None: :class:`AttentionCostModel`)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or len(lengths) == 0:
        raise ValueError(f"`lengths` must have shape [N] with N >= 1, got {list(lengths.shape)}")
    cost_model = AttentionCostModel() if cost_model is None else cost_model
    if not callable(cost_model):
        raise TypeError(f"`cost_model` must be callable (lengths -> costs), got {type(cost_model).__name__}")
    costs = np.asarray(cost_model(lengths), dtype=np.float64)
    if costs.shape != lengths.shape:
        raise ValueError(f"`cost_model` must map [N] lengths to [N] costs, got {list(costs.shape)}")
    return lengths, costs


def partition_by_cost(costs: np.ndarray, num_parts: int, part_size: int, num_swaps: int = 8) -> list[np.ndarray]:
    """Split ``N = num_parts * part_size`` items into ``num_parts`` parts of exactly ``part_size`` items.

    Greedy LPT with a capacity: items go heaviest first to the least loaded part that still has room;
    then up to ``num_swaps`` pairwise swaps between the heaviest and the lightest part, each picking the
    pair whose cost difference is closest to half their load gap (stopping when no swap lowers the
    heaviest of the two). Ties break by position (stable sort, lowest part index), so the result is a
    deterministic function of ``costs``.

    Quality: no partition beats ``max(max(costs), sum(costs) / num_parts)`` for the heaviest part; on
    heavy-tailed lengths (``4096 * u**3``, quadratic cost, 8 parts x 32 items) the heaviest part is
    within 0.1% of the mean, against ~37% above for a plain ``DistributedSampler``
    (``examples/benchmarks/balance.py``).
    Plain LPT without the capacity is within ``4/3 - 1/(3 * num_parts)`` of the optimum; the capacity
    can cost more when a few items dominate, which the swaps partly repair. Time is
    ``O(N * num_parts + num_swaps * part_size**2)``.

    Args:
        costs: ``[N]`` non-negative cost of each item.
        num_parts: parts (ranks).
        part_size: items per part (per-rank batch size).
        num_swaps: most refinement swaps (0: plain capacitated LPT).

    Returns:
        ``num_parts`` int64 arrays of ``part_size`` positions into ``costs`` each, sorted ascending;
        together a permutation of ``range(N)``.

    Example:
        >>> [p.tolist() for p in partition_by_cost(np.array([5.0, 1.0, 4.0, 2.0]), 2, 2)]
        [[0, 1], [2, 3]]
    """
    costs = np.asarray(costs, dtype=np.float64)
    num_parts = _check_int(num_parts, "num_parts", 1)
    part_size = _check_int(part_size, "part_size", 0)
    if costs.ndim != 1 or costs.shape[0] != num_parts * part_size:
        raise ValueError(
            f"`costs` must have shape [num_parts * part_size] = [{num_parts * part_size}], got {list(costs.shape)}"
        )
    loads = np.zeros(num_parts)
    counts = np.zeros(num_parts, dtype=np.int64)
    owner = np.empty(costs.shape[0], dtype=np.int64)
    open_loads = loads.copy()  # loads of the parts with room left, +inf for full ones
    for item in np.argsort(-costs, kind="stable"):
        part = int(np.argmin(open_loads))
        owner[item] = part
        loads[part] += costs[item]
        counts[part] += 1
        open_loads[part] = loads[part] if counts[part] < part_size else np.inf
    for _ in range(num_swaps if num_parts > 1 and part_size > 0 else 0):
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[heavy] - loads[light]
        heavy_items, light_items = np.flatnonzero(owner == heavy), np.flatnonzero(owner == light)
        delta = costs[heavy_items][:, None] - costs[light_items][None, :]
        # A swap moving `delta` lowers the heavier of the two parts iff 0 < delta < gap; best near gap / 2.
        score = np.where((delta > 0) & (delta < gap), np.abs(delta - gap / 2), np.inf)
        best = int(np.argmin(score))
        if not np.isfinite(score.flat[best]):
            break
        i, j = heavy_items[best // len(light_items)], light_items[best % len(light_items)]
        owner[i], owner[j] = light, heavy
        loads[heavy] -= delta.flat[best]
        loads[light] += delta.flat[best]
    return [np.flatnonzero(owner == part) for part in range(num_parts)]


@dataclass(frozen=True)
class AttentionCostModel:
    """Per-sample cost ``a * len + b * len**2``: linear layers per token plus attention per token pair.

    A transformer layer of width ``d`` spends about ``24 d^2`` FLOPs per token in its linear layers
    (``4 d^2`` MACs of projections, ``8 d^2`` of the MLP) and ``4 d`` per token pair in attention
    (``QK^T`` and ``AV``), so ``b / a = 1 / (6 d)``; the default ``b`` is that ratio for ``d = 256``.
    Only the ratio matters for balancing. Use :meth:`from_model` for absolute FLOPs of a given model.

    Args:
        a: cost per token.
        b: cost per token pair.

    Example:
        >>> AttentionCostModel(a=1.0, b=0.5)(np.array([2, 4])).tolist()
        [4.0, 12.0]
    """

    a: float = 1.0
    b: float = 1.0 / (6 * 256)

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0 or self.a + self.b <= 0:
            raise ValueError(f"`a` and `b` must be >= 0 and not both 0, got a={self.a}, b={self.b}")

    @classmethod
    def from_model(
        cls, model_dim: int, num_layers: int, *, linear_flops: float = 24.0, attention_flops: float = 4.0
    ) -> AttentionCostModel:
        """Forward FLOPs of ``num_layers`` layers of width ``model_dim``.

        Args:
            model_dim: layer width ``d``.
            num_layers: layers.
            linear_flops: FLOPs per token per ``d^2`` (24 for attention projections + 4x MLP; ~10 for
                HSTU, which has no MLP).
            attention_flops: FLOPs per token pair per ``d`` (4; 2 for a causal kernel that skips the
                masked half).
        """
        model_dim, num_layers = _check_int(model_dim, "model_dim", 1), _check_int(num_layers, "num_layers", 1)
        return cls(a=linear_flops * model_dim**2 * num_layers, b=attention_flops * model_dim * num_layers)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        """``[N]`` float64 costs of ``[N]`` lengths."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.a * lengths + self.b * lengths**2


class ResumableEpochSampler(DistributedSampler):
    """A ``DistributedSampler`` that yields an epoch batch by batch and resumes at a batch of an epoch.

    Subclasses call :meth:`_begin_iteration` when an iteration starts (it returns the first batch), bump
    ``_batches_consumed`` as batches leave, and name in :meth:`_layout` what must match for a saved
    position to mean the same batches (global batch size, token budget, ...).
    """

    _batches_consumed = 0  # batches of the current epoch this rank's iterator has yielded
    _resume: tuple[int, int] | None = None  # (epoch, first batch) of the next iteration

    def _layout(self) -> dict[str, int]:
        """What decides the epoch's batches beside seed and epoch; a position resumes only if they match."""
        return {}

    def _permutation(self) -> list[int]:
        """The epoch's order of all samples: permuted with ``seed + epoch`` as ``DistributedSampler`` does."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def _begin_iteration(self) -> int:
        """The first batch of this iteration (the restored position once, in its epoch; else 0)."""
        start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        self._resume = None
        self._batches_consumed = start
        return start

    def _start_batch(self) -> int:
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0

    @override
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its permutation is ``seed + epoch``); a pending resume of another epoch is dropped."""
        if epoch != self.epoch:
            self._batches_consumed = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_consumed", "seed"}`` and the layout: this sampler's position."""
        return {"epoch": self.epoch, "batches_consumed": self._batches_consumed, "seed": self.seed, **self._layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s position: the next iteration of its epoch skips the consumed batches.

        Raises:
            ValueError: keys are missing, or the layout differs (its batches would not align).
        """
        missing = {"epoch", "batches_consumed"} - set(state_dict)
        if missing:
            raise ValueError(f"`state_dict` must hold {sorted(missing)} (from {type(self).__name__}.state_dict)")
        for key, value in self._layout().items():
            if state_dict.get(key, value) != value:
                raise ValueError(
                    f"`state_dict` was saved with {key}={state_dict[key]}, this sampler's is "
                    f"{value}: the epoch's batches differ, so its batch position does not carry over"
                )
        self.seed = int(state_dict.get("seed", self.seed))
        self.set_epoch(int(state_dict["epoch"]))
        self._batches_consumed = int(state_dict["batches_consumed"])
        self._resume = (self.epoch, self._batches_consumed)


class BalancedDistributedSampler(ResumableEpochSampler):
    """A ``DistributedSampler`` whose global batches are split across ranks by cost (Base Batch Shuffling).

    Each epoch: the indices are permuted with ``seed + epoch`` exactly as ``DistributedSampler`` does,
    cut into global batches of ``num_replicas * batch_size``, and each global batch is partitioned
    across ranks with :func:`partition_by_cost` (identically on every rank, no communication); this
    rank's part is yielded, batch by batch. So the global batch of every step is the same set of
    samples as with a plain ``DistributedSampler`` (and a DataLoader of ``batch_size``); only the rank
    each sample goes to changes. The tail: without ``drop_last`` the permutation is padded by wrapping
    to a multiple of ``num_replicas`` (as ``DistributedSampler`` does) and the last, smaller global
    batch is split evenly (every rank gets the same smaller batch); with ``drop_last`` the incomplete
    global batch is dropped. Within a rank's batch, samples keep their permutation order.

    The position is resumable: :meth:`state_dict` holds the epoch and the batches this rank's iterator
    has yielded (exact with ``num_workers=0``; with worker prefetching it runs ahead of training, so
    pass the trained batch count to :meth:`load_state_dict` instead), and the next iteration of that
    epoch after :meth:`load_state_dict` starts at that batch.

    Args:
        lengths: ``[N]`` per-sample sequence lengths (``source.sample_lengths(split)``: metadata only).
        batch_size: samples per rank per step (the DataLoader's ``batch_size``).
        num_replicas: data-parallel ranks; ``None``: the process group's world size.
        rank: this rank; ``None``: the process group's rank.
        shuffle: permute with ``seed + epoch`` (else the natural order, still balanced per batch).
        seed: shuffle seed, the same on every rank.
        drop_last: drop the incomplete last global batch.
        cost_model: ``lengths -> costs`` (``[N]`` -> ``[N]``); ``None``: :class:`AttentionCostModel`.

    Example:
        >>> sampler = BalancedDistributedSampler(np.arange(1, 101), batch_size=8, num_replicas=4, rank=0)
        >>> len(sampler), len(list(sampler))
        (25, 25)
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        cost_model: CostModel | None = None,
    ) -> None:
        lengths, self.costs = _lengths_and_costs(lengths, cost_model)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        # DistributedSampler only takes len() of its dataset; the lengths stand in for it.
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        global_batch = self.num_replicas * self.batch_size
        if self.drop_last:
            self.total_size = len(lengths) // global_batch * global_batch
        else:
            self.total_size = math.ceil(len(lengths) / self.num_replicas) * self.num_replicas
        self.num_samples = self.total_size // self.num_replicas

    @property
    def num_batches(self) -> int:
        """Global batches (steps) per epoch, the last one possibly smaller."""
        return math.ceil(self.total_size / (self.num_replicas * self.batch_size))

    def _global_order(self) -> list[int]:
        """The epoch's padded permutation: exactly ``DistributedSampler.__iter__`` before it subsamples."""
        indices = self._permutation()
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - len(indices)
        return indices + (indices * math.ceil(padding / len(indices)))[:padding]

    @override
    def _layout(self) -> dict[str, int]:
        return {"global_batch_size": self.num_replicas * self.batch_size}

    @override
    def __iter__(self) -> Iterator[int]:
        start = self._begin_iteration()
        order = np.asarray(self._global_order(), dtype=np.int64)
        global_batch = self.num_replicas * self.batch_size
        for step in range(start, self.num_batches):
            chunk = order[step * global_batch : (step + 1) * global_batch]
            parts = partition_by_cost(self.costs[chunk], self.num_replicas, len(chunk) // self.num_replicas)
            mine = chunk[parts[self.rank]].tolist()
            for position, index in enumerate(mine):
                if position == len(mine) - 1:  # count the batch when its last sample leaves
                    self._batches_consumed = step + 1
                yield index

    @override
    def __len__(self) -> int:
        return max(self.num_samples - self._start_batch() * self.batch_size, 0)


def imbalance(rank_indices: Sequence[Sequence[int]], costs: np.ndarray, batch_size: int) -> np.ndarray:
    """Max over mean rank cost of each global batch (1.0: perfectly balanced).

    Works for any sampler: the k-th global batch is the k-th run of ``batch_size`` indices of every rank.

    Args:
        rank_indices: one index sequence per rank (e.g. ``list(sampler)`` for each rank), equal lengths.
        costs: ``[N]`` per-sample costs (e.g. ``AttentionCostModel()(lengths)``).
        batch_size: samples per rank per step.

    Returns:
        ``[num_batches]`` float64 ratios.

    Example:
        >>> imbalance([[0, 1], [2, 3]], np.array([3.0, 1.0, 1.0, 1.0]), batch_size=2).tolist()
        [1.3333333333333333]
    """
    batch_size = _check_int(batch_size, "batch_size", 1)
    indices = np.asarray(rank_indices, dtype=np.int64)
    if indices.ndim != 2:
        raise ValueError("`rank_indices` must be one equal-length index sequence per rank")
    costs = np.asarray(costs, dtype=np.float64)
    num_ranks, num_samples = indices.shape
    num_batches = math.ceil(num_samples / batch_size)
    rank_costs = np.zeros((num_batches, num_ranks))
    step = np.arange(num_samples) // batch_size
    for rank in range(num_ranks):
        np.add.at(rank_costs[:, rank], step, costs[indices[rank]])
    mean = rank_costs.mean(axis=1)
    return np.divide(rank_costs.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
