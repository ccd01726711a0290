"""Public fused pointwise ops of the HSTU layer: validation, defaults and ``impl=`` dispatch.

An HSTU layer (Zhai et al., 2024) computes ``U, V, Q, K = split(SiLU(uvqk(norm(x))))`` before its attention and
``norm(A) * U`` after it. Unfused, each is several kernels, and the split leaves Q, K and V as strided views of one
wide activation; under autocast, the input's norm runs on the float32 residual stream and autocast then casts its
output for the projection. ``impl="reference"`` is pure PyTorch (any device, the oracle); ``"triton"`` runs the kernels
(CUDA, or CPU under ``TRITON_INTERPRET=1``) and never falls back; ``"auto"`` picks Triton for CUDA tensors of
fp32/fp16/bf16 and the reference otherwise. The kernels compute in fp32 and round once to the input's dtype;
the reference is the unfused composition (each op rounded to the input's dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gem.ops._launch import resolve_triton_impl
from lightning_gem.ops.mx.saved import save_derived
from lightning_gem.ops.pointwise.impl.reference import norm_mul_reference, norm_reference, silu_split_reference

__all__ = ["IMPLS", "norm", "norm_mul", "norm_residual", "silu_split"]

IMPLS = ("auto", "reference", "triton")
_NORMS = ("rms", "layer")


def _resolve_impl(impl: str, x: Tensor) -> str:
    return resolve_triton_impl(impl, IMPLS, x, _silu_split_kernel)


def _silu_split_kernel() -> object:
    from lightning_gem.ops.pointwise.impl.triton.kernels import _silu_split_fwd_kernel

    return _silu_split_fwd_kernel


def silu_split(
    x: Tensor, sizes: Sequence[int], *, bias: Tensor | None = None, impl: str = "auto"
) -> tuple[Tensor, ...]:
    """``SiLU(x + bias)`` split along the last dim into parts of ``sizes`` columns, each part contiguous.

    The HSTU layer's ``U, V, Q, K`` from its projection viewed as ``[T, H, 2 Dv + 2 Dqk]``: each part comes out
    as its own contiguous ``[T, H, P]`` tensor (dense rows, which tensor-descriptor loads need), in one pass over ``x``;
    the backward writes ``x``'s gradient in one pass over the parts' gradients (a part whose output is unused
    gets zeros). The projection's bias may come here instead of to its matmul (``x`` without it): the backward then
    sums the bias's gradient in the same pass, where a Linear's backward reads its whole output gradient once more.

    Args:
        x: ``[..., W]`` float tensor (a non-contiguous one is copied first).
        sizes: one to four positive column counts summing to ``W``.
        bias: None, or ``x.shape[1:]`` (e.g. ``[H, W]`` for ``x [T, H, W]``), added to every row of ``x``'s first
            dim; any float dtype (a float32 parameter stays float32, its gradient too: the sum is in fp32).
        impl: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``len(sizes)`` tensors of shape ``[..., P]`` in ``x``'s dtype.

    Example:
        >>> u, v = silu_split(torch.tensor([[0.0, 1.0, -1.0]]), [1, 2])
        >>> u.shape, v.shape
        (torch.Size([1, 1]), torch.Size([1, 2]))
    """
    sizes = tuple(int(s) for s in sizes)
    if not 1 <= len(sizes) <= 4 or any(s < 1 for s in sizes):
        raise ValueError(f"`sizes` must be one to four positive column counts, got {sizes}")
    if x.dim() < 1 or x.shape[-1] != sum(sizes):
        raise ValueError(f"`x` must be [..., {sum(sizes)}] (the sum of `sizes` {sizes}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"`x` must be a float tensor, got {x.dtype}")
    if bias is not None:
        if x.dim() < 2 or bias.shape != x.shape[1:]:
            raise ValueError(f"`bias` must be x.shape[1:] for `x` of two dims or more, got {tuple(bias.shape)} "
                             f"for `x` {tuple(x.shape)}")  # fmt: skip
        if not bias.is_floating_point() or bias.device != x.device:
            raise TypeError(f"`bias` must be a float tensor on `x`'s device ({x.device}), got {bias.dtype} on "
                            f"{bias.device}")  # fmt: skip
    if _resolve_impl(impl, x) == "triton":
        from lightning_gem.ops.pointwise.impl.triton import silu_split_triton

        return silu_split_triton(x.contiguous(), sizes, None if bias is None else bias.contiguous())
    parts = silu_split_reference(x, sizes, bias)
    if not torch.compiler.is_compiling() and parts[0].requires_grad:  # quantized saves keep x's copy, not the parts
        save_derived(parts, x, functools.partial(silu_split_reference, sizes=sizes, bias=bias))
    return parts


def _check_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str) -> None:
    if kind not in _NORMS:
        raise ValueError(f"`kind` must be one of {_NORMS}, got {kind!r}")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"`{name}` must be [{n}], got {tuple(t.shape)}")
    if bias is not None and kind == "rms":
        raise ValueError("`bias` is for kind='layer' (RMSNorm has no shift)")


def _norm_options(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float | None, out_dtype: torch.dtype | None
) -> tuple[float, torch.dtype]:
    """``(eps, out_dtype)`` of a :func:`norm` call with their defaults, after checking its arguments."""
    if x.dim() < 1 or not x.is_floating_point():
        raise TypeError(f"`x` must be a float tensor of one dim or more, got {x.dtype} of shape {tuple(x.shape)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not out_dtype.is_floating_point:
        raise TypeError(f"`out_dtype` must be a float dtype, got {out_dtype}")
    _check_norm(x, weight, bias, kind)
    return torch.finfo(x.dtype).eps if eps is None else float(eps), out_dtype


def norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    eps: float | None = None,
    kind: str = "rms",
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> Tensor:
    """RMSNorm or LayerNorm over the last dim, computed in fp32 and written in ``out_dtype``.

    The norm before a Linear under autocast: a float32 ``x`` (the residual stream) normalised and written straight in
    the autocast dtype the Linear would cast it to, in one pass (the backward reads that dtype's gradient and writes
    ``x``'s in one pass with the weight's and bias's partial sums), where the norm wrote float32 and a cast followed.
    Same values as ``nn.RMSNorm`` / ``nn.LayerNorm`` then ``.to(out_dtype)``, up to the order of the row sums.

    Args:
        x: ``[..., N]`` float tensor.
        weight: ``[N]`` scale, or None.
        bias: ``[N]`` shift (LayerNorm only), or None.
        eps: added to the variance; None: ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm`` does.
        kind: ``"rms"`` or ``"layer"``.
        out_dtype: the output's float dtype; None: ``x``'s.
        impl: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``[..., N]`` in ``out_dtype``.

    Example:
        >>> x = torch.randn(3, 8)
        >>> y = norm(x, torch.ones(8), out_dtype=torch.bfloat16)
        >>> y.dtype, torch.allclose(y.float(), torch.nn.functional.rms_norm(x, (8,)), atol=1e-2)
        (torch.bfloat16, True)
    """
    eps, out_dtype = _norm_options(x, weight, bias, kind, eps, out_dtype)
    if _resolve_impl(impl, x) == "reference":
        return norm_reference(x, weight, bias, eps, kind, out_dtype)
    from lightning_gem.ops.pointwise.impl.triton import norm_triton

    return norm_triton(x.contiguous(), weight, bias, eps, kind == "layer", out_dtype)


def norm_residual(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    eps: float | None = None,
    kind: str = "rms",
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(norm(x), x)``: :func:`norm`, with ``x`` itself as a second output for the residual of a pre-norm block.

    In a block ``x + f(norm(x))`` the residual stream's gradient reaches ``x`` twice, through the norm and through the
    sum; autograd adds the two in a pass over the float32 rows of its own. Written ``y, x = norm_residual(x, ...)``,
    ``x + f(y)``, the second gradient comes to the norm's backward, whose kernel adds it into ``dx`` as it writes it
    (plain eager calls of the Triton impl; elsewhere the second output is ``x`` and autograd sums as before). The
    values are :func:`norm`'s and ``x``'s.

    Args:
        x, weight, bias, eps, kind, out_dtype, impl: as for :func:`norm`.

    Returns:
        ``(norm(x) [..., N] in out_dtype, x)``.

    Example:
        >>> x = torch.randn(3, 8, requires_grad=True)
        >>> y, residual = norm_residual(x, torch.ones(8))
        >>> (residual + y).sum().backward()
        >>> x.grad.shape
        torch.Size([3, 8])
    """
    eps, out_dtype = _norm_options(x, weight, bias, kind, eps, out_dtype)
    if _resolve_impl(impl, x) == "reference":
        return norm_reference(x, weight, bias, eps, kind, out_dtype), x
    from lightning_gem.ops.pointwise.impl.triton import norm_residual_triton

    return norm_residual_triton(x.contiguous(), weight, bias, eps, kind == "layer", out_dtype)


def norm_mul(
    x: Tensor,
    gate: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    eps: float | None = None,
    kind: str = "rms",
    impl: str = "auto",
) -> Tensor:
    """``norm(x) * gate``: RMSNorm or LayerNorm over the last dim, times a gate of the same shape.

    The HSTU layer's ``attention_norm(A) * U``, in one pass forward and one backward (``dx``, ``dgate`` and the
    weight's and bias's gradients); nothing but per-row statistics is saved beyond the inputs.

    Args:
        x: ``[..., N]`` float tensor.
        gate: the shape of ``x``.
        weight: ``[N]`` scale of the norm, or None.
        bias: ``[N]`` shift (LayerNorm only), or None.
        eps: added to the variance; None: ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm`` does.
        kind: ``"rms"`` or ``"layer"``.
        impl: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Example:
        >>> x, gate = torch.randn(3, 8), torch.randn(3, 8)
        >>> torch.allclose(norm_mul(x, gate), torch.nn.functional.rms_norm(x, (8,), eps=1e-6) * gate, atol=1e-5)
        True
    """
    if x.dim() < 1 or gate.shape != x.shape:
        raise ValueError(f"`gate` must have the shape of `x` {tuple(x.shape)}, got {tuple(gate.shape)}")
    if not x.is_floating_point() or gate.dtype != x.dtype:
        raise TypeError(f"`x` and `gate` must be float tensors of one dtype, got {x.dtype} and {gate.dtype}")
    _check_norm(x, weight, bias, kind)
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    if _resolve_impl(impl, x) == "reference":
        return norm_mul_reference(x, gate, weight, bias, eps, kind)
    from lightning_gem.ops.pointwise.impl.triton import norm_mul_triton

    return norm_mul_triton(x.contiguous(), gate.contiguous(), weight, bias, eps, kind == "layer")
