"""End to end: the GEM example model trained by the plain stack and by the kit's stack, same data, same steps.

Both stacks train ``GEMRanker`` (torchrec embedding tables, an HSTU history encoder, GDPA candidate
interaction, multi-task head; AdamW) on the same synthetic GEM-like users, production-shaped:
histories ``clip(L u^3, 16, L)`` up to ``--max-history`` events with several features per event and
pooled user features, hundreds of candidates per user.

- plain: attention on padded tensors (``attention_impl="padded"``: SDPA for softmax, eager for the
  pointwise HSTU attention, which SDPA lacks), ``precision="bf16-mixed"``, Lightning's default
  single-device strategy, a plain shuffled sampler; with ``--plain-micro-batches K`` each step is K
  micro-batches of ``batch_size / K`` users with gradient accumulation (the padded scores of many heads do not
  fit otherwise), timed as one step;
- kit: the GDPA Triton kernels (``attention_impl="auto"``), ``MXFP8Precision()`` (its ``auto`` recipe
  picks what is fast on the device: fp8 on Hopper; ``--kit-precision bf16``: bf16-mixed instead,
  ``mxfp8-attention``: FP8 attention too),
  ``GEM5DStrategy(train_pipeline=True)`` (world size 1: torchrec's sharded tables and gem5d's train step,
  without FSDP2 over a single rank; the next batch, pinned, copied and its embedding input path prepared on a
  side stream; ``--compile-layers``: each HSTU layer compiled too; ``--token-multiple N``: token counts padded
  to multiples of N by a padding user, so GEMMs meet few row counts, and with ``--token-growth G`` to buckets growing
  by G; ``--fused-optimizer``: AdamW's fused kernel; ``--cuda-graphs``: the encoder and the interaction replayed
  from CUDA graphs), Base Batch Shuffling in the DataModule;
- kit-eager (and kit-eager-2, the same again): the kit stack without ``--token-multiple``, ``--fused-optimizer``,
  ``--cuda-graphs`` and ``--compile-layers``; with the kit stack the summary compares their per-step losses on the
  same batches (the second eager run gives the gap that nondeterministic kernels alone make);
- kit-unfused: the kit stack with PyTorch's unfused ops around each HSTU layer's attention (``F.silu`` and a split
  into strided views, the norm and the gating product) instead of the fused kernels of
  :mod:`lightning_gem.ops.pointwise`, and the input norms in float32 then cast by autocast; in the candidate
  interaction likewise its norms, and its token interaction as batched matmuls instead of the fused token ops;
- kit-no-prefetch: the kit stack without the embedding input prefetch (``GEM5DStrategy(train_pipeline=False)``):
  the ids' input_dist, whose split sizes and per-key lengths the host reads, runs in the step on the compute stream
  instead of one batch ahead on a side stream;
- kit-fp8-saved: the kit stack with ``MXFP8Precision(saved_activations="fp8")``: what the HSTU layers and the
  candidate interaction save for the backward is stored in MXFP8 (the summary line compares its peak memory,
  step time and per-step losses with the kit stack's);
- kit-2 and kit-seed: the kit stack again, on the same batches: kit-2 from the same seed (its losses differ from
  the kit stack's only by nondeterministic kernels such as atomic adds), kit-seed with its weights initialized from
  the next seed (seed noise); with kit-fp8-saved the summary sets its loss gaps beside theirs.

Each stack runs ``--warmup + --steps`` training steps in ``Trainer.fit``; a step's time is the interval
between the ends of consecutive steps on the device's timeline (CUDA events: no device sync is added, data
loading counts). Reported per stack: median step time over the timed steps, tokens/s (history + candidate
tokens), local MFU of *useful* FLOPs, and peak memory. Useful FLOPs are counted apart, by ``torch``'s FLOP
counter over the timed batches through a model with the jagged attention ops (whose registered formulas
count only allowed query-key pairs), so the plain stack's padding is not counted as work and the timed
steps carry no counter. The speed-up is the plain median step time over the kit's. With ``--cuda-graphs`` each stack
also reports the graph signatures it captured and how many of them came in the timed steps (each such step ran
warm-ups and a capture besides its work).

``--preset nvidia-hstu`` is NVIDIA's published HSTU training configuration (recsys-examples,
``examples/hstu/training/benchmark``): 8 HSTU layers of width 1024, 4 heads x 256, item and contextual embeddings
of 128, 32 users a GPU, histories up to 4096; ``nvidia-hstu-fixed`` the same with every history 4096 long (their
fixed-shape profile). With ``--profile-steps N`` each stack also reports the shares of its device timeline spent
in attention, GEMMs, embeddings, the optimizer, norms and quantization, copies, other kernels and host gaps.

Usage:
    python examples/benchmarks/e2e.py                         # CUDA, production-like shapes
    python examples/benchmarks/e2e.py --preset nvidia-hstu --stacks kit --profile-steps 3
    python examples/benchmarks/e2e.py --device cpu --tiny     # a smoke run of the whole path on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import lightning as L
import torch
from gem_example import (
    ProfileLastSteps,
    StepClock,
    add_shape_arguments,
    gem_ranker,
    profiling_callbacks,
    step_shares,
    synthetic_users,
    use_tiny_shapes,
)
from lightning_gem.components.encoder import HSTULayer
from lightning_gem.components.interaction import GDPAInteraction
from lightning_gem.strategies import GEM5DStrategy

from lightning_gem.callbacks import MFUMonitor
from lightning_gem.data import GEMDataModule, SyntheticRankingSource
from lightning_gem.flops import model_flops, peak_tflops
from lightning_gem.precision import MXFP8Precision

STACKS = (
    "plain", "kit", "kit-unfused", "kit-no-prefetch", "kit-fp8-saved", "kit-2", "kit-seed", "kit-eager", "kit-eager-2"
)  # fmt: skip

_NVIDIA_HSTU = {
    "model_dim": 1024,
    "num_layers": 8,
    "num_heads": 4,
    "embedding_dim": 128,
    "batch_size": 32,
    "max_history": 4096,
}
#: Named shape sets; a flag given on the command line overrides its preset's value.
PRESETS: dict[str, dict[str, object]] = {
    "nvidia-hstu": _NVIDIA_HSTU,
    "nvidia-hstu-fixed": {**_NVIDIA_HSTU, "min_history": 4096},
}


class GraphSignatures(L.Callback):
    """The model's CUDA graph signatures (``GEMRanker.graph_signatures``) when the timed steps begin, after
    ``warmup`` steps, and when training ends: a signature new in a timed step cost that step warm-up runs and a
    capture, so the median step reads high while they keep coming."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.at_start: dict[str, int] = {}
        self.at_end: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.at_start = dict(getattr(pl_module, "graph_signatures", {}))

    def on_train_end(self, trainer, pl_module) -> None:
        self.at_end = dict(getattr(pl_module, "graph_signatures", {}))


