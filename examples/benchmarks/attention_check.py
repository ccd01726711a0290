"""GPU check of the GDPA Triton kernels: ``torch.compile`` against eager, bf16 correctness against the float64
reference, speed against ``torch.nn.attention.flex_attention`` (compiled, document-causal block mask) on
one jagged batch, and a table of tile shapes.

Run on a CUDA machine from the repository root: ``python examples/benchmarks/attention_check.py``. Each section
prints its own result (a failure is printed and the next section runs). Times are medians of
``triton.testing.do_bench``; TFLOP/s count only allowed (query, key) pairs (``gdpa_flops``), the same
useful work for both implementations.
"""

from __future__ import annotations

import math
import time
import traceback

import torch

from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.ops import gdpa_flops

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
        "softmax cross kv_index": dict(activation="softmax", causal=True, cross=True),
        "gelu cross kv_index": dict(activation="gelu", causal=False, cross=True),
    }
    print(f"\n== bf16 correctness (H={HEADS}, D={DIM}, {len(lengths)} segments, max err vs float64 reference) ==")
    print(f"{'mode':28s} {'tensor':6s} {'triton':>10s} {'ref bf16':>10s} {'ratio':>6s}")
    for name, mode in modes.items():
        mode = dict(mode)
        cross = mode.pop("cross", False)
        num_k = int(kv_lengths.sum()) if cross else total
        rand = lambda rows: torch.randn(rows, HEADS, DIM, generator=gen).cuda().to(torch.bfloat16)  # noqa: E731
        q, k, v = rand(total), rand(num_k), rand(num_k)
        jagged = (offsets, kv_offsets if cross else offsets, kv_index if cross else None, mode.pop("num_targets", None))
        options = dict(activation=mode["activation"], causal=mode.get("causal", False), window=mode.get("window"),
                       block_size=mode.get("block_size"), scale=1 / math.sqrt(DIM))  # fmt: skip
        grad_out = torch.randn(total, HEADS, DIM, generator=gen).cuda().to(torch.bfloat16)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gdpa_triton(*leaves, *jagged, **options)
        grads = torch.autograd.grad(out, leaves, grad_out)
        f64 = [t.double() for t in (q, k, v)]
        oracle = [gdpa_reference(*f64, *jagged, **options)]
        oracle += gdpa_reference_backward(grad_out.double(), *f64, *jagged, **options)
        same = [gdpa_reference(q, k, v, *jagged, **options)]
        same += gdpa_reference_backward(grad_out, q, k, v, *jagged, **options)
        for label, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
            err = float((got.double() - exact).abs().max())
            ref_err = float((ref.double() - exact).abs().max())
            print(f"{name:28s} {label:6s} {err:10.3e} {ref_err:10.3e} {err / max(ref_err, 1e-30):6.2f}")


def _bench(fn, grad_to_none=None) -> float:  # noqa: ANN001
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

    def document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
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
        fwd = _bench(lambda: gdpa_triton(q, k, v, offsets, offsets, **options))  # noqa: B023
        both = _bench(lambda: gdpa_triton(*leaves, offsets, offsets, **options).backward(grad_out), leaves)  # noqa: B023
        rows.append((f"gdpa triton {activation}", fwd, both))
    fwd = _bench(lambda: flex(fq.detach(), fk.detach(), fv.detach(), block_mask=block_mask, scale=scale))
    both = _bench(lambda: flex(fq, fk, fv, block_mask=block_mask, scale=scale).backward(fgrad), [fq, fk, fv])
    rows.append(("flex_attention softmax", fwd, both))
    # Same-answer check for the softmax pair (bf16 on both sides).
    ours = gdpa_triton(q, k, v, offsets, offsets, activation="softmax", causal=True, window=None, block_size=None,
                       scale=scale)  # fmt: skip
    theirs = flex(fq, fk, fv, block_mask=block_mask, scale=scale)[0].transpose(0, 1)[:total]
    print(f"max |gdpa - flex| (softmax, bf16): {float((ours.float() - theirs.float()).abs().max()):.3e}")
    print(f"flex block mask: first build {mask_ms:.1f} ms (incl. compile), then {block_mask_ms:.3f} ms per batch")
    print(f"{'impl':26s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'fwd+bwd ms':>11s} {'fwd+bwd TF/s':>13s}")
    for name, fwd, both in rows:
        print(f"{name:26s} {fwd:8.3f} {fwd_flops / fwd / 1e9:9.1f} {both:11.3f} "
              f"{(fwd_flops + bwd_flops) / both / 1e9:13.1f}")  # fmt: skip


