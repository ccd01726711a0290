"""Pure-PyTorch quantizers, fused norm + quantize and the random Hadamard transform: the oracles.

Every function runs on any device (CPU included) and is bit-exact to the rules in
:mod:`lightning_gem.ops.mx.formats`; the Triton kernels are tested against these.

Legend: ``R`` rows, ``C`` columns (quantized along ``C``), ``Br x Bc`` a scale block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gem.ops.mx.formats import E4M3_MAX, E8M0_BIAS, E8M0_NAN, QuantizedTensor, block_shape

__all__ = [
    "fwht",
    "norm_reference",
    "normalize_with_stats",
    "pow2",
    "quantization_stats",
    "quantize_reference",
    "shared_exponent",
]

_F32_EXPONENT_OF_E4M3_MAX = E8M0_BIAS + 8  # biased fp32 exponent of 448 = 1.75 * 2^8
_F32_MANTISSA_OF_1_75 = 0x600000


def shared_exponent(amax: Tensor, rounding: str = "rceil") -> Tensor:
    """int32 block exponents ``e`` from fp32 block maxima (see the scale rule in :mod:`~lightning_gem.ops.mx.formats`).

    ``rceil``: the smallest ``e`` with ``amax / 2^e <= 448``; ``floor``: ``floor(log2(amax)) - 8``. Both read
    the fp32 exponent and mantissa fields, so no rounding is involved; zero or subnormal maxima give -127,
    results are clamped to ``[-127, 127]``. NaN/Inf maxima are not special-cased here (callers mask them).
    """
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"`rounding` must be 'rceil' or 'floor', got {rounding!r}")
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    exponent_field = (bits >> 23) & 0xFF
    exponent = exponent_field - _F32_EXPONENT_OF_E4M3_MAX
    if rounding == "rceil":
        exponent = exponent + ((bits & 0x7FFFFF) > _F32_MANTISSA_OF_1_75).to(torch.int32)
    exponent = torch.where(exponent_field == 0, -E8M0_BIAS, exponent)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def pow2(exponent: Tensor) -> Tensor:
    """Exact fp32 ``2^e`` for int ``e`` in ``[-127, 127]`` (``2^-127`` is an fp32 subnormal)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def _blocks(x: Tensor, layout: str) -> tuple[Tensor, int, int]:
    """``x`` as fp32 ``[R / Br, Br, C / Bc, Bc]`` blocks (``R`` zero-padded to a multiple of ``Br``)."""
    if x.ndim != 2:
        raise ValueError(f"`x` must be a 2-D [R, C] matrix, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    block_rows, block_cols = block_shape(layout, cols)
    if cols == 0 or cols % block_cols:
        raise ValueError(f"`x` must have a positive multiple of {block_cols} columns for layout {layout!r}, got {cols}")
    padded_rows = -(-rows // block_rows) * block_rows
    if padded_rows == rows:
        xf = x.to(torch.float32).contiguous()
    else:
        xf = torch.zeros(padded_rows, cols, dtype=torch.float32, device=x.device)
        xf[:rows] = x
    return xf.view(padded_rows // block_rows, block_rows, cols // block_cols, block_cols), rows, cols


def quantize_reference(x: Tensor, layout: str, rounding: str = "rceil") -> QuantizedTensor:
    """Quantize ``[R, C]`` ``x`` along ``C`` into ``layout`` (see :mod:`~lightning_gem.ops.mx.formats`).

    Args:
        x: ``[R, C]`` float matrix; ``C`` a multiple of the block's columns. For ``128x128``, ``R`` need not
            be a multiple of 128 (the last tile's scale covers the rows present).
        layout: ``"mx"``, ``"1x128"``, ``"128x128"`` or ``"rowwise"``.
        rounding: ``"rceil"`` (default) or ``"floor"``.

    Returns:
        A :class:`~lightning_gem.ops.mx.formats.QuantizedTensor` with row-major scales.

    Example:
        >>> import torch
        >>> q = quantize_reference(torch.tensor([[480.0] + [1.0] * 31]), "mx")
        >>> int(q.scale), float(q.data[0, 0].float())  # 2^1: 480 fits as 240 instead of saturating
        (128, 240.0)
    """
    blocks, rows, cols = _blocks(x, layout)
    amax = blocks.abs().amax(dim=(1, 3))
    nonfinite = ~torch.isfinite(amax)  # amax propagates NaN and Inf
    exponent = shared_exponent(amax, rounding)
    scaled = blocks * pow2(-exponent)[:, None, :, None]
    scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX).masked_fill(nonfinite[:, None, :, None], float("nan"))
    data = scaled.reshape(-1, cols)[:rows].to(torch.float8_e4m3fn)
    if layout == "mx":
        scale = (exponent + E8M0_BIAS).to(torch.uint8).masked_fill(nonfinite, E8M0_NAN)
    else:
        scale = pow2(exponent).masked_fill(nonfinite, float("nan"))
    return QuantizedTensor(data, scale, layout)


def quantization_stats(x: Tensor, layout: str, rounding: str = "rceil") -> Tensor:
    """int64 ``[saturated, underflowed, non-finite, total]`` element counts of quantizing ``x`` along ``C``.

    ``saturated``: finite elements whose scaled magnitude exceeded 448 (clipped; only ``floor`` rounding can
    do this). ``underflowed``: non-zero finite elements that became zero. ``non-finite``: elements in blocks
    holding a NaN or an infinity (they dequantize to NaN).
    """
    blocks, rows, cols = _blocks(x, layout)
    amax = blocks.abs().amax(dim=(1, 3))
    nonfinite_block = ~torch.isfinite(amax)
    exponent = shared_exponent(amax, rounding)
    scaled = blocks * pow2(-exponent)[:, None, :, None]
    finite = ~nonfinite_block[:, None, :, None]
    saturated = (scaled.abs() > E4M3_MAX) & finite
    underflowed = (scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() == 0) & (blocks != 0) & finite
    num_nonfinite = nonfinite_block.sum() * blocks.shape[1] * blocks.shape[3]
    counts = [saturated.sum(), underflowed.sum(), num_nonfinite, torch.tensor(rows * cols, device=x.device)]
    return torch.stack([c.to(torch.int64) for c in counts])


def normalize_with_stats(
    x: Tensor, rstd: Tensor, mean: Tensor | None, weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """A norm's output from its saved statistics: ``((x - mean) * rstd) * weight + bias`` in fp32, cast to ``dtype``."""
    y = x.float()
    if mean is not None:
        y = y - mean[:, None]
    y = y * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def norm_reference(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    kind: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """RMSNorm (``kind="rms"``) or LayerNorm (``"layer"``) over the last dim of ``[R, D]`` ``x``, in fp32 (fp64 for
    fp64 ``x``: the oracle tests compare with).

    Returns:
        ``(y [R, D] in out_dtype (default x's), rstd [R], mean [R] or None)``, the statistics in the compute dtype.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = xf.mean(dim=-1) if kind == "layer" else None
    centered = xf - mean[:, None] if mean is not None else xf
    rstd = torch.rsqrt(centered.square().mean(dim=-1) + eps)
    y = centered * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype), rstd, mean


def fwht(x: Tensor) -> Tensor:
    """Unnormalised fast Walsh-Hadamard transform over the last dim (a power of two): ``x @ H``, Sylvester order.

    ``log2(n)`` butterfly stages, ``O(n log n)``; ``H H^T = n I``.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the transformed dim must be a power of two, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x
