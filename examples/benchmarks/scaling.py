"""Multi-GPU scaling of ``strategy="gem5d"``: the GEM example at a fixed per-GPU batch on 1 GPU and on N.

One run measures, each N-GPU configuration in its own group of N processes (one per GPU, NCCL):

- speed: per-GPU throughput (samples per second per GPU, timed from the end of one step to the end of
  the next, so data loading and the prefetched embedding all-to-all between steps count) at N over the
  same at 1 GPU: the scaling ratio; local MFU (the ``MFUMonitor``'s FLOPs of the jagged batch over the
  median step interval, against the device's peak) and E2E MFU = local MFU x scaling ratio. For sparse
  sharding group sizes 1, N/2 and N, dense FSDP over the data-parallel ranks and FSDP + tensor parallel
  (2), and at N the dense parameters replicated (one gradient all-reduce a step, as DDP); overlap
  (``train_pipeline``) on and off; Base Batch Shuffling (``GEMDataModule(balance=...)``) on and off, each
  with the ranks' compute imbalance (max/mean forward time).
- correctness: every layout's losses over the first steps against one GPU on the same global batch (fp32,
  SGD, the reference attention, the train pipeline on: equal up to the order of float reductions); a run
  saved mid-way at N ranks and resumed against the uninterrupted run; the saved weights loaded at N/2 ranks
  against the weights at N.

Usage:
    python examples/benchmarks/scaling.py --out scaling.json                  # every GPU of the machine
    python examples/benchmarks/scaling.py --device cpu --devices 2 --tiny     # the whole path on CPU/gloo
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from gem_example import (
    StepClock,
    add_shape_arguments,
    gem_ranker,
    profiling_callbacks,
    synthetic_users,
    use_tiny_shapes,
)
from lightning_gem.components import GEMRanker
from lightning_gem.strategies import GEM5DStrategy
from lightning_gem.strategies.sparse import TableConstraint, table_names

from lightning_gem.callbacks import MFUMonitor
from lightning_gem.data import GEMDataModule, SyntheticRankingSource
from lightning_gem.testing.distributed import RankError, forget_torchrec_node_groups, full_weights, run_ranks


class SGDRanker(GEMRanker):
    """The GEM example with plain SGD on the dense parameters: the correctness runs compare layouts, and
    Adam's first steps turn float-level differences of near-zero gradients into ``lr``-sized ones."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def sharding_constraints(spec: str, tables: list[str]) -> dict[str, TableConstraint]:
    """``"row_wise"``: every table sharded that way; ``"item=row_wise,user_segment=table_wise"``: those tables
    so, the others as the planner chooses (``"*=column_wise"`` names the others' way).

    Raises:
        ValueError: the spec names a table the model does not have.
    """
    if "=" not in spec:
        spec = f"*={spec}"
    ways = dict(part.split("=", 1) for part in spec.split(","))
    unknown = sorted(set(ways) - set(tables) - {"*"})
    if unknown:
        raise ValueError(f"--match-sharding names tables {unknown}; the model has {tables}")
    chosen = {name: ways.get(name, ways.get("*")) for name in tables}
    return {name: TableConstraint(sharding_types=(way,)) for name, way in chosen.items() if way}


class StartWeights(L.Callback):
    """The full weights when training starts (after sharding and any checkpoint load; collective)."""

    def __init__(self) -> None:
        self.weights: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.weights = full_weights(pl_module)


_SOURCES: dict[tuple[bool, int], SyntheticRankingSource] = {}


def make_source(args: argparse.Namespace, match: bool, num_users: int) -> SyntheticRankingSource:
    """Speed runs: production-shaped users. Correctness runs: one candidate per user, so every rank's loss
    averages as many candidates and the mean of the ranks' losses is the global batch's loss. Made once per
    process (the runs of a group share it)."""
    if (match, num_users) not in _SOURCES:
        _SOURCES[match, num_users] = _new_source(args, match, num_users)
    return _SOURCES[match, num_users]


def _new_source(args: argparse.Namespace, match: bool, num_users: int) -> SyntheticRankingSource:
    if not match:
        return synthetic_users(args, num_users)
    return SyntheticRankingSource(
        num_items=args.match_items,
        num_train_users=num_users,
        num_val_users=8,
        num_test_users=8,
        min_history_length=2,
        max_history_length=args.match_history,
        mean_candidates=1.0,
        max_candidates=1,
        seed=args.seed,
    )


