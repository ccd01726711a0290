"""The programs of GDPA's Triton backward (:mod:`.backward` launches them): a dK/dV program walks the query tiles
that see its key tile, a dQ program the key tiles its query tile sees.

Legend: ``T`` tokens, ``H`` heads, ``D`` / ``DV`` head dims, ``M`` / ``N`` a query / key block. The formulas are
those of :mod:`.backward`. With ``FP8`` the two products a program recomputes, ``S = scale Q K^T`` and
``dP = dO V^T``, take FP8 codes with one scale per (token, head) of all four operands (the row codes that
``gdpa_backward`` makes: contiguous ``[T, H, D]``, so their strides follow from the head count and head dim), passed
as one tuple ``fp8 = (Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, stride_qs_h, stride_ks_h)``; the products
that make dK, dV and dQ keep the inputs' dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_gem.ops.attention.impl.triton._common import (
    LOG2E,
    _activation,
    _activation_grad,
    _code_rows,
    _dq_key_blocks,
    _history_mask,
    _key_tile_queries,
    _kv_segment,
    _load_tile,
    _position,
    _query_rows,
    _query_tile_keys,
    _scaled_activation_and_grad,
    _stage_range,
)

__all__ = ["BOTH", "DK_ONLY", "DV_ONLY"]

# What a dK/dV program accumulates (``PART``).
BOTH = tl.constexpr(0)
DV_ONLY = tl.constexpr(1)
DK_ONLY = tl.constexpr(2)


@triton.jit
def _dkdv_query_blocks(
    dk_ND, dk2_ND, dv_NDV, k_ND, k2_ND, v_NDV, offs_n, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
    dq_row, dq_col, stride_qt, stride_dot, stride_dqt, m_lo, m_hi, row_end, shift, num_history, window, block_size,
    qk_scale, scale, inv_len_k, fp8_rows, fp8_keys,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr, PART: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """Query blocks ``[m_lo, m_hi)`` against one key tile; ``MASKED`` applies ``allowed``; ``PART`` (:data:`BOTH`,
    :data:`DV_ONLY`, :data:`DK_ONLY`) says which of dK and dV the tile accumulates (the other is returned as given);
    ``FUSED_DQ`` (with dK) adds
    this tile's part of dQ (``scale dS K``) into the fp32 rows at ``dq_base`` atomically: element by element, or with
    ``DQ_TMA`` as one bulk reduction of the whole tile through ``dq_desc`` (rows ``dq_row + m``, columns from
    ``dq_col``). Rows of the tile past ``row_end`` hold zeros there (nothing allowed), so adding them to the rows
    that follow, another segment's or past the buffer's end (clipped by the descriptor), changes nothing.

    ``FP8``: ``S`` and ``dP`` are products of FP8 codes times their rows' scales, the query rows' from ``fp8_rows``
    (``q8_base, do8_base, qs_base, dos_base, stride_q8t, stride_do8t``), the key tile's in ``fp8_keys`` (``k8, v8,
    sk, sv``); Q and dO are then read only for the products that make dK and dV (``k_ND`` only for ``FUSED_DQ``,
    ``v_NDV`` never).

    ``HALVES`` (the dK part with ``FUSED_DQ``, never with ``FP8``): the key tile, the query rows, dK and each dQ tile
    in two halves of ``BLOCK_D`` columns, ``k_ND`` / ``k2_ND`` and ``dk_ND`` / ``dk2_ND`` (the upper half masked past
    ``HEAD_DIM``), ``dq_desc`` in tiles of half a head's row; without it ``k2_ND`` is not read and ``dk2_ND`` is
    returned as given."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    HALF: tl.constexpr = BLOCK_D // 2
    offs_h = tl.arange(0, HALF)
    for m_start in tl.range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < row_end
        if FP8:
            q8_base, do8_base, qs_base, dos_base, stride_q8t, stride_do8t = fp8_rows
            k8_ND, v8_NDV, sk_N, sv_N = fp8_keys
            q8_MD, sq_M = _code_rows(q8_base, qs_base, offs_m, row_ok, stride_q8t, HEAD_DIM, BLOCK_D, MASKED)
            qk_NM = tl.dot(k8_ND, tl.trans(q8_MD)) * (sk_N[:, None] * sq_M[None, :])
            if PART != DV_ONLY:
                q_MD = _load_tile(q_base, offs_m, stride_qt, offs_d, row_ok, HEAD_DIM, BLOCK_D, MASKED)
                do8_MDV, sdo_M = _code_rows(do8_base, dos_base, offs_m, row_ok, stride_do8t, HEAD_DIM_V, BLOCK_DV,
                                            MASKED)  # fmt: skip
                dp_NM = tl.dot(v8_NDV, tl.trans(do8_MDV)) * (sv_N[:, None] * sdo_M[None, :])
            if PART != DK_ONLY:
                do_MDV = _load_tile(do_base, offs_m, stride_dot, offs_dv, row_ok, HEAD_DIM_V, BLOCK_DV, MASKED)
        elif HALVES:
            q_MD = _load_tile(q_base, offs_m, stride_qt, offs_h, row_ok, HALF, HALF, MASKED)
            q2_MD = _load_tile(q_base + HALF, offs_m, stride_qt, offs_h, row_ok, HEAD_DIM - HALF, HALF, MASKED)
            do_MDV = _load_tile(do_base, offs_m, stride_dot, offs_dv, row_ok, HEAD_DIM_V, BLOCK_DV, MASKED)
            qk_NM = tl.dot(k_ND, tl.trans(q_MD), input_precision=DOT_PRECISION)
            qk_NM = tl.dot(k2_ND, tl.trans(q2_MD), qk_NM, input_precision=DOT_PRECISION)
            dp_NM = tl.dot(v_NDV, tl.trans(do_MDV), input_precision=DOT_PRECISION)
        else:
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
            act_NM, act_grad_NM = _scaled_activation_and_grad(qk_NM, scale, ACTIVATION, FAST)
            if PART != DK_ONLY:
                p_NM = act_NM * inv_len_k
                if MASKED:
                    p_NM = tl.where(allowed_NM, p_NM, 0.0)
            if PART != DV_ONLY:
                ds_NM = act_grad_NM * dp_NM * inv_len_k
                if MASKED:
                    ds_NM = tl.where(allowed_NM, ds_NM, 0.0)
        if PART != DK_ONLY:
            dv_NDV = tl.dot(p_NM.to(do_MDV.dtype), do_MDV, dv_NDV, input_precision=DOT_PRECISION)
        if HALVES:
            ds_NM = ds_NM.to(q_MD.dtype)
            dk_ND = tl.dot(ds_NM, q_MD, dk_ND, input_precision=DOT_PRECISION)
            dk2_ND = tl.dot(ds_NM, q2_MD, dk2_ND, input_precision=DOT_PRECISION)
            _add_dq_part(ds_NM, k_ND, scale, dq_desc, dq_row + m_start, dq_col, dq_base, offs_m, offs_h, stride_dqt,
                         row_ok, offs_h < HALF, DQ_TMA, MASKED, False, DOT_PRECISION, BLOCK_D > 64)  # fmt: skip
            _add_dq_part(ds_NM, k2_ND, scale, dq_desc, dq_row + m_start, dq_col + HALF, dq_base + HALF, offs_m, offs_h,
                         stride_dqt, row_ok, offs_h < HEAD_DIM - HALF, DQ_TMA, MASKED, HEAD_DIM != BLOCK_D,
                         DOT_PRECISION, BLOCK_D > 64)  # fmt: skip
        elif PART != DV_ONLY:
            ds_NM = ds_NM.to(q_MD.dtype)
            dk_ND = tl.dot(ds_NM, q_MD, dk_ND, input_precision=DOT_PRECISION)
        if FUSED_DQ and PART != DV_ONLY and not HALVES:
            _add_dq_part(ds_NM, k_ND, scale, dq_desc, dq_row + m_start, dq_col, dq_base, offs_m, offs_d, stride_dqt,
                         row_ok, offs_d < HEAD_DIM, DQ_TMA, MASKED, HEAD_DIM != BLOCK_D, DOT_PRECISION,
                         BLOCK_D > 64)  # fmt: skip
    return dk_ND, dk2_ND, dv_NDV


