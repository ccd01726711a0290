"""Triton quantizers: one read of a high-precision tile, FP8 written in the layouts the GEMMs read.

Legend: ``R`` rows, ``C`` columns, ``Rp`` rows padded to a multiple of the block (the transposed layout's
contraction dim), ``B`` elements per scale block.

``_quantize_kernel`` reads a ``[TILE_R, TILE_C]`` tile once and writes any of:

- the row layout: ``q [R, C]`` in ``1 x B`` blocks along ``C`` (``mx``, ``1x128``), or one block per tile
  (``128x128``), or with one scale per row (``rowwise``);
- the transposed layout: ``qt [C, Rp]`` in ``1 x B`` blocks along ``R`` (what a weight-gradient GEMM reads:
  its contraction dim is the tokens), zero-padded to ``Rp``.

Rows and columns together (``mx``, ``1x128``, no norm), and ``mx`` columns alone, take ``_quantize_split_kernel``
instead: one launch whose programs each do one part of a region, its columns or its rows, side by side. For rows
and columns together the tuner also times the two parts as two launches (rows alone, then columns alone) and
keeps the faster plan.

A ``rowwise`` line spans more than a tile. Rows alone of up to :data:`ONE_PASS_MAX_COLS` columns are quantized
by ``_rowwise_rows_kernel`` in one pass, each program holding whole rows. Otherwise (columns wanted, or wider
rows) the maxima come first from ``_line_amax_kernel``: one read of ``x`` gives the row maxima and the column
maxima together, as magnitude bit patterns (see ``_common``), which ``_quantize_kernel`` turns into each line's
exponent and scale as it quantizes.

An optional norm prologue (``NORM``: RMSNorm or LayerNorm with saved ``rstd``/``mean``) normalises the tile
first, so a norm's output is quantized straight from its input without being written.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, is_interpreted, next_power_of_2
from lightning_gem.ops._tuning import pick_fastest
from lightning_gem.ops.mx.formats import block_shape
from lightning_gem.ops.mx.impl.triton._common import (
    _CHOSEN,
    NONFINITE_BITS,
    TUNE_ABOVE,
    _load_mx_tile,
    _magnitude_bits,
    _magnitude_bits_of,
    _quantize_blocks,
    _quantize_rows,
    _scale_value,
    _shared_exponent,
    _to_e4m3,
    launch_tuned,
    size_class,
)

__all__ = ["quantize_triton"]

_NORM_CODES = {None: 0, "rms": 1, "layer": 2}
_KEY_FLAGS = ["BLOCK", "ROWS", "COLS", "SQUARE", "GIVEN_AMAX", "MX", "NORM", "X_MX"]


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
# whenever one of them turns divisible by 16 or equals 1. The padded row count comes as a count of blocks, so the
# compiler still knows ``Rp`` (the stride of ``qt``) is a multiple of the block: without that every transposed
# store is a single byte. The strides left specialised (``stride_s_r``, ``stride_st_r``) depend on ``C`` alone.
@triton.jit(do_not_specialize=["num_rows", "num_padded_blocks", "stride_s_c", "stride_st_c", "size_class"])
def _quantize_kernel(
    X, Q, S, QT, ST,  # [R, C] input, [R, C] fp8 + scales, [C, Rp] fp8 + scales
    ROW_AMAX, COL_AMAX,  # [R] / [C] int32 magnitude bits of the line maxima, given in advance (rowwise)
    RSTD, MEAN, WEIGHT, BIAS,  # norm prologue: [R], [R], [C], [C]
    X_SCALES,  # X_MX: X is an MX copy (E4M3 codes as bytes [R, C]), these its biased E8M0 scales [R, C / 32]
    num_rows, num_cols, num_padded_blocks,  # Rp = num_padded_blocks * BLOCK
    stride_s_r, stride_s_c, stride_st_c, stride_st_r,
    size_class,  # autotuning key only: log2 of the element count, coarsened
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SQUARE: tl.constexpr, GIVEN_AMAX: tl.constexpr,
    MX: tl.constexpr, RCEIL: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr, EXACT: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, X_MX: tl.constexpr = False,
):  # fmt: skip
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    in_bounds = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    if X_MX:  # decoded from the MX copy (TILE_C a multiple of 32): a quarter of an fp32 x's bytes read
        col0 = pid_c * TILE_C
        x = _load_mx_tile(X, X_SCALES, rows, rows < num_rows, col0, num_cols, num_cols - col0, TILE_R, TILE_C)
    else:
        x = tl.load(X + rows[:, None] * num_cols + cols[None, :], mask=in_bounds, other=0.0).to(tl.float32)
    if NORM != 0:
        x = _normalize(x, rows, cols, RSTD, MEAN, WEIGHT, BIAS, num_rows, num_cols, NORM, OUT_DTYPE)

    if SQUARE:  # one scale for the whole 128 x 128 tile; its transpose is a tile of x^T with the same scale
        amax_bits = tl.max(tl.max(_magnitude_bits(x), axis=1), axis=0)
        nonfinite = amax_bits >= NONFINITE_BITS
        exponent = _shared_exponent(amax_bits, RCEIL)
        q = _to_e4m3(x, exponent, nonfinite, not RCEIL, EXACT)
        scale = _scale_value(exponent, nonfinite, MX)
        if ROWS:
            tl.store(S + pid_r * stride_s_r + pid_c * stride_s_c, scale)
            tl.store(Q + rows[:, None] * num_cols + cols[None, :], q, mask=in_bounds)
        if COLS:  # QT is a byte buffer here: the codes are transposed as bytes (rows past R load as zero codes).
            # 16-bit inputs only: fp32 tiles take _square_transposed_apart (see its docstring for why)
            padded_rows = num_padded_blocks * BLOCK
            t_mask = (cols < num_cols)[:, None] & (rows < padded_rows)[None, :]
            codes_t = tl.trans(q.to(tl.uint8, bitcast=True))
            tl.store(QT + cols[:, None] * padded_rows + rows[None, :], codes_t, mask=t_mask)
            tl.store(ST + pid_c * stride_st_c + pid_r * stride_st_r, scale)
    elif ROWS:
        q = _quantize_lines(
            x, rows, pid_c, num_rows, num_cols // BLOCK, ROW_AMAX, S, stride_s_r, stride_s_c,
            TILE_R, TILE_C, BLOCK, GIVEN_AMAX, MX, RCEIL, EXACT,
        )  # fmt: skip
        tl.store(Q + rows[:, None] * num_cols + cols[None, :], q, mask=in_bounds)

    if COLS and not SQUARE:
        padded_rows = num_padded_blocks * BLOCK
        qc = _quantize_columns(
            x, cols, pid_r, num_cols, num_padded_blocks, COL_AMAX, ST, stride_st_c, stride_st_r,
            TILE_R, TILE_C, BLOCK, GIVEN_AMAX, MX, RCEIL, EXACT,
        )  # fmt: skip
        # Only the FP8 codes are transposed (a quarter of the fp32 tile's bytes through shared memory): the
        # tile's columns become rows of the transposed layout.
        t_mask = (cols < num_cols)[:, None] & (rows < padded_rows)[None, :]
        tl.store(QT + cols[:, None] * padded_rows + rows[None, :], tl.trans(qc), mask=t_mask)


@triton.jit
def _quantize_lines(
    x, lines, pid_blocks, num_lines, num_blocks, AMAX, S, stride_line, stride_block,
    TILE_L: tl.constexpr, TILE_B: tl.constexpr, BLOCK: tl.constexpr, GIVEN_AMAX: tl.constexpr, MX: tl.constexpr,
    RCEIL: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Quantize a ``[TILE_L, TILE_B]`` tile along its second dim; store its scales; return the FP8 tile.

    ``lines`` are the tile's global line indices (rows of the output layout), ``pid_blocks`` the tile's index
    along the quantized dim. ``GIVEN_AMAX``: one block per line, whose maximum (magnitude bits) is read from
    ``AMAX`` instead of taken over the tile; the first tile along the line stores the line's scale.
    """
    if GIVEN_AMAX:
        line_mask = lines < num_lines
        amax_bits = tl.load(AMAX + lines, mask=line_mask, other=0)
        nonfinite = amax_bits >= NONFINITE_BITS
        exponent = _shared_exponent(amax_bits, RCEIL)
        q = _to_e4m3(x, exponent[:, None], nonfinite[:, None], not RCEIL, EXACT)
        scale_mask = line_mask & (pid_blocks == 0)
        tl.store(S + lines * stride_line, _scale_value(exponent, nonfinite, MX), mask=scale_mask)
    else:
        q, exponent, nonfinite = _quantize_rows(x, TILE_L, TILE_B, BLOCK, RCEIL, EXACT)
        blocks = pid_blocks * (TILE_B // BLOCK) + tl.arange(0, TILE_B // BLOCK)
        scale_mask = (lines < num_lines)[:, None] & (blocks < num_blocks)[None, :]
        scale_ptrs = S + lines[:, None] * stride_line + blocks[None, :] * stride_block
        tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=scale_mask)
    return q


