"""GDPA's forward tiles with pointer loads against the same tiles with tensor-descriptor loads, over a sweep of shapes.

Run on a CUDA machine (sm_90+) from the repository root::

    python examples/benchmarks/forward_tiles.py                      # the default sweep, softmax
    python examples/benchmarks/forward_tiles.py --cells causal,16,128,16,4096 bidirectional,8,64,64,j4096
    python examples/benchmarks/forward_tiles.py --check 25           # correctness of each descriptor tile first

A cell is ``MASK,HEADS,DIM,COUNT,LENGTHS``: ``MASK`` causal or bidirectional, ``COUNT`` segments, ``LENGTHS`` one
length (``4096``) or ``jL`` for ``clip(L u^3, 16, L)`` (u uniform, seeded). Each cell times every forward tile the
tuner lists for it (:func:`candidate_tiles` with descriptor loads allowed) and the descriptor-load twin of each
pointer tile whose key tiles are 64 or wider, each alone: ``gdpa_forward(..., tiles=...)`` without the log-sum-exp,
median of ``triton.testing.do_bench``, bf16, random inputs. TFLOP/s count useful FLOPs (allowed query-key pairs).
Per cell it prints the best pointer tile, the best descriptor tile and their ratio.

``--check N`` first runs each descriptor tile the tuner lists on N random jagged shapes per softmax mode (causal,
bidirectional, windows, targets, candidates over histories, a shared history; 1-12 segments of up to 1,200 tokens,
1-8 heads, head dims 64 and 128) against the float64 reference by FlashAttention's rule (within twice the error of
the same computation in the inputs' dtype plus two of its ulps: bf16 on a GPU, fp32 under the CPU interpreter), and
its log-sum-exp against the pointer tile's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_check import SWEEP_MODES

from lightning_gem.ops.attention.impl.reference import gdpa_reference
from lightning_gem.ops.attention.impl.triton import forward
from lightning_gem.ops.attention.impl.triton._tuning import Tiles, candidate_tiles
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.jagged_inputs import make_gdpa_inputs, random_lengths
from lightning_gem.testing.numerics import max_abs_error

DTYPE = torch.bfloat16
# Around the attention grid's softmax cells: 2-16 heads, head dims 64 and 128, uniform and jagged lengths of 1K-16K.
DEFAULT_CELLS = (
    "causal,16,128,16,4096", "causal,4,128,16,4096", "causal,2,128,16,4096", "causal,8,64,16,4096",
    "causal,16,128,64,j4096", "causal,4,128,64,j4096", "causal,8,64,256,j1024", "causal,4,64,256,j1024",
    "causal,16,128,64,j1024", "causal,8,128,8,j16384", "bidirectional,16,128,16,4096",
    "bidirectional,8,64,64,j4096",
)  # fmt: skip
CHECK_MODES = ("softmax causal", "softmax bidirectional", "softmax causal window targets", "softmax causal window",
               "softmax cross", "softmax shared kv causal")  # fmt: skip


def cell_lengths(text: str, count: int, generator: torch.Generator) -> list[int]:
    """``"4096"``: ``count`` segments of 4096; ``"j4096"``: ``clip(4096 u^3, 16, 4096)``."""
    if not text.startswith("j"):
        return [int(text)] * count
    longest = int(text[1:])
    return torch.clamp((longest * torch.rand(count, generator=generator) ** 3).long(), 16, longest).tolist()


def parse_cell(text: str) -> tuple[bool, int, int, int, str]:
    """``"causal,16,128,16,4096"`` -> ``(causal, heads, dim, count, lengths)``."""
    mask, heads, dim, count, lengths = text.split(",")
    if mask not in ("causal", "bidirectional"):
        raise ValueError(f"not a cell: {text!r} (MASK is causal or bidirectional)")
    return mask == "causal", int(heads), int(dim), int(count), lengths


def time_cell(text: str, generator: torch.Generator) -> dict:
    """Every listed tile's forward alone on one cell's inputs, in TFLOP/s."""
    import triton

    causal, heads, dim, count, lengths_text = parse_cell(text)
    lengths = cell_lengths(lengths_text, count, generator)
    counts = torch.tensor(lengths)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).cuda()
    q, k, v = (torch.randn(int(counts.sum()), heads, dim, device="cuda", dtype=DTYPE) for _ in range(3))
    longest = max(lengths)
    spec = Spec(offsets, offsets, None, None, "softmax", causal, None, None, dim**-0.5, longest, longest)
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    flops = 4 * dim * heads * pairs
    listed = candidate_tiles("fwd", DTYPE, q.device, dim, max_len_q=longest, descriptors=True)
    twins = [t._replace(tma=True) for t in listed if not t.tma and t.block_n >= 64]
    tiles = listed + [t for t in twins if t not in listed]
    result = {"cell": text, "tflops": {}}
    for t in tiles:
        try:
            ms = triton.testing.do_bench(lambda t=t: forward.gdpa_forward(q, k, v, spec, tiles=t, need_lse=False))
        except Exception as error:  # a tile that does not fit (shared memory) is reported, not timed
            result["tflops"][t.label] = type(error).__name__
            continue
        result["tflops"][t.label] = flops / ms / 1e9
    timed = {t: result["tflops"][t.label] for t in tiles if isinstance(result["tflops"][t.label], float)}
    pointer = max((t for t in timed if not t.tma), key=timed.__getitem__)
    descriptor = max((t for t in timed if t.tma), key=timed.__getitem__)
    result.update(pointer=pointer.label, descriptor=descriptor.label, ratio=timed[descriptor] / timed[pointer])
    print(f"{text:32s} pointer {pointer.label:16s} {timed[pointer]:6.1f} | descriptor {descriptor.label:20s} "
          f"{timed[descriptor]:6.1f} | x{result['ratio']:.3f}", flush=True)  # fmt: skip
    return result


def check_mode(name: str, shapes: int, device: torch.device) -> dict:
    """Each descriptor tile the tuner lists on ``shapes`` random jagged inputs of one mode, against float64 (on CPU,
    under Triton's interpreter: fp32 inputs of head dim 16 and up to 40 tokens a segment, the one CPU tile)."""
    mode = dict(SWEEP_MODES[name])
    dims, max_len = ((64, 128), 1200) if device.type == "cuda" else ((16,), 40)
    layout = mode.pop("layout")
    generator = torch.Generator().manual_seed(2000 + list(SWEEP_MODES).index(name))
    dtype = DTYPE if device.type == "cuda" else torch.float32  # the interpreter computes bf16 products in fp32
    worst: dict[Tiles, float] = {}
    failed: dict[Tiles, int] = {}
    for i in range(shapes):
        segments = int(torch.randint(1, 13, (), generator=generator))
        heads, dim = int(torch.randint(1, 9, (), generator=generator)), dims[i % len(dims)]
        q_lengths = random_lengths(segments, mode["q_max"], generator) if "q_max" in mode else None
        inputs = make_gdpa_inputs(layout, generator, num_segments=segments, max_len=max_len, q_lengths=q_lengths,
                                  heads=heads, dim=dim, dim_v=dim, dtype=dtype)  # fmt: skip
        t = {n: x.to(device) for n, x in vars(inputs).items() if isinstance(x, Tensor)}
        if t["q"].shape[0] == 0:
            continue
        kv_offsets = t["q_offsets"] if t.get("kv_offsets") is None else t["kv_offsets"]
        options = dict(activation="softmax", causal=mode.get("causal", False), window=mode.get("window"),
                       block_size=None, scale=1 / math.sqrt(dim))  # fmt: skip
        spec = Spec(t["q_offsets"], kv_offsets, t.get("kv_index"), t.get("num_targets"), **options)
        longest_q, longest_kv = int(t["q_offsets"].diff().max()), int(kv_offsets.diff().max())
        hinted = spec._replace(max_seq_len_q=max(longest_q, 1), max_seq_len_kv=max(longest_kv, 1))
        q, k, v = t["q"], t["k"], t["v"]
        exact = gdpa_reference(q.double(), k.double(), v.double(), spec)
        same = gdpa_reference(q, k, v, spec, compute_dtype=dtype)
        eps = torch.finfo(dtype).eps
        budget = max(2 * max_abs_error(same, exact) + 2 * eps * float(exact.abs().max()), 1e-30)
        listed = candidate_tiles("fwd", dtype, device, dim, max_len_q=longest_q, descriptors=True)
        tiles = [x for x in listed if x.tma] if device.type == "cuda" else [x._replace(tma=True) for x in listed]
        for tile in tiles:
            out, lse = forward.gdpa_forward(q, k, v, hinted, tiles=tile)
            _, pointer_lse = forward.gdpa_forward(q, k, v, hinted, tiles=tile._replace(tma=False))
            ratio = max_abs_error(out, exact) / budget
            finite = torch.isfinite(pointer_lse)
            lse_ok = bool(torch.equal(finite, torch.isfinite(lse))) and (
                not finite.any() or float((lse[finite] - pointer_lse[finite]).abs().max()) <= 1e-2
            )
            worst[tile] = max(worst.get(tile, 0.0), ratio)
            failed[tile] = failed.get(tile, 0) + int(ratio > 1 or not lse_ok or not bool(torch.isfinite(out).all()))
    rows = {tile.label: {"failed": failed[tile], "worst": worst[tile]} for tile in worst}
    for label, row in rows.items():
        print(f"check {name:30s} {label:22s} {shapes} shapes: failed {row['failed']}, worst {row['worst']:.3f} of the "
              "budget", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS), help="MASK,HEADS,DIM,COUNT,LENGTHS")
    parser.add_argument("--check", type=int, default=0, help="random shapes per softmax mode to check first")
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="only the check")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the check, interpreted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results: dict = {"check": {}, "cells": []}
    for name in CHECK_MODES if args.check else ():
        results["check"][name] = check_mode(name, args.check, device)
    if args.timing and device.type == "cuda":
        generator = torch.Generator().manual_seed(args.seed)
        print(f"softmax forward, bf16, TFLOP/s on {torch.cuda.get_device_name()}")
        results["cells"] = [time_cell(cell, generator) for cell in args.cells]
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
