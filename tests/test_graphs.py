"""ShapeGraphs: one capture per call signature, the bound call's arguments, and where it runs the module as it is.
The captures themselves need a GPU (the GPU test in tests/components/test_components_ranker.py); here a stand-in
capture returns the bound module, so what is checked is which calls would replay which graph."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from lightning_gem.graphs import ShapeGraphs
from lightning_gem.ops._launch import next_power_of_2


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: Tensor, offsets: Tensor, *, extra: Tensor | None = None, power: int = 1) -> Tensor:
        out = (x * self.weight) ** power + offsets[-1]
        return out if extra is None else out + extra


class _Counted(ShapeGraphs):
    """Captures nothing: the 'graph' is the bound module itself, and each capture is recorded."""

    def __init__(self, module: nn.Module, **kwargs: object) -> None:
        super().__init__(module, **kwargs)
        self.captured: list[tuple] = []

    def _capture(self, bound, tensors):
        self.captured.append(tuple(tuple(t.shape) for t in tensors))
        return bound


def test_one_capture_per_signature() -> None:
    module = _Scaled()
    graphs = _Counted(module)
    x, offsets = torch.randn(4, requires_grad=True), torch.tensor([0, 4])
    graphs(x, offsets)
    graphs(torch.randn(4, requires_grad=True), torch.tensor([0, 3]))  # same shapes and arguments: replayed
    assert graphs.num_graphs == 1
    graphs(torch.randn(8, requires_grad=True), offsets)  # a new token count
    graphs(x, offsets, power=2)  # another value of a non-tensor argument
    graphs(x.detach(), offsets)  # requires_grad differs
    graphs(x, offsets, extra=torch.ones(4))  # one more tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast: the CUDA autocast state is unchanged
        graphs(x, offsets)
    assert graphs.num_graphs == 5
    assert graphs.captured[0] == ((4,), (2,))


class _StaticGradient(torch.autograd.Function):
    """``x * weight`` whose backward returns views of buffers it owns and overwrites on every call, as a replayed
    graph's backward does."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, buffers: tuple[Tensor, Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.buffers = buffers
        return x * weight

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = ctx.buffers
        grad_x.copy_(grad * weight)
        grad_weight.copy_((grad * x).sum())
        return grad_x.detach(), grad_weight.detach(), None


class _StaticBuffers(ShapeGraphs):
    """Each 'capture' is ``_StaticGradient`` with buffers of its own."""

    def _capture(self, bound, tensors):
        buffers = (torch.zeros_like(tensors[0]), torch.zeros(()))
        return lambda x, offsets: _StaticGradient.apply(x, self.module.weight, buffers) + offsets[-1]


@pytest.mark.parametrize("order", ["after the step", "after the forward"])
def test_gradients_set_to_none_train_as_eager(order: str) -> None:
    """A replay's parameter gradient is a view of the graph's buffer (kept as ``.grad`` when the parameter had none)
    that the next replay overwrites. Gradients set to None after each step, or between the forward and the backward
    (Lightning's order), give eager mode's gradients."""
    results = []
    for graphs in (None, _StaticBuffers(_Scaled())):
        module = _Scaled() if graphs is None else graphs.module
        call = module if graphs is None else graphs
        grads = []
        for step in range(3):
            x = torch.full((4,), float(step + 1), requires_grad=True)
            loss = call(x, torch.tensor([0, 4])).sum()
            if order == "after the forward":
                module.weight.grad = None
            loss.backward()
            grads.append(module.weight.grad.clone())
            if order == "after the step":
                module.weight.grad = None
        results.append(grads)
    assert results[1] == results[0] == [torch.tensor(4.0 * (step + 1)) for step in range(3)]


@pytest.mark.parametrize("zero", ["in place", "accumulate"])
def test_gradients_held_at_a_replays_backward_are_refused(zero: str) -> None:
    """Gradients zeroed in place or accumulated would meet the graph's buffers: the second backward raises, naming
    the fix, before the graph's backward runs."""
    graphs = _StaticBuffers(_Scaled())
    graphs(torch.ones(4, requires_grad=True), torch.tensor([0, 4])).sum().backward()
    if zero == "in place":
        graphs.module.weight.grad.zero_()
    loss = graphs(torch.ones(4, requires_grad=True), torch.tensor([0, 4])).sum()
    with pytest.raises(RuntimeError, match="set_to_none=True"):
        loss.backward()


