"""The fused pointwise ops (SiLU-split, norm-gate, norm to another dtype): Triton kernels against the float64
reference, forward and backward, on odd widths, empty and one-row inputs; validation; the HSTU layer on either path,
also under autocast; torch.compile."""

from __future__ import annotations

import pytest
import torch

from lightning_gem.ops.pointwise import norm, norm_mul, norm_residual, silu_split
from lightning_gem.testing.numerics import assert_within_budget


def _triton_runs() -> bool:
    from lightning_gem.ops._launch import is_interpreted
    from lightning_gem.ops.pointwise.impl.triton.kernels import _silu_split_fwd_kernel

    return torch.cuda.is_available() or is_interpreted(_silu_split_fwd_kernel)


@pytest.fixture
def device() -> str:
    if not _triton_runs():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _grads(outputs, inputs, grads_out):
    return torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True)


SPLITS = [(2, 3, (5, 5, 4, 4)), (0, 2, (8, 8, 8, 8)), (1, 1, (3, 6)), (37, 4, (16, 16, 32, 32)), (9, 2, (7,))]


@pytest.mark.parametrize(("tokens", "heads", "sizes"), SPLITS)
@pytest.mark.parametrize("used", ["all", "some"])
def test_silu_split_matches_reference(device: str, tokens: int, heads: int, sizes: tuple, used: str) -> None:
    dtype = torch.float32  # bf16 arithmetic is not faithful in Triton's interpreter: bf16 runs on GPUs below
    x = torch.randn(tokens, heads, sum(sizes), dtype=dtype, device=device, requires_grad=True)
    parts = silu_split(x, sizes, impl="triton")
    assert [tuple(p.shape) for p in parts] == [(tokens, heads, s) for s in sizes]
    assert all(p.is_contiguous() and p.dtype == dtype for p in parts)
    x64 = x.detach().double().requires_grad_()
    exact = silu_split(x64, sizes, impl="reference")
    for part, ref in zip(parts, exact, strict=True):
        torch.testing.assert_close(part.double(), ref, rtol=1e-6, atol=1e-6)
    chosen = range(len(sizes)) if used == "all" else range(0, len(sizes), 2)  # unused parts: zero gradient
    grads = [torch.randn_like(parts[i]) for i in chosen]
    (dx,) = _grads([parts[i] for i in chosen], [x], grads)
    (dx64,) = _grads([exact[i] for i in chosen], [x64], [g.double() for g in grads])
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("tokens", "heads", "sizes"), [*SPLITS[:4], (300, 3, (16, 16, 8, 8))])
@pytest.mark.parametrize("used", ["all", "some"])
def test_silu_split_with_bias(device: str, tokens: int, heads: int, sizes: tuple, used: str) -> None:
    """``SiLU(x + bias)`` with a ``[H, W]`` bias: values and gradients of ``x`` and the bias (summed over the tokens
    by the backward's programs; 300 tokens span several row tiles a program) against the float64 reference."""
    x = torch.randn(tokens, heads, sum(sizes), device=device, requires_grad=True)
    bias = torch.randn(heads, sum(sizes), device=device, requires_grad=True)
    parts = silu_split(x, sizes, bias=bias, impl="triton")
    leaves64 = [t.detach().double().requires_grad_() for t in (x, bias)]
    exact = silu_split(leaves64[0], sizes, bias=leaves64[1], impl="reference")
    for part, ref in zip(parts, exact, strict=True):
        torch.testing.assert_close(part.double(), ref, rtol=1e-6, atol=1e-6)
    chosen = range(len(sizes)) if used == "all" else range(0, len(sizes), 2)
    grads = [torch.randn_like(parts[i]) for i in chosen]
    dx, dbias = _grads([parts[i] for i in chosen], [x, bias], grads)
    dx64, dbias64 = _grads([exact[i] for i in chosen], leaves64, [g.double() for g in grads])
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-6)
    if tokens == 0:
        assert dbias is None or not dbias.any()
    else:
        torch.testing.assert_close(dbias.double(), dbias64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("tokens", "sizes"), [(37, (32, 32, 64, 32)), (1, (96,)), (0, (32, 32))])
