"""``gdpa(..., impl="padded")``, the padded baseline, against the float64 oracle: every layout and rule, edge shapes."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import Tensor

from lightning_gem.ops import gdpa
from lightning_gem.testing.gdpa_oracle import gdpa_oracle
from lightning_gem.testing.jagged_inputs import LAYOUTS, GDPAInputs, make_gdpa_inputs

FP64_TOL = {"rtol": 1e-10, "atol": 1e-12}


def _generator(*params: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _grads(out: Tensor, inputs: tuple[Tensor, ...], grad_out: Tensor) -> list[Tensor]:
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


def _assert_padded_matches_oracle(inputs: GDPAInputs, generator: torch.Generator, **mode: object) -> None:
    inputs = inputs.with_qkv(*(t.detach().double().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)))
    qkv = (inputs.q, inputs.k, inputs.v)
    out = gdpa(*qkv, inputs.q_offsets, **inputs.kwargs(), impl="padded", **mode)
    expected = gdpa_oracle(*qkv, inputs.q_offsets, **inputs.kwargs(), dtype=torch.float64, **mode)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, **FP64_TOL, msg=lambda m: f"forward: {m}")
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    for name, got, want in zip("qkv", _grads(out, qkv, grad_out), _grads(expected, qkv, grad_out), strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize(
    "mode",
    [
        {"causal": True},
        {"causal": False},
        {"causal": True, "window": 3},
        {"causal": False, "block_size": 4},
        {"causal": True, "window": 2, "block_size": 5},
    ],
    ids=["causal", "full", "window", "block", "window-block"],
)
@pytest.mark.parametrize("activation", ["softmax", "silu", "gelu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_matches_oracle(layout: str, activation: str, mode: dict) -> None:
    generator = _generator(layout, activation, mode)
    inputs = make_gdpa_inputs(layout, generator, num_segments=5, max_len=11)
    _assert_padded_matches_oracle(inputs, generator, activation=activation, **mode)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize(
    ("q_lengths", "kv_lengths"),
    [([], []), ([0, 0, 0], [0, 4, 1]), ([1], [3]), ([3, 2, 1], [0, 0, 0]), ([7, 0, 5], [2, 3, 1])],
    ids=["B0", "all-empty", "len1", "empty-kv", "q-longer"],
)
@pytest.mark.parametrize("layout", ["self", "cross", "shared_kv"])
def test_padded_edge_shapes(layout: str, q_lengths: list[int], kv_lengths: list[int], activation: str) -> None:
    generator = _generator(layout, q_lengths, activation)
    inputs = make_gdpa_inputs(layout, generator, q_lengths=q_lengths, kv_lengths=kv_lengths, offsets_dtype=torch.int32)
    _assert_padded_matches_oracle(inputs, generator, activation=activation, causal=True)


def test_padded_uses_the_length_hints_and_keeps_the_input_dtype() -> None:
    generator = _generator("hints")
    inputs = make_gdpa_inputs("self", generator, q_lengths=[4, 0, 6], dtype=torch.float32)
    args = (inputs.q, inputs.k, inputs.v, inputs.q_offsets)
    hinted = gdpa(*args, activation="silu", causal=True, impl="padded", max_seq_len_q=8, max_seq_len_kv=8)
    plain = gdpa(*args, activation="silu", causal=True, impl="reference")
    assert hinted.dtype == torch.float32
    torch.testing.assert_close(hinted, plain, rtol=1e-5, atol=1e-6)
