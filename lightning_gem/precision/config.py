"""Typed configuration of MXFP8/FP8 training and the per-device plan of what actually runs.

A recipe names numerics; a backend names how they run. Conversion is device-independent: a converted
layer resolves its :class:`Plan` from the recipe and the device of its first input, and the first
resolution per (recipe, device) is logged, e.g. ``requested mxfp8 on sm_90: running fp8-blockwise``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from lightning_gem.ops.mx.gemm import scaled_mm_supported

__all__ = ["BACKENDS", "RECIPES", "SAVED_ACTIVATIONS", "MXConfig", "Plan", "resolve_plan"]

log = logging.getLogger(__name__)

RECIPES = ("auto", "mxfp8", "fp8-blockwise", "fp8-rowwise")
BACKENDS = ("mx_native", "mx_emulated", "fp8_blockwise", "fp8_rowwise")
SAVED_ACTIVATIONS = (None, "fp8")
# backend -> (activation/gradient layout, weight layout, elements a dim must be a multiple of)
_LAYOUTS = {
    "mx_native": ("mx", "mx", 32),
    "mx_emulated": ("mx", "mx", 32),
    "fp8_blockwise": ("1x128", "128x128", 128),
    "fp8_rowwise": ("rowwise", "rowwise", 16),
}


@dataclass(frozen=True, kw_only=True)
class MXConfig:
    """What to quantize and how.

    Example:
        >>> MXConfig(recipe="mxfp8", keep_bf16=("*.output",)).recipe
        'mxfp8'
    """

    recipe: str = "auto"
    """``"auto"`` (the fastest tested recipe for the device: FP8 blockwise on sm_90, FP8 rowwise on sm_89 and on
    sm_100+ (native MXFP8 GEMMs have not run on an sm_100 GPU yet, so ``auto`` does not pick them), emulated
    MXFP8 elsewhere), ``"mxfp8"`` (native on sm_100+, emulated elsewhere), ``"fp8-blockwise"`` or
    ``"fp8-rowwise"``."""
    backend: str | None = None
    """Force one of :data:`BACKENDS` (e.g. ``"mx_emulated"`` for exact MXFP8 numerics on a Hopper GPU); a
    forced backend never substitutes: ``mx_native`` off sm_100 raises at the first forward."""
    keep_bf16: tuple[str, ...] = ()
    """``fnmatch`` patterns of module names (as in ``named_modules``) left in high precision."""
    hadamard: bool | tuple[str, ...] = False
    """Random Hadamard transform on both operands of every GEMM, for all converted layers (``True``) or for
    those whose names match these patterns."""
    fuse_norm: bool = True
    """Fuse an RMSNorm/LayerNorm into the quantization of the Linear it feeds (a norm registered right
    before a converted Linear of matching width in the same parent); the norm's output is then quantized
    by the norm's own kernel. Safe when the output has other readers: they get the ordinary output."""
    quantize_saved_activations: bool = True
    """Save the FP8 transposed input for the weight gradient instead of the high-precision input."""
    rounding: str = "rceil"
    """Block exponent rule: ``"rceil"`` or ``"floor"`` (see :mod:`lightning_gem.ops.mx.formats`)."""
    min_features: int = 32
    """Layers with fewer input or output features stay in high precision."""
    attention: bool = False
    """FP8 attention: the GDPA layers of the kit's components (modules with an ``attention_precision``, such as
    ``HSTULayer`` and ``GDPAInteraction``) whose names ``keep_bf16`` does not match run their attention products on
    FP8 codes (``gdpa(precision="fp8")``); layers with a relative attention bias stay in high precision."""
    saved_activations: str | None = None
    """``"fp8"``: what the kit's GDPA layers (``HSTULayer``, ``GDPAInteraction``: the modules :attr:`attention`
    switches) but those ``keep_bf16`` matches save for the backward (norm inputs and outputs, Linear and attention
    inputs, gates) is stored in MXFP8 and dequantized when the backward reads it
    (:class:`~lightning_gem.ops.mx.saved.QuantizedSavedTensors`); None: as the ops save it."""
    seed: int = 0
    """Seed of the Hadamard signs (each layer offsets it by its index)."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"`recipe` must be one of {RECIPES}, got {self.recipe!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS} or None, got {self.backend!r}")
        if self.rounding not in ("rceil", "floor"):
            raise ValueError(f"`rounding` must be 'rceil' or 'floor', got {self.rounding!r}")
        if self.min_features < 1:
            raise ValueError(f"`min_features` must be >= 1, got {self.min_features}")
        if self.saved_activations not in SAVED_ACTIVATIONS:
            raise ValueError(f"`saved_activations` must be one of {SAVED_ACTIVATIONS}, got {self.saved_activations!r}")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        if not isinstance(self.hadamard, bool):
            object.__setattr__(self, "hadamard", tuple(self.hadamard))

    @property
    def min_multiple(self) -> int:
        """Dims must be multiples of this for the recipe's own layout (32 MX, 128 blockwise, 16 rowwise)."""
        if self.backend is not None:
            return _LAYOUTS[self.backend][2]
        return {"fp8-blockwise": 128, "fp8-rowwise": 16}.get(self.recipe, 32)


