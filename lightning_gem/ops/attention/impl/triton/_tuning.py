"""Tile shapes of the GDPA kernels: a few candidates per kernel and mode, and a tuner that times them once per key.

The key is what changes the best shape: the kernel, head dims, dtype, the mode's compile-time flags, the
length hints bucketed to powers of two, the number of heads and the total work (``Tq x H x Tk / Bkv``, queries
times heads times the mean kv segment, bucketed to powers of two), and for a forward with library kernels among
its candidates whether the call keeps the log-sum-exp. Lengths stay runtime values in the kernels, so
a new batch neither recompiles nor retunes unless its longest segment or its work crosses a power of two: a
training run whose batches hold about the same number of tokens tunes a key or two per layer shape.

``impl="auto"`` adds the library kernels that compute the mode exactly to the candidates: :data:`FLASH`
(FlashAttention-4, :mod:`..flash`, where installed) and :data:`VARLEN` (PyTorch's own FlashAttention-2,
:mod:`..varlen`); its key says so. The fastest Triton candidate of that timing is remembered too, under the key
without library kernels, which is what a traced call of the same shape (``torch.compile``, where only the Triton kernels
are traced) then uses. Each such choice is logged at INFO level with the times it was made on. Likewise a forward
key that allows descriptor loads (``Tiles.tma``) leaves its fastest pointer tile under the key of a call that
cannot take them (a traced one).

The tuner compiles a key's candidates at once on a thread pool, then times them on the call's own inputs
(CUDA events, after one warm-up run), only for real CUDA tensors outside tracing and graph capture;
elsewhere, and before a key is tuned, the first candidate runs (a best guess).
``LIGHTNING_GEM_GDPA_TUNE=0`` in the environment turns timing off.

Once a key's choice is made, the launch options built from it (constexprs and tile sizes) are remembered with it
(:func:`pick_launch`), so a tuned call builds neither its candidates nor its options again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar

import torch

from lightning_gem.ops._tuning import pick_fastest
from lightning_gem.ops.attention.impl.triton._common import next_power_of_2

__all__ = [
    "FLASH",
    "LIBRARIES",
    "VARLEN",
    "BackwardTiles",
    "Tiles",
    "backward_candidates",
    "candidate_tiles",
    "chosen_tiles",
    "forget_choices",
    "forward_tiles_fault",
    "length_bucket",
    "pick_launch",
    "pick_tiles",
    "split_candidates",
    "tile_meta",
    "tuning_times",
    "work_bucket",
]

log = logging.getLogger(__name__)


T = TypeVar("T")


class Tiles(NamedTuple):
    """A kernel's launch shape: query rows and key rows per tile, warps per program, pipeline stages; ``tma``
    (forward only): key and value tiles read through tensor descriptors (the copy engine's bulk tensor loads) where
    the call allows them (:func:`.forward.kv_descriptors_ok`), else through pointers."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2
    tma: bool = False

    @property
    def label(self) -> str:
        """``"(64, 64, 4, 3)"``, with `` tma`` for descriptor loads: for logs and benchmark tables."""
        return f"{tuple(self[:4])}{' tma' if self.tma else ''}"


class BackwardTiles(NamedTuple):
    """A backward launch: ``dkdv`` tiles the dK/dV programs (query rows x key rows, and the warps and stages of
    the launch); ``dq`` the dQ programs' query rows x key rows in the same launch, or None for dQ added through
    fp32 atomics by the dK/dV programs (not bitwise reproducible); ``tma`` (with ``dq`` None): those additions as
    one bulk tensor reduction per tile (the copy engine's ``cp.reduce.async.bulk``, sm_90+) instead of one atomic
    per element, in plain eager calls (traced ones add element by element). ``split``: dK and dV in programs of their
    own, one fp32 accumulator each (``Q K^T`` computed by both), beside the dQ programs or, with ``dq`` None, the dK
    one adding dQ. ``short``: the short-query kernel instead (:mod:`.backward_short`; ``dkdv`` then tiles its one
    query tile per segment and its key tiles)."""

    dkdv: Tiles
    dq: Tiles | None = None
    short: bool = False
    tma: bool = False
    split: bool = False
    halves: bool = False
    dv_stages: int = 0


# The candidates that run a library's kernels instead of a Triton launch (``impl="auto"`` only): FlashAttention-4
# (:mod:`..flash`) and PyTorch's own FlashAttention-2 (:mod:`..varlen`).
FLASH = "flash"
VARLEN = "varlen"
LIBRARIES = (FLASH, VARLEN)
_NAMES = {FLASH: "FlashAttention-4", VARLEN: "PyTorch FlashAttention-2"}

# The longest query segment the short-query backward holds in one tile.
SHORT_QUERY_ROWS = 64


_CHOSEN: dict[tuple, Tiles | BackwardTiles] = {}
# (the key's compile-time part, candidate) of candidates that failed to compile or launch (registers, shared memory):
# not listed again for keys that compile the same kernel.
_FAILED: set[tuple] = set()
# (key, variant) -> (the choice for key, the launch options built from it); filled once the choice is remembered.
_LAUNCHES: dict[tuple, tuple] = {}
# key -> {candidate: ms} of the timing that chose it (keys timed in this process only).
_TIMES: dict[tuple, dict] = {}


def length_bucket(length: int) -> int:
    """The power of two at or above ``length`` (16 at least): the tuner's key for a length hint."""
    return max(16, next_power_of_2(max(int(length), 1)))


def work_bucket(num_q: int, heads: int, num_kv: int, num_kv_segments: int) -> int | None:
    """The tuner's key for a call's total work: the bit length of ``Tq x H x (Tk / Bkv)`` (queries times heads
    times the mean kv segment, read from shapes alone: no sync), so keys change at powers of two. None for
    symbolic sizes (a trace with dynamic shapes: reading them would specialize the graph)."""
    sizes = (num_q, heads, num_kv, num_kv_segments)
    if not all(type(size) is int for size in sizes):
        return None
    return (num_q * heads * max(1, num_kv // max(1, num_kv_segments))).bit_length()


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
    fp8: bool = False,
    pointwise_targets: bool = False,
    pointwise: bool = False,
    descriptors: bool = False,
) -> list[Tiles]:
    """Candidate tiles of ``kernel`` (``"fwd"``, ``"dkdv"`` or ``"dq"``), best guess first.

    16 x 16 in the CPU interpreter (fast there, several blocks per test segment); fp32 halves the shapes
    (twice the shared memory per element). BlockAttention with a block that a tile edge divides gets
    tiles of exactly that edge: one query tile against its own key tile, no mask inside whole blocks.
    Short query segments (candidates over a history) get query tiles no taller than the longest one.
    ``fp8`` (the forward on FP8 codes): key tiles of 32 or more, the least an FP8 tensor-core product sums over
    (``P V`` sums over a key tile), so BlockAttention blocks of 16 take the general tiles (masked at block edges).
    With ``fp8`` and ``pointwise_targets`` (a pointwise activation with targets) the forward leaves out the tiles
    :func:`fp8_tiles_fault` refuses. ``pointwise`` (a pointwise activation): at head dims over 64 up to 128 the
    16-bit forward's first candidate is 128 x 32 over 8 warps and three stages, the fastest timed there (a softmax
    forward can fault at that tile, :func:`forward_tiles_fault`). ``descriptors`` (the call allows descriptor loads,
    :func:`.forward.kv_descriptors_ok`): a 16-bit softmax forward at head dims up to 128 over query segments longer
    than 64 also lists the 64 x 64 tile over 4 warps and the 128 x 64 over 8, both at three stages, with ``tma``
    (timed on an H100, the best of them runs 4-13% over the best pointer tile on segments of 4K and longer, about
    even at 1K: docs/benchmarks.md, "Softmax forward: descriptor-load tiles"). Pointwise activations list none:
    under descriptor loads the launcher gives them the exact activation, which costs them more than the loads save.
    """
    if device.type != "cuda":
        return [Tiles(16, 16, 1, 1)]
    if kernel == "fwd" and fp8 and pointwise_targets:
        tiles = candidate_tiles(kernel, dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q, fp8=True)
        return [t for t in tiles if not fp8_tiles_fault(t, head_dim, pointwise_targets)]
    if dtype == torch.float32:
        return [Tiles(32, 32, 4, 2)]
    edge = _block_tiles(block_size)
    if fp8 and edge is not None and edge < 32:
        edge = None
    if edge is not None and edge > 64 and head_dim > 128:
        # 128-row tiles of 256 columns exceed an sm_90 block's shared memory (every backward launch, and the forward's
        # 128 x 128): the 64-row tiles, which cover whole blocks as well (64 divides what 128 divides)
        edge = 64
    if edge is not None and edge <= 64:
        # One key tile per query tile (and one query tile per key tile): nothing to pipeline, so one stage (half the
        # shared memory of two, more programs an SM) is a candidate beside two.
        # Over head dim 128 the backward's two stages of K, V, Q and dO tiles exceed an sm_90 block's shared memory.
        if kernel == "fwd":
            return [Tiles(edge, edge, 4, 2), Tiles(edge, edge, 8, 2), Tiles(edge, edge, 4, 1), Tiles(edge, edge, 8, 1)]
        if head_dim > 128:
            return [Tiles(edge, edge, 8, 1), Tiles(edge, edge, 4, 1)]
        return [Tiles(edge, edge, 8, 2), Tiles(edge, edge, 4, 2), Tiles(edge, edge, 8, 1), Tiles(edge, edge, 4, 1)]
    if edge is not None:
        return [Tiles(edge, 64, 8, 2), Tiles(edge, edge, 8, 2)] if kernel == "fwd" else [Tiles(64, edge, 8, 2)]
    short = length_bucket(max_len_q)
    if kernel == "fwd":
        if short <= 64:
            return [Tiles(short, 64, 4, 3), Tiles(short, 128, 4, 3), Tiles(short, 128, 8, 3)]
        if descriptors and not pointwise and not fp8 and head_dim <= 128:
            tiles = candidate_tiles(kernel, dtype, device, head_dim, max_len_q=max_len_q)
            return [*tiles, Tiles(64, 64, 4, 3, tma=True), Tiles(128, 64, 8, 3, tma=True)]
        # Narrow key tiles over 4 warps first: the plan for untimed shapes, and the faster causal jagged forward at
        # head dims 64 and 128 (``examples/benchmarks/attention_check.py tiles`` times every candidate).
        if head_dim <= 64:
            return [Tiles(64, 32, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 2), Tiles(128, 64, 8, 3)]
        if head_dim <= 128:
            tiles = [Tiles(64, 32, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 4)]
            # Pointwise, 16-bit: 128 x 32 over 8 warps first (timed on an H100, SiLU causal at 4 and 16 heads x 128:
            # 420-515 TFLOP/s against 353-466 for the best of the others, on 16 x 4096 and 64 x clip(4096 u^3)).
            return [Tiles(128, 32, 8, 3), *tiles] if pointwise and not fp8 else tiles
        # Head dims over 128: the fp32 accumulator of a 64-row tile is 128 registers a thread over 4 warps; 8 warps
        # halve that, and taller tiles over 8 warps reuse each key tile twice as often. The 128-row tile over 8 warps
        # comes first: it is the plan of untimed calls (a graph traced with dynamic shapes), and the one the tuner
        # picks on the head-dim-256 cells of the attention grid (docs/benchmarks.md, Attention).
        return [Tiles(128, 64, 8, 2), Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 2), Tiles(64, 64, 4, 2),
                Tiles(64, 32, 4, 3)]  # fmt: skip
    # Backward tiles hold two fp32 accumulators (dK, dV) of BLOCK_N x D: at D = 128, 64-key tiles over 8
    # warps keep them in registers, where 4 warps spill hundreds of bytes per thread.
    if kernel == "dkdv":
        if short <= 32:
            return [Tiles(short, 64, 8, 2), Tiles(short, 64, 8, 3)]
        if head_dim <= 64:
            return [Tiles(64, 128, 8, 3), Tiles(64, 64, 8, 2), Tiles(128, 128, 8, 2), Tiles(64, 128, 4, 3)]
        if head_dim <= 128:
            return [Tiles(64, 128, 8, 3), Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 2)]
        # Over 128 (tiles of 256 columns) 64 x 64 at two stages needs more shared memory than an sm_90 block has.
        return [Tiles(32, 64, 8, 2), Tiles(16, 64, 8, 2), Tiles(32, 32, 4, 2)]
    if short <= 64:
        return [Tiles(short, 64, 8, 2), Tiles(short, 128, 8, 2)]
    if head_dim <= 128:
        return [Tiles(128, 64, 8, 2), Tiles(64, 64, 8, 2)]
    return [Tiles(64, 64, 8, 2), Tiles(64, 32, 8, 2)]


