"""GDPA against every public kernel that can run the case, on a grid of the shapes recommendation models run.

One process times every cell of a grid of modes x heads x head dims x length distributions, about ``--tokens``
tokens a batch (plus one row per mode at ``--long-tokens``, and the named workloads of earlier tables), forward and
forward+backward, bf16, against, in the same process on the same inputs:

- ``fa4``: FlashAttention-4's ``flash_attn_varlen_func`` (when installed; softmax modes without targets;
  BlockAttention as varlen segments of one block each);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (softmax, the same segments as fa4);
- ``flex``: ``torch.compile``d ``flex_attention`` on the packed batch ``[1, H, T, D]`` with a document mask (plus
  causal and block rules; softmax only), its block mask built outside the timings;
- ``padded``: eager PyTorch on padded ``[B, H, Lmax, D]`` tensors with a dense mask (pointwise modes; cells whose
  padded scores would not fit are skipped);

and ``gdpa(impl="auto")``, whose tuner times its own candidates (Triton tile shapes, and the library kernels, FA4 and
PyTorch's FA2, where they compute the mode exactly) on the first call of the cell (its measurements are kept in
``grid.json``, ``tuned``).
With ``--candidates`` every Triton candidate of the cell's forward and backward is also timed alone (``triton
best``: the fastest forward plus the fastest backward); ``--candidates reused`` does so only in cells that ran on a
choice the tuner made on another cell's inputs (its key's buckets held an earlier cell), the cells where a choice
can be wrong for the shape.

Times are medians of ``triton.testing.do_bench`` (enough runs for about ``--rep-runs`` repetitions, after a
warm-up), random normal inputs. TFLOP/s count only allowed (query, key) pairs (``gdpa_flops``; the backward is
2.5x the forward at equal head dims), the same numerator for every impl. ``x`` is ``best baseline ms / auto ms``.
Calls under 2 ms (forward+backward) also get their host time: the median wall clock of the call returning to the
host from an idle device, i.e. the time to issue its launches (``fwd_host_ms`` / ``both_host_ms``; a column for
auto): near the call's own time, the call is bound by the host rather than its kernels.

Run on a CUDA machine from the repository root::

    python examples/benchmarks/attention_grid.py --out-dir grid            # the whole grid
    python examples/benchmarks/attention_grid.py --modes "silu causal" --heads 16 --dims 128 --lengths 4k-uniform
    python examples/benchmarks/attention_grid.py --quick --out-dir /tmp/g  # CPU smoke test: tiny cells

Writes ``grid.json`` (every measurement), ``grid.md`` (the table) and ``grid.png`` (a heatmap of ``x``). A grid
too long for one sitting runs in slices: ``--time-limit S`` stops starting cells after S seconds and names the
next cell, ``--first-cell N`` starts there (each cell's inputs are seeded by its place, so the slices measure the
inputs of one whole run), and ``--render a/grid.json b/grid.json ...`` tabulates the slices as one grid::

    python examples/benchmarks/attention_grid.py --time-limit 500 --out-dir g0          # "... --first-cell 41"
    python examples/benchmarks/attention_grid.py --time-limit 500 --first-cell 41 --out-dir g1
    python examples/benchmarks/attention_grid.py --render g0/grid.json g1/grid.json --out-dir grid

``--resume DIR`` does that bookkeeping: each call runs a slice from the cell after the last one saved in ``DIR``
(into ``DIR/slice_NNNN``) and tabulates every slice of ``DIR`` as one grid in ``DIR`` (the same command, repeated
until it prints "grid done")::

    python examples/benchmarks/attention_grid.py --time-limit 500 --resume grid
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.ops import gdpa_flops
from lightning_gem.ops.attention.spec import Spec

DTYPE = torch.bfloat16
MODES: dict[str, dict] = {
    "softmax causal": dict(activation="softmax", causal=True),
    "softmax bidirectional": dict(activation="softmax"),
    "silu causal": dict(activation="silu", causal=True),
    "silu causal targets": dict(activation="silu", causal=True, targets=True),
    "softmax cross": dict(activation="softmax", cross=True),
    "silu cross": dict(activation="silu", cross=True),
    "softmax block 64": dict(activation="softmax", block_size=64),
}
# name -> (longest length L, "cubic": clip(L u^3, 16, L) | "uniform": all L)
LENGTHS = {"1k": (1024, "cubic"), "4k": (4096, "cubic"), "16k": (16384, "cubic"), "4k-uniform": (4096, "uniform")}
HEADS = (2, 4, 8, 16)
DIMS = (64, 128, 256)
# Candidates per user over one history (cross modes): uniform in this range.
CANDIDATES = (8, 64)
# The padded baseline is skipped above this estimate of its peak memory.
PADDED_LIMIT_GIB = 60.0


# ----------------------------------------------------------------------------------------------------------------------
# Cells


@dataclass
class Cell:
    mode: str
    heads: int
    dim: int
    lengths: str
    tokens: int
    num_segments: int = 0  # fixed count (named workloads); 0: as many as fill ``tokens``
    cross_queries: int = 0  # fixed candidates per user (named workloads); 0: uniform in CANDIDATES
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"{self.mode}, {self.lengths}, {self.heads}x{self.dim}, {self.tokens / 1024:g}K"


def grid_cells(args: argparse.Namespace) -> list[Cell]:
    """The named workloads first, then the grid with the modes innermost (so a ``--time-limit`` cuts shapes, never
    whole modes), then one row per mode at ``--long-tokens``."""
    cells = []
    if args.named:
        named = [
            Cell("softmax causal", 4, 128, "4k", 0, 64, name="64 seqs clip(4096 u^3), 4x128"),
            Cell("softmax causal", 8, 64, "1k", 0, 256, name="256 seqs clip(1024 u^3), 8x64"),
            Cell("softmax causal", 16, 128, "4k", 0, 64, name="64 seqs clip(4096 u^3), 16x128"),
            Cell("softmax causal", 16, 128, "4k-uniform", 0, 16, name="16 seqs of 4096, 16x128"),
            Cell("silu causal", 16, 128, "4k-uniform", 0, 16, name="silu: 16 seqs of 4096, 16x128"),
            Cell("softmax cross", 4, 128, "2k", 0, 512, 32, name="cross: 512 x 32 over clip(2048 u^3), 4x128"),
        ]
        cells += [c for c in named if c.mode in args.modes]
    cells += [
        Cell(m, h, d, n, args.tokens) for n in args.lengths for h in args.heads for d in args.dims for m in args.modes
    ]
    if args.long_tokens:
        cells += [Cell(m, 8, 128, "4k", args.long_tokens) for m in args.modes]
    return cells


def _lengths(kind: str, longest: int, tokens: int, count: int, gen: torch.Generator) -> Tensor:
    """Segment lengths: ``count`` of them, or as many as fill ``tokens`` exactly (the last one cut)."""
    if kind == "uniform":
        return torch.full((count or max(1, tokens // longest),), longest, dtype=torch.int64)
    if count:
        return (longest * torch.rand(count, generator=gen) ** 3).to(torch.int64).clamp(16, longest)
    out, total = [], 0
    while total < tokens:
        n = int(longest * float(torch.rand((), generator=gen)) ** 3)
        n = min(max(n, 16), longest, tokens - total)
        out.append(n)
        total += n
    return torch.tensor(out, dtype=torch.int64)


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int64)


@dataclass
class Case:
    cell: Cell
    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor
    q_lengths: Tensor  # CPU int64
    kv_lengths: Tensor
    q_offsets: Tensor  # device int64
    kv_offsets: Tensor | None  # None: self-attention
    num_targets: Tensor | None
    targets: Tensor | None  # CPU copy
    options: dict = field(default_factory=dict)  # gdpa mode options

    @property
    def cross(self) -> bool:
        return self.kv_offsets is not None


def make_case(cell: Cell, device: torch.device, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    spec = MODES[cell.mode]
    longest, kind = LENGTHS[cell.lengths] if cell.lengths in LENGTHS else (int(cell.lengths[:-1]) * 1024, "cubic")
    kv_lengths = _lengths(kind, longest, cell.tokens, cell.num_segments, gen)
    if spec.get("cross"):
        lo, hi = CANDIDATES
        if cell.cross_queries:
            q_lengths = torch.full_like(kv_lengths, cell.cross_queries)
        else:
            q_lengths = torch.randint(lo, hi + 1, kv_lengths.shape, generator=gen)
    else:
        q_lengths = kv_lengths
    targets = None
    if spec.get("targets"):
        targets = torch.minimum(torch.randint(1, 33, q_lengths.shape, generator=gen), q_lengths)
    h, d = cell.heads, cell.dim
    tq, tk = int(q_lengths.sum()), int(kv_lengths.sum())

    def randn(rows: int) -> Tensor:
        return torch.randn(rows, h, d, device=device, dtype=DTYPE)

    q_offsets = _offsets(q_lengths).to(device)
    kv_offsets = _offsets(kv_lengths).to(device) if spec.get("cross") else None
    options = dict(activation=spec["activation"], causal=spec.get("causal", False), block_size=spec.get("block_size"),
                   scale=1.0 / math.sqrt(d), max_seq_len_q=int(q_lengths.max()),
                   max_seq_len_kv=int(kv_lengths.max()))  # fmt: skip
    return Case(cell, randn(tq), randn(tk), randn(tk), randn(tq), q_lengths, kv_lengths, q_offsets, kv_offsets,
                None if targets is None else targets.to(device), targets, options)  # fmt: skip


def case_flops(case: Case) -> tuple[int, int]:
    kv_offsets = case.q_offsets if case.kv_offsets is None else case.kv_offsets
    jag = (case.q_offsets, kv_offsets, None, case.num_targets)
    mode = dict(causal=case.options["causal"], window=None, block_size=case.options["block_size"])
    return (
        gdpa_flops(case.q, case.k, case.v, *jag, **mode),
        gdpa_flops(case.q, case.k, case.v, *jag, **mode, backward=True),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Implementations: each builder returns (call(q, k, v) -> out, inputs (q, k, v), grad_out), or a string: why not.


Built = tuple[Callable[[Tensor, Tensor, Tensor], Tensor], tuple[Tensor, Tensor, Tensor], Tensor]


def build_gdpa(case: Case, impl: str, precision: str | None = None) -> Built:
    options = dict(case.options, impl=impl, num_targets=case.num_targets, check_offsets=False, precision=precision)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return gdpa(q, k, v, case.q_offsets, case.kv_offsets, **options)

    return call, (case.q, case.k, case.v), case.grad_out


def _segments(case: Case) -> tuple[Tensor, Tensor, int, int] | str:
    """int32 cumulative lengths and max lengths for varlen kernels; BlockAttention as one segment per block."""
    if case.options["activation"] != "softmax":
        return "n/a (softmax only)"
    if case.num_targets is not None:
        return "n/a (no target mask)"
    block = case.options["block_size"]
    dev = case.q.device
    if block is None:
        cu_q = _offsets(case.q_lengths).to(dev, torch.int32)
        cu_k = cu_q if case.kv_offsets is None else _offsets(case.kv_lengths).to(dev, torch.int32)
        return cu_q, cu_k, int(case.q_lengths.max()), int(case.kv_lengths.max())
    pieces = [min(block, int(n) - s) for n in case.q_lengths.tolist() for s in range(0, int(n), block)]
    cu = _offsets(torch.tensor(pieces, dtype=torch.int64)).to(dev, torch.int32)
    return cu, cu, max(pieces), max(pieces)


def build_fa4(case: Case) -> Built | str:
    from lightning_gem.imports import FA4_AVAILABLE

    if case.q.device.type != "cuda" or not FA4_AVAILABLE:
        return "n/a (FlashAttention-4 not installed)"
    segments = _segments(case)
    if isinstance(segments, str):
        return segments
    from flash_attn.cute.interface import flash_attn_varlen_func

    cu_q, cu_k, max_q, max_k = segments
    causal, scale = case.options["causal"], case.options["scale"]

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=causal)  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    return call, (case.q, case.k, case.v), case.grad_out


def build_varlen(case: Case) -> Built | str:
    if case.q.device.type != "cuda":
        return "n/a (needs CUDA)"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return "n/a (no torch.nn.attention.varlen in this torch)"
    segments = _segments(case)
    if isinstance(segments, str):
        return segments
    cu_q, cu_k, max_q, max_k = segments
    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, object] = {}
    if "scale" in params:
        extra["scale"] = case.options["scale"]
    elif abs(case.options["scale"] - 1 / math.sqrt(case.q.shape[-1])) > 1e-12:
        return "n/a (no scale argument)"
    if case.options["causal"]:
        if "window_size" in params:
            extra["window_size"] = (-1, 0)
        else:
            extra["is_causal"] = True

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)

    return call, (case.q, case.k, case.v), case.grad_out


_FLEX: dict[str, object] = {}
# What the one mask rule reads (every softmax cell of the grid): per token, its segment and its position.
_FLEX_STATE: dict[str, Tensor] = {}


def _flex_mask(b, h, q_idx, kv_idx):
    s = _FLEX_STATE
    allowed = s["q_doc"][q_idx] == s["kv_doc"][kv_idx]
    allowed = allowed & ((s["causal"] == 0) | (s["q_pos"][q_idx] >= s["kv_pos"][kv_idx]))
    same_block = s["q_pos"][q_idx] // s["block_len"] == s["kv_pos"][kv_idx] // s["block_len"]
    return allowed & ((s["block"] == 0) | same_block)


def build_flex(case: Case) -> Built | str:
    if case.q.device.type != "cuda":
        return "n/a (needs CUDA)"
    if case.options["activation"] != "softmax":
        return "n/a (flex_attention normalises with softmax; no pointwise activation)"
    if case.num_targets is not None:
        return "n/a (no target mask built)"
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        import torch._dynamo.config as dynamo_config  # (as a name of its own: `torch` stays this module's)

        # One compiled graph per head dim, head count and grad mode of the grid: past the default limit of 8,
        # dynamo would run flex_attention eagerly (dense scores), which is no baseline.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention)
    flex = _FLEX["fn"]
    dev = case.q.device
    tq, tk = case.q.shape[0], case.k.shape[0]
    pad_q, pad_k = -(-tq // 128) * 128, -(-tk // 128) * 128

    def ids(lengths: Tensor, padded: int) -> tuple[Tensor, Tensor]:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        pos = torch.arange(int(lengths.sum())) - _offsets(lengths)[:-1][doc]
        fill = torch.full((padded - len(doc),), -1, dtype=torch.int64)
        return torch.cat([doc, fill]).to(dev), torch.cat([pos, fill]).to(dev)

    block = case.options["block_size"]
    q_doc, q_pos = ids(case.q_lengths, pad_q)
    kv_doc, kv_pos = ids(case.kv_lengths, pad_k)
    _FLEX_STATE.update(q_doc=q_doc, q_pos=q_pos, kv_doc=kv_doc, kv_pos=kv_pos,
                       causal=torch.tensor(int(case.options["causal"]), device=dev),
                       block=torch.tensor(int(block is not None), device=dev),
                       block_len=torch.tensor(block or 1, device=dev))  # fmt: skip
    with warnings.catch_warnings():  # torch 2.11 deprecates _compile= but it still compiles the build
        warnings.simplefilter("ignore", DeprecationWarning)
        block_mask = create_block_mask(_flex_mask, 1, 1, pad_q, pad_k, device=dev, _compile=True)
    scale = case.options["scale"]

    def to_flex(t: Tensor, padded: int) -> Tensor:
        t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
        return t.transpose(0, 1).unsqueeze(0).contiguous()

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex(q, k, v, block_mask=block_mask, scale=scale)

    inputs = (to_flex(case.q, pad_q), to_flex(case.k, pad_k), to_flex(case.v, pad_k))
    return call, inputs, to_flex(case.grad_out, pad_q)


def build_padded(case: Case) -> Built | str:
    if case.options["activation"] == "softmax":
        return "n/a (pointwise modes only)"
    q_lengths, kv_lengths = case.q_lengths, case.kv_lengths
    lq, lk, num = int(q_lengths.max()), int(kv_lengths.max()), len(q_lengths)
    heads = case.q.shape[1]
    gib = num * heads * lq * lk * 2 * 6 / 2**30  # scores, activation, mask select, their gradients (bf16)
    if gib > PADDED_LIMIT_GIB:
        return f"n/a (padded scores need ~{gib:.0f} GiB)"
    dev = case.q.device
    i = torch.arange(lq, device=dev)[None, :, None]
    t = torch.arange(lk, device=dev)[None, None, :]
    len_q, len_k = q_lengths.to(dev)[:, None, None], kv_lengths.to(dev)[:, None, None]
    valid = (i < len_q) & (t < len_k)
    if case.cross:  # bottom-right aligned, no targets
        pos = i + len_k - len_q
        history = len_k
    else:
        history = len_k - (0 if case.targets is None else case.targets.to(dev)[:, None, None])
        pos = torch.minimum(i, history)
    allowed = t < history
    if case.options["causal"]:
        allowed = allowed & (t <= pos)
    if case.options["block_size"] is not None:
        s = case.options["block_size"]
        allowed = allowed & (pos // s == t // s)
    allowed = (allowed | ((t == i) & (t >= history))) & valid
    mask = allowed[:, None]  # [B, 1, Lq, Lk]
    norm = kv_lengths.clamp(min=1).to(dev, DTYPE)[:, None, None, None]
    act, scale = F.silu, case.options["scale"]

    def pad(x: Tensor, lengths: Tensor, width: int) -> Tensor:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(dev)
        pos_ = (
            torch.arange(int(lengths.sum()))
            - _offsets(lengths)[:-1][torch.repeat_interleave(torch.arange(len(lengths)), lengths)]
        ).to(dev)
        out = x.new_zeros(len(lengths), width, *x.shape[1:])
        out[doc, pos_] = x
        return out.transpose(1, 2).contiguous()

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        return torch.matmul(torch.where(mask, act(scores), 0), v) / norm

    inputs = (pad(case.q, q_lengths, lq), pad(case.k, kv_lengths, lk), pad(case.v, kv_lengths, lk))
    return call, inputs, pad(case.grad_out, q_lengths, lq)


BASELINES: dict[str, Callable[[Case], Built | str]] = {
    "fa4": build_fa4,
    "varlen": build_varlen,
    "flex": build_flex,
    "padded": build_padded,
}


# ----------------------------------------------------------------------------------------------------------------------
# Timing


def bench(fn: Callable[[], object], grad_to_none: list[Tensor] | None, runs: int) -> float:
    """Median ms of ``fn``: ``do_bench`` on CUDA with a warm-up and a repetition window of about ``runs`` calls;
    ``perf_counter`` medians on CPU."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(max(3, runs // 4)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=max(2 * estimate, 1.0), rep=max(runs * estimate, 5.0),
                                   grad_to_none=grad_to_none, return_mode="median")  # fmt: skip


