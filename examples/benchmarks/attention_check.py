"""GPU check of the GDPA Triton kernels: ``torch.compile`` against eager, bf16 correctness against the float64
reference (a few named cases, then a sweep of random jagged shapes per mode), speed against
``torch.nn.attention.flex_attention`` (compiled, document-causal block mask) on one jagged batch, and a table
of tile shapes per kernel on the benchmark workloads.

Run on a CUDA machine from the repository root: ``python examples/benchmarks/attention_check.py [section ...]``
(sections: compile, bf16, sweep, speed, tiles; default all but tiles). Each section prints its own result (a
failure is printed and the next section runs). Times are medians of
``triton.testing.do_bench``; TFLOP/s count only allowed (query, key) pairs (``gdpa_flops``), the same
useful work for both implementations.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.ops import gdpa_flops
from lightning_gem.ops.attention.spec import Spec

HEADS, DIM = 4, 128


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int64)


def _check_bf16() -> None:
    """Kernel bf16 error vs the float64 reference, next to the bf16-in/fp32-compute reference's own error."""
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 300, (8,), generator=gen)
    lengths[0], lengths[1] = 0, 1
    offsets = _offsets(lengths).cuda()
    total = int(lengths.sum())
    kv_lengths = torch.randint(1, 400, (3,), generator=gen)
    kv_offsets = _offsets(kv_lengths).cuda()
    kv_index = torch.randint(0, 3, (8,), generator=gen).cuda()
    targets = (lengths * torch.rand(8, generator=gen)).to(torch.int64).cuda()
    modes = {
        "softmax causal": dict(activation="softmax", causal=True),
        "silu causal targets": dict(activation="silu", causal=True, num_targets=targets),
        "softmax window 64 targets": dict(activation="softmax", causal=True, window=64, num_targets=targets),
        "softmax block 128": dict(activation="softmax", block_size=128),
        "softmax block 64": dict(activation="softmax", block_size=64),
        "softmax cross kv_index": dict(activation="softmax", causal=True, cross=True),
        "gelu cross kv_index": dict(activation="gelu", causal=False, cross=True),
    }
    print(f"\n== bf16 correctness (H={HEADS}, D={DIM}, {len(lengths)} segments, max err vs float64 reference) ==")
    print(f"{'mode':28s} {'tensor':6s} {'triton':>10s} {'ref bf16':>10s} {'ratio':>6s}")
    for name, mode in modes.items():
        mode = dict(mode)
        cross = mode.pop("cross", False)
        num_k = int(kv_lengths.sum()) if cross else total
        rand = lambda rows: torch.randn(rows, HEADS, DIM, generator=gen).cuda().to(torch.bfloat16)
        q, k, v = rand(total), rand(num_k), rand(num_k)
        jagged = (offsets, kv_offsets if cross else offsets, kv_index if cross else None, mode.pop("num_targets", None))
        options = dict(activation=mode["activation"], causal=mode.get("causal", False), window=mode.get("window"),
                       block_size=mode.get("block_size"), scale=1 / math.sqrt(DIM))  # fmt: skip
        grad_out = torch.randn(total, HEADS, DIM, generator=gen).cuda().to(torch.bfloat16)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        spec = Spec(*jagged, **options)
        out = gdpa_triton(*leaves, spec)
        grads = torch.autograd.grad(out, leaves, grad_out)
        f64 = [t.double() for t in (q, k, v)]
        oracle = [gdpa_reference(*f64, spec)]
        oracle += gdpa_reference_backward(grad_out.double(), *f64, spec)
        same = [gdpa_reference(q, k, v, spec)]
        same += gdpa_reference_backward(grad_out, q, k, v, spec)
        for label, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
            err = float((got.double() - exact).abs().max())
            ref_err = float((ref.double() - exact).abs().max())
            print(f"{name:28s} {label:6s} {err:10.3e} {ref_err:10.3e} {err / max(ref_err, 1e-30):6.2f}")


def _bench(fn, grad_to_none=None) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")


