"""Triton kernels of the per-candidate token ops, forward and backward, and their launchers.

Legend: ``C`` candidates, ``N`` tokens per candidate, ``H`` heads, ``D`` a head's width (a token's for the dots),
``P = N (N - 1) / 2`` token pairs; in kernels ``BLOCK_*`` pad those to powers of two.

Each candidate's ``N x N`` products are far too small for tensor cores (5 x 5 per head), so batched matmuls spend
their time on tiles that are mostly padding while the data they read would take a fraction of it to stream. These
kernels stream it: a program takes a block of candidates (and one head), reads each of their rows once, forms the
``N x N`` scores with elementwise products summed along ``D``, keeps the scores in registers, and mixes the rows by
broadcast multiply-adds into fp32 accumulators. A program holds a ``[BLOCK_C, BLOCK_N, BLOCK_D]`` tile of the side
that stays (queries, outputs, one of the gradients) and reads the other side one token row ``[BLOCK_C, 1, BLOCK_D]``
at a time, so the only sizeable reductions are along ``D``, and the sums over tokens are unrolled loops of
multiply-adds. Rows read a second time (the backward's later passes) come back from the L1/L2 caches: the program
read them just before.

- ``token_attention``: ``softmax(q k^T * scale) v`` per candidate and head, read from and written to the
  projection's own layouts (``qkv [C, N, 3, H, D]``, out ``[C, N, H, D]``), so no permute copies either side.
  The backward recomputes the softmax from ``q`` and ``k`` and writes ``dqkv`` in ``qkv``'s layout.
- ``pairwise_dots``: ``x_n . x_m * scale`` for ``n < m``, in ``torch.triu_indices(N, N, 1)``'s order; ``D`` (a
  token's whole width) in chunks. The backward is ``dx_n = scale * sum_m g_nm x_m`` with ``g`` the symmetric matrix
  of the pairs' gradients, no reduction at all.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, launch, next_power_of_2

__all__ = [
    "pairwise_dots_backward",
    "pairwise_dots_forward",
    "token_attention_backward",
    "token_attention_forward",
]

# Values of one [BLOCK_C, BLOCK_N, BLOCK_D] tile: at 8 warps 16 fp32 registers a thread, so a program's two or
# three live tiles leave room for the products being summed.
_ELEMENTS = 4096

_LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))


@triton.jit
def _column(m, j, t):
    """Column ``t`` of the last axis of ``m [BC, BN, BN]`` as ``[BC, BN, 1]`` (``j``: that axis's indices): a select
    and a sum over ``BN`` values, where indexing a register tile by a position is not expressible."""
    return tl.sum(tl.where(j == t, m, 0.0), axis=2, keep_dims=True)


@triton.jit
def _softmax_probabilities(s):
    """Softmax of base-2 scores along the last axis (padding keys at ``-inf``: every row has a real key)."""
    p = tl.exp2(s - tl.max(s, axis=2, keep_dims=True))
    return p / tl.sum(p, axis=2, keep_dims=True)


# Candidate counts change every batch: no new compiled variant when their divisibility by 16 does.
@triton.jit(do_not_specialize=["num_candidates"])
def _token_attention_fwd_kernel(
    QKV, OUT,  # [C, N, 3, H, D], [C, N, H, D]
    num_candidates, scale,
    N: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = pid % H  # a block's heads are neighbouring programs: together they read the block's rows whole
    c = ((pid // H).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None, None]  # [BC, 1, 1]
    n = tl.arange(0, BLOCK_N)[None, :, None]  # [1, BN, 1] query token
    j = tl.arange(0, BLOCK_N)[None, None, :]  # [1, 1, BN] key token (scores' last axis)
    e = tl.arange(0, BLOCK_D)[None, None, :]  # [1, 1, BD]
    row_ok = (c < num_candidates) & (e < D)  # one token's row of this head
    rows_ok = row_ok & (n < N)
    qkv_row = QKV + c * (N * 3 * H * D) + head * D + e  # token t's q at + t 3HD, its k at + HD more, v at + 2HD
    q = tl.load(qkv_row + n * (3 * H * D), mask=rows_ok, other=0.0).to(tl.float32) * (scale * _LOG2E)
    s = tl.full((BLOCK_C, BLOCK_N, BLOCK_N), float("-inf"), tl.float32)
    for t in tl.static_range(N):
        k_t = tl.load(qkv_row + t * (3 * H * D) + H * D, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.where(j == t, tl.sum(q * k_t, axis=2, keep_dims=True), s)
    p = _softmax_probabilities(s)
    o = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_D), tl.float32)
    for t in tl.static_range(N):
        v_t = tl.load(qkv_row + t * (3 * H * D) + 2 * H * D, mask=row_ok, other=0.0).to(tl.float32)
        o += _column(p, j, t) * v_t
    out = OUT + c * (N * H * D) + n * (H * D) + head * D + e
    tl.store(out, o.to(OUT.dtype.element_ty), mask=rows_ok)


@triton.jit(do_not_specialize=["num_candidates"])
def _token_attention_bwd_kernel(
    QKV, DOUT, DQKV,  # [C, N, 3, H, D], [C, N, H, D], [C, N, 3, H, D]
    num_candidates, scale,
    N: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``S = scale q k^T``, ``P = softmax(S)``, ``dP = dO v^T``, ``dS = P (dP - rowsum(P dP))``; then
    ``dq = dS k``, ``dk = dS^T q``, ``dv = P^T dO`` (``dS`` carrying ``scale``). One pass over the tokens per
    product, each holding one ``[BLOCK_C, BLOCK_N, BLOCK_D]`` tile (two at once cost registers: at ``N = 8``,
    ``D = 256`` on sm_90, 184 a thread against 128): ``S`` (queries held, keys streamed), ``dP`` (``dO`` held, values
    streamed), then ``dq``, ``dk`` and ``dv``, each accumulated over the keys, queries or ``dO`` rows read again."""
    pid = tl.program_id(0)
    head = pid % H
    c = ((pid // H).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None, None]
    n = tl.arange(0, BLOCK_N)[None, :, None]
    j = tl.arange(0, BLOCK_N)[None, None, :]
    e = tl.arange(0, BLOCK_D)[None, None, :]
    row_ok = (c < num_candidates) & (e < D)
    rows_ok = row_ok & (n < N)
    offset = c * (N * 3 * H * D) + head * D + e  # of token 0's q row; + t 3HD, + HD (k), + 2HD (v) as above
    qkv_row, dqkv_row = QKV + offset, DQKV + offset
    dout_row = DOUT + c * (N * H * D) + head * D + e

    q = tl.load(qkv_row + n * (3 * H * D), mask=rows_ok, other=0.0).to(tl.float32)
    s = tl.full((BLOCK_C, BLOCK_N, BLOCK_N), float("-inf"), tl.float32)
    for t in tl.static_range(N):
        k_t = tl.load(qkv_row + t * (3 * H * D) + H * D, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.where(j == t, tl.sum(q * k_t, axis=2, keep_dims=True), s)
    do = tl.load(dout_row + n * (H * D), mask=rows_ok, other=0.0).to(tl.float32)
    dp = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_N), tl.float32)
    for t in tl.static_range(N):
        v_t = tl.load(qkv_row + t * (3 * H * D) + 2 * H * D, mask=row_ok, other=0.0).to(tl.float32)
        dp = tl.where(j == t, tl.sum(do * v_t, axis=2, keep_dims=True), dp)
    p = _softmax_probabilities(s * (scale * _LOG2E))
    ds = p * (dp - tl.sum(p * dp, axis=2, keep_dims=True)) * scale  # padding: p = 0 (keys), dp = 0 (queries)

    dq = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_D), tl.float32)
    for t in tl.static_range(N):
        k_t = tl.load(qkv_row + t * (3 * H * D) + H * D, mask=row_ok, other=0.0).to(tl.float32)
        dq += _column(ds, j, t) * k_t
    tl.store(dqkv_row + n * (3 * H * D), dq.to(DQKV.dtype.element_ty), mask=rows_ok)

    # Transposed once (a small [BC, BN, BN] tile): key j's weights over the queries are then a column again.
    p_t, ds_t = tl.permute(p, (0, 2, 1)), tl.permute(ds, (0, 2, 1))
    dk = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_D), tl.float32)
    for t in tl.static_range(N):
        q_t = tl.load(qkv_row + t * (3 * H * D), mask=row_ok, other=0.0).to(tl.float32)
        dk += _column(ds_t, j, t) * q_t
    tl.store(dqkv_row + n * (3 * H * D) + H * D, dk.to(DQKV.dtype.element_ty), mask=rows_ok)
    dv = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_D), tl.float32)
    for t in tl.static_range(N):
        do_t = tl.load(dout_row + t * (H * D), mask=row_ok, other=0.0).to(tl.float32)
        dv += _column(p_t, j, t) * do_t
    tl.store(dqkv_row + n * (3 * H * D) + 2 * H * D, dv.to(DQKV.dtype.element_ty), mask=rows_ok)


