"""``MXLinear``: an ``nn.Linear`` whose three GEMMs run on block-scaled FP8 operands.

Legend: ``M`` tokens, ``K`` input features, ``N`` output features; every GEMM is ``a @ b^T`` with both
operands quantized along the contraction dim:

- forward ``y = x W^T``: ``x [M, K]`` and ``W [N, K]`` along ``K``;
- input gradient ``dx = dy W``: ``dy [M, N]`` and ``W^T [K, N]`` along ``N`` (a ``128x128`` weight tile is
  symmetric, so its transpose is the forward's quantized weight transposed, not a new quantization: the
  forward's read of ``W`` writes both);
- weight gradient ``dW = dy^T x``: ``dy^T [N, M]`` and ``x^T [K, M]`` along the tokens ``M`` (zero-padded
  to the block), each read once together with its row layout.

The parameters, their names and dtypes are ``nn.Linear``'s (checkpoints and FSDP see an ``nn.Linear``);
only the arithmetic changes. The input is cast to the autocast dtype (bf16 under the plugin) and the
output is in that dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_gem.ops.mx import QuantizedTensor, quantization_stats, quantize, random_hadamard, scaled_mm
from lightning_gem.precision.config import MXConfig, Plan, resolve_plan

__all__ = ["MXLinear", "NormHandoff"]

log = logging.getLogger(__name__)

STAT_NAMES = ("saturated", "underflowed", "nonfinite", "total")
OPERANDS = ("input", "weight", "grad_output")


@dataclass
class NormHandoff:
    """A fused norm's output handed to the Linear it feeds: the Linear skips re-quantizing ``y``.

    Attributes:
        y: the norm's output tensor (identity tells the Linear its input is this one).
        q: ``y`` quantized along its features in the Linear's activation layout.
        norm_input, rstd, mean, weight, bias, kind: what rebuilds ``y``'s transposed quantization for the
            weight gradient without storing ``y``.
        norm_input_mx: the norm input's MX copy where the norm wrote one for a saved-activation context: the
            Linear saves it in place of ``norm_input`` and rebuilds that operand from it.
    """

    y: Tensor
    q: QuantizedTensor
    norm_input: Tensor
    rstd: Tensor
    mean: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    kind: str
    norm_input_mx: QuantizedTensor | None = None


class MXLinear(nn.Linear):
    """``nn.Linear`` computing forward, input gradient and weight gradient with quantized operands.

    Made by :func:`lightning_gem.precision.convert` (or :meth:`from_linear`), which swaps the class of an
    existing ``nn.Linear`` in place: parameters, hooks and state-dict keys stay.

    Example:
        >>> layer = MXLinear.from_linear(nn.Linear(64, 32), MXConfig(recipe="mxfp8"))
        >>> layer(torch.randn(5, 64)).shape
        torch.Size([5, 32])
    """

    mx_config: MXConfig
    mx_seed: int
    mx_hadamard: bool

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MXConfig, *, seed: int = 0, hadamard: bool = False) -> MXLinear:
        """Turn ``linear`` into an ``MXLinear`` in place (idempotent) and return it."""
        linear.__class__ = cls
        linear.mx_config = config
        linear.mx_seed = seed
        linear.mx_hadamard = hadamard
        linear.collect_stats = False
        linear.quant_stats = None
        linear._handoff = None
        return linear

    def _eligible(self, plan: Plan) -> bool:
        return self.in_features % plan.multiple == 0 and self.out_features % plan.multiple == 0

    # Eager under torch.compile (a graph break): Dynamo (torch 2.11) does not trace the tuned Triton launches with
    # dynamic shapes, and the fused norm hands its quantized output over as module state.
    @torch.compiler.disable
    def forward(self, input: Tensor) -> Tensor:
        handoff, self._handoff = self._handoff, None
        plan = resolve_plan(self.mx_config, input.device)
        if not self._eligible(plan):
            _warn_ineligible(self, plan)
            return super().forward(input)
        if input.numel() == 0:  # no tokens (an empty jagged batch): nothing to quantize
            return super().forward(input)
        device_type = input.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            dtype = torch.float32
        if handoff is not None and (handoff.y is not input or self.mx_hadamard or input.dtype != dtype):
            handoff = None
        lead = input.shape[:-1]
        with torch.autocast(device_type, enabled=False):
            x2d = input.reshape(-1, self.in_features).to(dtype)
            out = _MXLinearFn.apply(x2d, self.weight, self.bias, self, plan, handoff)
        return out.reshape(*lead, self.out_features)

    def record_stats(self, operand: str, x: Tensor, layout: str) -> None:
        """Add ``x``'s saturation/underflow counts (rows along the contraction dim) to :attr:`quant_stats`."""
        counts = quantization_stats(x.detach(), layout, self.mx_config.rounding)
        if self.quant_stats is None:
            self.quant_stats = torch.zeros(len(OPERANDS), len(STAT_NAMES), dtype=torch.int64, device=x.device)
        self.quant_stats[OPERANDS.index(operand)] += counts

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.mx_config.recipe}, hadamard={self.mx_hadamard}"


