"""Analytic FLOPs (linear layers, GDPA, the HSTU cost model) against torch's FlopCounterMode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from lightning_gem.components import GEMRanker, JaggedHistoryEncoder
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_gem.data.synthetic import SyntheticRankingSource
from lightning_gem.flops import attention_cost_coefficients, gdpa_flops, linear_flops, model_flops, peak_tflops


def test_linear_flops_matches_the_counter() -> None:
    layer = nn.Linear(7, 5)
    x = torch.randn(11, 7, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    assert counter.get_total_flops() == linear_flops(11, 7, 5) + linear_flops(11, 7, 5, backward=True)
    assert linear_flops(0, 7, 5, backward=True) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        linear_flops(-1, 7, 5)


# (q lengths, kv lengths or None, kv_index, num_targets, mask rules) -> allowed pairs, counted by hand
PAIRS_BY_HAND = [
    ([3, 0, 4], None, None, None, dict(causal=True), 6 + 10),
    ([3, 0, 4], None, None, None, dict(), 9 + 16),
    ([3, 0, 4], None, None, None, dict(causal=True, window=1), (1 + 2 + 2) + (1 + 2 + 2 + 2)),
    ([3, 0, 4], None, None, None, dict(block_size=2), (4 + 1) + (4 + 4)),
    # history 2 each: history rows see 1 and 2 keys, every target the history and itself (3)
    ([3, 0, 4], None, None, [1, 0, 2], dict(causal=True), (1 + 2 + 3) + 0 + (1 + 2 + 3 + 3)),
    # cross, bottom-right aligned: 2 queries over 3 keys see 2 and 3 of them; none over an empty kv segment
    ([2, 1], [3, 0], None, None, dict(causal=True), 2 + 3),
    # both query segments over kv segment 0 (3 keys), bidirectional
    ([2, 1], [3, 0], [0, 0], None, dict(), 2 * 3 + 1 * 3),
]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()])


@pytest.mark.parametrize(("q_lengths", "kv_lengths", "kv_index", "num_targets", "mask", "pairs"), PAIRS_BY_HAND)
def test_gdpa_flops_counts_the_allowed_pairs(q_lengths, kv_lengths, kv_index, num_targets, mask, pairs) -> None:
    """``2 H (D + Dv)`` a pair forward and ``2 H (3 D + 2 Dv)`` backward, over pairs counted by hand; and it is the
    formula the FLOP counter uses for the GDPA op (re-exported from ``ops.attention.ops``)."""
    from lightning_gem.ops import gdpa
    from lightning_gem.ops.attention import ops

    assert gdpa_flops is ops.gdpa_flops
    heads, dim, dim_v = 2, 4, 3
    q_offsets = _offsets(q_lengths)
    kv_offsets = q_offsets if kv_lengths is None else _offsets(kv_lengths)
    kv_index = None if kv_index is None else torch.tensor(kv_index)
    num_targets = None if num_targets is None else torch.tensor(num_targets)
    q = torch.randn(sum(q_lengths), heads, dim, requires_grad=True)
    k, v = (torch.randn(int(kv_offsets[-1]), heads, d, requires_grad=True) for d in (dim, dim_v))
    jagged = (q_offsets, kv_offsets, kv_index, num_targets)
    assert gdpa_flops(q, k, v, *jagged, **mask) == 2 * pairs * heads * (dim + dim_v)
    assert gdpa_flops(q, k, v, *jagged, **mask, backward=True) == 2 * pairs * heads * (3 * dim + 2 * dim_v)
    with FlopCounterMode(display=False) as counter:
        out = gdpa(q, k, v, q_offsets, None if kv_lengths is None else kv_offsets, kv_index=kv_index,
                   num_targets=num_targets, impl="reference", **mask)  # fmt: skip
        out.sum().backward()
    assert counter.get_total_flops() == 2 * pairs * heads * (4 * dim + 3 * dim_v)


def _synthetic_batch(num_users: int = 8):
    source = SyntheticRankingSource(
        num_items=100,
        num_train_users=16,
        num_val_users=4,
        num_test_users=4,
        max_history_length=32,
        max_candidates=8,
        mean_candidates=4.0,
    )
    dataset = source.dataset("train")
    return source.schema, source.collate([dataset[i] for i in range(num_users)])


def _analytic_ranker_flops(model: GEMRanker, batch) -> tuple[int, int]:
    """(linear, gdpa) training FLOPs: Linear shapes from forward hooks, GDPA pairs from the batch offsets."""
    linear = 0

    def hook(module: nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal linear
        x = inputs[0]
        tokens = x.numel() // module.in_features
        # The backward computes the input's gradient only when the input needs one (not for dense features).
        linear += linear_flops(tokens, module.in_features, module.out_features) + linear_flops(
            tokens, module.in_features, module.out_features, backward=x.requires_grad
        )

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        model(batch)
    finally:
        for handle in handles:
            handle.remove()

    hp, hist, cand = model.hparams, batch.history_offsets(), batch.candidate_offsets()
    heads, head_dim = hp.num_heads, hp.model_dim // hp.num_heads
    t_hist, t_cand = int(hist[-1]), int(cand[-1])
    q_hist = torch.empty(t_hist, heads, head_dim)
    q_cand = torch.empty(t_cand, heads, head_dim)
    attention = 0
    for backward in (False, True):
        per_layer = gdpa_flops(
            q_hist, q_hist, q_hist, hist, hist, None, None, causal=True, window=None, block_size=None, backward=backward
        )
        attention += hp.num_layers * per_layer
        attention += gdpa_flops(
            q_cand,
            q_hist,
            q_hist,
            cand,
            hist,
            None,
            None,
            causal=False,
            window=None,
            block_size=None,
            backward=backward,
        )
    return linear, attention


def test_model_flops_of_a_ranker_agrees_with_the_analytic_sum() -> None:
    torch.manual_seed(0)
    schema, batch = _synthetic_batch()
    # self_interaction=False: the per-candidate token attention (SDPA + einsum) is not in the analytic sum.
    model = GEMRanker(
        schema, embedding_dim=8, model_dim=16, num_layers=2, num_heads=2, head_hidden_dims=(16,), self_interaction=False
    )
    measured = model_flops(model, batch)
    linear, attention = _analytic_ranker_flops(model, batch)
    assert attention > 0 and linear > 0
    assert abs(measured - (linear + attention)) <= 0.01 * measured, (measured, linear, attention)
    assert model_flops(model, batch, backward=False) < measured


def test_lightning_measure_flops_counts_the_custom_attention_ops() -> None:
    from lightning.fabric.utilities.throughput import measure_flops

    torch.manual_seed(0)
    schema, batch = _synthetic_batch()
    model = GEMRanker(schema, embedding_dim=8, model_dim=16, num_layers=2, num_heads=2, head_hidden_dims=(16,))
    counted = measure_flops(model, lambda: model(batch), lambda out: out.sum())
    assert counted == model_flops(model, batch)
    # GDPA (encoder and interaction) is part of it, as model_flops counts it (see the test above).
    _, attention = _analytic_ranker_flops(model, batch)
    assert attention > 0 and counted > attention


def test_attention_cost_coefficients_match_an_encoder_stack() -> None:
    torch.manual_seed(0)
    dim, num_layers, lengths = 16, 2, [5, 0, 9, 1]
    encoder = JaggedHistoryEncoder(None, dim, num_layers, num_heads=2, max_length=16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    features = torch.randn(int(offsets[-1]), dim)
    with FlopCounterMode(display=False) as counter:
        out = encoder(features, offsets)
        torch.autograd.grad(out.sum(), [p for p in encoder.parameters()], allow_unused=True)
    a, b = attention_cost_coefficients(dim, num_layers, num_heads=2)
    assert counter.get_total_flops() == pytest.approx(sum(a * n + b * n * n for n in lengths), rel=1e-9)
    a_fwd, b_fwd = attention_cost_coefficients(dim, num_layers, backward=False)
    assert a_fwd < a and b_fwd < b


def test_encoder_sample_cost_model_is_its_training_flops() -> None:
    torch.manual_seed(0)
    lengths = [7, 0, 12, 1]
    encoder = JaggedHistoryEncoder(24, 16, 3, num_heads=4, max_length=16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    features = torch.randn(int(offsets[-1]), 24, requires_grad=True)  # embeddings: they need gradients
    with FlopCounterMode(display=False) as counter:
        encoder(features, offsets).sum().backward()
    cost = encoder.sample_cost_model()
    assert counter.get_total_flops() == pytest.approx(float(cost(np.array(lengths)).sum()), rel=1e-9)
    assert encoder.sample_cost_model(backward=False).b < cost.b


def test_peak_table() -> None:
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("NVIDIA H200", table={"H200": 1.0}) == 1.0
    assert peak_tflops("cpu") is None
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops("Some Unknown GPU") is None


def test_matmul_counter_reads_formulas_registered_after_it_was_made() -> None:
    """An op module imported inside the counted region (GDPA's kernels load on their first call) still counts."""
    from torch.utils.flop_counter import flop_registry

    from lightning_gem.flops import MatmulFlopCounter

    lib = torch.library.Library("lightning_gem_flops_test", "FRAGMENT")
    lib.define("double_mm(Tensor a, Tensor b) -> Tensor")
    lib.impl("double_mm", lambda a, b: (a @ b) * 2, "CompositeExplicitAutograd")
    op = torch.ops.lightning_gem_flops_test.double_mm
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    with MatmulFlopCounter() as counter:
        flop_registry[op] = lambda a, b, out_val=None: 1000  # registered once the counter is running
        try:
            out = op(a, b)
        finally:
            del flop_registry[op]
    assert counter.flops == 1000
    torch.testing.assert_close(out, (a @ b) * 2)


def test_matmul_counter_runs_higher_order_ops() -> None:
    """Higher-order ops (Triton kernel wrappers on CUDA, control flow) run as called under the counter."""
    from lightning_gem.flops import MatmulFlopCounter

    x = torch.randn(4, 4)
    with MatmulFlopCounter() as counter:
        y = torch.cond(x.sum() > 0, lambda t: t @ t, lambda t: t + 1, (x,))
        z = x @ x
    torch.testing.assert_close(y, x @ x if x.sum() > 0 else x + 1)
    torch.testing.assert_close(z, x @ x)
    assert counter.flops == 2 * 4 * 4 * 4  # the plain matmul; what runs inside the higher-order op is not counted


def test_counting_a_compiled_module_leaves_it_compiled() -> None:
    """A module compiled with ``torch.compile`` and run once under the counter (eagerly, with exact FLOPs) compiles
    on its next call outside: a dispatch mode alone would make Dynamo skip its frame for good."""
    from lightning_gem.flops import MatmulFlopCounter

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).relu()

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    module = Block()
    module.compile(backend=backend)
    x = torch.randn(3, 4)
    with MatmulFlopCounter() as counter:
        expected = module(x)
    assert counter.flops == linear_flops(3, 4, 8)
    assert graphs == []  # counted eagerly
    torch.testing.assert_close(module(x), expected)
    assert len(graphs) == 1
