"""GDPA's Triton kernels as torch custom ops: ``lightning_gem::gdpa_triton`` and its backward.

Both are :func:`torch.library.triton_op` s whose bodies launch the kernels through
:func:`torch.library.wrap_triton`, so ``torch.compile`` sees (and can fuse around) the kernels, and the
body itself is the fake impl (it only allocates outputs and launches, which fake tensors trace). The
autograd formula calls the backward op; ``FlopCounterMode`` counts both with :func:`gdpa_op_flops`. Plain eager
calls skip the ops' dispatch (host time only) through a private ``autograd.Function`` over the same bodies.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch.library import triton_op

from lightning_gem.ops._launch import keep_opaque_when_interpreted, plain_eager, records_graph
from lightning_gem.ops.attention.impl.triton._common import is_interpreted
from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
from lightning_gem.ops.attention.impl.triton.forward import _gdpa_fwd_kernel, gdpa_forward
from lightning_gem.ops.attention.ops import register_flop_formulas
from lightning_gem.ops.attention.spec import Spec, op_signature, with_length_hints
from lightning_gem.ops.mx.saved import save_exact

__all__ = ["SUPPORTED_DTYPES", "gdpa_triton"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _forward(*arguments: object) -> tuple[Tensor, Tensor]:
    """Forward: ``(out [Tq, H, Dv], lse [H, Tq] fp32 base-2 log-sum-exp; empty unless softmax)``.

    The arguments (:data:`_FORWARD`) are ``q, k, v``, a :class:`Spec`'s fields, then ``flash`` (``impl="auto"``):
    the library kernels are candidates of the tuner too, forward and backward, in plain eager calls of the modes they
    compute exactly. ``deterministic`` is for the backward (saved with the inputs); the forward is deterministic
    anyway.
    """
    q, k, v, *spec, flash = _all_arguments(_FORWARD, arguments)
    return gdpa_forward(q, k, v, Spec(*spec), flash=flash)


def _backward_kernels(*arguments: object) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` from ``grad_out, q, k, v, out, lse``, a :class:`Spec`'s fields and ``flash``
    (:data:`_BACKWARD`). ``out`` and ``lse`` are read for softmax only; ``deterministic``: dQ without atomics (bitwise
    reproducible); ``flash``: the library kernels' backwards are candidates too (``impl="auto"``)."""
    arguments = _all_arguments(_BACKWARD, arguments)
    *spec, flash = arguments[6:]
    return gdpa_backward(*arguments[:6], Spec(*spec), flash=flash)


def _all_arguments(signature: inspect.Signature, arguments: tuple) -> tuple:
    """``arguments`` with the defaults of ``signature`` after them (the dispatcher leaves out trailing defaults)."""
    bound = signature.bind(*arguments)
    bound.apply_defaults()
    return bound.args


# triton_op infers the ops' schemas from these signatures: the Spec fields come from Spec itself.
_TENSORS = {"q": Tensor, "k": Tensor, "v": Tensor}
_FORWARD = _forward.__signature__ = op_signature(_TENSORS, {"flash": False}, tuple[Tensor, Tensor])
_BACKWARD = _backward_kernels.__signature__ = op_signature(
    {"grad_out": Tensor, **_TENSORS, "out": Tensor | None, "lse": Tensor | None},
    {"flash": False},
    tuple[Tensor, Tensor, Tensor],
)

_gdpa_triton_op = triton_op("lightning_gem::gdpa_triton", mutates_args=())(_forward)
_gdpa_triton_backward_op = triton_op("lightning_gem::gdpa_triton_backward", mutates_args=())(_backward_kernels)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *spec, flash = inputs  # the op is called with every argument (gdpa_triton)
    _save(ctx, q, k, v, Spec(*spec), flash, *output)


def _save(ctx, q: Tensor, k: Tensor, v: Tensor, spec: Spec, flash: bool, out: Tensor, lse: Tensor) -> None:
    """Save what the backward reads: ``q, k, v``, the spec's tensors, and for softmax only ``out`` and ``lse``; its
    other fields and ``flash`` as ``ctx.options`` and ``ctx.flash``."""
    ctx.mark_non_differentiable(lse)
    # The log-sum-exp gets no gradient: let it arrive as None instead of a zeros tensor made for it.
    ctx.set_materialize_grads(False)
    softmax = spec.activation == "softmax"  # pointwise activations need neither the output nor the log-sum-exp
    if softmax:  # its backward differences dO . O against dP: rounded to FP8 (saved-activation quantization) they
        save_exact(out, lse)  # would cancel to noise; Q, K and V may be stored quantized
    ctx.save_for_backward(q, k, v, out if softmax else None, lse if softmax else None, *spec[:4])
    ctx.options, ctx.flash = spec[4:], flash


