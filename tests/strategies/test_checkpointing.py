"""Automatic activation checkpointing: measured budgets, optimality against brute force, in-place application."""

from __future__ import annotations

import copy
import itertools
import pickle
import random

import pytest
import torch
import torch.nn.functional as F
from lightning_gem.strategies.activation_checkpointing import (
    ActivationCheckpointPlan,
    CandidateStats,
    apply_activation_checkpointing,
    checkpointed_modules,
    compile_memory_budget,
    default_checkpoint_candidates,
    measure_step_memory,
    plan_activation_checkpointing,
    remove_activation_checkpointing,
)
from lightning_gem.strategies.activation_checkpointing import planner as ckpt
from torch import nn

NUM_TOKENS, DIM = 512, 16
HIDDEN = (64, 256, 128, 32, 192)  # per block: the hidden width ...
EXTRA = (0, 2, 1, 3, 0)  # ... and extra saved [T, hidden] activations: distinct bytes-per-FLOP ratios


class Block(nn.Module):
    """``x + b(sin^k(dropout(relu(a(x)))))``: saves ``(2 + k) * T * hidden`` floats (ReLU output,
    dropout mask, and the input of each ``sin``; the bytes are known in advance)."""

    def __init__(self, hidden: int, extra: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)
        self.extra = extra
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(torch.relu(self.a(x)))
        for _ in range(self.extra):
            h = torch.sin(h)
        return x + self.b(h)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, DIM)
        self.blocks = nn.ModuleList(Block(h, k, dropout) for h, k in zip(HIDDEN, EXTRA, strict=True))
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _toy(dropout: float = 0.0):
    net = Net(dropout)
    ids, x = torch.randint(0, 10, (NUM_TOKENS,)), torch.randn(NUM_TOKENS, DIM)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        net(ids, x).square().mean().backward()

    return net, step


def _measured_peak(net: nn.Module, step, names) -> int:
    remove_activation_checkpointing(net)
    ckpt._checkpoint_names(net, names)
    try:
        return measure_step_memory(step, "cpu").peak
    finally:
        remove_activation_checkpointing(net)


def test_default_candidates_are_the_blocks_and_the_parts_around_them() -> None:
    net, step = _toy()
    assert default_checkpoint_candidates(net) == ["embed", *[f"blocks.{i}" for i in range(5)], "out"]
    plan = plan_activation_checkpointing(net, step, 1.0, log=False)
    assert plan.chosen == ()
    assert plan.skipped == {"embed": "no floating-point input", "out": "frees nothing"}


def test_measured_saved_bytes_and_flops_match_the_blocks() -> None:
    net, step = _toy()
    plan = plan_activation_checkpointing(net, step, 1.0, log=False)
    for stats, hidden, extra in zip(plan.candidates, HIDDEN, EXTRA, strict=True):
        # ReLU output (shared with the no-op dropout) and each sin input; a's input and the weights are excluded.
        assert stats.saved_bytes == stats.freed_bytes == (1 + extra) * NUM_TOKENS * hidden * 4
        assert stats.forward_flops == 2 * 2 * NUM_TOKENS * DIM * hidden


def test_plan_meets_the_budget_and_recomputes_the_least_it_can() -> None:
    net, step = _toy()
    plan = plan_activation_checkpointing(net, step, 0.8, log=False)
    assert plan.budget == int(0.8 * plan.unconstrained_peak)
    assert plan.chosen and plan.predicted_peak <= plan.budget
    assert _measured_peak(net, step, plan.chosen) <= plan.budget

    # Brute force over every subset, each measured: the peak model never predicts below the measurement,
    # and no subset that recomputes fewer FLOPs fits the budget.
    stats = plan.candidates
    for size in range(len(stats) + 1):
        for members in itertools.combinations(range(len(stats)), size):
            names = [stats[j].name for j in members]
            measured = _measured_peak(net, step, names)
            assert max(plan.outside_peak, ckpt._predicted_peak(stats, members)) >= measured, names
            if sum(stats[j].forward_flops for j in members) < plan.recompute_flops:
                assert measured > plan.budget, names


