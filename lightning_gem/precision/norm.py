"""RMSNorm / LayerNorm whose output is quantized by the norm's own kernel for the Linear it feeds.

:func:`lightning_gem.precision.convert` swaps the class of a norm that feeds a converted Linear of matching
width (``fuse_norm=True``): the pairs a module declares in ``norm_consumers()``, else the norm registered right
before the Linear. While training, the norm then runs
:func:`lightning_gem.ops.mx.norm_quantize`: one pass writes its output and that output quantized in the
Linear's layout, and hands both to the Linear, which uses the quantized copy only if its input *is* that
output (any other reader, or a different input, gets the ordinary path). Parameters and state-dict keys
are the original norm's. The backward is the norm's exact backward in fp32.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from lightning_gem.ops.mx import QuantizedTensor, dequantize, norm_quantize
from lightning_gem.ops.mx.saved import saves_quantized
from lightning_gem.precision.config import resolve_plan
from lightning_gem.precision.linear import MXLinear, NormHandoff

__all__ = ["MXLayerNorm", "MXRMSNorm", "fuse_norm"]


class _FusedNormMixin:
    """Shared forward of the fused norms; the subclasses only say which norm they are."""

    norm_kind: str
    _consumer: weakref.ref

    @torch.compiler.disable  # eager under torch.compile, as MXLinear.forward (whose input it hands over)
    def forward(self, input: Tensor) -> Tensor:
        out = self._fused(input, residual=False)
        return super().forward(input) if out is None else out[0]

    @torch.compiler.disable
    def forward_residual(self, input: Tensor) -> tuple[Tensor, Tensor]:
        """``(norm(input), input)`` for a pre-norm residual block ``x + f(norm(x))``: take the second output as the
        residual. Fused, its gradient comes to the norm's backward, which adds it into ``dx`` as it writes it (where
        autograd would sum the two gradients of ``input`` in a pass of its own)."""
        out = self._fused(input, residual=True)
        return (super().forward(input), input) if out is None else out

    def _fused(self, input: Tensor, residual: bool) -> tuple[Tensor, ...] | None:
        """The fused norm's ``(y,)`` (``(y, input)`` with ``residual``), its quantized ``y`` handed to the consumer;
        None where the consumer cannot take it."""
        consumer = self._consumer()
        if consumer is None or not torch.is_grad_enabled() or input.shape[-1] != consumer.in_features:
            return None
        plan = resolve_plan(consumer.mx_config, input.device)
        if consumer.mx_hadamard or not consumer._eligible(plan) or input.ndim != 2:
            return None
        device_type = input.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        weight = self.weight if self.elementwise_affine else None
        bias = getattr(self, "bias", None)
        with torch.autocast(device_type, enabled=False):
            y, q_data, q_scale, rstd, mean, x_codes, x_scales, *passed = _FusedNormFn.apply(
                input,
                weight,
                bias,
                self.norm_kind,
                self._eps(input.dtype),
                plan.act_layout,
                consumer.mx_config.rounding,
                dtype,
                residual,
            )
        q = QuantizedTensor(q_data, q_scale, plan.act_layout)
        x_mx = None if x_codes is None else QuantizedTensor(x_codes, x_scales, "mx")
        consumer._handoff = NormHandoff(
            y, q, input, rstd, mean if self.norm_kind == "layer" else None, weight, bias, self.norm_kind, x_mx
        )
        return (y, *passed)

    def _eps(self, dtype: torch.dtype) -> float:
        return torch.finfo(dtype).eps if self.eps is None else float(self.eps)  # nn.RMSNorm's default


class MXRMSNorm(_FusedNormMixin, nn.RMSNorm):
    """``nn.RMSNorm`` fused with the quantization of the Linear it feeds."""

    norm_kind = "rms"


class MXLayerNorm(_FusedNormMixin, nn.LayerNorm):
    """``nn.LayerNorm`` fused with the quantization of the Linear it feeds."""

    norm_kind = "layer"


def fuse_norm(norm: nn.Module, consumer: MXLinear) -> nn.Module:
    """Swap ``norm``'s class in place to its fused version feeding ``consumer`` (idempotent)."""
    norm.__class__ = MXRMSNorm if isinstance(norm, nn.RMSNorm) else MXLayerNorm
    norm._consumer = weakref.ref(consumer)
    return norm


