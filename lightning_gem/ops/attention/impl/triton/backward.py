"""GDPA backward in Triton, two kernels: one launch of dK/dV programs (one per kv segment, head and key block)
beside dQ programs (one per query segment, head and query block), so every output row has one writer and
results are bitwise reproducible (at the price of computing ``Q K^T`` and ``dO V^T`` twice); and a dK/dV kernel
that adds dQ into an fp32 buffer through atomics instead. ``deterministic=True`` keeps to the first; otherwise
the tuner times both and keeps the faster for each shape key.

Legend: ``T`` tokens, ``H`` heads, ``D`` / ``DV`` head dims, ``M`` / ``N`` a query / key block.

With ``S = scale Q K^T`` and ``O = P V``: ``dV = P^T dO``, ``dP = dO V^T``; softmax
``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` precomputed and ``P`` rebuilt from the saved
log-sum-exp; pointwise ``dS = mask * act'(S) * dP / Lk``; then ``dQ = scale dS K``, ``dK = scale dS^T Q``.

Programs run in groups of (segment, head) pairs whose streamed operands fit in a share of the L2 cache together
(:func:`._common._program_ids`): the key tiles of a pair that run at the same time read its queries and output
gradients from memory once, and add into its dQ rows in the cache; without a kv index the pairs are taken longest
segment first. The programs themselves live in :mod:`.backward_programs`. ``precision="fp8"``: ``S`` and ``dP``
are recomputed on FP8 row codes of q, k, v and dO (made here, one scale per token and head), dK, dV and dQ in the
inputs' dtype.

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

from lightning_gem.ops._launch import device_capability, plain_eager
from lightning_gem.ops.attention.impl import flash as fa4
from lightning_gem.ops.attention.impl.derived import segments_by_length
from lightning_gem.ops.attention.impl.triton._common import (
    _load_tile,
    _program_ids,
    cdiv,
    dense_rows,
    fast_math,
    head_tiles,
    kernel_options,
    launch,
    mode_flags,
    next_power_of_2,
    pair_group,
)
from lightning_gem.ops.attention.impl.triton._tuning import (
    FLASH,
    LIBRARIES,
    SHORT_QUERY_ROWS,
    BackwardTiles,
    Tiles,
    backward_candidates,
    length_bucket,
    pick_launch,
    tile_meta,
    work_bucket,
)
from lightning_gem.ops.attention.impl.triton.backward_programs import (
    BOTH,
    DK_ONLY,
    DV_ONLY,
    _dkdv_programs,
    _dq_program,
)
from lightning_gem.ops.attention.impl.triton.backward_short import _gdpa_bwd_short_kernel
from lightning_gem.ops.attention.impl.triton.forward import library_candidates
from lightning_gem.ops.attention.impl.triton.quantize import quantize_rows_triton
from lightning_gem.ops.attention.impl.varlen import varlen_backward
from lightning_gem.ops.attention.spec import Spec

__all__ = ["gdpa_backward"]


@triton.jit(do_not_specialize=["num_rows"])  # a per-batch count: no recompile when it changes
def _bwd_delta_kernel(
    OUT, DO, DELTA, DQ,  # [Tq, H, DV] x2, [H, Tq] fp32, [Tq, H, D] fp32 (ZERO_DQ)
    num_rows, stride_ot, stride_oh, stride_dot, stride_doh, stride_delta_h, stride_dqt, stride_dqh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr, ZERO_DQ: tl.constexpr,
):  # fmt: skip
    """``delta[h, t] = sum_d dO[t, h, d] * O[t, h, d]`` in fp32; with ``ZERO_DQ`` the same rows of the fp32 dQ
    accumulator are zeroed too (the atomic plans add into it), which saves that launch."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_t < num_rows
    o_TDV = _load_tile(OUT + head * stride_oh, offs_t, stride_ot, offs_dv, rows_ok, HEAD_DIM_V, BLOCK_DV, True)
    do_TDV = _load_tile(DO + head * stride_doh, offs_t, stride_dot, offs_dv, rows_ok, HEAD_DIM_V, BLOCK_DV, True)
    delta_T = tl.sum(o_TDV.to(tl.float32) * do_TDV.to(tl.float32), axis=1)
    tl.store(DELTA + head * stride_delta_h + offs_t, delta_T, mask=rows_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        dq_ptrs = DQ + head * stride_dqh + offs_t[:, None] * stride_dqt + offs_d[None, :]
        tl.store(
            dq_ptrs, tl.zeros((BLOCK_T, BLOCK_D), tl.float32), mask=rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        )


@triton.jit(do_not_specialize=["group"])  # a per-batch count: no recompile when it changes
def _gdpa_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like k v q
    DQ_DESC,  # DQ as [Tq, H * D] in tiles of [BLOCK_M, D] (DQ_TMA), else unused
    Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,  # [B + 1], [Bkv + 1], [B], [Bkv + 1], [B]
    BY_LENGTH,  # [Bkv] without a kv index: the segments longest first (int32); else never read
    Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE,  # with FP8: row codes like q k v dO (dense), [H, T] fp32
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh, stride_qs_h, stride_ks_h,
    scale, window, block_size, group,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr, LAUNCH: tl.constexpr,
):  # fmt: skip
    """One program per (kv segment, head, key tile): dK/dV, plus dQ through fp32 atomics with ``FUSED_DQ`` (bulk
    tensor reductions with ``DQ_TMA``). ``SPLIT``: two programs per key tile along axis 2, one for dK (and dQ), then
    one for dV: one fp32 accumulator each instead of two, so taller key tiles fit in registers, at the price of
    computing ``Q K^T`` twice; ``HALVES``: the dK program in two column halves (:mod:`.backward_programs`).
    ``LAUNCH`` (``DK_ONLY`` / ``DV_ONLY``, else ``BOTH``): a launch of one part's programs only, one a key tile (a
    plan's ``dv_stages``: the dK launch, then the dV one at its own stages). ``FP8``: ``S`` and ``dP`` from the row
    codes (:func:`gdpa_backward`); else those arguments are not read."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    fp8 = (Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, stride_qs_h, stride_ks_h)
    kv_seg, head, index = _program_ids(group)
    if not HAS_KV_INDEX:  # longest segments first
        kv_seg = tl.load(BY_LENGTH + kv_seg)
    _dkdv_programs(
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_DESC, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
        scale, window, block_size, kv_seg, head, index, fp8,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, FUSED_DQ, DQ_TMA,
        ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, SPLIT, FP8, HALVES,
        LAUNCH,
    )  # fmt: skip


# Per-batch counts: Triton would otherwise compile a new variant whenever one of them turns divisible by 16 or 1.
@triton.jit(do_not_specialize=["num_segments", "num_kv_segments", "num_key_tiles", "num_query_tiles", "group"])
def _gdpa_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ,  # [Tq, H, D], [Tk, H, D], [Tk, H, DV], [Tq, H, DV], [H, Tq] x2, like k v q
    Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,  # [B + 1], [Bkv + 1], [B] x2, [Bkv + 1], [B]
    BY_LENGTH,  # [B] without a kv index: the segments longest first (int32); else never read
    Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE,  # with FP8: row codes like q k v dO (dense), [H, T] fp32
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh, stride_qs_h, stride_ks_h,
    scale, window, block_size, num_segments, num_kv_segments, num_key_tiles, num_query_tiles, group,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
    HAS_KV_INDEX: tl.constexpr, HAS_TARGETS: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """The deterministic backward in one launch: dK/dV programs (key tiles of ``BLOCK_N`` over query tiles of
    ``BLOCK_M``) and dQ programs (query tiles of ``DQ_BLOCK_M`` over key tiles of ``DQ_BLOCK_N``) share the grid,
    so neither waits for the other's tail. Along axis 2 they alternate, dK/dV from the first key tile and dQ from the
    last query tile: under a causal mask both orders start with the costliest tiles. ``SPLIT``: two dK/dV programs
    per key tile, dK then dV (one accumulator each; ``num_key_tiles`` counts programs, twice the tiles). ``FP8``:
    ``S`` and ``dP`` from the row codes (:func:`gdpa_backward`); else those arguments are not read."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    fp8 = (Q8, K8, V8, DO8, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, stride_qs_h, stride_ks_h)
    seg, head, z = _program_ids(group)
    if not HAS_KV_INDEX:  # longest segments first
        seg = tl.load(BY_LENGTH + seg)
    paired = tl.minimum(num_key_tiles, num_query_tiles)
    is_dq = tl.where(z < 2 * paired, z % 2 == 1, num_query_tiles > num_key_tiles)
    index = tl.where(z < 2 * paired, z // 2, z - paired)
    if is_dq:
        if seg < num_segments:
            _dq_program(
                Q, K, V, DO, LSE, DELTA, DQ, Q_OFFSETS, KV_OFFSETS, KV_INDEX, NUM_TARGETS,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
                stride_dqt, stride_dqh, scale, window, block_size, seg, head,
                (num_query_tiles - 1 - index) * DQ_BLOCK_M, fp8,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N,
                ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, FP8,
            )  # fmt: skip
    elif seg < num_kv_segments:
        _dkdv_programs(
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ, Q_OFFSETS, KV_OFFSETS, NUM_TARGETS, SEG_OFFSETS, SEG_ORDER,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lse_h,
            stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh,
            scale, window, block_size, seg, head, index, fp8,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, False,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, HAS_KV_INDEX, HAS_TARGETS, DOT_PRECISION, FAST, SPLIT, FP8,
            False, BOTH,
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
    return device_capability(q.device)[0] >= 9


def _row_tiles(dq: Tensor, block_m: int, columns: int | None = None) -> object:
    """A tensor descriptor over ``dq [Tq, H, D]`` (contiguous) seen as ``[Tq, H * D]``, in tiles of one head's
    ``[block_m, D]`` (``[block_m, columns]``: part of a head's row)."""
    return head_tiles(dq, block_m, columns)


def _delta(out: Tensor, grad_out: Tensor, zero: Tensor | None = None) -> Tensor:
    """``[H, Tq]`` fp32 row sums of ``grad_out * out`` (softmax's ``delta``); ``zero`` (``[Tq, H, D]`` fp32, the
    atomic plans' dQ accumulator) is zeroed by the same launch."""
    num_q, heads, head_dim_v = out.shape
    delta = torch.empty(heads, num_q, dtype=torch.float32, device=out.device)
    if num_q == 0 or heads == 0:
        return delta
    head_dim = 1 if zero is None else zero.shape[2]
    block_d, block_dv = max(16, next_power_of_2(head_dim)), max(16, next_power_of_2(head_dim_v))
    block_t = max(1, min(64, 8192 // max(block_d, block_dv)))
    dq = delta if zero is None else zero  # a placeholder, never written, without ZERO_DQ
    dq_strides = (0, 0) if zero is None else zero.stride()[:2]
    launch(
        _bwd_delta_kernel,
        (cdiv(num_q, block_t), heads),
        (out, grad_out, delta, dq, num_q, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
         delta.stride(0), *dq_strides),
        dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_T=block_t,
             ZERO_DQ=zero is not None, num_warps=4),
    )  # fmt: skip
    return delta


def plan_kernel(plan: BackwardTiles):
    """The kernel ``plan`` launches: the short-query kernel, the dK/dV kernel (atomic dQ) or the one-launch one."""
    if plan.short:
        return _gdpa_bwd_short_kernel
    return _gdpa_bwd_dkdv_kernel if plan.dq is None else _gdpa_bwd_kernel


def plan_meta(plan: BackwardTiles, options: dict[str, object]) -> dict[str, object]:
    """The launch options of :func:`plan_kernel` for ``plan``: a call's ``options`` (:func:`kernel_options`, with
    ``FP8`` where the call runs the FP8 backward; default False) with the plan's constexprs, tiles, warps and
    stages."""
    meta = {"FP8": False, **options}
    if plan.short:  # no kv index, no targets and no FP8 on that path
        del meta["HAS_KV_INDEX"], meta["HAS_TARGETS"]
        assert not meta.pop("FP8"), "the short-query kernel has no FP8 path"
    elif plan.dq is None:
        meta.update(
            FUSED_DQ=True,
            DQ_TMA=plan.tma,
            SPLIT=plan.split,
            HALVES=plan.halves and not meta["FP8"],
            LAUNCH=(DK_ONLY if plan.dv_stages else BOTH).value,
        )
    else:
        meta.update(DQ_BLOCK_M=plan.dq.block_m, DQ_BLOCK_N=plan.dq.block_n, SPLIT=plan.split)
    meta.update(tile_meta(plan.dkdv))
    return meta


def dv_launch_meta(plan: BackwardTiles, meta: dict[str, object]) -> dict[str, object]:
    """The launch options of ``plan``'s dV launch (``dv_stages``) from its dK launch's ``meta``: the dV programs
    alone, adding no dQ (they take no descriptor), at their own stages."""
    return {**meta, "LAUNCH": DV_ONLY.value, "FUSED_DQ": False, "DQ_TMA": False, "HALVES": False,
            "num_stages": plan.dv_stages}  # fmt: skip


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
    column_halves: bool = False,
    dv_stages: int = 0,
    natural_lse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernels. ``out`` and ``lse`` (from :func:`gdpa_forward`) are needed for softmax
    only; the spec's length hints bound the segments. ``spec.deterministic`` keeps to the one-launch kernel whose dQ
    programs write each row once (bitwise reproducible); otherwise the tuner also tries the dK/dV kernel that adds
    dQ through fp32 atomics and keeps the faster. Where every query segment is short (at most ``SHORT_QUERY_ROWS``,
    no shared kv segments, no targets) the tuner also tries the short-query kernel (:mod:`.backward_short`,
    deterministic). ``dkdv_tiles`` (alone: the atomic kernel), both tiles (the one-launch kernel) or ``short_tiles``
    (the short-query kernel, whose ``block_m`` must hold the longest query segment) override the tuned choice;
    ``bulk_dq`` with ``dkdv_tiles`` alone adds dQ through bulk tensor reductions (:func:`bulk_reduction_ok`);
    ``split_dkdv`` gives dK and dV programs of their own (one accumulator each), with atomic dQ or ``dq_tiles``;
    ``column_halves`` (with ``split_dkdv`` and atomic dQ) has the dK program hold K, dK and each dQ tile as two
    halves of the head dim's columns (:mod:`.backward_programs`); ``dv_stages`` (with ``split_dkdv`` and atomic dQ)
    launches the dV programs after the dK ones, on their own, pipelined over that many stages. Returns ``(dq, dk,
    dv)`` in the inputs' dtypes.
    ``flash`` (``impl="auto"``, softmax modes a library's FlashAttention kernel computes exactly) lets the tuner
    pick that library's backward instead (:func:`.forward.library_candidates`), from the same ``out`` and ``lse``.
    ``natural_lse``: ``lse`` is a library kernel's own (:func:`.forward.gdpa_forward`'s ``lse_format``), handed to
    the library backwards and converted for the Triton kernels.
    """
    q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, scale = spec[:9]
    max_seq_len_q, max_seq_len_kv, deterministic = spec.max_seq_len_q, spec.max_seq_len_kv, spec.deterministic
    fp8 = spec.precision == "fp8"
    libraries = library_candidates(q, k, v, spec) if flash and not fp8 else []
    library_inputs = (grad_out, q, k, v, out, lse, spec)
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
        by_length = segments_by_length(kv_offsets)
    else:
        seg_offsets, seg_order = _segments_by_kv(kv_index, num_kv_segments)
        by_length = q_offsets  # a placeholder, never read
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
    if fp8:  # S and dP on row codes: q and k as the forward quantized them, v and dO the same way
        (q8, q_scale), (do8, do_scale) = (quantize_rows_triton(t, q_offsets, max_seq_len_q) for t in (q, grad_out))
        (k8, k_scale), (v8, v_scale) = (quantize_rows_triton(t, kv_offsets, max_seq_len_kv) for t in (k, v))
        codes = (q8, k8, v8, do8, q_scale, k_scale, v_scale, do_scale)
        code_strides = (q_scale.stride(0), k_scale.stride(0))
    else:  # placeholders, never read
        codes, code_strides = (q, k, v, grad_out) * 2, (0, 0)
    has_keys = k.shape[0] > 0
    # What the programs of one (segment, head) pair read from memory (pair_group): a key tile its queries and output
    # gradients (and the fp32 dQ rows it adds into), a dQ program its keys and values.
    q_bytes = (max_seq_len_q or num_q) * (head_dim + head_dim_v) * q.element_size()
    kv_bytes = (max_seq_len_kv or k.shape[0]) * (head_dim + head_dim_v) * k.element_size()
    dq32_bytes = (max_seq_len_q or num_q) * head_dim * 4
    # dQ: in q's dtype where a plan writes it directly; fp32 for the atomic kernel's adds. Made when first needed.
    dq_buffers: dict[torch.dtype, Tensor] = {}

    def dq_buffer(dtype: torch.dtype) -> Tensor:
        if dtype not in dq_buffers:  # the fp32 one contiguous: bulk reductions see it as [Tq, H * D]
            dq_buffers[dtype] = torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)
        return dq_buffers[dtype]

    converted: list[Tensor] = []

    def base2_lse() -> Tensor:
        """The log-sum-exp the Triton kernels read (base 2): FlashAttention-4's converted once, when first needed."""
        if not (natural_lse and softmax):
            return lse
        if not converted:
            converted.append(fa4.lse_to_base2(lse))
        return converted[0]

    def options(plan: BackwardTiles | str) -> dict[str, object]:
        if plan in LIBRARIES:
            return {}
        return plan_meta(plan, {**kernel_options(head_dim, head_dim_v, flags, q.dtype, fast), "FP8": fp8})

    def run(plan: BackwardTiles | str, meta: dict[str, object]) -> None:
        if plan in LIBRARIES:
            library_backward(plan, *library_inputs, natural_lse=natural_lse)
            return
        tiles = plan.dkdv
        if plan.short:  # softmax's delta comes from the kernel's own rows of O and dO
            dq = dq_buffer(q.dtype)
            args = (q, k, v, grad_out, base2_lse(), out, dq, dk, dv, q_offsets, kv_offsets, *strides[:9],
                    out_strides[0], out_strides[1], *dq.stride()[:2], *strides[9:], scale, window or 0,
                    block_size or 1)  # fmt: skip
            launch(_gdpa_bwd_short_kernel, (num_segments, heads), args, meta)
            return
        num_key_tiles = cdiv(max_seq_len_kv, tiles.block_n) if has_keys else 0
        if plan.dq is None:  # dQ added into fp32, zeroed before each run (the tuner runs a candidate several times)
            dq32 = dq_buffer(torch.float32)
            if softmax:
                delta = _delta(out, grad_out, zero=dq32)
            else:
                dq32.zero_()
                delta = lse  # a placeholder, never read
            if num_key_tiles > 0:
                # Bulk reductions in plain eager calls only: a traced launch (torch.compile, dispatch modes) cannot
                # take a tensor descriptor made inside the op, so there the same plan adds dQ element by element.
                bulk = plan.tma and plain_eager((q, k, v, grad_out))
                columns = head_dim // 2 if meta.get("HALVES") else head_dim
                dq_desc = _row_tiles(dq32, tiles.block_m, columns) if bulk else q_offsets  # a placeholder, never read
                args = (q, k, v, grad_out, base2_lse(), delta, dk, dv, dq32, dq_desc, q_offsets, kv_offsets, targets,
                        seg_offsets, seg_order, by_length, *codes, *strides, *dq32.stride()[:2], *code_strides, scale,
                        window or 0, block_size or 1, pair_group(q.device, q_bytes + dq32_bytes))  # fmt: skip
                meta = meta if bulk or not plan.tma else {**meta, "DQ_TMA": False}
                if plan.dv_stages:  # the dK programs, then the dV ones in a launch of their own at their own stages
                    launch(_gdpa_bwd_dkdv_kernel, (num_kv_segments, heads, num_key_tiles), args, meta)
                    dv_args = (*args[:9], q_offsets, *args[10:])  # the dV programs add no dQ: no descriptor
                    launch(_gdpa_bwd_dkdv_kernel, (num_kv_segments, heads, num_key_tiles), dv_args,
                           dv_launch_meta(plan, meta))  # fmt: skip
                else:
                    grid = (num_kv_segments, heads, num_key_tiles * (2 if plan.split else 1))
                    launch(_gdpa_bwd_dkdv_kernel, grid, args, meta)
            if q.dtype != torch.float32:  # the conversion is part of the plan's cost, timed with it by the tuner
                dq_buffer(q.dtype).copy_(dq32)
            return
        delta = _delta(out, grad_out) if softmax else lse
        dq = dq_buffer(q.dtype)
        num_query_tiles = cdiv(max_seq_len_q, plan.dq.block_m) if num_q > 0 else 0
        num_dkdv = num_key_tiles * (2 if plan.split else 1)  # dK/dV programs along axis 2
        if num_dkdv + num_query_tiles == 0:
            return
        args = (q, k, v, grad_out, base2_lse(), delta, dk, dv, dq, q_offsets, kv_offsets, kv_map, targets, seg_offsets,
                seg_order, by_length, *codes, *strides, *dq.stride()[:2], *code_strides, scale, window or 0,
                block_size or 1, num_segments, num_kv_segments, num_dkdv, num_query_tiles,
                pair_group(q.device, q_bytes + kv_bytes))  # fmt: skip
        grid = (max(num_segments, num_kv_segments), heads, num_dkdv + num_query_tiles)
        launch(_gdpa_bwd_kernel, grid, args, meta)

    short_query = kv_index is None and num_targets is None and max_seq_len_q <= SHORT_QUERY_ROWS and not fp8
    if short_tiles is not None:
        if not short_query or short_tiles.block_m < max_seq_len_q:
            raise ValueError(
                f"short_tiles needs no kv_index, no num_targets, precision other than 'fp8' and block_m >= "
                f"max_seq_len_q ({max_seq_len_q}), at most {SHORT_QUERY_ROWS}"
            )
        plan = BackwardTiles(short_tiles, short=True)
        meta = options(plan)
    elif dkdv_tiles is not None:
        plan = BackwardTiles(dkdv_tiles, dq_tiles, tma=bulk_dq, split=split_dkdv, halves=column_halves,
                             dv_stages=dv_stages)  # fmt: skip
        if (column_halves or dv_stages) and (not split_dkdv or dq_tiles is not None):
            raise ValueError("column_halves and dv_stages need split_dkdv and dkdv_tiles alone (atomic dQ)")
        if dq_tiles is None and deterministic:
            raise ValueError("deterministic=True needs dq_tiles with dkdv_tiles")
        if bulk_dq and (dq_tiles is not None or not bulk_reduction_ok(q)):
            raise ValueError("bulk_dq needs dkdv_tiles alone, on an sm_90+ GPU with a power-of-two head dim")
        meta = options(plan)
    else:
        # The key fixes short_query too: the flags hold kv_index and targets, the bucket the longest query segment.
        key = ("bwd", deterministic, head_dim, head_dim_v, torch.float8_e4m3fn if fp8 else q.dtype, flags, block_size,
               length_bucket(max_seq_len_q), length_bucket(max_seq_len_kv), heads,
               work_bucket(num_q, heads, k.shape[0], num_kv_segments), bool(libraries))  # fmt: skip

        def candidates() -> list[BackwardTiles | str]:
            plans = backward_candidates(q.dtype, q.device, head_dim, deterministic=deterministic,
                                        block_size=block_size, max_len_q=max_seq_len_q, short_query=short_query,
                                        tma=bulk_reduction_ok(q))  # fmt: skip
            return [*plans, *libraries]

        plan, meta = pick_launch(
            key, (q.device.type, fast), candidates, lambda p: run(p, options(p)), (q, k, v, grad_out), options
        )
    if plan in LIBRARIES:
        return library_backward(plan, *library_inputs, natural_lse=natural_lse)
    run(plan, meta)
    return dq_buffers[q.dtype], dk, dv


def library_backward(
    name: str,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spec: Spec,
    *,
    natural_lse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of library kernel ``name`` (:data:`FLASH` or :data:`VARLEN`): ``(dq, dk, dv)`` from the forward's
    ``out`` and ``lse`` (base 2, or a library's natural-log one with ``natural_lse``)."""
    if name == FLASH:
        return fa4.flash_backward(grad_out, q, k, v, out, lse, spec, natural_lse=natural_lse)
    return varlen_backward(grad_out, q, k, v, out, lse, spec, natural_lse=natural_lse)
