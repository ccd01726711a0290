"""Mid-epoch resumption: ``Trainer.fit(ckpt_path=...)`` replays exactly the batches the uninterrupted run saw."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gem.data import GEMDataModule, RankingBatch, SyntheticRankingSource

SOURCE = {"num_items": 200, "num_train_users": 300, "num_val_users": 16, "num_test_users": 16}
BATCH_SIZE = 16  # 300 users: 19 training batches per epoch
STOP_STEP = 26  # mid-epoch 1 (epoch 0 has steps 1..19)


class _Recorder(L.LightningModule):
    """Trains one parameter; records each training batch's identity (its feature values) in order."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch: RankingBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, RankingBatch)
        self.seen.append(tuple(batch.sequence_features.values().tolist()))
        return (self.weight - batch.labels.float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _data(source: SyntheticRankingSource, num_workers: int) -> GEMDataModule:
    return GEMDataModule(source=source, batch_size=BATCH_SIZE, seed=3, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fit_resumes_mid_epoch_with_the_same_batches(tmp_path, num_workers: int) -> None:
    source = SyntheticRankingSource(**SOURCE)
    full = _Recorder()
    _trainer(max_epochs=2, enable_checkpointing=False).fit(full, datamodule=_data(source, num_workers))
    assert len(full.seen) == 2 * 19 and len(set(full.seen[:19])) == 19

    first = _Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=STOP_STEP, save_top_k=-1)
    _trainer(max_epochs=2, max_steps=STOP_STEP, callbacks=[checkpoint]).fit(
        first, datamodule=_data(source, num_workers)
    )
    assert first.seen == full.seen[:STOP_STEP]
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["GEMDataModule"]
    assert state == {"seed": 3, "epoch": 1, "batch_size": BATCH_SIZE, "batches_trained": STOP_STEP - 19}

    second = _Recorder()
    with warnings.catch_warnings():
        # Lightning warns that a DataLoader without `state_dict` is not resumable; the sampler resumes instead.
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        _trainer(max_epochs=2, enable_checkpointing=False).fit(
            second, datamodule=_data(source, num_workers), ckpt_path=tmp_path / "mid.ckpt"
        )
    assert first.seen + second.seen == full.seen


def test_old_state_without_a_position_starts_the_epoch_from_its_first_batch() -> None:
    source = SyntheticRankingSource(**SOURCE)
    reference = _data(source, 0)
    reference.load_state_dict({"seed": 3, "epoch": 1, "batch_size": BATCH_SIZE})
    epoch1 = list(reference.train_dataloader().sampler)
    assert len(epoch1) == 300

    restored = _data(source, 0)
    restored.load_state_dict({"seed": 3, "epoch": 1, "batch_size": BATCH_SIZE, "batches_trained": 7})
    assert list(restored.train_dataloader().sampler) == epoch1[7 * BATCH_SIZE :]
    # The position applies once, to the sampler of its epoch: the next loader starts the epoch over.
    assert list(restored.train_dataloader().sampler) == epoch1
    with pytest.raises(ValueError, match="batch_size"):
        _data(source, 0).load_state_dict({"seed": 3, "epoch": 1, "batch_size": 8, "batches_trained": 7})
