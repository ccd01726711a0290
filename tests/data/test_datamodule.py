"""GEMDataModule: loaders, seeded and resumable shuffling, a Trainer run, and instantiation from a config."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DistributedSampler, SequentialSampler

from lightning_gem.data import (
    GEMDataModule,
    RankingBatch,
    RetrievalBatch,
    SyntheticRankingSource,
    SyntheticRetrievalSource,
)

SMALL = {"num_items": 200, "num_train_users": 100, "num_val_users": 30, "num_test_users": 20}


def _first_users(loader) -> list[int]:
    return list(iter(loader.sampler))[: loader.batch_size]


def test_loaders_produce_batches_of_the_source() -> None:
    data = GEMDataModule(source=SyntheticRankingSource(**SMALL), batch_size=16, eval_batch_size=25)
    assert data.schema is data.source.schema
    data.setup("fit")
    train, val = data.train_dataloader(), data.val_dataloader()
    assert isinstance(train.sampler, DistributedSampler) and isinstance(val.sampler, SequentialSampler)
    batches = list(train)
    assert all(isinstance(b, RankingBatch) for b in batches)
    assert [b.batch_size for b in batches] == [16] * 6 + [4]
    assert [b.batch_size for b in val] == [25, 5]
    assert sum(b.batch_size for b in data.test_dataloader()) == 20
    retrieval = GEMDataModule(source=SyntheticRetrievalSource(num_users=40), batch_size=8, drop_last=True)
    assert all(isinstance(b, RetrievalBatch) and b.batch_size == 8 for b in retrieval.train_dataloader())


def test_worker_processes_collate_the_same_batches() -> None:
    source = SyntheticRetrievalSource(num_users=40)
    in_process = list(GEMDataModule(source=source, batch_size=16).val_dataloader())
    workers = list(GEMDataModule(source=source, batch_size=16, num_workers=2).val_dataloader())
    assert len(workers) == len(in_process) == 3
    for a, b in zip(in_process, workers, strict=True):
        assert torch.equal(a.targets, b.targets) and torch.equal(a.history.values(), b.history.values())


def test_shuffle_is_seeded_per_epoch_and_resumable() -> None:
    source = SyntheticRankingSource(**SMALL)
    a, b = GEMDataModule(source=source, batch_size=10, seed=7), GEMDataModule(source=source, batch_size=10, seed=7)
    assert _first_users(a.train_dataloader()) == _first_users(b.train_dataloader())
    assert _first_users(a.train_dataloader()) != _first_users(GEMDataModule(source=source, seed=8).train_dataloader())
    loader = a.train_dataloader()
    epoch0 = list(iter(loader.sampler))
    loader.sampler.set_epoch(1)
    epoch1 = list(iter(loader.sampler))
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(100))
    # A restored module replays the saved epoch's order, whatever seed it was built with.
    state = {**a.state_dict(), "epoch": 1}
    restored = GEMDataModule(source=source, batch_size=10, seed=123)
    restored.load_state_dict(state)
    assert restored.state_dict() == {"seed": 7, "epoch": 1, "batch_size": 10}
    assert list(iter(restored.train_dataloader().sampler)) == epoch1
    with pytest.raises(ValueError, match="seed"):
        restored.load_state_dict({"epoch": 3})


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        ({"eval_batch_size": -1}, ValueError, "eval_batch_size"),
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"source": "synthetic"}, TypeError, "source"),
    ],
)
def test_arguments_are_checked(kwargs: dict, error: type, name: str) -> None:
    kwargs = {"source": SyntheticRankingSource(**SMALL), **kwargs}
    with pytest.raises(error, match=name):
        GEMDataModule(**kwargs)
    with pytest.raises(ValueError, match="stage"):
        GEMDataModule(source=SyntheticRankingSource(**SMALL)).setup("train")


class _DenseOnly(L.LightningModule):
    """The smallest model that consumes a RankingBatch: logistic regression on the dense features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.epochs_seen: list[int] = []

    def _loss(self, batch: RankingBatch) -> torch.Tensor:
        counts = batch.candidate_offsets().diff()
        logits = torch.repeat_interleave(self.linear(batch.dense_features).squeeze(1), counts)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels[:, 0])

    def training_step(self, batch: RankingBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, RankingBatch)
        return self._loss(batch)

    def validation_step(self, batch: RankingBatch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=batch.batch_size)

    def on_train_epoch_start(self) -> None:
        self.epochs_seen.append(self.trainer.train_dataloader.sampler.epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fits_and_checkpoints_the_position(tmp_path) -> None:
    data = GEMDataModule(source=SyntheticRankingSource(**SMALL), batch_size=32)
    model = _DenseOnly()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    assert model.epochs_seen == [0, 1]
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    (saved,) = [v for k, v in checkpoint.items() if k.endswith("GEMDataModule")]
    assert saved["seed"] == 0 and saved["epoch"] == 1


def test_instantiates_from_a_config_with_class_path() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningDataModule, "data")
    config = parser.parse_object(
        {
            "data": {
                "class_path": "lightning_gem.data.GEMDataModule",
                "init_args": {
                    "batch_size": 8,
                    "source": {
                        "class_path": "lightning_gem.data.SyntheticRankingSource",
                        "init_args": {"num_items": 50, "num_train_users": 20, "num_val_users": 5, "num_test_users": 5},
                    },
                },
            }
        }
    )
    data = parser.instantiate_classes(config).data
    assert isinstance(data, GEMDataModule) and isinstance(data.source, SyntheticRankingSource)
    assert data.batch_size == 8 and data.source.num_items == 50
