"""``torch.compile``'s analysis of the kit's Triton kernels sees only their outputs written.

Inductor runs a kernel launched through ``wrap_triton`` on functional inputs: every argument its analysis of the
kernel's Triton IR finds written is cloned first (unless the buffer can be reused in place). An input it wrongly sees
as written costs a copy each call, and on torch 2.11 the clone of a jagged call's ``[B]`` segment order failed to
compile under dynamic shapes. The analysis follows a store's address back through the IR: through a loaded value no
further, but through a called ``@triton.jit`` function's result to all of the function's arguments. So an input
pointer passed to a helper whose result addresses a store counts as written.

Here a subprocess with the interpreter off captures the launches of GDPA (each backward plan the tuner can pick at
head dims 64 and 256, the short-query kernel, FP8 attention's quantizer, and the modes' flags), of the candidate
interaction's token ops and of an HSTU layer's pointwise kernels, with no kernel run, and asks torch's own analysis
which arguments each kernel writes (their IR built for sm_90; no GPU needed).
"""

from __future__ import annotations

import importlib

import pytest

from lightning_gem.testing.sm90 import run_uninterpreted

_ANALYZE = r"""
import json
import torch
import triton
from triton.backends.compiler import GPUTarget


class _Hopper:  # the target torch.compile's analysis builds a kernel's IR for, with no GPU here
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        raise AttributeError(name)


triton.runtime.driver.set_active(_Hopper())

import lightning_gem.ops._launch as launching
from lightning_gem.ops.attention.impl.triton import _common, _tuning, backward, forward, ops, quantize
from lightning_gem.ops.pointwise.impl.triton import kernels as pointwise, token_kernels

launches = []
for module in (forward, backward, quantize, pointwise, token_kernels):  # record the launches instead of running them
    module.launch = lambda kernel, grid, args, meta: launches.append((kernel, args, meta))
for module in (launching, _common, ops, forward):  # CPU tensors pass the launchers' device checks
    module.is_interpreted = lambda kernel: True
cuda = torch.device("cuda")  # a GPU's candidate tiles and plans
first = lambda kernel, dtype, device, *a, **k: _tuning.candidate_tiles(kernel, dtype, cuda, *a, **k)[:1]
forward.candidate_tiles = first
from lightning_gem.ops.attention.spec import Spec

bf16 = torch.bfloat16
offsets = torch.tensor([0, 40, 41, 41, 100])
for head_dim in (64, 256):
    q, k, v, grad = (torch.randn(100, 2, head_dim, dtype=bf16) for _ in range(4))
    modes = [
        dict(activation="silu", causal=True, num_targets=torch.tensor([3, 0, 0, 5])),
        dict(activation="softmax", causal=True, window=16),
        dict(activation="softmax", causal=False, block_size=64),
        dict(activation="silu", causal=True, kv_index=torch.tensor([0, 0, 3, 3])),
        dict(activation="softmax", causal=True, deterministic=True),
        dict(activation="silu", causal=True, precision="fp8"),
    ]
    for mode in modes:
        deterministic, precision = mode.pop("deterministic", False), mode.pop("precision", None)
        spec = Spec(offsets, offsets, mode.pop("kv_index", None), mode.pop("num_targets", None), mode.pop("activation"),
                    mode.pop("causal"), mode.pop("window", None), mode.pop("block_size", None), head_dim ** -0.5,
                    max_seq_len_q=59, max_seq_len_kv=59, deterministic=deterministic, precision=precision)
        out, lse = forward.gdpa_forward(q, k, v, spec)
        # Every plan the tuner may time on long segments, and the short-query kernel where the segments fit it.
        plans = _tuning.backward_candidates(bf16, cuda, head_dim, deterministic=deterministic,
                                            block_size=spec.block_size, max_len_q=4096, tma=False)
        if spec.kv_index is None and spec.num_targets is None and precision is None:  # what the short kernel takes
            plans += [p for p in _tuning.backward_candidates(bf16, cuda, head_dim, deterministic=deterministic,
                                                             block_size=spec.block_size, max_len_q=59,
                                                             short_query=True, tma=False) if p.short]
        for plan in plans:
            if plan.short:
                backward.gdpa_backward(grad, q, k, v, out, lse, spec, short_tiles=plan.dkdv)
                continue
            backward.gdpa_backward(grad, q, k, v, out, lse, spec, dkdv_tiles=plan.dkdv, dq_tiles=plan.dq,
                                   split_dkdv=plan.split, column_halves=plan.halves, dv_stages=plan.dv_stages)

from lightning_gem.ops.pointwise.tokens import pairwise_dots, token_attention

tokens = torch.randn(8, 6, 3 * 64, dtype=bf16, requires_grad=True)  # the candidate interaction's token ops
token_attention(tokens, 2, impl="triton").float().sum().backward()
pairwise_dots(torch.randn(8, 6, 64, dtype=bf16, requires_grad=True), impl="triton").float().sum().backward()

from lightning_gem.components.encoder import HSTULayer

layer = HSTULayer(128, 2, attention_dim=64, linear_dim=64, attention_impl="triton", pointwise_impl="triton")
x = torch.randn(100, 128, requires_grad=True)
with torch.autocast("cpu", bf16):
    y = layer(x, offsets, max_seq_len=59, check_offsets=False)
y.float().sum().backward()

from torch._higher_order_ops import triton_kernel_wrap as wrap

written = {}  # per kernel and flags, what any of its launches writes
for kernel, args, meta in launches:
    kwargs = dict(zip(kernel.arg_names, args))
    kwargs.update({name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")})
    if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.12+
        accesses = wrap.identify_accessed_tensors(kernel, kwargs, {})
        names = sorted(dep.name for dep in accesses.read_writes.writes)
    else:
        names = sorted(wrap.identify_mutated_tensors(kernel, kwargs, {}))
    label = kernel.fn.__name__ + " " + ",".join(f"{k}={v}" for k, v in sorted(meta.items()) if k.isupper()
                                                and isinstance(v, bool) and v)
    written[label] = sorted({*written.get(label, ()), *names})
print(json.dumps(written))
"""

