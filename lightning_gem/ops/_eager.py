"""Whether a kernel launch is plain eager work: shared by the Triton launchers of every op family."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plain_eager(args: Sequence[object]) -> bool:
    """No compiler and no dispatch mode (fake, functional or FLOP-counting tensors) sees this call, and every
    tensor argument is a plain tensor: a launcher may then call its kernel directly instead of through
    ``torch.library.wrap_triton``, whose wrappers only cost host time outside tracing."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))
