"""``MXFP8Precision``: the Lightning precision plugin, a thin adapter over :func:`convert`.

Lightning's ``precision=`` strings are a closed list, so the plugin goes in ``plugins=[...]``:

    trainer = L.Trainer(plugins=[MXFP8Precision(recipe="auto")])

``convert_module`` converts the LightningModule's layers (before it moves to its device: conversion is
device-independent) and every step runs under bf16 autocast, so whatever is not converted runs as
``precision="bf16-mixed"`` would run it. What each converted layer runs is decided on its first input's
device and logged once.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_gem.precision.config import MXConfig
from lightning_gem.precision.convert import convert

__all__ = ["MXFP8Precision"]


class MXFP8Precision(Precision):
    """MXFP8 / FP8 training for the Linear layers, bf16 autocast for the rest.

    Args:
        recipe: ``"auto"``, ``"mxfp8"``, ``"fp8-blockwise"`` or ``"fp8-rowwise"`` (see :class:`MXConfig`).
        backend: force a backend (``"mx_emulated"``, ``"mx_native"``, ``"fp8_blockwise"``, ``"fp8_rowwise"``).
        keep_bf16: ``fnmatch`` patterns of module names to leave in high precision.
        hadamard: random Hadamard transform for all layers (True) or those matching the patterns.
        fuse_norm: fuse a norm into the quantization of the Linear it feeds.
        quantize_saved_activations: keep the weight gradient's input operand in FP8 between the passes.
        rounding: ``"rceil"`` or ``"floor"`` block exponents.
        min_features: layers narrower than this stay in high precision.
        attention: FP8 attention in the kit's GDPA layers (``HSTULayer``, ``GDPAInteraction``) but those
            ``keep_bf16`` matches (:attr:`MXConfig.attention`).
        saved_activations: ``"fp8"``: those layers store the activations their backward reads in MXFP8
            (:attr:`MXConfig.saved_activations`); None: as saved.
        autocast: run the step under bf16 autocast: ``True``, ``False`` (unconverted layers keep the model's
            dtype), or ``None`` (default: on CUDA only; CPU bf16 autocast gains no speed, and the converted
            layers' numerics are those of the recipe either way).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(plugins=[MXFP8Precision(recipe="mxfp8")], accelerator="cpu", logger=False)
    """

    precision = "bf16-mixed"

    def __init__(
        self,
        recipe: str = "auto",
        *,
        backend: str | None = None,
        keep_bf16: list[str] | tuple[str, ...] = (),
        hadamard: bool | list[str] = False,
        fuse_norm: bool = True,
        quantize_saved_activations: bool = True,
        rounding: str = "rceil",
        min_features: int = 32,
        attention: bool = False,
        saved_activations: str | None = None,
        autocast: bool | None = None,
    ) -> None:
        self.config = MXConfig(
            recipe=recipe,
            backend=backend,
            keep_bf16=tuple(keep_bf16),
            hadamard=hadamard if isinstance(hadamard, bool) else tuple(hadamard),
            fuse_norm=fuse_norm,
            quantize_saved_activations=quantize_saved_activations,
            rounding=rounding,
            min_features=min_features,
            attention=attention,
            saved_activations=saved_activations,
        )
        self.autocast = autocast

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return convert(module, self.config)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # The plugin is not told the accelerator: autocast each device type it may run on (a no-op for the other).
        with ExitStack() as stack:
            if self.autocast:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            if self.autocast is not False and torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            yield
