"""gem5d on CUDA GPUs (NCCL). Skipped without a GPU (the two-rank test without two).

The GEM example at a size where activations matter, on one GPU: it trains (with torchrec's
``DMPCollection`` sharding the tables, chosen by ``sparse_replication="auto"`` or by name), and under an
activation budget of half the unconstrained peak the measured peak stays within the budget + 10%; the train
pipeline (its side-stream prefetch, pinned batches copied asynchronously) trains like the plain loop. On two
GPUs with every table replicated on both (``sparse_group_size=1``): the replicas stay equal under each way of
keeping them so (``DMPCollection.sync``, ``DMPCollection``'s fully sharded strategy, gem5d's
``ReplicaSync``), and ``DMPCollection.sync`` trains like ``ReplicaSync``.

Run: ``python -m pytest -m gpu -s tests/strategies/test_gem5d_gpu.py``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest
import torch

from lightning_gem.testing.distributed import run_ranks

pytestmark = pytest.mark.gpu


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _fit_on_gpu(
    rank: int,
    world_size: int,
    budget: float | None,
    steps: int,
    replication: str = "auto",
    pipeline: bool = False,
    compile_layers: bool = False,
    mxfp8: bool = False,
) -> dict[str, Any]:
    import lightning as L
    from lightning_gem.components import GEMRanker
    from lightning_gem.strategies import GEM5DStrategy
    from lightning_gem.strategies.sparse import embedding_module_paths

    from lightning_gem.data import GEMDataModule, SyntheticRankingSource

    class StepMeter(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.peak = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            if batch_idx == 2:  # past the warm-up steps (kernel autotuning, allocator growth)
                torch.cuda.reset_peak_memory_stats()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]))
            if batch_idx >= 2:
                self.peak = max(self.peak, torch.cuda.max_memory_allocated())

    L.seed_everything(0, verbose=False)
    source = SyntheticRankingSource(num_train_users=4096, num_val_users=64, num_test_users=64, max_history_length=256)
    data = GEMDataModule(source=source, batch_size=256, seed=0, pin_memory=pipeline)
    model = GEMRanker(data.schema, embedding_dim=64, model_dim=256, num_layers=4, num_heads=4)
    meter = StepMeter()
    paths = embedding_module_paths(model)
    strategy = GEM5DStrategy(
        activation_memory_budget=budget,
        sparse_replication=replication,
        train_pipeline=pipeline,
        compile_layers=compile_layers,
    )
    plugins = None
    if mxfp8:
        from lightning_gem.precision import MXFP8Precision

        plugins = [MXFP8Precision()]
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        plugins=plugins,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
    )
    trainer.fit(model, datamodule=data)
    plan = strategy.activation_checkpoint_plan
    tables = [p.device.type for p in model.sequence_embeddings.parameters()]
    return {
        "losses": meter.losses,
        "step_seconds": float(np.median(meter.times[2:])),
        "peak": meter.peak,
        "budget": None if plan is None else plan.budget,
        "chosen": None if plan is None else list(plan.chosen),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "tables": sorted(set(tables)),
        "sharding": _sharded_by(model, paths, strategy.parallel.sparse),
        "prefetched": getattr(strategy.prefetcher, "hits", None),
    }


def _sharded_by(model: torch.nn.Module, paths: list[str], sparse: Any) -> dict[str, Any]:
    """What sharded the embedding modules at ``paths`` of ``model`` and whether they were replaced in place."""
    from torchrec.distributed.model_parallel import DMPCollection
    from torchrec.distributed.types import ShardedModule

    collection = sparse.collection
    return {
        "replication": sparse.replication,
        "paths": paths,
        "by_collection": isinstance(collection, DMPCollection),
        # the collection wraps the LightningModule itself, whose embedding modules are now torchrec's sharded ones
        "wraps_the_model": collection is not None and collection.module is model,
        "in_place": all(isinstance(model.get_submodule(p), ShardedModule) for p in paths),
        "mesh": collection.device_mesh.mesh.tolist() if collection is not None else None,
    }


def test_world_size_one_trains_on_a_gpu_with_nccl() -> None:
    _require_cuda()
    out = run_ranks(_fit_on_gpu, 1, None, 30)[0]
    assert out["backend"] == "nccl" and out["tables"] == ["cuda"]
    assert out["sharding"]["replication"] == "collection", out["sharding"]  # "auto" on CUDA: DMPCollection
    losses = out["losses"]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


def test_the_train_pipeline_trains_like_the_plain_loop_on_a_gpu() -> None:
    """Side-stream prefetch of pinned batches and of the embeddings' input path: the same losses as without it (the
    kernels' atomic backward allows float-level differences), every forward served by a prefetched input."""
    _require_cuda()
    steps = 8
    plain = run_ranks(_fit_on_gpu, 1, None, steps)[0]
    pipelined = run_ranks(_fit_on_gpu, 1, None, steps, "auto", True)[0]
    np.testing.assert_allclose(pipelined["losses"], plain["losses"], rtol=1e-3)
    assert pipelined["prefetched"] == 2 * steps and plain["prefetched"] is None


