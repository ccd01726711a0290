"""gem5d with real processes on CPU/gloo: the GEM example trains at 2 and 4 ranks in every layout that fits,
with the losses and weights of a single process on the same global batch; the HSTU encoder on token shards
(sequence parallelism) gives the outputs and gradients of the encoder on every token.

Each test spawns one group of processes (``lightning_gem.testing.distributed.run_ranks``) that trains
several layouts in turn.
The comparisons use SGD for the dense layers (see ``gem_workloads.make_model``) and, where a table has
replicas, for the embeddings: replicas are averaged after each step, which equals one update on the
whole batch for SGD only (with Adam it is torchrec's 2D approximation).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest
from gem_workloads import NUM_USERS, fit_gem, validate_gem

from lightning_gem.testing.distributed import run_ranks

STEPS = 5
GLOBAL_BATCH = 8
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6
CLIP = 0.05  # below the GEM example's gradient norms, so clipping acts on every step
SEQUENCE_PARALLEL = {"tensor_parallel_size": 2, "sequence_parallel": True}


def _train_layouts(
    rank: int, world_size: int, layouts: list[dict[str, Any]], bad_layouts: tuple[dict[str, Any], ...] = ()
) -> tuple[list[dict[str, Any]], list[str]]:
    """Train each layout in turn in this group of processes (rank 0 returns the losses and full weights),
    then try each bad layout and return the error each raised."""
    results = []
    for layout in layouts:
        kwargs = {k: v for k, v in layout.items() if k != "trainer"}
        out = fit_gem(world_size, kwargs, steps=STEPS, global_batch=GLOBAL_BATCH, trainer_kwargs=layout.get("trainer"))
        results.append(out if rank == 0 else {})
    errors = []
    for kwargs in bad_layouts:
        try:
            fit_gem(world_size, kwargs, steps=1, global_batch=GLOBAL_BATCH)
        except ValueError as err:
            errors.append(str(err))
        else:
            errors.append("no error")
    return results, errors


@functools.cache
def _single_process(embedding_optimizer: str, gradient_clip_val: float | None = None) -> dict[str, Any]:
    layout = {"embedding_optimizer": embedding_optimizer, "trainer": {"gradient_clip_val": gradient_clip_val}}
    return run_ranks(_train_layouts, 1, [layout])[0][0][0]


def _reference(layout: dict[str, Any]) -> dict[str, Any]:
    return _single_process(layout["embedding_optimizer"], layout.get("trainer", {}).get("gradient_clip_val"))


def _check_matches(result: dict[str, Any], reference: dict[str, Any], layout: dict[str, Any]) -> None:
    assert len(result["losses"]) == STEPS, layout
    loss_rtol, weight_atol = LOSS_RTOL, WEIGHT_ATOL
    if layout.get("embedding_comm_precision", "fp32") != "fp32":
        # Embeddings and their gradients rounded to bf16 on the wire (relative error up to 2^-8 each): the run
        # differs from fp32 (measured here: losses 2.7e-5 relative, weights 3.9e-5), within bf16's reach.
        assert result["losses"] != reference["losses"], layout
        loss_rtol, weight_atol = 5e-4, 5e-4
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=loss_rtol, err_msg=str(layout))
    assert result["weights"].keys() == reference["weights"].keys()
    for name, value in result["weights"].items():
        np.testing.assert_allclose(value, reference["weights"][name], atol=weight_atol, err_msg=f"{name} {layout}")
    # the run trained: the loss moved
    assert result["losses"][-1] < result["losses"][0] - 0.05, layout


def _layouts(world_size: int) -> list[dict[str, Any]]:
    """Every sparse group size x (dense replicate, dense shard, tensor parallel) of ``world_size`` ranks that the
    model fits (its 2 heads allow tensor parallel sizes 1 and 2)."""
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [
        {
            "sparse_group_size": group,
            "dense_replicate_size": replicate,
            "tensor_parallel_size": tensor,
            # one group: no replicas, so an adaptive optimizer's update is exact too
            "embedding_optimizer": "rowwise_adagrad" if group == world_size else "sgd",
        }
        for tensor in (1, 2)
        for group in sizes
        for replicate in sizes
        if tensor <= world_size and world_size % (replicate * tensor) == 0
    ]


BAD_LAYOUTS = {
    2: (
        ({"sparse_group_size": 3}, "`sparse_group_size` (3) must be <= the world size (2)"),
        ({"dense_replicate_size": 2, "dense_shard_size": 2}, "= 4 must equal the world size (2)"),
        ({"table_constraints": {"no_such_table": {"sharding_types": ["row_wise"]}}}, "tables ['no_such_table']"),
        (
            {"sparse_replication": "collection"},
            "`sparse_replication='collection'` cannot be used: torchrec's DMPCollection runs on CUDA only and this "
            "rank's device is cpu",
        ),
    ),
    4: (({"tensor_parallel_size": 4}, "`tensor_parallel_size` (4) must divide the heads of encoder.layers.0 (2)"),),
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_layout_trains_like_one_process(world_size: int) -> None:
    layouts = _layouts(world_size)
    if world_size == 2:
        # activation checkpointing planned on the first batch under 90% of the measured peak (this tiny
        # model's activations are a small part of its step)
        layouts.append({"embedding_optimizer": "rowwise_adagrad", "activation_memory_budget": 0.9})
        # the next batch's embedding all-to-all started under the current batch's compute
        layouts.append({"embedding_optimizer": "sgd", "sparse_group_size": 1, "train_pipeline": True})
        layouts.append({"embedding_optimizer": "rowwise_adagrad", "train_pipeline": True})
        # gradient clipping over FSDP2 DTensor, tensor-parallel DTensor and plain replicated gradients at once
        clip = {"gradient_clip_val": CLIP}
        layouts.append({"embedding_optimizer": "sgd", "trainer": clip})
        layouts.append({"embedding_optimizer": "sgd", "tensor_parallel_size": 2, "trainer": clip})
        # the encoder's layers on token shards (clipped: its norms' gradients are summed before the norm is taken)
        layouts.append({"embedding_optimizer": "rowwise_adagrad"} | SEQUENCE_PARALLEL)
        layouts.append({"embedding_optimizer": "sgd", "trainer": clip} | SEQUENCE_PARALLEL)
        # pooled tables table-wise (one on each rank: the collection's output comes back in sharding order), the
        # sequence tables row-wise
        ways = {"user_segment": "table_wise", "user_interest_tags": "table_wise", "item": "row_wise"}
        ways["action_type"] = "row_wise"
        constraints = {table: {"sharding_types": [way]} for table, way in ways.items()}
        layouts.append({"embedding_optimizer": "sgd", "sparse_group_size": 2, "table_constraints": constraints})
        # the embedding all-to-alls and reduce-scatters in bf16 (torchrec's quantized comms), under the pipeline
        layouts.append(
            {"embedding_optimizer": "sgd", "embedding_comm_precision": "bf16", "train_pipeline": True}
            | {"table_constraints": constraints}
        )
    else:
        # token shards in 2 tensor-parallel groups, the dense layers sharded over the groups
        layouts.append({"embedding_optimizer": "sgd", "sparse_group_size": 2} | SEQUENCE_PARALLEL)
    # the bad configurations ride along (a spawn costs more than a fit)
    bad = BAD_LAYOUTS[world_size]
    results, errors = run_ranks(_train_layouts, world_size, layouts, tuple(kwargs for kwargs, _ in bad))[0]
    for layout, result in zip(layouts, results, strict=True):
        _check_matches(result, _reference(layout), layout)
        # checkpointing changes no number; it is on exactly when a budget is given
        assert bool(result["checkpointed"]) == ("activation_memory_budget" in layout), result["checkpointed"]
        # with the pipeline, every forward of both embedding modules used the input_dist started ahead
        assert result["prefetched"] == (2 * STEPS if layout.get("train_pipeline") else None), result["prefetched"]
        # "auto" on CPU: DistributedModelParallel over a 2D environment, replicas averaged by ReplicaSync
        assert result["replication"] == "replica_sync", result["replication"]
        _check_token_shards(result, layout)
    for (kwargs, message), error in zip(bad, errors, strict=True):
        assert message in error, (kwargs, error)
    if world_size == 2:  # the clipped reference did clip
        assert _single_process("sgd", CLIP)["losses"][1:] != _single_process("sgd")["losses"][1:]


def _check_token_shards(result: dict[str, Any], layout: dict[str, Any]) -> None:
    """Under sequence parallelism the first layer's input norm saw ``ceil(T / 2)`` of the ``T`` tokens (padded
    when ``T`` is odd, which some batch is); otherwise all of them."""
    if "activation_memory_budget" in layout:
        return  # recomputation runs the norm again in the backward
    tokens, rows = result["history_tokens"], result["input_norm_rows"]
    shards = layout["tensor_parallel_size"] if layout.get("sequence_parallel") else 1
    assert len(tokens) == STEPS and rows == [-(-t // shards) for t in tokens], (layout, tokens, rows)
    if shards > 1:
        assert any(t % shards for t in tokens), tokens  # the padding path ran


def _sequence_parallel_encoder(rank: int, world_size: int, cases: list[tuple[str, list[int]]]) -> list[list[int]]:
    """For each ``(norm, lengths)``: the encoder with its layers on token shards over all ranks against a copy on
    every token, same weights and inputs (targets and time included), in float64 so that only the order of
    the sums differs; the outputs, input gradients and parameter gradients must match. Returns the rows the
    first layer's input norm saw, per case."""
    import copy

    import torch
    from lightning_gem.components.encoder import JaggedHistoryEncoder
    from lightning_gem.strategies.dense import TensorParallelGradients, apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    seen = []
    for norm, lengths in cases:
        torch.manual_seed(0)
        sharded = JaggedHistoryEncoder(
            None, 16, 2, 2, max_length=8, norm=norm, use_time=True, attention_impl="reference"
        ).double()
        for layer in sharded.layers:  # residual branches start at zero; give them weights
            torch.nn.init.normal_(layer.output.weight, std=0.3)
        whole = copy.deepcopy(sharded)
        rows: list[int] = []
        sharded.layers[0].input_norm.register_forward_pre_hook(lambda _, args, rows=rows: rows.append(args[0].shape[0]))
        partial = apply_tensor_parallel(sharded, mesh, sequence_parallel=True)
        assert sorted(partial) == sorted(
            f"layers.{i}.{norm_name}.{p}"
            for i in range(2)
            for norm_name in ("attention_norm", "input_norm")
            for p in (("weight", "bias") if norm == "layer" else ("weight",))
        ), partial
        sum_partial_grads = TensorParallelGradients([sharded.get_parameter(n) for n in partial], mesh.get_group())
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        num_tokens = int(offsets[-1])
        kwargs = {
            "time_deltas": torch.rand(num_tokens) * 1e4,
            "num_targets": torch.tensor([min(1, n) for n in lengths]),
            "max_seq_len": max(lengths),
        }
        features = torch.randn(num_tokens, 16, dtype=torch.float64)
        out_grad = torch.randn(num_tokens, 16, dtype=torch.float64)
        inputs = [features.clone().requires_grad_(), features.clone().requires_grad_()]
        outs = [sharded(inputs[0], offsets, **kwargs), whole(inputs[1], offsets, **kwargs)]
        for out in outs:
            out.backward(out_grad)
        sum_partial_grads()
        torch.testing.assert_close(outs[0], outs[1])
        torch.testing.assert_close(inputs[0].grad, inputs[1].grad)
        for name, param in sharded.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(grad, whole.get_parameter(name).grad, msg=lambda m, name=name: f"{name}: {m}")
        seen.append(rows)
    return seen


