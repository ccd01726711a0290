"""The precision benchmark's kernel table runs on CPU (tiny sizes), and its CUDA-only variants run under the
interpreter (no timing is judged)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmarks" / "precision.py"


@pytest.mark.slow
def test_kernels_only_writes_the_kernel_table(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    args = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--kernels-only", "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["linear"] == [] and "tuned_configs" in results
    names = {row["kernel"] for row in results["kernels"]}
    assert {"quantize rowwise rows", "quantize mx rows+cols", "layernorm+quantize 1x128"} <= names
    assert all(row["ms"] > 0 for row in results["kernels"])


def test_rowwise_variants_run() -> None:
    spec = importlib.util.spec_from_file_location("precision_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timed = {}
    x = torch.randn(40, 256, dtype=torch.float16, device="cuda" if torch.cuda.is_available() else "cpu")
    module.add_rowwise_variants(lambda name, fn, _bytes: timed.setdefault(name, fn()), x, 3 * x.numel())
    two_passes = timed["quantize rowwise rows, two passes"][0]
    from lightning_gem.ops.mx.impl.triton.quantize import quantize_triton

    one_pass = quantize_triton(x, "rowwise")[0]
    assert torch.equal(two_passes[0].view(torch.uint8), one_pass[0].view(torch.uint8))
    assert torch.equal(two_passes[1], one_pass[1])
    row_amax, col_amax = timed["rowwise line maxima (rows+cols)"]
    assert row_amax.shape == (40,) and col_amax.shape == (256,)


@pytest.mark.slow
def test_split_sweep_checks_every_config_against_the_reference() -> None:
    spec = importlib.util.spec_from_file_location("precision_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = module.sweep_split(40, 256, device, limit=2)
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"quantize mx rows+cols", "quantize mx cols", "quantize 1x128 rows+cols"}
    swept = [row for row in rows if row["config"] != "apart (two launches)"]
    assert len(swept) == 6 and all(row.get("codes_exact") is True and row["ms"] > 0 for row in swept), swept
