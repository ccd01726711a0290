"""gem5d without processes: mesh arithmetic, size checks, planner inputs, dense units, registration, the choice
between torchrec's DMPCollection and the strategy's own replica sync."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from lightning_gem.strategies import GEM5DStrategy
from lightning_gem.strategies.dense import dense_units, sequence_parallel_modules, tensor_parallel_modules
from lightning_gem.strategies.mesh import (
    MeshLayout,
    replica_group_ranks,
    resolve_layout,
    sharding_group_ranks,
)
from lightning_gem.strategies.replication import (
    CollectionSupport,
    ReplicationChoice,
    choose_replication,
    collection_support,
    evaluate_without_inference_mode,
)
from lightning_gem.strategies.sparse import EmbeddingOptimizerConfig, TableConstraint, embedding_module_paths
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def _all_layouts(world_size: int) -> list[MeshLayout]:
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [
        resolve_layout(
            world_size, sparse_group_size=s, dense_replicate_size=r, tensor_parallel_size=t, dense_shard_size=None
        )
        for s in divisors
        for r in divisors
        for t in divisors
        if world_size % (r * t) == 0
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 12])
def test_every_rank_has_one_place_on_each_axis(world_size: int) -> None:
    for layout in _all_layouts(world_size):
        dense = {layout.dense_coordinates(r) for r in range(world_size)}
        sparse = {layout.sparse_coordinates(r) for r in range(world_size)}
        assert len(dense) == len(sparse) == world_size, layout
        for rank in range(world_size):
            rep, shard, tp = layout.dense_coordinates(rank)
            assert rank == (rep * layout.dense_shard + shard) * layout.tensor_parallel + tp
        groups, replicas = sharding_group_ranks(layout), replica_group_ranks(layout)
        assert sorted(r for g in groups for r in g) == list(range(world_size))
        assert sorted(r for g in replicas for r in g) == list(range(world_size))
        assert {len(g) for g in groups} == {layout.sparse_group_size}
        assert {len(g) for g in replicas} == {layout.sparse_replicas}
        # a replica group holds exactly one rank of every sharding group, at the same position in each
        for replica in replicas:
            positions = {layout.sparse_coordinates(r)[1] for r in replica}
            assert len(positions) == 1 and len({layout.sparse_coordinates(r)[0] for r in replica}) == len(replica)


def test_documented_example_layout() -> None:
    layout = resolve_layout(8, sparse_group_size=4, dense_replicate_size=2, tensor_parallel_size=2)
    assert layout.dense_shard == 2 and layout.data_parallel == 4 and layout.sparse_replicas == 2
    assert sharding_group_ranks(layout) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_group_ranks(layout) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.dense_coordinates(r) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]


def test_defaults_fill_the_world() -> None:
    layout = resolve_layout(4)
    assert (layout.sparse_group_size, layout.dense_replicate, layout.dense_shard, layout.tensor_parallel) == (
        4,
        1,
        4,
        1,
    )
    assert (
        resolve_layout(1).describe()
        == "world 1 = sparse 1 replicas x 1 shards = dense 1 replicate x 1 shard x 1 tensor"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparse_group_size": 3}, "`sparse_group_size` \\(3\\) must divide the world size \\(4\\)"),
        ({"sparse_group_size": 8}, "`sparse_group_size` \\(8\\) must be <= the world size"),
        ({"dense_replicate_size": 3}, "must\\s+divide the world size \\(4\\)"),
        ({"dense_replicate_size": 2, "dense_shard_size": 1}, "= 2 must equal the world size \\(4\\)"),
        ({"tensor_parallel_size": 8}, "must\\s+divide the world size"),
        ({"sparse_group_size": 0}, "`sparse_group_size` must be >= 1"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_layout(4, **kwargs)


def test_bad_types_and_constructor_checks() -> None:
    with pytest.raises(TypeError, match="`dense_shard_size` must be an int"):
        resolve_layout(4, dense_shard_size=2.0)
    with pytest.raises(TypeError, match="`tensor_parallel_size` must be an int"):
        GEM5DStrategy(tensor_parallel_size=True)
    with pytest.raises(TypeError, match="`sequence_parallel` must be a bool"):
        GEM5DStrategy(sequence_parallel="yes")
    with pytest.raises(ValueError, match="`sparse_group_size` must be >= 1"):
        GEM5DStrategy(sparse_group_size=0)
    with pytest.raises(ValueError, match="`embedding_optimizer` must be"):
        GEM5DStrategy(embedding_optimizer="lamb")
    with pytest.raises(ValueError, match="`embedding_lr` must be > 0"):
        GEM5DStrategy(embedding_lr=0.0)
    with pytest.raises(ValueError, match="`activation_memory_budget`"):
        GEM5DStrategy(activation_memory_budget=1.5)
    with pytest.raises(ValueError, match="`embedding_comm_precision` must be one of"):
        GEM5DStrategy(embedding_comm_precision="int8")
    with pytest.raises(ValueError, match="`sharding_types` must be among"):
        TableConstraint(sharding_types=("grid",))
    with pytest.raises(ValueError, match="at least one sharding type"):
        TableConstraint(sharding_types=())


def test_table_constraints_accept_plain_dicts() -> None:
    strategy = GEM5DStrategy(table_constraints={"item": {"sharding_types": ("row_wise",)}})
    assert strategy.table_constraints == {"item": TableConstraint(sharding_types=("row_wise",))}


def test_embedding_optimizer_fused_params() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    adam = EmbeddingOptimizerConfig(name="adam", lr=0.01, betas=(0.8, 0.9)).fused_params()
    assert adam["optimizer"] == EmbOptimType.ADAM and adam["learning_rate"] == 0.01
    assert (adam["beta1"], adam["beta2"]) == (0.8, 0.9)
    sgd = EmbeddingOptimizerConfig(name="sgd", lr=0.5).fused_params()
    assert sgd == {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}


def _ranker() -> nn.Module:
    from gem_workloads import make_model, make_source

    return make_model(make_source().schema, dense_optimizer="adamw")


def test_dense_units_of_the_gem_example() -> None:
    model = _ranker()
    units, replicated = dense_units(model)
    names = [n for n, _ in units]
    assert embedding_module_paths(model) == ["sequence_embeddings", "pooled_embeddings"]
    # ModuleDict of per-table projections is descended into; nothing holding torchrec modules is a unit
    assert names == [
        "feature_proj.item",
        "feature_proj.action_type",
        "encoder",
        "pooled_proj",
        "dense_proj",
        "interaction",
        "head",
    ]
    assert sorted(n for n, _ in replicated) == ["candidate_bias", "history_bias"]
    unit_params = {id(p) for _, u in units for p in u.parameters()}
    embedding_params = {id(p) for n in embedding_module_paths(model) for p in model.get_submodule(n).parameters()}
    every = {id(p) for p in model.parameters()}
    assert unit_params | embedding_params | {id(p) for _, p in replicated} == every
    assert not unit_params & embedding_params


def test_components_declare_tensor_parallel_plans() -> None:
    found = {type(sub).__name__: plan for _, sub, plan in tensor_parallel_modules(_ranker())}
    assert found["HSTULayer"] == {"uvqk": "colwise", "output": "rowwise"}
    assert found["GDPAInteraction"]["attention_output"] == "rowwise"
    # sequence parallelism: the encoder shards its tokens; its layers name the norms that run on the shards
    model = _ranker()
    assert [name for name, _ in sequence_parallel_modules(model)] == ["encoder"]
    token_local = {
        type(sub).__name__: sub.tensor_parallel_token_local()
        for _, sub, _ in tensor_parallel_modules(model)
        if hasattr(sub, "tensor_parallel_token_local")
    }
    assert token_local == {"HSTULayer": ("input_norm",)}


def test_sequence_parallel_needs_components_that_declare_it() -> None:
    from lightning_gem.components import GDPAInteraction
    from lightning_gem.components.encoder import HSTULayer
    from lightning_gem.strategies.dense import apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    _one_process_group()
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match="no submodule of Sequential declares `enable_sequence_parallel"):
        apply_tensor_parallel(nn.Sequential(HSTULayer(8, 2)), mesh, sequence_parallel=True)

    class Shards(nn.Module):  # shards its tokens, but runs a component that cannot say which norms see them
        def __init__(self) -> None:
            super().__init__()
            self.inner = GDPAInteraction(8, 2)

        def enable_sequence_parallel(self, tp_mesh: object) -> None:
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="runs inner on token shards, but GDPAInteraction does not declare"):
        apply_tensor_parallel(Shards(), mesh, sequence_parallel=True)


def _strategy_from_cli(*args: str) -> GEM5DStrategy:
    """The Trainer's strategy as the ``lightning-gem`` CLI builds it from the gem5d config and ``args``."""
    from lightning.pytorch import LightningDataModule, LightningModule

    for module in ("lightning_gem.components", "lightning_gem.data"):  # their classes register for class_path
        importlib.import_module(module)
    from lightning_gem.cli import GEMCLI

    config = ROOT / "examples" / "configs" / "quickstart_gem5d.yaml"
    cli = GEMCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config), "--trainer.logger", "false", *args],
    )
    return cli.trainer.strategy


