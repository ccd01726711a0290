"""GDPA backward in Triton: a dK/dV kernel (one program per kv segment, head and key block) and a dQ kernel
(one program per query segment, head and query block). No atomics: every output row has one writer.

Legend: ``T`` tokens, ``H`` heads, ``D`` / ``DV`` head dims, ``M`` / ``N`` a query / key block.

With ``S = scale Q K^T`` and ``O = P V``: ``dV = P^T dO``, ``dP = dO V^T``; softmax
``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` precomputed and ``P`` rebuilt from the saved
log-sum-exp; pointwise ``dS = mask * act'(S) * dP / Lk``; then ``dQ = scale dS K``, ``dK = scale dS^T Q``.

kv sharing (``kv_index``): a kv segment's dK/dV program loops over the query segments that map to it,
listed by a CSR built on the device without a sync (``seg_offsets`` / ``seg_order``), so contributions add
up in registers, deterministically, instead of through fp32 atomics. Per query segment it visits only the
query rows whose key range meets its key block (``_query_range``), and target keys take their one query
(the target itself) as a row-wise product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops.attention.impl.triton._common import (
    LOG2E,
    Tiles,
    _activation,
    _activation_grad,
    _history_mask,
    _history_range,
    _kv_segment,
    _position,
    _query_range,
    default_tiles,
    dot_precision,
    launch,
)

__all__ = ["gdpa_backward"]


@triton.jit
def _gdpa_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like k, v
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,  # [B + 1], [Bkv + 1], [B], [Bkv + 1], [B]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, window, block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    kv_seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    n_start = tl.program_id(2) * BLOCK_N
    k_start = tl.load(KV_OFFSETS + kv_seg).to(tl.int64)
    len_k = (tl.load(KV_OFFSETS + kv_seg + 1) - k_start).to(tl.int32)
    if n_start >= len_k:
        return
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_k
    k_ND = tl.load(
        K + (k_start + offs_n)[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
        mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    v_NDV = tl.load(
        V + (k_start + offs_n)[:, None] * stride_vt + head * stride_vh + offs_dv[None, :],
        mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        other=0.0,
    )
    dk_ND = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_NDV = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    inv_len_k = 1.0 / len_k.to(tl.float32)

    first, end = kv_seg, kv_seg + 1
    if HAS_KV_INDEX:
        first = tl.load(SEG_OFFSETS + kv_seg).to(tl.int32)
        end = tl.load(SEG_OFFSETS + kv_seg + 1).to(tl.int32)
    for idx in range(first, end):
        seg = idx
        if HAS_KV_INDEX:
            seg = tl.load(SEG_ORDER + idx)
        q_start = tl.load(Q_OFFSETS + seg).to(tl.int64)
        len_q = (tl.load(Q_OFFSETS + seg + 1) - q_start).to(tl.int32)
        num_history = len_k
        if HAS_TARGETS:
            num_history = len_k - tl.load(NUM_TARGETS + seg).to(tl.int32)
        shift = len_k - len_q
        q_base = Q + q_start * stride_qt + head * stride_qh
        do_base = DO + q_start * stride_dot + head * stride_doh
        lse_base = LSE + head * stride_lse_h + q_start
        delta_base = DELTA + head * stride_lse_h + q_start

        i_lo, i_hi = _query_range(
            n_start, tl.minimum(n_start + BLOCK_N, num_history), len_q, shift, num_history, window, block_size,
            CAUSAL, HAS_WINDOW, HAS_BLOCK,
        )  # fmt: skip
        for m_start in range(i_lo, i_hi, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < i_hi
            q_MD = tl.load(
                q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )
            do_MDV = tl.load(
                do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
                mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0,
            )
            qk_NM = tl.dot(k_ND, tl.trans(q_MD), input_precision=DOT_PRECISION)
            allowed_NM = row_ok[None, :] & _history_mask(
                _position(offs_m, shift, num_history)[None, :], offs_n[:, None], num_history, window, block_size,
                CAUSAL, HAS_WINDOW, HAS_BLOCK,
            )  # fmt: skip
            dp_NM = tl.dot(v_NDV, tl.trans(do_MDV), input_precision=DOT_PRECISION)
            if ACTIVATION == "softmax":
                lse_M = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
                delta_M = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
                p_NM = tl.where(allowed_NM, tl.exp2(qk_NM * (scale * LOG2E) - lse_M[None, :]), 0.0)
                ds_NM = p_NM * (dp_NM - delta_M[None, :])
            else:
                s_NM = qk_NM * scale
                p_NM = tl.where(allowed_NM, _activation(s_NM, ACTIVATION) * inv_len_k, 0.0)
                ds_NM = tl.where(allowed_NM, _activation_grad(s_NM, ACTIVATION) * dp_NM * inv_len_k, 0.0)
            dv_NDV = tl.dot(p_NM.to(do_MDV.dtype), do_MDV, dv_NDV, input_precision=DOT_PRECISION)
            dk_ND = tl.dot(ds_NM.to(q_MD.dtype), q_MD, dk_ND, input_precision=DOT_PRECISION)

        if HAS_TARGETS:  # a target key t is seen by one query only: the target itself, row t of the segment
            own = col_ok & (shift == 0) & (offs_n >= num_history)
            q_own_ND = tl.load(
                q_base + offs_n[:, None] * stride_qt + offs_d[None, :],
                mask=own[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            ).to(tl.float32)
            do_own_NDV = tl.load(
                do_base + offs_n[:, None] * stride_dot + offs_dv[None, :],
                mask=own[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0,
            ).to(tl.float32)
            qk_N = tl.sum(k_ND.to(tl.float32) * q_own_ND, axis=1)
            dp_N = tl.sum(v_NDV.to(tl.float32) * do_own_NDV, axis=1)
            if ACTIVATION == "softmax":
                lse_N = tl.load(lse_base + offs_n, mask=own, other=float("inf"))
                delta_N = tl.load(delta_base + offs_n, mask=own, other=0.0)
                p_N = tl.where(own, tl.exp2(qk_N * (scale * LOG2E) - lse_N), 0.0)
                ds_N = p_N * (dp_N - delta_N)
            else:
                p_N = tl.where(own, _activation(qk_N * scale, ACTIVATION) * inv_len_k, 0.0)
                ds_N = tl.where(own, _activation_grad(qk_N * scale, ACTIVATION) * dp_N * inv_len_k, 0.0)
            dv_NDV += p_N[:, None] * do_own_NDV
            dk_ND += ds_N[:, None] * q_own_ND

    tl.store(
        DK + (k_start + offs_n)[:, None] * stride_dkt + head * stride_dkh + offs_d[None, :],
        (dk_ND * scale).to(DK.dtype.element_ty),
        mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(
        DV + (k_start + offs_n)[:, None] * stride_dvt + head * stride_dvh + offs_dv[None, :],
        dv_NDV.to(DV.dtype.element_ty),
        mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
    )


@triton.jit
def _gdpa_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like q
    Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,  # [B + 1], [Bkv + 1], [B], [B]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dqt, stride_dqh,
    scale, window, block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(Q_OFFSETS + seg).to(tl.int64)
    len_q = (tl.load(Q_OFFSETS + seg + 1) - q_start).to(tl.int32)
    if m_start >= len_q:
        return
    k_start, len_k, num_history, shift = _kv_segment(
        seg, len_q, KV_OFFSETS, KV_INDEX, NUM_TARGETS, HAS_KV_INDEX, HAS_TARGETS
    )
    inv_len_k = 1.0 / tl.maximum(len_k, 1).to(tl.float32)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    pos_m = _position(offs_m, shift, num_history)
    q_MD = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    do_MDV = tl.load(
        DO + (q_start + offs_m)[:, None] * stride_dot + head * stride_doh + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        other=0.0,
    )
    if ACTIVATION == "softmax":
        lse_M = tl.load(LSE + head * stride_lse_h + q_start + offs_m, mask=row_ok, other=float("inf"))
        delta_M = tl.load(DELTA + head * stride_lse_h + q_start + offs_m, mask=row_ok, other=0.0)
    k_base = K + k_start * stride_kt + head * stride_kh
    v_base = V + k_start * stride_vt + head * stride_vh
    dq_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    last_row = tl.minimum(m_start + BLOCK_M, len_q) - 1
    lo, _ = _history_range(
        _position(m_start, shift, num_history), num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
    )
    _, hi = _history_range(
        _position(last_row, shift, num_history), num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
    )
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        k_ND = tl.load(
            k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
            mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        v_NDV = tl.load(
            v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )
        qk_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=DOT_PRECISION)
        allowed_MN = row_ok[:, None] & _history_mask(
            pos_m[:, None], offs_n[None, :], num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        dp_MN = tl.dot(do_MDV, tl.trans(v_NDV), input_precision=DOT_PRECISION)
        if ACTIVATION == "softmax":
            p_MN = tl.where(allowed_MN, tl.exp2(qk_MN * (scale * LOG2E) - lse_M[:, None]), 0.0)
            ds_MN = p_MN * (dp_MN - delta_M[:, None])
        else:
            s_MN = qk_MN * scale
            ds_MN = tl.where(allowed_MN, _activation_grad(s_MN, ACTIVATION) * dp_MN * inv_len_k, 0.0)
        dq_MD = tl.dot(ds_MN.to(k_ND.dtype), k_ND, dq_MD, input_precision=DOT_PRECISION)

    if HAS_TARGETS:  # a target query's own key: a row-wise product
        own = row_ok & (shift == 0) & (offs_m >= num_history)
        k_own_MD = tl.load(
            k_base + offs_m[:, None] * stride_kt + offs_d[None, :],
            mask=own[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        ).to(tl.float32)
        v_own_MDV = tl.load(
            v_base + offs_m[:, None] * stride_vt + offs_dv[None, :],
            mask=own[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        ).to(tl.float32)
        qk_M = tl.sum(q_MD.to(tl.float32) * k_own_MD, axis=1)
        dp_M = tl.sum(do_MDV.to(tl.float32) * v_own_MDV, axis=1)
        if ACTIVATION == "softmax":
            p_M = tl.where(own, tl.exp2(qk_M * (scale * LOG2E) - lse_M), 0.0)
            ds_M = p_M * (dp_M - delta_M)
        else:
            ds_M = tl.where(own, _activation_grad(qk_M * scale, ACTIVATION) * dp_M * inv_len_k, 0.0)
        dq_MD += ds_M[:, None] * k_own_MD

    tl.store(
        DQ + (q_start + offs_m)[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
        (dq_MD * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


def _tile_meta(tiles: Tiles) -> dict[str, int]:
    return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "num_warps": tiles.num_warps}


def _segments_by_kv(kv_index: Tensor, num_kv_segments: int) -> tuple[Tensor, Tensor]:
    """CSR of the query segments of each kv segment: ``seg_offsets [Bkv + 1]``, ``seg_order [B]``. No sync."""
    index = kv_index.to(torch.int64)
    order = torch.argsort(index, stable=True)
    counts = torch.zeros(num_kv_segments + 1, dtype=torch.int64, device=index.device)
    counts.index_add_(0, index + 1, torch.ones_like(index))
    return counts.cumsum(0), order


def gdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    *,
    activation: str,
    causal: bool,
    window: int | None,
    block_size: int | None,
    scale: float,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    dkdv_tiles: Tiles | None = None,
    dq_tiles: Tiles | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernels. ``out`` and ``lse`` (from :func:`gdpa_forward`) are needed for softmax
    only; the tiles override :func:`default_tiles`. Returns ``(dq, dk, dv)`` in the inputs' dtypes.
    """
    grad_out, q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad_out, q, k, v))
    num_q, heads, head_dim = q.shape
    head_dim_v = v.shape[2]
    num_segments, num_kv_segments = q_offsets.shape[0] - 1, kv_offsets.shape[0] - 1
    softmax = activation == "softmax"
    if softmax:
        assert out is not None and lse is not None, "softmax backward needs the forward's out and lse"
        delta = (grad_out.to(torch.float32) * out.to(torch.float32)).sum(-1).transpose(0, 1).contiguous()
    else:
        lse = delta = torch.empty(0, 0, dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if num_segments == 0 or heads == 0:
        return dq, dk.zero_(), dv.zero_()
    if kv_index is None:
        seg_offsets = seg_order = q_offsets  # placeholders, never read
    else:
        seg_offsets, seg_order = _segments_by_kv(kv_index, num_kv_segments)
    dkdv_tiles = dkdv_tiles or default_tiles("dkdv", q.dtype, q.device)
    dq_tiles = dq_tiles or default_tiles("dq", q.dtype, q.device)
    meta = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        ACTIVATION=activation, CAUSAL=causal, HAS_WINDOW=window is not None, HAS_BLOCK=block_size is not None,
        HAS_KV_INDEX=kv_index is not None, HAS_TARGETS=num_targets is not None,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    common_strides = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), lse.stride(0) if softmax else 0,
    )  # fmt: skip
    targets = q_offsets if num_targets is None else num_targets  # placeholder when absent
    if k.shape[0] > 0:
        grid = (num_kv_segments, heads, max(1, triton.cdiv(max_seq_len_kv, dkdv_tiles.block_n)))
        args = (
            q, k, v, grad_out, lse, delta, dk, dv,
            q_offsets, kv_offsets, targets, seg_offsets, seg_order,
            *common_strides, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            scale, window or 0, block_size or 1,
        )  # fmt: skip
        launch(_gdpa_bwd_dkdv_kernel, grid, args, {**meta, **_tile_meta(dkdv_tiles)})
    if num_q > 0:
        grid = (num_segments, heads, max(1, triton.cdiv(max_seq_len_q, dq_tiles.block_m)))
        args = (
            q, k, v, grad_out, lse, delta, dq,
            q_offsets, kv_offsets, q_offsets if kv_index is None else kv_index, targets,
            *common_strides, dq.stride(0), dq.stride(1),
            scale, window or 0, block_size or 1,
        )  # fmt: skip
        launch(_gdpa_bwd_dq_kernel, grid, args, {**meta, **_tile_meta(dq_tiles)})
    return dq, dk, dv