def _grad_or_zeros(grad_out: Tensor | None, q: Tensor, v: Tensor) -> Tensor:
    """The output's gradient; zeros (as autograd would have made them) where none came (grads not materialized)."""
    if grad_out is not None:
        return grad_out
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    """``(dq, dk, dv)`` from what :func:`_save` kept, and no gradient for the other inputs."""
    saved = ctx.saved_tensors
    grad_out = _grad_or_zeros(grad_out, saved[0], saved[2])
    dq, dk, dv = _gdpa_triton_backward_op(grad_out, *saved, *ctx.options, ctx.flash)
    return dq, dk, dv, *(None,) * (len(Spec._fields) + 1)  # the spec's fields and ``flash``


_gdpa_triton_op.register_autograd(_backward, setup_context=_setup_context)


keep_opaque_when_interpreted(_gdpa_fwd_kernel, _gdpa_triton_op, _gdpa_triton_backward_op)


register_flop_formulas(
    torch.ops.lightning_gem.gdpa_triton, torch.ops.lightning_gem.gdpa_triton_backward, saved_outputs=2
)


class _GDPAEager(torch.autograd.Function):
    """The ops' bodies and autograd formula without the custom-op dispatch, for plain eager calls
    (``plain_eager``: nothing traces or counts them). The dispatch layers cost host time and nothing else there
    (docs/benchmarks.md#host-time-per-call), which makes small attention layers CPU-bound. The offsets
    travel inside the spec: each argument of ``apply`` costs host time of its own."""

    @staticmethod
    def forward(ctx, q, k, v, spec, flash):
        # Where a library kernel runs the forward, its own log-sum-exp is kept for the backward (which converts it
        # only if a Triton kernel reads it): two launches fewer a call, and none back for a library's backward.
        lse_format: dict[str, bool] = {}
        out, lse = gdpa_forward(q, k, v, spec, flash=flash, lse_format=lse_format)
        _save(ctx, q, k, v, spec, flash, out, lse)
        ctx.natural_lse = lse_format.get("natural", False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        q, k, v, out, lse, *jagged = ctx.saved_tensors
        spec = Spec(*jagged, *ctx.options)
        grad_out = _grad_or_zeros(grad_out, q, v)
        dq, dk, dv = gdpa_backward(grad_out, q, k, v, out, lse, spec, flash=ctx.flash, natural_lse=ctx.natural_lse)
        return dq, dk, dv, None, None


def gdpa_triton(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, flash: bool = False) -> Tensor:
    """GDPA through the Triton kernels, differentiable; inputs already validated by :func:`lightning_gem.ops.gdpa`.

    ``spec`` as for :func:`lightning_gem.ops.attention.impl.reference.gdpa_reference` (``kv_offsets`` is
    ``q_offsets`` for self-attention), with its length hints and ``deterministic`` (the backward computes dQ in its
    own kernel instead of accumulating it with fp32 atomics: bitwise reproducible, somewhat slower); ``flash``
    (``impl="auto"``): the library kernels (FlashAttention-4 where installed, PyTorch's FlashAttention-2) among the
    tuner's candidates, where they compute the mode exactly and the call is plain eager; never with
    ``deterministic``. A missing hint is read from the offsets (one device sync) in eager mode and replaced by the
    token count under ``torch.compile`` (correct, but launches more empty programs): pass the hints on hot paths.

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
    spec = with_length_hints(spec, q, k)
    flash = flash and not spec.deterministic and spec.precision is None
    if not plain_eager((q, k, v, *spec[:4])):
        return _gdpa_triton_op(q, k, v, *spec, flash)[0]
    if records_graph(q, k, v):
        return _GDPAEager.apply(q, k, v, spec, flash)[0]
    # Nothing to differentiate: no Function either, and FlashAttention-4 (if chosen) skips the log-sum-exp.
    return gdpa_forward(q, k, v, spec, flash=flash, need_lse=False)[0]