@pytest.mark.slow
def test_sequence_parallel_encoder_matches_the_encoder_on_every_token() -> None:
    # odd and even token counts (padded and not), a batch of 1 token (rank 1 holds only padding), none
    cases = [("rms", [3, 0, 5, 1]), ("layer", [4, 2, 6]), ("rms", [1]), ("rms", [0, 0])]
    rows = run_ranks(_sequence_parallel_encoder, 2, cases)[0]
    assert rows == [[5], [6], [1], [0]]  # ceil(T / 2) of T = 9, 12, 1, 0


CKPT_LAYOUT = {"sparse_group_size": 2, "dense_replicate_size": 2, "embedding_optimizer": "rowwise_adagrad"}


def _save_then_resume(rank: int, world_size: int, root: str, layout: dict[str, Any] = CKPT_LAYOUT) -> dict[str, Any]:
    """6 steps saving every 3, then a fresh run resumed from step 3 to step 6 (AdamW dense, stateful tables)."""
    straight = fit_gem(
        world_size, layout, steps=6, global_batch=GLOBAL_BATCH, root=root, ckpt_every=3, dense_optimizer="adamw"
    )
    resumed = fit_gem(
        world_size,
        layout,
        steps=6,
        global_batch=GLOBAL_BATCH,
        ckpt_path=f"{root}/step=3.ckpt",
        dense_optimizer="adamw",
    )
    # SGD keeps no state, so the checkpoint load initialises it with a zero-gradient step over groups that mix
    # FSDP2's DTensors and the replicated plain parameters.
    sgd = {"steps": 4, "global_batch": GLOBAL_BATCH, "dense_optimizer": "sgd"}
    sgd_straight = fit_gem(world_size, layout, root=f"{root}/sgd", ckpt_every=2, **sgd)
    sgd_resumed = fit_gem(world_size, layout, ckpt_path=f"{root}/sgd/step=2.ckpt", **sgd)
    out = {"straight": straight, "resumed": resumed, "sgd_straight": sgd_straight, "sgd_resumed": sgd_resumed}
    return out if rank == 0 else {}


