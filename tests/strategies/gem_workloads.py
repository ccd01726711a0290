"""What the spawned ranks run: the GEM example (``GEMRanker`` on synthetic data, tiny) under ``strategy="gem5d"``.

Functions here run inside processes of :func:`lightning_gem.testing.distributed.run_ranks` and return
plain picklable results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_gem.testing.distributed import forget_torchrec_node_groups, full_weights

NUM_USERS = 64


def make_source() -> Any:
    from lightning_gem.data import SyntheticRankingSource

    # One candidate per user: every rank's batch has the same number of candidates, so the mean of the
    # per-rank mean losses is the mean over the global batch (what a single process computes).
    return SyntheticRankingSource(
        num_items=200,
        num_train_users=NUM_USERS,
        num_val_users=8,
        num_test_users=8,
        min_history_length=2,
        max_history_length=12,
        mean_candidates=1.0,
        max_candidates=1,
        num_topics=4,
        num_segments=8,
        num_interest_tags=16,
        seed=0,
    )


def make_model(schema: Any, dense_optimizer: str = "sgd") -> Any:
    """The GEM example, tiny. ``dense_optimizer="sgd"``: plain SGD instead of the model's AdamW, because Adam's
    first steps move each weight by about ``lr x sign(grad)``, which turns float-level differences of
    near-zero gradients into ``lr``-sized ones and hides real mismatches between layouts."""
    from lightning_gem.components import GEMRanker

    kwargs = dict(
        embedding_dim=8,
        model_dim=16,
        num_layers=2,
        num_heads=2,
        head_hidden_dims=(16,),
        lr=0.05 if dense_optimizer == "sgd" else 1e-2,
        attention_impl="reference",
    )
    if dense_optimizer == "sgd":
        return _SGDRanker(schema, **kwargs)
    return GEMRanker(schema, **kwargs)


def _sgd_ranker_class() -> type:
    from lightning_gem.components import GEMRanker

    class SGDRanker(GEMRanker):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            # The multi-tensor kernels (CUDA's default) on CPU too: they refuse lists mixing FSDP2's DTensors with
            # plain tensors, which the strategy must keep apart (optimizer steps and checkpoint loads).
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, foreach=True)

    return SGDRanker


def _SGDRanker(schema: Any, **kwargs: Any) -> Any:
    return _sgd_ranker_class()(schema, **kwargs)


class LossRecorder:
    """A callback recording the global-batch mean training loss of every step (mean of the ranks' losses)."""

    def __new__(cls) -> Any:
        import lightning as L

        class _Recorder(L.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                loss = outputs["loss"].detach().clone()
                if torch.distributed.is_initialized():
                    torch.distributed.all_reduce(loss)
                    loss /= torch.distributed.get_world_size()
                self.losses.append(float(loss))

        return _Recorder()


def fit_gem(
    world_size: int,
    strategy_kwargs: dict[str, Any],
    *,
    steps: int,
    global_batch: int,
    seed: int = 0,
    root: str | None = None,
    ckpt_every: int | None = None,
    ckpt_path: str | None = None,
    dense_optimizer: str = "sgd",
    trainer_kwargs: dict[str, Any] | None = None,
    then_test: bool = False,
) -> dict[str, Any]:
    """Train the GEM example ``steps`` steps on ``world_size`` ranks; the losses, the full weights and, per
    encoder forward, its token count and the rows of the first layer's input norm (token shards under
    sequence parallelism)."""
    import lightning as L
    from lightning_gem.strategies import GEM5DStrategy

    from lightning_gem.data import GEMDataModule

    forget_torchrec_node_groups()
    L.seed_everything(seed, verbose=False)
    data = GEMDataModule(source=make_source(), batch_size=global_batch // world_size, seed=seed)
    model = make_model(data.schema, dense_optimizer)
    rows: dict[str, list[int]] = {"history_tokens": [], "input_norm_rows": []}
    model.encoder.register_forward_pre_hook(lambda _, args: rows["history_tokens"].append(args[0].shape[0]))
    model.encoder.layers[0].input_norm.register_forward_pre_hook(
        lambda _, args: rows["input_norm_rows"].append(args[0].shape[0])
    )
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    if ckpt_every is not None:
        assert root is not None
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=GEM5DStrategy(**strategy_kwargs),
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=ckpt_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
        **(trainer_kwargs or {}),
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    tested = trainer.test(model, datamodule=data, verbose=False) if then_test else None
    from lightning_gem.strategies.activation_checkpointing import checkpointed_modules

    return {
        "losses": recorder.losses,
        "weights": full_weights(model),
        "checkpointed": sorted(checkpointed_modules(model)),
        "compiled": sorted(n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None),
        "prefetched": getattr(trainer.strategy.prefetcher, "hits", None),
        "replication": trainer.strategy.parallel.sparse.replication,
        "tested": tested,
        **rows,
    }


def validate_gem(
    world_size: int, strategy_kwargs: dict[str, Any], *, ckpt_path: str, batch_size: int
) -> dict[str, np.ndarray]:
    """Load a checkpoint's weights through ``Trainer.validate`` on ``world_size`` ranks; the full weights.

    ``batch_size``: the saved run's per-rank batch (the DataModule refuses another one mid-epoch)."""
    import lightning as L
    from lightning_gem.strategies import GEM5DStrategy

    from lightning_gem.data import GEMDataModule

    forget_torchrec_node_groups()
    data = GEMDataModule(source=make_source(), batch_size=batch_size)
    model = make_model(data.schema)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=GEM5DStrategy(**strategy_kwargs),
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, datamodule=data, ckpt_path=ckpt_path)
    return full_weights(model)


def check_dir(path: str) -> bool:
    return Path(path).is_dir()