def test_compiled_layers_train_like_eager_ones_on_a_gpu_in_fp8() -> None:
    """``compile_layers`` with the kit's kernels: GDPA Triton traced into the layers' graphs, the FP8 linears and
    fused norms of ``MXFP8Precision`` run eagerly between them; the same losses as the eager layers, to the
    kernels' float-level differences."""
    _require_cuda()
    steps = 8
    eager = run_ranks(functools.partial(_fit_on_gpu, mxfp8=True), 1, None, steps)[0]
    compiled = run_ranks(functools.partial(_fit_on_gpu, compile_layers=True, mxfp8=True), 1, None, steps)[0]
    assert all(np.isfinite(compiled["losses"]))
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=2e-2)


def test_world_size_one_trains_with_dmpcollection() -> None:
    """``sparse_replication="collection"``: torchrec's DMPCollection shards the tables of the LightningModule in
    place (the collection wraps the model; its 1 x 1 mesh is gem5d's) and the GEM example trains."""
    _require_cuda()
    out = run_ranks(_fit_on_gpu, 1, None, 30, "collection")[0]
    sharding = out["sharding"]
    assert sharding["replication"] == "collection" and sharding["by_collection"], sharding
    assert sharding["wraps_the_model"] and sharding["in_place"] and sharding["paths"], sharding
    assert sharding["mesh"] == [[0]], sharding
    assert out["tables"] == ["cuda"]
    losses = out["losses"]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


def _replicas_on_gpus(rank: int, world_size: int, modes: tuple[str, ...], steps: int) -> dict[str, Any]:
    """Train the tiny GEM example with every table on every rank (``sparse_group_size=1``) once per mode of
    ``sparse_replication``, validating once before and after training; per mode (rank 0): the losses, the
    full weights (``full_weights`` raises if the replicas of a table differ), the largest difference between
    the ranks' tables and fused-optimizer states, and what sharded the tables."""
    import lightning as L
    import torch.distributed as dist
    from gem_workloads import LossRecorder, make_model, make_source
    from lightning_gem.strategies import GEM5DStrategy
    from lightning_gem.strategies.sparse import embedding_module_paths, local_state_tensors

    from lightning_gem.data import GEMDataModule
    from lightning_gem.testing.distributed import forget_torchrec_node_groups, full_weights

    results: dict[str, Any] = {}
    for mode in modes:
        forget_torchrec_node_groups()
        L.seed_everything(0, verbose=False)
        data = GEMDataModule(source=make_source(), batch_size=4, seed=0)
        model = make_model(data.schema)
        paths = embedding_module_paths(model)
        tables = {k: v for k, v in model.state_dict().items() if k.startswith(tuple(paths))}
        initial = {k: v.detach().cpu().numpy().copy() for k, v in tables.items()}
        recorder = LossRecorder()
        strategy = GEM5DStrategy(sparse_group_size=1, sparse_replication=mode, embedding_optimizer="rowwise_adagrad")
        trainer = L.Trainer(
            accelerator="gpu",
            devices=world_size,
            strategy=strategy,
            max_steps=steps,
            limit_val_batches=1,
            num_sanity_val_steps=1,  # a forward without backward first (fully sharded tables gathered after it ends)
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder],
        )
        trainer.fit(model, datamodule=data)
        trainer.validate(model, datamodule=data, verbose=False)
        flat = torch.cat([t.detach().reshape(-1).float() for t in local_state_tensors(model)])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        weights = full_weights(model)
        results[mode] = {
            "losses": recorder.losses,
            "weights": weights,
            "state_spread": max(float((g - gathered[0]).abs().max()) for g in gathered),
            "tables_moved": max(float(np.abs(weights[k] - v).max()) for k, v in initial.items()),
            "sharding": _sharded_by(model, paths, strategy.parallel.sparse),
        }
    return results if rank == 0 else {}


