"""GEMMs of block-scaled FP8 operands: ``a @ b^T`` with both operands quantized along the shared dim.

Legend: ``a`` is ``[M, K]``, ``b`` is ``[N, K]``, the result ``[M, N]``; ``K`` is the contraction dim.

Backends:

- ``"emulated"``: dequantize both operands to fp32 and multiply in fp32, on any device. FP8 products are
  exact in fp32 and the scales are powers of two, so this is the block-scaled GEMM's arithmetic up to the
  fp32 summation order: the numerics of MXFP8 hardware without the hardware.
- ``"scaled_mm"``: ``torch._scaled_mm`` (cuBLAS). Hopper (sm_90) runs ``rowwise`` x ``rowwise`` and the
  blockwise pairs ``1x128`` x ``128x128`` (forward, input gradient) and ``1x128`` x ``1x128`` (weight
  gradient); ``mx`` x ``mx`` (E8M0 scales in cuBLAS's swizzled tiles) needs sm_100 or newer. A ``128x128``
  operand's contraction dim must be a multiple of 512 (its scale rows a multiple of 4): on the H200 with torch
  2.11, narrower ones gave wrong results past the first 128 output columns (cuBLAS pads that dim to 4).
  ``mx_native`` (sm_100) is written to cuBLAS's documented layout but has not been run. A ``1x128`` first
  operand's rows are zero-padded to a multiple of 128 (jagged token counts are arbitrary; cuBLAS refused
  such a GEMM with CUBLAS_STATUS_NOT_SUPPORTED on the H200) and the result sliced back.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from lightning_gem.ops._device import device_capability
from lightning_gem.ops.mx.formats import QuantizedTensor

__all__ = ["GEMM_BACKENDS", "scaled_mm", "scaled_mm_supported"]

log = logging.getLogger(__name__)

GEMM_BACKENDS = ("emulated", "scaled_mm")
_BLOCKWISE_ROWS = 128
_NO_BIAS_EPILOGUE: set[tuple[str, str]] = set()  # layout pairs whose cuBLAS GEMM refused a bias here
_NATIVE_PAIRS = {("rowwise", "rowwise"), ("1x128", "128x128"), ("1x128", "1x128"), ("mx", "mx")}


def scaled_mm_supported(layout_a: str, layout_b: str, device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs this layout pair on ``device`` (asked at call time)."""
    if device.type != "cuda" or (layout_a, layout_b) not in _NATIVE_PAIRS:
        return False
    major, minor = device_capability(device)
    if layout_a == "mx":
        return major >= 10
    if layout_a == "rowwise":
        return (major, minor) >= (8, 9)
    return major == 9  # cuBLAS's 1x128 / 128x128 block scaling is an sm_90 feature


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype,
    backend: str,
    fast_accum: bool = False,
    bias: Tensor | None = None,
) -> Tensor:
    """``[M, N]`` ``dequantize(a) @ dequantize(b)^T (+ bias)`` in ``out_dtype``.

    Args:
        a: ``[M, K]`` quantized along ``K``.
        b: ``[N, K]`` quantized along ``K`` (a weight is ``[out_features, in_features]``: ``x @ w^T``).
        out_dtype: result dtype (``scaled_mm`` with ``rowwise`` scales supports bfloat16 only).
        backend: ``"emulated"`` or ``"scaled_mm"`` (see the module docstring); never falls back.
        fast_accum: let ``scaled_mm`` accumulate in the tensor cores' reduced-precision accumulator (faster;
            fine for short contraction dims such as a forward's features, not for a weight gradient's tokens).
        bias: ``[N]`` added to every row before the cast to ``out_dtype``: in cuBLAS's epilogue (no extra pass
            over the output) where it takes one for this layout pair, else as a separate add.

    Raises:
        ValueError: mismatched contraction dims, or ``scaled_mm`` on a device or layout pair it lacks.
    """
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"`a` [M, K] and `b` [N, K] must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if backend == "emulated":
        out = a.dequantize() @ b.dequantize().t()
        return (out if bias is None else out + bias.to(out.dtype)).to(out_dtype)
    if backend != "scaled_mm":
        raise ValueError(f"`backend` must be one of {GEMM_BACKENDS}, got {backend!r}")
    if not scaled_mm_supported(a.layout, b.layout, a.data.device):
        raise ValueError(
            f"torch._scaled_mm does not run {a.layout} x {b.layout} scales on {a.data.device}: use backend='emulated'"
        )
    rows = a.shape[0]
    if a.layout == "1x128" and rows % _BLOCKWISE_ROWS:
        a = _pad_rows(a, _BLOCKWISE_ROWS)
    scale_a, scale_b = _native_scales(a), _native_scales(b)
    if b.layout == "rowwise":
        scale_b = scale_b.reshape(1, -1)
    elif b.layout != "mx":  # [N, K / 128] or [N / 128, K / 128] -> transposed, as b itself is passed
        scale_b = scale_b.t()

    def gemm(epilogue_bias: Tensor | None = None) -> Tensor:
        return torch._scaled_mm(
            a.data, b.data.t(), scale_a, scale_b, bias=epilogue_bias, out_dtype=out_dtype, use_fast_accum=fast_accum
        )

    out = None
    pair = (a.layout, b.layout)
    if bias is not None and pair not in _NO_BIAS_EPILOGUE:
        try:
            out = gemm(bias.to(out_dtype))
        except RuntimeError as err:  # this cuBLAS has no bias epilogue for these scales: add it apart from now on
            _NO_BIAS_EPILOGUE.add(pair)
            log.info("torch._scaled_mm takes no bias with %s x %s scales here (%s): adding it separately", *pair, err)
    if out is None:
        out = gemm()
        if bias is not None:
            out = out + bias.to(out.dtype)
    return out[:rows] if out.shape[0] != rows else out