def test_cli_parses_a_gem5d_config(tmp_path: Path) -> None:
    strategy = _strategy_from_cli(
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.strategy.init_args.sequence_parallel",
        "true",
        "--trainer.strategy.init_args.sparse_replication",
        "replica_sync",
    )
    assert isinstance(strategy, GEM5DStrategy) and strategy.sequence_parallel is True
    assert strategy.sparse_replication == "replica_sync"
    assert strategy._sizes["sparse_group_size"] == 1
    assert strategy.table_constraints["item"] == TableConstraint(sharding_types=("row_wise", "table_wise"))
    assert not torch.distributed.is_initialized()  # building the Trainer starts no process group
    # the registered name alone takes every default
    strategy = _strategy_from_cli("--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", "gem5d")
    assert isinstance(strategy, GEM5DStrategy) and strategy._sizes["sparse_group_size"] is None
    assert strategy.sequence_parallel is False and strategy.sparse_replication == "auto"
    with pytest.raises(SystemExit):  # the CLI refuses a value outside the Literal
        _strategy_from_cli(
            "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy.init_args.sparse_replication", "dmp"
        )


def test_tensor_parallel_groups_train_on_the_union_of_their_batches() -> None:
    from lightning_gem.strategies.tp_batches import merge_tensor_parallel_batches
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(40))

    def loader(rank: int) -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=4, rank=rank, shuffle=True, seed=3)
        return DataLoader(data, batch_size=3, sampler=sampler, collate_fn=list)

    per_rank = [list(loader(r)) for r in range(4)]
    for first in (0, 2):  # tensor-parallel groups [0, 1] and [2, 3]
        for rank in (first, first + 1):
            merged = merge_tensor_parallel_batches(loader(rank), [first, first + 1])
            expected = [a + b for a, b in zip(per_rank[first], per_rank[first + 1], strict=True)]
            assert list(merged) == expected and len(merged) == len(expected)
            merged.batch_sampler.sampler.set_epoch(1)  # Lightning's per-epoch call reaches every rank's sampler
            assert [s.epoch for s in merged.batch_sampler.sampler.samplers] == [1, 1]
    single = loader(0)
    assert merge_tensor_parallel_batches(single, [0]) is single  # no tensor parallelism: the loader as it was
    with pytest.raises(TypeError, match="DistributedSampler"):
        merge_tensor_parallel_batches(DataLoader(data, batch_size=3), [0, 1])


