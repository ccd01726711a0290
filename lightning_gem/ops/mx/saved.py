"""Saved activations stored in MXFP8: what autograd keeps for the backward, quantized as it is saved.

Inside :class:`QuantizedSavedTensors` every tensor an op saves for its backward that is an activation (a
floating-point tensor of at least ``min_elements`` elements and two dims, the last a multiple of 32) is
stored as FP8 E4M3 codes with one E8M0 scale per 32 values along its last dim (``mx`` layout, RCEIL: no
value saturates) and dequantized to its dtype when the backward reads it: a bf16 activation then takes
``1 + 1/32`` bytes an element instead of 2, an fp32 one instead of 4. Stay exact: parameters and their
casts (a leaf tensor or a cast of one), small tensors, integer and boolean tensors, and what a kit op marks
with :func:`save_exact` (GDPA's softmax output and log-sum-exp, whose backward differences them). What an op
marks with :func:`save_derived` (``silu_split``'s parts, each a function of its saved input) is not stored at all:
its saving op gets it back recomputed from the source's saved copy, one recompute for all the parts.

The hooks chain to whatever hooks were active when the context was entered (an activation-checkpointing
region, a memory profiler): those see the FP8 codes and scales instead of the activation, so a quantized
region counts at its quantized size. A tensor saved twice in one region (by two ops) is quantized once, and
dequantized once when the backward reads it (kept until its last read).

Example:
    >>> import torch
    >>> x = torch.randn(64, 128, requires_grad=True)
    >>> with QuantizedSavedTensors(min_elements=0) as saved:
    ...     y = (x * 2).sin()
    >>> y.sum().backward()
    >>> saved.stats.tensors, saved.stats.bytes_in, saved.stats.bytes_out
    (1, 32768, 8448)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_gem.ops.mx.formats import QuantizedTensor

__all__ = ["QuantizedSavedTensors", "SavedTensorStats", "save_derived", "save_exact", "saves_quantized"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXACT: dict[int, weakref.ref] = {}  # id -> tensor marked by save_exact (not a WeakSet: a tensor's == is elementwise)
_DERIVED: dict[int, tuple[weakref.ref, int, _Derivation, int]] = {}  # part's storage address -> (part, its version,
# derivation, index)
_ACTIVE: list[QuantizedSavedTensors] = []  # the open contexts, innermost last: save_exact and save_derived are free
# while there are none


def save_exact(*tensors: Tensor | None) -> None:
    """Keep ``tensors`` exact when they are saved inside a :class:`QuantizedSavedTensors` context (a no-op outside
    one). Ops call this on what their backward cannot take rounded, before they save it."""
    if _ACTIVE and not torch.compiler.is_compiling():
        for t in tensors:
            if t is not None and not _is_exact(t):
                key = id(t)
                _EXACT[key] = weakref.ref(t, lambda _ref, key=key: _EXACT.pop(key, None))


def save_derived(parts: Sequence[Tensor], source: Tensor, recompute: Callable[[Tensor], Sequence[Tensor]]) -> None:
    """Inside a :class:`QuantizedSavedTensors` context (a no-op outside one): ``parts`` (each with a storage of its
    own) are ``recompute(source)``, a cheap function of ``source``. A part saved in the context (or a view of its
    storage) is stored as a reference to ``source``'s saved copy, and the backward's first read of any of them
    recomputes all of them from it (without grad), kept until each saved part was read. ``source`` must not change in
    place before it is saved; a changed one (or part) is saved as it is."""
    if not _ACTIVE or torch.compiler.is_compiling():
        return
    derivation = _Derivation(source, recompute)
    for index, part in enumerate(parts):
        key = part.untyped_storage().data_ptr()
        if key:  # an empty part has no storage of its own
            ref = weakref.ref(part, lambda _ref, key=key: _DERIVED.pop(key, None))
            _DERIVED[key] = (ref, part._version, derivation, index)


def saves_quantized(t: Tensor) -> QuantizedSavedTensors | None:
    """The open context that would store ``t`` in MXFP8 (RCEIL blocks of 32 along its last dim) if an op saved it
    now, or None: the innermost saved-tensor hooks are that context's and ``t`` is an activation it quantizes. An op
    that writes ``t``'s MX copy itself, from a read it makes anyway, saves the copy instead (codes and scales are
    stored as they are) and reports it with :meth:`QuantizedSavedTensors.stored_as`."""
    if not _ACTIVE or torch.compiler.is_compiling():
        return None
    context = _ACTIVE[-1]
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    top = top_hooks(False) if top_hooks is not None else None
    if top is None or top[0] is not context.pack_hook or context.rounding != "rceil" or not context._eligible(t):
        return None
    return context


def _is_exact(t: Tensor) -> bool:
    ref = _EXACT.get(id(t))
    return ref is not None and ref() is t


@dataclasses.dataclass
class SavedTensorStats:
    """What a context quantized, summed over every time it was entered (reset with :meth:`reset`)."""

    tensors: int = 0
    """Saved tensors stored in FP8."""
    bytes_in: int = 0
    """Their bytes in their own dtype."""
    bytes_out: int = 0
    """Their bytes as FP8 codes and scales."""
    recomputed: int = 0
    """Saved tensors stored as a reference to the source they are recomputed from (:func:`save_derived`)."""
    bytes_recomputed: int = 0
    """Their bytes in their own dtype (none stored)."""

    def reset(self) -> None:
        self.tensors = self.bytes_in = self.bytes_out = self.recomputed = self.bytes_recomputed = 0


class _Outer:
    """A tensor the outer hooks packed (unquantized), with their unpack."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], Tensor]) -> None:
        self.packed, self.unpack = packed, unpack


