"""Fixtures of the data tests: the shared MovieLens folder (skipped when absent) and small sources."""

from __future__ import annotations

from pathlib import Path

import pytest

# The public data sets live beside the repository (../shared/data), never inside it.
SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _folder(name: str) -> Path:
    folder = SHARED_DATA / name
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent: MovieLens tests read the public data set from ../shared/data/{name}")
    return folder


@pytest.fixture(scope="session")
def ml1m_dir() -> Path:
    return _folder("ml-1m")


@pytest.fixture(scope="session")
def ml100k_dir() -> Path:
    return _folder("ml-100k")


def _check_ranking_batch(batch, schema) -> None:
    """Every invariant a RankingBatch of ``schema`` promises (offsets, lengths, ids, labels, shapes)."""
    import torch

    from lightning_gem import jagged
    from lightning_gem.data import RankingBatch

    assert isinstance(batch, RankingBatch)
    kjt = batch.sequence_features
    assert kjt.keys() == [f.name for f in schema.sequence_features]
    b = batch.batch_size
    history_offsets, candidate_offsets = batch.history_offsets(), batch.candidate_offsets()
    jagged.validate_offsets(history_offsets)
    jagged.validate_offsets(candidate_offsets, num_values=batch.labels.shape[0])
    assert history_offsets.numel() == b + 1 and candidate_offsets.numel() == b + 1
    for feature in schema.history_features:
        assert torch.equal(kjt[feature.name].offsets().to(torch.int64), history_offsets)
    for feature in schema.candidate_features:
        assert torch.equal(kjt[feature.name].offsets().to(torch.int64), candidate_offsets)
    for feature in schema.sequence_features:
        jagged.check_ids(kjt[feature.name].values(), feature.num_embeddings, feature.name)
    assert int((history_offsets[1:] - history_offsets[:-1]).max()) <= schema.max_history_length
    assert batch.labels.dtype == torch.float32 and batch.labels.shape[1] == len(schema.tasks)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    if "cvr" in schema.tasks:
        ctr, cvr = batch.labels[:, schema.tasks.index("ctr")], batch.labels[:, schema.tasks.index("cvr")]
        assert bool((cvr <= ctr).all())
    if schema.pooled_features:
        assert batch.pooled_features.keys() == [f.name for f in schema.pooled_features]
        assert batch.pooled_features.stride() == b
        for feature in schema.pooled_features:
            jagged.check_ids(batch.pooled_features[feature.name].values(), feature.num_embeddings, feature.name)
    if schema.num_dense:
        assert batch.dense_features.shape == (b, schema.num_dense)
        assert bool(torch.isfinite(batch.dense_features).all())
    if schema.has_time:
        assert batch.history_time_deltas.shape == (int(history_offsets[-1]),)
        assert bool((batch.history_time_deltas > 0).all())


def _check_retrieval_batch(batch, schema) -> None:
    import torch

    from lightning_gem import jagged
    from lightning_gem.data import RetrievalBatch

    assert isinstance(batch, RetrievalBatch)
    offsets = batch.offsets()
    jagged.validate_offsets(offsets, num_values=batch.targets.numel())
    assert batch.history.keys() == [schema.item_feature, *schema.extra]
    assert int((offsets[1:] - offsets[:-1]).min()) >= 1
    assert int((offsets[1:] - offsets[:-1]).max()) <= schema.max_history_length
    jagged.check_ids(batch.history[schema.item_feature].values(), schema.num_items, "history")
    jagged.check_ids(batch.targets, schema.num_items, "targets")
    assert batch.targets.dtype == torch.int64
    # Within a sequence the target of position t is the input of position t + 1.
    items = batch.history[schema.item_feature].values()
    inner = torch.ones_like(batch.targets, dtype=torch.bool)
    inner[offsets[1:] - 1] = False
    assert torch.equal(batch.targets[inner], items[1:][inner[:-1]])


@pytest.fixture(scope="session")
def check_ranking_batch():
    return _check_ranking_batch


@pytest.fixture(scope="session")
def check_retrieval_batch():
    return _check_retrieval_batch