def test_bound_call_takes_the_tensors_and_keeps_the_rest() -> None:
    """What a graph would run: the module with the call's non-tensor arguments fixed and its tensors fed in
    order; outputs and gradients are the module's."""
    torch.manual_seed(0)
    module = _Scaled()
    graphs = _Counted(module)
    x, offsets, extra = torch.randn(5, requires_grad=True), torch.tensor([0, 2, 5]), torch.randn(5)
    out = graphs(x, offsets, extra=extra, power=3)
    (grad_x, grad_w) = torch.autograd.grad(out.sum(), (x, module.weight))
    want = module(x, offsets, extra=extra, power=3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close((grad_x, grad_w), torch.autograd.grad(want.sum(), (x, module.weight)))
    assert list(graphs.captured) == [((5,), (3,), (5,))]


def test_eval_no_grad_and_full_run_the_module_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    module = _Scaled()
    graphs = _Counted(module, max_graphs=2)
    x, offsets = torch.randn(3, requires_grad=True), torch.tensor([0, 3])
    with torch.no_grad():
        graphs(x, offsets)
    module.eval()
    graphs(x, offsets)
    module.train()
    assert graphs.num_graphs == 0
    graphs(x, offsets)
    graphs(torch.randn(4), offsets)
    with caplog.at_level(logging.WARNING, logger="lightning_gem.graphs"):
        out = graphs(torch.randn(6), offsets)  # a third signature: eager, said once
        graphs(torch.randn(7), offsets)
    assert graphs.num_graphs == 2
    assert out.shape == (6,)
    assert [r.message for r in caplog.records].count(
        "ShapeGraphs(_Scaled): 2 signatures captured (max_graphs); new ones run eagerly (fewer distinct shapes: pad "
        "to buckets, e.g. GEMRanker(token_growth=...))"
    ) == 1


def test_capture_needs_cuda_tensors() -> None:
    graphs = ShapeGraphs(_Scaled())
    with pytest.raises(ValueError, match=r"CUDA graphs need CUDA tensors: _Scaled got \['cpu'\]"):
        graphs(torch.randn(3, requires_grad=True), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="max_graphs"):
        ShapeGraphs(_Scaled(), max_graphs=0)


def test_length_hints_round_up_to_powers_of_two() -> None:
    """The rounding cuda_graphs applies to length hints (ops._launch.next_power_of_2)."""
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65, 4096, 4097)] == [1, 1, 2, 4, 8, 64, 128, 4096, 8192]


def test_symbolic_tracing_traces_the_module() -> None:
    """A symbolic trace (as a train pipeline's model rewrite makes) goes through the module itself."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _Scaled()
            self.__dict__["graphs"] = _Counted(self.inner)

        def forward(self, x: Tensor, offsets: Tensor) -> Tensor:
            return self.graphs(x, offsets, power=2)

    outer = Outer()
    traced = torch.fx.symbolic_trace(outer)
    assert outer.graphs.num_graphs == 0
    x, offsets = torch.randn(3), torch.tensor([0, 3])
    torch.testing.assert_close(traced(x, offsets), outer.inner(x, offsets, power=2))


def test_dispatch_modes_run_the_module() -> None:
    """Under a FLOP counter (a dispatch mode) nothing is captured: the counter sees the module's own operations."""
    from torch.utils.flop_counter import FlopCounterMode

    graphs = _Counted(nn.Linear(4, 4))
    with FlopCounterMode(display=False) as counter:
        graphs(torch.randn(2, 4, requires_grad=True))
    assert graphs.num_graphs == 0 and counter.get_total_flops() == 2 * 2 * 4 * 4


def test_a_copy_starts_without_graphs() -> None:
    """deepcopy (and pickle) of a model holding ShapeGraphs: the copy calls its own module and has captured nothing."""
    import copy

    graphs = _Counted(_Scaled())
    graphs(torch.randn(3, requires_grad=True), torch.tensor([0, 3]))
    clone = copy.deepcopy(graphs)
    assert graphs.num_graphs == 1 and clone.num_graphs == 0
    assert clone.module is not graphs.module and clone._params == [clone.module.weight]


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["after the step", "after the forward"])
def test_captured_steps_train_as_eager_gpu(order: str) -> None:
    """Captured and replayed on a GPU (two signatures, each replayed): the losses and parameters of six AdamW steps
    equal eager mode's, with the gradients set to None after the optimizer's step or between the forward and the
    backward (Lightning's order); zeroing them in place instead is refused at the next backward."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).cuda()
    results = []
    for graphed in (False, True):
        module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).cuda()
        module.load_state_dict(eager.state_dict())
        call = ShapeGraphs(module) if graphed else module
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        losses = []
        for step in range(6):
            generator = torch.Generator("cuda").manual_seed(step)
            x = torch.randn(8 if step % 2 else 4, 16, device="cuda", generator=generator)
            loss = call(x.requires_grad_()).square().mean()
            if order == "after the forward":
                optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if order == "after the step":
                optimizer.zero_grad()
            losses.append(loss.item())
        if graphed:
            assert call.num_graphs == 2
            optimizer.zero_grad(set_to_none=False)
            with pytest.raises(RuntimeError, match="set_to_none=True"):
                call(x).sum().backward()
        results.append((losses, [p.detach().clone() for p in module.parameters()]))
    (losses, params), (losses_g, params_g) = results
    assert losses_g == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for p, q in zip(params, params_g, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