@triton.jit
def _pair_index(lo, hi, N: tl.constexpr):
    """Position of the pair ``(lo, hi)``, ``lo < hi``, in the row-major upper triangle of an ``N x N`` matrix."""
    return lo * N - lo * (lo + 1) // 2 + hi - lo - 1


@triton.jit(do_not_specialize=["num_candidates"])
def _pairwise_dots_fwd_kernel(
    X, OUT,  # [C, N, D], [C, P]
    num_candidates, scale,
    N: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = (tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None, None]
    n = tl.arange(0, BLOCK_N)[None, :, None]
    j = tl.arange(0, BLOCK_N)[None, None, :]
    e = tl.arange(0, BLOCK_D)[None, None, :]
    c_ok = c < num_candidates
    x_row = X + c * (N * D) + e
    g = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_N), tl.float32)  # g[n, j] = x_n . x_j, kept for n < j only
    for start in tl.range(0, D, BLOCK_D):
        ok = c_ok & (start + e < D)
        x = tl.load(x_row + start + n * D, mask=ok & (n < N), other=0.0).to(tl.float32)
        for t in tl.static_range(1, N):
            x_t = tl.load(x_row + start + t * D, mask=ok, other=0.0).to(tl.float32)
            g = tl.where(j == t, g + tl.sum(x * x_t, axis=2, keep_dims=True), g)
    pairs = OUT + c * (N * (N - 1) // 2) + _pair_index(n, j, N)
    tl.store(pairs, (g * scale).to(OUT.dtype.element_ty), mask=c_ok & (n < j) & (j < N))


@triton.jit(do_not_specialize=["num_candidates", "stride_grad"])
def _pairwise_dots_bwd_kernel(
    GRAD, X, DX,  # [C, P] (rows stride_grad apart), [C, N, D], [C, N, D]
    num_candidates, stride_grad, scale,
    N: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = (tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None, None]
    n = tl.arange(0, BLOCK_N)[None, :, None]
    j = tl.arange(0, BLOCK_N)[None, None, :]
    e = tl.arange(0, BLOCK_D)[None, None, :]
    c_ok = c < num_candidates
    # The pairs' gradients as a symmetric [N, N] matrix with a zero diagonal, times the scale.
    pair_ok = c_ok & (n != j) & (n < N) & (j < N)
    pairs = GRAD + c * stride_grad + _pair_index(tl.minimum(n, j), tl.maximum(n, j), N)
    g = tl.load(pairs, mask=pair_ok, other=0.0).to(tl.float32) * scale
    x_row = X + c * (N * D) + e
    for start in tl.range(0, D, BLOCK_D):
        ok = c_ok & (start + e < D)
        dx = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_D), tl.float32)
        for t in tl.static_range(N):
            x_t = tl.load(x_row + start + t * D, mask=ok, other=0.0).to(tl.float32)
            dx += _column(g, j, t) * x_t
        tl.store(DX + c * (N * D) + n * D + start + e, dx.to(DX.dtype.element_ty), mask=ok & (n < N))


