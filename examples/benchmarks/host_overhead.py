"""Host time per call of small GPU launches: torch ops, raw Triton launches and the kit's FP8 quantizers.

Small layers, jagged batches and per-layer kernels make a training step bound by the time the host takes to
issue its launches. This script measures that time per call on this machine: the median wall clock of a call
that returns before its kernel has run (nothing waits on the device; inputs are tiny), over ``--calls`` calls
after a warm-up. References: ``torch.empty`` and one elementwise torch op; a Triton kernel launched with 4 and
with 28 arguments (the launcher's own cost); then ``lightning_gem.ops.mx.quantize`` in the layouts an FP8
Linear uses, each one Triton launch plus the kit's Python (validation, allocation, tuning lookup); then GDPA's
forward, and its forward and backward, on a tiny jagged batch (an HSTU layer makes one such call), beside
SDPA's on a padded batch of the same size, and with Q, K and V as strided views of one projection (pointer loads
instead of tensor descriptors); an HSTU layer's pointwise work around its attention, fused and unfused; a whole
HSTU layer's forward + backward (width 2048, 16 heads, 512 tokens) in bf16, with FP8 linears
(``convert(layer, MXConfig())``) and with FP8 saved activations besides, timed over a twentieth of the calls; last,
bf16 GEMMs (``torch.mm``, ``F.linear`` with a bias, and ``torch._scaled_mm`` in FP8) whose row count is the same on
every call against a new row count on every call, the host cost of a jagged batch whose token count changes each
step.

Usage (CUDA only):
    python examples/benchmarks/host_overhead.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gem_example import cprofile_table
from lightning_gem.components.encoder import HSTULayer

from lightning_gem.ops import gdpa
from lightning_gem.ops.mx import dequantize, norm_quantize, quantize
from lightning_gem.ops.pointwise import norm_mul, silu_split
from lightning_gem.precision import MXConfig, convert


@triton.jit
def _copy4(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


@triton.jit(do_not_specialize=["n"])
def _copy28(
    X, Y, A0, A1, A2, A3, A4, A5, n, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host microseconds of one call of ``fn`` (issued, not waited on)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def device_syncs(fn: Callable[[], object]) -> int:
    """How many times one call of ``fn`` makes the host wait for the device (``torch.cuda.set_sync_debug_mode``)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def host_profile(name: str, fn: Callable[[], object], calls: int) -> None:
    """Print the 30 functions with the most own host time over ``calls`` calls of ``fn`` (cProfile)."""
    import cProfile

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    print(cprofile_table(profiler, f"{name}: cProfile over {calls} calls", rows=30, keys=("tottime",)))