def test_byte_budget() -> None:
    net, step = _toy()
    peak = plan_activation_checkpointing(net, step, 1.0, log=False).unconstrained_peak
    plan = plan_activation_checkpointing(net, step, peak - 500_000, cost="time", log=False)
    assert plan.budget == peak - 500_000 and plan.chosen and plan.cost == "time"
    assert all(c.forward_seconds > 0 for c in plan.candidates)
    assert plan.compile_budget_fraction == pytest.approx(plan.budget / plan.unconstrained_peak)  # CPU: baseline 0
    assert _measured_peak(net, step, plan.chosen) <= plan.budget


def test_knapsack_is_exact_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        stats = []
        for i in range(n):
            saved = rng.randint(1, 100)
            stats.append(
                CandidateStats(
                    name=str(i),
                    saved_bytes=saved,
                    freed_bytes=rng.randint(1, saved),
                    backward_peak=rng.randint(100, 400),
                    forward_flops=rng.randint(0, 50),
                )
            )
        budget = rng.randint(50, 400)
        costs = [(s.forward_flops, s.saved_bytes) for s in stats]

        def total(members: tuple[int, ...], costs=costs) -> tuple[int, int]:
            return (sum(costs[j][0] for j in members), sum(costs[j][1] for j in members))

        fitting = [
            members
            for size in range(n + 1)
            for members in itertools.combinations(range(n), size)
            if ckpt._predicted_peak(stats, members) <= budget
        ]
        got = ckpt._cheapest(stats, costs, budget)
        if not fitting:
            assert got is None
            continue
        assert got is not None and ckpt._predicted_peak(stats, got) <= budget
        assert total(got) == min(map(total, fitting))
        lowest = ckpt._lowest_peak(stats)
        assert ckpt._predicted_peak(stats, lowest) == min(ckpt._predicted_peak(stats, m) for m in fitting)


def test_infeasible_budget_raises_or_warns_with_the_lowest_peak() -> None:
    net, step = _toy()
    with pytest.raises(ValueError, match="out of reach"):
        plan_activation_checkpointing(net, step, 0.05, log=False)
    with pytest.warns(UserWarning, match="out of reach"):
        plan = plan_activation_checkpointing(net, step, 0.05, log=False, on_infeasible="warn")
    assert not plan.fits and plan.chosen
    assert plan.predicted_peak < plan.unconstrained_peak
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        plan_activation_checkpointing(net, step, 1.5, log=False)
    with pytest.raises(ValueError, match="bytes"):
        plan_activation_checkpointing(net, step, 0, log=False)
    with pytest.raises(TypeError, match="budget"):
        plan_activation_checkpointing(net, step, True, log=False)
    with pytest.raises(ValueError, match="no submodule 'blocks.9'"):
        plan_activation_checkpointing(net, step, 0.5, candidates=["blocks.9"], log=False)
    with pytest.raises(ValueError, match="must not nest"):
        plan_activation_checkpointing(net, step, 0.5, candidates=["blocks", "blocks.1"], log=False)


def test_apply_is_in_place_idempotent_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    net, step = _toy(dropout=0.3)
    reference = copy.deepcopy(net)
    keys = list(net.state_dict())
    plan = plan_activation_checkpointing(net, step, 0.75, log=False)
    apply_activation_checkpointing(net, plan)
    apply_activation_checkpointing(net, plan)
    assert checkpointed_modules(net) == list(plan.chosen)
    assert list(net.state_dict()) == keys
    assert all(isinstance(net.get_submodule(n), Block) for n in plan.chosen)
    assert type(net.get_submodule(plan.chosen[0])).__name__ == "CheckpointedBlock"

    ids, x = torch.randint(0, 10, (NUM_TOKENS,)), torch.randn(NUM_TOKENS, DIM)
    for model in (net, reference):
        model.zero_grad(set_to_none=True)  # planning ran steps on net
        torch.manual_seed(1)  # the same dropout masks; the checkpoint replays them when it recomputes
        model(ids, x).square().mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)

    # A copy and a pickle round trip stay checkpointed; another plan replaces this one.
    assert checkpointed_modules(copy.deepcopy(net)) == list(plan.chosen)
    assert checkpointed_modules(pickle.loads(pickle.dumps(net))) == list(plan.chosen)
    other = ActivationCheckpointPlan(**{**plan.__dict__, "chosen": ("blocks.0",)})
    apply_activation_checkpointing(net, other)
    assert checkpointed_modules(net) == ["blocks.0"]
    remove_activation_checkpointing(net)
    assert checkpointed_modules(net) == [] and type(net.blocks[0]) is Block


