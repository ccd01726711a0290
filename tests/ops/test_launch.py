"""Which launches may skip ``torch.library.wrap_triton`` (``lightning_gem.ops._launch.plain_eager``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_gem.ops._launch import plain_eager


class _Subclass(torch.Tensor):
    """A tensor subclass, as DTensor or a fake tensor is: it must go through ``wrap_triton``."""


def test_plain_tensors_and_parameters_launch_directly() -> None:
    x, weight = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 8))
    assert plain_eager((x, weight, 3, None, "rows"))
    assert not plain_eager((x, x.as_subclass(_Subclass)))
    assert not plain_eager((torch.nn.Parameter(x.as_subclass(_Subclass)),))


def test_dispatch_modes_and_compilers_see_the_launch() -> None:
    x = torch.randn(4, 8)
    with FlopCounterMode(display=False):
        assert not plain_eager((x,))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t: torch.Tensor) -> torch.Tensor:
        seen.append(plain_eager((t,)))
        return t + 1

    traced(x)
    assert seen == [False]


def _scaled_add():  # noqa: ANN202
    """A small kernel with every kind of argument Triton specializes: pointers, ints, a float, a constexpr."""
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add(X, Y, OUT, num, stride, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < num
        x = tl.load(X + offs * stride, mask=ok)
        y = tl.load(Y + offs * stride, mask=ok)
        tl.store(OUT + offs * stride, x + alpha * y, mask=ok)

    return scaled_add


@pytest.mark.gpu
def test_direct_launch_matches_the_jit_launcher_on_a_gpu() -> None:
    """Kernels launched again skip Triton's JIT launcher, for each specialization of their arguments: aligned and
    unaligned pointers, an int equal to 1, divisible by 16 or neither; each launch computes what torch does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import triton

    from lightning_gem.ops import _launch

    kernel = _scaled_add()
    if _launch.is_interpreted(kernel):
        pytest.skip("needs compiled (not interpreted) Triton kernels")
    base = torch.randn(3, 4099, device="cuda")
    before = len(_launch._COMPILED)
    for _ in range(2):  # the second round launches every variant directly
        for offset, num, stride in ((0, 4096, 1), (1, 4000, 1), (0, 17, 1), (3, 1, 1), (0, 2000, 2)):
            x, y = base[0, offset:], base[1, offset:]
            out = torch.full_like(base[2], float("nan"))[offset:]
            alpha = float(torch.rand(()))
            grid = (triton.cdiv(num, 128),)
            _launch.launch(kernel, grid, (x, y, out, num, stride, alpha), {"BLOCK": 128, "num_warps": 4})
            expected = x[: num * stride : stride] + alpha * y[: num * stride : stride]
            torch.testing.assert_close(out[: num * stride : stride], expected)
    assert len(_launch._COMPILED) - before == 5  # one entry per specialization, reused in the second round
