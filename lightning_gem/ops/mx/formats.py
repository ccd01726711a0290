"""Block-scaled FP8 formats: what a quantized operand holds, and the exact scale rule every quantizer shares.

Legend: ``R`` rows, ``C`` columns (the contraction dim of the next GEMM is always the last, contiguous one),
``B`` elements per scale block along ``C``.

Four layouts, one element type (FP8 E4M3, max 448, no infinity) and one scale rule:

- ``mx``: OCP MXFP8, one E8M0 scale (a biased power-of-two exponent in a byte) per ``1 x 32`` block.
- ``1x128`` / ``128x128``: FP8 with a power-of-two fp32 scale per ``1 x 128`` block (activations and
  gradients) or per ``128 x 128`` tile (weights), Hopper's blockwise GEMM layouts.
- ``rowwise``: one power-of-two fp32 scale per row.

**Scale rule.** A block's shared exponent is ``e = ceil(log2(amax / 448))`` (``rceil``, the rule of
cuBLAS, Transformer Engine and torchao's RCEIL mode: the smallest power of two that brings the block's
largest magnitude into range, so nothing saturates) or ``e = floor(log2(amax)) - 8`` (``floor``, the OCP
spec's reference rule, where ``8`` is E4M3's largest exponent: values in ``(448, 512) * 2^e`` saturate to
448). ``e`` is computed from the bits of ``amax`` (no ``log2``, no division), so it is exact, and clamped
to E8M0's range ``[-127, 127]``; an all-zero block gets ``e = -127``. Elements are ``x * 2^-e`` rounded to
nearest-even E4M3 and saturated to ``+-448``. A block holding a NaN or an infinity gets a NaN scale
(E8M0 ``0xFF``; fp32 NaN for the other layouts) and NaN elements: it dequantizes to NaN, as the spec's
NaN scale means, rather than to a finite value that hides the overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "LAYOUTS",
    "Layout",
    "QuantizedTensor",
    "Rounding",
    "block_shape",
]

E4M3_MAX = 448.0
E4M3_EMAX = 8  # largest unbiased exponent of a normal E4M3 value (448 = 1.75 * 2^8)
E8M0_BIAS = 127
E8M0_NAN = 0xFF

Layout = Literal["mx", "1x128", "128x128", "rowwise"]
Rounding = Literal["rceil", "floor"]
LAYOUTS: tuple[str, ...] = ("mx", "1x128", "128x128", "rowwise")


def block_shape(layout: str, num_cols: int) -> tuple[int, int]:
    """``(rows, cols)`` of one scale block of ``layout`` over a matrix with ``num_cols`` columns."""
    if layout == "mx":
        return 1, 32
    if layout == "1x128":
        return 1, 128
    if layout == "128x128":
        return 128, 128
    if layout == "rowwise":
        return 1, num_cols
    raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")


@dataclass(frozen=True)
class QuantizedTensor:
    """An FP8 matrix and its block scales, quantized along its last (contraction) dim.

    Attributes:
        data: ``[R, C]`` ``torch.float8_e4m3fn`` elements.
        scale: ``[R / Br, C / Bc]`` scales: ``torch.uint8`` biased E8M0 exponents for ``mx``, fp32
            powers of two otherwise (the factor that dequantizes: ``x ~= data * scale``). The tensor may be
            column-major (``1x128``: Hopper's GEMM reads scales outer-dim-major); index it, don't view it.
        layout: one of :data:`LAYOUTS`.
    """

    data: Tensor
    scale: Tensor
    layout: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[R, C]`` values ``data * scale`` (a NaN scale makes its block NaN)."""
        rows, cols = self.data.shape
        block_rows, block_cols = block_shape(self.layout, cols)
        scale = decode_scale(self.scale) if self.layout == "mx" else self.scale
        scale = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
        return (self.data.to(torch.float32) * scale).to(dtype)


def decode_scale(scale_e8m0: Tensor) -> Tensor:
    """fp32 ``2^(s - 127)`` of biased E8M0 exponents ``s`` (``0xFF`` is NaN; ``0`` is ``2^-127``, a subnormal)."""
    exponent = scale_e8m0.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(scale_e8m0.to(torch.int32) == E8M0_NAN, torch.full_like(value, float("nan")), value)
