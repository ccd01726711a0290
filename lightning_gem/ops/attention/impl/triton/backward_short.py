"""GDPA backward for short query segments: one program per (segment, head) holds the whole query segment in one
tile and walks the keys once, writing each key tile's dK and dV as it goes and adding up dQ in registers.

Legend: ``T`` tokens, ``H`` heads, ``D`` / ``DV`` head dims, ``M`` the query tile (the whole segment), ``N`` a key
tile. The formulas are those of :mod:`.backward`.

This is the shape of target-aware cross attention: tens of candidates per user over a history of thousands of
keys. There the general backward is bound by its dQ, which every key tile adds into fp32 rows through atomics
(or which a dQ program walks again over every key); here each key is read once, each dK/dV row written once, no
atomics (deterministic), and keys no query sees get zeros without a product. It serves launches with no
``kv_index`` (each query segment its own keys) and no targets, whose longest query segment fits one tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_gem.ops.attention.impl.triton._common import (
    LOG2E,
    _dq_key_blocks,
    _query_rows,
    _query_tile_keys,
    _stage_range,
)

__all__ = ["_gdpa_bwd_short_kernel"]


@triton.jit
def _zero_key_rows(dk_base, dv_base, stride_dkt, stride_dvt, n_lo, n_hi,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros into dK and dV rows ``[n_lo, n_hi)``: keys that no query of the segment sees."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n_start in tl.range(n_lo, n_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        rows = offs_n < n_hi
        tl.store(
            dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :],
            tl.zeros([BLOCK_N, BLOCK_D], dtype=dk_base.dtype.element_ty),
            mask=rows[:, None] & (offs_d[None, :] < HEAD_DIM),
        )
        tl.store(
            dv_base + offs_n[:, None] * stride_dvt + offs_dv[None, :],
            tl.zeros([BLOCK_N, BLOCK_DV], dtype=dv_base.dtype.element_ty),
            mask=rows[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        )


@triton.jit
def _gdpa_bwd_short_kernel(
    Q, K, V, DO, LSE, OUT, DQ, DK, DV,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq], like dO, q k v
    Q_OFFSETS, KV_OFFSETS,  # [B + 1] each
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_ot, stride_oh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, window, block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """One program per (segment, head); the segment's queries (at most ``BLOCK_M``) against all its keys. Softmax's
    ``delta = rowsum(dO * O)`` is taken from the program's own rows (no separate kernel)."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    qk_scale = scale * LOG2E
    seg = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(Q_OFFSETS + seg).to(tl.int64)
    len_q = (tl.load(Q_OFFSETS + seg + 1) - q_start).to(tl.int32)
    k_start = tl.load(KV_OFFSETS + seg).to(tl.int64)
    len_k = (tl.load(KV_OFFSETS + seg + 1) - k_start).to(tl.int32)
    num_history = len_k  # no targets on this path
    shift = len_k - len_q
    inv_len_k = 1.0 / tl.maximum(len_k, 1).to(tl.float32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok, pos_m, q_MD, do_MDV, lse_M, delta_M = _query_rows(
        Q, DO, LSE, OUT, q_start, head, offs_m, len_q, shift, num_history, stride_qt, stride_qh, stride_dot,
        stride_doh, stride_lse_h, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, ACTIVATION,
        True,
    )  # fmt: skip
    k_base = K + k_start * stride_kt + head * stride_kh
    v_base = V + k_start * stride_vt + head * stride_vh
    dk_base = DK + k_start * stride_dkt + head * stride_dkh
    dv_base = DV + k_start * stride_dvt + head * stride_dvh

    # The keys any query sees, [lo, hi), walked in tiles from lo: edge tiles masked, whole-seen tiles not.
    lo, full_lo, full_hi, hi = _query_tile_keys(
        0, len_q, shift, num_history, window, block_size, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_BLOCK
    )
    seen = len_q > 0  # an empty query segment sees no key
    lo = tl.where(seen, lo, 0)
    hi = tl.where(seen, hi, 0)
    full_lo = tl.where(seen, full_lo, 0)
    full_hi = tl.where(seen, full_hi, 0)
    dq_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for stage in tl.static_range(3):  # masked edge, unmasked inside, masked edge
        n_lo, n_hi = _stage_range(stage, lo, full_lo, full_hi, hi)
        dq_MD = _dq_key_blocks(
            dq_MD, q_MD, do_MDV, lse_M, delta_M, k_base, v_base, dk_base, dv_base,
            stride_kt, stride_vt, stride_dkt, stride_dvt, n_lo, n_hi, hi, pos_m, row_ok,
            qk_scale, scale, inv_len_k, num_history, window, block_size, k_base,  # k_base: no FP8 operands here
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, True,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, DOT_PRECISION, FAST,
        )  # fmt: skip
    # Keys before lo and from hi on: no query sees them (the walk stored rows of [lo, hi) only).
    _zero_key_rows(dk_base, dv_base, stride_dkt, stride_dvt, 0, lo, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N)
    _zero_key_rows(
        dk_base, dv_base, stride_dkt, stride_dvt, hi, len_k, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N
    )
    tl.store(
        DQ + (q_start + offs_m)[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
        (dq_MD * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
