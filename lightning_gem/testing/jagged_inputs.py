"""Random jagged inputs for tests: lengths with empty and length-1 segments, offsets, GDPA q/k/v batches.

Lengths are drawn up to a small odd maximum so they are multiples of nothing in particular, and every
batch of two or more segments holds at least one empty and one length-1 segment. Offsets are built with
a plain Python running sum, not with :mod:`lightning_gem.jagged`, so tests of that module stay independent.

Example:
    >>> import torch
    >>> from lightning_gem.testing.jagged_inputs import make_gdpa_inputs
    >>> inputs = make_gdpa_inputs("cross", torch.Generator().manual_seed(0), heads=2, dim=4, dim_v=3)
    >>> inputs.q.shape[1:], inputs.v.shape[1:]
    (torch.Size([2, 4]), torch.Size([2, 3]))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "GDPAInputs", "lengths_to_offsets", "make_gdpa_inputs", "random_lengths"]

# How query segments meet kv segments:
#   self          kv_offsets omitted (k/v rows are the query rows)
#   self_targets  as self, plus random num_targets in [0, L] (0 and L both drawn when B allows)
#   cross         separate kv_offsets, lengths drawn independently (an empty kv under a non-empty q too)
#   shared_kv     fewer kv segments than query segments; kv_index maps several query segments to one
LAYOUTS = ("self", "self_targets", "cross", "shared_kv")


def lengths_to_offsets(lengths: Sequence[int], dtype: torch.dtype = torch.int64) -> Tensor:
    """``[B + 1]`` offsets of ``lengths`` (a running sum starting at 0)."""
    return torch.tensor([0, *itertools.accumulate(int(n) for n in lengths)], dtype=dtype)


def random_lengths(num_segments: int, max_len: int, generator: torch.Generator, *, edges: bool = True) -> list[int]:
    """``num_segments`` lengths in ``[0, max_len]``; with ``edges`` a 0 and a 1 are always among them.

    The edge lengths are placed at random positions, so first/last segment handling is exercised too.
    """
    lengths = torch.randint(0, max_len + 1, (num_segments,), generator=generator).tolist()
    if edges and num_segments >= 2:
        where = torch.randperm(num_segments, generator=generator)[:2].tolist()
        lengths[where[0]], lengths[where[1]] = 0, 1
    return lengths


@dataclass
class GDPAInputs:
    """Keyword-ready GDPA inputs; ``kwargs()`` gives the jagged arguments of :func:`lightning_gem.ops.gdpa`."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_offsets: Tensor
    kv_offsets: Tensor | None = None
    kv_index: Tensor | None = None
    num_targets: Tensor | None = None
    q_lengths: list[int] = field(default_factory=list)
    kv_lengths: list[int] = field(default_factory=list)

    def kwargs(self) -> dict[str, Tensor | None]:
        return {"kv_offsets": self.kv_offsets, "kv_index": self.kv_index, "num_targets": self.num_targets}

    def with_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> GDPAInputs:
        """The same jagged layout with other ``q``, ``k``, ``v`` (e.g. cast, or leaves requiring grad)."""
        return GDPAInputs(
            q, k, v, self.q_offsets, self.kv_offsets, self.kv_index, self.num_targets, self.q_lengths, self.kv_lengths
        )


def make_gdpa_inputs(
    layout: str,
    generator: torch.Generator,
    *,
    num_segments: int = 5,
    max_len: int = 11,
    q_lengths: Sequence[int] | None = None,
    kv_lengths: Sequence[int] | None = None,
    heads: int = 2,
    dim: int = 4,
    dim_v: int = 3,
    dtype: torch.dtype = torch.float64,
    offsets_dtype: torch.dtype = torch.int64,
) -> GDPAInputs:
    """Random GDPA inputs in one of :data:`LAYOUTS`.

    ``q_lengths`` / ``kv_lengths`` fix the segment lengths (``kv_lengths`` only for ``cross`` and
    ``shared_kv``); otherwise they are drawn with :func:`random_lengths`. Values are standard normal.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    q_lengths = list(q_lengths) if q_lengths is not None else random_lengths(num_segments, max_len, generator)
    num_segments = len(q_lengths)
    kv_index = num_targets = kv_offsets = None
    if layout in ("self", "self_targets"):
        kv_lengths = q_lengths
    elif layout == "cross":
        kv_lengths = list(kv_lengths) if kv_lengths is not None else random_lengths(num_segments, max_len, generator)
        kv_offsets = lengths_to_offsets(kv_lengths, offsets_dtype)
    else:
        if kv_lengths is None:
            kv_lengths = random_lengths(max(1, (num_segments + 1) // 2), max_len, generator)
        kv_lengths = list(kv_lengths)
        kv_offsets = lengths_to_offsets(kv_lengths, offsets_dtype)
        if not kv_lengths and num_segments:
            raise ValueError("`kv_lengths` must name at least one kv segment for a non-empty `shared_kv` batch")
        index = torch.randint(0, max(1, len(kv_lengths)), (num_segments,), generator=generator)
        if num_segments >= 2:
            index[1] = index[0]  # at least two query segments share one kv segment
        kv_index = index.to(offsets_dtype)
    if layout == "self_targets":
        targets = [int(torch.randint(0, n + 1, (), generator=generator)) for n in q_lengths]
        if num_segments >= 2:  # the edges: no target, and a segment made only of targets
            targets[0], targets[-1] = 0, q_lengths[-1]
        num_targets = torch.tensor(targets, dtype=offsets_dtype)
    total_q, total_k = sum(q_lengths), sum(kv_lengths)

    def randn(rows: int, width: int) -> Tensor:
        return torch.randn(rows, heads, width, generator=generator, dtype=torch.float64).to(dtype)

    q = randn(total_q, dim)
    k, v = randn(total_k, dim), randn(total_k, dim_v)  # total_k == total_q for self-attention
    return GDPAInputs(
        q, k, v, lengths_to_offsets(q_lengths, offsets_dtype), kv_offsets, kv_index, num_targets, q_lengths, kv_lengths
    )
