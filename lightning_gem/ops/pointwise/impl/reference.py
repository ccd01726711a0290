"""Pure-PyTorch references of the HSTU layer's fused pointwise ops: any device, autograd, the tests' oracle.

They are the plain PyTorch compositions an unfused layer runs (the Triton kernels compute in fp32 and round once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["norm_mul_reference", "norm_reference", "silu_split_reference"]


def silu_split_reference(x_RW: Tensor, sizes: Sequence[int], bias: Tensor | None = None) -> tuple[Tensor, ...]:
    """``SiLU(x + bias)`` of each ``[..., W]`` row split into parts of ``sizes`` columns (``sum(sizes) == W``; views of
    one tensor); ``bias`` broadcasts over ``x``'s leading dims. ``F.silu`` computes reduced-precision inputs in fp32 and
    rounds once, as the kernel does; the sum with the bias is rounded to ``x``'s dtype first, as a Linear's output is
    (the kernel adds in fp32)."""
    return tuple(F.silu(x_RW if bias is None else (x_RW + bias).to(x_RW.dtype)).split(list(sizes), dim=-1))


def norm_mul_reference(
    x_RN: Tensor, gate_RN: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, kind: str
) -> Tensor:
    """``norm(x) * gate`` over the last dim, RMSNorm (``kind="rms"``) or LayerNorm (``"layer"``): PyTorch's fused
    norm with its weight (and bias) in ``x``'s dtype, then the product, each rounded to ``x``'s dtype (the unfused
    layer; exact in fp64, the tests' oracle)."""
    return norm_reference(x_RN, weight, bias, eps, kind, x_RN.dtype) * gate_RN


def norm_reference(
    x_RN: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, kind: str, out_dtype: torch.dtype
) -> Tensor:
    """``norm(x)`` over the last dim in ``x``'s dtype (PyTorch's fused norm, its weight and bias cast to it), then
    cast to ``out_dtype``: what a norm module followed by autocast's cast for a Linear computes."""
    shape = x_RN.shape[-1:]
    weight = None if weight is None else weight.to(x_RN.dtype)
    if kind == "rms":
        return F.rms_norm(x_RN, shape, weight, eps).to(out_dtype)
    return F.layer_norm(x_RN, shape, weight, None if bias is None else bias.to(x_RN.dtype), eps).to(out_dtype)
