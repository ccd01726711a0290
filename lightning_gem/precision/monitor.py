"""``QuantizationMonitor``: per-layer saturation and underflow of the quantized operands, logged.

Every ``every_n_steps`` training steps, the converted layers count, for their input, weight and output
gradient, the elements that saturated (clipped at 448), underflowed (non-zero that became zero) or sat in
a NaN/Inf block, and the callback logs the fractions as ``quant/<layer>/<operand>_<stat>`` to the
Trainer's loggers (and keeps the last ones in :attr:`QuantizationMonitor.last`). GDPA layers with FP8 attention
count their q, k and v the same way, as ``quant/<layer>/attention_<q|k|v>_<stat>``. Counting is an extra pass over
the operands, so it runs only on the monitored steps.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_gem.ops.attention.fp8 import OPERANDS as ATTENTION_OPERANDS
from lightning_gem.precision.convert import converted_layers
from lightning_gem.precision.linear import OPERANDS, STAT_NAMES

__all__ = ["QuantizationMonitor"]


class QuantizationMonitor(pl.Callback):
    """Log the fraction of saturated / underflowed / non-finite quantized elements per converted layer.

    Args:
        every_n_steps: monitor one training step in this many (a step costs one extra pass per operand).
        stats: which of ``"saturated"``, ``"underflowed"``, ``"nonfinite"`` to log.

    Example:
        >>> import lightning as L
        >>> from lightning_gem.precision import MXFP8Precision
        >>> trainer = L.Trainer(plugins=[MXFP8Precision()], callbacks=[QuantizationMonitor(50)], logger=False)
    """

    def __init__(self, every_n_steps: int = 100, stats: tuple[str, ...] = ("saturated", "underflowed", "nonfinite")):
        if every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be >= 1, got {every_n_steps}")
        unknown = set(stats) - set(STAT_NAMES[:3])
        if unknown:
            raise ValueError(f"`stats` must be among {STAT_NAMES[:3]}, got {sorted(unknown)}")
        self.every_n_steps = every_n_steps
        self.stats = tuple(stats)
        self.last: dict[str, float] = {}

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        active = trainer.global_step % self.every_n_steps == 0
        for layer in (*converted_layers(pl_module).values(), *_fp8_attention(pl_module).values()):
            layer.collect_stats = active
            layer.quant_stats = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics: dict[str, float] = {}
        # The Linear layers' operands, then q, k, v of FP8 attention (MXConfig.attention).
        layers = [(name, layer, OPERANDS) for name, layer in converted_layers(pl_module).items()]
        layers += [(name, layer, ATTENTION_OPERANDS) for name, layer in _fp8_attention(pl_module).items()]
        for name, layer, operands in layers:
            counts, layer.quant_stats, layer.collect_stats = layer.quant_stats, None, False
            if counts is None:
                continue
            counts = counts.double().cpu()
            prefix = "attention_" if operands is ATTENTION_OPERANDS else ""
            for i, operand in enumerate(operands):
                total = max(float(counts[i, STAT_NAMES.index("total")]), 1.0)
                for stat in self.stats:
                    metrics[f"quant/{name}/{prefix}{operand}_{stat}"] = float(counts[i, STAT_NAMES.index(stat)]) / total
        if metrics:
            self.last = metrics
            # Straight to the loggers: monitored steps need not fall on the Trainer's log_every_n_steps.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _fp8_attention(module: nn.Module) -> dict[str, nn.Module]:
    """Name -> layer of every GDPA layer of ``module`` running FP8 attention."""
    return {name: m for name, m in module.named_modules() if getattr(m, "attention_precision", None) == "fp8"}


def summarize(metrics: dict[str, float]) -> dict[str, float]:
    """Worst value of each ``<operand>_<stat>`` over layers (a one-line health check)."""
    worst: dict[str, float] = {}
    for key, value in metrics.items():
        stat = key.rsplit("/", 1)[-1]
        worst[stat] = max(worst.get(stat, 0.0), value)
    return worst
