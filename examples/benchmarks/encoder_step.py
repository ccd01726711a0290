"""The HSTU encoder's training step: kernels launched, host time and device time, per norm and compile variant.

A step of ``JaggedHistoryEncoder`` (the GEM example's history encoder) trains on one rank's share of
long-tailed users: forward under bf16 autocast (CUDA), a scalar loss, backward. Variants:

- ``torch-norm``: the layers' norms as ``torch.nn.RMSNorm``. Under autocast they get bf16 inputs with fp32
  weights, and ``torch.rms_norm`` then runs its unfused composite;
- ``unfused``: the kit's :class:`~lightning_gem.components.encoder.RMSNorm` (what ``make_norm`` builds),
  whose weight follows its input's dtype so the fused kernel runs, and PyTorch's unfused ops around the attention
  (``pointwise_impl="reference"``: ``F.silu``, a split into strided views, the norm, then the gating product);
- ``kit-norm``: the same with the kit's fused SiLU-split and norm-gate kernels (:mod:`lightning_gem.ops.pointwise`,
  the layers' default on CUDA);
- ``compiled``: ``kit-norm`` with each layer ``torch.compile`` d (``dynamic=True``: one graph for every
  jagged size).

Per variant and share: the step's median time (CUDA events; CPU: wall clock), the host time to issue it
(the call's wall clock before the device is waited on; equal to the step time when the host is the bound),
and from ``torch.profiler`` the kernels one step launches and the device time they take. A step whose
kernels keep the device busy for much less than the step's length is bound by host time.

Usage:
    python examples/benchmarks/encoder_step.py                      # CUDA, the GEM example's encoder
    python examples/benchmarks/encoder_step.py --device cpu --dim 32 --num-layers 2 --batch-size 4 \\
        --max-history-length 64 --reps 1 --variants torch-norm kit-norm   # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gem_example import cprofile_table, device_kernels
from lightning_gem.components.encoder import JaggedHistoryEncoder, RMSNorm
from torch import nn

VARIANTS = ("torch-norm", "unfused", "kit-norm", "compiled")


def build(variant: str, args: argparse.Namespace, device: torch.device) -> JaggedHistoryEncoder:
    """The encoder of ``variant`` (the same initial weights for every variant)."""
    torch.manual_seed(0)
    encoder = JaggedHistoryEncoder(
        input_dim=None,
        dim=args.dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        max_length=args.max_history_length,
    ).to(device)
    if variant in ("torch-norm", "unfused"):
        for layer in encoder.layers:
            layer.pointwise_impl = "reference"
    if variant == "torch-norm":
        for module in encoder.modules():
            if type(module) is RMSNorm:
                module.__class__ = nn.RMSNorm
    if variant == "compiled":
        for layer in encoder.layers:
            layer.compile(dynamic=True)
    return encoder


def profile_step(step: Callable[[], None], device: torch.device) -> tuple[int, float]:
    """``(kernels launched, ms of device time they took)`` in one call of ``step`` (zeros on CPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels = device_kernels(prof)
    return len(kernels), sum(e.device_time for e in kernels) / 1e3


def time_step(step: Callable[[], None], device: torch.device, reps: int) -> tuple[float, float]:
    """Median ``(step ms, host ms)`` over ``reps`` calls, each started on an idle device."""
    cuda = device.type == "cuda"
    step_ms, host_ms = [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - started) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            step_ms.append(start.elapsed_time(end))
        else:
            step_ms.append(host_ms[-1])
    return statistics.median(step_ms), statistics.median(host_ms)


def host_profile(step: Callable[[], None], device: torch.device, steps: int, label: str) -> None:
    """Print the 25 functions with the most own host time over ``steps`` steps (cProfile), and the 25 with the most
    time with callees: where a host-bound step's time goes."""
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    print(cprofile_table(profiler, f"{label}: cProfile over {steps} steps", rows=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=32, help="users in a share")
    parser.add_argument("--shares", type=int, default=2, help="shares of random users timed per variant")
    parser.add_argument("--max-history-length", type=int, default=4096, help="lengths clip(L u^3, 16, L)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="print the host functions with the most own time over "
        "N steps of each variant's first share (Python's cProfile)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    top = args.max_history_length
    shares = [np.clip((top * rng.random(args.batch_size) ** 3).astype(int), 16, top) for _ in range(args.shares)]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"JaggedHistoryEncoder dim {args.dim} x {args.num_layers} layers x {args.num_heads} heads, "
        f"{args.batch_size} users a share, histories clip({top} u^3, 16, {top}), on {name}"
    )
    header = f"{'variant':<11} {'tokens':>7} | {'step ms':>8} {'host ms':>8} | {'kernels':>7} {'device ms':>9}"
    print(f"{header} | warm-up s")
    results = []
    for variant in args.variants:
        encoder = build(variant, args, device)
        for lengths in shares:
            offsets = torch.tensor(np.r_[0, np.cumsum(lengths)], device=device)
            x = torch.randn(int(lengths.sum()), args.dim, device=device, requires_grad=True)
            longest = int(lengths.max())

            def step(
                encoder: nn.Module = encoder,
                x: torch.Tensor = x,
                offsets: torch.Tensor = offsets,
                longest: int = longest,
            ) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    y = encoder(x, offsets, max_seq_len=longest, check_offsets=False)
                y.float().square().mean().backward()

            started = time.perf_counter()
            for _ in range(args.warmup):  # compiles, tunes kernels, fills the allocator
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            warmup_s = time.perf_counter() - started
            step_ms, host_ms = time_step(step, device, args.reps)
            kernels, device_ms = profile_step(step, device)
            if args.cprofile and lengths is shares[0]:
                host_profile(step, device, args.cprofile, variant)
            row = dict(variant=variant, tokens=int(lengths.sum()), step_ms=step_ms, host_ms=host_ms)
            results.append({**row, "kernels": kernels, "device_ms": device_ms, "warmup_s": warmup_s})
            print(
                f"{variant:<11} {row['tokens']:>7} | {step_ms:>8.2f} {host_ms:>8.2f} | {kernels:>7} "
                f"{device_ms:>9.2f} | {warmup_s:.1f}"
            )
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
