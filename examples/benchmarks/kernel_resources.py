"""Registers, spills, tensor-core instructions and shared memory of GDPA's kernels compiled for sm_90, on any machine.

No GPU needed (Triton's compiler and its backend's ``ptxas`` / ``cuobjdump``)::

    python examples/benchmarks/kernel_resources.py --dim 256
    python examples/benchmarks/kernel_resources.py --dim 128 --activation softmax --plans 64,128,8,3 64,128,8,2,tma

prints one row per launch: the forward's tile candidates, then each backward plan's dK/dV kernel, on bf16 operands
and with ``S`` and ``dP`` on FP8 codes (a plan as in
``attention_sweep.py --plans``: ``block_m,block_n,warps,stages`` with ``tma`` and ``split`` flags; default every
plan the tuner times on long sequences: the one-launch dK/dV + dQ kernel, atomic and bulk-reduced dQ, and the split
dK/dV programs). Per row: registers a thread, stack
bytes a thread (spills), shared memory (over the 232,448 bytes of an H100 / H200 block: the launch fails), spill
stores / loads in all of the SASS, and for each loop (the masked and unmasked key or query walks, in code order)
its instructions, tensor-core instructions and spills. Spills inside the unmasked (middle) loop are the ones that
cost every iteration. A kernel spec fits when it compiles and its shared memory fits; timing decides among those
(``attention_sweep.py`` on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import parse_plan

SHARED_LIMIT = 232448  # bytes of shared memory one block may have on sm_90


def call_options(activation: str, dim: int) -> dict:
    """The constexprs of a bf16 causal call of ``activation`` at head dim ``dim`` on a GPU (no window, blocks, kv
    index or targets), as the launchers make them."""
    import torch

    from lightning_gem.ops.attention.impl.triton._common import kernel_options, mode_flags

    flags = mode_flags(activation, True, None, None, None, None)
    return kernel_options(dim, dim, flags, torch.bfloat16, True)


def _row(label: str, compiled) -> str:
    from lightning_gem.testing.sm90 import resources

    use = resources(compiled)
    fits = "" if use.shared <= SHARED_LIMIT else " (too much shared memory)"
    loops = "; ".join(f"{loop.instructions} instr, {loop.mma} mma, {loop.spill_stores}/{loop.spill_loads} spills"
                      for loop in use.loops)  # fmt: skip
    return (f"{label:34s} regs {use.registers:3d}  stack {use.stack:5d}  smem {use.shared:6d}{fits}  "
            f"spills {use.spill_stores}/{use.spill_loads}  loops: {loops}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128, help="head dim of q, k and v")
    parser.add_argument("--activation", default="silu", help="softmax or a pointwise activation (causal either way)")
    parser.add_argument("--parts", default="fwd,bwd", help="fwd, bwd or both")
    parser.add_argument("--plans", nargs="*", type=parse_plan, default=None, help="backward plans (default: tuner's)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_resources.py compiles the kernels: unset TRITON_INTERPRET")
    import torch

    from lightning_gem.ops.attention.impl.triton import forward
    from lightning_gem.ops.attention.impl.triton._tuning import (
        backward_candidates,
        candidate_tiles,
        split_candidates,
        tile_meta,
    )
    from lightning_gem.ops.attention.impl.triton.backward import dv_launch_meta, plan_kernel, plan_meta
    from lightning_gem.testing.sm90 import compile_kernel

    cuda, options = torch.device("cuda"), call_options(args.activation, args.dim)
    print(f"sm_90, {args.activation} causal, head dim {args.dim}, bf16")
    if "fwd" in args.parts:
        for tiles in candidate_tiles("fwd", torch.bfloat16, cuda, args.dim):
            # Key and value tiles through pointers, through tensor descriptors, then the products on FP8 codes.
            for variant in ("", "tma", "fp8"):
                meta = {**options, **tile_meta(tiles), "TMA": variant == "tma", "FP8": variant == "fp8", "WS": False}
                meta["FAST"] = options["FAST"] and variant != "tma"  # as the launcher compiles them
                compiled = compile_kernel(forward._gdpa_fwd_kernel, meta)
                print(_row(f"fwd {tiles.label} {variant}".rstrip(), compiled), flush=True)
    if "bwd" not in args.parts:
        return
    plans = args.plans
    if plans is None:  # every plan the tuner times on long sequences, split dK/dV programs included
        plans = backward_candidates(torch.bfloat16, cuda, args.dim, deterministic=False, tma=True)
        plans += split_candidates(torch.bfloat16, cuda, args.dim, tma=True)
        plans = list(dict.fromkeys(plans))
    for plan in plans:  # each plan as it runs on bf16 inputs, then with S and dP on FP8 codes (precision="fp8")
        for fp8 in (False, True) if not plan.short else (False,):
            meta = plan_meta(plan, {**options, "FP8": fp8})
            label = _label(plan) + (" fp8" if fp8 else "")
            try:
                compiled = compile_kernel(plan_kernel(plan), meta)
            except Exception as error:  # e.g. an FP8 product over fewer than 32 rows: the tuner skips such a plan
                cause = error.__cause__ or error  # Triton's CompilationError wraps the assertion that failed
                while cause.__cause__ is not None:
                    cause = cause.__cause__
                print(f"{label:34s} does not compile: {type(cause).__name__}: {str(cause)[:160]}", flush=True)
                continue
            print(_row(label, compiled), flush=True)
            if plan.dv_stages:  # the dV programs' own launch
                dv_meta = dv_launch_meta(plan, meta)
                print(_row(f"  its dV launch{' fp8' if fp8 else ''}", compile_kernel(plan_kernel(plan), dv_meta)))


def _label(plan) -> str:
    if plan.dq is not None:
        return f"one-launch {plan.dkdv.label} dq {plan.dq.label}" + (" split" if plan.split else "")
    label = f"dkdv {plan.dkdv.label}" + (" bulk dQ" if plan.tma else " atomic dQ") + (" split" if plan.split else "")
    return label + (" halves" if plan.halves else "") + (f" dv{plan.dv_stages}" if plan.dv_stages else "")


if __name__ == "__main__":
    main()
