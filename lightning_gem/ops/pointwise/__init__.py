"""Fused pointwise ops: the HSTU layer's ``silu_split``, ``norm_mul`` and ``norm`` (``norm_residual``) around its
attention, and the candidate interaction's per-candidate ``token_attention`` and ``pairwise_dots``."""

from lightning_gem.ops.pointwise.api import IMPLS, norm, norm_mul, norm_residual, silu_split
from lightning_gem.ops.pointwise.tokens import MAX_TOKENS, pairwise_dots, token_attention

__all__ = [
    "IMPLS",
    "MAX_TOKENS",
    "norm",
    "norm_mul",
    "norm_residual",
    "pairwise_dots",
    "silu_split",
    "token_attention",
]
