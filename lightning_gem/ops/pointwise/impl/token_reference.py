"""Pure-PyTorch references of the per-candidate token ops: any device, autograd, the tests' oracle.

They are the compositions an unfused token interaction runs: views and permutes, two batched matmuls around a
softmax for the attention, one batched matmul and a gather of its upper triangle for the pairwise dots.

Legend: ``C`` candidates, ``N`` tokens per candidate, ``H`` heads, ``D`` a head's width (a token's for the dots),
``P = N (N - 1) / 2`` token pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pairwise_dots_reference", "token_attention_reference"]


def token_attention_reference(qkv_CNX: Tensor, num_heads: int, scale: float) -> Tensor:
    """``softmax(q k^T * scale) v`` per candidate and head of ``qkv [C, N, 3 H D]`` (laid out as ``[3, H, D]``),
    as ``[C, N, H D]``: the permutes, matmuls and softmax of an unfused layer, each rounded to ``qkv``'s dtype."""
    num_candidates, num_tokens, width = qkv_CNX.shape
    head_dim = width // (3 * num_heads)
    qkv = qkv_CNX.view(num_candidates, num_tokens, 3, num_heads, head_dim)
    q_CHND, k_CHND, v_CHND = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    weights = torch.matmul(q_CHND, k_CHND.transpose(-1, -2) * scale).softmax(dim=-1)
    mixed = torch.matmul(weights.to(v_CHND.dtype), v_CHND)
    return mixed.transpose(1, 2).reshape(num_candidates, num_tokens, num_heads * head_dim)


def pairwise_dots_reference(x_CND: Tensor, scale: float) -> Tensor:
    """``[C, P]``: ``x_n . x_m * scale`` for every pair ``n < m`` of each candidate's tokens, in the row-major order of
    ``torch.triu_indices(N, N, offset=1)`` (one batched matmul of all ``N x N`` products, then the gather)."""
    num_tokens = x_CND.shape[1]
    rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1, device=x_CND.device)
    return torch.einsum("cnd,cmd->cnm", x_CND, x_CND)[:, rows, cols] * scale
