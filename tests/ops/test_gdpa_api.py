"""The public GDPA API: every validation error names its argument, impl dispatch, the conveniences' defaults."""

from __future__ import annotations

import doctest
from collections.abc import Callable

import pytest
import torch

import lightning_gem.jagged
import lightning_gem.ops.attention.api
from lightning_gem.ops import block_attention, gdpa, hstu_attention, jagged_flash_attention
from lightning_gem.testing import gdpa_oracle, jagged_inputs, numerics
from lightning_gem.testing.gdpa_oracle import gdpa_oracle as oracle
from lightning_gem.testing.jagged_inputs import lengths_to_offsets, make_gdpa_inputs

Q_LENGTHS, KV_LENGTHS = [3, 0, 4], [2, 3, 1]
TQ, TK, H, D, DV = 7, 6, 2, 4, 3


def _valid_call() -> dict:
    """Valid cross-attention arguments; each error case breaks exactly one of them."""
    return {
        "q": torch.randn(TQ, H, D),
        "k": torch.randn(TK, H, D),
        "v": torch.randn(TK, H, DV),
        "q_offsets": lengths_to_offsets(Q_LENGTHS),
        "kv_offsets": lengths_to_offsets(KV_LENGTHS),
    }


def _self_call() -> dict:
    call = _valid_call()
    call.update(k=torch.randn(TQ, H, D), v=torch.randn(TQ, H, DV), kv_offsets=None)
    return call


def _with(base: Callable[[], dict], **changes: object) -> Callable[[], dict]:
    return lambda: {**base(), **changes}