def _warps(tile_elements: int) -> int:
    return 8 if tile_elements > 2048 else 4


def _attention_blocks(num_tokens: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_C, BLOCK_N, BLOCK_D)``: a head's whole row per token (the scores need all of it), and as many
    candidates as keep a tile near ``_ELEMENTS`` values (at least one: a wide head makes a larger tile)."""
    block_n, block_d = next_power_of_2(num_tokens), next_power_of_2(head_dim)
    return max(1, min(64, _ELEMENTS // (block_n * block_d))), block_n, block_d


def token_attention_forward(qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """``[C, N, H D]``: per candidate and head ``softmax(q k^T * scale) v`` of a contiguous ``qkv [C, N, 3 H D]``
    (laid out as ``[3, H, D]``), in ``qkv``'s dtype."""
    num_candidates, num_tokens, width = qkv_CNX.shape
    head_dim = width // (3 * num_heads)
    out = qkv_CNX.new_empty(num_candidates, num_tokens, num_heads * head_dim)
    if out.numel() == 0:
        return out
    block_c, block_n, block_d = _attention_blocks(num_tokens, head_dim)
    grid = (cdiv(num_candidates, block_c) * num_heads,)
    args = (qkv_CNX, out, num_candidates, scale, num_tokens, num_heads, head_dim, block_c, block_n, block_d)
    launch(_token_attention_fwd_kernel, grid, args, {"num_warps": _warps(block_c * block_n * block_d)})
    return out