def forward_tiles_fault(
    tiles: Tiles, dtype: torch.dtype, head_dim: int, block_size: int | None, activation: str = "softmax"
) -> bool:
    """Whether the 16-bit forward at these tiles can fault on sm_90 (Triton 3.6): at head dims up to 128, narrow key
    tiles in the pipelined key loop stopped with a misaligned shared-memory address at the key tile's load (found by
    ``compute-sanitizer``) on some shapes and modes and not on others (what decides is not known): key tiles of 16
    (SiLU causal over segments of 1,031, pointer and descriptor loads), key tiles of 32 over two stages (64 x 32 on
    softmax over 32 candidates a history), and with softmax key tiles of 32 under 128-row query tiles: 128 x 32 over
    8 warps and three stages faulted on softmax without a causal mask (bidirectional self-attention, candidates over
    histories) on an H100, and ran 160 random causal softmax shapes (windows and targets included) and 250 pointwise
    ones (SiLU and GELU; causal, bidirectional, windows, targets, candidates over histories; 2,500 tokens a segment at
    most) there. So for a pointwise ``activation`` 128 x 32 over three stages is not refused (at head dim 128 it is
    the fastest SiLU forward timed: 10-18% over 128 x 64). 64 x 32 over three stages, the first softmax candidate at
    these head dims, ran every shape tried; BlockAttention was not seen to fault and is not concerned. Such tiles are
    refused when passed on CUDA; the candidate lists of :func:`candidate_tiles` hold none of them (a test keeps them
    so)."""
    if block_size is not None or dtype not in (torch.bfloat16, torch.float16) or head_dim > 128:
        return False
    if tiles.block_n != 32:
        return tiles.block_n < 32
    return tiles.num_stages == 2 or (activation == "softmax" and tiles.block_m >= 128)