def _one_process_group() -> None:
    from lightning_gem.testing.distributed import free_port

    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")


def test_optimizer_groups_mixing_dtensor_and_plain_parameters_step_with_foreach() -> None:
    """FSDP2 parameters (DTensors) and replicated ones (plain) in one group: PyTorch's foreach kernels refuse the
    mix, so gem5d splits such groups for the step only; the update equals the per-parameter one."""
    from lightning_gem.strategies.dense import split_mixed_param_groups
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _one_process_group()
    mesh = init_device_mesh("cpu", (1,))
    values, grads = [torch.randn(8, 4), torch.randn(4)], [torch.randn(8, 4), torch.randn(4)]

    def params() -> list[nn.Parameter]:
        out = [nn.Parameter(distribute_tensor(values[0].clone(), mesh, [Shard(0)])), nn.Parameter(values[1].clone())]
        out[0].grad = distribute_tensor(grads[0].clone(), mesh, [Shard(0)])
        out[1].grad = grads[1].clone()
        return out

    with pytest.raises(RuntimeError, match="mixed"):
        torch.optim.AdamW(params(), lr=0.1, foreach=True).step()
    fast, slow = params(), params()
    fast_opt = torch.optim.AdamW(fast, lr=0.1, foreach=True)
    slow_opt = torch.optim.AdamW(slow, lr=0.1, foreach=False)
    schedule = torch.optim.lr_scheduler.StepLR(fast_opt, step_size=1, gamma=0.5)
    group = fast_opt.param_groups[0]
    for _ in range(3):
        with split_mixed_param_groups(fast_opt):
            assert len(fast_opt.param_groups) == 2
            fast_opt.step()
        slow_opt.step()
        schedule.step()
        slow_opt.param_groups[0]["lr"] = fast_opt.param_groups[0]["lr"]
    assert fast_opt.param_groups == [group] and group["lr"] == pytest.approx(0.1 / 8)
    torch.testing.assert_close(fast[0].full_tensor(), slow[0].full_tensor())
    torch.testing.assert_close(fast[1], slow[1])