# Calls shorter than this (ms, forward+backward) also get their host time measured: where it nears the call's time,
# the call is bound by the host issuing its launches, not by its kernels.
HOST_TIMED_BELOW_MS = 2.0


def host_ms(fn: Callable[[], object], grad_to_none: list[Tensor] | None = None, calls: int = 20) -> float:
    """Median wall-clock ms of ``fn`` returning to the host, without waiting for the device (from an idle device,
    after a warm-up call): the time it takes the host to issue the call's launches. ``grad_to_none``: tensors whose
    gradients are dropped before each call, untimed (as ``do_bench`` does)."""
    fn()
    times = []
    for _ in range(calls):
        for tensor in grad_to_none or ():
            tensor.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times)


def time_built(built: Built, runs: int) -> tuple[dict[str, float], Tensor]:
    """``({"fwd_ms", "both_ms"[, "fwd_host_ms", "both_host_ms"]}, the forward's output)``: the forward without
    autograd, then with its backward; calls under :data:`HOST_TIMED_BELOW_MS` also their host times (:func:`host_ms`).
    """
    call, inputs, grad_out = built
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def forward() -> None:
        with torch.no_grad():
            call(*inputs)

    def both() -> None:
        call(*leaves).backward(grad_out)

    with torch.no_grad():
        out = call(*inputs)
    timed = {"fwd_ms": bench(forward, None, runs), "both_ms": bench(both, leaves, runs)}
    if timed["both_ms"] < HOST_TIMED_BELOW_MS or not torch.cuda.is_available():  # (every CPU call: smoke tests)
        timed.update(fwd_host_ms=host_ms(forward), both_host_ms=host_ms(both, leaves))
    return timed, out


