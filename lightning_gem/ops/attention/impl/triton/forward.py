"""GDPA forward in Triton: one program per (query segment, head, query block) over jagged ``[T, H, D]`` tensors.

Legend: ``T`` tokens (``Tq`` queries, ``Tk`` keys), ``H`` heads, ``D`` q/k head dim, ``DV`` value head dim,
``M`` / ``N`` a query / key block, ``B`` query segments.

A program reads its segment's lengths from the offsets (lengths are runtime values, never constexpr: a
new batch never recompiles), finds the history keys its query block can see (``[lo, hi)`` of its first
and last rows) and visits only the key blocks in that range. Key blocks that every row of the tile sees
whole run without a mask; only the blocks at the edges (the causal diagonal, window and block borders,
segment ends) apply the exact ``allowed`` rule. A target query's own key is a row-wise dot product that
seeds its row. Softmax keeps an fp32 running max and sum in base 2 (the scale folded into one multiplier)
and saves the log-sum-exp (base 2, ``+inf`` for rows that see no key) for the backward; pointwise
activations accumulate ``act(s) v`` and divide by the kv segment's length.

Key and value tiles are read through pointers, or (``TMA``, plain eager calls on sm_90+) through tensor descriptors
by the copy engine: whole tiles, so an edge tile also reads rows past its segment's end (the next segment's, or
zeros past the tensor), which the mask of the edge stages drops like any other disallowed key.

Schedule (:func:`._common._program_ids`): programs run in groups of (segment, head) pairs whose keys and values
fit in a share of the L2 cache together, so the query tiles of a pair that run at the same time read its keys and
values from memory once; the pairs are taken longest segment first (without a kv index), and within a group query
blocks run last block first, so the costliest tiles of causal attention start before the cheap ones. Programs past
a segment's end return at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.imports import FA4_AVAILABLE
from lightning_gem.ops._launch import device_capability, plain_eager
from lightning_gem.ops.attention.fp8 import BOUND_SLACK as _BOUND_SLACK
from lightning_gem.ops.attention.fp8 import P_SCALE
from lightning_gem.ops.attention.impl import flash as fa4
from lightning_gem.ops.attention.impl import varlen as fa2
from lightning_gem.ops.attention.impl.derived import segments_by_length
from lightning_gem.ops.attention.impl.triton._common import (
    E4M3_GRID_FIRST,
    LOG2E,
    _activation,
    _e4m3_grid,
    _history_mask,
    _key_tile,
    _kv_segment,
    _load_tile,
    _position,
    _pow2_ceil,
    _program_ids,
    _query_tile_keys,
    _scaled_activation,
    _stage_range,
    cdiv,
    dense_rows,
    fast_math,
    head_rows_ok,
    head_tiles,
    is_interpreted,
    kernel_options,
    launch,
    mode_flags,
    pair_group,
)
from lightning_gem.ops.attention.impl.triton._tuning import (
    FLASH,
    LIBRARIES,
    VARLEN,
    Tiles,
    candidate_tiles,
    forward_tiles_fault,
    fp8_tiles_fault,
    length_bucket,
    pick_launch,
    tile_meta,
    work_bucket,
)
from lightning_gem.ops.attention.impl.triton.quantize import quantize_fp8_triton
from lightning_gem.ops.attention.spec import Spec

__all__ = ["gdpa_forward"]


P_CODE = tl.constexpr(P_SCALE)
P_CODE_LOG2 = tl.constexpr(math.log2(P_SCALE))  # softmax's codes from the exponent (P_SCALE is a power of two)
BOUND_SLACK = tl.constexpr(_BOUND_SLACK)


@triton.jit
def _fwd_key_blocks(
    acc_MDV, m_M, l_M, q_MD, k_base, v_base, kv_row, head, stride_kt, stride_vt, n_lo, n_hi, hi, pos_m, row_ok,
    qk_scale, scale, num_history, window, block_size, sq_M, ks_base, stride_vd, p_code_M,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr, WS: tl.constexpr = False,
):  # fmt: skip
    """Key blocks ``[n_lo, n_hi)`` of one query tile; ``MASKED`` applies ``allowed`` (else all are allowed); ``WS``
    warp-specializes the loop (Triton's producer / consumer partition of the descriptor loads and the products).

    ``k_base`` / ``v_base`` point at the segment's first key row of the head, or with ``TMA`` are the tensor
    descriptors of :func:`_kv_descriptors`, read at rows ``kv_row + n`` and the head's columns. With ``FP8`` (the
    recipe of :mod:`lightning_gem.ops.attention.fp8`) ``q``, ``k`` and ``v`` are E4M3 codes: ``sq_M`` the query rows'
    scales, ``ks_base`` the keys' (contiguous), ``v_base`` the head's ``[Dv, Tk]`` transposed codes (channels
    ``stride_vd`` apart) and ``P`` is stored as ``p * p_code_M`` (256 for softmax, ``256 / b_i`` pointwise). Each
    score then costs one multiply by its key's scale; the query rows' scales join ``qk_scale`` / ``scale`` as row
    vectors, and softmax's codes come from the exponent (``exp2(s - m + 8) = 256 p``), so ``l_M`` holds ``256 l``."""
    if FP8:  # per-row factors, once: a score's product needs its key's scale only
        row_qk_M = sq_M * qk_scale
        row_qk_M1 = row_qk_M[:, None]
        row_scale_M1 = (sq_M * scale)[:, None]
        code_shift = P_CODE_LOG2
    else:
        row_qk_M = qk_scale
        row_qk_M1 = qk_scale
        row_scale_M1 = scale
        code_shift = 0.0
    for n_start in tl.range(n_lo, n_hi, BLOCK_N, warp_specialize=WS):
        if FP8:  # tiles start on multiples of 16 keys (_query_tile_keys' ALIGN): V's transposed rows copy async
            offs_n = tl.max_contiguous(tl.multiple_of(n_start + tl.arange(0, BLOCK_N), 16), BLOCK_N)
            col_ok = offs_n < hi
            offs_dv = tl.arange(0, BLOCK_DV)
            k_ND = _load_tile(k_base, offs_n, stride_kt, tl.arange(0, BLOCK_D), col_ok, HEAD_DIM, BLOCK_D, MASKED)
            # Whole rows of keys, 16 bytes at a time: a segment's columns start 16-aligned and the codes end in a zero
            # tail as long as a tile, so an edge tile's keys past ``hi`` are read (zeros, or the next segment's codes)
            # and dropped by P's mask like any other disallowed key.
            vt_ptrs = v_base + offs_dv[:, None] * stride_vd + offs_n[None, :]
            vt_DVN = tl.load(vt_ptrs, mask=offs_dv[:, None] < HEAD_DIM_V, other=0.0)
            if MASKED:
                sk_N = tl.load(ks_base + offs_n, mask=col_ok, other=0.0)
            else:
                sk_N = tl.load(ks_base + offs_n)
            v_NDV = tl.trans(vt_DVN)
        elif TMA:  # whole tiles through the copy engine: rows past ``hi`` are read, and masked below
            offs_n = n_start + tl.arange(0, BLOCK_N)
            k_ND = k_base.load([kv_row + n_start, head * HEAD_DIM])
            v_NDV = v_base.load([kv_row + n_start, head * HEAD_DIM_V])
        else:
            offs_n = n_start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < hi
            k_ND, v_NDV = _key_tile(
                k_base, v_base, offs_n, col_ok, stride_kt, stride_vt, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED
            )
        qk_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=DOT_PRECISION)
        if FP8:  # the codes' product times its key's scale (a power of two: exact); the row's comes with row_*
            qk_MN = qk_MN * sk_N[None, :]
        if MASKED:
            allowed_MN = row_ok[:, None] & _history_mask(
                pos_m[:, None], offs_n[None, :], num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
            )
        if ACTIVATION == "softmax":
            if MASKED:
                s_MN = tl.where(allowed_MN, qk_MN * row_qk_M1, float("-inf"))
                m_new_M = tl.maximum(m_M, tl.max(s_MN, axis=1))
                # A row with nothing allowed so far keeps -inf: subtract 0 instead (exp2(-inf) = 0, no NaN).
                m_safe_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
                p_MN = tl.exp2(s_MN - (m_safe_M - code_shift)[:, None])
            else:  # every score is finite: the new max is too (row factors are >= 0: the max of the scaled row)
                m_new_M = tl.maximum(m_M, tl.max(qk_MN, axis=1) * row_qk_M)
                m_safe_M = m_new_M
                p_MN = tl.exp2(qk_MN * row_qk_M1 - (m_safe_M - code_shift)[:, None])
            alpha_M = tl.exp2(m_M - m_safe_M)
            l_M = l_M * alpha_M + tl.sum(p_MN, axis=1)
            acc_MDV = acc_MDV * alpha_M[:, None]
            m_M = m_new_M
        else:
            p_MN = _scaled_activation(qk_MN, row_scale_M1, ACTIVATION, FAST)
            if MASKED:
                p_MN = tl.where(allowed_MN, p_MN, 0.0)
            if FP8:
                p_MN = p_MN * p_code_M[:, None]
        if FP8:
            if E4M3_GRID_FIRST:
                p_MN = _e4m3_grid(p_MN)
        acc_MDV = tl.dot(p_MN.to(v_NDV.dtype), v_NDV, acc_MDV, input_precision=DOT_PRECISION)
    return acc_MDV, m_M, l_M


