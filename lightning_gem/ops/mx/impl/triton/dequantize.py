"""Dequantize an MXFP8 matrix (``mx`` layout) to a float dtype in one pass.

The data and its E8M0 scales are read once and the output written once: ``code * 2^(s - 127)`` is exact in
fp32, and so in bf16 and fp32 outputs (E4M3's 4 significant bits fit either); an fp16 output is clamped to
fp16's largest finite value, which a rounded-up block maximum may pass by less than one E4M3 step. A NaN
scale (``0xFF``) makes its block NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, launch
from lightning_gem.ops.mx.impl.triton._common import _decode_mx

__all__ = ["dequantize_mx_triton"]

_BLOCK = 32  # elements per E8M0 scale (OCP MX)
_TILE = 4096  # elements a program writes: 16 KiB of fp32, enough to keep the copy at memory speed


@triton.jit(do_not_specialize=["num_blocks"])
def _dequantize_mx_kernel(
    CODES,  # [N] E4M3 codes as uint8 (a contiguous [R, C] matrix, C a multiple of 32)
    SCALES,  # [N / 32] biased E8M0 exponents, row-major: one a block of 32 codes
    OUT,  # [N] output
    num_blocks,
    BLOCKS: tl.constexpr,  # blocks of 32 a program
    FP16_OUT: tl.constexpr,
):
    # [BLOCKS, 32] tiles: one scale load and one power of two a block, broadcast along its 32 codes (an element-wise
    # index into the scales would load and decode every scale 32 times)
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < num_blocks
    offsets = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    codes = tl.load(CODES + offsets, mask=in_range[:, None], other=0)
    biased = tl.load(SCALES + blocks, mask=in_range, other=127)
    values = _decode_mx(codes, biased)
    if FP16_OUT:  # the clamp may turn a NaN block finite: NaN again after it
        values = tl.minimum(tl.maximum(values, -65504.0), 65504.0)
        values = tl.where((biased == 255)[:, None], float("nan"), values)
    tl.store(OUT + offsets, values.to(OUT.dtype.element_ty), mask=in_range[:, None])


def dequantize_mx_triton(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``[R, C]`` ``dtype`` values of contiguous E4M3 ``data`` ``[R, C]``, row-major E8M0 ``scale`` ``[R, C / 32]``."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    num_elements = data.numel()
    if num_elements:
        launch(
            _dequantize_mx_kernel,
            (cdiv(num_elements, _TILE),),
            (data.view(torch.uint8), scale, out, num_elements // _BLOCK),
            {"BLOCKS": _TILE // _BLOCK, "FP16_OUT": dtype == torch.float16, "num_warps": 8},
        )
    return out