def test_a_group_plan_moves_to_its_ranks_devices() -> None:
    """The planner plans one sharding group (ranks 0..g-1 on cuda:0..g-1); group 1 of size 1 on two GPUs
    is rank 1 on cuda:1, not cuda:0 (metadata only: no GPU needed)."""
    from lightning_gem.strategies.sparse import _readdress_plan
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    def plan(device: str) -> ShardingPlan:
        shard = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 4], placement=f"rank:0/{device}")
        sharding = ParameterSharding(
            sharding_type="table_wise", compute_kernel="fused", ranks=[0], sharding_spec=EnumerableShardingSpec([shard])
        )
        return ShardingPlan({"embeddings": {"item": sharding}})

    moved = plan("cuda:0")
    _readdress_plan(moved, offset=3, device_type="cuda", local_world_size=2)
    sharding = moved.plan["embeddings"]["item"]
    assert sharding.ranks == [3]
    assert str(sharding.sharding_spec.shards[0].placement) == "rank:3/cuda:1"
    on_cpu = plan("cpu")
    _readdress_plan(on_cpu, offset=1, device_type="cpu", local_world_size=2)
    assert str(on_cpu.plan["embeddings"]["item"].sharding_spec.shards[0].placement) == "rank:1/cpu"


def test_a_rank_without_a_shard_of_a_table_has_no_local_shards() -> None:
    """torchrec gives such a rank an empty LocalShardsWrapper whose offsets still list one dummy chunk."""
    from lightning_gem.strategies.sparse import local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchrec.distributed.shards_wrapper import LocalShardsWrapper

    _one_process_group()
    mesh = init_device_mesh("cpu", (1,))
    empty = LocalShardsWrapper(local_shards=[], local_offsets=[])
    table = DTensor.from_local(empty, mesh, [Shard(0)], run_check=False, shape=torch.Size([10, 4]), stride=(4, 1))
    assert local_shards(table) == []
    full = torch.randn(6, 4)
    held = DTensor.from_local(
        LocalShardsWrapper(local_shards=[full[2:5]], local_offsets=[(2, 0)]),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size([6, 4]),
        stride=(4, 1),
    )
    [(shard, offset)] = local_shards(held)
    assert offset == (2, 0) and torch.equal(shard, full[2:5])


@pytest.mark.parametrize("bias", ["relative_attention_bias", "relative_time_bias"])
def test_tensor_parallelism_refuses_a_relative_attention_bias(bias: str) -> None:
    from lightning_gem.components.encoder import JaggedHistoryEncoder
    from lightning_gem.strategies.dense import apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    _one_process_group()
    encoder = JaggedHistoryEncoder(None, 16, num_layers=1, num_heads=2, max_length=8, **{bias: True})
    with pytest.raises(ValueError, match="relative attention bias"):
        apply_tensor_parallel(encoder, init_device_mesh("cpu", (1,)))


def _support(*without: str) -> CollectionSupport:
    """A torchrec offering DMPCollection in full but for the features named in ``without``."""
    offered = {name: name not in without for name in ("collection", "contiguous_groups", "fully_sharded")}
    return CollectionSupport(version="0.test", **offered)


def test_the_installed_torchrec_offers_dmpcollection_in_full() -> None:
    support = collection_support()
    assert (support.collection, support.contiguous_groups, support.fully_sharded) == (True, True, True), support


