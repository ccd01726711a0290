"""Device helpers shared by the GDPA forward and backward kernels: positions, key/query ranges, masks, activations.

Every rule here is :mod:`lightning_gem.ops.attention.masks` written for one tile: ``p(i)`` is a query's
position, ``[lo, hi)`` the history keys a query (or a whole query block, since ``lo`` and ``hi`` never
decrease with ``i``) can see, and :func:`_history_mask` the exact ``allowed`` rule for history keys. The
"own target" pair ``(i, i)`` of a target query is handled separately by the kernels (it is one key per
row, a row-wise dot product, not a tile).

Integer division is only ever applied to non-negative values: Triton's ``//`` truncates on the GPU, the
masks' rule floors. A negative position (cross-attention with more queries than keys) sees no block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gem.ops._launch import cdiv, dot_precision, is_interpreted, launch, next_power_of_2

__all__ = [
    "E4M3_GRID_FIRST",
    "LOG2E",
    "cdiv",
    "dense_rows",
    "dot_precision",
    "fast_math",
    "head_rows_ok",
    "head_tiles",
    "is_interpreted",
    "kernel_options",
    "launch",
    "mode_flags",
    "next_power_of_2",
    "pair_group",
]

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E): kernels keep scores in base 2 for softmax

# Triton 3.6's interpreter rounds fp32 to E4M3 wrongly where the rounding carries into the exponent (7.77 becomes
# 4, not 8); under it values are put on the E4M3 grid first (P in the forward, the operands in the quantizer), so
# their conversion is exact. Compiled kernels convert in one instruction (cvt.rn.satfinite), which rounds right.
E4M3_GRID_FIRST = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _e4m3_grid(x):
    """``x`` (fp32, below 448 in magnitude) rounded to the nearest E4M3 value (ties to even), in fp32."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits; subnormals
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer, ties to even
    return ((x / step + magic) - magic) * step


@triton.jit
def _pow2_ceil(x):
    """The smallest power of two at or above ``x`` (fp32, positive and normal), from its bits: exact."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _program_ids(group):
    """This program's ``(a, head, z)`` on a grid ``(A, H, Z)``, in an order that keeps what a program streams in the
    L2 cache: the programs, counted as launched (axis 0 fastest), take the first ``group`` (a, head) pairs at ``z``
    0, then at 1, up to ``Z - 1``, then the next ``group`` pairs the same way. Programs that run together then
    share their pairs' operands (a segment's keys and values read by each of its query tiles, or its queries and
    output gradients read by each of its key tiles) instead of each reading its own from memory; and within a group
    the programs of lower ``z`` (which the kernels give the costliest tiles) start first. ``a`` is a position in the
    pairs' order: a kernel that schedules longest segments first loads its segment from the order
    (:func:`..derived.segments_by_length`) itself, so the long segments' tiles start in the first waves instead of
    trailing behind the short ones. That load stays in the kernel's own body: ``torch.compile``'s analysis of which
    arguments a kernel writes follows a called function's results back to all of its arguments, and a store address
    computed from this function's result would mark the order as written (then cloned before every launch)."""
    num_a = tl.num_programs(0)
    heads = tl.num_programs(1)
    num_z = tl.num_programs(2)
    r = tl.program_id(0) + num_a * (tl.program_id(1) + heads * tl.program_id(2))
    first = r // (group * num_z) * group  # the group's first pair
    size = tl.minimum(group, num_a * heads - first)  # the last group may hold fewer
    within = r - first * num_z
    pair = first + within % size
    return pair // heads, (pair % heads).to(tl.int64), within // size


@triton.jit
def _position(i, shift, num_history):
    """``p(i)``: ``min(i, h)`` for self-attention (``shift == 0``), ``i + shift`` for cross-attention."""
    return tl.where((shift == 0) & (i > num_history), num_history, i + shift)


