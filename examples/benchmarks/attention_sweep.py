"""Launch shapes and kernel variants of GDPA's Triton kernels, timed one against another on the same inputs.

For each workload of ``attention.py`` (same shapes and seeds) and each of its modes, on a CUDA machine::

    python examples/benchmarks/attention_sweep.py --workloads jagged4k,jagged1k --out sweep.json

prints and saves:

- ``forward``: every tile shape of a wider set than the tuner's candidates (query rows, key rows, warps,
  stages), with pointer loads, with tensor-descriptor loads (``tma``) and warp-specialized (``ws``, at 4 warps) where
  the GPU runs them (``warp_specialize_fault``: none yet), compiled at once, each timed alone (median of
  ``triton.testing.do_bench``), with useful TFLOP/s;
- ``backward``: every backward plan (the tuner's candidates, dQ through element atomics or through bulk tensor
  reductions on several tile shapes, the one-launch dK/dV + dQ kernel, and dK and dV in programs of their own),
  each timed alone, with its largest difference from the one-launch (bitwise reproducible) plan's gradients,
  relative to their largest value.

``--heads`` and ``--dim`` run a workload's lengths at other head counts and head dims (shapes around the named
ones), ``--uniform 16x4096`` segments of one length instead of the workload's, ``--targets 64`` the causal modes with
the last 64 tokens of every segment as targets (``num_targets``: HSTU's targets).

The tuner picks among a subset of these at run time; this script shows what each variant costs, so candidate
lists are chosen on measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import WORKLOAD_NAMES, make_case, make_workload

from lightning_gem.ops._tuning import _compile_all
from lightning_gem.ops.attention.impl.triton._tuning import (
    BackwardTiles,
    Tiles,
    backward_candidates,
    candidate_tiles,
    forward_tiles_fault,
    split_candidates,
)
from lightning_gem.ops.attention.impl.triton.backward import bulk_reduction_ok, gdpa_backward
from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, kv_descriptors_ok, warp_specialize_fault
from lightning_gem.ops.attention.ops import gdpa_flops
from lightning_gem.ops.attention.spec import Spec

# Tile shapes beyond the tuner's: (block_m, block_n, warps, stages) by head dim.
FORWARD_SHAPES = {
    64: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 3), (32, 32, 4, 3), (64, 16, 4, 3),
         (128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    128: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 3), (32, 32, 4, 3), (64, 16, 4, 3),
          (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(128, 64, 8, 1), (128, 32, 8, 3), (128, 32, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (128, 128, 8, 1)],
}  # fmt: skip
BACKWARD_SHAPES = {
    64: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3),
         (64, 128, 4, 3), (32, 128, 8, 3)],
    128: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3), (32, 64, 8, 2),
          (32, 128, 8, 2), (128, 128, 8, 2)],
    256: [(64, 64, 8, 1), (64, 64, 4, 1), (32, 64, 8, 1), (32, 64, 4, 2), (64, 32, 8, 1), (32, 32, 4, 2),
          (16, 128, 8, 1), (32, 128, 8, 1)],
}  # fmt: skip


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


def _context_lost(error: Exception) -> bool:
    """Whether ``error`` is a CUDA error (a faulting kernel): the process's CUDA context is lost, so every later launch
    would fail as well, whatever its variant. Said, and the workload's remaining variants are not run."""
    if type(error).__name__ != "AcceleratorError" and "CUDA error" not in str(error):
        return False
    print("    (a CUDA error: this process cannot launch again; the remaining variants were not run)")
    return True


def parse_plan(text: str) -> BackwardTiles:
    """``"32,64,8,2"`` (block_m, block_n, warps, stages of the dK/dV kernel with atomic dQ), with ``,tma`` (dQ
    through bulk tensor reductions), ``,split`` (dK and dV in programs of their own), ``,halves`` (with ``split``:
    the dK program's K, dK and dQ tiles in two column halves), ``,dv2`` (with ``split``: the dV programs in a launch of
    their own at 2 stages) and ``,dq128x64`` (dQ programs of 128 query rows x 64 key rows in the same launch instead of
    atomic dQ) after it as wanted."""
    numbers, flags, dq, dv_stages = [], set(), None, 0
    for item in text.split(","):
        if item.isdigit():
            numbers.append(int(item))
        elif item.startswith("dv") and item[2:].isdigit():
            dv_stages = int(item[2:])
        elif item.startswith("dq") and "x" in item:
            rows, keys = item[2:].split("x")
            dq = (int(rows), int(keys))
        else:
            flags.add(item)
    alone = "halves" in flags or dv_stages  # options of the split dK/dV programs with atomic dQ
    bad = flags - {"tma", "split", "halves"} or (alone and ("split" not in flags or dq is not None))
    if bad or len(numbers) != 4 or (dq is not None and "tma" in flags):
        raise ValueError(
            f"not a backward plan: {text!r} (block_m,block_n,warps,stages[,tma][,split[,halves][,dvN]][,dqMxN])"
        )
    tiles = Tiles(*numbers)
    dq_tiles = None if dq is None else Tiles(*dq, tiles.num_warps, tiles.num_stages)
    return BackwardTiles(tiles, dq_tiles, tma="tma" in flags, split="split" in flags, halves="halves" in flags,
                         dv_stages=dv_stages)  # fmt: skip


