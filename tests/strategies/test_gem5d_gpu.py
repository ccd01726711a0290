"""gem5d on one CUDA GPU (NCCL, world size 1): the same code path as the gloo tests. Skipped without a GPU.

The GEM example at a size where activations matter: it trains, and under an activation budget of half
the unconstrained peak the measured peak stays within the budget + 10% at most 1.25x the step time.
"""

from __future__ import annotations

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


def _fit_on_gpu(rank: int, world_size: int, budget: float | None, steps: int) -> dict[str, Any]:
    import lightning as L
    from lightning_gem.components import GEMRanker
    from lightning_gem.strategies import GEM5DStrategy

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
    data = GEMDataModule(source=source, batch_size=256, seed=0)
    model = GEMRanker(data.schema, embedding_dim=64, model_dim=256, num_layers=4, num_heads=4)
    meter = StepMeter()
    strategy = GEM5DStrategy(activation_memory_budget=budget)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
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
    }


def test_world_size_one_trains_on_a_gpu_with_nccl() -> None:
    _require_cuda()
    out = run_ranks(_fit_on_gpu, 1, None, 30)[0]
    assert out["backend"] == "nccl" and out["tables"] == ["cuda"]
    losses = out["losses"]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


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
    assert bounded["step_seconds"] <= 1.25 * free["step_seconds"], (bounded["step_seconds"], free["step_seconds"])
