"""The per-candidate token ops (``token_attention``, ``pairwise_dots``): Triton kernels against the float64 reference,
forward and backward, over token counts, odd head widths, empty and one-candidate batches, fp32 and bf16; validation;
the custom ops under opcheck, FLOP counting and torch.compile; bf16 at the interaction's real size on a GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_gem.ops.pointwise import MAX_TOKENS, pairwise_dots, token_attention
from lightning_gem.testing.numerics import assert_within_budget


def _triton_runs() -> bool:
    from lightning_gem.ops._launch import is_interpreted
    from lightning_gem.ops.pointwise.impl.triton.token_kernels import _token_attention_fwd_kernel

    return torch.cuda.is_available() or is_interpreted(_token_attention_fwd_kernel)


@pytest.fixture
def device() -> str:
    if not _triton_runs():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _grad(output: torch.Tensor, leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(output, leaf, grad)[0]


def _check(got: torch.Tensor, exact: torch.Tensor, naive: torch.Tensor, name: str) -> None:
    """fp32 to a few ulps of the float64 oracle; bf16 within the error budget of the same ops run in bf16."""
    assert got.dtype == naive.dtype and got.shape == exact.shape, name
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5, msg=name)
    else:
        assert_within_budget(got, exact, naive, name=name)


# (candidates, tokens, heads, head width): N in {1, 2, 5, 7, 16, 17, 32 (the most)}: one to twelve candidates a
# program's tile of rows, and one whole tile; odd and power-of-two widths, C in {0, 1, 2, 3, 37}.
ATTENTION = [(3, 5, 2, 24), (37, 7, 1, 40), (1, 1, 2, 16), (0, 5, 2, 8), (3, 2, 4, 32), (37, 5, 4, 64), (1, 7, 3, 5),
             (2, 16, 2, 8), (3, 17, 2, 16), (2, 32, 1, 8)]  # fmt: skip


@pytest.mark.parametrize(("candidates", "tokens", "heads", "head_dim"), ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_attention_matches_reference(
    device: str, candidates: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    scale = None if head_dim % 2 else 0.3  # the default (head_dim ** -0.5) and a given one
    qkv = (2 * torch.randn(candidates, tokens, 3 * heads * head_dim, device=device)).to(dtype).requires_grad_()
    out = token_attention(qkv, heads, scale, impl="triton")
    assert out.shape == (candidates, tokens, heads * head_dim) and out.is_contiguous()
    qkv64 = qkv.detach().double().requires_grad_()
    exact = token_attention(qkv64, heads, scale, impl="reference")
    plain = qkv.detach().requires_grad_()
    naive = token_attention(plain, heads, scale, impl="reference")
    _check(out, exact, naive, "out")
    grad = torch.randn_like(out)
    dqkv = _grad(out, qkv, grad)
    _check(dqkv, _grad(exact, qkv64, grad.double()), _grad(naive, plain, grad), "dqkv")


# (candidates, tokens, width): N in {1, 2, 5, 7, 16, 17, 32}; widths odd, a power of two, and wider than one chunk
# (1100).
DOTS = [(3, 5, 24), (37, 7, 40), (1, 1, 16), (0, 5, 8), (3, 2, 64), (1, 5, 1100), (37, 5, 3), (2, 16, 8), (3, 17, 8),
        (2, 32, 20)]  # fmt: skip


@pytest.mark.parametrize(("candidates", "tokens", "width"), DOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairwise_dots_matches_reference(device: str, candidates: int, tokens: int, width: int, dtype) -> None:
    scale = width**-0.5
    x = torch.randn(candidates, tokens, width, device=device).to(dtype).requires_grad_()
    out = pairwise_dots(x, scale, impl="triton")
    assert out.shape == (candidates, tokens * (tokens - 1) // 2)
    x64 = x.detach().double().requires_grad_()
    exact = pairwise_dots(x64, scale, impl="reference")
    plain = x.detach().requires_grad_()
    naive = pairwise_dots(plain, scale, impl="reference")
    _check(out, exact, naive, "dots")
    # The gradient arrives as a column slice of a wider one (strided rows), as after the interaction's concatenation.
    wide = torch.randn(candidates, 3 + out.shape[1], device=device, dtype=dtype)
    grad = wide[:, 3:]
    dx = _grad(out, x, grad)
    _check(dx, _grad(exact, x64, grad.double()), _grad(naive, plain, grad), "dx")


def test_pair_order_is_triu_indices(device: str) -> None:
    """Pair ``k`` is ``(rows[k], cols[k])`` of ``torch.triu_indices(N, N, 1)``: one-hot tokens make each dot a label."""
    tokens = 6
    x = torch.zeros(1, tokens, 8, device=device)
    for n in range(tokens):
        x[0, n, 0] = 2.0**n  # x_n . x_m = 2^(n + m): distinct for every pair n < m
    rows, cols = torch.triu_indices(tokens, tokens, offset=1)
    expected = (2.0 ** (rows + cols)).to(device)[None]
    assert torch.equal(pairwise_dots(x, impl="triton"), expected)


def test_non_contiguous_inputs(device: str) -> None:
    qkv = torch.randn(3 * 2 * 8, 4, 5, device=device).permute(1, 2, 0)  # [4, 5, 48], not contiguous
    torch.testing.assert_close(token_attention(qkv, 2, impl="triton"), token_attention(qkv, 2, impl="reference"))
    x = torch.randn(24, 5, 3, device=device).transpose(0, 2)  # [3, 5, 24]
    torch.testing.assert_close(pairwise_dots(x, impl="triton"), pairwise_dots(x, impl="reference"))


def test_inputs_are_checked() -> None:
    qkv = torch.randn(2, 3, 12)
    with pytest.raises(ValueError, match="qkv"):
        token_attention(qkv[0], 2)
    with pytest.raises(ValueError, match="3 \\* num_heads"):
        token_attention(qkv, 3)
    with pytest.raises(ValueError, match="num_heads"):
        token_attention(qkv, 0)
    with pytest.raises(TypeError, match="float"):
        token_attention(qkv.long(), 2)
    with pytest.raises(ValueError, match="impl"):
        token_attention(qkv, 2, impl="cuda")
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):  # a named impl never falls back
        token_attention(qkv.double(), 2, impl="triton")
    with pytest.raises(ValueError, match="x"):
        pairwise_dots(qkv[0])
    with pytest.raises(TypeError, match="float"):
        pairwise_dots(qkv.int())
    too_many = torch.randn(2, MAX_TOKENS + 1, 12)
    if _triton_runs():
        with pytest.raises(ValueError, match="at most"):
            pairwise_dots(too_many, impl="triton")
        with pytest.raises(ValueError, match="at most"):
            token_attention(too_many, 2, impl="triton")


def test_auto_on_cpu_is_the_reference() -> None:
    qkv, x = torch.randn(3, 4, 24), torch.randn(3, 4, 10)
    assert torch.equal(token_attention(qkv, 2), token_attention(qkv, 2, impl="reference"))
    assert torch.equal(pairwise_dots(x, 0.5), pairwise_dots(x, 0.5, impl="reference"))


def test_opcheck(device: str) -> None:
    from lightning_gem.ops.pointwise.impl import triton as _registers_the_ops  # noqa: F401

    qkv = torch.randn(5, 3, 3 * 2 * 12, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.lightning_gem.token_attention.default, (qkv, 2, 0.25))
    grad = torch.randn(5, 3, 24, device=device)
    torch.library.opcheck(torch.ops.lightning_gem.token_attention_backward.default, (grad, qkv.detach(), 2, 0.25))
    x = torch.randn(5, 4, 20, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.lightning_gem.pairwise_dots.default, (x, 0.5))
    torch.library.opcheck(torch.ops.lightning_gem.pairwise_dots_backward.default, (torch.randn(5, 6), x.detach(), 0.5))


def test_flops_are_those_of_the_matmuls(device: str) -> None:
    """The kit's FLOP counter counts the attention as its two matmuls (and their four in the backward) whichever
    path runs it; the dots count their pairs only (the reference's batched matmul also computes the rest)."""
    from lightning_gem.flops import MatmulFlopCounter

    candidates, tokens, heads, head_dim = 6, 5, 2, 8
    qkv = torch.randn(candidates, tokens, 3 * heads * head_dim, device=device, requires_grad=True)
    counted = {}
    for impl in ("triton", "reference"):
        with MatmulFlopCounter() as counter:
            out = token_attention(qkv, heads, impl=impl)
            torch.autograd.grad(out, qkv, torch.ones_like(out))
        counted[impl] = counter.flops
    per_matmul = 2 * candidates * tokens * tokens * heads * head_dim
    assert counted["triton"] == counted["reference"] == 6 * per_matmul
    x = torch.randn(candidates, tokens, 16, device=device, requires_grad=True)
    with MatmulFlopCounter() as counter:
        out = pairwise_dots(x, impl="triton")
        torch.autograd.grad(out, x, torch.ones_like(out))
    assert counter.flops == 6 * candidates * (tokens * (tokens - 1) // 2) * 16


def test_through_the_custom_ops(device: str) -> None:
    """Under ``FlopCounterMode`` the ops and their backwards run as custom ops (as a compiler sees them): the same
    values and gradients as the eager path, and the FLOPs of their formulas."""
    from torch.utils.flop_counter import FlopCounterMode

    qkv = torch.randn(6, 5, 3 * 2 * 8, device=device, requires_grad=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        dots = pairwise_dots(token_attention(qkv, 2, impl="triton"), 0.5, impl="triton")
        return dots, _grad(dots, qkv, torch.ones_like(dots))

    eager = step()
    with FlopCounterMode(display=False) as counter:
        counted = step()
    for got, want in zip(counted, eager, strict=True):
        torch.testing.assert_close(got, want)
    attention = 6 * (2 * 6 * 5 * 5 * 16)  # six matmuls (two forward, four backward) of 2 C N^2 (H D) each
    dots = 6 * 6 * 10 * 16  # 6 D a pair (2 forward, 4 backward), 10 pairs a candidate
    assert counter.get_total_flops() == attention + dots


def test_compiled_fullgraph(device: str) -> None:
    """Both ops under ``torch.compile(fullgraph=True)``, forward and backward, match eager."""

    def fn(qkv):
        mixed = token_attention(qkv, 2, impl="triton")
        return pairwise_dots(mixed, 0.5, impl="triton")

    qkv = torch.randn(7, 5, 3 * 16, device=device, requires_grad=True)
    eager = fn(qkv)
    # The interpreter runs kernels on CPU tensors, which Inductor cannot launch: trace with AOT autograd only.
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(qkv)
    torch.testing.assert_close(compiled, eager)
    grad = torch.randn_like(eager)
    torch.testing.assert_close(_grad(compiled, qkv, grad), _grad(eager, qkv, grad))


@pytest.mark.gpu
def test_bf16_within_budget_at_real_size_gpu() -> None:
    """bf16 at the interaction's size (4096 candidates, 5 tokens, 4 heads of 256): the kernels (bf16 products,
    fp32 sums and softmax) within the budget of PyTorch's unfused bf16 ops, forward and backward."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    candidates, tokens, heads, head_dim = 4096, 5, 4, 256
    qkv = torch.randn(candidates, tokens, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(candidates, tokens, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    cases = (
        ("token_attention", qkv, lambda t, impl: token_attention(t, heads, impl=impl)),
        ("pairwise_dots", x, lambda t, impl: pairwise_dots(t, (heads * head_dim) ** -0.5, impl=impl)),
    )
    for name, data, op in cases:
        leaf = data.clone().requires_grad_()
        out = op(leaf, "triton")
        leaf64 = data.double().requires_grad_()
        exact = op(leaf64, "reference")
        plain = data.clone().requires_grad_()
        naive = op(plain, "reference")
        assert_within_budget(out, exact, naive, name=name)
        grad = torch.randn_like(out)
        got = _grad(out, leaf, grad)
        assert_within_budget(got, _grad(exact, leaf64, grad.double()), _grad(naive, plain, grad), name=f"d {name}")
