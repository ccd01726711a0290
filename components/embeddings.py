"""Sparse embedding modules built from typed table configs: torchrec ``EmbeddingCollection`` (per-token,
jagged) and ``EmbeddingBagCollection`` (pooled).

Features that name the same ``SparseFeature.table`` share one table (torchrec's
``EmbeddingConfig(feature_names=[...])``), e.g. a history item id and a candidate item id. The builders
return plain torchrec modules: keep them as direct attributes of the model so torchrec's sharders find
and shard them in place later. torchrec is imported here and not by the package root.

Example:
    >>> import torch
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> from lightning_gem.data.schema import SparseFeature
    >>> from lightning_gem.components.embeddings import (
    ...     build_embedding_collection, concat_sequence_embeddings, tables_from_features)
    >>> features = [SparseFeature(name="hist_item", num_embeddings=100, table="item"),
    ...             SparseFeature(name="cand_item", num_embeddings=100, table="item")]
    >>> tables = tables_from_features(features, embedding_dim=8)
    >>> [(t.name, t.feature_names) for t in tables]
    [('item', ('hist_item', 'cand_item'))]
    >>> ec = build_embedding_collection(tables)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["hist_item", "cand_item"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 1, 1, 1]))
    >>> concat_sequence_embeddings(ec(kjt), ["hist_item"]).shape
    torch.Size([3, 8])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from lightning_gem.data.schema import SparseFeature

__all__ = [
    "TableConfig",
    "build_embedding_bag_collection",
    "build_embedding_collection",
    "concat_sequence_embeddings",
    "tables_from_features",
]


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table and the features that look it up."""

    name: str
    """Table name (unique within a collection)."""
    num_embeddings: int
    """Rows; ids lie in ``[0, num_embeddings)``."""
    embedding_dim: int
    """Columns."""
    feature_names: tuple[str, ...]
    """KJT keys looked up in this table; each produces one output of the same name."""
    init_scale: float | None = None
    """Rows initialised uniform in ``[-init_scale, init_scale]``; ``None``: torchrec's default
    ``sqrt(1 / num_embeddings)``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("`name` must be a non-empty string")
        if self.num_embeddings < 1:
            raise ValueError(f"`num_embeddings` of table {self.name!r} must be >= 1, got {self.num_embeddings}")
        if self.embedding_dim < 1:
            raise ValueError(f"`embedding_dim` of table {self.name!r} must be >= 1, got {self.embedding_dim}")
        if not self.feature_names:
            raise ValueError(f"`feature_names` of table {self.name!r} must name at least one feature")
        if self.init_scale is not None and self.init_scale <= 0:
            raise ValueError(f"`init_scale` of table {self.name!r} must be > 0, got {self.init_scale}")

    def _init_kwargs(self) -> dict[str, float]:
        if self.init_scale is None:
            return {}
        return {"weight_init_min": -self.init_scale, "weight_init_max": self.init_scale}


def tables_from_features(
    features: Sequence[SparseFeature], embedding_dim: int, *, init_scale: float | None = None
) -> list[TableConfig]:
    """Group features by ``SparseFeature.table_name`` into tables, in order of first appearance.

    Args:
        features: the features to embed; features with the same table name share a table.
        embedding_dim: the width of every table.
        init_scale: see :attr:`TableConfig.init_scale`.

    Raises:
        ValueError: duplicate feature names, or features of one table disagreeing on ``num_embeddings``.
    """
    names = [f.name for f in features]
    if len(set(names)) != len(names):
        raise ValueError(f"feature names must be unique, got {names}")
    grouped: dict[str, list[SparseFeature]] = {}
    for feature in features:
        group = grouped.setdefault(feature.table_name, [])
        if group and group[0].num_embeddings != feature.num_embeddings:
            raise ValueError(
                f"features sharing table {feature.table_name!r} must agree on num_embeddings, got "
                f"{group[0].num_embeddings} ({group[0].name!r}) and {feature.num_embeddings} ({feature.name!r})"
            )
        group.append(feature)
    return [
        TableConfig(
            name=table,
            num_embeddings=group[0].num_embeddings,
            embedding_dim=embedding_dim,
            feature_names=tuple(f.name for f in group),
            init_scale=init_scale,
        )
        for table, group in grouped.items()
    ]


def _check_tables(tables: Sequence[TableConfig]) -> None:
    if not tables:
        raise ValueError("`tables` must hold at least one TableConfig")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    features = [f for t in tables for f in t.feature_names]
    if len(set(features)) != len(features):
        raise ValueError(f"a feature may be looked up in one table only, got {features}")


def build_embedding_collection(
    tables: Sequence[TableConfig], device: torch.device | str | None = None
) -> EmbeddingCollection:
    """A torchrec ``EmbeddingCollection``: one ``[L, dim]`` embedding per id, output per feature as a
    ``JaggedTensor`` with the input's lengths.

    torchrec requires one width for all tables of an ``EmbeddingCollection``.

    Args:
        tables: the tables (see :func:`tables_from_features`).
        device: where the weights are created (``"meta"`` for deferred init by a sharder).
    """
    _check_tables(tables)
    dims = {t.embedding_dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"all tables of an EmbeddingCollection must have one embedding_dim, got {sorted(dims)}")
    configs = [
        EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
            **t._init_kwargs(),
        )
        for t in tables
    ]
    return EmbeddingCollection(tables=configs, device=torch.device(device) if device is not None else None)


def build_embedding_bag_collection(
    tables: Sequence[TableConfig],
    device: torch.device | str | None = None,
    pooling: Literal["sum", "mean"] = "sum",
) -> EmbeddingBagCollection:
    """A torchrec ``EmbeddingBagCollection``: the ids of each (sample, feature) pooled to one vector.

    Args:
        tables: the tables (see :func:`tables_from_features`).
        device: where the weights are created.
        pooling: ``"sum"`` or ``"mean"`` over each bag (an empty bag pools to zeros).
    """
    _check_tables(tables)
    if pooling not in ("sum", "mean"):
        raise ValueError(f"`pooling` must be 'sum' or 'mean', got {pooling!r}")
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
            pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            **t._init_kwargs(),
        )
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device) if device is not None else None)


def concat_sequence_embeddings(embeddings: Mapping[str, JaggedTensor], keys: Sequence[str]) -> Tensor:
    """Concatenate per-token embeddings of features with identical lengths: ``[T, len(keys) * dim]``.

    Args:
        embeddings: an ``EmbeddingCollection`` output (feature name -> ``JaggedTensor`` of ``[T, dim]``), or
            a sharded collection's awaitable of it.
        keys: the features to concatenate, in order; all must have the same ``T``.
    """
    if not keys:
        raise ValueError("`keys` must name at least one feature")
    if not isinstance(embeddings, Mapping):
        # A sharded collection's output, torchrec's LazyAwaitable: attribute access waits once and caches.
        embeddings = dict(embeddings.items())
    missing = [k for k in keys if k not in embeddings]
    if missing:
        raise ValueError(f"features {missing} are not in the embeddings (have {sorted(embeddings)})")
    values = [embeddings[k].values() for k in keys]
    rows = {v.shape[0] for v in values}
    if len(rows) != 1:
        raise ValueError(
            f"features {list(keys)} must have the same number of tokens, got {[v.shape[0] for v in values]}"
        )
    return values[0] if len(values) == 1 else torch.cat(values, dim=1)