def test_auto_keeps_replicas_with_dmpcollection_on_cuda_only() -> None:
    layout = resolve_layout(4, sparse_group_size=2)
    choice = choose_replication("auto", device_type="cpu", layout=layout, optimizer="sgd", support=_support())
    assert choice.mode == "replica_sync" and "CUDA only" in choice.reason and "device is cpu" in choice.reason
    # the device type is all that is asked of the device: the CUDA branch is plain logic
    assert choose_replication("auto", device_type="cuda", layout=layout, optimizer="sgd", support=_support()).mode == (
        "collection"
    )
    assert choose_replication("collection", device_type="cuda", layout=layout, optimizer="rowwise_adagrad").mode == (
        "collection"
    )
    assert choose_replication("fully_sharded", device_type="cuda", layout=layout, optimizer="sgd").mode == (
        "fully_sharded"
    )
    for device_type in ("cpu", "cuda"):  # asked for by name, the strategy's own sync runs anywhere
        choice = choose_replication("replica_sync", device_type=device_type, layout=layout, optimizer="adam")
        assert choice == ReplicationChoice("replica_sync", "requested")


@pytest.mark.parametrize("requested", ["collection", "fully_sharded"])
def test_dmpcollection_on_cpu_is_refused_by_name(requested: str) -> None:
    layout = resolve_layout(2)
    with pytest.raises(
        ValueError, match=rf"`sparse_replication='{requested}'` cannot be used: .*CUDA only.*device is cpu"
    ):
        choose_replication(requested, device_type="cpu", layout=layout, optimizer="sgd")


@pytest.mark.parametrize(
    ("without", "optimizer", "reason"),
    [
        (("collection",), "sgd", "torchrec 0.test has no DMPCollection"),
        (("contiguous_groups",), "sgd", "no contiguous sharding groups"),
        ((), "adam", "embedding_optimizer='adam'"),
    ],
    ids=["no DMPCollection", "strided groups only", "adam"],
)
def test_what_keeps_dmpcollection_out(without: tuple[str, ...], optimizer: str, reason: str) -> None:
    layout = resolve_layout(4, sparse_group_size=2)
    kwargs = {"device_type": "cuda", "layout": layout, "optimizer": optimizer, "support": _support(*without)}
    choice = choose_replication("auto", **kwargs)
    assert choice.mode == "replica_sync" and reason in choice.reason, choice
    with pytest.raises(ValueError, match=re.escape(reason)):
        choose_replication("collection", **kwargs)


def test_strided_groups_are_ours_when_one_group_or_no_sharding() -> None:
    """DMPCollection without contiguous groups strides them: ``[j, j + W/S, ...]``, which is ``rank // S`` only for
    ``S = 1`` and ``S = W``."""
    strided = _support("contiguous_groups")
    for group in (1, 4):
        layout = resolve_layout(4, sparse_group_size=group)
        assert choose_replication("auto", device_type="cuda", layout=layout, optimizer="sgd", support=strided).mode == (
            "collection"
        )


def test_fully_sharded_needs_a_torchrec_that_has_it() -> None:
    layout = resolve_layout(2, sparse_group_size=1)
    older = _support("fully_sharded")
    with pytest.raises(ValueError, match="torchrec 0.test has no ShardingStrategy.FULLY_SHARDED"):
        choose_replication("fully_sharded", device_type="cuda", layout=layout, optimizer="sgd", support=older)
    assert choose_replication("collection", device_type="cuda", layout=layout, optimizer="sgd", support=older).mode == (
        "collection"
    )


def test_dmpcollection_must_place_shards_on_this_hosts_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """DMPCollection puts a re-addressed shard on ``cuda:(rank % torchrec's local size)`` (LOCAL_WORLD_SIZE)."""
    layout = resolve_layout(16, sparse_group_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    kwargs = {"device_type": "cuda", "layout": layout, "optimizer": "sgd", "support": _support()}
    choice = choose_replication("auto", local_world_size=4, **kwargs)
    assert choice.mode == "replica_sync" and "set LOCAL_WORLD_SIZE=4" in choice.reason, choice
    with pytest.raises(ValueError, match="set LOCAL_WORLD_SIZE=4"):
        choose_replication("collection", local_world_size=4, **kwargs)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert choose_replication("auto", local_world_size=4, **kwargs).mode == "collection"


def test_sparse_replication_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"`sparse_replication` must be one of \('auto', 'collection'"):
        GEM5DStrategy(sparse_replication="dmp")
    with pytest.raises(ValueError, match="must be one of"):
        choose_replication("dmp", device_type="cuda", layout=resolve_layout(1), optimizer="sgd")
    # the device is known at setup only: naming DMPCollection on a CPU-only machine constructs
    assert GEM5DStrategy().sparse_replication == "auto"
    assert GEM5DStrategy(sparse_replication="fully_sharded").sparse_replication == "fully_sharded"