def test_silu_split_writes_and_reads_an_mx_copy(device: str, dtype, with_bias: bool, tokens: int, sizes) -> None:
    """The forward's MX copy of x is the MX quantizer's, bit for bit (a block of zeros, a block of large values);
    the forward and backward read from the copy give what they give on the copy dequantized, bit for bit."""
    from lightning_gem.ops.mx import dequantize, quantize
    from lightning_gem.ops.pointwise.impl.triton.kernels import MXRows, silu_split_backward, silu_split_forward

    torch.manual_seed(0)
    width = sum(sizes)
    x = (torch.randn(tokens, 3, width, device=device) * 3).to(dtype)
    if tokens:
        x[0, 0, :32], x[-1, 1, -32:] = 0.0, x[-1, 1, -32:] * 1e4
    bias = torch.randn(3, width, device=device).to(dtype) if with_bias else None
    *parts, copy = silu_split_forward(x, sizes, bias, save_fp8=True)
    assert all(torch.equal(a, b) for a, b in zip(parts, silu_split_forward(x, sizes, bias), strict=True))
    q, _ = quantize(x.reshape(-1, width), "mx")
    assert copy.codes.dtype == torch.float8_e4m3fn and copy.scales.shape == (tokens, 3, width // 32)
    assert torch.equal(copy.codes.reshape(-1, width).view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(copy.scales.reshape(-1, width // 32), q.scale)
    decoded = dequantize(q, dtype).view(x.shape)
    from_copy, from_decoded = silu_split_forward(copy, sizes, bias), silu_split_forward(decoded, sizes, bias)
    assert all(torch.equal(a, b) for a, b in zip(from_copy, from_decoded, strict=True))
    grads = [torch.randn_like(p) for p in from_decoded]
    grads[-1] = None  # an unused part
    (dx, db), (dx_ref, db_ref) = (
        silu_split_backward(copy, grads, sizes, bias),
        silu_split_backward(decoded, grads, sizes, bias),
    )
    assert dx.dtype == dtype and torch.equal(dx, dx_ref)
    assert (db is None and db_ref is None) or torch.equal(db, db_ref)
    with pytest.raises(ValueError, match="multiples of 32"):
        silu_split_forward(MXRows(copy.codes, copy.scales, dtype), (16, width - 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "width", "gated", "kind"), [(37, 64, True, "rms"), (5, 96, False, "layer"), (0, 32, True, "rms")]
)
def test_norm_mul_writes_and_reads_an_mx_copy(
    device: str, dtype, rows: int, width: int, gated: bool, kind: str
) -> None:
    """The norm's MX copy of x is the MX quantizer's, bit for bit; its backward read from the copy gives what it
    gives on the copy dequantized."""
    from lightning_gem.ops.mx import dequantize, quantize
    from lightning_gem.ops.pointwise.impl.triton.kernels import norm_mul_backward, norm_mul_forward

    torch.manual_seed(0)
    layer = kind == "layer"
    x = (torch.randn(rows, width, device=device) * 3).to(dtype)
    gate = torch.randn(rows, width, device=device).to(dtype) if gated else None
    weight, bias = torch.randn(width, device=device), torch.randn(width, device=device) if layer else None
    y, mean, rstd, copy = norm_mul_forward(x, gate, weight, bias, 1e-5, layer, save_fp8=True)
    y_ref, mean_ref, rstd_ref = norm_mul_forward(x, gate, weight, bias, 1e-5, layer)
    assert torch.equal(y, y_ref) and torch.equal(mean, mean_ref) and torch.equal(rstd, rstd_ref)
    q, _ = quantize(x, "mx")
    assert torch.equal(copy.codes.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(copy.scales, q.scale)
    grad = torch.randn_like(y)
    got = norm_mul_backward(grad, copy, gate, weight, bias, mean, rstd, layer)
    expected = norm_mul_backward(grad, dequantize(q, dtype), gate, weight, bias, mean, rstd, layer)
    assert got[0].dtype == dtype
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_silu_split_bias_fp32_beside_16bit_x(device: str) -> None:
    """A float32 bias (a Linear's parameter) with a 16-bit ``x`` (its autocast output): the parts in ``x``'s dtype,
    the bias's gradient in float32."""
    dtype = torch.float16
    x = torch.randn(40, 2, 12, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(2, 12, device=device, requires_grad=True)
    parts = silu_split(x, (6, 6), bias=bias, impl="triton")
    assert all(p.dtype == dtype for p in parts)
    ref = silu_split(x.double() + bias.double(), (6, 6), impl="reference")
    for part, want in zip(parts, ref, strict=True):
        torch.testing.assert_close(part.double(), want, rtol=2e-3, atol=2e-3)
    sum(p.float().sum() for p in parts).backward()
    assert bias.grad.dtype == torch.float32 and x.grad.dtype == dtype


NORMS = [(7, 6), (1, 64), (0, 16), (130, 50), (5, 1024)]


@pytest.mark.parametrize(("rows", "width"), NORMS)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("affine", [True, False])
def test_norm_mul_matches_reference(device: str, rows: int, width: int, kind: str, affine: bool) -> None:
    x = torch.randn(rows, width, device=device, requires_grad=True)
    gate = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.randn(width, device=device, requires_grad=True) if affine else None
    bias = torch.randn(width, device=device, requires_grad=True) if affine and kind == "layer" else None
    leaves = [t for t in (x, gate, weight, bias) if t is not None]
    y = norm_mul(x, gate, weight, bias, eps=1e-5, kind=kind, impl="triton")
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, gate64, *affine64 = leaves64
    w64, b64 = (affine64 + [None, None])[:2]
    exact = norm_mul(x64, gate64, w64, b64, eps=1e-5, kind=kind, impl="reference")
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(y)
    for got, want, name in zip(_grads(y, leaves, grad), _grads(exact, leaves64, grad.double()), "xgwb", strict=False):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * max(1, rows) ** 0.5, msg=name)


@pytest.mark.parametrize(("rows", "width"), NORMS)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_norm_matches_reference(device: str, rows: int, width: int, kind: str, affine: bool, out_dtype) -> None:
    """``norm`` of float32 rows written in ``out_dtype``: the float64 norm rounded once to it; the backward takes a
    gradient of ``out_dtype`` and gives float32 ones. (float16 out: a low-precision dtype the interpreter stores
    faithfully; the GPU test below runs bf16.)"""
    x = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.randn(width, device=device, requires_grad=True) if affine else None
    bias = torch.randn(width, device=device, requires_grad=True) if affine and kind == "layer" else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    y = norm(x, weight, bias, eps=1e-5, kind=kind, out_dtype=out_dtype, impl="triton")
    assert y.dtype == out_dtype and y.shape == x.shape
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, *affine64 = leaves64
    w64, b64 = (affine64 + [None, None])[:2]
    exact = norm(x64, w64, b64, eps=1e-5, kind=kind, impl="reference")
    ulp = torch.finfo(out_dtype).eps
    torch.testing.assert_close(y.double(), exact, rtol=ulp, atol=1e-5)
    grad = torch.randn_like(y)
    grads = _grads(y, leaves, grad)
    assert all(g.dtype == torch.float32 for g in grads)
    for got, want, name in zip(grads, _grads(exact, leaves64, grad.double()), "xwb", strict=False):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * max(1, rows) ** 0.5, msg=name)


@pytest.mark.parametrize(("rows", "width"), [(37, 48), (1, 1024), (0, 16)])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("used", ["both", "norm", "residual"])
def test_norm_residual_adds_the_residual_gradient(device: str, rows: int, width: int, kind: str, used: str) -> None:
    """``norm_residual``'s outputs are ``norm(x)`` and ``x``; used as ``x + f(norm(x))``, its backward (one kernel,
    the residual's gradient added into ``dx``) gives the gradients that autograd's sum of the two paths gives, also
    when only one output is used."""
    torch.manual_seed(0)
    x = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.randn(width, device=device, requires_grad=True)
    bias = torch.randn(width, device=device, requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    options = {"eps": 1e-5, "kind": kind, "out_dtype": torch.float16}
    y, residual = norm_residual(x, weight, bias, impl="triton", **options)
    assert type(y.grad_fn).__name__ == "_NormResidualEagerBackward" and residual.grad_fn is y.grad_fn
    want = norm(x, weight, bias, impl="triton", **options)
    assert torch.equal(y, want) and torch.equal(residual, x)
    grad_y, grad_x = torch.randn_like(y), torch.randn_like(x)

    def loss(normed: torch.Tensor, passed: torch.Tensor) -> torch.Tensor:
        terms = {"norm": (normed.float() * grad_y).sum(), "residual": (passed * grad_x).sum()}
        return sum(terms.values()) if used == "both" else terms[used]

    got = torch.autograd.grad(loss(y, residual), leaves, allow_unused=True)
    expected = torch.autograd.grad(loss(want, x), leaves, allow_unused=True)
    for a, b, name in zip(got, expected, "xwb", strict=False):
        if b is None:
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, msg=name)
    y_ref, residual_ref = norm_residual(x, weight, bias, impl="reference", **options)
    assert residual_ref is x and y_ref.dtype == torch.float16


def test_norm_reference_is_the_module_then_the_cast() -> None:
    """The reference is what a norm module and autocast's cast for a Linear compute; the default out dtype is x's."""
    x = torch.randn(4, 3, 16)
    module = torch.nn.LayerNorm(16, eps=1e-5)
    torch.nn.init.normal_(module.weight)
    torch.nn.init.normal_(module.bias)
    got = norm(x, module.weight, module.bias, eps=1e-5, kind="layer", out_dtype=torch.bfloat16, impl="reference")
    assert torch.equal(got, module(x).to(torch.bfloat16))
    assert norm(x, impl="reference").dtype == torch.float32


def test_norm_for_linear_under_autocast(device: str) -> None:
    """Under autocast a float32 input's norm comes out in the autocast dtype (the values of the module then the cast);
    without autocast and for other norm classes it is the module's own output."""
    from lightning_gem.components.encoder import RMSNorm, norm_for_linear

    torch.manual_seed(0)
    x = torch.randn(9, 24, device=device)
    for module in (RMSNorm(24, eps=1e-6), torch.nn.LayerNorm(24)):
        module = module.to(device)
        torch.nn.init.normal_(module.weight)
        want = module(x)
        with torch.autocast(device, dtype=torch.float16 if device == "cpu" else torch.bfloat16):
            got = norm_for_linear(module, x, "triton")
            dtype = torch.get_autocast_dtype(device)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=torch.finfo(dtype).eps, atol=1e-5)
        assert torch.equal(norm_for_linear(module, x, "triton"), want)  # no autocast: the module

    class OwnNorm(torch.nn.LayerNorm):  # another class (e.g. a norm fused with FP8 quantization) keeps its forward
        def forward(self, input):
            return super().forward(input) + 1

    own = OwnNorm(24).to(device)
    with torch.autocast(device, dtype=torch.float16 if device == "cpu" else torch.bfloat16):
        assert torch.equal(norm_for_linear(own, x, "triton"), own(x))


def test_inputs_are_checked() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="sizes"):
        silu_split(x, (4, 5))
    with pytest.raises(ValueError, match="sizes"):
        silu_split(x, (2, 2, 2, 1, 1))
    with pytest.raises(ValueError, match="impl"):
        silu_split(x, (4, 4), impl="cuda")
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):  # a named impl never falls back
        silu_split(x.double(), (4, 4), impl="triton")
    with pytest.raises(ValueError, match="bias"):
        silu_split(x, (4, 4), bias=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="bias"):
        silu_split(x[0], (4, 4), bias=torch.zeros(8))
    with pytest.raises(TypeError, match="bias"):
        silu_split(x, (4, 4), bias=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="gate"):
        norm_mul(x, x[:, :4])
    with pytest.raises(ValueError, match="weight"):
        norm_mul(x, x, torch.ones(4))
    with pytest.raises(ValueError, match="bias"):
        norm_mul(x, x, torch.ones(8), torch.zeros(8), kind="rms")
    with pytest.raises(ValueError, match="kind"):
        norm_mul(x, x, kind="batch")
    with pytest.raises(TypeError, match="dtype"):
        norm_mul(x, x.double())
    with pytest.raises(TypeError, match="out_dtype"):
        norm(x, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="weight"):
        norm(x, torch.ones(4))
    with pytest.raises(ValueError, match="bias"):
        norm(x, torch.ones(8), torch.zeros(8))


def _graph_nodes(root) -> set[str]:
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _run_layer_pair(device: str, fused_options: dict, plain_options: dict, autocast: bool = False) -> list[tuple]:
    """Two HSTU layers (``fused_options``, then ``plain_options``) with the same random weights on one jagged batch:
    for each, ``(output, [input's and parameters' gradients] of the output's square sum, autograd node names)``."""
    from lightning_gem.components.encoder import HSTULayer

    torch.manual_seed(0)
    lengths = [5, 0, 1, 19]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    fused = HSTULayer(32, 2, **fused_options).to(device)
    for p in fused.parameters():  # output starts at zero: random weights so every path is exercised
        torch.nn.init.normal_(p, std=0.3)
    plain = HSTULayer(32, 2, **plain_options).to(device)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(sum(lengths), 32, device=device)
    runs = []
    for layer in (fused, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.float16 if device == "cpu" else torch.bfloat16, enabled=autocast):
            y = layer(xi, offsets, max_seq_len=19)
        nodes = _graph_nodes(y.grad_fn)
        y.square().sum().backward()
        runs.append((y.detach(), [xi.grad, *(p.grad for p in layer.parameters())], nodes))
    return runs


@pytest.mark.parametrize("case", ["plain", "hooked", "reference"])
def test_linear_silu_split_moves_a_plain_linears_bias(device: str, case: str) -> None:
    """A plain Linear's bias goes to the split (no addmm in the graph); a hooked Linear, or the reference impl, keeps
    it in the matmul. Values and gradients are the unfused composition's either way."""
    from lightning_gem.components.encoder import linear_silu_split

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 2 * 12).to(device)
    if case == "hooked":
        linear.register_forward_hook(lambda module, args, out: None)
    x = torch.randn(30, 8, device=device, requires_grad=True)
    parts = linear_silu_split(linear, x, 2, (4, 8), "reference" if case == "reference" else "triton")
    assert ("AddmmBackward0" in _graph_nodes(parts[0].grad_fn)) == (case != "plain")
    grads = [torch.randn_like(p) for p in parts]
    got = _grads(parts, [x, linear.weight, linear.bias], grads)
    want_parts = silu_split(linear(x).view(30, 2, 12), (4, 8), impl="reference")
    want = _grads(want_parts, [x, linear.weight, linear.bias], grads)
    for a, b in zip((*parts, *got), (*want_parts, *want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_head_norm", [True, False])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_hstu_layer_fused_matches_unfused(device: str, per_head_norm: bool, norm: str) -> None:
    """The layer through the Triton attention and fused ops against the same weights on the reference path."""
    options = {"per_head_norm": per_head_norm, "norm": norm}
    (out, grads, _), (want_out, want_grads, _) = _run_layer_pair(
        device, {**options, "attention_impl": "triton"}, {**options, "attention_impl": "reference"}
    )
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_hstu_layer_residual_norm_under_autocast(device: str) -> None:
    """Under autocast the layer's input norm is ``norm_residual`` (the residual's gradient added in the norm's
    backward kernel): the layer's output and gradients match the same layer with PyTorch's pointwise ops."""
    fused, plain = _run_layer_pair(
        device, {"attention_impl": "triton"}, {"attention_impl": "triton", "pointwise_impl": "reference"}, True
    )
    for (out, _, nodes), is_fused in ((fused, True), (plain, False)):
        assert out.dtype == torch.float32
        assert ("_NormResidualEagerBackward" in nodes) == is_fused
    torch.testing.assert_close(fused[0], plain[0], rtol=2e-2, atol=2e-2)
    for got, want in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_compiled_fullgraph(device: str) -> None:
    """Both ops under ``torch.compile(fullgraph=True)``, forward and backward, match eager."""

    def fn(x, w):
        u, v = silu_split(x, (8, 8), impl="triton")
        return norm_mul(v, u, w, eps=1e-6, impl="triton")

    x = torch.randn(6, 2, 16, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    eager = fn(x, w)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(x, w)
    torch.testing.assert_close(compiled, eager)
    g = torch.randn_like(eager)
    for a, b in zip(_grads(compiled, [x, w], g), _grads(eager, [x, w], g), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("affine", [True, False])
def test_norm_through_the_custom_ops(device: str, affine: bool) -> None:
    """``norm`` through the custom ops (as a FLOP-counting mode or a compiler sees it) matches the eager path, forward
    and backward, with and without a weight (the backward op's missing outputs are separate empty tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True) if affine else None
    leaves = [t for t in (x, w) if t is not None]
    eager = norm(x, w, out_dtype=torch.float16, impl="triton")
    g = torch.randn_like(eager)
    want = _grads(eager, leaves, g)
    with FlopCounterMode(display=False):
        counted = norm(x, w, out_dtype=torch.float16, impl="triton")
        got = _grads(counted, leaves, g)
    torch.testing.assert_close(counted, eager)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bf16_within_budget_gpu(kind: str) -> None:
    """bf16 on the GPU: the kernels (fp32 inside, one rounding) within the budget of PyTorch's unfused bf16 ops."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(3001, 4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sizes = (256, 256, 256, 256)
    parts = silu_split(x, sizes)
    x64 = x.detach().double().requires_grad_()
    exact = silu_split(x64, sizes, impl="reference")
    naive = silu_split(x.detach(), sizes, impl="reference")
    for i, (p, e, n) in enumerate(zip(parts, exact, naive, strict=True)):
        assert_within_budget(p, e, n, name=f"part {i}")
    grads = [torch.randn_like(p) for p in parts]
    (dx,) = _grads(parts, [x], grads)
    (dx64,) = _grads(exact, [x64], [g.double() for g in grads])
    xn = x.detach().requires_grad_()
    (dxn,) = _grads(silu_split(xn, sizes, impl="reference"), [xn], grads)
    assert_within_budget(dx, dx64, dxn, name="dx")

    a, u = (torch.randn(3001 * 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w = torch.randn(256, device="cuda", requires_grad=True)
    b = torch.randn(256, device="cuda", requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (a, u, w, b) if t is not None]
    y = norm_mul(a, u, w, b, eps=1e-6, kind=kind)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    exact = norm_mul(*leaves64[:3], leaves64[3] if b is not None else None, eps=1e-6, kind=kind, impl="reference")
    plain = [t.detach().requires_grad_() for t in leaves]
    naive = norm_mul(*plain[:3], plain[3] if b is not None else None, eps=1e-6, kind=kind, impl="reference")
    assert_within_budget(y, exact, naive, name="y")
    g = torch.randn_like(y)
    names = "augb"[: len(leaves)]
    grads = zip(_grads(y, leaves, g), _grads(exact, leaves64, g.double()), _grads(naive, plain, g), names, strict=True)
    for got, want, same, name in grads:
        assert_within_budget(got, want, same, name=f"d{name}", ulps=16.0)

    # The norm of a float32 residual stream written in bf16 (and its float32 gradient) against the module then the cast.
    x = torch.randn(3001 * 4, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (x, w, b) if t is not None]
    y = norm(x, w, b, eps=1e-6, kind=kind, out_dtype=torch.bfloat16)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    exact = norm(*leaves64[:2], leaves64[2] if b is not None else None, eps=1e-6, kind=kind, impl="reference")
    plain = [t.detach().requires_grad_() for t in leaves]
    naive = norm(*plain[:2], plain[2] if b is not None else None, eps=1e-6, kind=kind, out_dtype=torch.bfloat16,
                 impl="reference")  # fmt: skip
    assert_within_budget(y, exact, naive, name="norm y")
    g = torch.randn_like(y)
    grads = zip(_grads(y, leaves, g), _grads(exact, leaves64, g.double()), _grads(naive, plain, g), "xwb", strict=False)
    for got, want, same, name in grads:
        assert_within_budget(got, want, same, name=f"norm d{name}", ulps=16.0)
