"""Typed descriptions of the features a data source produces and a model consumes.

A DataModule exposes its schema (``datamodule.schema``); models take it as a constructor argument, so
the same model class trains on synthetic data, MovieLens or a user's own source. The LightningCLI links
``data.schema`` to ``model.schema`` when both are instantiated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankingSchema", "RetrievalSchema", "SparseFeature"]


@dataclass(frozen=True, kw_only=True)
class SparseFeature:
    """One sparse id feature (a key of a ``KeyedJaggedTensor``)."""

    name: str
    """The KJT key."""
    num_embeddings: int
    """Ids lie in ``[0, num_embeddings)``."""
    table: str = ""
    """Embedding table name; features with the same table share embeddings. Empty: the feature's name."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("`name` must be a non-empty string")
        if self.num_embeddings < 1:
            raise ValueError(f"`num_embeddings` of feature {self.name!r} must be >= 1, got {self.num_embeddings}")

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True, kw_only=True)
class RankingSchema:
    """Features of a multi-task ranking batch (:class:`~lightning_gem.data.batch.RankingBatch`).

    History features are per history event (all with the same per-user lengths); candidate features
    are per candidate (ad) of the user; pooled features are user-level multi-hot ids that an
    ``EmbeddingBagCollection`` pools.
    """

    history_features: tuple[SparseFeature, ...]
    """Per-event sparse features of the user history, e.g. item id and action type."""
    candidate_features: tuple[SparseFeature, ...]
    """Per-candidate sparse features, usually sharing tables with history features."""
    pooled_features: tuple[SparseFeature, ...] = ()
    """User-level multi-hot features, pooled."""
    num_dense: int = 0
    """Width of ``dense_features``."""
    has_time: bool = False
    """Whether batches carry ``history_time_deltas`` (seconds between each event and the request)."""
    tasks: tuple[str, ...] = ("ctr", "cvr")
    """Label columns, in order."""
    max_history_length: int = 256
    """Longest history a batch may hold (after truncation to the most recent events)."""

    def __post_init__(self) -> None:
        if not self.history_features:
            raise ValueError("`history_features` must name at least one feature")
        if not self.candidate_features:
            raise ValueError("`candidate_features` must name at least one feature")
        names = [f.name for f in self.all_features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        if not self.tasks:
            raise ValueError("`tasks` must name at least one task")
        if self.max_history_length < 1:
            raise ValueError(f"`max_history_length` must be >= 1, got {self.max_history_length}")
        tables: dict[str, int] = {}
        for feature in self.all_features:
            size = tables.setdefault(feature.table_name, feature.num_embeddings)
            if size != feature.num_embeddings:
                raise ValueError(
                    f"features sharing table {feature.table_name!r} must agree on num_embeddings, got {size} and "
                    f"{feature.num_embeddings} ({feature.name!r})"
                )

    @property
    def all_features(self) -> tuple[SparseFeature, ...]:
        return self.history_features + self.candidate_features + self.pooled_features

    @property
    def sequence_features(self) -> tuple[SparseFeature, ...]:
        """The features of ``RankingBatch.sequence_features`` (history, then candidates)."""
        return self.history_features + self.candidate_features


@dataclass(frozen=True, kw_only=True)
class RetrievalSchema:
    """Features of a next-item retrieval batch (:class:`~lightning_gem.data.batch.RetrievalBatch`)."""

    num_items: int
    """Item ids lie in ``[0, num_items)``; the catalogue ranked at evaluation."""
    max_history_length: int = 200
    """Longest input sequence (the most recent events are kept)."""
    item_feature: str = "item_id"
    """The KJT key of the item ids."""
    extra: dict[str, int] = field(default_factory=dict)
    """Optional other per-event features: KJT key -> num_embeddings."""

    def __post_init__(self) -> None:
        if self.num_items < 2:
            raise ValueError(f"`num_items` must be >= 2, got {self.num_items}")
        if self.max_history_length < 1:
            raise ValueError(f"`max_history_length` must be >= 1, got {self.max_history_length}")
