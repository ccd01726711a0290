"""How every op family's Triton kernels are launched: directly in plain eager mode, through
``torch.library.wrap_triton`` where a compiler or dispatch mode traces the call, and compiled only under
:func:`compile_only`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["compile_only", "is_interpreted", "launch", "plain_eager"]

_COMPILE_ONLY: ContextVar[bool] = ContextVar("lightning_gem_compile_only", default=False)
# Compiled kernels by (kernel, device, specialization of the arguments, meta): see _launch_eager.
_COMPILED: dict[tuple, object] = {}


def plain_eager(args: Sequence[object]) -> bool:
    """No compiler and no dispatch mode (fake, functional or FLOP-counting tensors) sees this call, and every
    tensor argument is a plain tensor or parameter (no tensor subclass): a launcher may then call its kernel
    directly instead of through ``torch.library.wrap_triton``, whose wrappers only cost host time outside
    tracing (on an H200, ~0.7 ms of host time per launch)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a weight passed as it is (FSDP2's unsharded ones too)


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it was defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


@contextmanager
def compile_only() -> Iterator[None]:
    """Inside, :func:`launch` compiles its kernel (``kernel.warmup``) and launches nothing."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def _launch_eager(kernel: object, grid: tuple[int, ...], args: Sequence[object], meta: dict[str, object]) -> None:
    """``kernel[grid](*args, **meta)``, but a kernel already compiled for these arguments' specialization is
    launched directly, without the JIT launcher's per-call binding, key building and cache lookup.

    The specialization is Triton's own (``native_specialize_impl`` per argument, honouring each parameter's
    ``do_not_specialize``: dtype and 16-byte alignment of tensors, width and divisibility of integers, ``1`` and
    None as constants), so the cached kernel is the one the JIT launcher would pick. Interpreted kernels, grids
    that are not int tuples and constexprs left to their defaults go through the JIT launcher.
    """
    if is_interpreted(kernel) or not isinstance(grid, tuple):
        kernel[grid](*args, **meta)  # type: ignore[index]
        return
    from triton._C.libtriton import native_specialize_impl
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    params = kernel.params  # type: ignore[attr-defined]
    try:
        backend = kernel.device_caches[device][3]  # type: ignore[attr-defined]
        spec = tuple(
            native_specialize_impl(
                backend, arg, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
            )  # fmt: skip
            for arg, param in zip(args, params, strict=False)
        )
        key = (kernel, device, spec, tuple(meta.items()))
        compiled = _COMPILED.get(key)
    except TypeError:  # an unhashable meta value
        compiled = key = None
    if compiled is None:
        compiled = kernel[grid](*args, **meta)  # type: ignore[index]
        names = kernel.arg_names[len(args) :]  # type: ignore[attr-defined]
        if key is not None and compiled is not None and all(name in meta for name in names):
            _COMPILED[key] = (compiled, names)
        return
    compiled, names = compiled
    values = (*args, *(meta[name] for name in names))
    stream = driver.active.get_current_stream(device)
    from triton import knobs

    grid = (*grid, 1, 1)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *values)  # fmt: skip


def launch(kernel: object, grid: object, args: Sequence[object], meta: dict[str, object]) -> None:
    """``kernel[grid](*args, **meta)``: directly in plain eager mode, else through ``wrap_triton``.

    Through ``wrap_triton`` compiled kernels go into traced graphs. An interpreted kernel is returned unwrapped
    by ``wrap_triton`` and would read the data of fake tensors: there it is skipped, which is exactly the op's
    fake impl (outputs allocated, contents unspecified). Under :func:`compile_only` the kernel is compiled for
    these arguments and not run.
    """
    from torch._subclasses.fake_tensor import is_fake
    from torch.library import wrap_triton

    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **meta)  # type: ignore[attr-defined]
        return
    if plain_eager(args):  # nothing traces this call (wrap_triton's wrappers would only cost host time)
        _launch_eager(kernel, grid, args, meta)
        return
    if is_interpreted(kernel) and any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return
    wrap_triton(kernel)[grid](*args, **meta)
