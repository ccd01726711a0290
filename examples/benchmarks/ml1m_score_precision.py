"""What bf16 catalogue scores cost a MovieLens-1M ranking: the same users and weights ranked three ways.

A ``SequentialRecommender`` (trained here on CPU in fp32 for ``--epochs`` epochs, or loaded from ``--ckpt``) embeds
each test user's history; the held-out item is ranked against the whole catalogue with the user's seen items
removed, with scores

- ``fp32``: what the model does (``catalogue_ranks``, fp32 whatever the autocast state);
- ``bf16``: a bf16 matmul, as bf16 autocast made it before, ties counted against the target (``rank_of_target``'s
  default);
- ``bf16, optimistic ties``: the same scores, ties counted for the target (how much of the loss is ties).

Usage:
    python examples/benchmarks/ml1m_score_precision.py PATH/TO/ml-1m --epochs 12
    python examples/benchmarks/ml1m_score_precision.py PATH/TO/ml-1m --ckpt last.ckpt   # a trained model
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from lightning_gem.components import SequentialRecommender
from lightning_gem.components.retrieval import catalogue_ranks, exclude_seen

from lightning_gem.data import GEMDataModule, MovieLens1MSource
from lightning_gem.metrics import NDCG, HitRate, rank_of_target


def bf16_ranks(queries: torch.Tensor, catalogue: torch.Tensor, target: torch.Tensor, seen_rows, seen_items, ties):
    scores = (queries.bfloat16() @ catalogue.bfloat16().T).float()
    return rank_of_target(exclude_seen(scores, target, seen_rows, seen_items), target, ties=ties)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the ml-1m folder")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--ckpt", default=None, help="a SequentialRecommender checkpoint instead of training")
    args = parser.parse_args()
    torch.manual_seed(0)
    source = MovieLens1MSource(path=args.path, train_on_validation_item=True, train_windows="all")
    datamodule = GEMDataModule(source, batch_size=128, eval_batch_size=512)
    if args.ckpt:
        model = SequentialRecommender.load_from_checkpoint(args.ckpt, map_location="cpu", compile_layers=False)
    else:
        model = SequentialRecommender(source.schema, embedding_dim=50, num_layers=2, num_heads=1, dropout=0.2)
        start = time.perf_counter()
        trainer = L.Trainer(
            max_epochs=args.epochs,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model, datamodule)
        print(f"trained {args.epochs} epochs in {time.perf_counter() - start:.0f} s")
    model.eval()
    datamodule.setup("test")
    ranks: dict[str, list[torch.Tensor]] = {"fp32": [], "bf16": [], "bf16, optimistic ties": []}
    with torch.no_grad():
        catalogue = model._catalogue_embeddings()
        for batch in datamodule.test_dataloader():
            queries, target, seen_rows, seen_items = model.ranking_inputs(batch)
            ranks["fp32"].append(
                catalogue_ranks(queries, catalogue, target, seen_rows=seen_rows, seen_items=seen_items)
            )
            for name, ties in (("bf16", "pessimistic"), ("bf16, optimistic ties", "optimistic")):
                ranks[name].append(bf16_ranks(queries, catalogue, target, seen_rows, seen_items, ties))
    print("| scores | HR@10 | NDCG@10 | HR@50 |\n| --- | --- | --- | --- |")
    for name, values in ranks.items():
        r = torch.cat(values)
        hr10, ndcg10, hr50 = (metric(k)(r) for metric, k in ((HitRate, 10), (NDCG, 10), (HitRate, 50)))
        print(f"| {name} | {hr10:.4f} | {ndcg10:.4f} | {hr50:.4f} |")


if __name__ == "__main__":
    main()
