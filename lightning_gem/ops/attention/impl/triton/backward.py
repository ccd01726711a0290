"""GDPA backward in Triton, two kernels: one launch of dK/dV programs (one per kv segment, head and key block)
beside dQ programs (one per query segment, head and query block), so every output row has one writer and
results are bitwise reproducible (at the price of computing ``Q K^T`` and ``dO V^T`` twice); and a dK/dV kernel
that adds dQ into an fp32 buffer through atomics instead. ``deterministic=True`` keeps to the first; otherwise
the tuner times both and keeps the faster for each shape key.

Legend: ``T`` tokens, ``H`` heads, ``D`` / ``DV`` head dims, ``M`` / ``N`` a query / key block.

With ``S = scale Q K^T`` and ``O = P V``: ``dV = P^T dO``, ``dP = dO V^T``; softmax
``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` precomputed and ``P`` rebuilt from the saved
log-sum-exp; pointwise ``dS = mask * act'(S) * dP / Lk``; then ``dQ = scale dS K``, ``dK = scale dS^T Q``.

kv sharing (``kv_index``): a kv segment's dK/dV program loops over the query segments that map to it,
listed by a CSR built on the device without a sync (``seg_offsets`` / ``seg_order``), so contributions add
up in registers, deterministically, instead of through fp32 atomics. Per query segment it visits only the
query rows whose key range meets its key block (``_key_tile_queries``), and target keys take their one query
(the target itself) as a row-wise product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import plain_eager
from lightning_gem.ops.attention.impl.triton._common import (
    LOG2E,
    _activation,
    _activation_grad,
    _dq_key_blocks,
    _history_mask,
    _key_tile_queries,
    _kv_segment,
    _load_tile,
    _position,
    _query_rows,
    _query_tile_keys,
    _stage_range,
    cdiv,
    dense_rows,
    fast_math,
    kernel_options,
    launch,
    mode_flags,
    next_power_of_2,
)
from lightning_gem.ops.attention.impl.triton._tuning import (
    FLASH,
    SHORT_QUERY_ROWS,
    BackwardTiles,
    Tiles,
    backward_candidates,
    length_bucket,
    pick_launch,
    tile_meta,
    work_bucket,
)
from lightning_gem.ops.attention.impl.triton.backward_short import _gdpa_bwd_short_kernel
from lightning_gem.ops.attention.impl.triton.forward import flash_candidate
from lightning_gem.ops.attention.spec import Spec

__all__ = ["gdpa_backward"]

# What a dK/dV program accumulates (``PART``).
BOTH = tl.constexpr(0)
DV_ONLY = tl.constexpr(1)
DK_ONLY = tl.constexpr(2)


@triton.jit(do_not_specialize=["num_rows"])  # a per-batch count: no recompile when it changes
def _bwd_delta_kernel(
    OUT, DO, DELTA,  # [Tq, H, DV] x2, [H, Tq] fp32
    num_rows, stride_ot, stride_oh, stride_dot, stride_doh, stride_delta_h,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """``delta[h, t] = sum_d dO[t, h, d] * O[t, h, d]`` in fp32."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_t < num_rows
    o_TDV = _load_tile(OUT + head * stride_oh, offs_t, stride_ot, offs_dv, rows_ok, HEAD_DIM_V, BLOCK_DV, True)
    do_TDV = _load_tile(DO + head * stride_doh, offs_t, stride_dot, offs_dv, rows_ok, HEAD_DIM_V, BLOCK_DV, True)
    delta_T = tl.sum(o_TDV.to(tl.float32) * do_TDV.to(tl.float32), axis=1)
    tl.store(DELTA + head * stride_delta_h + offs_t, delta_T, mask=rows_ok)