def _benchmark() -> None:
    """64 sequences, lengths clip(4096 u^3, 16, 4096), 4 heads x 128, bf16: GDPA vs compiled flex_attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    gen = torch.Generator().manual_seed(0)
    lengths = (4096 * torch.rand(64, generator=gen) ** 3).to(torch.int64).clamp(16, 4096)
    offsets = _offsets(lengths).cuda()
    total = int(lengths.sum())
    max_len = int(lengths.max())
    q, k, v = (torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    grad_out = torch.randn_like(q)
    scale = 1 / math.sqrt(DIM)
    print(f"\n== speed: 64 sequences, {total} tokens (max {max_len}), H={HEADS}, D={DIM}, bf16, causal ==")

    # flex_attention on the packed batch: [1, H, T_pad, D] with a document-causal mask.
    padded = (total + 127) // 128 * 128
    doc = torch.repeat_interleave(torch.arange(64, device="cuda"), lengths.cuda())
    doc = torch.cat([doc, torch.full((padded - total,), -1, device="cuda")])

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    start = time.perf_counter()
    block_mask = create_block_mask(document_causal, 1, 1, padded, padded, device="cuda")
    torch.cuda.synchronize()
    mask_ms = (time.perf_counter() - start) * 1e3
    block_mask_ms = _bench(lambda: create_block_mask(document_causal, 1, 1, padded, padded, device="cuda"))
    flex = torch.compile(flex_attention)

    def to_flex(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros(padded - total, HEADS, DIM)])
        return t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()

    fq, fk, fv = to_flex(q), to_flex(k), to_flex(v)
    fgrad = to_flex(grad_out).detach()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flops_kwargs = dict(causal=True, window=None, block_size=None)
    fwd_flops = gdpa_flops(q, k, v, offsets, offsets, None, None, **flops_kwargs)
    bwd_flops = gdpa_flops(q, k, v, offsets, offsets, None, None, **flops_kwargs, backward=True)

    rows = []
    for activation in ("softmax", "silu"):
        options = dict(activation=activation, causal=True, window=None, block_size=None, scale=scale,
                       max_seq_len_q=max_len, max_seq_len_kv=max_len)  # fmt: skip
        spec = Spec(offsets, offsets, None, None, **options)
        fwd = _bench(lambda spec=spec: gdpa_triton(q, k, v, spec))
        both = _bench(lambda spec=spec: gdpa_triton(*leaves, spec).backward(grad_out), leaves)
        rows.append((f"gdpa triton {activation}", fwd, both))
    fwd = _bench(lambda: flex(fq.detach(), fk.detach(), fv.detach(), block_mask=block_mask, scale=scale))
    both = _bench(lambda: flex(fq, fk, fv, block_mask=block_mask, scale=scale).backward(fgrad), [fq, fk, fv])
    rows.append(("flex_attention softmax", fwd, both))
    # Same-answer check for the softmax pair (bf16 on both sides).
    ours = gdpa_triton(q, k, v, Spec(offsets, offsets, None, None, "softmax", True, None, None, scale))
    theirs = flex(fq, fk, fv, block_mask=block_mask, scale=scale)[0].transpose(0, 1)[:total]
    print(f"max |gdpa - flex| (softmax, bf16): {float((ours.float() - theirs.float()).abs().max()):.3e}")
    print(f"flex block mask: first build {mask_ms:.1f} ms (incl. compile), then {block_mask_ms:.3f} ms per batch")
    print(f"{'impl':26s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'fwd+bwd ms':>11s} {'fwd+bwd TF/s':>13s}")
    for name, fwd, both in rows:
        print(
            f"{name:26s} {fwd:8.3f} {fwd_flops / fwd / 1e9:9.1f} {both:11.3f} "
            f"{(fwd_flops + bwd_flops) / both / 1e9:13.1f}"
        )


def _tile_workloads() -> list[tuple[str, torch.Tensor, torch.Tensor | None, int, int, dict]]:
    """The benchmark's workloads: (name, q lengths, kv lengths or None, heads, dim, gdpa options)."""
    gen = torch.Generator().manual_seed(0)
    cubic = lambda n, hi: (hi * torch.rand(n, generator=gen) ** 3).to(torch.int64).clamp(16, hi)
    long, short = cubic(64, 4096), cubic(256, 1024)
    causal = dict(causal=True)
    return [
        ("4k softmax", long, None, 4, 128, dict(activation="softmax", **causal)),
        ("4k silu", long, None, 4, 128, dict(activation="silu", **causal)),
        ("1k softmax", short, None, 8, 64, dict(activation="softmax", **causal)),
        ("1k silu", short, None, 8, 64, dict(activation="silu", **causal)),
        ("cross 32 x 2k", torch.full((512,), 32), cubic(512, 2048), 4, 128, dict(activation="softmax")),
        ("block 64 8x4k", torch.full((8,), 4096), None, 4, 128, dict(activation="softmax", block_size=64)),
    ]


