"""The pointwise kernels as torch custom ops (``lightning_gem::silu_split``, ``lightning_gem::norm_mul`` (gated or
not) and their backwards), visible to ``torch.compile``; plain eager calls skip the ops' dispatch (host time only)
through private ``autograd.Function`` s over the same launchers, as GDPA's Triton ops do."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.library import triton_op

from lightning_gem.ops._launch import keep_opaque_when_interpreted, plain_eager, records_graph
from lightning_gem.ops.mx.saved import save_derived, saves_quantized
from lightning_gem.ops.pointwise.impl.triton.kernels import (
    MXRows,
    _silu_split_fwd_kernel,
    norm_mul_backward,
    norm_mul_forward,
    silu_split_backward,
    silu_split_forward,
)

__all__ = ["SUPPORTED_DTYPES", "norm_mul_triton", "norm_triton", "silu_split_triton"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_op("lightning_gem::silu_split", mutates_args=())
def _silu_split_op(x: Tensor, sizes: list[int], bias: Tensor | None) -> list[Tensor]:
    return list(silu_split_forward(x, tuple(sizes), bias))


@triton_op("lightning_gem::silu_split_backward", mutates_args=())
def _silu_split_backward_op(
    x: Tensor, grads: list[Tensor | None], sizes: list[int], bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(dx, dbias)``; an empty tensor for a missing bias (an op's outputs are fixed)."""
    dx, dbias = silu_split_backward(x, tuple(grads), tuple(sizes), bias)
    return dx, x.new_empty(0) if dbias is None else dbias


def _silu_split_setup(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)  # an unused part's gradient stays None: its columns of dX are written as zeros
    ctx.save_for_backward(inputs[0], inputs[2])
    ctx.sizes = inputs[1]


def _silu_split_grad(ctx, grads):
    x, bias = ctx.saved_tensors
    dx, dbias = _silu_split_backward_op(x, list(grads), list(ctx.sizes), bias)
    return dx, None, dbias if bias is not None else None


_silu_split_op.register_autograd(_silu_split_grad, setup_context=_silu_split_setup)