@triton.jit(do_not_specialize=["group"])  # a per-batch count: no recompile when it changes
def _gdpa_fwd_kernel(
    Q, K, V, OUT, LSE,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] fp32
    K_DESC, V_DESC,  # with TMA: K and V as tensor descriptors (:func:`_kv_descriptors`); else never read
    Q_DESC,  # with WS: Q as a tensor descriptor of [BLOCK_M, HEAD_DIM] tiles over [Tq, H * D]; else never read
    Q_SCALE, K_SCALE, V_SCALE, K_NORM,  # with FP8: [H, Tq], [H, Tk], [Bkv, H, DV], [Bkv, H] fp32; else never read
    V_OFFSETS,  # with FP8: [Bkv + 1] the kv segments' first columns in V's transposed codes (multiples of 16)
    Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,  # [B + 1], [Bkv + 1], [B], [B]
    BY_LENGTH,  # [B] without a kv index: the segments longest first (int32); else never read
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_lse_h,
    stride_qs_h, stride_ks_h, scale, window, block_size, group,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr, FP8: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """One query tile of one segment and head. ``WS`` (with ``TMA``, bf16): one warp-specialized loop over every key
    tile, each masked, with no early exit and Q read through ``Q_DESC``, the form Triton 3.6's sm_90 warp
    specialization partitions (two loops, a branch in the loop or an early ``return`` it cannot lower). With ``FP8``
    (:mod:`lightning_gem.ops.attention.fp8`) Q and K hold E4M3 codes, V the transposed codes ``[H, DV, Tk]``
    (``stride_vt`` 1, channels ``stride_vd`` apart) and the scales are read from ``*_SCALE`` and ``K_NORM``; the
    output is in OUT's dtype either way."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    qk_scale = scale * LOG2E  # softmax scores in base 2
    seg, head, z = _program_ids(group)
    if not HAS_KV_INDEX:  # longest segments first
        seg = tl.load(BY_LENGTH + seg)
    m_start = (tl.num_programs(2) - 1 - z) * BLOCK_M  # last query blocks first
    q_start = tl.load(Q_OFFSETS + seg).to(tl.int64)
    len_q = (tl.load(Q_OFFSETS + seg + 1) - q_start).to(tl.int32)
    if not WS:
        if m_start >= len_q:
            return
    k_start, len_k, num_history, shift = _kv_segment(
        seg, len_q, KV_OFFSETS, KV_INDEX, NUM_TARGETS, HAS_KV_INDEX, HAS_TARGETS
    )

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    pos_m = _position(offs_m, shift, num_history)
    q_base = Q + q_start * stride_qt + head * stride_qh
    if WS:  # rows past the segment read the next one's (or zeros past Tq): masked like any row not ok
        q_MD = Q_DESC.load([(q_start + m_start).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
    else:
        q_MD = _load_tile(q_base, offs_m, stride_qt, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    if TMA:
        k_base, v_base = K_DESC, V_DESC
        kv_row = k_start.to(tl.int32)
        kv_head = head.to(tl.int32)
    else:
        k_base = K + k_start * stride_kt + head * stride_kh
        v_base = V + k_start * stride_vt + head * stride_vh
        kv_row = 0
        kv_head = 0

    heads = tl.num_programs(1)
    sq_M = tl.zeros([BLOCK_M], dtype=tl.float32)  # FP8: the query rows' scales, and P's code multiplier per row
    p_code_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    ks_base = K_SCALE
    if FP8:
        kv_seg = seg
        if HAS_KV_INDEX:
            kv_seg = tl.load(KV_INDEX + seg)
        sq_M = tl.load(Q_SCALE + head * stride_qs_h + q_start + offs_m, mask=row_ok, other=0.0)
        ks_base = K_SCALE + head * stride_ks_h + k_start
        v_base = V + head * stride_vh + tl.multiple_of(tl.load(V_OFFSETS + kv_seg).to(tl.int64), 16)
        if ACTIVATION == "softmax":
            p_code_M = tl.full([BLOCK_M], P_CODE, dtype=tl.float32)
        else:  # |act(s)| <= max(|s|, 1) <= the row's bound b_i: codes of 256 act(s) / b_i never overflow
            q_norm_M = tl.sqrt(tl.sum(q_MD.to(tl.float32) * q_MD.to(tl.float32), axis=1)) * sq_M
            k_norm = tl.load(K_NORM + kv_seg * heads + head)
            p_code_M = P_CODE / _pow2_ceil(tl.maximum(q_norm_M * k_norm * tl.abs(scale) * BOUND_SLACK, 1.0))

    # Own targets first: they seed the running max and sum of softmax rows that are targets.
    acc_MDV = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    # A run-time branch: only tiles that hold targets pay for the row-wise tiles (registers) of this term.
    if HAS_TARGETS and (shift == 0) & (m_start + BLOCK_M > num_history):
        own = row_ok & (offs_m >= num_history)
        k_own = K + k_start * stride_kt + head * stride_kh
        v_own = v_base  # FP8: the segment's first column of the transposed codes
        if not FP8:
            v_own = V + k_start * stride_vt + head * stride_vh
        k_own_MD = _load_tile(k_own, offs_m, stride_kt, offs_d, own, HEAD_DIM, BLOCK_D, True)
        if FP8:  # the transposed codes: the own keys' columns
            vt_own_DVM = tl.load(v_own + offs_dv[:, None] * stride_vd + offs_m[None, :] * stride_vt,
                                 mask=(offs_dv[:, None] < HEAD_DIM_V) & own[None, :], other=0.0)  # fmt: skip
        else:
            v_own_MDV = _load_tile(v_own, offs_m, stride_vt, offs_dv, own, HEAD_DIM_V, BLOCK_DV, True).to(tl.float32)
        qk_own_M = tl.sum(q_MD.to(tl.float32) * k_own_MD.to(tl.float32), axis=1)
        if FP8:
            qk_own_M = qk_own_M * sq_M * tl.load(ks_base + offs_m, mask=own, other=0.0)
        if ACTIVATION == "softmax":
            m_M = tl.where(own, qk_own_M * qk_scale, float("-inf"))
            l_M = tl.where(own, 1.0, 0.0)
            if FP8:  # p = 1 at the row's own max: its code is p_code_M, exactly (l_M sums the codes)
                l_M = l_M * p_code_M
                acc_MDV = tl.where(own[:, None], tl.trans(vt_own_DVM).to(tl.float32) * p_code_M[:, None], 0.0)
            else:
                acc_MDV = tl.where(own[:, None], v_own_MDV, 0.0)
        else:
            # A row vector: through _activation (_scaled_activation's one-tanh form here gave misaligned-address
            # faults on an H100 with some tile candidates)
            p_own_M = tl.where(own, _activation(qk_own_M * scale, ACTIVATION, FAST), 0.0)
            if FP8:
                # One product of the codes with P's codes on a diagonal: the term lands in the accumulator's layout
                # (formed elementwise in the codes' load layout, its conversion to the accumulator's faulted with
                # "misaligned address" at 128-row tiles over head dims above 128 on an H100), and its weight is
                # rounded to a code like every other weight of the row.
                p_own_MM = tl.where(offs_m[:, None] == offs_m[None, :], (p_own_M * p_code_M)[:, None], 0.0)
                if E4M3_GRID_FIRST:
                    p_own_MM = _e4m3_grid(p_own_MM)
                acc_MDV = tl.dot(p_own_MM.to(vt_own_DVM.dtype), tl.trans(vt_own_DVM), input_precision=DOT_PRECISION)
            else:
                acc_MDV = p_own_M[:, None] * v_own_MDV

    lo, full_lo, full_hi, hi = _query_tile_keys(
        m_start, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK,
        16 if FP8 else 1,
    )  # fmt: skip
    if WS:
        acc_MDV, m_M, l_M = _fwd_key_blocks(
            acc_MDV, m_M, l_M, q_MD, k_base, v_base, kv_row, kv_head, stride_kt, stride_vt, lo,
            tl.where(m_start < len_q, hi, lo), hi, pos_m,  # a tile past its segment's end: no key tiles
            row_ok, qk_scale, scale, num_history, window, block_size, sq_M, ks_base, stride_vd, p_code_M,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST, TMA, FP8, True,
        )  # fmt: skip
    else:
        for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
            n_lo, n_hi = _stage_range(stage, lo, full_lo, full_hi, hi)
            acc_MDV, m_M, l_M = _fwd_key_blocks(
                acc_MDV, m_M, l_M, q_MD, k_base, v_base, kv_row, kv_head, stride_kt, stride_vt, n_lo, n_hi, hi,
                pos_m, row_ok, qk_scale, scale, num_history, window, block_size, sq_M, ks_base, stride_vd, p_code_M,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST, TMA, FP8,
            )  # fmt: skip

    if FP8:  # back from the codes' units: V's scale per channel, and pointwise P's multiplier per row (softmax's
        # is in l_M too, and cancels)
        v_scale_DV = tl.load(V_SCALE + (kv_seg * heads + head) * HEAD_DIM_V + offs_dv, mask=offs_dv < HEAD_DIM_V,
                             other=0.0)  # fmt: skip
        if ACTIVATION == "softmax":
            acc_MDV = acc_MDV * v_scale_DV[None, :]
        else:
            acc_MDV = acc_MDV * (v_scale_DV[None, :] / p_code_M[:, None])
    if ACTIVATION == "softmax":
        has_key = l_M > 0.0
        out_MDV = acc_MDV / tl.where(has_key, l_M, 1.0)[:, None]
        log2_l_M = tl.log2(tl.where(has_key, l_M, 1.0))
        if FP8:  # l_M summed the codes, 256 p
            log2_l_M = log2_l_M - P_CODE_LOG2
        lse_M = tl.where(has_key, m_M + log2_l_M, float("inf"))
        tl.store(LSE + head * stride_lse_h + q_start + offs_m, lse_M, mask=row_ok)
    else:
        out_MDV = acc_MDV / tl.maximum(len_k, 1).to(tl.float32)
    tl.store(
        OUT + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out_MDV.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
    )


def gdpa_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: Spec,
    *,
    flash: bool = False,
    tiles: Tiles | None = None,
    need_lse: bool = True,
    warp_specialize: bool = False,
    lse_format: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Returns ``out [Tq, H, DV]`` (q's dtype) and ``lse [H, Tq]`` (fp32, base 2;
    empty for pointwise activations). The spec's ``max_seq_len_q`` sizes the grid and must bound every ``Lq``;
    ``tiles`` overrides the tuned choice (:mod:`._tuning`). ``flash`` (``impl="auto"``) lets the tuner pick a
    library's FlashAttention kernel instead (:func:`library_candidates`), which needs ``max_seq_len_kv`` too;
    ``need_lse=False`` (nothing differentiates the call) lets FlashAttention-4 skip the log-sum-exp (the returned one
    is then empty).
    Tiles with ``tma`` read key and value tiles through tensor descriptors where :func:`kv_descriptors_ok` (else
    through pointers); the tuner lists such candidates for softmax (:func:`._tuning.candidate_tiles`).
    ``warp_specialize`` (with ``tiles`` of 4 warps and ``tma``, bf16 or fp16, q's heads one dense row of
    ``[Tq, H * D]``, no targets): the loop over key tiles warp-specialized (:func:`warp_specialize_fault` says what
    else it needs), another variant the sweep times, never the tuner's. ``spec.precision == "fp8"`` quantizes q, k
    and v (:func:`lightning_gem.ops.attention.fp8.quantize_fp8`) (the same codes from
    :func:`.quantize.quantize_fp8_triton`) and runs the kernel's products on them; the output is in q's dtype either
    way. ``lse_format`` (a dict): where a library kernel runs, its own log-sum-exp is returned
    (natural log; a row that sees nothing ``-inf`` in FA4's, ``+inf`` in FA2's; two launches fewer) and
    ``lse_format["natural"]`` set True, for a backward told so (:func:`.backward.gdpa_backward`'s ``natural_lse``).
    """
    q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, scale = spec[:9]
    max_seq_len_q = spec.max_seq_len_q
    (q, q_strides), (k, k_strides), (v, v_strides) = dense_rows(q), dense_rows(k), dense_rows(v)
    num_q, heads, head_dim = q.shape
    head_dim_v = v.shape[2]
    num_segments = q_offsets.shape[0] - 1
    out = q.new_empty(num_q, heads, head_dim_v)
    softmax = activation == "softmax"
    lse = torch.empty(heads if softmax else 0, num_q, dtype=torch.float32, device=q.device)
    if num_segments == 0 or num_q == 0 or heads == 0:
        return out, lse
    fp8 = spec.precision == "fp8"
    if fp8:  # the kernel reads the codes; v's transposed: keys contiguous (stride 1), channels a padded row apart
        max_kv = spec.max_seq_len_kv or k.shape[0]
        codes = quantize_fp8_triton(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_kv)
        operands = (codes.q, codes.k, codes.v_t)
        scales = (codes.q_scale, codes.k_scale, codes.v_scale, codes.k_norm, codes.v_offsets)
        q_strides, k_strides = codes.q.stride(), codes.k.stride()
        v_strides = (1, codes.v_t.stride(0), codes.v_t.stride(1))
    else:
        operands, scales, v_strides = (q, k, v), (q,) * 5, (*v_strides[:2], 1)  # placeholders are never read
    out_strides = out.stride()
    # What the query tiles of one (segment, head) pair read from memory: its keys and values
    kv_bytes = (spec.max_seq_len_kv or k.shape[0]) * (head_dim + head_dim_v) * operands[1].element_size()
    args = (
        *operands, out, lse, *scales,
        q_offsets, kv_offsets,
        q_offsets if kv_index is None else kv_index,  # placeholders are never read (HAS_* is False)
        q_offsets if num_targets is None else num_targets,
        q_offsets if kv_index is not None else segments_by_length(kv_offsets),
        q_strides[0], q_strides[1], k_strides[0], k_strides[1], *v_strides, out_strides[0],
        out_strides[1], lse.stride(0) if softmax else 0, scales[0].stride(0), scales[1].stride(0),
        scale, window or 0, block_size or 1, pair_group(q.device, kv_bytes),
    )  # fmt: skip
    flags = mode_flags(activation, causal, window, block_size, kv_index, num_targets)
    descriptors = not fp8 and kv_descriptors_ok(q, k, v)
    if warp_specialize:
        tma = descriptors and isinstance(tiles, Tiles) and tiles.tma
        reason = warp_specialize_fault(q, tiles, tma, fp8, num_targets is not None)
        if reason is not None:
            raise ValueError(f"`warp_specialize=True`: {reason}")
    fast = fast_math(q)

    libraries = library_candidates(q, k, v, spec) if flash and not fp8 else []
    dtype = operands[0].dtype  # of the kernel's products: the inputs', or E4M3

    def options(tiles: Tiles | str) -> dict[str, object]:
        if tiles in LIBRARIES:
            return {}
        tma = descriptors and tiles.tma
        # Triton 3.6 miscompiles the one-instruction tanh of the pointwise activations in a loop fed by descriptor
        # loads at some tile shapes (64 x 64 over 4 warps, 2-3 stages: the launch fails on an H200), so those take the
        # exact form.
        meta = {**kernel_options(head_dim, head_dim_v, flags, dtype, fast and not tma), **tile_meta(tiles)}
        return {**meta, "TMA": tma, "FP8": fp8, "WS": warp_specialize}

    def run(tiles: Tiles | str, meta: dict[str, object]) -> None:
        if tiles in LIBRARIES:
            library_forward(tiles, q, k, v, spec, need_lse=need_lse, natural_lse=lse_format is not None)  # as called
            return
        grid = (num_segments, heads, max(1, cdiv(max_seq_len_q, tiles.block_m)))
        descriptors = _kv_descriptors(k, v, tiles.block_n) if meta["TMA"] else (k, v)
        q_descriptor = head_tiles(q, tiles.block_m) if meta["WS"] else q
        launch(_gdpa_fwd_kernel, grid, (*args[:5], *descriptors, q_descriptor, *args[5:]), meta)

    pointwise_targets = not softmax and num_targets is not None
    if tiles is None:
        # With library kernels among the candidates, a call that keeps no log-sum-exp (nothing differentiates it) is
        # its own key: FA4 skips computing it there, so the fastest candidate can differ from a training call's.
        key = ("fwd", head_dim, head_dim_v, dtype, flags, block_size, descriptors, length_bucket(max_seq_len_q), heads,
               work_bucket(num_q, heads, k.shape[0], kv_offsets.shape[0] - 1), bool(libraries) and not need_lse,
               bool(libraries))  # fmt: skip

        def candidates() -> list[Tiles | str]:
            tiles = candidate_tiles("fwd", q.dtype, q.device, head_dim, block_size=block_size, max_len_q=max_seq_len_q,
                                    fp8=fp8, pointwise_targets=pointwise_targets, pointwise=not softmax,
                                    descriptors=descriptors)  # fmt: skip
            return [*tiles, *libraries]

        tiles, meta = pick_launch(
            key, (q.device.type, fast), candidates, lambda t: run(t, options(t)), (q, k, v), options
        )
    else:
        if (
            q.device.type == "cuda"
            and not fp8
            and forward_tiles_fault(tiles, q.dtype, head_dim, block_size, activation)
        ):
            raise ValueError(f"tiles={tiles}: at head dim {head_dim} this forward can fault on sm_90 (a misaligned "
                             "shared-memory address; see forward_tiles_fault): take key tiles of 64, or 32 over three "
                             "stages (under 64-row query tiles for softmax)")  # fmt: skip
        if fp8 and fp8_tiles_fault(tiles, head_dim, pointwise_targets):
            raise ValueError(f"tiles={tiles}: the FP8 forward of a pointwise activation with targets at head dim "
                             f"{head_dim} takes tiles over 8 warps")  # fmt: skip
        meta = options(tiles)
    if tiles in LIBRARIES:
        if lse_format is not None:
            lse_format["natural"] = True
        return library_forward(tiles, q, k, v, spec, need_lse=need_lse, natural_lse=lse_format is not None)
    run(tiles, meta)
    return out, lse