def time_candidates(case: Case, runs: int) -> dict[str, dict[str, float]]:
    """Every Triton candidate of the case's forward and backward launchers, each timed alone (ms)."""
    from lightning_gem.ops.attention.impl.triton._tuning import backward_candidates, candidate_tiles
    from lightning_gem.ops.attention.impl.triton.backward import bulk_reduction_ok, gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, kv_descriptors_ok

    o = case.options
    kv_offsets = case.q_offsets if case.kv_offsets is None else case.kv_offsets
    qkv = (case.q, case.k, case.v)
    spec = Spec(case.q_offsets, kv_offsets, None, case.num_targets, o["activation"], o["causal"], None,
                o["block_size"], o["scale"], o["max_seq_len_q"], o["max_seq_len_kv"])  # fmt: skip
    fwd, bwd = {}, {}
    for tiles in candidate_tiles(
        "fwd",
        DTYPE,
        case.q.device,
        case.cell.dim,
        block_size=o["block_size"],
        max_len_q=o["max_seq_len_q"],
        pointwise=o["activation"] != "softmax",
        descriptors=kv_descriptors_ok(*qkv),
    ):
        try:
            fwd[tiles.label] = bench(lambda t=tiles: gdpa_forward(*qkv, spec, tiles=t), None, runs)
        except Exception as error:
            fwd[tiles.label] = f"{type(error).__name__}"
    out, lse = gdpa_forward(*qkv, spec)
    short = case.kv_offsets is None and case.num_targets is None and o["max_seq_len_q"] <= 64
    plans = backward_candidates(DTYPE, case.q.device, case.cell.dim, deterministic=False, block_size=o["block_size"],
                                max_len_q=o["max_seq_len_q"], short_query=short or (case.cross and
                                o["max_seq_len_q"] <= 64), tma=bulk_reduction_ok(case.q))  # fmt: skip
    for plan in plans:
        chosen = dict(short_tiles=plan.dkdv) if plan.short else dict(dkdv_tiles=plan.dkdv, dq_tiles=plan.dq,
                                                                      bulk_dq=plan.tma)  # fmt: skip
        try:
            bwd[str(plan)] = bench(lambda c=chosen: gdpa_backward(case.grad_out, *qkv, out, lse, spec, **c), None, runs)
        except Exception as error:
            bwd[str(plan)] = f"{type(error).__name__}"
    return {"fwd": fwd, "bwd": bwd}


