"""Speed of quantized Linear layers and of the quantization kernels, against bf16 in the same run.

Run on a CUDA machine from the repository root::

    python examples/benchmarks/precision.py                       # every shape and recipe, kernel bandwidth
    python examples/benchmarks/precision.py --tokens 65536 --out precision.json
    python examples/benchmarks/precision.py --device cpu --tiny   # smoke test: tiny sizes, emulated recipes
    python examples/benchmarks/precision.py --kernels-only --out precision.json   # the kernel table alone
    python examples/benchmarks/precision.py --kernels-only --sweep-norm   # and every fused norm kernel config
    python examples/benchmarks/precision.py --kernels-only --sweep-split  # and rows+cols configs of mx / 1x128

**Linear forward + backward** at GEM MLP shapes (``tokens x in -> out``): ``y = layer(x); y.backward(dy)``
with bf16 activations and parameters, quantization included (every operand quantized in every step, as in
training). Recipes: ``bf16`` (``nn.Linear``), ``fp8-rowwise`` and ``fp8-blockwise`` (``torch._scaled_mm``),
``mxfp8-emulated`` (exact MXFP8 numerics with fp32 GEMMs: a numerics reference, not a speed path).
``x`` is ``bf16_ms / recipe_ms`` (above 1: faster than bf16); with ``--rounds N`` bf16 and the recipes are timed
in turn N times, ``x`` is the median of the rounds' ratios and ``x range`` their lowest and highest. ``gemm-only``
is the three FP8 GEMMs alone on pre-quantized operands: the ceiling quantization eats into.

**Kernel bandwidth**: bytes a kernel must move (its input read once, its FP8 outputs and scales written
once) over its median time, against a device-to-device copy of the same input measured in the same run.
On CUDA the table also times the alternatives the kernels choose between (rowwise rows in two passes, the
line maxima pass alone) and lists the tile configs the tuner chose, per row those its first call chose.
``--sweep-norm`` times every candidate config of the fused norm + quantize kernel alone (RMSNorm and
LayerNorm, ``mx`` and ``1x128``), each checked against the tuned launch's output. ``--sweep-split`` times a grid
of configs of the one-launch rows+cols kernel (``mx``, ``1x128``; ``mx`` columns alone), each checked bit for bit
against the reference quantization. The 128x128 weight quantizer is also timed as a step runs it: several
weights quantized back to back in a CUDA graph (the device's time, without Python's launch cost), against
copies of the same weights in a graph.

**Quality** (``--quality-steps N``): a synthetic regression task (a frozen random teacher MLP), the same
student (pre-norm residual blocks: RMSNorm -> Linear -> SiLU -> Linear) trained with AdamW for ``N`` steps
from the same initialisation on the same batches per recipe; the final held-out MSE and its relative
difference to the bf16 run.

Times are medians of ``triton.testing.do_bench`` after a warm-up call (``time.perf_counter`` on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_gem.ops.mx import norm_quantize, norm_quantize_transposed, quantize, scaled_mm
from lightning_gem.precision import MXConfig, convert

SHAPES = ((1024, 4096), (4096, 1024), (4096, 4096))  # (in_features, out_features)
RECIPES = {
    "fp8-rowwise": MXConfig(recipe="fp8-rowwise"),
    "fp8-blockwise": MXConfig(recipe="fp8-blockwise"),
    "mxfp8-emulated": MXConfig(backend="mx_emulated"),
}


def bench(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of ``fn`` after one warm-up call."""
    fn()
    if device == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_graph(fn: Callable[[], object], replays: int = 50) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph: the device's time alone, without the
    host's launch overhead (which ``do_bench`` measures too when a kernel is shorter than its launch)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles and tunes) off the capturing stream, as capture asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def linear_step(layer: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(grad)

    return step


