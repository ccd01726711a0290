"""The attention grid benchmark runs its whole path on tiny CPU cells (no timing is judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _grid(*args: str) -> subprocess.CompletedProcess:
    script = ROOT / "examples" / "benchmarks" / "attention_grid.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow
def test_attention_grid_quick(tmp_path: Path) -> None:
    modes = ("--quick", "--modes", "silu causal targets", "softmax block 64")
    _grid(*modes, "--out-dir", str(tmp_path))
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert [r["cell"]["mode"] for r in grid["results"]] == ["silu causal targets", "softmax block 64"]
    pointwise, block = grid["results"]
    for result in grid["results"]:
        assert result["fwd_gflop"] > 0 and result["impls"]["auto"]["fwd_ms"] > 0
        # tiny calls: their host time too (on a CPU the whole call)
        assert 0 < result["impls"]["auto"]["fwd_host_ms"] and 0 < result["impls"]["auto"]["both_host_ms"]
        assert result["q_tokens"] == 384
    # The padded baseline runs the pointwise cell (targets included); the softmax-only kernels say why they do not.
    assert pointwise["impls"]["padded"]["both_ms"] > 0 and pointwise["x_fwd"] > 0
    assert pointwise["impls"]["flex"]["skipped"].startswith("n/a")
    assert block["impls"]["padded"]["skipped"] == "n/a (pointwise modes only)"
    assert "n/a" in block["impls"]["fa4"]["skipped"]
    table = (tmp_path / "grid.md").read_text()
    assert "| silu causal targets, 1k, 2x16, 0.375K |" in table and "auto host ms fwd / f+b" in table
    assert (tmp_path / "grid.png").stat().st_size > 0
    # A slice from the second cell on holds that cell alone, on the same inputs; slices tabulate as one grid.
    _grid(*modes, "--first-cell", "1", "--out-dir", str(tmp_path / "slice"))
    (sliced,) = json.loads((tmp_path / "slice" / "grid.json").read_text())["results"]
    assert sliced["label"] == block["label"] and sliced["fwd_gflop"] == block["fwd_gflop"]
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"meta": grid["meta"], "results": [pointwise]}))
    _grid("--render", str(first), str(tmp_path / "slice" / "grid.json"), "--out-dir", str(tmp_path / "both"))
    rows = [line for line in (tmp_path / "both" / "grid.md").read_text().splitlines() if line.startswith("| ")]
    labels = [row.split(" | ")[0].removeprefix("| ") for row in rows[2:]]
    assert labels == ["silu causal targets, 1k, 2x16, 0.375K", block["label"]]
    # --resume: the same command runs the next slice each time (a time limit this short lets one cell through a
    # call) and tabulates the slices so far as one grid; once every cell is in a slice it says so.
    resume = ("--time-limit", "1e-6", "--resume", str(tmp_path / "resumed"))
    for expected in (1, 2):
        _grid(*modes, *resume)
        saved = sorted((tmp_path / "resumed").glob("slice_*/grid.json"))
        assert [p.parent.name for p in saved] == ["slice_0000", "slice_0001"][:expected]
        rows = [line for line in (tmp_path / "resumed" / "grid.md").read_text().splitlines() if line.startswith("| ")]
        assert len(rows) == 2 + expected
    assert "grid done" in _grid(*modes, *resume).stdout
    assert json.loads(saved[1].read_text())["results"][0]["index"] == 1


@pytest.mark.slow
def test_attention_grid_fp8(tmp_path: Path) -> None:
    """``--precision fp8`` times the same auto call on FP8 codes beside its bf16 one (on CPU: the reference's
    emulation of the codes) and tabulates the ratio."""
    _grid(
        "--quick", "--modes", "silu causal", "--precision", "fp8", "--baselines", "padded", "--out-dir", str(tmp_path)
    )
    (result,) = json.loads((tmp_path / "grid.json").read_text())["results"]
    fp8 = result["impls"]["auto fp8"]
    assert fp8["fwd_ms"] > 0 and fp8["both_ms"] > 0 and 0 < fp8["max_abs_diff"] < 1
    assert result["fp8_x_fwd"] > 0 and result["fp8_x_both"] > 0
    assert "auto FP8 fwd / f+b, x its bf16" in (tmp_path / "grid.md").read_text()


def _script_module():
    """attention_grid.py imported as a module (its functions, without running it)."""
    import importlib.util

    path = ROOT / "examples" / "benchmarks" / "attention_grid.py"
    spec = importlib.util.spec_from_file_location("attention_grid_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_flex_builder_reads_the_module_torch() -> None:
    """``build_flex`` binds no local ``torch`` (an ``import torch.x`` inside it would, and every call after the first
    would then fail with a NameError in its nested helpers)."""
    code = _script_module().build_flex.__code__
    assert "torch" not in code.co_varnames + code.co_cellvars


def test_candidate_labels() -> None:
    from lightning_gem.ops.attention.impl.triton._tuning import FLASH, VARLEN, BackwardTiles, Tiles

    label = _script_module()._label
    assert label(FLASH) == "fa4"
    assert label(VARLEN) == "varlen"
    assert label(Tiles(128, 64, 8, 3)) == "(128, 64, 8, 3)"
    assert label(BackwardTiles(Tiles(64, 128, 8, 1), tma=True, split=True)) == "(64, 128, 8, 1) split bulk dQ"
    assert label(BackwardTiles(Tiles(64, 128, 8, 3))) == "(64, 128, 8, 3) atomic dQ"
    assert label(BackwardTiles(Tiles(64, 64, 8, 2), Tiles(128, 64, 8, 2))) == "(64, 64, 8, 2) dQ (128, 64, 8, 2)"
    assert label(BackwardTiles(Tiles(64, 64, 4, 2), short=True)) == "short (64, 64, 4, 2)"
