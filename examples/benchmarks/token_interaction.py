"""The candidate interaction's token attention and pairwise dots: PyTorch's ops against the fused Triton kernels.

``GDPAInteraction``'s token interaction mixes each candidate's ``N`` tokens (the candidate, what it read from the
history, context tokens) with a softmax attention over them, per head, and then takes the dot products of its token
pairs. Unfused (``pointwise`` impl ``"reference"``), that is, exactly as the layer runs it: the projection viewed as
``[C, N, 3, H, d]`` and permuted, ``matmul(q, k^T * d^-0.5)``, ``softmax``, ``matmul(weights, v)``, a transpose and
reshape back to ``[C, N, H d]``; then ``einsum("cnd,cmd->cnm")``, the gather of the upper triangle
(``triu_indices``) and the division by ``sqrt(dim)``. Fused: :func:`lightning_gem.ops.pointwise.token_attention` and
:func:`lightning_gem.ops.pointwise.pairwise_dots`.

For every candidate count, token count and (width, heads) shape, on random inputs in ``--dtype``: the median time of
the forward and of the forward + backward (``triton.testing.do_bench`` after its warm-up; CPU: the wall clock of a
few calls), the fused kernels' speed-up, and the bandwidth the fused kernels reach (the bytes they must move: their
inputs and outputs once, over their time). The largest difference of the fused outputs from PyTorch's, relative to
their largest value, is printed beside them.

Usage:
    python examples/benchmarks/token_interaction.py                       # CUDA: the full grid, bf16
    TRITON_INTERPRET=1 python examples/benchmarks/token_interaction.py --device cpu --candidates 5 --tokens 3 \\
        --shapes 16x2 --dtype fp32                                          # a smoke run, kernels interpreted
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gem.ops.pointwise import pairwise_dots, token_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_token_attention(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The interaction's unfused token attention: ``[C, N, 3 dim]`` -> ``[C, N, dim]``."""
    num_candidates, num_tokens, width = qkv.shape
    dim = width // 3
    d = dim // num_heads
    q, k, v = qkv.view(num_candidates, num_tokens, 3, num_heads, d).permute(2, 0, 3, 1, 4).unbind(0)
    weights = torch.matmul(q, k.transpose(-1, -2) * d**-0.5).softmax(dim=-1)
    return torch.matmul(weights.to(v.dtype), v).transpose(1, 2).reshape(num_candidates, num_tokens, dim)


def torch_pairwise_dots(tokens: torch.Tensor) -> torch.Tensor:
    """The interaction's unfused pairwise dots: ``[C, N, dim]`` -> ``[C, N (N - 1) / 2]``."""
    num_tokens, dim = tokens.shape[1:]
    rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1, device=tokens.device)
    return torch.einsum("cnd,cmd->cnm", tokens, tokens)[:, rows, cols] / dim**0.5


def _median_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # warm-up (the interpreter's first call of a kernel is slower)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _forward_backward(op: Callable[[torch.Tensor], torch.Tensor], leaf: torch.Tensor, grad: torch.Tensor):
    return lambda: torch.autograd.grad(op(leaf), leaf, grad)


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def time_case(
    name: str,
    unfused: Callable[[torch.Tensor], torch.Tensor],
    fused: Callable[[torch.Tensor], torch.Tensor],
    data: torch.Tensor,
    bytes_forward: int,
    bytes_backward: int,
    reps: int,
) -> dict:
    """Forward and forward + backward of both paths on ``data``; the fused kernels' bytes give their bandwidth."""
    device = data.device.type
    leaf = data.clone().requires_grad_()
    with torch.no_grad():
        want, got = unfused(data), fused(data)
    grad = torch.randn_like(want)
    row = {"op": name, "difference": _relative_difference(got, want)}
    for part, make in (("fwd", lambda op: lambda: op(data)), ("fwd+bwd", lambda op: _forward_backward(op, leaf, grad))):
        with torch.set_grad_enabled(part != "fwd"):
            torch_ms = _median_ms(make(unfused), device, reps)
            fused_ms = _median_ms(make(fused), device, reps)
        moved = bytes_forward + (bytes_backward if part != "fwd" else 0)
        row[part] = {"torch_ms": torch_ms, "fused_ms": fused_ms, "fused_gb_per_s": moved / fused_ms / 1e6}
    return row


