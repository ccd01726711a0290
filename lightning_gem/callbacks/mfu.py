"""A callback that logs model FLOPs, achieved TFLOP/s, local MFU, rank imbalance and E2E MFU per step.

``E2E MFU = local MFU x scaling ratio`` (``DESIGN.md``): local MFU is achieved / peak FLOP/s of one
device; the scaling ratio is the per-device throughput of the run over a single-device baseline.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_gem.flops import peak_tflops as device_peak_tflops

__all__ = ["MFUMonitor"]


class MFUMonitor(L.Callback):
    """Logs ``perf/*`` per training step and prints a one-page report at the end of ``fit``.

    The FLOPs are those of the actual step: a ``FlopCounterMode`` is entered in ``on_train_batch_start``
    and left in ``on_train_batch_end``, so forward, backward and optimizer step of the real (jagged)
    batch are counted; only matmuls count (see :mod:`lightning_gem.flops`). The counter's dispatch and
    module hooks slow small models down (tens of percent on CPU-sized layers, little on GPU-sized
    ones), which lowers the measured TFLOP/s: raise ``flops_every_n_steps`` to measure less often; steps
    in between reuse the last measured FLOPs (an approximation when batch shapes vary).

    Logged (``on_step``): ``perf/model_flops``, ``perf/step_time_s`` (CUDA synchronised, data loading
    excluded), ``perf/tflops`` (achieved, this rank), ``perf/mfu`` (when a peak is known),
    ``perf/step_time_imbalance`` (max / mean step time over ranks: an all-gather of two scalars per step;
    1.0 in one process), ``perf/samples_per_s_per_device`` (global samples / world size / slowest
    rank's step time), and with ``baseline_samples_per_s`` ``perf/scaling_ratio`` and ``perf/e2e_mfu``.

    Args:
        peak_tflops: peak TFLOP/s of one device; None: looked up for CUDA devices
            (:func:`lightning_gem.flops.peak_tflops`, dense bf16); CPU has no default, so no MFU.
        baseline_samples_per_s: single-device throughput of the same model and batch size, the
            denominator of the scaling ratio.
        flops_every_n_steps: count FLOPs every ``n`` steps (1: every step).
        plot: save ``mfu.png`` (TFLOP/s and MFU over steps) to the trainer's log dir if matplotlib is
            installed.

    Example:
        >>> monitor = MFUMonitor(peak_tflops=989.0, baseline_samples_per_s=20_000.0)
    """

    def __init__(
        self,
        peak_tflops: float | None = None,
        baseline_samples_per_s: float | None = None,
        flops_every_n_steps: int = 1,
        plot: bool = True,
    ) -> None:
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"`peak_tflops` must be > 0, got {peak_tflops}")
        if baseline_samples_per_s is not None and not baseline_samples_per_s > 0:
            raise ValueError(f"`baseline_samples_per_s` must be > 0, got {baseline_samples_per_s}")
        if flops_every_n_steps < 1:
            raise ValueError(f"`flops_every_n_steps` must be >= 1, got {flops_every_n_steps}")
        self.peak_tflops = peak_tflops
        self.baseline_samples_per_s = baseline_samples_per_s
        self.flops_every_n_steps = flops_every_n_steps
        self.plot = plot
        self.history: list[dict[str, float]] = []
        self._counter: FlopCounterMode | None = None
        self._started: float | None = None
        self._last_flops = 0
        self._num_batches = 0
        self._peak: float | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history = []
        self._num_batches = 0
        self._peak = self.peak_tflops if self.peak_tflops is not None else device_peak_tflops(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _synchronize(pl_module.device)
        if self._num_batches % self.flops_every_n_steps == 0:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None:
            return
        _synchronize(pl_module.device)
        seconds = time.perf_counter() - self._started
        self._started = None
        if self._counter is not None:
            self._stop_counter()
        self._num_batches += 1
        samples = float(getattr(batch, "batch_size", 0) or 0)
        metrics = self._step_metrics(pl_module, seconds, samples)
        self.history.append({"step": float(trainer.global_step), **metrics})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._stop_counter()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.history or not trainer.is_global_zero:
            return
        print(self.report(), flush=True)
        if self.plot:
            log_dir = trainer.log_dir or trainer.default_root_dir
            self.save_plot(Path(log_dir) / "mfu.png")

    def _stop_counter(self) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._last_flops = int(counter.get_total_flops())

    def _step_metrics(self, pl_module: L.LightningModule, seconds: float, samples: float) -> dict[str, float]:
        gathered = pl_module.all_gather(torch.tensor([seconds, samples], dtype=torch.float64, device=pl_module.device))
        gathered = gathered.reshape(-1, 2).cpu()
        times, world = gathered[:, 0], gathered.shape[0]
        slowest = float(times.max())
        metrics = {
            "perf/model_flops": float(self._last_flops),
            "perf/step_time_s": seconds,
            "perf/tflops": self._last_flops / seconds / 1e12 if seconds > 0 else math.nan,
            "perf/step_time_imbalance": slowest / float(times.mean()) if float(times.mean()) > 0 else 1.0,
            "perf/samples_per_s_per_device": float(gathered[:, 1].sum()) / world / slowest if slowest > 0 else 0.0,
        }
        if self._peak is not None:
            metrics["perf/mfu"] = metrics["perf/tflops"] / self._peak
        if self.baseline_samples_per_s is not None:
            metrics["perf/scaling_ratio"] = metrics["perf/samples_per_s_per_device"] / self.baseline_samples_per_s
            if "perf/mfu" in metrics:
                metrics["perf/e2e_mfu"] = metrics["perf/mfu"] * metrics["perf/scaling_ratio"]
        return metrics

    def report(self) -> str:
        """A one-page summary: the mean of each logged ``perf/*`` value over the steps of the run."""
        names = [name for name in self.history[0] if name != "step"] if self.history else []
        lines = [f"MFU report over {len(self.history)} training steps (means)"]
        lines.append(f"  peak TFLOP/s per device: {self._peak if self._peak is not None else 'unknown (no MFU)'}")
        for name in names:
            values = [row[name] for row in self.history if name in row and math.isfinite(row[name])]
            if values:
                lines.append(f"  {name:<32} {statistics.fmean(values):.6g}")
        lines.append("  E2E MFU = local MFU x scaling ratio")
        return "\n".join(lines)

    def save_plot(self, path: Path) -> Path | None:
        """Save TFLOP/s (and MFU, if known) over steps to ``path``; None (with a message) without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("MFUMonitor: matplotlib is not installed, skipping the plot (pip install matplotlib)", flush=True)
            return None
        steps = [row["step"] for row in self.history]
        has_mfu = "perf/mfu" in self.history[0]
        fig, axes = plt.subplots(2 if has_mfu else 1, 1, sharex=True, squeeze=False, figsize=(8, 5))
        axes[0, 0].plot(steps, [row["perf/tflops"] for row in self.history])
        axes[0, 0].set_ylabel("TFLOP/s")
        if has_mfu:
            axes[1, 0].plot(steps, [row["perf/mfu"] for row in self.history])
            axes[1, 0].set_ylabel("MFU")
        axes[-1, 0].set_xlabel("step")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