@triton.jit
def _kv_segment(seg, len_q, KV_OFFSETS, KV_INDEX, NUM_TARGETS, HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """The kv segment query segment ``seg`` attends to: ``(k_start, len_k, num_history, shift)``."""
    kv_seg = seg
    if HAS_KV_INDEX:
        kv_seg = tl.load(KV_INDEX + seg)
    k_start = tl.load(KV_OFFSETS + kv_seg).to(tl.int64)
    len_k = (tl.load(KV_OFFSETS + kv_seg + 1) - k_start).to(tl.int32)
    num_history = len_k
    if HAS_TARGETS:
        num_history = len_k - tl.load(NUM_TARGETS + seg).to(tl.int32)
    return k_start, len_k, num_history, len_k - len_q


@triton.jit
def _block_start(p, block_size):
    """First key of ``p``'s block; a whole block before 0 for negative ``p`` (sees no key)."""
    return tl.where(p < 0, -block_size, (tl.maximum(p, 0) // block_size) * block_size)


@triton.jit
def _history_range(
    p, num_history, window, block_size, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr
):
    """History keys ``[lo, hi)`` seen by a query at position ``p`` (``masks.key_ranges``)."""
    lo = p * 0
    hi = p * 0 + num_history
    if CAUSAL:
        hi = tl.minimum(hi, p + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, p - window)
        hi = tl.minimum(hi, p + window + 1)
    if HAS_BLOCK:
        start = _block_start(p, block_size)
        lo = tl.maximum(lo, start)
        hi = tl.minimum(hi, start + block_size)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _key_tile_queries(
    n_start, len_q, shift, num_history, window, block_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):  # fmt: skip
    """Queries of the key tile at ``n_start``, as ``(lo, a, b, hi)`` for :func:`_stage_range` (the transpose of
    :func:`_query_tile_keys`).

    ``[lo, hi)`` holds every query whose history range meets the tile's history keys ``[n_start, n_end)`` (a
    superset). It inverts :func:`_history_range` with ``p(i) = i + shift``: ``hi(p) > n_start`` bounds ``p``
    below and ``lo(p) < n_end`` bounds it above. In self-attention every target query sits at ``p = h``, so an
    upper bound at or past ``h`` keeps all of them.

    Query tiles of ``BLOCK_M`` rows in ``[a, b)`` see all ``BLOCK_N`` keys of the tile (exact): a query sees the
    whole tile iff ``lo(p) <= n_start`` and ``hi(p) >= n_start + BLOCK_N`` (and the tile lies in the history);
    each rule bounds ``p`` to an interval, so these queries are contiguous, and inside them a tile needs no mask.
    Both ranges are empty when no query qualifies.
    """
    # Queries that see some history key of the tile.
    n_end = tl.minimum(n_start + BLOCK_N, num_history)
    i_lo = n_start * 0
    i_hi = n_start * 0 + len_q
    p_max = n_start * 0 + num_history  # no upper bound below h
    if CAUSAL:
        i_lo = tl.maximum(i_lo, n_start - shift)
    if HAS_WINDOW:
        i_lo = tl.maximum(i_lo, n_start - window - shift)
        p_max = tl.minimum(p_max, n_end - 1 + window)
    if HAS_BLOCK:
        i_lo = tl.maximum(i_lo, (n_start // block_size) * block_size - shift)
        last = tl.maximum(n_end - 1, 0)
        p_max = tl.minimum(p_max, (last // block_size) * block_size + block_size - 1)
    self_attention = shift == 0
    keep_targets = self_attention & (p_max >= num_history)
    i_hi = tl.where(keep_targets, i_hi, tl.minimum(i_hi, p_max - shift + 1))
    i_hi = tl.maximum(tl.where(n_start < n_end, i_hi, i_lo), i_lo)

    # Queries that see every key of the tile.
    full_end = n_start + BLOCK_N
    ok = full_end <= num_history
    p_lo = shift  # i >= 0
    p_hi = n_start * 0 + 2147483647
    if CAUSAL:
        p_lo = tl.maximum(p_lo, full_end - 1)
    if HAS_WINDOW:
        p_lo = tl.maximum(p_lo, full_end - 1 - window)
        p_hi = tl.minimum(p_hi, n_start + window)
    if HAS_BLOCK:
        start = (tl.maximum(n_start, 0) // block_size) * block_size
        ok = ok & (full_end <= start + block_size)
        p_lo = tl.maximum(p_lo, start)
        p_hi = tl.minimum(p_hi, start + block_size - 1)
    full_lo = p_lo - shift
    # Self-attention: history rows have p = i < h, every target row p = h.
    ok = ok & ~(self_attention & (p_lo > num_history))
    full_hi = tl.where(self_attention & (p_hi >= num_history), len_q, tl.minimum(len_q, p_hi - shift + 1))
    full_hi = tl.maximum(tl.where(ok, full_hi, full_lo), full_lo)

    a, b = _stages(i_lo, i_hi, full_lo, full_hi, BLOCK_M)
    return i_lo, a, b, i_hi


@triton.jit
def _stages(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split ``[lo, hi)``, walked in steps of ``BLOCK`` from ``lo``, into masked / unmasked / masked parts.

    Returns ``(a, b)``: tiles in ``[lo, a)`` and ``[b, hi)`` need the mask, tiles in ``[a, b)`` lie inside
    ``[full_lo, full_hi)`` and need none. ``a`` and ``b`` stay on the ``lo + k * BLOCK`` grid.
    """
    a = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK) * BLOCK, hi)
    b = a + (tl.maximum(tl.minimum(full_hi, hi) - a, 0) // BLOCK) * BLOCK
    return a, b


@triton.jit
def _stage_range(stage: tl.constexpr, lo, a, b, hi):
    """Stage ``stage`` of a :func:`_stages` split: 0 ``[lo, a)`` and 2 ``[b, hi)`` masked, 1 ``[a, b)`` unmasked."""
    if stage == 0:
        return lo, a
    elif stage == 1:
        return a, b
    else:
        return b, hi


@triton.jit
def _query_tile_keys(
    m_start, len_q, shift, num_history, window, block_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, ALIGN: tl.constexpr = 1,
):  # fmt: skip
    """History keys of the query tile at ``m_start``, as ``(lo, a, b, hi)`` for :func:`_stage_range`.

    ``[lo, hi)`` is all the tile sees (its first row's ``lo``, its last row's ``hi``), and tiles of
    ``BLOCK_N`` keys in ``[a, b)`` are seen whole by every row (the ranges only move right with the row).
    ``ALIGN``: ``lo`` rounded down to a multiple of it (the keys this adds are masked), so every tile of a walk from
    it starts on one too: a kernel may tell the compiler so (``tl.multiple_of``) and copy rows that run along the
    keys asynchronously, ``ALIGN`` keys at a time.
    """
    last_row = tl.minimum(m_start + BLOCK_M, len_q) - 1
    lo, hi_first = _history_range(
        _position(m_start, shift, num_history), num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
    )
    if ALIGN > 1:
        lo = (lo // ALIGN) * ALIGN
    lo_last, hi = _history_range(
        _position(last_row, shift, num_history), num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
    )
    a, b = _stages(lo, hi, lo_last, hi_first, BLOCK_N)
    return lo, a, b, hi


@triton.jit
def _history_mask(
    p, t, num_history, window, block_size, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr
):
    """``allowed(i, t)`` for history keys ``t < h`` (``masks.allowed_mask`` without the own-target term)."""
    allowed = t < num_history
    if CAUSAL:
        allowed = allowed & (t <= p)
    if HAS_WINDOW:
        allowed = allowed & (tl.abs(p - t) <= window)
    if HAS_BLOCK:
        allowed = allowed & (_block_start(p, block_size) == (t // block_size) * block_size)
    return allowed


@triton.jit
def _tanh_approx(x):
    """``tanh`` in one MUFU instruction (``tanh.approx.f32``: relative error about 2^-11); CUDA only."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """``sigmoid`` in fp32; ``FAST``: ``0.5 + 0.5 tanh(x / 2)`` with the one-instruction tanh (bf16 inputs)."""
    if FAST:
        y = 0.5 + 0.5 * _tanh_approx(0.5 * x)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """Pointwise activation in fp32 (``gelu`` is the exact erf form)."""
    if ACTIVATION == "silu":
        y = x * _sigmoid(x, FAST)
    elif ACTIVATION == "gelu":
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "relu":
        y = tl.maximum(x, 0.0)
    else:
        tl.static_assert(ACTIVATION == "sigmoid")
        y = _sigmoid(x, FAST)
    return y


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """Derivative of :func:`_activation` in fp32."""
    if ACTIVATION == "silu":
        sig = _sigmoid(x, FAST)
        y = sig * (1.0 + x * (1.0 - sig))
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        y = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACTIVATION == "relu":
        y = tl.where(x > 0.0, 1.0, 0.0)
    else:
        tl.static_assert(ACTIVATION == "sigmoid")
        sig = _sigmoid(x, FAST)
        y = sig * (1.0 - sig)
    return y


@triton.jit
def _scaled_activation(qk, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """``act(qk * scale)`` in fp32. SiLU with ``FAST``: ``h + h tanh(h)`` with ``h = qk scale / 2`` (the same
    function as ``x sigmoid(x)``, in one multiply, one MUFU tanh and one FMA a score instead of four ALU ops). The
    value of :func:`_scaled_activation_and_grad` (the derivative it drops is not compiled)."""
    y, _ = _scaled_activation_and_grad(qk, scale, ACTIVATION, FAST)
    return y


@triton.jit
def _scaled_activation_and_grad(qk, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """``(act(x), act'(x))`` at ``x = qk * scale`` in fp32 (a caller that reads one of them compiles only that one).
    SiLU with ``FAST`` shares one tanh of ``h = x / 2``: ``act = h + h t`` and ``act' = (1 + t + h (1 - t^2)) / 2``
    (``sigmoid(x) = (1 + t) / 2``)."""
    if ACTIVATION == "silu" and FAST:
        h = qk * (0.5 * scale)
        t = _tanh_approx(h)
        y = h + h * t
        dy = 0.5 + 0.5 * (t + h * (1.0 - t * t))
    else:
        x = qk * scale
        y = _activation(x, ACTIVATION, FAST)
        dy = _activation_grad(x, ACTIVATION, FAST)
    return y, dy


@triton.jit
def _load_tile(
    base, offs_r, stride_r, offs_c, rows_ok, NUM_COLS: tl.constexpr, BLOCK_C: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """A ``[R, BLOCK_C]`` tile of rows ``offs_r``; masks only what can be out of range (zeros there)."""
    ptrs = base + offs_r[:, None] * stride_r + offs_c[None, :]
    if CHECK_ROWS:
        if NUM_COLS == BLOCK_C:
            tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok[:, None] & (offs_c[None, :] < NUM_COLS), other=0.0)
    else:
        if NUM_COLS == BLOCK_C:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_c[None, :] < NUM_COLS, other=0.0)
    return tile


@triton.jit
def _code_rows(codes_base, scales_base, offs_r, rows_ok, stride_r, NUM_COLS: tl.constexpr, BLOCK_C: tl.constexpr,
               CHECK_ROWS: tl.constexpr):  # fmt: skip
    """FP8 codes ``[R, BLOCK_C]`` of rows ``offs_r`` and the rows' scales ``[R]`` (one per row, contiguous), zeros
    where out of range (``CHECK_ROWS``: rows outside ``rows_ok`` may be)."""
    codes = _load_tile(codes_base, offs_r, stride_r, tl.arange(0, BLOCK_C), rows_ok, NUM_COLS, BLOCK_C, CHECK_ROWS)
    if CHECK_ROWS:
        scales = tl.load(scales_base + offs_r, mask=rows_ok, other=0.0)
    else:
        scales = tl.load(scales_base + offs_r)
    return codes, scales


@triton.jit
def _key_tile(
    k_base, v_base, offs_n, col_ok, stride_kt, stride_vt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Key rows ``offs_n`` of one kv segment and head: ``k [N, D]`` and ``v [N, DV]``; ``MASKED`` loads zeros at
    rows not ``col_ok`` (else every row is read). The caller makes the rows: a store addressed by a called
    function's result counts all of its arguments as written in ``torch.compile``'s analysis (see
    :func:`_program_ids`), so no row index comes out of a function that takes ``k_base`` or ``v_base``."""
    k_ND = _load_tile(k_base, offs_n, stride_kt, tl.arange(0, BLOCK_D), col_ok, HEAD_DIM, BLOCK_D, MASKED)
    v_NDV = _load_tile(v_base, offs_n, stride_vt, tl.arange(0, BLOCK_DV), col_ok, HEAD_DIM_V, BLOCK_DV, MASKED)
    return k_ND, v_NDV


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, q_start, head, offs_m, len_q, shift, num_history, stride_qt, stride_qh,
                stride_dot, stride_doh, stride_lse_h, stride_delta_t, stride_delta_h, HEAD_DIM: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                ACTIVATION: tl.constexpr, DELTA_FROM_OUT: tl.constexpr):  # fmt: skip
    """A query tile's rows ``offs_m`` of a segment of ``len_q`` for a backward: ``row_ok`` (rows in the segment),
    their positions (:func:`_position`), ``q [M, D]``, ``dO [M, DV]`` (zeros past the rows), and softmax's
    log-sum-exp ``[M]`` (``+inf`` past the rows) and ``delta = rowsum(dO * O) [M]`` (zeros for pointwise
    activations). ``delta`` is read from ``DELTA [H, Tq]``, or with ``DELTA_FROM_OUT`` computed from the
    forward's output, ``DELTA = O [Tq, H, DV]``; either way ``stride_delta_t`` and ``stride_delta_h`` are its token
    and head strides."""
    row_ok = offs_m < len_q
    pos_m = _position(offs_m, shift, num_history)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_MD = _load_tile(
        Q + q_start * stride_qt + head * stride_qh, offs_m, stride_qt, offs_d, row_ok, HEAD_DIM, BLOCK_D, True
    )
    do_MDV = _load_tile(
        DO + q_start * stride_dot + head * stride_doh, offs_m, stride_dot, offs_dv, row_ok, HEAD_DIM_V, BLOCK_DV, True
    )
    lse_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    delta_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ACTIVATION == "softmax":
        lse_M = tl.load(LSE + head * stride_lse_h + q_start + offs_m, mask=row_ok, other=float("inf"))
        if DELTA_FROM_OUT:
            o_MDV = _load_tile(
                DELTA + q_start * stride_delta_t + head * stride_delta_h, offs_m, stride_delta_t, offs_dv, row_ok,
                HEAD_DIM_V, BLOCK_DV, True,
            )  # fmt: skip
            delta_M = tl.sum(o_MDV.to(tl.float32) * do_MDV.to(tl.float32), axis=1)
        else:
            delta_ptrs = DELTA + head * stride_delta_h + (q_start + offs_m) * stride_delta_t
            delta_M = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    return row_ok, pos_m, q_MD, do_MDV, lse_M, delta_M


@triton.jit
def _dq_key_blocks(
    dq_MD, q_MD, do_MDV, lse_M, delta_M, k_base, v_base, dk_base, dv_base,
    stride_kt, stride_vt, stride_dkt, stride_dvt, n_lo, n_hi, hi, pos_m, row_ok,
    qk_scale, scale, inv_len_k, num_history, window, block_size, fp8,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DKDV: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr, FP8: tl.constexpr = False,
):  # fmt: skip
    """Key tiles ``[n_lo, n_hi)`` against one query tile (rows from :func:`_query_rows`): each tile's part of dQ
    (unscaled) added to ``dq_MD``, and with ``DKDV`` (the tile is the only one that sees these keys) the tile's dK
    and dV stored at ``dk_base`` / ``dv_base`` (rows below ``hi``; else those arguments are not read). ``MASKED``
    applies ``allowed``. Rows past the segment hold zeros (q, dO) and an infinite log-sum-exp, so they add
    nothing unmasked.

    ``FP8`` (not with ``DKDV``): ``q_MD`` and ``do_MDV`` are the rows' FP8 codes, and ``fp8`` holds the keys' codes
    and every row's scale, ``(k8_base, v8_base, ks_base, vs_base, stride_k8t, stride_v8t, sq_M, sdo_M)``: ``S`` and
    ``dP`` are products of codes, and K (at ``k_base``) is read for dQ's product only."""
    tl.static_assert(not (FP8 and DKDV), "the FP8 backward writes dK and dV from dK/dV programs")
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n_start in tl.range(n_lo, n_hi, BLOCK_N):
        if FP8:
            k8_base, v8_base, ks_base, vs_base, stride_k8t, stride_v8t, sq_M, sdo_M = fp8
            offs_n = n_start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < hi
            k8_ND, sk_N = _code_rows(k8_base, ks_base, offs_n, col_ok, stride_k8t, HEAD_DIM, BLOCK_D, MASKED)
            v8_NDV, sv_N = _code_rows(v8_base, vs_base, offs_n, col_ok, stride_v8t, HEAD_DIM_V, BLOCK_DV, MASKED)
            k_ND = _load_tile(k_base, offs_n, stride_kt, offs_d, col_ok, HEAD_DIM, BLOCK_D, MASKED)
            qk_MN = tl.dot(q_MD, tl.trans(k8_ND)) * (sq_M[:, None] * sk_N[None, :])
            dp_MN = tl.dot(do_MDV, tl.trans(v8_NDV)) * (sdo_M[:, None] * sv_N[None, :])
        else:
            offs_n = n_start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < hi
            k_ND, v_NDV = _key_tile(
                k_base, v_base, offs_n, col_ok, stride_kt, stride_vt, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED
            )
            qk_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=DOT_PRECISION)
            dp_MN = tl.dot(do_MDV, tl.trans(v_NDV), input_precision=DOT_PRECISION)
        if MASKED:
            allowed_MN = row_ok[:, None] & _history_mask(
                pos_m[:, None], offs_n[None, :], num_history, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK
            )
        if ACTIVATION == "softmax":
            p_MN = tl.exp2(qk_MN * qk_scale - lse_M[:, None])
            if MASKED:
                p_MN = tl.where(allowed_MN, p_MN, 0.0)
            ds_MN = p_MN * (dp_MN - delta_M[:, None])
        else:
            s_MN = qk_MN * scale
            ds_MN = _activation_grad(s_MN, ACTIVATION, FAST) * dp_MN * inv_len_k
            if MASKED:
                ds_MN = tl.where(allowed_MN, ds_MN, 0.0)
            if DKDV:
                p_MN = _activation(s_MN, ACTIVATION, FAST) * inv_len_k
                if MASKED:
                    p_MN = tl.where(allowed_MN, p_MN, 0.0)
        ds_MN = ds_MN.to(k_ND.dtype)
        if DKDV:
            dv_NDV = tl.dot(tl.trans(p_MN.to(do_MDV.dtype)), do_MDV, input_precision=DOT_PRECISION)
            dk_ND = tl.dot(tl.trans(ds_MN), q_MD, input_precision=DOT_PRECISION) * scale
            tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :], dk_ND.to(dk_base.dtype.element_ty),
                     mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM))  # fmt: skip
            tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_dv[None, :], dv_NDV.to(dv_base.dtype.element_ty),
                     mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))  # fmt: skip
        dq_MD = tl.dot(ds_MN, k_ND, dq_MD, input_precision=DOT_PRECISION)
    return dq_MD


# The share of the L2 cache :func:`pair_group` plans a launch's groups of (segment, head) pairs to fill.
L2_SHARE = 0.5
_L2_BYTES: dict[int, int] = {}


def pair_group(device: torch.device, bytes_per_pair: int | torch.SymInt) -> int | torch.SymInt:
    """How many (segment, head) pairs :func:`_program_ids` runs together: as many as fill :data:`L2_SHARE` of
    ``device``'s L2 cache with ``bytes_per_pair`` each (what one pair's programs stream, at the longest segment),
    at least one. Off CUDA devices (the interpreter) the cache of a Hopper GPU (50 MiB) is assumed. A symbolic size
    (a traced call's length hint) gives a symbolic count, without a guard on it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        l2 = _L2_BYTES.get(index)
        if l2 is None:
            l2 = _L2_BYTES[index] = torch.cuda.get_device_properties(index).L2_cache_size
    else:
        l2 = 50 << 20
    return torch.sym_max(1, int(l2 * L2_SHARE) // torch.sym_max(1, bytes_per_pair))


def fast_math(q: torch.Tensor) -> bool:
    """Whether pointwise activations may use one-instruction approximations: compiled CUDA kernels on bf16
    inputs, whose rounding (2^-8) dwarfs the approximation's (2^-11)."""
    return q.is_cuda and q.dtype == torch.bfloat16


# The kernels' compile-time mode flags, in the order of :func:`mode_flags`.
_MODE_FLAGS = ("ACTIVATION", "CAUSAL", "HAS_WINDOW", "HAS_BLOCK", "HAS_KV_INDEX", "HAS_TARGETS")


def mode_flags(
    activation: str,
    causal: bool,
    window: int | None,
    block_size: int | None,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> tuple[str, bool, bool, bool, bool, bool]:
    """What of a call's mode the kernels compile in: activation, causal, and whether it has a window, blocks, a
    kv index and targets (the values of window and block size stay runtime arguments)."""
    return (activation, causal, window is not None, block_size is not None, kv_index is not None,
            num_targets is not None)  # fmt: skip


def kernel_options(
    head_dim: int, head_dim_v: int, flags: tuple, dtype: torch.dtype, fast: bool
) -> dict[str, int | str | bool]:
    """The constexprs every GDPA kernel takes: head dims and their power-of-two blocks, the mode ``flags``
    (:func:`mode_flags`), ``tl.dot``'s precision for ``dtype`` and ``fast`` (:func:`fast_math`)."""
    options: dict[str, int | str | bool] = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, next_power_of_2(head_dim_v)),
    }
    options.update(zip(_MODE_FLAGS, flags, strict=True))
    options["DOT_PRECISION"] = dot_precision(dtype)
    options["FAST"] = fast
    return options


def dense_rows(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` with a unit stride in its last dim (copied only where it has not) and its strides, read once."""
    strides = t.stride()
    if strides[-1] == 1:
        return t, strides
    t = t.contiguous()
    return t, t.stride()


def head_rows_ok(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can read ``t [T, H, D]`` as ``[T, H * D]`` in tiles of one head's whole row: a
    power-of-two head dim, each head's row one dense run, rows 16-byte aligned."""
    head_dim = t.shape[2]
    if head_dim != max(16, next_power_of_2(head_dim)) or t.stride(2) != 1 or t.stride(1) != head_dim:
        return False
    return (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def head_tiles(t: torch.Tensor, rows: int, columns: int | None = None) -> object:
    """A tensor descriptor over ``t [T, H, D]`` seen as ``[T, H * D]`` (:func:`head_rows_ok`), in tiles of one head's
    ``[rows, D]`` (``[rows, columns]``: part of a head's row); reads past ``T`` give zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, columns or t.shape[2]])
