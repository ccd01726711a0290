"""Device helpers every MX/FP8 kernel shares: the exact block exponent, ``2^e`` and the E4M3 cast.

They implement :func:`lightning_gem.ops.mx.impl.reference.shared_exponent` and the element rule of
:mod:`lightning_gem.ops.mx.formats` on fp32 tiles with integer bit operations, so kernels and the
reference agree bit for bit (no ``log2``, ``exp2`` or division, whose GPU versions are approximate).

Block maxima are taken over the magnitudes' bit patterns as integers: for non-negative floats integer
order is float order, and Inf (``0x7F800000``) and NaN (above it) come out on top, so one integer
reduction gives both the maximum and whether the block holds a non-finite value.
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from lightning_gem.ops._launch import is_interpreted, launch
from lightning_gem.ops._tuning import pick_fastest

NONFINITE_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _magnitude_bits(x):
    """int32 bit patterns of ``|x|`` (ordered as ``|x|``; Inf and NaN at the top)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _shared_exponent(amax_bits, RCEIL: tl.constexpr):
    """int32 ``e`` of block maxima given as magnitude bits: ``rceil`` or ``floor``; zero/subnormal -> -127."""
    exponent_field = amax_bits >> 23
    exponent = exponent_field - 135  # 135: biased fp32 exponent of 448 = 1.75 * 2^8
    if RCEIL:
        exponent += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above 1.75: one power more
    exponent = tl.where(exponent_field == 0, -127, exponent)
    return tl.minimum(tl.maximum(exponent, -127), 127)


