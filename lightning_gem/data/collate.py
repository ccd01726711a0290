"""Samples and the collate functions that pack them into :class:`RankingBatch` / :class:`RetrievalBatch`.

A sample is a small named tuple of numpy arrays (views into a source's flat arrays, so producing one is a
few slices). Collation is vectorized: one ``np.concatenate`` per field, then one
``KeyedJaggedTensor.from_lengths_sync`` per KJT. The KJT value layout is key-major (all values of key 0
over the batch, then key 1, ...), so a ``[T, F]`` block of ``F`` per-event features transposed and
flattened is exactly the values of ``F`` keys that share the same lengths.

Example:
    >>> import numpy as np
    >>> from lightning_gem.data.collate import RetrievalSample, collate_retrieval
    >>> from lightning_gem.data.schema import RetrievalSchema
    >>> schema = RetrievalSchema(num_items=10)
    >>> samples = [RetrievalSample(history=np.array([[1], [2]]), targets=np.array([2, 3])),
    ...            RetrievalSample(history=np.array([[4]]), targets=np.array([5]))]
    >>> batch = collate_retrieval(samples, schema)
    >>> batch.offsets().tolist(), batch.targets.tolist()
    ([0, 2, 3], [2, 3, 5])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_gem.data.batch import RankingBatch, RetrievalBatch
from lightning_gem.data.schema import RankingSchema, RetrievalSchema

__all__ = ["RankingSample", "RetrievalSample", "collate_ranking", "collate_retrieval"]

# KJT lengths use int32 (as torchrec's own data sets do), values int64.
_LENGTH_DTYPE = np.int32


class RankingSample(NamedTuple):
    """One user of a ranking batch (``L`` history events, ``c`` candidates).

    Shapes:
        history: ``[L, F_h]`` int64, columns in the order of ``schema.history_features``; the most recent
            ``max_history_length`` events, oldest first.
        candidates: ``[c, F_c]`` int64, columns in the order of ``schema.candidate_features``.
        labels: ``[c, num_tasks]`` float32 in {0, 1}.
        pooled: one ``[n_k]`` int64 array per ``schema.pooled_features`` entry.
        dense: ``[num_dense]`` float32, or ``None`` when ``schema.num_dense == 0``.
        time_deltas: ``[L]`` float32 seconds between each event and the request, or ``None``.
    """

    history: np.ndarray
    candidates: np.ndarray
    labels: np.ndarray
    pooled: tuple[np.ndarray, ...] = ()
    dense: np.ndarray | None = None
    time_deltas: np.ndarray | None = None


class RetrievalSample(NamedTuple):
    """One user sequence of a retrieval batch (``L`` input events).

    Shapes:
        history: ``[L, F]`` int64: the item id column, then one column per ``schema.extra`` key.
        targets: ``[L]`` int64, the next item after each input position.
        timestamps: ``[L]`` float32 seconds, or ``None``.
    """

    history: np.ndarray
    targets: np.ndarray
    timestamps: np.ndarray | None = None


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _block_kjt(
    keys: list[str], blocks: list[np.ndarray], block_lengths: list[np.ndarray], num_columns: list[int]
) -> KeyedJaggedTensor:
    """One KJT from ``[T_i, F_i]`` blocks whose ``F_i`` columns share the ``[B]`` lengths of block ``i``."""
    values = np.concatenate([block.T.reshape(-1) for block in blocks]) if blocks else np.zeros(0, np.int64)
    lengths = np.concatenate([np.tile(lens, cols) for lens, cols in zip(block_lengths, num_columns, strict=True)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=_tensor(values, torch.int64), lengths=_tensor(lengths.astype(_LENGTH_DTYPE), torch.int32)
    )


def _check_nonempty(samples: Sequence[object], kind: type) -> None:
    if len(samples) == 0:
        raise ValueError("`samples` must hold at least one sample, got an empty sequence")
    if not isinstance(samples[0], kind):
        raise TypeError(f"`samples` must hold {kind.__name__} tuples, got {type(samples[0]).__name__}")


def collate_ranking(samples: Sequence[RankingSample], schema: RankingSchema) -> RankingBatch:
    """Pack ``B`` ranking samples into one :class:`RankingBatch`.

    Args:
        samples: ``B`` :class:`RankingSample` s.
        schema: the features' schema (key order of the KJTs, tasks, dense width).

    Returns:
        A RankingBatch: ``sequence_features`` with the history keys (lengths = history lengths) then the
        candidate keys (lengths = candidates per user), ``labels [C, num_tasks]``, ``pooled_features``,
        ``dense_features [B, num_dense]`` and ``history_time_deltas [T_h]`` as the schema declares.

    Raises:
        ValueError: an empty ``samples``, or arrays whose widths disagree with ``schema``.
        TypeError: ``samples`` does not hold RankingSample tuples.
    """
    _check_nonempty(samples, RankingSample)
    num_history, num_candidate = len(schema.history_features), len(schema.candidate_features)
    history = np.concatenate([s.history for s in samples])
    candidates = np.concatenate([s.candidates for s in samples])
    labels = np.concatenate([s.labels for s in samples])
    if history.ndim != 2 or history.shape[1] != num_history:
        raise ValueError(f"`samples[i].history` must be [L, {num_history}], got a [T, {history.shape[1:]}] batch")
    if candidates.ndim != 2 or candidates.shape[1] != num_candidate:
        raise ValueError(f"`samples[i].candidates` must be [c, {num_candidate}], got [C, {candidates.shape[1:]}]")
    if labels.shape != (candidates.shape[0], len(schema.tasks)):
        raise ValueError(
            f"`samples[i].labels` must be [c, {len(schema.tasks)}] (one row per candidate), got {labels.shape} "
            f"for {candidates.shape[0]} candidates"
        )
    history_lengths = np.fromiter((len(s.history) for s in samples), np.int64, len(samples))
    candidate_lengths = np.fromiter((len(s.candidates) for s in samples), np.int64, len(samples))
    sequence_features = _block_kjt(
        [f.name for f in schema.sequence_features],
        [history, candidates],
        [history_lengths, candidate_lengths],
        [num_history, num_candidate],
    )

    pooled_features = None
    if schema.pooled_features:
        per_key = list(zip(*(s.pooled for s in samples), strict=True))
        if len(per_key) != len(schema.pooled_features):
            raise ValueError(f"`samples[i].pooled` must hold {len(schema.pooled_features)} arrays, got {len(per_key)}")
        pooled_features = _block_kjt(
            [f.name for f in schema.pooled_features],
            [np.concatenate(arrays)[:, None] for arrays in per_key],
            [np.fromiter((len(a) for a in arrays), np.int64, len(arrays)) for arrays in per_key],
            [1] * len(per_key),
        )

    dense_features = None
    if schema.num_dense:
        dense = np.stack([s.dense for s in samples])
        if dense.shape != (len(samples), schema.num_dense):
            raise ValueError(f"`samples[i].dense` must be [{schema.num_dense}], got a batch of shape {dense.shape}")
        dense_features = _tensor(dense, torch.float32)

    time_deltas = None
    if schema.has_time:
        time_deltas = _tensor(np.concatenate([s.time_deltas for s in samples]), torch.float32)

    return RankingBatch(
        sequence_features=sequence_features,
        labels=_tensor(labels, torch.float32),
        history_key=schema.history_features[0].name,
        candidate_key=schema.candidate_features[0].name,
        pooled_features=pooled_features,
        dense_features=dense_features,
        history_time_deltas=time_deltas,
        longest_history=int(history_lengths.max()),
        most_candidates=int(candidate_lengths.max()),
    )


def collate_retrieval(samples: Sequence[RetrievalSample], schema: RetrievalSchema) -> RetrievalBatch:
    """Pack ``B`` retrieval samples into one :class:`RetrievalBatch`.

    Args:
        samples: ``B`` :class:`RetrievalSample` s.
        schema: gives the KJT keys (``item_feature``, then ``extra`` keys).

    Returns:
        A RetrievalBatch with ``history`` (KJT of stride ``B``), ``targets [T]`` int64 and, when every
        sample has them, ``timestamps [T]`` float32.

    Raises:
        ValueError: an empty ``samples`` or widths that disagree with ``schema``.
        TypeError: ``samples`` does not hold RetrievalSample tuples.
    """
    _check_nonempty(samples, RetrievalSample)
    keys = [schema.item_feature, *schema.extra]
    history = np.concatenate([s.history for s in samples])
    targets = np.concatenate([s.targets for s in samples])
    if history.ndim != 2 or history.shape[1] != len(keys):
        raise ValueError(f"`samples[i].history` must be [L, {len(keys)}] (keys {keys}), got [T, {history.shape[1:]}]")
    if targets.shape != (history.shape[0],):
        raise ValueError(f"`samples[i].targets` must be [L] (one per event), got {targets.shape} for {len(history)}")
    lengths = np.fromiter((len(s.history) for s in samples), np.int64, len(samples))
    timestamps = None
    if samples[0].timestamps is not None:
        timestamps = _tensor(np.concatenate([s.timestamps for s in samples]), torch.float32)
    return RetrievalBatch(
        history=_block_kjt(keys, [history], [lengths], [len(keys)]),
        targets=_tensor(targets, torch.int64),
        item_key=schema.item_feature,
        timestamps=timestamps,
    )
