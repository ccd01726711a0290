"""GDPA on padded tensors: what a model without jagged kernels does, kept as the baseline the kit is measured against.

The jagged batch is padded to ``[B, H, Lmax, D]`` (each query segment gets its own copy of its kv
segment, also when candidates share a history), the allowed pairs become a dense ``[B, 1, Lq, Lk]``
mask, and attention is ``torch.nn.functional.scaled_dot_product_attention`` (softmax) or
``mask * act(scale Q K^T) / Lk @ V`` in eager PyTorch (pointwise activations, which SDPA lacks).
Plain causal self-attention without targets takes SDPA's ``is_causal`` path (FlashAttention on a GPU):
padding sits after each sequence, so real queries never see it.

Memory and FLOPs grow with ``B * Lmax**2``, not with the sum of the segments' squares: that is the
point of comparison, not a recommended path. Autograd differentiates it; it runs wherever PyTorch
does, in the inputs' dtype (SDPA and matmuls accumulate in fp32 on GPUs).

It is also the one implementation that takes a ``score_bias`` (a learned bias of relative positions or
times, as HSTU's relative attention bias), since it alone holds the ``[B, H, L, L]`` scores: then the scores
are computed in fp32, the bias added, and the masked softmax or pointwise weights multiply the values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gem import jagged
from lightning_gem.ops.attention.impl.reference import POINTWISE
from lightning_gem.ops.attention.masks import padded_mask, segments
from lightning_gem.ops.attention.spec import Spec

__all__ = ["gdpa_padded"]


def _pad_rows(x: Tensor, starts: Tensor, lengths: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Rows ``[starts[b], starts[b] + lengths[b])`` of ``x [T, H, D]`` as ``[B, H, max_len, D]`` (zeros past
    each length), and the ``[B, max_len]`` validity mask."""
    pos = torch.arange(max_len, device=x.device)
    valid = pos[None, :] < lengths[:, None]
    index = (starts[:, None] + pos).clamp_max(max(x.shape[0] - 1, 0))
    padded = x[index] * valid[:, :, None, None].to(x.dtype)  # [B, L, H, D]
    return padded.transpose(1, 2), valid


def gdpa_padded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: Spec,
    *,
    score_bias: Tensor | None = None,
    normalization_length: int | None = None,
) -> Tensor:
    """GDPA forward on validated inputs by padding (see :func:`lightning_gem.ops.gdpa` for the contract).

    Shapes as :func:`~lightning_gem.ops.attention.impl.reference.gdpa_reference`; the spec's ``max_seq_len_q`` /
    ``max_seq_len_kv`` are the padded lengths (read from the offsets, a device sync, when None).
    ``score_bias`` (self-attention without targets) broadcasts to ``[B, H, Lq, Lk]`` of those lengths.
    """
    if q.shape[0] == 0 or k.shape[0] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, scale = spec[:9]
    q_start, len_q, k_start, len_k, num_history = segments(q_offsets, kv_offsets, kv_index, num_targets)
    max_q = int(len_q.max()) if spec.max_seq_len_q is None else spec.max_seq_len_q
    max_k = int(len_k.max()) if spec.max_seq_len_kv is None else spec.max_seq_len_kv
    if max_q == 0 or max_k == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    if score_bias is not None and tuple(score_bias.shape[-2:]) != (max_q, max_k):
        raise ValueError(
            f"`score_bias` must end in [L, L] = [{max_q}, {max_k}] (the padded lengths), got {tuple(score_bias.shape)}"
        )
    q_BHLD, q_valid = _pad_rows(q, q_start, len_q, max_q)
    k_BHLD, _ = _pad_rows(k, k_start, len_k, max_k)
    v_BHLD, _ = _pad_rows(v, k_start, len_k, max_k)

    plain_causal = causal and kv_index is None and num_targets is None and window is None and block_size is None
    sdpa_causal = activation == "softmax" and plain_causal and score_bias is None and max_q == max_k
    if sdpa_causal and torch.equal(q_offsets.to(torch.int64), kv_offsets.to(torch.int64)):
        out = F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, is_causal=True, scale=scale)
    else:
        mask = padded_mask(
            len_q, len_k, num_history, max_q, max_k, causal=causal, window=window, block_size=block_size
        )[:, None]  # [B, 1, Lq, Lk]
        if score_bias is not None:
            divisor = len_k.clamp_min(1)[:, None, None, None] if normalization_length is None else normalization_length
            out = _biased(q_BHLD, k_BHLD, v_BHLD, mask, score_bias, activation=activation, scale=scale, divisor=divisor)
            # Rows gathered by position, not by the validity mask: no data-dependent shape, so a compiled
            # layer keeps one graph.
            segment, position = jagged.segment_positions(q_offsets, q.shape[0])
            return out.transpose(1, 2)[segment, position]
        elif activation == "softmax":
            # A query that sees no key (an empty history, padding) would be NaN in SDPA: let it see
            # everything, then zero it.
            empty = ~mask.any(dim=-1, keepdim=True)
            out = F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, attn_mask=mask | empty, scale=scale)
            out = out.masked_fill(empty, 0.0)
        else:
            scores = torch.matmul(q_BHLD, k_BHLD.transpose(-1, -2)) * scale
            weights = torch.where(mask, POINTWISE[activation][0](scores), torch.zeros_like(scores))
            divisor = len_k.clamp_min(1).to(q.dtype)[:, None, None, None]
            out = torch.matmul(weights, v_BHLD) / (divisor if normalization_length is None else normalization_length)
    return out.transpose(1, 2)[q_valid]  # [Tq, H, Dv]: the valid rows, in segment order


def _biased(
    q_BHLD: Tensor,
    k_BHLD: Tensor,
    v_BHLD: Tensor,
    mask: Tensor,
    score_bias: Tensor,
    *,
    activation: str,
    scale: float,
    divisor: Tensor | int,
) -> Tensor:
    """``[B, H, Lq, Dv]`` attention of padded ``q``, ``k``, ``v`` with ``score_bias`` added to the fp32 scores;
    ``mask [B, 1, Lq, Lk]`` the allowed pairs, ``divisor`` the pointwise normaliser (``[B, 1, 1, 1]`` lengths or
    a fixed length)."""
    scores = torch.einsum("bhid,bhtd->bhit", q_BHLD, k_BHLD).float() * scale + score_bias
    if activation == "softmax":  # a finite fill: padded query rows (no allowed key) stay finite in backward
        weights = torch.softmax(scores.masked_fill(~mask, -1e30), dim=-1) * mask
    else:
        weights = (POINTWISE[activation][0](scores) / divisor).masked_fill(~mask, 0.0)
    return torch.einsum("bhit,bhtd->bhid", weights.to(v_BHLD.dtype), v_BHLD)
