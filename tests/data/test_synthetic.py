"""Synthetic sources: determinism, batch validity, the shape of the data, and that the labels are learnable."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from lightning_gem.data import SyntheticRankingSource, SyntheticRetrievalSource

SMALL = {"num_items": 300, "num_train_users": 400, "num_val_users": 100, "num_test_users": 100}


@pytest.fixture(scope="module")
def default_source() -> SyntheticRankingSource:
    """The embedded default (20,000 train users), built once and timed."""
    source = SyntheticRankingSource()
    start = time.perf_counter()
    source.arrays("train")
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"building the default synthetic source took {elapsed:.1f} s"
    return source


def _all_arrays(source) -> list[np.ndarray]:
    out = []
    for split in ("train", "val", "test"):
        a = source.arrays(split)
        for value in vars(a).values():
            out.extend(value if isinstance(value, tuple) else [value])
    return [np.asarray(x) for x in out if x is not None]


def test_ranking_is_deterministic_by_seed() -> None:
    first, second = SyntheticRankingSource(**SMALL, seed=3), SyntheticRankingSource(**SMALL, seed=3)
    for x, y in zip(_all_arrays(first), _all_arrays(second), strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(first.oracle_probabilities("val"), second.oracle_probabilities("val"))
    other = SyntheticRankingSource(**SMALL, seed=4)
    assert not np.array_equal(first.arrays("train").history, other.arrays("train").history)


def test_retrieval_is_deterministic_by_seed() -> None:
    first, second = SyntheticRetrievalSource(num_users=100, seed=1), SyntheticRetrievalSource(num_users=100, seed=1)
    for x, y in zip(_all_arrays(first), _all_arrays(second), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(
        first.arrays("test").items, SyntheticRetrievalSource(num_users=100, seed=2).arrays("test").items
    )


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_ranking_batches_are_valid(split: str, check_ranking_batch) -> None:
    source = SyntheticRankingSource(**SMALL, min_history_length=1, max_history_length=64)
    dataset = source.dataset(split)
    assert len(dataset) == SMALL[f"num_{split}_users"]
    for start in range(0, len(dataset), 37):
        batch = source.collate([dataset[i] for i in range(start, min(start + 37, len(dataset)))])
        check_ranking_batch(batch, source.schema)
    one = source.collate([dataset[-1]])
    check_ranking_batch(one, source.schema)
    assert one.batch_size == 1


def test_ranking_batch_matches_the_arrays() -> None:
    source = SyntheticRankingSource(**SMALL)
    arrays, dataset = source.arrays("val"), source.dataset("val")
    batch = source.collate([dataset[i] for i in (5, 0, 7)])
    history = np.concatenate([arrays.history[arrays.history_starts[i] : arrays.history_ends[i]] for i in (5, 0, 7)])
    np.testing.assert_array_equal(batch.sequence_features["item_id"].values().numpy(), history[:, 0])
    np.testing.assert_array_equal(batch.sequence_features["action_type"].values().numpy(), history[:, 1])
    lengths = source.sample_lengths("val")[[5, 0, 7]]
    np.testing.assert_array_equal(batch.sequence_features["item_id"].lengths().numpy(), lengths)
    counts = source.num_candidates("val")[[5, 0, 7]]
    np.testing.assert_array_equal(batch.sequence_features["candidate_item_id"].lengths().numpy(), counts)


def test_ranking_data_has_the_promised_shape(default_source: SyntheticRankingSource) -> None:
    lengths = default_source.sample_lengths("train")
    assert lengths.dtype == np.int64 and lengths.shape == (20000,)
    assert lengths.min() >= 4 and lengths.max() <= 256
    assert np.median(lengths) < 0.5 * lengths.mean() + 10  # heavy-tailed: the mean is pulled up by the tail
    assert np.percentile(lengths, 99) > 200
    candidates = default_source.num_candidates("train")
    assert 8 <= candidates.mean() <= 12 and candidates.min() >= 1 and candidates.max() <= 32
    labels = default_source.arrays("train").labels
    assert 0.15 <= labels[:, 0].mean() <= 0.35
    assert 0.0 < labels[:, 1].mean() < labels[:, 0].mean()
    assert (labels[:, 1] <= labels[:, 0]).all()
    actions = default_source.arrays("train").history[:, 1]
    assert set(np.unique(actions)) == {0, 1, 2}
    sample = default_source.dataset("train")[int(np.argmax(lengths))]
    assert (np.diff(sample.time_deltas) < 0).all(), "time deltas must grow with distance from the request"


def test_oracle_beats_features_without_history(default_source: SyntheticRankingSource) -> None:
    """Learnability: the hidden model's AUC is high; a logistic regression on pooled + dense features is far lower."""
    val = default_source.arrays("val")
    labels = torch.from_numpy(val.labels[:, 0]).long()
    oracle_auc = binary_auroc(torch.from_numpy(default_source.oracle_probabilities("val")[:, 0]), labels).item()
    cvr_auc = binary_auroc(
        torch.from_numpy(default_source.oracle_probabilities("val")[:, 1]), torch.from_numpy(val.labels[:, 1]).long()
    ).item()

    def user_features(split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        a = default_source.arrays(split)
        tags = torch.from_numpy(a.pooled_values[1])
        owner = torch.repeat_interleave(torch.arange(a.num_samples), torch.from_numpy(np.diff(a.pooled_offsets[1])))
        x = torch.zeros(a.num_samples, default_source.num_segments + default_source.num_interest_tags)
        x[torch.arange(a.num_samples), torch.from_numpy(a.pooled_values[0])] = 1.0
        x.index_put_((owner, default_source.num_segments + tags), torch.tensor(1.0), accumulate=True)
        x = torch.cat([x, torch.from_numpy(a.dense)], dim=1)
        counts = torch.from_numpy(np.diff(a.candidate_offsets))
        positives = torch.zeros(a.num_samples).index_add_(
            0, torch.repeat_interleave(torch.arange(a.num_samples), counts), torch.from_numpy(a.labels[:, 0])
        )
        return x, positives, counts.float(), counts

    # Logistic regression on user-level features = a binomial model per user (the same likelihood as per row).
    x, positives, counts, _ = user_features("train")
    linear = torch.nn.Linear(x.shape[1], 1)
    optimizer = torch.optim.LBFGS(linear.parameters(), max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logit = linear(x).squeeze(1)
        loss = (counts * torch.nn.functional.softplus(logit) - positives * logit).sum() / counts.sum()
        loss = loss + 1e-4 * linear.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    x_val, _, _, counts_val = user_features("val")
    with torch.no_grad():
        scores = torch.repeat_interleave(linear(x_val).squeeze(1), counts_val)
    lr_auc = binary_auroc(scores, labels).item()
    print(
        f"synthetic val CTR AUC: oracle {oracle_auc:.3f}, LR(pooled+dense) {lr_auc:.3f}; oracle CVR AUC {cvr_auc:.3f}"
    )
    assert oracle_auc >= 0.85
    assert cvr_auc >= 0.85
    assert 0.52 <= lr_auc <= 0.65
    assert oracle_auc - lr_auc >= 0.2


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_retrieval_batches_are_valid(split: str, check_retrieval_batch) -> None:
    source = SyntheticRetrievalSource(num_users=200, max_history_length=30)
    dataset = source.dataset(split)
    assert len(dataset) == 200
    batch = source.collate([dataset[i] for i in range(len(dataset))])
    check_retrieval_batch(batch, source.schema)
    assert batch.timestamps.shape == batch.targets.shape
    np.testing.assert_array_equal(source.sample_lengths(split), np.diff(batch.offsets().numpy()))


def test_retrieval_leave_one_out_targets() -> None:
    source = SyntheticRetrievalSource(num_users=50, max_history_length=1000)
    items = source.arrays("test").items[:, 0]
    for split, drop in (("train", 3), ("val", 2), ("test", 1)):
        arrays = source.arrays(split)
        ends = source.arrays("test").ends  # test inputs end one before each user's last event
        np.testing.assert_array_equal(arrays.ends, ends - (drop - 1))
        sample = source.dataset(split)[0]
        assert sample.targets[-1] == items[arrays.ends[0]]
    assert source.dataset("test")[0].targets[-1] == items[source.arrays("test").ends[0]]


def test_retrieval_has_structure() -> None:
    """Next items repeat topics/successors far above chance, so a sequence model has something to learn."""
    source = SyntheticRetrievalSource()
    sample_items = source.arrays("train").items[:, 0]
    transitions = set(zip(sample_items[:-1].tolist(), sample_items[1:].tolist(), strict=True))
    assert len(transitions) < 0.5 * (len(sample_items) - 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"num_items": 0}, ValueError, "num_items"),
        ({"num_train_users": 1.5}, TypeError, "num_train_users"),
        ({"min_history_length": 0}, ValueError, "min_history_length"),
        ({"min_history_length": 300}, ValueError, "min_history_length"),
        ({"click_rate": 1.5}, ValueError, "click_rate"),
        ({"mean_candidates": 100.0}, ValueError, "mean_candidates"),
        ({"num_segments": 5}, ValueError, "num_segments"),
    ],
)
def test_ranking_arguments_are_checked(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        SyntheticRankingSource(**kwargs)


def test_bad_split_and_index() -> None:
    source = SyntheticRankingSource(**SMALL)
    with pytest.raises(ValueError, match="split"):
        source.dataset("training")
    with pytest.raises(IndexError):
        source.dataset("val")[100]
    with pytest.raises(ValueError, match="samples"):
        source.collate([])
