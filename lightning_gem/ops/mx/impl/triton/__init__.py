"""Triton kernels of :mod:`lightning_gem.ops.mx` (loaded on first use: importing them needs Triton)."""

from lightning_gem.ops.mx.impl.triton.ops import (
    SUPPORTED_DTYPES,
    mx_norm_quantize,
    mx_norm_quantize_op,
    mx_quantize,
    mx_quantize_op,
)

__all__ = ["SUPPORTED_DTYPES", "mx_norm_quantize", "mx_norm_quantize_op", "mx_quantize", "mx_quantize_op"]