@triton_op("lightning_gem::norm_mul", mutates_args=())
def _norm_mul_op(
    x: Tensor, gate: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float, layer: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return norm_mul_forward(x, gate, weight, bias, eps, layer, out_dtype)


@triton_op("lightning_gem::norm_mul_backward", mutates_args=())
def _norm_mul_backward_op(
    grad: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    layer: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dgate, dweight, dbias)``; empty tensors for a missing gate, weight or bias (an op's outputs are
    fixed)."""
    dx, dgate, dw, db = norm_mul_backward(grad, x, gate, weight, bias, mean, rstd, layer)

    def given(t: Tensor | None) -> Tensor:  # an empty tensor of its own for each missing one: outputs never alias
        return x.new_empty(0, dtype=torch.float32) if t is None else t

    return dx, given(dgate), given(dw), given(db)


def _norm_mul_setup(ctx, inputs, output) -> None:
    x, gate, weight, bias, _eps, layer, _out_dtype = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(x, gate, weight, bias, output[1], output[2])
    ctx.layer = layer


def _norm_mul_grad(ctx, grad_y, _grad_mean, _grad_rstd):
    x, gate, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dgate, dw, db = _norm_mul_backward_op(grad_y, x, gate, weight, bias, mean, rstd, ctx.layer)
    dgate = dgate if gate is not None else None
    return dx, dgate, dw if weight is not None else None, db if bias is not None else None, None, None, None


_norm_mul_op.register_autograd(_norm_mul_grad, setup_context=_norm_mul_setup)


keep_opaque_when_interpreted(
    _silu_split_fwd_kernel, _silu_split_op, _silu_split_backward_op, _norm_mul_op, _norm_mul_backward_op
)


class _SiluSplitEager(torch.autograd.Function):
    """The op and its autograd formula without the custom-op dispatch, for plain eager calls.

    Where a :class:`~lightning_gem.ops.mx.saved.QuantizedSavedTensors` context would store ``x`` in MXFP8 (and the
    parts are whole blocks of 32), the forward writes ``x``'s MX copy itself from the read it makes anyway and saves
    that: the backward reads the copy in ``x``'s place, and the parts, when an op saves them, are recomputed from it
    (:func:`~lightning_gem.ops.mx.saved.save_derived`), with no quantizing or dequantizing pass of their own."""

    @staticmethod
    def forward(ctx, x, sizes, bias):
        ctx.set_materialize_grads(False)
        ctx.sizes = sizes
        saver = saves_quantized(x) if not any(p % 32 for p in sizes) else None
        if saver is None:
            ctx.save_for_backward(x, None, bias)
            ctx.mx_dtype = None
            parts = silu_split_forward(x, sizes, bias)
            save_derived(parts, x, functools.partial(silu_split_forward, sizes=sizes, bias=bias))
            return parts
        *parts, copy = silu_split_forward(x, sizes, bias, save_fp8=True)
        saver.stored_as(x, copy.codes, copy.scales)
        ctx.save_for_backward(copy.codes, copy.scales, bias)  # FP8 codes and uint8 scales: stored as they are
        ctx.mx_dtype = x.dtype
        recompute = functools.partial(_silu_split_from_codes, scales=copy.scales, dtype=x.dtype, sizes=sizes, bias=bias)
        save_derived(parts, copy.codes, recompute)
        return tuple(parts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        x, bias = _saved_input(ctx)
        dx, dbias = silu_split_backward(x, grads, ctx.sizes, bias)
        return dx, None, dbias


def _silu_split_from_codes(codes: Tensor, scales: Tensor, dtype: torch.dtype, sizes, bias) -> tuple[Tensor, ...]:
    return silu_split_forward(MXRows(codes, scales, dtype), sizes, bias)


def _norm_forward_saving(ctx, x: Tensor, gate, weight, bias, eps: float, layer: bool, out_dtype) -> tuple:
    """The norm's forward, saving ``x`` for its backward as its MX copy written by the same kernel where a
    :class:`~lightning_gem.ops.mx.saved.QuantizedSavedTensors` context would store ``x`` in MXFP8 anyway
    (:func:`_saved_input` reads it back); ``(y, mean, rstd)``."""
    saver = saves_quantized(x) if x.shape[-1] % 32 == 0 else None
    if saver is None:
        y, mean, rstd = norm_mul_forward(x, gate, weight, bias, eps, layer, out_dtype)
        ctx.save_for_backward(x, None, gate, weight, bias, mean, rstd)
        ctx.mx_dtype = None
        return y, mean, rstd
    y, mean, rstd, copy = norm_mul_forward(x, gate, weight, bias, eps, layer, out_dtype, save_fp8=True)
    saver.stored_as(x, copy.codes, copy.scales)
    ctx.save_for_backward(copy.codes, copy.scales, gate, weight, bias, mean, rstd)
    ctx.mx_dtype = x.dtype
    return y, mean, rstd


def _saved_input(ctx) -> tuple:
    """What a forward saved as ``(x, None, *rest)`` or, with ``ctx.mx_dtype``, ``(codes, scales, *rest)``:
    ``(x or its MXRows copy, *rest)``."""
    x, scales, *rest = ctx.saved_tensors
    return (x if ctx.mx_dtype is None else MXRows(x, scales, ctx.mx_dtype), *rest)


class _NormMulEager(torch.autograd.Function):
    """The op and its autograd formula without the custom-op dispatch, for plain eager calls."""

    @staticmethod
    def forward(ctx, x, gate, weight, bias, eps, layer, out_dtype):
        ctx.layer = layer
        return _norm_forward_saving(ctx, x, gate, weight, bias, eps, layer, out_dtype)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, gate, weight, bias, mean, rstd = _saved_input(ctx)
        dx, dgate, dw, db = norm_mul_backward(grad_y, x, gate, weight, bias, mean, rstd, ctx.layer)
        return dx, dgate, dw, db, None, None, None


class _NormResidualEager(torch.autograd.Function):
    """``(norm(x), x)``: the norm with ``x`` passed through as a second output, for plain eager calls. Used as the
    residual, that output brings its gradient to this backward, which adds it into the norm's ``dx`` as it writes
    it, where autograd would sum the two gradients of ``x`` in a pass of its own."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, layer, out_dtype):
        y, _, _ = _norm_forward_saving(ctx, x, None, weight, bias, eps, layer, out_dtype)
        ctx.layer = layer
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return y, x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y, grad_x):
        x, _, weight, bias, mean, rstd = _saved_input(ctx)
        if grad_y is None:  # only the residual was used
            return grad_x, None, None, None, None, None
        dx, _, dw, db = norm_mul_backward(grad_y, x, None, weight, bias, mean, rstd, ctx.layer, grad_residual=grad_x)
        return dx, dw, db, None, None, None


