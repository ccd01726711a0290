"""HSTULayer and JaggedHistoryEncoder on jagged inputs: shapes, gradients, batch invariance, masking."""

from __future__ import annotations

import pytest
import torch
from lightning_gem.components import encoder as encoder_module
from lightning_gem.components.encoder import (
    HSTULayer,
    JaggedHistoryEncoder,
    RMSNorm,
    make_norm,
    pad_tokens_to_multiple,
    recency_positions,
    time_buckets,
)
from torch import nn

LENGTHS = [0, 1, 5, 0, 3, 7]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _randomized(module: nn.Module) -> nn.Module:
    """Residual branches start at zero (identity layers); give them weights so the tests see attention."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, HSTULayer):
                nn.init.normal_(sub.output.weight, std=0.3)
    return module


def test_rms_norm_keeps_the_fused_kernel_for_an_input_of_another_dtype() -> None:
    norm = make_norm("rms", 64)
    assert type(norm) is RMSNorm and isinstance(norm, nn.RMSNorm)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(9, 64).to(torch.bfloat16).requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = norm(x)
    assert "aten::_fused_rms_norm" in {e.name for e in prof.events()}  # not the composite fallback
    # As the unfused norm with the weight in the input's dtype: the output in that dtype, the gradient reaching
    # the fp32 weight.
    want = nn.functional.rms_norm(x.float(), (64,), norm.weight.to(torch.bfloat16).float(), norm.eps)
    assert y.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1e-2)
    y.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32 and x.grad is not None
    same = torch.randn(9, 64)  # matching dtypes: exactly nn.RMSNorm
    torch.testing.assert_close(norm(same), nn.RMSNorm.forward(norm, same), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("per_head_norm", [True, False])
def test_hstu_layer_shapes_and_gradients(activation: str, per_head_norm: bool) -> None:
    torch.manual_seed(0)
    layer = _randomized(
        HSTULayer(dim=12, num_heads=3, activation=activation, per_head_norm=per_head_norm, norm="layer")
    )
    offsets = _offsets(LENGTHS)
    x = torch.randn(int(offsets[-1]), 12, requires_grad=True)
    y = layer(x, offsets)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    for name, kind in layer.tensor_parallel_plan().items():
        assert isinstance(layer.get_submodule(name), nn.Linear) and kind in ("colwise", "rowwise")


@pytest.mark.parametrize("multiple", [1, 3, 5, 16, 17, 32])
def test_padding_tokens_to_a_multiple_leaves_the_real_tokens_outputs_alone(multiple: int) -> None:
    """Sequence parallelism pads the tokens to a multiple of the tensor-parallel size: the padding is a
    sequence of its own (longer than the max_seq_len hint at multiple=32), so the real tokens' outputs and
    gradients are those without it."""
    torch.manual_seed(0)
    layer = _randomized(HSTULayer(dim=8, num_heads=2))
    offsets = _offsets(LENGTHS)
    num_tokens = int(offsets[-1])
    num_targets = torch.tensor([min(2, n) for n in LENGTHS])
    x = torch.randn(num_tokens, 8, requires_grad=True)
    padded, padded_offsets, padded_targets, hint = pad_tokens_to_multiple(x, offsets, multiple, num_targets, 7)
    assert padded.shape[0] % multiple == 0 and 0 <= padded.shape[0] - num_tokens < multiple
    if padded.shape[0] == num_tokens:
        assert padded is x and padded_offsets is offsets and padded_targets is num_targets and hint == 7
    else:
        assert padded_offsets[:-1].tolist() == offsets.tolist() and int(padded_offsets[-1]) == padded.shape[0]
        assert padded_targets.tolist() == [*num_targets.tolist(), 0] and hint == max(7, padded.shape[0] - num_tokens)
    out = layer(padded, padded_offsets, num_targets=padded_targets, max_seq_len=hint)[:num_tokens]
    out_grad = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, out_grad)
    alone = layer(x, offsets, num_targets=num_targets, max_seq_len=7)
    (alone_grad,) = torch.autograd.grad(alone, x, out_grad)
    torch.testing.assert_close(out, alone)
    torch.testing.assert_close(grad, alone_grad)


def test_padding_to_a_multiple_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="`multiple` must be >= 1"):
        pad_tokens_to_multiple(torch.zeros(2, 4), _offsets([2]), 0)


def test_a_fresh_layer_is_the_identity() -> None:
    layer = HSTULayer(dim=8, num_heads=2)
    x = torch.randn(4, 8)
    torch.testing.assert_close(layer(x, _offsets([4])), x)


def test_hstu_layer_on_an_empty_batch() -> None:
    layer = HSTULayer(dim=8, num_heads=2)
    assert layer(torch.zeros(0, 8), torch.zeros(3, dtype=torch.int64)).shape == (0, 8)


def test_hstu_layer_output_of_a_sample_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(0)
    layer = _randomized(HSTULayer(dim=16, num_heads=2)).eval()
    offsets = _offsets(LENGTHS)
    x = torch.randn(int(offsets[-1]), 16)
    together = layer(x, offsets)
    for b, length in enumerate(LENGTHS):
        start, end = int(offsets[b]), int(offsets[b + 1])
        alone = layer(x[start:end], _offsets([length]))
        torch.testing.assert_close(together[start:end], alone, atol=1e-5, rtol=1e-5)


def test_hstu_layer_is_causal_and_targets_do_not_see_each_other() -> None:
    torch.manual_seed(0)
    layer = _randomized(HSTULayer(dim=8, num_heads=2)).eval()
    offsets = _offsets([6])
    x = torch.randn(6, 8)
    changed = x.clone()
    changed[4] += 1.0
    base, after = layer(x, offsets), layer(changed, offsets)
    torch.testing.assert_close(base[:4], after[:4])  # the past never sees the future
    assert not torch.allclose(base[5] - x[5], after[5] - x[5])  # ... and the future sees the past
    num_targets = torch.tensor([2])  # tokens 4 and 5 are targets
    base, after = layer(x, offsets, num_targets=num_targets), layer(changed, offsets, num_targets=num_targets)
    torch.testing.assert_close(base[5], after[5])  # target 5 does not see target 4
    assert not torch.allclose(base[4] - x[4], after[4] - changed[4])  # a target sees itself
    assert not torch.allclose(base[4], after[4])


def test_recency_positions_and_time_buckets_by_hand() -> None:
    offsets = _offsets([3, 0, 1, 4])
    assert recency_positions(offsets, max_length=10).tolist() == [3, 2, 1, 1, 4, 3, 2, 1]
    assert recency_positions(offsets, max_length=2).tolist() == [2, 2, 1, 1, 2, 2, 2, 1]
    with_targets = recency_positions(offsets, max_length=10, num_targets=torch.tensor([1, 0, 0, 2]))
    assert with_targets.tolist() == [2, 1, 0, 1, 2, 1, 0, 0]
    deltas = torch.tensor([0.0, 1.0, 3.0, -5.0, float("nan"), 1e12])
    # floor(2 * log2(1 + dt)): 0, 2, 4, 0 (negative), 0 (NaN), capped at 63
    assert time_buckets(deltas, 64).tolist() == [0, 2, 4, 0, 0, 63]


def test_encoder_shapes_gradients_and_batch_invariance() -> None:
    torch.manual_seed(0)
    encoder = _randomized(
        JaggedHistoryEncoder(input_dim=10, dim=16, num_layers=2, num_heads=2, max_length=4, use_time=True)
    )
    offsets = _offsets(LENGTHS)
    total = int(offsets[-1])
    features = torch.randn(total, 10, requires_grad=True)
    deltas = torch.rand(total) * 1e5
    out = encoder(features, offsets, time_deltas=deltas)
    assert out.shape == (total, 16) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(features.grad).all()
    assert encoder.position.weight.grad.abs().sum() > 0 and encoder.time.weight.grad.abs().sum() > 0

    encoder.eval()
    together = encoder(features, offsets, time_deltas=deltas)
    start, end = int(offsets[2]), int(offsets[3])
    alone = encoder(features[start:end], _offsets([LENGTHS[2]]), time_deltas=deltas[start:end])
    torch.testing.assert_close(together[start:end], alone, atol=1e-5, rtol=1e-5)


def test_encoder_errors_name_the_argument() -> None:
    encoder = JaggedHistoryEncoder(input_dim=4, dim=8, num_layers=1, num_heads=2, use_time=True)
    offsets = _offsets([2])
    with pytest.raises(ValueError, match="time_deltas"):
        encoder(torch.randn(2, 4), offsets)
    with pytest.raises(ValueError, match="features"):
        encoder(torch.randn(2, 5), offsets, time_deltas=torch.zeros(2))
    with pytest.raises(ValueError, match="offsets"):
        encoder(torch.randn(3, 4), offsets, time_deltas=torch.zeros(3))
    with pytest.raises(ValueError, match="divisible"):
        HSTULayer(dim=10, num_heads=3)


def test_attention_scale_is_the_gdpa_score_scale() -> None:
    """None scales scores by 1/sqrt(head dim); HSTU's reference applies SiLU to the raw scores (scale 1)."""
    torch.manual_seed(0)
    default = _randomized(HSTULayer(dim=50, num_heads=2))  # head dim 25: 1/sqrt(25) = 0.2
    explicit, raw = (
        HSTULayer(dim=50, num_heads=2, attention_scale=0.2),
        HSTULayer(dim=50, num_heads=2, attention_scale=1.0),
    )
    explicit.load_state_dict(default.state_dict())
    raw.load_state_dict(default.state_dict())
    x, offsets = torch.randn(16, 50), _offsets([9, 7])
    torch.testing.assert_close(explicit(x, offsets), default(x, offsets))
    assert not torch.allclose(raw(x, offsets), default(x, offsets))
    with pytest.raises(ValueError, match="attention_scale"):
        HSTULayer(dim=50, num_heads=2, attention_scale=0.0)