def fp8_tiles_fault(tiles: Tiles, head_dim: int, pointwise_targets: bool) -> bool:
    """Whether the FP8 forward at these tiles computes wrong values on sm_90: with a pointwise activation and targets
    (``pointwise_targets``) at head dims over 128, tiles over 4 warps gave non-finite or wrong rows at the targets on
    an H100 (Triton 3.6; the own-target term's product of the value codes with the row's weights on a diagonal),
    where the same tiles run softmax, and pointwise attention at head dims up to 128, and tiles over 8 warps (64 or
    128 query rows) match the emulation. Such tiles are left out of the candidates, and refused when passed."""
    return pointwise_targets and head_dim > 128 and tiles.num_warps < 8


def backward_candidates(
    dtype: torch.dtype,
    device: torch.device,
    head_dim: int,
    *,
    deterministic: bool,
    block_size: int | None = None,
    max_len_q: int = 1 << 30,
    short_query: bool = False,
    tma: bool = False,
) -> list[BackwardTiles]:
    """Candidate backward launches, best guess first: the one-launch dK/dV + dQ kernel over pairs of the
    ``dkdv`` and ``dq`` candidates (the launch takes the dK/dV tiles' warps and stages), and unless
    ``deterministic`` the dK/dV kernel with atomic dQ. Off CUDA the atomic one comes first (the interpreter
    then tests both kernels: ``deterministic=True`` picks the other). ``short_query`` (the launch can take the
    short-query kernel: no shared kv segments, no targets, every query segment within ``SHORT_QUERY_ROWS``) adds
    that kernel's tiles (head dims up to 128: at 256 its one query tile and two key-tile accumulators exceed the
    registers), first on CUDA (its one pass over the keys is the best guess there), last elsewhere. ``tma``
    (the launcher can reduce dQ tiles through the copy engine) adds the atomic kernel with bulk reductions, first of
    the non-short launches on CUDA. Over head dim 128 the split dK and dV programs of :func:`split_candidates`
    come first of those: one accumulator a program is what lets a key tile be 128 rows tall there."""
    dkdv = candidate_tiles("dkdv", dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q)
    dq = candidate_tiles("dq", dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q)
    merged = [BackwardTiles(dkdv[0], dq[0])]
    merged += [BackwardTiles(t, dq[0]) for t in dkdv[1:2]]
    merged += [BackwardTiles(dkdv[0], t) for t in dq[1:2]]
    short = _short_tiles(dtype, device, max_len_q) if short_query and head_dim <= 128 else []
    if deterministic:
        return short + merged if device.type == "cuda" else merged + short
    atomic = [BackwardTiles(t) for t in dkdv[:4]]
    bulk = [BackwardTiles(t, tma=True) for t in dkdv[:2]] if tma else []
    if device.type != "cuda":
        return atomic + merged + short + bulk
    split = []
    if head_dim > 128:
        split = split_candidates(dtype, device, head_dim, block_size=block_size, max_len_q=max_len_q, tma=tma)
    return short + split + bulk + merged + atomic


