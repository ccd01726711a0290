"""The GDPA kernels compile for Hopper (sm_90) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which executes them as Python and never sees
Triton's code generator: a construct the compiler rejects (or ptxas fails on) would pass there. Here a
subprocess with the interpreter off compiles a few specializations for ``sm_90`` through Triton's
compiler and the ``ptxas`` its wheel ships (no GPU needed).
"""

from __future__ import annotations

import importlib

import pytest

from lightning_gem.testing.sm90 import run_uninterpreted

# Two specializations that between them turn on every mode flag, a head dim below its block (96 of 128), int32 and
# int64 offsets, the forward with key and value tiles through tensor descriptors (and its warp-specialized loop), the
# atomic-dQ dK/dV kernel (dQ through bulk tensor reductions), the one-launch dK/dV + dQ kernel (both with dK and dV in
# one program, and in programs of their own) and the short-query kernel.
_COMPILE = r"""
import json
from lightning_gem.ops.attention.impl.triton import backward, backward_short, forward, quantize
from lightning_gem.ops.attention.impl.triton._tuning import BackwardTiles, Tiles
from lightning_gem.testing.sm90 import compile_kernel

def compile_one(kernel, constexprs, offsets, num_warps, num_stages):
    meta = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
    return len(compile_kernel(kernel, meta, offsets=offsets).asm["cubin"])

modes = [
    (dict(ACTIVATION="softmax", CAUSAL=True, HAS_WINDOW=True, HAS_BLOCK=False, HAS_KV_INDEX=True,
          HAS_TARGETS=False, HEAD_DIM=64, HEAD_DIM_V=64, BLOCK_D=64, BLOCK_DV=64), "*i32", (128, 64, 4, 3), True),
    (dict(ACTIVATION="silu", CAUSAL=True, HAS_WINDOW=False, HAS_BLOCK=True, HAS_KV_INDEX=False,
          HAS_TARGETS=True, HEAD_DIM=96, HEAD_DIM_V=96, BLOCK_D=128, BLOCK_DV=128), "*i64", (64, 64, 8, 2), False),
]
sizes = {}
for flags, offsets, (bm, bn, warps, stages), fused in modes:
    common = dict(flags, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION="tf32", FAST=True)
    name = flags["ACTIVATION"]
    forward_meta = dict(common, TMA=False, FP8=False, WS=False)
    sizes[f"fwd {name}"] = compile_one(forward._gdpa_fwd_kernel, forward_meta, offsets, warps, stages)
    if fused:  # key and value tiles through tensor descriptors (power-of-two head dims), as the launcher compiles them
        sizes[f"fwd tma {name}"] = compile_one(forward._gdpa_fwd_kernel, dict(forward_meta, TMA=True, FAST=False),
                                               offsets, warps, stages)
        # The warp-specialized loop: Triton partitions it (a producer warp group, setmaxnreg) at 4 warps
        ws = compile_kernel(forward._gdpa_fwd_kernel, dict(forward_meta, TMA=True, FAST=False, WS=True, num_warps=4,
                                                           num_stages=stages), offsets=offsets)  # fmt: skip
        assert "async_task_id" in ws.asm["ttgir"] and "setmaxnreg" in ws.asm["ptx"], "not warp-specialized"
        sizes[f"fwd ws {name}"] = len(ws.asm["cubin"])
    short = {k: v for k, v in common.items() if k not in ("HAS_KV_INDEX", "HAS_TARGETS")}
    sizes[f"short {name}"] = compile_one(backward_short._gdpa_bwd_short_kernel, dict(short, BLOCK_M=32), offsets, 4,
                                         stages)
    # The fused-dQ mode adds its tiles through bulk tensor reductions (its head dim is a power of two).
    dkdv = dict(common, FUSED_DQ=fused, DQ_TMA=fused, FP8=False, HALVES=False, LAUNCH=0)
    sizes[f"dkdv {name}"] = compile_one(backward._gdpa_bwd_dkdv_kernel, dict(dkdv, SPLIT=False), offsets, warps,
                                        stages)
    sizes[f"dkdv split {name}"] = compile_one(backward._gdpa_bwd_dkdv_kernel, dict(dkdv, SPLIT=True), offsets, warps,
                                              stages)
    # The dK program in column halves (the second mode's head dim of 96 leaves its upper half partly masked).
    sizes[f"dkdv split halves {name}"] = compile_one(backward._gdpa_bwd_dkdv_kernel,
                                                     dict(dkdv, SPLIT=True, HALVES=True), offsets, warps, stages)
    # The dK programs in a launch of their own (LAUNCH 2), then the dV ones with the launcher's options for them
    # (dv_launch_meta: LAUNCH 1, no dQ) at their own stages.
    dk_launch = dict(dkdv, SPLIT=True, HALVES=True, LAUNCH=2)
    sizes[f"dk launch {name}"] = compile_one(backward._gdpa_bwd_dkdv_kernel, dk_launch, offsets, warps, stages)
    dv_plan = BackwardTiles(Tiles(bm, bn, warps, stages), split=True, halves=True, dv_stages=2)
    dv_launch = backward.dv_launch_meta(dv_plan, dk_launch)
    sizes[f"dv launch {name}"] = compile_one(backward._gdpa_bwd_dkdv_kernel, dv_launch, offsets, warps,
                                             dv_plan.dv_stages)  # fmt: skip
    for split in (False, True):
        one_launch = dict(common, DQ_BLOCK_M=bn, DQ_BLOCK_N=bm, SPLIT=split, FP8=False)
        sizes[f"bwd {name} split {split}"] = compile_one(backward._gdpa_bwd_kernel, one_launch, offsets, warps, stages)
for zero_dq in (False, True):  # with ZERO_DQ it also zeroes the atomic plans' fp32 dQ rows
    delta = dict(HEAD_DIM=96, HEAD_DIM_V=96, BLOCK_D=128, BLOCK_DV=128, BLOCK_T=64, ZERO_DQ=zero_dq)
    sizes[f"delta zero_dq {zero_dq}"] = compile_one(backward._bwd_delta_kernel, delta, "*i64", 4, 1)
# The FP8 path: the forward on E4M3 codes, the backward's S and dP on row codes (the atomic-dQ kernel with dK and dV
# in programs of their own, the one-launch kernel with targets' row-wise terms), and the three kernels of its quantizer.
fp8 = dict(modes[0][0], BLOCK_M=128, BLOCK_N=64, DOT_PRECISION="tf32", FAST=True, TMA=False, FP8=True, WS=False)
sizes["fwd fp8"] = compile_one(forward._gdpa_fwd_kernel, fp8, "*i32", 8, 3)
bwd_fp8 = dict(modes[1][0], BLOCK_M=64, BLOCK_N=64, DOT_PRECISION="tf32", FAST=True, FP8=True)
sizes["dkdv split fp8"] = compile_one(backward._gdpa_bwd_dkdv_kernel, dict(bwd_fp8, FUSED_DQ=True, DQ_TMA=False,
                                      SPLIT=True, HALVES=False, LAUNCH=0), "*i64", 8, 2)  # fmt: skip
sizes["bwd fp8"] = compile_one(backward._gdpa_bwd_kernel, dict(bwd_fp8, DQ_BLOCK_M=64, DQ_BLOCK_N=64, SPLIT=False),
                               "*i64", 8, 2)  # fmt: skip
sizes["quantize rows"] = compile_one(quantize._rows_kernel, dict(HEAD_DIM=96, BLOCK_D=128, BLOCK_T=64, WITH_NORM=True),
                                     "*i64", 4, 1)
for write_codes in (False, True):
    sizes[f"quantize values {write_codes}"] = compile_one(
        quantize._values_kernel, dict(HEAD_DIM_V=96, BLOCK_DV=128, BLOCK_T=64, WRITE_CODES=write_codes), "*i64", 4, 1
    )
print(json.dumps(sizes))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    importlib.import_module("triton.backends.nvidia.compiler")  # the CUDA backend is installed

    sizes = run_uninterpreted(_COMPILE)
    assert len(sizes) == 28
    assert all(size > 0 for size in sizes.values()), sizes


# Every launch the tuner can pick on long bf16 sequences, at the head dims whose tiles are largest, compiled: a
# candidate whose shared memory exceeds a block's fails at launch on every call (the tuner skips it, after paying
# its compilation).
_FITS = r"""
import json, sys
import torch
sys.path.insert(0, "examples/benchmarks")
from kernel_resources import SHARED_LIMIT, call_options
from lightning_gem.ops.attention.impl.triton import forward
from lightning_gem.ops.attention.impl.triton._common import kernel_options, mode_flags
from lightning_gem.ops.attention.impl.triton._tuning import backward_candidates, candidate_tiles, tile_meta
from lightning_gem.ops.attention.impl.triton.backward import dv_launch_meta, plan_kernel, plan_meta
from lightning_gem.testing.sm90 import compile_kernel

