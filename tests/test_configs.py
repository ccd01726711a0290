"""Each shipped config runs through the ``lightning-gem`` CLI (a few batches, on CPU); each overlay is run composed
on its base config, and the overlays compose to the recipes docs/results.md names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_gem.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
DATA = ROOT.parent / "shared" / "data"
SHORT = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=2",  # 2 batches: the CLI reads 1 as 1.0, all of them
    "--trainer.limit_test_batches=2",
    "--trainer.enable_progress_bar=false",
]


def _fit(config: str | tuple[str, ...], tmp_path: Path, *extra: str) -> None:
    configs = (config,) if isinstance(config, str) else config
    main(
        [
            "fit",
            *(f"--config={CONFIGS / name}" for name in configs),
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


ML1M_HSTU = "ml1m_hstu_h200.yaml"
OVERLAYS = sorted(path.name for path in (CONFIGS / "ml1m_hstu_h200").glob("*.yaml"))
EAGER = "--model.init_args.compile_layers=false"  # eager on CPU: compiling the layers would take minutes


@pytest.mark.parametrize(
    ("config", "folder", "extra"),
    [
        ("ml100k_ctr.yaml", "ml-100k", []),
        ("ml1m_retrieval.yaml", "ml-1m", []),
        (ML1M_HSTU, "ml-1m", [*ON_CPU, EAGER]),
        *[
            pytest.param((ML1M_HSTU, f"ml1m_hstu_h200/{overlay}"), "ml-1m", [*ON_CPU, EAGER], id=f"base+{overlay}")
            for overlay in OVERLAYS
        ],
    ],
)
def test_movielens_config_trains(
    config: str | tuple[str, ...], folder: str, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not (DATA / folder).is_dir():
        pytest.skip(f"MovieLens data not found at {DATA / folder}")
    path = f"--data.init_args.source.init_args.path={DATA / folder}"
    _fit(config, tmp_path, path, "--data.init_args.batch_size=32", "--data.init_args.eval_batch_size=32", *extra)
    printed = capsys.readouterr().out
    expected = "val/auc_ctr=" if "ctr" in str(config) else "val/hr@10="
    assert expected in printed


def _composed(configs: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> dict:
    with pytest.raises(SystemExit):
        main(["fit", *(f"--config={CONFIGS / name}" for name in configs), "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("overlays", "expected"),
    [
        # (input_projection, final_norm, train_windows, lr_schedule, compile_layers, max_epochs, validation item
        # trained on, the checkpoint callback's monitor and save_last)
        pytest.param((), (False, False, "all", "cosine", True, 135, True, None, True), id="base"),
        pytest.param(
            ("projection_and_norm",), (True, True, "all", "cosine", True, 135, True, None, True), id="projection"
        ),
        pytest.param(
            ("projection_and_norm", "recent_window"),
            (True, True, "last", "constant", False, 100, True, None, True),
            id="reference_recipe",
        ),
        pytest.param(
            ("projection_and_norm", "recent_window", "holdout"),
            (True, True, "last", "constant", False, 100, False, "val/ndcg@10", True),
            id="first_recipe",
        ),
        pytest.param(
            ("holdout",), (False, False, "all", "cosine", True, 135, False, "val/ndcg@10", True), id="holdout"
        ),
    ],
)
def test_overlays_compose_on_the_base(
    overlays: tuple[str, ...], expected: tuple, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _composed((ML1M_HSTU, *(f"ml1m_hstu_h200/{name}.yaml" for name in overlays)), capsys)
    model, source = config["model"]["init_args"], config["data"]["init_args"]["source"]["init_args"]
    callbacks = config["trainer"]["callbacks"]
    checkpoint = next(c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint"))
    assert [c["class_path"].rsplit(".", 1)[1] for c in callbacks] == ["ThroughputReport", "ModelCheckpoint"]
    assert (
        model["input_projection"],
        model["final_norm"],
        source["train_windows"],
        model["lr_schedule"],
        model["compile_layers"],
        config["trainer"]["max_epochs"],
        source["train_on_validation_item"],
        checkpoint["monitor"],
        bool(checkpoint["save_last"]),
    ) == expected
    assert (model["embedding_dim"], model["num_layers"], model["num_heads"], model["relative_attention_bias"]) == (
        50,
        8,
        2,
        True,
    )


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


def test_nvidia_hstu_config_has_their_shapes_and_trains_small_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _composed(("hstu_nvidia_e2e.yaml",), capsys)
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    source = data["source"]["init_args"]
    assert (model["model_dim"], model["num_layers"], model["num_heads"], model["embedding_dim"]) == (1024, 8, 4, 128)
    assert (data["batch_size"], source["min_history_length"], source["max_history_length"]) == (32, 16, 4096)
    assert config["trainer"]["strategy"]["class_path"].endswith("GEM5DStrategy")
    # The fast path by default: bf16 (faster than FP8 linears at this width), few GEMM shapes, the fused AdamW.
    assert config["trainer"]["precision"] == "bf16-mixed" and not config["trainer"].get("plugins")
    assert model["token_multiple"] == 1024 and model["fused_optimizer"] is True
    # The same file, shrunk to CPU size: its model, strategy, precision and data path train.
    small = [
        "--trainer.accelerator=cpu", "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
        "--model.init_args.model_dim=64", "--model.init_args.embedding_dim=32", "--model.init_args.num_layers=2",
        "--model.init_args.head_hidden_dims=[64]",
        "--data.init_args.pin_memory=false", "--data.init_args.batch_size=8",
        "--data.init_args.source.init_args.num_items=500", "--data.init_args.source.init_args.num_train_users=32",
        "--data.init_args.source.init_args.max_history_length=64",
        "--data.init_args.source.init_args.mean_candidates=4", "--data.init_args.source.init_args.max_candidates=8",
    ]  # fmt: skip
    main(
        ["fit", f"--config={CONFIGS / 'hstu_nvidia_e2e.yaml'}", *small, f"--trainer.default_root_dir={tmp_path}",
         f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "MFU report over 2 training steps" in printed
    flops = float(re.search(r"perf/model_flops +(\S+)", printed).group(1))
    assert flops > 0
    header, *rows = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()
    assert "train/loss" in header.split(",") and len(rows) >= 3
