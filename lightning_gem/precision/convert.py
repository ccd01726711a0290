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

import torch
from torch import nn

from lightning_gem.ops.mx.saved import QuantizedSavedTensors, SavedTensorStats
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
        model: any module; its ``nn.Linear`` s become :class:`~lightning_gem.precision.MXLinear`, with
            ``config.attention`` its GDPA layers run FP8 attention (:attr:`MXConfig.attention`), and with
            ``config.saved_activations="fp8"`` they store their saved activations in FP8
            (:attr:`MXConfig.saved_activations`).
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
    _set_saved_activations(model, config)
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


def _set_saved_activations(model: nn.Module, config: MXConfig) -> None:
    """Store what the kit's GDPA layers (modules with an ``attention_precision``) save for backward in FP8 with
    ``config.saved_activations == "fp8"``, except where ``keep_bf16`` matches; lift it from the others.

    Each such layer's call with grad enabled runs inside a fresh
    :class:`~lightning_gem.ops.mx.saved.QuantizedSavedTensors` (a forward pre-hook enters it, a forward hook that
    also runs on an exception leaves it); ``layer.saved_activation_stats`` adds up what it quantized."""
    for name, module in model.named_modules():
        if not hasattr(module, "attention_precision"):
            continue
        for handle in module.__dict__.pop("_saved_activation_handles", ()):
            handle.remove()
        if config.saved_activations is None or _matches(name, config.keep_bf16):
            module.__dict__.pop("saved_activation_stats", None)
            continue
        module.saved_activation_stats = SavedTensorStats()
        module._saved_activation_contexts = []
        module._saved_activation_handles = (
            module.register_forward_pre_hook(_enter_saved_activations),
            module.register_forward_hook(_exit_saved_activations, always_call=True),
        )


def _enter_saved_activations(module: nn.Module, _args: tuple) -> None:
    context = None
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # a compiled region saves what its graph says
        context = QuantizedSavedTensors(stats=module.saved_activation_stats).__enter__()
    module._saved_activation_contexts.append(context)


def _exit_saved_activations(module: nn.Module, _args: tuple, _output: object) -> None:
    contexts = module._saved_activation_contexts
    context = contexts.pop() if contexts else None
    if context is not None:
        context.__exit__(None, None, None)


def _fuse_norms(model: nn.Module) -> None:
    """Pair each RMSNorm/LayerNorm with the converted Linear it feeds: the pairs a module declares
    (``norm_consumers()``: norm child name -> the Linear's path under the module), else, for modules that declare
    none, the converted Linear registered right after the norm in the same parent."""
    for parent in model.modules():
        for norm, consumer in _norm_pairs(parent):
            if not isinstance(norm, (nn.RMSNorm, nn.LayerNorm)) or not isinstance(consumer, MXLinear):
                continue
            if len(norm.normalized_shape) == 1 and norm.normalized_shape[0] == consumer.in_features:
                fuse_norm(norm, consumer)


def _norm_pairs(parent: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    declared = getattr(parent, "norm_consumers", None)
    if declared is None:
        children = list(parent.children())
        return list(zip(children, children[1:], strict=False))
    pairs = []
    for norm_name, path in declared().items():
        try:
            pairs.append((parent.get_submodule(norm_name), parent.get_submodule(path)))
        except AttributeError:  # a submodule this configuration does not build
            continue
    return pairs


def converted_layers(model: nn.Module) -> dict[str, MXLinear]:
    """Name -> :class:`~lightning_gem.precision.MXLinear` of every converted layer of ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MXLinear)}