def _tiles() -> None:
    """Kernel times of each candidate launch (and a few more) on the benchmark workloads: the forward, and the
    backward as the dK/dV kernel with atomic dQ or as the one-launch dK/dV + dQ kernel."""
    from lightning_gem.ops.attention.impl.triton._tuning import (
        BackwardTiles,
        Tiles,
        backward_candidates,
        candidate_tiles,
    )
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, kv_descriptors_ok

    extra_fwd = [Tiles(128, 64, 8, 2), Tiles(128, 128, 8, 3), Tiles(64, 64, 4, 2), Tiles(128, 64, 4, 3)]
    extra_bwd = [BackwardTiles(Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)), BackwardTiles(Tiles(32, 128, 8, 2)),
                 BackwardTiles(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
                 BackwardTiles(Tiles(32, 128, 4, 3), Tiles(128, 32, 4, 3))]  # fmt: skip
    for name, q_lengths, kv_lengths, heads, dim, mode in _tile_workloads():
        offsets = _offsets(q_lengths).cuda()
        kv_offsets = offsets if kv_lengths is None else _offsets(kv_lengths).cuda()
        kv_index = None if kv_lengths is None else torch.arange(len(q_lengths), device="cuda")
        total, total_k = int(q_lengths.sum()), int((q_lengths if kv_lengths is None else kv_lengths).sum())
        q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(total_k, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        grad_out = torch.randn_like(q)
        options = dict(activation=mode["activation"], causal=mode.get("causal", False), window=None,
                       block_size=mode.get("block_size"), scale=1 / math.sqrt(dim))  # fmt: skip
        jagged = (offsets, kv_offsets, kv_index, None)
        max_q = int(q_lengths.max())
        lens = dict(max_seq_len_q=max_q, max_seq_len_kv=int((q_lengths if kv_lengths is None else kv_lengths).max()))
        spec = Spec(*jagged, **options, **lens)
        out, lse = gdpa_forward(q, k, v, spec)
        fwd_flops = gdpa_flops(
            q, k, v, *jagged, causal=options["causal"], window=None, block_size=options["block_size"]
        )
        print(f"\n== tiles: {name} (H={heads}, D={dim}, {total} q tokens, fwd {fwd_flops / 1e9:.3g} GFLOP) ==")
        fwd = candidate_tiles("fwd", q.dtype, q.device, dim, block_size=options["block_size"], max_len_q=max_q,
                              pointwise=options["activation"] != "softmax",
                              descriptors=kv_descriptors_ok(q, k, v))  # fmt: skip
        fwd += [t for t in extra_fwd if t not in fwd and (max_q > 64 or t.block_m <= 64)]
        bwd = backward_candidates(
            q.dtype, q.device, dim, deterministic=False, block_size=options["block_size"], max_len_q=max_q
        )
        bwd += [t for t in extra_bwd if t not in bwd and (max_q > 64 or t.dkdv.block_m <= 64)]
        runs = [(f"forward {t.label}", partial(gdpa_forward, q, k, v, spec, tiles=t)) for t in fwd]
        for plan in bwd:
            label = f"backward {plan.dkdv.label} " + ("atomic dQ" if plan.dq is None else f"dQ {plan.dq.label}")
            run = partial(gdpa_backward, grad_out, q, k, v, out, lse, spec, dkdv_tiles=plan.dkdv, dq_tiles=plan.dq)
            runs.append((label, run))
        for label, run in runs:
            try:
                ms = f"{_bench(run):8.3f} ms"
            except Exception as error:
                ms = type(error).__name__
            print(f"  {label:60s} {ms}", flush=True)


SWEEP_MODES = {
    "softmax causal": dict(layout="self", activation="softmax", causal=True),
    "softmax bidirectional": dict(layout="self", activation="softmax"),
    "silu causal": dict(layout="self", activation="silu", causal=True),
    "silu causal targets": dict(layout="self_targets", activation="silu", causal=True),
    "softmax causal window targets": dict(layout="self_targets", activation="softmax", causal=True, window=48),
    "softmax causal window": dict(layout="self", activation="softmax", causal=True, window=48),
    "softmax block 64": dict(layout="self", activation="softmax", block_size=64),
    "silu block 32 causal": dict(layout="self", activation="silu", causal=True, block_size=32),
    "softmax cross": dict(layout="cross", activation="softmax"),
    "silu cross": dict(layout="cross", activation="silu"),
    # Candidates over histories: query segments of at most 64 (the short-query backward) over up to 300 keys.
    "softmax cross short queries": dict(layout="cross", activation="softmax", q_max=64),
    "silu cross short queries causal": dict(layout="cross", activation="silu", causal=True, q_max=32),
    "softmax shared kv causal": dict(layout="shared_kv", activation="softmax", causal=True),
    "gelu shared kv": dict(layout="shared_kv", activation="gelu"),
}
# The modes of the shape grid (attention_grid.py).
GRID_MODES = ["softmax causal", "softmax bidirectional", "silu causal", "silu causal targets", "softmax cross",
              "silu cross", "softmax block 64"]  # fmt: skip


def _supports(impl: str, inputs: object, mode: dict) -> bool:
    """Whether ``impl`` computes ``mode`` on these inputs (``flash``: FA4's exact modes, FA4 installed; ``varlen``:
    PyTorch's FlashAttention-2, the same modes)."""
    if impl == "varlen":
        from lightning_gem.ops.attention.impl.varlen import varlen_unsupported

        spec = Spec(inputs.q_offsets, inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets,
                    inputs.kv_index, inputs.num_targets, mode["activation"], mode.get("causal", False),
                    mode.get("window"), mode.get("block_size"), 1.0)  # fmt: skip
        return varlen_unsupported(inputs.q, inputs.v, spec) is None
    if impl != "flash":  # the kit's own, in any precision
        return True
    from lightning_gem.imports import FA4_AVAILABLE
    from lightning_gem.ops.attention.impl.flash import unsupported

    reason = unsupported(inputs.q, inputs.v, activation=mode["activation"], block_size=mode.get("block_size"),
                         kv_index=inputs.kv_index, num_targets=inputs.num_targets,
                         self_attention=inputs.kv_offsets is None)  # fmt: skip
    return reason is None and bool(FA4_AVAILABLE)


@contextlib.contextmanager
def _tuner_picks(candidate: str):
    """Inside: GDPA's tuner chooses ``candidate`` (a library backend, e.g. ``"varlen"``) for every key, untimed and
    not remembered, and raises where it is not a candidate, so ``impl="auto"`` runs that backend forward and
    backward or fails."""
    from lightning_gem.ops.attention.impl.triton import _tuning

    def pick(registry, key, candidates, run, tensors, **options):
        if candidate not in candidates:
            raise RuntimeError(f"{candidate!r} is not a candidate of {key[0]} here: {candidates}")
        return candidate

    real = _tuning.pick_fastest
    _tuning.pick_fastest = pick
    _tuning.forget_choices()
    try:
        yield
    finally:
        _tuning.pick_fastest = real
        _tuning.forget_choices()


def _sweep(
    num_shapes: int = 200,
    modes: list[str] | None = None,
    device: str = "cuda",
    impls: tuple[str, ...] = ("triton",),
    dims: tuple[int, ...] = (32, 64, 128),
) -> int:
    """Random jagged shapes per mode (bf16 on GPUs, 1-8 segments of 0-300 tokens with an empty and a length-1
    one, heads 1-4, head dims cycling through ``dims``; the short-query modes draw query segments of at most 32 or
    64), forward and backward of ``gdpa(impl=...)`` for each of ``impls`` that computes the mode, against the
    float64 reference, by FlashAttention's rule: no non-finite value, and per tensor (out, dq, dk, dv)
    ``max|x - oracle| <= 2 max|x_ref - oracle| + 2 ulp``, where ``x_ref`` is the reference computed in the inputs'
    own dtype throughout (every matmul, the softmax or activation, the sums) and ``ulp`` the dtype's epsilon at the
    tensor's scale (the case's largest exact value where the tensor is exactly zero, as a gradient is when every
    query sees a single key). An impl written ``triton-fp8`` (or ``auto-fp8``) runs ``precision="fp8"``: its ``x_ref``
    are the FP8 emulations of the forward and the backward (``gdpa_fp8_reference`` and
    ``gdpa_fp8_reference_backward`` of :mod:`lightning_gem.ops.attention.fp8`). ``varlen`` is ``impl="auto"`` made
    to run PyTorch's FlashAttention-2 forward and backward (:func:`_tuner_picks`), in the modes it computes. Returns
    the number of failures."""
    from lightning_gem.ops import gdpa
    from lightning_gem.ops.attention.fp8 import gdpa_fp8_reference, gdpa_fp8_reference_backward
    from lightning_gem.testing.jagged_inputs import make_gdpa_inputs, random_lengths
    from lightning_gem.testing.numerics import max_abs_error

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(
        f"\n== sweep: {num_shapes} random jagged shapes per mode, {dtype}, head dims {dims}, impls {impls}, "
        "forward + backward vs float64 (FlashAttention's rule) =="
    )
    print(f"{'mode':32s} {'impl':10s} {'shapes':>6s} {'failed':>6s} {'non-finite':>10s} {'worst err/budget':>16s}")
    total_failed = 0
    for name in modes or list(SWEEP_MODES):
        mode = dict(SWEEP_MODES[name])
        gen = torch.Generator().manual_seed(list(SWEEP_MODES).index(name))
        layout = mode.pop("layout")
        stats = {impl: [0, 0, 0, 0.0] for impl in impls}  # shapes, failed, non-finite, worst err/budget
        for i in range(num_shapes):
            num_segments = int(torch.randint(1, 9, (), generator=gen))
            dim = dims[i % len(dims)] if device == "cuda" else 16
            heads = int(torch.randint(1, 5, (), generator=gen))
            q_lengths = random_lengths(num_segments, mode["q_max"], gen) if "q_max" in mode else None
            inputs = make_gdpa_inputs(layout, gen, num_segments=num_segments, max_len=300, q_lengths=q_lengths,
                                      heads=heads, dim=dim, dim_v=dim, dtype=dtype)  # fmt: skip
            dev = {n: t.to(device) for n, t in vars(inputs).items() if isinstance(t, torch.Tensor)}
            inputs = inputs.with_qkv(dev["q"], dev["k"], dev["v"])
            for field in ("q_offsets", "kv_offsets", "kv_index", "num_targets"):
                setattr(inputs, field, dev.get(field))
            kv_offsets = dev["q_offsets"] if dev.get("kv_offsets") is None else dev["kv_offsets"]
            jagged = (dev["q_offsets"], kv_offsets, dev.get("kv_index"), dev.get("num_targets"))
            options = dict(activation=mode["activation"], causal=mode.get("causal", False), window=mode.get("window"),
                           block_size=mode.get("block_size"), scale=1 / math.sqrt(dim))  # fmt: skip
            q, k, v = dev["q"], dev["k"], dev["v"]
            grad_out = torch.randn(q.shape[0], heads, dim, generator=gen).to(device, dtype)
            f64 = [t.double() for t in (q, k, v)]
            spec = Spec(*jagged, **options)
            oracle = [gdpa_reference(*f64, spec)]
            oracle += gdpa_reference_backward(grad_out.double(), *f64, spec)
            same = [gdpa_reference(q, k, v, spec, compute_dtype=dtype)]
            same += gdpa_reference_backward(grad_out, q, k, v, spec, compute_dtype=dtype)
            case_scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in oracle)
            gdpa_options = {key: value for key, value in options.items() if value is not None or key == "window"}
            for impl in impls:
                base, _, precision = impl.partition("-")
                if not _supports(base, inputs, mode):
                    continue
                refs = same
                if precision:
                    fp8_spec = spec._replace(precision=precision)
                    emulated = gdpa_fp8_reference(q, k, v, fp8_spec)
                    refs = [emulated, *gdpa_fp8_reference_backward(grad_out, q, k, v, emulated, fp8_spec)]
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                forced = _tuner_picks(base) if base == "varlen" else contextlib.nullcontext()
                with forced:  # "varlen": impl="auto" made to run PyTorch's FlashAttention-2 both ways
                    out = gdpa(*leaves, inputs.q_offsets, inputs.kv_offsets, kv_index=inputs.kv_index,
                               num_targets=inputs.num_targets, impl="auto" if base == "varlen" else base,
                               precision=precision or None, **gdpa_options)  # fmt: skip
                    grads = torch.autograd.grad(out, leaves, grad_out) if q.shape[0] else (q, k, v)
                bad = non_finite = False
                worst = 0.0
                for got, exact, ref in zip([out, *grads], oracle, refs, strict=True):
                    if got.numel() == 0:
                        continue
                    non_finite = non_finite or not bool(torch.isfinite(got).all())
                    scale = float(exact.abs().max()) or case_scale
                    budget = 2 * max_abs_error(ref, exact) + 2 * torch.finfo(dtype).eps * scale
                    ratio = max_abs_error(got, exact) / max(budget, 1e-30)
                    worst = max(worst, ratio)
                    bad = bad or ratio > 1
                row = stats[impl]
                row[0] += 1
                row[1] += bad
                row[2] += non_finite
                row[3] = max(row[3], worst)
        for impl, (shapes, failed, non_finite, worst) in stats.items():
            total_failed += failed + non_finite
            print(f"{name:32s} {impl:10s} {shapes:6d} {failed:6d} {non_finite:10d} {worst:16.3f}", flush=True)
    print(f"sweep: {'all within budget, no non-finite value' if total_failed == 0 else f'{total_failed} failures'}")
    return total_failed