def test_compile_memory_budget_sets_and_restores_the_config() -> None:
    config = torch._functorch.config
    before = config.activation_memory_budget
    with compile_memory_budget(0.25):
        assert config.activation_memory_budget == 0.25
        with pytest.raises(RuntimeError), compile_memory_budget(0.0):
            assert config.activation_memory_budget == 0.0
            raise RuntimeError
        assert config.activation_memory_budget == 0.25
    assert config.activation_memory_budget == before
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="fraction"), compile_memory_budget(bad):
            pass


def test_compile_memory_budget_makes_the_partitioner_recompute() -> None:
    def saved_bytes(fraction: float) -> int:
        torch._dynamo.reset()
        net = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        compiled = torch.compile(net, backend="aot_eager_decomp_partition")
        x = torch.randn(256, DIM)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size() if not isinstance(t, nn.Parameter) else 0
            return t

        with compile_memory_budget(fraction), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compiled(x).sum().backward()
        return total

    assert saved_bytes(0.0) < saved_bytes(1.0)


def test_plan_on_gem_ranker() -> None:
    from lightning_gem.components import GEMRanker

    from lightning_gem.data import GEMDataModule, SyntheticRankingSource

    source = SyntheticRankingSource(
        num_items=200, num_train_users=32, num_val_users=4, num_test_users=4, max_history_length=32
    )
    data = GEMDataModule(source=source, batch_size=16, balance=False)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = GEMRanker(source.schema, embedding_dim=8, model_dim=16, num_layers=3, attention_impl="reference")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()

    step()
    candidates = default_checkpoint_candidates(model)
    assert {"encoder.layers.0", "encoder.layers.2", "interaction", "head", "sequence_embeddings"} <= set(candidates)
    assert "encoder" not in candidates
    plan = plan_activation_checkpointing(model, step, 0.75, log=False)
    assert plan.skipped["sequence_embeddings"] == "no floating-point input"  # never recompute a lookup
    assert [c.name for c in plan.candidates][:3] == [f"encoder.layers.{i}" for i in range(3)]
    layers = plan.candidates[:3]
    assert len({c.saved_bytes for c in layers}) == 1 and len({c.forward_flops for c in layers}) == 1
    assert all(c.forward_flops > 0 for c in layers)  # the GDPA flop formula counts
    assert plan.chosen and plan.predicted_peak <= plan.budget
    keys = list(model.state_dict())
    torch.manual_seed(0)
    step()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    apply_activation_checkpointing(model, plan)
    assert list(model.state_dict()) == keys
    assert measure_step_memory(step, "cpu").peak <= plan.budget
    for name, grad in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, msg=name)
    assert "encoder.layers.0" in plan.summary() and "recompute" in str(plan)


def test_checkpointed_blocks_trace_under_compile() -> None:
    net, _ = _toy()
    reference = copy.deepcopy(net)
    ckpt._checkpoint_names(net, ["blocks.1", "blocks.2"])
    ids, x = torch.randint(0, 10, (NUM_TOKENS,)), torch.randn(NUM_TOKENS, DIM)
    torch.compile(net, backend="aot_eager", fullgraph=True)(ids, x).square().mean().backward()
    reference(ids, x).square().mean().backward()
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
