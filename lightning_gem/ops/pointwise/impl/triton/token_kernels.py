"""Triton kernels of the per-candidate token ops, forward and backward, and their launchers.

Legend: ``C`` candidates, ``N`` tokens per candidate, ``H`` heads, ``D`` a head's width (a token's for the dots),
``P = N (N - 1) / 2`` token pairs, ``R`` token rows of a program; in kernels ``BLOCK_*`` pad those to powers of two.

Each candidate's ``N x N`` products are far too small for tensor cores on their own (5 x 5 per head), and batched
matmuls spend their time on tiles that are mostly padding. These kernels take the candidates' token rows as they lie
in memory, ``BLOCK_R`` consecutive rows a program (``BLOCK_R // N`` whole candidates, so at most ``N - 1`` rows of
padding), and compute every product of the tile's rows with one ``tl.dot`` (``[BLOCK_R, BLOCK_R]``): the products
of tokens of different candidates are computed and masked out. Those wasted products cost little (``BLOCK_R`` is
64 or so, against a row's ``D`` loads), and in exchange every load is a dense ``[BLOCK_R, BLOCK_D]`` tile and every
mix of rows (``P v``, the backward's ``dS k``, ``dS^T q``, ``P^T dO``, the dots' ``g x``) is one more ``tl.dot`` of
the same masked matrix, with no cross-thread reductions beyond the softmax's.

- ``token_attention``: ``softmax(q k^T * scale) v`` per candidate and head, read from and written to the
  projection's own layouts (``qkv [C, N, 3, H, D]``, out ``[C, N, H, D]``), so no permute copies either side.
  A head's whole row per token (the scores need all of it). The backward recomputes the softmax from ``q`` and
  ``k`` and writes ``dqkv`` in ``qkv``'s layout.
- ``pairwise_dots``: ``x_n . x_m * scale`` for ``n < m``, in ``torch.triu_indices(N, N, 1)``'s order; ``D`` (a
  token's whole width) in chunks. The backward is ``dx_n = scale * sum_m g_nm x_m`` with ``g`` the symmetric matrix
  of the pairs' gradients.

Products are taken in the inputs' dtype with fp32 accumulation (``tl.dot``), the softmax in fp32; ``P`` and ``dS``
go back to the inputs' dtype for the products that mix rows, as a batched matmul of the unfused layer does. fp32
inputs multiply in full fp32 (``"ieee"``), not TF32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from lightning_gem.ops._launch import cdiv, dot_precision, launch, next_power_of_2
from lightning_gem.ops.pointwise.impl.triton.kernels import tile_warps

__all__ = [
    "pairwise_dots_backward",
    "pairwise_dots_forward",
    "token_attention_backward",
    "token_attention_forward",
]

_LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))

# Triton 3.6's interpreter multiplies bf16 tiles wrongly in tl.dot (it reads their bits as integers): interpreted,
# the products take fp32 copies of the operands, exact where the GPU rounds nothing either.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` in fp32 (``tl.dot``'s accumulator), the operands in their own dtype."""
    if _INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _rows(num_candidates, N: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's token rows: ``(row [BLOCK_R] int64 global row index, cand [BLOCK_R] its candidate within the
    tile, ok [BLOCK_R])``. A tile holds ``BLOCK_R // N`` whole candidates; the rows past them are padding."""
    per_tile = BLOCK_R // N
    r = tl.arange(0, BLOCK_R)
    cand = r // N
    first = tl.program_id(0).to(tl.int64) * per_tile
    ok = (cand < per_tile) & (first + cand < num_candidates)
    return first * N + r, cand, ok


@triton.jit
def _same_candidate(cand, ok):
    """``[BLOCK_R, BLOCK_R]``: whether two rows are tokens of one real candidate."""
    return (cand[:, None] == cand[None, :]) & ok[:, None] & ok[None, :]


@triton.jit
def _softmax(s, same):
    """Softmax along the last axis of base-2 scores, other candidates' tokens masked out. A padding row keeps a
    finite row (its own diagonal): it is never stored."""
    diagonal = tl.arange(0, s.shape[0])[:, None] == tl.arange(0, s.shape[1])[None, :]
    s = tl.where(same | diagonal, s, float("-inf"))
    p = tl.exp2(s - tl.max(s, axis=1)[:, None])
    return p / tl.sum(p, axis=1)[:, None]


