"""Speed and memory of GDPA (``impl="triton"``) against PyTorch baselines on jagged recommendation workloads.

Run on a CUDA machine from the repository root::

    python examples/benchmarks/attention.py                      # every workload
    python examples/benchmarks/attention.py --workloads jagged4k,cross --out attention.md
    python examples/benchmarks/attention.py --device cpu --tiny  # smoke test: tiny sizes, reference impl

Per workload and mode a table compares GDPA with:

- ``flex``: ``torch.compile``d ``flex_attention`` on the packed batch ``[1, H, T_pad, D]`` with the mode's block
  mask built from per-token document ids and positions (block-mask build time is printed under the table, not
  included in the timings);
- ``sdpa padded``: ``scaled_dot_product_attention`` on padded ``[B, H, Lmax, D]`` tensors forced to the flash
  backend (causal), or the efficient backend when a key-padding mask is needed (flash takes no mask);
  BlockAttention on equal-length sequences runs as flash over the blocks laid out as a batch;
- ``sdpa njt``: SDPA on nested jagged tensors (``torch.nested.nested_tensor_from_jagged``), default backend;
- ``eager padded``: for pointwise (SiLU) modes, ``mask * silu(Q K^T * scale) / L @ V`` in plain torch on padded
  tensors.

Times are medians of ``triton.testing.do_bench`` (``time.perf_counter`` on CPU) after a warm-up call; layout
conversions (padding, packing) are done once outside the timings. TFLOP/s count only useful work: allowed
(query, key) pairs of the real (unpadded) tokens (``gdpa_flops``), the same numerator for every impl.
``x`` is ``baseline_ms / gdpa_ms`` (above 1: GDPA is faster). Memory columns: ``in MiB`` the impl's inputs
(and masks) in its own layout; ``fwd MiB`` / ``f+b MiB`` the peak of ``torch.cuda.max_memory_allocated`` during
one call above what was allocated before it (stats reset before the call). ``max|err|`` is the largest
absolute difference of the forward output to GDPA's, on real tokens.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.ops import gdpa_flops

DTYPE = torch.bfloat16
MIB = 2**20
FLEX_PAD = 128
WORKLOAD_NAMES = ("jagged4k", "jagged1k", "cross", "block1k", "block4k", "block16k")
POINTWISE = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid}
COLUMNS = ("impl", "fwd ms", "fwd TF/s", "f+b ms", "f+b TF/s", "in MiB", "fwd MiB", "f+b MiB", "fwd x", "f+b x",
           "max|err|")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    name: str
    q_lengths: Tensor  # [B] int64 on CPU
    kv_lengths: Tensor | None  # [B] int64 on CPU; None: self-attention
    heads: int
    dim: int
    modes: list[tuple[str, dict]]  # (label, gdpa options: activation, causal, block_size)
    seed: int


def _cubic(gen: torch.Generator, n: int, lo: int, hi: int) -> Tensor:
    return (hi * torch.rand(n, generator=gen) ** 3).to(torch.int64).clamp(lo, hi)


def make_workload(name: str, tiny: bool, seed: int) -> Workload:
    seed = seed + WORKLOAD_NAMES.index(name)
    gen = torch.Generator().manual_seed(seed)
    causal = [
        ("softmax causal", dict(activation="softmax", causal=True)),
        ("silu causal", dict(activation="silu", causal=True)),
    ]
    if name == "jagged4k":
        n, hi, lo, heads, dim = (4, 64, 4, 2, 16) if tiny else (64, 4096, 16, 4, 128)
        return Workload(name, _cubic(gen, n, lo, hi), None, heads, dim, causal, seed)
    if name == "jagged1k":
        n, hi, lo, heads, dim = (6, 32, 4, 2, 16) if tiny else (256, 1024, 16, 8, 64)
        return Workload(name, _cubic(gen, n, lo, hi), None, heads, dim, causal, seed)
    if name == "cross":
        users, cands, hi, lo, heads, dim = (4, 4, 32, 4, 2, 16) if tiny else (512, 32, 2048, 16, 4, 128)
        q_lengths = torch.full((users,), cands, dtype=torch.int64)
        modes = [("softmax cross (candidates x history)", dict(activation="softmax", causal=False))]
        return Workload(name, q_lengths, _cubic(gen, users, lo, hi), heads, dim, modes, seed)
    # BlockAttention, block 64, 8 equal-length sequences (so 16x the length is 16x the work).
    block = 8 if tiny else 64
    n, length = {"block1k": (8, 1024), "block4k": (8, 4096), "block16k": (8, 16384)}[name]
    if tiny:
        n, length = {"block1k": (2, 16), "block4k": (2, 32), "block16k": (1, 64)}[name]
    modes = [(f"softmax block {block}", dict(activation="softmax", causal=False, block_size=block))]
    heads, dim = (2, 16) if tiny else (4, 128)
    return Workload(name, torch.full((n,), length, dtype=torch.int64), None, heads, dim, modes, seed)


# ----------------------------------------------------------------------------------------------------------------------
# One (workload, mode) case on the device


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int64)


def _token_ids(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Per token of the packed batch: its segment and its position in the segment (CPU int64)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(int(lengths.sum())) - _offsets(lengths)[:-1][doc]
    return doc, pos


@dataclass
class Case:
    workload: Workload
    label: str
    options: dict
    device: torch.device
    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor
    q_lengths: Tensor
    kv_lengths: Tensor
    q_offsets: Tensor
    kv_offsets: Tensor
    scale: float
    notes: list[str] = field(default_factory=list)

    @property
    def self_attention(self) -> bool:
        return self.workload.kv_lengths is None

    @property
    def activation(self) -> str:
        return self.options["activation"]

    @property
    def causal(self) -> bool:
        return self.options.get("causal", False)

    @property
    def block_size(self) -> int | None:
        return self.options.get("block_size")


def make_case(workload: Workload, label: str, options: dict, device: torch.device) -> Case:
    torch.manual_seed(workload.seed)
    kv_lengths = workload.q_lengths if workload.kv_lengths is None else workload.kv_lengths
    tq, tk = int(workload.q_lengths.sum()), int(kv_lengths.sum())
    h, d = workload.heads, workload.dim
    q = torch.randn(tq, h, d, device=device, dtype=DTYPE)
    k = torch.randn(tk, h, d, device=device, dtype=DTYPE)
    v = torch.randn(tk, h, d, device=device, dtype=DTYPE)
    grad_out = torch.randn(tq, h, d, device=device, dtype=DTYPE)
    q_offsets = _offsets(workload.q_lengths).to(device)
    kv_offsets = q_offsets if workload.kv_lengths is None else _offsets(kv_lengths).to(device)
    return Case(workload, label, options, device, q, k, v, grad_out, workload.q_lengths, kv_lengths, q_offsets,
                kv_offsets, 1.0 / math.sqrt(d))  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Implementations: each builder returns an Impl, or a string saying why it does not apply ("n/a ...").


@dataclass
class Impl:
    inputs: tuple[Tensor, Tensor, Tensor]  # q, k, v in the impl's own layout
    call: Callable[[Tensor, Tensor, Tensor], Tensor]
    grad_out: Tensor  # in the output's layout
    unpack: Callable[[Tensor], Tensor]  # output -> [Tq, H, Dv] on real tokens
    extra: tuple[Tensor, ...] = ()  # masks and other tensors the impl holds


def build_gdpa(case: Case, impl: str, deterministic: bool = False) -> Impl:
    kv_offsets = None if case.self_attention else case.kv_offsets
    options = dict(case.options, scale=case.scale, max_seq_len_q=int(case.q_lengths.max()),
                   max_seq_len_kv=int(case.kv_lengths.max()), impl=impl, deterministic=deterministic)  # fmt: skip
    gdpa(case.q, case.k, case.v, case.q_offsets, kv_offsets, **options)  # validates the offsets once

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return gdpa(q, k, v, case.q_offsets, kv_offsets, **options, check_offsets=False)

    return Impl((case.q, case.k, case.v), call, case.grad_out, lambda out: out)


_FLEX: Callable | None = None


def build_flex(case: Case) -> Impl | str:
    if case.device.type != "cuda":
        return "n/a (needs CUDA)"
    if case.activation != "softmax":
        return "n/a (flex_attention always normalises with softmax; no pointwise activation)"
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    flex = _FLEX
    dev = case.device
    tq, tk = case.q.shape[0], case.k.shape[0]
    pad_q, pad_k = -(-tq // FLEX_PAD) * FLEX_PAD, -(-tk // FLEX_PAD) * FLEX_PAD

    def ids(lengths: Tensor, padded: int) -> tuple[Tensor, Tensor]:
        doc, pos = _token_ids(lengths)
        fill = torch.full((padded - len(doc),), -1, dtype=torch.int64)
        return torch.cat([doc, fill]).to(dev), torch.cat([pos, fill]).to(dev)

    q_doc, q_pos = ids(case.q_lengths, pad_q)
    kv_doc, kv_pos = ids(case.kv_lengths, pad_k)
    causal, block = case.causal, case.block_size
    if causal and not case.self_attention:
        return "n/a (cross-attention causal alignment not built for flex here)"

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_doc[q_idx] == kv_doc[kv_idx]
        if causal:
            allowed = allowed & (q_pos[q_idx] >= kv_pos[kv_idx])
        if block is not None:
            allowed = allowed & (q_pos[q_idx] // block == kv_pos[kv_idx] // block)
        return allowed

    def build() -> object:
        try:
            with warnings.catch_warnings():  # torch 2.11 deprecates _compile= but it still compiles the build
                warnings.simplefilter("ignore", DeprecationWarning)
                return create_block_mask(mask_mod, 1, 1, pad_q, pad_k, device=dev, _compile=True)
        except TypeError:
            return create_block_mask(mask_mod, 1, 1, pad_q, pad_k, device=dev)

    start = time.perf_counter()
    block_mask = build()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    rebuild_ms = _bench_cuda(build, None, 50)
    case.notes.append(
        f"flex block mask ({pad_q} x {pad_k}): first build {first_ms:.1f} ms (incl. compile), "
        f"rebuild {rebuild_ms:.3f} ms; not in the flex timings"
    )

    def to_flex(t: Tensor, padded: int) -> Tensor:
        t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
        return t.transpose(0, 1).unsqueeze(0).contiguous()

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex(q, k, v, block_mask=block_mask, scale=case.scale)

    inputs = (to_flex(case.q, pad_q), to_flex(case.k, pad_k), to_flex(case.v, pad_k))
    return Impl(inputs, call, to_flex(case.grad_out, pad_q), lambda out: out[0].transpose(0, 1)[:tq])


def _pad(x: Tensor, lengths: Tensor) -> Tensor:
    """Packed ``[T, H, D]`` -> padded ``[B, H, Lmax, D]`` (zeros after each sequence)."""
    doc, pos = _token_ids(lengths)
    out = x.new_zeros(len(lengths), int(lengths.max()), *x.shape[1:])
    out[doc.to(x.device), pos.to(x.device)] = x
    return out.transpose(1, 2).contiguous()


def _unpad(y: Tensor, lengths: Tensor) -> Tensor:
    doc, pos = _token_ids(lengths)
    return y.transpose(1, 2)[doc.to(y.device), pos.to(y.device)]


def build_sdpa_padded(case: Case) -> Impl | str:
    if case.device.type != "cuda":
        return "n/a (flash backend needs CUDA)"
    if case.activation != "softmax":
        return "n/a (SDPA is softmax-only)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = case.scale
    if case.block_size is not None:
        block = case.block_size
        lengths = case.q_lengths
        if case.causal or bool((lengths != lengths[0]).any()) or int(lengths[0]) % block:
            return "n/a (blocks as batch needs equal lengths that are multiples of the block, non-causal)"
        # BlockAttention on equal-length sequences is exactly flash attention over [T / block, H, block, D].
        tq, h, d = case.q.shape

        def to_blocks(t: Tensor) -> Tensor:
            return t.reshape(tq // block, block, h, t.shape[-1]).transpose(1, 2).contiguous()

        def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)

        case.notes.append("sdpa padded: flash over the blocks laid out as a batch [T/block, H, block, D]")
        inputs = (to_blocks(case.q), to_blocks(case.k), to_blocks(case.v))
        return Impl(inputs, call, to_blocks(case.grad_out), lambda out: out.transpose(1, 2).reshape(tq, h, -1))

    q_lengths, kv_lengths = case.q_lengths, case.kv_lengths
    inputs = (_pad(case.q, q_lengths), _pad(case.k, kv_lengths), _pad(case.v, kv_lengths))
    grad_out = _pad(case.grad_out, q_lengths)
    if case.self_attention:
        if not case.causal:
            return "n/a (non-causal padded self-attention needs a key-padding mask; not in these workloads)"
        # Causal + padding at the end: real queries never see padded keys, so no mask is needed.

        def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        case.notes.append("sdpa padded: flash backend, is_causal=True, padding excluded from timing")
        return Impl(inputs, call, grad_out, lambda out: _unpad(out, q_lengths))
    if case.causal:
        return "n/a (causal cross-attention with padding not built here)"
    lk = int(kv_lengths.max())
    key_mask = (torch.arange(lk) < kv_lengths[:, None]).to(case.device)[:, None, None, :]  # [B, 1, 1, Lk]

    def call_masked(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale)

    case.notes.append(
        "sdpa padded: EFFICIENT_ATTENTION backend with a boolean key-padding mask "
        "(the flash backend takes no attn_mask)"
    )
    return Impl(inputs, call_masked, grad_out, lambda out: _unpad(out, q_lengths), (key_mask,))


def build_sdpa_njt(case: Case) -> Impl | str:
    if case.activation != "softmax":
        return "n/a (SDPA is softmax-only)"
    if case.block_size is not None:
        return "n/a (nested jagged SDPA takes no attn_mask, so no block mask)"
    if case.causal and not case.self_attention:
        return "n/a (causal cross-attention on NJT not built here)"
    if case.causal and case.device.type != "cuda":
        return "n/a (on CPU NJT SDPA has only the math backend, which rejects is_causal=True)"
    q_off, kv_off = case.q_offsets, case.kv_offsets
    q_max, kv_max = int(case.q_lengths.max()), int(case.kv_lengths.max())
    q_min, kv_min = int(case.q_lengths.min()), int(case.kv_lengths.min())
    causal, scale = case.causal, case.scale

    def nest(t: Tensor, offsets: Tensor, lo: int, hi: int) -> Tensor:
        return torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=lo, max_seqlen=hi).transpose(1, 2)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(
            nest(q, q_off, q_min, q_max), nest(k, kv_off, kv_min, kv_max), nest(v, kv_off, kv_min, kv_max),
            is_causal=causal, scale=scale,
        )  # fmt: skip
        return out.transpose(1, 2).values()

    return Impl((case.q, case.k, case.v), call, case.grad_out, lambda out: out)


def build_eager_padded(case: Case) -> Impl | str:
    if case.activation == "softmax":
        return None  # only for pointwise modes: not a row
    act = POINTWISE[case.activation]
    q_lengths, kv_lengths = case.q_lengths, case.kv_lengths
    lq, lk = int(q_lengths.max()), int(kv_lengths.max())
    i = torch.arange(lq)[:, None]
    t = torch.arange(lk)[None, :]
    allowed = (t < kv_lengths[:, None, None]) & (i < q_lengths[:, None, None])  # [B, Lq, Lk]
    if case.causal:
        if not case.self_attention:
            return "n/a (causal cross-attention not built here)"
        allowed = allowed & (t <= i)
    if case.block_size is not None:
        allowed = allowed & (i // case.block_size == t // case.block_size)
    mask = allowed[:, None].to(case.device)  # [B, 1, Lq, Lk]
    norm = kv_lengths.clamp(min=1).to(case.device, DTYPE)[:, None, None, None]
    scale = case.scale

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        return torch.matmul(torch.where(mask, act(scores), 0), v) / norm

    case.notes.append(f"eager padded: where(mask, {case.activation}(QK^T*scale), 0) @ V / L on [B, H, Lmax, D], bf16")
    inputs = (_pad(case.q, q_lengths), _pad(case.k, kv_lengths), _pad(case.v, kv_lengths))
    return Impl(inputs, call, _pad(case.grad_out, q_lengths), lambda out: _unpad(out, q_lengths), (mask, norm))


# ----------------------------------------------------------------------------------------------------------------------
# Measurement


def _bench_cuda(fn: Callable, grad_to_none: list[Tensor] | None, rep: int) -> float:
    import triton.testing

    return triton.testing.do_bench(
        fn, warmup=max(rep // 3, 10), rep=rep, grad_to_none=grad_to_none, return_mode="median"
    )


def _bench_cpu(fn: Callable, grad_to_none: list[Tensor] | None, repeats: int = 11) -> float:
    times = []
    for _ in range(repeats):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _peak_mib(fn: Callable, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


@dataclass
class Result:
    name: str
    fwd_ms: float
    both_ms: float
    in_mib: float
    fwd_mib: float | None
    both_mib: float | None
    err: float | None
    out: Tensor | None = None


def measure(case: Case, name: str, impl: Impl, rep: int, reference: Tensor | None) -> Result:
    device = case.device
    bench = (lambda fn, grads: _bench_cuda(fn, grads, rep)) if device.type == "cuda" else _bench_cpu
    inputs = impl.inputs
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def fwd() -> Tensor:
        return impl.call(*inputs)

    def both() -> None:
        impl.call(*leaves).backward(impl.grad_out)

    out = fwd()  # warm-up (compiles)
    both()
    _sync(device)
    got = impl.unpack(out).detach()
    err = None if reference is None else float((got.float() - reference.float()).abs().max())
    del out
    fwd_ms = bench(fwd, None)
    both_ms = bench(both, leaves)
    fwd_mib = _peak_mib(fwd, device)
    for t in leaves:
        t.grad = None
    both_mib = _peak_mib(both, device)
    in_mib = sum(t.numel() * t.element_size() for t in (*inputs, *impl.extra)) / MIB
    return Result(name, fwd_ms, both_ms, in_mib, fwd_mib, both_mib, err, got if reference is None else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _short(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"error: {type(error).__name__}: {text[:200]}"


def run_case(case: Case, gdpa_impl: str, rep: int) -> tuple[list[list[str]], int, int, dict[str, Result]]:
    """Measure every impl on one case; returns the table rows, the useful forward / backward FLOPs and the
    results by impl name."""
    flops_kwargs = dict(causal=case.causal, window=None, block_size=case.block_size)
    jag = (case.q_offsets, case.kv_offsets, None, None)
    fwd_flops = gdpa_flops(case.q, case.k, case.v, *jag, **flops_kwargs)
    bwd_flops = gdpa_flops(case.q, case.k, case.v, *jag, **flops_kwargs, backward=True)
    builders: list[tuple[str, Callable[[Case], Impl | str | None]]] = [
        (f"gdpa {gdpa_impl}", lambda c: build_gdpa(c, gdpa_impl)),
        ("gdpa deterministic", lambda c: build_gdpa(c, gdpa_impl, True) if gdpa_impl == "triton" else None),
        ("flex", build_flex),
        ("sdpa padded", build_sdpa_padded),
        ("sdpa njt", build_sdpa_njt),
        ("eager padded", build_eager_padded),
    ]
    rows: list[list[str]] = []
    results: dict[str, Result] = {}
    base: Result | None = None
    reference: Tensor | None = None
    for name, builder in builders:
        try:
            impl = builder(case)
            if impl is None:
                continue
            if isinstance(impl, str):
                rows.append([name, impl])
                continue
            result = measure(case, name, impl, rep, reference)
            del impl
        except Exception as error:
            rows.append([name, _short(error)])
            if name == f"gdpa {gdpa_impl}":
                base = None
            _free(case.device)
            continue
        if name == f"gdpa {gdpa_impl}":
            base, reference = result, result.out
            result.out = None
        results[name] = result
        rows.append(_row(result, base, fwd_flops, bwd_flops))
        _free(case.device)
        print(f"    {name}: fwd {result.fwd_ms:.3f} ms, fwd+bwd {result.both_ms:.3f} ms", file=sys.stderr, flush=True)
    return rows, fwd_flops, bwd_flops, results


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _tflops(flops: int, ms: float) -> str:
    value = flops / ms / 1e9
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _row(r: Result, base: Result | None, fwd_flops: int, bwd_flops: int) -> list[str]:
    return [
        r.name,
        _fmt(r.fwd_ms),
        _tflops(fwd_flops, r.fwd_ms),
        _fmt(r.both_ms),
        _tflops(fwd_flops + bwd_flops, r.both_ms),
        _fmt(r.in_mib, ".1f"),
        _fmt(r.fwd_mib, ".1f"),
        _fmt(r.both_mib, ".1f"),
        "-" if base is None else f"{r.fwd_ms / base.fwd_ms:.2f}",
        "-" if base is None else f"{r.both_ms / base.both_ms:.2f}",
        "ref" if base is r else _fmt(r.err, ".2e"),
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Output


def text_table(rows: list[list[str]]) -> str:
    full = [r for r in rows if len(r) == len(COLUMNS)]
    widths = [max(len(c), *(len(r[j]) for r in full)) if full else len(c) for j, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(COLUMNS, widths, strict=True)))]
    for r in rows:
        if len(r) == len(COLUMNS):
            lines.append(
                "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
            )
        else:
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    for r in rows:
        cells = r if len(r) == len(COLUMNS) else [r[0], r[1].replace("|", "/")] + [""] * (len(COLUMNS) - 2)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(device: torch.device) -> list[str]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"none (cpu: {platform.processor() or '?'})"
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"gpu: {gpu}",
        f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton_version}, "
        f"python {platform.python_version()}",
        f"command: {command}",
    ]


def _copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in TB/s (bytes read + written) on 1 GiB, the ceiling for memory-bound work."""
    if device.type != "cuda":
        return None
    buffers = [torch.empty(2**29, dtype=torch.bfloat16, device=device) for _ in range(2)]
    ms = _bench_cuda(lambda: buffers[1].copy_(buffers[0]), None, 50)
    buffers.clear()
    _free(device)
    return 2 * 2**30 / ms / 1e9


