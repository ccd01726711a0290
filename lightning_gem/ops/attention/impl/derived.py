"""Tensors the attention launchers derive from a call's offsets, kept while those offsets live unchanged.

Every layer of a step takes the same offsets, forward and backward; what is made from them (int32 copies, block
offsets, the segments' order by length, the longest segment where no length hint was passed) is then made once a step
instead of twice a layer (each is a launch or a few, host time in small calls; the longest segment a device sync).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from lightning_gem.jagged import max_length_hint
from lightning_gem.ops._launch import plain_eager

__all__ = ["longest_segment", "made_from", "segments_by_length"]

T = TypeVar("T")

_MADE: dict[int, tuple[weakref.ref, int, dict]] = {}


def made_from(offsets: Tensor, what: tuple, make: Callable[[], T]) -> T:
    """``make()``, remembered for ``(offsets, what)`` until ``offsets`` is freed or modified in place (its version
    counter moves); not remembered while a CUDA graph is captured (the tensor would live in the graph's pool) nor
    where a compiler or dispatch mode sees the call (its tensors belong to that trace). Keyed by the tensor's id with
    a weak reference to it (tensors compare elementwise, so they key no dict)."""
    if (offsets.is_cuda and torch.cuda.is_current_stream_capturing()) or not plain_eager((offsets,)):
        return make()
    key, version = id(offsets), offsets._version
    entry = _MADE.get(key)
    if entry is None or entry[0]() is not offsets or entry[1] != version:
        entry = _MADE[key] = (weakref.ref(offsets, lambda _, key=key: _MADE.pop(key, None)), version, {})
    made = entry[2].get(what)
    if made is None:
        made = entry[2][what] = make()
    return made


def segments_by_length(offsets: Tensor) -> Tensor:
    """The segments of ``offsets [B + 1]``, longest first (ties in order), as int32 ``[B]`` indices on its device;
    made without a device sync, once per offsets tensor (:func:`made_from`)."""

    def make() -> Tensor:
        lengths = offsets[1:] - offsets[:-1]
        return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)

    return made_from(offsets, ("by length",), make)


def longest_segment(offsets: Tensor, num_rows: int) -> int:
    """:func:`lightning_gem.jagged.max_length_hint` of ``offsets`` (a device sync in eager mode), read once per offsets
    tensor (:func:`made_from`): layers that all take a step's offsets without a length hint sync once a step, not once
    a call."""
    return made_from(offsets, ("longest", num_rows), lambda: max_length_hint(offsets, num_rows))
