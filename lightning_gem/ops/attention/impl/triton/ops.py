"""GDPA's Triton kernels as torch custom ops: ``lightning_gem::gdpa_triton`` and its backward.

Both are :func:`torch.library.triton_op` s whose bodies launch the kernels through
:func:`torch.library.wrap_triton`, so ``torch.compile`` sees (and can fuse around) the kernels, and the
body itself is the fake impl (it only allocates outputs and launches, which fake tensors trace). The
autograd formula calls the backward op; ``FlopCounterMode`` counts both with :func:`gdpa_op_flops`. Plain eager
calls skip the ops' dispatch (host time only) through a private ``autograd.Function`` over the same bodies.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op
from torch.utils.flop_counter import register_flop_formula

from lightning_gem.jagged import max_length_hint
from lightning_gem.ops._launch import plain_eager, records_graph
from lightning_gem.ops.attention.impl.triton._common import is_interpreted
from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
from lightning_gem.ops.attention.impl.triton.forward import _gdpa_fwd_kernel, gdpa_forward
from lightning_gem.ops.attention.ops import gdpa_op_flops

__all__ = ["SUPPORTED_DTYPES", "gdpa_triton"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    activation: str,
    causal: bool,
    window: int | None,
    block_size: int | None,
    scale: float,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    deterministic: bool = False,
    flash: bool = False,
) -> tuple[Tensor, Tensor]:
    """Forward: ``(out [Tq, H, Dv], lse [H, Tq] fp32 base-2 log-sum-exp; empty unless softmax)``.

    ``deterministic`` is for the backward (saved with the inputs); the forward is deterministic anyway. ``flash``
    (``impl="auto"``): FlashAttention-4 is one more candidate of the tuner, forward and backward, in plain eager
    calls of the modes it computes exactly.
    """
    return gdpa_forward(
        q, k, v, q_offsets, kv_offsets, kv_index, num_targets, activation=activation, causal=causal,
        window=window, block_size=block_size, scale=scale, max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv, flash=flash,
    )  # fmt: skip


def _backward_kernels(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor | None,
    lse: Tensor | None,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    activation: str,
    causal: bool,
    window: int | None,
    block_size: int | None,
    scale: float,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    deterministic: bool = False,
    flash: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)``; ``out`` and ``lse`` are read for softmax only; ``deterministic``: dQ without
    atomics (bitwise reproducible); ``flash``: FlashAttention-4's backward is one more candidate (``impl="auto"``)."""
    return gdpa_backward(
        grad_out, q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets, activation=activation,
        causal=causal, window=window, block_size=block_size, scale=scale, max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv, deterministic=deterministic, flash=flash,
    )  # fmt: skip


_gdpa_triton_op = triton_op("lightning_gem::gdpa_triton", mutates_args=())(_forward)
_gdpa_triton_backward_op = triton_op("lightning_gem::gdpa_triton_backward", mutates_args=())(_backward_kernels)


def _setup_context(ctx, inputs, output) -> None:
    _save(ctx, inputs[:7], inputs[7:], *output)


def _save(ctx, tensors: tuple, options: tuple, out: Tensor, lse: Tensor) -> None:
    """Save what the backward reads: ``tensors`` (q, k, v, offsets, index, targets), ``options`` (activation first,
    then the ops' other arguments) and, for softmax only, ``out`` and ``lse``."""
    ctx.mark_non_differentiable(lse)
    # The log-sum-exp gets no gradient: let it arrive as None instead of a zeros tensor made for it.
    ctx.set_materialize_grads(False)
    q, k, v, *jagged = tensors
    softmax = options[0] == "softmax"  # pointwise activations need neither the output nor the log-sum-exp
    ctx.save_for_backward(q, k, v, out if softmax else None, lse if softmax else None, *jagged)
    ctx.options = options


def _grad_or_zeros(grad_out: Tensor | None, saved: tuple) -> Tensor:
    """The output's gradient; zeros (as autograd would have made them) where none came (grads not materialized)."""
    if grad_out is not None:
        return grad_out
    q, _, v = saved[:3]
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    """``(dq, dk, dv)`` from what :func:`_save` kept, and no gradient for the other inputs."""
    saved = ctx.saved_tensors
    dq, dk, dv = _gdpa_triton_backward_op(_grad_or_zeros(grad_out, saved), *saved, *ctx.options)
    return dq, dk, dv, *(None,) * 13


_gdpa_triton_op.register_autograd(_backward, setup_context=_setup_context)


def _keep_opaque(mode, op, types, args, kwargs):
    return mode.__torch_dispatch__(op, types, args, kwargs)


