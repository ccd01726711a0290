"""Fused pointwise ops of the HSTU layer around its attention: ``silu_split`` and ``norm_mul``."""

from lightning_gem.ops.pointwise.api import IMPLS, norm_mul, silu_split

__all__ = ["IMPLS", "norm_mul", "silu_split"]
