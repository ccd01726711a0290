"""The token-op kernels as torch custom ops (``lightning_gem::token_attention``, ``lightning_gem::pairwise_dots`` and
their backwards), visible to ``torch.compile`` and counted by FLOP counters; plain eager calls skip the ops' dispatch
(host time only) through private ``autograd.Function`` s over the same launchers, as the other pointwise ops do.

The FLOP formulas count the useful products: those of the two attention matmuls per candidate (and the four of
their backward) and, for the dots, the ``P`` pairs only; the kernels' masked products between different candidates
of a tile are not counted.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op
from torch.utils.flop_counter import register_flop_formula

from lightning_gem.ops._launch import keep_opaque_when_interpreted, plain_eager, records_graph
from lightning_gem.ops.pointwise.impl.triton.token_kernels import (
    _token_attention_fwd_kernel,
    pairwise_dots_backward,
    pairwise_dots_forward,
    token_attention_backward,
    token_attention_forward,
)

__all__ = ["pairwise_dots_triton", "token_attention_triton"]


@triton_op("lightning_gem::token_attention", mutates_args=())
def _token_attention_op(qkv: Tensor, num_heads: int, scale: float) -> Tensor:
    return token_attention_forward(qkv, num_heads, scale)


@triton_op("lightning_gem::token_attention_backward", mutates_args=())
def _token_attention_backward_op(grad: Tensor, qkv: Tensor, num_heads: int, scale: float) -> Tensor:
    return token_attention_backward(grad, qkv, num_heads, scale)


def _token_attention_setup(ctx, inputs, output) -> None:
    qkv, num_heads, scale = inputs
    ctx.save_for_backward(qkv)  # the softmax is recomputed: nothing else is kept
    ctx.num_heads, ctx.scale = num_heads, scale


def _token_attention_grad(ctx, grad):
    (qkv,) = ctx.saved_tensors
    return _token_attention_backward_op(grad, qkv, ctx.num_heads, ctx.scale), None, None


_token_attention_op.register_autograd(_token_attention_grad, setup_context=_token_attention_setup)


@triton_op("lightning_gem::pairwise_dots", mutates_args=())
def _pairwise_dots_op(x: Tensor, scale: float) -> Tensor:
    return pairwise_dots_forward(x, scale)


@triton_op("lightning_gem::pairwise_dots_backward", mutates_args=())
def _pairwise_dots_backward_op(grad: Tensor, x: Tensor, scale: float) -> Tensor:
    return pairwise_dots_backward(grad, x, scale)


def _pairwise_dots_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _pairwise_dots_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return _pairwise_dots_backward_op(grad, x, ctx.scale), None


_pairwise_dots_op.register_autograd(_pairwise_dots_grad, setup_context=_pairwise_dots_setup)


keep_opaque_when_interpreted(
    _token_attention_fwd_kernel,
    _token_attention_op,
    _token_attention_backward_op,
    _pairwise_dots_op,
    _pairwise_dots_backward_op,
)


def _attention_flops(qkv: Tensor, backward: bool) -> int:
    """``q k^T`` and ``P v``: ``2 C H N^2 D`` each (``H D`` = a third of ``qkv``'s width); the backward has four."""
    num_candidates, num_tokens, width = qkv.shape
    per_matmul = 2 * num_candidates * num_tokens * num_tokens * (width // 3)
    return (4 if backward else 2) * per_matmul


def _dots_flops(x: Tensor, backward: bool) -> int:
    """``2 D`` a pair forward; the backward adds each pair's gradient times the other token to both tokens."""
    num_candidates, num_tokens, width = x.shape
    pairs = num_candidates * num_tokens * (num_tokens - 1) // 2
    return (4 if backward else 2) * pairs * width


@register_flop_formula(torch.ops.lightning_gem.token_attention, get_raw=True)
def _token_attention_flops(qkv, num_heads, scale, *args, out_val=None, **kwargs) -> int:
    return _attention_flops(qkv, backward=False)


@register_flop_formula(torch.ops.lightning_gem.token_attention_backward, get_raw=True)
def _token_attention_backward_flops(grad, qkv, num_heads, scale, *args, out_val=None, **kwargs) -> int:
    return _attention_flops(qkv, backward=True)


@register_flop_formula(torch.ops.lightning_gem.pairwise_dots, get_raw=True)
def _pairwise_dots_flops(x, scale, *args, out_val=None, **kwargs) -> int:
    return _dots_flops(x, backward=False)


@register_flop_formula(torch.ops.lightning_gem.pairwise_dots_backward, get_raw=True)
def _pairwise_dots_backward_flops(grad, x, scale, *args, out_val=None, **kwargs) -> int:
    return _dots_flops(x, backward=True)


class _TokenAttentionEager(torch.autograd.Function):
    """The op and its autograd formula without the custom-op dispatch, for plain eager calls."""

    @staticmethod
    def forward(ctx, qkv, num_heads, scale):
        ctx.save_for_backward(qkv)
        ctx.num_heads, ctx.scale = num_heads, scale
        return token_attention_forward(qkv, num_heads, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (qkv,) = ctx.saved_tensors
        return token_attention_backward(grad, qkv, ctx.num_heads, ctx.scale), None, None


class _PairwiseDotsEager(torch.autograd.Function):
    """The op and its autograd formula without the custom-op dispatch, for plain eager calls."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return pairwise_dots_forward(x, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return pairwise_dots_backward(grad, x, ctx.scale), None


def token_attention_triton(qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """Per-candidate, per-head softmax attention of a contiguous ``qkv`` through the Triton kernels (inputs validated
    by the caller)."""
    if not plain_eager((qkv_CNX,)):
        return _token_attention_op(qkv_CNX, num_heads, scale)
    if records_graph(qkv_CNX):
        return _TokenAttentionEager.apply(qkv_CNX, num_heads, scale)
    return token_attention_forward(qkv_CNX, num_heads, scale)


def pairwise_dots_triton(x_CND: Tensor, scale: float) -> Tensor:
    """The scaled dot products of each candidate's token pairs of a contiguous ``x`` through the Triton kernels
    (inputs validated by the caller)."""
    if not plain_eager((x_CND,)):
        return _pairwise_dots_op(x_CND, scale)
    if records_graph(x_CND):
        return _PairwiseDotsEager.apply(x_CND, scale)
    return pairwise_dots_forward(x_CND, scale)
