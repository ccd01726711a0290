"""RMSNorm / LayerNorm fused with quantization: the normalised rows go straight to FP8 in the GEMM's layout.

Legend: ``R`` rows (tokens), ``D`` features (the next GEMM's contraction dim), ``B`` scale block along ``D``.

A program normalises ``NUM_TILES`` tiles of ``TILE_R`` whole rows, one after another, each held in registers
(one read of ``x``; the weight and bias are read once per program, not once per tile), rounds the output to
``x``'s dtype (exactly what an unfused norm would write) and quantizes it in ``1 x B`` blocks (``mx``,
``1x128``) or per row (``rowwise``): it writes ``q [R, D]``, the scales and the ``rstd`` (and ``mean``) the
norm's backward needs; the high-precision output itself only on request. The transposed layout the
weight gradient needs is made later from ``x`` and the saved statistics by ``quantize_triton(...,
norm=...)``, so no normalised activation is ever stored for backward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, is_interpreted, next_power_of_2
from lightning_gem.ops.mx.impl.triton._common import (
    _quantize_rows,
    _scale_value,
    _store_mx_tile,
    launch_tuned,
    size_class,
)
from lightning_gem.ops.mx.impl.triton.quantize import _TL_DTYPES, row_buffers

__all__ = ["norm_quantize_triton"]


# Per-batch sizes (jagged token counts): no new compiled variant when their divisibility by 16 changes.
@triton.jit(do_not_specialize=["num_rows", "stride_s_c", "size_class"])  # stride_s_r depends on D alone
def _norm_quantize_kernel(
    X, WEIGHT, BIAS, Y, Q, S, RSTD, MEAN,  # [R, D], [D], [D], [R, D], [R, D] fp8, scales, [R], [R]
    XQ, XS,  # SAVE_X: x's own MX copy, [R, D] E4M3 codes as bytes and [R, D / 32] biased E8M0 exponents (uint8)
    num_rows, dim, eps, stride_s_r, stride_s_c,
    size_class,  # autotuning key only
    BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, LAYER: tl.constexpr, WRITE_Y: tl.constexpr, MX: tl.constexpr,
    RCEIL: tl.constexpr, OUT_DTYPE: tl.constexpr, EXACT: tl.constexpr, TILE_R: tl.constexpr, NUM_TILES: tl.constexpr,
    EVEN_D: tl.constexpr,  # dim == BLOCK_D: no padding columns to zero (rows past the end are never stored)
    SAVE_X: tl.constexpr = False,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    # Loaded as [1, D] rows: with TILE_R == 1 they take x's register layout, so they need no shared-memory
    # round trip (a 1-D load got its own layout, converted through shared memory once a program).
    if WEIGHT is not None:
        weight = tl.load(WEIGHT + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
    if BIAS is not None:
        bias = tl.load(BIAS + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
    blocks = tl.arange(0, BLOCK_D // BLOCK)
    block_mask = blocks < tl.cdiv(dim, BLOCK)
    rows = tl.program_id(0).to(tl.int64) * (TILE_R * NUM_TILES) + tl.arange(0, TILE_R)
    x_next = tl.load(X + rows[:, None] * dim + cols[None, :], mask=(rows < num_rows)[:, None] & col_mask[None, :])
    for tile in range(NUM_TILES):
        row_mask = rows < num_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * dim + cols[None, :]
        x = x_next.to(tl.float32) if EVEN_D else tl.where(mask, x_next.to(tl.float32), 0.0)
        if SAVE_X:  # x's MX copy (RCEIL blocks of 32) from the same read, for a saved-activation context
            _store_mx_tile(XQ, XS, x, rows, row_mask, 0, dim, dim, TILE_R, BLOCK_D, EXACT)
        if NUM_TILES > 1:  # the next tile's load is in flight while this one is computed
            next_rows = rows + TILE_R
            next_mask = ((next_rows < num_rows) & (tile + 1 < NUM_TILES))[:, None] & col_mask[None, :]
            x_next = tl.load(X + next_rows[:, None] * dim + cols[None, :], mask=next_mask)
        if LAYER:
            mean = tl.sum(x, axis=1) / dim
            x = x - mean[:, None] if EVEN_D else tl.where(mask, x - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=row_mask)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / dim + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = x * rstd[:, None]
        if WEIGHT is not None:
            y = y * weight
        if BIAS is not None:
            y = y + bias
        if not EVEN_D:
            y = tl.where(mask, y, 0.0)
        y = y.to(OUT_DTYPE)
        if WRITE_Y:
            tl.store(Y + offsets, y, mask=mask)
        # y in its own dtype: a bf16 tile's block maxima come from its 16-bit patterns, two a register
        q, exponent, nonfinite = _quantize_rows(y, TILE_R, BLOCK_D, BLOCK, RCEIL, EXACT)
        tl.store(Q + offsets, q, mask=mask)
        scale_ptrs = S + rows[:, None] * stride_s_r + blocks[None, :] * stride_s_c
        tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=row_mask[:, None] & block_mask[None, :])
        rows += TILE_R


_INTERPRETED = is_interpreted(_norm_quantize_kernel)


def norm_quantize_triton(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    kind: str,
    layout: str,
    rounding: str = "rceil",
    write_output: bool = False,
    out_dtype: torch.dtype | None = None,
    save_input: bool = False,
    config: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Normalise ``[R, D]`` ``x`` and quantize the result along ``D``; also the body of the custom op
    ``lightning_gem::mx_norm_quantize`` (:mod:`.ops`), whose schema these arguments are.

    ``save_input``: also write ``x``'s own MX copy (RCEIL, as a saved-activation context stores ``x``; ``D`` a
    multiple of 32). ``config``: ``(TILE_R, NUM_TILES, num_warps)`` to launch instead of the tuner's choice
    (benchmarks time each candidate of :func:`_valid_configs` so).

    Returns:
        ``(q [R, D] fp8, scale, rstd [R] fp32, mean [R] fp32, y [R, D], x_codes [R, D] fp8, x_scales [R, D / 32]
        uint8)``; scales as :func:`~lightning_gem.ops.mx.impl.triton.quantize.quantize_triton` lays them out;
        ``mean`` (RMSNorm), ``y`` (without ``write_output``) and ``x``'s copy (without ``save_input``) empty, as an op
        returns a fixed tuple of tensors. The output is rounded to ``out_dtype`` (default ``x``'s) before
        quantization.
    """
    out_dtype = out_dtype or x.dtype
    num_rows, dim = x.shape
    device = x.device
    block_d = next_power_of_2(dim)
    mx = layout == "mx"
    block = {"mx": 32, "1x128": 128, "rowwise": block_d}[layout]
    q, scale = row_buffers(layout, num_rows, dim, device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=device)
    mean = torch.empty(num_rows, dtype=torch.float32, device=device) if kind == "layer" else None
    y = torch.empty_like(x, dtype=out_dtype) if write_output else None
    x_codes = torch.empty(num_rows if save_input else 0, dim, dtype=torch.float8_e4m3fn, device=device)
    x_scales = torch.empty(num_rows if save_input else 0, dim // 32, dtype=torch.uint8, device=device)
    args = (
        x, weight, bias, y, q, scale, rstd, mean, x_codes.view(torch.uint8) if save_input else None,
        x_scales if save_input else None,
        num_rows, dim, float(eps), *scale.stride(), size_class(num_rows * dim),
    )  # fmt: skip
    meta = dict(
        BLOCK_D=block_d, BLOCK=block, LAYER=kind == "layer", WRITE_Y=write_output, MX=mx,
        RCEIL=rounding == "rceil", OUT_DTYPE=_TL_DTYPES[out_dtype], EXACT=_INTERPRETED, EVEN_D=dim == block_d,
        SAVE_X=save_input,
    )  # fmt: skip
    outputs = (q, scale, rstd, x.new_empty(0, dtype=torch.float32) if mean is None else mean,
               x.new_empty(0) if y is None else y, x_codes, x_scales)  # fmt: skip
    if not num_rows:
        return outputs
    configs = _valid_configs(block_d) if config is None else (config,)
    key = ("norm_quantize", args[-1], x.dtype, block_d, block, meta["LAYER"], write_output, mx, out_dtype, save_input)
    grid = lambda tile_r, num_tiles: (cdiv(num_rows, tile_r * num_tiles),)
    launch_tuned(_norm_quantize_kernel, configs, key, grid, args, meta, num_rows * dim, ("TILE_R", "NUM_TILES"))
    return outputs


# (rows per tile, tiles per program, num_warps): whole rows live in registers, so fewer rows for wider ones;
# several tiles a program read the weight and bias once for all of them (one tile: once a tile, from L2).
# Only one-row tiles hold the weight and bias in x's register layout; taller ones convert them through shared
# memory once a program. The second line: one-row tiles several a program (a 4096-wide row is 32 values a
# thread over 4 warps), and 16-warp tiles. The third: 16 to 64 tiles a program. A bf16 row of 4096 is 8 KB
# and an fp32 weight 16 KB: read once for every few rows, the weight and a bias move more bytes through L2
# than the rows do.
_CONFIGS = [
    (2, 1, 8), (1, 1, 4), (2, 8, 8), (1, 8, 4), (4, 1, 8), (8, 1, 8), (16, 1, 8),
    (1, 2, 4), (1, 4, 4), (1, 4, 8), (1, 8, 8), (2, 4, 8), (4, 2, 16), (2, 4, 16),
    (1, 16, 4), (1, 32, 4), (1, 64, 4), (1, 16, 8), (2, 16, 8), (2, 32, 8),
]  # fmt: skip


@functools.cache
def _valid_configs(block_d: int) -> tuple[tuple[int, int, int], ...]:
    """The candidates for rows padded to ``block_d`` (pruned once per width)."""
    return tuple(c for c in _CONFIGS if _valid_rows(c[0], block_d, c[2]))


def _valid_rows(tile_r: int, block_d: int, num_warps: int) -> bool:
    """At most 64 values of a tile a thread (more spill), and no tiny tiles."""
    fits = tile_r * block_d <= min(16384, 2048 * num_warps)
    return fits and (tile_r >= 4 or block_d >= 1024 or tile_r * 32 >= 64)
