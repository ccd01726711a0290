"""GDPA as a torch custom op: opcheck, torch.compile(fullgraph=True), FLOP counting; and the GPU checks."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from lightning_gem.ops import gdpa
from lightning_gem.testing.gdpa_oracle import count_allowed_pairs, gdpa_oracle
from lightning_gem.testing.jagged_inputs import LAYOUTS, GDPAInputs, make_gdpa_inputs
from lightning_gem.testing.numerics import assert_within_budget

importlib.import_module("lightning_gem.ops.attention.ops")  # registers torch.ops.lightning_gem.* (gdpa: lazily)

HEADS, DIM, DIM_V = 2, 4, 3


def _inputs(layout: str, seed: int, dtype: torch.dtype = torch.float32, **kwargs: object) -> GDPAInputs:
    x = make_gdpa_inputs(
        layout, torch.Generator().manual_seed(seed), heads=HEADS, dim=DIM, dim_v=DIM_V, dtype=dtype, **kwargs
    )
    return x.with_qkv(*(t.requires_grad_() for t in (x.q, x.k, x.v)))


def _op_args(x: GDPAInputs, activation: str, causal: bool, window: int | None, block_size: int | None) -> tuple:
    """Positional arguments of ``lightning_gem::gdpa_reference`` (kv_offsets filled in, as ``gdpa`` does)."""
    kv_offsets = x.q_offsets if x.kv_offsets is None else x.kv_offsets
    return (
        x.q,
        x.k,
        x.v,
        x.q_offsets,
        kv_offsets,
        x.kv_index,
        x.num_targets,
        activation,
        causal,
        window,
        block_size,
        DIM**-0.5,
    )


# ---------------------------------------------------------------------------------------------- opcheck

OPCHECK_CASES = {
    # name: (layout, activation, causal, window, block_size, explicit lengths)
    "no-optional-tensors": ("self", "softmax", True, None, None, {}),
    "kv-index": ("shared_kv", "silu", False, 3, None, {}),
    "num-targets": ("self_targets", "gelu", True, None, 4, {}),
    "kv-index-and-targets": ("shared_kv", "relu", True, 2, None, {"q_lengths": [3, 4, 3], "kv_lengths": [3, 4]}),
    "cross-empty-kv": ("cross", "sigmoid", True, None, 5, {"q_lengths": [2, 5, 0], "kv_lengths": [0, 3, 4]}),
}


@pytest.mark.parametrize(
    ("op", "before"),
    [
        ("gdpa_reference", ["q", "k", "v"]),
        ("gdpa_reference_backward", ["grad_out", "q", "k", "v"]),
        ("gdpa_triton", ["q", "k", "v"]),
        ("gdpa_triton_backward", ["grad_out", "q", "k", "v", "out", "lse"]),
        ("gdpa_flash", ["q", "k", "v"]),
        ("gdpa_flash_backward", ["grad_out", "q", "k", "v", "out", "lse"]),
    ],
)
def test_op_arguments_are_the_spec_fields(op: str, before: list[str]) -> None:
    """Every GDPA op takes its data, then :class:`Spec`'s fields in order (all of them but the reference's, which
    stops at ``scale``; the Triton ops add ``flash``): ``op(q, k, v, *spec)`` and ``Spec(*args)`` rely on it."""
    pytest.importorskip("triton")
    from lightning_gem.ops.attention.spec import Spec

    for module in ("lightning_gem.ops.attention.impl.triton.ops", "lightning_gem.ops.attention.impl.flash"):
        importlib.import_module(module)  # registers their ops
    names = [arg.name for arg in getattr(torch.ops.lightning_gem, op).default._schema.arguments]
    fields = list(Spec._fields[: Spec._fields.index("scale") + 1] if op.startswith("gdpa_reference") else Spec._fields)
    assert names == before + fields + (["flash"] if op.startswith("gdpa_triton") else [])


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_gdpa_reference(case: str) -> None:
    layout, activation, causal, window, block_size, lengths = OPCHECK_CASES[case]
    x = _inputs(layout, 0, dtype=torch.float64, **lengths)
    if case == "kv-index-and-targets":  # targets need every query segment as long as its kv segment
        x.kv_index = torch.tensor([0, 1, 0])
        x.num_targets = torch.tensor([1, 0, 3])
    args = _op_args(x, activation, causal, window, block_size)
    torch.library.opcheck(torch.ops.lightning_gem.gdpa_reference.default, args)
    grad_out = torch.randn(x.q.shape[0], HEADS, DIM_V, dtype=torch.float64)
    detached = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.lightning_gem.gdpa_reference_backward.default, (grad_out, *detached))


# --------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("layout", ["self_targets", "shared_kv"])
def test_gdpa_compiles_with_fullgraph(layout: str) -> None:
    x = _inputs(layout, 1)
    mode = {"activation": "silu", "causal": True, "window": 3}

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return gdpa(q, k, v, x.q_offsets, **x.kwargs(), **mode)

    torch.compiler.reset()
    try:
        compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
        out = compiled(x.q, x.k, x.v)
        expected = run(x.q, x.k, x.v)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        grad_out = torch.randn_like(out)
        got = torch.autograd.grad(out, (x.q, x.k, x.v), grad_out)
        want = torch.autograd.grad(expected, (x.q, x.k, x.v), grad_out)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    finally:
        torch.compiler.reset()


# ----------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"causal": True},
        {"causal": True, "window": 2},
        {"block_size": 4},
        {"causal": True, "window": 3, "block_size": 5},
    ],
    ids=["dense", "causal", "causal-window", "block", "all"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flop_counter_counts_allowed_pairs(layout: str, mode: dict) -> None:
    x = _inputs(layout, 2, num_segments=6)
    pairs = count_allowed_pairs(x.q_offsets, x.kv_offsets, kv_index=x.kv_index, num_targets=x.num_targets, **mode)
    assert pairs > 0
    with FlopCounterMode(display=False) as forward:
        out = gdpa(x.q, x.k, x.v, x.q_offsets, **x.kwargs(), activation="silu", **mode)
    assert forward.get_total_flops() == 2 * pairs * HEADS * (DIM + DIM_V)
    with FlopCounterMode(display=False) as backward:
        out.backward(torch.randn_like(out))
    assert backward.get_total_flops() == 2 * pairs * HEADS * (3 * DIM + 2 * DIM_V)


def test_flop_counter_empty_batch() -> None:
    x = _inputs("cross", 3, q_lengths=[0, 4, 0], kv_lengths=[5, 0, 2])  # no query meets a key
    with FlopCounterMode(display=False) as counter:
        gdpa(x.q, x.k, x.v, x.q_offsets, **x.kwargs()).sum().backward()
    assert counter.get_total_flops() == 0


# ------------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gdpa_on_cuda_within_budget(cuda: torch.device, dtype: torch.dtype, activation: str, impl: str) -> None:
    """Whatever runs on the GPU (the reference today, Triton under ``auto`` later) is judged by the oracle."""
    host = make_gdpa_inputs(
        "self_targets",
        torch.Generator().manual_seed(4),
        num_segments=7,
        max_len=11,
        heads=HEADS,
        dim=8,
        dim_v=8,
        dtype=dtype,
    )
    device_kwargs = {n: None if t is None else t.to(cuda) for n, t in host.kwargs().items()}
    q, k, v = (t.to(cuda).requires_grad_() for t in (host.q, host.k, host.v))
    mode = {"activation": activation, "causal": True, "window": 5}
    out = gdpa(q, k, v, host.q_offsets.to(cuda), **device_kwargs, impl=impl, **mode)
    assert out.device.type == "cuda" and out.dtype == dtype
    exact = [t.detach().double().requires_grad_() for t in (host.q, host.k, host.v)]
    oracle = gdpa_oracle(*exact, host.q_offsets, **host.kwargs(), **mode)
    naive = [t.detach().clone().requires_grad_() for t in (host.q, host.k, host.v)]
    same_precision = gdpa_oracle(*naive, host.q_offsets, **host.kwargs(), dtype=dtype, **mode)
    assert_within_budget(out.cpu(), oracle, same_precision, name="forward")
    grad_out = torch.randn(out.shape, dtype=dtype)
    got = torch.autograd.grad(out, (q, k, v), grad_out.to(cuda))
    want = torch.autograd.grad(oracle, exact, grad_out.double())
    budget = torch.autograd.grad(same_precision, naive, grad_out)
    for name, g, w, b in zip("qkv", got, want, budget, strict=True):
        assert_within_budget(g.cpu(), w, b, name=f"d{name}")
