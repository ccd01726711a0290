"""The launch-shape tuner every op family's Triton kernels share: for a key, the fastest of a few candidates,
timed once on the call's own buffers and remembered in the caller's registry."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from lightning_gem.ops._launch import compile_only

__all__ = ["can_time", "measure", "pick_fastest"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def can_time(tensors: tuple[object, ...]) -> bool:
    """Whether candidates can be timed now: real CUDA tensors, no compiler tracing, no graph capture."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling():
        return False
    tensors = tuple(t for t in tensors if isinstance(t, torch.Tensor))
    if not all(type(t) is torch.Tensor and t.is_cuda and not is_fake(t) for t in tensors):
        return False
    return not torch.cuda.is_current_stream_capturing()


def _compile_all(candidates: list[T], run: Callable[[T], None]) -> None:
    """Compile every candidate at once on a thread pool (Triton's asynchronous compile mode: code generation
    and ``ptxas`` of one kernel overlap those of the others), instead of one after another as each is first run.
    A candidate that fails to compile is left to fail again, alone, when it is timed."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without it: candidates compile as they are first run
        return
    with ThreadPoolExecutor(max_workers=min(8, len(candidates))) as pool:
        with AsyncCompileMode(pool, ignore_errors=True), compile_only():
            for candidate in candidates:
                try:
                    run(candidate)
                except Exception:
                    continue


# The most runs one round of :func:`measure` times of a candidate.
MAX_REPS = 64


def measure(
    candidates: list[T], run: Callable[[T], None], *, rounds: int = 3, reps: int = 3, round_ms: float = 1.0
) -> dict[T, float]:
    """Milliseconds per run of each candidate: each runs once (compiling it) and once more between CUDA events,
    which sizes its rounds: at least ``reps`` runs, and about ``round_ms`` of them for a short one (up to
    :data:`MAX_REPS`), so a call of a few microseconds is timed over many runs rather than three. Then ``rounds``
    rounds take the candidates in turn and time each one's runs between CUDA events; a candidate's time is the median
    of its rounds (interleaving spreads clock and thermal drift over every candidate alike). One that fails to run
    (out of shared memory and kin) is left out."""
    sized: dict[T, int] = {}
    for candidate in candidates:
        try:
            run(candidate)
            torch.cuda.synchronize()
        except Exception:
            continue
        sized[candidate] = min(MAX_REPS, max(reps, math.ceil(round_ms / max(_time_runs(run, candidate, 1), 1e-3))))
    samples: dict[T, list[float]] = {c: [] for c in sized}
    for _ in range(rounds):
        for candidate, count in sized.items():
            samples[candidate].append(_time_runs(run, candidate, count))
    return {c: sorted(times)[len(times) // 2] for c, times in samples.items()}


def _time_runs(run: Callable[[T], None], candidate: T, count: int) -> float:
    """Milliseconds per run of ``count`` runs of ``candidate`` back to back, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        run(candidate)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / count


def pick_fastest(
    registry: dict[Hashable, T],
    key: Hashable,
    candidates: list[T],
    run: Callable[[T], None],
    tensors: tuple[object, ...],
    *,
    timing: bool = True,
    compile_first: bool = False,
    timings: dict[T, float] | None = None,
) -> T:
    """The candidate for ``key``: the one remembered in ``registry``, else (when ``timing`` and :func:`can_time`
    allow) the fastest by :func:`measure`, remembered; else the first, not remembered.

    ``run(candidate)`` launches the kernel with that candidate on the call's own buffers (kernels that only write
    their outputs, so running one several times is harmless). ``compile_first`` compiles them all at once on a
    thread pool beforehand. ``timings``, when given, receives the measured milliseconds of each candidate (only
    when they are timed now). A key holding symbolic sizes (tracing with dynamic shapes) can be neither looked up
    nor timed: the first candidate.
    """
    if len(candidates) == 1:
        return candidates[0]
    try:
        chosen = registry.get(key)
    except TypeError:  # an unhashable SymInt in the key
        return candidates[0]
    if chosen is not None:
        return chosen
    if not timing or not can_time(tensors):
        return candidates[0]
    if compile_first:
        _compile_all(candidates, run)
    measured = measure(candidates, run)
    best = min(measured, key=measured.__getitem__) if measured else candidates[0]
    if timings is not None:
        timings.update(measured)
    registry[key] = best
    log.debug("tuned %s: %s", key, best)
    return best
