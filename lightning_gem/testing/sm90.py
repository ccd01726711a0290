"""GDPA's Triton kernels compiled for Hopper (sm_90) without a GPU, and what the compiled code uses.

Triton's compiler and the ``ptxas`` / ``cuobjdump`` its CUDA backend ships need no GPU, so a CPU machine can check
that a specialization compiles (the interpreter never runs the code generator) and read its resources: registers a
thread, spill stores and loads (``STL`` / ``LDL``) in each loop of the SASS, tensor-core instructions (``HGMMA``,
Hopper's warp-group MMA; ``HMMA`` the older per-warp one), and shared memory. A spill in a kernel's prologue costs
little; one in the loop over key or query tiles costs every iteration. Run with ``TRITON_INTERPRET`` unset or 0.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["LoopUse", "Resources", "compile_kernel", "resources", "run_uninterpreted"]

# Pointer arguments in fp32 (the rest of the upper-case arguments are bf16 tensors), and the offset-like ones.
_FP32 = ("LSE", "DELTA", "DQ", "Q_SCALE", "K_SCALE", "V_SCALE", "DO_SCALE", "K_NORM", "SCALE", "NORM", "AMAX")
_FP8 = ("CODES", "V_T", "Q8", "K8", "V8", "DO8")  # the FP8 quantizer's outputs, the FP8 backward's row codes
_OFFSETS = ("Q_OFFSETS", "KV_OFFSETS", "KV_INDEX", "NUM_TARGETS", "SEG_OFFSETS", "SEG_ORDER", "BY_LENGTH")


def run_uninterpreted(script: str, *, timeout: float = 900) -> object:
    """Run the Python source ``script`` in a fresh interpreter with Triton's interpreter off (``TRITON_INTERPRET=0``:
    the kernels go through Triton's compiler), from the repository's root and with it on the path; return the JSON
    value its last line of output prints.

    Raises:
        RuntimeError: the script failed (the message ends with its standard error's tail).
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"the script exited with {result.returncode}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compile_kernel(kernel, meta: dict, offsets: str = "*i32"):
    """``kernel`` (a ``@triton.jit`` function of the GDPA kernels) compiled for sm_90 with the launch options
    ``meta`` (its constexprs and ``num_warps`` / ``num_stages``, as the launchers pass them): upper-case arguments
    are bf16 tensors but ``LSE``, ``DELTA`` and ``DQ`` (fp32) and the offsets (``offsets``, ``"*i32"`` or
    ``"*i64"``); ``DQ_DESC`` a tensor descriptor of ``[BLOCK_M, HEAD_DIM]`` fp32 tiles when ``DQ_TMA``, ``K_DESC`` /
    ``V_DESC`` ones of ``[BLOCK_N, HEAD_DIM(_V)]`` bf16 tiles when ``TMA``, ``Q_DESC`` one of ``[BLOCK_M, HEAD_DIM]``
    when ``WS``; ``Q``, ``K``, ``V`` E4M3 and their scales fp32 when ``FP8``, the FP8 quantizer's ``CODES`` /
    ``V_T`` E4M3 and its scales and maxima fp32; lower-case ones ``i32`` but ``scale`` (fp32); pointers and strides
    divisible by 16. Returns Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs and not p.has_default]
    if missing:  # else each would be typed as a tensor argument below, and a branch on it would not be static
        raise ValueError(f"{kernel.fn.__name__} needs the constexprs {missing} in `meta`")
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _FP32:
            signature[name] = "*fp32"
        elif name == "DQ_DESC":
            tile = (constexprs["BLOCK_M"], constexprs["HEAD_DIM"] // (2 if constexprs.get("HALVES") else 1))
            signature[name] = f"tensordesc<fp32[{tile[0]},{tile[1]}]>" if constexprs["DQ_TMA"] else offsets
        elif name in ("K_DESC", "V_DESC"):
            tile = (constexprs["BLOCK_N"], constexprs["HEAD_DIM" if name == "K_DESC" else "HEAD_DIM_V"])
            signature[name] = f"tensordesc<bf16[{tile[0]},{tile[1]}]>" if constexprs["TMA"] else "*bf16"
        elif name == "Q_DESC":
            tile = (constexprs["BLOCK_M"], constexprs["HEAD_DIM"])
            signature[name] = f"tensordesc<bf16[{tile[0]},{tile[1]}]>" if constexprs.get("WS") else "*bf16"
        elif name in _OFFSETS:
            signature[name] = offsets
        elif name in _FP8 or (name in ("Q", "K", "V") and constexprs.get("FP8")):
            signature[name] = "*fp8e4nv"
        elif name.isupper():
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    # As a launch on real tensors specializes them: 16-byte aligned pointers, strides that are multiples of 16
    # (rows of whole heads of a power-of-two head dim), which is what lets the compiler pipeline the loads.
    aligned = [name for name, kind in signature.items() if kind.startswith("*") or name.startswith("stride_")]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@dataclass(frozen=True)
class LoopUse:
    """One loop of the SASS (a backward branch's span): its instructions, tensor-core instructions and spills."""

    instructions: int
    mma: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel uses: registers a thread, stack bytes a thread (spills), shared memory bytes,
    spill stores and loads in the whole kernel, and its loops in code order."""

    registers: int
    stack: int
    shared: int
    spill_stores: int
    spill_loads: int
    loops: tuple[LoopUse, ...]


def _cuobjdump(*args: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def resources(compiled) -> Resources:
    """Resources of a kernel from :func:`compile_kernel`, read from its cubin with the backend's ``cuobjdump``."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(compiled.asm["cubin"])
        usage = _cuobjdump("-res-usage", path)
        sass = _cuobjdump("-sass", path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = set()  # a branch back to a lower address closes a loop
    for address, text in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            spans.add((int(branch.group(1), 16), address))
    loops = []
    for low, high in sorted(spans):
        body = [text for address, text in code if low <= address <= high]
        loops.append(LoopUse(len(body), sum("MMA" in t for t in body), sum("STL" in t for t in body),
                             sum("LDL" in t for t in body)))  # fmt: skip
    texts = [text for _, text in code]
    return Resources(registers, stack, compiled.metadata.shared, sum("STL" in t for t in texts),
                     sum("LDL" in t for t in texts), tuple(loops))  # fmt: skip
