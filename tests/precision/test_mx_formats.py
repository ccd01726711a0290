"""Bit-exact MX / FP8 block quantization on the spec's edge cases, for the reference and the Triton kernels.

Expected codes are worked out by hand from the rule in ``lightning_gem.ops.mx.formats``: ``e = ceil(log2(amax
/ 448))`` (RCEIL) or ``floor(log2(amax)) - 8`` (FLOOR), elements ``x * 2^-e`` rounded to nearest-even E4M3
and saturated to 448, NaN scale (E8M0 0xFF) for blocks holding NaN or Inf.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gem.ops.mx import quantization_stats, quantize
from lightning_gem.ops.mx.formats import decode_scale
from lightning_gem.ops.mx.impl.reference import shared_exponent

IMPLS = ["reference", "triton"]
NAN = float("nan")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton impl needs CUDA tensors where there is a GPU


def _mx_block(*values: float) -> torch.Tensor:
    """One 32-wide block: ``values`` then zeros."""
    block = torch.zeros(1, 32)
    block[0, : len(values)] = torch.tensor(values)
    return block.to(DEVICE)


def _quantize_one(x: torch.Tensor, layout: str, impl: str, rounding: str = "rceil"):
    return quantize(x, layout, rounding=rounding, impl=impl)[0]


@pytest.mark.parametrize(
    ("amax", "rceil", "floor"),
    [
        (448.0, 0, 0),
        (480.0, 1, 0),  # above 448: RCEIL moves up a power, FLOOR saturates
        (512.0, 1, 1),  # an exact power of two
        (449.0, 1, 0),
        (256.0, 0, 0),
        (1.0, -8, -8),
        (0.0, -127, -127),  # all-zero block
        (1e-40, -127, -127),  # fp32 subnormal
        (2.0**-120, -127, -128 + 1),  # below the E8M0 range: clamped
        (3.0e38, 120, 119),
    ],
)
def test_shared_exponent(amax: float, rceil: int, floor: int) -> None:
    value = torch.tensor([amax])
    assert int(shared_exponent(value, "rceil")) == rceil
    assert int(shared_exponent(value, "floor")) == max(floor, -127)
    if 0 < amax < 3e38 and rceil > -127:  # RCEIL is the smallest power of two that fits the block
        assert amax / 2.0**rceil <= 448 < amax / 2.0 ** (rceil - 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("rounding", "values", "scale", "codes"),
    [
        ("rceil", (448.0, 1.0), 127, (448.0, 1.0)),
        ("rceil", (480.0, 1.0), 128, (240.0, 0.5)),
        ("floor", (480.0, 1.0), 127, (448.0, 1.0)),  # saturated
        ("rceil", (512.0, -3.0), 128, (256.0, -1.5)),  # block max exactly a power of two
        ("rceil", (-448.0, 2.0**-8, 3 * 2.0**-10, 2.0**-10, 2.0**-11, 0.75 * 2.0**-9), 127,
         (-448.0, 2.0**-8, 2.0**-8, 0.0, 0.0, 2.0**-9)),  # E4M3 subnormals: ties to even, underflow to 0
        ("rceil", (0.0,), 0, (0.0,)),  # all-zero block: scale 2^-127, elements 0
    ],
)  # fmt: skip
def test_mx_edge_cases(impl: str, rounding: str, values: tuple, scale: int, codes: tuple) -> None:
    q = _quantize_one(_mx_block(*values), "mx", impl, rounding)
    assert q.scale.dtype == torch.uint8 and int(q.scale) == scale
    assert q.data.float()[0, : len(codes)].tolist() == list(codes)
    assert bool((q.data.float()[0, len(codes) :] == 0).all())
    assert q.dequantize()[0, : len(codes)].tolist() == [c * 2.0 ** (scale - 127) for c in codes]


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_subnormal_block_keeps_its_values(impl: str) -> None:
    x = _mx_block(1e-40, -3e-41)
    q = _quantize_one(x, "mx", impl)
    assert int(q.scale) == 0  # 2^-127
    # Scaled up by 2^127 they are ordinary E4M3 values (torch's cast rounds them independently).
    expected = (x.cpu().double() * 2.0**127).float().to(torch.float8_e4m3fn).double() * 2.0**-127
    assert torch.equal(q.dequantize().cpu().double(), expected) and bool(q.data.float()[0, 0] > 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf])
@pytest.mark.parametrize("layout", ["mx", "1x128", "rowwise"])
def test_nonfinite_block_dequantizes_to_nan(impl: str, bad: float, layout: str) -> None:
    x = torch.randn(2, 256, device=DEVICE)
    x[0, 5] = bad
    q = _quantize_one(x, layout, impl)
    out = q.dequantize()
    width = {"mx": 32, "1x128": 128, "rowwise": 256}[layout]
    assert bool(out[0, :width].isnan().all()), "the block holding the non-finite value is NaN"
    assert bool(torch.isfinite(out[0, width:]).all()) and bool(torch.isfinite(out[1]).all()), "others are not"
    scale = q.scale[0, 0]
    assert (int(scale) == 0xFF) if layout == "mx" else bool(scale.isnan())
    counts = quantization_stats(x, layout)
    assert counts.tolist() == [0, int(counts[1]), width, x.numel()]


def test_e8m0_decoding() -> None:
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    decoded = decode_scale(codes)
    assert decoded[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert bool(decoded[-1].isnan())


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_block_layouts_use_the_same_rule(impl: str) -> None:
    x = torch.zeros(128, 256, device=DEVICE)
    x[0, 0], x[0, 130], x[5, 3] = 480.0, 448.0, 1.0
    blockwise = _quantize_one(x, "1x128", impl)
    assert blockwise.scale[0].tolist() == [2.0, 1.0] and blockwise.scale[5, 0] == 2.0**-8
    tile = _quantize_one(x, "128x128", impl)
    assert tile.scale.tolist() == [[2.0, 1.0]]
    rowwise = _quantize_one(x, "rowwise", impl)
    assert rowwise.scale[0, 0] == 2.0 and rowwise.scale[1, 0] == 2.0**-127
    for q in (blockwise, tile, rowwise):
        assert q.data.float()[0, 0] == 240.0


def test_floor_rounding_counts_saturation() -> None:
    x = _mx_block(480.0, 470.0, 1.0)
    assert quantization_stats(x, "mx", "floor").tolist() == [2, 0, 0, 32]
    assert quantization_stats(x, "mx", "rceil").tolist() == [0, 0, 0, 32]
    tiny = _mx_block(448.0, 2.0**-11)
    assert quantization_stats(tiny, "mx").tolist() == [0, 1, 0, 32]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(x=torch.randn(4, 48), layout="mx"), ValueError),  # 48 is not a multiple of 32
        (dict(x=torch.randn(4, 64), layout="mx8"), ValueError),
        (dict(x=torch.randn(4, 64), layout="mx", rounding="nearest"), ValueError),
        (dict(x=torch.randn(256, 200), layout="128x128", cols=True), ValueError),  # 200 is not a multiple of 128
        (dict(x=torch.randn(64), layout="mx"), ValueError),
        (dict(x=torch.randint(0, 3, (4, 64)), layout="mx"), TypeError),
        (dict(x=torch.randn(4, 64), layout="mx", impl="cuda"), ValueError),
    ],
)
def test_quantize_validates(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        quantize(**kwargs)


@pytest.mark.parametrize("rows", [256, 200])
def test_128x128_columns_are_the_transposed_tiles(rows: int) -> None:
    """A weight's transposed quantization (the input gradient's operand) is its own tiles transposed: the same
    codes and scales, with rows past R padded as zero codes."""
    x = torch.randn(rows, 384) * torch.logspace(-3, 3, 384)
    q, qt = quantize(x, "128x128", cols=True)
    assert qt.shape == (384, 256) and qt.scale.shape == (3, 2)
    assert torch.equal(qt.scale, q.scale.t())
    assert torch.equal(qt.data[:, :rows].view(torch.uint8), q.data.t().view(torch.uint8))
    assert not qt.data[:, rows:].view(torch.uint8).any()
