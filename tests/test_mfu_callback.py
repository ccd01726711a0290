"""MFUMonitor in short CPU fits: finite perf metrics, imbalance 1.0 in one process, the report; the counting leaves
the training unchanged, a resumed run counts the uninterrupted run's steps, throughput is total over total."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning_gem.components import GEMRanker
from torch.utils.data import DataLoader

from lightning_gem.callbacks import MFUMonitor, mfu
from lightning_gem.data import GEMDataModule
from lightning_gem.data.synthetic import SyntheticRankingSource
from lightning_gem.testing.distributed import run_ranks


def _trainer(monitor: MFUMonitor, root: Path, **kwargs) -> L.Trainer:
    kwargs.setdefault("log_every_n_steps", 1)
    kwargs.setdefault("accelerator", "cpu")
    return L.Trainer(
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def _ranker_and_loader(num_users: int) -> tuple[GEMRanker, DataLoader]:
    """A tiny GEMRanker and a loader of batches of 8 synthetic users (the last one smaller)."""
    torch.manual_seed(0)
    source = SyntheticRankingSource(
        num_items=100,
        num_train_users=num_users,
        num_val_users=4,
        num_test_users=4,
        max_history_length=16,
        max_candidates=4,
        mean_candidates=2.0,
    )
    loader = DataLoader(source.dataset("train"), batch_size=8, collate_fn=source.collate)
    model = GEMRanker(source.schema, embedding_dim=8, model_dim=16, num_layers=1, num_heads=2, head_hidden_dims=(16,))
    return model, loader


def test_fit_logs_mfu_and_prints_the_report(tmp_path, capsys) -> None:
    model, loader = _ranker_and_loader(40)
    monitor = MFUMonitor(peak_tflops=1.0, baseline_samples_per_s=100.0)
    trainer = _trainer(monitor, tmp_path, max_steps=5, limit_val_batches=0)
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
    assert "MFU report over 4 training steps on 1 device(s)" in out and "perf/mfu" in out
    summary = json.loads((tmp_path / "mfu.json").read_text())
    assert summary["steps"] == 4 and summary["mfu"] > 0 and summary["compute_imbalance"] == 1.0
    assert summary["e2e_mfu"] == pytest.approx(summary["mfu"] * summary["scaling_ratio"])
    assert summary["scaling_ratio"] == pytest.approx(summary["samples_per_s_per_device"] / 100.0)
    equation = f"{summary['e2e_mfu']:.4g} = {summary['mfu']:.4g} x {summary['scaling_ratio']:.4g}"
    assert f"E2E MFU = local MFU x scaling ratio: {equation}" in out
    assert 0 < summary["compute_time_s"] < summary["step_time_s"]
    assert (tmp_path / "mfu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A single-device run's summary is the baseline of a scaled run.
    assert MFUMonitor(baseline_samples_per_s=tmp_path / "mfu.json").baseline_samples_per_s == pytest.approx(
        summary["samples_per_s_per_device"]
    )


def test_steps_between_counts_scale_the_counted_flops_by_their_tokens(tmp_path) -> None:
    model, loader = _ranker_and_loader(20)  # batches of 8, 8 and 4 users
    tokens = [batch.num_tokens for batch in loader]
    monitor = MFUMonitor(flops_every_n_steps=10, plot=False)
    _trainer(monitor, tmp_path, max_steps=3, limit_val_batches=0).fit(model, loader)
    counted = monitor.history[0]["perf/model_flops"]
    for row, n in zip(monitor.history[1:], tokens[1:], strict=True):
        assert row["perf/model_flops"] == pytest.approx(counted * n / tokens[0])


def _fit_and_state(callbacks: list[L.Callback], root: Path) -> dict[str, torch.Tensor]:
    """Parameters (and buffers) of the tiny ranker with dropout after 5 steps with ``callbacks``."""
    model, loader = _ranker_and_loader(40)
    torch.manual_seed(1)  # dropout draws random numbers every step: a counter drawing any would shift them
    model = GEMRanker(model.schema, embedding_dim=8, model_dim=16, num_layers=1, num_heads=2, dropout=0.2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, loader)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_counting_flops_leaves_the_training_unchanged(tmp_path) -> None:
    # FlopCounterMode runs silu_backward through its decomposition: other rounding, other gradients.
    counted = _fit_and_state([MFUMonitor(flops_every_n_steps=1, plot=False)], tmp_path)
    plain = _fit_and_state([], tmp_path)
    assert counted.keys() == plain.keys()
    for name in counted:
        assert torch.equal(counted[name], plain[name]), name  # bit-identical after 5 counted updates


def test_no_mfu_without_a_peak_on_cpu_and_arguments_are_checked() -> None:
    monitor = MFUMonitor()
    assert monitor.peak_tflops is None
    with pytest.raises(ValueError, match="peak_tflops"):
        MFUMonitor(peak_tflops=0.0)
    with pytest.raises(ValueError, match="flops_every_n_steps"):
        MFUMonitor(flops_every_n_steps=0)
    with pytest.raises(ValueError, match="baseline_samples_per_s"):
        MFUMonitor(baseline_samples_per_s="no/such/mfu.json")


class _Clock:
    """Stands in for the ``time`` module the monitor reads (``perf_counter``): the modules below advance it by the
    time their work is meant to take, so step times, and every rate and imbalance made from them, are exact. The
    times are binary fractions: their sums and quotients are exact in floating point too."""

    def __init__(self) -> None:
        self.now = 1024.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


SLOW_STEP_S, FAST_STEP_S = 0.125, 0.015625


class _SlowEveryThirdStep(L.LightningModule):
    """Steps of 4 samples; every third one takes ``SLOW_STEP_S`` on ``clock``, the others ``FAST_STEP_S`` (a loaded
    machine's stalls)."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.clock = clock

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.advance(SLOW_STEP_S if batch_idx % 3 == 2 else FAST_STEP_S)
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_throughput_is_total_samples_over_total_time(tmp_path, capsys, monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(mfu, "time", clock)
    monitor = MFUMonitor(plot=False)
    loader = DataLoader(torch.randn(64, 4), batch_size=4)
    _trainer(monitor, tmp_path, max_steps=10).fit(_SlowEveryThirdStep(clock), loader)
    summary = monitor.summary()
    rows = monitor.history[1:]  # the first (warm-up) step is left out: batches 1 to 9, of which 2, 5 and 8 are slow
    assert [row["perf/step_time_s"] for row in rows] == [FAST_STEP_S, SLOW_STEP_S, FAST_STEP_S] * 3
    total_time = 3 * SLOW_STEP_S + 6 * FAST_STEP_S
    assert summary["samples_per_s_per_device"] == 4 * 9 / total_time
    assert summary["samples_per_s_per_device_median"] == 4 / FAST_STEP_S
    # The mean of per-step rates weighs a fast step as much as a slow one: (6 * 256 + 3 * 32) / 9 = 181.3 per s
    # against the true 76.8 per s.
    rates = [row["perf/samples_per_s_per_device"] for row in rows]
    assert statistics.fmean(rates) == pytest.approx((6 * 4 / FAST_STEP_S + 3 * 4 / SLOW_STEP_S) / 9)
    assert summary["tflops"] == pytest.approx(sum(row["perf/model_flops"] for row in rows) / total_time / 1e12)
    # CPU: no peak, so no MFU; one device: the scaling ratio is 1 by definition.
    out = capsys.readouterr().out
    assert "E2E MFU = local MFU x scaling ratio: n/a = n/a (no peak TFLOP/s" in out and "x 1 (one device" in out


def test_a_resumed_run_counts_the_steps_the_uninterrupted_run_counts(tmp_path) -> None:
    source = SyntheticRankingSource(
        num_items=100, num_train_users=80, num_val_users=4, num_test_users=4, max_history_length=16
    )

    def fit(max_steps: int, ckpt_path: Path | None = None) -> MFUMonitor:
        torch.manual_seed(0)
        model = GEMRanker(source.schema, embedding_dim=8, model_dim=16, num_layers=1, num_heads=2)
        monitor = MFUMonitor(flops_every_n_steps=4, plot=False)
        trainer = _trainer(monitor, tmp_path, max_steps=max_steps, limit_val_batches=0)
        if max_steps == 3:
            trainer.callbacks.append(ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=3))
        trainer.fit(model, datamodule=GEMDataModule(source=source, batch_size=8, seed=1), ckpt_path=ckpt_path)
        return monitor

    full = {row["step"]: row["perf/model_flops"] for row in fit(8).history}
    fit(3)  # writes mid.ckpt after 3 steps, between the counted steps (global steps 0 and 4)
    resumed = {row["step"]: row["perf/model_flops"] for row in fit(8, tmp_path / "mid.ckpt").history}
    assert sorted(resumed) == [4.0, 5.0, 6.0, 7.0, 8.0]  # rows are numbered by the steps done after them
    # Global step 3 scales step 0's count (restored from the checkpoint); step 4 is counted, in both runs.
    assert resumed == {step: flops for step, flops in full.items() if step >= 4}
    assert len(set(full.values())) > 1  # the batches differ in size: a wrong count would show


FORWARD_S = (0.125, 0.375)  # rank 0's and rank 1's forward: rank 1's batch is 3x the work
BACKWARD_S = 0.0625


class _UnevenModule(L.LightningModule):
    """Rank 1's forward takes 3x rank 0's on ``clock``; the backward's all-reduce makes every rank wait for the
    slowest forward, so each step ends ``max(FORWARD_S) + BACKWARD_S`` after it began, on every rank."""

    def __init__(self, clock: _Clock, forward_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.clock, self.forward_s = clock, forward_s

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.advance(self.forward_s)
        return self.layer(batch).square().mean()

    def on_after_backward(self) -> None:
        self.clock.advance(max(FORWARD_S) - self.forward_s + BACKWARD_S)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_uneven(rank: int, world_size: int, root: str) -> None:
    clock = _Clock()
    mfu.time = clock  # this rank's process only: it exits after the fit
    monitor = MFUMonitor(plot=False)
    trainer = _trainer(monitor, Path(root), devices=world_size, strategy="ddp", max_steps=4)
    trainer.fit(_UnevenModule(clock, FORWARD_S[rank]), DataLoader(torch.randn(64, 4), batch_size=4))


@pytest.mark.slow
def test_two_gloo_ranks_report_the_compute_imbalance_that_step_times_hide(tmp_path) -> None:
    # The processes are the harness's (it destroys the process group before each exits), not ddp_spawn's, whose
    # gloo threads could abort a process at exit after a finished fit.
    run_ranks(_fit_uneven, 2, str(tmp_path))
    summary = json.loads((tmp_path / "mfu.json").read_text())
    # Forward 0.375 s vs 0.125 s: max / mean = 0.375 / 0.25 = 1.5; the synchronised steps are equal.
    assert summary["compute_imbalance"] == 1.5, summary
    assert summary["step_time_imbalance"] == 1.0, summary
    assert summary["compute_time_s"] == FORWARD_S[0], summary  # rank 0 writes mfu.json: its own forward
    assert summary["step_time_s"] == max(FORWARD_S) + BACKWARD_S, summary


class _Recorder(Logger):
    """A logger that keeps what it was given: ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def test_every_step_is_measured_and_logged_on_the_loggers_steps(tmp_path) -> None:
    model, loader = _ranker_and_loader(48)
    monitor = MFUMonitor(peak_tflops=1.0, plot=False)
    recorder = _Recorder()
    trainer = _trainer(monitor, tmp_path, max_steps=6, limit_val_batches=0, log_every_n_steps=2)
    trainer.loggers = [recorder]
    trainer.fit(model, loader)
    assert len(monitor.history) == 6
    logged = [step for step, metrics in recorder.rows if "perf/mfu" in metrics]
    assert logged == [1, 3, 5], recorder.rows  # the loggers' steps (every second one), each with the step's values


@pytest.mark.gpu
def test_cuda_steps_are_timed_by_events_without_a_sync_per_step(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, loader = _ranker_and_loader(48)
    monitor = MFUMonitor(plot=False)
    _trainer(monitor, tmp_path, accelerator="gpu", devices=1, max_steps=6, limit_val_batches=0).fit(model, loader)
    assert len(monitor.history) == 6
    for row in monitor.history:
        assert 0 < row["perf/compute_time_s"] < row["perf/step_time_s"] < 10.0, row
        assert row["perf/mfu"] > 0 and row["perf/step_time_imbalance"] == 1.0
