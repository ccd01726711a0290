"""GDPA as torch custom ops: the reference registered with a fake impl, autograd and a FLOP formula.

This module imports no optional backend (no Triton): the Triton kernels register their own ops in
``impl/triton``. Registering the reference as an op lets ``torch.compile`` trace through it as a single
node and lets ``torch.utils.flop_counter.FlopCounterMode`` count it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.masks import num_allowed_pairs
from lightning_gem.ops.attention.spec import MODE_SCHEMA, Spec

__all__ = ["gdpa_flops", "gdpa_op_flops", "gdpa_reference_op", "register_flop_formulas"]


@torch.library.custom_op(
    "lightning_gem::gdpa_reference", mutates_args=(), schema=f"(Tensor q, Tensor k, Tensor v, {MODE_SCHEMA}) -> Tensor"
)
def gdpa_reference_op(q: Tensor, k: Tensor, v: Tensor, *spec: object) -> Tensor:
    """Forward of the reference GDPA: ``q, k, v`` and the first nine fields of a :class:`Spec` (inputs already
    validated by :func:`lightning_gem.ops.gdpa`)."""
    return gdpa_reference(q, k, v, Spec(*spec))


@gdpa_reference_op.register_fake
def _(q, k, v, *spec):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op(
    "lightning_gem::gdpa_reference_backward",
    mutates_args=(),
    schema=f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, {MODE_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)
def gdpa_reference_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *spec: object) -> tuple[Tensor, ...]:
    """Backward of the reference GDPA: the explicit formulas of :func:`gdpa_reference_backward`."""
    return gdpa_reference_backward(grad_out, q, k, v, Spec(*spec))


@gdpa_reference_backward_op.register_fake
def _(grad_out, q, k, v, *spec):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *options = inputs
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, kv_index, num_targets)
    ctx.options = options


def _backward(ctx, grad_out):
    dq, dk, dv = gdpa_reference_backward_op(grad_out.contiguous(), *ctx.saved_tensors, *ctx.options)
    return dq, dk, dv, *(None,) * 9


gdpa_reference_op.register_autograd(_backward, setup_context=_setup_context)


def gdpa_flops(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None = None,
    num_targets: Tensor | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
    backward: bool = False,
) -> int:
    """Useful matmul FLOPs of one GDPA call: only allowed (query, key) pairs are counted.

    Forward: ``2 * pairs * H * (D + Dv)`` (``Q K^T`` and ``P V``). Backward: ``2 * pairs * H * (3 D + 2 Dv)``
    (recomputed ``Q K^T``, ``dV``, ``dP``, ``dQ``, ``dK``), i.e. 2.5x the forward when ``D == Dv``.
    Pointwise work (softmax, activations) is not counted, as FlashAttention's accounting does.
    Under fake tensors (compile-time tracing) the offsets' values are unknown: the dense upper bound
    ``sum over segments of Lq * Lk`` cannot be formed either, so ``Tq * Tk`` is not used; 0 is returned.
    """
    if any(t is not None and t.device.type == "meta" for t in (q_offsets, kv_offsets)) or _is_fake(q_offsets):
        return 0
    pairs = num_allowed_pairs(
        q_offsets, kv_offsets, kv_index, num_targets, causal=causal, window=window, block_size=block_size
    )
    heads, dim, dim_v = q.shape[1], q.shape[2], v.shape[2]
    per_pair = 3 * dim + 2 * dim_v if backward else dim + dim_v
    return 2 * pairs * heads * per_pair


def _is_fake(tensor: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def gdpa_op_flops(qkv: tuple, rest: tuple, *, backward: bool) -> int:
    """:func:`gdpa_flops` from a GDPA op's positional arguments: ``qkv`` and what follows the op's tensors
    (``q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, ...``)."""
    q_offsets, kv_offsets, kv_index, num_targets, _activation, causal, window, block_size = rest[:8]
    jagged = (q_offsets, kv_offsets, kv_index, num_targets)
    return gdpa_flops(*qkv, *jagged, causal=causal, window=window, block_size=block_size, backward=backward)


def register_flop_formulas(forward_op: object, backward_op: object, *, saved_outputs: int) -> None:
    """Count a GDPA op and its backward with :func:`gdpa_op_flops`: ``forward_op`` takes ``(q, k, v, *spec)``,
    ``backward_op`` ``(grad_out, q, k, v, *saved, *spec)`` with ``saved_outputs`` forward outputs between (``spec``:
    :class:`Spec`'s fields in order, as many as the op takes)."""
    first = 4 + saved_outputs

    def forward_flops(*args, out_val=None, **kwargs) -> int:
        return gdpa_op_flops(args[:3], args[3:], backward=False)

    def backward_flops(*args, out_val=None, **kwargs) -> int:
        return gdpa_op_flops(args[1:4], args[first:], backward=True)

    register_flop_formula(forward_op, get_raw=True)(forward_flops)
    register_flop_formula(backward_op, get_raw=True)(backward_flops)


register_flop_formulas(
    torch.ops.lightning_gem.gdpa_reference, torch.ops.lightning_gem.gdpa_reference_backward, saved_outputs=0
)
