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

from lightning_gem.ops.attention.fp8 import E4M3, FP8Operands, pow2_scale, value_columns, value_offsets
from lightning_gem.ops.attention.impl.triton._common import E4M3_GRID_FIRST, _e4m3_grid, cdiv, launch, next_power_of_2

__all__ = ["quantize_fp8_triton"]

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
def _rows_kernel(
    X, CODES, SCALE, NORM,  # [T, H, D] input, [T, H, D] e4m3, [H, T] fp32, [B, H] fp32 (zeros in, maxima out)
    OFFSETS, stride_xt, stride_xh, stride_scale_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, WITH_NORM: tl.constexpr,
):  # fmt: skip
    """Codes of ``BLOCK_T`` rows of one segment and head with one scale a row; ``WITH_NORM``: the segment's largest
    dequantized row norm into ``NORM``."""
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(1)
    start = tl.load(OFFSETS + seg).to(tl.int64)
    length = (tl.load(OFFSETS + seg + 1) - start).to(tl.int32)
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start + offs_t
    ok = (offs_t < length)[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(X + rows[:, None] * stride_xt + head * stride_xh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    scale_T = _pow2_scale(tl.max(tl.abs(x), axis=1))
    codes = _codes(x, scale_T[:, None])
    tl.store(CODES + rows[:, None] * stride_xt + head * stride_xh + offs_d[None, :], codes, mask=ok)
    tl.store(SCALE + head * stride_scale_h + rows, scale_T, mask=offs_t < length)
    if WITH_NORM:
        c = codes.to(tl.float32)
        norm_T = tl.sqrt(tl.sum(c * c, axis=1)) * scale_T
        tl.atomic_max(NORM + seg * heads + head, tl.max(tl.where(offs_t < length, norm_T, 0.0), axis=0), sem="relaxed")


@triton.jit
def _value_amax_kernel(
    V, AMAX,  # [T, H, DV], [B, H, DV] fp32 (zeros in, maxima out)
    OFFSETS, stride_vt, stride_vh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """The largest ``|v|`` of each channel over ``BLOCK_T`` tokens of one segment and head, into the segment's."""
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(1)
    start = tl.load(OFFSETS + seg).to(tl.int64)
    length = (tl.load(OFFSETS + seg + 1) - start).to(tl.int32)
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_t < length)[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    v = tl.load(V + (start + offs_t)[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=ok, other=0.0)
    amax_D = tl.max(tl.abs(v.to(tl.float32)), axis=0)
    tl.atomic_max(AMAX + (seg * heads + head) * HEAD_DIM_V + offs_d, amax_D, mask=offs_d < HEAD_DIM_V, sem="relaxed")


@triton.jit
def _value_codes_kernel(
    V, AMAX, V_T,  # [T, H, DV], [B, H, DV] fp32 maxima, [H, DV, columns] e4m3
    OFFSETS, V_OFFSETS, stride_vt, stride_vh, stride_th, stride_td,  # V_OFFSETS: the segments' first columns
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Codes of ``BLOCK_T`` tokens of one segment and head, written transposed (tokens contiguous), each channel's
    scale computed from the segment's maximum (the launcher turns the maxima into the scales after)."""
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(1)
    start = tl.load(OFFSETS + seg).to(tl.int64)
    length = (tl.load(OFFSETS + seg + 1) - start).to(tl.int32)
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_t < length)[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    v = tl.load(V + (start + offs_t)[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=ok, other=0.0)
    entry = AMAX + (seg * heads + head) * HEAD_DIM_V + offs_d
    scale_D = _pow2_scale(tl.load(entry, mask=offs_d < HEAD_DIM_V, other=0.0))
    codes = _codes(v.to(tl.float32), scale_D[None, :])
    column = tl.multiple_of(tl.load(V_OFFSETS + seg).to(tl.int64), 16)
    tl.store(V_T + head * stride_th + offs_d[None, :] * stride_td + (column + offs_t)[:, None], codes, mask=ok)


def quantize_fp8_triton(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                        max_seq_len_q: int, max_seq_len_kv: int) -> FP8Operands:  # fmt: skip
    """:func:`lightning_gem.ops.attention.fp8.quantize_fp8` on the GPU (or in the interpreter), the same bits.
    ``q``, ``k``, ``v`` need a unit stride in their last dim; the length hints size the grids."""
    num_q, heads, dim = q.shape
    num_kv, dim_v = k.shape[0], v.shape[2]
    num_segments, num_kv_segments = q_offsets.shape[0] - 1, kv_offsets.shape[0] - 1
    block_d, block_dv = max(16, next_power_of_2(dim)), max(16, next_power_of_2(dim_v))
    q8 = torch.empty(q.shape, dtype=E4M3, device=q.device)
    k8 = torch.empty(k.shape, dtype=E4M3, device=k.device)
    # Validated offsets put every row in one segment: the kernels write every code and row scale.
    q_scale = torch.empty(heads, num_q, dtype=torch.float32, device=q.device)
    k_scale = torch.empty(heads, num_kv, dtype=torch.float32, device=k.device)
    k_norm = torch.zeros(num_kv_segments, heads, dtype=torch.float32, device=k.device)
    v_scale = torch.zeros(num_kv_segments, heads, dim_v, dtype=torch.float32, device=v.device)
    v_offsets = value_offsets(kv_offsets)
    v_t = torch.zeros(heads, dim_v, value_columns(num_kv, num_kv_segments), dtype=E4M3, device=v.device)
    if num_q and num_segments and heads:
        grid = (num_segments, heads, max(1, cdiv(max_seq_len_q, BLOCK_T)))
        launch(_rows_kernel, grid, (q, q8, q_scale, k_norm, q_offsets, q.stride(0), q.stride(1), num_q),
               {"HEAD_DIM": dim, "BLOCK_D": block_d, "BLOCK_T": BLOCK_T, "WITH_NORM": False})  # fmt: skip
    if num_kv and num_kv_segments and heads:
        grid = (num_kv_segments, heads, max(1, cdiv(max_seq_len_kv, BLOCK_T)))
        launch(_rows_kernel, grid, (k, k8, k_scale, k_norm, kv_offsets, k.stride(0), k.stride(1), num_kv),
               {"HEAD_DIM": dim, "BLOCK_D": block_d, "BLOCK_T": BLOCK_T, "WITH_NORM": True})  # fmt: skip
        value_meta = {"HEAD_DIM_V": dim_v, "BLOCK_DV": block_dv, "BLOCK_T": BLOCK_T}
        launch(_value_amax_kernel, grid, (v, v_scale, kv_offsets, v.stride(0), v.stride(1)), value_meta)
        launch(_value_codes_kernel, grid, (v, v_scale, v_t, kv_offsets, v_offsets, v.stride(0), v.stride(1),
                                           v_t.stride(0), v_t.stride(1)), value_meta)  # fmt: skip
    v_scale.copy_(pow2_scale(v_scale))  # the maxima the codes were made from, as their scales
    return FP8Operands(q8, q_scale, k8, k_scale, v_t, v_offsets, v_scale, k_norm)
