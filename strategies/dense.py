"""Dense 3D parallelism: HSDP/FSDP2 over ``(dense_replicate, dense_shard)``, tensor parallel over ``tensor_parallel``.

Plain functions over a model and the dense view of the mesh (``mesh.py``). The model may hold torchrec
modules: FSDP2 is never applied to a module containing one (their parameters are sharded by torchrec
and trained by the fused optimizer). Instead the *dense units* are found: the largest submodules with
parameters and no torchrec module inside, each called through its own ``forward``. Each unit gets
``fully_shard`` (and so does each block of an ``nn.ModuleList`` inside it, one all-gather per block);
containers without a forward (``nn.ModuleDict``/``nn.ModuleList``) are descended into. Parameters
held directly by a module that also holds torchrec modules (e.g. a bias on the LightningModule) stay
replicated; :class:`ReplicatedGradients` all-reduces their gradients. With nothing to shard (``dense_shard``
and ``tensor_parallel`` of 1: one process, or pure data parallelism) no FSDP2 is applied and every dense
parameter is replicated that way, as DDP would (one all-reduce a step, no per-unit hooks).

Tensor parallelism uses the plan each component declares (``tensor_parallel_plan()``: submodule name
-> ``"colwise"`` / ``"rowwise"``), applied with DTensor's ``parallelize_module`` before FSDP2.

Sequence parallelism (Megatron-style, optional) applies inside the components that can shard their
tokens over the tensor-parallel ranks (``enable_sequence_parallel(tp_mesh)``, e.g. the HSTU encoder):
between the tensor-parallel components inside them each rank holds a share of the tokens (dim 0), the
column-wise linears all-gather the tokens before their matmul and the row-wise linears reduce-scatter
their output to token shares instead of all-reducing it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "ReplicatedGradients",
    "clip_grad_norm_",
    "TensorParallelGradients",
    "apply_fsdp",
    "apply_tensor_parallel",
    "dense_units",
    "sequence_parallel_modules",
    "split_mixed_param_groups",
    "tensor_parallel_modules",
]


def _is_torchrec(module: nn.Module) -> bool:
    from torchrec.distributed.types import ShardedModule
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return isinstance(module, (EmbeddingCollection, EmbeddingBagCollection, ShardedModule))


def _holds_torchrec(module: nn.Module) -> bool:
    return any(_is_torchrec(sub) for sub in module.modules())


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def dense_units(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Parameter]]]:
    """``(units, replicated)``: the dense units of ``module`` and the parameters left outside them.

    Units are ``(qualified name, module)`` for the largest parameter-holding submodules without a torchrec
    module inside and with a ``forward`` of their own (``nn.ModuleDict``/``nn.ModuleList`` are descended
    into). ``replicated`` are the parameters held directly by modules that contain torchrec modules.
    """
    units: list[tuple[str, nn.Module]] = []
    replicated: list[tuple[str, nn.Parameter]] = []

    def visit(prefix: str, sub: nn.Module) -> None:
        if _is_torchrec(sub) or not _has_parameters(sub):
            return
        if not _holds_torchrec(sub) and not isinstance(sub, (nn.ModuleDict, nn.ModuleList)):
            units.append((prefix, sub))
            return
        for name, param in sub.named_parameters(recurse=False):
            replicated.append((f"{prefix}.{name}" if prefix else name, param))
        for name, child in sub.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", module)
    return units, replicated


def tensor_parallel_modules(module: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    """``(name, submodule, plan)`` for every submodule declaring a ``tensor_parallel_plan()``."""
    found = []
    for name, sub in module.named_modules():
        plan_fn = getattr(type(sub), "tensor_parallel_plan", None)
        if callable(plan_fn):
            found.append((name, sub, dict(plan_fn())))
    return found


def sequence_parallel_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` for every submodule that can shard its tokens (``enable_sequence_parallel()``)."""
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if callable(getattr(type(sub), "enable_sequence_parallel", None))
    ]


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False) -> list[str]:
    """Shard the linears named by each component's ``tensor_parallel_plan()`` over ``tp_mesh``, in place.

    Column-wise linears keep their output sharded (heads split across ranks), row-wise linears take a
    sharded input and all-reduce their output, so a plan pairs them around per-head computation. The
    component's head count (``num_heads``) is divided by the tensor-parallel size so its reshapes see
    the local heads.

    With ``sequence_parallel``, every component declaring ``enable_sequence_parallel(tp_mesh)`` is told to
    run its inside on token shards, and the tensor-parallel components inside it take token shards:
    column-wise linears all-gather them (backward: reduce-scatter), row-wise linears reduce-scatter to
    them instead of all-reducing.

    Returns:
        The qualified names of the parameters each rank computes only part of the gradient of, which
        :class:`TensorParallelGradients` must sum: those of the components' head-local submodules
        (``tensor_parallel_head_local()``) and, inside a sequence-parallel component, of their
        token-local submodules (``tensor_parallel_token_local()``).

    Raises:
        ValueError: a component's head count is not divisible by the tensor-parallel size, or its plan
            names a submodule that is not an ``nn.Linear``; ``sequence_parallel`` finds no component
            declaring ``enable_sequence_parallel``, or a tensor-parallel component inside one does not
            declare ``tensor_parallel_token_local()``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    regions = sequence_parallel_modules(module) if sequence_parallel else []
    if sequence_parallel and not regions:
        raise ValueError(
            f"sequence_parallel=True: no submodule of {type(module).__name__} declares `enable_sequence_parallel("
            "tp_mesh)` (e.g. JaggedHistoryEncoder), so there are no token shards to run on; turn it off"
        )
    size = tp_mesh.size()
    partial: list[str] = []
    for name, sub, plan in tensor_parallel_modules(module):
        label = name or type(sub).__name__
        heads = getattr(sub, "num_heads", None)
        if getattr(sub, "per_head_norm", True) is False:
            raise ValueError(
                f"{label} normalises all heads together (per_head_norm=False): its tensor-parallel plan needs "
                "per-head norms"
            )
        if getattr(sub, "relative_bias", None) is not None or getattr(sub, "time_bias", None) is not None:
            raise ValueError(
                f"{label} adds a relative attention bias (a dense attention path): its "
                "tensor-parallel plan does not cover it"
            )
        if heads is not None and heads % size:
            raise ValueError(f"`tensor_parallel_size` ({size}) must divide the heads of {label} ({heads})")
        on_shards = any(_inside(name, region) for region, _ in regions)
        if on_shards and not callable(getattr(type(sub), "tensor_parallel_token_local", None)):
            raise ValueError(
                f"sequence_parallel=True runs {label} on token shards, but {type(sub).__name__} does not declare "
                "`tensor_parallel_token_local()` (its submodules whose parameters see only a rank's tokens)"
            )
        parallelize_module(sub, tp_mesh, _linear_styles(label, sub, plan, on_shards))
        if heads is not None:
            sub.num_heads = heads // size
        partial += _partial_gradient_params(name, sub, on_shards)
    for _, region in regions:
        region.enable_sequence_parallel(tp_mesh)
    return partial


def _inside(name: str, region: str) -> bool:
    return region == "" or name == region or name.startswith(f"{region}.")


def _partial_gradient_params(name: str, sub: nn.Module, on_shards: bool) -> list[str]:
    """The qualified names of the parameters of ``sub``'s head-local submodules and, ``on_shards``, of its
    token-local ones: each tensor-parallel rank computes a part of their gradients."""
    kinds = ("head", "token") if on_shards else ("head",)
    names = []
    for kind in kinds:
        declared = getattr(type(sub), f"tensor_parallel_{kind}_local", None)
        for local in declared() if callable(declared) else ():
            prefix = f"{name}.{local}" if name else local
            names += [f"{prefix}.{p}" for p, _ in sub.get_submodule(local).named_parameters()]
    return names


def _linear_styles(label: str, sub: nn.Module, plan: dict[str, str], on_shards: bool) -> dict[str, Any]:
    """The DTensor parallel style of each linear of ``plan``; ``on_shards``: inputs and outputs are token shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    tokens = Shard(0) if on_shards else None  # None: replicated (the styles' default)
    styles: dict[str, Any] = {}
    for target, style in plan.items():
        linear = sub.get_submodule(target)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"tensor-parallel plan of {label}: {target!r} is a {type(linear).__name__}, not nn.Linear")
        if style == "colwise":
            styles[target] = ColwiseParallel(input_layouts=tokens)
        elif style == "rowwise":
            styles[target] = RowwiseParallel(output_layouts=tokens)
        else:
            raise ValueError(f"tensor-parallel plan of {label}: style must be 'colwise' or 'rowwise', got {style!r}")
    return styles