@triton.jit
def _add_dq_part(ds_NM, k_NC, scale, dq_desc, desc_row, desc_col, dq_base, offs_m, offs_c, stride_dqt, row_ok, cols_ok,
                 DQ_TMA: tl.constexpr, MASKED: tl.constexpr, CHECK_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 TRANSPOSED: tl.constexpr):  # fmt: skip
    """Add this key tile's part of dQ, ``scale dS K``, over the columns ``offs_c`` that ``k_NC`` holds, into the fp32
    rows at ``dq_base``: with ``DQ_TMA`` as one bulk reduction through ``dq_desc`` at ``[desc_row, desc_col]``, else
    element by element, only query rows in ``row_ok`` (``MASKED``) and columns in ``cols_ok`` (``CHECK_COLS``).

    ``TRANSPOSED`` (element-by-element additions only) computes the tile as ``(scale dS K)^T = scale K^T dS^T``
    instead: ``K^T`` is the key tile's shared-memory copy read transposed and ``dS^T`` is what the program holds, so
    neither K in a second layout nor ``dS^T`` turned around through shared memory is needed, and a tile of 16-64
    query rows becomes the products' N, not their M (a warp group's tensor-core product takes 64 rows at least).
    At head dims over 64 that took 16-49 KB of shared memory off the dK/dV programs on sm_90 and, on their taller tiles,
    half or more of their register spills (``examples/benchmarks/kernel_resources.py``): it is what lets the 32-row,
    two-stage dK programs of head dim 256 fit."""
    if TRANSPOSED and not DQ_TMA:  # [C, M]: the query rows across
        dq = tl.dot(tl.trans(k_NC), ds_NM, input_precision=DOT_PRECISION) * scale
        dq_ptrs = dq_base + offs_m[None, :] * stride_dqt + offs_c[:, None]
        row_mask, col_mask = row_ok[None, :], cols_ok[:, None]
    else:  # [M, C]
        dq = tl.dot(tl.trans(ds_NM), k_NC, input_precision=DOT_PRECISION) * scale
        dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_c[None, :]
        row_mask, col_mask = row_ok[:, None], cols_ok[None, :]
    if DQ_TMA:
        dq_desc.atomic_add([desc_row, desc_col], dq)
    elif MASKED and CHECK_COLS:
        tl.atomic_add(dq_ptrs, dq, mask=row_mask & col_mask, sem="relaxed")
    elif MASKED:
        tl.atomic_add(dq_ptrs, dq, mask=row_mask, sem="relaxed")
    elif CHECK_COLS:
        tl.atomic_add(dq_ptrs, dq, mask=col_mask, sem="relaxed")
    else:
        tl.atomic_add(dq_ptrs, dq, sem="relaxed")


