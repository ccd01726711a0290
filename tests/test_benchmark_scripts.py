"""The end-to-end and rank-balance benchmark scripts run their whole path at tiny sizes on CPU (no timing is judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_e2e_trains_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    printed = _run("e2e.py", "--device", "cpu", "--tiny", "--root", str(tmp_path), "--out", str(out))
    assert "kit / plain step throughput" in printed
    results = json.loads(out.read_text())
    assert results["useful_flops"] > 0
    for stack in ("plain", "kit"):
        assert results[stack]["step_ms"] > 0 and results[stack]["tokens_per_s"] > 0


def test_balance_ranks_splits_and_times_every_share(tmp_path: Path) -> None:
    out = tmp_path / "balance.json"
    sizes = ["--max-history-length", "64", "--batch-size", "2", "--model-dim", "16", "--num-layers", "1"]
    runs = ["--num-ranks", "4", "--num-batches", "2", "--reps", "1", "--num-heads", "2"]
    printed = _run("balance_ranks.py", "--device", "cpu", *sizes, *runs, "--out", str(out))
    assert "balanced is" in printed
    results = json.loads(out.read_text())
    plain, balanced = results["plain"], results["balanced"]
    assert len(plain) == len(balanced) == 2
    assert all(len(row["rank_ms"]) == 4 and min(row["rank_ms"]) > 0 for row in plain + balanced)
    # The same global batch, split by cost: never worse balanced than the plain split.
    for p, b in zip(plain, balanced, strict=True):
        assert p["tokens"] == b["tokens"] and b["cost_imbalance"] <= p["cost_imbalance"] + 1e-9
