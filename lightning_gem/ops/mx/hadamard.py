"""Random Hadamard transform along the contraction dim: spreads outliers across a quantization block.

``T = diag(s) H / sqrt(n)`` with ``H`` the ``n x n`` Sylvester-Hadamard matrix and ``s`` random signs drawn
from a seed, applied block-diagonally to every ``n`` consecutive features. ``T`` is orthogonal, so applying
it to both GEMM operands along their shared dim leaves the product unchanged, ``(xT)(wT)^T = x w^T``,
while each rotated block's values are mixed sums with far smaller peaks than a lone outlier: block scales
fit the bulk better.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gem.ops.mx.impl.reference import fwht

__all__ = ["hadamard_signs", "random_hadamard", "random_hadamard_matrix"]


def hadamard_signs(n: int, seed: int, device: torch.device | str | None = None) -> Tensor:
    """``[n]`` fp32 random ``+-1`` from ``seed`` (drawn on CPU, so every device gets the same signs)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(device=device, dtype=torch.float32)


def random_hadamard_matrix(
    n: int, seed: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``[n, n]`` ``T = diag(s) H / sqrt(n)`` (orthogonal) in ``dtype``."""
    signs = hadamard_signs(n, seed, device).to(dtype)
    return fwht(torch.diag(signs)) / math.sqrt(n)


def random_hadamard(x: Tensor, *, block: int, seed: int, impl: str = "auto") -> Tensor:
    """Apply ``T`` block-diagonally along the last dim of ``x`` (a multiple of ``block``, a power of two).

    Args:
        x: ``[..., C]`` float tensor.
        block: transform size (the quantization block: 32 for MX, 128 for FP8 blockwise).
        seed: seed of the random signs; both operands of a GEMM must use the same one.
        impl: ``"fwht"`` (butterflies, ``O(C log block)``, exact order of the definition), ``"matmul"``
            (one ``[*, block] @ [block, block]`` GEMM in ``x``'s dtype: tensor cores on GPUs), or
            ``"auto"`` (``matmul`` on CUDA, ``fwht`` elsewhere).

    Returns:
        ``[..., C]`` in ``x``'s dtype.

    Example:
        >>> x = torch.randn(4, 64)
        >>> y = random_hadamard(x, block=32, seed=0)
        >>> torch.allclose(y.norm(dim=1), x.norm(dim=1), atol=1e-5)  # orthogonal
        True
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"`block` must be a power of two, got {block}")
    if x.shape[-1] % block:
        raise ValueError(f"the last dim of `x` ({x.shape[-1]}) must be a multiple of `block` ({block})")
    if impl == "auto":
        impl = "matmul" if x.device.type == "cuda" else "fwht"
    blocks = x.reshape(-1, block)
    if impl == "fwht":
        signs = hadamard_signs(block, seed, x.device).to(torch.promote_types(x.dtype, torch.float32))
        out = fwht(blocks.to(signs.dtype) * signs) / math.sqrt(block)
    elif impl == "matmul":
        # Half-precision GEMMs accumulate in fp32 and round once: the same rounding as casting the result.
        out = blocks @ random_hadamard_matrix(block, seed, x.device, x.dtype)
    else:
        raise ValueError(f"`impl` must be 'auto', 'fwht' or 'matmul', got {impl!r}")
    return out.to(x.dtype).reshape(x.shape)
