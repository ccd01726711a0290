"""GDPA's FP8 operands in Triton: the codes and scales of :func:`lightning_gem.ops.attention.fp8.quantize_fp8`, bit
for bit, in four launches that read each input once for its codes (v twice: its scales span a whole segment).

One program per (segment, head, block of ``BLOCK_T`` tokens), as the attention kernels walk jagged tensors, so a
program's tokens share their segment: its partial maxima go to the segment's entries with one atomic maximum per
entry (non-negative floats order as their bits, which Triton's float atomic maximum relies on), never one per token.
Legend: ``T`` tokens, ``H`` heads, ``D`` head dim, ``B`` segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops.attention.fp8 import E4M3, FP8Operands, value_columns, value_offsets
from lightning_gem.ops.attention.impl.triton._common import E4M3_GRID_FIRST, _e4m3_grid, cdiv, launch, next_power_of_2

__all__ = ["quantize_fp8_triton", "quantize_rows_triton"]

BLOCK_T = 64


@triton.jit
def _pow2_scale(amax):
    """:func:`lightning_gem.ops.attention.fp8.pow2_scale` of ``amax`` (fp32, non-negative), from its bits."""
    bits = amax.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 0xFF
    exponent = tl.where((bits & 0x7FFFFF) > 0x600000, field - 7, field - 8)
    ok = (field > 0) & (field < 0xFF) & (exponent > 0)
    return (tl.where(ok, exponent, 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _codes(x, scale):
    """``x / scale`` (a power of two: exact) as E4M3, rounded to nearest even."""
    y = x * (1.0 / scale)
    if E4M3_GRID_FIRST:  # the interpreter's own rounding carries wrongly (see _common.E4M3_GRID_FIRST)
        y = _e4m3_grid(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _tile_range(length, NUM_COLS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's ``BLOCK_T`` rows of a segment of ``length`` (from axis 2), its ``BLOCK_C`` columns, and which
    of them are in range (``ok``). Takes no pointer: the kernels load ``length`` and address their stores with
    these."""
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    return offs_t, offs_c, (offs_t < length)[:, None] & (offs_c < NUM_COLS)[None, :]