@triton.jit
def _dkdv_query_blocks(
    dk_ND, dv_NDV, k_ND, v_NDV, offs_n, q_base, do_base, lse_base, delta_base, dq_base, dq_desc, dq_row, dq_col,
    stride_qt, stride_dot, stride_dqt, m_lo, m_hi, row_end, shift, num_history, window, block_size,
    qk_scale, scale, inv_len_k,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr, PART: tl.constexpr,
):  # fmt: skip
    """Query blocks ``[m_lo, m_hi)`` against one key tile; ``MASKED`` applies ``allowed``; ``PART`` (:data:`BOTH`,
    :data:`DV_ONLY`, :data:`DK_ONLY`) says which of dK and dV the tile accumulates (the other is returned as given);
    ``FUSED_DQ`` (with dK) adds
    this tile's part of dQ (``scale dS K``) into the fp32 rows at ``dq_base`` atomically: element by element, or with
    ``DQ_TMA`` as one bulk reduction of the whole tile through ``dq_desc`` (rows ``dq_row + m``, columns from
    ``dq_col``). Rows of the tile past ``row_end`` hold zeros there (nothing allowed), so adding them to the rows
    that follow, another segment's or past the buffer's end (clipped by the descriptor), changes nothing."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for m_start in tl.range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < row_end
        q_MD = _load_tile(q_base, offs_m, stride_qt, offs_d, row_ok, HEAD_DIM, BLOCK_D, MASKED)
        do_MDV = _load_tile(do_base, offs_m, stride_dot, offs_dv, row_ok, HEAD_DIM_V, BLOCK_DV, MASKED)
        qk_NM = tl.dot(k_ND, tl.trans(q_MD), input_precision=DOT_PRECISION)
        if PART != DV_ONLY:
            dp_NM = tl.dot(v_NDV, tl.trans(do_MDV), input_precision=DOT_PRECISION)
        if MASKED:
            allowed_NM = row_ok[None, :] & _history_mask(
                _position(offs_m, shift, num_history)[None, :], offs_n[:, None], num_history, window, block_size,
                CAUSAL, HAS_WINDOW, HAS_BLOCK,
            )  # fmt: skip
        if ACTIVATION == "softmax":
            if MASKED:
                lse_M = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
                p_NM = tl.where(allowed_NM, tl.exp2(qk_NM * qk_scale - lse_M[None, :]), 0.0)
            else:
                lse_M = tl.load(lse_base + offs_m)
                p_NM = tl.exp2(qk_NM * qk_scale - lse_M[None, :])
            if PART != DV_ONLY:
                if MASKED:
                    delta_M = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
                else:
                    delta_M = tl.load(delta_base + offs_m)
                ds_NM = p_NM * (dp_NM - delta_M[None, :])
        else:
            s_NM = qk_NM * scale
            if PART != DK_ONLY:
                p_NM = _activation(s_NM, ACTIVATION, FAST) * inv_len_k
                if MASKED:
                    p_NM = tl.where(allowed_NM, p_NM, 0.0)
            if PART != DV_ONLY:
                ds_NM = _activation_grad(s_NM, ACTIVATION, FAST) * dp_NM * inv_len_k
                if MASKED:
                    ds_NM = tl.where(allowed_NM, ds_NM, 0.0)
        if PART != DK_ONLY:
            dv_NDV = tl.dot(p_NM.to(do_MDV.dtype), do_MDV, dv_NDV, input_precision=DOT_PRECISION)
        if PART != DV_ONLY:
            ds_NM = ds_NM.to(q_MD.dtype)
            dk_ND = tl.dot(ds_NM, q_MD, dk_ND, input_precision=DOT_PRECISION)
        if FUSED_DQ and PART != DV_ONLY:
            dq_MD = tl.dot(tl.trans(ds_NM), k_ND, input_precision=DOT_PRECISION) * scale
            dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :]
            if DQ_TMA:
                dq_desc.atomic_add([dq_row + m_start, dq_col], dq_MD)
            elif MASKED:
                tl.atomic_add(dq_ptrs, dq_MD, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
            elif HEAD_DIM == BLOCK_D:
                tl.atomic_add(dq_ptrs, dq_MD, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq_MD, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
    return dk_ND, dv_NDV


@triton.jit
def _dkdv_program(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC,
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
    scale, window, block_size, kv_seg, head, n_start,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    PART: tl.constexpr,
):  # fmt: skip
    """dK and dV of the key tile at ``n_start`` of kv segment ``kv_seg``, head ``head`` (and, with ``FUSED_DQ``,
    its part of dQ through atomics), or only one of them (``PART``); nothing when the tile lies past the segment's
    end."""
    qk_scale = scale * LOG2E
    k_start = tl.load(KV_OFFSETS + kv_seg).to(tl.int64)
    len_k = (tl.load(KV_OFFSETS + kv_seg + 1) - k_start).to(tl.int32)
    if n_start < len_k:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < len_k
        k_ND = _load_tile(
            K + k_start * stride_kt + head * stride_kh, offs_n, stride_kt, offs_d, col_ok, HEAD_DIM, BLOCK_D, True
        )
        v_NDV = _load_tile(
            V + k_start * stride_vt + head * stride_vh, offs_n, stride_vt, offs_dv, col_ok, HEAD_DIM_V, BLOCK_DV, True
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
            dq_base = DQ + q_start * stride_dqt + head * stride_dqh

            i_lo, a, b, i_hi = _key_tile_queries(
                n_start, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK
            )
            for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
                m_lo, m_hi = _stage_range(stage, i_lo, a, b, i_hi)
                dk_ND, dv_NDV = _dkdv_query_blocks(
                    dk_ND, dv_NDV, k_ND, v_NDV, offs_n, q_base, do_base, lse_base, delta_base, dq_base, DQ_DESC,
                    q_start.to(tl.int32), (head * HEAD_DIM).to(tl.int32),
                    stride_qt, stride_dot, stride_dqt, m_lo, m_hi, i_hi, shift, num_history, window, block_size,
                    qk_scale, scale, inv_len_k, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, stage != 1, FUSED_DQ,
                    DQ_TMA, ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST, PART,
                )  # fmt: skip

            # A target key t is seen by one query only: the target itself, row t of the segment. A run-time branch:
            # only key tiles that hold targets pay for the row-wise tiles (registers) of this term.
            if HAS_TARGETS and (shift == 0) & (n_start + BLOCK_N > num_history):
                own = col_ok & (offs_n >= num_history)
                q_own_ND = _load_tile(q_base, offs_n, stride_qt, offs_d, own, HEAD_DIM, BLOCK_D, True).to(tl.float32)
                do_own_NDV = _load_tile(do_base, offs_n, stride_dot, offs_dv, own, HEAD_DIM_V, BLOCK_DV, True)
                do_own_NDV = do_own_NDV.to(tl.float32)
                qk_N = tl.sum(k_ND.to(tl.float32) * q_own_ND, axis=1)
                dp_N = tl.sum(v_NDV.to(tl.float32) * do_own_NDV, axis=1)
                if ACTIVATION == "softmax":
                    lse_N = tl.load(lse_base + offs_n, mask=own, other=float("inf"))
                    delta_N = tl.load(delta_base + offs_n, mask=own, other=0.0)
                    p_N = tl.where(own, tl.exp2(qk_N * qk_scale - lse_N), 0.0)
                    ds_N = p_N * (dp_N - delta_N)
                else:
                    p_N = tl.where(own, _activation(qk_N * scale, ACTIVATION, FAST) * inv_len_k, 0.0)
                    ds_N = tl.where(own, _activation_grad(qk_N * scale, ACTIVATION, FAST) * dp_N * inv_len_k, 0.0)
                if PART != DK_ONLY:
                    dv_NDV += p_N[:, None] * do_own_NDV
                if PART != DV_ONLY:
                    dk_ND += ds_N[:, None] * q_own_ND
                if FUSED_DQ and PART != DV_ONLY:
                    tl.atomic_add(
                        dq_base + offs_n[:, None] * stride_dqt + offs_d[None, :],
                        ds_N[:, None] * k_ND.to(tl.float32) * scale,
                        mask=own[:, None] & (offs_d[None, :] < HEAD_DIM),
                        sem="relaxed",
                    )

        if PART != DV_ONLY:
            tl.store(
                DK + (k_start + offs_n)[:, None] * stride_dkt + head * stride_dkh + offs_d[None, :],
                (dk_ND * scale).to(DK.dtype.element_ty),
                mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
            )
        if PART != DK_ONLY:
            tl.store(
                DV + (k_start + offs_n)[:, None] * stride_dvt + head * stride_dvh + offs_dv[None, :],
                dv_NDV.to(DV.dtype.element_ty),
                mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            )


@triton.jit
def _dkdv_programs(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC,
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
    scale, window, block_size, kv_seg, head, index,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """dK/dV program ``index`` of a kv segment and head: key tile ``index`` (dK and dV), or with ``SPLIT`` key tile
    ``index // 2``'s dK (even ``index``; it adds dQ with ``FUSED_DQ``) or dV (odd)."""
    if SPLIT:
        n_start = (index // 2) * BLOCK_N
        if index % 2 == 0:
            _dkdv_program(
                Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS,
                SEG_ORDER, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lse_h, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
                scale, window, block_size, kv_seg, head, n_start,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, DK_ONLY,
            )  # fmt: skip
        else:
            _dkdv_program(
                Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS,
                SEG_ORDER, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lse_h, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
                scale, window, block_size, kv_seg, head, n_start,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, False,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, DV_ONLY,
            )  # fmt: skip
    else:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
            stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
            scale, window, block_size, kv_seg, head, index * BLOCK_N,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, BOTH,
        )  # fmt: skip