def test_gem5d_evaluates_under_no_grad_not_inference_mode(tmp_path: Path) -> None:
    """FSDP2's gathered parameters and fully sharded tables cannot be first allocated under inference mode: the
    strategy turns every evaluation loop to ``no_grad`` (what Lightning does for its FSDP strategy)."""
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop)
    assert [loop.inference_mode for loop in loops] == [True, True, True, False]  # Lightning's defaults
    assert evaluate_without_inference_mode(trainer) == ["validate_loop", "test_loop", "predict_loop"]
    assert not any(loop.inference_mode for loop in loops)
    assert evaluate_without_inference_mode(trainer) == []  # idempotent


def test_fully_sharded_tables_gather_before_the_next_forward_and_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table left sharded by a forward without backward is gathered before the next forward or by
    ``gather_sharded_tables`` (the strategy's evaluation-end hooks), never right after a forward."""
    from lightning_gem.strategies.replication import gather_sharded_tables, gather_tables_before_forward
    from torchrec.distributed import batched_embedding_kernel

    class FullyShardedKernel(nn.Module):  # stands in for torchrec's (CUDA-only) fully sharded kernel
        def __init__(self) -> None:
            super().__init__()
            self.weights_sharded, self.gathers = False, 0

        def _all_gather_table_weights(self) -> None:
            self.gathers += 1
            self.weights_sharded = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.weights_sharded = True  # torchrec reduce-scatters the table after every forward
            return x

    monkeypatch.setattr(batched_embedding_kernel, "ShardedBatchedFusedEmbedding", FullyShardedKernel)
    kernel = FullyShardedKernel()
    model = nn.Sequential(nn.Linear(2, 2), kernel)
    assert gather_tables_before_forward(model) == 1
    model(torch.randn(1, 2))
    assert kernel.gathers == 0 and kernel.weights_sharded  # not right after the forward
    model(torch.randn(1, 2))
    assert kernel.gathers == 1  # before the next one
    gather_sharded_tables(model)
    assert kernel.gathers == 2 and not kernel.weights_sharded
    gather_sharded_tables(model)
    assert kernel.gathers == 2  # nothing left sharded: nothing to gather


def test_replicated_gradients_average_every_trainable_parameter_and_leave_frozen_ones_alone() -> None:
    """Every trainable parameter enters the all-reduce (zeros where this rank's batch gave none, so all ranks'
    buffers agree); a frozen one gets no gradient."""
    from lightning_gem.strategies.dense import ReplicatedGradients

    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    used.grad = torch.full((3,), 4.0)
    ReplicatedGradients([used, unused, frozen], group=None, divide_factor=2.0)()
    assert torch.equal(used.grad, torch.full((3,), 2.0))
    assert torch.equal(unused.grad, torch.zeros(2))
    assert frozen.grad is None


def test_the_pipeline_copies_pipelineable_batches_without_blocking_on_cuda() -> None:
    """A pinned batch copies asynchronously on the prefetch stream only if asked to: Lightning's own move asks
    for tensors alone, so the train pipeline asks torchrec ``Pipelineable`` batches itself."""
    from lightning_gem.strategies.gem5d import _move_batch
    from torchrec.streamable import Pipelineable

    class Batch(Pipelineable):
        def __init__(self) -> None:
            self.calls: list[tuple[torch.device, bool]] = []

        def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
            self.calls.append((device, non_blocking))
            return self

        def record_stream(self, stream: torch.Stream) -> None:
            pass

    moved: list[object] = []

    def lightning_move(batch: object, device: torch.device) -> object:
        moved.append(batch)
        return batch

    batch = Batch()
    assert _move_batch(batch, torch.device("cuda", 0), lightning_move) is batch
    assert batch.calls == [(torch.device("cuda", 0), True)] and moved == []
    assert _move_batch(batch, torch.device("cpu"), lightning_move) is batch  # CPU: Lightning's move
    assert _move_batch({"x": 1}, torch.device("cuda", 0), lightning_move) == {"x": 1}  # not Pipelineable
    assert moved == [batch, {"x": 1}] and len(batch.calls) == 1
