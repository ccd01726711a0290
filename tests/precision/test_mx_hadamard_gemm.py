"""Random Hadamard transform (orthogonality in fp64, fast vs explicit) and the scaled-GEMM backends."""

from __future__ import annotations

import pytest
import torch

from lightning_gem.ops.mx import quantize, random_hadamard, random_hadamard_matrix, scaled_mm, scaled_mm_supported
from lightning_gem.ops.mx.impl.reference import fwht

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_is_orthogonal_in_fp64(n: int) -> None:
    transform = random_hadamard_matrix(n, seed=3, dtype=torch.float64)
    torch.testing.assert_close(transform @ transform.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-14)
    sylvester = fwht(torch.eye(n, dtype=torch.float64))
    assert set(sylvester.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(sylvester @ sylvester.T, n * torch.eye(n, dtype=torch.float64), rtol=0, atol=0)


def test_fwht_and_matmul_agree_and_preserve_products() -> None:
    x, w = torch.randn(6, 256, dtype=torch.float64), torch.randn(5, 256, dtype=torch.float64)
    fast = random_hadamard(x, block=128, seed=7, impl="fwht")
    explicit = random_hadamard(x, block=128, seed=7, impl="matmul")
    torch.testing.assert_close(fast, explicit, rtol=0, atol=1e-12)
    rotated_w = random_hadamard(w, block=128, seed=7)
    torch.testing.assert_close(fast @ rotated_w.T, x @ w.T, rtol=0, atol=1e-12)  # (xT)(wT)^T = x w^T
    assert not torch.allclose(random_hadamard(x, block=128, seed=8), fast)  # the seed matters


def test_hadamard_spreads_an_outlier() -> None:
    x = torch.randn(4, 32) * 0.01
    x[:, 3] = 100.0
    rotated = random_hadamard(x, block=32, seed=0)
    assert float(rotated.abs().amax() / rotated.pow(2).mean().sqrt()) < 1.5  # a flat block: fits a scale well
    assert float(x.abs().amax() / x.pow(2).mean().sqrt()) > 5


def test_hadamard_validates() -> None:
    with pytest.raises(ValueError, match="power of two"):
        random_hadamard(torch.randn(2, 48), block=24, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        random_hadamard(torch.randn(2, 48), block=32, seed=0)


def test_emulated_gemm_is_the_dequantized_product() -> None:
    a, b = quantize(torch.randn(40, 128), "mx")[0], quantize(torch.randn(24, 128), "mx")[0]
    expected = a.dequantize().double() @ b.dequantize().double().T
    out = scaled_mm(a, b, out_dtype=torch.float32, backend="emulated")
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)
    bias = torch.randn(24)
    with_bias = scaled_mm(a, b, out_dtype=torch.float32, backend="emulated", bias=bias)
    torch.testing.assert_close(with_bias.double(), expected + bias.double(), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="share K"):
        scaled_mm(a, quantize(torch.randn(24, 64), "mx")[0], out_dtype=torch.float32, backend="emulated")


def test_native_gemm_refuses_what_the_device_lacks() -> None:
    a = quantize(torch.randn(16, 128), "mx")[0]
    assert not scaled_mm_supported("mx", "mx", torch.device("cpu"))
    with pytest.raises(ValueError, match="does not run"):
        scaled_mm(a, a, out_dtype=torch.bfloat16, backend="scaled_mm")


def test_blockwise_rows_pad_with_zero_rows_in_the_scale_layout_cublas_reads() -> None:
    from lightning_gem.ops.mx.gemm import _native_scales, _pad_rows

    q = quantize(torch.randn(301, 256), "1x128")[0]
    padded = _pad_rows(q, 128)
    assert padded.shape == (384, 256) and padded.scale.shape == (384, 2)
    assert padded.scale.stride(0) == 1, "outer-dim-major, as torch._scaled_mm reads a 1x128 first operand"
    assert _native_scales(padded).data_ptr() == padded.scale.data_ptr()  # no further copy
    dense = padded.dequantize()
    torch.testing.assert_close(dense[:301], q.dequantize(), rtol=0, atol=0)
    assert not dense[301:].any()


def test_kit_quantizers_leave_room_for_the_padded_rows_cublas_reads() -> None:
    """The Triton quantizers' 1x128 rows sit in buffers of whole 128-row blocks: padding them is a view (no copy),
    whose first rows are the quantized rows; other layouts' buffers are exact."""
    from lightning_gem.ops.mx import norm_quantize
    from lightning_gem.ops.mx.gemm import _native_scales, _pad_rows

    x = torch.randn(301, 256)
    for q in (
        quantize(x, "1x128", impl="triton")[0],
        norm_quantize(x, torch.rand(256), layout="1x128", impl="triton").q,
    ):
        padded = _pad_rows(q, 128)
        assert padded.shape == (384, 256) and padded.scale.shape == (384, 2)
        assert padded.data.data_ptr() == q.data.data_ptr() and padded.scale.data_ptr() == q.scale.data_ptr()
        assert _native_scales(padded).data_ptr() == padded.scale.data_ptr()
        torch.testing.assert_close(padded.data[:301].float(), q.data.float(), rtol=0, atol=0)
        torch.testing.assert_close(padded.scale[:301], q.scale, rtol=0, atol=0)
    reference = quantize(x, "1x128", impl="reference")[0]
    torch.testing.assert_close(
        quantize(x, "1x128", impl="triton")[0].dequantize(), reference.dequantize(), rtol=0, atol=0
    )
    mx = quantize(x, "mx", impl="triton")[0]
    assert mx.data.untyped_storage().nbytes() == 301 * 256 and mx.scale.shape == (301, 8)
    copied = _pad_rows(reference, 128)  # the reference's exact buffers: copied, zero rows appended
    assert copied.data.data_ptr() != reference.data.data_ptr() and not copied.dequantize()[301:].any()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize(("layout_a", "layout_b"), [("1x128", "128x128"), ("1x128", "1x128"), ("rowwise", "rowwise")])
@pytest.mark.parametrize("shape", [(256, 384, 512), (300, 256, 1024), (301, 256, 512)], ids=str)
def test_native_gemm_matches_emulated(layout_a: str, layout_b: str, shape: tuple[int, int, int]) -> None:
    if not scaled_mm_supported(layout_a, layout_b, torch.device("cuda")):
        pytest.skip(f"{layout_a} x {layout_b} not supported on this GPU")
    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a, b = quantize(x, layout_a)[0], quantize(w, layout_b)[0]
    native = scaled_mm(a, b, out_dtype=torch.bfloat16, backend="scaled_mm").float()
    emulated = scaled_mm(a, b, out_dtype=torch.float32, backend="emulated")
    relative = float((native - emulated).norm() / emulated.norm())
    assert relative < 4e-3, relative  # same operands: only accumulation order and the bf16 output differ
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 10  # in cuBLAS's epilogue where it takes one
    native = scaled_mm(a, b, out_dtype=torch.bfloat16, backend="scaled_mm", bias=bias).float()
    emulated = scaled_mm(a, b, out_dtype=torch.float32, backend="emulated", bias=bias)
    assert float((native - emulated).norm() / emulated.norm()) < 4e-3