def _load_elsewhere(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Weights of a checkpoint loaded by ``validate`` at this world size; the error of resuming training here."""
    weights = validate_gem(world_size, {"sparse_group_size": 1}, ckpt_path=path, batch_size=GLOBAL_BATCH // 4)
    # a new run (no training step) starting from the weights, with tensor parallelism
    layout = {"weights_from": path, "tensor_parallel_size": 2, "embedding_optimizer": "sgd"}
    started = fit_gem(world_size, layout, steps=0, global_batch=GLOBAL_BATCH, then_test=True)
    assert 0.0 <= started["tested"][0]["test/auc_ctr"] <= 1.0  # the test loader, merged per tensor-parallel group
    try:
        # the saved per-rank batch (2) on 2 ranks, sharded over both: another embedding plan
        layout = CKPT_LAYOUT | {"sparse_group_size": 2}
        fit_gem(world_size, layout, steps=7, global_batch=GLOBAL_BATCH // 2, ckpt_path=path)
    except ValueError as err:
        error = str(err)
    else:
        error = "no error"
    return {"weights": weights, "started": started["weights"], "error": error} if rank == 0 else {}


@pytest.mark.slow
def test_checkpoint_resumes_exactly_and_loads_at_another_world_size(tmp_path) -> None:
    out = run_ranks(_save_then_resume, 4, str(tmp_path))[0]
    straight, resumed = out["straight"], out["resumed"]
    assert (tmp_path / "step=3.ckpt" / "meta.pt").is_file() and (tmp_path / "step=6.ckpt" / "meta.pt").is_file()
    assert len(resumed["losses"]) == 3  # steps 4..6 only: the DataModule resumed mid-epoch
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-6)
    np.testing.assert_allclose(out["sgd_resumed"]["losses"], out["sgd_straight"]["losses"][2:], rtol=1e-6)
    for name, value in straight["weights"].items():
        np.testing.assert_allclose(resumed["weights"][name], value, atol=1e-6, err_msg=name)

    # weights reshard to 2 ranks and a replicated layout; the embedding optimizer state cannot
    elsewhere = run_ranks(_load_elsewhere, 2, str(tmp_path / "step=6.ckpt"))[0]
    for name, value in straight["weights"].items():
        np.testing.assert_allclose(elsewhere["weights"][name], value, atol=0, err_msg=name)
        np.testing.assert_allclose(elsewhere["started"][name], value, atol=0, err_msg=name)
    assert "torchrec cannot reshard optimizer state" in elsewhere["error"]

    # one ordinary Lightning checkpoint that the plain model loads in this (single, process-group-free) process
    from gem_workloads import make_model
    from lightning_gem.strategies.distributed_checkpoint import consolidate

    consolidate(tmp_path / "step=6.ckpt", tmp_path / "model.ckpt")
    plain = type(make_model(None, "adamw")).load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu")
    state = plain.state_dict()
    assert sorted(state) == sorted(straight["weights"])
    for name, value in straight["weights"].items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)


@pytest.mark.slow
def test_checkpoint_resumes_exactly_in_one_process(tmp_path) -> None:
    """World size 1 keeps the dense parameters plain (no FSDP2 over one rank): its checkpoints resume too."""
    out = run_ranks(_save_then_resume, 1, str(tmp_path), {"embedding_optimizer": "rowwise_adagrad"})[0]
    np.testing.assert_allclose(out["resumed"]["losses"], out["straight"]["losses"][3:], rtol=1e-6)
    np.testing.assert_allclose(out["sgd_resumed"]["losses"], out["sgd_straight"]["losses"][2:], rtol=1e-6)
    for name, value in out["straight"]["weights"].items():
        np.testing.assert_allclose(out["resumed"]["weights"][name], value, atol=1e-6, err_msg=name)


def _compiled_against_eager(rank: int, world_size: int) -> dict[str, Any]:
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"compile_layers": True})):
        for checkpointing in ({}, {"activation_memory_budget": 0.9}):
            layout = {"embedding_optimizer": "rowwise_adagrad"} | extra | checkpointing
            before = _dynamo_graphs()
            runs[name, bool(checkpointing)] = fit_gem(world_size, layout, steps=STEPS, global_batch=GLOBAL_BATCH)
            runs[name, bool(checkpointing)]["graphs"] = _dynamo_graphs() - before
    return runs if rank == 0 else {}


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones_under_fsdp2_and_checkpointing() -> None:
    """compile_layers: each HSTU layer compiled with dynamic shapes between activation checkpointing and FSDP2
    over 2 ranks: the same losses and weights as the eager layers, without a graph per jagged batch size."""
    runs = run_ranks(_compiled_against_eager, 2)[0]
    for checkpointing in (False, True):
        eager, compiled = runs["eager", checkpointing], runs["compiled", checkpointing]
        assert compiled["compiled"] == ["encoder.layers.0", "encoder.layers.1"] and not eager["compiled"]
        assert bool(compiled["checkpointed"]) == checkpointing
        np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=LOSS_RTOL)
        for name, value in compiled["weights"].items():
            np.testing.assert_allclose(value, eager["weights"][name], atol=1e-5, err_msg=name)
        assert eager["graphs"] == 0
    # dynamic shapes: the first run's five batches (three token counts) took fewer graphs than steps; the second
    # run's layers, checkpointed or not, reused them
    assert 1 <= runs["compiled", False]["graphs"] < STEPS and runs["compiled", True]["graphs"] < STEPS
    from lightning_gem.strategies import GEM5DStrategy

    with pytest.raises(TypeError, match="compile_layers"):
        GEM5DStrategy(compile_layers="yes")


def _pipeline_across_epochs(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    layout = {"embedding_optimizer": "rowwise_adagrad"}
    plain = fit_gem(world_size, layout, steps=steps, global_batch=GLOBAL_BATCH)
    # then Trainer.test on the same Trainer: the parallelized model is reused, the pipeline serves the test too
    piped = fit_gem(
        world_size, layout | {"train_pipeline": True}, steps=steps, global_batch=GLOBAL_BATCH, then_test=True
    )
    out = {"plain": plain["losses"], "piped": piped["losses"], "hits": piped["prefetched"], "tested": piped["tested"]}
    return out if rank == 0 else {}


@pytest.mark.slow
def test_train_pipeline_loses_no_batch_at_epoch_ends() -> None:
    batches_per_epoch = NUM_USERS // GLOBAL_BATCH
    steps = 2 * batches_per_epoch + 1  # two whole epochs and the first batch of a third
    out = run_ranks(_pipeline_across_epochs, 2, steps)[0]
    assert len(out["piped"]) == steps
    np.testing.assert_allclose(out["piped"], out["plain"], rtol=1e-6)
    test_batches = math.ceil(8 / 2 / (GLOBAL_BATCH // 2))  # 8 test users shared by 2 ranks, batches of 4
    # both embedding modules at every step, the last batch of each epoch included, then every test batch
    assert out["hits"] == 2 * steps + 2 * test_batches
    assert 0.0 <= out["tested"][0]["test/auc_ctr"] <= 1.0


@pytest.mark.slow
def test_cli_fits_the_gem5d_config_on_two_processes(tmp_path) -> None:
    """``lightning-gem fit --config examples/configs/quickstart_gem5d.yaml``: Lightning launches the second process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "lightning_gem.cli",
        "fit",
        f"--config={root / 'examples' / 'configs' / 'quickstart_gem5d.yaml'}",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=2",  # 2 batches: the CLI reads 1 as 1.0, all of them
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--data.init_args.source.init_args.num_train_users=400",
        "--data.init_args.source.init_args.num_val_users=64",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    assert (checkpoint / "meta.pt").is_file() and len(list(checkpoint.glob("*.distcp"))) == 2


def _dense_only(rank: int, world_size: int) -> list[float]:
    import lightning as L
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_gem.strategies import GEM5DStrategy

    class Recorded(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.seen.append(float(out["loss"]))
            return out

    L.seed_everything(0, verbose=False)
    model = Recorded()
    model.seen = []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="gem5d",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=1,
    )
    trainer.fit(model)
    assert isinstance(trainer.strategy, GEM5DStrategy) and trainer.strategy.embedding_optimizer is None
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # FSDP2 on the whole model
    return model.seen


@pytest.mark.slow
def test_a_model_without_embedding_tables_trains_under_fsdp2() -> None:
    losses = run_ranks(_dense_only, 2)
    assert len(losses[0]) == 3 and all(np.isfinite(losses[0] + losses[1]))


def _dmpcollection_groups_and_plans(rank: int, world_size: int) -> list[dict[str, Any]]:
    """For each sparse group size: DMPCollection's sharding and replica groups and its re-addressing of the
    group-local plan, next to gem5d's mesh groups and re-addressed plan.

    DMPCollection cannot be built on CPU (it asserts a CUDA device); its group construction and plan
    re-addressing are methods over rank arithmetic and the process groups, called here on a stand-in
    instance that has the one attribute they read (``_device``).
    """
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from gem_workloads import make_model, make_source
    from lightning_gem.strategies.mesh import build_device_mesh, resolve_layout
    from lightning_gem.strategies.sparse import EmbeddingOptimizerConfig, make_sharders, plan_sharding
    from torchrec.distributed.model_parallel import DMPCollection

    from lightning_gem.data import GEMDataModule
    from lightning_gem.testing.distributed import forget_torchrec_node_groups

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    stand_in = SimpleNamespace(_device=device)
    model = make_model(GEMDataModule(source=make_source(), batch_size=4).schema)
    sharders = make_sharders("cpu", EmbeddingOptimizerConfig(name="sgd"))
    out = []
    for group_size in (1, 2, world_size):
        forget_torchrec_node_groups()
        layout = resolve_layout(world_size, sparse_group_size=group_size)
        sparse = build_device_mesh(layout, "cpu")[2]
        theirs, sharding_pg, replica_pg = DMPCollection._create_process_groups(
            stand_in, global_rank=rank, world_size=world_size, local_size=group_size, use_inter_host_allreduce=True
        )
        local = plan_sharding(model, layout, rank, device, sharders, group_local=True)
        ours = plan_sharding(model, layout, rank, device, sharders)
        DMPCollection._remap_sharding_plan(
            stand_in,
            plan=local,
            rank=rank,
            step=world_size // group_size,
            sharding_group_size=group_size,
            use_inter_host_allreduce=True,
        )

        def addresses(plan: Any) -> dict[str, tuple[list[int], list[int]]]:
            return {
                f"{path}.{table}": (s.ranks, [shard.placement.rank() for shard in s.sharding_spec.shards])
                for path, module_plan in plan.plan.items()
                for table, s in module_plan.items()
            }

        out.append(
            {
                "group_size": group_size,
                "mesh": (theirs.mesh.tolist(), sparse.mesh.tolist()),
                "sharding": (dist.get_process_group_ranks(sharding_pg), sparse["sparse_shard"].mesh.tolist()),
                "replica": (dist.get_process_group_ranks(replica_pg), sparse["sparse_replicate"].mesh.tolist()),
                "plan": (addresses(local), addresses(ours)),
            }
        )
    return out


@pytest.mark.slow
def test_dmpcollection_builds_our_groups_and_readdresses_the_plan_as_we_do() -> None:
    """``DMPCollection(use_inter_host_allreduce=True)``: sharding groups ``rank // S`` and replica groups
    ``{j, j + S, ...}``, those of ``mesh.py``; given the group-local plan it moves every shard to the ranks
    gem5d's own re-addressing gives (so the plan handed to it must not be re-addressed before)."""
    world_size = 4
    per_rank = run_ranks(_dmpcollection_groups_and_plans, world_size)
    for rank, cases in enumerate(per_rank):
        for case in cases:
            theirs, ours = case["mesh"]
            assert theirs == ours == [list(range(g, g + case["group_size"])) for g in range(0, 4, case["group_size"])]
            for axis in ("sharding", "replica"):
                theirs, ours = case[axis]
                assert theirs == ours, (rank, axis, case)
            theirs, ours = case["plan"]
            assert theirs == ours, (rank, case["group_size"])
            group = rank // case["group_size"] * case["group_size"]
            assert all(min(ranks) >= group for ranks, _ in ours.values()), ours  # re-addressed into this group


def _kernels_of_sharded_tables(rank: int, world_size: int) -> list[str]:
    import torch
    from lightning_gem.strategies.replication import embedding_kernels
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel

    torch.distributed.init_process_group("gloo")
    meta = torch.device("meta")
    model = torch.nn.ModuleDict(
        {
            "pooled": EmbeddingBagCollection(
                [EmbeddingBagConfig(name="p", embedding_dim=8, num_embeddings=10, feature_names=["f"])], device=meta
            ),
            "sequence": EmbeddingCollection(
                [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=10, feature_names=["g"])], device=meta
            ),
        }
    )
    sharded = DistributedModelParallel(model, device=torch.device("cpu"))
    names = {type(m).__name__ for m in embedding_kernels(sharded)}
    assert not any("Batched" in type(m).__name__ for m in sharded.modules())  # the reason for embedding_kernels
    return sorted(names)


@pytest.mark.slow
def test_embedding_kernels_reach_into_sharded_modules_lookup_lists() -> None:
    """torchrec's sharded modules keep their lookups in plain lists, outside ``module.modules()``: the fully
    sharded tables' hooks are found through them."""
    names = run_ranks(_kernels_of_sharded_tables, 1)[0]
    assert {"ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection"} <= set(names)
    assert sum("Batched" in name for name in names) >= 2, names  # one TBE kernel per collection at least
