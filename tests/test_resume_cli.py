"""Interrupt and resume through the CLI: a real ``lightning-gem fit`` process is killed mid-epoch (by its PID) and
``--ckpt_path last`` resumes it to the losses of an uninterrupted run, with MFUMonitor on; in one process and on
2 gloo ranks under gem5d. The runs are the shipped quickstart configs, shrunk to 24 steps of tiny batches.

Only the killed run is a ``lightning-gem`` process of its own (importing the kit is most of a tiny run's time):
the uninterrupted and the resumed fit run through the same CLI entry point in this process, or, on 2 ranks, one
after the other in the processes of one ``run_ranks`` call.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lightning_gem.cli import main
from lightning_gem.testing.distributed import forget_torchrec_node_groups, free_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
STEPS_PER_EPOCH = 16  # 256 training users in batches of 16 per rank
CHECKPOINT_EVERY = 6  # last.ckpt after step 6 (killed there, mid-epoch 0); again after 12 and 18
COMPARED = ("train/loss", "perf/model_flops", "val/loss", "val/auc_ctr", "val/ne_ctr")


def _tiny_config(name: str, folder: Path, world_size: int) -> Path:
    """The shipped config ``name``, shrunk: tiny model and data, every step logged, last.ckpt every few steps."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    trainer = config["trainer"]
    trainer.update(
        max_epochs=2,
        max_steps=24,
        val_check_interval=0.5,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
    )
    trainer["logger"]["init_args"]["save_dir"] = str(folder)
    callbacks = [cb for cb in trainer.get("callbacks", []) if not cb["class_path"].endswith("MFUMonitor")]
    for callback in callbacks:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = CHECKPOINT_EVERY
    # Counted every 4 steps: the resumed run (from step 6) must scale step 4's count, restored from the checkpoint.
    monitor = {"flops_every_n_steps": 4, "plot": False}
    trainer["callbacks"] = [*callbacks, {"class_path": "lightning_gem.callbacks.MFUMonitor", "init_args": monitor}]
    config["model"]["init_args"].update(embedding_dim=8, model_dim=16, num_layers=1, num_heads=2)
    data = config["data"]["init_args"]
    data.update(batch_size=16, eval_batch_size=64)
    data["source"]["init_args"].update(
        num_items=200,
        num_train_users=256 * world_size,
        num_val_users=64,
        num_test_users=64,
        max_history_length=32,
        max_candidates=8,
        mean_candidates=4.0,
    )
    path = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def _command(config: Path, *extra: str) -> list[str]:
    script = Path(sys.executable).with_name("lightning-gem")
    launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "lightning_gem.cli"]
    return [*launcher, "fit", f"--config={config}", *extra]


def _environment() -> dict[str, str]:
    """This process's environment with a main port free now: each launch picks its own rendezvous port."""
    return {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _fit_then_resume(uninterrupted: str, interrupted: str) -> str:
    """Fit ``uninterrupted``, then ``interrupted --ckpt_path last``, through the CLI entry point; what the resumed
    fit printed."""
    threads = torch.get_num_threads()  # the configs' num_threads: 1 applies to this process
    main(["fit", f"--config={uninterrupted}"])
    forget_torchrec_node_groups()  # the second fit's process groups are new
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["fit", f"--config={interrupted}", "--ckpt_path=last"])
    torch.set_num_threads(threads)
    return printed.getvalue()


def _fit_then_resume_on_rank(rank: int, world_size: int, uninterrupted: str, interrupted: str) -> str:
    return _fit_then_resume(uninterrupted, interrupted)


def _run_and_kill(config: Path, last: Path, log: Path, attempts: int = 3) -> None:
    """Start a fit and kill it (SIGKILL to its process group: the launcher's ranks too) once ``last`` is written.

    Each launch gets a main port that is free when it starts; one that failed before writing anything because the
    port was taken before its store bound it (another process on the machine got it first: EADDRINUSE) is started
    again, on a new port, from an empty run folder, up to ``attempts`` times in all."""
    for _ in range(attempts):
        killed, returncode = _start_and_kill(config, last, log)
        port_taken = returncode not in (0, -signal.SIGKILL) and "EADDRINUSE" in log.read_text()
        if killed or not port_taken or last.exists():
            break
        shutil.rmtree(last.parents[2], ignore_errors=True)  # the run's version folder: the next launch starts clean
    assert killed, log.read_text()[-3000:]  # killed once `last` was written, not finished or failed


def _start_and_kill(config: Path, last: Path, log: Path) -> tuple[bool, int]:
    """One launch of :func:`_run_and_kill`: whether it was killed once ``last`` was written, and its return code."""
    with log.open("w") as out:
        # A session of its own: its process group id is its PID, shared by the ranks it launches.
        process = subprocess.Popen(
            _command(config), env=_environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 240
            while not last.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            with contextlib.suppress(ProcessLookupError):  # the group is gone if the run ended by itself
                os.killpg(process.pid, signal.SIGKILL)
        finally:
            process.wait(timeout=60)
    return process.returncode == -signal.SIGKILL and last.exists(), process.returncode


def _metrics(run: Path) -> dict[tuple[str, int], str]:
    """``(name, step) -> value`` (as written) of the compared columns of a run's metrics.csv."""
    values = {}
    with (run / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            for name in COMPARED:
                if row.get(name):
                    values[name, int(row["step"])] = row[name]
    return values


@pytest.mark.parametrize(
    ("config", "world_size", "written"),
    [
        pytest.param("quickstart.yaml", 1, "last.ckpt", id="one-process", marks=pytest.mark.slow),
        pytest.param("quickstart_gem5d.yaml", 2, "last.ckpt/meta.pt", id="gem5d-2-gloo-ranks", marks=pytest.mark.slow),
    ],
)
def test_a_killed_fit_resumes_with_ckpt_path_last_to_the_uninterrupted_losses(
    config: str, world_size: int, written: str, tmp_path: Path
) -> None:
    uninterrupted = _tiny_config(config, tmp_path / "uninterrupted", world_size)
    interrupted = _tiny_config(config, tmp_path / "interrupted", world_size)
    runs = tmp_path / "interrupted" / Path(config).stem
    _run_and_kill(interrupted, runs / "version_0" / "checkpoints" / written, tmp_path / "killed.log")
    if world_size == 1:
        printed = _fit_then_resume(str(uninterrupted), str(interrupted))
    else:
        printed = run_ranks(_fit_then_resume_on_rank, world_size, str(uninterrupted), str(interrupted))[0]

    assert f"--ckpt_path last: resuming from {runs / 'version_0' / 'checkpoints' / 'last.ckpt'}" in printed
    reference = _metrics(tmp_path / "uninterrupted" / Path(config).stem / "version_0")
    resumed = _metrics(runs / "version_1")
    first = min(step for name, step in resumed if name == "train/loss")
    assert 0 < first < STEPS_PER_EPOCH, first  # resumed mid-epoch 0
    assert {name for name, _ in resumed} == set(COMPARED), resumed  # a validation after the resume, MFU counted
    assert resumed == {key: value for key, value in reference.items() if key[1] >= first}
    assert "MFU report over" in printed and "E2E MFU = local MFU x scaling ratio:" in printed
