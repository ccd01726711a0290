"""The end-to-end and rank-balance benchmark scripts run their whole path at tiny sizes on CPU (no timing is judged)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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


@pytest.mark.slow
def test_e2e_trains_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    printed = _run(
        "e2e.py", "--device", "cpu", "--tiny", "--plain-micro-batches", "2", "--root", str(tmp_path), "--out", str(out)
    )
    assert "kit / plain step throughput" in printed and "plain steps: 2 micro-batches of 2 users" in printed
    results = json.loads(out.read_text())
    assert results["useful_flops"] > 0
    for stack in ("plain", "kit"):
        assert results[stack]["step_ms"] > 0 and results[stack]["tokens_per_s"] > 0


@pytest.mark.slow
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


@pytest.mark.slow
def test_scaling_runs_every_configuration_on_two_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    printed = _run(
        "scaling.py", "--device", "cpu", "--devices", "2", "--tiny", "--root", str(tmp_path), "--out", str(out)
    )
    assert "losses match 1 GPU in every layout" in printed
    results = json.loads(out.read_text())
    assert results["n"] == 2 and "error" not in results["baseline"]
    layouts = {row["layout"] for row in results["layouts"]}
    assert layouts == {
        "sparse 1 / FSDP", "sparse 1 / FSDP+TP2", "sparse 2 / FSDP", "sparse 2 / FSDP+TP2", "sparse 2 / replicated"
    }  # fmt: skip
    for row in results["layouts"]:
        assert row["speed"]["samples_per_s_per_gpu"] > 0 and row["speed"]["scaling_ratio"] > 0
        assert row["match"]["max_loss_rel_diff"] <= 1e-4, row["layout"]
    assert results["overlap_on_prefetched"] > 0, "the overlap run must serve forwards from prefetched all-to-alls"
    checkpoint = results["checkpoint"]
    assert checkpoint["errors"] == []
    assert checkpoint["resume_max_loss_rel_diff"] <= 1e-6 and checkpoint["weights_at_half_max_abs_diff"] <= 1e-6


def test_gpu_suite_skips_what_the_machine_lacks(tmp_path: Path) -> None:
    """The steps that cannot run here (scaling on fewer than 2 GPUs, ML-1M without its folder) say so."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("with 2+ GPUs the scaling step runs for real")
    env = {k: v for k, v in os.environ.items() if k != "ML1M"} | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    script = ROOT / "examples" / "benchmarks" / "run_gpu_suite.sh"
    done = subprocess.run(["bash", str(script), "scaling", "ml1m"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "summary.txt").read_text().splitlines() == [
        f"scaling: skipped ({torch.cuda.device_count()} GPU)",
        "ml1m: skipped (set ML1M to the ml-1m folder)",
    ]


@pytest.mark.slow
def test_encoder_step_times_each_norm_variant(tmp_path: Path) -> None:
    out = tmp_path / "encoder.json"
    sizes = ["--dim", "32", "--num-layers", "2", "--num-heads", "2", "--batch-size", "3", "--max-history-length", "48"]
    runs = ["--warmup", "1", "--reps", "1", "--variants", "torch-norm", "kit-norm"]
    _run("encoder_step.py", "--device", "cpu", *sizes, *runs, "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == ["torch-norm"] * 2 + ["kit-norm"] * 2
    assert all(r["step_ms"] > 0 and r["tokens"] >= 3 * 16 for r in results)


@pytest.mark.slow
def test_compile_fp8_layers_runs_both_variants() -> None:
    printed = _run("compile_fp8_layers.py", "--device", "cpu", "--dim", "128", "--max-length", "24", "--reps", "1")
    # Compiled layers compute what the eager ones do (fp32 on CPU: to rounding; fp8's emulated GEMMs quantize the
    # same values, so the two differ by the order of their sums only), in a bounded number of graphs.
    for variant, tolerance in (("bf16", 1e-2), ("fp8", 5e-2)):
        line = next(line for line in printed.splitlines() if line.startswith(f"{variant}:"))
        pattern = rf"{variant}: runs; largest relative difference (\S+); eager (\S+) ms, compiled (\S+) ms a step"
        found = re.match(pattern + r" \(\S+x\); (\d+) graphs", line)
        assert found, line
        difference, eager_ms, compiled_ms, graphs = float(found[1]), float(found[2]), float(found[3]), int(found[4])
        assert difference < tolerance and eager_ms > 0 and compiled_ms > 0 and 1 <= graphs <= 8, line


@pytest.mark.slow
def test_ml1m_variants_fits_tests_and_tabulates(tmp_path: Path) -> None:
    data = ROOT.parent / "shared" / "data" / "ml-1m"
    if not data.is_dir():
        pytest.skip(f"MovieLens data not found at {data}")
    tiny = (
        "--trainer.accelerator cpu --trainer.precision 32-true --trainer.max_epochs 1 --trainer.limit_train_batches 2"
        " --trainer.limit_test_batches 2 --data.init_args.eval_batch_size 32 --model.init_args.compile_layers false"
        " --model.init_args.num_layers 1"
    )
    variants = tmp_path / "variants.txt"
    variants.write_text(f"a {tiny}\nb {tiny} --model.init_args.embedding_dim 16\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "ML1M": str(data), "PYTHON": sys.executable}
    script = ROOT / "examples" / "benchmarks" / "ml1m_variants.sh"
    done = subprocess.run(
        ["bash", str(script), str(variants)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in (tmp_path / "out" / "table.md").read_text().splitlines() if line.startswith("| a |")]
    cells = rows[0].strip("|").split("|")
    assert cells[1].strip() == "1" and all(0.0 <= float(c) <= 1.0 for c in cells[2:])


@pytest.mark.slow
def test_ml1m_score_precision_ranks_three_ways() -> None:
    data = ROOT.parent / "shared" / "data" / "ml-1m"
    if not data.is_dir():
        pytest.skip(f"MovieLens data not found at {data}")
    printed = _run("ml1m_score_precision.py", str(data), "--epochs", "0")
    rows = {
        cells[0]: [float(c) for c in cells[1:]]
        for line in printed.splitlines()
        if line.startswith("| ") and not line.startswith("| scores")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
        if not cells[0].startswith("---")
    }
    assert set(rows) == {"fp32", "bf16", "bf16, optimistic ties"}
    for name, (hr10, ndcg10, hr50) in rows.items():
        # NDCG@10 weighs each hit of HR@10 by at most 1, and a hit in the top 10 is one in the top 50.
        assert 0.0 <= ndcg10 <= hr10 <= hr50 <= 1.0, (name, hr10, ndcg10, hr50)
    # The same bf16 scores with ties counted for the target rank every target as high or higher.
    assert all(o >= p for o, p in zip(rows["bf16, optimistic ties"], rows["bf16"], strict=True)), rows


def test_score_precision_ranks_bf16_ties_both_ways() -> None:
    """``bf16_ranks`` on scores that bf16 rounding ties: item 1 (1.001) ties the target (1.0) in bf16, item 3 (2.0)
    outranks it, item 4 (3.0) is seen and excluded; the second user's target is its best item."""
    import importlib.util

    path = ROOT / "examples" / "benchmarks" / "ml1m_score_precision.py"
    spec = importlib.util.spec_from_file_location("ml1m_score_precision", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    catalogue = torch.tensor([[1.0, 0.0], [1.001, 0.0], [0.5, 0.25], [2.0, 0.0], [3.0, 0.0]])
    target = torch.tensor([0, 2])
    seen_rows, seen_items = torch.tensor([0, -1]), torch.tensor([4, 0])
    args = (queries, catalogue, target, seen_rows, seen_items)
    assert script.bf16_ranks(*args, "pessimistic").tolist() == [3, 1]
    assert script.bf16_ranks(*args, "optimistic").tolist() == [2, 1]
    # In fp32 item 1 outranks the target outright: rank 3 whichever way ties count.
    fp32 = script.catalogue_ranks(queries, catalogue, target, seen_rows=seen_rows, seen_items=seen_items)
    assert fp32.tolist() == [3, 1]


def test_ml100k_time_bias_trains_with_and_without_it(tmp_path: Path) -> None:
    """A made-up ml-100k folder (20 users rating 9-14 of 30 movies) through the conversion, both fits and the table."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for user in range(1, 21):
        count = 9 + user % 6
        for i, movie in enumerate(torch.randperm(30, generator=gen)[:count].tolist()):
            lines.append(f"{user}\t{movie + 1}\t{1 + (user + i) % 5}\t{880000000 + 3600 * user + 60 * i * i}\n")
    (tmp_path / "u.data").write_text("".join(lines))
    (tmp_path / "u.item").write_text("".join(f"{m}|Movie {m} (1995)|01-Jan-1995||url|0|1\n" for m in range(1, 31)))
    args = ("--ml100k", str(tmp_path), "--seeds", "0", "--epochs", "1", "--num-layers", "1", "--parallel", "1")
    printed = _run("ml100k_time_bias.py", *args)
    rows = [line.split("|") for line in printed.splitlines() if line.startswith("| 0 |")]
    assert [r[2].strip() for r in rows] == ["no", "yes"]
    assert all(0.0 <= float(c) <= 1.0 for r in rows for c in r[3:8])


def _benchmark(name: str):
    """The benchmark script ``name`` as a module (the scripts import their shared ``gem_example`` by name)."""
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_device_time_unions_each_family_and_shares_divide_by_the_real_step() -> None:
    gem = _benchmark("gem_example")
    kernels = [
        ("_gdpa_fwd_kernel", 0.0, 600.0),
        ("_gdpa_bwd_kernel", 300.0, 900.0),  # overlaps the forward on another stream: counted once
        ("_bwd_delta_kernel", 950.0, 1000.0),
        ("nvjet_tst_128x256_64x4", 800.0, 1200.0),
        ("split_embedding_backward_codegen", 1200.0, 1300.0),
        ("multi_tensor_apply_kernel", 1300.0, 1400.0),
        ("_norm_quantize_kernel", 1400.0, 1450.0),
        ("vectorized_elementwise_kernel", 3000.0, 3500.0),
    ]
    times = gem.device_time(kernels)
    assert times == pytest.approx(
        {"attention": 0.95, "gemm": 0.4, "embeddings": 0.1, "optimizer": 0.1, "norm+quantize": 0.05, "other": 0.5,
         "busy": 1.95, "window": 3.5}
    )  # fmt: skip
    # Two profiled steps of a 1.5 ms step (unprofiled): shares of 3 ms of device time.
    shares = gem.step_shares(times, num_steps=2, step_ms=1.5)
    assert shares["attention"] == pytest.approx(0.95 / 3) and shares["busy"] == pytest.approx(0.65)
    assert shares["host gaps"] == pytest.approx(0.35) and "window" not in shares
    # A profile busier than the real step (host slower under the profiler, kernels not): busy saturates at 1.
    assert gem.step_shares(times, num_steps=1, step_ms=1.0)["host gaps"] == 0.0


def test_family_kernels_lists_each_familys_costliest_kernels_per_step() -> None:
    gem = _benchmark("gem_example")
    kernels = [
        ("_gdpa_fwd_kernel", 0.0, 600.0),
        ("vectorized_elementwise_kernel<add>", 600.0, 700.0),
        ("reduce_kernel<sum>", 700.0, 1000.0),
        ("vectorized_elementwise_kernel<add>", 1000.0, 1300.0),
        ("nvjet_tst_128x256", 1300.0, 1400.0),
        ("unrolled_elementwise_kernel<mul>", 1400.0, 1410.0),
    ]
    lines = gem.family_kernels(kernels, num_steps=2, per_family=2)
    # Families by their time (attention 0.3 ms a step, other 0.355, gemm 0.05), kernels by theirs, per step.
    assert [line.split()[0] for line in lines] == ["other", "other", "attention", "gemm"]
    assert lines[0].split()[1:5] == ["0.20", "ms", "1", "launches"] and lines[0].endswith("kernel<add>")
    assert lines[1].endswith("reduce_kernel<sum>") and lines[1].split()[1] == "0.15"
    assert lines[2].split()[1] == "0.30" and lines[3].split()[1] == "0.05"


def test_e2e_counts_the_graph_signatures_captured_in_the_timed_steps() -> None:
    """GraphSignatures reads a model's ``graph_signatures`` at the first timed step and at the end of training (a
    model without it: none)."""
    e2e = _benchmark("e2e")
    model, trainer = SimpleNamespace(graph_signatures={}), SimpleNamespace(global_step=0)
    callback = e2e.GraphSignatures(warmup=2)
    for step, counts in enumerate([{"encoder": 1}, {"encoder": 3}, {"encoder": 4}, {"encoder": 6}]):
        model.graph_signatures, trainer.global_step = counts, step
        callback.on_train_batch_start(trainer, model, None, step)
    callback.on_train_end(trainer, model)
    assert callback.at_start == {"encoder": 4} and callback.at_end == {"encoder": 6}
    plain, trainer.global_step = e2e.GraphSignatures(warmup=0), 0
    plain.on_train_batch_start(trainer, object(), None, 0)
    plain.on_train_end(trainer, object())
    assert plain.at_start == {} and plain.at_end == {}


def test_e2e_presets_set_nvidia_hstu_shapes_and_flags_override_them() -> None:
    e2e = _benchmark("e2e")
    hstu, fixed = e2e.PRESETS["nvidia-hstu"], e2e.PRESETS["nvidia-hstu-fixed"]
    assert (hstu["model_dim"], hstu["num_layers"], hstu["num_heads"], hstu["batch_size"]) == (1024, 8, 4, 32)
    assert hstu["model_dim"] // hstu["num_heads"] == 256 and hstu["max_history"] == 4096
    assert fixed == {**hstu, "min_history": 4096}
    args, stacks = e2e.parse_args(["--preset", "nvidia-hstu-fixed", "--num-layers", "2", "--stacks", "kit"])
    shape = (args.num_layers, args.model_dim, args.num_heads, args.min_history, args.max_history)
    assert shape == (2, 1024, 4, 4096, 4096)  # --num-layers given: the preset's 8 overridden
    assert stacks == ["kit"]
    args, _ = e2e.parse_args([])  # no preset: the GEM example's own shapes
    assert (args.model_dim, args.num_layers, args.min_history) == (512, 4, 16)


@pytest.mark.slow
def test_e2e_preset_runs_the_kit_stack_with_uniform_histories(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    printed = _run(
        "e2e.py", "--device", "cpu", "--tiny", "--preset", "nvidia-hstu-fixed", "--stacks",
        "kit,kit-fp8-saved,kit-2,kit-seed", "--model-dim", "64", "--root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert "histories of 64" in printed  # --tiny's longest history, every history that long
    summary = next(line for line in printed.splitlines() if line.startswith("FP8 saved activations: peak memory"))
    assert " kit-2 0, 0, " in summary and " kit-seed " in summary  # the noise floors beside the FP8 gap
    results = json.loads(out.read_text())
    assert results["args"]["num_layers"] == "2" and results["args"]["min_history"] == "64"
    assert results["kit"]["step_ms"] > 0 and "plain" not in results
    exact, fp8 = results["kit"]["losses"], results["kit-fp8-saved"]["losses"]
    assert len(exact) == len(fp8) and exact[0] == fp8[0]  # the same first forward; FP8 changes backwards only
    assert results["kit-2"]["losses"] == exact  # the CPU path is deterministic: run again, the same losses
    assert results["kit-seed"]["losses"][0] != exact[0]  # other initial weights, the same batches
    stats = results["kit-fp8-saved"]["saved_activations"]  # what the layers stored in FP8 and recomputed, a step
    assert stats["tensors"] > 0 and 0 < stats["gib_fp8"] < stats["gib_in"] / 1.9 and stats["recomputed"] > 0
    assert "recomputed" in summary and "saved_activations" not in results["kit"]


@pytest.mark.slow
def test_e2e_compares_the_kit_with_its_eager_self(tmp_path: Path) -> None:
    """``kit-eager`` is the kit stack without its host-time options; beside ``kit`` the summary gives their per-step
    loss gaps on the same batches (padding users, over several a batch with token buckets, change no real user's
    loss)."""
    out = tmp_path / "e2e.json"
    printed = _run(
        "e2e.py", "--device", "cpu", "--tiny", "--stacks", "kit,kit-eager", "--token-multiple", "4",
        "--token-growth", "1.5", "--fused-optimizer", "--kit-precision", "bf16", "--root", str(tmp_path),
        "--out", str(out),
    )  # fmt: skip
    assert "kit against kit-eager over 4 steps: per-step loss gap largest" in printed
    results = json.loads(out.read_text())
    fast, eager = results["kit"]["losses"], results["kit-eager"]["losses"]
    assert len(fast) == len(eager) == 4
    assert max(abs(a - b) for a, b in zip(fast, eager, strict=True)) < 1e-4


def test_sweep_plans_parse_tiles_and_flags() -> None:
    """``attention_sweep.py --plans`` (and ``kernel_resources.py --plans``) names the backward plans it times."""
    parse_plan = _benchmark("attention_sweep").parse_plan
    from lightning_gem.ops.attention.impl.triton._tuning import BackwardTiles, Tiles

    assert parse_plan("32,64,8,2") == BackwardTiles(Tiles(32, 64, 8, 2))
    assert parse_plan("64,128,8,1,tma,split") == BackwardTiles(Tiles(64, 128, 8, 1), tma=True, split=True)
    one_launch = BackwardTiles(Tiles(64, 128, 8, 1), Tiles(128, 64, 8, 1), split=True)
    assert parse_plan("64,128,8,1,split,dq128x64") == one_launch
    for bad in ("64,128,8", "64,128,8,1,fast", "64,128,8,1,tma,dq128x64"):
        with pytest.raises(ValueError, match="not a backward plan"):
            parse_plan(bad)


def test_forward_tiles_checks_each_descriptor_tile_under_the_interpreter(tmp_path: Path) -> None:
    """``forward_tiles.py --check`` runs the descriptor-load forward of every softmax mode against float64 (on CPU:
    Triton's interpreter, tiny shapes); its cells parse and its jagged lengths stay in ``[16, L]``."""
    script = _benchmark("forward_tiles")
    assert script.parse_cell("bidirectional,8,64,256,j1024") == (False, 8, 64, 256, "j1024")
    with pytest.raises(ValueError, match="not a cell"):
        script.parse_cell("window,8,64,256,j1024")
    lengths = script.cell_lengths("j1024", 300, torch.Generator().manual_seed(0))
    assert len(lengths) == 300 and min(lengths) == 16 and max(lengths) <= 1024 and len(set(lengths)) > 100
    assert script.cell_lengths("4096", 3, torch.Generator()) == [4096] * 3
    out = tmp_path / "tiles.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "benchmarks" / "forward_tiles.py"), "--device", "cpu", "--check", "2",
         "--no-timing", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    checked = json.loads(out.read_text())["check"]
    assert set(checked) == set(script.CHECK_MODES)
    for mode, rows in checked.items():
        assert rows and all(row["failed"] == 0 for row in rows.values()), (mode, rows)
        assert all(label.endswith(" tma") for label in rows), rows


@pytest.mark.slow
def test_token_interaction_times_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "tokens.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in the inherited interpreter
    sizes = ["--candidates", "5", "--tokens", "3", "--shapes", "16x2", "--dtype", "fp32", "--reps", "1"]
    _run("token_interaction.py", "--device", device, *sizes, "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["op"] for row in rows] == ["token_attention", "pairwise_dots"]
    assert all(row[part]["torch_ms"] > 0 and row[part]["fused_ms"] > 0 for row in rows for part in ("fwd", "fwd+bwd"))
    assert all(row["difference"] < 1e-5 for row in rows)


def test_pointwise_tiles_checks_and_times_each_override(tmp_path: Path) -> None:
    """A smoke run under the interpreter: every kernel's default and overridden launches agree and are timed."""
    out = tmp_path / "pointwise.json"
    _run("pointwise_tiles.py", "--device", "cpu", "--quick", "--shapes", "24x2x32", "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert [r["kernel"].rsplit(" ", 1)[0] for r in results] == [
        "silu_split fwd", "silu_split bwd", "norm_mul fwd", "norm_mul bwd", "input norm fwd",
        "input norm + residual bwd",
    ]  # fmt: skip
    assert all(len(r["variants"]) == 2 and r["default_ms"] > 0 for r in results)