@triton.jit
def _tile(X, rows, head, offs_c, ok, stride_xt, stride_xh):
    """The ``[BLOCK_T, BLOCK_C]`` tile of ``X`` at token rows ``rows`` and columns ``offs_c`` of ``head``, in fp32
    (zeros where not ``ok``). Only loaded values come out: the rows and columns a kernel stores at are its own (a
    store addressed by a called function's result counts all of its arguments as written in ``torch.compile``'s
    analysis; see :func:`._common._program_ids`)."""
    x = tl.load(X + rows[:, None] * stride_xt + head * stride_xh + offs_c[None, :], mask=ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _rows_kernel(
    X, CODES, SCALE, NORM,  # [T, H, D] input, [T, H, D] e4m3, [H, T] fp32, [B, H] fp32 (zeros in, maxima out)
    OFFSETS, stride_xt, stride_xh, stride_ct, stride_ch, stride_scale_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, WITH_NORM: tl.constexpr,
):  # fmt: skip
    """Codes of ``BLOCK_T`` rows of one segment and head with one scale a row; ``WITH_NORM``: the segment's largest
    dequantized row norm into ``NORM``."""
    seg = tl.program_id(0)
    start = tl.load(OFFSETS + seg).to(tl.int64)
    length = (tl.load(OFFSETS + seg + 1) - start).to(tl.int32)
    if tl.program_id(2) * BLOCK_T >= length:
        return
    head, heads = tl.program_id(1).to(tl.int64), tl.num_programs(1)
    offs_t, offs_d, ok = _tile_range(length, HEAD_DIM, BLOCK_D, BLOCK_T)
    rows = start + offs_t
    x = _tile(X, rows, head, offs_d, ok, stride_xt, stride_xh)
    scale_T = _pow2_scale(tl.max(tl.abs(x), axis=1))
    codes = _codes(x, scale_T[:, None])
    tl.store(CODES + rows[:, None] * stride_ct + head * stride_ch + offs_d[None, :], codes, mask=ok)
    tl.store(SCALE + head * stride_scale_h + rows, scale_T, mask=offs_t < length)
    if WITH_NORM:
        c = codes.to(tl.float32)
        norm_T = tl.sqrt(tl.sum(c * c, axis=1)) * scale_T
        tl.atomic_max(NORM + seg * heads + head, tl.max(tl.where(offs_t < length, norm_T, 0.0), axis=0), sem="relaxed")


@triton.jit
def _values_kernel(
    V, AMAX, V_T, V_SCALE,  # [T, H, DV], [B, H, DV] fp32 (zeros in, maxima out), [H, DV, columns] e4m3, like AMAX
    OFFSETS, V_OFFSETS, stride_vt, stride_vh, stride_th, stride_td,  # V_OFFSETS: the segments' first columns
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, WRITE_CODES: tl.constexpr,
):  # fmt: skip
    """``BLOCK_T`` tokens of one segment and head: each channel's largest ``|v|`` into the segment's, or with
    ``WRITE_CODES`` (a second launch, once every maximum is in) their codes on the scales of those maxima, written
    transposed (tokens contiguous), the first block of each segment and head (an empty segment's too: scale 1) also
    writing those scales to ``V_SCALE``."""
    seg = tl.program_id(0)
    start = tl.load(OFFSETS + seg).to(tl.int64)
    length = (tl.load(OFFSETS + seg + 1) - start).to(tl.int32)
    if WRITE_CODES and tl.program_id(2) == 0:
        offs = (seg * tl.num_programs(1) + tl.program_id(1)) * HEAD_DIM_V + tl.arange(0, BLOCK_DV)
        in_row = tl.arange(0, BLOCK_DV) < HEAD_DIM_V
        tl.store(V_SCALE + offs, _pow2_scale(tl.load(AMAX + offs, mask=in_row, other=0.0)), mask=in_row)
    if tl.program_id(2) * BLOCK_T >= length:
        return
    head, heads = tl.program_id(1).to(tl.int64), tl.num_programs(1)
    offs_t, offs_d, ok = _tile_range(length, HEAD_DIM_V, BLOCK_DV, BLOCK_T)
    v = _tile(V, start + offs_t, head, offs_d, ok, stride_vt, stride_vh)
    entry = AMAX + (seg * heads + head) * HEAD_DIM_V + offs_d
    if WRITE_CODES:
        codes = _codes(v, _pow2_scale(tl.load(entry, mask=offs_d < HEAD_DIM_V, other=0.0))[None, :])
        column = tl.multiple_of(tl.load(V_OFFSETS + seg).to(tl.int64), 16)
        tl.store(V_T + head * stride_th + offs_d[None, :] * stride_td + (column + offs_t)[:, None], codes, mask=ok)
    else:
        tl.atomic_max(entry, tl.max(tl.abs(v), axis=0), mask=offs_d < HEAD_DIM_V, sem="relaxed")


def quantize_rows_triton(
    x: Tensor, offsets: Tensor, max_seq_len: int, norm: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`lightning_gem.ops.attention.fp8.quantize_rows` of ``x [T, H, D]`` (unit stride in its last dim; every
    row in a segment of ``offsets``, each at most ``max_seq_len`` long): the same codes ``[T, H, D]`` and scales
    ``[H, T]``. ``norm`` (``[B, H]`` fp32 zeros): also each segment and head's largest dequantized row norm, into it."""
    num_rows, heads, dim = x.shape
    codes = torch.empty(x.shape, dtype=E4M3, device=x.device)
    # Validated offsets put every row in one segment: the kernel writes every code and row scale.
    scale = torch.empty(heads, num_rows, dtype=torch.float32, device=x.device)
    num_segments = offsets.shape[0] - 1
    if num_rows and num_segments and heads:
        grid = (num_segments, heads, max(1, cdiv(max_seq_len, BLOCK_T)))
        meta = {"HEAD_DIM": dim, "BLOCK_D": max(16, next_power_of_2(dim)), "BLOCK_T": BLOCK_T,
                "WITH_NORM": norm is not None}  # fmt: skip
        strides = (x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), num_rows)
        launch(_rows_kernel, grid, (x, codes, scale, scale if norm is None else norm, offsets, *strides), meta)
    return codes, scale


def quantize_fp8_triton(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                        max_seq_len_q: int, max_seq_len_kv: int) -> FP8Operands:  # fmt: skip
    """:func:`lightning_gem.ops.attention.fp8.quantize_fp8` on the GPU (or in the interpreter), the same bits.
    ``q``, ``k``, ``v`` need a unit stride in their last dim; the length hints size the grids."""
    heads = q.shape[1]
    num_kv, dim_v = k.shape[0], v.shape[2]
    num_kv_segments = kv_offsets.shape[0] - 1
    k_norm = torch.zeros(num_kv_segments, heads, dtype=torch.float32, device=k.device)
    q8, q_scale = quantize_rows_triton(q, q_offsets, max_seq_len_q)
    k8, k_scale = quantize_rows_triton(k, kv_offsets, max_seq_len_kv, norm=k_norm)
    v_amax = torch.zeros(num_kv_segments, heads, dim_v, dtype=torch.float32, device=v.device)
    v_offsets = value_offsets(kv_offsets)
    v_t = torch.zeros(heads, dim_v, value_columns(num_kv, num_kv_segments), dtype=E4M3, device=v.device)
    if num_kv and num_kv_segments and heads:
        grid = (num_kv_segments, heads, max(1, cdiv(max_seq_len_kv, BLOCK_T)))
        v_scale = torch.empty_like(v_amax)  # every entry written by the second launch
        values = (v, v_amax, v_t, v_scale, kv_offsets, v_offsets, *v.stride()[:2], *v_t.stride()[:2])
        meta = {"HEAD_DIM_V": dim_v, "BLOCK_DV": max(16, next_power_of_2(dim_v)), "BLOCK_T": BLOCK_T}
        for write_codes in (False, True):  # the maxima, then the codes on their scales
            launch(_values_kernel, grid, values, {**meta, "WRITE_CODES": write_codes})
    else:
        v_scale = torch.ones_like(v_amax)  # no key: every segment's scale is that of a zero maximum
    return FP8Operands(q8, q_scale, k8, k_scale, v_t, v_offsets, v_scale, k_norm)