def _attention_cases() -> list[tuple[str, Callable[[], object]]]:
    """GDPA (Triton) and SDPA (padded) forward, and forward + backward, on 8 sequences of 64 tokens, 4 heads x 128."""
    segments, length, heads, dim = 8, 64, 4, 128
    q, k, v = (
        torch.randn(segments * length, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    offsets = torch.arange(0, segments * length + 1, length, device="cuda", dtype=torch.int32)
    qp, kp, vp = (
        torch.randn(segments, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )

    def gdpa_forward(activation: str) -> torch.Tensor:
        return gdpa(
            q, k, v, offsets, activation=activation, causal=True, max_seq_len_q=length, impl="triton",
            check_offsets=False,
        )  # fmt: skip

    def sdpa_forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True)

    # Q, K and V as strided views of one [T, H, 4 D] projection (an HSTU layer's split without the fused SiLU-split):
    # GDPA then loads them through pointers instead of tensor descriptors.
    uvqk = torch.randn(segments * length, heads, 4 * dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def gdpa_strided() -> torch.Tensor:
        _, sv, sq, sk = uvqk.split([dim] * 4, dim=-1)
        return gdpa(
            sq, sk, sv, offsets, activation="silu", causal=True, max_seq_len_q=length, impl="triton",
            check_offsets=False,
        )  # fmt: skip

    return [
        ("GDPA softmax forward", lambda: gdpa_forward("softmax")),
        ("GDPA softmax forward + backward", lambda: gdpa_forward("softmax").sum().backward()),
        ("GDPA silu forward + backward", lambda: gdpa_forward("silu").sum().backward()),
        ("GDPA silu forward + backward, strided q, k, v", lambda: gdpa_strided().sum().backward()),
        ("SDPA forward (padded)", sdpa_forward),
        ("SDPA forward + backward (padded)", lambda: sdpa_forward().sum().backward()),
    ]


def _pointwise_cases(tokens: int = 512, heads: int = 4, dim: int = 128) -> list[tuple[str, Callable[[], object]]]:
    """An HSTU layer's pointwise work around its attention, forward + backward: the fused kernels
    (:mod:`lightning_gem.ops.pointwise`) against PyTorch's unfused ops (``impl="reference"``)."""
    uvqk = torch.randn(tokens, heads, 4 * dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attn = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(dim, device="cuda", requires_grad=True)

    def split(impl: str) -> None:
        torch.autograd.backward(silu_split(uvqk, [dim] * 4, impl=impl), [attn] * 4)

    def gated(impl: str) -> None:
        norm_mul(attn, gate, weight, eps=1e-6, impl=impl).sum().backward()

    return [
        ("silu_split forward + backward, fused", lambda: split("auto")),
        ("silu_split forward + backward, unfused", lambda: split("reference")),
        ("norm_mul forward + backward, fused", lambda: gated("auto")),
        ("norm_mul forward + backward, unfused", lambda: gated("reference")),
    ]


def _layer_cases(dim: int = 2048, heads: int = 16) -> list[tuple[str, Callable[[], object]]]:
    """One HSTU layer's forward + backward under bf16 autocast on 4 sequences (512 tokens): bf16 linears, FP8 linears
    (the fused norm handing its quantized output to ``uvqk``), and FP8 linears with FP8 saved activations."""
    lengths = [100, 200, 150, 62]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    x = torch.randn(sum(lengths), dim, device="cuda", requires_grad=True)
    cases = []
    configs = {
        "bf16": None, "FP8 linears": MXConfig(), "FP8 linears, FP8 saved activations": MXConfig(saved_activations="fp8")
    }  # fmt: skip
    for name, config in configs.items():
        layer = HSTULayer(dim, heads).to("cuda")
        if config is not None:
            convert(layer, config)

        def step(layer: HSTULayer = layer) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(x, offsets, max_seq_len=max(lengths), check_offsets=False)
            out.float().sum().backward()

        cases.append((f"HSTU layer forward + backward, {name}", step))
    return cases


def _gemm_cases(rows: int = 256, width: int = 256, shapes: int = 10_000) -> list[tuple[str, Callable[[], object]]]:
    """GEMMs ``[M, width] x [width, width]``, ``M`` fixed at ``rows`` or new on every call (``rows + 8 i``, ``i``
    cycling through ``shapes`` values); small enough that the device keeps up with the host."""
    a = torch.randn(rows + 8 * shapes, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, width, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    a8 = a.to(torch.float8_e4m3fn)
    w8 = w.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants its second operand
    one = torch.ones((), device="cuda")
    step = itertools.count(1)

    def new_rows() -> int:
        return rows + 8 * (next(step) % shapes)

    def scaled_mm(m: int) -> torch.Tensor:
        return torch._scaled_mm(a8[:m], w8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    functional = torch.nn.functional
    return [
        ("bf16 mm, same M", lambda: torch.mm(a[:rows], w)),
        ("bf16 mm, new M each call", lambda: torch.mm(a[: new_rows()], w)),
        ("bf16 linear + bias, same M", lambda: functional.linear(a[:rows], w, bias)),
        ("bf16 linear + bias, new M each call", lambda: functional.linear(a[: new_rows()], w, bias)),
        ("fp8 _scaled_mm, same M", lambda: scaled_mm(rows)),
        ("fp8 _scaled_mm, new M each call", lambda: scaled_mm(new_rows())),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument(
        "--cprofile", nargs="*", default=[], metavar="CALL",
        help="also print where the host time of these calls goes (cProfile over --calls calls; a prefix of the name)",
    )  # fmt: skip
    parser.add_argument("--only", nargs="*", default=[], metavar="CALL", help="time only these calls (name prefixes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py measures CUDA launches: no CUDA device here")
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    extra = [torch.empty(16, device="cuda") for _ in range(6)]
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    a_mx, norm_weight = quantize(a, "mx")[0], torch.ones(512, device="cuda")
    cases: list[tuple[str, Callable[[], object]]] = [
        ("torch.empty", lambda: torch.empty(256, 512, device="cuda")),
        ("torch add", lambda: x.add(1)),
        ("Triton launch, 4 arguments", lambda: _copy4[(4,)](x, y, 4096, BLOCK=1024)),
        (
            "Triton launch, 28 arguments",
            lambda: _copy28[(4,)](x, y, *extra, 4096, *range(1, 11), B0=1, B1=2, B2=3, B3=4, B4=5, BLOCK=1024),
        ),
        ("quantize 1x128 rows", lambda: quantize(a, "1x128")),
        ("quantize 1x128 rows+cols", lambda: quantize(a, "1x128", cols=True)),
        ("quantize rowwise rows", lambda: quantize(a, "rowwise")),
        ("quantize 128x128 (weight)", lambda: quantize(a, "128x128")),
        ("quantize mx rows", lambda: quantize(a, "mx")),
        ("dequantize mx", lambda: dequantize(a_mx, torch.bfloat16)),
        ("norm_quantize 1x128 (fused norm)", lambda: norm_quantize(a, norm_weight, layout="1x128", write_output=True)),
        *_attention_cases(),
        *_pointwise_cases(),
        *_layer_cases(),
        *_gemm_cases(),
    ]
    if args.only:
        cases = [(name, fn) for name, fn in cases if any(name.startswith(prefix) for prefix in args.only)]
    print(f"host time per call on {torch.cuda.get_device_name()}, median of {args.calls}")
    print("| call | host us | device syncs |\n| --- | --- | --- |")
    for name, fn in cases:
        calls = max(args.calls // 20, 20) if name.startswith("HSTU layer") else args.calls  # milliseconds a call
        print(f"| {name} | {host_us(fn, calls):.1f} | {device_syncs(fn)} |")
    for name, fn in cases:
        if any(name.startswith(prefix) for prefix in args.cprofile):
            host_profile(name, fn, args.calls)


if __name__ == "__main__":
    main()