class _Quantized:
    """An activation's FP8 codes and E8M0 scales (each as the outer hooks packed it), its shape and dtype, and how
    many saves of it are still to be read: the first read dequantizes, and the others until the last take the same
    tensor."""

    __slots__ = ("codes", "scales", "shape", "dtype", "unpack", "pending", "restored")

    def __init__(self, codes: Any, scales: Any, shape: torch.Size, dtype: torch.dtype, unpack: Any) -> None:
        self.codes, self.scales, self.shape, self.dtype, self.unpack = codes, scales, shape, dtype, unpack
        self.pending = 0
        self.restored: Tensor | None = None

    def restore(self) -> Tensor:
        from lightning_gem.ops.mx.api import dequantize

        if self.unpack is not None:  # once: a tensor saved twice shares this object, and outer hooks unpack once
            self.codes, self.scales, self.unpack = self.unpack(self.codes), self.unpack(self.scales), None
        restored = self.restored
        if restored is None:
            restored = dequantize(QuantizedTensor(self.codes, self.scales, "mx"), self.dtype).view(self.shape)
        self.pending -= 1  # below zero only when a retained graph is read again: each read dequantizes then
        self.restored = restored if self.pending > 0 else None
        return restored


class _Derivation:
    """Parts that ``recompute(source)`` gives back: the source (until the context saves it), its saved copy, and
    the recomputed parts while saved ones are still to be read."""

    __slots__ = ("source", "version", "recompute", "packed", "parts", "pending", "counted")

    def __init__(self, source: Tensor, recompute: Callable[[Tensor], Sequence[Tensor]]) -> None:
        self.source: Tensor | None = source
        self.version = source._version
        self.recompute = recompute
        self.packed: Any = None
        self.parts: tuple[Tensor, ...] | None = None
        self.pending = 0
        self.counted: set[tuple] = set()

    def part(self, index: int, first: bool) -> Tensor:
        parts = self.parts
        if parts is None:
            with torch.no_grad():
                parts = tuple(self.recompute(QuantizedSavedTensors._unpack(self.packed)))
            self.parts = parts
        if first:
            self.pending -= 1
            if self.pending == 0:  # every saved part was read: a later read (retain_graph) recomputes
                self.parts = None
        return parts[index]


class _Derived:
    """A saved part of a :class:`_Derivation`: which part, and the view of its storage that was saved."""

    __slots__ = ("derivation", "index", "shape", "stride", "offset", "read")

    def __init__(self, derivation: _Derivation, index: int, t: Tensor) -> None:
        self.derivation, self.index, self.read = derivation, index, False
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()

    def restore(self) -> Tensor:
        part = self.derivation.part(self.index, not self.read)
        self.read = True
        return part.as_strided(self.shape, self.stride, self.offset)


_CAST_OR_VIEW = frozenset(("ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0"))