@dataclass(frozen=True)
class Plan:
    """What runs for one recipe on one device.

    Attributes:
        backend: one of :data:`BACKENDS`.
        act_layout: layout of activations and gradients. weight_layout: layout of weights.
        multiple: every GEMM dim a layer has must be a multiple of this.
        gemm: ``"scaled_mm"`` (hardware FP8) or ``"emulated"`` (fp32 on dequantized operands).
        description: the line that is logged.
    """

    backend: str
    act_layout: str
    weight_layout: str
    multiple: int
    gemm: str
    description: str


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _default_backend(recipe: str, device: torch.device) -> str:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if recipe == "fp8-blockwise":
        return "fp8_blockwise"
    if recipe == "fp8-rowwise":
        return "fp8_rowwise"
    if capability >= (10, 0):
        # A default never picks a path that has not run: mx_native has not run on an sm_100 GPU yet, so `auto`
        # takes FP8 rowwise there (scaled_mm's rowwise GEMMs, run on sm_90) until it has; `mxfp8` asks for it.
        return "mx_native" if recipe == "mxfp8" else "fp8_rowwise"
    if capability >= (9, 0):
        return "fp8_blockwise"  # no MXFP8 GEMMs on Hopper; 1x128 / 128x128 blocks are its closest fast path
    if recipe == "auto" and capability >= (8, 9):
        return "fp8_rowwise"
    return "mx_emulated"


@functools.cache
def _resolve(recipe: str, backend: str | None, device: torch.device) -> Plan:
    chosen = backend or _default_backend(recipe, device)
    act_layout, weight_layout, multiple = _LAYOUTS[chosen]
    if chosen == "mx_emulated":
        gemm = "emulated"
    elif chosen == "mx_native":
        if not scaled_mm_supported("mx", "mx", device):
            raise ValueError(f"backend 'mx_native' needs MXFP8 GEMMs (sm_100+), not {_device_name(device)}")
        gemm = "scaled_mm"
    else:
        native = scaled_mm_supported(act_layout, act_layout, device)
        gemm = "scaled_mm" if native else "emulated"
        if native and weight_layout == "128x128":
            # Right only where a 128x128 weight's scale rows (dim / 128) are a multiple of 4, the padding cuBLAS's
            # block-scaling layout is defined with (lightning_gem.ops.mx.gemm); other widths stay in high precision.
            multiple = 512
    running = chosen.replace("_", "-") + (" (emulated GEMMs)" if gemm == "emulated" else "")
    requested = recipe if backend is None else f"{recipe} with backend {backend}"
    description = f"requested {requested} on {_device_name(device)}: running {running}"
    substituted = (recipe == "mxfp8" and not chosen.startswith("mx")) or (
        gemm == "emulated" and recipe.startswith("fp8")
    )
    if substituted:
        log.warning(description)
    else:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # Lightning's handler prints INFO

        rank_zero_info(description)
    return Plan(chosen, act_layout, weight_layout, multiple, gemm, description)


def resolve_plan(config: MXConfig, device: torch.device) -> Plan:
    """The :class:`Plan` for ``config`` on ``device`` (resolved and logged once per pair)."""
    return _resolve(config.recipe, config.backend, torch.device(device))