@triton.jit
def _gdpa_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like k v q
    DQ_DESC,  # DQ as [Tq, H * D] in tiles of [BLOCK_M, D] (DQ_TMA), else unused
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,  # [B + 1], [Bkv + 1], [B], [Bkv + 1], [B]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
    scale, window, block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """One program per (kv segment, head, key tile): dK/dV, plus dQ through fp32 atomics with ``FUSED_DQ`` (bulk
    tensor reductions with ``DQ_TMA``). ``SPLIT``: two programs per key tile along axis 2, one for dK (and dQ), then
    one for dV: one fp32 accumulator each instead of two, so taller key tiles fit in registers, at the price of
    computing ``Q K^T`` twice."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    _dkdv_programs(
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
        scale, window, block_size, tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2),
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
        ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, SPLIT,
    )  # fmt: skip


@triton.jit
def _dq_program(
    Q, K, V, DO, LSE, DELTA, DQ, Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dqt, stride_dqh,
    scale, window, block_size, seg, head, m_start,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """dQ of the query tile at ``m_start`` of query segment ``seg``, head ``head`` (one writer per row); nothing
    when the tile lies past the segment's end."""
    qk_scale = scale * LOG2E
    q_start = tl.load(Q_OFFSETS + seg).to(tl.int64)
    len_q = (tl.load(Q_OFFSETS + seg + 1) - q_start).to(tl.int32)
    if m_start < len_q:
        k_start, len_k, num_history, shift = _kv_segment(
            seg, len_q, KV_OFFSETS, KV_INDEX, NUM_TARGETS, HAS_KV_INDEX, HAS_TARGETS
        )
        inv_len_k = 1.0 / tl.maximum(len_k, 1).to(tl.float32)

        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok, pos_m, q_MD, do_MDV, lse_M, delta_M = _query_rows(
            Q, DO, LSE, DELTA, q_start, head, offs_m, len_q, shift, num_history, stride_qt, stride_qh, stride_dot,
            stride_doh, stride_lse_h, 1, stride_lse_h, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, ACTIVATION,
            False,
        )  # fmt: skip
        k_base = K + k_start * stride_kt + head * stride_kh
        v_base = V + k_start * stride_vt + head * stride_vh
        dq_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        lo, full_lo, full_hi, hi = _query_tile_keys(
            m_start, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
            n_lo, n_hi = _stage_range(stage, lo, full_lo, full_hi, hi)
            dq_MD = _dq_key_blocks(  # dK and dV come from the dK/dV program: the dk/dv arguments are not read
                dq_MD, q_MD, do_MDV, lse_M, delta_M, k_base, v_base, k_base, v_base,
                stride_kt, stride_vt, stride_kt, stride_vt, n_lo, n_hi, hi, pos_m, row_ok,
                qk_scale, scale, inv_len_k, num_history, window, block_size,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, False,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST,
            )  # fmt: skip

        if HAS_TARGETS and (shift == 0) & (m_start + BLOCK_M > num_history):  # target rows' own key: row-wise products
            own = row_ok & (offs_m >= num_history)
            k_own_MD = _load_tile(k_base, offs_m, stride_kt, offs_d, own, HEAD_DIM, BLOCK_D, True).to(tl.float32)
            v_own_MDV = _load_tile(v_base, offs_m, stride_vt, offs_dv, own, HEAD_DIM_V, BLOCK_DV, True).to(tl.float32)
            qk_M = tl.sum(q_MD.to(tl.float32) * k_own_MD, axis=1)
            dp_M = tl.sum(do_MDV.to(tl.float32) * v_own_MDV, axis=1)
            if ACTIVATION == "softmax":
                p_M = tl.where(own, tl.exp2(qk_M * qk_scale - lse_M), 0.0)
                ds_M = p_M * (dp_M - delta_M)
            else:
                ds_M = tl.where(own, _activation_grad(qk_M * scale, ACTIVATION, FAST) * dp_M * inv_len_k, 0.0)
            dq_MD += ds_M[:, None] * k_own_MD

        tl.store(
            DQ + (q_start + offs_m)[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
            (dq_MD * scale).to(DQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        )


# Per-batch counts: Triton would otherwise compile a new variant whenever one of them turns divisible by 16 or 1.
@triton.jit(do_not_specialize=["num_segments", "num_kv_segments", "num_key_tiles", "num_query_tiles"])
def _gdpa_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like k v q
    Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,  # [B + 1], [Bkv + 1], [B] x2, [Bkv + 1], [B]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
    scale, window, block_size, num_segments, num_kv_segments, num_key_tiles, num_query_tiles,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """The deterministic backward in one launch: dK/dV programs (key tiles of ``BLOCK_N`` over query tiles of
    ``BLOCK_M``) and dQ programs (query tiles of ``DQ_BLOCK_M`` over key tiles of ``DQ_BLOCK_N``) share the grid,
    so neither waits for the other's tail. Along axis 2 they alternate, dK/dV from the first key tile and dQ from the
    last query tile: under a causal mask both orders start with the costliest tiles. ``SPLIT``: two dK/dV programs
    per key tile, dK then dV (one accumulator each; ``num_key_tiles`` counts programs, twice the tiles)."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    paired = tl.minimum(num_key_tiles, num_query_tiles)
    is_dq = tl.where(z < 2 * paired, z % 2 == 1, num_query_tiles > num_key_tiles)
    index = tl.where(z < 2 * paired, z // 2, z - paired)
    if is_dq:
        if seg < num_segments:
            _dq_program(
                Q, K, V, DO, LSE, DELTA, DQ, Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
                stride_dqt, stride_dqh, scale, window, block_size, seg, head,
                (num_query_tiles - 1 - index) * DQ_BLOCK_M,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST,
            )  # fmt: skip
    elif seg < num_kv_segments:
        _dkdv_programs(
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
            stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
            scale, window, block_size, seg, head, index,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, False,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, SPLIT,
        )  # fmt: skip


def _segments_by_kv(kv_index: Tensor, num_kv_segments: int) -> tuple[Tensor, Tensor]:
    """CSR of the query segments of each kv segment: ``seg_offsets [Bkv + 1]``, ``seg_order [B]``. No sync."""
    # Three device ops: one stable sort gives the order and the sorted entries, whose first position at or past each
    # kv segment is that segment's offset.
    sorted_index, order = torch.sort(kv_index.to(torch.int64), stable=True)
    bounds = torch.arange(num_kv_segments + 1, dtype=torch.int64, device=kv_index.device)
    return torch.searchsorted(sorted_index, bounds), order


def bulk_reduction_ok(q: Tensor) -> bool:
    """Whether dQ tiles of ``q`` can be added through the copy engine's bulk tensor reductions: compiled kernels on
    an sm_90+ GPU and a power-of-two head dim (one descriptor tile spans a head's row of the fp32 dQ buffer, which
    the backward allocates contiguous whatever ``q``'s strides). Only plain eager launches use them."""
    head_dim = q.shape[2]
    if not q.is_cuda or q.shape[0] == 0 or head_dim != max(16, next_power_of_2(head_dim)):  # the kernels' BLOCK_D
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 9


def _row_tiles(dq: Tensor, block_m: int) -> object:
    """A tensor descriptor over ``dq [Tq, H, D]`` (contiguous) seen as ``[Tq, H * D]``, in tiles of one head's
    ``[block_m, D]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_q, heads, head_dim = dq.shape
    return TensorDescriptor.from_tensor(dq.view(num_q, heads * head_dim), [block_m, head_dim])


def _delta(out: Tensor, grad_out: Tensor) -> Tensor:
    """``[H, Tq]`` fp32 row sums of ``grad_out * out`` (softmax's ``delta``)."""
    num_q, heads, head_dim_v = out.shape
    delta = torch.empty(heads, num_q, dtype=torch.float32, device=out.device)
    if num_q == 0 or heads == 0:
        return delta
    block_dv = max(16, next_power_of_2(head_dim_v))
    block_t = max(1, min(64, 8192 // block_dv))
    launch(
        _bwd_delta_kernel,
        (cdiv(num_q, block_t), heads),
        (out, grad_out, delta, num_q, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
         delta.stride(0)),
        dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_T=block_t, num_warps=4),
    )  # fmt: skip
    return delta


def plan_kernel(plan: BackwardTiles):
    """The kernel ``plan`` launches: the short-query kernel, the dK/dV kernel (atomic dQ) or the one-launch one."""
    if plan.short:
        return _gdpa_bwd_short_kernel
    return _gdpa_bwd_dkdv_kernel if plan.dq is None else _gdpa_bwd_kernel


def plan_meta(plan: BackwardTiles, options: dict[str, object]) -> dict[str, object]:
    """The launch options of :func:`plan_kernel` for ``plan``: a call's ``options`` (:func:`kernel_options`) with
    the plan's constexprs, tiles, warps and stages."""
    meta = dict(options)
    if plan.short:  # no kv index and no targets on that path
        del meta["HAS_KV_INDEX"], meta["HAS_TARGETS"]
    elif plan.dq is None:
        meta.update(FUSED_DQ=True, DQ_TMA=plan.tma, SPLIT=plan.split)
    else:
        meta.update(DQ_BLOCK_M=plan.dq.block_m, DQ_BLOCK_N=plan.dq.block_n, SPLIT=plan.split)
    meta.update(tile_meta(plan.dkdv))
    return meta


def gdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    spec: Spec,
    *,
    flash: bool = False,
    dkdv_tiles: Tiles | None = None,
    dq_tiles: Tiles | None = None,
    short_tiles: Tiles | None = None,
    bulk_dq: bool = False,
    split_dkdv: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernels. ``out`` and ``lse`` (from :func:`gdpa_forward`) are needed for softmax
    only; the spec's length hints bound the segments. ``spec.deterministic`` keeps to the one-launch kernel whose dQ
    programs write each row once (bitwise reproducible); otherwise the tuner also tries the dK/dV kernel that adds
    dQ through fp32 atomics and keeps the faster. Where every query segment is short (at most ``SHORT_QUERY_ROWS``,
    no shared kv segments, no targets) the tuner also tries the short-query kernel (:mod:`.backward_short`,
    deterministic). ``dkdv_tiles`` (alone: the atomic kernel), both tiles (the one-launch kernel) or ``short_tiles``
    (the short-query kernel, whose ``block_m`` must hold the longest query segment) override the tuned choice;
    ``bulk_dq`` with ``dkdv_tiles`` alone adds dQ through bulk tensor reductions (:func:`bulk_reduction_ok`);
    ``split_dkdv`` gives dK and dV programs of their own (one accumulator each), with atomic dQ or ``dq_tiles``.
    Returns ``(dq, dk, dv)`` in the inputs' dtypes. ``flash`` (``impl="auto"``, softmax modes FlashAttention-4
    computes exactly) lets the tuner pick FlashAttention-4's backward instead, from the same ``out`` and ``lse``.
    """
    q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, scale = spec[:9]
    max_seq_len_q, max_seq_len_kv, deterministic = spec.max_seq_len_q, spec.max_seq_len_kv, spec.deterministic
    use_flash = flash and flash_candidate(q, k, v, spec)
    flash_inputs = (grad_out, q, k, v, out, lse, spec)
    grad_out, do_strides = dense_rows(grad_out)
    (q, q_strides), (k, k_strides), (v, v_strides) = dense_rows(q), dense_rows(k), dense_rows(v)
    num_q, heads, head_dim = q.shape
    head_dim_v = v.shape[2]
    num_segments, num_kv_segments = q_offsets.shape[0] - 1, kv_offsets.shape[0] - 1
    softmax = activation == "softmax"
    if softmax:
        assert out is not None and lse is not None, "softmax backward needs the forward's out and lse"
        out, out_strides = dense_rows(out)
        lse_stride = lse.stride(0)
    else:  # placeholders, never read: only softmax reads the output and the log-sum-exp (or delta)
        out, out_strides, lse, lse_stride = grad_out, do_strides, grad_out, 0
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if num_segments == 0 or heads == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    if kv_index is None:
        seg_offsets = seg_order = q_offsets  # placeholders, never read
    else:
        seg_offsets, seg_order = _segments_by_kv(kv_index, num_kv_segments)
    flags = mode_flags(activation, causal, window, block_size, kv_index, num_targets)
    fast = fast_math(q)
    dk_strides, dv_strides = dk.stride(), dv.stride()
    # Strides of q, k, v, dO, the log-sum-exp, dK and dV; dQ's follow per plan.
    strides = (
        q_strides[0], q_strides[1], k_strides[0], k_strides[1], v_strides[0], v_strides[1],
        do_strides[0], do_strides[1], lse_stride,
        dk_strides[0], dk_strides[1], dv_strides[0], dv_strides[1],
    )  # fmt: skip
    targets = q_offsets if num_targets is None else num_targets  # placeholder when absent
    kv_map = q_offsets if kv_index is None else kv_index  # placeholder when absent
    has_keys = k.shape[0] > 0
    # dQ: in q's dtype where a plan writes it directly; fp32 for the atomic kernel's adds. Made when first needed.
    dq_buffers: dict[torch.dtype, Tensor] = {}

    def dq_buffer(dtype: torch.dtype) -> Tensor:
        if dtype not in dq_buffers:  # the fp32 one contiguous: bulk reductions see it as [Tq, H * D]
            dq_buffers[dtype] = torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)
        return dq_buffers[dtype]

    def options(plan: BackwardTiles | str) -> dict[str, object]:
        return {} if plan == FLASH else plan_meta(plan, kernel_options(head_dim, head_dim_v, flags, q.dtype, fast))

    def run(plan: BackwardTiles | str, meta: dict[str, object]) -> None:
        if plan == FLASH:
            from lightning_gem.ops.attention.impl.flash import flash_backward

            flash_backward(*flash_inputs)
            return
        tiles = plan.dkdv
        if plan.short:  # softmax's delta comes from the kernel's own rows of O and dO
            dq = dq_buffer(q.dtype)
            args = (q, k, v, grad_out, lse, out, dq, dk, dv, q_offsets, kv_offsets, *strides[:9], out_strides[0],
                    out_strides[1], *dq.stride()[:2], *strides[9:], scale, window or 0, block_size or 1)  # fmt: skip
            launch(_gdpa_bwd_short_kernel, (num_segments, heads), args, meta)
            return
        delta = _delta(out, grad_out) if softmax else lse
        num_key_tiles = cdiv(max_seq_len_kv, tiles.block_n) if has_keys else 0
        if plan.dq is None:
            dq32 = dq_buffer(torch.float32).zero_()  # zeroed before each run (the tuner runs a candidate several times)
            if num_key_tiles > 0:
                # Bulk reductions in plain eager calls only: a traced launch (torch.compile, dispatch modes) cannot
                # take a tensor descriptor made inside the op, so there the same plan adds dQ element by element.
                bulk = plan.tma and plain_eager((q, k, v, grad_out))
                dq_desc = _row_tiles(dq32, tiles.block_m) if bulk else q_offsets  # a placeholder, never read
                args = (q, k, v, grad_out, lse, delta, dk, dv, dq32, dq_desc, q_offsets, kv_offsets, targets,
                        seg_offsets, seg_order, *strides, *dq32.stride()[:2], scale, window or 0,
                        block_size or 1)  # fmt: skip
                grid = (num_kv_segments, heads, num_key_tiles * (2 if plan.split else 1))
                launch(_gdpa_bwd_dkdv_kernel, grid, args, meta if bulk or not plan.tma else {**meta, "DQ_TMA": False})
            return
        dq = dq_buffer(q.dtype)
        num_query_tiles = cdiv(max_seq_len_q, plan.dq.block_m) if num_q > 0 else 0
        num_dkdv = num_key_tiles * (2 if plan.split else 1)  # dK/dV programs along axis 2
        if num_dkdv + num_query_tiles == 0:
            return
        args = (q, k, v, grad_out, lse, delta, dk, dv, dq, q_offsets, kv_offsets, kv_map, targets, seg_offsets,
                seg_order, *strides, *dq.stride()[:2], scale, window or 0, block_size or 1, num_segments,
                num_kv_segments, num_dkdv, num_query_tiles)  # fmt: skip
        grid = (max(num_segments, num_kv_segments), heads, num_dkdv + num_query_tiles)
        launch(_gdpa_bwd_kernel, grid, args, meta)

    short_query = kv_index is None and num_targets is None and max_seq_len_q <= SHORT_QUERY_ROWS
    if short_tiles is not None:
        if not short_query or short_tiles.block_m < max_seq_len_q:
            raise ValueError(
                f"short_tiles needs no kv_index, no num_targets and block_m >= max_seq_len_q ({max_seq_len_q}), "
                f"at most {SHORT_QUERY_ROWS}"
            )
        plan = BackwardTiles(short_tiles, short=True)
        meta = options(plan)
    elif dkdv_tiles is not None:
        plan = BackwardTiles(dkdv_tiles, dq_tiles, tma=bulk_dq, split=split_dkdv)
        if dq_tiles is None and deterministic:
            raise ValueError("deterministic=True needs dq_tiles with dkdv_tiles")
        if bulk_dq and (dq_tiles is not None or not bulk_reduction_ok(q)):
            raise ValueError("bulk_dq needs dkdv_tiles alone, on an sm_90+ GPU with a power-of-two head dim")
        meta = options(plan)
    else:
        # The key fixes short_query too: the flags hold kv_index and targets, the bucket the longest query segment.
        key = ("bwd", deterministic, head_dim, head_dim_v, q.dtype, flags, block_size, length_bucket(max_seq_len_q),
               length_bucket(max_seq_len_kv), heads, work_bucket(num_q, heads, k.shape[0], num_kv_segments),
               use_flash)  # fmt: skip

        def candidates() -> list[BackwardTiles | str]:
            plans = backward_candidates(q.dtype, q.device, head_dim, deterministic=deterministic,
                                        block_size=block_size, max_len_q=max_seq_len_q, short_query=short_query,
                                        tma=bulk_reduction_ok(q))  # fmt: skip
            return [*plans, FLASH] if use_flash else plans

        plan, meta = pick_launch(
            key, (q.device.type, fast), candidates, lambda p: run(p, options(p)), (q, k, v, grad_out), options
        )
    if plan == FLASH:
        from lightning_gem.ops.attention.impl.flash import flash_backward

        return flash_backward(*flash_inputs)
    run(plan, meta)
    if plan.dq is None and not plan.short:
        return dq_buffers[torch.float32].to(q.dtype), dk, dv
    return dq_buffers[q.dtype], dk, dv