def split_candidates(
    dtype: torch.dtype,
    device: torch.device,
    head_dim: int,
    *,
    block_size: int | None = None,
    max_len_q: int = 1 << 30,
    tma: bool = False,
) -> list[BackwardTiles]:
    """Launches of the dK/dV kernel with split dK and dV programs (atomic dQ; bulk reductions where ``tma``): one
    fp32 accumulator a program, each computing ``Q K^T`` itself. Over head dim 128 these are the fastest backward
    measured (docs/benchmarks.md): two accumulators of a 64-row key tile do not fit the registers of 8 warps, and
    a 64-row tile over 8 warps computes ``Q K^T`` in both of its warp groups, where one accumulator of a 128-row
    tile does neither; one stage at 64 query rows (two at 32), so its K, V, Q and dO tiles fit in shared memory. At
    head dims up to 128 they ran slower than the unsplit launch on every shape timed, so :func:`backward_candidates`
    takes them only over 128, where the dK program also comes with its K, dK and dQ tiles in column halves
    (``halves``: each half's product and reduction hold half the registers). None where a BlockAttention block or
    short query segments fix the tiles."""
    if device.type != "cuda":
        return [BackwardTiles(Tiles(16, 16, 1, 1), split=True)]
    if dtype == torch.float32 or _block_tiles(block_size) is not None or length_bucket(max_len_q) <= 64:
        return []
    if head_dim <= 64:
        shapes = [Tiles(64, 128, 8, 2), Tiles(128, 128, 8, 2), Tiles(128, 64, 8, 2)]
    elif head_dim <= 128:
        shapes = [Tiles(64, 128, 8, 2)]
    else:
        # The dK program's K, dK and dQ tiles in two column halves (fewer registers live at once), with dQ added
        # element by element (what a traced call runs): first on query tiles of 64 rows at one stage (the plan of
        # untimed calls, run on the GPU in every mode), then of 32 rows at two stages (their dQ tiles computed
        # transposed, :func:`.backward_programs._add_dq_part`, is what fits them in shared memory: the loads of the
        # next query tile overlap this one's products), each also with the dV programs in a launch of their own at
        # the most stages their K tile and their Q and dO tiles fit in shared memory (three of 32 rows, two of 64);
        # then dQ through bulk reductions, halves and whole. Timed on an H100 (docs/benchmarks.md, "Head dim 256
        # backward"): the 32-row plans lead on softmax, the 64-row one with its own dV launch on SiLU.
        single, pipelined = Tiles(64, 128, 8, 1), Tiles(32, 128, 8, 2)
        plans = [
            BackwardTiles(single, split=True, halves=True),
            BackwardTiles(pipelined, split=True, halves=True),
            BackwardTiles(pipelined, split=True, halves=True, dv_stages=3),
            BackwardTiles(single, split=True, halves=True, dv_stages=2),
            BackwardTiles(single, tma=tma, split=True, halves=True),
            BackwardTiles(single, tma=tma, split=True),
        ]
        return list(dict.fromkeys(plans))
    return [BackwardTiles(t, tma=tma, split=True) for t in shapes]


