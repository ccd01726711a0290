"""GDPA's FP8 path: the quantization recipe, its reference emulation, the Triton forward on the codes, and the API.

The emulation (:func:`gdpa_fp8_reference`) is judged against the float64 reference of the unquantized function
within a budget derived from E4M3's rounding: each of the four factors of a term (q, k, v and P) is rounded to 3
mantissa bits, a relative error uniform within 2^-4 (rms 2^-4 / sqrt(3)), so independent errors of four factors give
a relative rms error of about 2 * 2^-4 / sqrt(3) = 0.072; the tests allow twice that in the relative Frobenius norm.
The kernel is judged by FlashAttention's rule against that emulation: its error from the float64 reference at most
twice the emulation's (it rounds P against the running maximum instead of the final one), plus a few ulp.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.fp8 import (
    E4M3_MAX,
    P_SCALE,
    gdpa_fp8_reference,
    gdpa_fp8_reference_backward,
    pointwise_bound,
    pow2_scale,
    quantize_fp8,
    value_codes,
    value_columns,
)
from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.jagged_inputs import make_gdpa_inputs

FP8_BUDGET = 2 * 2 * 2.0**-4 / math.sqrt(3)  # twice the rms relative error of four E4M3-rounded factors
# Gradients: dS carries the rounding of S's two factors and dP's two (as the forward's four: 0.072), and as much
# again from the FP8 forward's output in softmax's rowsum(dO * O), or from the slope act'(S) at a rounded S: about
# sqrt(2) x 0.072 = 0.1 rms; twice that. Measured on CPU (4 seeds x 4 layouts x these activations): at most 0.167.
FP8_GRAD_BUDGET = 2 * math.sqrt(2) * 2 * 2.0**-4 / math.sqrt(3)
LAYOUTS = ("self", "self_targets", "cross", "shared_kv")
ACTIVATIONS = ("softmax", "silu", "gelu", "sigmoid", "relu")


def _inputs(layout: str, seed: int, dtype: torch.dtype, dim: int = 16, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    kwargs = {"q_lengths": [37, 0, 1, 16, 70], "max_len": 80, "heads": 2, "dim": dim, "dim_v": dim, **kwargs}
    inputs = make_gdpa_inputs(layout, generator, dtype=dtype, **kwargs)
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    return inputs, (inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def test_pow2_scale() -> None:
    amax = torch.tensor([0.0, 448.0, 449.0, 1.0, 224.0001, 3e38, 1e-30, float("inf"), float("nan")])
    scale = pow2_scale(amax)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two: scaling by them is exact
    finite = torch.isfinite(amax) & (amax > 0)
    ratio = amax[finite] / scale[finite]
    assert torch.all(ratio <= E4M3_MAX) and torch.all(ratio > E4M3_MAX / 2)  # the smallest such power
    assert torch.all(scale[~finite] == 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rounds_to_nearest_codes(dtype: torch.dtype) -> None:
    inputs, jagged = _inputs("shared_kv", 1, dtype, dim=32)
    q = inputs.q.clone()
    q[3] = 0.0  # a zero row: scale 1, codes 0
    q[5, 0, 0] = 1e30 if dtype == torch.float32 else 3e38  # one huge value: its row's scale follows it, no overflow
    codes = quantize_fp8(q, inputs.k, inputs.v, jagged[1])
    for x, x8, scale in ((q, codes.q, codes.q_scale.t()), (inputs.k, codes.k, codes.k_scale.t())):
        deq = x8.float() * scale[:, :, None]
        assert torch.isfinite(deq).all()
        # Round to nearest: within half a step of 2^-3 relative (normals), or of the subnormal step 2^-9 * scale.
        tolerance = torch.maximum(x.float().abs() * 2.0**-4, scale[:, :, None] * 2.0**-10)
        assert torch.all((deq - x.float()).abs() <= tolerance)
    assert torch.all(codes.q[3].float() == 0) and torch.all(codes.q_scale[:, 3] == 1)
    # v: one scale per (kv segment, head, channel), codes transposed with keys contiguous, segments 16-aligned.
    num_kv, num_segments = inputs.k.shape[0], jagged[1].numel() - 1
    assert codes.v_t.shape == (2, 32, value_columns(num_kv, num_segments))
    lengths = jagged[1][1:] - jagged[1][:-1]
    assert torch.all(codes.v_offsets % 16 == 0) and torch.all(codes.v_offsets[1:] - codes.v_offsets[:-1] >= lengths)
    seg = torch.searchsorted(jagged[1][1:], torch.arange(num_kv), right=True)
    deq_v = value_codes(codes, jagged[1]) * codes.v_scale[seg]
    tolerance = torch.maximum(inputs.v.float().abs() * 2.0**-4, codes.v_scale[seg] * 2.0**-10)
    assert torch.all((deq_v - inputs.v.float()).abs() <= tolerance)
    # k_norm: the largest dequantized key norm of each kv segment and head.
    norms = torch.linalg.vector_norm(codes.k.float(), dim=2) * codes.k_scale.t()
    for s in range(jagged[1].numel() - 1):
        rows = norms[int(jagged[1][s]) : int(jagged[1][s + 1])]
        expected = rows.amax(0) if rows.numel() else torch.zeros(2)
        torch.testing.assert_close(codes.k_norm[s], expected, rtol=0, atol=0)


def test_pointwise_codes_cannot_overflow() -> None:
    """The worst case of the bound: a query and a key along one direction, so ``|s|`` is exactly ``scale |q| |k|``."""
    direction = torch.randn(64)
    q = (direction * 7.3)[None, None, :]
    k = torch.stack([direction * 11.0, -direction * 5.0])[:, None, :]
    codes = quantize_fp8(q, k, torch.randn(2, 1, 64), torch.tensor([0, 2]))
    q_deq, k_deq = codes.q.float() * codes.q_scale.t()[:, :, None], codes.k.float() * codes.k_scale.t()[:, :, None]
    scale = 0.125
    s = (q_deq[:, 0] @ k_deq[:, 0].T) * scale
    q_norm = torch.linalg.vector_norm(codes.q.float(), dim=2) * codes.q_scale.t()
    bound = pointwise_bound(q_norm, codes.k_norm[0], scale)
    for act in (torch.nn.functional.silu, torch.nn.functional.gelu, torch.relu, torch.sigmoid):
        assert float((act(s) * (P_SCALE / bound)).abs().max()) <= P_SCALE


@pytest.mark.parametrize("activation", ["softmax", "silu", "gelu", "sigmoid"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_gradients_within_fp8_budget(layout: str, activation: str) -> None:
    """The FP8 backward (``S`` and ``dP`` on row codes, the rest unquantized) against the float64 gradients of the
    exact function, within :data:`FP8_GRAD_BUDGET`; FP8 is coarser than bf16 here too. ReLU is left out: its
    derivative jumps at 0, so a score whose FP8 value has the other sign (one near 0) moves its gradient by the whole
    entry, however fine the rest (the kernel still matches the emulation there, tested below)."""
    inputs, jagged = _inputs(layout, 2, torch.bfloat16, dim=64)
    spec = Spec(*jagged, activation, True, None, None, 0.125)
    out = gdpa_fp8_reference(inputs.q, inputs.k, inputs.v, spec)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    grads = gdpa_fp8_reference_backward(grad_out, inputs.q, inputs.k, inputs.v, out, spec)
    exact = gdpa_reference_backward(grad_out.double(), *(t.double() for t in (inputs.q, inputs.k, inputs.v)), spec)
    same = gdpa_reference_backward(grad_out, inputs.q, inputs.k, inputs.v, spec, compute_dtype=torch.bfloat16)
    for name, got, want, bf16 in zip(("dq", "dk", "dv"), grads, exact, same, strict=True):
        assert torch.isfinite(got).all(), name
        assert _rel(bf16, want) < _rel(got, want) <= FP8_GRAD_BUDGET, name


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulation_within_fp8_budget(layout: str, activation: str) -> None:
    inputs, jagged = _inputs(layout, 2, torch.bfloat16, dim=64)
    spec = Spec(*jagged, activation, True, None, None, 0.125)
    ref = gdpa_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), spec)
    out = gdpa_fp8_reference(inputs.q, inputs.k, inputs.v, spec)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, ref) <= FP8_BUDGET
    # FP8 is coarser than bf16: the emulation is not secretly computing in bf16.
    same = gdpa_reference(inputs.q, inputs.k, inputs.v, spec, compute_dtype=torch.bfloat16)
    assert _rel(out, ref) > _rel(same, ref)


def _triton_forward():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_gem.ops.attention.impl.triton import forward

    if not isinstance(forward._gdpa_fwd_kernel, InterpretedFunction) and not torch.cuda.is_available():
        pytest.skip("GDPA Triton kernels need a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")
    return forward


MASKS = [(True, None, None), (False, None, None), (True, 5, None), (False, None, 8)]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"causal{int(m[0])}-w{m[1]}-bs{m[2]}")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_forward_on_codes(layout: str, activation: str, mask: tuple) -> None:
    """The kernel's FP8 forward against the float64 reference, by FlashAttention's rule with the emulation as the
    same-precision computation; pointwise rows round the same codes as the emulation."""
    forward = _triton_forward()
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles

    device = "cpu" if not torch.cuda.is_available() else "cuda"
    inputs, jagged = _inputs(layout, 3, torch.float32, dim=16 if device == "cpu" else 64)  # FP8 MMAs sum 32 or more
    lens = {"max_seq_len_q": max(inputs.q_lengths), "max_seq_len_kv": max(inputs.kv_lengths)}
    spec = Spec(*jagged, activation, *mask, 0.25, **lens, precision="fp8")
    moved = [None if t is None else t.to(device) for t in (inputs.q, inputs.k, inputs.v, *jagged)]
    tiles = Tiles(16, 16, 1, 1) if device == "cpu" else Tiles(64, 64, 4, 2)
    out, lse = forward.gdpa_forward(*moved[:3], Spec(*moved[3:], *spec[4:]), tiles=tiles)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    ref = gdpa_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), spec)
    emulated = gdpa_fp8_reference(inputs.q, inputs.k, inputs.v, spec).double()
    allowed = 2 * float((emulated - ref).abs().max()) + 1e-6
    assert float((out.cpu().double() - ref).abs().max()) <= allowed
    if activation != "softmax" and device == "cpu":
        # Pointwise rows round the same P as the emulation where S is summed as it is (the interpreter); the GPU's FP8
        # MMAs sum S coarser, so a P near a rounding boundary may take the next code there.
        torch.testing.assert_close(out.cpu().double(), emulated, rtol=1e-5, atol=1e-6)


BACKWARD_PLANS = {
    "atomic-dq": {},
    "one-launch": {"dq_tiles": True},
    "split": {"split_dkdv": True},
}


# Every plan, layout and activation under a causal mask; the other masks on the first plan.
_BACKWARD_CASES = [
    *((layout, activation, MASKS[0], plan) for layout in LAYOUTS for activation in ("softmax", "silu", "relu")
      for plan in BACKWARD_PLANS),
    *((layout, activation, mask, "atomic-dq") for layout in ("self", "cross") for activation in ("softmax", "silu")
      for mask in MASKS[1:]),
]  # fmt: skip


@pytest.mark.parametrize(("layout", "activation", "mask", "plan"), _BACKWARD_CASES, ids=str)
def test_triton_fp8_backward_matches_its_emulation(layout: str, activation: str, mask: tuple, plan: str) -> None:
    """The Triton backward with ``precision="fp8"`` (``S`` and ``dP`` on FP8 codes), on every kernel plan, from the FP8
    forward's own output and log-sum-exp: within FlashAttention's rule of the float64 gradients, with
    :func:`gdpa_fp8_reference_backward` as the same-precision computation, and in the interpreter equal to that
    emulation up to fp32 rounding (fp32 inputs)."""
    forward = _triton_forward()
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward

    device = "cpu" if not torch.cuda.is_available() else "cuda"
    tiles = Tiles(16, 16, 1, 1) if device == "cpu" else Tiles(64, 64, 4, 2)
    # FP8 tensor cores take products of at least 32 along their summed dim: head dim 64 on a GPU.
    inputs, jagged = _inputs(layout, 8, torch.float32, dim=16 if device == "cpu" else 64)
    lens = {"max_seq_len_q": max(inputs.q_lengths), "max_seq_len_kv": max(inputs.kv_lengths)}
    spec = Spec(*jagged, activation, *mask, 0.25, **lens, precision="fp8")
    moved = [None if t is None else t.to(device) for t in (inputs.q, inputs.k, inputs.v, *jagged)]
    q, k, v = moved[:3]
    device_spec = Spec(*moved[3:], *spec[4:])
    out, lse = forward.gdpa_forward(q, k, v, device_spec, tiles=tiles)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    options = {key: tiles if value is True else value for key, value in BACKWARD_PLANS[plan].items()}
    softmax = activation == "softmax"
    grads = gdpa_backward(grad_out, q, k, v, out if softmax else None, lse if softmax else None, device_spec,
                          dkdv_tiles=tiles, **options)  # fmt: skip
    _assert_fp8_gradients(grads, grad_out, inputs, out, spec, exact_sums=device == "cpu")


def _assert_fp8_gradients(grads, grad_out, inputs, out, spec: Spec, *, exact_sums: bool) -> None:
    """FP8 gradients (fp32 inputs) against the float64 ones by FlashAttention's rule, with
    :func:`gdpa_fp8_reference_backward` from the same forward output as the same-precision computation; with
    ``exact_sums`` (the interpreter, which sums in fp32 as the emulation does; the GPU's FP8 MMAs sum coarser) also
    equal to that emulation up to fp32 rounding."""
    grad_out, out = grad_out.detach().cpu(), out.detach().cpu()
    emulated = gdpa_fp8_reference_backward(grad_out, inputs.q, inputs.k, inputs.v, out, spec)
    f64 = [t.double() for t in (inputs.q, inputs.k, inputs.v)]
    exact = gdpa_reference_backward(grad_out.double(), *f64, spec._replace(precision=None))
    for name, got, want, ref in zip(("dq", "dk", "dv"), grads, emulated, exact, strict=True):
        got = got.detach().cpu()
        assert torch.isfinite(got).all(), name
        allowed = 2 * float((want.double() - ref).abs().max()) + 1e-5 * float(ref.abs().max())
        assert float((got.double() - ref).abs().max()) <= allowed, name
        if exact_sums:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_api_fp8_forward_and_gradients(impl: str) -> None:
    """``gdpa(precision="fp8")``: the forward on the codes, the gradients of the FP8 backward."""
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    if impl == "triton":
        _triton_forward()
    inputs, jagged = _inputs("self_targets", 4, torch.float32, dim=16 if device == "cpu" else 64)
    leaves = [t.to(device).requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    options = {"activation": "silu", "causal": True, "scale": 0.25}
    out = gdpa(*leaves, inputs.q_offsets.to(device), num_targets=inputs.num_targets.to(device), impl=impl,
               precision="fp8", **options)  # fmt: skip
    spec = Spec(*jagged, "silu", True, None, None, 0.25, precision="fp8")
    emulated = gdpa_fp8_reference(inputs.q, inputs.k, inputs.v, spec)
    ref = gdpa_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), spec)
    assert (
        float((out.detach().cpu().double() - ref).abs().max())
        <= 2 * float((emulated.double() - ref).abs().max()) + 1e-6
    )
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    _assert_fp8_gradients(grads, grad_out, inputs, out.detach(), spec, exact_sums=device == "cpu")


def test_api_rejects_what_fp8_cannot_run() -> None:
    inputs, _ = _inputs("self", 5, torch.float32)
    q, k, v, offsets = inputs.q, inputs.k, inputs.v, inputs.q_offsets
    with pytest.raises(ValueError, match="`precision` must be one of"):
        gdpa(q, k, v, offsets, impl="reference", precision="fp4")
    for impl in ("padded", "flash"):
        with pytest.raises(ValueError, match="`precision='fp8'` needs impl="):
            gdpa(q, k, v, offsets, impl=impl, precision="fp8")
    bias = torch.zeros(len(inputs.q_lengths), 1, 80, 80)
    with pytest.raises(ValueError, match="cannot take `score_bias`"):
        gdpa(q, k, v, offsets, score_bias=bias, max_seq_len_q=80, precision="fp8")


def test_fp8_kernels_get_products_of_32_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 tensor-core products sum 32 or more values: on a GPU the API refuses head dims of 16 or less, and the
    forward's candidate tiles are at least 32 keys wide, also for BlockAttention blocks of 16."""
    from types import SimpleNamespace

    from lightning_gem.ops.attention import api
    from lightning_gem.ops.attention.impl.triton._tuning import candidate_tiles

    monkeypatch.setattr(api, "device_capability", lambda device: (9, 0))
    on_gpu = SimpleNamespace(is_cuda=True, device="cuda:0", shape=(10, 2, 16))
    with pytest.raises(ValueError, match="head dims over 16"):
        api._check_precision("fp8", "triton", on_gpu, SimpleNamespace(shape=(10, 2, 64)))
    api._check_precision("fp8", "triton", SimpleNamespace(is_cuda=True, device="cuda:0", shape=(10, 2, 32)),
                         SimpleNamespace(shape=(10, 2, 32)))  # fmt: skip
    cuda = torch.device("cuda")
    for block_size in (None, 16, 48, 64):
        tiles = candidate_tiles("fwd", torch.bfloat16, cuda, 64, block_size=block_size, fp8=True)
        assert tiles and all(t.block_n >= 32 for t in tiles), block_size
    assert candidate_tiles("fwd", torch.bfloat16, cuda, 64, block_size=16)[0].block_n == 16  # bf16 keeps block tiles


def test_fp8_attention_through_the_precision_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MXConfig(attention=True)`` turns the kit's GDPA layers to ``precision="fp8"`` but those ``keep_bf16`` matches
    and those with a relative bias; the layers hand it to ``gdpa``. Converting again without it turns them back."""
    from lightning_gem.components.encoder import HSTULayer
    from lightning_gem.components.interaction import GDPAInteraction

    from lightning_gem.ops.attention import api
    from lightning_gem.precision import MXConfig, convert

    model = nn.ModuleDict({
        "encoder": nn.ModuleList([HSTULayer(32, 2), HSTULayer(32, 2), HSTULayer(32, 2, relative_bias_length=8)]),
        "interaction": GDPAInteraction(32, 2),
    })  # fmt: skip
    convert(model, MXConfig(recipe="fp8-rowwise", attention=True, keep_bf16=("encoder.1",)))
    precisions = {name: m.attention_precision for name, m in model.named_modules() if hasattr(m, "attention_precision")}
    assert precisions == {"encoder.0": "fp8", "encoder.1": None, "encoder.2": None, "interaction": "fp8"}

    seen = []
    real = api.gdpa
    monkeypatch.setattr(
        "lightning_gem.components.encoder.gdpa", lambda *a, **kw: seen.append(kw["precision"]) or real(*a, **kw)
    )
    x, offsets = torch.randn(7, 32), torch.tensor([0, 3, 7])
    with torch.no_grad():
        model["encoder"][0](x, offsets)
        model["encoder"][1](x, offsets)
    assert seen == ["fp8", None]
    convert(model, MXConfig(recipe="fp8-rowwise"))
    assert all(m.attention_precision is None for m in model.modules() if hasattr(m, "attention_precision"))
    with pytest.raises(ValueError, match="attention_precision"):
        HSTULayer(32, 2, relative_bias_length=8, attention_precision="fp8")
    with pytest.raises(ValueError, match="attention_precision"):
        GDPAInteraction(32, 2, attention_precision="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", ["self_targets", "cross"])
def test_triton_fp8_bf16_gpu(layout: str, activation: str, dim: int) -> None:
    """Every forward tile candidate on FP8 codes from bf16 inputs, compiled (FP8 tensor cores), against the float64
    reference by FlashAttention's rule with the emulation as the same-precision computation; no non-finite value."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (sm_89+)")
    forward = _triton_forward()
    from lightning_gem.ops.attention.impl.triton._tuning import candidate_tiles

    inputs, jagged = _inputs(layout, 6, torch.bfloat16, dim=dim, q_lengths=[300, 0, 1, 64, 517, 3], max_len=520)
    cuda = [None if t is None else t.cuda() for t in (inputs.q, inputs.k, inputs.v, *jagged)]
    lens = {"max_seq_len_q": max(inputs.q_lengths), "max_seq_len_kv": max(inputs.kv_lengths)}
    spec = Spec(*cuda[3:], activation, True, None, None, dim**-0.5, **lens, precision="fp8")
    cpu_spec = Spec(*jagged, *spec[4:])
    ref = gdpa_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), cpu_spec)
    emulated = gdpa_fp8_reference(inputs.q, inputs.k, inputs.v, cpu_spec).double()
    allowed = 2 * float((emulated - ref).abs().max()) + 2 * torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
    pointwise_targets = activation != "softmax" and layout == "self_targets"
    listed = candidate_tiles("fwd", torch.bfloat16, torch.device("cuda"), dim, max_len_q=lens["max_seq_len_q"],
                             fp8=True, pointwise_targets=pointwise_targets)  # fmt: skip
    for tiles in listed:
        out, _ = forward.gdpa_forward(*cuda[:3], spec, tiles=tiles)
        assert torch.isfinite(out).all(), tiles
        err = float((out.cpu().double() - ref).abs().max())
        assert err <= allowed, f"{tiles}: {err} > {allowed}"


