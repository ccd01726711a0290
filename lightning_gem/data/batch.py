"""Batch types: small dataclasses of tensors and ``KeyedJaggedTensor`` s that torchrec pipelines can move.

Both implement torchrec's ``Pipelineable`` (``to``, ``record_stream``, ``pin_memory``), so torchrec's
train pipelines can prefetch them to the device and overlap the embedding all-to-all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

__all__ = ["RankingBatch", "RetrievalBatch"]


class _PipelineableDataclass(Pipelineable):
    """``to`` / ``record_stream`` / ``pin_memory`` over every tensor-like field of a dataclass."""

    def _map(self, fn):
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Tensor, KeyedJaggedTensor)):
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device, non_blocking: bool = False):
        return self._map(lambda x: x.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Tensor, KeyedJaggedTensor)):
                value.record_stream(stream)

    def pin_memory(self):
        return self._map(lambda x: x.pin_memory())


@dataclass
class RankingBatch(_PipelineableDataclass):
    """A batch of ``B`` users, each with a jagged history and a jagged list of candidates (ads).

    Shapes (``T_h`` history events, ``C`` candidates over the batch):
        sequence_features: KJT of stride ``B``; the schema's history keys (lengths = history lengths,
            identical for every history key) followed by its candidate keys (lengths = candidates per user).
        pooled_features: KJT of stride ``B`` with the user-level multi-hot keys, or ``None``.
        dense_features: ``[B, num_dense]`` float, or ``None``.
        history_time_deltas: ``[T_h]`` float seconds between each event and the request, or ``None``.
        labels: ``[C, num_tasks]`` float in {0, 1} (task order from the schema).
        longest_history, most_candidates: the longest history and the most candidates of a user, known on the
            host (the collate sets them): a model takes them as kernel hints and the offsets as valid without
            reading them back from the device (no device sync). ``None``: not known.
    """

    sequence_features: KeyedJaggedTensor
    labels: Tensor
    history_key: str
    """A history key whose lengths are the history lengths."""
    candidate_key: str
    """A candidate key whose lengths are the candidate counts."""
    pooled_features: KeyedJaggedTensor | None = None
    dense_features: Tensor | None = None
    history_time_deltas: Tensor | None = None
    longest_history: int | None = None
    most_candidates: int | None = None

    @property
    def batch_size(self) -> int:
        return self.sequence_features.stride()

    @property
    def num_tokens(self) -> int:
        """History events plus candidates: the tokens the model processes."""
        return int(self.sequence_features[self.history_key].values().numel()) + int(self.labels.shape[0])

    def history_offsets(self) -> Tensor:
        """``[B + 1]`` int64 offsets of the histories."""
        return self.sequence_features[self.history_key].offsets().to(torch.int64)

    def candidate_offsets(self) -> Tensor:
        """``[B + 1]`` int64 offsets of the candidates."""
        return self.sequence_features[self.candidate_key].offsets().to(torch.int64)


@dataclass
class RetrievalBatch(_PipelineableDataclass):
    """A batch of ``B`` user sequences for next-item prediction.

    Shapes (``T`` events over the batch):
        history: KJT of stride ``B`` with the item key (and optional extra per-event keys), the inputs.
        targets: ``[T]`` int64, the next item after each input position; for evaluation batches the
            target of each sequence's last position is the held-out item that is ranked.
        timestamps: ``[T]`` float seconds of each event, or ``None``.
    """

    history: KeyedJaggedTensor
    targets: Tensor
    item_key: str = "item_id"
    timestamps: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.history.stride()

    @property
    def num_tokens(self) -> int:
        """Events over the batch."""
        return int(self.targets.numel())

    def offsets(self) -> Tensor:
        """``[B + 1]`` int64 offsets of the sequences."""
        return self.history[self.item_key].offsets().to(torch.int64)
