"""Automatic activation checkpointing: recompute the cheapest set of blocks that fits a memory budget.

The plan comes from measurements of one training step (``run_step``: forward and backward), not
from formulas:

1. the step's memory timeline (one step): its unconstrained peak, split where backward finishes each
   candidate (a gradient hook on the candidate's inputs), so each candidate gets the peak while
   backward runs through it, and the part before the first candidate's forward and after the last
   candidate's backward (embeddings, the optimizer step), which checkpointing cannot lower. CUDA:
   ``torch.cuda.max_memory_allocated``, everything resident included (parameters, optimizer state,
   gradients, activations). CPU has no allocator statistics: there the peak is that of the bytes the
   step's own ops allocate and still hold (activations, temporaries, gradients), tracked through a
   dispatch mode; tensors that exist before the step (parameters, optimizer state, the batch) do not
   count.
2. per candidate block (one instrumented step): the bytes its forward saves for backward
   (``saved_tensors_hooks``, storages deduplicated; parameters, buffers and the block's own inputs
   left out, since checkpointing keeps those anyway), the part of them that checkpointing frees (what
   nothing outside the block also saves), and its forward FLOPs (``FlopCounterMode``; the kit's
   attention ops register their formulas) or, with ``cost="time"``, its measured forward time.
3. the peak model: while backward runs through candidate ``j``, a checkpointed set ``S`` lowers the
   measured peak by the freed bytes of the members of ``S`` whose activations are still held (those
   backward reaches after ``j``) and, if ``j`` is in ``S``, raises it by what rematerialising ``j``
   adds beyond its freed bytes. The predicted peak is the largest over candidates and the outside part.
4. a 0/1 knapsack: the set with the least recompute cost (FLOPs or seconds, then recomputed bytes)
   whose predicted peak fits the budget, solved exactly by dynamic programming over the Pareto
   frontier of (bytes freed so far, cost) along the candidates.

If checkpointing every candidate still does not fit, :func:`plan_activation_checkpointing` raises a
``ValueError`` that names the lowest reachable peak; with ``on_infeasible="warn"`` it warns and returns
the plan with that lowest peak instead.

Eager mode: :func:`apply_activation_checkpointing` turns the chosen modules into non-reentrant
``torch.utils.checkpoint`` regions in place: module names, ``state_dict`` keys and ``isinstance`` stay
as they were. Under ``torch.compile`` the partitioner chooses op-level recomputation itself, from
``torch._functorch.config.activation_memory_budget``: :func:`compile_memory_budget` sets it, and
:attr:`ActivationCheckpointPlan.compile_budget_fraction` translates a plan's byte budget into it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8)) for _ in range(4)])
    >>> x = torch.randn(256, 8)
    >>> plan = plan_activation_checkpointing(model, lambda: model(x).sum().backward(), 0.6,
    ...                                      candidates=["0", "1", "2", "3"])
    >>> apply_activation_checkpointing(model, plan)
    >>> plan.predicted_peak <= plan.budget
    True
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_gem.strategies.activation_checkpointing.measure import (
    CandidateStats,
    _device_of,
    _forward_seconds,
    _measure_timeline,
    _Profile,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ActivationCheckpointPlan",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "compile_memory_budget",
    "default_checkpoint_candidates",
    "plan_activation_checkpointing",
    "remove_activation_checkpointing",
]

_MAX_FRONTIER = 20_000  # Pareto states kept by the knapsack; beyond it, the solution is feasible but may not be optimal


# -- the plan ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationCheckpointPlan:
    """Which submodules to checkpoint, with the measurements behind the choice (all sizes in bytes)."""

    chosen: tuple[str, ...]
    """Submodules to checkpoint, in the order of ``candidates``."""
    candidates: tuple[CandidateStats, ...]
    """The measured candidates the choice was made from, last released by backward first (forward order
    for a chain of blocks)."""
    skipped: dict[str, str]
    """Candidates left out before the choice, with the reason (no floating-point input, never ran, frees nothing)."""
    unconstrained_peak: int
    """Measured peak of the step without checkpointing (see the module docstring for what CUDA and CPU count)."""
    baseline: int
    """Memory allocated when the step starts (CUDA); 0 on CPU, where only the step's allocations count."""
    outside_peak: int
    """Peak of the step outside the activations' lifetime (before the first candidate's forward, after the
    last candidate's backward: embeddings, the optimizer step); no plan goes below it."""
    budget: int
    """The peak allowed."""
    predicted_peak: int
    """Peak predicted for ``chosen`` (see the module docstring)."""
    cost: Literal["flops", "time"] = "flops"
    """What the knapsack minimised."""
    device: str = "cpu"
    """Device type the step ran on."""

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget (False only for a best-effort plan)."""
        return self.predicted_peak <= self.budget

    @property
    def recompute_flops(self) -> int:
        """Forward FLOPs recomputed per step by the chosen blocks."""
        chosen = set(self.chosen)
        return sum(c.forward_flops for c in self.candidates if c.name in chosen)

    @property
    def compile_budget_fraction(self) -> float:
        """The budget as a fraction of the step's activation memory (the peak above the baseline), the unit
        of :func:`compile_memory_budget`. The compiler measures activations of its own graph, so this is the
        same proportion, not the same bytes."""
        activations = self.unconstrained_peak - self.baseline
        if activations <= 0:
            return 1.0
        return min(1.0, max(0.0, (self.budget - self.baseline) / activations))

    def summary(self) -> str:
        """A readable table of the plan, for logs."""
        total_flops = sum(c.forward_flops for c in self.candidates) or 1
        head = (
            f"Activation checkpointing ({self.device}): budget {_fmt_bytes(self.budget)} of unconstrained peak "
            f"{_fmt_bytes(self.unconstrained_peak)} ({self.budget / max(self.unconstrained_peak, 1):.0%}); "
            f"predicted peak {_fmt_bytes(self.predicted_peak)}{'' if self.fits else ' (OVER BUDGET)'} "
            f"(outside the activations' lifetime {_fmt_bytes(self.outside_peak)}); "
            f"recomputing {len(self.chosen)} of {len(self.candidates)} candidates, "
            f"{self.recompute_flops / 1e9:.3g} GFLOP per step "
            f"({self.recompute_flops / total_flops:.0%} of their forward)"
        )
        chosen = set(self.chosen)
        width = max([len(c.name) for c in self.candidates] + [9])
        lines = [
            head,
            f"  {'candidate':<{width}} {'saved':>10} {'freed':>10} {'bwd peak':>10} {'fwd GFLOP':>10} {'fwd ms':>8}"
            "  recompute",
        ]
        for c in self.candidates:
            ms = "-" if c.forward_seconds is None else f"{c.forward_seconds * 1e3:.2f}"
            lines.append(
                f"  {c.name:<{width}} {_fmt_bytes(c.saved_bytes):>10} {_fmt_bytes(c.freed_bytes):>10} "
                f"{_fmt_bytes(c.backward_peak):>10} {c.forward_flops / 1e9:>10.3g} {ms:>8}  "
                f"{'yes' if c.name in chosen else 'no'}"
            )
        if self.skipped:
            lines.append("  skipped: " + ", ".join(f"{name} ({why})" for name, why in self.skipped.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- candidates --------------------------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def default_checkpoint_candidates(module: nn.Module) -> list[str]:
    """The blocks of ``module`` worth considering: the repeated blocks and the parts around them.

    The repeated blocks are the children of every ``nn.ModuleList`` (HSTU layers, transformer blocks;
    the outermost list where lists nest). Around them, every other child of the modules that contain
    those blocks is a candidate too, if it holds parameters and is not a container (e.g. for a
    ``GEMRanker``: ``encoder.layers.*``, ``interaction``, ``head``, the projections and norms). Without a
    ``ModuleList`` the candidates are the root's children. Measurement then drops those that take no
    floating-point input (embedding lookups over ids: recomputing them would repeat the lookup and, when
    sharded, its all-to-all), that never run in the step, or that free nothing.
    """
    blocks: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and not any(_is_under(name, b) for b in blocks):
            blocks.extend(_join(name, child) for child, _ in sub.named_children())
    containers = {""}
    for block in blocks:
        parts = block.split(".")
        containers.update(".".join(parts[:i]) for i in range(1, len(parts)))
    found = set(blocks)
    for parent in sorted(containers):
        owner = module.get_submodule(parent)
        if isinstance(owner, nn.ModuleList):
            continue
        for child_name, child in owner.named_children():
            name = _join(parent, child_name)
            if name in containers or name in found or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                continue
            if any(p.requires_grad for p in child.parameters()):
                found.add(name)
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return sorted(found, key=order.__getitem__)


def _check_candidates(module: nn.Module, names: Sequence[str]) -> list[str]:
    if isinstance(names, str):
        raise TypeError("`candidates` must be a sequence of submodule names, not one string")
    names = list(dict.fromkeys(names))
    for name in names:
        try:
            module.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"`candidates`: {type(module).__name__} has no submodule {name!r}") from err
    for a in names:
        for b in names:
            if a != b and _is_under(b, a):
                raise ValueError(f"`candidates` must not nest: {b!r} lies inside {a!r}")
    return names


# -- the knapsack ------------------------------------------------------------------------------------


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b, strict=True))


_State = tuple[int, tuple, tuple[int, ...]]  # (freed bytes so far, cost, members)


def _pareto(states: list[_State]) -> list[_State]:
    """Non-dominated states, freed ascending (cost then strictly ascending too)."""
    states.sort(key=lambda s: (-s[0], s[1]))
    kept: list[_State] = []
    for state in states:
        if not kept or state[1] < kept[-1][1]:
            kept.append(state)
    kept.reverse()
    if len(kept) > _MAX_FRONTIER:
        # Keep the most-freeing state of each freed-bytes bucket: still feasible, possibly not the cheapest.
        width = (kept[-1][0] - kept[0][0]) / _MAX_FRONTIER + 1
        thinned: dict[int, _State] = {}
        for state in kept:
            thinned[int((state[0] - kept[0][0]) / width)] = state
        kept = list(thinned.values())
    return kept


def _predicted_peak(stats: Sequence[CandidateStats], members: Sequence[int]) -> int:
    """Peak of the activations' lifetime with ``members`` (indices into ``stats``) checkpointed.

    ``stats`` are in reverse release order: while backward runs through candidate ``j``, the ones
    before it in ``stats`` still hold their activations (checkpointed ones hold none), the ones after
    it have released theirs, and ``j`` itself, if checkpointed, holds its rematerialised ``saved_bytes``
    instead of its ``freed_bytes``.
    """
    chosen, predicted, freed_before = set(members), 0, 0
    for j, s in enumerate(stats):
        extra = s.saved_bytes - s.freed_bytes if j in chosen else 0
        predicted = max(predicted, s.backward_peak - freed_before + extra)
        if j in chosen:
            freed_before += s.freed_bytes
    return predicted


def _cheapest(stats: Sequence[CandidateStats], costs: Sequence[tuple], budget: int) -> tuple[int, ...] | None:
    """Indices of the cheapest set whose predicted peak fits ``budget`` (None: no set fits).

    Dynamic programming along ``stats`` over the Pareto frontier of (bytes freed by the chosen earlier
    candidates, cost): every candidate's backward segment must fit, skipped or chosen, and more freed
    bytes before it only help, so dominated states can go and the DP is exact.
    """
    frontier: list[_State] = [(0, tuple(0 for _ in costs[0]) if costs else (), ())]
    for j, s in enumerate(stats):
        skip = [state for state in frontier if s.backward_peak - state[0] <= budget]
        take = [
            (f + s.freed_bytes, _add(c, costs[j]), (*m, j))
            for f, c, m in frontier
            if s.backward_peak - f + s.saved_bytes - s.freed_bytes <= budget
        ]
        frontier = _pareto(skip + take)
        if not frontier:
            return None
    return min(frontier, key=lambda state: state[1])[2]


def _lowest_peak(stats: Sequence[CandidateStats]) -> tuple[int, ...]:
    """The set with the lowest predicted peak (a bisection over budgets)."""
    costs = [(0,)] * len(stats)
    low, high, best = 0, _predicted_peak(stats, ()), ()
    while low < high:
        mid = (low + high) // 2
        members = _cheapest(stats, costs, mid)
        if members is None:
            low = mid + 1
        else:
            high, best = mid, members
    return best


# -- planning ----------------------------------------------------------------------------------------


def _check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(f"`budget` must be bytes (int) or a fraction of the peak (float), got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"`budget` as a fraction of the unconstrained peak must lie in (0, 1], got {budget}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"`budget` in bytes must be > 0, got {budget}")


def plan_activation_checkpointing(
    module: nn.Module,
    run_step: Callable[[], Any],
    budget: int | float,
    *,
    candidates: Sequence[str] | None = None,
    cost: Literal["flops", "time"] = "flops",
    on_infeasible: Literal["raise", "warn"] = "raise",
    log: bool = True,
) -> ActivationCheckpointPlan:
    """Measure ``run_step`` and choose the submodules of ``module`` to checkpoint so the peak fits ``budget``.

    ``run_step`` runs three or four times (peak, profile, optional timing; see the module docstring). It
    must run one forward and one backward of ``module`` as training does (include ``zero_grad(set_to_none=True)``
    and the optimizer step if the training step has them, so the peak includes their memory). Checkpointing
    already applied to ``module`` is lifted while measuring and restored afterwards.

    Args:
        module: the model (or the part of it whose submodules may be checkpointed).
        run_step: one training step through ``module``; its return value is ignored.
        budget: the peak allowed: bytes (``int``), or a fraction in ``(0, 1]`` of the measured
            unconstrained peak (``float``). On CUDA the peak includes everything resident; on CPU only
            what the step allocates.
        candidates: submodule names that may be checkpointed (not nested); default
            :func:`default_checkpoint_candidates`.
        cost: the recompute cost to minimise: forward ``"flops"`` (deterministic; pointwise-only blocks
            count as free) or measured forward ``"time"``.
        on_infeasible: when even checkpointing every candidate exceeds the budget: ``"raise"`` a
            ``ValueError``, or ``"warn"`` and return the plan with the lowest predicted peak.
        log: log the plan's summary (rank zero).

    Returns:
        The plan; apply it with :func:`apply_activation_checkpointing`.
    """
    if cost not in ("flops", "time"):
        raise ValueError(f"`cost` must be 'flops' or 'time', got {cost!r}")
    if on_infeasible not in ("raise", "warn"):
        raise ValueError(f"`on_infeasible` must be 'raise' or 'warn', got {on_infeasible!r}")
    _check_budget(budget)
    names = _check_candidates(module, default_checkpoint_candidates(module) if candidates is None else candidates)
    device = _device_of(module)
    previous = checkpointed_modules(module)
    remove_activation_checkpointing(module)
    try:
        timeline = _measure_timeline(module, names, run_step, device)
        profile = _Profile(module, names)
        profile.run(run_step)
        seconds = _forward_seconds(module, names, run_step) if cost == "time" else {}
    finally:
        _checkpoint_names(module, previous)
    memory, outside_peak = timeline.memory, timeline.outside_peak
    budget_bytes = int(budget * memory.peak) if isinstance(budget, float) else budget

    skipped: dict[str, str] = {}
    for name in names:
        if name not in profile.order:
            skipped[name] = "did not run"
        elif name not in profile.float_input:
            skipped[name] = "no floating-point input"
    stats: list[CandidateStats] = []
    for name in reversed(timeline.release_order):  # in the order the knapsack's DP needs: see _predicted_peak
        candidate = profile.stats(name, timeline.backward_peaks[name], seconds.get(name))
        if candidate.freed_bytes > 0:
            stats.append(candidate)
        else:
            skipped[name] = "frees nothing"

    primary = [s.forward_seconds if cost == "time" else s.forward_flops for s in stats]
    costs = [(p, s.saved_bytes) for p, s in zip(primary, stats, strict=True)]
    members = _cheapest(stats, costs, budget_bytes) if outside_peak <= budget_bytes else None
    if members is None:
        members = _lowest_peak(stats)
        lowest = max(outside_peak, _predicted_peak(stats, members))
        message = (
            f"activation budget {_fmt_bytes(budget_bytes)} is out of reach: the unconstrained peak is "
            f"{_fmt_bytes(memory.peak)} and checkpointing the candidates brings it down to {_fmt_bytes(lowest)} "
            f"at best (outside the activations' lifetime the step peaks at {_fmt_bytes(outside_peak)}, baseline "
            f"{_fmt_bytes(memory.baseline)}); raise the budget, add candidates, or lower the batch size"
        )
        if on_infeasible == "raise":
            raise ValueError(message)
        warnings.warn(message + "; using the lowest-peak plan", stacklevel=2)
    chosen = [stats[j] for j in members]
    plan = ActivationCheckpointPlan(
        chosen=tuple(s.name for s in chosen),
        candidates=tuple(stats),
        skipped=skipped,
        unconstrained_peak=memory.peak,
        baseline=memory.baseline,
        budget=budget_bytes,
        outside_peak=outside_peak,
        predicted_peak=max(outside_peak, _predicted_peak(stats, members)),
        cost=cost,
        device=device.type,
    )
    if log:
        rank_zero_info(plan.summary())
    return plan


# -- applying ----------------------------------------------------------------------------------------


class _Checkpointed(nn.Module):
    """Base of the classes :func:`apply_activation_checkpointing` gives to checkpointed modules.

    ``CheckpointedX(_Checkpointed, X)`` runs ``X.forward`` inside a non-reentrant checkpoint; the class
    swap (as FSDP2's ``fully_shard`` does) keeps names, ``state_dict`` keys and ``isinstance(m, X)``, and
    traces under ``torch.compile``.
    """

    _checkpoint_base: type[nn.Module]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = super().forward
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = super().__reduce_ex__(protocol)
        # Pickle the made class as "the checkpointed class of its base", which unpickling can rebuild.
        if "_checkpoint_base" in type(self).__dict__ and reduced[0] is copyreg.__newobj__:
            return (_new_checkpointed, (self._checkpoint_base,), *reduced[2:])
        return reduced


@functools.cache
def _checkpointed_class(base: type[nn.Module]) -> type[nn.Module]:
    return type(
        f"Checkpointed{base.__name__}",
        (_Checkpointed, base),
        {"_checkpoint_base": base, "__module__": base.__module__, "__doc__": base.__doc__},
    )


def _new_checkpointed(base: type[nn.Module]) -> nn.Module:
    cls = _checkpointed_class(base)
    return cls.__new__(cls)


def checkpointed_modules(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` (itself included, as ``""``) that run checkpointed."""
    return [name for name, sub in module.named_modules() if isinstance(sub, _Checkpointed)]


def _checkpoint_names(module: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        sub = module.get_submodule(name)
        if not isinstance(sub, _Checkpointed):
            sub.__class__ = _checkpointed_class(type(sub))


def remove_activation_checkpointing(module: nn.Module) -> None:
    """Undo :func:`apply_activation_checkpointing` on ``module`` and its submodules."""
    for name, sub in module.named_modules():
        if not isinstance(sub, _Checkpointed):
            continue
        if "_checkpoint_base" not in type(sub).__dict__:
            raise ValueError(
                f"cannot lift checkpointing from {name or 'the module'}: its class was swapped again afterwards "
                f"({type(sub).__name__}, e.g. by fully_shard); plan and apply checkpointing before wrapping"
            )
        sub.__class__ = type(sub)._checkpoint_base


def apply_activation_checkpointing(module: nn.Module, plan: ActivationCheckpointPlan) -> None:
    """Checkpoint exactly ``plan.chosen`` in ``module``, in place (idempotent; names and ``state_dict`` unchanged).

    Each chosen submodule's forward then runs inside ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
    (RNG state preserved, so dropout masks replay) whenever grad is enabled; checkpointing on other
    submodules is lifted. Apply before ``fully_shard`` / ``torch.compile``, as for any checkpoint wrapper.
    """
    for name in plan.chosen:
        try:
            module.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"the plan names {name!r}, which {type(module).__name__} does not have") from err
    chosen = set(plan.chosen)
    stale = [name for name in checkpointed_modules(module) if name not in chosen]
    for name in stale:
        remove_activation_checkpointing(module.get_submodule(name))
    _checkpoint_names(module, plan.chosen)


# -- torch.compile -----------------------------------------------------------------------------------


@contextlib.contextmanager
def compile_memory_budget(fraction: float) -> Iterator[None]:
    """Set ``torch._functorch.config.activation_memory_budget`` to ``fraction`` inside the block, then restore it.

    Under ``torch.compile`` the min-cut partitioner then picks op-level recomputation (a knapsack over
    the graph's ops) so that saved activations are about ``fraction`` of what it saves by default
    (``1.0``: default, ``0.0``: recompute everything it can). The value is read when a graph is compiled,
    so the first call of the compiled module (and any recompilation) must run inside the block.

    Example:
        >>> import torch
        >>> with compile_memory_budget(0.5):
        ...     torch._functorch.config.activation_memory_budget
        0.5
    """
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`fraction` must be a number in [0, 1], got {fraction!r}")
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=float(fraction)):
        yield