ERRORS = {
    # name: (arguments, exception type, argument the message must name)
    "q-not-a-tensor": (_with(_valid_call, q=[[0.0]]), TypeError, "q"),
    "q-int": (_with(_valid_call, q=torch.zeros(TQ, H, D, dtype=torch.int64)), TypeError, "q"),
    "q-2d": (_with(_valid_call, q=torch.randn(TQ, H * D)), ValueError, "q"),
    "k-4d": (_with(_valid_call, k=torch.randn(TK, H, D, 1)), ValueError, "k"),
    "v-2d": (_with(_valid_call, v=torch.randn(TK, DV)), ValueError, "v"),
    "k-dtype": (_with(_valid_call, k=torch.randn(TK, H, D, dtype=torch.float64)), TypeError, "k"),
    "v-dtype": (_with(_valid_call, v=torch.randn(TK, H, DV, dtype=torch.bfloat16)), TypeError, "v"),
    "k-device": (_with(_valid_call, k=torch.empty(TK, H, D, device="meta")), ValueError, "k"),
    "k-heads": (_with(_valid_call, k=torch.randn(TK, H + 1, D)), ValueError, "k"),
    "v-heads": (_with(_valid_call, v=torch.randn(TK, H + 1, DV)), ValueError, "v"),
    "k-head-dim": (_with(_valid_call, k=torch.randn(TK, H, D + 1)), ValueError, "k"),
    "v-rows": (_with(_valid_call, v=torch.randn(TK + 1, H, DV)), ValueError, "v"),
    "self-kv-rows": (_with(_self_call, k=torch.randn(TQ + 1, H, D), v=torch.randn(TQ + 1, H, DV)), ValueError, "k"),
    "q-offsets-float": (_with(_valid_call, q_offsets=torch.tensor([0.0, 3.0, 3.0, 7.0])), TypeError, "q_offsets"),
    "q-offsets-2d": (_with(_valid_call, q_offsets=lengths_to_offsets(Q_LENGTHS)[None]), ValueError, "q_offsets"),
    "q-offsets-end": (_with(_valid_call, q_offsets=torch.tensor([0, 3, 3, 6])), ValueError, "q_offsets"),
    "q-offsets-start": (_with(_valid_call, q_offsets=torch.tensor([1, 3, 3, 7])), ValueError, "q_offsets"),
    "q-offsets-decreasing": (_with(_valid_call, q_offsets=torch.tensor([0, 4, 3, 7])), ValueError, "q_offsets"),
    "kv-offsets-end": (_with(_valid_call, kv_offsets=torch.tensor([0, 2, 5, 5])), ValueError, "kv_offsets"),
    "kv-offsets-count": (_with(_valid_call, kv_offsets=torch.tensor([0, 2, 6])), ValueError, "kv_offsets"),
    "activation": (_with(_valid_call, activation="tanh"), ValueError, "activation"),
    "impl": (_with(_valid_call, impl="cuda"), ValueError, "impl"),
    "window-negative": (_with(_valid_call, window=-1), ValueError, "window"),
    "window-float": (_with(_valid_call, window=1.5), ValueError, "window"),
    "block-size-zero": (_with(_valid_call, block_size=0), ValueError, "block_size"),
    "block-size-float": (_with(_valid_call, block_size=2.0), ValueError, "block_size"),
    "kv-index-float": (_with(_valid_call, kv_index=torch.tensor([0.0, 1.0, 2.0])), TypeError, "kv_index"),
    "kv-index-short": (_with(_valid_call, kv_index=torch.tensor([0, 1])), ValueError, "kv_index"),
    "kv-index-2d": (_with(_valid_call, kv_index=torch.tensor([[0, 1, 2]])), ValueError, "kv_index"),
    "kv-index-too-big": (_with(_valid_call, kv_index=torch.tensor([0, 3, 1])), ValueError, "kv_index"),
    "kv-index-negative": (_with(_valid_call, kv_index=torch.tensor([0, -1, 1])), ValueError, "kv_index"),
    "targets-cross": (_with(_valid_call, num_targets=torch.tensor([1, 0, 1])), ValueError, "num_targets"),
    "targets-negative": (_with(_self_call, num_targets=torch.tensor([1, 0, -1])), ValueError, "num_targets"),
    "targets-too-many": (_with(_self_call, num_targets=torch.tensor([1, 1, 0])), ValueError, "num_targets"),
    "targets-shape": (_with(_self_call, num_targets=torch.tensor([1, 0])), ValueError, "num_targets"),
    "targets-float": (_with(_self_call, num_targets=torch.tensor([1.0, 0.0, 1.0])), TypeError, "num_targets"),
    "max-seq-len-q": (_with(_valid_call, max_seq_len_q=3), ValueError, "max_seq_len_q"),
    "max-seq-len-kv": (_with(_valid_call, max_seq_len_kv=2), ValueError, "max_seq_len_kv"),
    "score-bias-cross": (_with(_valid_call, score_bias=torch.zeros(4, 4)), ValueError, "score_bias"),
    "score-bias-impl": (_with(_self_call, score_bias=torch.zeros(4, 4), impl="reference"), ValueError, "score_bias"),
    "score-bias-targets": (
        _with(_self_call, score_bias=torch.zeros(4, 4), num_targets=torch.tensor([1, 0, 1])),
        ValueError,
        "score_bias",
    ),
    "score-bias-int": (_with(_self_call, score_bias=torch.zeros(4, 4, dtype=torch.int64)), TypeError, "score_bias"),
    "score-bias-heads": (_with(_self_call, score_bias=torch.zeros(3, H + 1, 4, 4)), ValueError, "score_bias"),
    "score-bias-1d": (_with(_self_call, score_bias=torch.zeros(4)), ValueError, "score_bias"),
    "score-bias-length": (_with(_self_call, score_bias=torch.zeros(5, 5)), ValueError, "score_bias"),
    "normalization-length-zero": (
        _with(_self_call, activation="silu", normalization_length=0),
        ValueError,
        "normalization_length",
    ),
    "normalization-length-softmax": (_with(_self_call, normalization_length=4), ValueError, "normalization_length"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_gdpa_validation_errors(case: str) -> None:
    make_call, exc, argument = ERRORS[case]
    with pytest.raises(exc, match=f"`{argument}`"):
        gdpa(**make_call())


def test_gdpa_accepts_the_valid_calls_the_errors_break() -> None:
    for make_call in (_valid_call, _self_call):
        call = make_call()
        out = gdpa(**call, max_seq_len_q=4, max_seq_len_kv=4)
        assert out.shape == (TQ, H, DV) and out.dtype == call["q"].dtype
    gdpa(**_self_call(), num_targets=torch.tensor([0, 0, 4]))  # 0 and the full length are both allowed
    gdpa(**_valid_call(), kv_index=torch.tensor([2, 2, 0], dtype=torch.int32))


def test_gdpa_check_offsets_false_skips_value_checks_only() -> None:
    call = _valid_call()
    torch.testing.assert_close(gdpa(**call, check_offsets=False), gdpa(**call), rtol=0, atol=0)
    with pytest.raises(ValueError, match="`q`"):  # shape checks still run
        gdpa(**{**call, "q": torch.randn(TQ, H * D)}, check_offsets=False)


# -------------------------------------------------------------------------------------------- dispatch


def test_impl_triton_never_falls_back() -> None:
    # fp64 has no Triton kernel: the named impl raises instead of running the reference.
    call = _valid_call()
    with pytest.raises(TypeError, match="float64|fp64"):
        gdpa(**{**call, "q": call["q"].double(), "k": call["k"].double(), "v": call["v"].double()}, impl="triton")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_impl_auto_is_the_reference_on_cpu(activation: str) -> None:
    call = _valid_call()
    auto = gdpa(**call, activation=activation, causal=True, impl="auto")
    reference = gdpa(**call, activation=activation, causal=True, impl="reference")
    torch.testing.assert_close(auto, reference, rtol=0, atol=0)
    assert lightning_gem.ops.attention.api.resolve_impl("auto", call["q"]) == "reference"


# ---------------------------------------------------------------------------------- modes and defaults


def _fp64_self_inputs(seed: int, **kwargs: object) -> jagged_inputs.GDPAInputs:
    return make_gdpa_inputs("self", torch.Generator().manual_seed(seed), q_lengths=[5, 0, 1, 9], **kwargs)


@pytest.mark.parametrize("impl", ["reference", "padded"])
def test_normalization_length_divides_pointwise_attention_by_it(impl: str) -> None:
    inputs = _fp64_self_inputs(7)
    qkv, offsets = (inputs.q, inputs.k, inputs.v), inputs.q_offsets
    own = gdpa(*qkv, offsets, activation="silu", causal=True, impl=impl)
    fixed = gdpa(*qkv, offsets, activation="silu", causal=True, normalization_length=12, impl=impl)
    lengths = lightning_gem.jagged.offsets_to_lengths(offsets).double()
    factor = lengths[lightning_gem.jagged.segment_ids(offsets, own.shape[0])] / 12
    torch.testing.assert_close(fixed, own * factor[:, None, None], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "mode",
    [
        {"activation": "softmax", "causal": True},
        {"activation": "silu", "window": 2},
        {"activation": "gelu", "block_size": 3},
    ],
)
def test_a_score_bias_of_zeros_is_gdpa(mode: dict) -> None:
    """``score_bias`` resolves ``impl="auto"`` to the dense path, whose scores are fp32: fp32 tolerances."""
    inputs = _fp64_self_inputs(3)
    qkv, offsets = (inputs.q, inputs.k, inputs.v), inputs.q_offsets
    biased = gdpa(*qkv, offsets, **mode, score_bias=torch.zeros(9, 9))
    torch.testing.assert_close(biased, gdpa(*qkv, offsets, **mode, impl="reference"), rtol=1e-5, atol=1e-6)


def test_a_score_bias_is_added_to_every_score_and_gets_a_gradient() -> None:
    """Against a direct per-sequence computation: ``silu(scale q k^T + bias[b, h]) / L``, causal."""
    inputs = _fp64_self_inputs(5)
    qkv, offsets = (inputs.q, inputs.k, inputs.v), inputs.q_offsets
    lengths = lightning_gem.jagged.offsets_to_lengths(offsets).tolist()
    bias = torch.randn(len(lengths), inputs.q.shape[1], 9, 9, dtype=torch.float64, requires_grad=True)
    out = gdpa(*qkv, offsets, activation="silu", causal=True, score_bias=bias, max_seq_len_q=9, impl="padded")
    start = 0
    for b, length in enumerate(lengths):
        q, k, v = (x[start : start + length].transpose(0, 1) for x in qkv)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5 + bias[b, :, :length, :length]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        expected = (torch.nn.functional.silu(scores) * causal / max(length, 1)) @ v
        torch.testing.assert_close(out[start : start + length], expected.transpose(0, 1), rtol=1e-5, atol=1e-6)
        start += length
    out.sum().backward()
    assert bias.grad[0, :, :5, :5].abs().sum() > 0 and bias.grad[0, :, 5:].abs().sum() == 0  # padding: no gradient


def test_jagged_flash_attention_is_causal_softmax() -> None:
    x = _fp64_self_inputs(0)
    out = jagged_flash_attention(x.q, x.k, x.v, x.q_offsets)
    torch.testing.assert_close(out, gdpa(x.q, x.k, x.v, x.q_offsets, activation="softmax", causal=True))
    torch.testing.assert_close(out, oracle(x.q, x.k, x.v, x.q_offsets, activation="softmax", causal=True))
    bidirectional = jagged_flash_attention(x.q, x.k, x.v, x.q_offsets, causal=False)
    torch.testing.assert_close(bidirectional, oracle(x.q, x.k, x.v, x.q_offsets, activation="softmax"))


def test_hstu_attention_is_causal_silu_with_targets() -> None:
    x = _fp64_self_inputs(1)
    targets = torch.tensor([2, 0, 1, 3])
    out = hstu_attention(x.q, x.k, x.v, x.q_offsets, num_targets=targets)
    expected = oracle(x.q, x.k, x.v, x.q_offsets, activation="silu", causal=True, num_targets=targets)
    torch.testing.assert_close(out, expected)
    relu = hstu_attention(x.q, x.k, x.v, x.q_offsets, activation="relu", causal=False)
    torch.testing.assert_close(relu, oracle(x.q, x.k, x.v, x.q_offsets, activation="relu"))


def test_block_attention_is_bidirectional_softmax_in_blocks() -> None:
    x = _fp64_self_inputs(2)
    out = block_attention(x.q, x.k, x.v, x.q_offsets, block_size=4)
    torch.testing.assert_close(out, oracle(x.q, x.k, x.v, x.q_offsets, activation="softmax", block_size=4))
    causal_silu = block_attention(x.q, x.k, x.v, x.q_offsets, block_size=3, activation="silu", causal=True)
    expected = oracle(x.q, x.k, x.v, x.q_offsets, activation="silu", causal=True, block_size=3)
    torch.testing.assert_close(causal_silu, expected)


def test_explicit_equal_kv_offsets_are_self_attention() -> None:
    """Docstring: self-attention is kv_offsets omitted *or* equal lengths everywhere; targets work in both."""
    x = _fp64_self_inputs(3)
    targets = torch.tensor([1, 0, 1, 4])
    omitted = gdpa(x.q, x.k, x.v, x.q_offsets, activation="silu", causal=True, num_targets=targets)
    explicit = gdpa(
        x.q,
        x.k,
        x.v,
        x.q_offsets,
        x.q_offsets.clone().to(torch.int32),
        activation="silu",
        causal=True,
        num_targets=targets,
    )
    torch.testing.assert_close(explicit, omitted, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["softmax", "gelu"])
def test_scale_argument(activation: str) -> None:
    x = make_gdpa_inputs("cross", torch.Generator().manual_seed(4), q_lengths=[4, 2], kv_lengths=[3, 6])
    out = gdpa(x.q, x.k, x.v, x.q_offsets, **x.kwargs(), activation=activation, scale=0.3)
    expected = oracle(x.q, x.k, x.v, x.q_offsets, **x.kwargs(), activation=activation, scale=0.3)
    torch.testing.assert_close(out, expected)
    default = gdpa(x.q, x.k, x.v, x.q_offsets, **x.kwargs(), activation=activation)
    torch.testing.assert_close(
        default, gdpa(x.q, x.k, x.v, x.q_offsets, **x.kwargs(), activation=activation, scale=D**-0.5), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "module",
    [lightning_gem.jagged, lightning_gem.ops.attention.api, gdpa_oracle, jagged_inputs, numerics],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def test_impl_triton_through_the_public_api_matches_the_reference() -> None:
    # On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU natively.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    call = {name: tensor.to(device) for name, tensor in _valid_call().items()}
    got = gdpa(**call, activation="silu", causal=True, impl="triton")
    want = gdpa(**call, activation="silu", causal=True, impl="reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
