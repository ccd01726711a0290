"""Launch shapes of the HSTU layer's pointwise kernels, timed one against another on the same inputs.

For each shape (tokens x heads x head dim of an HSTU layer: its SiLU-split over U, V, Q, K with the projection's
bias, and its norms over ``heads x head dim`` columns) and each kernel, forward and backward:

- ``silu_split`` (:func:`lightning_gem.ops.pointwise.silu_split`'s kernels): rows a tile, warps, persistent programs
  an SM (the backward's, with a bias);
- ``norm_mul`` (the attention output's RMSNorm per head times the gate U) and the input RMSNorm (fp32 residual in,
  bf16 out) with its residual gradient added in the backward: rows a tile, warps, persistent programs an SM
  (backward).

Each variant is the launcher's own rule with one or more of its choices overridden (the ``tile_rows``,
warps and resident-program rules of :mod:`lightning_gem.ops.pointwise.impl.triton.kernels`), checked
against the default variant's outputs, and timed alone (median of ``triton.testing.do_bench``). Printed per kernel
and shape: the default's time and GB/s of the bytes the kernel must move (each input read once, each output written
once), the fastest variant and its speed-up, beside a same-run copy's GB/s. The default rules are chosen on these
measurements (docs/benchmarks.md, "Pointwise kernels").

Usage::

    python examples/benchmarks/pointwise_tiles.py                       # the three default shapes, on CUDA
    python examples/benchmarks/pointwise_tiles.py --shapes 16384x4x256 --out pointwise.json
    TRITON_INTERPRET=1 python examples/benchmarks/pointwise_tiles.py --device cpu --quick --shapes 24x2x32  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision import bench

import lightning_gem.ops.pointwise.impl.triton.kernels as kernels

# Tokens x heads x head dim: NVIDIA's HSTU configuration (width 1024 = 4 x 256), the GEM example at width 2048
# (16 x 128) and at width 512 (4 x 128); about one training step's tokens each.
DEFAULT_SHAPES = ("36864x4x256", "36864x16x128", "32768x4x128")


@contextlib.contextmanager
def overridden(rows: int | None = None, warps: int | None = None, per_sm: int | None = None) -> Iterator[None]:
    """Inside, the pointwise launchers take ``rows`` rows a tile, ``warps`` warps and ``per_sm`` persistent programs
    an SM where given (None: their own rule)."""
    saved = (kernels._tile_rows, kernels._resident_programs, kernels.launch)
    tile_rows, resident, launch = saved

    def rows_rule(block_cols: int, max_rows: int = 64, elements: int = kernels._ELEMENTS) -> int:
        return rows if rows is not None else tile_rows(block_cols, max_rows, elements)

    def resident_rule(x: torch.Tensor, per_sm: int = 4, override: int | None = per_sm) -> int:
        return resident(x, override if override is not None else per_sm)

    def launch_with(kernel, grid, args, meta) -> None:  # every launcher's warps, whatever its rule
        return launch(kernel, grid, args, {**meta, "num_warps": warps} if warps is not None else meta)

    kernels._tile_rows, kernels._resident_programs, kernels.launch = rows_rule, resident_rule, launch_with
    try:
        yield
    finally:
        kernels._tile_rows, kernels._resident_programs, kernels.launch = saved


def _bench(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` (``precision.bench``: ``triton.testing.do_bench`` on CUDA, the wall clock elsewhere)."""
    return bench(fn, "cuda" if torch.cuda.is_available() else "cpu")


def sweep(name: str, nbytes: int, run: Callable[[], tuple], variants: list[dict], atol: float) -> dict:
    """Time ``run`` under the default rules and each of ``variants`` (keywords of :func:`overridden`); a variant
    whose outputs differ from the default's beyond ``atol`` (plus 2% relative) is reported and not timed."""
    with overridden():
        reference = [t.float().clone() for t in run() if t is not None]
        default_ms = _bench(run)
    timed = []
    for variant in variants:
        with overridden(**variant):
            try:
                outputs = [t.float() for t in run() if t is not None]
                worst = max(float((a - b).abs().max()) for a, b in zip(outputs, reference, strict=True))
                if not all(torch.allclose(a, b, rtol=2e-2, atol=atol) for a, b in zip(outputs, reference, strict=True)):
                    print(f"    {variant}: outputs differ from the default's (largest {worst:.3g}); not timed")
                    continue
                timed.append((variant, _bench(run)))
            except Exception as error:  # e.g. a tile over the registers or shared memory
                print(f"    {variant}: {type(error).__name__}: {str(error)[:120]}")
    best_variant, best_ms = min([("the default", default_ms), *timed], key=lambda item: item[1])
    print(
        f"{name}: default {default_ms * 1e3:7.1f} us {nbytes / default_ms / 1e6:5.0f} GB/s; fastest {best_variant} "
        f"{best_ms * 1e3:7.1f} us ({default_ms / best_ms:.2f}x)",
        flush=True,
    )
    return {"kernel": name, "bytes": nbytes, "default_ms": default_ms,
            "variants": [{"override": v, "ms": ms} for v, ms in timed]}  # fmt: skip


