"""A callback that logs model FLOPs, achieved TFLOP/s, local MFU, rank imbalance and E2E MFU per step.

``E2E MFU = local MFU x scaling ratio`` (``DESIGN.md``): local MFU is achieved / peak FLOP/s of one
device; the scaling ratio is the per-device throughput of the run over a single-device baseline.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_gem.flops import MatmulFlopCounter
from lightning_gem.flops import peak_tflops as device_peak_tflops

__all__ = ["MFUMonitor"]


class MFUMonitor(L.Callback):
    """Logs ``perf/*`` per training step and prints a one-page report at the end of ``fit``.

    The FLOPs are those of the actual step: a :class:`~lightning_gem.flops.MatmulFlopCounter` is entered in
    ``on_train_batch_start`` and left in ``on_train_batch_end``, so forward, backward and optimizer step of the
    real (jagged) batch are counted; only matmuls count (see :mod:`lightning_gem.flops`). The counter runs every
    op exactly as called (no decomposition, no random number drawn, no tensor or autograd node added), so a
    counted step computes the same values as an uncounted one: the monitor does not change the training. Its
    dispatch slows small models down (tens of percent on CPU-sized layers, little on GPU-sized ones), which
    lowers the measured TFLOP/s: raise ``flops_every_n_steps`` to measure less often. The counted steps are
    those whose ``trainer.global_step`` is a multiple of ``flops_every_n_steps``, and the last count is part of
    the callback's checkpoint state, so a resumed run counts the steps the uninterrupted one counts. Steps in
    between take the last measured FLOPs scaled by their batch's size (``batch.num_tokens`` when the batch has
    it, else its samples): exact for linear layers, an approximation for attention.

    Logged (``on_step``): ``perf/model_flops``, ``perf/step_time_s`` (data loading excluded; on CUDA timed by
    events on the current stream, so the callback adds no device sync per step), ``perf/tflops`` (achieved,
    this rank), ``perf/mfu`` (when a peak is known),
    ``perf/step_time_imbalance`` (max / mean step time over ranks), ``perf/compute_time_s`` and
    ``perf/compute_imbalance`` (the forward pass, from the step's start to ``on_before_backward``,
    and its max / mean over ranks), ``perf/samples_per_s_per_device`` (global samples / world size /
    slowest rank's step time), and with a baseline ``perf/scaling_ratio`` and ``perf/e2e_mfu``. Ranks
    are compared through one all-gather of three scalars per step (1.0 in one process), made for the steps since
    the last on the steps the loggers write (``Trainer(log_every_n_steps=...)``), at least every 64 steps, and at
    the end of training; that is also when a CUDA run waits for its events. Every step is measured and kept in
    :attr:`history` (the report and ``mfu.json``); the values go to ``self.log`` on the loggers' steps.

    Why the forward: gradient all-reduces make every rank's *step* wait for the slowest, so step times
    come out nearly equal whatever the load; a data-parallel forward has no collective, so its time is
    the rank's own compute (with sharded embeddings their all-to-all in the forward also synchronises:
    the figure then measures the dense part only if the embeddings are cheap).

    The run's rates (:meth:`summary`, the report) are totals over totals: ``samples_per_s_per_device`` is the
    samples of all steps over the sum of their slowest-rank step times, ``tflops`` the FLOPs over the step
    times; the median of the per-step rates is beside it (``samples_per_s_per_device_median``). A mean of
    per-step rates would weigh a fast step as much as a slow one and overstate a loaded run's throughput.

    At the end of ``fit`` rank 0 prints :meth:`report`, writes :meth:`summary` to ``mfu.json`` and,
    with ``plot``, the curves to ``mfu.png`` in the trainer's log dir. A single-device run's
    ``mfu.json`` is a valid ``baseline_samples_per_s`` for a multi-device run: the scaling ratio is
    then measured, not assumed.

    Args:
        peak_tflops: peak TFLOP/s of one device; None: looked up for CUDA devices
            (:func:`lightning_gem.flops.peak_tflops`, dense bf16); CPU has no default, so no MFU.
        baseline_samples_per_s: single-device throughput of the same model and per-device batch size,
            the denominator of the scaling ratio: a number, or the path of a single-device run's
            ``mfu.json`` (its ``samples_per_s_per_device``).
        flops_every_n_steps: count FLOPs every ``n`` steps (1: every step).
        plot: save ``mfu.png`` (TFLOP/s, MFU, imbalance over steps) if matplotlib is installed.

    Example:
        >>> monitor = MFUMonitor(peak_tflops=989.0, baseline_samples_per_s=20_000.0)
    """

    def __init__(
        self,
        peak_tflops: float | None = None,
        baseline_samples_per_s: float | str | Path | None = None,
        flops_every_n_steps: int = 1,
        plot: bool = True,
    ) -> None:
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"`peak_tflops` must be > 0, got {peak_tflops}")
        if isinstance(baseline_samples_per_s, str | Path):
            baseline_samples_per_s = _baseline_from_summary(Path(baseline_samples_per_s))
        if baseline_samples_per_s is not None and not baseline_samples_per_s > 0:
            raise ValueError(f"`baseline_samples_per_s` must be > 0, got {baseline_samples_per_s}")
        if flops_every_n_steps < 1:
            raise ValueError(f"`flops_every_n_steps` must be >= 1, got {flops_every_n_steps}")
        self.peak_tflops = peak_tflops
        self.baseline_samples_per_s = baseline_samples_per_s
        self.flops_every_n_steps = flops_every_n_steps
        self.plot = plot
        self.history: list[dict[str, float]] = []
        self._counter: MatmulFlopCounter | None = None
        self._step: _StepTimes | None = None  # the step in progress
        self._pending: list[_StepTimes] = []  # steps done, not yet in the history
        self._totals: list[tuple[float, float]] = []  # per history row: samples per device, slowest step time
        self._last_flops = 0
        self._last_size = 0.0  # batch size (tokens or samples) of the step whose FLOPs were counted
        self._peak: float | None = None
        self._world_size = 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_flops": self._last_flops, "last_size": self._last_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_flops, self._last_size = int(state_dict["last_flops"]), float(state_dict["last_size"])

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history, self._pending, self._totals = [], [], []
        self._peak = self.peak_tflops if self.peak_tflops is not None else device_peak_tflops(pl_module.device)
        self._world_size = trainer.world_size

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.flops_every_n_steps == 0:
            self._counter = MatmulFlopCounter()
            self._counter.__enter__()
        self._step = _StepTimes(pl_module.device)

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._step is not None and self._step.forward_end is None:
            self._step.forward_end = self._step.mark()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None:
            return
        step, self._step = self._step, None
        step.end = step.mark()
        samples = batch.shape[0] if isinstance(batch, torch.Tensor) else getattr(batch, "batch_size", 0)
        step.samples = float(samples or 0)
        size = float(getattr(batch, "num_tokens", step.samples) or 0)
        if self._counter is not None:
            self._stop_counter()
            self._last_size = size
        step.flops = self._last_flops * size / self._last_size if self._last_size > 0 else float(self._last_flops)
        step.global_step = float(trainer.global_step)
        self._pending.append(step)
        # Resolved (one device sync, one all-gather for the steps since the last) on the steps the loggers write,
        # as Lightning's ThroughputMonitor logs, and at least every `_MAX_PENDING` steps: each logged float becomes
        # a device tensor, several milliseconds of host time a step in a host-bound run.
        logs = getattr(trainer._logger_connector, "should_update_logs", True)
        if logs or len(self._pending) >= _MAX_PENDING:
            self._resolve(pl_module)
            if logs:
                metrics = {k: v for k, v in self.history[-1].items() if k != "step"}
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resolve(pl_module)  # every rank: the all-gather is a collective

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._stop_counter()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks
        if not self.history or not trainer.is_global_zero:
            return
        print(self.report(), flush=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "mfu.json").write_text(json.dumps(self.summary(), indent=1))
        if self.plot:
            self.save_plot(log_dir / "mfu.png")

    def _stop_counter(self) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._last_flops = counter.flops

    def _resolve(self, pl_module: L.LightningModule) -> None:
        """Turn the pending steps' timings into :attr:`history` rows: every rank's (step time, samples, forward
        time) of those steps in one all-gather. Ranks resolve on the same steps (the loggers' and the run's end)."""
        steps, self._pending = self._pending, []
        if not steps:
            return
        local = torch.tensor([s.times() for s in steps], dtype=torch.float64, device=pl_module.device)
        gathered = pl_module.all_gather(local).reshape(-1, len(steps), 3).cpu()  # [world, steps, 3]
        for index, step in enumerate(steps):
            ranks = gathered[:, index]
            self.history.append({"step": step.global_step, **self._step_metrics(step, ranks)})
            self._totals.append((float(ranks[:, 1].sum()) / ranks.shape[0], float(ranks[:, 0].max())))

    def _step_metrics(self, step: _StepTimes, ranks: torch.Tensor) -> dict[str, float]:
        """``ranks``: ``[world, 3]`` step time, samples, forward time of every rank for this step."""
        seconds, _, forward = step.times()
        times, world = ranks[:, 0], ranks.shape[0]
        slowest = float(times.max())
        flops = step.flops
        metrics = {
            "perf/model_flops": flops,
            "perf/step_time_s": seconds,
            "perf/tflops": flops / seconds / 1e12 if seconds > 0 else math.nan,
            "perf/step_time_imbalance": _max_over_mean(times),
            "perf/compute_time_s": forward,
            "perf/compute_imbalance": _max_over_mean(ranks[:, 2]),
            "perf/samples_per_s_per_device": float(ranks[:, 1].sum()) / world / slowest if slowest > 0 else 0.0,
        }
        if self._peak is not None:
            metrics["perf/mfu"] = metrics["perf/tflops"] / self._peak
        if self.baseline_samples_per_s is not None:
            metrics["perf/scaling_ratio"] = metrics["perf/samples_per_s_per_device"] / self.baseline_samples_per_s
            if "perf/mfu" in metrics:
                metrics["perf/e2e_mfu"] = metrics["perf/mfu"] * metrics["perf/scaling_ratio"]
        return metrics

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """The run's ``perf/*`` values (without its first ``skip_first`` warm-up steps when there are more), plus
        ``steps``, ``world_size`` and ``peak_tflops``: what ``mfu.json`` holds.

        Rates are totals over totals: ``samples_per_s_per_device`` = samples per device of all steps / the sum of
        their slowest-rank step times (``samples_per_s_per_device_median`` beside it), ``tflops`` = FLOPs / the
        sum of this rank's step times, and ``mfu``, ``scaling_ratio``, ``e2e_mfu`` from those. Times and
        imbalances are means over the steps.
        """
        first = skip_first if len(self.history) > skip_first else 0
        rows, totals = self.history[first:], self._totals[first:]
        summary: dict[str, float] = {"steps": float(len(rows)), "world_size": float(self._world_size)}
        if self._peak is not None:
            summary["peak_tflops"] = float(self._peak)
        for name in [name for name in rows[0] if name != "step"] if rows else []:
            values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
            if values:
                summary[name.removeprefix("perf/")] = statistics.fmean(values)
        if not rows:
            return summary
        seconds = sum(row["perf/step_time_s"] for row in rows)
        slowest = sum(time for _, time in totals)
        summary["tflops"] = sum(row["perf/model_flops"] for row in rows) / seconds / 1e12 if seconds > 0 else math.nan
        summary["samples_per_s_per_device"] = sum(samples for samples, _ in totals) / slowest if slowest > 0 else 0.0
        summary["samples_per_s_per_device_median"] = statistics.median(
            row["perf/samples_per_s_per_device"] for row in rows
        )
        if self._peak is not None:
            summary["mfu"] = summary["tflops"] / self._peak
        if self.baseline_samples_per_s is not None:
            summary["scaling_ratio"] = summary["samples_per_s_per_device"] / self.baseline_samples_per_s
            if "mfu" in summary:
                summary["e2e_mfu"] = summary["mfu"] * summary["scaling_ratio"]
        return summary

    def report(self) -> str:
        """A one-page summary of :meth:`summary`, ending with the E2E MFU equation and its numbers."""
        summary = self.summary()
        steps, world_size = int(summary.pop("steps")), int(summary.pop("world_size"))
        lines = [
            f"MFU report over {steps} training steps on {world_size} device(s) (first step excluded; rates are "
            "totals over totals, times and imbalances means over the steps)"
        ]
        peak = summary.pop("peak_tflops", None)
        lines.append(f"  peak TFLOP/s per device: {peak if peak is not None else 'unknown (no MFU)'}")
        lines += [f"  perf/{name:<32} {value:.6g}" for name, value in summary.items()]
        lines.append(self._equation(summary, world_size))
        return "\n".join(lines)

    def _equation(self, summary: dict[str, float], world_size: int) -> str:
        """``E2E MFU = local MFU x scaling ratio`` with the run's numbers, or ``n/a`` and why for a missing one."""
        mfu = f"{summary['mfu']:.4g}" if "mfu" in summary else "n/a (no peak TFLOP/s: pass `peak_tflops`)"
        if "scaling_ratio" in summary:
            ratio = f"{summary['scaling_ratio']:.4g}"
        elif world_size == 1:
            ratio = "1 (one device: the run is its own baseline)"
        else:
            ratio = "n/a (no single-device baseline: pass `baseline_samples_per_s`, e.g. a one-device mfu.json)"
        if "e2e_mfu" in summary:
            e2e = f"{summary['e2e_mfu']:.4g}"
        elif "mfu" in summary and world_size == 1:
            e2e = f"{summary['mfu']:.4g}"
        else:
            e2e = "n/a"
        return f"  E2E MFU = local MFU x scaling ratio: {e2e} = {mfu} x {ratio}"

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
        panels = [("TFLOP/s", ["perf/tflops"]), ("MFU", ["perf/mfu", "perf/e2e_mfu"])]
        panels.append(("max / mean over ranks", ["perf/step_time_imbalance", "perf/compute_imbalance"]))
        panels = [(label, [n for n in names if n in self.history[0]]) for label, names in panels]
        panels = [(label, names) for label, names in panels if names]
        fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(8, 2.5 * len(panels)))
        for ax, (label, names) in zip(axes[:, 0], panels, strict=True):
            for name in names:
                ax.plot(steps, [row[name] for row in self.history], label=name.removeprefix("perf/"))
            ax.set_ylabel(label)
            ax.legend(loc="best", fontsize="small")
        axes[-1, 0].set_xlabel("step")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path


def _max_over_mean(values: torch.Tensor) -> float:
    mean = float(values.mean())
    return float(values.max()) / mean if mean > 0 else 1.0


def _baseline_from_summary(path: Path) -> float:
    """``samples_per_s_per_device`` of a single-device run's ``mfu.json``."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"`baseline_samples_per_s`: cannot read an mfu.json summary from {path}: {error}") from None
    if "samples_per_s_per_device" not in summary:
        raise ValueError(f"`baseline_samples_per_s`: {path} has no 'samples_per_s_per_device' (not an mfu.json?)")
    return float(summary["samples_per_s_per_device"])


_MAX_PENDING = 64  # steps kept unresolved at most (when the loggers write less often)


class _StepTimes:
    """One training step's start, end of forward and end: CUDA events on the current stream, read once the step
    has run (no device sync per step, so the host keeps running ahead of the device as it would without the
    callback), or elsewhere wall-clock times (CPU work is done when the call returns)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self.mark()
        self.forward_end: Any = None
        self.end: Any = None
        self.samples = self.flops = self.global_step = 0.0
        self._times: tuple[float, float, float] | None = None

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def times(self) -> tuple[float, float, float]:
        """``(step seconds, samples, forward seconds)``; waits for a CUDA step to finish."""
        if self._times is None:
            forward_end = self.end if self.forward_end is None else self.forward_end  # manual optimization: no hook
            if self.cuda:
                self.end.synchronize()
                step, forward = (self.start.elapsed_time(e) / 1e3 for e in (self.end, forward_end))
            else:
                step, forward = self.end - self.start, forward_end - self.start
            self._times = (step, self.samples, forward)
        return self._times
