"""Triton kernels of :mod:`lightning_gem.ops.pointwise` (loaded on first use: importing them needs Triton)."""

from lightning_gem.ops.pointwise.impl.triton.ops import (
    SUPPORTED_DTYPES,
    norm_mul_triton,
    norm_residual_triton,
    norm_triton,
    silu_split_triton,
)
from lightning_gem.ops.pointwise.impl.triton.token_ops import pairwise_dots_triton, token_attention_triton

__all__ = [
    "SUPPORTED_DTYPES",
    "norm_mul_triton",
    "norm_residual_triton",
    "norm_triton",
    "pairwise_dots_triton",
    "silu_split_triton",
    "token_attention_triton",
]
