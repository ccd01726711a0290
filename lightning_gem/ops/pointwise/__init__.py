"""Fused pointwise ops of the HSTU layer around its attention: ``silu_split``, ``norm_mul`` and ``norm``."""

from lightning_gem.ops.pointwise.api import IMPLS, norm, norm_mul, silu_split

__all__ = ["IMPLS", "norm", "norm_mul", "silu_split"]
