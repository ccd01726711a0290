"""The data-source interface and the flat-array datasets every built-in source uses.

A source owns the data of one task and exposes four things:

- ``schema``: a :class:`RankingSchema` or :class:`RetrievalSchema` (models are built from it);
- ``dataset(split)``: a map-style ``torch.utils.data.Dataset`` with one sample per item, for ``split``
  in ``"train"``, ``"val"``, ``"test"``;
- ``collate(samples)``: packs samples into a :class:`RankingBatch` / :class:`RetrievalBatch`;
- ``sample_lengths(split)``: ``[N]`` int64 history length of every sample, read from offsets without
  building samples (the load-balancing sampler's cost input).

Data lives in flat numpy arrays: per-event rows shared by all samples plus ``[N]`` start/end pointers,
so a sample is a few slices (histories of one user's successive samples overlap without copies), and
collation is vectorized (:mod:`lightning_gem.data.collate`). Sources build their arrays lazily, once,
on first use; constructors only store (and check) their typed arguments, so LightningCLI can
instantiate them from YAML.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from lightning_gem.data.batch import RankingBatch, RetrievalBatch
from lightning_gem.data.collate import RankingSample, RetrievalSample, collate_ranking, collate_retrieval
from lightning_gem.data.schema import RankingSchema, RetrievalSchema

__all__ = [
    "SPLITS",
    "DataSource",
    "RankingArrays",
    "RankingDataset",
    "RankingSource",
    "RetrievalArrays",
    "RetrievalDataset",
    "RetrievalSource",
    "check_split",
    "leave_one_out_windows",
]

SPLITS = ("train", "val", "test")


def check_split(split: object) -> str:
    """Return ``split`` if it is one of ``"train"``, ``"val"``, ``"test"``; else raise ``ValueError``."""
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
    return split  # type: ignore[return-value]


def _check_train_windows(train_windows: object) -> str:
    """Return ``train_windows`` if it is ``"last"`` or ``"all"`` (see :func:`leave_one_out_windows`)."""
    if train_windows not in ("last", "all"):
        raise ValueError(f"`train_windows` must be 'last' or 'all', got {train_windows!r}")
    return train_windows  # type: ignore[return-value]


def _check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"`{name}` must be {bound}, got {value}")
    return int(value)


def _check_range(ids: np.ndarray, num_embeddings: int, what: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise ValueError(f"{what} must lie in [0, {num_embeddings}), got [{int(ids.min())}, {int(ids.max())}]")


def _check_pointers(starts: np.ndarray, ends: np.ndarray, num_rows: int, what: str) -> None:
    if starts.shape != ends.shape or starts.ndim != 1:
        raise ValueError(f"{what} starts/ends must be matching [N] arrays, got {starts.shape} and {ends.shape}")
    if starts.size and (starts.min() < 0 or ends.max() > num_rows or (ends < starts).any()):
        raise ValueError(f"{what} start/end pointers must satisfy 0 <= start <= end <= {num_rows}")


def _check_index(index: int, size: int) -> int:
    if not -size <= index < size:
        raise IndexError(f"sample index {index} out of range for {size} samples")
    return index + size if index < 0 else index


class DataSource(abc.ABC):
    """What :class:`~lightning_gem.data.GEMDataModule` needs from a source of samples.

    Subclass :class:`RankingSource` or :class:`RetrievalSource` to get ``dataset``, ``collate`` and
    ``sample_lengths`` from flat arrays; implement this class directly for anything else.
    """

    @property
    @abc.abstractmethod
    def schema(self) -> RankingSchema | RetrievalSchema:
        """The features of the batches this source's ``collate`` produces."""

    @abc.abstractmethod
    def dataset(self, split: str) -> Dataset:
        """The map-style dataset of ``split`` (``"train"``, ``"val"`` or ``"test"``), one user per item."""

    @abc.abstractmethod
    def collate(self, samples: Sequence) -> RankingBatch | RetrievalBatch:
        """Pack samples of :meth:`dataset` into a batch."""

    @abc.abstractmethod
    def sample_lengths(self, split: str) -> np.ndarray:
        """``[N]`` int64 history length of each sample of ``split``, without building the samples."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RankingArrays:
    """Flat arrays of one ranking split (``N`` samples, ``T`` event rows, ``C`` candidates).

    Shapes:
        history: ``[T, F_h]`` int64 event rows; sample ``i``'s history is
            ``history[history_starts[i]:history_ends[i]]`` (oldest first, already truncated).
        history_starts, history_ends: ``[N]`` int64 row pointers.
        candidate_offsets: ``[N + 1]`` int64 offsets into ``candidates`` and ``labels``.
        candidates: ``[C, F_c]`` int64.
        labels: ``[C, num_tasks]`` float32.
        pooled_offsets, pooled_values: one ``[N + 1]`` / ``[P_k]`` pair per pooled feature.
        dense: ``[N, num_dense]`` float32 or ``None``.
        event_times: ``[T]`` float64 seconds of each event row, or ``None``.
        request_times: ``[N]`` float64 seconds of each sample's request; a time delta is
            ``request_times[i] - event_times[row]``.
    """

    history: np.ndarray
    history_starts: np.ndarray
    history_ends: np.ndarray
    candidate_offsets: np.ndarray
    candidates: np.ndarray
    labels: np.ndarray
    pooled_offsets: tuple[np.ndarray, ...] = ()
    pooled_values: tuple[np.ndarray, ...] = ()
    dense: np.ndarray | None = None
    event_times: np.ndarray | None = None
    request_times: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.history_starts.shape[0])

    def validate(self, schema: RankingSchema) -> None:
        """Check shapes, pointers and id ranges against ``schema`` (once, when a source is built).

        Raises:
            ValueError: naming the array that is wrong.
        """
        n = self.num_samples
        _check_pointers(self.history_starts, self.history_ends, len(self.history), "history")
        if (self.history_ends - self.history_starts).max(initial=0) > schema.max_history_length:
            raise ValueError(f"histories must be truncated to max_history_length={schema.max_history_length}")
        offsets = self.candidate_offsets
        if offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != len(self.candidates):
            raise ValueError(f"`candidate_offsets` must be [{n + 1}] from 0 to {len(self.candidates)}")
        if (np.diff(offsets) < 0).any():
            raise ValueError("`candidate_offsets` must be non-decreasing")
        if self.labels.shape != (len(self.candidates), len(schema.tasks)):
            raise ValueError(f"`labels` must be [{len(self.candidates)}, {len(schema.tasks)}], got {self.labels.shape}")
        if not np.isin(self.labels, (0.0, 1.0)).all():
            raise ValueError("`labels` must lie in {0, 1}")
        for column, feature in enumerate(schema.history_features):
            _check_range(self.history[:, column], feature.num_embeddings, f"history feature {feature.name!r}")
        for column, feature in enumerate(schema.candidate_features):
            _check_range(self.candidates[:, column], feature.num_embeddings, f"candidate feature {feature.name!r}")
        if len(self.pooled_offsets) != len(schema.pooled_features):
            raise ValueError(f"need {len(schema.pooled_features)} pooled features, got {len(self.pooled_offsets)}")
        for off, values, feature in zip(self.pooled_offsets, self.pooled_values, schema.pooled_features, strict=True):
            if off.shape != (n + 1,) or off[-1] != len(values):
                raise ValueError(f"pooled feature {feature.name!r} offsets must be [{n + 1}] ending at {len(values)}")
            _check_range(values, feature.num_embeddings, f"pooled feature {feature.name!r}")
        if schema.num_dense and (self.dense is None or self.dense.shape != (n, schema.num_dense)):
            raise ValueError(f"`dense` must be [{n}, {schema.num_dense}]")
        if schema.has_time and (self.event_times is None or self.request_times is None):
            raise ValueError("schema.has_time needs `event_times` and `request_times`")


class RankingDataset(Dataset):
    """Map-style dataset over :class:`RankingArrays`; item ``i`` is a :class:`RankingSample` of views."""

    def __init__(self, arrays: RankingArrays) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return self.arrays.num_samples

    def __getitem__(self, index: int) -> RankingSample:
        a = self.arrays
        index = _check_index(index, len(self))
        start, end = a.history_starts[index], a.history_ends[index]
        c0, c1 = a.candidate_offsets[index], a.candidate_offsets[index + 1]
        time_deltas = None
        if a.event_times is not None and a.request_times is not None:
            time_deltas = (a.request_times[index] - a.event_times[start:end]).astype(np.float32)
        return RankingSample(
            history=a.history[start:end],
            candidates=a.candidates[c0:c1],
            labels=a.labels[c0:c1],
            pooled=tuple(v[o[index] : o[index + 1]] for o, v in zip(a.pooled_offsets, a.pooled_values, strict=True)),
            dense=None if a.dense is None else a.dense[index],
            time_deltas=time_deltas,
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class RetrievalArrays:
    """Flat arrays of one retrieval split (``N`` samples over ``T`` event rows).

    Sample ``i``'s inputs are rows ``[starts[i], ends[i])`` and its targets the item ids of rows
    ``[starts[i] + 1, ends[i] + 1)``: the next event of each input (rows of one user are contiguous).

    Shapes:
        items: ``[T, F]`` int64: item id column, then the schema's extra columns.
        starts, ends: ``[N]`` int64.
        timestamps: ``[T]`` float32 seconds or ``None``.
    """

    items: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    timestamps: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.starts.shape[0])

    def validate(self, schema: RetrievalSchema) -> None:
        """Check pointers, truncation and id ranges against ``schema``."""
        _check_pointers(self.starts, self.ends, len(self.items) - 1, "sequence")
        if (self.ends - self.starts).max(initial=0) > schema.max_history_length:
            raise ValueError(f"sequences must be truncated to max_history_length={schema.max_history_length}")
        _check_range(self.items[:, 0], schema.num_items, f"feature {schema.item_feature!r}")
        for column, (key, size) in enumerate(schema.extra.items(), start=1):
            _check_range(self.items[:, column], size, f"feature {key!r}")


class RetrievalDataset(Dataset):
    """Map-style dataset over :class:`RetrievalArrays`; item ``i`` is a :class:`RetrievalSample`."""

    def __init__(self, arrays: RetrievalArrays) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return self.arrays.num_samples

    def __getitem__(self, index: int) -> RetrievalSample:
        a = self.arrays
        index = _check_index(index, len(self))
        start, end = a.starts[index], a.ends[index]
        return RetrievalSample(
            history=a.items[start:end],
            targets=a.items[start + 1 : end + 1, 0],
            timestamps=None if a.timestamps is None else a.timestamps[start:end],
        )


class _ArraySource(DataSource):
    """Caches ``_build()`` (split -> arrays), validated against the schema once."""

    _built: dict | None = None

    @abc.abstractmethod
    def _build(self) -> dict:
        """Build the arrays of every split: ``{"train": ..., "val": ..., "test": ...}``."""

    def arrays(self, split: str) -> RankingArrays | RetrievalArrays:
        """The flat arrays behind ``dataset(split)`` (built on first call)."""
        check_split(split)
        if self._built is None:
            built = self._build()
            for arrays in built.values():
                arrays.validate(self.schema)
            self._built = built
        return self._built[split]


class RankingSource(_ArraySource):
    """A source of :class:`RankingBatch` es built from :class:`RankingArrays` (implement ``_build``)."""

    @property
    @abc.abstractmethod
    def schema(self) -> RankingSchema: ...

    def dataset(self, split: str) -> RankingDataset:
        return RankingDataset(self.arrays(split))

    def collate(self, samples: Sequence[RankingSample]) -> RankingBatch:
        return collate_ranking(samples, self.schema)

    def sample_lengths(self, split: str) -> np.ndarray:
        arrays = self.arrays(split)
        return (arrays.history_ends - arrays.history_starts).astype(np.int64)

    def num_candidates(self, split: str) -> np.ndarray:
        """``[N]`` int64 candidates of each sample of ``split``."""
        return np.diff(self.arrays(split).candidate_offsets).astype(np.int64)


class RetrievalSource(_ArraySource):
    """A source of :class:`RetrievalBatch` es built from :class:`RetrievalArrays` (implement ``_build``)."""

    @property
    @abc.abstractmethod
    def schema(self) -> RetrievalSchema: ...

    def dataset(self, split: str) -> RetrievalDataset:
        return RetrievalDataset(self.arrays(split))

    def collate(self, samples: Sequence[RetrievalSample]) -> RetrievalBatch:
        return collate_retrieval(samples, self.schema)

    def sample_lengths(self, split: str) -> np.ndarray:
        arrays = self.arrays(split)
        return (arrays.ends - arrays.starts).astype(np.int64)


def leave_one_out_windows(
    sequence_offsets: np.ndarray,
    split: str,
    max_history_length: int,
    train_on_validation_item: bool = False,
    train_windows: str = "last",
) -> tuple[np.ndarray, np.ndarray]:
    """Input windows of the leave-one-out protocol over user sequences stored back to back.

    For a user sequence ``s`` of length ``n`` (rows ``[o, o + n)``):

    - ``"train"``: the training sequence is ``s[:-2]``; inputs ``s[:-3]``, targets ``s[1:-2]``. With
      ``train_on_validation_item`` (the HSTU reference recipe, which trains on every item but the test one):
      the training sequence is ``s[:-1]``, inputs ``s[:-2]``, targets ``s[1:-1]``, so validation then scores
      an item the model was trained on;
    - ``"val"``: inputs ``s[:-2]``, targets ``s[1:-1]`` (the last target ``s[-2]`` is held out);
    - ``"test"``: inputs ``s[:-1]``, targets ``s[1:]`` (the last target ``s[-1]`` is held out).

    Inputs keep the most recent ``max_history_length`` events; users with no input in a split are left
    out of it (so every user with ``n >= 4`` is in all three). With ``train_windows="all"``, a training
    sequence longer than that also yields the windows before its most recent one, back to its start
    (consecutive, not overlapping, each ``max_history_length`` inputs but the first), so every training
    target of every user is trained on once per epoch instead of only the most recent ones.

    Args:
        sequence_offsets: ``[U + 1]`` int64 offsets of the users' sequences.
        split: ``"train"``, ``"val"`` or ``"test"``.
        max_history_length: longest input window.
        train_on_validation_item: train on the validation item too (see ``"train"``).
        train_windows: ``"last"`` (each user's most recent window) or ``"all"`` (see above); ``"train"`` only.

    Returns:
        ``(starts, ends)``, ``[N]`` int64 each, for :class:`RetrievalArrays` (a user's windows are adjacent,
        oldest first).
    """
    _check_train_windows(train_windows)
    drop = {"train": 2 if train_on_validation_item else 3, "val": 2, "test": 1}[check_split(split)]
    begins, ends = sequence_offsets[:-1].astype(np.int64), sequence_offsets[1:].astype(np.int64) - drop
    keep = ends > begins
    begins, ends = begins[keep], ends[keep]
    if split != "train" or train_windows == "last":
        return np.maximum(begins, ends - max_history_length), ends
    counts = -((begins - ends) // max_history_length)  # windows per user: ceil(inputs / max_history_length)
    user = np.repeat(np.arange(len(ends)), counts)
    back = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0 = the most recent
    window_ends = ends[user] - (counts[user] - 1 - back) * max_history_length
    return np.maximum(begins[user], window_ends - max_history_length), window_ends
