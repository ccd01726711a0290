"""The GEM example workload the end-to-end and scaling benchmarks share: its shape arguments, synthetic users
and model.

``GEMRanker`` (torchrec embedding tables, an HSTU history encoder, GDPA candidate interaction, multi-task
head) on synthetic GEM-like users: histories ``clip(L u^3, 16, L)`` up to ``--max-history`` events with
several features per event and pooled user features, hundreds of candidates per user.
"""

from __future__ import annotations

import argparse

from lightning_gem.components import GEMRanker

from lightning_gem.data import SyntheticRankingSource

__all__ = ["add_shape_arguments", "gem_ranker", "synthetic_users", "use_tiny_shapes"]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-history``, ``--mean-candidates``, ``--max-candidates``, ``--num-items`` and the model's widths."""
    parser.add_argument("--max-history", type=int, default=4096)
    parser.add_argument("--mean-candidates", type=float, default=128.0)
    parser.add_argument("--max-candidates", type=int, default=512)
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)


def use_tiny_shapes(args: argparse.Namespace) -> None:
    """Shrink the shape arguments in place to a smoke run of the whole path (CPU-sized)."""
    args.max_history, args.mean_candidates, args.max_candidates = 64, 4.0, 8
    args.num_items, args.embedding_dim, args.model_dim, args.num_layers = 500, 32, 64, 2


def synthetic_users(args: argparse.Namespace, num_users: int) -> SyntheticRankingSource:
    """``num_users`` training users of the shape arguments' sizes (one validation and one test user)."""
    return SyntheticRankingSource(
        num_items=args.num_items,
        num_train_users=num_users,
        num_val_users=1,
        num_test_users=1,
        min_history_length=16,
        max_history_length=args.max_history,
        mean_candidates=args.mean_candidates,
        max_candidates=args.max_candidates,
        seed=args.seed,
    )


def gem_ranker(source: SyntheticRankingSource, args: argparse.Namespace, attention_impl: str = "auto") -> GEMRanker:
    """The GEM example at the shape arguments' widths (AdamW, lr 1e-4)."""
    return GEMRanker(
        source.schema,
        embedding_dim=args.embedding_dim,
        model_dim=args.model_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_hidden_dims=(args.model_dim,),
        attention_impl=attention_impl,
        lr=1e-4,
    )