@triton.jit
def _pow2(exponent):
    """Exact fp32 ``2^e`` for int32 ``e`` in ``[-127, 127]`` built from bits (``2^-127`` is subnormal)."""
    bits = tl.where(exponent >= -126, (exponent + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_mx(codes, biased):
    """fp32 values of MX blocks: ``codes`` (E4M3 as uint8, blocks of 32 along a last dim of their own) times
    ``2^(biased - 127)`` (``biased``: their E8M0 scales, ``codes``'s shape without that dim; ``0xFF``: a NaN block)."""
    scale = tl.where(biased == 255, float("nan"), _pow2(biased.to(tl.int32) - 127))
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.expand_dims(scale, -1)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` in ``[-448, 448]`` rounded to nearest-even on the E4M3 grid, still in fp32.

    Normal range: keep 3 mantissa bits of the fp32 pattern (the carry moves into the exponent as it
    should). Below E4M3's smallest normal ``2^-6`` the grid is uniform (``2^-9`` apart): add and subtract
    ``1.5 * 2^23`` at that scale, which rounds to nearest-even in fp32 arithmetic; done on ``|v|`` with the
    sign put back, so what rounds to zero keeps its sign (``-0`` is its own E4M3 code, as ``cvt.rn`` writes
    it). Used under the interpreter, whose fp32 -> e4m3 cast truncates across binades; GPUs convert with
    ``cvt.rn``.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    subnormal = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sign = bits & -2147483648  # the sign bit, 0x80000000
    subnormal = (subnormal.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _to_e4m3(x, exponent, nonfinite, SATURATE: tl.constexpr, EXACT: tl.constexpr):
    """``x * 2^-e`` rounded to E4M3 (nearest-even), saturated to +-448; NaN (``0x7F``) where ``nonfinite``.

    ``SATURATE``: clamp first (FLOOR exponents can overshoot 448; RCEIL ones never do). ``EXACT``: round
    in fp32 arithmetic before the cast (the interpreter's cast is wrong; the hardware's is exact).

    On GPUs NaN blocks are made in fp32, before the cast: the RCEIL path multiplies a NaN block by a NaN
    factor (one select per block, none per element; a GPU's fp32 NaN results are the positive canonical
    NaN, which the saturating cast writes as ``0x7F``). A select on the uint8 codes instead compiled to
    unpacking and repacking the cast's byte pairs, about four instructions an element.
    """
    if EXACT:
        scaled = tl.minimum(tl.maximum(x * _pow2(-exponent), -448.0), 448.0)
        code = _round_e4m3(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(nonfinite, 0x7F, code)  # E4M3's NaN, written as bits (the interpreter mis-casts NaN)
        return code.to(tl.float8e4nv, bitcast=True)
    if SATURATE:  # after the clamp: min/max would turn NaN into +-448
        scaled = tl.minimum(tl.maximum(x * _pow2(-exponent), -448.0), 448.0)
        return tl.where(nonfinite, float("nan"), scaled).to(tl.float8e4nv)
    return (x * tl.where(nonfinite, float("nan"), _pow2(-exponent))).to(tl.float8e4nv)


@triton.jit
def _magnitude_bits_of(x):
    """``_magnitude_bits`` of ``x`` in its own dtype's values: a bf16 tile's from its 16-bit patterns (the fp32
    pattern of a bf16 value is its own shifted up 16 bits), so the tile need not be held widened to fp32."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
    else:
        return _magnitude_bits(x.to(tl.float32))


@triton.jit
def _scale_value(exponent, nonfinite, MX: tl.constexpr):
    """What a scale tensor stores: biased E8M0 (``0xFF`` NaN) for ``MX``, else fp32 ``2^e`` (NaN)."""
    if MX:
        value = tl.where(nonfinite, 255, exponent + 127).to(tl.uint8)
    else:
        value = tl.where(nonfinite, float("nan"), _pow2(exponent))
    return value


@triton.jit
def _quantize_blocks(x, AXIS: tl.constexpr, RCEIL: tl.constexpr, EXACT: tl.constexpr):
    """Quantize ``x`` in blocks that run along ``AXIS``: ``(e4m3 codes, exponents, nonfinite)``, the last two with
    ``AXIS`` reduced away. A block's maximum comes from ``x``'s own dtype (``_magnitude_bits_of``); masked
    elements loaded as zeros lower no maximum."""
    amax_bits = tl.max(_magnitude_bits_of(x), axis=AXIS)
    nonfinite = amax_bits >= NONFINITE_BITS
    exponent = _shared_exponent(amax_bits, RCEIL)
    exponents, flags = tl.expand_dims(exponent, AXIS), tl.expand_dims(nonfinite, AXIS)
    return _to_e4m3(x.to(tl.float32), exponents, flags, not RCEIL, EXACT), exponent, nonfinite


@triton.jit
def _quantize_rows(
    x,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK: tl.constexpr,
    RCEIL: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Quantize an fp32 ``[TILE_R, TILE_C]`` tile in ``1 x BLOCK`` blocks: ``(e4m3 tile, exponents, nonfinite)``.

    The exponents and NaN flags are ``[TILE_R, TILE_C // BLOCK]``, one per block.
    """
    q, exponent, nonfinite = _quantize_blocks(tl.reshape(x, (TILE_R, TILE_C // BLOCK, BLOCK)), 2, RCEIL, EXACT)
    return tl.reshape(q, (TILE_R, TILE_C)), exponent, nonfinite


@triton.jit
def _load_mx_tile(CODES, SCALES, rows, row_ok, col0, width, num_cols, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """An fp32 ``[TILE_R, TILE_C]`` tile decoded from an MX copy along rows (E4M3 codes ``[R, width]`` as bytes, biased
    E8M0 scales ``[R, width / 32]``): rows ``rows`` where ``row_ok``, columns from ``col0`` (a multiple of 32), the
    first ``num_cols`` of them; zeros elsewhere."""
    cols = tl.arange(0, TILE_C)
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    codes = tl.load(CODES + rows[:, None] * width + col0 + cols[None, :], mask=mask, other=0)
    blocks = tl.arange(0, TILE_C // 32)
    scale_mask = row_ok[:, None] & (blocks < num_cols // 32)[None, :]
    biased = tl.load(SCALES + rows[:, None] * (width // 32) + col0 // 32 + blocks[None, :], mask=scale_mask, other=127)
    return tl.reshape(_decode_mx(tl.reshape(codes, (TILE_R, TILE_C // 32, 32)), biased), (TILE_R, TILE_C))


@triton.jit
def _store_mx_tile(CODES, SCALES, x, rows, row_ok, col0, width, num_cols, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
                   EXACT: tl.constexpr):  # fmt: skip
    """Store the fp32 tile ``x`` as its MX copy (RCEIL blocks of 32 along the row) where :func:`_load_mx_tile` reads
    it (codes as bytes)."""
    cols = tl.arange(0, TILE_C)
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    q, exponent, nonfinite = _quantize_rows(x, TILE_R, TILE_C, 32, True, EXACT)
    tl.store(CODES + rows[:, None] * width + col0 + cols[None, :], q.to(tl.uint8, bitcast=True), mask=mask)
    blocks = tl.arange(0, TILE_C // 32)
    scale_mask = row_ok[:, None] & (blocks < num_cols // 32)[None, :]
    scales = _scale_value(exponent, nonfinite, True)
    tl.store(SCALES + rows[:, None] * (width // 32) + col0 // 32 + blocks[None, :], scales, mask=scale_mask)


_CHOSEN: dict[tuple, tuple[int, ...] | str] = {}  # a str: which plan of several launches (quantize's rows+cols)
_UNTUNED: dict[tuple, tuple[tuple[int, ...], str]] = {}


def chosen_configs() -> dict[tuple, tuple[int, ...] | str]:
    """The tile choices made so far in this process, ``{key: (TILE_R, TILE_C, ..., num_warps)}``, and the plans
    chosen where a launch has several (one entry per tuning: for logs and benchmarks)."""
    return dict(_CHOSEN)


def untuned_configs() -> dict[tuple, tuple[tuple[int, ...], str]]:
    """Keys launched with their first config, untimed, in this process: ``{key: (config, why)}`` (why no tuning
    ran: ``"small"``, ``"interpreted"``, ``"one candidate"`` or ``"not timeable"``; for logs and benchmarks)."""
    return dict(_UNTUNED)


TUNE_ABOVE = 1 << 22
"""Elements: smaller problems (and interpreted kernels) take the first valid config, with no tuning runs."""


def size_class(elements: int) -> int:
    """A problem's size in its tuning key (and kernel argument): log2 of its element count, coarsened."""
    return max(elements, 1).bit_length() // 2


def launch_tuned(
    kernel: object,
    configs: list[tuple[int, ...]],
    key: tuple,
    grid: Callable[..., tuple[int, ...]],
    args: tuple,
    meta: dict,
    elements: int,
    names: tuple[str, ...] = ("TILE_R", "TILE_C"),
) -> None:
    """Launch ``kernel`` with the fastest of ``configs`` (``(TILE_R, TILE_C, ..., num_warps)``, already pruned to
    the valid ones) for ``key``, chosen by :func:`lightning_gem.ops._tuning.pick_fastest` on this call's own
    buffers. ``names``: the kernel's names of a config's entries before ``num_warps`` (``grid`` takes the first
    two in that order).

    The key is explicit (the caller's :func:`size_class` and compile-time flags), so a new batch of another jagged
    size retunes only when its size class is new. Problems of fewer than :data:`TUNE_ABOVE` ``elements``, and
    interpreted kernels, take the first config. Where timing is impossible (tracing, graph capture, CPU) the
    first config runs and nothing is remembered. Keys that were not timed are listed by :func:`untuned_configs`.
    """
    why = "small" if elements < TUNE_ABOVE else "interpreted" if is_interpreted(kernel) else None
    if why is not None:
        configs = configs[:1]

    def run(config: tuple[int, ...]) -> None:
        *tiles, warps = config
        launch(kernel, grid(*tiles), args, {**meta, **dict(zip(names, tiles, strict=True)), "num_warps": warps})

    config = pick_fastest(_CHOSEN, key, configs, run, args)
    _note_untuned(key, config, why or ("one candidate" if len(configs) == 1 else "not timeable"))
    run(config)


def _note_untuned(key: tuple, config: tuple[int, ...], why: str) -> None:
    """Log ``key`` in :func:`untuned_configs` unless the tuner remembered a choice for it."""
    try:
        if key not in _CHOSEN and key not in _UNTUNED and len(_UNTUNED) < 256:  # bounded: jagged sizes make keys
            _UNTUNED[key] = (config, why)
    except TypeError:  # an unhashable SymInt in the key
        pass
