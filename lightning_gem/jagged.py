"""Jagged (values, offsets) helpers: the one place offsets are validated and converted.

A jagged batch of ``B`` sequences is a ``values`` tensor of shape ``[T, ...]`` whose rows are the
concatenated sequences, and an ``offsets`` tensor of shape ``[B + 1]`` with ``offsets[0] == 0``,
non-decreasing entries and ``offsets[-1] == T``, exactly as torchrec's ``JaggedTensor`` and fbgemm's
jagged ops use it. Sequence ``b`` is ``values[offsets[b]:offsets[b + 1]]``.

Validation reads the offsets' values, which synchronises with the device; hot paths call it once per
batch (or pass ``check_values=False`` after the batch has been checked upstream).

Example:
    >>> import torch
    >>> from lightning_gem import jagged
    >>> offsets = jagged.lengths_to_offsets(torch.tensor([2, 0, 3]))
    >>> offsets.tolist()
    [0, 2, 2, 5]
    >>> padded, mask = jagged.to_padded(torch.arange(5.0), offsets)
    >>> padded.tolist()
    [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 3.0, 4.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "INDEX_DTYPES",
    "check_device",
    "check_floating",
    "check_ids",
    "lengths_to_offsets",
    "max_length",
    "max_length_hint",
    "offsets_to_lengths",
    "segment_ids",
    "segment_positions",
    "from_padded",
    "to_padded",
    "validate_lengths",
    "validate_offsets",
    "validate_offsets_together",
]

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index_tensor(tensor: object, name: str) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of int32 or int64, got {type(tensor).__name__}")
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"`{name}` must have dtype int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


def validate_offsets(
    offsets: Tensor,
    name: str = "offsets",
    *,
    num_values: int | None = None,
    device: torch.device | str | None = None,
    check_values: bool = True,
) -> Tensor:
    """Check that ``offsets`` is a valid ``[B + 1]`` offsets tensor and return it unchanged.

    Args:
        offsets: ``[B + 1]`` int32/int64 tensor.
        name: the argument's name, used in error messages.
        num_values: if given, ``offsets[-1]`` must equal it (the number of rows of the values).
        device: if given, ``offsets`` must live on this device.
        check_values: read the values (a device sync) to check start, order and end.

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 1-D, empty, wrong device, ``offsets[0] != 0``, decreasing entries or
            ``offsets[-1] != num_values``.
    """
    _check_index_tensor(offsets, name)
    if offsets.numel() == 0:
        raise ValueError(f"`{name}` must have at least one entry (offsets of B sequences have B + 1), got none")
    if device is not None:
        check_device(offsets, name, torch.device(device))
    if not check_values:
        return offsets
    # One device sync for the common (valid) case: the three checks read back together.
    bad_start = offsets[0] != 0
    bad_order = (offsets[1:] < offsets[:-1]).any() if offsets.numel() > 1 else torch.zeros((), dtype=torch.bool)
    bad_end = offsets[-1] != num_values if num_values is not None else torch.zeros((), dtype=torch.bool)
    if not bool(torch.stack([bad_start, bad_order.to(bad_start.device), bad_end.to(bad_start.device)]).any()):
        return offsets
    first = int(offsets[0])
    if first != 0:
        raise ValueError(f"`{name}` must start at 0, got offsets[0] = {first}")
    if offsets.numel() > 1:
        steps = offsets[1:] - offsets[:-1]
        if bool((steps < 0).any()):
            where = int(torch.nonzero(steps < 0)[0])
            raise ValueError(
                f"`{name}` must be non-decreasing, got offsets[{where}] = {int(offsets[where])} > "
                f"offsets[{where + 1}] = {int(offsets[where + 1])}"
            )
    if num_values is not None:
        last = int(offsets[-1])
        if last != num_values:
            raise ValueError(f"`{name}` must end at the number of values {num_values}, got offsets[-1] = {last}")
    return offsets


def validate_offsets_together(checks: Sequence[tuple[Tensor, str, int | None, int | None]]) -> list[int]:
    """Validate several offsets tensors of one batch with a single device sync; return their longest sequences.

    Each check is ``(offsets, name, num_values, max_len)``: the :func:`validate_offsets` rules (with
    ``num_values`` if not None) and, if ``max_len`` is not None, no sequence longer than ``max_len`` (a
    kernel's length hint). A model calls this once per batch, then passes ``check_offsets=False`` and the
    returned lengths (exact kernel hints, read in the same sync) on.

    Returns:
        The longest sequence of each checked offsets tensor, in order (0 for no sequence).

    Raises:
        TypeError, ValueError: as :func:`validate_offsets` (naming the offending tensor), or a sequence
            longer than its ``max_len``.
    """
    flags: list[Tensor] = []
    longest: list[Tensor] = []
    for offsets, name, num_values, max_len in checks:
        validate_offsets(offsets, name, check_values=False)  # dtype, shape, non-empty: no read
        flags.append(offsets[0] != 0)
        steps = offsets_to_lengths(offsets)
        longest.append(steps.max() if steps.numel() else offsets.new_zeros(()))
        if steps.numel():
            flags.append((steps < 0).any())
            if max_len is not None:
                flags.append(longest[-1] > max_len)
        if num_values is not None:
            flags.append(offsets[-1] != num_values)
    if not checks:
        return []
    device = checks[0][0].device
    values = torch.stack([t.to(device=device, dtype=torch.int64) for t in (*flags, *longest)]).tolist()
    if not any(values[: len(flags)]):
        return values[len(flags) :]
    for offsets, name, num_values, max_len in checks:  # something is wrong: find it and say what
        validate_offsets(offsets, name, num_values=num_values)
        found = max_length(offsets)
        if max_len is not None and found > max_len:
            raise ValueError(f"`{name}` holds a sequence of {found}, longer than the maximum length {max_len}")
    return values[len(flags) :]  # a flag was set, so one of the checks above raised: not reached


def validate_lengths(lengths: Tensor, name: str = "lengths") -> Tensor:
    """Check that ``lengths`` is a 1-D int32/int64 tensor of non-negative entries and return it."""
    _check_index_tensor(lengths, name)
    if lengths.numel() and bool((lengths < 0).any()):
        where = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"`{name}` must be non-negative, got {name}[{where}] = {int(lengths[where])}")
    return lengths


def lengths_to_offsets(lengths: Tensor) -> Tensor:
    """``[B]`` lengths to ``[B + 1]`` int64 offsets (``offsets[0] = 0``)."""
    validate_lengths(lengths)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def offsets_to_lengths(offsets: Tensor) -> Tensor:
    """``[B + 1]`` offsets to ``[B]`` lengths, in the offsets' dtype."""
    _check_index_tensor(offsets, "offsets")
    return offsets[1:] - offsets[:-1]


def max_length(offsets: Tensor) -> int:
    """The longest sequence's length (0 for an empty batch). Reads the values: a device sync."""
    if offsets.numel() <= 1:
        return 0
    return int((offsets[1:] - offsets[:-1]).max())


def max_length_hint(offsets: Tensor, num_rows: int) -> int:
    """A bound on the longest sequence for sizing a launch: :func:`max_length` in eager (a device sync), the row
    count ``num_rows`` under ``torch.compile`` (no sync; correct, but larger than needed)."""
    if torch.compiler.is_compiling() or offsets.shape[0] < 2:
        return num_rows
    return int((offsets[1:] - offsets[:-1]).max())


def segment_ids(offsets: Tensor, num_values: int | None = None) -> Tensor:
    """``[T]`` int64 index of the sequence each value belongs to."""
    lengths = offsets_to_lengths(offsets).to(torch.int64)
    total = int(offsets[-1]) if num_values is None else num_values
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def segment_positions(offsets: Tensor, num_values: int | None = None) -> tuple[Tensor, Tensor]:
    """``([T] segment of each value, [T] its position within that segment)``, int64 (see :func:`segment_ids`)."""
    segment = segment_ids(offsets, num_values)
    position = torch.arange(segment.numel(), device=offsets.device) - offsets[:-1].to(torch.int64)[segment]
    return segment, position


def check_device(tensor: Tensor, name: str, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``tensor`` is on ``device`` (index-insensitive for a bare ``cuda``)."""
    if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
        raise ValueError(f"`{name}` must be on {device}, got {tensor.device}")


def check_floating(tensor: object, name: str) -> Tensor:
    """Raise ``TypeError`` unless ``tensor`` is a floating-point tensor."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {tensor.dtype}")
    return tensor


def check_ids(ids: Tensor, num_embeddings: int, name: str = "ids") -> Tensor:
    """Check that ``ids`` are integer ids in ``[0, num_embeddings)`` and return them.

    Raises:
        TypeError: not an integer tensor.
        ValueError: an id below 0 or at/above ``num_embeddings``.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of int32 or int64, got {type(ids).__name__}")
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"`{name}` must have dtype int32 or int64, got {ids.dtype}")
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_embeddings:
            bad = low if low < 0 else high
            raise ValueError(
                f"`{name}` must lie in [0, {num_embeddings}) (num_embeddings = {num_embeddings}), got {bad}"
            )
    return ids


def to_padded(
    values: Tensor, offsets: Tensor, max_len: int | None = None, padding_value: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Jagged ``[T, ...]`` to padded ``[B, L, ...]`` plus a ``[B, L]`` bool mask of real positions.

    For references and baselines only: the kit's hot paths never pad. Sequences longer than
    ``max_len`` are truncated (their tail is dropped).
    """
    validate_offsets(offsets, num_values=values.shape[0], device=values.device)
    lengths = offsets_to_lengths(offsets).to(torch.int64)
    batch = lengths.numel()
    length = max_length(offsets) if max_len is None else max_len
    positions = torch.arange(length, device=values.device)
    mask = positions[None, :] < lengths[:, None]
    padded = values.new_full((batch, length, *values.shape[1:]), padding_value)
    index = offsets[:-1, None].to(torch.int64) + positions[None, :]
    padded[mask] = values[index[mask]]
    return padded, mask


def from_padded(padded: Tensor, offsets: Tensor) -> Tensor:
    """Padded ``[B, L, ...]`` back to jagged ``[T, ...]`` (the inverse of :func:`to_padded`)."""
    lengths = offsets_to_lengths(validate_offsets(offsets)).to(torch.int64)
    if lengths.numel() != padded.shape[0]:
        raise ValueError(f"`padded` must have {lengths.numel()} rows (one per sequence), got {padded.shape[0]}")
    if lengths.numel() and int(lengths.max()) > padded.shape[1]:
        raise ValueError(f"`padded` must be at least {int(lengths.max())} long in dim 1, got {padded.shape[1]}")
    mask = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
    return padded[mask]
