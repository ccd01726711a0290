"""The slowest of N simulated data-parallel ranks, with and without Base Batch Shuffling, on one device.

A synchronous data-parallel step lasts as long as its slowest rank (the gradient all-reduce waits for
it). This script takes the first global batches of an epoch of long-tailed synthetic GEM data
(``num_ranks x batch_size`` users each), splits each global batch across the ranks twice, as a plain
``DistributedSampler`` does and as :class:`~lightning_gem.data.balancing.BalancedDistributedSampler`
does (the same set of users per global batch, so the same averaged gradient), and runs every rank's
share in turn on the one device: a training step of the GEM example model (``GEMRanker``: torchrec
embeddings, HSTU encoder, GDPA candidate interaction, multi-task head; forward + backward + AdamW,
bf16 autocast on CUDA). Each share is timed with CUDA events (CPU: ``perf_counter``), median of
``--reps`` runs after a warm-up. Reported per global batch: the slowest rank, the mean rank, and over
all batches the ratio plain / balanced of the mean slowest-rank time (the speed-up of a real N-rank
step, all-reduce excluded, which is the same in both). A least-squares fit ``ms = fixed + slope *
cost`` over all shares says how much of a step is per-step overhead that no balancing can even out
(launches, host syncs, optimizer): balancing pays in proportion to the cost-dependent part.

Usage:
    python examples/benchmarks/balance_ranks.py                      # CUDA if present, GEM example size
    python examples/benchmarks/balance_ranks.py --device cpu --max-history-length 128 --batch-size 4 \\
        --model-dim 32 --num-batches 2 --reps 1                      # a smoke run on CPU
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
import torch.nn.functional as F
from gem_example import device_kernels
from lightning_gem.components import GEMRanker
from torch.utils.data import DistributedSampler

from lightning_gem.data import SyntheticRankingSource
from lightning_gem.data.balancing import AttentionCostModel, BalancedDistributedSampler
from lightning_gem.flops import attention_cost_coefficients


def _rank_shares(
    lengths: np.ndarray, num_ranks: int, batch_size: int, num_batches: int, balanced: bool, cost_model: Callable
) -> list[list[list[int]]]:
    """``[num_batches][num_ranks]`` index lists: each rank's share of each of the first global batches."""
    shares = []
    for rank in range(num_ranks):
        if balanced:
            sampler = BalancedDistributedSampler(
                lengths, batch_size, num_ranks, rank, seed=0, drop_last=True, cost_model=cost_model
            )
        else:
            sampler = DistributedSampler(range(len(lengths)), num_ranks, rank, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(0)
        order = list(sampler)
        shares.append([order[b * batch_size : (b + 1) * batch_size] for b in range(num_batches)])
    return [[shares[rank][b] for rank in range(num_ranks)] for b in range(num_batches)]


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """``time(fn) -> ms`` of one call, synchronised (CUDA events on GPU)."""

    def cuda_time(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_time(fn: Callable[[], None]) -> float:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3

    return cuda_time if device.type == "cuda" else cpu_time


def _device_busy(fn: Callable[[], None], time_ms: Callable[[Callable[[], None]], float]) -> tuple[float, float, int]:
    """``(step ms, ms of device kernels in it, kernels launched)`` of one call of ``fn``, by ``torch.profiler``: a
    step that keeps the device busy far less than its length is bound by host time, which balancing cannot even
    out. Prints the kernels that took longest."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        wall = time_ms(fn)
    kernels = device_kernels(prof)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    for name, times in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]:
        print(f"  {sum(times) / 1e3:8.2f} ms {len(times):5d}x  {name[:100]}")
    return wall, sum(e.device_time for e in kernels) / 1e3, len(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-ranks", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="users per rank per step")
    parser.add_argument("--num-batches", type=int, default=6, help="global batches measured")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per rank share (median)")
    parser.add_argument("--max-history-length", type=int, default=4096, help="lengths clip(L u^3, 16, L)")
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--profile", action="store_true", help="also print how busy the device is in the lightest and heaviest share"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    num_users = args.num_ranks * args.batch_size * args.num_batches
    source = SyntheticRankingSource(
        num_items=20_000,
        num_train_users=num_users,
        num_val_users=1,
        num_test_users=1,
        min_history_length=16,
        max_history_length=args.max_history_length,
        mean_candidates=16.0,
        max_candidates=64,
        seed=0,
    )
    dataset, lengths = source.dataset("train"), source.sample_lengths("train")
    model = GEMRanker(
        source.schema,
        embedding_dim=64,
        model_dim=args.model_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_hidden_dims=(256,),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The cost model of this encoder's FLOPs (the interaction and embeddings are linear in the batch).
    a, b = attention_cost_coefficients(args.model_dim, args.num_layers, num_heads=args.num_heads)
    cost_model = AttentionCostModel(a=a, b=b)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch) -> None:
        with autocast:
            logits = model(batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    time_ms = _timer(device)

    def measure(ranks: list[list[int]]) -> dict[str, object]:
        """Warm up and time every rank's share of one global batch split."""
        batches = [source.collate([dataset[i] for i in share]).to(device) for share in ranks]
        for batch in batches:  # warm-up: autotune / allocator at every shape of this global batch
            step(batch)
        rep_ms = [[time_ms(lambda b=batch: step(b)) for _ in range(args.reps)] for batch in batches]
        rank_ms = [statistics.median(reps) for reps in rep_ms]
        costs = [float(cost_model(lengths[share]).sum()) for share in ranks]
        return {
            "rank_ms": rank_ms,
            "rep_ms": rep_ms,
            "rank_cost": costs,
            "slowest_ms": max(rank_ms),
            "mean_ms": statistics.fmean(rank_ms),
            "time_imbalance": max(rank_ms) / statistics.fmean(rank_ms),
            "cost_imbalance": max(costs) / statistics.fmean(costs),
            "tokens": int(sum(lengths[i] for share in ranks for i in share)),
        }

    # Each global batch is timed split both ways, back to back, the split that goes first alternating from batch
    # to batch: a drift of the machine over the run (clocks, allocator, host caches) falls on both alike.
    splits = {
        name: _rank_shares(lengths, args.num_ranks, args.batch_size, args.num_batches, balanced, cost_model)
        for name, balanced in (("plain", False), ("balanced", True))
    }
    results: dict[str, list[dict[str, object]]] = {"plain": [], "balanced": []}
    for index in range(args.num_batches):
        for name in ("plain", "balanced") if index % 2 == 0 else ("balanced", "plain"):
            results[name].append(measure(splits[name][index]))
    if args.profile:  # after all timing: a profiler run can leave the process slower for a while
        first = splits["plain"][0]
        for share in sorted(first, key=lambda share: cost_model(lengths[share]).sum())[:: len(first) - 1]:
            batch = source.collate([dataset[i] for i in share]).to(device)
            wall, busy, launches = _device_busy(lambda b=batch: step(b), time_ms)
            tokens = int(lengths[share].sum())
            busy_share = f"device busy {busy:.2f} ms ({busy / wall:.0%}), {launches} kernels"
            print(f"plain share of {tokens} tokens: step {wall:.2f} ms (profiled), {busy_share}")

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{args.num_ranks} simulated ranks x {args.batch_size} users on {device_name}; histories "
        f"clip({args.max_history_length} u^3, 16, {args.max_history_length}); GEMRanker dim {args.model_dim}, "
        f"{args.num_layers} layers, {args.num_heads} heads; median of {args.reps}"
    )
    print(f"{'batch':>5} {'tokens':>7} | {'plain slowest ms':>16} {'mean':>7} {'max/mean':>8} | ", end="")
    print(f"{'balanced slowest ms':>19} {'mean':>7} {'max/mean':>8} | {'speed-up':>8}")
    for i, (plain, balanced) in enumerate(zip(results["plain"], results["balanced"], strict=True)):
        print(
            f"{i:>5} {plain['tokens']:>7} | {plain['slowest_ms']:>16.2f} {plain['mean_ms']:>7.2f} "
            f"{plain['time_imbalance']:>8.3f} | {balanced['slowest_ms']:>19.2f} {balanced['mean_ms']:>7.2f} "
            f"{balanced['time_imbalance']:>8.3f} | {plain['slowest_ms'] / balanced['slowest_ms']:>8.2f}"
        )
    slowest = {name: statistics.fmean(row["slowest_ms"] for row in rows) for name, rows in results.items()}
    speedup = slowest["plain"] / slowest["balanced"]
    print(
        f"mean slowest-rank step: plain {slowest['plain']:.2f} ms, balanced {slowest['balanced']:.2f} ms: "
        f"balanced is {speedup:.2f}x faster"
    )
    times = np.array([ms for rows in results.values() for row in rows for ms in row["rank_ms"]])
    costs = np.array([c for rows in results.values() for row in rows for c in row["rank_cost"]])
    slope, fixed = np.polyfit(costs, times, 1)
    r2 = 1 - np.var(times - (fixed + slope * costs)) / np.var(times)
    print(
        f"fit over {len(times)} shares: ms = {fixed:.2f} + {slope * 1e12:.3f} x training TFLOP of the encoder "
        f"(R^2 {r2:.2f}); the fixed part is {fixed / times.mean():.0%} of a mean share"
    )
    if args.out is not None:
        summary = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device_name, "speedup": speedup}
        summary["fit"] = {"fixed_ms": fixed, "ms_per_tflop": slope * 1e12, "r2": r2}
        args.out.write_text(json.dumps({**summary, **results}, indent=1))


if __name__ == "__main__":
    main()
