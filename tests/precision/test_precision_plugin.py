"""MXFP8Precision in a Trainer: conversion, training, the monitor callback, checkpoints, the quickstart config."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gem.precision import MXConfig, MXFP8Precision, MXLinear, MXRMSNorm, QuantizationMonitor, convert

ROOT = Path(__file__).resolve().parents[2]


class _Regressor(L.LightningModule):
    """A pre-norm MLP learning a fixed random linear map (small, fast, no torchrec)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.register_buffer("target", torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch).float(), batch @ self.target)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(64 * 16, 64), batch_size=64)


def _trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_trainer_fits_like_high_precision_and_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = _Regressor()
    model = _Regressor()
    model.load_state_dict(plain.state_dict())
    torch.manual_seed(1)
    _trainer(tmp_path / "plain", max_epochs=3).fit(plain)
    monitor = QuantizationMonitor(every_n_steps=5)
    torch.manual_seed(1)
    trainer = _trainer(tmp_path / "mx", max_epochs=3, plugins=[MXFP8Precision(recipe="mxfp8")], callbacks=[monitor])
    trainer.fit(model)
    assert isinstance(model.up, MXLinear) and isinstance(model.down, MXLinear) and isinstance(model.norm, MXRMSNorm)
    x = torch.randn(256, 64)
    with torch.no_grad():
        target = x @ plain.target
        plain_loss = float(nn.functional.mse_loss(plain(x), target))
        mx_loss = float(nn.functional.mse_loss(model(x).float(), target))
    assert plain_loss < 0.5, "the task is learned"
    assert abs(mx_loss / plain_loss - 1) < 0.05, (mx_loss, plain_loss)
    assert set(monitor.last) >= {"quant/up/input_underflowed", "quant/down/grad_output_saturated"}
    assert all(0.0 <= v < 0.1 for v in monitor.last.values())

    path = tmp_path / "mx.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == set(plain.state_dict())  # the checkpoint of a plain model
    reloaded = _Regressor()
    reloaded.load_state_dict(state)
    convert(reloaded, MXConfig(recipe="mxfp8"))
    model.eval()
    reloaded.eval()
    assert torch.equal(reloaded(x), model(x))


def test_plugin_config_and_autocast() -> None:
    plugin = MXFP8Precision(recipe="fp8-blockwise", keep_bf16=["head.*"], hadamard=["*.up"], autocast=True)
    assert plugin.config.keep_bf16 == ("head.*",) and plugin.config.hadamard == ("*.up",)
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with MXFP8Precision().forward_context():  # default: autocast on CUDA only
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="recipe"):
        MXFP8Precision(recipe="int8")


@pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("jsonargparse") is None,
    reason="the quickstart needs torchrec and jsonargparse",
)
def test_quickstart_mxfp8_config_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gem.cli import main

    main(
        [
            "fit",
            f"--config={ROOT / 'examples' / 'configs' / 'quickstart_mxfp8.yaml'}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=2",  # 2 batches: the CLI reads 1 as 1.0, all of them
            "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.init_args.source.init_args.num_train_users=200",
            "--data.init_args.source.init_args.num_val_users=100",
            "--data.init_args.source.init_args.num_test_users=100",
            "--data.init_args.batch_size=32",
        ]
    )
    printed = capsys.readouterr().out
    assert "val/auc_ctr=" in printed
    metrics = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "quant/encoder.layers.0.uvqk/input_underflowed" in metrics


class _Attender(L.LightningModule):
    """One HSTU layer over jagged sequences, trained to match a random target (small, fast, no torchrec)."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_gem.components.encoder import HSTULayer

        self.layer = HSTULayer(32, 2)
        self.offsets = torch.tensor([0, 5, 5, 12, 16])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, target = batch[0], batch[1]
        return nn.functional.mse_loss(self.layer(x, self.offsets).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 2, 16, 32), batch_size=None)


def test_monitor_counts_fp8_attention(tmp_path: Path) -> None:
    """With ``attention=True`` the layer attends on FP8 codes and the monitor logs its q, k, v counts."""
    torch.manual_seed(0)
    model = _Attender()
    monitor = QuantizationMonitor(every_n_steps=1)
    plugin = MXFP8Precision(recipe="fp8-rowwise", attention=True, autocast=False)
    _trainer(tmp_path, max_steps=4, plugins=[plugin], callbacks=[monitor], logger=False).fit(model)
    assert model.layer.attention_precision == "fp8"
    keys = {f"quant/layer/attention_{operand}_{stat}" for operand in "qkv" for stat in ("saturated", "nonfinite")}
    assert keys <= set(monitor.last)
    assert all(monitor.last[key] == 0.0 for key in keys)  # the scales follow each block's maximum; inputs finite
    assert all(0.0 <= value < 0.1 for value in monitor.last.values())