def silu_split_triton(x_RW: Tensor, sizes: tuple[int, ...], bias: Tensor | None = None) -> tuple[Tensor, ...]:
    """``SiLU(x + bias)`` split into contiguous parts through the Triton kernels (inputs validated by the caller;
    ``bias`` a contiguous ``[G, W]`` or ``[W]``, or None)."""
    if not plain_eager((x_RW, bias)):
        parts = tuple(_silu_split_op(x_RW, list(sizes), bias))
        if not torch.compiler.is_compiling():  # the op saved x: quantized saves keep x's copy, not the parts
            save_derived(parts, x_RW, functools.partial(silu_split_forward, sizes=sizes, bias=bias))
        return parts
    if records_graph(x_RW) or (bias is not None and records_graph(bias)):
        return _SiluSplitEager.apply(x_RW, sizes, bias)
    return silu_split_forward(x_RW, sizes, bias)


def norm_mul_triton(
    x_RN: Tensor, gate_RN: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, layer: bool
) -> Tensor:
    """``norm(x) * gate`` through the Triton kernels (inputs validated by the caller)."""
    return _norm_gated(x_RN, gate_RN, weight, bias, eps, layer, x_RN.dtype)


def norm_triton(
    x_RN: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, layer: bool, out_dtype: torch.dtype
) -> Tensor:
    """``norm(x)`` in ``out_dtype`` through the Triton kernels (inputs validated by the caller)."""
    return _norm_gated(x_RN, None, weight, bias, eps, layer, out_dtype)


def norm_residual_triton(
    x_RN: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, layer: bool, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(norm(x) in out_dtype, x)`` through the Triton kernels (inputs validated by the caller); in plain eager
    calls the backward adds the second output's gradient into ``dx`` (:class:`_NormResidualEager`). Traced, the
    norm is the custom op and ``x`` itself is the second output (autograd sums the gradients)."""
    tensors = (x_RN, weight, bias)
    if plain_eager(tensors) and records_graph(*(t for t in tensors if t is not None)):
        return _NormResidualEager.apply(x_RN, weight, bias, eps, layer, out_dtype)
    return _norm_gated(x_RN, None, weight, bias, eps, layer, out_dtype), x_RN


def _norm_gated(
    x_RN: Tensor,
    gate_RN: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    layer: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    if not plain_eager((x_RN, gate_RN, weight, bias)):
        return _norm_mul_op(x_RN, gate_RN, weight, bias, eps, layer, out_dtype)[0]
    if records_graph(*(t for t in (x_RN, gate_RN, weight, bias) if t is not None)):
        return _NormMulEager.apply(x_RN, gate_RN, weight, bias, eps, layer, out_dtype)
    return norm_mul_forward(x_RN, gate_RN, weight, bias, eps, layer, out_dtype)[0]