@triton.jit
def _dkdv_program(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC,
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
    scale, window, block_size, kv_seg, head, n_start, fp8,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    PART: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """dK and dV of the key tile at ``n_start`` of kv segment ``kv_seg``, head ``head`` (and, with ``FUSED_DQ``,
    its part of dQ through atomics), or only one of them (``PART``); nothing when the tile lies past the segment's
    end. ``FP8``: ``S`` and ``dP`` from the row codes of the tuple ``fp8`` (module docstring). ``HALVES`` (dK with
    ``FUSED_DQ``): K, dK and dQ in two column halves (:func:`_dkdv_query_blocks`)."""
    qk_scale = scale * LOG2E
    k_start = tl.load(KV_OFFSETS + kv_seg).to(tl.int64)
    len_k = (tl.load(KV_OFFSETS + kv_seg + 1) - k_start).to(tl.int32)
    if n_start < len_k:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        HALF: tl.constexpr = BLOCK_D // 2
        offs_h = tl.arange(0, HALF)
        col_ok = offs_n < len_k
        heads = tl.num_programs(1)
        if FP8:  # the key tile's codes and scales; K itself only for dQ's product, V not at all
            Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, stride_qs_h, stride_ks_h = fp8
            k8_ND, sk_N = _code_rows(K8 + k_start * heads * HEAD_DIM + head * HEAD_DIM,
                                     K_SCALE + head * stride_ks_h + k_start, offs_n, col_ok, heads * HEAD_DIM,
                                     HEAD_DIM, BLOCK_D, True)  # fmt: skip
            v8_NDV, sv_N = _code_rows(V8 + k_start * heads * HEAD_DIM_V + head * HEAD_DIM_V,
                                      V_SCALE + head * stride_ks_h + k_start, offs_n, col_ok, heads * HEAD_DIM_V,
                                      HEAD_DIM_V, BLOCK_DV, True)  # fmt: skip
            fp8_keys = (k8_ND, v8_NDV, sk_N, sv_N)
            k_ND, v_NDV = k8_ND, v8_NDV  # placeholders, not read
            if FUSED_DQ:
                k_ND = _load_tile(
                    K + k_start * stride_kt + head * stride_kh, offs_n, stride_kt, offs_d, col_ok, HEAD_DIM, BLOCK_D,
                    True,
                )  # fmt: skip
        elif HALVES:
            k_base = K + k_start * stride_kt + head * stride_kh
            k_ND = _load_tile(k_base, offs_n, stride_kt, offs_h, col_ok, HALF, HALF, True)
            k2_ND = _load_tile(k_base + HALF, offs_n, stride_kt, offs_h, col_ok, HEAD_DIM - HALF, HALF, True)
            v_NDV = _load_tile(
                V + k_start * stride_vt + head * stride_vh, offs_n, stride_vt, offs_dv, col_ok, HEAD_DIM_V, BLOCK_DV,
                True,
            )  # fmt: skip
            fp8_keys = (k_ND, v_NDV, col_ok, col_ok)  # placeholders, not read
        else:
            k_ND = _load_tile(
                K + k_start * stride_kt + head * stride_kh, offs_n, stride_kt, offs_d, col_ok, HEAD_DIM, BLOCK_D, True
            )
            v_NDV = _load_tile(
                V + k_start * stride_vt + head * stride_vh, offs_n, stride_vt, offs_dv, col_ok, HEAD_DIM_V, BLOCK_DV,
                True,
            )  # fmt: skip
            fp8_keys = (k_ND, v_NDV, col_ok, col_ok)  # placeholders, not read
        if HALVES:
            dk_ND = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
            dk2_ND = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
        else:
            dk_ND = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dk2_ND = dk_ND  # a placeholder, not read
            k2_ND = k_ND  # a placeholder, not read
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
            if FP8:
                fp8_rows = (Q8 + q_start * heads * HEAD_DIM + head * HEAD_DIM,
                            DO8 + q_start * heads * HEAD_DIM_V + head * HEAD_DIM_V,
                            Q_SCALE + head * stride_qs_h + q_start, DO_SCALE + head * stride_qs_h + q_start,
                            heads * HEAD_DIM, heads * HEAD_DIM_V)  # fmt: skip
            else:
                fp8_rows = (q_base, do_base, lse_base, lse_base, stride_qt, stride_dot)  # placeholders, not read

            i_lo, a, b, i_hi = _key_tile_queries(
                n_start, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK
            )
            for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
                m_lo, m_hi = _stage_range(stage, i_lo, a, b, i_hi)
                dk_ND, dk2_ND, dv_NDV = _dkdv_query_blocks(
                    dk_ND, dk2_ND, dv_NDV, k_ND, k2_ND, v_NDV, offs_n, q_base, do_base, lse_base, delta_base, dq_base,
                    DQ_DESC, q_start.to(tl.int32), (head * HEAD_DIM).to(tl.int32),
                    stride_qt, stride_dot, stride_dqt, m_lo, m_hi, i_hi, shift, num_history, window, block_size,
                    qk_scale, scale, inv_len_k, fp8_rows, fp8_keys, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    stage != 1, FUSED_DQ, DQ_TMA, ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST, PART,
                    FP8, HALVES,
                )  # fmt: skip

            # A target key t is seen by one query only: the target itself, row t of the segment. A run-time branch:
            # only key tiles that hold targets pay for the row-wise tiles (registers) of this term.
            if HAS_TARGETS and (shift == 0) & (n_start + BLOCK_N > num_history):
                own = col_ok & (offs_n >= num_history)
                do_own_NDV = _load_tile(do_base, offs_n, stride_dot, offs_dv, own, HEAD_DIM_V, BLOCK_DV, True)
                do_own_NDV = do_own_NDV.to(tl.float32)
                if HALVES:  # both halves of the target rows' queries against both halves of the keys
                    q_own_ND = _load_tile(q_base, offs_n, stride_qt, offs_h, own, HALF, HALF, True).to(tl.float32)
                    q2_own_ND = _load_tile(q_base + HALF, offs_n, stride_qt, offs_h, own, HEAD_DIM - HALF, HALF,
                                           True).to(tl.float32)  # fmt: skip
                    qk_N = tl.sum(k_ND.to(tl.float32) * q_own_ND, axis=1)
                    qk_N += tl.sum(k2_ND.to(tl.float32) * q2_own_ND, axis=1)
                    dp_N = tl.sum(v_NDV.to(tl.float32) * do_own_NDV, axis=1)
                else:
                    q_own_ND = _load_tile(q_base, offs_n, stride_qt, offs_d, own, HEAD_DIM, BLOCK_D, True)
                    q_own_ND = q_own_ND.to(tl.float32)
                    q2_own_ND = q_own_ND  # a placeholder, not read
                    if FP8:  # the target rows' own codes, as the forward's own term and the tiles above
                        q8_base, do8_base, qs_base, dos_base, stride_q8t, stride_do8t = fp8_rows
                        q8_own_ND, sq_N = _code_rows(q8_base, qs_base, offs_n, own, stride_q8t, HEAD_DIM, BLOCK_D,
                                                     True)  # fmt: skip
                        do8_own_NDV, sdo_N = _code_rows(do8_base, dos_base, offs_n, own, stride_do8t, HEAD_DIM_V,
                                                        BLOCK_DV, True)  # fmt: skip
                        qk_N = tl.sum(k8_ND.to(tl.float32) * q8_own_ND.to(tl.float32), axis=1) * (sk_N * sq_N)
                        dp_N = tl.sum(v8_NDV.to(tl.float32) * do8_own_NDV.to(tl.float32), axis=1) * (sv_N * sdo_N)
                    else:
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
                if HALVES:
                    dk_ND += ds_N[:, None] * q_own_ND
                    dk2_ND += ds_N[:, None] * q2_own_ND
                    dq_own = dq_base + offs_n[:, None] * stride_dqt + offs_h[None, :]
                    tl.atomic_add(dq_own, ds_N[:, None] * k_ND.to(tl.float32) * scale, mask=own[:, None],
                                  sem="relaxed")  # fmt: skip
                    tl.atomic_add(dq_own + HALF, ds_N[:, None] * k2_ND.to(tl.float32) * scale,
                                  mask=own[:, None] & (offs_h[None, :] < HEAD_DIM - HALF), sem="relaxed")  # fmt: skip
                elif PART != DV_ONLY:
                    dk_ND += ds_N[:, None] * q_own_ND
                if FUSED_DQ and PART != DV_ONLY and not HALVES:
                    tl.atomic_add(
                        dq_base + offs_n[:, None] * stride_dqt + offs_d[None, :],
                        ds_N[:, None] * k_ND.to(tl.float32) * scale,
                        mask=own[:, None] & (offs_d[None, :] < HEAD_DIM),
                        sem="relaxed",
                    )

        if HALVES:
            dk_ptrs = DK + (k_start + offs_n)[:, None] * stride_dkt + head * stride_dkh + offs_h[None, :]
            tl.store(dk_ptrs, (dk_ND * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
            tl.store(dk_ptrs + HALF, (dk2_ND * scale).to(DK.dtype.element_ty),
                     mask=col_ok[:, None] & (offs_h[None, :] < HEAD_DIM - HALF))  # fmt: skip
        elif PART != DV_ONLY:
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
    scale, window, block_size, kv_seg, head, index, fp8,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr, LAUNCH: tl.constexpr,
):  # fmt: skip
    """dK/dV program ``index`` of a kv segment and head: key tile ``index`` (dK and dV), or with ``SPLIT`` key tile
    ``index // 2``'s dK (even ``index``; it adds dQ with ``FUSED_DQ``) or dV (odd); or in a launch of one part's
    programs (``LAUNCH``: :data:`DK_ONLY`, :data:`DV_ONLY`; :data:`BOTH` otherwise), key tile ``index``'s part."""
    if LAUNCH != BOTH:
        n_start = index * BLOCK_N
        dk_part: tl.constexpr = LAUNCH == DK_ONLY  # annotated: a static branch below (the other part not compiled)
    elif SPLIT:
        n_start = (index // 2) * BLOCK_N
        dk_part = index % 2 == 0
    if SPLIT or LAUNCH != BOTH:
        if dk_part:
            _dkdv_program(
                Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS,
                SEG_ORDER, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lse_h, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
                scale, window, block_size, kv_seg, head, n_start, fp8,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, DK_ONLY,
                FP8, HALVES,
            )  # fmt: skip
        else:
            _dkdv_program(
                Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS,
                SEG_ORDER, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lse_h, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
                scale, window, block_size, kv_seg, head, n_start, fp8,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, False,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, DV_ONLY,
                FP8, False,
            )  # fmt: skip
    else:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
            stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
            scale, window, block_size, kv_seg, head, index * BLOCK_N, fp8,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, BOTH, FP8, False,
        )  # fmt: skip


@triton.jit
def _dq_program(
    Q, K, V, DO, LSE, DELTA, DQ, Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dqt, stride_dqh,
    scale, window, block_size, seg, head, m_start, fp8,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """dQ of the query tile at ``m_start`` of query segment ``seg``, head ``head`` (one writer per row); nothing
    when the tile lies past the segment's end. ``FP8``: ``S`` and ``dP`` from the row codes of the tuple ``fp8``
    (as :func:`_dkdv_program`'s); the query tile then holds only the codes of its rows of Q and dO."""
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
        heads = tl.num_programs(1)
        k_base = K + k_start * stride_kt + head * stride_kh
        v_base = V + k_start * stride_vt + head * stride_vh
        if FP8:  # q_MD and do_MDV: the rows' codes, read through the dense codes' strides
            Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, stride_qs_h, stride_ks_h = fp8
            row_ok, pos_m, q_MD, do_MDV, lse_M, delta_M = _query_rows(
                Q8, DO8, LSE, DELTA, q_start, head, offs_m, len_q, shift, num_history, heads * HEAD_DIM, HEAD_DIM,
                heads * HEAD_DIM_V, HEAD_DIM_V, stride_lse_h, 1, stride_lse_h, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                BLOCK_DV, BLOCK_M, ACTIVATION, False,
            )  # fmt: skip
            sq_M = tl.load(Q_SCALE + head * stride_qs_h + q_start + offs_m, mask=row_ok, other=0.0)
            sdo_M = tl.load(DO_SCALE + head * stride_qs_h + q_start + offs_m, mask=row_ok, other=0.0)
            ks_base = K_SCALE + head * stride_ks_h + k_start
            vs_base = V_SCALE + head * stride_ks_h + k_start
            k8_base = K8 + k_start * heads * HEAD_DIM + head * HEAD_DIM
            v8_base = V8 + k_start * heads * HEAD_DIM_V + head * HEAD_DIM_V
            key_codes = (k8_base, v8_base, ks_base, vs_base, heads * HEAD_DIM, heads * HEAD_DIM_V, sq_M, sdo_M)
        else:
            row_ok, pos_m, q_MD, do_MDV, lse_M, delta_M = _query_rows(
                Q, DO, LSE, DELTA, q_start, head, offs_m, len_q, shift, num_history, stride_qt, stride_qh, stride_dot,
                stride_doh, stride_lse_h, 1, stride_lse_h, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                ACTIVATION, False,
            )  # fmt: skip
            key_codes = k_base  # a placeholder, not read
        dq_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        lo, full_lo, full_hi, hi = _query_tile_keys(
            m_start, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK
        )
        for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
            n_lo, n_hi = _stage_range(stage, lo, full_lo, full_hi, hi)
            dq_MD = _dq_key_blocks(  # dK and dV come from the dK/dV program: the dk/dv arguments are not read
                dq_MD, q_MD, do_MDV, lse_M, delta_M, k_base, v_base, k_base, v_base,
                stride_kt, stride_vt, stride_kt, stride_vt, n_lo, n_hi, hi, pos_m, row_ok,
                qk_scale, scale, inv_len_k, num_history, window, block_size, key_codes,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, False,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST, FP8,
            )  # fmt: skip

        if HAS_TARGETS and (shift == 0) & (m_start + BLOCK_M > num_history):  # target rows' own key: row-wise products
            own = row_ok & (offs_m >= num_history)
            k_own_MD = _load_tile(k_base, offs_m, stride_kt, offs_d, own, HEAD_DIM, BLOCK_D, True).to(tl.float32)
            if FP8:  # codes of both sides of the two row-wise products, as in the forward's own term
                k8_own_MD, sk_M = _code_rows(k8_base, ks_base, offs_m, own, heads * HEAD_DIM, HEAD_DIM, BLOCK_D, True)
                v8_own_MDV, sv_M = _code_rows(v8_base, vs_base, offs_m, own, heads * HEAD_DIM_V, HEAD_DIM_V,
                                              BLOCK_DV, True)  # fmt: skip
                qk_M = tl.sum(q_MD.to(tl.float32) * k8_own_MD.to(tl.float32), axis=1) * (sq_M * sk_M)
                dp_M = tl.sum(do_MDV.to(tl.float32) * v8_own_MDV.to(tl.float32), axis=1) * (sdo_M * sv_M)
            else:
                v_own_MDV = _load_tile(v_base, offs_m, stride_vt, offs_dv, own, HEAD_DIM_V, BLOCK_DV, True)
                qk_M = tl.sum(q_MD.to(tl.float32) * k_own_MD, axis=1)
                dp_M = tl.sum(do_MDV.to(tl.float32) * v_own_MDV.to(tl.float32), axis=1)
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