class _FusedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kind, eps, layout, rounding, out_dtype, residual):
        # Where a saved-activation context would store x in MXFP8, the norm's kernel writes that copy from its own
        # read of x; this backward and the Linear it feeds (through the handoff) read the copy, and another save of x
        # in the context takes it too (stored_as).
        saver = saves_quantized(x)
        out = norm_quantize(
            x, weight, bias, kind=kind, eps=eps, layout=layout, rounding=rounding, write_output=True,
            out_dtype=out_dtype, save_input=saver is not None,
        )  # fmt: skip
        mean = out.mean if out.mean is not None else out.rstd.new_empty(0)
        if saver is None:
            ctx.save_for_backward(x, None, weight, bias, out.rstd, out.mean)  # a mean: LayerNorm
            ctx.mx_dtype = None
            x_codes = x_scales = None
        else:
            x_codes, x_scales = out.x_mx.data, out.x_mx.scale
            saver.stored_as(x, x_codes, x_scales)
            ctx.save_for_backward(x_codes, x_scales, weight, bias, out.rstd, out.mean)
            ctx.mx_dtype = x.dtype
        copy = () if x_codes is None else (x_codes, x_scales)
        ctx.mark_non_differentiable(out.q.data, out.q.scale, out.rstd, mean, *copy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        # The copy goes to the Linear too (its weight gradient's operand is rebuilt from it); residual: x passed
        # through as a last output, its gradient added into dx by the backward.
        return (out.y, out.q.data, out.q.scale, out.rstd, mean, x_codes, x_scales, *((x,) if residual else ()))

    @staticmethod
    def backward(ctx, grad_y, *grads):
        x, scales, weight, bias, rstd, mean = ctx.saved_tensors
        grad_residual = grads[6] if len(grads) > 6 else None
        nones = (None,) * 6
        if grad_y is None:  # only the residual (or nothing) was used
            return grad_residual, None, None, *nones
        dtype = x.dtype if ctx.mx_dtype is None else ctx.mx_dtype
        if _norm_kernels_run(grad_y):  # one pass: dx (the residual's gradient added), the weight's and bias's sums
            from lightning_gem.ops.pointwise.impl.triton.kernels import MXRows, norm_mul_backward

            layer = mean is not None
            x = x.contiguous() if ctx.mx_dtype is None else MXRows(x, scales, dtype)  # the copy, read in place
            grad_x, _, grad_w, grad_b = norm_mul_backward(
                grad_y, x, None, weight, bias, mean if layer else rstd, rstd, layer, grad_residual=grad_residual
            )
            return grad_x, grad_w, grad_b, *nones
        if ctx.mx_dtype is not None:
            x = dequantize(QuantizedTensor(x, scales, "mx"), dtype)
        xhat = x.float()
        if mean is not None:
            xhat = xhat - mean[:, None]
        xhat = xhat * rstd[:, None]
        dy = grad_y.float()
        dxhat = dy * weight.float() if weight is not None else dy
        grad_x = dxhat - xhat * (dxhat * xhat).mean(dim=1, keepdim=True)
        if mean is not None:
            grad_x = grad_x - dxhat.mean(dim=1, keepdim=True)
        grad_x = (grad_x * rstd[:, None]).to(dtype)
        grad_w = (dy * xhat).sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = dy.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        if grad_residual is not None:
            grad_x = grad_x + grad_residual
        return grad_x, grad_w, grad_b, *nones


def _norm_kernels_run(x: Tensor) -> bool:
    """Whether the pointwise ops' ``impl="auto"`` takes their Triton kernels for ``x`` (CUDA floats; the norm's
    backward asks of its incoming gradient, whose device and dtype are its input's or the autocast dtype)."""
    from lightning_gem.ops._launch import resolve_triton_impl
    from lightning_gem.ops.pointwise import IMPLS

    return resolve_triton_impl("auto", IMPLS, x, lambda: None) == "triton"
