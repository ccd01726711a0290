"""An independent, padded dense GDPA oracle written straight from the ``gdpa`` docstring.

It shares nothing with the code it judges: the mask is built by explicit Python loops over every
``(i, t)`` pair of every segment from the docstring's rules (``lightning_gem.ops.attention.masks`` is
not imported), the batch is padded densely, and the whole computation runs in one dtype (float64 for
the oracle; the same code in float32/float16/bfloat16 gives the error budget of a same-precision
computation). It is differentiable by autograd, so its gradients judge the op's explicit backward.
Only for small shapes: the mask loops are O(sum of Lq * Lk) in Python.

Example:
    >>> import torch
    >>> from lightning_gem.testing.gdpa_oracle import allowed_pairs
    >>> allowed_pairs(3, 3, 1, causal=True, window=None, block_size=None, self_attention=True)
    [[True, False, False], [True, True, False], [True, True, True]]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["allowed_pairs", "count_allowed_pairs", "gdpa_oracle", "segment_masks"]


def allowed_pairs(
    len_q: int,
    len_k: int,
    num_targets: int,
    *,
    causal: bool,
    window: int | None,
    block_size: int | None,
    self_attention: bool,
) -> list[list[bool]]:
    """``[len_q][len_k]`` allowed pairs of one segment, pair by pair from the docstring's rules."""
    history = len_k - num_targets if self_attention else len_k
    rows = []
    for i in range(len_q):
        position = min(i, history) if self_attention else i + len_k - len_q
        row = []
        for t in range(len_k):
            if t >= history:
                row.append(t == i)  # a target sees itself, never another target
                continue
            ok = True
            if causal and t > position:
                ok = False
            if window is not None and abs(position - t) > window:
                ok = False
            if block_size is not None and position // block_size != t // block_size:  # floor division
                ok = False
            row.append(ok)
        rows.append(row)
    return rows


def _segments(
    q_offsets: Tensor, kv_offsets: Tensor | None, kv_index: Tensor | None, num_targets: Tensor | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int], bool]:
    """Per query segment: its q rows, its kv rows, its number of targets; and whether it is self-attention."""
    q_off = [int(x) for x in q_offsets.tolist()]
    kv_off = q_off if kv_offsets is None else [int(x) for x in kv_offsets.tolist()]
    num_segments = len(q_off) - 1
    index = list(range(num_segments)) if kv_index is None else [int(x) for x in kv_index.tolist()]
    targets = [0] * num_segments if num_targets is None else [int(x) for x in num_targets.tolist()]
    q_rows = [(q_off[b], q_off[b + 1]) for b in range(num_segments)]
    kv_rows = [(kv_off[j], kv_off[j + 1]) for j in index]
    # "Self-attention (kv_offsets omitted, or equal lengths everywhere)".
    self_attention = kv_offsets is None or all(
        qe - qs == ke - ks for (qs, qe), (ks, ke) in zip(q_rows, kv_rows, strict=True)
    )
    return q_rows, kv_rows, targets, self_attention


def segment_masks(
    q_offsets: Tensor,
    kv_offsets: Tensor | None = None,
    *,
    kv_index: Tensor | None = None,
    num_targets: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
) -> list[list[list[bool]]]:
    """The allowed-pair mask of every query segment (a list of ``[Lq][Lk]`` nested lists)."""
    q_rows, kv_rows, targets, self_attention = _segments(q_offsets, kv_offsets, kv_index, num_targets)
    return [
        allowed_pairs(
            qe - qs, ke - ks, n, causal=causal, window=window, block_size=block_size, self_attention=self_attention
        )
        for (qs, qe), (ks, ke), n in zip(q_rows, kv_rows, targets, strict=True)
    ]


def count_allowed_pairs(q_offsets: Tensor, kv_offsets: Tensor | None = None, **mask_kwargs: object) -> int:
    """Brute-force number of allowed (query, key) pairs over the batch (per head)."""
    return sum(sum(row) for mask in segment_masks(q_offsets, kv_offsets, **mask_kwargs) for row in mask)


def _activation(name: str, x: Tensor) -> Tensor:
    if name == "silu":
        return x / (1 + torch.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "sigmoid":
        return 1 / (1 + torch.exp(-x))
    raise ValueError(f"`activation` must be softmax, silu, gelu, relu or sigmoid, got {name!r}")


def _pad(rows: Tensor, length: int) -> Tensor:
    return torch.cat([rows, rows.new_zeros(length - rows.shape[0], *rows.shape[1:])])


def gdpa_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor | None = None,
    *,
    kv_index: Tensor | None = None,
    num_targets: Tensor | None = None,
    activation: str = "softmax",
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """GDPA on a densely padded batch, every step in ``dtype``. Returns ``[Tq, H, Dv]`` in ``dtype``.

    Same arguments and meaning as :func:`lightning_gem.ops.gdpa` (inputs are assumed valid).
    """
    q_rows, kv_rows, targets, self_attention = _segments(q_offsets, kv_offsets, kv_index, num_targets)
    heads, dim_v = q.shape[1], v.shape[2]
    if not q_rows or all(qe == qs for qs, qe in q_rows):
        return torch.zeros(q.shape[0], heads, dim_v, dtype=dtype)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    max_q = max(qe - qs for qs, qe in q_rows)
    max_k = max(1, max(ke - ks for ks, ke in kv_rows))
    q_pad = torch.stack([_pad(q[qs:qe].to(dtype), max_q) for qs, qe in q_rows])  # [B, Lq, H, D]
    k_pad = torch.stack([_pad(k[ks:ke].to(dtype), max_k) for ks, ke in kv_rows])  # [B, Lk, H, D]
    v_pad = torch.stack([_pad(v[ks:ke].to(dtype), max_k) for ks, ke in kv_rows])  # [B, Lk, H, Dv]
    padded_masks = []
    for (qs, qe), (ks, ke), n in zip(q_rows, kv_rows, targets, strict=True):
        pairs = allowed_pairs(
            qe - qs, ke - ks, n, causal=causal, window=window, block_size=block_size, self_attention=self_attention
        )
        rows = [row + [False] * (max_k - len(row)) for row in pairs]
        padded_masks.append(rows + [[False] * max_k] * (max_q - len(rows)))
    mask = torch.tensor(padded_masks, dtype=torch.bool)[:, None]  # [B, 1, Lq, Lk]
    scores = torch.einsum("bqhd,bkhd->bhqk", q_pad, k_pad) * scale
    if activation == "softmax":
        has_key = mask.any(dim=-1, keepdim=True)
        # Rows without any allowed key get constant scores (no NaN, zero gradient) and then zero weight.
        scores = torch.where(has_key, scores.masked_fill(~mask, float("-inf")), torch.zeros_like(scores))
        probs = torch.softmax(scores, dim=-1) * mask
    else:
        len_k = torch.tensor([max(1, ke - ks) for ks, ke in kv_rows], dtype=dtype).view(-1, 1, 1, 1)
        probs = _activation(activation, scores) * mask / len_k
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v_pad)
    return torch.cat([out[b, : qe - qs] for b, (qs, qe) in enumerate(q_rows)])
