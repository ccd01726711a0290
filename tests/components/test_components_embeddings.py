"""torchrec embedding builders: shared tables, jagged outputs, pooled outputs, errors."""

from __future__ import annotations

import pytest
import torch
from lightning_gem.components.embeddings import (
    TableConfig,
    build_embedding_bag_collection,
    build_embedding_collection,
    concat_sequence_embeddings,
    tables_from_features,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_gem.data.schema import SparseFeature


def _features() -> list[SparseFeature]:
    return [
        SparseFeature(name="hist_item", num_embeddings=30, table="item"),
        SparseFeature(name="hist_action", num_embeddings=4),
        SparseFeature(name="cand_item", num_embeddings=30, table="item"),
    ]


def test_features_sharing_a_table_share_weights() -> None:
    tables = tables_from_features(_features(), embedding_dim=6, init_scale=0.1)
    assert [(t.name, t.feature_names) for t in tables] == [
        ("item", ("hist_item", "cand_item")),
        ("hist_action", ("hist_action",)),
    ]
    ec = build_embedding_collection(tables)
    assert isinstance(ec, EmbeddingCollection)
    assert float(ec.embeddings["item"].weight.detach().abs().max()) <= 0.1
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["hist_item", "hist_action", "cand_item"],
        values=torch.tensor([3, 7, 1, 2, 3, 7]),
        lengths=torch.tensor([2, 0, 2, 0, 1, 1]),  # B = 2: histories [2, 0], candidates [1, 1]
    )
    out = ec(kjt)
    history = concat_sequence_embeddings(out, ["hist_item", "hist_action"])
    assert history.shape == (2, 12)
    torch.testing.assert_close(out["cand_item"].values(), out["hist_item"].values())  # ids 3, 7 in one table
    assert out["hist_item"].lengths().tolist() == [2, 0]
    history.sum().backward()
    assert ec.embeddings["item"].weight.grad[[3, 7]].abs().sum() > 0


def test_pooled_collection_and_meta_device() -> None:
    tables = [TableConfig(name="tags", num_embeddings=10, embedding_dim=4, feature_names=("tags",))]
    ebc = build_embedding_bag_collection(tables, pooling="mean")
    assert isinstance(ebc, EmbeddingBagCollection)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["tags"], values=torch.tensor([1, 2, 5]), lengths=torch.tensor([2, 0, 1])
    )
    pooled = ebc(kjt).values()
    assert pooled.shape == (3, 4)
    weight = ebc.embedding_bags["tags"].weight
    torch.testing.assert_close(pooled[0], weight[[1, 2]].mean(0))
    torch.testing.assert_close(pooled[1], torch.zeros(4))
    meta = build_embedding_collection(tables, device="meta")
    assert meta.embeddings["tags"].weight.is_meta


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="num_embeddings"):
        tables_from_features(
            [
                SparseFeature(name="a", num_embeddings=3, table="t"),
                SparseFeature(name="b", num_embeddings=4, table="t"),
            ],
            4,
        )
    with pytest.raises(ValueError, match="unique"):
        tables_from_features([SparseFeature(name="a", num_embeddings=3)] * 2, 4)
    with pytest.raises(ValueError, match="one embedding_dim"):
        build_embedding_collection(
            [
                TableConfig(name="a", num_embeddings=3, embedding_dim=4, feature_names=("a",)),
                TableConfig(name="b", num_embeddings=3, embedding_dim=8, feature_names=("b",)),
            ]
        )
    with pytest.raises(ValueError, match="not in the embeddings"):
        concat_sequence_embeddings({}, ["missing"])
