"""Which launches may skip ``torch.library.wrap_triton`` (``lightning_gem.ops._launch.plain_eager``)."""

from __future__ import annotations

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
