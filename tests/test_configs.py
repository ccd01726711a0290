"""Each shipped config runs through the ``lightning-gem`` CLI (a few batches, on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_gem.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
DATA = ROOT.parent / "shared" / "data"
SHORT = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
    "--trainer.enable_progress_bar=false",
]


def _fit(config: str, tmp_path: Path, *extra: str) -> None:
    main(
        [
            "fit",
            f"--config={CONFIGS / config}",
            *SHORT,
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            *extra,
        ]
    )


def test_quickstart_config_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    _fit(
        "quickstart.yaml",
        tmp_path,
        "--data.init_args.source.init_args.num_train_users=600",
        "--data.init_args.source.init_args.num_val_users=200",
        "--data.init_args.source.init_args.num_test_users=200",
        "--data.init_args.batch_size=32",
    )
    printed = capsys.readouterr().out
    assert "val/auc_ctr=" in printed and "val/ne_ctr=" in printed and "samples/s" in printed
    assert "MFU report over 2 training steps" in printed and "perf/tflops" in printed
    assert list(tmp_path.rglob("metrics.csv")) and list(tmp_path.rglob("mfu.json")) and list(tmp_path.rglob("mfu.png"))
    assert torch.get_num_threads() == 1  # the config's num_threads: 1
    torch.set_num_threads(threads)


# GPU configs run here on CPU in full precision: the same model and data path, a few batches.
ON_CPU = ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.check_val_every_n_epoch=1"]


@pytest.mark.parametrize(
    ("config", "folder", "extra"),
    [
        ("ml100k_ctr.yaml", "ml-100k", []),
        ("ml1m_retrieval.yaml", "ml-1m", []),
        ("ml1m_hstu_h200.yaml", "ml-1m", ON_CPU),
        ("ml1m_hstu_h200_reference.yaml", "ml-1m", ON_CPU),
        ("ml1m_hstu_h200_all_windows.yaml", "ml-1m", [*ON_CPU, "--model.init_args.compile_layers=false"]),
        ("ml1m_hstu_h200_best.yaml", "ml-1m", [*ON_CPU, "--model.init_args.compile_layers=false"]),
    ],
)
def test_movielens_config_trains(
    config: str, folder: str, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not (DATA / folder).is_dir():
        pytest.skip(f"MovieLens data not found at {DATA / folder}")
    path = f"--data.init_args.source.init_args.path={DATA / folder}"
    _fit(config, tmp_path, path, "--data.init_args.batch_size=32", *extra)
    printed = capsys.readouterr().out
    expected = "val/auc_ctr=" if "ctr" in config else "val/hr@10="
    assert expected in printed


@pytest.mark.parametrize(
    ("config", "option", "message"),
    [
        (
            "quickstart.yaml",
            "--model.init_args.interaction_activation=swish",
            "lightning-gem: ValueError: `interaction_activation` must be one of 'softmax', 'silu', 'gelu', 'relu', "
            "'sigmoid'; got 'swish'",
        ),
        (
            "ml100k_ctr.yaml",
            "--data.init_args.source.init_args.path=/nonexistent",
            "lightning-gem: FileNotFoundError: MovieLens file /nonexistent/u.data not found: expected u.data",
        ),
        (
            "ml1m_retrieval.yaml",
            "--data.init_args.source.init_args.path=/nonexistent",
            "lightning-gem: FileNotFoundError: MovieLens file /nonexistent/movies.dat not found",
        ),
    ],
)
def test_a_refused_value_ends_the_cli_with_one_line(config: str, option: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={CONFIGS / config}", f"--trainer.default_root_dir={tmp_path}", option])
    assert str(exit_info.value).startswith(message) and "\n" not in str(exit_info.value), exit_info.value