def _auto_choices(before: dict, after: dict) -> dict[str, str]:
    """The tuner's new choices between two snapshots, ``{"fwd": ..., "bwd": ...}`` as short strings: the choice of
    the key ending in True where FlashAttention-4 was a candidate (its key ending in False then holds the best Triton
    candidate), else of the key ending in False."""
    picked: dict[str, str] = {}
    for key, choice in after.items():
        if key in before or key[0] not in ("fwd", "bwd"):
            continue
        if key[-1] is True or key[0] not in picked:
            picked[key[0]] = _label(choice)
    return picked


def _label(choice: object) -> str:
    """A tuner candidate as a short string: ``fa4``, ``varlen`` (PyTorch's FlashAttention-2), a forward's tiles, or a
    backward plan."""
    from lightning_gem.ops.attention.impl.triton._tuning import FLASH, VARLEN

    if choice == FLASH:
        return "fa4"
    if choice == VARLEN:
        return "varlen"
    if not hasattr(choice, "dkdv"):
        return choice.label
    if choice.short:
        return f"short {choice.dkdv.label}"
    split = " split" if choice.split else ""
    if choice.dq is None:
        return f"{choice.dkdv.label}{split} {'bulk' if choice.tma else 'atomic'} dQ"
    return f"{choice.dkdv.label}{split} dQ {choice.dq.label}"


