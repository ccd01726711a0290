"""Token-budget batching: variable batch sizes under a cap on the tokens each rank processes per step.

With long-tailed history lengths a fixed batch size either wastes the device on steps of short users
or runs out of memory on a step of long ones. Here a step is as many users as fit ``max_tokens`` per
rank (history tokens, from ``source.sample_lengths``: metadata, nothing is loaded), and the users of a
step are still split across ranks by cost, heavy with light (Base Batch Shuffling), so ranks finish
together.

:func:`pack_by_tokens` is the pure packer; :class:`TokenBudgetSampler` the ``DistributedSampler``
subclass that yields this rank's batches (lists of indices), identical on every rank from the shared
seed and epoch, with the same number of steps on every rank, resumable mid-epoch.
:class:`~lightning_gem.data.GEMDataModule` uses it with ``max_tokens=...``.

Example:
    >>> import numpy as np
    >>> lengths = np.array([90, 10, 50, 50, 30, 70, 20, 80])
    >>> steps = pack_by_tokens(np.arange(8), lengths, lengths.astype(float), max_tokens=100, num_parts=2)
    >>> [[part.tolist() for part in step] for step in steps]
    [[[0, 1], [2, 3]], [[7, 6], [5, 4]]]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_gem.data.balancing import CostModel, ResumableEpochSampler, _check_int, _lengths_and_costs

__all__ = ["BatchedDataset", "TokenBudgetSampler", "pack_by_tokens"]


def _pack_step(
    pool: list[int], lengths: np.ndarray, costs: np.ndarray, max_tokens: int, num_parts: int, max_batch_size: int | None
) -> tuple[list[np.ndarray], list[int]]:
    """Split ``pool`` over ``num_parts`` by cost under the caps: greedy LPT; returns (parts, left over)."""
    order = sorted(pool, key=lambda i: -costs[i])  # stable: ties keep the pool's order
    load, tokens = np.zeros(num_parts), np.zeros(num_parts, dtype=np.int64)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    left: list[int] = []
    for index in order:
        counts = np.array([len(part) for part in parts])
        fits = tokens + lengths[index] <= max_tokens
        if max_batch_size is not None:
            fits &= counts < max_batch_size
        if not fits.any():
            left.append(index)
            continue
        # The least-loaded part that has room; among equal loads (zero-cost samples) the emptiest.
        candidates = np.flatnonzero(fits)
        part = candidates[np.lexsort((counts[candidates], load[candidates]))[0]]
        parts[part].append(index)
        load[part] += costs[index]
        tokens[part] += lengths[index]
    left_set = set(left)
    return [np.array(part, dtype=np.int64) for part in parts], [i for i in pool if i in left_set]


def pack_by_tokens(
    order: np.ndarray,
    lengths: np.ndarray,
    costs: np.ndarray,
    max_tokens: int,
    num_parts: int,
    max_batch_size: int | None = None,
    drop_last: bool = False,
) -> list[list[np.ndarray]]:
    """Pack the samples of ``order`` into steps of ``num_parts`` batches of at most ``max_tokens`` tokens each.

    Samples are taken in ``order`` into a pool of up to ``num_parts * max_tokens`` tokens; the pool is
    split across the parts by cost (greedy LPT: heaviest first, each to the least-loaded part with room
    for its tokens); samples that fit no part carry over, first, to the next step. Every part of every
    step gets at least one sample. The tail: when fewer than ``num_parts`` samples remain, they are
    dropped with ``drop_last``, else padded with samples from the start of ``order`` (as
    ``DistributedSampler`` pads), so every sample appears in exactly one step (padding aside).

    Args:
        order: ``[N]`` sample indices in the epoch's order.
        lengths: per-sample token counts, indexed by sample index (each ``<= max_tokens``).
        costs: per-sample costs, indexed by sample index.
        max_tokens: token cap of one part (rank) in one step.
        num_parts: parts (data-parallel ranks) per step.
        max_batch_size: optional cap on the samples of one part.
        drop_last: drop the tail of fewer than ``num_parts`` samples instead of padding it.

    Returns:
        ``steps[s][p]``: the ``[n_sp]`` int64 sample indices of part ``p`` of step ``s``.
    """
    max_tokens, num_parts = _check_int(max_tokens, "max_tokens", 1), _check_int(num_parts, "num_parts", 1)
    if max_batch_size is not None:
        max_batch_size = _check_int(max_batch_size, "max_batch_size", 1)
    order = np.asarray(order, dtype=np.int64)
    lengths, costs = np.asarray(lengths, dtype=np.int64), np.asarray(costs, dtype=np.float64)
    if len(order) and int(lengths[order].max()) > max_tokens:
        raise ValueError(
            f"`max_tokens` ({max_tokens}) must be >= the longest sample ({int(lengths[order].max())} tokens): "
            "cap the history length in the source or raise `max_tokens`"
        )
    capacity = num_parts * max_tokens
    steps: list[list[np.ndarray]] = []
    pool: list[int] = []
    position = 0
    while position < len(order) or pool:
        pool_tokens = int(lengths[pool].sum()) if pool else 0
        while position < len(order):
            index = int(order[position])
            full = max_batch_size is not None and len(pool) >= num_parts * max_batch_size
            if full or (pool_tokens + lengths[index] > capacity and len(pool) >= num_parts):
                break
            pool.append(index)
            pool_tokens += int(lengths[index])
            position += 1
        if len(pool) < num_parts:  # the tail
            if drop_last or not len(order):
                break
            pool += [int(i) for i in np.resize(order, num_parts - len(pool))]
        parts, pool = _pack_step(pool, lengths, costs, max_tokens, num_parts, max_batch_size)
        steps.append(parts)
    return steps


class TokenBudgetSampler(ResumableEpochSampler):
    """Yields this rank's batches (index lists) of at most ``max_tokens`` history tokens, balanced by cost.

    Each epoch the indices are permuted with ``seed + epoch`` (as ``DistributedSampler`` does) and
    packed by :func:`pack_by_tokens` into steps of ``num_replicas`` batches; this rank yields its batch
    of each step. Every rank computes the same packing, so all ranks run the same number of steps with
    no communication. Use it as a DataLoader ``sampler`` with ``batch_size=None`` over a dataset that
    takes a list of indices (``GEMDataModule(max_tokens=...)`` does this); it stays a
    ``DistributedSampler`` so Lightning leaves it in place and calls :meth:`set_epoch`.

    Args:
        lengths: ``[N]`` per-sample token counts (``source.sample_lengths(split)``), each ``<= max_tokens``.
        max_tokens: token cap of one rank's batch.
        num_replicas: data-parallel ranks; ``None``: the process group's world size.
        rank: this rank; ``None``: the process group's rank.
        shuffle: permute with ``seed + epoch`` (else the natural order).
        seed: shuffle seed, the same on every rank.
        drop_last: drop a tail of fewer than ``num_replicas`` samples (else pad it by wrapping).
        cost_model: ``lengths -> costs`` to balance by; ``None``: :class:`AttentionCostModel`.
        max_batch_size: optional cap on samples per batch.

    Example:
        >>> sampler = TokenBudgetSampler(np.full(100, 10), max_tokens=200, num_replicas=2, rank=0)
        >>> len(sampler), [len(batch) for batch in sampler][:3]
        (3, [20, 20, 10])
    """

    def __init__(
        self,
        lengths: np.ndarray,
        max_tokens: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        cost_model: CostModel | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        lengths, self.costs = _lengths_and_costs(lengths, cost_model)
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.lengths = lengths.astype(np.int64)
        self.max_tokens = _check_int(max_tokens, "max_tokens", 1)
        if int(self.lengths.max()) > self.max_tokens:
            raise ValueError(
                f"`max_tokens` ({self.max_tokens}) must be >= the longest sample ({int(self.lengths.max())} tokens)"
            )
        self.max_batch_size = None if max_batch_size is None else _check_int(max_batch_size, "max_batch_size", 1)
        self._steps: tuple[int, list[list[np.ndarray]]] | None = None  # (epoch, packing) cache

    def steps(self) -> list[list[np.ndarray]]:
        """This epoch's packing, ``steps[s][rank]`` (every rank's batches; cached per epoch)."""
        if self._steps is None or self._steps[0] != self.epoch:
            packing = pack_by_tokens(
                np.asarray(self._permutation()),
                self.lengths,
                self.costs,
                self.max_tokens,
                self.num_replicas,
                self.max_batch_size,
                self.drop_last,
            )
            self._steps = (self.epoch, packing)
        return self._steps[1]

    @property
    def num_batches(self) -> int:
        """Steps (batches per rank) in this epoch."""
        return len(self.steps())

    @override
    def _layout(self) -> dict[str, int]:
        return {"max_tokens": self.max_tokens, "num_replicas": self.num_replicas}

    @override
    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        start = self._begin_iteration()
        for step, parts in enumerate(self.steps()[start:], start=start):
            self._batches_consumed = step + 1
            yield parts[self.rank].tolist()

    @override
    def __len__(self) -> int:
        """Batches this rank yields this epoch (all of them, also when resumed mid-epoch; see GEMDataModule)."""
        return self.num_batches


class BatchedDataset(Dataset):
    """``dataset[[i, j, ...]]`` -> ``collate([dataset[i], dataset[j], ...])``: for samplers that yield batches."""

    def __init__(self, dataset: Dataset, collate: Any) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, indices: list[int]) -> Any:
        return self.collate([self.dataset[i] for i in indices])