def make_model(source: SyntheticRankingSource, args: argparse.Namespace, match: bool) -> GEMRanker:
    if match:
        dims = dict(embedding_dim=16, model_dim=32, num_layers=2, num_heads=2, head_hidden_dims=(32,))
        return SGDRanker(source.schema, **dims, lr=0.05, attention_impl="reference")
    return gem_ranker(source, args)


def fit(rank: int, world_size: int, job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One training run of ``job`` on this rank (every rank of the group calls it); rank 0's measurements."""
    forget_torchrec_node_groups()
    match = job["match"]
    L.seed_everything(args.seed, verbose=False)
    if match:  # the reference runs' fp32 matmuls stay fp32
        torch.backends.cuda.matmul.allow_tf32 = False
    steps = job["steps"]
    source = make_source(args, match, num_users=job["num_users"])
    # Pinned batches on CUDA: the train pipeline's prefetch then copies them asynchronously on its stream.
    data = GEMDataModule(
        source=source,
        batch_size=job["batch"],
        seed=args.seed,
        balance=job["balance"],
        pin_memory=args.device == "cuda",
    )
    model = make_model(source, args, match)
    clock = StepClock(mean_loss=match)
    start = StartWeights()
    callbacks: list[Any] = [clock] + ([start] if match else [])
    monitor = None
    if not match:
        baseline = job.get("baseline_samples_per_s")
        monitor = MFUMonitor(flops_every_n_steps=steps + 1, plot=False, baseline_samples_per_s=baseline)
        callbacks.append(monitor)
        if rank == 0 and args.profile_dir is not None:
            stem = str(args.profile_dir / job["name"].replace(" ", "").replace("/", "_").replace(",", "_"))
            callbacks += profiling_callbacks(args, steps, job["name"], stem)
    if job.get("save_every"):
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=job["root"], every_n_train_steps=job["save_every"], save_top_k=-1, filename="{step}"
            )
        )
    cuda = args.device == "cuda"
    options = dict(job["strategy"])
    if job.get("sharding_type"):
        options["table_constraints"] = sharding_constraints(job["sharding_type"], table_names(model))
    strategy = GEM5DStrategy(**options)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world_size,
        strategy=strategy,
        precision="32-true" if match or not cuda else "bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(job.get("save_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=job["root"],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=data, ckpt_path=job.get("ckpt_path"))
    out: dict[str, Any] = {"losses": clock.losses}
    if strategy.parallel is not None:
        out["plan"] = strategy.parallel.describe()["plan"]
    if job.get("weights"):
        out["weights"] = full_weights(model)
    if match:
        out["start_weights"] = start.weights
    if monitor is not None:
        interval = clock.median_interval(skip=args.warmup)
        summary = monitor.summary(skip_first=args.warmup)
        samples_per_gpu = job["batch"]  # a tensor-parallel group trains on its ranks' batches merged
        # Local MFU over the median step interval (the same clock as the throughput), from the monitor's FLOPs
        # of the step: the monitor's own per-step span leaves out what runs between steps (the prefetch).
        flops, peak = summary.get("model_flops", math.nan), summary.get("peak_tflops", math.nan)
        out.update(
            step_ms=interval * 1e3,
            samples_per_s_per_gpu=samples_per_gpu / interval,
            model_flops=flops,
            mfu=flops / interval / (peak * 1e12),
            compute_imbalance=summary.get("compute_imbalance", math.nan),
            step_time_imbalance=summary.get("step_time_imbalance", math.nan),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan,
            prefetched=getattr(strategy.prefetcher, "hits", None),
        )
    return out if rank == 0 else {}


def load_weights(rank: int, world_size: int, job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The full weights of a gem5d checkpoint loaded on this group's layout (``Trainer.validate``)."""
    forget_torchrec_node_groups()
    source = make_source(args, match=True, num_users=job["num_users"])
    data = GEMDataModule(source=source, batch_size=job["batch"], seed=args.seed)
    model = make_model(source, args, match=True)
    cuda = args.device == "cuda"
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world_size,
        strategy=GEM5DStrategy(**job["strategy"]),
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=job["root"],
    )
    trainer.validate(model, datamodule=data, ckpt_path=job["ckpt_path"], verbose=False)
    weights = full_weights(model)
    return {"weights": weights} if rank == 0 else {}


