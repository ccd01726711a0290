"""How every op family's Triton kernels are launched: directly in plain eager mode, through
``torch.library.wrap_triton`` where a compiler or dispatch mode traces the call, and compiled only under
:func:`compile_only`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from lightning_gem.ops._device import device_capability

__all__ = [
    "cdiv",
    "compile_only",
    "device_capability",
    "dot_precision",
    "is_interpreted",
    "keep_opaque_when_interpreted",
    "launch",
    "next_power_of_2",
    "plain_eager",
    "records_graph",
    "resolve_triton_impl",
]

_COMPILE_ONLY: ContextVar[bool] = ContextVar("lightning_gem_compile_only", default=False)


def plain_eager(args: Sequence[object]) -> bool:
    """No compiler and no dispatch mode (fake, functional or FLOP-counting tensors) sees this call, and every
    tensor argument is a plain tensor or parameter (no tensor subclass): a launcher may then call its kernel
    directly instead of through ``torch.library.wrap_triton``, whose wrappers only cost host time outside
    tracing (docs/benchmarks.md#host-time-per-call)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    for a in args:  # a loop, not all() over a generator: launches pass some thirty arguments
        if type(a) not in _PLAIN_ARGS and isinstance(a, torch.Tensor):
            return False
    return True


def records_graph(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a call on ``tensors``: grad mode on and one of them requiring grad, or a
    forward-mode AD level open (a dual tensor would carry a tangent the kernels cannot; the Function says so)."""
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a weight passed as it is (FSDP2's unsharded ones too)
_PLAIN_ARGS = frozenset((*_PLAIN, int, float, bool, str, type(None)))  # the types a launch passes, settled at once


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a launch grid, in plain Python (Triton's own is a constexpr function: slower on the host)."""
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 inputs (not TF32), native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    """The power of two at or above ``n`` (1 for ``n <= 1``), in plain Python."""
    return 1 << max(int(n) - 1, 0).bit_length()


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it was defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def keep_opaque_when_interpreted(kernel: object, *ops: object) -> None:
    """Where ``kernel`` runs in Triton's interpreter (CPU tests), keep ``ops`` (``triton_op`` s of its family) opaque
    nodes under AOT autograd's tracing (``FunctionalTensorMode``), run eagerly. A ``triton_op`` decomposes into its
    kernels there through ``wrap_triton``, which cannot wrap interpreted kernels: the decomposition would trace only
    the allocations."""
    if not is_interpreted(kernel):
        return
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    for op in ops:
        op.register_torch_dispatch(FunctionalTensorMode, _keep_opaque)  # type: ignore[attr-defined]


def _keep_opaque(mode, op, types, args, kwargs):
    return mode.__torch_dispatch__(op, types, args, kwargs)


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_triton_impl(impl: str, impls: Sequence[str], x: torch.Tensor, kernel: Callable[[], object]) -> str:
    """``"reference"`` or ``"triton"`` for an op family's ``impl`` (one of ``impls``) and input ``x``: ``"auto"`` takes
    Triton for CUDA tensors of float16, bfloat16 or float32 and the reference otherwise; ``"triton"`` raises for
    other dtypes, and off CUDA unless ``kernel()`` (one of the family's kernels, imported on demand) runs in Triton's
    interpreter. A named impl never falls back."""
    if impl not in impls:
        raise ValueError(f"`impl` must be one of {tuple(impls)}, got {impl!r}")
    if impl == "auto":
        return "triton" if x.device.type == "cuda" and x.dtype in _TRITON_DTYPES else "reference"
    if impl == "triton":
        if x.dtype not in _TRITON_DTYPES:
            raise TypeError(f"impl='triton' takes float16, bfloat16 or float32 inputs, got {x.dtype}")
        if x.device.type != "cuda" and not is_interpreted(kernel()):
            raise ValueError(
                f"impl='triton' needs CUDA tensors, got {x.device} (on CPU the kernels run only under "
                "TRITON_INTERPRET=1, set before Triton is imported)"
            )
    return impl


@contextmanager
def compile_only() -> Iterator[None]:
    """Inside, :func:`launch` compiles its kernel (``kernel.warmup``) and launches nothing."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


@torch.compiler.disable
def launch(kernel: object, grid: object, args: Sequence[object], meta: dict[str, object]) -> None:
    """``kernel[grid](*args, **meta)``: directly in plain eager mode, else through ``wrap_triton``.

    Through ``wrap_triton`` compiled kernels go into traced graphs: the ops' decompositions, which AOT autograd
    traces, call this. Dynamo compiles neither this frame nor Triton's launcher frames below it on their own (it
    would where a compiled region runs its callees eagerly past a graph break): the launch options would become
    inputs of those frames' graphs, which automatic dynamic shapes turns into symbols where they differ between
    calls, and ``wrap_triton`` takes no symbolic ``num_warps``. An interpreted kernel is returned unwrapped by
    ``wrap_triton`` and would read the data of fake tensors: there it is skipped, which is exactly the op's fake
    impl (outputs allocated, contents unspecified). Under :func:`compile_only` the kernel is compiled for these
    arguments and not run.
    """
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **meta)  # type: ignore[attr-defined]
        return
    if plain_eager(args):  # nothing traces this call (wrap_triton's wrappers would only cost host time)
        kernel[grid](*args, **meta)  # type: ignore[index]
        return
    # Imported here, past the eager path: an import statement costs a microsecond or two on every call.
    from torch._subclasses.fake_tensor import is_fake
    from torch.library import wrap_triton

    if is_interpreted(kernel) and any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return
    wrap_triton(kernel)[grid](*args, **meta)
