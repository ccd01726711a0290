"""Base Batch Shuffling: the partitioner, the cost model, the sampler's invariants, resumption and balance quality."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from lightning_gem.data.balancing import (
    AttentionCostModel,
    BalancedDistributedSampler,
    imbalance,
    partition_by_cost,
)


def _u3_lengths(num: int, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).random(num)
    return np.clip(4096 * u**3, 16, 4096).astype(np.int64)


def _ranks(lengths: np.ndarray, world: int, batch_size: int, **kwargs) -> list[list[int]]:
    """Each rank's epoch, from a sampler built independently on that rank."""
    return [
        list(BalancedDistributedSampler(lengths, batch_size, num_replicas=world, rank=r, **kwargs))
        for r in range(world)
    ]


def _plain_ranks(num: int, world: int, **kwargs) -> list[list[int]]:
    return [list(DistributedSampler(range(num), num_replicas=world, rank=r, **kwargs)) for r in range(world)]


def _global_batches(ranks: list[list[int]], batch_size: int) -> list[set[int]]:
    num = len(ranks[0])
    return [{i for rank in ranks for i in rank[s : s + batch_size]} for s in range(0, num, batch_size)]


@pytest.mark.parametrize("num_parts", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("part_size", [0, 1, 5])
def test_partition_is_an_exact_capacity_permutation(num_parts: int, part_size: int) -> None:
    costs = np.random.default_rng(num_parts).random(num_parts * part_size) ** 3
    parts = partition_by_cost(costs, num_parts, part_size)
    assert len(parts) == num_parts and all(len(p) == part_size for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(num_parts * part_size))
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_by_cost(costs, num_parts, part_size), strict=True))


def test_partition_balances_and_breaks_ties_stably() -> None:
    costs = AttentionCostModel()(_u3_lengths(256))
    loads = [costs[p].sum() for p in partition_by_cost(costs, 8, 32)]
    assert max(loads) / np.mean(loads) < 1.01
    # Swaps never make LPT worse.
    plain = [costs[p].sum() for p in partition_by_cost(costs, 8, 32, num_swaps=0)]
    assert max(loads) <= max(plain)
    assert [p.tolist() for p in partition_by_cost(np.ones(6), 3, 2)] == [[0, 3], [1, 4], [2, 5]]
    # One dominant item: the heaviest part is that item plus the lightest companions.
    parts = partition_by_cost(np.array([100.0, 1, 2, 3, 4, 5]), 2, 3)
    assert parts[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="costs"):
        partition_by_cost(np.ones(5), 2, 3)
    with pytest.raises(TypeError, match="num_parts"):
        partition_by_cost(np.ones(4), 2.0, 2)


def test_cost_model() -> None:
    model = AttentionCostModel.from_model(model_dim=256, num_layers=4)
    assert model.b / model.a == pytest.approx(AttentionCostModel().b / AttentionCostModel().a)
    assert model(np.array([10])).tolist() == [24 * 256**2 * 4 * 10 + 4 * 256 * 4 * 100]
    with pytest.raises(ValueError, match="`a` and `b`"):
        AttentionCostModel(a=0.0, b=0.0)
    # Any callable replaces it.
    ranks = _ranks(np.arange(1, 41), 2, 4, cost_model=lambda lengths: np.ones(len(lengths)))
    assert sorted(ranks[0] + ranks[1]) == list(range(40))
    with pytest.raises(ValueError, match="cost_model"):
        BalancedDistributedSampler(np.arange(8), 2, 1, 0, cost_model=lambda lengths: np.ones(3))