def _qkv(lengths: list[int], heads: int = 2, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return tuple(torch.randn(total, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize(
    ("activation", "causal", "window"), [("silu", True, None), ("softmax", True, None), ("silu", False, 2)]
)
@pytest.mark.parametrize("max_seq_len", [None, 9])
def test_relative_bias_attention_with_a_zero_bias_is_gdpa(
    activation: str, causal: bool, window: int | None, max_seq_len: int | None
) -> None:
    from lightning_gem.components.encoder import RelativePositionBias, relative_bias_attention

    from lightning_gem.ops import gdpa

    q, k, v = _qkv(LENGTHS)
    offsets = _offsets(LENGTHS)
    bias = RelativePositionBias(4).double()
    nn.init.zeros_(bias.weight)
    kwargs = dict(activation=activation, causal=causal, window=window)
    expected = gdpa(q, k, v, offsets, impl="reference", **kwargs)
    torch.testing.assert_close(relative_bias_attention(q, k, v, offsets, bias, max_seq_len, **kwargs), expected)


def test_relative_bias_attention_adds_the_bias_of_each_distance_and_learns_it() -> None:
    """Against a direct per-sequence computation: ``silu(q k^T / sqrt(D) + w[t - i]) / L``, causal."""
    from lightning_gem.components.encoder import RelativePositionBias, relative_bias_attention

    q, k, v = _qkv([5, 0, 3])
    offsets = _offsets([5, 0, 3])
    bias = RelativePositionBias(3).double()
    out = relative_bias_attention(q, k, v, offsets, bias, 6)
    for start, length in ((0, 5), (5, 3)):
        qs, ks, vs = (x[start : start + length].transpose(0, 1) for x in (q, k, v))
        i = torch.arange(length)
        w = bias.weight[(i[None, :] - i[:, None]).clamp(-2, 2) + 2]
        scores = torch.nn.functional.silu(qs @ ks.transpose(1, 2) / 8**0.5 + w) / length
        expected = (scores * (i[None, :] <= i[:, None])) @ vs
        torch.testing.assert_close(out[start : start + length], expected.transpose(0, 1))
    out.square().sum().backward()
    assert bias.weight.grad is not None and bias.weight.grad.abs().sum() > 0


def test_relative_bias_attention_is_causal_and_batch_invariant() -> None:
    from lightning_gem.components.encoder import RelativePositionBias, relative_bias_attention

    q, k, v = _qkv([4, 6])
    offsets = _offsets([4, 6])
    bias = RelativePositionBias(8).double()
    out = relative_bias_attention(q, k, v, offsets, bias, 8)
    alone = relative_bias_attention(q[4:], k[4:], v[4:], _offsets([6]), bias, None)
    torch.testing.assert_close(out[4:], alone)
    k2, v2 = k.clone(), v.clone()
    k2[9], v2[9] = 0.0, 0.0  # the last token of the second sequence: earlier outputs must not move
    moved = relative_bias_attention(q, k2, v2, offsets, bias, 8)
    torch.testing.assert_close(moved[:9], out[:9])


def test_layers_with_a_relative_bias_train_and_refuse_targets() -> None:
    encoder = JaggedHistoryEncoder(8, 16, num_layers=2, num_heads=2, max_length=8, relative_attention_bias=True)
    encoder = _randomized(encoder)
    assert all(layer.relative_bias.weight.shape == (15,) for layer in encoder.layers)
    offsets = _offsets([3, 0, 5])
    out = encoder(torch.randn(8, 8), offsets, max_seq_len=8)
    out.square().sum().backward()
    assert all(layer.relative_bias.weight.grad.abs().sum() > 0 for layer in encoder.layers)
    with pytest.raises(ValueError, match="num_targets"):
        encoder.layers[0](torch.randn(8, 16), offsets, num_targets=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="relative_bias_length"):
        HSTULayer(dim=16, num_heads=2, relative_bias_length=0)


def test_relative_time_buckets_pair_the_predicted_event_with_each_key() -> None:
    """Row ``i`` takes the time of the event position ``i`` predicts (the next one; the last position its own)."""
    from lightning_gem.components.encoder import relative_time_buckets, time_buckets

    timestamps = torch.tensor([0.0, 10.0, 1000.0, 5.0, 7.0, 3.0])  # sequences of 3, 0, 2 and 1 events
    offsets = _offsets([3, 0, 2, 1])
    buckets = relative_time_buckets(timestamps, offsets, 4, 64)
    assert buckets.shape == (4, 4, 4) and buckets.dtype == torch.int64
    first = torch.tensor([[10.0, 0.0, 990.0], [1000.0, 990.0, 0.0], [1000.0, 990.0, 0.0]])  # |t(i + 1) - t(j)|
    assert torch.equal(buckets[0, :3, :3], time_buckets(first, 64))
    assert torch.equal(buckets[2, :2, :2], time_buckets(torch.tensor([[2.0, 0.0], [2.0, 0.0]]), 64))
    assert buckets[3, 0, 0] == 0 and relative_time_buckets(timestamps[:0], _offsets([0, 0]), 3, 64).shape == (2, 3, 3)


def test_relative_time_bias_adds_the_bias_of_each_gap_and_learns_it() -> None:
    """Against a direct per-sequence computation: ``silu(q k^T / sqrt(D) + w_pos[t - i] + w_time[b(i, t)]) / L``."""
    from lightning_gem.components.encoder import (
        RelativePositionBias,
        RelativeTimeBias,
        relative_bias_attention,
        relative_time_buckets,
    )

    q, k, v = _qkv([5, 0, 3])
    offsets = _offsets([5, 0, 3])
    timestamps = torch.tensor([0.0, 3.0, 3.0, 100.0, 5000.0, 7.0, 8.0, 60.0])
    position, time = RelativePositionBias(3).double(), RelativeTimeBias(16).double()
    buckets = relative_time_buckets(timestamps, offsets, 6, 16)
    out = relative_bias_attention(q, k, v, offsets, position, 6, time_bias=time, time_buckets=buckets)
    alone = relative_bias_attention(q, k, v, offsets, None, 6, time_bias=time, time_buckets=buckets)
    for start, length in ((0, 5), (5, 3)):
        qs, ks, vs = (x[start : start + length].transpose(0, 1) for x in (q, k, v))
        i = torch.arange(length)
        w = position.weight[(i[None, :] - i[:, None]).clamp(-2, 2) + 2]
        t = timestamps[start : start + length]
        gaps = (t[(i + 1).clamp(max=length - 1)][:, None] - t[None, :]).abs()
        wt = time.weight[torch.floor(2 * torch.log2(1 + gaps)).clamp(max=15).long()]
        for got, extra in ((out, w + wt), (alone, wt)):
            scores = torch.nn.functional.silu(qs @ ks.transpose(1, 2) / 8**0.5 + extra) / length
            expected = (scores * (i[None, :] <= i[:, None])) @ vs
            torch.testing.assert_close(got[start : start + length], expected.transpose(0, 1))
    out.square().sum().backward()
    assert time.weight.grad is not None and time.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="time_buckets"):
        relative_bias_attention(q, k, v, offsets, None, 5, time_bias=time, time_buckets=buckets)


def test_layers_with_a_relative_time_bias_train_and_need_timestamps() -> None:
    encoder = JaggedHistoryEncoder(8, 16, num_layers=2, num_heads=2, max_length=8, relative_time_bias=True)
    encoder = _randomized(encoder)
    assert all(layer.time_bias.weight.shape == (64,) and layer.relative_bias is None for layer in encoder.layers)
    offsets, features = _offsets([3, 0, 5]), torch.randn(8, 8)
    timestamps = torch.tensor([0.0, 60.0, 3600.0, 0.0, 1.0, 2.0, 86400.0, 86401.0])
    out = encoder(features, offsets, timestamps=timestamps)
    out.square().sum().backward()
    assert all(layer.time_bias.weight.grad.abs().sum() > 0 for layer in encoder.layers)
    later = timestamps.clone()
    later[6:] += 1e6  # the second sequence's last two events much later: its outputs move, the first's do not
    moved = encoder(features, offsets, timestamps=later)
    torch.testing.assert_close(moved[:3], out[:3])
    assert not torch.allclose(moved[3:], out[3:])
    with pytest.raises(ValueError, match="timestamps"):
        encoder(features, offsets)
    with pytest.raises(ValueError, match="time_buckets"):
        encoder.layers[0](torch.randn(8, 16), offsets)
    with pytest.raises(ValueError, match="relative_time_buckets"):
        HSTULayer(dim=16, num_heads=2, relative_time_buckets=0)


@pytest.mark.parametrize("relative_bias", [False, True])
def test_a_fixed_normalization_length_divides_pointwise_attention_by_it(
    relative_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``normalization_length=N``: ``silu(s) / N`` for every sequence (the HSTU reference), on the GDPA path and
    the relative-bias path alike; each sequence's own length is the default."""
    torch.manual_seed(0)
    lengths = [5, 0, 3, 7]
    offsets, x = _offsets(lengths), torch.randn(sum(lengths), 16, dtype=torch.float64)
    own = _randomized(HSTULayer(16, 2, relative_bias_length=8 if relative_bias else None)).double()
    fixed = HSTULayer(16, 2, normalization_length=12, relative_bias_length=8 if relative_bias else None).double()
    fixed.load_state_dict(own.state_dict())
    own_attn, fixed_attn = [], []
    for layer, store in ((own, own_attn), (fixed, fixed_attn)):  # the attention output, before the norm
        monkeypatch.setattr(  # rows of one head each: back to one row a token
            encoder_module, "norm_mul", lambda a, *args, store=store, **kw: store.append(a.reshape(len(x), -1)) or a
        )
        layer(x, offsets, max_seq_len=8)
    start = 0
    for length in lengths:  # the same weights, rescaled by own length / N
        rows = slice(start, start + length)
        torch.testing.assert_close(fixed_attn[0][rows], own_attn[0][rows] * (length / 12))
        start += length
    with pytest.raises(ValueError, match="normalization_length"):
        HSTULayer(16, 2, normalization_length=0)


def test_absolute_positions_and_a_fixed_normalization_make_a_causal_encoding_independent_of_what_follows() -> None:
    """With positions from the start and pointwise attention divided by a fixed length, a prefix of a history
    encodes as the prefix of its encoding (what causal next-item training needs). Recency positions count from
    the end, and a sequence's own length counts its events, so with either every encoding moves when an event
    is appended."""
    torch.manual_seed(0)
    kwargs = dict(input_dim=8, dim=16, num_layers=2, num_heads=2, max_length=6)
    variants = {
        ("absolute", True): True,
        ("recency", True): False,
        ("absolute", False): False,
    }
    features = torch.randn(9, 8)  # 9 events: positions past max_length share the last embedding
    state = None
    for (positions, fixed), invariant in variants.items():
        encoder = JaggedHistoryEncoder(**kwargs, position_encoding=positions, fixed_attention_normalization=fixed)
        if state is None:
            state = _randomized(encoder).state_dict()
        encoder.load_state_dict(state)
        encoder.eval()
        full = encoder(features, _offsets([9]))
        prefix = encoder(features[:5], _offsets([5]))
        assert torch.allclose(full[:5], prefix, atol=1e-5) == invariant, (positions, fixed)
    with pytest.raises(ValueError, match="position_encoding"):
        JaggedHistoryEncoder(**kwargs, position_encoding="rotary")


def _dense_bias_attention_before(q, k, v, offsets, bias, max_seq_len, *, activation, causal, window, scale,
                                 normalization_length, time_bias, time_buckets):  # fmt: skip
    """The encoder's own dense relative-bias attention before it became GDPA's ``score_bias`` (kept as the oracle)."""
    from lightning_gem import jagged
    from lightning_gem.ops.attention.impl.reference import POINTWISE

    num_tokens, num_heads, dim = q.shape
    lengths = jagged.offsets_to_lengths(offsets).to(torch.int64)
    size = max(1, jagged.max_length(offsets) if max_seq_len is None else max_seq_len)
    positions = torch.arange(size)
    valid_BL = positions[None, :] < lengths[:, None]
    rows_BL = (offsets[:-1, None].to(torch.int64) + positions[None, :]).clamp(max=max(num_tokens - 1, 0))

    def padded(x):
        return (x[rows_BL] * valid_BL[:, :, None, None].to(x.dtype)).transpose(1, 2)

    scores = torch.einsum("bhid,bhtd->bhit", padded(q), padded(k)).float()
    scores = scores * (1.0 / dim**0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias(size)
    if time_bias is not None:
        scores = scores + time_bias(time_buckets)
    allowed = valid_BL[:, None, :, None] & valid_BL[:, None, None, :]
    if causal:
        allowed = allowed & (positions[None, :] <= positions[:, None])
    if window is not None:
        allowed = allowed & ((positions[None, :] - positions[:, None]).abs() <= window)
    if activation == "softmax":
        weights = torch.softmax(scores.masked_fill(~allowed, -1e30), dim=-1) * allowed
    else:
        divisor = lengths.clamp_min(1)[:, None, None, None] if normalization_length is None else normalization_length
        weights = POINTWISE[activation][0](scores) / divisor
        weights = weights.masked_fill(~allowed, 0.0)
    out_BHLD = torch.einsum("bhit,bhtd->bhid", weights.to(v.dtype), padded(v))
    segment, position = jagged.segment_positions(offsets, num_tokens)
    return out_BHLD.transpose(1, 2)[segment, position]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("activation", "causal", "window", "normalization_length"),
    [("silu", True, None, None), ("silu", True, None, 12), ("softmax", True, None, None), ("gelu", False, 2, None)],
)
@pytest.mark.parametrize("biases", ["position", "time", "both"])
@pytest.mark.parametrize("max_seq_len", [None, 9])
def test_relative_bias_attention_through_gdpa_equals_the_dense_path_it_replaced(
    dtype: torch.dtype,
    activation: str,
    causal: bool,
    window: int | None,
    normalization_length: int | None,
    biases: str,
    max_seq_len: int | None,
) -> None:
    """GDPA's ``score_bias`` (``impl="padded"``) gives the outputs and gradients of the dense path the encoder
    had: bit for bit with one bias; with both, the two biases are summed before they meet the scores, so within
    fp32 rounding."""
    from lightning_gem.components.encoder import (
        RelativePositionBias,
        RelativeTimeBias,
        relative_bias_attention,
        relative_time_buckets,
    )

    torch.manual_seed(0)
    q, k, v = (x.to(dtype).requires_grad_() for x in _qkv(LENGTHS, heads=3, dim=4, seed=1))
    offsets = _offsets(LENGTHS)
    size = max(LENGTHS) if max_seq_len is None else max_seq_len
    position = RelativePositionBias(5) if biases in ("position", "both") else None
    time = RelativeTimeBias(16) if biases in ("time", "both") else None
    buckets = relative_time_buckets(torch.rand(sum(LENGTHS)) * 1e5, offsets, size, 16)
    kwargs = dict(activation=activation, causal=causal, window=window, scale=None,
                  normalization_length=normalization_length, time_bias=time, time_buckets=buckets)  # fmt: skip
    results = []
    for attention in (relative_bias_attention, _dense_bias_attention_before):
        out = attention(q, k, v, offsets, position, max_seq_len, **kwargs)
        grads = torch.autograd.grad(out.square().sum(), [q, k, v, *(b.weight for b in (position, time) if b)])
        results.append((out, *grads))
    for got, expected in zip(*results, strict=True):
        if biases == "both":  # the scores are fp32 (also for fp64 inputs): one fp32 rounding apart
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, expected)


def _compiled_against_eager(device: str, heads: int, head_dim: int, batches: list[list[int]]) -> None:
    """Two HSTU layers compiled (:func:`compile_hstu_layers`: dynamic shapes) under bf16 autocast, on jagged batches
    of different token counts: outputs and gradients (the uvqk bias's through ``silu_split``'s backward included)
    as close to the eager layers' in fp32 as the eager layers under the same autocast are, by FlashAttention's
    rule (within twice the eager bf16 error, plus a thousandth of the value's norm)."""
    import copy

    from lightning_gem.components.encoder import compile_hstu_layers

    torch.manual_seed(0)
    dim = heads * head_dim
    layers = [HSTULayer(dim, heads, attention_dim=head_dim, linear_dim=head_dim) for _ in range(2)]
    eager = _randomized(nn.ModuleList(layers)).to(device)
    compiled = copy.deepcopy(eager)
    assert len(compile_hstu_layers(compiled)) == 2

    def run(stack: nn.ModuleList, x: torch.Tensor, offsets: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
        h = inputs = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            for layer in stack:
                h = layer(h, offsets, max_seq_len=int(offsets.diff().max()), check_offsets=False)
        return [h.detach(), *torch.autograd.grad(h.float().square().mean(), [inputs, *stack.parameters()])]

    for lengths in batches:
        offsets = _offsets(lengths).to(device)
        x = torch.randn(sum(lengths), dim, device=device)
        exact, same, got = run(eager, x, offsets, False), run(eager, x, offsets, True), run(compiled, x, offsets, True)
        for name, e, s, g in zip(["out", "dx", *dict(eager.named_parameters())], exact, same, got, strict=True):
            norm = float(torch.linalg.vector_norm(e))
            budget = 2 * float(torch.linalg.vector_norm(s.float() - e)) + 1e-3 * norm
            error = float(torch.linalg.vector_norm(g.float() - e))
            assert error <= budget, (lengths, name, error, budget)


def test_compiled_layers_match_eager_ones() -> None:
    """``compile_layers``' graphs on CPU (the layers' reference ops traced): as close to fp32 as the eager layers."""
    _compiled_against_eager("cpu", 2, 16, [[30, 0, 1, 17], [40, 3], [7] * 5])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 256])
def test_compiled_layers_match_eager_ones_gpu(head_dim: int) -> None:
    """``compile_layers``' graphs with the kit's kernels traced in (GDPA, ``silu_split`` with the projection's bias,
    the fused norms) on a GPU, at head dim 256 as in NVIDIA's HSTU configuration (4 heads x 256) and at 64:
    the same outputs and gradients as the eager layers over jagged batches of three token counts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _compiled_against_eager("cuda", 4, head_dim, [[300, 0, 1, 517, 64], [1000, 3], [77] * 9])