def _pad_rows(q: QuantizedTensor, multiple: int) -> QuantizedTensor:
    """A ``1x128``-quantized ``[M, K]`` as ``[M', K]``, ``M'`` the next multiple of ``multiple``: the rows past ``M``
    only make output rows the caller drops. Where the codes' and scales' storage extends that far (the kit's
    quantizers allocate so: ``row_buffers``), views of it; otherwise a copy with zero rows (scale 1) appended."""
    (rows, cols), lines = q.shape, q.scale.shape[1]
    padded = -(-rows // multiple) * multiple
    data, scale = q.data, q.scale
    if (
        data.stride() == (cols, 1)
        and scale.stride() == (1, padded)  # outer-dim-major, its lines `padded` apart
        and data.untyped_storage().nbytes() >= (data.storage_offset() + padded * cols) * data.element_size()
        and scale.untyped_storage().nbytes() >= (scale.storage_offset() + padded * lines) * scale.element_size()
    ):
        return QuantizedTensor(
            data.as_strided((padded, cols), (cols, 1)), scale.as_strided((padded, lines), (1, padded)), q.layout
        )
    data = q.data.new_zeros(padded, q.shape[1])
    data[:rows] = q.data
    scale = q.scale.new_ones(q.scale.shape[1], padded).t()  # outer-dim-major, as _native_scales passes it
    scale[:rows] = q.scale
    return QuantizedTensor(data, scale, q.layout)


def _native_scales(q: QuantizedTensor) -> Tensor:
    """``q``'s scales as ``torch._scaled_mm`` reads them for the first operand's orientation."""
    scale = q.scale
    if q.layout == "1x128" and scale.stride(0) != 1:  # outer-dim-major ([R, K/128] with the rows contiguous)
        scale = scale.t().contiguous().t()
    elif q.layout == "128x128" and scale.shape[1] % 4:
        raise ValueError(
            f"128x128 scales need K / 128 to be a multiple of 4 for torch._scaled_mm here, got K = {q.shape[1]}"
        )
    elif q.layout == "mx":
        scale = _to_blocked(scale).view(torch.float8_e8m0fnu)
    return scale


def _to_blocked(scale: Tensor) -> Tensor:
    """E8M0 scales ``[R, K/32]`` in cuBLAS's block-scaling tiles: 128 rows x 4 scale columns per tile,
    rows interleaved as ``(32, 4)``, the tile flattened; rows padded to 128 and columns to 4 with zeros.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scale.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = scale
    tiles = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(padded_rows, padded_cols)
