"""GDPAInteraction and MultiTaskHead: shapes, empty users, target-awareness, ESMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning_gem.components.heads import MultiTaskHead
from lightning_gem.components.interaction import GDPAInteraction

HISTORY = [0, 1, 4, 3, 0]
CANDIDATES = [2, 0, 3, 1, 1]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _inputs(dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    history = torch.randn(sum(HISTORY), dim, generator=g)
    candidates = torch.randn(sum(CANDIDATES), dim, generator=g)
    context = torch.randn(len(HISTORY), 2, dim, generator=g)
    return candidates, _offsets(CANDIDATES), history, _offsets(HISTORY), context


@pytest.mark.parametrize("self_interaction", [False, True])
def test_interaction_shapes_and_gradients(self_interaction: bool) -> None:
    torch.manual_seed(0)
    interaction = GDPAInteraction(
        16, 2, self_interaction=self_interaction, num_context_tokens=2 if self_interaction else 0
    )
    candidates, cand_offsets, history, hist_offsets, context = _inputs(16)
    candidates.requires_grad_(True)
    history.requires_grad_(True)
    out = interaction(candidates, cand_offsets, history, hist_offsets, context=context if self_interaction else None)
    assert out.shape == candidates.shape and torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(candidates.grad).all() and torch.isfinite(history.grad).all()
    assert history.grad.abs().sum() > 0
    for name, param in interaction.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_interaction_with_no_candidates_at_all() -> None:
    interaction = GDPAInteraction(8, 2, self_interaction=True, num_context_tokens=1)
    out = interaction(
        torch.zeros(0, 8),
        torch.zeros(3, dtype=torch.int64),
        torch.randn(4, 8),
        _offsets([1, 3]),
        context=torch.randn(2, 1, 8),
    )
    assert out.shape == (0, 8)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_a_candidate_sees_only_its_own_user_and_not_other_candidates(self_interaction: bool) -> None:
    torch.manual_seed(0)
    interaction = GDPAInteraction(
        16, 2, self_interaction=self_interaction, num_context_tokens=2 if self_interaction else 0
    )
    interaction.eval()
    candidates, cand_offsets, history, hist_offsets, context = _inputs(16)
    ctx = context if self_interaction else None
    together = interaction(candidates, cand_offsets, history, hist_offsets, context=ctx)
    # user 2 (history 4, candidates 3), scored one candidate at a time, alone in its batch
    h_start, h_end = int(hist_offsets[2]), int(hist_offsets[3])
    for c in range(int(cand_offsets[2]), int(cand_offsets[3])):
        alone = interaction(
            candidates[c : c + 1],
            _offsets([1]),
            history[h_start:h_end],
            _offsets([h_end - h_start]),
            context=context[2:3] if self_interaction else None,
        )
        torch.testing.assert_close(together[c : c + 1], alone, atol=1e-5, rtol=1e-5)


def test_empty_history_reads_nothing() -> None:
    torch.manual_seed(0)
    interaction = GDPAInteraction(8, 2).eval()
    candidates = torch.randn(2, 8)
    out = interaction(candidates, _offsets([2]), torch.zeros(0, 8), _offsets([0]))
    # attended = 0 -> attention_output bias only
    x = candidates + interaction.attention_output.bias
    torch.testing.assert_close(out, x + interaction.mlp(interaction.mlp_norm(x)))


def test_interaction_errors() -> None:
    with pytest.raises(ValueError, match="self_interaction"):
        GDPAInteraction(8, 2, num_context_tokens=1)
    interaction = GDPAInteraction(8, 2, self_interaction=True, num_context_tokens=1)
    with pytest.raises(ValueError, match="context"):
        interaction(torch.randn(1, 8), _offsets([1]), torch.randn(1, 8), _offsets([1]))
    with pytest.raises(ValueError, match="candidates"):
        interaction(torch.randn(1, 4), _offsets([1]), torch.randn(1, 8), _offsets([1]), context=torch.randn(1, 1, 8))


def test_multitask_head_shapes_and_esmm() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    head = MultiTaskHead(8, tasks=("ctr", "cvr", "like"), hidden_dims=(16, 8))
    assert head(x).shape == (5, 3)
    esmm = MultiTaskHead(8, tasks=("ctr", "cvr"), esmm=True)
    raw = esmm.tower_logits(x)
    logits = esmm(x)
    torch.testing.assert_close(logits[:, 0], raw[:, 0])
    torch.testing.assert_close(torch.sigmoid(logits[:, 1]), torch.sigmoid(raw[:, 0]) * torch.sigmoid(raw[:, 1]))
    # extreme tower outputs keep finite logits and gradients
    extreme = MultiTaskHead(1, tasks=("ctr", "cvr"), hidden_dims=(), esmm=True)
    inputs = torch.tensor([[1e4], [-1e4], [0.0]], requires_grad=True)
    out = extreme(inputs)
    F.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
    assert torch.isfinite(out).all() and torch.isfinite(inputs.grad).all()
    with pytest.raises(ValueError, match="esmm"):
        MultiTaskHead(8, tasks=("click",), esmm=True)


@pytest.mark.parametrize("esmm", [False, True])
def test_head_logits_are_fp32_under_bf16_autocast(esmm: bool) -> None:
    """The towers' hidden layers follow autocast; their last Linear (``width x 1``) does not, so logits keep fp32
    resolution (bf16 ones would tie many predictions in AUC) and equal an fp32 last layer on the same hidden."""
    torch.manual_seed(0)
    head = MultiTaskHead(16, tasks=("ctr", "cvr"), hidden_dims=(32,), esmm=esmm)
    x = torch.randn(4096, 16)
    with torch.autocast("cpu", torch.bfloat16):
        logits = head(x)
        hidden = {task: tower[:-1](x) for task, tower in head.towers.items()}
    assert logits.dtype == torch.float32
    assert hidden["ctr"].dtype == torch.bfloat16  # the hidden layers still run in bf16
    raw = torch.cat([tower[-1](hidden[task].float()) for task, tower in head.towers.items()], dim=1)
    torch.testing.assert_close(raw[:, 0], logits[:, 0])
    assert logits[:, 0].unique().numel() > 4000  # distinct predictions, not bf16's few thousand values


@pytest.mark.parametrize("num_context_tokens", [0, 3, 31])
def test_token_interaction_fused_matches_reference(num_context_tokens: int) -> None:
    """The interaction on the Triton path (fused token attention and pairwise dots, under Triton's interpreter on CPU)
    against the same weights on the reference path (PyTorch's matmuls): outputs and every gradient. 33 tokens a
    candidate are past the kernels' limit: the Triton interaction takes PyTorch's ops there, not an error."""
    from lightning_gem.ops._launch import is_interpreted
    from lightning_gem.ops.pointwise.impl.triton.token_kernels import _token_attention_fwd_kernel

    if not (torch.cuda.is_available() or is_interpreted(_token_attention_fwd_kernel)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    kwargs = {"self_interaction": True, "num_context_tokens": num_context_tokens}
    fused = GDPAInteraction(24, 2, attention_impl="triton", **kwargs).to(device)
    for p in fused.parameters():  # random weights (and biases) so every term of the token interaction matters
        torch.nn.init.normal_(p, std=0.3)
    plain = GDPAInteraction(24, 2, attention_impl="reference", **kwargs).to(device)
    plain.load_state_dict(fused.state_dict())
    candidates, cand_offsets, history, hist_offsets, _ = _inputs(24)
    context = torch.randn(len(HISTORY), num_context_tokens, 24) if num_context_tokens else None
    outs, grads = [], []
    for interaction in (fused, plain):
        leaves = [t.clone().to(device).requires_grad_() for t in (candidates, history)]
        extra = {"context": context.to(device).requires_grad_()} if context is not None else {}
        out = interaction(leaves[0], cand_offsets.to(device), leaves[1], hist_offsets.to(device), **extra)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(
            [*(t.grad for t in leaves), *(t.grad for t in extra.values()), *(p.grad for p in interaction.parameters())]
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_every_norm_before_a_linear_goes_through_norm_for_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The query, history, token and MLP norms each feed a Linear through ``norm_for_linear`` (under autocast: the
    norm written in the Linear's dtype in one pass), with the interaction's pointwise impl; the mix norm, whose output
    is a token besides a Linear's input, does not."""
    import lightning_gem.components.interaction as interaction_module

    seen = []

    def spy(module, x, impl="auto"):
        seen.append((module, impl))
        return module(x)

    monkeypatch.setattr(interaction_module, "norm_for_linear", spy)
    interaction = GDPAInteraction(24, 2, self_interaction=True, num_context_tokens=1, attention_impl="reference")
    candidates, cand_offsets, history, hist_offsets, _ = _inputs(24)
    interaction(candidates, cand_offsets, history, hist_offsets, context=torch.randn(len(HISTORY), 1, 24))
    norms = [interaction.query_norm, interaction.history_norm, interaction.token_norm, interaction.mlp_norm]
    assert [module for module, _ in seen] == norms
    assert {impl for _, impl in seen} == {"reference"}


def test_pointwise_impl_picks_the_token_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pointwise_impl`` overrides the impl beside the attention's: ``"reference"`` keeps the token interaction on
    PyTorch's matmuls (the fused ops are never called), ``"triton"`` sends it to the fused ops; a bad value raises."""
    import lightning_gem.components.interaction as module

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("impl"))
        return real(*args, **kwargs)

    real = module.token_attention
    monkeypatch.setattr(module, "token_attention", spy)
    candidates, cand_offsets, history, hist_offsets, _ = _inputs(24)
    for pointwise, expected in (("reference", []), ("auto", ["auto"])):
        calls.clear()
        options = {"self_interaction": True, "attention_impl": "reference", "pointwise_impl": pointwise}
        interaction = GDPAInteraction(24, 2, **options)
        interaction(candidates, cand_offsets, history, hist_offsets)
        assert calls == expected, pointwise
    with pytest.raises(ValueError, match="pointwise_impl"):
        GDPAInteraction(24, 2, pointwise_impl="cuda")
