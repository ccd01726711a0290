"""Triton kernels of the HSTU layer's pointwise work around its attention, forward and backward.

Legend: ``R`` rows (tokens x heads for per-head work, tokens otherwise), ``W`` a row's width, ``P`` one part's
columns, ``N`` the normalised width.

- ``silu_split``: ``SiLU`` of the ``uvqk`` projection's rows, written as four contiguous parts (U, V, Q, K): one
  read and one write, where ``F.silu`` left one wide activation and the split strided views of it (which tensor
  descriptors cannot read). Its backward multiplies the parts' gradients by ``SiLU'`` straight into the projection's
  gradient, where autograd concatenated the parts' gradients first (one more read and write of the widest
  activation of the layer). The projection's bias may come to the kernels instead of its matmul: the forward adds it,
  and the backward sums its gradient in registers as it writes the projection's (one read of that gradient fewer).
- ``norm_mul``: ``norm(A) * U`` (RMSNorm or LayerNorm of the attention output, gated): one pass forward where the
  norm and the product were two, and one backward pass for ``dA``, ``dU`` and the weight's partial sums, where
  the product's backward and the norm's were several kernels and the norm's output was saved for the backward.
  Without a gate, the norm alone, written in another dtype than its input's where asked: a float32 residual
  stream's norm comes out in bf16 for the Linear that reads it under autocast (one pass where the norm and
  autocast's cast were two; the backward reads the bf16 gradient and writes the float32 one, where a cast came
  first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, is_interpreted, launch, next_power_of_2
from lightning_gem.ops.mx.impl.triton._common import _load_mx_tile, _store_mx_tile

__all__ = ["MXRows", "norm_mul_backward", "norm_mul_forward", "silu_split_backward", "silu_split_forward", "tile_warps"]

# Elements a program holds per part or per tile: a few registers a thread at 4 warps.
_ELEMENTS = 4096


@triton.jit
def _x_tile(X, CODES, SCALES, rows, row_ok, start, width, P: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_P: tl.constexpr, FROM_FP8: tl.constexpr):  # fmt: skip
    """A part's ``[BLOCK_R, BLOCK_P]`` tile of ``x`` in fp32 (zeros outside): loaded, or ``FROM_FP8`` decoded from its
    MX copy (codes ``[R, W]`` as bytes, biased E8M0 scales ``[R, W / 32]``; the part's columns whole blocks)."""
    if FROM_FP8:
        x = _load_mx_tile(CODES, SCALES, rows, row_ok, start, width, P, BLOCK_R, BLOCK_P)
    else:
        cols = tl.arange(0, BLOCK_P)
        mask = row_ok[:, None] & (cols < P)[None, :]
        x = tl.load(X + rows[:, None] * width + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _silu_part_forward(
    X, BIAS, OUT, CODES, SCALES, rows, groups_R, row_ok, start, width, P: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, SAVE_FP8: tl.constexpr, FROM_FP8: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_P)
    mask = row_ok[:, None] & (cols < P)[None, :]
    x = _x_tile(X, CODES, SCALES, rows, row_ok, start, width, P, BLOCK_R, BLOCK_P, FROM_FP8)
    if SAVE_FP8:  # x's MX copy from the same read
        _store_mx_tile(CODES, SCALES, x, rows, row_ok, start, width, P, BLOCK_R, BLOCK_P, EXACT)
    if BIAS is not None:
        x += tl.load(BIAS + groups_R[:, None] * width + start + cols[None, :], mask=mask).to(tl.float32)
    y = x * tl.sigmoid(x)
    tl.store(OUT + rows[:, None] * P + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


# Per-batch sizes (jagged token counts): no new compiled variant when their divisibility by 16 changes.
@triton.jit(do_not_specialize=["num_rows"])
def _silu_split_fwd_kernel(
    X, BIAS, OUT0, OUT1, OUT2, OUT3,  # [R, W]; [G, W] or None; [R, P0] ... [R, P3]
    CODES, SCALES,  # x's MX copy, [R, W] bytes and [R, W / 32] biased exponents: written (SAVE_FP8) or read for x
    num_rows, groups,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr, SAVE_FP8: tl.constexpr = False, FROM_FP8: tl.constexpr = False,
    EXACT: tl.constexpr = False,
):  # fmt: skip
    """Row ``r`` adds the bias row ``r % groups`` (the rows are tokens x ``groups``) before the SiLU."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    groups_R = rows % groups
    width = P0 + P1 + P2 + P3
    _silu_part_forward(
        X, BIAS, OUT0, CODES, SCALES, rows, groups_R, row_ok, 0, width, P0, BLOCK_R, BLOCK_P, SAVE_FP8, FROM_FP8, EXACT
    )
    if P1 > 0:
        _silu_part_forward(
            X, BIAS, OUT1, CODES, SCALES, rows, groups_R, row_ok, P0, width, P1, BLOCK_R, BLOCK_P, SAVE_FP8,
            FROM_FP8, EXACT,
        )  # fmt: skip
    if P2 > 0:
        _silu_part_forward(
            X, BIAS, OUT2, CODES, SCALES, rows, groups_R, row_ok, P0 + P1, width, P2, BLOCK_R, BLOCK_P, SAVE_FP8,
            FROM_FP8, EXACT,
        )  # fmt: skip
    if P3 > 0:
        _silu_part_forward(
            X, BIAS, OUT3, CODES, SCALES, rows, groups_R, row_ok, P0 + P1 + P2, width, P3, BLOCK_R, BLOCK_P,
            SAVE_FP8, FROM_FP8, EXACT,
        )  # fmt: skip


@triton.jit
def _silu_part_backward(
    X, CODES, SCALES, BIAS, GRAD, DX, rows, row_ok, group, start, width, P: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_GRAD: tl.constexpr, FROM_FP8: tl.constexpr,
):  # fmt: skip
    """Writes the part's columns of ``dX`` for ``rows`` and returns them (fp32; zeros at rows past the end)."""
    cols = tl.arange(0, BLOCK_P)
    col_ok = cols < P
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * width + start + cols[None, :]
    if HAS_GRAD:
        x = _x_tile(X, CODES, SCALES, rows, row_ok, start, width, P, BLOCK_R, BLOCK_P, FROM_FP8)
        if BIAS is not None:
            x += tl.load(BIAS + group * width + start + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(GRAD + rows[:, None] * P + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(x)
        dx = g * s * (1.0 + x * (1.0 - s))
    else:  # a part without a gradient (unused output): its columns of dX are zeros
        dx = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    return dx


@triton.jit
def _store_bias_part(DB_PART, db, start, P: tl.constexpr, BLOCK_P: tl.constexpr):
    cols = tl.arange(0, BLOCK_P)
    tl.store(DB_PART + start + cols, tl.sum(db, axis=0), mask=cols < P)


@triton.jit(do_not_specialize=["num_tokens", "num_tiles"])
def _silu_split_bwd_kernel(
    X, BIAS, G0, G1, G2, G3, DX, DB_PART,  # [R, W]; [G, W] or None; [R, P0] ... [R, P3]; [R, W]; [S, G, W] or None
    CODES, SCALES,  # FROM_FP8: x's MX copy, read instead of X
    num_tokens, num_tiles,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr, HAS3: tl.constexpr,
    FROM_FP8: tl.constexpr = False,
):  # fmt: skip
    """Program ``(s, g)`` walks the tiles ``s, s + S, ...`` of ``BLOCK_R`` tokens of bias group ``g`` (rows
    ``token * G + g``; ``G`` is 1 without a bias). With a bias it sums its rows of ``dX`` per column in registers and
    writes them once, to ``DB_PART[s, g]``; the launcher sums the ``S`` partial rows. The sums stay per thread (a tile's
    shape) until the end: a column sum per tile would cross warps through shared memory on every tile."""
    pid = tl.program_id(0)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    width = P0 + P1 + P2 + P3
    db0 = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    db1 = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    db2 = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    db3 = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        tokens = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = tokens < num_tokens
        rows = tokens * groups + group
        dx = _silu_part_backward(
            X, CODES, SCALES, BIAS, G0, DX, rows, row_ok, group, 0, width, P0, BLOCK_P, BLOCK_R, HAS0, FROM_FP8
        )
        if DB_PART is not None:
            db0 += dx
        if P1 > 0:
            dx = _silu_part_backward(
                X, CODES, SCALES, BIAS, G1, DX, rows, row_ok, group, P0, width, P1, BLOCK_P, BLOCK_R, HAS1, FROM_FP8
            )
            if DB_PART is not None:
                db1 += dx
        if P2 > 0:
            start = P0 + P1
            dx = _silu_part_backward(
                X, CODES, SCALES, BIAS, G2, DX, rows, row_ok, group, start, width, P2, BLOCK_P, BLOCK_R, HAS2,
                FROM_FP8,
            )  # fmt: skip
            if DB_PART is not None:
                db2 += dx
        if P3 > 0:
            start = P0 + P1 + P2
            dx = _silu_part_backward(
                X, CODES, SCALES, BIAS, G3, DX, rows, row_ok, group, start, width, P3, BLOCK_P, BLOCK_R, HAS3,
                FROM_FP8,
            )  # fmt: skip
            if DB_PART is not None:
                db3 += dx
    if DB_PART is not None:
        base = DB_PART + (pid * groups + group) * width
        _store_bias_part(base, db0, 0, P0, BLOCK_P)
        if P1 > 0:
            _store_bias_part(base, db1, P0, P1, BLOCK_P)
        if P2 > 0:
            _store_bias_part(base, db2, P0 + P1, P2, BLOCK_P)
        if P3 > 0:
            _store_bias_part(base, db3, P0 + P1 + P2, P3, BLOCK_P)


@triton.jit
def _normalize(x, row_ok, col_ok, N: tl.constexpr, eps, LAYER: tl.constexpr):
    """``(x - mean) * rstd`` of fp32 rows (zeros in padding columns), with ``mean`` (0 for RMSNorm) and ``rstd``."""
    x = tl.where(row_ok[:, None] & col_ok[None, :], x, 0.0)
    if LAYER:
        mean = tl.sum(x, axis=1) / N
        x = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    else:
        mean = tl.zeros_like(tl.sum(x, axis=1))
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    return x * rstd[:, None], mean, rstd


@triton.jit(do_not_specialize=["num_rows"])
def _norm_mul_fwd_kernel(
    X, GATE, WEIGHT, BIAS, Y, MEAN, RSTD,  # [R, N], [R, N] or None, [N], [N], [R, N], [R], [R]
    CODES, SCALES,  # SAVE_FP8: x's MX copy, [R, N] bytes and [R, N / 32] biased exponents
    num_rows, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, LAYER: tl.constexpr,
    SAVE_FP8: tl.constexpr = False, EXACT: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if SAVE_FP8:
        _store_mx_tile(CODES, SCALES, x, rows, row_ok, 0, N, N, BLOCK_R, BLOCK_N, EXACT)
    xhat, mean, rstd = _normalize(x, row_ok, col_ok, N, eps, LAYER)
    y = xhat
    if WEIGHT is not None:
        y = y * tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if BIAS is not None:
        y = y + tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATE is not None:
        y = y * tl.load(GATE + offsets, mask=mask).to(tl.float32)
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    if LAYER:
        tl.store(MEAN + rows, mean, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_tiles"])
def _norm_mul_bwd_kernel(
    GRAD, X, GATE, WEIGHT, BIAS, MEAN, RSTD, DX, DGATE, DW_PART, DB_PART,  # [R, N] x 3, [N] x 2, [R] x 2, [R, N] x 2,
    DRES,  # [G, N] x 2 (G programs; GATE and DGATE None without a gate); [R, N] or None
    CODES, SCALES,  # FROM_FP8: x's MX copy, read instead of X
    num_rows, num_tiles,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, LAYER: tl.constexpr, FROM_FP8: tl.constexpr = False,
):  # fmt: skip
    """Persistent programs over row tiles: each accumulates its share of the weight's (and bias's) gradient in
    registers and writes it once, to row ``program_id`` of ``DW_PART`` (``DB_PART``); the launcher sums them.
    ``DRES``: a gradient of ``x`` from elsewhere (a residual branch), added into ``dx`` as it is written."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if WEIGHT is not None:
        w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
    if BIAS is not None:
        b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        x = _x_tile(X, CODES, SCALES, rows, row_ok, 0, N, N, BLOCK_R, BLOCK_N, FROM_FP8)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if LAYER:
            x = x - tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, x * rstd[:, None], 0.0)
        dnormed = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
        if GATE is not None:
            gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
            normed = xhat
            if WEIGHT is not None:
                normed = normed * w[None, :]
            if BIAS is not None:
                normed = normed + b[None, :]
            tl.store(DGATE + offsets, (dnormed * normed).to(DGATE.dtype.element_ty), mask=mask)
            dnormed = dnormed * gate
        dw += tl.sum(dnormed * xhat, axis=0)
        db += tl.sum(dnormed, axis=0)
        dxhat = dnormed * w[None, :] if WEIGHT is not None else dnormed
        dx = dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / N)[:, None]
        if LAYER:
            dx = dx - (tl.sum(dxhat, axis=1) / N)[:, None]
        dx = dx * rstd[:, None]
        if DRES is not None:
            dx += tl.load(DRES + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    if WEIGHT is not None:
        tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
    if BIAS is not None:
        tl.store(DB_PART + pid * N + cols, db, mask=col_ok)


def _tile_rows(block_cols: int, max_rows: int = 64, elements: int = _ELEMENTS) -> int:
    """Rows a program takes so a tile holds about ``elements`` values (all powers of two)."""
    return max(1, min(max_rows, elements // block_cols))


def _split_launch(sizes: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """``(BLOCK_P, BLOCK_R, sizes padded to four with zeros)`` of the SiLU-split kernels."""
    block_p = next_power_of_2(max(sizes))
    return block_p, _tile_rows(block_p), (*sizes, 0, 0, 0)[:4]


def _bias_groups(x_RW: Tensor, bias: Tensor | None) -> int:
    """Bias rows (1 without a bias): row ``r`` of ``x`` takes bias row ``r % groups``."""
    return 1 if bias is None else bias.numel() // x_RW.shape[-1]


class MXRows(NamedTuple):
    """A ``[..., W]`` tensor's MX copy along its rows (``W`` a multiple of 32): E4M3 codes ``[..., W]``, one biased
    E8M0 scale (uint8; ``0xFF`` NaN) per 32 of a row ``[..., W / 32]`` (RCEIL: no value saturates), and the
    tensor's dtype. The SiLU-split kernels write it beside their parts and read it in place of the tensor."""

    codes: Tensor
    scales: Tensor
    dtype: torch.dtype

    @classmethod
    def empty_for(cls, x: Tensor) -> MXRows:
        """An unwritten copy of ``x``'s shape and dtype."""
        scales = x.new_empty(*x.shape[:-1], x.shape[-1] // 32, dtype=torch.uint8)
        return cls(torch.empty_like(x, dtype=torch.float8_e4m3fn), scales, x.dtype)


def _mx_args(copy: MXRows | None, placeholder: Tensor) -> tuple[Tensor, Tensor]:
    """The ``CODES, SCALES`` kernel arguments of ``copy`` (codes as bytes), or ``placeholder`` twice without one."""
    return (copy.codes.view(torch.uint8), copy.scales) if copy is not None else (placeholder, placeholder)


_EXACT = is_interpreted(_silu_split_fwd_kernel)  # the interpreter's E4M3 cast is wrong: round in fp32 first


def silu_split_forward(
    x_RW: Tensor | MXRows, sizes: tuple[int, ...], bias: Tensor | None = None, *, save_fp8: bool = False
) -> tuple[Tensor, ...]:
    """``SiLU(x + bias)`` of a contiguous ``[..., W]`` tensor (``R`` rows of ``W``) split into ``len(sizes)`` (1 to 4)
    contiguous ``[..., P]`` parts of ``sizes`` columns. ``bias``: None, or a contiguous ``[G, W]`` (or ``[W]``) whose
    rows repeat down ``x``'s rows (``x`` viewed as ``[R / G, G, W]``). ``x`` may be an :class:`MXRows` copy (read in
    its place, the parts in its dtype); ``save_fp8``: return ``(*parts, MXRows of x)``, the copy from the same read.
    Both need every part's size a multiple of 32."""
    from_fp8 = isinstance(x_RW, MXRows)
    source = x_RW.codes if from_fp8 else x_RW
    dtype = x_RW.dtype if from_fp8 else source.dtype
    if (from_fp8 or save_fp8) and any(p % 32 for p in sizes):
        raise ValueError(f"an MX copy needs parts of multiples of 32 columns, got {sizes}")
    num_rows = source.numel() // source.shape[-1]
    lead = source.shape[:-1]
    parts = tuple(source.new_empty(*lead, p, dtype=dtype) for p in sizes)
    copy = MXRows.empty_for(source) if save_fp8 else None
    if num_rows:
        block_p, block_r, padded = _split_launch(sizes)
        outs = (*parts, source, source, source)[:4]  # a missing part is never written (its size is 0)
        codes, scales = _mx_args(x_RW if from_fp8 else copy, source)
        args = (source, bias, *outs, codes, scales, num_rows, _bias_groups(source, bias), *padded, block_p, block_r)
        meta = {"SAVE_FP8": save_fp8, "FROM_FP8": from_fp8, "EXACT": _EXACT, "num_warps": 4}
        launch(_silu_split_fwd_kernel, (cdiv(num_rows, block_r),), args, meta)
    return parts if copy is None else (*parts, copy)


def silu_split_backward(
    x_RW: Tensor | MXRows, grads: tuple[Tensor | None, ...], sizes: tuple[int, ...], bias: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """``(dX in x's shape, dbias in bias's shape or None)``: each part's gradient (None: zeros) times ``SiLU'`` of
    its columns of ``x + bias``; the bias's gradient summed by the same pass (fp32 partial sums per program). ``x``
    may be an :class:`MXRows` copy, read in its place (``dX`` in its dtype)."""
    from_fp8 = isinstance(x_RW, MXRows)
    source = x_RW.codes if from_fp8 else x_RW
    width = source.shape[-1]
    num_rows = source.numel() // width
    groups = _bias_groups(source, bias)
    dx = torch.empty(source.shape, dtype=x_RW.dtype if from_fp8 else source.dtype, device=source.device)
    if num_rows == 0:
        return dx, None if bias is None else torch.zeros_like(bias)
    block_p, block_r, padded = _split_launch(sizes)
    has = tuple(g is not None for g in grads) + (False,) * (4 - len(grads))
    gs = tuple(g.contiguous() if g is not None else dx for g in (*grads, None, None, None)[:4])
    if bias is None:  # a program a tile
        num_tiles = programs = cdiv(num_rows, block_r)
    else:  # a quarter of the rows (each part's running sums stay in registers) and persistent programs, as many as
        # stay resident: each writes one row of partial sums
        block_r = _tile_rows(block_p, elements=_ELEMENTS // 4)
        num_tiles = cdiv(num_rows // groups, block_r)
        programs = max(1, min(num_tiles, _resident_programs(dx) // groups))
    # With a bias, 8 warps: 6-14% faster than 4 on an H100 at the HSTU layer's shapes (33-37K tokens, parts of 4 x 128
    # to 16 x 128 and 4 x 256; examples/benchmarks/pointwise_tiles.py), where 4 moved 2.1-2.4 of a copy's 3.0 TB/s.
    warps = 4 if bias is None else 8
    db_part = None if bias is None else dx.new_empty(programs, groups, width, dtype=torch.float32)
    codes, scales = _mx_args(x_RW if from_fp8 else None, source)
    args = (
        source, bias, *gs, dx, db_part, codes, scales, num_rows // groups, num_tiles, *padded, block_p, block_r, *has,
    )  # fmt: skip
    launch(_silu_split_bwd_kernel, (programs, groups), args, {"FROM_FP8": from_fp8, "num_warps": warps})
    return dx, None if bias is None else db_part.sum(0).to(bias.dtype).view(bias.shape)


def tile_warps(tile_elements: int) -> int:
    """Warps of a program holding a tile of ``tile_elements`` values: 8 past 4,096 (a few registers a thread)."""
    return 8 if tile_elements > 4096 else 4


def norm_mul_forward(
    x_RN: Tensor,
    gate_RN: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    layer: bool,
    out_dtype: torch.dtype | None = None,
    *,
    save_fp8: bool = False,
) -> tuple[Tensor, ...]:
    """``(norm(x) * gate, mean [R] fp32 (empty for RMSNorm), rstd [R] fp32)`` of contiguous ``[..., N]`` tensors
    (``R`` rows of ``N``); ``norm(x)`` alone without a gate, in ``out_dtype`` (None: ``x``'s). ``save_fp8``: an
    :class:`MXRows` copy of ``x`` from the same read comes fourth (``N`` a multiple of 32)."""
    n = x_RN.shape[-1]
    if save_fp8 and n % 32:
        raise ValueError(f"an MX copy needs rows of a multiple of 32 columns, got {n}")
    num_rows = x_RN.numel() // n
    y = torch.empty_like(x_RN, dtype=out_dtype)
    rstd = x_RN.new_empty(num_rows, dtype=torch.float32)
    mean = x_RN.new_empty(num_rows if layer else 0, dtype=torch.float32)
    copy = MXRows.empty_for(x_RN) if save_fp8 else None
    if num_rows:
        block_n = next_power_of_2(n)
        block_r = _tile_rows(block_n)
        codes, scales = _mx_args(copy, x_RN)
        args = (
            x_RN, gate_RN, weight, bias, y, mean if layer else rstd, rstd, codes, scales, num_rows, eps, n, block_n,
            block_r, layer,
        )  # fmt: skip
        meta = {"SAVE_FP8": save_fp8, "EXACT": _EXACT, "num_warps": tile_warps(block_n * block_r)}
        launch(_norm_mul_fwd_kernel, (cdiv(num_rows, block_r),), args, meta)
    return (y, mean, rstd) if copy is None else (y, mean, rstd, copy)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _resident_programs(x: Tensor, per_sm: int = 4) -> int:
    """Persistent programs of a launch on ``x``'s device: ``per_sm`` an SM (``per_sm`` in Triton's interpreter)."""
    return per_sm * _num_sms(x.device.index or 0) if x.device.type == "cuda" else per_sm


def norm_mul_backward(
    grad_RN: Tensor,
    x_RN: Tensor | MXRows,
    gate_RN: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    layer: bool,
    grad_residual: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dgate, dweight, dbias)`` of :func:`norm_mul_forward` (``dx`` in ``x``'s dtype whatever ``grad``'s; the
    last three None without a gate / weight / bias). ``grad_residual`` (``x``'s shape): added into ``dx`` by the same
    kernel, as a gradient of ``x`` from another branch. ``x`` may be an :class:`MXRows` copy, read in its place."""
    copy = x_RN if isinstance(x_RN, MXRows) else None
    if copy is not None:
        x_RN = copy.codes
    n = x_RN.shape[-1]
    num_rows = x_RN.numel() // n
    dx = torch.empty_like(x_RN, dtype=copy.dtype if copy is not None else x_RN.dtype)
    dgate = None if gate_RN is None else torch.empty_like(gate_RN)
    block_n = next_power_of_2(n)
    block_r = _tile_rows(block_n, max_rows=32)
    num_tiles = cdiv(num_rows, block_r)
    # Two persistent programs an SM, not four: half the rows of partial sums to write and add up. Timed on an H100
    # (examples/benchmarks/pointwise_tiles.py, docs/benchmarks.md "Pointwise kernels"): as fast or faster (to 1.29x) on
    # 33-37K rows of 512 to 2,048 columns, gated and with the residual's gradient; rows of one head (128-256
    # columns, the per-head attention norm) were not in that sweep.
    programs = max(1, min(num_tiles, _resident_programs(x_RN, per_sm=2)))
    if num_rows == 0:
        return dx, dgate, None if weight is None else weight.new_zeros(n), None if bias is None else bias.new_zeros(n)
    if grad_residual is not None:
        grad_residual = grad_residual.contiguous()
    # Every program writes its whole row of partial sums (zeros where it met no tile).
    dw_part = x_RN.new_empty(programs, n, dtype=torch.float32) if weight is not None else None
    db_part = x_RN.new_empty(programs, n, dtype=torch.float32) if bias is not None else None
    codes, scales = _mx_args(copy, x_RN)
    args = (
        grad_RN.contiguous(), x_RN, gate_RN, weight, bias, mean if layer else rstd, rstd, dx, dgate, dw_part, db_part,
        grad_residual, codes, scales, num_rows, num_tiles, n, block_n, block_r, layer,
    )  # fmt: skip
    meta = {"FROM_FP8": copy is not None, "num_warps": tile_warps(block_n * block_r)}
    launch(_norm_mul_bwd_kernel, (programs,), args, meta)
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dgate, dw, db
