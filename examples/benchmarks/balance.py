"""Load balance of Base Batch Shuffling against a plain ``DistributedSampler``.

Prints, per length distribution, the max/mean rank cost of each global batch (mean and p95 over the
global batches of a few epochs; 1.0 is perfect balance), with the default
:class:`~lightning_gem.data.balancing.AttentionCostModel` (``len + len**2 / 1536``). Only full global
batches count. Pure CPU, no sample is loaded: only the lengths.

Then token-budget batching (:class:`~lightning_gem.data.token_budget.TokenBudgetSampler`, each rank's
batch capped at ``--max-tokens``, default ``batch_size`` x the mean length): steps per epoch, samples
per batch, how full the token budget is, and the same max/mean rank cost per step.

Usage:
    python examples/benchmarks/balance.py PATH/TO/ml-1m [--num-replicas 8] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DistributedSampler

from lightning_gem.data.balancing import AttentionCostModel, BalancedDistributedSampler, imbalance
from lightning_gem.data.token_budget import TokenBudgetSampler


def _ratios(lengths: np.ndarray, num_replicas: int, batch_size: int, num_epochs: int, balanced: bool) -> np.ndarray:
    costs = AttentionCostModel()(lengths)
    ratios = []
    for epoch in range(num_epochs):
        ranks = []
        for rank in range(num_replicas):
            if balanced:
                sampler = BalancedDistributedSampler(lengths, batch_size, num_replicas, rank, drop_last=True)
            else:
                sampler = DistributedSampler(range(len(lengths)), num_replicas, rank, drop_last=True)
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
        full = len(lengths) // (num_replicas * batch_size) * batch_size
        ratios.append(imbalance([r[:full] for r in ranks], costs, batch_size))
    return np.concatenate(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ml1m_path", type=Path, help="folder of MovieLens-1M (sequences.txt, movies.dat, ...)")
    parser.add_argument("--num-replicas", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-epochs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None, help="token budget per rank and step")
    args = parser.parse_args()

    from lightning_gem.data import MovieLens1MSource

    u = np.random.default_rng(0).random(args.num_replicas * args.batch_size * 50)
    cases = {
        "synthetic clip(4096*u^3, 16, 4096)": np.clip(4096 * u**3, 16, 4096).astype(np.int64),
        "ML-1M train, history <= 200": MovieLens1MSource(path=str(args.ml1m_path)).sample_lengths("train"),
        "ML-1M train, uncapped": MovieLens1MSource(path=str(args.ml1m_path), max_history_length=1 << 20).sample_lengths(
            "train"
        ),
    }
    print(f"{args.num_replicas} ranks x {args.batch_size} samples, cost = len + len^2/1536, {args.num_epochs} epochs")
    header = f"{'lengths':<36} {'N':>6} {'max len':>7} {'sampler':<18} {'mean max/mean':>13} {'p95':>7}"
    header += f" {'ms/epoch/rank':>13}"
    print(header)
    print("-" * len(header))
    for name, lengths in cases.items():
        for balanced in (False, True):
            start = time.perf_counter()
            ratios = _ratios(lengths, args.num_replicas, args.batch_size, args.num_epochs, balanced)
            ms = (time.perf_counter() - start) * 1e3 / (args.num_epochs * args.num_replicas)
            label = "balanced (BBS)" if balanced else "DistributedSampler"
            print(
                f"{name:<36} {len(lengths):>6} {lengths.max():>7} {label:<18} "
                f"{ratios.mean():>13.4f} {np.percentile(ratios, 95):>7.4f} {ms:>13.1f}"
            )
    print()
    header = f"{'lengths (token budget)':<36} {'max tokens':>10} {'steps':>6} {'samples/batch':>13} {'fill':>6}"
    header += f" {'mean max/mean':>13} {'p95':>7}"
    print(header)
    print("-" * len(header))
    for name, lengths in cases.items():
        max_tokens = args.max_tokens or max(int(lengths.max()), int(args.batch_size * lengths.mean()))
        costs = AttentionCostModel()(lengths)
        samplers = [
            TokenBudgetSampler(lengths, max_tokens, args.num_replicas, rank) for rank in range(args.num_replicas)
        ]
        ratios, sizes, fill, steps = [], [], [], []
        for epoch in range(args.num_epochs):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            packing = samplers[0].steps()
            assert all(len(sampler) == len(packing) for sampler in samplers)  # every rank, the same steps
            steps.append(len(packing))
            for step in packing[:-1]:  # the last step holds the remainder
                loads = np.array([costs[part].sum() for part in step])
                ratios.append(loads.max() / loads.mean())
                sizes += [len(part) for part in step]
                fill.append(sum(lengths[part].sum() for part in step) / (max_tokens * args.num_replicas))
        print(
            f"{name:<36} {max_tokens:>10} {np.mean(steps):>6.0f} {np.mean(sizes):>6.1f} [{min(sizes)}-{max(sizes)}]"
            f" {np.mean(fill):>6.3f} {np.mean(ratios):>13.4f} {np.percentile(ratios, 95):>7.4f}"
        )


if __name__ == "__main__":
    main()