def bench_linear(
    tokens: int, shape: tuple[int, int], device: str, recipes: list[str], emulated_max: int, rounds: int = 1
) -> list[dict]:
    """Forward+backward time of bf16 and each recipe's Linear. With ``rounds`` > 1 the layers are timed in turn,
    round after round, so a drift of the GPU's clocks during the run falls on bf16 and the recipes alike: ``ms``
    is the median over rounds and ``x`` the median of the rounds' own ratios (``x_min``/``x_max`` their range)."""
    in_features, out_features = shape
    base = nn.Linear(in_features, out_features, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    flops = 6 * tokens * in_features * out_features
    steps, errors = {"bf16": linear_step(base, x, grad)}, {}
    for recipe in recipes:
        if recipe == "mxfp8-emulated" and tokens > emulated_max:
            continue
        layer = nn.Sequential(nn.Linear(in_features, out_features, device=device, dtype=torch.bfloat16))
        layer.load_state_dict({"0." + k: v for k, v in base.state_dict().items()})
        convert(layer, RECIPES[recipe])
        steps[recipe] = linear_step(layer, x, grad)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            if name in errors:
                continue
            try:
                times[name].append(bench(step, device))
            except (RuntimeError, ValueError) as error:  # report a recipe this device cannot run, keep going
                errors[name] = f"{type(error).__name__}: {error}"[:300]
                print(dict(tokens=tokens, shape=shape, recipe=name, error=errors[name]), file=sys.stderr)
    rows = []
    for name in steps:
        if name in errors:
            rows.append(dict(tokens=tokens, shape=shape, recipe=name, error=errors[name]))
            continue
        ms = statistics.median(times[name])
        ratios = [b / t for b, t in zip(times["bf16"], times[name], strict=True)]
        row = dict(tokens=tokens, shape=shape, recipe=name, ms=ms, tflops=flops / ms / 1e9, rounds=rounds)
        row.update(x=statistics.median(ratios), x_min=min(ratios), x_max=max(ratios), times_ms=times[name])
        if name not in ("bf16", "mxfp8-emulated") and device == "cuda":
            row["gemm_only_ms"] = bench_gemms(x.detach(), base.weight.detach(), grad, name)
            row["gemm_only_x"] = statistics.median(times["bf16"]) / row["gemm_only_ms"]
        rows.append(row)
    return rows


def bench_gemms(x: Tensor, weight: Tensor, grad: Tensor, recipe: str) -> float:
    """The recipe's three GEMMs on operands quantized beforehand."""
    act, wgt = ("rowwise", "rowwise") if recipe == "fp8-rowwise" else ("1x128", "128x128")
    xq, xq_t = quantize(x, act, cols=True)
    wq = quantize(weight, wgt)[0]
    wq_t = quantize(weight.t().contiguous(), wgt)[0]
    gq, gq_t = quantize(grad, act, cols=True)
    w_out = torch.bfloat16 if act == "rowwise" else torch.float32

    def gemms() -> None:
        scaled_mm(xq, wq, out_dtype=torch.bfloat16, backend="scaled_mm")
        scaled_mm(gq, wq_t, out_dtype=torch.bfloat16, backend="scaled_mm")
        scaled_mm(gq_t, xq_t, out_dtype=w_out, backend="scaled_mm")

    return bench(gemms, "cuda")


def warm_layer_step(tokens: int, shape: tuple[int, int], recipe: str) -> Callable[[], None]:
    """A forward+backward step of one converted ``Linear(*shape)`` on random CUDA inputs, run once (compiled,
    tuned) and synchronised."""
    layer = convert(nn.Sequential(nn.Linear(*shape, device="cuda", dtype=torch.bfloat16)), RECIPES[recipe])
    x = torch.randn(tokens, shape[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16)
    step = linear_step(layer, x, grad)
    step()
    torch.cuda.synchronize()
    return step


def profile_step(tokens: int, shape: tuple[int, int], recipe: str) -> str:
    """GPU time per kernel over 3 forward+backward steps of one converted layer (``torch.profiler``)."""
    step = warm_layer_step(tokens, shape, recipe)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    return f"profile: {recipe} {tokens} x {shape}\n{table}"


def host_profile(tokens: int, shape: tuple[int, int], recipe: str, steps: int = 20) -> str:
    """Python's ``cProfile`` over ``steps`` forward+backward steps of one converted layer, the GPU synchronised
    once at the end: the host's own time per step (what a small, host-bound layer costs)."""
    import cProfile
    import io
    import pstats

    step = warm_layer_step(tokens, shape, recipe)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    host_ms = (time.perf_counter() - start) * 1e3 / steps
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    body = "\n".join(line[:150] for line in text.getvalue().splitlines()[6:])
    return f"host profile: {recipe} {tokens} x {shape}: {host_ms:.3f} ms of host time per step\n{body}"


def bench_kernels(tokens: int, dim: int, device: str) -> list[dict]:
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    weight = torch.randn(dim, device=device)
    numel = x.numel()
    copy_ms = bench(lambda: torch.empty_like(x).copy_(x), device)
    copy_gbs = 2 * numel * 2 / copy_ms / 1e6
    rows = [dict(kernel="copy (bf16 -> bf16)", ms=copy_ms, gbs=copy_gbs, of_copy=1.0)]

    def add(
        name: str,
        fn: Callable[[], object],
        bytes_moved: float,
        timer: Callable | None = None,
        copy: float | None = None,
    ) -> None:
        """Time ``fn`` (``bench`` unless ``timer``) and add its row; "of copy" against ``copy`` GB/s if given."""
        known = tuned_configs()
        ms = (timer or functools.partial(bench, device=device))(fn)
        gbs = bytes_moved / ms / 1e6
        # the tile choices this row's first call made (none: an earlier row's launches were the same)
        chosen = [f"{key.split()[0]} {config}" for key, config in tuned_configs().items() if key not in known]
        of_copy = gbs / (copy or copy_gbs)
        rows.append(dict(kernel=name, ms=ms, gbs=gbs, of_copy=of_copy, config="; ".join(chosen)))

    scale_bytes = {"mx": numel / 32, "1x128": numel / 128 * 4, "rowwise": tokens * 4}
    for layout in ("mx", "1x128", "rowwise"):
        add(f"quantize {layout} rows", lambda lay=layout: quantize(x, lay), 2 * numel + numel + scale_bytes[layout])
        if layout == "rowwise" and device == "cuda":
            add_rowwise_variants(add, x, 2 * numel + numel + scale_bytes[layout])
        add(
            f"quantize {layout} rows+cols",
            lambda lay=layout: quantize(x, lay, cols=True),
            2 * numel + 2 * numel + 2 * scale_bytes[layout],
        )
        add(
            f"quantize {layout} rows+cols, and the column sums",
            lambda lay=layout: quantize(x, lay, cols=True, return_column_sums=True),
            2 * numel + 2 * numel + 2 * scale_bytes[layout],
        )
        add(
            f"quantize {layout} cols",
            lambda lay=layout: quantize(x, lay, rows=False, cols=True),
            2 * numel + numel + scale_bytes[layout],
        )
    add(
        "column sums alone (x.sum(0) in fp32): the unfused bias gradient",
        lambda: x.sum(0, dtype=torch.float32),
        2 * numel,
    )
    w = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    add(f"quantize 128x128 weight ({dim} x {dim}), launched from Python", lambda: quantize(w, "128x128"), 3 * w.numel())
    if device == "cuda":
        add_weight_rows(rows, add, dim)
    for kind in ("rms", "layer"):
        for layout in ("mx", "1x128"):
            bias = torch.randn(dim, device=device) if kind == "layer" else None
            add(
                f"{kind}norm+quantize {layout}",
                lambda k=kind, lay=layout, b=bias: norm_quantize(x, weight, b, kind=k, layout=lay),
                2 * numel + numel + scale_bytes[layout] + tokens * 4 * (2 if kind == "layer" else 1),
            )
    stats = norm_quantize(x, weight, kind="rms", layout="1x128")
    add(
        "rmsnorm output, transposed quantize 1x128",
        lambda: norm_quantize_transposed(x, stats.rstd, None, weight, None, kind="rms", layout="1x128"),
        2 * numel + numel + scale_bytes["1x128"] + tokens * 4,
    )
    return rows


def add_weight_rows(rows: list[dict], add: Callable, dim: int, count: int = 16) -> None:
    """The 128x128 weight quantizer as a step runs it, timed on the device alone: ``count`` distinct
    ``dim x dim`` weights (more bytes than L2 holds, so each is read from memory) quantized one after another
    in a CUDA graph, against copies of the same weights in a graph; "of copy" is against that copy."""
    weights = [torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    outs = [torch.empty_like(w) for w in weights]
    copy_ms = bench_graph(lambda: [o.copy_(w) for o, w in zip(outs, weights, strict=True)])
    copy_gbs = 2 * 2 * count * weights[0].numel() / copy_ms / 1e6
    name = f"copy {count} weights ({dim} x {dim}) in a CUDA graph"
    rows.append(dict(kernel=name, ms=copy_ms / count, gbs=copy_gbs, of_copy=1.0))
    add(
        f"quantize 128x128 weight ({dim} x {dim}), {count} in a CUDA graph, per weight",
        lambda: [quantize(w, "128x128") for w in weights],
        3 * weights[0].numel(),  # bytes and time per weight
        timer=lambda fn: bench_graph(fn) / count,
        copy=copy_gbs,
    )
    # The input gradient's operand: the transposed tiles written by the same read, against transposing the
    # quantized weight's codes and scales afterwards (PyTorch copies). Bytes: the two FP8 layouts and the read.
    for name, fn in (
        ("and its transposed tiles in one read", lambda w: quantize(w, "128x128", cols=True)),
        ("then its codes and scales transposed", lambda w: _transposed_copy(quantize(w, "128x128")[0])),
    ):
        add(
            f"quantize 128x128 weight ({dim} x {dim}) {name}, {count} in a CUDA graph, per weight",
            lambda f=fn: [f(w) for w in weights],
            4 * weights[0].numel(),
            timer=lambda fn: bench_graph(fn) / count,
            copy=copy_gbs,
        )


def _transposed_copy(q: object) -> tuple[Tensor, Tensor]:
    """A ``128x128``-quantized matrix's codes and scales transposed by PyTorch copies (what a backward did before
    the quantizer wrote the transposed tiles itself)."""
    return q.data.t().contiguous(), q.scale.t().contiguous()


def split_candidates(block: int, rows: bool) -> list[tuple[int, ...]]:
    """``(REGION_R, REGION_C, COL_TILE_C, ROW_TILE_R, C_FIRST, num_warps)`` configs of the one-launch rows+cols (or
    columns) kernel to sweep: column slabs 64 wide (a 128-byte line of each row: 32 and 16 wide ones ran at half
    the speed on an H200), slabs of 2K to 128 bf16 values a thread, regions numbered either way; wider regions
    write longer runs of ``mx`` row scales (up to whole 4096-wide rows), and ``mx`` also gets small programs of 1
    or 2 warps (its best on an H200)."""
    import itertools

    region_rs = (64, 256, 512) if block == 32 else (128, 256)
    region_cs = (128, 256, 512, 1024, 2048, 4096) if rows else (64, 128)
    row_tiles = (1, 2, 4, 8, 16, 32, 64) if rows else (64,)
    configs = []
    for region_r, region_c, row_tile_r, c_first, warps in itertools.product(
        region_rs, region_cs, row_tiles, (0, 1), (1, 2, 4, 8)
    ):
        slabs = [region_r * 64] + ([row_tile_r * region_c] if rows else [])
        if not all(2048 <= n <= 128 * 32 * warps for n in slabs) or (warps == 8 and max(slabs) <= 16384):
            continue
        if warps < 4 and block == 128:  # small programs serve mx only (1x128 ran at 17-70% with them)
            continue
        if rows and region_c % block:
            continue
        configs.append((region_r, region_c, 64, row_tile_r, c_first, warps))
    return configs


def sweep_split(tokens: int, dim: int, device: str, limit: int | None = None, serial: bool = False) -> list[dict]:
    """Every swept config of the one-launch ``mx`` / ``1x128`` rows+cols kernel (and ``mx`` columns alone) on
    ``tokens x dim`` bf16 with a NaN and an Inf: its time, its share of the copy bandwidth, and whether its codes
    and scales are bit-identical to the reference's. The tuner's own candidates come first; the two-launch plan
    ("apart") is timed beside them. ``serial``: compile each config as it is first run, not all at once up front."""
    from lightning_gem.ops._tuning import _compile_all
    from lightning_gem.ops.mx.impl.triton.quantize import _SPLIT_CONFIGS, quantize_triton

    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    x[3, 5], x[1, dim - 1] = float("nan"), float("inf")
    numel = x.numel()
    copy_gbs = 2 * numel * 2 / bench(lambda: torch.empty_like(x).copy_(x), device) / 1e6
    out = []
    for layout, rows in (("mx", True), ("mx", False), ("1x128", True)):
        block = 32 if layout == "mx" else 128
        scale_bytes = numel / 32 if layout == "mx" else numel / 128 * 4
        moved = 2 * numel + (numel + scale_bytes) * (2 if rows else 1)
        name = f"quantize {layout} {'rows+cols' if rows else 'cols'}"
        want = quantize(x, layout, rows=rows, cols=True, impl="reference")
        if rows:
            ms = bench(lambda lay=layout: (quantize(x, lay), quantize(x, lay, rows=False, cols=True)), device)
            out.append(dict(kernel=name, config="apart (two launches)", ms=ms, of_copy=moved / ms / 1e6 / copy_gbs))
        tuner = list(_SPLIT_CONFIGS[block, rows])
        configs = (tuner + [c for c in split_candidates(block, rows) if c not in tuner])[:limit]

        def run(config: tuple, lay: str = layout, r: bool = rows) -> tuple:
            return quantize_triton(x, lay, rows=r, cols=True, split_config=config)

        if device == "cuda" and not serial:
            _compile_all(configs, run)
        for config in configs:
            try:
                got = run(config)
                exact = all(
                    _same_bits(g[0], w.data) and _same_bits(g[1], w.scale)
                    for g, w in zip(got, want, strict=True)
                    if w is not None
                )
                ms = bench(functools.partial(run, config), device)
            except Exception as error:
                out.append(dict(kernel=name, config=config, error=repr(error)[:200]))
                continue
            out.append(dict(kernel=name, config=config, ms=ms, of_copy=moved / ms / 1e6 / copy_gbs, codes_exact=exact))
        del want
    return out


def sweep_norm(tokens: int, dim: int, device: str) -> list[dict]:
    """Every candidate tile config of the fused norm + quantize kernel, launched alone on ``tokens x dim`` bf16
    with a NaN and an Inf in two rows (on CPU only under ``TRITON_INTERPRET=1``, as a smoke test): its time;
    whether it writes the tuned launch's bits (else how many FP8 codes differ and the largest relative change of
    ``rstd``: a config that spreads a row over other warps sums it in another order); and whether its FP8 codes
    and scales are exactly those of the output it writes."""
    from lightning_gem.ops._launch import next_power_of_2
    from lightning_gem.ops.mx.impl.triton.norm_quantize import _valid_configs, norm_quantize_triton

    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    x[3, 5], x[1, dim - 1] = float("nan"), float("inf")
    weight, bias = torch.randn(dim, device=device), torch.randn(dim, device=device)
    numel = x.numel()
    copy_gbs = 2 * numel * 2 / bench(lambda: torch.empty_like(x).copy_(x), device) / 1e6
    rows = []
    for kind, layout in (("layer", "mx"), ("layer", "1x128"), ("rms", "mx"), ("rms", "1x128")):
        name, b = f"{kind}norm+quantize {layout}", bias if kind == "layer" else None
        scale_bytes = numel / 32 if layout == "mx" else numel / 128 * 4
        moved = 3 * numel + scale_bytes + tokens * 4 * (2 if kind == "layer" else 1)
        tuned = norm_quantize_triton(x, weight, b, 1e-6, kind, layout)
        for config in _valid_configs(next_power_of_2(dim)):
            run = functools.partial(norm_quantize_triton, x, weight, b, 1e-6, kind, layout, config=config)
            try:
                same = _difference(run(), tuned)
                q, scale, _, _, y = run(write_output=True)
                reference = quantize(y, layout, impl="reference")[0]
                exact = _same_bits(q, reference.data) and _same_bits(scale, reference.scale)
                ms = bench(run, device)
            except Exception as error:
                rows.append(dict(kernel=name, config=config, error=repr(error)[:200]))
                continue
            of_copy = moved / ms / 1e6 / copy_gbs
            rows.append(dict(kernel=name, config=config, ms=ms, of_copy=of_copy, vs_tuned=same, codes_exact=exact))
    return rows


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Bit-identical tensors (NaN payloads included)."""
    bits = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _difference(out: tuple, tuned: tuple) -> str:
    """``"identical"`` when two norm + quantize outputs ``(q, scale, rstd, mean, y)`` match bit for bit, else what
    differs."""
    (q, scale, rstd, mean, _), (q0, scale0, rstd0, mean0, _) = out, tuned
    pairs = [(q, q0), (scale, scale0), (rstd, rstd0)] + ([(mean, mean0)] if mean is not None else [])
    if all(_same_bits(a, b) for a, b in pairs):
        return "identical"
    codes = int((q.view(torch.uint8) != q0.view(torch.uint8)).sum())
    change = float(((rstd - rstd0).abs() / rstd0.abs()).nan_to_num(0.0).max())
    return f"{codes} of {q.numel()} codes differ, rstd up to {change:.1e} relative"


def add_rowwise_variants(add: Callable[[str, Callable[[], object], float], None], x: Tensor, rows_bytes: float) -> None:
    """Time what rowwise quantization chooses between: rows alone in two passes (line maxima, then the
    quantizer) against the one-pass kernel; and rows+cols and cols pass by pass: the line maxima, then the
    quantizing pass (each counted by the bytes it moves: ``x`` read by both)."""
    from lightning_gem.ops.mx.impl.triton.quantize import _TL_DTYPES, _line_maxima, quantize_triton

    no_norm, out_dtype = (None, None, None, None), _TL_DTYPES[x.dtype]
    add("quantize rowwise rows, two passes", lambda: quantize_triton(x, "rowwise", one_pass=False), rows_bytes)
    numel, dim = x.numel(), x.shape[1]
    cols_bytes = 2 * numel + numel + 4 * dim  # x read, codes and fp32 scales of the transposed layout written
    for name, rows, moved in (("rows+cols", True, rows_bytes + numel + 4 * dim), ("cols", False, cols_bytes)):
        maxima = _line_maxima(x, rows, True, no_norm, 0, out_dtype)
        add(f"rowwise line maxima ({name})", lambda r=rows: _line_maxima(x, r, True, no_norm, 0, out_dtype), 2 * numel)
        add(
            f"rowwise {name}, quantizing pass given the maxima",
            lambda r=rows, m=maxima: quantize_triton(x, "rowwise", rows=r, cols=True, maxima=m),
            moved,
        )


def tuned_configs() -> dict[str, str]:
    """The tile configs the Triton quantizers' tuner chose in this process, by tuning key; keys launched with
    their first config untimed say so, and why."""
    try:
        from lightning_gem.ops.mx.impl.triton._common import chosen_configs, untuned_configs
    except ImportError:  # no Triton
        return {}
    configs = {" ".join(map(str, key)): str(config) for key, config in chosen_configs().items()}
    for key, (config, why) in untuned_configs().items():
        configs[" ".join(map(str, key))] = f"{config} (first, untimed: {why})"
    return configs


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _student(dim: int, hidden: int, depth: int, device: str) -> nn.Module:
    torch.manual_seed(1)
    blocks = [_Block(dim, hidden) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.RMSNorm(dim), nn.Linear(dim, 8)).to(device)


def quality(steps: int, device: str, recipes: list[str], dim: int = 512, batch: int = 2048) -> list[dict]:
    """Final held-out MSE of the same student trained per recipe (bf16 autocast around every run)."""
    generator = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)  # the teacher, independent of what ran before
    teacher = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, 8)).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)

    def batch_of(seed: int) -> tuple[Tensor, Tensor]:
        generator.manual_seed(seed)
        x = torch.randn(batch, dim, device=device, generator=generator)
        return x, teacher(x)

    eval_x, eval_y = batch_of(10**6)
    rows = []
    for recipe in ["bf16", *recipes]:
        try:
            mse = _train(recipe, steps, device, dim, batch_of, eval_x, eval_y)
            rows.append(dict(recipe=recipe, steps=steps, eval_mse=mse))
        except (RuntimeError, ValueError) as error:
            print(f"quality {recipe}: {type(error).__name__}: {error}", file=sys.stderr)
    for row in rows:
        row["rel_to_bf16"] = row["eval_mse"] / rows[0]["eval_mse"] - 1
    return rows


def _train(recipe: str, steps: int, device: str, dim: int, batch_of: Callable, eval_x: Tensor, eval_y: Tensor) -> float:
    """Train the student with ``recipe`` and return its held-out MSE."""
    model = _student(dim, 4 * dim, 3, device)
    if recipe != "bf16":
        convert(model, RECIPES[recipe])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=steps)
    for step in range(steps):
        x, y = batch_of(step)
        with torch.autocast(device, dtype=torch.bfloat16):  # the forward only, as Lightning's bf16-mixed
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        return float(torch.nn.functional.mse_loss(model(eval_x).float(), eval_y))


def markdown(
    linear_rows: list[dict],
    kernel_rows: list[dict],
    quality_rows: list[dict],
    sweep_rows: list[dict] | None = None,
    split_rows: list[dict] | None = None,
) -> str:
    lines = [
        "| tokens | in -> out | recipe | f+b ms | TFLOP/s | x bf16 | x range | gemm-only ms | gemm-only x |",
        "|" + "---|" * 9,
    ]
    for r in linear_rows:
        if "error" in r:
            lines.append(f"| {r['tokens']:,} | {r['shape'][0]} -> {r['shape'][1]} | {r['recipe']} | {r['error']} |")
            continue
        gemm = (f"{r['gemm_only_ms']:.3f}", f"{r['gemm_only_x']:.2f}") if "gemm_only_ms" in r else ("", "")
        spread = f"{r['x_min']:.2f}-{r['x_max']:.2f}" if r.get("rounds", 1) > 1 and r["recipe"] != "bf16" else ""
        lines.append(
            f"| {r['tokens']:,} | {r['shape'][0]} -> {r['shape'][1]} | {r['recipe']} | {r['ms']:.3f} | "
            f"{r['tflops']:.0f} | {r['x']:.2f} | {spread} | {gemm[0]} | {gemm[1]} |"
        )
    lines += ["", "| kernel | ms | GB/s | of copy | tiles chosen |", "|---|---|---|---|---|"]
    for r in kernel_rows:
        lines.append(f"| {r['kernel']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['of_copy']:.0%} | {r.get('config', '')} |")
    if sweep_rows:
        lines += _config_table(sweep_rows, "(TILE_R, NUM_TILES, warps)", ("vs_tuned", "codes_exact"))
    if split_rows:
        by_time = sorted(split_rows, key=lambda r: (r["kernel"], r.get("ms", float("inf"))))
        config = "(REGION_R, REGION_C, COL_TILE_C, ROW_TILE_R, C_FIRST, warps)"
        lines += _config_table(by_time, config, ("codes_exact",))
    if quality_rows:
        lines += ["", "| recipe | steps | eval MSE | vs bf16 |", "|---|---|---|---|"]
        for r in quality_rows:
            lines.append(f"| {r['recipe']} | {r['steps']} | {r['eval_mse']:.5f} | {r['rel_to_bf16']:+.2%} |")
    return "\n".join(lines)


def _config_table(rows: list[dict], config: str, checks: tuple[str, ...]) -> list[str]:
    """A sweep's markdown rows: kernel, config, ms, share of the copy bandwidth, then ``checks`` (or the error)."""
    header = ["kernel", config, "ms", "of copy", *(c.replace("_", " ") for c in checks)]
    lines = ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "error" in r:
            cells = [r["error"]] + [""] * (len(header) - 3)
        else:
            cells = [f"{r['ms']:.3f}", f"{r['of_copy']:.0%}", *(str(r.get(c, "")) for c in checks)]
        lines.append("| " + " | ".join([r["kernel"], str(r["config"]), *cells]) + " |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--emulated-max-tokens", type=int, default=16384, help="skip mxfp8-emulated above this")
    parser.add_argument("--rounds", type=int, default=1, help="time bf16 and the recipes in turn this many times")
    parser.add_argument("--kernel-tokens", type=int, default=65536)
    parser.add_argument("--kernel-dim", type=int, default=4096)
    parser.add_argument("--quality-steps", type=int, default=0, help="also train the synthetic task this long")
    parser.add_argument("--quality-dim", type=int, default=512, help="width of the synthetic task's student")
    parser.add_argument("--quality-batch", type=int, default=2048)
    parser.add_argument("--skip-speed", action="store_true", help="only the quality comparison")
    parser.add_argument("--kernels-only", action="store_true", help="only the kernel bandwidth table")
    parser.add_argument("--sweep-norm", action="store_true", help="time every fused norm kernel config")
    parser.add_argument("--sweep-split", action="store_true", help="time a grid of one-launch rows+cols configs")
    parser.add_argument("--sweep-limit", type=int, help="at most this many configs per kernel in --sweep-split")
    parser.add_argument("--sweep-serial", action="store_true", help="--sweep-split compiles each config as it runs")
    parser.add_argument("--profile", action="store_true", help="print per-kernel GPU time of one FP8 step")
    parser.add_argument("--host-profile", action="store_true", help="print cProfile of FP8 steps (host time)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.tiny:
        args.tokens, shapes, args.kernel_tokens, args.kernel_dim = [256], ((128, 256),), 256, 128
        args.recipes = [r for r in args.recipes if r != "fp8-blockwise" or args.device == "cuda"]
    linear_rows, kernel_rows = [], []
    if not args.skip_speed:
        if not args.kernels_only:
            linear_rows = [
                row
                for tokens in args.tokens
                for shape in shapes
                for row in bench_linear(tokens, shape, args.device, args.recipes, args.emulated_max_tokens, args.rounds)
            ]
        kernel_rows = bench_kernels(args.kernel_tokens, args.kernel_dim, args.device)
    sweep_rows = sweep_norm(args.kernel_tokens, args.kernel_dim, args.device) if args.sweep_norm else []
    split_rows = []
    if args.sweep_split:
        split_rows = sweep_split(args.kernel_tokens, args.kernel_dim, args.device, args.sweep_limit, args.sweep_serial)
    quality_rows = []
    if args.quality_steps:
        quality_rows = quality(args.quality_steps, args.device, args.recipes, args.quality_dim, args.quality_batch)
    if args.host_profile and args.device == "cuda":
        for recipe in ("fp8-rowwise", "fp8-blockwise"):
            print(host_profile(min(args.tokens), SHAPES[0], recipe))
    if args.profile and args.device == "cuda":
        print(profile_step(min(args.tokens), SHAPES[0], "fp8-rowwise"))  # small: where fixed costs show
        for recipe in ("fp8-blockwise", "fp8-rowwise"):
            print(profile_step(max(args.tokens), SHAPES[-1], recipe))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    table = markdown(linear_rows, kernel_rows, quality_rows, sweep_rows, split_rows)
    print(f"{device_name}, torch {torch.__version__}, command: {' '.join(sys.argv)}\n\n{table}")
    configs = tuned_configs()
    if configs:
        print("\ntuned configs:\n" + "\n".join(f"  {key}: {config}" for key, config in configs.items()))
    results = dict(device=device_name, torch=torch.__version__, linear=linear_rows, kernels=kernel_rows)
    results["tuned_configs"] = configs
    results["quality"] = quality_rows
    results["norm_sweep"] = sweep_rows
    results["split_sweep"] = split_rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
