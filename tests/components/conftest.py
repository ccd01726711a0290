"""Hand-made batches for the component tests (no dependency on the data sources)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_gem.data.batch import RankingBatch, RetrievalBatch
from lightning_gem.data.schema import RankingSchema, RetrievalSchema, SparseFeature

NUM_ITEMS = 50


def ranking_schema(
    *, pooled: bool = True, num_dense: int = 3, has_time: bool = True, tasks=("ctr", "cvr")
) -> RankingSchema:
    return RankingSchema(
        history_features=(
            SparseFeature(name="hist_item", num_embeddings=NUM_ITEMS, table="item"),
            SparseFeature(name="hist_action", num_embeddings=4),
        ),
        candidate_features=(SparseFeature(name="cand_item", num_embeddings=NUM_ITEMS, table="item"),),
        pooled_features=(SparseFeature(name="user_tags", num_embeddings=20),) if pooled else (),
        num_dense=num_dense,
        has_time=has_time,
        tasks=tuple(tasks),
        max_history_length=16,
    )


def make_ranking_batch(
    schema: RankingSchema,
    history_lengths: Sequence[int],
    candidate_counts: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    learnable: bool = False,
) -> RankingBatch:
    """A RankingBatch; with ``learnable`` every task's label is 1 iff the candidate's item id is even."""
    g = generator or torch.Generator().manual_seed(0)
    hist_len = torch.tensor(history_lengths, dtype=torch.int64)
    cand_len = torch.tensor(candidate_counts, dtype=torch.int64)
    num_hist, num_cand = int(hist_len.sum()), int(cand_len.sum())
    values, lengths, keys = [], [], []
    hist_items = torch.randint(0, NUM_ITEMS, (num_hist,), generator=g)
    for f in schema.history_features:
        keys.append(f.name)
        values.append(
            hist_items if f.name == "hist_item" else torch.randint(0, f.num_embeddings, (num_hist,), generator=g)
        )
        lengths.append(hist_len)
    cand_items = torch.randint(0, NUM_ITEMS, (num_cand,), generator=g)
    labels = torch.randint(0, 2, (num_cand, len(schema.tasks)), generator=g).float()
    if learnable:
        labels[:] = (cand_items % 2 == 0).float()[:, None]
    for f in schema.candidate_features:
        keys.append(f.name)
        values.append(
            cand_items if f.name == "cand_item" else torch.randint(0, f.num_embeddings, (num_cand,), generator=g)
        )
        lengths.append(cand_len)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    pooled = None
    if schema.pooled_features:
        pooled_len = torch.randint(0, 3, (len(history_lengths) * len(schema.pooled_features),), generator=g)
        pooled = KeyedJaggedTensor.from_lengths_sync(
            keys=[f.name for f in schema.pooled_features],
            values=torch.randint(0, 20, (int(pooled_len.sum()),), generator=g),
            lengths=pooled_len,
        )
    return RankingBatch(
        sequence_features=kjt,
        labels=labels,
        history_key=schema.history_features[0].name,
        candidate_key=schema.candidate_features[0].name,
        pooled_features=pooled,
        dense_features=torch.randn(len(history_lengths), schema.num_dense, generator=g) if schema.num_dense else None,
        history_time_deltas=torch.rand(num_hist, generator=g) * 1e6 if schema.has_time else None,
    )


def retrieval_schema() -> RetrievalSchema:
    return RetrievalSchema(num_items=NUM_ITEMS, max_history_length=16, extra={"rating": 6})


def make_retrieval_batch(
    schema: RetrievalSchema,
    lengths: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    learnable: bool = False,
) -> RetrievalBatch:
    """A RetrievalBatch; with ``learnable`` every sequence counts up: item i is followed by i + 1."""
    g = generator or torch.Generator().manual_seed(0)
    lens = torch.tensor(lengths, dtype=torch.int64)
    items, targets = [], []
    for n in lengths:
        if learnable:
            start = int(torch.randint(0, schema.num_items, (1,), generator=g))
            seq = (torch.arange(n + 1) + start) % schema.num_items
        else:
            seq = torch.randint(0, schema.num_items, (n + 1,), generator=g)
        items.append(seq[:-1])
        targets.append(seq[1:])
    item_values = torch.cat(items) if items else torch.zeros(0, dtype=torch.int64)
    keys, values, all_lengths = [schema.item_feature], [item_values], [lens]
    for name, size in schema.extra.items():
        keys.append(name)
        values.append(torch.randint(0, size, (item_values.numel(),), generator=g))
        all_lengths.append(lens)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(all_lengths))
    timestamps = torch.cat([torch.sort(torch.rand(n, generator=g) * 1e5).values for n in lengths])
    return RetrievalBatch(
        history=kjt,
        targets=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.int64),
        item_key=schema.item_feature,
        timestamps=timestamps,
    )


def _quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU Trainer that writes and prints nothing: no logger, checkpoints, progress bar or model summary."""
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.fixture
def quiet_trainer():
    """:func:`_quiet_trainer`, as a fixture (test modules do not import conftest)."""
    return _quiet_trainer


@pytest.fixture
def batches() -> SimpleNamespace:
    """The helpers above, as a fixture (test modules do not import conftest)."""
    return SimpleNamespace(
        NUM_ITEMS=NUM_ITEMS,
        ranking_schema=ranking_schema,
        make_ranking_batch=make_ranking_batch,
        retrieval_schema=retrieval_schema,
        make_retrieval_batch=make_retrieval_batch,
    )
