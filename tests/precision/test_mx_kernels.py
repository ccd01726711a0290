"""Triton quantizers and fused norm + quantize against the reference: bit-exact over a matrix of shapes.

Runs on CUDA when present (adding bf16), else on CPU under Triton's interpreter (fp32/fp16: the
interpreter's bf16 arithmetic is unreliable).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_gem.ops.mx import QuantizedTensor, dequantize, norm_quantize, norm_quantize_transposed, quantize
from lightning_gem.ops.mx.impl.reference import norm_reference
from lightning_gem.testing.numerics import assert_within_budget

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SHAPES = [(1, 128), (37, 256), (130, 384), (256, 384), (0, 128)]


def _equal(a, b) -> bool:
    """Same dequantized values (NaN where NaN), same layout."""
    da, db = a.dequantize(), b.dequantize()
    return a.layout == b.layout and a.shape == b.shape and bool(((da == db) | (da.isnan() & db.isnan())).all())


def _input(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over many binades (per-column magnitudes), a NaN and an Inf in separate blocks."""
    x = torch.randn(rows, cols, device=DEVICE) * torch.logspace(-2, 2, cols, device=DEVICE)
    if rows > 3:
        x[3, 5], x[1, cols - 1] = float("nan"), float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["mx", "1x128", "128x128", "rowwise"])
def test_quantize_matches_reference(layout: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _input(*shape, dtype)
    cols = shape[0] > 0
    rows_t, cols_t = quantize(x, layout, cols=cols, impl="triton")
    rows_r, cols_r = quantize(x, layout, cols=cols, impl="reference")
    assert rows_t.data.dtype == torch.float8_e4m3fn and _equal(rows_t, rows_r)
    if cols:
        assert _equal(cols_t, cols_r)
        padded = -(-shape[0] // (32 if layout == "mx" else 128)) * (32 if layout == "mx" else 128)
        assert cols_t.shape == (shape[1], padded)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (37, 256), (130, 4128), (0, 64)], ids=str)
def test_dequantize_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _input(*shape, dtype)
    q = quantize(x, "mx", impl="reference")[0]
    for out_dtype in DTYPES:
        triton_out, reference_out = dequantize(q, out_dtype, impl="triton"), dequantize(q, out_dtype, impl="reference")
        assert triton_out.dtype == reference_out.dtype == out_dtype and triton_out.shape == x.shape
        assert bool(((triton_out == reference_out) | (triton_out.isnan() & reference_out.isnan())).all())
        expected = q.dequantize(torch.float32)
        if out_dtype == torch.float16:
            expected = expected.clamp(-65504.0, 65504.0)
        assert bool(((reference_out.float() == expected) | expected.isnan()).all())  # exact in every dtype


def test_dequantize_rejects() -> None:
    q = quantize(torch.randn(4, 128), "1x128", impl="reference")[0]
    with pytest.raises(ValueError, match="'mx' layout"):
        dequantize(q, impl="triton")
    with pytest.raises(TypeError, match="dtype"):
        dequantize(q, torch.float64)