def _compile() -> None:
    """``torch.compile(fullgraph=True)`` (Inductor) of forward + backward, against eager."""
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    lengths = torch.tensor([37, 0, 1, 300, 129])
    offsets = _offsets(lengths).cuda()
    total = int(lengths.sum())
    options = dict(
        activation="softmax", causal=True, window=None, block_size=8, scale=0.125, max_seq_len_q=300, max_seq_len_kv=300
    )

    def loss(q, k, v):
        return gdpa_triton(q, k, v, Spec(offsets, offsets, None, None, **options)).float().square().sum()

    for dtype in (torch.bfloat16, torch.float32):
        try:
            torch._dynamo.reset()
            leaves = [torch.randn(total, HEADS, DIM, device="cuda", dtype=dtype).requires_grad_() for _ in range(3)]
            eager = [t.detach().clone().requires_grad_() for t in leaves]
            value = torch.compile(loss, fullgraph=True)(*leaves)
            value.backward()
            expected = loss(*eager)
            expected.backward()
            diffs = [float((a.grad - b.grad).abs().max()) for a, b in zip(leaves, eager, strict=True)]
            print(f"compile {dtype}: ok, |loss diff| {float((value - expected).abs()):.3e}, grad diffs {diffs}")
        except Exception as error:
            text = "\n".join(line for line in str(error).splitlines() if "DEBUG" not in line)
            print(f"compile {dtype}: {type(error).__name__}:\n{text[:800]}\n...\n{text[-2500:]}")


