"""Token-budget batching: the packer's invariants, the sampler across ranks, and GEMDataModule(max_tokens=...)."""

from __future__ import annotations

import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gem.data import GEMDataModule, RankingBatch, SyntheticRankingSource
from lightning_gem.data.balancing import AttentionCostModel
from lightning_gem.data.token_budget import TokenBudgetSampler, pack_by_tokens


def _u3_lengths(num: int, seed: int = 0, longest: int = 1024) -> np.ndarray:
    u = np.random.default_rng(seed).random(num)
    return np.clip(longest * u**3, 1, longest).astype(np.int64)


@pytest.mark.parametrize("num_parts", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("max_batch_size", [None, 4])
def test_packing_covers_every_sample_once_under_the_caps(num_parts: int, max_batch_size: int | None) -> None:
    lengths = _u3_lengths(500, seed=num_parts)
    costs = AttentionCostModel()(lengths)
    order = np.random.default_rng(1).permutation(len(lengths))
    steps = pack_by_tokens(order, lengths, costs, 2048, num_parts, max_batch_size=max_batch_size, drop_last=True)
    assert all(len(step) == num_parts for step in steps)
    parts = [part for step in steps for part in step]
    assert all(len(part) >= 1 and lengths[part].sum() <= 2048 for part in parts)
    if max_batch_size is not None:
        assert max(len(part) for part in parts) <= max_batch_size
    seen = np.concatenate(parts)
    assert len(seen) == len(set(seen.tolist()))  # no repeats
    # Only a tail of fewer than num_parts samples may be dropped.
    assert len(lengths) - len(seen) < num_parts
    again = pack_by_tokens(order, lengths, costs, 2048, num_parts, max_batch_size=max_batch_size, drop_last=True)
    assert all(np.array_equal(a, b) for s, t in zip(steps, again, strict=True) for a, b in zip(s, t, strict=True))


def test_packing_fills_the_budget_and_balances_ranks() -> None:
    lengths = _u3_lengths(4000, longest=4096)
    costs = AttentionCostModel()(lengths)
    steps = pack_by_tokens(np.arange(len(lengths)), lengths, costs, 8192, 8, drop_last=True)
    tokens = np.array([[lengths[part].sum() for part in step] for step in steps[:-2]])
    loads = np.array([[costs[part].sum() for part in step] for step in steps[:-2]])
    # Steps use most of the 8 x 8192 token budget (a fixed batch size would have to assume the worst case).
    assert tokens.sum(axis=1).mean() / (8 * 8192) > 0.85
    # Heavy users are paired with light ones: the slowest rank is close to the mean.
    assert np.mean(loads.max(axis=1) / loads.mean(axis=1)) < 1.15


def test_packing_tail_is_padded_or_dropped_and_errors_name_the_argument() -> None:
    lengths = np.full(9, 5)  # 8 fill the first step (4 parts x 10 tokens), one is left for the tail
    padded = pack_by_tokens(np.arange(9), lengths, lengths.astype(float), 10, 4)
    assert [sorted(np.concatenate(step).tolist()) for step in padded] == [list(range(8)), [0, 1, 2, 8]]
    assert all(len(part) == 1 for part in padded[-1])
    dropped = pack_by_tokens(np.arange(9), lengths, lengths.astype(float), 10, 4, drop_last=True)
    assert len(dropped) == 1
    with pytest.raises(ValueError, match="max_tokens"):
        pack_by_tokens(np.arange(5), np.array([1, 2, 30, 4, 5]), np.ones(5), 10, 2)
    with pytest.raises(ValueError, match="num_parts"):
        pack_by_tokens(np.arange(5), lengths, np.ones(5), 10, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudgetSampler(np.array([3, 40]), max_tokens=32, num_replicas=1, rank=0)


@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_independent_rank_samplers_agree_cover_the_epoch_and_resume(world: int) -> None:
    lengths = _u3_lengths(700, seed=world)
    ranks = [TokenBudgetSampler(lengths, 1024, num_replicas=world, rank=r, seed=4) for r in range(world)]
    for sampler in ranks:
        sampler.set_epoch(2)
    epochs = [list(sampler) for sampler in ranks]
    assert len({len(epoch) for epoch in epochs}) == 1 and len(epochs[0]) == len(ranks[0])
    flat = [i for epoch in epochs for batch in epoch for i in batch]
    assert sorted(set(flat)) == list(range(len(lengths)))  # every sample, and only padding repeats
    assert len(flat) - len(lengths) < world
    assert all(lengths[batch].sum() <= 1024 for epoch in epochs for batch in epoch)
    # Another epoch is another packing; the same epoch is the same.
    ranks[0].set_epoch(3)
    assert list(ranks[0]) != epochs[0]
    ranks[0].set_epoch(2)
    assert list(ranks[0]) == epochs[0]
    # Resume after k batches on a fresh sampler: the rest of the epoch, exactly.
    iterator = iter(ranks[-1])
    k = len(epochs[-1]) // 2
    for _ in range(k):
        next(iterator)
    state = ranks[-1].state_dict()
    assert state["batches_consumed"] == k
    fresh = TokenBudgetSampler(lengths, 1024, num_replicas=world, rank=world - 1, seed=4)
    fresh.load_state_dict(state)
    assert list(fresh) == epochs[-1][k:]
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudgetSampler(lengths, 2048, num_replicas=world, rank=0).load_state_dict(state)


SOURCE = {"num_items": 200, "num_train_users": 300, "num_val_users": 16, "num_test_users": 16}


class _Recorder(L.LightningModule):
    """Trains one parameter; records each training batch's users and tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, ...]] = []
        self.tokens: list[int] = []

    def training_step(self, batch: RankingBatch, batch_idx: int) -> torch.Tensor:
        self.seen.append(tuple(batch.sequence_features.values().tolist()))
        self.tokens.append(int(batch.history_offsets()[-1]))
        return (self.weight - batch.labels.float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def sample_cost_model(self) -> AttentionCostModel:
        return AttentionCostModel(a=0.0, b=1.0)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_datamodule_token_budget_trains_under_the_cap_and_resumes_mid_epoch(tmp_path) -> None:
    source = SyntheticRankingSource(**SOURCE)
    max_tokens = int(source.sample_lengths("train").max()) * 3

    def data() -> GEMDataModule:
        return GEMDataModule(source=source, batch_size=64, seed=5, max_tokens=max_tokens)

    full = _Recorder()
    _trainer(max_epochs=2, enable_checkpointing=False).fit(full, datamodule=data())
    steps_per_epoch = len(full.seen) // 2
    assert max(full.tokens) <= max_tokens and len(set(map(len, full.seen))) > 1  # variable batch sizes
    assert sum(len(batch) > 0 for batch in full.seen[:steps_per_epoch]) == steps_per_epoch
    # The module's cost model reached the sampler.
    datamodule = data()
    datamodule.trainer = _trainer()
    datamodule.trainer.strategy.connect(_Recorder())
    assert datamodule._cost_model()(np.array([3])).tolist() == [9.0]

    stop = steps_per_epoch + steps_per_epoch // 2
    first = _Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=stop, save_top_k=-1)
    _trainer(max_epochs=2, max_steps=stop, callbacks=[checkpoint]).fit(first, datamodule=data())
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["GEMDataModule"]
    assert state["max_tokens"] == max_tokens and state["batches_trained"] == stop - steps_per_epoch
    second = _Recorder()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        _trainer(max_epochs=2, enable_checkpointing=False).fit(
            second, datamodule=data(), ckpt_path=tmp_path / "mid.ckpt"
        )
    assert first.seen + second.seen == full.seen
    with pytest.raises(ValueError, match="max_tokens"):
        GEMDataModule(source=source, batch_size=64, max_tokens=max_tokens + 1).load_state_dict(state)
