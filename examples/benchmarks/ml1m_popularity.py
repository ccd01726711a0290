"""Popularity baseline on MovieLens-1M with the retrieval protocol of ``ml1m_retrieval.yaml``.

Ranks every movie by its count in the training sequences, removes the user's seen items (never the
target), and reports HR@K / NDCG@K of the held-out test item: the floor a sequential model must beat.

    python examples/benchmarks/ml1m_popularity.py PATH/TO/ml-1m
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from lightning_gem.data import MovieLens1MSource
from lightning_gem.metrics import NDCG, HitRate, rank_of_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder of MovieLens-1M (sequences.txt, movies.dat)")
    parser.add_argument("--split", default="test", choices=("val", "test"))
    args = parser.parse_args()

    source = MovieLens1MSource(path=args.path)
    counts = np.zeros(source.schema.num_items)
    train = source.dataset("train")
    for i in range(len(train)):
        sample = train[i]
        np.add.at(counts, np.asarray(sample.history)[:, 0], 1)
        np.add.at(counts, np.asarray(sample.targets), 1)
    popularity = torch.tensor(counts, dtype=torch.float64)

    metrics = {f"{name}@{k}": cls(k) for k in (10, 50, 200) for name, cls in (("hr", HitRate), ("ndcg", NDCG))}
    evaluated = source.dataset(args.split)
    for i in range(len(evaluated)):
        sample = evaluated[i]
        target = int(np.asarray(sample.targets)[-1])
        scores = popularity.clone()
        scores[torch.from_numpy(np.asarray(sample.history)[:, 0])] = float("-inf")
        scores[target] = popularity[target]
        rank = rank_of_target(scores[None], torch.tensor([target]))
        for metric in metrics.values():
            metric.update(rank)
    shown = "  ".join(f"{name}={float(metric.compute()):.4f}" for name, metric in metrics.items())
    print(f"popularity, {args.split} ({len(evaluated)} users, seen items removed): {shown}")


if __name__ == "__main__":
    main()