def _flash_overhead(heads: int = 16, dim: int = 128, rounds: int = 5) -> None:
    """What GDPA's path around FlashAttention-4 costs: on 64 sequences of clip(4096 u^3, 16, 4096) (causal softmax,
    bf16), FA4's own ``flash_attn_varlen_func``, the kit's wrappers of its forward and backward called directly,
    ``gdpa(impl="flash")`` and ``gdpa(impl="auto")``, forward and forward+backward, in ``rounds`` interleaved
    rounds (median ms each), then the device kernels of one auto forward+backward (``torch.profiler``)."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    from lightning_gem.ops import gdpa
    from lightning_gem.ops.attention.impl.flash import flash_backward, flash_forward

    gen = torch.Generator().manual_seed(0)
    lengths = (4096 * torch.rand(64, generator=gen) ** 3).to(torch.int64).clamp(16, 4096)
    offsets = _offsets(lengths).cuda()
    cu = offsets.to(torch.int32)
    total, longest = int(lengths.sum()), int(lengths.max())
    q, k, v, grad = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scale = 1 / math.sqrt(dim)
    spec = Spec(offsets, offsets, None, None, "softmax", True, None, None, scale, longest, longest)

    def fa4(*t):
        return flash_attn_varlen_func(q=t[0], k=t[1], v=t[2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                      max_seqlen_k=longest, softmax_scale=scale, causal=True)[0]  # fmt: skip

    def wrappers_both() -> None:
        out, lse = flash_forward(q, k, v, spec)
        flash_backward(grad, q, k, v, out, lse, spec)

    def api(impl: str):
        return lambda *t: gdpa(*t, offsets, activation="softmax", causal=True, scale=scale, max_seq_len_q=longest,
                               impl=impl, check_offsets=False)  # fmt: skip

    runs = {
        "fa4 varlen fwd": lambda: fa4(q, k, v),
        "kit wrapper fwd": lambda: flash_forward(q, k, v, spec),
        "gdpa flash fwd": lambda: api("flash")(q, k, v),
        "gdpa auto fwd": lambda: api("auto")(q, k, v),
        "fa4 varlen f+b": lambda: fa4(*leaves).backward(grad),
        "kit wrappers f+b": wrappers_both,
        "gdpa flash f+b": lambda: api("flash")(*leaves).backward(grad),
        "gdpa auto f+b": lambda: api("auto")(*leaves).backward(grad),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up: compiles and tunes
        with torch.no_grad() if name.endswith("fwd") else torch.enable_grad():
            fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            with torch.no_grad() if name.endswith("fwd") else torch.enable_grad():
                times[name].append(_bench(fn, leaves))
    print(f"\n== FlashAttention-4 through the kit: {total} tokens, {heads} x {dim}, causal, {rounds} rounds ==")
    for name, values in times.items():
        print(f"{name:20s} {sorted(values)[len(values) // 2]:8.3f} ms   (rounds {min(values):.3f}-{max(values):.3f})")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            api("auto")(*leaves).backward(grad)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


SECTIONS = {
    "flash": _flash_overhead,
    "compile": _compile,
    "bf16": _check_bf16,
    "sweep": _sweep,
    "speed": _benchmark,
    "tiles": _tiles,
}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", default=["compile", "bf16", "sweep", "speed"], choices=list(SECTIONS))
    parser.add_argument(
        "--modes",
        help=f"comma-separated sweep modes or their indices, or 'grid' (default all): {', '.join(SWEEP_MODES)}",
    )
    parser.add_argument("--shapes", type=int, default=200, help="random shapes per sweep mode (default 200)")
    parser.add_argument(
        "--impls",
        default="triton",
        help="comma-separated gdpa impls of the sweep (default triton; varlen: auto running PyTorch's FA2)",
    )
    parser.add_argument("--dims", default="32,64,128", help="comma-separated head dims of the sweep")
    parser.add_argument("--out", help="also write the sweep's failure count here (JSON)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name in args.sections:
        start = time.perf_counter()
        try:
            if name == "sweep":
                if args.modes == "grid":
                    picked = GRID_MODES
                elif args.modes:
                    picked = [list(SWEEP_MODES)[int(m)] if m.isdigit() else m for m in args.modes.split(",")]
                else:
                    picked = None
                dims = tuple(int(d) for d in args.dims.split(","))
                failures = _sweep(args.shapes, picked, impls=tuple(args.impls.split(",")), dims=dims)
                if args.out:
                    Path(args.out).write_text(json.dumps({"failures": failures}))
            else:
                SECTIONS[name]()
        except Exception:
            traceback.print_exc()
        print(f"[{name}: {time.perf_counter() - start:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