@triton.jit
def _quantize_columns(
    x, cols, pid_r, num_cols, num_blocks, AMAX, ST, stride_line, stride_block,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK: tl.constexpr, GIVEN_AMAX: tl.constexpr, MX: tl.constexpr,
    RCEIL: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Quantize a ``[TILE_R, TILE_C]`` tile down its columns in ``BLOCK x 1`` blocks, in place: the FP8 tile in
    ``x``'s layout, its scales stored as the transposed layout's (line = column, block = row block).

    ``GIVEN_AMAX``: one block per column, whose maximum (magnitude bits) is read from ``AMAX``; the first tile
    down the column stores its scale.
    """
    col_mask = cols < num_cols
    if GIVEN_AMAX:
        amax_bits = tl.load(AMAX + cols, mask=col_mask, other=0)
        nonfinite = amax_bits >= NONFINITE_BITS
        exponent = _shared_exponent(amax_bits, RCEIL)
        q = _to_e4m3(x, exponent[None, :], nonfinite[None, :], not RCEIL, EXACT)
        tl.store(ST + cols * stride_line, _scale_value(exponent, nonfinite, MX), mask=col_mask & (pid_r == 0))
    else:
        NUM_BLOCKS: tl.constexpr = TILE_R // BLOCK
        # exponent, nonfinite: [NUM_BLOCKS, TILE_C]
        q, exponent, nonfinite = _quantize_blocks(tl.reshape(x, (NUM_BLOCKS, BLOCK, TILE_C)), 1, RCEIL, EXACT)
        q = tl.reshape(q, (TILE_R, TILE_C))
        row_blocks = pid_r * NUM_BLOCKS + tl.arange(0, NUM_BLOCKS)
        scale_mask = (row_blocks < num_blocks)[:, None] & col_mask[None, :]
        scale_ptrs = ST + cols[None, :] * stride_line + row_blocks[:, None] * stride_block
        tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=scale_mask)
    return q


@triton.jit
def _split_columns(
    X, QT, ST, SUMS, num_rows, num_cols, padded_rows, stride_st_c, stride_st_r, region_r, region_c, part,
    BLOCK: tl.constexpr, MX: tl.constexpr, RCEIL: tl.constexpr, EXACT: tl.constexpr,
    REGION_R: tl.constexpr, REGION_C: tl.constexpr, COL_TILE_C: tl.constexpr,
):  # fmt: skip
    """The transposed layout of the region's ``part``-th ``[REGION_R, COL_TILE_C]`` column slab, loaded as
    ``[REGION_R / BLOCK, BLOCK, COL_TILE_C]`` so each block's maximum is one reduction, no reshape. ``SUMS``
    (``[Rp / BLOCK, C]`` fp32, or None): each block's column sums, from the same registers."""
    within = tl.arange(0, BLOCK)
    NUM_BLOCKS: tl.constexpr = REGION_R // BLOCK
    row_blocks = region_r * NUM_BLOCKS + tl.arange(0, NUM_BLOCKS)
    rows = row_blocks[:, None, None] * BLOCK + within[None, :, None]
    cols = region_c * REGION_C + part * COL_TILE_C + tl.arange(0, COL_TILE_C)
    mask = (rows < num_rows) & (cols < num_cols)[None, None, :]
    x = tl.load(X + rows * num_cols + cols[None, None, :], mask=mask, other=0.0)  # zeros: no maximum, zero codes
    q, exponent, nonfinite = _quantize_blocks(x, 1, RCEIL, EXACT)  # exponent: [NUM_BLOCKS, COL_TILE_C]
    scale_mask = (row_blocks < padded_rows // BLOCK)[:, None] & (cols < num_cols)[None, :]
    if SUMS is not None:
        sums = tl.sum(x.to(tl.float32), axis=1)  # [NUM_BLOCKS, COL_TILE_C]
        tl.store(SUMS + row_blocks[:, None] * num_cols + cols[None, :], sums, mask=scale_mask)
    scale_ptrs = ST + cols[None, :] * stride_st_c + row_blocks[:, None] * stride_st_r
    tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=scale_mask)
    t_rows = row_blocks[None, :, None] * BLOCK + within[None, None, :]  # the slab's columns become rows of qt
    t_mask = (cols < num_cols)[:, None, None] & (t_rows < padded_rows)  # rows past R are written as zeros
    tl.store(QT + cols[:, None, None] * padded_rows + t_rows, tl.permute(q, (2, 0, 1)), mask=t_mask)


@triton.jit
def _split_rows(
    X, Q, S, num_rows, num_cols, stride_s_r, stride_s_c, region_r, region_c, part,
    BLOCK: tl.constexpr, MX: tl.constexpr, RCEIL: tl.constexpr, EXACT: tl.constexpr,
    REGION_R: tl.constexpr, REGION_C: tl.constexpr, ROW_TILE_R: tl.constexpr,
):  # fmt: skip
    """The row layout of the region's ``part``-th ``[ROW_TILE_R, REGION_C]`` row slab, loaded as
    ``[ROW_TILE_R, REGION_C / BLOCK, BLOCK]``."""
    within = tl.arange(0, BLOCK)
    NUM_BLOCKS: tl.constexpr = REGION_C // BLOCK
    blocks = region_c * NUM_BLOCKS + tl.arange(0, NUM_BLOCKS)
    rows = region_r * REGION_R + part * ROW_TILE_R + tl.arange(0, ROW_TILE_R)
    offsets = rows[:, None, None] * num_cols + blocks[None, :, None] * BLOCK + within[None, None, :]
    mask = (rows < num_rows)[:, None, None] & (blocks < num_cols // BLOCK)[None, :, None]
    x = tl.load(X + offsets, mask=mask, other=0.0)
    q, exponent, nonfinite = _quantize_blocks(x, 2, RCEIL, EXACT)  # exponent: [ROW_TILE_R, NUM_BLOCKS]
    tl.store(Q + offsets, q, mask=mask)
    scale_mask = (rows < num_rows)[:, None] & (blocks < num_cols // BLOCK)[None, :]
    scale_ptrs = S + rows[:, None] * stride_s_r + blocks[None, :] * stride_s_c
    tl.store(scale_ptrs, _scale_value(exponent, nonfinite, MX), mask=scale_mask)


# Per-batch sizes (jagged token counts) as in _quantize_kernel: Rp comes as a count of blocks.
@triton.jit(do_not_specialize=["num_rows", "num_padded_blocks", "stride_s_c", "stride_st_c", "size_class"])
def _quantize_split_kernel(
    X, Q, S, QT, ST,  # [R, C] input, [R, C] fp8 + scales, [C, Rp] fp8 + scales
    SUMS,  # [Rp / BLOCK, C] fp32 column sums of each block of rows, or None
    num_rows, num_cols, num_padded_blocks, stride_s_r, stride_s_c, stride_st_c, stride_st_r,
    size_class,  # autotuning key only
    BLOCK: tl.constexpr, MX: tl.constexpr, RCEIL: tl.constexpr, EXACT: tl.constexpr, ROWS: tl.constexpr,
    REGION_R: tl.constexpr, REGION_C: tl.constexpr, COL_TILE_C: tl.constexpr, ROW_TILE_R: tl.constexpr,
    C_FIRST: tl.constexpr,
):  # fmt: skip
    """Rows (``ROWS``) and columns of ``[REGION_R, REGION_C]`` regions in one launch of single-part programs.

    Each region has ``REGION_C / COL_TILE_C`` column programs (tall slabs: the transposed layout) and
    ``REGION_R / ROW_TILE_R`` row programs (wide slabs: the row layout), numbered consecutively, so the programs
    of one region run at the same time and the second read of its tile mostly hits L2. Each part keeps the tile
    shape that suits it, with few registers (a bf16 tile stays bf16); one program doing both parts of a tile
    needs the whole tile widened to fp32 at once, which is why this kernel, not ``_quantize_kernel`` with both
    flags, quantizes rows and columns together (docs/benchmarks.md#quantization-kernels). ``C_FIRST`` numbers the
    regions along ``x``'s rows first (a band of whole rows at a time) instead of down its columns.

    Columns alone (no ``ROWS``) of ``mx`` come here too: the 3-D slabs take each 32-row block's maximum in one
    reduction, where ``_quantize_kernel`` reshapes its 2-D tile.
    """
    NUM_COL_PARTS: tl.constexpr = REGION_C // COL_TILE_C
    PARTS: tl.constexpr = NUM_COL_PARTS + (REGION_R // ROW_TILE_R if ROWS else 0)
    pid = tl.program_id(0)
    region, part = pid // PARTS, pid % PARTS
    padded_rows = num_padded_blocks * BLOCK
    if C_FIRST:  # regions numbered along the rows of x first: a band of whole rows read front to back
        num_regions_c = tl.cdiv(num_cols, REGION_C)
        region_r = (region // num_regions_c).to(tl.int64)
        region_c = (region % num_regions_c).to(tl.int64)
    else:  # down the columns first: the transposed layout's rows written front to back
        num_regions_r = tl.cdiv(padded_rows, REGION_R)
        region_r = (region % num_regions_r).to(tl.int64)
        region_c = (region // num_regions_r).to(tl.int64)
    if part < NUM_COL_PARTS:
        _split_columns(
            X, QT, ST, SUMS, num_rows, num_cols, padded_rows, stride_st_c, stride_st_r, region_r, region_c, part,
            BLOCK, MX, RCEIL, EXACT, REGION_R, REGION_C, COL_TILE_C,
        )  # fmt: skip
    elif ROWS:  # compiled only when rows are wanted (Q and S are None otherwise)
        _split_rows(
            X, Q, S, num_rows, num_cols, stride_s_r, stride_s_c, region_r, region_c, part - NUM_COL_PARTS,
            BLOCK, MX, RCEIL, EXACT, REGION_R, REGION_C, ROW_TILE_R,
        )  # fmt: skip


# (REGION_R, REGION_C, COL_TILE_C, ROW_TILE_R, C_FIRST, num_warps) candidates of _quantize_split_kernel, by block
# and by whether rows are wanted, the fastest of ``precision.py --sweep-split`` first (the plan for untimed sizes).
# Column slabs are 64 wide: a full 128-byte line of each row. 1x128 wants 4 warps. mx rows+cols wants small programs
# (1 or 2 warps) in regions only 64 rows tall and wide row slabs, so each row's E8M0 scales are written in runs of
# 32 bytes or more, not 4 bytes at a time (the rates: docs/benchmarks.md#quantization-kernels).
_SPLIT_CONFIGS = {
    (128, True): [(128, 128, 64, 64, 0, 4), (128, 256, 64, 32, 0, 4), (128, 128, 64, 32, 0, 4)],
    (32, True): [
        (64, 1024, 64, 2, 1, 1),
        (64, 4096, 64, 1, 0, 2),
        (64, 2048, 64, 2, 1, 2),
        (256, 4096, 64, 2, 0, 4),
        (256, 1024, 64, 8, 1, 4),
    ],
    (32, False): [(256, 64, 64, 64, 0, 4), (512, 64, 64, 64, 0, 4), (256, 128, 64, 64, 0, 4)],
}


def _launch_split(
    x: Tensor, q: Tensor | None, s: Tensor | None, qt: Tensor, st: Tensor, meta: dict, num_rows: int, padded: int,
    config: tuple[int, ...] | None = None, sums: Tensor | None = None,
) -> None:  # fmt: skip
    """Launch ``_quantize_split_kernel`` (tuned for large inputs, or with exactly ``config``): rows and columns of
    ``mx`` / ``1x128``, or columns alone (``q`` None); ``sums``: ``[Rp / BLOCK, C]`` column sums per row block."""
    block, rows, num_cols = meta["BLOCK"], q is not None, x.shape[1]
    elements = padded * num_cols
    s_strides = s.stride() if rows else (0, 0)
    args = (x, q, s, qt, st, sums, num_rows, num_cols, padded // block, *s_strides, *st.stride(), size_class(elements))
    meta = {**{k: meta[k] for k in ("BLOCK", "MX", "RCEIL", "EXACT")}, "ROWS": rows}
    key = ("quantize_split", size_class(elements), next_power_of_2(num_cols), x.dtype, block, rows, meta["RCEIL"])
    key += ("sums",) if sums is not None else ()

    def grid(region_r: int, region_c: int, col_tile_c: int, row_tile_r: int, c_first: int) -> tuple[int]:
        parts = region_c // col_tile_c + (region_r // row_tile_r if rows else 0)
        return (cdiv(padded, region_r) * cdiv(num_cols, region_c) * parts,)

    names = ("REGION_R", "REGION_C", "COL_TILE_C", "ROW_TILE_R", "C_FIRST")
    configs = _SPLIT_CONFIGS[block, rows] if config is None else [config]  # one candidate: launched untimed
    launch_tuned(_quantize_split_kernel, configs, key, grid, args, meta, elements, names)


def _check_split_config(config: tuple[int, ...], block: int) -> None:
    """Raise unless ``config`` (``REGION_R, REGION_C, COL_TILE_C, ROW_TILE_R, C_FIRST, num_warps``) tiles whole
    blocks."""
    region_r, region_c, col_tile_c, row_tile_r, _, _ = config
    if region_r % block or region_c % block or region_c % col_tile_c or region_r % row_tile_r:
        raise ValueError(
            f"`split_config` {config} must have REGION_R and REGION_C multiples of the block ({block}), REGION_C a "
            "multiple of COL_TILE_C and REGION_R a multiple of ROW_TILE_R"
        )


def row_buffers(layout: str, num_rows: int, num_cols: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Codes ``[R, C]`` and scales (:func:`scale_buffer`) of ``R`` rows quantized along ``C`` in ``layout`` (not
    ``128x128``). ``1x128`` rows are a GEMM's first operand, which cuBLAS takes in whole blocks of 128 rows only:
    their codes and scales are views of buffers with room for the rows up to a multiple of 128 (contents there
    unspecified), so :func:`lightning_gem.ops.mx.scaled_mm` passes those blocks without a padded copy."""
    lines = -(-num_rows // 128) * 128 if layout == "1x128" else num_rows
    q = torch.empty(lines, num_cols, dtype=torch.float8_e4m3fn, device=device)
    return q[:num_rows], scale_buffer(layout, lines, num_cols // block_shape(layout, num_cols)[1], device)[:num_rows]


# Per-batch sizes (jagged token counts): no new compiled variant when their divisibility by 16 changes.
@triton.jit(do_not_specialize=["num_rows", "size_class"])
def _rowwise_rows_kernel(
    X, Q, S,  # [R, C] input, [R, C] fp8, [R, 1] fp32 scales
    RSTD, MEAN, WEIGHT, BIAS,  # norm prologue: [R], [R], [C], [C]
    num_rows, num_cols,
    size_class,  # autotuning key only
    RCEIL: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr, EXACT: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,  # TILE_C >= C: a program holds TILE_R whole rows
):  # fmt: skip
    """``rowwise`` rows in one read of ``x``: each row's maximum, exponent, scale and FP8 codes from registers."""
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.arange(0, TILE_C)
    row_mask = rows < num_rows
    in_bounds = row_mask[:, None] & (cols < num_cols)[None, :]
    offsets = rows[:, None] * num_cols + cols[None, :]
    x = tl.load(X + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    if NORM != 0:
        x = _normalize(x, rows, cols, RSTD, MEAN, WEIGHT, BIAS, num_rows, num_cols, NORM, OUT_DTYPE)
    q, exponent, nonfinite = _quantize_blocks(x, 1, RCEIL, EXACT)  # one block a row
    tl.store(Q + offsets, q, mask=in_bounds)
    tl.store(S + rows, _scale_value(exponent, nonfinite, False), mask=row_mask)


ONE_PASS_MAX_COLS = 16384
"""Widest rows ``rowwise`` quantizes in one pass (whole rows in registers); wider ones take two passes."""

# (elements per program, num_warps) candidates of _rowwise_rows_kernel: as many whole rows as fill that many.
_ONE_PASS_CONFIGS = [(8192, 8), (4096, 4), (16384, 8), (16384, 16)]


@functools.cache
def _one_pass_configs(num_cols: int) -> tuple[tuple[int, int, int], ...]:
    """``(TILE_R, TILE_C, num_warps)`` of ``_rowwise_rows_kernel`` for rows of ``num_cols``, at most 64 fp32
    values per thread (listed once per width)."""
    tile_c = next_power_of_2(num_cols)
    configs: list[tuple[int, int, int]] = []
    for elements, warps in _ONE_PASS_CONFIGS:
        config = (max(1, elements // tile_c), tile_c, warps)
        if config[0] * tile_c <= 64 * 32 * warps and config not in configs:
            configs.append(config)
    return tuple(configs)


def _rowwise_rows(x: Tensor, q: Tensor, s: Tensor, meta: dict, norm_args: tuple) -> None:
    """Launch ``_rowwise_rows_kernel`` (tuned for large inputs) for rows-only ``rowwise`` quantization."""
    num_rows, num_cols = x.shape
    elements = num_rows * num_cols
    args = (x, q, s, *norm_args, num_rows, num_cols, size_class(elements))
    meta = {k: meta[k] for k in ("RCEIL", "NORM", "OUT_DTYPE", "EXACT")}
    key = ("rowwise_rows", size_class(elements), x.dtype, num_cols, meta["RCEIL"], meta["NORM"], meta["OUT_DTYPE"])
    grid = lambda tile_r, tile_c: (cdiv(num_rows, tile_r),)
    launch_tuned(_rowwise_rows_kernel, _one_pass_configs(num_cols), key, grid, args, meta, elements)


_INTERPRETED = is_interpreted(_quantize_kernel)  # whether every kernel here rounds in fp32 first (EXACT)


def scale_buffer(layout: str, num_lines: int, num_blocks: int, device: torch.device) -> Tensor:
    """Scales of ``num_lines`` lines of ``num_blocks`` blocks: uint8 E8M0 row-major for ``mx``; fp32
    column-major for ``1x128`` (Hopper's GEMM reads them outer-dim-major); fp32 ``[num_lines, 1]`` for
    ``rowwise``."""
    if layout == "rowwise":
        return torch.empty(num_lines, 1, dtype=torch.float32, device=device)
    if layout == "mx":
        return torch.empty(num_lines, num_blocks, dtype=torch.uint8, device=device)
    return torch.empty(num_blocks, num_lines, dtype=torch.float32, device=device).t()


# Per-batch sizes (jagged token counts): no new compiled variant when their divisibility by 16 changes.
@triton.jit(do_not_specialize=["num_rows", "size_class"])
def _line_amax_kernel(
    X, ROW_AMAX, COL_AMAX,  # [R, C] input; [R] / [C] int32 magnitude bits of the row / column maxima (zeroed)
    SUMS,  # [cdiv(R, SUM_ROWS), C] fp32 column sums of each SUM_ROWS rows, or None
    RSTD, MEAN, WEIGHT, BIAS,  # norm prologue: [R], [R], [C], [C]
    num_rows, num_cols,
    size_class,  # autotuning key only
    ROWS: tl.constexpr, COLS: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, STEPS: tl.constexpr, SUM_ROWS: tl.constexpr,
):  # fmt: skip
    """Maxima of ``|x|`` (or of the norm's output) along rows and/or columns, from one read of ``x``.

    Program ``(i, j)`` walks a ``[STEPS * TILE_R, TILE_C]`` strip down its ``TILE_R``-row tiles: the strip's
    column maxima stay in registers and are combined across strips with one integer atomic max per column at the
    end; each tile's row maxima go straight out by atomic max (one per row and strip). Both buffers start at
    zero, so running the kernel again (as the tuner does) changes nothing. Maxima are magnitude bit patterns, so
    NaN and Inf come out on top and need no separate check. Masked elements load as zero, below any maximum.

    ``SUMS``: the column sums of every ``SUM_ROWS`` rows too (a bias gradient's partial sums), stored, not
    accumulated, so they too come out the same on a second run. A strip holds whole groups of ``SUM_ROWS``.
    """
    GROUP: tl.constexpr = SUM_ROWS // TILE_R  # tiles per group of summed rows
    pid_r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    col_mask = cols < num_cols
    col_bits = tl.zeros((TILE_C,), dtype=tl.int32)
    for group in range(STEPS // GROUP):
        col_sums = tl.zeros((TILE_C,), dtype=tl.float32)
        for inner in range(GROUP):
            rows = (pid_r * STEPS + group * GROUP + inner) * TILE_R + tl.arange(0, TILE_R)
            row_mask = rows < num_rows
            in_bounds = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * num_cols + cols[None, :], mask=in_bounds, other=0.0)
            if NORM != 0:
                x = _normalize(
                    x.to(tl.float32), rows, cols, RSTD, MEAN, WEIGHT, BIAS, num_rows, num_cols, NORM, OUT_DTYPE
                )
            bits = _magnitude_bits_of(x)  # a bf16 tile's from its own bits, not widened first
            if ROWS:
                tl.atomic_max(ROW_AMAX + rows, tl.max(bits, axis=1), mask=row_mask, sem="relaxed")
            if COLS:
                col_bits = tl.maximum(col_bits, tl.max(bits, axis=0))
            if SUMS is not None:
                col_sums += tl.sum(x.to(tl.float32), axis=0)
        if SUMS is not None:
            sum_row = pid_r * (STEPS // GROUP) + group
            tl.store(SUMS + sum_row * num_cols + cols, col_sums, mask=col_mask & (sum_row * SUM_ROWS < num_rows))
    if COLS:
        tl.atomic_max(COL_AMAX + cols, col_bits, mask=col_mask, sem="relaxed")


# (TILE_R, TILE_C, STEPS, num_warps) candidates of _line_amax_kernel: a program's strip is STEPS * TILE_R rows of
# TILE_C columns. Wider tiles take fewer row atomics, taller strips fewer column atomics; many strips keep every
# SM busy, where programs walking whole rows would number only as many as the rows' blocks (the rates:
# docs/benchmarks.md#quantization-kernels). Every TILE_R divides SUM_ROWS, and every strip holds whole groups of
# SUM_ROWS rows.
_AMAX_CONFIGS = [
    (32, 256, 16, 4), (16, 512, 16, 4), (32, 512, 8, 8), (64, 256, 8, 8), (16, 1024, 16, 8), (32, 128, 32, 4),
    (8, 1024, 32, 4), (64, 128, 16, 4),
]  # fmt: skip
SUM_ROWS = 128
"""Rows per partial column sum of the line-maxima kernel (``_line_maxima(..., sums=True)``)."""


def _line_maxima(
    x: Tensor, rows: bool, cols: bool, norm_args: tuple, norm_code: int, out_dtype: object, sums: bool = False
) -> tuple[Tensor | None, Tensor | None] | tuple[Tensor | None, Tensor | None, Tensor]:
    """int32 magnitude bits of the maxima of ``x``'s rows ``[R]`` and/or columns ``[C]`` (of the norm's output
    when ``norm_code`` is set), or None where not requested: what ``rowwise`` scales are made from. ``sums``:
    also the fp32 column sums of every :data:`SUM_ROWS` rows, ``[cdiv(R, SUM_ROWS), C]``, as a third output.

    The kernel may run several times while it is tuned: the maxima it raises atomically stay the same.
    """
    num_rows, num_cols = x.shape
    row_amax = torch.zeros(num_rows, dtype=torch.int32, device=x.device) if rows else None
    col_amax = torch.zeros(num_cols, dtype=torch.int32, device=x.device) if cols else None
    partial = torch.empty(-(-num_rows // SUM_ROWS), num_cols, dtype=torch.float32, device=x.device) if sums else None
    elements = num_rows * num_cols
    args = (x, row_amax, col_amax, partial, *norm_args, num_rows, num_cols, size_class(elements))
    meta = dict(ROWS=rows, COLS=cols, NORM=norm_code, OUT_DTYPE=out_dtype, SUM_ROWS=SUM_ROWS)
    key = ("line_amax", size_class(elements), x.dtype, rows, cols, norm_code, out_dtype, sums)
    grid = lambda tile_r, tile_c, steps: (cdiv(num_rows, tile_r * steps), cdiv(num_cols, tile_c))
    configs = [c for c in _AMAX_CONFIGS if c[1] <= max(next_power_of_2(num_cols), 128)] or _AMAX_CONFIGS[:1]
    if num_rows > 0:
        launch_tuned(_line_amax_kernel, configs, key, grid, args, meta, elements, ("TILE_R", "TILE_C", "STEPS"))
    return (row_amax, col_amax) if not sums else (row_amax, col_amax, partial)


def quantize_triton(
    x: Tensor,
    layout: str,
    rounding: str = "rceil",
    *,
    rows: bool = True,
    cols: bool = False,
    norm: tuple[str, Tensor, Tensor | None, Tensor | None, Tensor | None] | None = None,
    norm_dtype: torch.dtype | None = None,
    one_pass: bool = True,
    split_config: tuple[int, ...] | None = None,
    maxima: tuple[Tensor | None, Tensor | None] | None = None,
    column_sums: bool = False,
    x_scales: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None] | tuple[object, object, Tensor]:
    """Quantize ``[R, C]`` ``x`` (contiguous) along ``C`` (``rows``) and/or along ``R`` transposed (``cols``).

    Args:
        x: ``[R, C]`` fp32/fp16/bf16 matrix (validated by the public API).
        layout: ``"mx"``, ``"1x128"``, ``"128x128"`` or ``"rowwise"``.
        rounding: ``"rceil"`` or ``"floor"``.
        rows: write ``(q [R, C], scale)``.
        cols: write ``(qt [C, Rp], scale_t)``, ``Rp`` = ``R`` rounded up to the block (zero rows appended).
        norm: ``(kind, rstd [R], mean [R] or None, weight [C] or None, bias [C] or None)``: quantize the
            norm's output ``norm(x)`` (rounded to ``norm_dtype``, default ``x``'s) instead of ``x``.
        one_pass: ``rowwise`` rows alone (no ``cols``) of at most :data:`ONE_PASS_MAX_COLS` columns in one read
            of ``x``; False takes the two-pass path (line maxima, then quantization) every layout with ``cols``
            takes. Same results either way (benchmarks time both).
        split_config: ``(REGION_R, REGION_C, COL_TILE_C, ROW_TILE_R, C_FIRST, num_warps)``: quantize ``mx`` / ``1x128``
            columns (and rows, if asked) in one launch of ``_quantize_split_kernel`` with exactly these tiles,
            whatever the tuner would choose (benchmarks and tests time and check every candidate so).
        maxima: ``rowwise`` two-pass only: ``(row_amax, col_amax)`` of ``x`` from ``_line_maxima`` (for the
            lines asked, None otherwise), so only the quantizing pass runs (benchmarks time the passes apart).
        column_sums: also return the fp32 sums of ``x``'s columns ``[C]`` (a bias gradient), from the same read of
            ``x`` where columns are quantized by the split kernel or ``rowwise``'s line maxima; otherwise by a
            separate reduction. No norm.
        x_scales: ``x`` is an MX copy (E4M3 codes ``[R, C]``) and these its biased E8M0 scales ``[R, C / 32]``
            (uint8): its values are read from the copy. With a norm (``norm_dtype`` given), columns alone, ``mx``
            or ``1x128``: a fused norm's weight-gradient operand rebuilt from the input's saved copy.

    Returns:
        ``((q, scale) or None, (qt, scale_t) or None)``, and the column sums third when asked. Scales: uint8
        E8M0 ``[R, C/32]`` for ``mx``; fp32 column-major ``[R, C/128]`` for ``1x128`` (Hopper's GEMM reads them
        so); ``[R/128, C/128]`` for ``128x128``; ``[R, 1]`` for ``rowwise``; the transposed layout's likewise with
        ``R`` and ``C`` swapped.
    """
    num_rows, num_cols = x.shape
    if x_scales is not None:
        if norm is None or norm_dtype is None or rows or not cols or layout not in ("mx", "1x128"):
            raise ValueError(
                "`x_scales` (an MX copy's input) takes a norm with its `norm_dtype`, columns alone, mx or 1x128"
            )
        x = x.view(torch.uint8)  # the codes as bytes, as the kernel decodes them
    norm_dtype = norm_dtype or x.dtype
    mx, square, rowwise = layout == "mx", layout == "128x128", layout == "rowwise"
    block = {"mx": 32, "1x128": 128, "128x128": 128, "rowwise": 1}[layout]
    pad_block = 128 if rowwise else block  # rowwise's transposed contraction dim is padded like 1x128's
    padded_rows = -(-num_rows // pad_block) * pad_block
    device = x.device

    q = s = qt = st = None
    if rows:
        if square:
            q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=device)
            s = torch.empty(-(-num_rows // 128), num_cols // 128, dtype=torch.float32, device=device)
        else:
            q, s = row_buffers(layout, num_rows, num_cols, device)
    if column_sums and norm is not None:
        raise ValueError("`column_sums` are of x itself: no norm")

    def done(row_out: object, col_out: object, partial: Tensor | None = None) -> tuple:
        """The outputs, with the column sums from the kernel's partial sums (or a reduction of ``x``) if asked."""
        if not column_sums:
            return row_out, col_out
        return row_out, col_out, partial.sum(0) if partial is not None else x.sum(0, dtype=torch.float32)

    if square and cols and x.dtype == torch.float32:
        return done(*_square_transposed_apart(x, rounding, rows, padded_rows))
    if cols:
        # 128x128: the kernel writes the transposed codes as bytes (see _quantize_kernel); the result is viewed as FP8
        qt = torch.empty(num_cols, padded_rows, dtype=torch.uint8 if square else torch.float8_e4m3fn, device=device)
        if square:
            st = torch.empty(num_cols // 128, padded_rows // 128, dtype=torch.float32, device=device)
        else:
            st = scale_buffer(layout, num_cols, padded_rows // block, device)

    kind, rstd, mean, weight, bias = norm if norm is not None else (None, None, None, None, None)
    norm_args, norm_code, out_dtype = (rstd, mean, weight, bias), _NORM_CODES[kind], _TL_DTYPES[norm_dtype]
    meta = dict(
        BLOCK=block if not rowwise else 128, ROWS=rows, COLS=cols, SQUARE=square, GIVEN_AMAX=rowwise, MX=mx,
        RCEIL=rounding == "rceil", NORM=norm_code, OUT_DTYPE=out_dtype, EXACT=_INTERPRETED, X_MX=x_scales is not None,
    )  # fmt: skip
    if rowwise and rows and not cols and one_pass and num_cols <= ONE_PASS_MAX_COLS:
        if num_rows > 0:
            _rowwise_rows(x, q, s, meta, norm_args)
        return done((q, s), None)
    split = cols and layout in ("mx", "1x128") and kind is None
    partial = None  # [Rp / block, C] column sums of each block of rows, for the split kernel to fill
    if split and column_sums:
        partial = torch.empty(padded_rows // block, num_cols, dtype=torch.float32, device=device)
    if split_config is not None:
        if not split:
            raise ValueError("`split_config` takes mx or 1x128 columns (with or without rows) and no norm")
        _check_split_config(split_config, block)
        if padded_rows > 0:
            _launch_split(x, q, s, qt, st, meta, num_rows, padded_rows, config=split_config, sums=partial)
        return done(((q, s) if rows else None), (qt, st), partial)
    if split and (rows or mx):
        if padded_rows > 0:
            launch = _rows_and_columns if rows else _columns_alone
            if not launch(x, q, s, qt, st, meta, num_rows, padded_rows, partial):
                partial = None  # the plan that ran wrote no sums
        return done(((q, s) if rows else None), (qt, st), partial)
    if maxima is not None and not rowwise:
        raise ValueError("`maxima` are given to rowwise quantization only")
    partial = _launch_general(
        x, q, s, qt, st, meta, norm_args, num_rows, padded_rows, maxima, column_sums, x_scales
    )  # fmt: skip
    if square and cols:
        qt = qt.view(torch.float8_e4m3fn)
    return done(((q, s) if rows else None), ((qt, st) if cols else None), partial)


def _square_transposed_apart(
    x: Tensor, rounding: str, rows: bool, padded_rows: int
) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor]]:
    """``128x128`` tiles of an fp32 ``x`` and their transpose: the kernel writes the row layout, PyTorch transposes
    the codes and scales. The kernel's in-register transposition is exact for bf16 and fp16 tiles only: Triton
    (3.6, compiled for the GPU) writes wrong codes for some shapes of tiles quantized from fp32; the GPU tests
    hold both paths to the reference."""
    q, s = quantize_triton(x, "128x128", rounding)[0]
    if padded_rows == x.shape[0]:  # whole blocks of rows (a weight's usual shape): one transposing copy
        qt = q.t().contiguous()
    else:
        qt = q.new_zeros(x.shape[1], padded_rows)  # rows past R: zero codes, as the kernel writes them
        qt[:, : x.shape[0]] = q.t()
    return ((q, s) if rows else None), (qt, s.t().contiguous())


def _launch_general(
    x: Tensor, q: Tensor | None, s: Tensor | None, qt: Tensor | None, st: Tensor | None, meta: dict,
    norm_args: tuple, num_rows: int, padded_rows: int, maxima: tuple[Tensor | None, Tensor | None] | None = None,
    sums: bool = False, x_scales: Tensor | None = None,
) -> Tensor | None:  # fmt: skip
    """``_quantize_kernel`` (after the line maxima, for ``rowwise``) over the rows and/or columns ``meta`` asks.
    ``maxima``: ``rowwise``'s ``(row_amax, col_amax)`` from :func:`_line_maxima` already, so only the quantizing
    pass runs (benchmarks time the two passes apart so). ``sums``: return the line-maxima pass's partial column
    sums (``rowwise`` with its maxima computed here; None otherwise). ``x_scales``: ``x`` is an MX copy's codes
    (``meta["X_MX"]``)."""
    rows, cols, rowwise = meta["ROWS"], meta["COLS"], meta["GIVEN_AMAX"]
    num_cols, pad_block = x.shape[1], meta["BLOCK"]
    row_amax, col_amax = maxima or (None, None)
    partial = None
    if rowwise and maxima is None:  # the transposed layout's zero padding changes no maximum
        row_amax, col_amax, *rest = _line_maxima(x, rows, cols, norm_args, meta["NORM"], meta["OUT_DTYPE"], sums)
        partial = rest[0] if sums else None
    grid_rows = padded_rows if cols else num_rows
    args = (
        x, q, s, qt, st, row_amax, col_amax, *norm_args, x_scales,  # None where absent: the kernel never reads them
        num_rows, num_cols, padded_rows // pad_block,
        *(s.stride() if rows else (0, 0)), *(st.stride() if cols else (0, 0)),
        size_class(grid_rows * num_cols),
    )  # fmt: skip
    if grid_rows > 0:  # no rows: nothing to launch
        _launch(args, meta, grid_rows, num_cols)
    return partial


# How rows and columns of ``mx`` / ``1x128`` are quantized together, by block, the plan for untimed sizes first:
# "split" is one launch of _quantize_split_kernel, which reads each tile once for both layouts; "apart" is the rows
# alone with whole-row tiles, then the columns alone (two reads of ``x``; the tuner times both where it can, the
# rates: docs/benchmarks.md#quantization-kernels).
_ROWS_AND_COLUMNS_PLANS = {32: ("split", "apart"), 128: ("split", "apart")}


def _columns_alone(
    x: Tensor, q: None, s: None, qt: Tensor, st: Tensor, meta: dict, num_rows: int, padded: int,
    sums: Tensor | None = None,
) -> bool:  # fmt: skip
    """The transposed layout alone of ``mx`` (the split kernel's column slabs, filling ``sums``: returns True) or
    ``1x128`` (``_quantize_kernel``, no sums: False)."""
    if meta["BLOCK"] == 32:
        _launch_split(x, None, None, qt, st, meta, num_rows, padded, sums=sums)
        return True
    _launch_general(x, None, None, qt, st, {**meta, "ROWS": False}, (None,) * 4, num_rows, padded)
    return False


def _rows_and_columns(
    x: Tensor, q: Tensor, s: Tensor, qt: Tensor, st: Tensor, meta: dict, num_rows: int, padded: int,
    sums: Tensor | None = None,
) -> bool:  # fmt: skip
    """Rows and columns of ``mx`` / ``1x128`` (no norm) by the faster of the two plans above for this size;
    True when the plan that ran filled ``sums`` (the split kernel's column slabs do)."""
    block = meta["BLOCK"]
    elements = padded * x.shape[1]

    def run(plan: str) -> bool:
        if plan == "split":
            _launch_split(x, q, s, qt, st, meta, num_rows, padded, sums=sums)
            return True
        _launch_general(x, q, s, None, None, {**meta, "COLS": False}, (None,) * 4, num_rows, padded)
        return _columns_alone(x, None, None, qt, st, meta, num_rows, padded, sums)

    plans = list(_ROWS_AND_COLUMNS_PLANS[block])
    if elements < TUNE_ABOVE or is_interpreted(_quantize_split_kernel):  # as launch_tuned: small or interpreted
        plans = plans[:1]
    width = next_power_of_2(x.shape[1])
    key = ("quantize_rows_and_columns", size_class(elements), width, x.dtype, block, meta["RCEIL"], sums is not None)
    return run(pick_fastest(_CHOSEN, key, plans, run, (x, q, qt)))


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# (TILE_R, TILE_C, num_warps) candidates; _valid_tiles keeps those whose tiles hold whole scale blocks. The wide,
# short ones (whole rows of a GEM width) serve rows alone: they write each row's scales contiguously, where a
# 32 x 128 tile's ``mx`` scales are 32 scattered 4-byte stores (rows alone run at the copy's bandwidth:
# docs/benchmarks.md#quantization-kernels).
_CONFIGS = [
    (32, 128, 4), (64, 128, 8), (32, 256, 8), (128, 128, 8), (128, 128, 16), (128, 64, 4), (128, 32, 4), (32, 64, 4),
    (2, 4096, 8), (1, 4096, 4), (2, 2048, 4), (4, 1024, 4), (8, 512, 4),
]  # fmt: skip


@functools.cache
def _valid_configs(
    block: int, rows: bool, cols: bool, square: bool, given_amax: bool, width: int
) -> tuple[tuple[int, int, int], ...]:
    """The candidates whose tiles hold whole scale blocks for these flags and are no wider than ``width`` (the
    rows' width rounded up to a power of two; 128 always fits), pruned once per set of flags and width.

    ``128x128`` (weights) takes 8 warps only: a weight is too small for the tuner, which times launches from
    Python, to tell its configs apart, and 8 warps are the faster for the transposed tiles of weights replayed in a
    CUDA graph (docs/benchmarks.md#quantization-kernels, the 128x128 row).
    """
    return tuple(
        c
        for c in _CONFIGS
        if c[1] <= max(width, 128)
        and _valid_tiles(c[0], c[1], block, rows, cols, square, given_amax)
        and (not square or c[2] == 8)
    )


def _valid_tiles(tile_r: int, tile_c: int, block: int, rows: bool, cols: bool, square: bool, given_amax: bool) -> bool:
    if square:
        return (tile_r, tile_c) == (128, 128)
    if not given_amax and ((rows and tile_c % block) or (cols and tile_r % block)):
        return False
    if not cols:
        return tile_r <= 64  # rows only: short, wide tiles
    return rows or tile_c <= 64 or (tile_r, tile_c) == (128, 128)  # transposed only: tall tiles


def _launch(args: tuple, meta: dict, grid_rows: int, num_cols: int) -> None:
    """Tuned launch for large inputs (once per size class and flags); the first valid config for small ones."""
    width = next_power_of_2(num_cols)  # in the key too: the candidates and the best of them depend on it
    configs = _valid_configs(meta["BLOCK"], meta["ROWS"], meta["COLS"], meta["SQUARE"], meta["GIVEN_AMAX"], width)
    key = ("quantize", args[-1], width, args[0].dtype, *(meta[k] for k in _KEY_FLAGS), meta["OUT_DTYPE"])
    grid = lambda tile_r, tile_c: (cdiv(grid_rows, tile_r), cdiv(num_cols, tile_c))
    launch_tuned(_quantize_kernel, configs, key, grid, args, meta, grid_rows * num_cols)
