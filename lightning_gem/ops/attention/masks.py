"""Which (query, key) pairs GDPA lets attend: the one definition every implementation follows.

Notation for one query segment ``b`` attending to kv segment ``j = kv_index[b]``: ``Lq`` queries,
``Lk`` keys, query ``i`` in ``[0, Lq)``, key ``t`` in ``[0, Lk)``.

- Self-attention (``Lq == Lk`` segment by segment, the same offsets): ``h = Lk - num_targets[b]``
  history tokens, then targets. A query's position is ``p(i) = min(i, h)``: every target sits at the
  position right after the history.
- Cross-attention: no targets (``h = Lk``); queries are aligned to the end of the keys, so
  ``p(i) = i + Lk - Lq`` (FlashAttention's bottom-right causal alignment).

``allowed(i, t)`` holds iff ``t == i and t >= h`` (a target sees itself), or ``t < h`` and all of:
    causal:          ``t <= p(i)``
    window w:        ``|p(i) - t| <= w``
    block_size s:    ``p(i) // s == t // s`` (blocks aligned to the segment start)
So a target never sees another target, and no history query sees a target.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_gem import jagged

__all__ = ["Segments", "key_ranges", "num_allowed_pairs", "padded_mask", "segments"]


class Segments(NamedTuple):
    """Per query segment ``b`` (``[B]`` int64 each): where its queries and its kv segment's keys start, their
    lengths, and ``h``, the history length (``Lk`` less the targets)."""

    q_start: Tensor
    len_q: Tensor
    k_start: Tensor
    len_k: Tensor
    num_history: Tensor


def segments(q_offsets: Tensor, kv_offsets: Tensor, kv_index: Tensor | None, num_targets: Tensor | None) -> Segments:
    """The :class:`Segments` of validated offsets, kv index and targets (see the module docstring)."""
    q_offsets, kv_offsets = q_offsets.to(torch.int64), kv_offsets.to(torch.int64)
    q_start, len_q = q_offsets[:-1], q_offsets[1:] - q_offsets[:-1]
    kv_seg = torch.arange(len_q.numel(), device=q_offsets.device) if kv_index is None else kv_index.to(torch.int64)
    k_start, len_k = kv_offsets[:-1][kv_seg], (kv_offsets[1:] - kv_offsets[:-1])[kv_seg]
    num_history = len_k if num_targets is None else len_k - num_targets.to(torch.int64)
    return Segments(q_start, len_q, k_start, len_k, num_history)


def padded_mask(
    len_q: Tensor,
    len_k: Tensor,
    num_history: Tensor,
    num_q: int,
    num_k: int,
    *,
    causal: bool,
    window: int | None,
    block_size: int | None,
) -> Tensor:
    """``[N, num_q, num_k]`` boolean mask of the allowed pairs of ``N`` segments padded to ``num_q`` queries and
    ``num_k`` keys; ``len_q``, ``len_k``, ``num_history``: ``[N]`` each. Pairs outside ``[0, len)`` are False."""
    q_pos = torch.arange(num_q, device=len_q.device)[None, :, None]
    k_pos = torch.arange(num_k, device=len_q.device)[None, None, :]
    len_q, len_k, num_history = len_q[:, None, None], len_k[:, None, None], num_history[:, None, None]
    # Each query row sees one contiguous range of history keys, plus its own key if it is a target:
    # building the mask from the ranges costs a few comparisons per pair whatever the rules enabled.
    lo, hi, own_target = key_ranges(
        q_pos, len_q, len_k, num_history, causal=causal, window=window, block_size=block_size
    )
    in_history = (k_pos >= lo) & (k_pos < hi) & (q_pos < len_q)
    return in_history | (own_target & (k_pos == q_pos))


def key_ranges(
    q_pos: Tensor,
    len_q: Tensor,
    len_k: Tensor,
    num_history: Tensor,
    *,
    causal: bool,
    window: int | None,
    block_size: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per query row: the history keys it sees as a half-open range ``[lo, hi)`` and whether it also sees
    its own target key. The arguments broadcast against each other (e.g. one entry per query row).

    Kernels use this to skip key blocks outside ``[lo, hi)``; FLOP counting sums ``hi - lo`` (+1).
    """
    shift = len_k - len_q
    is_self = shift == 0
    p = torch.where(is_self & (q_pos > num_history), num_history, q_pos + shift)
    lo = torch.zeros_like(p)
    hi = num_history.clone()
    if causal:
        hi = torch.minimum(hi, p + 1)
    if window is not None:
        lo = torch.maximum(lo, p - window)
        hi = torch.minimum(hi, p + window + 1)
    if block_size is not None:
        start = torch.div(p, block_size, rounding_mode="floor") * block_size
        lo = torch.maximum(lo, start)
        hi = torch.minimum(hi, start + block_size)
    hi = torch.maximum(hi, lo)
    own_target = is_self & (q_pos >= num_history) & (q_pos < len_k)
    return lo, hi, own_target


def num_allowed_pairs(
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    *,
    causal: bool,
    window: int | None,
    block_size: int | None,
) -> int:
    """Number of allowed (query, key) pairs over the batch, per head: O(Tq) work, no mask is built."""
    _, len_q, _, len_k, num_history = segments(q_offsets, kv_offsets, kv_index, num_targets)
    total_q = int(len_q.sum())
    if total_q == 0:
        return 0
    seg, q_pos = jagged.segment_positions(q_offsets, total_q)
    lo, hi, own = key_ranges(
        q_pos, len_q[seg], len_k[seg], num_history[seg], causal=causal, window=window, block_size=block_size
    )
    return int((hi - lo).clamp_min(0).sum() + own.sum())