def run_shape(num_candidates: int, num_tokens: int, dim: int, num_heads: int, args: argparse.Namespace) -> list[dict]:
    """The token attention at this shape, and the pairwise dots at its (C, N, dim) (the first time it comes)."""
    dtype, impl = DTYPES[args.dtype], "triton"
    size = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=args.device).manual_seed(0)
    qkv = torch.randn(num_candidates, num_tokens, 3 * dim, device=args.device, dtype=dtype, generator=gen)
    # Reads qkv, writes out; backward: reads qkv and the output's gradient, writes dqkv.
    attention_bytes = (num_candidates * num_tokens * 4 * dim * size, num_candidates * num_tokens * 7 * dim * size)
    rows = [
        time_case(
            "token_attention",
            lambda t: torch_token_attention(t, num_heads),
            lambda t: token_attention(t, num_heads, impl=impl),
            qkv,
            *attention_bytes,
            args.reps,
        )
    ]
    if num_heads == min(h for d, h in args.shapes if d == dim):
        tokens = torch.randn(num_candidates, num_tokens, dim, device=args.device, dtype=dtype, generator=gen)
        pairs = num_candidates * num_tokens * (num_tokens - 1) // 2
        tokens_bytes = num_candidates * num_tokens * dim * size
        # Reads x, writes the pairs; backward: reads x and the pairs' gradient, writes dx.
        dots_bytes = (tokens_bytes + pairs * size, 2 * tokens_bytes + pairs * size)

        def fused_dots(t: torch.Tensor) -> torch.Tensor:
            return pairwise_dots(t, dim**-0.5, impl=impl)

        rows.append(time_case("pairwise_dots", torch_pairwise_dots, fused_dots, tokens, *dots_bytes, args.reps))
    for row in rows:
        row.update(candidates=num_candidates, tokens=num_tokens, dim=dim, heads=num_heads)
    return rows


def _print_row(row: dict) -> None:
    heads = row["heads"] if row["op"] == "token_attention" else "-"
    cells = [row["op"], row["candidates"], row["tokens"], row["dim"], heads]
    for part in ("fwd", "fwd+bwd"):
        t = row[part]
        cells += [f"{t['torch_ms']:.3f}", f"{t['fused_ms']:.3f}", f"{t['torch_ms'] / t['fused_ms']:.2f}x"]
        cells.append(f"{t['fused_gb_per_s']:.4g}")
    cells.append(f"{row['difference']:.1e}")
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def _shape(text: str) -> tuple[int, int]:
    dim, heads = (int(v) for v in text.split("x"))
    if dim % heads:
        raise argparse.ArgumentTypeError(f"width {dim} is not a multiple of {heads} heads")
    return dim, heads


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--candidates", type=_ints, default=[1024, 4096, 16384], help="comma-separated C values")
    parser.add_argument("--tokens", type=_ints, default=[3, 5, 8], help="comma-separated N values")
    parser.add_argument(
        "--shapes", type=_shape, nargs="+", default=[(1024, 4), (1024, 8), (512, 4)], help="WIDTHxHEADS pairs"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per measurement on CPU (CUDA: do_bench)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu (with TRITON_INTERPRET=1) for a smoke run")
    if args.device != "cuda":
        from lightning_gem.ops._launch import is_interpreted
        from lightning_gem.ops.pointwise.impl.triton.token_kernels import _token_attention_fwd_kernel

        if not is_interpreted(_token_attention_fwd_kernel):
            raise SystemExit("off CUDA the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton's interpreter)"
    print(f"token interaction on {where}, {args.dtype}; ms are medians; GB/s of the fused kernels' own traffic")
    print(
        "| op | C | N | dim | H | torch fwd ms | fused fwd ms | speed-up | fused GB/s | torch f+b ms | fused f+b ms "
        "| speed-up | fused GB/s | max rel diff |"
    )
    print("| --- " * 14 + "|")
    results = []
    for dim, heads in args.shapes:
        for num_tokens in args.tokens:
            for num_candidates in args.candidates:
                for row in run_shape(num_candidates, num_tokens, dim, heads, args):
                    _print_row(row)
                    results.append(row)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"device": where, "dtype": args.dtype, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
