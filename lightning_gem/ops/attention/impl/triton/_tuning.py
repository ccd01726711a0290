"""Tile shapes of the GDPA kernels: a few candidates per kernel and mode, and a tuner that times them once per key.

The key is what changes the best shape: the kernel, head dims, dtype, the mode's compile-time flags and the
length hints bucketed to powers of two. Lengths stay runtime values in the kernels, so a new batch with a
new longest sequence neither recompiles nor retunes unless it crosses a power of two.

The tuner compiles a key's candidates at once on a thread pool, then times them on the call's own inputs
(CUDA events, after one warm-up run), only for real CUDA tensors outside tracing and graph capture;
elsewhere, and before a key is tuned, the first candidate runs (a best guess).
``LIGHTNING_GEM_GDPA_TUNE=0`` in the environment turns timing off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
import triton

__all__ = [
    "BackwardTiles",
    "Tiles",
    "backward_candidates",
    "candidate_tiles",
    "chosen_tiles",
    "forget_choices",
    "length_bucket",
    "pick_tiles",
    "tile_meta",
]


T = TypeVar("T")


class Tiles(NamedTuple):
    """A kernel's launch shape: query rows and key rows per tile, warps per program, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2


class BackwardTiles(NamedTuple):
    """A backward launch: ``dkdv`` tiles the dK/dV programs (query rows x key rows, and the warps and stages of
    the launch); ``dq`` the dQ programs' query rows x key rows in the same launch, or None for dQ added through
    fp32 atomics by the dK/dV programs (not bitwise reproducible)."""

    dkdv: Tiles
    dq: Tiles | None = None


_CHOSEN: dict[tuple, Tiles | BackwardTiles] = {}


def length_bucket(length: int) -> int:
    """The power of two at or above ``length`` (16 at least): the tuner's key for a length hint."""
    return max(16, triton.next_power_of_2(max(int(length), 1)))


def _block_tiles(block_size: int | None) -> int | None:
    """The largest tile edge (<= 128) that divides ``block_size``: BlockAttention tiles then cover whole blocks."""
    if block_size is None:
        return None
    for edge in (128, 64, 32, 16):
        if block_size % edge == 0:
            return edge
    return None


def candidate_tiles(
    kernel: str,
    dtype: torch.dtype,
    device: torch.device,
    head_dim: int,
    *,
    block_size: int | None = None,
    max_len_q: int = 1 << 30,
) -> list[Tiles]:
    """Candidate tiles of ``kernel`` (``"fwd"``, ``"dkdv"`` or ``"dq"``), best guess first.

    16 x 16 in the CPU interpreter (fast there, several blocks per test segment); fp32 halves the shapes
    (twice the shared memory per element). BlockAttention with a block that a tile edge divides gets
    tiles of exactly that edge: one query tile against its own key tile, no mask inside whole blocks.
    Short query segments (candidates over a history) get query tiles no taller than the longest one.
    """
    if device.type != "cuda":
        return [Tiles(16, 16, 1, 1)]
    if dtype == torch.float32:
        return [Tiles(32, 32, 4, 2)]
    edge = _block_tiles(block_size)
    if edge is not None and edge <= 64:
        if kernel == "fwd":
            return [Tiles(edge, edge, 4, 2), Tiles(edge, edge, 8, 2)]
        return [Tiles(edge, edge, 8, 2), Tiles(edge, edge, 4, 2)]
    if edge is not None:
        return [Tiles(edge, 64, 8, 2), Tiles(edge, edge, 8, 2)] if kernel == "fwd" else [Tiles(64, edge, 8, 2)]
    short = length_bucket(max_len_q)
    if kernel == "fwd":
        if short <= 64:
            return [Tiles(short, 64, 4, 3), Tiles(short, 128, 4, 3), Tiles(short, 128, 8, 3)]
        if head_dim <= 64:
            return [Tiles(128, 64, 4, 3), Tiles(128, 128, 8, 3), Tiles(64, 64, 4, 3)]
        if head_dim <= 128:
            return [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 2), Tiles(128, 128, 8, 2)]
        return [Tiles(64, 64, 4, 2), Tiles(128, 32, 8, 2)]
    # Backward tiles hold two fp32 accumulators (dK, dV) of BLOCK_N x D: at D = 128, 64-key tiles over 8
    # warps keep them in registers, where 4 warps spill hundreds of bytes per thread.
    if kernel == "dkdv":
        if short <= 32:
            return [Tiles(short, 64, 8, 2), Tiles(short, 64, 8, 3)]
        if head_dim <= 64:
            return [Tiles(64, 64, 8, 2), Tiles(64, 128, 8, 3), Tiles(64, 64, 4, 3)]
        if head_dim <= 128:
            return [Tiles(64, 64, 8, 2), Tiles(64, 128, 8, 3), Tiles(32, 64, 8, 2)]
        return [Tiles(32, 64, 8, 2), Tiles(16, 64, 8, 2)]
    if short <= 64:
        return [Tiles(short, 64, 8, 2), Tiles(short, 128, 8, 2)]
    if head_dim <= 128:
        return [Tiles(128, 64, 8, 2), Tiles(64, 64, 8, 2)]
    return [Tiles(64, 64, 8, 2), Tiles(64, 32, 8, 2)]