def apply_fsdp(
    units: Iterable[tuple[str, nn.Module]],
    dp_mesh: Any,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    sum_reductions: bool = False,
) -> list[str]:
    """``fully_shard`` each dense unit (and each ``nn.ModuleList`` block inside it) over ``dp_mesh``.

    Args:
        units: from :func:`dense_units`.
        dp_mesh: the data-parallel mesh (1D: FSDP, 2D ``(replicate, shard)``: HSDP).
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` or None.
        sum_reductions: reduce with plain sums and scale separately (gloo has no pre-multiplied sum).

    Returns:
        The qualified names of the modules given ``fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    wrapped = []

    def shard(module: nn.Module, name: str) -> None:
        # Gradients are averaged over dp_mesh (FSDP2's default). No custom divide factor: with a shard
        # axis of size 1 (HSDP n x 1) FSDP2 would divide twice.
        fsdp_module = fully_shard(module, **kwargs)
        if sum_reductions:
            fsdp_module.set_force_sum_reduction_for_comms(True)
        wrapped.append(name)

    for name, unit in units:
        for sub_name, sub in unit.named_modules():
            if isinstance(sub, nn.ModuleList):
                for index, block in enumerate(sub):
                    if _has_parameters(block):
                        shard(block, ".".join(p for p in (name, sub_name, str(index)) if p))
        shard(unit, name)
    return wrapped


class TensorParallelGradients:
    """Sums gradients over the tensor-parallel group for the replicated parameters each rank computes a part of:
    head-local ones (its heads' part) and, under sequence parallelism, token-local ones (its tokens' part).

    Works on the FSDP2-sharded gradients too: the ranks of a tensor-parallel group hold the same shard.
    """

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.params = params
        self.group = group

    @torch.no_grad()
    def __call__(self) -> None:
        from torch.distributed.tensor import DTensor

        for param in self.params:
            grad = param.grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)


class ReplicatedGradients:
    """Sums the gradients of replicated parameters over the data-parallel group and divides them.

    Call after the last backward before the optimizer step (accumulated gradients are reduced once).
    """

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup | None, divide_factor: float) -> None:
        self.params = [p for p in params if p.requires_grad]  # frozen ones get no gradient, zero or not
        self.group = group
        self.divide_factor = divide_factor

    @torch.no_grad()
    def __call__(self) -> None:
        alone = self.group is None or dist.get_world_size(self.group) == 1
        if not self.params or (alone and self.divide_factor == 1.0):
            return
        # Every rank contributes every parameter (zeros where its batch gave no gradient), so the ranks' buffers
        # agree and every replica gets the same average. A parameter that no rank's batch reached ends with a zero
        # gradient, where DDP would find out with one more collective and leave it None.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flatten_dense_tensors(grads)
        if not alone:
            dist.all_reduce(flat, group=self.group)
        flat /= self.divide_factor
        # One multi-tensor copy back (not a launch per parameter: a host-bound step pays for each).
        torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters that mix FSDP2/tensor-parallel DTensors (on different
    meshes or placements) and plain replicated tensors: the total norm of the full gradients, the same
    on every rank; every gradient scaled by ``min(1, max_norm / total)``.

    Returns:
        The total norm (a plain scalar tensor).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:  # one norm per (mesh, placements): torch's norm cannot mix them
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    # min(1, max_norm / total) as a device tensor, not read back: no device sync (as torch's own clipping).
    scale = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for group in groups.values():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in group]  # a shard scaled is the DTensor scaled
        torch._foreach_mul_(local, scale.to(local[0].device))
    return total


@contextlib.contextmanager
def split_mixed_param_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, every parameter group of ``optimizer`` holding both DTensor (FSDP2 / tensor-parallel)
    and plain parameters (the replicated ones, see :func:`dense_units`) is two groups with its options.

    PyTorch's multi-tensor (``foreach``, the CUDA default) and fused optimizer kernels refuse a list mixing
    DTensors and plain tensors. Splitting only for the step keeps them (no per-parameter fallback) and leaves
    the groups as the user built them everywhere else (LR schedulers and checkpoints index the groups;
    optimizer state is keyed by parameter, so it is the same either way). Options written into the split groups
    inside the block (a loaded checkpoint's learning rate) are copied back to the groups they came from.
    """
    from torch.distributed.tensor import DTensor

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer: the optimizer it wraps
    groups = optimizer.param_groups
    parts: list[list[dict[str, Any]]] = []  # per group: the groups it is while split
    for group in groups:
        sharded = [p for p in group["params"] if isinstance(p, DTensor)]
        plain = [p for p in group["params"] if not isinstance(p, DTensor)]
        parts.append([{**group, "params": sharded}, {**group, "params": plain}] if sharded and plain else [group])
    if len(parts) == sum(len(p) for p in parts):
        yield
        return
    optimizer.param_groups = [part for group_parts in parts for part in group_parts]
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for group, (first, *_) in zip(groups, parts, strict=True):
            group.update({k: v for k, v in first.items() if k != "params"})
