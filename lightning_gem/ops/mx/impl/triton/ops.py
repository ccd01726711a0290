"""The MX/FP8 Triton quantizers as torch custom ops, visible to ``torch.compile``.

``lightning_gem::mx_quantize`` and ``lightning_gem::mx_norm_quantize`` are :func:`torch.library.triton_op` s:
their bodies allocate outputs and launch through ``wrap_triton``, so they are their own fake impls and
compiled graphs hold the kernels. Outputs that were not asked for come back as empty tensors (an op
returns a fixed tuple of tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from lightning_gem.ops._launch import keep_opaque_when_interpreted
from lightning_gem.ops.mx.impl.triton.norm_quantize import _norm_quantize_kernel, norm_quantize_triton
from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

__all__ = ["SUPPORTED_DTYPES", "mx_norm_quantize", "mx_norm_quantize_op", "mx_quantize", "mx_quantize_op"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_op("lightning_gem::mx_quantize", mutates_args=())
def mx_quantize_op(
    x: Tensor,
    layout: str,
    rounding: str,
    rows: bool,
    cols: bool,
    norm_kind: str | None = None,
    rstd: Tensor | None = None,
    mean: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
    column_sums: bool = False,
    x_scales: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, scale, qt, scale_t, sums)`` of :func:`quantize_triton` (empty where not requested)."""
    return _quantize(
        x, layout, rounding, rows, cols, norm_kind, rstd, mean, weight, bias, norm_dtype, column_sums, x_scales
    )


def _quantize(x, layout, rounding, rows, cols, norm_kind, rstd, mean, weight, bias, norm_dtype, column_sums, x_scales):
    norm = (norm_kind, rstd, mean, weight, bias) if norm_kind is not None else None
    out = quantize_triton(
        x, layout, rounding, rows=rows, cols=cols, norm=norm, norm_dtype=norm_dtype, column_sums=bool(column_sums),
        x_scales=x_scales,
    )  # fmt: skip
    row_out, col_out = out[:2]
    if row_out is None or col_out is None:  # the op's fixed outputs: empty where not asked for
        empty = (x.new_empty(0, dtype=torch.float8_e4m3fn), x.new_empty(0, dtype=torch.float32))
        row_out, col_out = row_out or empty, col_out or empty
    sums = out[2] if column_sums else x.new_empty(0, dtype=torch.float32)
    return (*row_out, *col_out, sums)


# The launcher is the op's body: its arguments are the schema, its outputs the op's fixed tuple.
mx_norm_quantize_op = triton_op("lightning_gem::mx_norm_quantize", mutates_args=())(norm_quantize_triton)


keep_opaque_when_interpreted(_norm_quantize_kernel, mx_quantize_op, mx_norm_quantize_op)


def mx_quantize(*args: object) -> tuple[Tensor, ...]:
    """:func:`mx_quantize_op` under ``torch.compile``; its body called directly in eager mode.

    In eager mode the op's dispatch layers add host time and nothing else, enough to make small FP8 layers
    CPU-bound (docs/benchmarks.md#host-time-per-call).
    """
    if torch.compiler.is_compiling():
        return mx_quantize_op(*args)
    return _quantize(*args, *(None,) * (13 - len(args)))


def mx_norm_quantize(*args: object) -> tuple[Tensor, ...]:
    """:func:`mx_norm_quantize_op` under ``torch.compile``; its body called directly in eager mode."""
    if torch.compiler.is_compiling():
        return mx_norm_quantize_op(*args)
    return norm_quantize_triton(*args)
