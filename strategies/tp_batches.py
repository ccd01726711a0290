"""Tensor-parallel groups train on one batch: the batches their ranks' samplers give, merged.

Tensor-parallel linears need the same input on every rank of a tensor-parallel group. Rather than
each rank training on its own batch, each tensor-parallel group trains on the union of its ranks'
batches: :func:`merge_tensor_parallel_batches` rebuilds a ``DataLoader`` whose batches are the
samples the loader would give to each rank of the group, collated together, identical on those
ranks. The global batch stays the same set of samples; its data-parallel degree is
``world / tensor_parallel``. The embedding lookups run on every rank of the group (the duplicates are
counted out by torchrec's gradient division and the replica average, see ``sparse.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

__all__ = ["merge_tensor_parallel_batches"]


class _FanOut:
    """``set_epoch`` (and ``load_state_dict``) forwarded to every rank's sampler."""

    def __init__(self, samplers: Sequence[Any]) -> None:
        self.samplers = list(samplers)

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)


class _MergedBatchSampler(Sampler[list[int]]):
    """Batches of the concatenated index lists of several ranks' batch samplers."""

    def __init__(self, batch_samplers: Sequence[BatchSampler]) -> None:
        self.batch_samplers = list(batch_samplers)
        self.sampler = _FanOut([b.sampler for b in batch_samplers])  # where Lightning calls set_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for parts in zip(*self.batch_samplers, strict=True):
            yield [index for part in parts for index in part]

    def __len__(self) -> int:
        return len(self.batch_samplers[0])


def merge_tensor_parallel_batches(loader: DataLoader, group_ranks: Sequence[int]) -> DataLoader:
    """A loader giving every rank of ``group_ranks`` the union of their batches from ``loader``.

    Args:
        loader: this rank's loader; its sampler must be a ``DistributedSampler`` (what a distributed
            strategy gives every rank; its subclasses, e.g. the cost-balanced one, keep their position).
        group_ranks: the global ranks of this rank's tensor-parallel group, in order.

    Raises:
        TypeError: the loader's sampler is not a ``DistributedSampler`` (its peers' samples are unknown).
    """
    if len(group_ranks) == 1:
        return loader
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler) or loader.batch_size is None:
        raise TypeError(
            "tensor parallelism needs loaders with a DistributedSampler and a batch_size, so that a tensor-parallel "
            f"group can train on the union of its ranks' batches; got sampler {type(sampler).__name__}"
        )
    batch_samplers = []
    for rank in group_ranks:
        peer = copy.copy(sampler)
        peer.rank = rank
        batch_samplers.append(BatchSampler(peer, loader.batch_size, loader.drop_last))
    return DataLoader(
        loader.dataset,
        batch_sampler=_MergedBatchSampler(batch_samplers),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )
