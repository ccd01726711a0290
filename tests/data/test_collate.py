"""Collation: the exact KJT layout on hand-made samples, empty histories, errors, torchrec compatibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from lightning_gem.data import (
    RankingSample,
    RankingSchema,
    RetrievalSample,
    RetrievalSchema,
    SparseFeature,
    SyntheticRankingSource,
    collate_ranking,
    collate_retrieval,
)

SCHEMA = RankingSchema(
    history_features=(
        SparseFeature(name="item", num_embeddings=10, table="items"),
        SparseFeature(name="action", num_embeddings=3),
    ),
    candidate_features=(SparseFeature(name="cand", num_embeddings=10, table="items"),),
    pooled_features=(SparseFeature(name="tags", num_embeddings=5),),
    num_dense=2,
    has_time=True,
    tasks=("ctr", "cvr"),
)


def _sample(history: list[tuple[int, int]], candidates: list[int], tags: list[int]) -> RankingSample:
    return RankingSample(
        history=np.array(history, dtype=np.int64).reshape(-1, 2),
        candidates=np.array(candidates, dtype=np.int64)[:, None],
        labels=np.array([[1.0, 0.0]] * len(candidates), dtype=np.float32),
        pooled=(np.array(tags, dtype=np.int64),),
        dense=np.array([0.5, -1.0], dtype=np.float32),
        time_deltas=np.arange(len(history), 0, -1).astype(np.float32),
    )


def test_ranking_layout_is_key_major(check_ranking_batch) -> None:
    samples = [_sample([(1, 0), (2, 1)], [7], [0, 4]), _sample([], [8, 9], []), _sample([(3, 2)], [6], [3])]
    batch = collate_ranking(samples, SCHEMA)
    check_ranking_batch(batch, SCHEMA)
    kjt = batch.sequence_features
    assert kjt.values().tolist() == [1, 2, 3, 0, 1, 2, 7, 8, 9, 6]
    assert kjt.lengths().tolist() == [2, 0, 1, 2, 0, 1, 1, 2, 1]
    assert kjt.lengths().dtype == torch.int32 and kjt.values().dtype == torch.int64
    assert batch.history_offsets().tolist() == [0, 2, 2, 3]
    assert batch.candidate_offsets().tolist() == [0, 1, 3, 4]
    assert batch.pooled_features["tags"].lengths().tolist() == [2, 0, 1]
    assert batch.history_time_deltas.tolist() == [2.0, 1.0, 1.0]
    assert batch.dense_features.shape == (3, 2)
    assert batch.num_tokens == 3 + 4
    assert (batch.longest_history, batch.most_candidates) == (2, 2)  # host ints: kernel hints without a sync


def test_ranking_batch_feeds_torchrec_modules() -> None:
    source = SyntheticRankingSource(num_items=100, num_train_users=8, num_val_users=2, num_test_users=2)
    batch = source.collate([source.dataset("train")[i] for i in range(8)])
    schema = source.schema
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name="item", embedding_dim=4, num_embeddings=100, feature_names=["item_id", "candidate_item_id"]
            ),
            EmbeddingConfig(name="action", embedding_dim=4, num_embeddings=3, feature_names=["action_type"]),
        ]
    )
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f.name, embedding_dim=4, num_embeddings=f.num_embeddings, feature_names=[f.name])
            for f in schema.pooled_features
        ]
    )
    sequences = ec(batch.sequence_features)
    assert sequences["item_id"].values().shape == (int(batch.history_offsets()[-1]), 4)
    assert sequences["candidate_item_id"].values().shape == (batch.labels.shape[0], 4)
    assert ebc(batch.pooled_features).values().shape == (8, 4 * len(schema.pooled_features))
    moved = batch.to(torch.device("cpu"))
    assert torch.equal(moved.labels, batch.labels)


def test_retrieval_layout() -> None:
    schema = RetrievalSchema(num_items=10, extra={"rating": 5})
    samples = [
        RetrievalSample(history=np.array([[1, 4], [2, 3]]), targets=np.array([2, 9])),
        RetrievalSample(history=np.array([[5, 0]]), targets=np.array([6])),
    ]
    batch = collate_retrieval(samples, schema)
    assert batch.history.keys() == ["item_id", "rating"]
    assert batch.history.values().tolist() == [1, 2, 5, 4, 3, 0]
    assert batch.offsets().tolist() == [0, 2, 3]
    assert batch.targets.tolist() == [2, 9, 6] and batch.timestamps is None


def test_collate_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="samples"):
        collate_ranking([], SCHEMA)
    with pytest.raises(TypeError, match="RankingSample"):
        collate_ranking([RetrievalSample(history=np.zeros((1, 1), np.int64), targets=np.zeros(1, np.int64))], SCHEMA)
    bad = _sample([(1, 0)], [7, 8], [0])._replace(labels=np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="labels"):
        collate_ranking([bad], SCHEMA)
    wide = _sample([(1, 0)], [7], [0])._replace(history=np.zeros((1, 3), np.int64))
    with pytest.raises(ValueError, match="history"):
        collate_ranking([wide], SCHEMA)
    with pytest.raises(ValueError, match="targets"):
        collate_retrieval(
            [RetrievalSample(history=np.zeros((2, 1), np.int64), targets=np.zeros(1, np.int64))],
            RetrievalSchema(num_items=3),
        )