def backward_candidates(
    dtype: torch.dtype,
    device: torch.device,
    head_dim: int,
    *,
    deterministic: bool,
    block_size: int | None = None,
    max_len_q: int = 1 << 30,
) -> list[BackwardTiles]:
    """Candidate backward launches, best guess first: the one-launch dK/dV + dQ kernel over pairs of the
    ``dkdv`` and ``dq`` candidates (the launch takes the dK/dV tiles' warps and stages), and unless
    ``deterministic`` the dK/dV kernel with atomic dQ. Off CUDA the atomic one comes first (the interpreter
    then tests both kernels: ``deterministic=True`` picks the other)."""
    dkdv = candidate_tiles("dkdv", dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q)
    dq = candidate_tiles("dq", dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q)
    merged = [BackwardTiles(dkdv[0], dq[0])]
    merged += [BackwardTiles(t, dq[0]) for t in dkdv[1:2]]
    merged += [BackwardTiles(dkdv[0], t) for t in dq[1:2]]
    if deterministic:
        return merged
    atomic = [BackwardTiles(t) for t in dkdv[:2]]
    return atomic + merged if device.type != "cuda" else merged + atomic


def _can_time(tensors: tuple[torch.Tensor, ...]) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    if os.environ.get("LIGHTNING_GEM_GDPA_TUNE", "1") == "0" or torch.compiler.is_compiling():
        return False
    if not all(type(t) is torch.Tensor and t.is_cuda and not is_fake(t) for t in tensors):
        return False
    return not torch.cuda.is_current_stream_capturing()


def _compile_all(candidates: list[T], run: Callable[[T], None]) -> None:
    """Compile every candidate at once on a thread pool (Triton's asynchronous compile mode: code generation
    and ``ptxas`` of one kernel overlap those of the others), instead of one after another as each is first run.
    A candidate that fails to compile is left to fail again, alone, when it is timed."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_gem.ops.attention.impl.triton._common import compile_only

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without it: candidates compile as they are first run
        return
    with ThreadPoolExecutor(max_workers=min(8, len(candidates))) as pool:
        with AsyncCompileMode(pool, ignore_errors=True), compile_only():
            for candidate in candidates:
                try:
                    run(candidate)
                except Exception:  # noqa: BLE001  (reported when the candidate is timed)
                    continue


def pick_tiles(key: tuple, candidates: list[T], run: Callable[[T], None], tensors: tuple[torch.Tensor, ...]) -> T:
    """The tiles for ``key``: the remembered choice, else (when timing is possible) the fastest candidate.

    ``run(tiles)`` launches the kernel with ``tiles`` on the call's own buffers; it is run once to compile,
    then timed; a candidate that fails to compile (shared memory) is dropped. ``tensors`` are the call's
    inputs: timing needs real CUDA tensors.
    """
    if len(candidates) == 1:
        return candidates[0]
    try:
        chosen = _CHOSEN.get(key)
    except TypeError:  # symbolic sizes in the key (tracing with dynamic shapes): nothing to look up or time
        return candidates[0]
    if chosen is not None:
        return chosen  # type: ignore[return-value]
    if not _can_time(tensors):
        return candidates[0]
    _compile_all(candidates, run)
    best, best_ms = candidates[0], float("inf")
    for tiles in candidates:
        try:
            run(tiles)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001  (triton.runtime.OutOfResources and kin: not a candidate here)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            run(tiles)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 5
        if ms < best_ms:
            best, best_ms = tiles, ms
    _CHOSEN[key] = best
    return best


def forget_choices() -> None:
    """Drop the choices made so far (compiled kernels stay cached): the next call of each key times its
    candidates again, e.g. after a warm-up that shared the device with other work."""
    _CHOSEN.clear()


def chosen_tiles() -> dict[tuple, Tiles | BackwardTiles]:
    """A copy of the choices made so far in this process: ``{key: tiles}`` (for benchmarks and logs)."""
    return dict(_CHOSEN)


def tile_meta(tiles: Tiles) -> dict[str, int]:
    """Launch options of ``tiles``: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``."""
    return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "num_warps": tiles.num_warps,
            "num_stages": tiles.num_stages}  # fmt: skip
