"""GDPA reference vs an independent padded dense oracle: every mode, forward and backward, every dtype.

The oracle (``lightning_gem.testing.gdpa_oracle``) builds the mask pair by pair from the ``gdpa``
docstring and runs densely in float64; the op's gradients come from its explicit backward
(``gdpa_reference_backward`` through the registered autograd), the oracle's from autograd.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.gdpa_oracle import allowed_pairs, gdpa_oracle
from lightning_gem.testing.jagged_inputs import LAYOUTS, GDPAInputs, lengths_to_offsets, make_gdpa_inputs
from lightning_gem.testing.numerics import assert_within_budget

ACTIVATIONS = ("softmax", "silu", "gelu", "relu", "sigmoid")
# float64 vs float64: only the order of summation differs between the bucketed op and the dense oracle.
FP64_TOL = {"rtol": 1e-10, "atol": 1e-12}


def _generator(*params: object) -> torch.Generator:
    """A generator seeded by the test's parameters: each case draws its own, reproducible shapes."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _grads(out: Tensor, inputs: tuple[Tensor, ...], grad_out: Tensor) -> list[Tensor]:
    """``d<out, grad_out>/d inputs``; zeros for inputs the output does not reach (e.g. an all-empty batch)."""
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


def _leaves(inputs: GDPAInputs, dtype: torch.dtype) -> GDPAInputs:
    return inputs.with_qkv(*(t.detach().to(dtype).requires_grad_() for t in (inputs.q, inputs.k, inputs.v)))


def _run_op(inputs: GDPAInputs, **mode: object) -> Tensor:
    return gdpa(inputs.q, inputs.k, inputs.v, inputs.q_offsets, **inputs.kwargs(), impl="reference", **mode)


def _run_oracle(inputs: GDPAInputs, dtype: torch.dtype = torch.float64, **mode: object) -> Tensor:
    return gdpa_oracle(inputs.q, inputs.k, inputs.v, inputs.q_offsets, **inputs.kwargs(), dtype=dtype, **mode)


def _assert_matches_oracle_fp64(inputs: GDPAInputs, generator: torch.Generator, **mode: object) -> None:
    inputs = _leaves(inputs, torch.float64)
    qkv = (inputs.q, inputs.k, inputs.v)
    out = _run_op(inputs, **mode)
    expected = _run_oracle(inputs, **mode)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **FP64_TOL, msg=lambda m: f"forward: {m}")
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    for name, got, want in zip("qkv", _grads(out, qkv, grad_out), _grads(expected, qkv, grad_out), strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL, msg=lambda m, name=name: f"d{name}: {m}")


# ------------------------------------------------------------------------------------- the oracle itself


def test_oracle_masks_by_hand() -> None:
    """The oracle's mask on cases worked out by hand from the docstring, so the oracle is judged too."""
    T, F_ = True, False
    # Self-attention, 5 tokens of which 2 targets (h = 3), causal: targets see the history and themselves.
    assert allowed_pairs(5, 5, 2, causal=True, window=None, block_size=None, self_attention=True) == [
        [T, F_, F_, F_, F_],
        [T, T, F_, F_, F_],
        [T, T, T, F_, F_],
        [T, T, T, T, F_],
        [T, T, T, F_, T],
    ]
    # Bidirectional: history still never sees targets; window 1 around p(target) = 3 keeps t = 2 only.
    assert allowed_pairs(5, 5, 2, causal=False, window=1, block_size=None, self_attention=True) == [
        [T, T, F_, F_, F_],
        [T, T, T, F_, F_],
        [F_, T, T, F_, F_],
        [F_, F_, T, T, F_],
        [F_, F_, T, F_, T],
    ]
    # Blocks of 2 aligned to the segment start.
    assert allowed_pairs(5, 5, 0, causal=False, window=None, block_size=2, self_attention=True) == [
        [T, T, F_, F_, F_],
        [T, T, F_, F_, F_],
        [F_, F_, T, T, F_],
        [F_, F_, T, T, F_],
        [F_, F_, F_, F_, T],
    ]
    # Cross-attention, bottom-right aligned: p(i) = i + Lk - Lq.
    assert allowed_pairs(2, 4, 0, causal=True, window=None, block_size=None, self_attention=False) == [
        [T, T, T, F_],
        [T, T, T, T],
    ]
    # More queries than keys: p(0) = p(1) = negative, so causal leaves them no key at all.
    assert allowed_pairs(3, 1, 0, causal=True, window=None, block_size=None, self_attention=False) == [
        [F_],
        [F_],
        [T],
    ]
    # Negative positions are floored into block -1: never the block of a key.
    assert allowed_pairs(3, 1, 0, causal=False, window=None, block_size=4, self_attention=False) == [
        [F_],
        [F_],
        [T],
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_softmax_matches_torch_sdpa(causal: bool) -> None:
    inputs = make_gdpa_inputs("self", _generator(causal), q_lengths=[7], heads=2, dim=4, dim_v=4)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (inputs.q, inputs.k, inputs.v)), is_causal=causal
    )
    torch.testing.assert_close(_run_oracle(inputs, causal=causal), expected.transpose(0, 1), **FP64_TOL)