@pytest.mark.parametrize("world", range(1, 17))
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_invariants(world: int, drop_last: bool) -> None:
    num, batch_size, seed = 203, 4, 11
    lengths = _u3_lengths(num, seed=world)
    ranks = _ranks(lengths, world, batch_size, seed=seed, drop_last=drop_last)
    plain = _plain_ranks(num, world, seed=seed, drop_last=drop_last)
    global_batch = world * batch_size
    # Every rank yields the same number of samples, as many as the sampler says.
    assert {len(r) for r in ranks} == {
        len(BalancedDistributedSampler(lengths, batch_size, world, 0, drop_last=drop_last))
    }
    everything = [i for r in ranks for i in r]
    if drop_last:
        assert len(everything) == num // global_batch * global_batch and len(set(everything)) == len(everything)
    else:  # each sample once, padding by wrapping only up to a multiple of world (like DistributedSampler)
        assert set(everything) == set(range(num)) and len(everything) == -(-num // world) * world
    # Same global batches as the plain sampler (as sets), full batches of batch_size on every rank.
    balanced_batches = _global_batches(ranks, batch_size)
    plain_batches = _global_batches(plain, batch_size)[: len(balanced_batches)]
    assert balanced_batches == plain_batches
    for rank in ranks:
        full = num // global_batch * batch_size
        assert len(rank) in (full, full + (-(-num // world) - full) * (not drop_last))
    # Deterministic, and another epoch is another permutation.
    assert ranks == _ranks(lengths, world, batch_size, seed=seed, drop_last=drop_last)
    sampler = BalancedDistributedSampler(lengths, batch_size, world, 0, seed=seed, drop_last=drop_last)
    sampler.set_epoch(1)
    assert list(sampler) != ranks[0] or len(ranks[0]) <= 1


@pytest.mark.parametrize("world", [1, 3, 8])
def test_resume_mid_epoch_yields_the_remaining_batches(world: int) -> None:
    lengths, batch_size = _u3_lengths(150), 4
    for rank in range(world):
        sampler = BalancedDistributedSampler(lengths, batch_size, world, rank, seed=3)
        sampler.set_epoch(2)
        full = list(sampler)
        iterator = iter(sampler)
        taken = [next(iterator) for _ in range(2 * batch_size + 1)]  # two batches and part of a third
        state = sampler.state_dict()
        assert state["epoch"] == 2 and state["batches_consumed"] == 2 and taken == full[: len(taken)]
        restored = BalancedDistributedSampler(lengths, batch_size, world, rank, seed=99)
        restored.load_state_dict(state)
        restored.set_epoch(2)  # Lightning calls this at the epoch start: the resume survives it
        assert len(restored) == len(full) - 2 * batch_size
        assert list(restored) == full[2 * batch_size :]
        assert list(restored) == full  # only the first iteration after loading resumes
    with pytest.raises(ValueError, match="global_batch_size"):
        BalancedDistributedSampler(lengths, 8, world, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="batches_consumed"):
        BalancedDistributedSampler(lengths, batch_size, world, 0).load_state_dict({"epoch": 1})


def _mean_imbalance(lengths: np.ndarray, world: int = 8, batch_size: int = 32) -> tuple[float, float]:
    costs = AttentionCostModel()(lengths)
    full = len(lengths) // (world * batch_size) * batch_size  # full global batches only
    balanced = [r[:full] for r in _ranks(lengths, world, batch_size)]
    plain = [r[:full] for r in _plain_ranks(len(lengths), world, seed=0)]
    return imbalance(balanced, costs, batch_size).mean(), imbalance(plain, costs, batch_size).mean()


def test_balance_quality_on_heavy_tailed_lengths() -> None:
    balanced, plain = _mean_imbalance(_u3_lengths(8 * 32 * 20))
    print(f"u**3 lengths, 8 ranks x 32: balanced {balanced:.4f}, DistributedSampler {plain:.4f}")
    assert balanced <= 1.03 < plain


def test_balance_quality_on_movielens_1m(ml1m_dir) -> None:
    from lightning_gem.data import MovieLens1MSource

    lengths = MovieLens1MSource(path=str(ml1m_dir)).sample_lengths("train")
    balanced, plain = _mean_imbalance(lengths)
    print(f"ML-1M lengths, 8 ranks x 32: balanced {balanced:.4f}, DistributedSampler {plain:.4f}")
    assert balanced <= 1.03 < plain


def test_imbalance_and_argument_checks() -> None:
    assert imbalance([[0], [1]], np.array([2.0, 2.0]), 1).tolist() == [1.0]
    assert imbalance([[0], [1]], np.zeros(2), 1).tolist() == [1.0]
    with pytest.raises(ValueError, match="lengths"):
        BalancedDistributedSampler(np.zeros((2, 2)), 1, 1, 0)
    with pytest.raises(ValueError, match="batch_size"):
        BalancedDistributedSampler(np.ones(4), 0, 1, 0)


def test_datamodule_balances_train_only_when_asked() -> None:
    from torch.utils.data import SequentialSampler

    from lightning_gem.data import GEMDataModule, SyntheticRankingSource

    source = SyntheticRankingSource(num_items=200, num_train_users=100, num_val_users=30, num_test_users=20)
    balanced, plain = (
        GEMDataModule(source=source, batch_size=16),
        GEMDataModule(source=source, batch_size=16, balance=False),
    )
    assert isinstance(balanced.train_dataloader().sampler, BalancedDistributedSampler)
    assert type(plain.train_dataloader().sampler) is DistributedSampler
    assert isinstance(balanced.val_dataloader().sampler, SequentialSampler)
    # One replica: the same batches as sets, in the same order of steps.
    batches = [set(b) for b in balanced.train_dataloader().batch_sampler]
    assert batches == [set(b) for b in plain.train_dataloader().batch_sampler]