def _short_tiles(dtype: torch.dtype, device: torch.device, max_len_q: int) -> list[BackwardTiles]:
    """The short-query kernel's launches: one query tile of the segment's (bucketed) length over key tiles."""
    rows = length_bucket(max_len_q)
    if device.type != "cuda":
        return [BackwardTiles(Tiles(rows, 16, 1, 1), short=True)]
    if dtype == torch.float32:
        return [BackwardTiles(Tiles(rows, 32, 4, 2), short=True)]
    shapes = [Tiles(rows, 64, 4, 2), Tiles(rows, 64, 8, 2), Tiles(rows, 128, 8, 2), Tiles(rows, 64, 4, 3)]
    return [BackwardTiles(t, short=True) for t in shapes]


def pick_tiles(
    key: tuple, candidates: Callable[[], list[T]], run: Callable[[T], None], tensors: tuple[torch.Tensor, ...]
) -> T:
    """The tiles for ``key``: the remembered choice, else (when timing is possible) the fastest of
    ``candidates()``, compiled all at once first (:func:`lightning_gem.ops._tuning.pick_fastest`; ``run(tiles)``
    launches the kernel with that candidate on the call's own buffers, ``tensors`` are the call's inputs). The
    candidates are only listed for a key not chosen yet. ``LIGHTNING_GEM_GDPA_TUNE=0`` turns timing off.

    A key whose last entry is True holds library kernels (:data:`LIBRARIES`) among its candidates (``impl="auto"``):
    the best Triton candidate is remembered under the same key ending in False too, and the choice is logged."""
    try:
        chosen = _CHOSEN.get(key)
    except TypeError:  # an unhashable SymInt in the key (tracing with dynamic shapes): nothing is looked up or kept
        return candidates()[0]
    if chosen is not None:
        return chosen
    timing = os.environ.get("LIGHTNING_GEM_GDPA_TUNE", "1") != "0"
    static = _compiled_part(key)
    listed = [c for c in candidates() if (static, c) not in _FAILED] or candidates()
    timings: dict = {}
    chosen = pick_fastest(_CHOSEN, key, listed, run, tensors, timing=timing, compile_first=True, timings=timings)
    if timings:
        _TIMES[key] = dict(timings)
        _FAILED.update((static, c) for c in listed if c not in timings and c not in LIBRARIES)
        if any(c in LIBRARIES for c in listed):
            _remember_auto(key, chosen, timings, listed)
        if key[0] == "fwd" and key[6]:
            _remember_pointer_tiles(key, timings)
    return chosen


