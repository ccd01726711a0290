"""MFUMonitor in a short CPU fit: finite perf metrics, imbalance 1.0 in one process, the report."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning_gem.components import GEMRanker
from torch.utils.data import DataLoader

from lightning_gem.callbacks import MFUMonitor
from lightning_gem.data.synthetic import SyntheticRankingSource


def test_fit_logs_mfu_and_prints_the_report(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    source = SyntheticRankingSource(
        num_items=100,
        num_train_users=40,
        num_val_users=4,
        num_test_users=4,
        max_history_length=16,
        max_candidates=4,
        mean_candidates=2.0,
    )
    loader = DataLoader(source.dataset("train"), batch_size=8, collate_fn=source.collate)
    model = GEMRanker(source.schema, embedding_dim=8, model_dim=16, num_layers=1, num_heads=2, head_hidden_dims=(16,))
    monitor = MFUMonitor(peak_tflops=1.0, baseline_samples_per_s=100.0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
    )
    trainer.fit(model, loader)

    assert len(monitor.history) == 5
    for row in monitor.history:
        assert row["perf/model_flops"] > 0
        for name in ("perf/tflops", "perf/mfu", "perf/scaling_ratio", "perf/e2e_mfu"):
            assert math.isfinite(row[name]) and row[name] > 0, (name, row)
        assert row["perf/step_time_imbalance"] == 1.0
        assert row["perf/e2e_mfu"] == pytest.approx(row["perf/mfu"] * row["perf/scaling_ratio"])
    assert trainer.callback_metrics["perf/mfu"] > 0
    out = capsys.readouterr().out
    assert "MFU report over 5 training steps" in out and "perf/mfu" in out


def test_no_mfu_without_a_peak_on_cpu_and_arguments_are_checked() -> None:
    monitor = MFUMonitor()
    assert monitor.peak_tflops is None
    with pytest.raises(ValueError, match="peak_tflops"):
        MFUMonitor(peak_tflops=0.0)
    with pytest.raises(ValueError, match="flops_every_n_steps"):
        MFUMonitor(flops_every_n_steps=0)
