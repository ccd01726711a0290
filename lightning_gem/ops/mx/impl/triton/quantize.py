"""Triton quantizers: one read of a high-precision tile, FP8 written in the layouts the GEMMs read.

Legend: ``R`` rows, ``C`` columns, ``Rp`` rows padded to a multiple of the block (the transposed layout's
contraction dim), ``B`` elements per scale block.

``_quantize_kernel`` reads a ``[TILE_R, TILE_C]`` tile once and writes any of:

- the row layout: ``q [R, C]`` in ``1 x B`` blocks along ``C`` (``mx``, ``1x128``), or one block per tile
  (``128x128``), or with per-row exponents computed beforehand (``rowwise``);
- the transposed layout: ``qt [C, Rp]`` in ``1 x B`` blocks along ``R`` (what a weight-gradient GEMM reads:
  its contraction dim is the tokens), zero-padded to ``Rp``.

An optional norm prologue (``NORM``: RMSNorm or LayerNorm with saved ``rstd``/``mean``) normalises the tile
first, so a norm's output is quantized straight from its input without being written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import is_interpreted
from lightning_gem.ops.mx.impl.triton._common import (
    NONFINITE_BITS,
    _magnitude_bits,
    _quantize_rows,
    _scale_value,
    _shared_exponent,
    _to_e4m3,
    launch_tuned,
)

__all__ = ["quantize_triton"]

_NORM_CODES = {None: 0, "rms": 1, "layer": 2}
_KEY_FLAGS = ["BLOCK", "ROWS", "COLS", "SQUARE", "GIVEN_EXP", "MX", "NORM"]


@triton.jit
def _normalize(
    x, rows, cols, RSTD, MEAN, WEIGHT, BIAS, num_rows, num_cols, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    """The norm's output for a tile, rounded to the activation dtype as the unfused norm would write it."""
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    if NORM == 2:
        x = x - tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
    y = x * rstd[:, None]
    if WEIGHT is not None:
        y = y * tl.load(WEIGHT + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if BIAS is not None:
        y = y + tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = tl.where(row_mask[:, None] & col_mask[None, :], y, 0.0)
    return y.to(OUT_DTYPE).to(tl.float32)


# Per-batch sizes (jagged token counts) and what derives from them: Triton would otherwise compile a new variant
# whenever one of them turns divisible by 16 or equals 1.
@triton.jit(do_not_specialize=["num_rows", "padded_rows", "stride_s_r", "stride_s_c", "stride_st_c", "stride_st_r",
                               "size_class"])  # fmt: skip
def _quantize_kernel(
    X, Q, S, QT, ST,  # [R, C] input, [R, C] fp8 + scales, [C, Rp] fp8 + scales
    ROW_EXP, COL_EXP,  # [R] / [C] int32 exponents given in advance (rowwise; 128 marks a NaN row)
    RSTD, MEAN, WEIGHT, BIAS,  # norm prologue: [R], [R], [C], [C]
    num_rows, num_cols, padded_rows,
    stride_s_r, stride_s_c, stride_st_c, stride_st_r,
    size_class,  # autotuning key only: log2 of the element count, coarsened
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SQUARE: tl.constexpr, GIVEN_EXP: tl.constexpr,
    MX: tl.constexpr, RCEIL: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr, EXACT: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    in_bounds = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    x = tl.load(X + rows[:, None] * num_cols + cols[None, :], mask=in_bounds, other=0.0).to(tl.float32)
    if NORM != 0:
        x = _normalize(x, rows, cols, RSTD, MEAN, WEIGHT, BIAS, num_rows, num_cols, NORM, OUT_DTYPE)

    if ROWS:
        if SQUARE:  # one scale for the whole 128 x 128 tile
            amax_bits = tl.max(tl.max(_magnitude_bits(x), axis=1), axis=0)
            nonfinite = amax_bits >= NONFINITE_BITS
            exponent = _shared_exponent(amax_bits, RCEIL)
            q = _to_e4m3(x, exponent, nonfinite, not RCEIL, EXACT)
            tl.store(S + pid_r * stride_s_r + pid_c * stride_s_c, _scale_value(exponent, nonfinite, MX))
        else:
            q = _quantize_lines(
                x, rows, pid_c, num_rows, num_cols // BLOCK, ROW_EXP, S, stride_s_r, stride_s_c,
                TILE_R, TILE_C, BLOCK, GIVEN_EXP, MX, RCEIL, EXACT,
            )  # fmt: skip
        tl.store(Q + rows[:, None] * num_cols + cols[None, :], q, mask=in_bounds)

    if COLS:
        xt = tl.trans(x)  # [TILE_C, TILE_R]: the tile's columns become rows of the transposed layout
        qt = _quantize_lines(
            xt, cols, pid_r, num_cols, padded_rows // BLOCK, COL_EXP, ST, stride_st_c, stride_st_r,
            TILE_C, TILE_R, BLOCK, GIVEN_EXP, MX, RCEIL, EXACT,
        )  # fmt: skip
        t_mask = (cols < num_cols)[:, None] & (rows < padded_rows)[None, :]
        tl.store(QT + cols[:, None] * padded_rows + rows[None, :], qt, mask=t_mask)


@triton.jit
def _quantize_lines(
    x, lines, pid_blocks, num_lines, num_blocks, EXP, S, stride_line, stride_block,
    TILE_L: tl.constexpr, TILE_B: tl.constexpr, BLOCK: tl.constexpr, GIVEN_EXP: tl.constexpr, MX: tl.constexpr,
    RCEIL: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Quantize a ``[TILE_L, TILE_B]`` tile along its second dim; store its scales; return the FP8 tile.

    ``lines`` are the tile's global line indices (rows of the output layout), ``pid_blocks`` the tile's index
    along the quantized dim. ``GIVEN_EXP``: per-line exponents read from ``EXP`` (rowwise, 128 = NaN line)
    instead of block maxima; their scales are written by the launcher.
    """
    if GIVEN_EXP:
        exponent = tl.load(EXP + lines, mask=lines < num_lines, other=0)
        q = _to_e4m3(x, exponent[:, None], (exponent == 128)[:, None], not RCEIL, EXACT)
    else:
        q, exponent, nonfinite = _quantize_rows(x, TILE_L, TILE_B, BLOCK, RCEIL, EXACT)
        blocks = pid_blocks * (TILE_B // BLOCK) + tl.arange(0, TILE_B // BLOCK)
        scale_mask = (lines < num_lines)[:, None] & (blocks < num_blocks)[None, :]
        scale_ptrs = S + lines[:, None] * stride_line + blocks[None, :] * stride_block
        tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=scale_mask)
    return q


def scale_buffer(layout: str, num_lines: int, num_blocks: int, device: torch.device) -> Tensor:
    """Scales of ``num_lines`` lines of ``num_blocks`` blocks: uint8 E8M0 row-major for ``mx``; fp32
    column-major for ``1x128`` (Hopper's GEMM reads them outer-dim-major)."""
    if layout == "mx":
        return torch.empty(num_lines, num_blocks, dtype=torch.uint8, device=device)
    return torch.empty(num_blocks, num_lines, dtype=torch.float32, device=device).t()


def _rowwise_exponents(x: Tensor, dim: int, rounding: str) -> Tensor:
    """int32 exponents of ``x``'s rows (``dim=1``) or columns (``dim=0``); 128 marks a NaN/Inf row."""
    from lightning_gem.ops.mx.impl.reference import shared_exponent

    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, dtype=torch.float32)  # NaN and Inf propagate
    exponent = shared_exponent(amax, rounding)
    return torch.where(torch.isfinite(amax), exponent, 128).to(torch.int32)


def quantize_triton(
    x: Tensor,
    layout: str,
    rounding: str = "rceil",
    *,
    rows: bool = True,
    cols: bool = False,
    norm: tuple[str, Tensor, Tensor | None, Tensor | None, Tensor | None] | None = None,
    norm_dtype: torch.dtype | None = None,
) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None]:
    """Quantize ``[R, C]`` ``x`` (contiguous) along ``C`` (``rows``) and/or along ``R`` transposed (``cols``).

    Args:
        x: ``[R, C]`` fp32/fp16/bf16 matrix (validated by the public API).
        layout: ``"mx"``, ``"1x128"``, ``"128x128"`` (``rows`` only) or ``"rowwise"``.
        rounding: ``"rceil"`` or ``"floor"``.
        rows: write ``(q [R, C], scale)``.
        cols: write ``(qt [C, Rp], scale_t)``, ``Rp`` = ``R`` rounded up to the block (zero rows appended).
        norm: ``(kind, rstd [R], mean [R] or None, weight [C] or None, bias [C] or None)``: quantize the
            norm's output ``norm(x)`` (rounded to ``norm_dtype``, default ``x``'s) instead of ``x``.

    Returns:
        ``((q, scale) or None, (qt, scale_t) or None)``. Scales: uint8 E8M0 ``[R, C/32]`` for ``mx``; fp32
        column-major ``[R, C/128]`` for ``1x128`` (Hopper's GEMM reads them so); ``[R/128, C/128]`` for
        ``128x128``; ``[R, 1]`` for ``rowwise``; the transposed layout's likewise with ``R`` and ``C`` swapped.
    """
    num_rows, num_cols = x.shape
    norm_dtype = norm_dtype or x.dtype
    mx, square, rowwise = layout == "mx", layout == "128x128", layout == "rowwise"
    block = {"mx": 32, "1x128": 128, "128x128": 128, "rowwise": 1}[layout]
    pad_block = 128 if rowwise else block  # rowwise's transposed contraction dim is padded like 1x128's
    padded_rows = -(-num_rows // pad_block) * pad_block
    device = x.device

    q = s = qt = st = None
    row_exp = col_exp = None
    if rows:
        q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=device)
        if square:
            s = torch.empty(-(-num_rows // 128), num_cols // 128, dtype=torch.float32, device=device)
        elif rowwise:
            row_exp = _rowwise_exponents(x if norm is None else _norm_output(x, norm, norm_dtype), 1, rounding)
        else:
            s = scale_buffer(layout, num_rows, num_cols // block, device)
    if cols:
        qt = torch.empty(num_cols, padded_rows, dtype=torch.float8_e4m3fn, device=device)
        if rowwise:
            col_exp = _rowwise_exponents(x if norm is None else _norm_output(x, norm, norm_dtype), 0, rounding)
        else:
            st = scale_buffer(layout, num_cols, padded_rows // block, device)

    placeholder = x.new_empty(0)
    kind, rstd, mean, weight, bias = norm if norm is not None else (None, None, None, None, None)
    grid_rows = padded_rows if cols else num_rows
    args = (
        x, q if rows else placeholder, s if s is not None else placeholder,
        qt if cols else placeholder, st if st is not None else placeholder,
        row_exp, col_exp, rstd, mean, weight, bias,
        num_rows, num_cols, padded_rows,
        *(s.stride() if s is not None else (0, 0)), *(st.stride() if st is not None else (0, 0)),
        max(grid_rows * num_cols, 1).bit_length() // 2,
    )  # fmt: skip
    meta = dict(
        BLOCK=block if not rowwise else 128, ROWS=rows, COLS=cols, SQUARE=square, GIVEN_EXP=rowwise, MX=mx,
        RCEIL=rounding == "rceil", NORM=_NORM_CODES[kind], OUT_DTYPE=_TL_DTYPES[norm_dtype],
        EXACT=is_interpreted(_quantize_kernel),
    )  # fmt: skip
    if grid_rows > 0:  # no rows: nothing to launch
        _launch(args, meta, grid_rows, num_cols)
    if rowwise:
        from lightning_gem.ops.mx.impl.reference import pow2

        if rows:
            s = torch.where(row_exp == 128, float("nan"), pow2(row_exp))[:, None]
        if cols:
            st = torch.where(col_exp == 128, float("nan"), pow2(col_exp))[:, None]
    return ((q, s) if rows else None), ((qt, st) if cols else None)


def _norm_output(x: Tensor, norm: tuple, dtype: torch.dtype) -> Tensor:
    """The norm's output in ``dtype`` (rowwise scales need its row/column maxima before the cast)."""
    from lightning_gem.ops.mx.impl.reference import normalize_with_stats

    kind, rstd, mean, weight, bias = norm
    return normalize_with_stats(x, rstd, mean if kind == "layer" else None, weight, bias, dtype)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# (TILE_R, TILE_C, num_warps) candidates; _valid_tiles keeps those whose tiles hold whole scale blocks.
_CONFIGS = [
    (32, 128, 4), (64, 128, 8), (32, 256, 8), (128, 128, 8), (128, 128, 16), (128, 64, 4), (128, 32, 4), (32, 64, 4),
]  # fmt: skip
_TUNE_ABOVE = 1 << 22  # elements; smaller problems take the first valid config (no tuning runs)


def _valid_tiles(tile_r: int, tile_c: int, meta: dict) -> bool:
    block, rows, cols = meta["BLOCK"], meta["ROWS"], meta["COLS"]
    if meta["SQUARE"]:
        return (tile_r, tile_c) == (128, 128)
    if not meta["GIVEN_EXP"] and ((rows and tile_c % block) or (cols and tile_r % block)):
        return False
    if not cols:
        return tile_r <= 64  # rows only: short, wide tiles
    return rows or tile_c <= 64  # transposed only: tall, narrow tiles


def _launch(args: tuple, meta: dict, grid_rows: int, num_cols: int) -> None:
    """Tuned launch for large inputs (once per size class and flags); the first valid config for small ones."""
    configs = [c for c in _CONFIGS if _valid_tiles(c[0], c[1], meta)]
    if grid_rows * num_cols < _TUNE_ABOVE or meta["EXACT"]:
        configs = configs[:1]
    key = ("quantize", args[-1], args[0].dtype, *(meta[k] for k in _KEY_FLAGS), meta["OUT_DTYPE"])
    grid = lambda tile_r, tile_c: (triton.cdiv(grid_rows, tile_r), triton.cdiv(num_cols, tile_c))  # noqa: E731
    launch_tuned(_quantize_kernel, configs, key, grid, args, meta)