def _tuned(before: dict) -> dict[str, dict[str, float]]:
    """The tuner's own measurements of the keys it timed since ``before`` (a :func:`tuning_times` snapshot):
    ``{"fwd": {candidate: ms}, "bwd": ...}``, the library kernels as ``fa4`` and ``varlen``."""
    from lightning_gem.ops.attention.impl.triton._tuning import tuning_times

    tuned: dict[str, dict[str, float]] = {}
    for key, times in tuning_times().items():
        if key not in before and key[0] in ("fwd", "bwd"):
            tuned[key[0]] = {_label(c): ms for c, ms in times.items()}
    return tuned


def run_cell(case: Case, args: argparse.Namespace) -> dict:
    from lightning_gem.ops.attention.impl.triton._tuning import chosen_tiles, tuning_times

    fwd_flops, bwd_flops = case_flops(case)
    result: dict = {"cell": asdict(case.cell), "label": case.cell.label, "fwd_gflop": fwd_flops / 1e9,
                    "bwd_gflop": bwd_flops / 1e9, "segments": len(case.q_lengths), "q_tokens": case.q.shape[0],
                    "kv_tokens": case.k.shape[0], "impls": {}}  # fmt: skip
    impl = "auto" if case.q.is_cuda else "reference"
    before, times_before = chosen_tiles(), tuning_times()
    start = time.perf_counter()
    built = build_gdpa(case, impl)
    call, inputs, grad_out = built
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    call(*leaves).backward(grad_out)  # the first call of each key tunes it (forward, then backward)
    if case.q.is_cuda:
        torch.cuda.synchronize()
    result["tune_s"] = time.perf_counter() - start
    result["chosen"] = _auto_choices(before, chosen_tiles())
    result["tuned"] = _tuned(times_before)
    result["impls"]["auto"], ours = time_built(built, args.rep_runs)
    del leaves
    if args.precision == "fp8":  # the same auto call on FP8 codes, against the bf16 one above
        built_fp8 = build_gdpa(case, impl, precision="fp8")
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        built_fp8[0](*leaves).backward(grad_out)  # tunes its keys
        timed, out = time_built(built_fp8, args.rep_runs)
        result["impls"]["auto fp8"] = dict(timed, max_abs_diff=float((out.float() - ours.float()).abs().max()))
        del leaves
    # "reused": only where the cell ran on a choice another cell's timing made (one that tuned its forward and its
    # backward on its own inputs took the fastest of its candidates by the tuner's measurement, in "tuned").
    retimed = args.candidates == "all" or (args.candidates == "reused" and set(result["tuned"]) != {"fwd", "bwd"})
    if retimed and case.q.is_cuda:
        result["candidates"] = cands = time_candidates(case, args.rep_runs)
        fwd_c = [ms for ms in cands["fwd"].values() if isinstance(ms, float)]
        bwd_c = [ms for ms in cands["bwd"].values() if isinstance(ms, float)]
        if fwd_c and bwd_c:
            result["impls"]["triton best"] = {"fwd_ms": min(fwd_c), "both_ms": min(fwd_c) + min(bwd_c)}
    for name, builder in BASELINES.items():
        if name not in args.baselines:
            continue
        try:
            got = builder(case)
            if isinstance(got, str):
                result["impls"][name] = {"skipped": got}
                continue
            entry, out = time_built(got, args.rep_runs)
            if name != "padded" and name != "flex":
                entry["max_abs_diff"] = float((out.float() - ours.float()).abs().max())
            result["impls"][name] = entry
        except Exception as error:
            lines = [line for line in str(error).strip().splitlines() if line.strip()]
            result["impls"][name] = {"error": f"{type(error).__name__}: {(lines[0] if lines else '')[:200]}"}
        finally:
            gc.collect()
            if case.q.is_cuda:
                torch.cuda.empty_cache()
    for entry in result["impls"].values():
        if "fwd_ms" in entry:
            entry["fwd_tflops"] = fwd_flops / entry["fwd_ms"] / 1e9
            entry["both_tflops"] = (fwd_flops + bwd_flops) / entry["both_ms"] / 1e9
    _ratios(result)
    return result


