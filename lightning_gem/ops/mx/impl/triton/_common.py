"""Device helpers every MX/FP8 kernel shares: the exact block exponent, ``2^e`` and the saturating cast.

They implement :func:`lightning_gem.ops.mx.impl.reference.shared_exponent` and the element rule of
:mod:`lightning_gem.ops.mx.formats` on fp32 tiles with integer bit operations, so kernels and the
reference agree bit for bit (no ``log2``, ``exp2`` or division, whose GPU versions are approximate).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _shared_exponent(amax, RCEIL: tl.constexpr):
    """int32 ``e`` of fp32 block maxima: ``rceil`` (``RCEIL``) or ``floor``; zero/subnormal -> -127; clamped."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent_field = (bits >> 23) & 0xFF
    exponent = exponent_field - 135  # 135: biased fp32 exponent of 448 = 1.75 * 2^8
    if RCEIL:
        exponent += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above 1.75: one more power of two
    exponent = tl.where(exponent_field == 0, -127, exponent)
    return tl.minimum(tl.maximum(exponent, -127), 127)


@triton.jit
def _pow2(exponent):
    """Exact fp32 ``2^e`` for int32 ``e`` in ``[-127, 127]`` built from bits (``2^-127`` is subnormal)."""
    bits = tl.where(exponent >= -126, (exponent + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` in ``[-448, 448]`` rounded to nearest-even on the E4M3 grid, still in fp32.

    Normal range: keep 3 mantissa bits of the fp32 pattern (the carry moves into the exponent as it
    should). Below E4M3's smallest normal ``2^-6`` the grid is uniform (``2^-9`` apart): add and subtract
    ``1.5 * 2^23`` at that scale, which rounds to nearest-even in fp32 arithmetic. Done by hand because the
    interpreter's fp32 -> e4m3 cast truncates across binades; the hardware cast then converts exactly.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _to_e4m3(x, exponent, nonfinite):
    """``x * 2^-e`` saturated to +-448 and rounded to E4M3; NaN where ``nonfinite`` (broadcast shapes)."""
    scaled = x * _pow2(-exponent)
    scaled = _round_e4m3(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
    code = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    code = tl.where(nonfinite, 0x7F, code)  # E4M3's NaN, written as bits (the interpreter mis-casts NaN)
    return code.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _scale_value(exponent, nonfinite, MX: tl.constexpr):
    """What a scale tensor stores: biased E8M0 (``0xFF`` NaN) for ``MX``, else fp32 ``2^e`` (NaN)."""
    if MX:
        value = tl.where(nonfinite, 255, exponent + 127).to(tl.uint8)
    else:
        value = tl.where(nonfinite, float("nan"), _pow2(exponent))
    return value


@triton.jit
def _quantize_rows(x, TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK: tl.constexpr, RCEIL: tl.constexpr):
    """Quantize an fp32 ``[TILE_R, TILE_C]`` tile in ``1 x BLOCK`` blocks: ``(e4m3 tile, exponents, nonfinite)``.

    The exponents and NaN flags are ``[TILE_R, TILE_C // BLOCK]``, one per block.
    """
    NUM_BLOCKS: tl.constexpr = TILE_C // BLOCK
    blocks = tl.reshape(x, (TILE_R, NUM_BLOCKS, BLOCK))
    amax = tl.max(tl.abs(blocks), axis=2)
    bad = (blocks != blocks) | (tl.abs(blocks) == float("inf"))
    nonfinite = tl.max(bad.to(tl.int32), axis=2) > 0
    exponent = _shared_exponent(amax, RCEIL)
    q = _to_e4m3(blocks, exponent[:, :, None], nonfinite[:, :, None])
    return tl.reshape(q, (TILE_R, TILE_C)), exponent, nonfinite


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was defined under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def run_kernel(kernel: object, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
    """Launch through ``wrap_triton`` so traced graphs hold the kernel; skip interpreted kernels on fake tensors.

    ``wrap_triton`` hands interpreted kernels back unwrapped, and those would read fake tensors' data:
    under the interpreter, tracing allocates the outputs and launches nothing (that is the fake impl).
    """
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from torch.library import wrap_triton

    if interpreted(kernel) and any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return
    wrap_triton(kernel)[grid](*args, **meta)