def run_shape(tokens: int, heads: int, head_dim: int, device: str, quick: bool = False) -> list[dict]:
    """Every kernel's sweep at one shape (bf16 activations, fp32 residual, norm weights and biases in fp32);
    ``quick``: two variants a kernel."""
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    tag, width = f"{tokens}x{heads}x{head_dim}", heads * head_dim
    x, bias = randn(tokens, heads, 4 * head_dim), randn(heads, 4 * head_dim)
    sizes = (head_dim,) * 4
    grads = tuple(randn(tokens, heads, head_dim) for _ in sizes)
    rows_warps = [dict(rows=r, warps=w) for r in (1, 2, 4, 8) for w in (4, 8)]
    persistent = [dict(rows=r, warps=w, per_sm=p) for r in (1, 2, 4, 8) for w in (4, 8) for p in (2, 4)]
    if quick:
        rows_warps, persistent = [dict(rows=1, warps=4), dict(rows=4, warps=4)], [dict(rows=1, per_sm=2), dict(warps=8)]
    results = [
        sweep(f"silu_split fwd {tag}", 2 * x.numel() * 2, lambda: kernels.silu_split_forward(x, sizes, bias),
              rows_warps, 1e-2),
        sweep(f"silu_split bwd {tag}", 3 * x.numel() * 2, lambda: kernels.silu_split_backward(x, grads, sizes, bias),
              persistent, 5e-2),
    ]  # fmt: skip
    # The HSTU layer's norms (RMSNorm, its default): the attention output's per head (``per_head_norm``, the default:
    # rows of one head's columns) times the gate U, and the input norm over the fp32 residual's rows (bf16 out).
    attn, gate, grad = randn(tokens, heads, head_dim), randn(tokens, heads, head_dim), randn(tokens, heads, head_dim)
    weight = 1 + 0.1 * randn(head_dim, dtype=torch.float32)
    _, mean, rstd = kernels.norm_mul_forward(attn, gate, weight, None, 1e-5, False)
    results.append(
        sweep(
            f"norm_mul fwd {tag}",
            3 * attn.numel() * 2,
            lambda: kernels.norm_mul_forward(attn, gate, weight, None, 1e-5, False)[:1],
            rows_warps,
            1e-2,
        )
    )
    results.append(sweep(f"norm_mul bwd {tag}", 5 * attn.numel() * 2,
                         lambda: kernels.norm_mul_backward(grad, attn, gate, weight, None, mean, rstd, False)[:2],
                         persistent, 5e-2))  # fmt: skip
    residual, grad_residual = randn(tokens, width, dtype=torch.float32), randn(tokens, width, dtype=torch.float32)
    grad_y, width_weight = randn(tokens, width), 1 + 0.1 * randn(width, dtype=torch.float32)

    def input_norm() -> tuple:
        return kernels.norm_mul_forward(residual, None, width_weight, None, 1e-5, False, torch.bfloat16)

    _, mean, rstd = input_norm()
    results.append(sweep(f"input norm fwd {tag}", residual.numel() * 6, lambda: input_norm()[:1], rows_warps, 1e-2))

    def input_norm_backward() -> tuple:
        return kernels.norm_mul_backward(grad_y, residual, None, width_weight, None, mean, rstd, False,
                                         grad_residual=grad_residual)[:1]  # fmt: skip

    results.append(sweep(f"input norm + residual bwd {tag}", residual.numel() * 14, input_norm_backward, persistent,
                         5e-2))  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="TOKENSxHEADSxHEAD_DIM")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="two variants a kernel (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    big = torch.empty(1 << (28 if args.device == "cuda" else 20), dtype=torch.uint8, device=args.device)
    copy_gbps = 2 * big.numel() / _bench(lambda: torch.empty_like(big).copy_(big)) / 1e6
    print(f"{name}: copy {copy_gbps:.0f} GB/s", flush=True)
    results = []
    for shape in args.shapes:
        tokens, heads, head_dim = (int(n) for n in shape.split("x"))
        results += run_shape(tokens, heads, head_dim, args.device, args.quick)
    if args.out is not None:
        args.out.write_text(json.dumps({"gpu": name, "copy_gbps": copy_gbps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
