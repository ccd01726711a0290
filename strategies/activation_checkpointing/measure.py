"""Measurements behind the activation-checkpointing planner: one training step's memory, per candidate block.

:func:`measure_step_memory` gives a step's peak (CUDA: the caching allocator's statistics, everything
resident; CPU: the bytes the step's own ops allocate and still hold, tracked through a dispatch mode).
``_measure_timeline`` splits that peak where backward finishes each candidate block; ``_Profile``
records, per candidate, the bytes its forward saves for backward, the part checkpointing frees, and its
forward FLOPs, as :class:`CandidateStats`. :mod:`~lightning_gem.strategies.activation_checkpointing.planner`
plans from them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["CandidateStats", "StepMemory", "measure_step_memory"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CandidateStats:
    """What one candidate block costs and saves in a measured step."""

    name: str
    """Submodule name (as in ``named_modules``)."""
    saved_bytes: int
    """Bytes its forward saves for backward (its inputs, parameters and buffers excluded): what backward
    rematerialises when the block is checkpointed."""
    freed_bytes: int
    """Of ``saved_bytes``, the bytes checkpointing frees (storages nothing outside the block also holds)."""
    backward_peak: int
    """Measured peak of the unconstrained step while backward runs through this candidate (for the first
    one backward reaches, from the forward of the first candidate on: the activations' peak)."""
    forward_flops: int
    """FLOPs of its forward, the recompute cost (``FlopCounterMode``)."""
    forward_seconds: float | None = None
    """Measured forward time (only with ``cost="time"``)."""


class StepMemory(NamedTuple):
    """Memory of one measured step (bytes)."""

    peak: int
    """CUDA: ``max_memory_allocated`` over the step; CPU: the peak of the step's own allocations."""
    baseline: int
    """CUDA: memory allocated when the step started; CPU: 0."""


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


class _Meter:
    """Peak memory of a step on ``device``, readable piecewise: :meth:`split` returns the peak since the last split."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.live = None if self.cuda else _LiveBytes()
        self.baseline = 0

    def __enter__(self) -> _Meter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        else:
            self.live.__exit__(*exc)

    def split(self) -> int:
        if self.cuda:  # the caching allocator counts on the host, in stream order: no sync needed
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        peak, self.live.peak = self.live.peak, self.live.sweep()
        return peak


def measure_step_memory(run_step: Callable[[], Any], device: torch.device | str | None = None) -> StepMemory:
    """Run ``run_step`` once and measure its peak memory on ``device`` (default: CUDA if available).

    On CUDA this is the allocator's peak over the step; on other devices the peak of the bytes that the
    step's ops allocate and still hold (see the module docstring).
    """
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    with _Meter(device) as meter:
        run_step()
    return StepMemory(meter.split(), meter.baseline)


class _Timeline(NamedTuple):
    memory: StepMemory
    outside_peak: int  # before the first candidate's forward and after the last candidate's backward
    release_order: list[str]  # candidates as backward releases their activations (never released: last)
    backward_peaks: dict[str, int]  # the peak while backward runs through each candidate (see below)


def _measure_timeline(
    module: nn.Module, names: Sequence[str], run_step: Callable[[], Any], device: torch.device
) -> _Timeline:
    """The step's peak memory, split where backward finishes each candidate.

    A candidate's backward is finished when the gradient of its inputs is ready (a multi-grad hook on
    them). The peak between two such events is the peak while backward runs through the later one; the
    first segment also holds the forward from the first candidate on (the activations' peak). Before
    the first candidate's forward and after the last candidate's backward (embeddings, the optimizer
    step) lies the part that checkpointing does not change. Candidates whose inputs need no gradient
    never report: they share the segment that runs to the end of the step.
    """
    state: dict[str, Any] = {"open": False}
    outside: list[int] = []
    events: list[tuple[str, int]] = []
    hooks: list[Any] = []
    started: set[str] = set()

    def released(name: str) -> Callable[[Tensor], None]:
        def hook(_grad: Tensor) -> None:
            events.append((name, meter.split()))

        return hook

    def forward_pre(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            if name in started or not any(t.is_floating_point() for t in tensors):
                return  # candidates fed by ids only (embedding lookups) are dropped later
            started.add(name)
            if not state["open"]:
                state["open"] = True
                outside.append(meter.split())
            needs_grad = [t for t in tensors if t.requires_grad]
            if needs_grad:
                hooks.append(torch.autograd.graph.register_multi_grad_hook(needs_grad, released(name), mode="any"))

        return hook

    handles = [module.get_submodule(n).register_forward_pre_hook(forward_pre(n), with_kwargs=True) for n in names]
    try:
        with _Meter(device) as meter:
            run_step()
        tail = meter.split()
    finally:
        for handle in handles + hooks:
            handle.remove()
    order = [name for name, _ in events]
    silent = [name for name in names if name in started and name not in order]
    peaks = {name: peak for name, peak in events}
    if silent:
        peaks.update(dict.fromkeys(silent, tail))
    else:
        outside.append(tail)
    peak = max([*outside, *peaks.values()])
    return _Timeline(StepMemory(peak, meter.baseline), max(outside, default=0), order + silent, peaks)


def _storages(t: Tensor) -> list[Any]:
    """The untyped storages behind ``t`` (several for a wrapper subclass such as DTensor)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    if t.device.type == "meta":
        return []
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return []
    return [storage] if storage.nbytes() else []


def _key(storage: Any) -> tuple[str, int]:
    return (storage.device.type, storage.data_ptr())


class _LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by storages that ops create while the mode is active (any device).

    ``current`` counts storages until a sweep finds them freed; sweeps run only when ``current`` exceeds
    the peak, so the peak is exact and the cost stays near one sweep per new high.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def sweep(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                for storage in _storages(t):
                    key = _key(storage)
                    known = self.live.get(key)
                    if known is None or known[0].expired():  # new, or a freed storage's address reused
                        self.current += storage.nbytes() - (0 if known is None else known[1])
                        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        if self.current > self.peak:
            self.peak = max(self.peak, self.sweep())
        return out


class _Profile:
    """Per-candidate saved bytes, freed bytes and forward FLOPs of one step (see the module docstring)."""

    def __init__(self, module: nn.Module, names: list[str]) -> None:
        self.names = names
        self.subs = {name: module.get_submodule(name) for name in names}
        self.static = {_key(s) for t in (*module.parameters(), *module.buffers()) for s in _storages(t)}
        self.stack: list[str] = []
        self.order: dict[str, int] = {}
        self.float_input: set[str] = set()
        self.inputs: dict[tuple[str, int], tuple[StorageWeakRef, set[str]]] = {}
        self.owners: dict[tuple[str, int], set[str | None]] = {}
        self.nbytes: dict[tuple[str, int], int] = {}
        self.pinned: set[tuple[str, int]] = set()
        self.flops = dict.fromkeys(names, 0)
        self._flops_at: dict[str, int] = {}
        self.counter = FlopCounterMode(display=False)

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.order.setdefault(name, len(self.order))
            for t in tree_leaves((args, kwargs)):
                if not isinstance(t, Tensor):
                    continue
                if t.is_floating_point():
                    self.float_input.add(name)
                for storage in _storages(t):
                    key = _key(storage)
                    if key in self.owners:  # saved earlier, now also a block input: checkpointing keeps it
                        self.pinned.add(key)
                    entry = self.inputs.get(key)
                    if entry is None or entry[0].expired():
                        entry = self.inputs[key] = (StorageWeakRef(storage), set())
                    entry[1].add(name)
            self.stack.append(name)
            self._flops_at[name] = self.counter.get_total_flops()

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple, _output: Any) -> None:
            assert self.stack and self.stack[-1] == name, "candidate hooks out of order"
            self.stack.pop()
            self.flops[name] += self.counter.get_total_flops() - self._flops_at.pop(name)

        return hook

    def _pack(self, t: Tensor) -> Tensor:
        owner = self.stack[-1] if self.stack else None
        for storage in _storages(t):
            key = _key(storage)
            if key in self.static:
                continue
            entry = self.inputs.get(key)
            if entry is not None and not entry[0].expired():
                if owner in entry[1]:
                    continue  # the block's own input: its checkpoint keeps it
                self.pinned.add(key)  # another block's input
            self.owners.setdefault(key, set()).add(owner)
            self.nbytes[key] = storage.nbytes()
        return t

    def run(self, run_step: Callable[[], Any]) -> None:
        handles = []
        try:
            for name, sub in self.subs.items():
                handles.append(sub.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                handles.append(sub.register_forward_hook(self._post(name), always_call=True))
            with self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                run_step()
        finally:
            for handle in handles:
                handle.remove()

    def stats(self, name: str, backward_peak: int, seconds: float | None) -> CandidateStats:
        saved = freed = 0
        for key, owners in self.owners.items():
            if name in owners:
                saved += self.nbytes[key]
                if len(owners) == 1 and key not in self.pinned:
                    freed += self.nbytes[key]
        return CandidateStats(
            name=name,
            saved_bytes=saved,
            freed_bytes=freed,
            backward_peak=backward_peak,
            forward_flops=self.flops[name],
            forward_seconds=seconds,
        )


def _forward_seconds(module: nn.Module, names: list[str], run_step: Callable[[], Any]) -> dict[str, float]:
    device = _device_of(module)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start: dict[str, float] = {}
    seconds = dict.fromkeys(names, 0.0)
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sync()
            start[name] = time.perf_counter()

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sync()
            seconds[name] += time.perf_counter() - start.pop(name)

        return hook

    try:
        for name in names:
            sub = module.get_submodule(name)
            handles += [sub.register_forward_pre_hook(pre(name)), sub.register_forward_hook(post(name))]
        run_step()
    finally:
        for handle in handles:
            handle.remove()
    return seconds