def _is_parameter_or_cast(t: Tensor) -> bool:
    """A leaf that requires grad (a parameter), or dtype casts and views of one (autocast's copy of a weight, and its
    transpose, which ``F.linear`` saves)."""
    fn = t.grad_fn
    if fn is None:
        return t.requires_grad
    while type(fn).__name__ in _CAST_OR_VIEW and fn.next_functions:
        fn = fn.next_functions[0][0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


class QuantizedSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Store the activations saved for backward inside the context in MXFP8 (module docstring).

    Args:
        min_elements: tensors with fewer elements stay exact (their FP8 copy would save little and cost a launch).
        rounding: block exponent rule, ``"rceil"`` (default: nothing saturates) or ``"floor"``.
        stats: a :class:`SavedTensorStats` to add to (default: a new one, as ``.stats``).

    The context may be entered again (one instance per module call is the usual use: see
    :func:`lightning_gem.precision.convert`), but not while it is open.
    """

    def __init__(self, *, min_elements: int = 1 << 14, rounding: str = "rceil", stats: SavedTensorStats | None = None):
        if min_elements < 0:
            raise ValueError(f"`min_elements` must be >= 0, got {min_elements}")
        if rounding not in ("rceil", "floor"):
            raise ValueError(f"`rounding` must be 'rceil' or 'floor', got {rounding!r}")
        self.min_elements = min_elements
        self.rounding = rounding
        self.stats = stats if stats is not None else SavedTensorStats()
        self._outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None = None
        self._seen: dict[tuple, tuple[StorageWeakRef, _Quantized]] = {}
        self._open = False
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> QuantizedSavedTensors:
        if self._open:
            raise RuntimeError("this QuantizedSavedTensors context is already open; enter a new instance")
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self._outer = top(False) if top is not None else None
        super().__enter__()
        self._open = True
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        self._open = False
        self._seen.clear()
        self._outer = None
        super().__exit__(*exc)

    def stored_as(self, t: Tensor, codes: Tensor, scales: Tensor) -> None:
        """``t`` is stored by an op as its MX copy ``codes [..., C], scales [..., C / 32]`` (see
        :func:`saves_quantized`): count it, and let another save of ``t`` in this context take that copy (where no
        outer hooks are chained: those see what each save stores)."""
        if self._outer is None:
            width = t.shape[-1]
            packed = _Quantized(codes.view(-1, width), scales.view(-1, width // 32), t.shape, t.dtype, None)
            storage = t.untyped_storage()
            self._seen[self._key(t, storage)] = (StorageWeakRef(storage), packed)
        self.stats.tensors += 1
        self.stats.bytes_in += t.numel() * t.element_size()
        self.stats.bytes_out += codes.numel() * codes.element_size() + scales.numel() * scales.element_size()

    @staticmethod
    def _key(t: Tensor, storage: torch.UntypedStorage) -> tuple:
        """What identifies a saved tensor's value in :attr:`_seen` (``storage``: ``t``'s)."""
        return (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)

    def _eligible(self, t: Tensor) -> bool:
        return (
            type(t) is Tensor
            and t.dtype in _FLOAT_DTYPES
            and t.ndim >= 2
            and t.shape[-1] % 32 == 0
            and t.numel() >= max(self.min_elements, 1)
            and t.device.type in ("cuda", "cpu")
            and not _is_parameter_or_cast(t)
            and not _is_exact(t)
        )

    def _pack(self, t: Tensor) -> Any:
        outer = self._outer
        if torch.compiler.is_compiling():
            return t if outer is None else _Outer(outer[0](t), outer[1])
        derived = self._pack_derived(t)
        if derived is not None:
            return derived
        if not self._eligible(t):
            return t if outer is None else _Outer(outer[0](t), outer[1])
        storage = t.untyped_storage()
        key = self._key(t, storage)
        seen = self._seen.get(key)
        if seen is not None and not seen[0].expired():  # the same tensor again (a freed one's address: expired)
            seen[1].pending += 1
            return seen[1]
        from lightning_gem.ops.mx.api import quantize

        q, _ = quantize(t.detach().reshape(-1, t.shape[-1]), "mx", rounding=self.rounding)
        codes, scales = q.data, q.scale
        if outer is not None:
            codes, scales = outer[0](codes), outer[0](scales)
        packed = _Quantized(codes, scales, t.shape, t.dtype, None if outer is None else outer[1])
        packed.pending = 1
        self._seen[key] = (StorageWeakRef(storage), packed)
        self.stats.tensors += 1
        self.stats.bytes_in += t.numel() * t.element_size()
        self.stats.bytes_out += q.data.numel() + q.scale.numel()
        return packed

    def _pack_derived(self, t: Tensor) -> _Derived | None:
        """``t`` as a reference to its derivation's source (:func:`save_derived`), or None if it is not a part of
        one, or it or its source changed in place since."""
        if not _DERIVED or type(t) is not Tensor:
            return None
        entry = _DERIVED.get(t.untyped_storage().data_ptr() or -1)
        if entry is None or entry[0]() is None or t._version != entry[1]:  # a live part holds its storage's address
            return None
        _, _, derivation, index = entry
        if derivation.packed is None:
            source = derivation.source
            if source is None or source._version != derivation.version:
                return None
            derivation.packed, derivation.source = self._pack(source), None
        derivation.pending += 1
        view = (index, t.storage_offset(), tuple(t.shape), t.stride())
        if view not in derivation.counted:  # a view saved twice counts once, as a quantized tensor does
            derivation.counted.add(view)
            self.stats.recomputed += 1
            self.stats.bytes_recomputed += t.numel() * t.element_size()
        return _Derived(derivation, index, t)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, _Derived):
            return packed.restore()
        if isinstance(packed, _Quantized):
            return packed.restore()
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        return packed
