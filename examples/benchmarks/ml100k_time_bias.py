"""The relative time bias on next-item retrieval with real timestamps: MovieLens-100K, with and without it.

The ML-1M copy most runs use (``sequences.txt``) holds no times, so the time half of HSTU's relative attention
bias (``SequentialRecommender(relative_time_bias=True)``) is measured on MovieLens-100K, whose ``u.data`` has
them: its ratings are rewritten once into ML-1M's ``ratings.dat`` / ``movies.dat`` format in a temporary folder
and read by :class:`~lightning_gem.data.MovieLens1MSource` (leave-one-out, every window, the reference's
training item split; ranked against all 1,682 movies with seen items removed). Each seed trains the same model
twice, without and with the bias, and tests the last weights. Runs ``--parallel`` processes at once, one thread
each, so it suits a CPU. Download ml-100k from https://grouplens.org/datasets/movielens/100k/::

    python examples/benchmarks/ml100k_time_bias.py --ml100k PATH/TO/ml-100k --seeds 0 1 2 3 --epochs 40
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

METRICS = ("hr@10", "ndcg@10", "hr@50", "hr@200", "ndcg@200")


def convert(ml100k: Path, folder: Path) -> None:
    """``u.data`` (tab-separated ``user item rating time``) and ``u.item`` (``id|title|...``) in ML-1M's format."""
    ratings = [line.split("\t") for line in (ml100k / "u.data").read_text().splitlines() if line.strip()]
    (folder / "ratings.dat").write_text("".join("::".join(r[:4]) + "\n" for r in ratings))
    items = (ml100k / "u.item").read_text(encoding="latin-1").splitlines()
    lines = [f"{fields[0]}::{fields[1]}::Unknown\n" for fields in (line.split("|") for line in items if line.strip())]
    (folder / "movies.dat").write_text("".join(lines), encoding="latin-1")


def train(folder: str, seed: int, time_bias: bool, args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from lightning_gem.components import SequentialRecommender

    from lightning_gem.data import GEMDataModule, MovieLens1MSource

    torch.set_num_threads(1)
    L.seed_everything(seed, verbose=False)
    source = MovieLens1MSource(
        path=folder, max_history_length=200, train_on_validation_item=True, train_windows="all", published=False
    )  # ML-100K written as ML-1M files
    data = GEMDataModule(source=source, batch_size=128, eval_batch_size=512)
    model = SequentialRecommender(
        embedding_dim=50,
        num_layers=args.num_layers,
        num_heads=2,
        relative_attention_bias=True,
        relative_time_bias=time_bias,
        dropout=0.2,
        num_negatives=128,
        temperature=0.05,
        lr=1e-3,
        lr_schedule="cosine",
        input_projection=False,
        final_norm=False,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        precision=32,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    result = trainer.test(model, datamodule=data, verbose=False)[0]
    return dict(seed=seed, time_bias=time_bias, seconds=seconds, **{m: result[f"test/{m}"] for m in METRICS})


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ml100k", required=True, help="the ml-100k folder (u.data, u.item)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=2, help="training processes at once")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        convert(Path(args.ml100k), Path(folder))
        jobs = [(folder, seed, bias, args) for seed in args.seeds for bias in (False, True)]
        with concurrent.futures.ProcessPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(train, *zip(*jobs, strict=True)))
    print(f"command: {' '.join(sys.argv)}")
    print("| seed | relative time bias | " + " | ".join(METRICS) + " | fit s |")
    print("|" + " --- |" * (len(METRICS) + 3))
    for r in rows:
        cells = " | ".join(f"{r[m]:.4f}" for m in METRICS)
        print(f"| {r['seed']} | {'yes' if r['time_bias'] else 'no'} | {cells} | {r['seconds']:.0f} |")
    for bias in (False, True):
        means = [statistics.mean(r[m] for r in rows if r["time_bias"] == bias) for m in METRICS]
        print(f"| mean | {'yes' if bias else 'no'} | " + " | ".join(f"{v:.4f}" for v in means) + " | |")
    return rows


if __name__ == "__main__":
    main()