# Candidate counts change every batch: no new compiled variant when their divisibility by 16 does.
@triton.jit(do_not_specialize=["num_candidates"])
def _token_attention_fwd_kernel(
    QKV, OUT,  # [C N, 3, H, D], [C N, H, D]
    num_candidates, scale,
    N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    row, cand, ok = _rows(num_candidates, N, BLOCK_R)
    head = tl.program_id(1)
    e = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (e[None, :] < D)
    qkv = QKV + row[:, None] * (3 * H * D) + head * D + e[None, :]  # q; k at + H D, v at + 2 H D
    q = tl.load(qkv, mask=mask, other=0.0)
    k = tl.load(qkv + H * D, mask=mask, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION) * (scale * _LOG2E)
    p = _softmax(s, _same_candidate(cand, ok))
    v = tl.load(qkv + 2 * H * D, mask=mask, other=0.0)
    o = _dot(p.to(v.dtype), v, PRECISION)
    tl.store(OUT + row[:, None] * (H * D) + head * D + e[None, :], o.to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_candidates"])
def _token_attention_bwd_kernel(
    QKV, DOUT, DQKV,  # [C N, 3, H, D], [C N, H, D], [C N, 3, H, D]
    num_candidates, scale,
    N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``S = scale q k^T``, ``P = softmax(S)``, ``dP = dO v^T``, ``dS = P (dP - rowsum(P dP))``; then
    ``dq = dS k``, ``dk = dS^T q``, ``dv = P^T dO`` (``dS`` carrying ``scale``)."""
    row, cand, ok = _rows(num_candidates, N, BLOCK_R)
    head = tl.program_id(1)
    e = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (e[None, :] < D)
    offset = row[:, None] * (3 * H * D) + head * D + e[None, :]  # q; k at + H D, v at + 2 H D
    q = tl.load(QKV + offset, mask=mask, other=0.0)
    k = tl.load(QKV + offset + H * D, mask=mask, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION)
    do = tl.load(DOUT + row[:, None] * (H * D) + head * D + e[None, :], mask=mask, other=0.0)
    v = tl.load(QKV + offset + 2 * H * D, mask=mask, other=0.0)
    dp = _dot(do, tl.trans(v), PRECISION)
    p = _softmax(s * (scale * _LOG2E), _same_candidate(cand, ok))  # zero off a candidate's own tokens
    ds = (p * (dp - tl.sum(p * dp, axis=1)[:, None]) * scale).to(q.dtype)
    dq = _dot(ds, k, PRECISION)
    tl.store(DQKV + offset, dq.to(DQKV.dtype.element_ty), mask=mask)
    dk = _dot(tl.trans(ds), q, PRECISION)
    tl.store(DQKV + offset + H * D, dk.to(DQKV.dtype.element_ty), mask=mask)
    dv = _dot(tl.trans(p.to(do.dtype)), do, PRECISION)
    tl.store(DQKV + offset + 2 * H * D, dv.to(DQKV.dtype.element_ty), mask=mask)


@triton.jit
def _pair_index(lo, hi, N: tl.constexpr):
    """Position of the pair ``(lo, hi)``, ``lo < hi``, in the row-major upper triangle of an ``N x N`` matrix."""
    return lo * N - lo * (lo + 1) // 2 + hi - lo - 1


@triton.jit(do_not_specialize=["num_candidates"])
def _pairwise_dots_fwd_kernel(
    X, OUT,  # [C N, D], [C, P]
    num_candidates, scale,
    N: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row, cand, ok = _rows(num_candidates, N, BLOCK_R)
    e = tl.arange(0, BLOCK_D)
    g = tl.zeros((BLOCK_R, BLOCK_R), tl.float32)
    for start in tl.range(0, D, BLOCK_D):
        x = tl.load(X + row[:, None] * D + start + e[None, :], mask=ok[:, None] & (start + e[None, :] < D), other=0.0)
        g += _dot(x, tl.trans(x), PRECISION)
    n, m = (row % N)[:, None], (row % N)[None, :]
    pairs = OUT + (row // N)[:, None] * (N * (N - 1) // 2) + _pair_index(n, m, N)
    tl.store(pairs, (g * scale).to(OUT.dtype.element_ty), mask=_same_candidate(cand, ok) & (n < m))


@triton.jit(do_not_specialize=["num_candidates", "stride_grad"])
def _pairwise_dots_bwd_kernel(
    GRAD, X, DX,  # [C, P] (rows stride_grad apart), [C N, D], [C N, D]
    num_candidates, stride_grad, scale,
    N: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row, cand, ok = _rows(num_candidates, N, BLOCK_R)
    # The pairs' gradients as a symmetric [R, R] matrix, zero on the diagonal and between candidates.
    n, m = (row % N)[:, None], (row % N)[None, :]
    pair_ok = _same_candidate(cand, ok) & (n != m)
    pairs = GRAD + (row // N)[:, None] * stride_grad + _pair_index(tl.minimum(n, m), tl.maximum(n, m), N)
    g = tl.load(pairs, mask=pair_ok, other=0.0).to(X.dtype.element_ty)
    e = tl.arange(0, BLOCK_D)
    for start in tl.range(0, D, BLOCK_D):
        mask = ok[:, None] & (start + e[None, :] < D)
        x = tl.load(X + row[:, None] * D + start + e[None, :], mask=mask, other=0.0)
        dx = _dot(g, x, PRECISION) * scale
        tl.store(DX + row[:, None] * D + start + e[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def _row_block(num_tokens: int, block_d: int, elements: int) -> int:
    """``BLOCK_R``: rows that keep a ``[BLOCK_R, BLOCK_D]`` tile near ``elements`` values, from 16 (``tl.dot``'s
    least) to 128, and at least one candidate's tokens."""
    return max(16, next_power_of_2(num_tokens), min(128, elements // block_d))


def token_attention_forward(qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """``[C, N, H D]``: per candidate and head ``softmax(q k^T * scale) v`` of a contiguous ``qkv [C, N, 3 H D]``
    (laid out as ``[3, H, D]``), in ``qkv``'s dtype."""
    num_candidates, num_tokens, width = qkv_CNX.shape
    head_dim = width // (3 * num_heads)
    out = qkv_CNX.new_empty(num_candidates, num_tokens, num_heads * head_dim)
    if out.numel() == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    block_r = _row_block(num_tokens, block_d, 16384)
    grid = (cdiv(num_candidates, block_r // num_tokens), num_heads)
    precision = dot_precision(out.dtype)
    args = (qkv_CNX, out, num_candidates, scale, num_tokens, num_heads, head_dim, block_r, block_d, precision)
    launch(_token_attention_fwd_kernel, grid, args, {"num_warps": tile_warps(block_r * block_d)})
    return out


def token_attention_backward(grad_CNY: Tensor, qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """``dqkv`` in ``qkv``'s shape and dtype from the output's gradient ``[C, N, H D]`` (the softmax recomputed)."""
    num_candidates, num_tokens, width = qkv_CNX.shape
    head_dim = width // (3 * num_heads)
    dqkv = qkv_CNX.new_empty(qkv_CNX.shape)
    if dqkv.numel() == 0:
        return dqkv
    block_d = max(16, next_power_of_2(head_dim))
    block_r = _row_block(num_tokens, block_d, 8192)  # four operand tiles live at once
    grid = (cdiv(num_candidates, block_r // num_tokens), num_heads)
    args = (
        qkv_CNX, grad_CNY.contiguous(), dqkv, num_candidates, scale, num_tokens, num_heads, head_dim, block_r,
        block_d, dot_precision(dqkv.dtype),
    )  # fmt: skip
    launch(_token_attention_bwd_kernel, grid, args, {"num_warps": tile_warps(block_r * block_d)})
    return dqkv


def _dots_blocks(num_tokens: int, width: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)`` of the pairwise-dot kernels: ``D`` in chunks of at most 128."""
    block_d = min(128, max(16, next_power_of_2(width)))
    return _row_block(num_tokens, block_d, 8192), block_d


def pairwise_dots_forward(x_CND: Tensor, scale: float) -> Tensor:
    """``[C, P]``: ``x_n . x_m * scale`` of each pair ``n < m`` of a contiguous ``x [C, N, D]``, in ``x``'s dtype."""
    num_candidates, num_tokens, width = x_CND.shape
    out = x_CND.new_empty(num_candidates, num_tokens * (num_tokens - 1) // 2)
    if out.numel() == 0:
        return out
    block_r, block_d = _dots_blocks(num_tokens, width)
    args = (x_CND, out, num_candidates, scale, num_tokens, width, block_r, block_d, dot_precision(x_CND.dtype))
    grid = (cdiv(num_candidates, block_r // num_tokens),)
    launch(_pairwise_dots_fwd_kernel, grid, args, {"num_warps": tile_warps(block_r * block_d)})
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
    block_r, block_d = _dots_blocks(num_tokens, width)
    args = (grad_CP, x_CND, dx, num_candidates, grad_CP.stride(0), scale, num_tokens, width, block_r, block_d,
            dot_precision(x_CND.dtype))  # fmt: skip
    grid = (cdiv(num_candidates, block_r // num_tokens),)
    launch(_pairwise_dots_bwd_kernel, grid, args, {"num_warps": tile_warps(block_r * block_d)})
    return dx