def library_candidates(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> list[str]:
    """The library kernels ``impl="auto"`` may time on this call, in a plain eager call (nothing traces it) of a mode
    they compute exactly (:func:`lightning_gem.ops.attention.impl.flash.mode_unsupported`): :data:`FLASH`
    (FlashAttention-4) where installed and its GPU and head dims allow, :data:`VARLEN` (PyTorch's FlashAttention-2)
    where its own rules do (each module's ``device_unsupported``)."""
    if not q.is_cuda or not plain_eager((q, k, v)):
        return []
    self_attention = spec.kv_offsets is spec.q_offsets
    if fa4.mode_unsupported(q, activation=spec.activation, block_size=spec.block_size, kv_index=spec.kv_index,
                            num_targets=spec.num_targets, self_attention=self_attention) is not None:  # fmt: skip
        return []
    libraries = []
    if FA4_AVAILABLE and fa4.device_unsupported(q, v) is None:
        libraries.append(FLASH)
    if fa2.device_unsupported(q, v) is None:
        libraries.append(VARLEN)
    return libraries


def library_forward(
    name: str, q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, need_lse: bool, natural_lse: bool
) -> tuple[Tensor, Tensor]:
    """The forward of library kernel ``name`` (:data:`FLASH` or :data:`VARLEN`): ``(out, lse)``, the log-sum-exp in
    base 2, or the library's natural-log one with ``natural_lse``."""
    if name == FLASH:
        return fa4.flash_forward(q, k, v, spec, need_lse=need_lse, natural_lse=natural_lse)
    return fa2.varlen_forward(q, k, v, spec, need_lse=need_lse, natural_lse=natural_lse)


def kv_descriptors_ok(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the forward may read key and value tiles through tensor descriptors (the copy engine's bulk tensor
    loads): a plain eager call on an sm_90+ GPU (or in Triton's interpreter, which emulates them), power-of-two head
    dims (a tile spans a head's whole row) and each head's row of ``k`` and ``v`` one dense run of a ``[T, H * D]``
    matrix whose rows are 16-byte aligned."""
    if k.shape[0] == 0 or not plain_eager((q, k, v)) or not (head_rows_ok(k) and head_rows_ok(v)):
        return False
    if not k.is_cuda:
        return is_interpreted(_gdpa_fwd_kernel)
    return device_capability(k.device)[0] >= 9


def warp_specialize_fault(q: Tensor, tiles: Tiles | str | None, tma: bool, fp8: bool, targets: bool) -> str | None:
    """Why the warp-specialized forward cannot run this call, or None. Triton 3.6 partitions the loop (a producer
    warp group issuing the descriptor loads, the 4 warps of the tile consuming them) only at 4 warps a tile of 64 or
    more query rows (compiled for sm_90 at every head dim and mode; tiles of 32 rows are left unpartitioned), with
    every load of the kernel through tensor descriptors (a pointer load of Q fails an assertion of its lowering,
    which aborts the process) and no branch before the loop that holds loads (the own-target term of targets).
    Compiled kernels are refused until one has run correctly on a GPU: on an H100 its GPU test ran past a 120 s limit
    without a result (a hang would poison the process), so it runs under Triton's interpreter only."""
    if q.device.type == "cuda":
        return (
            "has not yet run correctly on a GPU (Triton 3.6, sm_90: its test ran past its time limit on an H100); "
            "it runs under Triton's interpreter only"
        )
    if not isinstance(tiles, Tiles) or tiles.num_warps != 4 or tiles.block_m < 64:
        return f"needs `tiles` of 4 warps and at least 64 query rows, got {tiles}"
    if fp8 or not tma:
        return "needs `tma=True` on bf16 or fp16 operands that tensor descriptors can read (kv_descriptors_ok)"
    if targets:
        return "not with `num_targets`"
    if not head_rows_ok(q):
        return "needs q's heads as one dense, 16-byte aligned row of [Tq, H * D]"
    return None


def _kv_descriptors(k: Tensor, v: Tensor, block_n: int) -> tuple[object, object]:
    """Tensor descriptors over ``k [Tk, H, D]`` and ``v [Tk, H, DV]`` in tiles of one head's ``[block_n, D]``."""
    return head_tiles(k, block_n), head_tiles(v, block_n)