def _ratios(result: dict) -> None:
    """``x_fwd`` / ``x_both``: the fastest baseline's time over auto's (above 1: auto is faster); and auto's time
    over the best Triton candidate's (``vs_triton_best``)."""
    impls = result["impls"]
    auto = impls["auto"]
    for phase in ("fwd", "both"):
        timed = {n: e[f"{phase}_ms"] for n, e in impls.items() if n in BASELINES and "fwd_ms" in e}
        if timed:
            best = min(timed, key=timed.__getitem__)
            result[f"best_{phase}"] = best
            result[f"x_{phase}"] = timed[best] / auto[f"{phase}_ms"]
        if "triton best" in impls:
            result[f"vs_triton_best_{phase}"] = auto[f"{phase}_ms"] / impls["triton best"][f"{phase}_ms"]
        if "auto fp8" in impls:  # above 1: FP8 is faster than the kit's own bf16 call
            result[f"fp8_x_{phase}"] = auto[f"{phase}_ms"] / impls["auto fp8"][f"{phase}_ms"]


# ----------------------------------------------------------------------------------------------------------------------
# Output


def markdown(results: list[dict], meta: dict) -> str:
    head = (
        "| cell | GFLOP fwd | auto fwd TF/s | best baseline fwd | x fwd | auto f+b TF/s | best baseline f+b "
        "| x f+b | auto / triton best fwd, f+b | chosen fwd / bwd |"
    )
    if any("auto fp8" in r["impls"] for r in results):
        head += " auto FP8 fwd / f+b, x its bf16 |"
    host = any("both_host_ms" in r["impls"]["auto"] for r in results)
    if host:
        head += " auto host ms fwd / f+b (of its ms) |"
    lines = [f"Grid: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, FA4 {meta['fa4']}, "
             f"commit {meta['commit']}, {meta['date']}. Command: `{meta['command']}`", "", head,
             "|" + " --- |" * (head.count("|") - 1)]  # fmt: skip
    for r in results:
        impls = r["impls"]
        auto = impls["auto"]

        def best(phase: str, r: dict = r) -> str:
            name = r.get(f"best_{phase}")
            return "-" if name is None else f"{name} {r['impls'][name][f'{phase}_tflops']:.0f}"

        def ratio(key: str, r: dict = r) -> str:
            return f"{r[key]:.2f}" if key in r else "-"

        vs = f"{ratio('vs_triton_best_fwd')}, {ratio('vs_triton_best_both')}"
        chosen = f"{r['chosen'].get('fwd', '-')} / {r['chosen'].get('bwd', '-')}"
        fp8 = ""
        if "auto fp8" in impls:
            fp8 = (f" fp8 {impls['auto fp8']['fwd_tflops']:.0f} / {impls['auto fp8']['both_tflops']:.0f} TF/s, "
                   f"{ratio('fp8_x_fwd')} / {ratio('fp8_x_both')}x bf16 |")  # fmt: skip
        if host:
            fp8 += (f" {auto['fwd_host_ms']:.3f} / {auto['both_host_ms']:.3f} ({auto['fwd_ms']:.3f} / "
                    f"{auto['both_ms']:.3f}) |" if "both_host_ms" in auto else " - |")  # fmt: skip
        lines.append(
            f"| {r['label']} | {r['fwd_gflop']:.0f} | {auto['fwd_tflops']:.0f} | {best('fwd')} | {ratio('x_fwd')} "
            f"| {auto['both_tflops']:.0f} | {best('both')} | {ratio('x_both')} | {vs} | {chosen} |{fp8}"
        )
    return "\n".join(lines) + "\n"