def _compiled_part(key: tuple) -> tuple:
    """What of a key fixes the compiled kernels (kernel, head dims, dtype, mode flags, block size, and the forward's
    descriptor loads or the backward's determinism): the keys of :mod:`.forward` and :mod:`.backward` end in their
    length buckets, heads, work bucket and library-kernel flags."""
    return key[:7]


def _remember_auto(key: tuple, chosen: object, timings: dict, listed: list) -> None:
    """After an ``impl="auto"`` timing: the fastest Triton candidate under the key without library kernels (the
    forward's with its no-log-sum-exp flag off too: a call without them keys on neither), and a log line of what was
    chosen."""
    kernels = {c: ms for c, ms in timings.items() if c not in LIBRARIES}
    if kernels:
        triton_key = (*key[:-2], False, False) if key[0] == "fwd" else (*key[:-1], False)
        _CHOSEN.setdefault(triton_key, min(kernels, key=kernels.__getitem__))
    best_kernel = min(kernels.items(), key=lambda item: item[1]) if kernels else None
    libraries = ", ".join(f"{_NAMES[c]} " + (f"{timings[c]:.3f} ms" if c in timings else "failed")
                          for c in LIBRARIES if c in listed)  # fmt: skip
    log.info(
        "GDPA impl='auto' %s: %s (%.3f ms); %s; best Triton %s",
        key[0],
        _NAMES[chosen] if chosen in LIBRARIES else f"Triton {_label(chosen)}",
        timings.get(chosen, float("nan")),
        libraries or "no library kernel",
        f"{_label(best_kernel[0])} {best_kernel[1]:.3f} ms" if best_kernel else "none",
    )


