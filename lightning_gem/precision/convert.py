"""``convert(model, config)``: swap eligible ``nn.Linear`` s (and the norms feeding them) for quantized ones.

Plain functions over modules: no Trainer, no device. Conversion swaps classes in place, so parameters,
their names, hooks and optimizer references are untouched, and it is idempotent. Which layers convert:
every ``nn.Linear`` whose name matches no ``keep_bf16`` pattern and whose dims are at least
``min_features`` and multiples of the recipe's block; the rest stay and are listed in one warning.
"""

from __future__ import annotations

import fnmatch
import logging
import zlib

from torch import nn

from lightning_gem.precision.config import MXConfig
from lightning_gem.precision.linear import MXLinear
from lightning_gem.precision.norm import fuse_norm

__all__ = ["convert", "converted_layers"]

log = logging.getLogger(__name__)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def convert(model: nn.Module, config: MXConfig | None = None) -> nn.Module:
    """Convert ``model`` in place for ``config`` and return it.

    Args:
        model: any module; its ``nn.Linear`` s become :class:`~lightning_gem.precision.MXLinear`, and with
            ``config.attention`` its GDPA layers run FP8 attention (:attr:`MXConfig.attention`).
        config: :class:`~lightning_gem.precision.MXConfig` (default: ``MXConfig()``, recipe ``"auto"``).

    Returns:
        ``model``, converted. Calling again with another config reconfigures the converted layers.

    Example:
        >>> import torch
        >>> model = convert(nn.Sequential(nn.RMSNorm(64), nn.Linear(64, 64), nn.Linear(64, 3)))
        >>> [type(m).__name__ for m in model]
        ['MXRMSNorm', 'MXLinear', 'Linear']
    """
    config = config or MXConfig()
    skipped: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _matches(name, config.keep_bf16):
            continue
        small = min(module.in_features, module.out_features) < config.min_features
        if small or module.in_features % config.min_multiple or module.out_features % config.min_multiple:
            skipped.append(f"{name or '<root>'} ({module.in_features}->{module.out_features})")
            continue
        hadamard = config.hadamard if isinstance(config.hadamard, bool) else _matches(name, config.hadamard)
        seed = config.seed + zlib.crc32(name.encode())  # stable per layer name, across processes and runs
        MXLinear.from_linear(module, config, seed=seed, hadamard=hadamard)
    if config.fuse_norm:
        _fuse_norms(model)
    skipped += _set_attention_precision(model, config)
    if skipped:
        log.warning(
            f"{len(skipped)} layer(s) stay in high precision (Linear layers with fewer than {config.min_features} "
            f"features or dims not multiples of {config.min_multiple}, attention with a relative bias): "
            f"{', '.join(skipped)}"
        )
    return model


def _set_attention_precision(model: nn.Module, config: MXConfig) -> list[str]:
    """``attention_precision`` of every module that has one: ``"fp8"`` with ``config.attention`` (unless
    ``keep_bf16`` matches its name, or it has a relative attention bias, which the kernels do not take), else None.
    Returns the layers left in high precision for a bias."""
    skipped = []
    for name, module in model.named_modules():
        if not hasattr(module, "attention_precision"):
            continue
        biased = getattr(module, "relative_bias", None) is not None or getattr(module, "time_bias", None) is not None
        wanted = config.attention and not _matches(name, config.keep_bf16)
        if wanted and biased:
            skipped.append(f"{name or '<root>'} (attention with a relative bias)")
        module.attention_precision = "fp8" if wanted and not biased else None
    return skipped


def _fuse_norms(model: nn.Module) -> None:
    """Pair each RMSNorm/LayerNorm with the converted Linear registered right after it in the same parent."""
    for parent in model.modules():
        children = list(parent.children())
        for norm, nxt in zip(children, children[1:], strict=False):
            if not isinstance(norm, (nn.RMSNorm, nn.LayerNorm)) or not isinstance(nxt, MXLinear):
                continue
            if len(norm.normalized_shape) == 1 and norm.normalized_shape[0] == nxt.in_features:
                fuse_norm(norm, nxt)


def converted_layers(model: nn.Module) -> dict[str, MXLinear]:
    """Name -> :class:`~lightning_gem.precision.MXLinear` of every converted layer of ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MXLinear)}
