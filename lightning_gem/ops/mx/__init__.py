"""MXFP8 and block-scaled FP8: quantizers, fused norm + quantize, random Hadamard, scaled GEMMs.

Imports torch only; the Triton kernels load on first use. See :mod:`lightning_gem.ops.mx.formats` for
the formats and the exact scale rule.
"""

from lightning_gem.ops.mx.api import (
    IMPLS,
    NormQuantized,
    dequantize,
    norm_quantize,
    norm_quantize_transposed,
    quantize,
    resolve_impl,
)
from lightning_gem.ops.mx.formats import E4M3_MAX, LAYOUTS, QuantizedTensor, block_shape
from lightning_gem.ops.mx.gemm import GEMM_BACKENDS, scaled_mm, scaled_mm_supported
from lightning_gem.ops.mx.hadamard import random_hadamard, random_hadamard_matrix
from lightning_gem.ops.mx.impl.reference import quantization_stats

__all__ = [
    "E4M3_MAX",
    "GEMM_BACKENDS",
    "IMPLS",
    "LAYOUTS",
    "NormQuantized",
    "QuantizedTensor",
    "block_shape",
    "dequantize",
    "norm_quantize",
    "norm_quantize_transposed",
    "quantization_stats",
    "quantize",
    "random_hadamard",
    "random_hadamard_matrix",
    "resolve_impl",
    "scaled_mm",
    "scaled_mm_supported",
]
