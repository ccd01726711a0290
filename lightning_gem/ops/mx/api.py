"""Public MX/FP8 quantization functions: validation, defaults and ``impl=`` dispatch.

``impl="reference"`` is pure PyTorch (any device, the oracle); ``"triton"`` runs the kernels (CUDA, or
CPU under ``TRITON_INTERPRET=1``) and never falls back; ``"auto"`` picks Triton for CUDA tensors of
fp32/fp16/bf16 and the reference otherwise. Both produce bit-identical FP8 data and scales.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_gem.ops._launch import resolve_triton_impl
from lightning_gem.ops.mx.formats import LAYOUTS, QuantizedTensor, block_shape, decode_scale
from lightning_gem.ops.mx.impl.reference import norm_reference, normalize_with_stats, quantize_reference

__all__ = [
    "IMPLS",
    "NormQuantized",
    "dequantize",
    "norm_quantize",
    "norm_quantize_transposed",
    "quantize",
    "resolve_impl",
]

IMPLS = ("auto", "reference", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NormQuantized(NamedTuple):
    """What :func:`norm_quantize` returns.

    Attributes:
        q: the normalised ``[R, D]`` rows quantized along ``D``.
        rstd: ``[R]`` fp32 reciprocal standard deviations (RMS for RMSNorm).
        mean: ``[R]`` fp32 means (LayerNorm) or None.
        y: the ``[R, D]`` normalised output in ``x``'s dtype if ``write_output``, else None.
        x_mx: ``x`` itself quantized in the ``mx`` layout (RCEIL) if ``save_input``, else None.
    """

    q: QuantizedTensor
    rstd: Tensor
    mean: Tensor | None
    y: Tensor | None
    x_mx: QuantizedTensor | None = None


def resolve_impl(impl: str, x: Tensor) -> str:
    """``"reference"`` or ``"triton"`` for ``impl`` and input ``x`` (``"auto"``: Triton for CUDA floats)."""
    return resolve_triton_impl(impl, IMPLS, x, _quantize_kernel)


def _quantize_kernel() -> object:
    from lightning_gem.ops.mx.impl.triton.quantize import _quantize_kernel

    return _quantize_kernel


def _check_matrix(x: Tensor, name: str, layout: str) -> None:
    if not isinstance(x, Tensor) or x.ndim != 2:
        raise ValueError(f"`{name}` must be a 2-D [R, C] tensor, got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {x.dtype}")
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")


def quantize(
    x: Tensor,
    layout: str = "mx",
    *,
    rounding: str = "rceil",
    rows: bool = True,
    cols: bool = False,
    return_column_sums: bool = False,
    impl: str = "auto",
) -> (
    tuple[QuantizedTensor | None, QuantizedTensor | None]
    | tuple[QuantizedTensor | None, QuantizedTensor | None, Tensor]
):
    """Quantize ``[R, C]`` ``x`` to FP8 E4M3 with block scales, along ``C`` and/or along ``R``.

    Args:
        x: ``[R, C]`` float matrix.
        layout: ``"mx"`` (OCP MXFP8: ``1 x 32`` blocks, E8M0 scales), ``"1x128"``, ``"128x128"`` (weights)
            or ``"rowwise"`` (see :mod:`lightning_gem.ops.mx.formats`).
        rounding: ``"rceil"`` (default; as cuBLAS / Transformer Engine / torchao RCEIL) or ``"floor"``
            (the OCP reference rule, which may saturate).
        rows: return ``x`` quantized along ``C`` (``[R, C]``).
        cols: return ``x^T`` quantized along ``R`` (``[C, Rp]``, ``R`` zero-padded to a multiple of the
            block, 128 for ``rowwise``): the layout of a weight-gradient GEMM's operands. For ``128x128``
            its tiles are ``x``'s own transposed (same scales, transposed): a weight's layout for the
            input-gradient GEMM. The Triton path reads ``x`` once for both.
        return_column_sums: also return ``x.sum(0)`` in fp32 (``[C]``): a Linear's bias gradient when ``x`` is its
            output gradient. The Triton path sums from the same read that quantizes the columns (for ``mx`` and
            ``1x128`` when its one-launch plan runs, and for ``rowwise``), else by a separate reduction.
        impl: ``"auto"``, ``"reference"`` or ``"triton"`` (module docstring).

    Returns:
        ``(rows or None, cols or None)`` :class:`~lightning_gem.ops.mx.formats.QuantizedTensor` s, and the column
        sums third with ``return_column_sums``.

    Example:
        >>> import torch
        >>> q, _ = quantize(torch.randn(4, 64), "mx")
        >>> q.data.dtype, q.scale.shape
        (torch.float8_e4m3fn, torch.Size([4, 2]))
    """
    _check_matrix(x, "x", layout)
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"`rounding` must be 'rceil' or 'floor', got {rounding!r}")
    block_cols = block_shape(layout, x.shape[1])[1]
    if x.shape[1] == 0 or x.shape[1] % block_cols:
        raise ValueError(f"`x` must have a positive multiple of {block_cols} columns for {layout!r}, got {x.shape[1]}")
    if cols and x.shape[0] == 0:
        raise ValueError("`x` must have rows to quantize along them (cols=True)")
    if resolve_impl(impl, x) == "triton":
        from lightning_gem.ops.mx.impl.triton import mx_quantize

        args = (x.contiguous(), layout, rounding, rows, cols)
        q, s, qt, st, sums = mx_quantize(*args, *(None,) * 6, True) if return_column_sums else mx_quantize(*args)
        row_out = QuantizedTensor(q, s, layout) if rows else None
        col_out = QuantizedTensor(qt, st, layout) if cols else None
        return (row_out, col_out, sums) if return_column_sums else (row_out, col_out)
    row_out = quantize_reference(x, layout, rounding) if rows else None
    col_out = None
    if cols:
        pad = 128 if layout == "rowwise" else block_cols
        padded = torch.zeros(-(-x.shape[0] // pad) * pad, x.shape[1], dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        col_out = quantize_reference(padded.t().contiguous(), layout, rounding)
    return (row_out, col_out, x.sum(0, dtype=torch.float32)) if return_column_sums else (row_out, col_out)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, impl: str = "auto") -> Tensor:
    """``[R, C]`` values ``data * scale`` of ``q`` in ``dtype`` (a NaN scale makes its block NaN).

    Args:
        q: a :class:`~lightning_gem.ops.mx.formats.QuantizedTensor` (``"triton"``: ``mx`` layout, contiguous).
        dtype: fp32, fp16 or bf16 (fp16 is clamped to its largest finite value).
        impl: ``"auto"`` (Triton for CUDA ``mx`` data), ``"reference"`` or ``"triton"``: the same values.

    Example:
        >>> import torch
        >>> q, _ = quantize(torch.tensor([[1.0, -3.0] * 16]), "mx")
        >>> dequantize(q)[0, :2]
        tensor([ 1., -3.])
    """
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"`dtype` must be one of {_FLOAT_DTYPES}, got {dtype}")
    use_triton = impl == "triton" or (impl == "auto" and q.data.device.type == "cuda" and q.layout == "mx")
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}")
    if use_triton:
        if q.layout != "mx":
            raise ValueError(f"impl='triton' dequantizes the 'mx' layout, got {q.layout!r}")
        resolve_impl("triton", torch.empty(0, device=q.data.device))  # raises off CUDA without the interpreter
        from lightning_gem.ops.mx.impl.triton.dequantize import dequantize_mx_triton

        return dequantize_mx_triton(q.data.contiguous(), q.scale.contiguous(), dtype)
    if q.layout == "mx":  # one broadcast multiply instead of the general path's expanded scale matrix
        rows, cols = q.data.shape
        scale = decode_scale(q.scale).unsqueeze(-1)
        out = (q.data.to(torch.float32).view(rows, cols // 32, 32) * scale).view(rows, cols).to(dtype)
    else:
        out = q.dequantize(dtype)
    return out.clamp_(-65504.0, 65504.0) if dtype == torch.float16 else out  # clamping keeps NaN


def norm_quantize(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    kind: str = "rms",
    eps: float = 1e-6,
    layout: str = "mx",
    rounding: str = "rceil",
    write_output: bool = False,
    out_dtype: torch.dtype | None = None,
    save_input: bool = False,
    impl: str = "auto",
) -> NormQuantized:
    """RMSNorm or LayerNorm over the last dim of ``[R, D]`` ``x``, its output quantized along ``D`` in one pass.

    The output is rounded to ``out_dtype`` before quantization, exactly as an unfused norm's output would
    be, so ``norm_quantize(...).q`` equals ``quantize(norm(x))`` bit for bit. The transposed layout for the
    weight gradient comes from :func:`norm_quantize_transposed` without storing the normalised activation.

    Args:
        x: ``[R, D]`` input rows. weight, bias: ``[D]`` affine parameters or None.
        kind: ``"rms"`` or ``"layer"``. eps: added to the variance.
        layout: ``"mx"``, ``"1x128"`` or ``"rowwise"``. rounding: as in :func:`quantize`.
        write_output: also return the normalised output.
        out_dtype: dtype the output is rounded to (and returned in); default ``x``'s (under autocast, the
            autocast dtype: the residual stream may be fp32 while the GEMMs read bf16).
        save_input: also quantize ``x`` itself in the ``mx`` layout with RCEIL rounding from the same read, as
            :class:`~lightning_gem.ops.mx.saved.QuantizedSavedTensors` would store it (``D`` a multiple of 32).
        impl: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        :class:`NormQuantized`.

    Example:
        >>> import torch
        >>> out = norm_quantize(torch.randn(8, 64), torch.ones(64), layout="mx")
        >>> out.q.data.shape, out.rstd.shape
        (torch.Size([8, 64]), torch.Size([8]))
    """
    _check_matrix(x, "x", layout)
    if kind not in ("rms", "layer"):
        raise ValueError(f"`kind` must be 'rms' or 'layer', got {kind!r}")
    if layout == "128x128":
        raise ValueError("norm outputs are activations: use layout 'mx', '1x128' or 'rowwise'")
    dim = x.shape[1]
    block_cols = block_shape(layout, dim)[1]
    if dim == 0 or dim % block_cols:
        raise ValueError(f"`x` must have a positive multiple of {block_cols} features for {layout!r}, got {dim}")
    if save_input and dim % 32:
        raise ValueError(f"`save_input` quantizes `x` in blocks of 32 features, got {dim}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != (dim,):
            raise ValueError(f"`{name}` must have shape [{dim}] (x's features), got {tuple(param.shape)}")
    if resolve_impl(impl, x) == "triton":
        from lightning_gem.ops.mx.impl.triton import mx_norm_quantize

        q, s, rstd, mean, y, x_codes, x_scales = mx_norm_quantize(
            x.contiguous(), weight, bias, float(eps), kind, layout, rounding, write_output, out_dtype, save_input
        )
        x_mx = QuantizedTensor(x_codes, x_scales, "mx") if save_input else None
        return NormQuantized(
            QuantizedTensor(q, s, layout), rstd, mean if kind == "layer" else None, y if write_output else None, x_mx
        )
    y, rstd, mean = norm_reference(x, weight, bias, eps, kind, out_dtype)
    x_mx = quantize_reference(x, "mx", "rceil") if save_input else None
    return NormQuantized(quantize_reference(y, layout, rounding), rstd, mean, y if write_output else None, x_mx)


def norm_quantize_transposed(
    x: Tensor | QuantizedTensor,
    rstd: Tensor,
    mean: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    kind: str = "rms",
    layout: str = "mx",
    rounding: str = "rceil",
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> QuantizedTensor:
    """The norm's output ``y = norm(x)`` (from saved ``rstd``/``mean``), transposed and quantized along ``R``.

    This is ``quantize(y, layout, rows=False, cols=True)[1]`` without ``y`` ever being stored: the weight
    gradient of the GEMM after a fused norm reads it, and the norm's backward keeps ``x`` anyway.

    Args:
        x: ``[R, D]`` the norm's input, or its ``mx``-layout copy (:func:`norm_quantize`'s ``x_mx``: the values
            are read from the copy, a quarter of an fp32 input's bytes; ``out_dtype`` then required, ``layout``
            ``"mx"`` or ``"1x128"``). rstd, mean: ``[R]`` fp32 from :func:`norm_quantize` (``mean`` for LayerNorm
            only). weight, bias: the norm's ``[D]`` parameters or None.
        kind, layout, rounding, out_dtype, impl: as in :func:`norm_quantize`.

    Returns:
        ``[D, Rp]`` :class:`~lightning_gem.ops.mx.formats.QuantizedTensor` (``Rp`` as in :func:`quantize`).
    """
    x_scales = None  # with an MX copy on the Triton path: its scales, the kernel decoding x from the codes
    if isinstance(x, QuantizedTensor):
        if x.layout != "mx" or out_dtype is None or layout not in ("mx", "1x128"):
            raise ValueError("an MX copy `x` needs the 'mx' layout, an `out_dtype`, and `layout` 'mx' or '1x128'")
        if resolve_impl(impl, rstd) == "triton":  # rstd: fp32 on the copy's device, as x's values are
            x, x_scales = x.data, x.scale.contiguous()
        else:
            x = x.dequantize(torch.float32)  # the reference path normalises in fp32 whatever x's dtype
    else:
        _check_matrix(x, "x", layout)
    if kind not in ("rms", "layer") or (kind == "layer") != (mean is not None):
        raise ValueError(f"`kind` must be 'rms' (no `mean`) or 'layer' (with `mean`), got {kind!r}")
    if tuple(rstd.shape) != (x.shape[0],):
        raise ValueError(f"`rstd` must have shape [{x.shape[0]}] (x's rows), got {tuple(rstd.shape)}")
    if x_scales is not None or resolve_impl(impl, x) == "triton":
        from lightning_gem.ops.mx.impl.triton import mx_quantize

        args = (x.contiguous(), layout, rounding, False, True, kind, rstd, mean, weight, bias, out_dtype, False)
        outputs = mx_quantize(*args, x_scales)
        return QuantizedTensor(outputs[2], outputs[3], layout)
    y = normalize_with_stats(x, rstd, mean, weight, bias, out_dtype or x.dtype)
    return quantize(y, layout, rounding=rounding, rows=False, cols=True, impl="reference")[1]