# ------------------------------------------------------------------------------ the float64 mode matrix


@pytest.mark.parametrize("block_size", [None, 1, 4, 5])
@pytest.mark.parametrize("window", [None, 0, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gdpa_matches_oracle(
    layout: str, activation: str, causal: bool, window: int | None, block_size: int | None
) -> None:
    generator = _generator(layout, activation, causal, window, block_size)
    inputs = make_gdpa_inputs(layout, generator, num_segments=5, max_len=11)
    mode = {"activation": activation, "causal": causal, "window": window, "block_size": block_size}
    _assert_matches_oracle_fp64(inputs, generator, **mode)


SHAPES = {
    # name: (query lengths, kv lengths for cross / shared_kv)
    "B0": ([], []),
    "all-empty": ([0, 0, 0], [0, 4, 1]),
    "B1-len1": ([1], [3]),
    "B1-long": ([12], [7]),
    "empty-kv": ([3, 2, 1], [0, 0, 0]),
    "q-longer-than-kv": ([7, 0, 5], [2, 3, 1]),
}


@pytest.mark.parametrize("mode", [{}, {"causal": True, "window": 3, "block_size": 4}], ids=["plain", "masked"])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gdpa_edge_shapes(shape: str, layout: str, activation: str, mode: dict) -> None:
    q_lengths, kv_lengths = SHAPES[shape]
    generator = _generator(shape, layout, activation, mode)
    inputs = make_gdpa_inputs(layout, generator, q_lengths=q_lengths, kv_lengths=kv_lengths, offsets_dtype=torch.int32)
    _assert_matches_oracle_fp64(inputs, generator, activation=activation, **mode)


@pytest.mark.parametrize(
    ("layout", "mode"),
    [
        ("self_targets", {"activation": "softmax", "causal": True}),
        ("self", {"activation": "silu", "causal": True, "window": 3, "block_size": 4}),
        ("cross", {"activation": "gelu", "causal": True}),
        ("shared_kv", {"activation": "sigmoid", "block_size": 5}),
        ("self_targets", {"activation": "relu", "window": 0}),
    ],
    ids=lambda x: x if isinstance(x, str) else x["activation"],
)
def test_gdpa_gradcheck(layout: str, mode: dict) -> None:
    inputs = make_gdpa_inputs(
        layout, _generator(layout, mode), q_lengths=[3, 0, 1, 4], kv_lengths=[2, 5, 0, 4], heads=1, dim=3, dim_v=2
    )
    inputs = _leaves(inputs, torch.float64)

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return gdpa(q, k, v, inputs.q_offsets, **inputs.kwargs(), impl="reference", **mode)

    assert torch.autograd.gradcheck(fn, (inputs.q, inputs.k, inputs.v))


# ------------------------------------------------------------------------------------- lower precisions

# Every result is judged against the float64 oracle on the same rounded inputs, within SLACK times the
# error that the oracle makes when run entirely in that dtype, floored at a few ulps of that dtype (see
# lightning_gem.testing.numerics). The op accumulates in float32, so in float16/bfloat16 it uses about a
# tenth of that budget; in float32 it is as precise as the naive run, up to summation order.
SLACK = 2.0


@pytest.mark.parametrize("mode", [{"causal": True, "window": 3}, {"block_size": 5}], ids=["causal-window", "block"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gdpa_low_precision_within_budget(dtype: torch.dtype, layout: str, activation: str, mode: dict) -> None:
    generator = _generator(dtype, layout, activation, mode)
    inputs = make_gdpa_inputs(layout, generator, num_segments=5, max_len=11, dim=8, dim_v=6, dtype=dtype)
    mode = {"activation": activation, **mode}
    low = _leaves(inputs, dtype)
    exact = _leaves(inputs, torch.float64)  # the same rounded values, as float64 leaves
    naive = _leaves(inputs, dtype)

    out = _run_op(low, **mode)
    assert out.dtype == dtype
    oracle = _run_oracle(exact, **mode)
    same_precision = _run_oracle(naive, dtype=dtype, **mode)
    assert_within_budget(out, oracle, same_precision, name="forward", slack=SLACK)

    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(dtype)
    got = _grads(out, (low.q, low.k, low.v), grad_out)
    want = _grads(oracle, (exact.q, exact.k, exact.v), grad_out.to(torch.float64))
    budget = _grads(same_precision, (naive.q, naive.k, naive.v), grad_out)
    for name, g, w, b in zip("qkv", got, want, budget, strict=True):
        assert g.dtype == dtype
        assert_within_budget(g, w, b, name=f"d{name}", slack=SLACK)


# ------------------------------------------------------------------------------------ batch invariance


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["self", "self_targets", "cross"])
def test_gdpa_batch_invariance(layout: str, activation: str) -> None:
    """A segment's output is the same alone and among longer and shorter ones (1/Lk is per segment)."""
    generator = _generator(layout, activation)
    q_lengths, kv_lengths = [12, 0, 5, 1, 9], [3, 7, 6, 0, 11]
    batch = make_gdpa_inputs(layout, generator, q_lengths=q_lengths, kv_lengths=kv_lengths, dtype=torch.float32)
    mode = {"activation": activation, "causal": True}
    out = _run_op(batch, **mode)
    b = 2
    qs, qe = sum(q_lengths[:b]), sum(q_lengths[: b + 1])
    ks, ke = (qs, qe) if batch.kv_offsets is None else (sum(kv_lengths[:b]), sum(kv_lengths[: b + 1]))
    alone = GDPAInputs(
        batch.q[qs:qe],
        batch.k[ks:ke],
        batch.v[ks:ke],
        lengths_to_offsets([qe - qs]),
        None if batch.kv_offsets is None else lengths_to_offsets([ke - ks]),
        None,
        None if batch.num_targets is None else batch.num_targets[b : b + 1],
    )
    torch.testing.assert_close(out[qs:qe], _run_op(alone, **mode), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ memory use


class _LargestTensor(TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch function returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_reference_never_pads_the_whole_batch() -> None:
    """One long segment among many length-1 ones: no tensor may approach ``B * Lmax^2 * H``."""
    lengths = [64] + [1] * 63
    heads, dim = 2, 4
    inputs = make_gdpa_inputs(
        "self",
        torch.Generator().manual_seed(0),
        q_lengths=lengths,
        heads=heads,
        dim=dim,
        dim_v=dim,
        dtype=torch.float32,
    )
    qkv = (inputs.q, inputs.k, inputs.v)
    spec = Spec(inputs.q_offsets, inputs.q_offsets, None, None, "silu", causal=True, window=None, block_size=None,
                scale=0.5)  # fmt: skip
    with _LargestTensor() as counter:
        out = gdpa_reference(*qkv, spec)
        gdpa_reference_backward(torch.ones_like(out), *qkv, spec)
    padded_scores = len(lengths) * max(lengths) ** 2 * heads
    # Buckets pad each segment at most to twice its length in each of the two dims.
    bound = max(4 * heads * sum(n * n for n in lengths), inputs.q.numel())
    assert heads * max(lengths) ** 2 <= counter.largest, "the long segment's own scores were not seen"
    assert counter.largest <= bound < padded_scores // 8, (counter.largest, bound, padded_scores)


# ------------------------------------------------------------------------------------ self-consistency


def test_all_pairs_of_the_matrix_are_exercised() -> None:
    """The random shapes of the matrix hold empty and length-1 segments and queries with no allowed key."""
    seen_empty = seen_one = seen_keyless = False
    for layout, causal in itertools.product(LAYOUTS, [False, True]):
        inputs = make_gdpa_inputs(layout, _generator(layout, causal), num_segments=5, max_len=11)
        seen_empty |= 0 in inputs.q_lengths
        seen_one |= 1 in inputs.q_lengths
        out = _run_oracle(inputs, activation="softmax", causal=causal, block_size=4)
        seen_keyless |= bool((out.abs().sum(dim=(1, 2)) == 0).any())
    assert seen_empty and seen_one and seen_keyless


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_reference_ignores_autocast(activation: str) -> None:
    """Under bf16 autocast (a mixed-precision Trainer on CPU) the reference still computes in float32."""
    inputs = _leaves(make_gdpa_inputs("self_targets", _generator("autocast", activation)), torch.float32)
    expected = _run_op(inputs, activation=activation, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _run_op(inputs, activation=activation, causal=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = torch.autograd.grad(out.sum(), (inputs.q, inputs.k, inputs.v))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (inputs.q, inputs.k, inputs.v)))
