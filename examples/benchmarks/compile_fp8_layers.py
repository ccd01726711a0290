"""HSTU layers compiled with dynamic shapes, in bf16 and with FP8 linears, against the same layers eager.

Two ``HSTULayer`` s (GDPA attention: the Triton kernels on a GPU) train on jagged batches under bf16 autocast:
forward, a scalar loss, backward. Variants, each compiled layer by layer (``compile_hstu_layers``, as
``GEM5DStrategy(compile_layers=True)`` and ``SequentialRecommender(compile_layers=True)`` do):

- ``bf16``: the layers as built;
- ``fp8``: converted by :func:`lightning_gem.precision.convert` (``fp8-blockwise``, the norm fused with the
  quantization of ``uvqk``'s input). ``MXLinear`` and the fused norms run eagerly under ``torch.compile`` (a
  graph break each), so the compiled graphs hold the ops between them.

Per variant: whether the compiled layers run, their largest relative difference from the eager ones (outputs
over the batches), the median step time of both (``--reps`` passes over the batches after one warm-up pass;
the device is synchronised around each pass) and the graphs Dynamo compiled.

Usage:
    python examples/benchmarks/compile_fp8_layers.py                 # CUDA, width 1024, 8 heads
    python examples/benchmarks/compile_fp8_layers.py --device cpu --dim 128 --max-length 40 --reps 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from lightning_gem.components.encoder import HSTULayer, compile_hstu_layers
from torch import nn

from lightning_gem.precision import MXConfig, convert


def _batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.batches):
        lengths = torch.randint(16, args.max_length, (args.users,), generator=g).tolist()
        offsets = torch.tensor([0, *lengths], device=args.device).cumsum(0)
        out.append((torch.randn(int(offsets[-1]), args.dim, device=args.device), offsets, max(lengths)))
    return out


def _layers(args: argparse.Namespace, fp8: bool) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(HSTULayer(args.dim, args.num_heads) for _ in range(args.num_layers)).to(args.device)
    for layer in layers:  # a fresh residual branch is zero: give it weights
        nn.init.normal_(layer.output.weight, std=0.02)
    return convert(layers, MXConfig(recipe="fp8-blockwise")) if fp8 else layers


def _step(layers: nn.ModuleList, x: torch.Tensor, offsets: torch.Tensor, longest: int) -> torch.Tensor:
    with torch.autocast(x.device.type, torch.bfloat16):
        y = x
        for layer in layers:
            y = layer(y, offsets, max_seq_len=longest)
    y.float().square().mean().backward()
    return y.detach().float()


def _pass_ms(layers: nn.ModuleList, batches: list, reps: int) -> float:
    def sync() -> None:
        if batches[0][0].is_cuda:
            torch.cuda.synchronize()

    times = []
    for _ in range(reps + 1):  # the first pass warms up
        sync()
        start = time.perf_counter()
        for batch in batches:
            _step(layers, *batch)
        sync()
        times.append((time.perf_counter() - start) * 1e3 / len(batches))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    batches = _batches(args)
    print(f"{args.num_layers} HSTU layers, width {args.dim}, {args.num_heads} heads, {args.users} users a batch")
    for name, fp8 in (("bf16", False), ("fp8", True)):
        try:
            eager = _layers(args, fp8)
            compiled = copy.deepcopy(eager)
            compile_hstu_layers(compiled)
            torch.compiler.reset()
            errors = []
            for batch in batches:
                a, b = _step(eager, *batch), _step(compiled, *batch)
                errors.append(float((a - b).abs().max() / a.abs().max()))
            eager_ms, compiled_ms = _pass_ms(eager, batches, args.reps), _pass_ms(compiled, batches, args.reps)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(
                f"{name}: runs; largest relative difference {max(errors):.2e}; eager {eager_ms:.2f} ms, compiled "
                f"{compiled_ms:.2f} ms a step ({eager_ms / compiled_ms:.2f}x); {graphs} graphs"
            )
        except Exception as error:  # report and go on to the next variant
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}")


if __name__ == "__main__":
    main()