def run_stack(
    stack: str, source: SyntheticRankingSource, tokens_per_step: float, args: argparse.Namespace
) -> dict[str, float]:
    """Train ``stack`` for warm-up + timed steps on ``source``; returns its measurements."""
    L.seed_everything(args.seed + (stack == "kit-seed"), verbose=False)  # the batches come from `source` either way
    kit = stack.startswith("kit")
    fast = kit and not stack.startswith("kit-eager")  # the host-time options apply (kit-eager: without them)
    saved = "fp8" if stack == "kit-fp8-saved" else None  # the GDPA layers' saved activations in FP8
    mx = kit and args.kit_precision in ("mxfp8", "mxfp8-attention")  # else bf16 autocast, as the plain stack
    model = gem_ranker(
        source,
        args,
        "auto" if kit else "padded",
        token_multiple=args.token_multiple if fast else None,
        token_growth=args.token_growth if fast else None,
        fused_optimizer=args.fused_optimizer and fast,
        cuda_graphs=args.cuda_graphs and fast,
    )
    if stack == "kit-unfused":  # PyTorch's unfused ops around the attention instead of the fused kernels
        for layer in model.modules():
            if isinstance(layer, HSTULayer | GDPAInteraction):
                layer.pointwise_impl = "reference"
    cuda = args.device == "cuda"
    pinned = kit and cuda  # the kit's pipeline copies pinned batches asynchronously
    micro = 1 if kit else args.plain_micro_batches  # the plain stack may need several to fit in memory
    batch_size = args.batch_size // micro
    data = GEMDataModule(source=source, batch_size=batch_size, seed=args.seed, balance=kit, pin_memory=pinned)
    monitor = MFUMonitor(flops_every_n_steps=args.warmup + args.steps + 1, plot=False)  # counts step 0 only
    clock = StepClock(batches_per_step=micro)
    profilers = profiling_callbacks(args, args.warmup + args.steps, stack)
    signatures = GraphSignatures(args.warmup)
    callbacks: list[L.Callback] = [monitor, clock, signatures, *profilers]
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=GEM5DStrategy(train_pipeline=stack != "kit-no-prefetch", compile_layers=args.compile_layers and fast)
        if kit
        else "auto",
        precision=None if mx else ("bf16-mixed" if cuda else "32-true"),
        plugins=[MXFP8Precision(attention=args.kit_precision == "mxfp8-attention", saved_activations=saved)]
        if mx
        else None,
        max_steps=args.warmup + args.steps,
        accumulate_grad_batches=micro,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=args.root,
    )
    if cuda:
        gc.collect()  # the previous stack's model and optimizer state: not in this one's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=data)
    step_s = clock.median_interval(skip=args.warmup)
    saved_stats = _saved_activation_stats(model, args.warmup + args.steps) if saved else {}
    from lightning_gem.ops.attention.impl.triton._tuning import chosen_tiles
    from lightning_gem.ops.mx.impl.triton._common import chosen_configs

    # Kernel tunings so far in this process (each times its candidates once): many here mean shapes keep changing.
    print(f"{stack}: tuned keys so far: {len(chosen_tiles())} attention, {len(chosen_configs())} FP8 quantization")
    graphs = {}
    if signatures.at_end:
        graphs = {"at_first_timed_step": signatures.at_start, "at_end": signatures.at_end}
        timed = {name: count - signatures.at_start.get(name, 0) for name, count in signatures.at_end.items()}
        print(f"{stack}: CUDA graph signatures {signatures.at_end}, captured in the timed steps {timed}")
    profiled = next((p for p in profilers if isinstance(p, ProfileLastSteps) and p.device_ms), None)
    shares = step_shares(profiled.device_ms, profiled.num_steps, step_s * 1e3) if profiled else {}
    return {
        "losses": clock.losses,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_step / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        **({"shares": shares} if shares else {}),
        **({"graph_signatures": graphs} if graphs else {}),
        **({"saved_activations": saved_stats} if saved_stats else {}),
    }


