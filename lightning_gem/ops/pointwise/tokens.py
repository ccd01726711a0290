"""Public per-candidate token ops of the candidate interaction: validation, defaults and ``impl=`` dispatch.

A ranking model's candidate interaction mixes a handful of feature tokens per candidate (the candidate, what it read
from the history, user-level context tokens): a small softmax attention over a candidate's ``N`` tokens, then
DLRM-style dot products of its token pairs. As batched matmuls these are thousands of ``N x N`` products per head,
which leave tensor cores idle and need permute copies either side; the kernels read each row once and write the
results in the layouts the neighbouring Linears use.

``impl="reference"`` is pure PyTorch (any device, the oracle); ``"triton"`` runs the kernels (CUDA, or CPU under
``TRITON_INTERPRET=1``) and never falls back; ``"auto"`` picks Triton for CUDA tensors of fp32/fp16/bf16 with at
most :data:`MAX_TOKENS` tokens a candidate, and the reference otherwise. The kernels multiply in the input's dtype
with fp32 accumulation and keep the softmax in fp32, rounding as few times as the reference's matmuls do.
"""

from __future__ import annotations

from torch import Tensor

from lightning_gem.ops._launch import resolve_triton_impl
from lightning_gem.ops.pointwise.api import IMPLS
from lightning_gem.ops.pointwise.impl.token_reference import pairwise_dots_reference, token_attention_reference

__all__ = ["MAX_TOKENS", "pairwise_dots", "token_attention"]

#: Tokens a candidate may have on the Triton path (a kernel program holds a candidate's tokens in one tile of rows,
#: so its tiles grow with them; the GPU benchmark runs up to 32).
MAX_TOKENS = 32


def _token_kernel() -> object:
    from lightning_gem.ops.pointwise.impl.triton.token_kernels import _token_attention_fwd_kernel

    return _token_attention_fwd_kernel


def _resolve_impl(impl: str, x: Tensor, num_tokens: int) -> str:
    resolved = resolve_triton_impl(impl, IMPLS, x, _token_kernel)
    if resolved == "triton" and num_tokens > MAX_TOKENS:
        if impl == "triton":
            raise ValueError(f"impl='triton' takes at most {MAX_TOKENS} tokens a candidate, got {num_tokens}")
        return "reference"
    return resolved


def token_attention(qkv: Tensor, num_heads: int, scale: float | None = None, *, impl: str = "auto") -> Tensor:
    """Softmax attention among each candidate's tokens, per head: ``softmax(q k^T * scale) v``.

    ``qkv`` is a projection's output whose last dim is laid out as ``[3, H, D]`` (``qkv.view(C, N, 3, H, D)``:
    queries, keys and values, each head-major); the result is ``[C, N, H * D]`` (heads side by side, as a Linear
    reads them). The kernels read ``qkv`` and write the result in place of the permutes and matmuls; their backward
    recomputes the softmax from ``q`` and ``k`` (nothing but ``qkv`` is saved) and writes ``qkv``'s gradient in its
    layout.

    Args:
        qkv: ``[C, N, 3 * H * D]`` float tensor (a non-contiguous one is copied first).
        num_heads: ``H``.
        scale: multiplies the scores; None: ``D ** -0.5``.
        impl: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``[C, N, H * D]`` in ``qkv``'s dtype.

    Example:
        >>> qkv = torch.randn(4, 3, 3 * 8)
        >>> token_attention(qkv, num_heads=2).shape
        torch.Size([4, 3, 8])
    """
    if qkv.dim() != 3:
        raise ValueError(f"`qkv` must be [C, N, 3 * num_heads * head_dim], got shape {tuple(qkv.shape)}")
    if not qkv.is_floating_point():
        raise TypeError(f"`qkv` must be a float tensor, got {qkv.dtype}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"`num_heads` must be a positive int, got {num_heads!r}")
    width = qkv.shape[2]
    if width == 0 or width % (3 * num_heads):
        raise ValueError(
            f"`qkv`'s last dim must be a positive multiple of 3 * num_heads = {3 * num_heads}, got {width}"
        )
    head_dim = width // (3 * num_heads)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if _resolve_impl(impl, qkv, qkv.shape[1]) == "reference":
        return token_attention_reference(qkv, num_heads, scale)
    from lightning_gem.ops.pointwise.impl.triton import token_attention_triton

    return token_attention_triton(qkv.contiguous(), num_heads, scale)


def pairwise_dots(x: Tensor, scale: float = 1.0, *, impl: str = "auto") -> Tensor:
    """Dot products of each candidate's token pairs, times ``scale`` (DLRM-style explicit interactions).

    Pairs ``(n, m)`` with ``n < m`` in the row-major order of ``torch.triu_indices(N, N, offset=1)``; the kernels
    write only those (summing in fp32), without the ``N x N`` matrix and the gather of its upper triangle.

    Args:
        x: ``[C, N, D]`` float tensor (a non-contiguous one is copied first).
        scale: multiplies every dot product (``D ** -0.5`` keeps them at the tokens' scale).
        impl: ``"auto"``, ``"triton"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``[C, N * (N - 1) / 2]`` in ``x``'s dtype.

    Example:
        >>> x = torch.tensor([[[1.0, 0.0], [1.0, 2.0], [0.0, 3.0]]])
        >>> pairwise_dots(x)  # (0, 1), (0, 2), (1, 2)
        tensor([[1., 0., 6.]])
    """
    if x.dim() != 3:
        raise ValueError(f"`x` must be [C, N, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"`x` must be a float tensor, got {x.dtype}")
    scale = float(scale)
    if _resolve_impl(impl, x, x.shape[1]) == "reference":
        return pairwise_dots_reference(x, scale)
    from lightning_gem.ops.pointwise.impl.triton import pairwise_dots_triton

    return pairwise_dots_triton(x.contiguous(), scale)