def _label(choice: Tiles | BackwardTiles) -> str:
    return choice.label if isinstance(choice, Tiles) else str(tuple(choice))


def _remember_pointer_tiles(key: tuple, timings: dict) -> None:
    """After timing a forward key that allows descriptor loads: its fastest pointer tile under the key of a call of
    the same shape that allows neither descriptors nor library kernels (a traced one), which then runs that tile
    instead of its first candidate."""
    pointer = {c: ms for c, ms in timings.items() if isinstance(c, Tiles) and not c.tma}
    if pointer:
        _CHOSEN.setdefault((*key[:6], False, *key[7:-2], False, False), min(pointer, key=pointer.__getitem__))


def pick_launch(
    key: tuple,
    variant: Hashable,
    candidates: Callable[[], list[T]],
    run: Callable[[T], None],
    tensors: tuple[torch.Tensor, ...],
    options: Callable[[T], dict[str, object]],
) -> tuple[T, dict[str, object]]:
    """``(tiles, options(tiles))``: :func:`pick_tiles`'s choice for ``key`` and the launch options the launcher
    builds from it (constexprs and tile sizes; not to be changed by the caller). Once the choice is settled (tuned
    and remembered, or the only candidate) the pair is remembered under ``(key, variant)``, so later calls of the key
    neither list candidates nor build options. ``variant`` holds what, besides the key, the candidates (the device
    type) and the options depend on."""
    memo = (key, variant)
    try:
        launch = _LAUNCHES.get(memo)
    except TypeError:  # an unhashable SymInt in the key (tracing with dynamic shapes): nothing is remembered
        tiles = pick_tiles(key, candidates, run, tensors)
        return tiles, options(tiles)
    if launch is not None:
        return launch
    listed: list[T] = []

    def listing() -> list[T]:
        listed[:] = candidates()
        return listed

    tiles = pick_tiles(key, listing, run, tensors)
    launch = (tiles, options(tiles))
    if _CHOSEN.get(key) == tiles or len(listed) == 1:
        _LAUNCHES[memo] = launch
    return launch


def forget_choices() -> None:
    """Drop the choices made so far (compiled kernels stay cached): the next call of each key times its
    candidates again, e.g. after a warm-up that shared the device with other work."""
    _CHOSEN.clear()
    _LAUNCHES.clear()
    _FAILED.clear()
    _TIMES.clear()


def chosen_tiles() -> dict[tuple, Tiles | BackwardTiles]:
    """A copy of the choices made so far in this process: ``{key: tiles}`` (for benchmarks and logs)."""
    return dict(_CHOSEN)


def tuning_times() -> dict[tuple, dict]:
    """The measurements behind the choices timed so far in this process: ``{key: {candidate: ms}}`` (each
    candidate's median per run on the call that tuned the key; library kernels among them where they were
    candidates)."""
    return {key: dict(times) for key, times in _TIMES.items()}


def tile_meta(tiles: Tiles) -> dict[str, int]:
    """Launch options of ``tiles``: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``."""
    return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "num_warps": tiles.num_warps,
            "num_stages": tiles.num_stages}  # fmt: skip