# What a kernel may write: its outputs and its own scratch (gradients but the incoming ``DO``, partial sums, the
# normalizer's statistics, the backward's ``DELTA``, FP8 attention's codes, scales and maxima).
_OUTPUT_PREFIXES = ("OUT", "Y", "RSTD", "MEAN", "LSE", "DELTA", "DK", "DV", "DQ", "DX", "DGATE", "DW", "DB", "CODES",
                    "SCALE", "NORM", "AMAX", "V_T", "V_SCALE")  # fmt: skip


@pytest.mark.slow
def test_compile_sees_only_outputs_written() -> None:
    pytest.importorskip("triton")
    importlib.import_module("triton.backends.nvidia.compiler")

    written = run_uninterpreted(_ANALYZE)
    kernels = {label.split()[0] for label in written}
    assert {"_gdpa_fwd_kernel", "_gdpa_bwd_kernel", "_gdpa_bwd_dkdv_kernel", "_gdpa_bwd_short_kernel", "_rows_kernel",
            "_values_kernel", "_silu_split_fwd_kernel", "_silu_split_bwd_kernel", "_norm_mul_fwd_kernel",
            "_norm_mul_bwd_kernel", "_token_attention_fwd_kernel", "_token_attention_bwd_kernel",
            "_pairwise_dots_fwd_kernel", "_pairwise_dots_bwd_kernel"} <= kernels, kernels  # fmt: skip
    assert any("FP8=True" in label for label in written), written  # the FP8 forward and backward
    inputs = {
        label: [name for name in names if not name.startswith(_OUTPUT_PREFIXES)] for label, names in written.items()
    }
    assert not any(inputs.values()), {label: names for label, names in inputs.items() if names}
    assert all(written.values()), written  # each writes something: the analysis ran