def sweep_case(
    case,
    quick: bool,
    parts: tuple[str, ...] = ("fwd", "bwd"),
    extra_plans: tuple[BackwardTiles, ...] = (),
    targets: int = 0,
    plans_only: bool = False,
) -> dict:
    """Time ``case``'s forward and backward variants. ``targets``: the last ``targets`` tokens of every segment
    (all of a shorter one) are targets (``num_targets``; causal self-attention only). ``plans_only``: of the
    backward, ``extra_plans`` and the tuner's first one-launch plan (the reference of the gradients) only."""
    q, k, v = case.q, case.k, case.v
    head_dim = q.shape[2]
    num_targets = case.q_lengths.clamp(max=targets).to(q.device) if targets else None
    jagged = (case.q_offsets, case.kv_offsets, None, num_targets)
    max_q, max_kv = int(case.q_lengths.max()), int(case.kv_lengths.max())
    spec = Spec(*jagged, case.activation, case.causal, None, case.block_size, case.scale, max_q, max_kv)
    fwd_flops = gdpa_flops(q, k, v, *jagged, causal=case.causal, window=None, block_size=case.block_size)
    bwd_flops = gdpa_flops(q, k, v, *jagged, causal=case.causal, window=None, block_size=case.block_size, backward=True)
    result: dict = {"forward": [], "backward": []}

    # Forward: the tuner's candidates and the wider set.
    pointwise = case.activation != "softmax"
    shapes = candidate_tiles(
        "fwd", q.dtype, q.device, head_dim, block_size=case.block_size, max_len_q=max_q, pointwise=pointwise
    )
    if not quick:
        shapes = _unique(shapes + [Tiles(*s) for s in FORWARD_SHAPES.get(head_dim, [])])
    faulting = [t for t in shapes if forward_tiles_fault(t, q.dtype, head_dim, case.block_size, case.activation)]
    if faulting:  # they can stop the process (a CUDA error): every later variant would be lost
        print(f"  forward tiles left out (forward_tiles_fault): {', '.join(t.label for t in faulting)}")
        shapes = [t for t in shapes if t not in faulting]

    # Each shape with pointer loads of the key and value tiles and, where the GPU has them, tensor-descriptor loads,
    # and then the warp-specialized loop (4 warps: each shape's rows and keys at 4 warps) where it can run.
    variants = [(tiles, False, False) for tiles in shapes]
    if kv_descriptors_ok(q, k, v):
        variants += [(tiles, True, False) for tiles in shapes]
        specialized = _unique([t._replace(num_warps=4) for t in shapes])
        variants += [(t, True, True) for t in specialized if warp_specialize_fault(q, t, True, False, False) is None]

    def forward(variant: tuple[Tiles, bool, bool]) -> tuple:
        return gdpa_forward(q, k, v, spec, tiles=variant[0]._replace(tma=variant[1]), warp_specialize=variant[2])

    _compile_all(variants, forward)
    print("  forward:")
    for variant in variants:
        tiles, tma, ws = variant
        label = f"{tiles._replace(tma=tma).label}{' ws' if ws else ''}"
        try:
            ms = _bench(lambda t=variant: forward(t))
        except Exception as error:
            print(f"    failed     {label}: {type(error).__name__}")
            if _context_lost(error):
                return {**result, "context_lost": label}
            continue
        result["forward"].append(
            {"tiles": list(tiles[:4]), "tma": tma, "ws": ws, "ms": ms, "tflops": fwd_flops / ms / 1e9}
        )
        print(f"    {ms * 1e3:8.1f} us {fwd_flops / ms / 1e9:7.1f} TF/s  {label}")
    best = min(result["forward"], key=lambda r: r["ms"])
    best_variant = (Tiles(*best["tiles"]), best["tma"], best["ws"])
    if "bwd" not in parts:
        return result

    # Backward: plans against the one-launch plan's gradients.
    out, lse = forward(best_variant)
    tma = bulk_reduction_ok(q)
    plans = backward_candidates(
        q.dtype, q.device, head_dim, deterministic=False, block_size=case.block_size, max_len_q=max_q, tma=tma
    )
    plans += split_candidates(q.dtype, q.device, head_dim, block_size=case.block_size, max_len_q=max_q, tma=tma)
    if not quick:
        extra = [Tiles(*s) for s in BACKWARD_SHAPES.get(head_dim, [])]
        plans += [BackwardTiles(t) for t in extra] + ([BackwardTiles(t, tma=True) for t in extra] if tma else [])
    if plans_only:
        plans = [next(plan for plan in plans if plan.dq is not None)]
    plans = _unique(plans + [plan for plan in extra_plans if tma or not plan.tma])

    def backward(plan: BackwardTiles) -> tuple:
        if plan.short:
            return gdpa_backward(case.grad_out, q, k, v, out, lse, spec, short_tiles=plan.dkdv)
        tiles = {"dkdv_tiles": plan.dkdv, "dq_tiles": plan.dq, "bulk_dq": plan.tma, "split_dkdv": plan.split,
                 "column_halves": plan.halves, "dv_stages": plan.dv_stages}  # fmt: skip
        return gdpa_backward(case.grad_out, q, k, v, out, lse, spec, **tiles)

    reference = None
    for plan in plans:
        if plan.dq is not None:
            reference = [g.float() for g in backward(plan)]
            break
    _compile_all(plans, backward)
    print("  backward:")
    for plan in plans:
        label = "short" if plan.short else "bulk dQ" if plan.tma else "atomic dQ" if plan.dq is None else "one-launch"
        label += " split" if plan.split else ""
        label += " halves" if plan.halves else ""
        label += f" dv{plan.dv_stages}" if plan.dv_stages else ""
        try:
            ms = _bench(lambda p=plan: backward(p))
            grads = backward(plan)
        except Exception as error:
            print(f"    failed     {label} {plan}: {type(error).__name__}: {str(error)[:200]}")
            if _context_lost(error):
                return {**result, "context_lost": label}
            continue
        err = max(float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in
                  zip(grads, reference, strict=True)) if reference is not None else float("nan")  # fmt: skip
        dq_tiles = None if plan.dq is None else list(plan.dq)
        result["backward"].append({"plan": label, "dkdv": list(plan.dkdv), "dq": dq_tiles, "ms": ms,
                                   "tflops": bwd_flops / ms / 1e9, "rel_err": err})  # fmt: skip
        dq = "" if plan.dq is None else f" dq {plan.dq.label}"
        print(
            f"    {ms * 1e3:8.1f} us {bwd_flops / ms / 1e9:7.1f} TF/s  err {err:.1e}  {label:16s} {plan.dkdv.label}{dq}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="jagged4k,jagged1k", help=f"comma-separated, of {WORKLOAD_NAMES}")
    parser.add_argument("--modes", default="", help="only modes whose label contains this (default: every mode)")
    parser.add_argument("--quick", action="store_true", help="the tuner's candidates only")
    parser.add_argument("--parts", default="fwd,bwd", help="fwd, bwd or both")
    parser.add_argument("--heads", type=int, help="heads of every workload (default: each workload's own)")
    parser.add_argument("--dim", type=int, help="head dim of every workload (default: each workload's own)")
    parser.add_argument(
        "--plans",
        nargs="*",
        default=[],
        type=parse_plan,
        help="more backward plans to time, e.g. 32,64,8,2,tma,split (see parse_plan)",
    )
    parser.add_argument(
        "--plans-only", action="store_true", help="backward: --plans and one one-launch plan only (the reference)"
    )
    parser.add_argument("--uniform", help="COUNTxLENGTH: that many segments of one length instead of the workload's")
    parser.add_argument(
        "--targets", type=int, default=0, help="the last this many tokens of each segment are targets (causal modes)"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_sweep.py needs a CUDA GPU")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.workloads.split(","):
        workload = make_workload(name.strip(), tiny=False, seed=0)
        workload = dataclasses.replace(workload, heads=args.heads or workload.heads, dim=args.dim or workload.dim)
        if args.uniform:
            count, length = (int(n) for n in args.uniform.split("x"))
            workload = dataclasses.replace(workload, q_lengths=torch.full((count,), length), kv_lengths=None)
            name = f"{name} {args.uniform}"
        for label, options in workload.modes:
            self_causal = options.get("causal") and workload.kv_lengths is None
            if args.modes not in label or (args.targets and not self_causal):
                continue
            case = make_case(workload, label, options, torch.device("cuda"))
            label += f", {args.targets} targets" if args.targets else ""
            print(f"\n== {name}: {label} (H={workload.heads}, D={workload.dim}) ==", flush=True)
            key = f"{name}: {label} H={workload.heads} D={workload.dim}"
            parts = tuple(args.parts.split(","))
            results[key] = sweep_case(case, args.quick, parts, tuple(args.plans), args.targets, args.plans_only)
            if "context_lost" in results[key]:
                break
        else:
            continue
        break  # the process's CUDA context is lost: nothing more can run in it
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