def run_jobs(rank: int, world_size: int, jobs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each job in turn on this group of processes (one import and start-up for several runs)."""
    return [(load_weights if job.get("load") else fit)(rank, world_size, job, args) for job in jobs]


def run_group(world_size: int, jobs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``jobs`` on a fresh group of ``world_size`` processes; a failure is recorded in every job's result, not
    raised, so one broken configuration does not hide the other groups' measurements."""
    started = time.perf_counter()
    threads = max(1, min(8, (os.cpu_count() or 2) // world_size))
    names = ", ".join(job["name"] for job in jobs)
    try:
        outs = run_ranks(run_jobs, world_size, jobs, args, timeout=args.timeout, threads=threads)[0]
    except RankError as err:
        print(f"[{names}] FAILED:\n{str(err)[-3000:]}", flush=True)
        outs = [{"error": str(err)[-3000:]} for _ in jobs]
    print(f"[{names}] on {world_size} ranks: {time.perf_counter() - started:.1f} s", flush=True)
    for job, out in zip(jobs, outs, strict=True):
        brief = {k: v for k, v in out.items() if isinstance(v, int | float) and k != "prefetched"}
        print(f"  {job['name']}: " + ", ".join(f"{k} {v:.4g}" for k, v in brief.items()), flush=True)
    return outs


def layouts(n: int) -> list[dict[str, Any]]:
    """Sparse sharding group sizes 1, N/2, N x dense FSDP over the data-parallel ranks and FSDP + TP (2); and
    at group size N the dense parameters replicated (``dense_replicate_size=N``: one all-reduce a step, as DDP)."""
    groups = sorted({1, max(1, n // 2), n})
    dense = [{"tensor_parallel_size": 1}] + ([{"tensor_parallel_size": 2}] if n % 2 == 0 and n >= 2 else [])
    rows = [{"sparse_group_size": g, **d} for g in groups for d in dense]
    return rows + [{"sparse_group_size": n, "tensor_parallel_size": 1, "dense_replicate_size": n}]


def headline_layout(n: int, dense: str) -> dict[str, Any]:
    """The layout of the overlap/shuffling-off and checkpoint runs: sparse group size N, dense ``dense``."""
    layout = {"sparse_group_size": n, "tensor_parallel_size": 1}
    return layout | ({"dense_replicate_size": n} if dense == "replicated" else {})


def layout_name(strategy: dict[str, Any]) -> str:
    return "sparse {} / {}".format(*layout_key(strategy).split("/"))


def layout_key(strategy: dict[str, Any]) -> str:
    """``"4/FSDP"``, ``"2/FSDP+TP2"``, ``"4/replicated"``: sparse group size / dense layout (``--layouts``)."""
    tp = strategy.get("tensor_parallel_size", 1)
    dense = "FSDP" if tp == 1 else f"FSDP+TP{tp}"
    if strategy.get("dense_replicate_size", 1) > 1:
        dense = "replicated"
    return f"{strategy['sparse_group_size']}/{dense}"


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def weights_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) if a[k].size else 0.0 for k in a)


def start_weights_difference(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Per weight differing from the reference's when training started: the largest absolute difference."""
    a, b = run.get("start_weights", {}), ref.get("start_weights", {})
    if not a or not b:
        return {"missing": math.inf}
    out = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a.keys() & b.keys() if a[k].size}
    out.update({k: math.inf for k in a.keys() ^ b.keys()})
    return {k: v for k, v in out.items() if v != 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--devices", type=int, default=None, help="N; default: every GPU (cuda) or 2 (cpu)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few steps: a smoke run of the path")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of a speed run")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--batch-size", type=int, default=64, help="users per GPU (per data-parallel rank)")
    add_shape_arguments(parser)
    parser.add_argument("--match-steps", type=int, default=6, help="steps of a correctness run")
    parser.add_argument("--match-batch", type=int, default=16, help="users per data-parallel rank, correctness")
    parser.add_argument("--match-history", type=int, default=64)
    parser.add_argument("--match-items", type=int, default=5000)
    parser.add_argument("--loss-rtol", type=float, default=1e-4, help="correctness: max relative loss difference")
    parser.add_argument(
        "--comm-precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="the speed runs' embedding all-to-all precision (GEM5DStrategy(embedding_comm_precision=...)); "
        "not fp32: each layout is also checked against 1 GPU with it, under --comms-loss-rtol",
    )
    parser.add_argument("--comms-loss-rtol", type=float, default=1e-3, help="the same with 16-bit comms")
    parser.add_argument(
        "--match-sharding",
        nargs="*",
        default=["table_wise", "row_wise", "column_wise"],
        help="correctness at sparse group size N also under these shardings: a way for every table (row_wise) or "
        "table=way pairs (item=row_wise,user_segment=table_wise; '*' for the tables not named)",
    )
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds a group may take per result")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="checkpoints and logs; default: a temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="also write every measurement as JSON here")
    parser.add_argument(
        "--layouts", nargs="*", default=None, help="only these (sparse group/dense: 4/FSDP 2/FSDP+TP2 4/replicated)"
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=("offs", "checkpoint"),
        help="skip the overlap/shuffling-off runs or the checkpoint runs (a run split over several invocations)",
    )
    parser.add_argument(
        "--headline",
        default="FSDP",
        choices=("FSDP", "replicated"),
        help="the dense layout (at sparse group size N) of the overlap/shuffling-off and checkpoint runs",
    )
    parser.add_argument("--profile-dir", type=Path, default=None, help="rank 0's profiles of the speed runs go here")
    parser.add_argument("--cprofile-steps", type=int, default=0, help="cProfile this many last steps of each speed run")
    parser.add_argument("--profile-steps", type=int, default=0, help="torch.profiler over this many last steps")
    parser.add_argument("--sync-debug", action="store_true", help="list the device syncs of the first timed step")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.batch_size, args.match_steps = 3, 1, 4, 4
        use_tiny_shapes(args)
        args.match_batch, args.match_history, args.match_items = 4, 16, 200
    n = args.devices or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if n < 2:
        parser.error(f"needs at least 2 devices, got {n}")
    root = Path(args.root or tempfile.mkdtemp(prefix="gem5d-scaling-"))
    results: dict[str, Any] = {"n": n, "args": {k: str(v) for k, v in vars(args).items()}}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results["device"] = device

    def speed_job(strategy: dict[str, Any], **kw: Any) -> dict[str, Any]:
        job = dict(match=False, steps=args.warmup + args.steps, batch=args.batch_size, balance=True)
        job["num_users"] = args.batch_size * n * (args.warmup + args.steps + 2)  # the same users in every run
        strategy = {"train_pipeline": True, "embedding_comm_precision": args.comm_precision, **strategy}
        return {**job, "strategy": strategy, "root": str(root / "speed"), **kw}

    def match_job(strategy: dict[str, Any], **kw: Any) -> dict[str, Any]:
        job = dict(match=True, steps=args.match_steps, batch=args.match_batch, balance=True, root=str(root / "match"))
        job["num_users"] = args.match_batch * n * (args.match_steps + 2)
        # The train pipeline on, as in the speed runs: its side-stream prefetch is part of what is checked.
        return {**job, "strategy": {"embedding_optimizer": "sgd", "train_pipeline": True, **strategy}, **kw}

    # 1 GPU: the speed baseline (the same per-GPU batch) and the correctness reference (the N-GPU runs'
    # global batch: N per-rank batches, also under tensor parallelism, whose groups merge their ranks' batches).
    # The baseline is the faster of the single-GPU runs with and without the train pipeline (its side-stream
    # prefetch also spares one GPU the host waits of the embedding input path).
    plain, overlapped, ref = run_group(
        1,
        [
            speed_job({"train_pipeline": False}, name="1 GPU"),
            speed_job({}, name="1 GPU, overlap"),
            match_job({}, batch=args.match_batch * n, name="1 GPU, global batch (fp32)"),
        ],
        args,
    )
    base = max((plain, overlapped), key=lambda run: run.get("samples_per_s_per_gpu", 0.0))
    base["overlap"] = base is overlapped
    results["baseline"], results["baseline_runs"], results["reference"] = base, [plain, overlapped], ref
    save(results, args.out)
    baseline = base.get("samples_per_s_per_gpu")

    rows, by_sharding = [], {}
    chosen = [layout for layout in layouts(n) if args.layouts is None or layout_key(layout) in args.layouts]
    if args.layouts is not None and len(chosen) != len(args.layouts):
        parser.error(f"--layouts {args.layouts}: at N = {n} the layouts are {[layout_key(x) for x in layouts(n)]}")
    for layout in chosen:
        name = layout_name(layout)
        ways = args.match_sharding if layout == {"sparse_group_size": n, "tensor_parallel_size": 1} else []
        comms = [args.comm_precision] if args.comm_precision != "fp32" else []
        speed, check, *extra = run_group(
            n,
            [
                speed_job(layout, baseline_samples_per_s=baseline, name=name),
                match_job(layout, name=name + " (fp32)"),
                *(match_job(layout, sharding_type=way, name=f"{name}, {way} (fp32)") for way in ways),
                *(match_job({**layout, "embedding_comm_precision": p}, name=f"{name}, {p} comms") for p in comms),
            ],
            args,
        )
        constrained = extra[: len(ways)]
        check["max_loss_rel_diff"] = max_relative_difference(check.get("losses", []), ref.get("losses", []))
        check["start_weights_diff"] = start_weights_difference(check, ref)
        if comms:  # the speed runs' embedding comms precision: rounding on the wire
            check["comms_max_loss_rel_diff"] = max_relative_difference(
                extra[-1].get("losses", []), ref.get("losses", [])
            )
        rows.append({"layout": name, "strategy": layout, "speed": speed, "match": check})
        for way, out in zip(ways, constrained, strict=True):
            out["max_loss_rel_diff"] = max_relative_difference(out.get("losses", []), ref.get("losses", []))
            out["start_weights_diff"] = start_weights_difference(out, ref)
            by_sharding[way] = out
        save(results | {"layouts": rows, "match_by_sharding": by_sharding}, args.out)
    results["layouts"], results["match_by_sharding"] = rows, by_sharding

    # Overlap and batch shuffling off; checkpoints: save at N mid-way and resume, against the uninterrupted run.
    headline = headline_layout(n, args.headline)
    if "offs" not in args.skip:
        off, unshuffled = run_group(
            n,
            [
                speed_job({**headline, "train_pipeline": False}, baseline_samples_per_s=baseline, name="overlap off"),
                speed_job(headline, balance=False, baseline_samples_per_s=baseline, name="shuffling off"),
            ],
            args,
        )
        results["overlap_off"], results["shuffling_off"] = off, unshuffled
        save(results, args.out)
    if "checkpoint" not in args.skip:
        results["checkpoint"] = checkpoint_runs(n, headline, root, match_job, args)
    results["overlap_on_prefetched"] = next(
        (r["speed"].get("prefetched") or 0 for r in rows if r["strategy"] == headline), None
    )  # forwards served by a prefetched all-to-all
    report(results, args)
    save(results, args.out)


def checkpoint_runs(
    n: int, headline: dict[str, Any], root: Path, match_job: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Save at N mid-way and resume against the uninterrupted run; the saved weights loaded at N/2."""
    half = args.match_steps // 2
    ckpt_root = root / "checkpoints"
    ckpt = str(ckpt_root / f"step={half}.ckpt")
    whole, saved, resumed = run_group(
        n,
        [
            match_job(headline, root=str(root / "whole"), name="uninterrupted"),
            match_job(headline, steps=half, save_every=half, weights=True, root=str(ckpt_root), name="save"),
            match_job(headline, ckpt_path=ckpt, root=str(ckpt_root), name="resume"),
        ],
        args,
    )
    # The saved weights on N/2 ranks (default sparse group: all of them).
    [loaded] = run_group(
        n // 2, [match_job({}, ckpt_path=ckpt, root=str(root / "load"), load=True, name=f"weights at {n // 2}")], args
    )
    return {
        "resume_max_loss_rel_diff": max_relative_difference(resumed.get("losses", []), whole.get("losses", [])[half:]),
        "weights_at_half_max_abs_diff": weights_difference(loaded.get("weights", {}), saved.get("weights", {}))
        if "weights" in loaded and "weights" in saved
        else math.inf,
        "errors": [r["error"] for r in (whole, saved, resumed, loaded) if "error" in r],
    }


def save(results: dict[str, Any], path: Path | None) -> None:
    """Write what is measured so far (after every group: a run cut short keeps its finished groups)."""
    if path is not None:
        path.write_text(json.dumps(_plain(results), indent=1))


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    n, base = results["n"], results["baseline"]
    print(
        f"\ngem5d scaling on {n} x {results['device']}: GEMRanker dim {args.model_dim} x {args.num_layers} layers, "
        f"{args.batch_size} users/GPU, histories clip({args.max_history} u^3), ~{args.mean_candidates:.0f} "
        f"candidates/user, {'bf16-mixed' if args.device == 'cuda' else 'fp32'}, {args.comm_precision} embedding comms"
    )
    for run, name in zip(results.get("baseline_runs", [base]), ("1 GPU", "1 GPU, overlap"), strict=False):
        print(
            f"{name}: {run.get('step_ms', math.nan):.2f} ms/step, {run.get('samples_per_s_per_gpu', math.nan):.1f} "
            f"samples/s, local MFU {run.get('mfu', math.nan):.1%}" + (" (the baseline)" if run is base else "")
        )
    header = f"{'configuration':<36} {'ms/step':>8} {'samples/s/GPU':>14} {'scaling':>8} {'MFU':>6} {'E2E MFU':>8}"
    print(header + f" {'imbalance':>9} {'loss vs 1 GPU':>14}")
    base_rate = base.get("samples_per_s_per_gpu", math.nan)

    def line(name: str, speed: dict[str, Any], check: dict[str, Any] | None = None) -> None:
        if "error" in speed:
            print(f"{name:<36} failed")
            return
        scaling = speed["samples_per_s_per_gpu"] / base_rate
        speed["scaling_ratio"], speed["e2e_mfu"] = scaling, speed["mfu"] * scaling
        diff = "" if check is None else ("failed" if "error" in check else f"{check['max_loss_rel_diff']:.1e}")
        print(
            f"{name:<36} {speed['step_ms']:>8.2f} {speed['samples_per_s_per_gpu']:>14.1f} {scaling:>8.3f} "
            f"{speed['mfu']:>6.1%} {speed['e2e_mfu']:>8.1%} {speed['compute_imbalance']:>9.3f} {diff:>14}"
        )

    for row in results["layouts"]:
        line(row["layout"] + " (overlap, BBS)", row["speed"], row["match"])
    if "overlap_off" in results:
        line(f"sparse {n} / {args.headline}, no overlap", results["overlap_off"])
        line(f"sparse {n} / {args.headline}, no BBS", results["shuffling_off"])
        headline = headline_layout(n, args.headline)
        on = next((r["speed"] for r in results["layouts"] if r["strategy"] == headline), {"error": "not run"})
        off = results["overlap_off"]
        if "error" not in on and "error" not in off:
            print(f"overlap saves {off['step_ms'] - on['step_ms']:.2f} ms/step ({off['step_ms'] / on['step_ms']:.3f}x)")
    if "checkpoint" in results:
        ck = results["checkpoint"]
        print(
            f"resume at {n} vs uninterrupted: max relative loss difference {ck['resume_max_loss_rel_diff']:.1e}; "
            f"weights loaded at {n // 2} vs saved at {n}: max abs difference {ck['weights_at_half_max_abs_diff']:.1e}"
        )
    for way, out in results.get("match_by_sharding", {}).items():
        diff = "failed" if "error" in out else f"{out['max_loss_rel_diff']:.1e}"
        print(f"sparse {n}, tables sharded {way}: max relative loss difference vs 1 GPU {diff}")
        print(f"  weights differing from 1 GPU's at the start: {out.get('start_weights_diff')}")
    for row in results["layouts"]:
        if row["match"].get("plan"):
            print(f"embedding plan of {row['layout']}: {row['match']['plan']}")
        print(f"  weights differing from 1 GPU's at the start: {row['match'].get('start_weights_diff')}")
    bad = [
        r["layout"] for r in results["layouts"] if not r["match"].get("max_loss_rel_diff", math.inf) <= args.loss_rtol
    ]
    for row in results["layouts"]:
        if "comms_max_loss_rel_diff" in row["match"]:
            diff = row["match"]["comms_max_loss_rel_diff"]
            print(f"{row['layout']} with {args.comm_precision} embedding comms: max relative loss diff {diff:.1e}")
            if not diff <= args.comms_loss_rtol:
                bad.append(f"{row['layout']} ({args.comm_precision} comms)")
    print("losses match 1 GPU in every layout" if not bad else f"losses differ from 1 GPU: {bad}")


def _plain(value: Any) -> Any:
    """JSON-ready: numpy arrays (weights) dropped to their shapes."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in ("weights", "start_weights")}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


if __name__ == "__main__":
    main()
