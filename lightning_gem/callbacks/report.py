"""A callback that measures training throughput and prints it beside the validation metrics."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

__all__ = ["ThroughputReport"]


class ThroughputReport(L.Callback):
    """Logs ``train/samples_per_s`` and ``train/tokens_per_s`` and prints one line per validation.

    Throughput is measured over the training batches since the previous validation (wall time between
    ``on_train_batch_start`` and ``on_train_batch_end``, so data loading between batches is excluded only
    if ``include_data_time=False``). A batch's tokens come from its ``num_tokens`` attribute when it has
    one (``RankingBatch``, ``RetrievalBatch``); samples from ``batch_size``.

    Args:
        include_data_time: count the time spent waiting for the next batch (end-to-end throughput).
        metrics: prefixes of logged metrics to print after each validation.
    """

    def __init__(self, include_data_time: bool = True, metrics: tuple[str, ...] = ("val/", "test/")) -> None:
        self.include_data_time = include_data_time
        self.metrics = metrics
        self._reset()

    def _reset(self) -> None:
        self._samples = 0
        self._tokens = 0
        self._seconds = 0.0
        self._started: float | None = None
        self._last_end: float | None = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._started = self._last_end if (self.include_data_time and self._last_end is not None) else now

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None:
            return
        now = time.perf_counter()
        self._seconds += now - self._started
        self._last_end = now
        self._samples += int(getattr(batch, "batch_size", 0) or 0)
        self._tokens += int(getattr(batch, "num_tokens", 0) or 0)
        if self._seconds > 0:
            pl_module.log_dict(
                {
                    "train/samples_per_s": self._samples / self._seconds,
                    "train/tokens_per_s": self._tokens / self._seconds,
                },
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None  # validation time is not training time

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._print(trainer, "validation")
        self._reset()

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._print(trainer, "test")

    def _print(self, trainer: L.Trainer, stage: str) -> None:
        values = {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name.startswith(self.metrics) and isinstance(value, (torch.Tensor, float, int))
        }
        shown = " ".join(f"{name}={value:.4f}" for name, value in sorted(values.items()))
        speed = ""
        if stage == "validation" and self._seconds > 0:
            speed = (
                f" | train {self._samples / self._seconds:,.0f} samples/s, "
                f"{self._tokens / self._seconds:,.0f} tokens/s over {self._seconds:.1f} s"
            )
        if trainer.is_global_zero:
            print(f"[{stage}] epoch {trainer.current_epoch} step {trainer.global_step}: {shown}{speed}", flush=True)
