"""MXFP8 / FP8 mixed precision: ``MXFP8Precision`` (Lightning plugin) over plain ``convert(model, config)``.

Importing this package imports Lightning (the plugin and the monitor callback are Lightning classes).

Example:
    >>> import lightning as L
    >>> from lightning_gem.precision import MXFP8Precision
    >>> trainer = L.Trainer(plugins=[MXFP8Precision(recipe="auto")], accelerator="cpu", logger=False)
"""

from lightning_gem.precision.config import BACKENDS, RECIPES, MXConfig, Plan, resolve_plan
from lightning_gem.precision.convert import convert, converted_layers
from lightning_gem.precision.linear import MXLinear
from lightning_gem.precision.monitor import QuantizationMonitor
from lightning_gem.precision.norm import MXLayerNorm, MXRMSNorm
from lightning_gem.precision.plugin import MXFP8Precision

__all__ = [
    "BACKENDS",
    "RECIPES",
    "MXConfig",
    "MXFP8Precision",
    "MXLayerNorm",
    "MXLinear",
    "MXRMSNorm",
    "Plan",
    "QuantizationMonitor",
    "convert",
    "converted_layers",
    "resolve_plan",
]
