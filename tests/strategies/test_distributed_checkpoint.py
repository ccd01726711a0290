"""gem5d's directory checkpoints: complete exactly when their meta file is there, even after an interrupted save."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning_gem.strategies import distributed_checkpoint as checkpoint
from torch import nn


def _save(path: Path, module: nn.Module, step: int) -> None:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    checkpoint.save(path, module, [optimizer], None, {"step": step}, is_global_zero=True)


def test_a_save_ends_complete_and_an_interrupted_one_is_not_taken_for_complete(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    module = nn.Linear(3, 2)
    _save(path, module, 1)
    assert checkpoint.is_distributed_checkpoint(path) and checkpoint.read_meta(path)["step"] == 1
    assert not (path / f"{checkpoint.META_FILENAME}.partial").exists()  # written aside, then renamed
    # A save killed after removing the old meta and before writing its own leaves shards without meta.
    (path / checkpoint.META_FILENAME).unlink()
    assert not checkpoint.is_distributed_checkpoint(path)
    with torch.no_grad():
        module.weight.add_(1.0)
    _save(path, module, 2)  # the next save writes over the interrupted one
    assert checkpoint.read_meta(path)["step"] == 2
    loaded = torch.load(path / checkpoint.META_FILENAME, weights_only=False)
    assert loaded == {"step": 2}