def token_attention_backward(grad_CNY: Tensor, qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """``dqkv`` in ``qkv``'s shape and dtype from the output's gradient ``[C, N, H D]`` (the softmax recomputed)."""
    num_candidates, num_tokens, width = qkv_CNX.shape
    head_dim = width // (3 * num_heads)
    dqkv = qkv_CNX.new_empty(qkv_CNX.shape)
    if dqkv.numel() == 0:
        return dqkv
    block_c, block_n, block_d = _attention_blocks(num_tokens, head_dim)
    grid = (cdiv(num_candidates, block_c) * num_heads,)
    args = (
        qkv_CNX, grad_CNY.contiguous(), dqkv, num_candidates, scale, num_tokens, num_heads, head_dim, block_c,
        block_n, block_d,
    )  # fmt: skip
    launch(_token_attention_bwd_kernel, grid, args, {"num_warps": _warps(block_c * block_n * block_d)})
    return dqkv


def _dots_blocks(num_tokens: int, width: int) -> tuple[int, int, int]:
    """``(BLOCK_C, BLOCK_N, BLOCK_D)`` of the pairwise-dot kernels: ``D`` in chunks, a tile near ``_ELEMENTS``."""
    block_n = next_power_of_2(num_tokens)
    block_d = min(next_power_of_2(width), max(64, _ELEMENTS // block_n))
    return max(1, min(64, _ELEMENTS // (block_n * block_d))), block_n, block_d


def pairwise_dots_forward(x_CND: Tensor, scale: float) -> Tensor:
    """``[C, P]``: ``x_n . x_m * scale`` of each pair ``n < m`` of a contiguous ``x [C, N, D]``, in ``x``'s dtype."""
    num_candidates, num_tokens, width = x_CND.shape
    out = x_CND.new_empty(num_candidates, num_tokens * (num_tokens - 1) // 2)
    if out.numel() == 0:
        return out
    block_c, block_n, block_d = _dots_blocks(num_tokens, width)
    args = (x_CND, out, num_candidates, scale, num_tokens, width, block_c, block_n, block_d)
    warps = _warps(block_c * block_n * block_d)
    launch(_pairwise_dots_fwd_kernel, (cdiv(num_candidates, block_c),), args, {"num_warps": warps})
    return out


def pairwise_dots_backward(grad_CP: Tensor, x_CND: Tensor, scale: float) -> Tensor:
    """``dx`` in ``x``'s shape and dtype from the pairs' gradient ``[C, P]`` (rows may be strided, as a column slice
    of a wider gradient is)."""
    num_candidates, num_tokens, width = x_CND.shape
    if grad_CP.numel() == 0 or x_CND.numel() == 0:  # no pairs (N <= 1), no candidates or no width
        return x_CND.new_zeros(x_CND.shape)
    dx = x_CND.new_empty(x_CND.shape)
    if grad_CP.stride(1) != 1:
        grad_CP = grad_CP.contiguous()
    block_c, block_n, block_d = _dots_blocks(num_tokens, width)
    args = (grad_CP, x_CND, dx, num_candidates, grad_CP.stride(0), scale, num_tokens, width, block_c, block_n, block_d)
    warps = _warps(block_c * block_n * block_d)
    launch(_pairwise_dots_bwd_kernel, (cdiv(num_candidates, block_c),), args, {"num_warps": warps})
    return dx