def _summary(sections: list[dict], gdpa_impl: str) -> list[str]:
    """GDPA per case: forward and forward+backward against flex, TFLOP/s, backward / forward; block scaling."""
    lines = ["## Summary", "", "| case | fwd ms | f+b ms | fwd TF/s | bwd / fwd | fwd x flex | f+b x flex |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    block_fwd: dict[int, float] = {}
    for section in sections:
        ours, flex = section["results"].get(f"gdpa {gdpa_impl}"), section["results"].get("flex")
        if ours is None:
            continue
        fwd_x = "-" if flex is None else f"{flex['fwd_ms'] / ours['fwd_ms']:.2f}"
        both_x = "-" if flex is None else f"{flex['both_ms'] / ours['both_ms']:.2f}"
        ratio = (ours["both_ms"] - ours["fwd_ms"]) / ours["fwd_ms"]
        tflops = _tflops(section["fwd_flops"], ours["fwd_ms"])
        lines.append(
            f"| {section['title'].split(' | ')[0]} | {ours['fwd_ms']:.3f} | {ours['both_ms']:.3f} | "
            f"{tflops} | {ratio:.2f} | {fwd_x} | {both_x} |"
        )
        if section["block_size"] is not None:
            block_fwd[section["max_len"]] = ours["fwd_ms"]
    if len(block_fwd) > 1:
        shortest, longest = min(block_fwd), max(block_fwd)
        growth = block_fwd[longest] / block_fwd[shortest]
        lines += ["", f"BlockAttention forward, {longest} vs {shortest} tokens per sequence (same batch): "
                  f"{longest // shortest}x the length, {growth:.2f}x the time"]  # fmt: skip
    return lines


def run_workload(name: str, args: argparse.Namespace, device: torch.device, copy_tbs: float | None) -> list[dict]:
    """Every mode of workload ``name``: one section each (title, table rows, notes, FLOPs, results)."""
    gdpa_impl = "triton" if device.type == "cuda" else "reference"
    workload = make_workload(name, args.tiny, args.seed)
    sections = []
    for label, options in workload.modes:
        case = make_case(workload, label, options, device)
        lengths = workload.q_lengths
        kv = "" if workload.kv_lengths is None else (
            f", kv {int(workload.kv_lengths.sum())} tokens (max {int(workload.kv_lengths.max())})")  # fmt: skip
        title = (
            f"{name}: {label} | {len(lengths)} segments, {int(lengths.sum())} q tokens "
            f"(max {int(lengths.max())}){kv}, H={workload.heads}, D={workload.dim}, bf16"
        )
        case_start = time.perf_counter()
        if device.type == "cuda":
            from lightning_gem.ops.attention.impl.triton._tuning import chosen_tiles

            chosen_before = chosen_tiles()
        try:
            rows, fwd_flops, bwd_flops, results = run_case(case, gdpa_impl, args.rep)
        except Exception as error:
            rows, fwd_flops, bwd_flops, results = [["(case)", _short(error)]], 0, 0, {}
        gdpa_result = results.get(f"gdpa {gdpa_impl}")
        if case.block_size is not None and gdpa_result is not None and copy_tbs:
            moved = sum(t.numel() * t.element_size() for t in (case.q, case.k, case.v, case.q))  # Q, K, V, O
            tbs = moved / gdpa_result.fwd_ms / 1e9
            case.notes.append(
                f"forward moves Q, K, V, O ({moved / 1e6:.1f} MB) at {tbs:.2f} TB/s = "
                f"{100 * tbs / copy_tbs:.0f}% of the measured copy bandwidth "
                f"({copy_tbs:.2f} TB/s)"
            )
        if device.type == "cuda":
            for key, tiles in chosen_tiles().items():
                if key not in chosen_before:
                    which = key[0] if key[0] == "fwd" else f"{key[0]} ({'deterministic' if key[1] else 'default'})"
                    case.notes.append(f"tuned {which}: {tiles}")
        notes = [f"useful GFLOP: fwd {fwd_flops / 1e9:.4g}, bwd {bwd_flops / 1e9:.4g}", *case.notes]
        sections.append(dict(
            title=title, rows=rows, notes=notes, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
            results={n: {k: v for k, v in vars(r).items() if k != "out"} for n, r in results.items()},
            block_size=case.block_size, max_len=int(lengths.max()), seconds=time.perf_counter() - case_start,
        ))  # fmt: skip
        del case
        _free(device)
    return sections


def _print_section(section: dict) -> list[str]:
    """Print one section's table and notes; return its Markdown."""
    print(f"\n== {section['title']} ==")
    print(text_table(section["rows"]))
    for note in section["notes"]:
        print(f"  {note}")
    print(f"  [{section['seconds']:.1f} s]", flush=True)
    return [f"## {section['title']}", "", markdown_table(section["rows"]), "", *[f"- {n}" for n in section["notes"]],
            ""]  # fmt: skip


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    while not path.exists() and process.poll() is None:
        time.sleep(0.1)


def _worker(args: argparse.Namespace, device: torch.device) -> None:
    """One workload in its own process: a warm-up pass (compiles; runs alongside the other workers), then,
    once the parent says go, the timed pass alone on the device; sections go to ``<dir>/<name>.json``."""
    folder, (name,) = Path(args.worker_dir), args.workloads.split(",")
    warm = argparse.Namespace(**{**vars(args), "rep": 1})
    run_workload(name, warm, device, None)
    # The warm-up shared the device with the other workers: keep the compiled kernels, time the tiles again alone.
    from lightning_gem.ops.attention.impl.triton._tuning import forget_choices

    forget_choices()
    (folder / f"{name}.ready").touch()
    while not (folder / f"{name}.go").exists():
        time.sleep(0.05)
    sections = run_workload(name, args, device, args.copy_tbs)
    (folder / f"{name}.json").write_text(json.dumps(sections))


def _parallel(names: list[str], args: argparse.Namespace, copy_tbs: float | None) -> Iterator[dict]:
    """Workers compile every workload at once, then time one workload at a time (nothing else on the device);
    yields each workload's sections as its worker finishes."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = [sys.executable, __file__, "--device", args.device, "--rep", str(args.rep), "--seed", str(args.seed),
                "--worker-dir", tmp, "--copy-tbs", str(copy_tbs or 0.0)]  # fmt: skip
        base += ["--tiny"] if args.tiny else []
        workers = {name: subprocess.Popen([*base, "--workloads", name]) for name in names}
        for name, process in workers.items():
            _wait_for(folder / f"{name}.ready", process)
        for name, process in workers.items():
            (folder / f"{name}.go").touch()
            process.wait()
            result = folder / f"{name}.json"
            if result.exists():
                yield from json.loads(result.read_text())
            else:
                title = f"{name}: worker failed (exit {process.returncode})"
                failed = dict(title=title, rows=[], notes=[], fwd_flops=0, bwd_flops=0, results={}, block_size=None,
                              max_len=0, seconds=0.0)  # fmt: skip
                yield failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = ", ".join(WORKLOAD_NAMES)
    parser.add_argument("--workloads", default="all", help=f"comma-separated from {choices}, 'block' or 'all'")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--rep", type=int, default=75, help="do_bench rep in ms (default 75)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the tables as Markdown to this file")
    parser.add_argument("--parallel-compile", action="store_true",
                        help="one process per workload compiles at once; timing still runs one at a time")  # fmt: skip
    parser.add_argument("--worker-dir", help=argparse.SUPPRESS)
    parser.add_argument("--copy-tbs", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()

    names: list[str] = []
    for item in args.workloads.split(","):
        item = item.strip()
        expanded = WORKLOAD_NAMES if item == "all" else [n for n in WORKLOAD_NAMES if n.startswith("block")] \
            if item == "block" else [item]  # fmt: skip
        for n in expanded:
            if n not in WORKLOAD_NAMES:
                parser.error(f"unknown workload {n!r}; choose from {WORKLOAD_NAMES}")
            if n not in names:
                names.append(n)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu --tiny")
    gdpa_impl = "triton" if device.type == "cuda" else "reference"
    for key in ("recompile_limit", "cache_size_limit"):  # flex recompiles once per workload shape
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    if args.worker_dir:
        _worker(args, device)
        return

    start = time.perf_counter()
    top = header(device)
    print("\n".join(top), flush=True)
    legend = (
        "x = baseline ms / gdpa ms (>1: GDPA faster); TF/s = useful (unpadded, allowed-pair) FLOPs / time; "
        "MiB = peak above pre-call allocation; in MiB = inputs + masks in the impl's layout"
    )
    print(legend)
    md = ["# GDPA attention benchmark", "", *[f"- {line}" for line in top], f"- {legend}", ""]
    copy_tbs = _copy_bandwidth(device)
    sections = []
    if args.parallel_compile:
        produced = _parallel(names, args, copy_tbs)
    else:
        produced = (section for name in names for section in run_workload(name, args, device, copy_tbs))
    for section in produced:
        md += _print_section(section)
        sections.append(section)
    summary = _summary(sections, gdpa_impl)
    print("\n" + "\n".join(summary))
    md += summary
    total = f"total {time.perf_counter() - start:.1f} s"
    print(f"\n{total}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join([*md, "", total, ""]))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