if is_interpreted(_gdpa_fwd_kernel):
    # triton_op decomposes into its kernels when AOT autograd traces (FunctionalTensorMode), through
    # wrap_triton; interpreted kernels cannot be wrapped, so the decomposition would trace only the
    # allocations. Under the interpreter (CPU tests) the ops therefore stay opaque nodes, run eagerly.
    for _op in (_gdpa_triton_op, _gdpa_triton_backward_op):
        _op.register_torch_dispatch(FunctionalTensorMode, _keep_opaque)


@register_flop_formula(torch.ops.lightning_gem.gdpa_triton, get_raw=True)
def _gdpa_triton_flop(*args, out_val=None, **kwargs) -> int:
    return gdpa_op_flops(args[:3], args[3:], backward=False)


@register_flop_formula(torch.ops.lightning_gem.gdpa_triton_backward, get_raw=True)
def _gdpa_triton_backward_flop(*args, out_val=None, **kwargs) -> int:
    # (grad_out, q, k, v, out, lse, q_offsets, ...)
    return gdpa_op_flops(args[1:4], args[6:], backward=True)


class _GDPAEager(torch.autograd.Function):
    """The ops' bodies and autograd formula without the custom-op dispatch, for plain eager calls
    (``plain_eager``: nothing traces or counts them). The dispatch layers cost host time and nothing else there
    (about half a millisecond per forward + backward), which makes small attention layers CPU-bound. The ops'
    non-tensor arguments travel as one tuple: each argument of ``apply`` costs host time of its own."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, kv_index, num_targets, options):
        tensors = (q, k, v, q_offsets, kv_offsets, kv_index, num_targets)
        out, lse = _forward(*tensors, *options)
        _save(ctx, tensors, options, out, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        saved = ctx.saved_tensors
        dq, dk, dv = _backward_kernels(_grad_or_zeros(grad_out, saved), *saved, *ctx.options)
        return dq, dk, dv, None, None, None, None, None


def gdpa_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None = None,
    num_targets: Tensor | None = None,
    *,
    activation: str,
    causal: bool,
    window: int | None,
    block_size: int | None,
    scale: float,
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    deterministic: bool = False,
    flash: bool = False,
) -> Tensor:
    """GDPA through the Triton kernels, differentiable; inputs already validated by :func:`lightning_gem.ops.gdpa`.

    Same arguments as :func:`lightning_gem.ops.attention.impl.reference.gdpa_reference` (``kv_offsets``
    given: pass ``q_offsets`` for self-attention), plus the length hints and ``deterministic`` (the
    backward computes dQ in its own kernel instead of accumulating it with fp32 atomics: bitwise
    reproducible, somewhat slower) and ``flash`` (``impl="auto"``: FlashAttention-4 among the tuner's candidates,
    where it computes the mode exactly and the call is plain eager; never with ``deterministic``). A missing hint
    is read from the offsets (one device sync) in eager mode and replaced by the token count under ``torch.compile``
    (correct, but launches more empty programs): pass the hints on hot paths.

    Returns:
        ``[Tq, H, Dv]`` in q's dtype.

    Raises:
        TypeError: a dtype the kernels do not take (float64: use the reference).
        ValueError: CPU tensors while the kernels are compiled for GPUs (not Triton's interpreter).
    """
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`q` must be float16, bfloat16 or float32 for impl='triton', got {q.dtype}")
    if q.device.type != "cuda" and not is_interpreted(_gdpa_fwd_kernel):
        raise ValueError(
            f"impl='triton' needs CUDA tensors, got `q` on {q.device} (on CPU the kernels run only under "
            "TRITON_INTERPRET=1, set before Triton is imported)"
        )
    if max_seq_len_q is None:
        max_seq_len_q = max_length_hint(q_offsets, q.shape[0])
    if max_seq_len_kv is None:
        max_seq_len_kv = max_length_hint(kv_offsets, k.shape[0])
    tensors = (q, k, v, q_offsets, kv_offsets, kv_index, num_targets)
    flash = flash and not deterministic
    options = (activation, causal, window, block_size, float(scale), max_seq_len_q, max_seq_len_kv, deterministic,
               flash)  # fmt: skip
    if not plain_eager(tensors):
        return _gdpa_triton_op(*tensors, *options)[0]
    if records_graph(q, k, v):
        return _GDPAEager.apply(*tensors, options)[0]
    # Nothing to differentiate: no Function either, and FlashAttention-4 (if chosen) skips the log-sum-exp.
    return gdpa_forward(
        *tensors, activation=activation, causal=causal, window=window, block_size=block_size, scale=float(scale),
        max_seq_len_q=max_seq_len_q, max_seq_len_kv=max_seq_len_kv, flash=flash, need_lse=False,
    )[0]  # fmt: skip
