"""CUDA graphs for the dense parts of a training step whose inputs come in a few shapes.

A jagged model's step issues hundreds of small launches from Python; at small widths the device then waits for
the host (docs/results.md, End to end). Where the inputs of a module come in a few shapes (token counts padded to a
multiple, length hints rounded to powers of two), :class:`ShapeGraphs` captures the module's forward and backward
once per input signature with :func:`torch.cuda.make_graphed_callables` and replays them afterwards: one launch of
a graph instead of every kernel's host path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_gem.ops._launch import plain_eager

__all__ = ["ShapeGraphs"]

log = logging.getLogger(__name__)


class _Bound(nn.Module):
    """``module`` called with the non-tensor arguments of one call fixed: its forward takes that call's tensors only
    (what :func:`torch.cuda.make_graphed_callables` feeds a graph), in the order they were flattened."""

    def __init__(self, module: nn.Module, leaves: list[Any], spec: TreeSpec) -> None:
        super().__init__()
        self.module = module
        self._leaves = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        self._slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        self._spec = spec

    def forward(self, *tensors: Tensor) -> Any:
        leaves = list(self._leaves)
        for slot, tensor in zip(self._slots, tensors, strict=True):
            leaves[slot] = tensor
        args, kwargs = tree_unflatten(leaves, self._spec)
        return self.module(*args, **kwargs)


class _NoHeldGradients:
    """A backward pre-hook on a replay's outputs: refuses the backward when a parameter of the module holds a
    gradient. A replay's parameter gradients are the graph's own buffers, which autograd keeps as a parameter's
    ``.grad`` when it has none; the graphs' next replays overwrite those buffers, so a gradient kept into another
    call's backward (accumulation, ``zero_grad(set_to_none=False)``) would be wrong. Checked when the backward starts,
    so gradients may be set to None before the forward or after it (Lightning zeroes between the forward and the
    backward)."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.module = module
        self.params = params

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        if any(param.grad is not None for param in self.params):
            raise RuntimeError(
                f"ShapeGraphs({type(self.module).__name__}): parameters hold gradients when a replay's backward "
                "starts; gradients cannot accumulate over calls or be zeroed in place (set them to None: "
                "zero_grad(set_to_none=True), Lightning's default)"
            )


class ShapeGraphs:
    """Calls ``module`` through CUDA graphs in training: one forward and one backward graph captured per signature
    of a call (its tensors' shapes, dtypes and ``requires_grad``, the values of its other arguments, the autocast
    state), replayed for every later call of that signature with the new tensors copied in.

    Not a module of its own: it holds ``module`` without registering it, so parameters and checkpoints are the module's
    as they are. Eval mode, no-grad calls, traced calls (compilers, symbolic tracing), calls under a dispatch mode (FLOP
    counters) and calls on tensor subclasses run ``module`` as it is. Once ``max_graphs`` signatures are captured, a new
    one runs ``module`` eagerly and says so once in the log (shapes that change every call need padding or bucketing
    first: ``GEMRanker(token_multiple=..., token_growth=...)``, length hints rounded up to powers of two).

    Compiled or activation-checkpointed submodules are refused at capture. What a captured call may not do (as any CUDA
    graph): read device values on the host, or depend on anything but its arguments' shapes and its non-tensor
    arguments. Outputs are the graph's own buffers, overwritten by the next replay of the same signature: use them
    within the step. Graphs of one instance share one memory pool, which holds as long as one signature's forward and
    backward run before the next signature's forward (a training step does). Parameters must hold no gradient when a
    replay's backward starts (set to None before it, as Lightning's default ``zero_grad`` does after the forward):
    gradients cannot accumulate over calls. Under autocast the capture disables autocast's weight cache (as graphs
    require); the casts are then part of the graph.

    Args:
        module: what to call; its parameters get their gradients by autograd as usual.
        max_graphs: signatures to capture at most.
        warmup_iters: eager forward and backward runs before a capture (kernel tuners time their candidates there).
    """

    def __init__(self, module: nn.Module, *, max_graphs: int = 32, warmup_iters: int = 3) -> None:
        if max_graphs < 1 or warmup_iters < 1:
            raise ValueError(f"`max_graphs` and `warmup_iters` must be >= 1, got {max_graphs}, {warmup_iters}")
        self.module = module
        self.max_graphs = max_graphs
        self.warmup_iters = warmup_iters
        self._graphs: dict[Hashable, Callable[..., Any]] = {}
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._pool: Any = None
        self._full_logged = False

    def __getstate__(self) -> dict[str, Any]:
        # Captured graphs belong to this process's device memory: a copy (deepcopy, pickle) starts without them.
        return {**self.__dict__, "_graphs": {}, "_pool": None, "_full_logged": False}

    @property
    def num_graphs(self) -> int:
        """Signatures captured so far."""
        return len(self._graphs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.module(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
        # Symbolic tracing (a train pipeline's model rewrite), dispatch modes (FLOP counters), tensor subclasses
        if any(isinstance(leaf, torch.fx.Proxy) for leaf in leaves) or not plain_eager(tensors):
            return self.module(*args, **kwargs)
        key = (
            spec,
            tuple(None if isinstance(leaf, Tensor) else leaf for leaf in leaves),
            tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
        )
        graphed = self._graphs.get(key)
        if graphed is None:
            if len(self._graphs) >= self.max_graphs:
                if not self._full_logged:
                    log.warning(
                        "ShapeGraphs(%s): %d signatures captured (max_graphs); new ones run eagerly (fewer distinct "
                        "shapes: pad to buckets, e.g. GEMRanker(token_growth=...))",
                        type(self.module).__name__,
                        self.max_graphs,
                    )
                    self._full_logged = True
                return self.module(*args, **kwargs)
            graphed = self._graphs[key] = self._capture(_Bound(self.module, leaves, spec), tensors)
        out = graphed(*tensors)
        nodes = {t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.grad_fn is not None}
        check = _NoHeldGradients(self.module, self._params)
        for node in nodes:
            node.register_prehook(check)
        return out

    def _capture(self, bound: _Bound, tensors: tuple[Tensor, ...]) -> Callable[..., Any]:
        """``bound``'s forward and backward captured on copies of ``tensors`` (the graphs' own input buffers)."""
        name = type(self.module).__name__
        if not tensors or not all(t.is_cuda for t in tensors):
            raise ValueError(f"CUDA graphs need CUDA tensors: {name} got {sorted({str(t.device) for t in tensors})}")
        for path, module in self.module.named_modules(prefix=name):
            # A compiled module's guards and an activation checkpoint's recomputation are not captured as such.
            if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_checkpoint_base"):
                raise ValueError(f"CUDA graphs do not run compiled or activation-checkpointed modules: {path}")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        autocast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        with autocast:
            graphed = torch.cuda.make_graphed_callables(
                bound, samples, num_warmup_iters=self.warmup_iters, allow_unused_input=True, pool=self._pool
            )
        log.info("ShapeGraphs(%s): captured signature %d", type(self.module).__name__, len(self._graphs) + 1)
        return graphed