def _require_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")


def _check_replicas(out: dict[str, Any], steps: int) -> None:
    for mode, result in out.items():
        sharding = result["sharding"]
        assert sharding["replication"] == mode and sharding["in_place"], (mode, sharding)
        if mode == "replica_sync":
            assert not sharding["by_collection"] and sharding["mesh"] is None, sharding
        else:
            assert sharding["by_collection"] and sharding["wraps_the_model"], (mode, sharding)
            assert sharding["mesh"] == [[0], [1]], (mode, sharding)  # sharding groups [0], [1]; replica group [0, 1]
        assert len(result["losses"]) == steps and all(np.isfinite(result["losses"])), (mode, result["losses"])
        assert result["state_spread"] == 0.0, (mode, result["state_spread"])  # tables and optimizer states
        assert result["tables_moved"] > 0.0, mode


def test_two_gpus_keep_dmpcollection_replicas_equal() -> None:
    """Two ranks, each holding every table (two replicas of each): after training the replicas' tables and
    fused-optimizer (rowwise Adagrad) states are bit-equal under ``DMPCollection.sync`` as under gem5d's
    ``ReplicaSync``, which averages the same tensors, so both train alike."""
    _require_two_gpus()
    steps = 6
    out = run_ranks(_replicas_on_gpus, 2, ("collection", "replica_sync"), steps, timeout=600)[0]
    _check_replicas(out, steps)
    collection, replica_sync = out["collection"], out["replica_sync"]
    assert collection["losses"][-1] < collection["losses"][0], collection["losses"]
    np.testing.assert_allclose(collection["losses"], replica_sync["losses"], rtol=1e-4)
    for name, value in collection["weights"].items():
        np.testing.assert_allclose(value, replica_sync["weights"][name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_two_gpus_train_fully_sharded_tables() -> None:
    """``sparse_replication="fully_sharded"`` on two ranks, each holding every table: it trains, evaluation (a
    forward without backward, before and after training) leaves the replicas gathered and equal, the optimizer
    states are equal, and the first step reads the same tables as under ``DMPCollection.sync``."""
    _require_two_gpus()
    steps = 6
    out = run_ranks(_replicas_on_gpus, 2, ("fully_sharded", "collection"), steps, timeout=600)[0]
    _check_replicas(out, steps)
    np.testing.assert_allclose(out["fully_sharded"]["losses"][0], out["collection"]["losses"][0], rtol=1e-5)


def test_activation_budget_of_half_the_peak_on_a_gpu() -> None:
    _require_cuda()
    free = run_ranks(_fit_on_gpu, 1, None, 12)[0]
    bounded = run_ranks(_fit_on_gpu, 1, 0.5, 12)[0]
    mib = 2**20
    print(  # the measured figures, for the benchmark notes (pytest -s)
        f"activation budget {bounded['budget'] / mib:.1f} MiB: peak {bounded['peak'] / mib:.1f} MiB "
        f"(unconstrained {free['peak'] / mib:.1f} MiB), step {bounded['step_seconds'] * 1e3:.2f} ms "
        f"(unconstrained {free['step_seconds'] * 1e3:.2f} ms), recomputed {bounded['chosen']}"
    )
    assert bounded["chosen"], "a budget of half the peak must checkpoint something"
    assert bounded["peak"] <= 1.1 * bounded["budget"], (bounded["peak"], bounded["budget"], free["peak"])
    # The recomputation's cost is a speed figure: examples/benchmarks/activation_checkpointing.py measures it.