def test_fp8_pointwise_targets_over_head_dim_128_keep_to_8_warps() -> None:
    """The FP8 forward of a pointwise activation with targets over head dim 128 computed wrong target rows on an H100
    at every tile over 4 warps: the tuner lists none there, and such tiles passed explicitly raise, naming the
    argument (before a launch)."""
    forward = _triton_forward()
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles, candidate_tiles

    cuda = torch.device("cuda")
    for dim in (192, 256):
        for max_len_q in (1 << 30, 40):  # general and short-query tiles
            listed = candidate_tiles("fwd", torch.bfloat16, cuda, dim, fp8=True, pointwise_targets=True,
                                     max_len_q=max_len_q)  # fmt: skip
            assert listed and all(t.num_warps == 8 for t in listed), listed
    assert any(t.block_m == 128 for t in candidate_tiles("fwd", torch.bfloat16, cuda, 256, fp8=True,
                                                         pointwise_targets=True))  # fmt: skip
    assert any(t.num_warps == 4 for t in candidate_tiles("fwd", torch.bfloat16, cuda, 256, fp8=True))
    assert any(t.num_warps == 4 for t in candidate_tiles("fwd", torch.bfloat16, cuda, 128, fp8=True,
                                                         pointwise_targets=True))  # fmt: skip
    inputs, jagged = _inputs("self_targets", 8, torch.float32, dim=160)
    spec = Spec(*jagged, "silu", True, None, None, 160**-0.5, max_seq_len_q=70, max_seq_len_kv=70, precision="fp8")
    with pytest.raises(ValueError, match="tiles="):
        forward.gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=Tiles(64, 64, 4, 2))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_quantizer_gives_the_reference_codes(layout: str, strided: bool) -> None:
    """The quantizer the Triton forward launches produces :func:`quantize_fp8`'s codes and scales (zeros compare equal
    whatever their sign: the interpreter's conversion drops the sign of a code that rounds to zero), also from q and
    k that are views into a wider projection (as an HSTU layer splits its ``uvqk``): the codes come out contiguous."""
    _triton_forward()
    from lightning_gem.ops.attention.impl.triton.quantize import quantize_fp8_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs, jagged = _inputs(layout, 7, torch.bfloat16, dim=32, q_lengths=[37, 0, 1, 16, 150], max_len=160)
    q, k, v, q_offsets, kv_offsets = (t.to(device) for t in (inputs.q, inputs.k, inputs.v, *jagged[:2]))
    if strided:  # rows three heads' widths apart, the codes' buffers sized for dense rows
        q = torch.cat([q, q, q], dim=2)[..., 32:64]
        k = torch.cat([k, k], dim=1)[:, : k.shape[1]]
        assert q.stride(0) != q.shape[1] * q.shape[2] and k.stride(0) != k.shape[1] * k.shape[2]
    v = v[..., :24].contiguous()  # a value head dim below its block
    expected = quantize_fp8(q, k, v, kv_offsets)
    got = quantize_fp8_triton(q, k, v, q_offsets, kv_offsets, max(inputs.q_lengths), max(inputs.kv_lengths))
    for name, want, have in zip(expected._fields, expected, got, strict=True):
        assert want.shape == have.shape and want.dtype == have.dtype, name
        torch.testing.assert_close(have.float(), want.float(), rtol=0, atol=0, msg=name)


def test_quantization_stats_count_underflow_and_bad_blocks() -> None:
    from lightning_gem.ops.attention.fp8 import quantization_stats

    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, 2, 16, generator=generator) for n in (10, 8, 8))
    q[0, 0, :3] = 1e-12  # beside a large value of the same row: codes of zero
    q[0, 0, 5] = 100.0
    k[2, 1, 4] = float("nan")  # a row of 16 in a NaN block
    v[5, 0, 2] = float("inf")  # a channel of segment 1 (5 tokens) in an Inf block
    counts = quantization_stats(q, k, v, torch.tensor([0, 3, 8]))
    assert counts.tolist() == [[0, 3, 0, 320], [0, 0, 16, 256], [0, 0, 5, 256]]