_warned: set[tuple[int, int, str, int]] = set()


def _warn_ineligible(layer: MXLinear, plan: Plan) -> None:
    """One warning per shape and backend in a process (a model's layers share a few shapes)."""
    key = (layer.in_features, layer.out_features, plan.backend, plan.multiple)
    if key not in _warned:
        _warned.add(key)
        log.warning(
            f"Linear({layer.in_features}, {layer.out_features}) layers stay in high precision under {plan.backend}: "
            f"their dims must be multiples of {plan.multiple} (warned once per shape)"
        )


def _rotate(x: Tensor, layer: MXLinear, plan: Plan) -> Tensor:
    """``x`` with the layer's random Hadamard transform along its last dim (identity when disabled)."""
    if not layer.mx_hadamard:
        return x
    block = 32 if plan.act_layout == "mx" else 128
    return random_hadamard(x, block=block, seed=layer.mx_seed)


def _transpose_padded(x: Tensor, multiple: int) -> Tensor:
    """``[M, C]`` -> ``[C, Mp]`` with zero columns appended up to a multiple of ``multiple``."""
    padded = x.new_zeros(-(-x.shape[0] // multiple) * multiple, x.shape[1])
    padded[: x.shape[0]] = x
    return padded.t().contiguous()


def _quantize_tokens(x: Tensor, layer: MXLinear, plan: Plan) -> QuantizedTensor:
    """``x [M, C]`` transposed and quantized along the tokens (the weight gradient's operand layout)."""
    if layer.mx_hadamard:  # rotate along the tokens: transpose and pad first, then quantize rows
        block = 32 if plan.act_layout == "mx" else 128
        rotated = _rotate(_transpose_padded(x, block), layer, plan)
        return quantize(rotated, plan.act_layout, rounding=layer.mx_config.rounding)[0]
    return quantize(x, plan.act_layout, rounding=layer.mx_config.rounding, rows=False, cols=True)[1]


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, plan, handoff):
        rounding = layer.mx_config.rounding
        needs_dw = weight.requires_grad
        keep_fp8 = layer.mx_config.quantize_saved_activations and not layer.mx_hadamard and needs_dw
        if handoff is not None:
            xq, xq_t = handoff.q, None
        else:
            xq, xq_t = quantize(_rotate(x, layer, plan), plan.act_layout, rounding=rounding, rows=True, cols=keep_fp8)
        # A 128x128 weight's transposed tiles (the input gradient's operand) come from the same read of the weight.
        transpose_w = plan.weight_layout == "128x128" and not layer.mx_hadamard and ctx.needs_input_grad[0]
        wq, wq_t = quantize(_rotate(weight, layer, plan), plan.weight_layout, rounding=rounding, cols=transpose_w)
        if layer.collect_stats:
            layer.record_stats("input", x, plan.act_layout)
            layer.record_stats("weight", weight, plan.weight_layout)
        # Fast accumulation on the forward GEMM of rowwise FP8 only (contraction over features, as torchao's
        # float8 training does); blockwise and MX scaling promote per block anyway.
        fast = plan.act_layout == "rowwise"
        gemm_dtype = _gemm_dtype(x.dtype, plan)
        bias_in = None if bias is None else bias.to(gemm_dtype)  # added in the GEMM's epilogue when it can
        out = scaled_mm(xq, wq, out_dtype=gemm_dtype, backend=plan.gemm, fast_accum=fast, bias=bias_in).to(x.dtype)

        ctx.layer, ctx.plan, ctx.has_bias = layer, plan, bias is not None
        ctx.x_source = "handoff" if handoff is not None else ("fp8" if keep_fp8 else "input")
        ctx.wq_t_meta = wq_t.layout if wq_t is not None else None
        ctx.kind = handoff.kind if handoff is not None else None
        tensors: tuple = (weight,)
        if wq_t is not None:
            tensors += (wq_t.data, wq_t.scale)
        if ctx.x_source == "handoff":
            copy = handoff.norm_input_mx
            tensors += (handoff.norm_input, None) if copy is None else (copy.data, copy.scale)
            tensors += (handoff.rstd, handoff.mean, handoff.weight, handoff.bias)
        elif ctx.x_source == "fp8":
            tensors += (xq_t.data, xq_t.scale)
        else:
            tensors += (x,)
        ctx.save_for_backward(*tensors)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layer, plan = ctx.layer, ctx.plan
        rounding = layer.mx_config.rounding
        weight, *rest = ctx.saved_tensors
        dy = grad_out.contiguous().to(ctx.x_dtype)
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if layer.collect_stats:
            layer.record_stats("grad_output", dy, plan.act_layout)

        grad_x = grad_w = grad_b = None
        direct_cols = needs_dw and not layer.mx_hadamard
        # The bias gradient comes from the read of dy that quantizes its columns, where dy is summed as given
        # (not rotated, not cast from another dtype); otherwise from a reduction of its own.
        needs_db = ctx.has_bias and ctx.needs_input_grad[2]
        fused_db = needs_db and direct_cols and grad_out.dtype == dy.dtype
        dyq, dyq_t, *sums = quantize(
            _rotate(dy, layer, plan), plan.act_layout, rounding=rounding, cols=direct_cols, return_column_sums=fused_db
        )
        if needs_dx:
            if ctx.wq_t_meta is not None:
                wq_t = QuantizedTensor(rest[0], rest[1], ctx.wq_t_meta)
            else:
                w_t = weight.t().contiguous()
                wq_t = quantize(_rotate(w_t, layer, plan), plan.weight_layout, rounding=rounding)[0]
            grad_x = scaled_mm(dyq, wq_t, out_dtype=_gemm_dtype(ctx.x_dtype, plan), backend=plan.gemm).to(ctx.x_dtype)
        if needs_dw:
            rest = rest[2:] if ctx.wq_t_meta is not None else rest
            if layer.mx_hadamard:
                dyq_t = _quantize_tokens(dy, layer, plan)
            xq_t = _saved_tokens_operand(ctx, rest, layer, plan)
            grad_w = scaled_mm(dyq_t, xq_t, out_dtype=_gemm_dtype(torch.float32, plan), backend=plan.gemm)
            grad_w = grad_w.to(weight.dtype)
        if needs_db:
            grad_b = (sums[0] if fused_db else grad_out.sum(0)).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _gemm_dtype(wanted: torch.dtype, plan: Plan) -> torch.dtype:
    """What the GEMM writes: ``wanted`` when emulated; bf16 from cuBLAS's FP8 GEMMs.

    Rowwise and MX scaling write bf16 only; blockwise could write fp32, but its weight-gradient GEMM is slower
    writing fp32 than bf16, and the gradient's operands carry 3 mantissa bits: bf16 loses nothing they hold.
    """
    return torch.bfloat16 if plan.gemm == "scaled_mm" else wanted


def _saved_tokens_operand(ctx, rest: list[Tensor], layer: MXLinear, plan: Plan) -> QuantizedTensor:
    """The weight gradient's ``x^T`` operand from what forward saved."""
    if ctx.x_source == "fp8":
        return QuantizedTensor(rest[0], rest[1], plan.act_layout)
    if ctx.x_source == "handoff":
        from lightning_gem.ops.mx import norm_quantize_transposed

        norm_input, scales, rstd, mean, weight, bias = rest[:6]
        if scales is not None:  # the norm input's MX copy, read in place of the input
            norm_input = QuantizedTensor(norm_input, scales, "mx")
        return norm_quantize_transposed(
            norm_input, rstd, mean, weight, bias, kind=ctx.kind, layout=plan.act_layout,
            rounding=layer.mx_config.rounding, out_dtype=ctx.x_dtype,
        )  # fmt: skip
    return _quantize_tokens(rest[0], layer, plan)