def summary(results: list[dict]) -> str:
    lines = []
    for phase in ("fwd", "both"):
        xs = [(r[f"x_{phase}"], r["label"]) for r in results if f"x_{phase}" in r]
        if xs:
            worst = min(xs)
            lines.append(
                f"auto / best baseline ({phase}): min {worst[0]:.3f} ({worst[1]}), median "
                f"{statistics.median(x for x, _ in xs):.3f}, cells below 0.97: {sum(x < 0.97 for x, _ in xs)}"
                f" of {len(xs)}"
            )
        vs = [(r[f"vs_triton_best_{phase}"], r["label"]) for r in results if f"vs_triton_best_{phase}" in r]
        if vs:
            worst = max(vs)
            lines.append(
                f"auto / best Triton candidate ({phase}): max {worst[0]:.3f} ({worst[1]}), cells above "
                f"1.05: {sum(x > 1.05 for x, _ in vs)} of {len(vs)}"
            )
    return "\n".join(lines)


def heatmap(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = [r for r in results if not r["cell"]["name"] and r["cell"]["num_segments"] == 0]
    if not grid:
        return
    rows = sorted({r["cell"]["mode"] for r in grid}, key=list(MODES).index)
    cols = sorted(
        {(r["cell"]["lengths"], r["cell"]["heads"], r["cell"]["dim"], r["cell"]["tokens"]) for r in grid},
        key=lambda c: (c[3], list(LENGTHS).index(c[0]) if c[0] in LENGTHS else 9, c[1], c[2]),
    )
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.32 * len(cols) + 3), 2 + 1.1 * len(rows) * 2), squeeze=False)
    for ax, phase in zip(axes[:, 0], ("fwd", "both"), strict=True):
        data = np.full((len(rows), len(cols)), np.nan)
        for r in grid:
            c = r["cell"]
            key = (c["lengths"], c["heads"], c["dim"], c["tokens"])
            if f"x_{phase}" in r:
                data[rows.index(c["mode"]), cols.index(key)] = r[f"x_{phase}"]
        image = ax.imshow(np.log2(data), cmap="RdYlGn", vmin=-2, vmax=2, aspect="auto")
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_xticks(range(len(cols)), [f"{c[0]} {c[1]}x{c[2]}" + (f" {c[3] // 1024}K" if c[3] != cols[0][3] else "")
                                         for c in cols], rotation=90, fontsize=6)  # fmt: skip
        for (i, j), x in np.ndenumerate(data):
            if not np.isnan(x):
                ax.text(j, i, f"{x:.1f}", ha="center", va="center", fontsize=5)
        ax.set_title(f"gdpa auto vs the fastest baseline, {'forward' if phase == 'fwd' else 'forward+backward'} "
                     "(best baseline ms / auto ms)", fontsize=8)  # fmt: skip
        fig.colorbar(image, ax=ax, label="log2 x")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def _meta(args: argparse.Namespace) -> dict:
    from lightning_gem.imports import FA4_AVAILABLE

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"  # fmt: skip
    except OSError:
        commit = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    fa4 = "-"
    if FA4_AVAILABLE:
        from importlib.metadata import version

        fa4 = version("flash-attn-4")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "fa4": fa4, "commit": commit,
            "date": time.strftime("%Y-%m-%d"), "command": "python examples/benchmarks/attention_grid.py " +
            " ".join(sys.argv[1:])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--heads", nargs="+", type=int, default=list(HEADS))
    parser.add_argument("--dims", nargs="+", type=int, default=list(DIMS))
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    parser.add_argument("--tokens", type=int, default=65536, help="tokens a batch (kv tokens for cross modes)")
    parser.add_argument("--long-tokens", type=int, default=262144, help="one row per mode this big (0: none)")
    parser.add_argument("--no-named", dest="named", action="store_false", help="leave out the named workloads")
    parser.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES))
    parser.add_argument("--candidates", nargs="?", const="all", choices=("all", "reused"),
                        help="also time every Triton candidate alone: in every cell, or (reused) in cells that ran "
                        "on a choice tuned on another cell's inputs")  # fmt: skip
    parser.add_argument("--rep-runs", type=int, default=10, help="timed runs a measurement, about")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="stop starting cells after this many seconds (a call runs one cell at least)",
    )
    parser.add_argument("--first-cell", type=int, default=0, help="start at this cell (a slice of a longer run)")
    parser.add_argument("--render", nargs="+", type=Path, default=None, help="only tabulate these grid.json files")
    parser.add_argument("--resume", type=Path, default=None,
                        help="a slices directory: run a slice from the cell after the last one saved there (in a "
                        "subdirectory of its own), then tabulate every slice there as one grid")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny cells, one of each mode (a CPU smoke test)")
    parser.add_argument("--precision", choices=("fp8",), help="also time auto on FP8 codes, against its bf16 call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("attention_grid"))
    args = parser.parse_args()
    if args.quick:
        args.heads, args.dims, args.lengths, args.tokens, args.long_tokens = [2], [16], ["1k"], 384, 0
        args.named, args.rep_runs = False, 4
        LENGTHS["1k"] = (64, "cubic")
    if args.resume is not None:
        done = _slices(args.resume)
        args.first_cell = max((r["index"] for path in done for r in json.loads(path.read_text())["results"]),
                              default=-1) + 1  # fmt: skip
        args.out_dir = args.resume / f"slice_{args.first_cell:04d}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        write_tables(*_saved(args.render), args.out_dir)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = _meta(args)
    print(json.dumps(meta), flush=True)
    cells = grid_cells(args)
    results: list[dict] = []
    start = time.perf_counter()
    for n, cell in enumerate(cells):
        if n < args.first_cell:
            continue
        if args.time_limit and results and time.perf_counter() - start > args.time_limit:  # one cell at least
            print(f"time limit: cells {n}-{len(cells) - 1} not run (go on with --first-cell {n})", flush=True)
            break
        case = make_case(cell, device, args.seed + n)  # seeded by the cell's place: slices repeat one run's inputs
        result = run_cell(case, args)
        result["index"] = n
        results.append(result)
        del case
        line = " ".join(f"{k}={result[k]:.2f}" for k in ("x_fwd", "x_both", "vs_triton_best_fwd",
                                                          "vs_triton_best_both") if k in result)  # fmt: skip
        elapsed = time.perf_counter() - start
        print(f"[{elapsed:6.0f} s] cell {n}: {cell.label}: {line} chosen {result['chosen']}", flush=True)
        (args.out_dir / "grid.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    else:
        if args.resume is not None:
            print("grid done: every cell is in a slice", flush=True)
    if results:
        write_tables(results, meta, args.out_dir)
    if args.resume is not None and _slices(args.resume):
        write_tables(*_saved(_slices(args.resume)), args.resume)


def _slices(directory: Path) -> list[Path]:
    """The ``grid.json`` files of ``--resume``'s slice subdirectories, in cell order."""
    return sorted(directory.glob("slice_*/grid.json")) if directory.is_dir() else []


def _saved(paths: list[Path]) -> tuple[list[dict], dict]:
    """The results of several ``grid.json`` files (slices of one grid) in order, and the first one's meta with
    every slice's command."""
    saved = [json.loads(path.read_text()) for path in paths]
    meta = dict(saved[0]["meta"], command=" ; ".join(s["meta"]["command"] for s in saved))
    return [r for s in saved for r in s["results"]], meta


def write_tables(results: list[dict], meta: dict, out_dir: Path) -> None:
    """``grid.md`` (the table and its summary lines) and ``grid.png`` in ``out_dir``; the summary printed too."""
    (out_dir / "grid.md").write_text(markdown(results, meta) + "\n" + summary(results) + "\n")
    heatmap(results, out_dir / "grid.png")
    print(summary(results))


if __name__ == "__main__":
    main()