def _saved_activation_stats(model: torch.nn.Module, steps: int) -> dict[str, float]:
    """What the quantized saved-activation contexts of ``model``'s layers stored, a step (GiB): the tensors stored
    in FP8 in their own dtype and as codes and scales, and the tensors recomputed instead of stored."""
    stats = [m.saved_activation_stats for m in model.modules() if getattr(m, "saved_activation_stats", None)]
    per_step = 2**30 * max(steps, 1)
    return {
        "tensors": sum(s.tensors for s in stats) / max(steps, 1),
        "gib_in": sum(s.bytes_in for s in stats) / per_step,
        "gib_fp8": sum(s.bytes_out for s in stats) / per_step,
        "recomputed": sum(s.recomputed for s in stats) / max(steps, 1),
        "gib_recomputed": sum(s.bytes_recomputed for s in stats) / per_step,
    }


def _late_loss(losses: list[float]) -> float:
    """Mean training loss of the last quarter of the steps (of all of them when there are fewer than 4)."""
    tail = losses[-max(len(losses) // 4, 1) :] if losses else [float("nan")]
    return statistics.fmean(tail)


def _gaps(a: list[float], b: list[float]) -> tuple[float, float]:
    """Largest and mean absolute difference of two runs' per-step losses (NaN for none)."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=False)] or [float("nan")]
    return max(diffs), statistics.fmean(diffs)


def _loss_gaps(results: dict[str, dict]) -> str:
    """The kit stack's per-step losses against the kit without its host-time options (``kit-eager``), on the same
    batches: largest and mean gap, and where ``kit-eager-2`` ran (the same eager stack again, differing only by
    nondeterministic kernels such as atomic adds), the same figures between the two eager runs as the noise floor."""

    eager = results["kit-eager"]["losses"]
    worst, mean = _gaps(results["kit"]["losses"], eager)
    line = f"kit against kit-eager over {len(eager)} steps: per-step loss gap largest {worst:.4g}, mean {mean:.4g}"
    if "kit-eager-2" in results:
        worst2, mean2 = _gaps(results["kit-eager-2"]["losses"], eager)
        line += f"; kit-eager run twice: largest {worst2:.4g}, mean {mean2:.4g}"
    speedup = results["kit-eager"]["step_ms"] / results["kit"]["step_ms"]
    return f"{line}; step time kit-eager / kit {speedup:.2f}x"


def _saved_activation_summary(results: dict[str, dict]) -> str:
    """kit-fp8-saved against the kit stack: peak memory, step time, and its per-step loss gaps (largest, mean) and
    late loss beside those of kit-2 (nondeterministic kernels alone) and kit-seed (another initialization) where
    they ran, all on the same batches."""
    exact, fp8 = results["kit"], results["kit-fp8-saved"]
    line = (
        f"FP8 saved activations: peak memory {fp8['peak_gib'] / exact['peak_gib'] - 1:+.1%}, step time "
        f"{fp8['step_ms'] / exact['step_ms'] - 1:+.1%}; per-step loss gap against kit (largest, mean), late loss:"
    )
    for stack in ("kit-fp8-saved", "kit-2", "kit-seed"):
        if stack in results:
            worst, mean = _gaps(exact["losses"], results[stack]["losses"])
            line += f" {stack} {worst:.4g}, {mean:.4g}, {_late_loss(results[stack]['losses']):.4f};"
    line += f" kit's late loss {_late_loss(exact['losses']):.4f}"
    stats = fp8.get("saved_activations")
    if stats:
        line += (
            f"; a step stored {stats['tensors']:.0f} tensors in FP8 ({stats['gib_in']:.2f} GiB as"
            f" {stats['gib_fp8']:.2f} GiB) and recomputed {stats['recomputed']:.0f} ({stats['gib_recomputed']:.2f} GiB)"
        )
    return line


def useful_flops_per_step(source: SyntheticRankingSource, args: argparse.Namespace) -> float:
    """Mean training FLOPs of the timed batches, counted through the jagged attention ops' formulas."""
    L.seed_everything(args.seed, verbose=False)
    device = torch.device(args.device)
    model = gem_ranker(source, args, "auto").to(device)
    data = GEMDataModule(source=source, batch_size=args.batch_size, seed=args.seed, balance=False)
    data.setup("fit")
    counts = []
    # The same matmuls as the trained stacks, at their speed: on CUDA in bf16 (a float32 pass over 8 layers of
    # 4096-token histories would take longer than the training it counts).
    for step, batch in enumerate(data.train_dataloader()):
        if step >= args.warmup:
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                counts.append(model_flops(model, batch))  # backward of sum(logits): the loss adds no matmul
    return statistics.fmean(counts)


def _mean_tokens_per_user(source: SyntheticRankingSource) -> float:
    """History + candidate tokens of the mean user (every user is trained once, in both stacks)."""
    dataset = source.dataset("train")
    return statistics.fmean(len(dataset[i].history) + len(dataset[i].candidates) for i in range(len(dataset)))


def _histories(args: argparse.Namespace) -> str:
    if args.min_history >= args.max_history:
        return f"histories of {args.max_history}"
    return f"histories clip({args.max_history} u^3, {args.min_history}, {args.max_history})"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line (``argv``, default ``sys.argv[1:]``) as arguments, a preset's values under the flags given,
    and the stacks to run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a named shape set (see above)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the whole path")
    parser.add_argument("--stacks", default="plain,kit", help=f"comma-separated from {STACKS}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--batch-size", type=int, default=32, help="users per step")
    add_shape_arguments(parser)
    parser.add_argument(
        "--plain-micro-batches",
        type=int,
        default=1,
        help="the plain stack's step as this many micro-batches with gradient accumulation (its padded attention "
        "scores grow with the heads: wide models fit only so); the step time covers them all",
    )
    parser.add_argument(
        "--compile-layers", action="store_true", help="the kit stack compiles each HSTU layer (gem5d's compile_layers)"
    )
    parser.add_argument(
        "--token-multiple",
        type=int,
        default=None,
        help="the kit stack pads each batch's history and candidate tokens to multiples of this with a padding user "
        "(GEMRanker's token_multiple): few distinct GEMM row counts instead of a new one every step",
    )
    parser.add_argument(
        "--token-growth",
        type=float,
        default=None,
        help="with --token-multiple, pad to geometrically growing buckets of that many multiples instead (GEMRanker's "
        "token_growth, e.g. 1.125): a few token counts a run, i.e. a few CUDA graph signatures",
    )
    parser.add_argument(
        "--fused-optimizer", action="store_true", help="the kit stack's AdamW in its fused kernel (GEMRanker's option)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the kit stack's encoder and interaction through CUDA graphs (GEMRanker's cuda_graphs; needs "
        "--token-multiple)",
    )
    parser.add_argument(
        "--kit-precision",
        choices=("mxfp8", "mxfp8-attention", "bf16"),
        default="mxfp8",
        help="the kit stack's precision: MXFP8Precision's auto recipe (FP8 linears on Hopper), the same with FP8 "
        "attention in the GDPA layers (MXFP8Precision(attention=True)), or bf16-mixed",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=Path("logs/e2e"), help="the Trainer's default_root_dir")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many last steps of each stack")
    parser.add_argument("--cprofile-steps", type=int, default=0, help="cProfile this many last steps of each stack")
    parser.add_argument(
        "--cprofile-dump", type=Path, default=None, help="with --cprofile-steps, also write each stack's stats here"
    )
    parser.add_argument("--sync-debug", action="store_true", help="list the device syncs of the first timed step")
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.warmup, args.batch_size = min(args.steps, 3), min(args.warmup, 1), min(args.batch_size, 4)
        use_tiny_shapes(args)
    if "kit-fp8-saved" in args.stacks and args.kit_precision == "bf16":
        parser.error("--stacks kit-fp8-saved stores saved activations through MXFP8Precision: not with bf16")
    if args.token_growth is not None and args.token_multiple is None:
        parser.error("--token-growth needs --token-multiple")
    if args.cuda_graphs and args.token_multiple is None:
        parser.error("--cuda-graphs needs --token-multiple (GEMRanker's cuda_graphs: unpadded batches are new shapes)")
    if args.batch_size % args.plain_micro_batches:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --plain-micro-batches")
    stacks = [s.strip() for s in args.stacks.split(",")]
    if any(s not in STACKS for s in stacks):
        parser.error(f"--stacks must be from {STACKS}, got {args.stacks!r}")
    return args, stacks


def main() -> None:
    args, stacks = parse_args()
    source = synthetic_users(args, args.batch_size * (args.warmup + args.steps))  # every stack, and the FLOPs
    tokens_per_step = args.batch_size * _mean_tokens_per_user(source)
    results = {}
    for stack in stacks:  # each stack's figures are written as soon as it has run: a cut-short run keeps them
        results[stack] = run_stack(stack, source, tokens_per_step, args)
        print(f"{stack}: {results[stack]['step_ms']:.2f} ms per step (median)", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps({"partial": True, **results}, indent=1))
    useful = useful_flops_per_step(source, args)  # the same global batches in both stacks
    peak = peak_tflops(args.device) if args.device == "cuda" else None
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"GEMRanker dim {args.model_dim} x {args.num_layers} layers x {args.num_heads} heads, {args.batch_size} users"
        f"/step, {_histories(args)}, ~{args.mean_candidates:.0f} candidates/user, on {device}"
    )
    if args.plain_micro_batches > 1 and "plain" in results:
        micro = args.plain_micro_batches
        print(f"plain steps: {micro} micro-batches of {args.batch_size // micro} users")
    header = f"{'stack':<15} {'step ms':>9} {'tokens/s':>11} {'useful TFLOP/s':>14} {'MFU':>6} {'peak GiB':>9}"
    print(f"{header} {'loss':>7}")
    for stack, r in results.items():
        tflops = useful / (r["step_ms"] / 1e3) / 1e12
        r["useful_tflops"] = tflops
        r["mfu"] = tflops / peak if peak else float("nan")
        print(
            f"{stack:<15} {r['step_ms']:>9.2f} {r['tokens_per_s']:>11.0f} {tflops:>14.4g} {r['mfu']:>6.1%}"
            f" {r['peak_gib']:>9.2f} {_late_loss(r['losses']):>7.4f}"
        )
    for stack, r in results.items():
        if "shares" in r:
            print(f"{stack} share of the step: " + ", ".join(f"{k} {v:.1%}" for k, v in r["shares"].items()))
    if {"plain", "kit"} <= results.keys():
        print(f"kit / plain step throughput: {results['plain']['step_ms'] / results['kit']['step_ms']:.2f}x")
    if {"kit", "kit-fp8-saved"} <= results.keys():
        print(_saved_activation_summary(results))
    if {"kit", "kit-eager"} <= results.keys():
        print(_loss_gaps(results))
    if args.out is not None:
        summary = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "useful_flops": useful}
        args.out.write_text(json.dumps({**summary, **results}, indent=1))


if __name__ == "__main__":
    main()