cuda, shared = torch.device("cuda"), {}
for dim in (128, 256):
    options = call_options("softmax", dim)
    for tiles in candidate_tiles("fwd", torch.bfloat16, cuda, dim):
        meta = {**options, **tile_meta(tiles), "TMA": False, "FP8": False, "WS": False}
        compiled = compile_kernel(forward._gdpa_fwd_kernel, meta)
        shared[f"fwd {dim} {tuple(tiles)}"] = compiled.metadata.shared
    if dim <= 128:  # the pointwise forward's own first candidate
        silu = call_options("silu", dim)
        tiles = candidate_tiles("fwd", torch.bfloat16, cuda, dim, pointwise=True)[0]
        meta = {**silu, **tile_meta(tiles), "TMA": False, "FP8": False, "WS": False}
        shared[f"fwd silu {dim} {tuple(tiles)}"] = compile_kernel(forward._gdpa_fwd_kernel, meta).metadata.shared
    for plan in backward_candidates(torch.bfloat16, cuda, dim, deterministic=False, tma=True):
        meta = plan_meta(plan, options)
        shared[f"bwd {dim} {plan}"] = compile_kernel(plan_kernel(plan), meta).metadata.shared
        if plan.dv_stages:  # its dV programs' own launch, as the launcher makes it
            dv_meta = dv_launch_meta(plan, meta)
            shared[f"bwd {dim} {plan} dV launch"] = compile_kernel(plan_kernel(plan), dv_meta).metadata.shared
    for size in (64, 128):  # BlockAttention: tiles of whole blocks
        block = kernel_options(dim, dim, mode_flags("softmax", True, None, size, None, None), torch.bfloat16, True)
        for tiles in candidate_tiles("fwd", torch.bfloat16, cuda, dim, block_size=size):
            meta = {**block, **tile_meta(tiles), "TMA": False, "FP8": False, "WS": False}
            compiled = compile_kernel(forward._gdpa_fwd_kernel, meta)
            shared[f"fwd block {size} {dim} {tuple(tiles)}"] = compiled.metadata.shared
        for plan in backward_candidates(torch.bfloat16, cuda, dim, deterministic=False, block_size=size, tma=True):
            compiled = compile_kernel(plan_kernel(plan), plan_meta(plan, block))
            shared[f"bwd block {size} {dim} {plan}"] = compiled.metadata.shared
print(json.dumps({"limit": SHARED_LIMIT, "shared": shared}))
"""


@pytest.mark.slow
def test_tuner_candidates_fit_shared_memory_sm90() -> None:
    pytest.importorskip("triton")
    importlib.import_module("triton.backends.nvidia.compiler")

    report = run_uninterpreted(_FITS)
    assert len(report["shared"]) >= 20  # forward and backward candidates at both head dims
    too_big = {name: size for name, size in report["shared"].items() if size > report["limit"]}
    assert not too_big, too_big
