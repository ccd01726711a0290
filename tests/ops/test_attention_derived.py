"""What the attention launchers derive from a call's offsets, and how long they keep it."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_gem.ops.attention.impl.derived import made_from, segments_by_length


def test_segments_by_length_longest_first_ties_in_order() -> None:
    offsets = torch.tensor([0, 4, 4, 9, 13, 14, 19])  # lengths 4, 0, 5, 4, 1, 5
    order = segments_by_length(offsets)
    assert order.dtype == torch.int32
    assert order.tolist() == [2, 5, 0, 3, 4, 1]
    assert segments_by_length(torch.tensor([0, 7])).tolist() == [0]


def test_made_once_per_offsets_until_changed_in_place() -> None:
    offsets = torch.tensor([0, 2, 7, 8])
    calls = []

    def make() -> torch.Tensor:
        calls.append(1)
        return offsets.flip(0)

    first = made_from(offsets, ("test",), make)
    assert made_from(offsets, ("test",), make) is first and len(calls) == 1
    assert segments_by_length(offsets) is segments_by_length(offsets)
    offsets[1] = 1  # in place: the version counter moves, everything made from it is made again
    again = made_from(offsets, ("test",), make)
    assert again is not first and len(calls) == 2
    assert segments_by_length(offsets).tolist() == [1, 0, 2]
    # An equal but distinct tensor is another key.
    assert made_from(offsets.clone(), ("test",), make) is not again and len(calls) == 3


def test_not_kept_where_a_dispatch_mode_sees_the_call() -> None:
    offsets = torch.tensor([0, 3, 5])
    calls = []

    def make() -> torch.Tensor:
        calls.append(1)
        return offsets + 1

    with FlopCounterMode(display=False):
        made_from(offsets, ("traced",), make)
        made_from(offsets, ("traced",), make)
    assert len(calls) == 2