@pytest.mark.parametrize("layout", ["mx", "1x128"])
def test_floor_rounding_matches_reference(layout: str) -> None:
    x = _input(64, 256, torch.float32)
    assert _equal(quantize(x, layout, rounding="floor", impl="triton")[0], quantize(x, layout, rounding="floor")[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("layout", "shape"),
    [("mx", (1, 64)), ("mx", (37, 256)), ("mx", (300, 96)), ("1x128", (1, 128)), ("1x128", (300, 384))],
    ids=str,
)
def test_columns_alone_match_reference(layout: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """The transposed layout without the row layout (for ``mx`` its own launch: columns of 3-D slabs)."""
    x = _input(*shape, dtype)
    rows_t, cols_t = quantize(x, layout, rows=False, cols=True, impl="triton")
    assert rows_t is None and _equal(cols_t, quantize(x, layout, cols=True, impl="reference")[1])


@pytest.mark.parametrize("plan", ["split", "apart"])
@pytest.mark.parametrize(("layout", "shape"), [("mx", (37, 256)), ("mx", (300, 96)), ("1x128", (130, 384))], ids=str)
def test_rows_and_columns_plans_match_reference(
    plan: str, layout: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and columns together in one split launch, or the rows then the columns apart: the same bits."""
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    monkeypatch.setattr(triton_quantize, "_ROWS_AND_COLUMNS_PLANS", {32: (plan,), 128: (plan,)})
    x = _input(*shape, torch.float16)
    got, want = quantize(x, layout, cols=True, impl="triton"), quantize(x, layout, cols=True, impl="reference")
    assert _equal(got[0], want[0]) and _equal(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mx", "1x128"])
def test_every_split_config_matches_reference(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate of the one-launch rows+cols kernel (the tuner times them only above a size) writes the
    reference's bits, over ragged last regions."""
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    block = {"mx": 32, "1x128": 128}[layout]
    monkeypatch.setattr(triton_quantize, "_ROWS_AND_COLUMNS_PLANS", {block: ("split",)})
    x = _input(300, 384, torch.float16)
    want = quantize(x, layout, cols=True, return_column_sums=True, impl="reference")
    for config in triton_quantize._SPLIT_CONFIGS[block, True]:
        monkeypatch.setitem(triton_quantize._SPLIT_CONFIGS, (block, True), [config])
        got = quantize(x, layout, cols=True, return_column_sums=True, impl="triton")
        assert _equal(got[0], want[0]) and _equal(got[1], want[1]), config
        _assert_column_sums(got[2], x)


@pytest.mark.parametrize(
    ("layout", "config"),
    [("mx", (1024, 1024, 16, 16, 1, 8)), ("mx", (512, 256, 32, 8, 0, 4)), ("1x128", (256, 256, 32, 16, 1, 4))],
    ids=str,
)
@pytest.mark.parametrize("rows", [True, False])
def test_split_config_matches_reference(layout: str, config: tuple, rows: bool) -> None:
    """A config forced on the one-launch kernel (regions larger than the input, or ragged against it) writes the
    reference's bits, rows and columns or columns alone."""
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    x = _input(300, 384, torch.float16)
    got = quantize_triton(x, layout, rows=rows, cols=True, split_config=config)
    want = quantize(x, layout, rows=rows, cols=True, impl="reference")
    assert got[1] is not None and _equal(QuantizedTensor(*got[1], layout), want[1])
    assert (got[0] is None) == (not rows)
    if rows:
        assert _equal(QuantizedTensor(*got[0], layout), want[0])


def _assert_column_sums(sums: torch.Tensor, x: torch.Tensor) -> None:
    """``sums`` are ``x``'s fp32 column sums up to the summation order: within ``1e-5 * sum |x|`` per column (NaN
    and Inf where the column holds them)."""
    want = x.sum(0, dtype=torch.float32)
    assert sums.dtype == torch.float32 and sums.shape == want.shape
    finite = want.isfinite()
    assert torch.equal(sums[~finite].nan_to_num(), want[~finite].nan_to_num())
    bound = 1e-5 * x[:, finite].abs().sum(0, dtype=torch.float32)
    assert bool(((sums[finite] - want[finite]).abs() <= bound).all())


@pytest.mark.parametrize(
    ("layout", "rows", "cols"),
    [
        ("mx", True, True), ("mx", False, True), ("1x128", True, True), ("1x128", False, True), ("rowwise", True, True),
        ("rowwise", False, True), ("rowwise", True, False), ("128x128", True, True), ("mx", True, False),
    ],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize(
    "shape", [(1, 128), (129, 256), pytest.param((300, 384), marks=pytest.mark.slow)], ids=str
)  # the widest, several row tiles: in the full suite
def test_column_sums_come_with_the_quantized_outputs(
    layout: str, rows: bool, cols: bool, shape: tuple[int, int]
) -> None:
    """``return_column_sums`` (a bias gradient read with the output gradient): the same quantized outputs, and the
    column sums, fused where the columns are quantized (split kernel, rowwise line maxima) or reduced apart."""
    for dtype in DTYPES:
        x = _input(*shape, dtype)
        got = quantize(x, layout, rows=rows, cols=cols, return_column_sums=True, impl="triton")
        want = quantize(x, layout, rows=rows, cols=cols, return_column_sums=True, impl="reference")
        assert len(got) == len(want) == 3
        for g, w in zip(got[:2], want[:2], strict=True):
            assert (g is None) == (w is None) and (g is None or _equal(g, w)), (layout, rows, cols, dtype)
        _assert_column_sums(got[2], x)
        _assert_column_sums(want[2], x)


def test_split_config_is_checked() -> None:
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    x = _input(64, 256, torch.float16)
    with pytest.raises(ValueError, match="multiples of the block"):
        quantize_triton(x, "1x128", cols=True, split_config=(256, 64, 32, 16, 0, 4))
    with pytest.raises(ValueError, match="no norm"):
        quantize_triton(x, "rowwise", cols=True, split_config=(256, 256, 32, 16, 0, 4))


def _kernel_configs() -> list[tuple[int, int, int]]:
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    return list(triton_quantize._CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", _kernel_configs(), ids=str)
def test_every_quantize_kernel_config_matches_reference(config: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tile config ``_quantize_kernel`` may be tuned to, forced, for every flag set it serves: rows, the
    transposed layout (its FP8 codes transposed in registers) and both, over ragged tiles. The tuner times them
    only above a size, so without this a config could first run, untested, on a large input."""
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    monkeypatch.setattr(triton_quantize, "_CONFIGS", [config])
    triton_quantize._valid_configs.cache_clear()
    cases = [("mx", True, False), ("1x128", True, False), ("1x128", False, True), ("rowwise", True, False)]
    cases += [("rowwise", True, True), ("rowwise", False, True), ("128x128", True, False), ("128x128", True, True)]
    shape = (300, 384) if config[1] <= 512 else (37, config[1])  # wide tiles serve rows as wide as themselves
    checked = 0
    try:
        for dtype in DTYPES:
            x = _input(*shape, dtype)
            for layout, rows, cols in cases:
                block = {"mx": 32, "rowwise": 128}.get(layout, 128)
                square, width = layout == "128x128", max(512, config[1])
                if not triton_quantize._valid_configs(block, rows, cols, square, layout == "rowwise", width):
                    continue
                got = triton_quantize.quantize_triton(x, layout, rows=rows, cols=cols, one_pass=False)
                want = quantize(x, layout, rows=rows, cols=cols, impl="reference")
                for g, w in zip(got, want, strict=True):
                    assert (g is None) == (w is None), (layout, rows, cols)
                    assert g is None or _equal(QuantizedTensor(*g, layout), w), (layout, rows, cols, dtype)
                checked += 1
    finally:
        monkeypatch.undo()
        triton_quantize._valid_configs.cache_clear()
    assert checked > 0


@pytest.mark.parametrize("config", [(2, 512, 4), (1, 256, 4)], ids=str)
def test_wide_row_tiles_match_reference(config: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The short, wide tiles rows alone may take (here wider than the rows, and over a ragged last tile)."""
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    x = _input(37, 384, torch.float16)
    monkeypatch.setattr(triton_quantize, "_CONFIGS", [config])
    triton_quantize._valid_configs.cache_clear()  # the candidates are pruned once per set of flags: prune these
    try:
        for layout in ("mx", "1x128", "rowwise"):
            got = triton_quantize.quantize_triton(x, layout, one_pass=False)[0]
            want = quantize(x, layout, impl="reference")[0]
            assert _equal(QuantizedTensor(*got, layout), want), layout
    finally:
        monkeypatch.undo()
        triton_quantize._valid_configs.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("layout", ["mx", "1x128", "rowwise"])
@pytest.mark.parametrize(
    "dim", [pytest.param(384, marks=pytest.mark.slow), 256]
)  # padded to a power of two in the kernel (in the full suite), or not
def test_norm_quantize(kind: str, layout: str, dtype: torch.dtype, dim: int) -> None:
    rows = 45
    x = (torch.randn(rows, dim, device=DEVICE) * 2 + 0.5).to(dtype)
    weight = torch.randn(dim, device=DEVICE)
    bias = torch.randn(dim, device=DEVICE) if kind == "layer" else None
    out = norm_quantize(x, weight, bias, kind=kind, layout=layout, write_output=True, impl="triton")
    # The quantization of the norm's output is exact ...
    assert _equal(out.q, quantize(out.y, layout, impl="reference")[0])
    # ... and the output itself is a correctly computed norm.
    oracle = norm_reference(x.double(), weight.double(), None if bias is None else bias.double(), 1e-6, kind)[0]
    same_precision = norm_reference(x, weight, bias, 1e-6, kind)[0]
    assert_within_budget(out.y, oracle, same_precision, name=f"{kind}norm output")
    transposed = norm_quantize_transposed(x, out.rstd, out.mean, weight, bias, kind=kind, layout=layout, impl="triton")
    assert _equal(transposed, quantize(out.y, layout, rows=False, cols=True, impl="reference")[1])


@pytest.mark.parametrize("dim", [384, 1024, 16])  # padded to a power of two or not; shorter than a warp
@pytest.mark.parametrize("offset", [100.0, -3e4])
def test_layernorm_quantize_large_mean(offset: float, dim: int) -> None:
    """Rows whose mean is 1,000 to 300,000 spreads from zero (and a constant row, variance 0): the float32 output,
    mean and rstd stay within the budget of the same computation in float32 against a float64 oracle."""
    x = torch.randn(37, dim, device=DEVICE) * 0.1 + offset
    x[5] = offset
    weight, bias = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE)
    layout = "1x128" if dim % 128 == 0 else "rowwise"
    out = norm_quantize(x, weight, bias, kind="layer", layout=layout, write_output=True, impl="triton")
    oracle = norm_reference(x.double(), weight.double(), bias.double(), 1e-6, "layer")
    same_precision = norm_reference(x, weight, bias, 1e-6, "layer")
    for got, want, naive, name in zip(
        (out.y, out.rstd, out.mean), oracle, same_precision, ("output", "rstd", "mean"), strict=True
    ):
        assert_within_budget(got, want, naive, name=f"layernorm {name}")
    assert _equal(out.q, quantize(out.y, layout, impl="reference")[0])


@pytest.mark.parametrize("config", [(2, 4, 8), (4, 3, 8), (1, 3, 4)], ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_quantize_several_tiles_per_program(kind: str, config: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gem.ops.mx.impl.triton import norm_quantize as triton_norm

    dim = 1024 if config[0] == 1 else 256  # one-row tiles are candidates for rows of 1024 and more
    x = (torch.randn(45, dim, device=DEVICE) * 2 + 0.5).to(torch.float16)  # 45 rows: the last program's tiles ragged
    x[0], x[3, 5], x[9, 7] = 0.0, float("nan"), float("inf")
    weight, bias = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE) if kind == "layer" else None
    for layout in ("mx", "1x128"):
        one_tile = norm_quantize(x, weight, bias, kind=kind, layout=layout, write_output=True, impl="triton")
        monkeypatch.setattr(triton_norm, "_CONFIGS", [config])
        triton_norm._valid_configs.cache_clear()  # the candidates are pruned once per width: prune the patched ones
        tiles = norm_quantize(x, weight, bias, kind=kind, layout=layout, write_output=True, impl="triton")
        monkeypatch.undo()
        triton_norm._valid_configs.cache_clear()  # and the real ones again, for the next call
        # Each config sums a row in its own order (on a GPU, rstd can move by an ulp): the norm's outputs agree
        # to rounding, and the FP8 codes are exactly those of the output this config wrote.
        assert _same_bits(tiles.q, quantize(tiles.y, layout, impl="reference")[0])
        for a, b in ((tiles.rstd, one_tile.rstd), (tiles.mean, one_tile.mean)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)
        torch.testing.assert_close(tiles.y, one_tile.y, rtol=2e-3, atol=1e-6, equal_nan=True)


def test_norm_quantize_rounds_to_out_dtype() -> None:
    x = torch.randn(16, 128, device=DEVICE)
    weight = torch.randn(128, device=DEVICE)
    out = norm_quantize(x, weight, layout="1x128", write_output=True, out_dtype=torch.float16, impl="triton")
    assert out.y.dtype == torch.float16
    assert _equal(out.q, quantize(out.y, "1x128", impl="reference")[0])


def test_norm_quantize_validates() -> None:
    with pytest.raises(ValueError, match="weight"):
        norm_quantize(torch.randn(4, 64), torch.randn(32))
    with pytest.raises(ValueError, match="kind"):
        norm_quantize(torch.randn(4, 64), kind="batch")
    with pytest.raises(ValueError, match="activations"):
        norm_quantize(torch.randn(4, 128), layout="128x128")


def test_opcheck() -> None:
    x = torch.randn(64, 128, device=DEVICE)
    torch.library.opcheck(torch.ops.lightning_gem.mx_quantize.default, (x, "1x128", "rceil", True, True))
    args = (x, torch.randn(128, device=DEVICE), None, 1e-6, "rms", "mx", "rceil", True)
    torch.library.opcheck(torch.ops.lightning_gem.mx_norm_quantize.default, args)


def test_quantize_under_torch_compile() -> None:
    x = torch.randn(64, 256, device=DEVICE)

    def run(t: torch.Tensor) -> torch.Tensor:
        rows, cols = quantize(t, "mx", cols=True, impl="triton")
        return rows.dequantize() + cols.dequantize().t()

    _assert_compiles_exactly(run, x)


def _assert_compiles_exactly(run, x: torch.Tensor) -> None:
    """``torch.compile(run, fullgraph=True)`` traces through the quantizer ops and gives ``run``'s result exactly."""
    torch.compiler.reset()
    try:
        compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), run(x), rtol=0, atol=0)
    finally:
        torch.compiler.reset()


def _same_bits(a, b) -> bool:
    """Bit-identical data and scales (NaN encodings included), same layout."""
    return (
        a.layout == b.layout
        and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        and torch.equal(a.scale.contiguous().view(torch.int32), b.scale.contiguous().view(torch.int32))
    )


def _rowwise_edges(dtype: torch.dtype) -> torch.Tensor:
    """``[131, 160]`` (rows no multiple of 128, columns no multiple of a tile) whose rows and columns have
    maxima on every edge of the scale rule: exactly 448, 480 (rounds a power up under rceil, saturates under
    floor), a power of two, subnormal only, all zero, NaN, -Inf."""
    x = torch.randn(131, 160, device=DEVICE) * torch.logspace(-2, 1.5, 160, device=DEVICE)
    x[5] = -torch.rand(160, device=DEVICE) * torch.finfo(dtype).tiny  # subnormal only
    x[0] = 0.0  # an all-zero row
    x[:, 7] = 0.0  # an all-zero column
    x[1, 3], x[2, 4], x[4, 9] = 448.0, -480.0, 256.0
    x[:, 15] = torch.rand(131, device=DEVICE) * 0.125
    x[50, 15] = -0.125  # a column whose maximum is a power of two
    x[20, 11], x[30, 13] = float("nan"), float("-inf")  # NaN and -Inf rows and columns
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_rowwise_edges_match_reference_bit_for_bit(rounding: str, dtype: torch.dtype) -> None:
    x = _rowwise_edges(dtype)
    rows_t, cols_t = quantize(x, "rowwise", rounding=rounding, cols=True, impl="triton")
    rows_r, cols_r = quantize(x, "rowwise", rounding=rounding, cols=True, impl="reference")
    assert _same_bits(rows_t, rows_r) and _same_bits(cols_t, cols_r)
    assert cols_t.scale[7, 0] == 2.0**-127 and cols_t.scale[11, 0].isnan() and cols_t.scale[13, 0].isnan()
    # Each direction alone reads the same maxima.
    assert _same_bits(quantize(x, "rowwise", rounding=rounding, impl="triton")[0], rows_r)
    assert _same_bits(quantize(x, "rowwise", rounding=rounding, rows=False, cols=True, impl="triton")[1], cols_r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_rowwise_norm_prologue_edges_match_reference(kind: str, dtype: torch.dtype) -> None:
    from lightning_gem.ops.mx.impl.reference import normalize_with_stats, quantize_reference
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    x = _rowwise_edges(dtype)
    # Powers of two keep the norm's products exact, so the edge values reach the quantizer as they are.
    rstd = torch.exp2(torch.randint(-2, 3, (131,), device=DEVICE).float())
    rstd[40] = 0.0  # an all-zero row made by the norm
    mean = torch.randn(131, device=DEVICE) if kind == "layer" else None
    weight = torch.exp2(torch.randint(-2, 3, (160,), device=DEVICE).float())
    weight[21] = 0.0  # one more all-zero column, made by the norm
    bias = torch.zeros(160, device=DEVICE) if kind == "layer" else None
    y = normalize_with_stats(x, rstd, mean, weight, bias, dtype)
    norm = (kind, rstd, mean, weight, bias)
    for rounding in ("rceil", "floor"):
        (q, s), (qt, st) = quantize_triton(x, "rowwise", rounding, rows=True, cols=True, norm=norm)
        assert _same_bits(QuantizedTensor(q, s, "rowwise"), quantize_reference(y, "rowwise", rounding))
        padded = torch.cat([y, y.new_zeros(256 - 131, 160)])
        assert _same_bits(QuantizedTensor(qt, st, "rowwise"), quantize_reference(padded.t(), "rowwise", rounding))
        assert st[21, 0] == 2.0**-127


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_rowwise_rows_one_pass_matches_two_passes_and_reference(rounding: str, dtype: torch.dtype) -> None:
    from lightning_gem.ops.mx.impl.reference import quantize_reference
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    x = _rowwise_edges(dtype)  # zero, subnormal, NaN and -Inf rows; 131 rows, 160 columns (no power of two)
    for inputs in (x, x[:1], _input(37, 272, dtype)):
        one = QuantizedTensor(*quantize_triton(inputs, "rowwise", rounding)[0], "rowwise")
        two = QuantizedTensor(*quantize_triton(inputs, "rowwise", rounding, one_pass=False)[0], "rowwise")
        assert _same_bits(one, quantize_reference(inputs, "rowwise", rounding)) and _same_bits(one, two)


def test_rowwise_rows_one_pass_norm_prologue_and_wide_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gem.ops.mx.impl.reference import normalize_with_stats, quantize_reference
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    x = _rowwise_edges(torch.float16)
    rstd, mean = torch.rand(131, device=DEVICE) + 0.5, torch.randn(131, device=DEVICE)
    weight, bias = torch.randn(160, device=DEVICE), torch.randn(160, device=DEVICE)
    y = normalize_with_stats(x, rstd, mean, weight, bias, torch.float16)
    expected = quantize_reference(y, "rowwise", "rceil")
    norm = ("layer", rstd, mean, weight, bias)
    for max_cols in (triton_quantize.ONE_PASS_MAX_COLS, 128):  # one pass; rows too wide for it: two passes
        monkeypatch.setattr(triton_quantize, "ONE_PASS_MAX_COLS", max_cols)
        q, s = triton_quantize.quantize_triton(x, "rowwise", norm=norm)[0]
        assert _same_bits(QuantizedTensor(q, s, "rowwise"), expected)


def _amax_configs() -> list[tuple[int, int, int, int]]:
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    return list(triton_quantize._AMAX_CONFIGS)


@pytest.mark.parametrize("shape", [(1, 16), (37, 160), (131, 272), (300, 48)], ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(True, False), (False, True), (True, True)])
def test_line_maxima_match_torch(shape: tuple[int, int], rows: bool, cols: bool) -> None:
    from lightning_gem.ops.mx.impl.triton.quantize import _TL_DTYPES, _line_maxima

    x = _input(*shape, torch.float16)
    x[:, 2] = 0.0
    no_norm = (None, None, None, None)
    row_amax, col_amax = _line_maxima(x, rows, cols, no_norm, 0, _TL_DTYPES[torch.float16])
    magnitudes = x.float().abs()
    for amax, expected, wanted in ((row_amax, magnitudes.amax(1), rows), (col_amax, magnitudes.amax(0), cols)):
        if not wanted:
            assert amax is None
            continue
        assert amax.dtype == torch.int32
        torch.testing.assert_close(amax.view(torch.float32), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("config", _amax_configs(), ids=str)
def test_every_line_maxima_config_matches_torch(config: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each strip config the line-maxima kernel may be tuned to, forced: strips ragged in both dims, several strips
    down and across (row maxima combined across strips, column maxima across strips down), NaN and Inf on top."""
    from lightning_gem.ops.mx.impl.triton import quantize as triton_quantize

    monkeypatch.setattr(triton_quantize, "_AMAX_CONFIGS", [config])
    tile_r, tile_c, steps, _ = config
    x = _input(tile_r * steps + 37, 2 * tile_c + 48, torch.bfloat16)  # two strips down and three across, ragged
    x[5, 7], x[tile_r * steps + 3, tile_c + 1] = float("nan"), float("-inf")
    no_norm = (None, None, None, None)
    args = (x, True, True, no_norm, 0, triton_quantize._TL_DTYPES[x.dtype])
    row_amax, col_amax, partial = triton_quantize._line_maxima(*args, sums=True)
    group = triton_quantize.SUM_ROWS
    assert partial.shape == (-(-x.shape[0] // group), x.shape[1])
    for i in range(partial.shape[0]):  # each group of rows summed on its own (NaN and Inf where present)
        _assert_column_sums(partial[i], x[i * group : (i + 1) * group])
    magnitudes = x.float().abs().nan_to_num(nan=0.0, posinf=float("inf"))  # NaN put back below, where it tops
    want_rows = magnitudes.amax(1).where(~x.isnan().any(1), float("nan"))
    want_cols = magnitudes.amax(0).where(~x.isnan().any(0), float("nan"))
    torch.testing.assert_close(row_amax.view(torch.float32), want_rows, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(col_amax.view(torch.float32), want_cols, rtol=0, atol=0, equal_nan=True)


def test_rowwise_opcheck_and_torch_compile() -> None:
    importlib.import_module("lightning_gem.ops.mx.impl.triton")  # registers the ops

    x = torch.randn(37, 160, device=DEVICE)
    rstd, weight = torch.rand(37, device=DEVICE) + 0.5, torch.randn(160, device=DEVICE)
    op = torch.ops.lightning_gem.mx_quantize.default
    torch.library.opcheck(op, (x, "rowwise", "rceil", True, True))
    torch.library.opcheck(op, (x, "rowwise", "floor", False, True, "rms", rstd, None, weight, None))

    def run(t: torch.Tensor) -> torch.Tensor:
        rows, cols = quantize(t, "rowwise", cols=True, impl="triton")
        return rows.dequantize() + cols.dequantize()[:, : t.shape[0]].t()

    _assert_compiles_exactly(run, x)


def test_untimed_launches_are_listed_with_why() -> None:
    from lightning_gem.ops.mx.impl.triton._common import chosen_configs, untuned_configs
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    quantize_triton(torch.randn(32, 128, device=DEVICE), "1x128", cols=True)
    listed = {key: entry for key, entry in untuned_configs().items() if key[0] == "quantize"}
    assert listed and all(key not in chosen_configs() for key in listed)
    assert {why for _, why in listed.values()} <= {"small", "interpreted", "one candidate", "not timeable"}


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times candidates on a CUDA GPU")
@pytest.mark.parametrize("layout", ["mx", "1x128", "rowwise"])
def test_tuned_launches_match_reference(layout: str) -> None:
    """Above the tuning threshold every candidate (several tiles a program among them) runs once, and the one
    chosen writes the reference's bits."""
    from lightning_gem.ops.mx.impl.triton._common import TUNE_ABOVE

    x = _input(8192, 1024, torch.bfloat16)
    assert x.numel() >= TUNE_ABOVE
    for rows, cols in ((True, False), (False, True), (True, True)):
        got = quantize(x, layout, rows=rows, cols=cols, impl="triton")
        want = quantize(x, layout, rows=rows, cols=cols, impl="reference")
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None) and (a is None or _equal(a, b))
    weight = _input(1024, 1024, torch.bfloat16)
    got, want = quantize(weight, "128x128", cols=True, impl="triton"), quantize(weight, "128x128", cols=True)
    assert _equal(got[0], want[0]) and _equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times candidates on a CUDA GPU")
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_tuned_norm_quantize_matches_reference(kind: str) -> None:
    """Above the tuning threshold every norm candidate (one-row tiles among them) runs once; the chosen one writes a
    correct norm and, bit for bit, the codes of that output (NaN blocks included)."""
    from lightning_gem.ops.mx.impl.triton._common import TUNE_ABOVE

    x = (torch.randn(8192, 1024, device=DEVICE) * 2 + 0.5).to(torch.bfloat16)
    x[3, 5], x[9, 7] = float("nan"), float("inf")
    assert x.numel() >= TUNE_ABOVE
    weight = torch.randn(1024, device=DEVICE)
    bias = torch.randn(1024, device=DEVICE) if kind == "layer" else None
    finite = torch.isfinite(x).all(1)
    oracle = norm_reference(x.double(), weight.double(), None if bias is None else bias.double(), 1e-6, kind)[0]
    same_precision = norm_reference(x, weight, bias, 1e-6, kind)[0]
    for layout in ("mx", "1x128"):
        out = norm_quantize(x, weight, bias, kind=kind, layout=layout, write_output=True, impl="triton")
        assert _same_bits(out.q, quantize(out.y, layout, impl="reference")[0]), layout
        assert_within_budget(out.y[finite], oracle[finite], same_precision[finite], name=f"{kind}norm output")