def _tiles() -> None:
    """Kernel times of a few tile shapes on the benchmark batch (softmax causal): forward, then the backward
    with one kernel's tiles varied and the other's at its default."""
    from lightning_gem.ops.attention.impl.triton._common import Tiles, default_tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    gen = torch.Generator().manual_seed(0)
    lengths = (4096 * torch.rand(64, generator=gen) ** 3).to(torch.int64).clamp(16, 4096)
    offsets = _offsets(lengths).cuda()
    total, max_len = int(lengths.sum()), int(lengths.max())
    q, k, v = (torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    grad_out = torch.randn_like(q)
    options = dict(activation="softmax", causal=True, window=None, block_size=None, scale=1 / math.sqrt(DIM))
    jagged = (offsets, offsets, None, None)
    out, lse = gdpa_forward(q, k, v, *jagged, **options, max_seq_len_q=max_len)
    lens = dict(max_seq_len_q=max_len, max_seq_len_kv=max_len)
    shapes = [Tiles(*t) for t in ((64, 64, 4), (128, 64, 8), (128, 32, 4), (64, 128, 8), (32, 64, 4), (32, 128, 8),
                                  (64, 32, 4), (128, 128, 8))]  # fmt: skip
    defaults = {name: default_tiles(name, q.dtype, q.device) for name in ("fwd", "dkdv", "dq")}
    print(f"\n== tile shapes (softmax causal, bf16; defaults {defaults}) ==")
    print(f"{'BLOCK_M x BLOCK_N / warps':26s} {'fwd ms':>8s} {'bwd(dkdv=x) ms':>15s} {'bwd(dq=x) ms':>13s}")
    for tiles in shapes:
        times = []
        for run in (
            lambda: gdpa_forward(q, k, v, *jagged, **options, max_seq_len_q=max_len, tiles=tiles),  # noqa: B023
            lambda: gdpa_backward(grad_out, q, k, v, out, lse, *jagged, **options, **lens, dkdv_tiles=tiles),  # noqa: B023
            lambda: gdpa_backward(grad_out, q, k, v, out, lse, *jagged, **options, **lens, dq_tiles=tiles),  # noqa: B023
        ):
            try:
                times.append(f"{_bench(run):.3f}")
            except Exception as error:  # noqa: BLE001  (a tile that does not fit is reported, not fatal)
                times.append(type(error).__name__)
        print(f"{tiles.block_m:4d} x {tiles.block_n:4d} / {tiles.num_warps:2d}{'':12s} {times[0]:>8s} {times[1]:>15s} "
              f"{times[2]:>13s}")  # fmt: skip


def _compile() -> None:
    """``torch.compile(fullgraph=True)`` (Inductor) of forward + backward, against eager."""
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    lengths = torch.tensor([37, 0, 1, 300, 129])
    offsets = _offsets(lengths).cuda()
    total = int(lengths.sum())
    options = dict(activation="softmax", causal=True, window=None, block_size=8, scale=0.125,
                   max_seq_len_q=300, max_seq_len_kv=300)  # fmt: skip

    def loss(q, k, v):  # noqa: ANN001, ANN202
        return gdpa_triton(q, k, v, offsets, offsets, **options).float().square().sum()

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
        except Exception as error:  # noqa: BLE001  (print the cause and go on)
            text = "\n".join(line for line in str(error).splitlines() if "DEBUG" not in line)
            print(f"compile {dtype}: {type(error).__name__}:\n{text[:800]}\n...\n{text[-2500:]}")


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for section in (_compile, _check_bf16, _benchmark, _tiles):
        start = time.perf_counter()
        try:
            section()
        except Exception:  # noqa: BLE001  (print and go on: one call should report every section)
            traceback.print_exc()
        print(f"[{section.__name__}: {time.perf_counter() - start:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
