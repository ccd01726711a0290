"""The GEM example workload the end-to-end and scaling benchmarks share: its shape arguments, synthetic users
and model.

``GEMRanker`` (torchrec embedding tables, an HSTU history encoder, GDPA candidate interaction, multi-task
head) on synthetic GEM-like users: histories ``clip(L u^3, 16, L)`` up to ``--max-history`` events with
several features per event and pooled user features, hundreds of candidates per user.

Also the profiling helpers the benchmarks share. The model and the data load when first used, so scripts that
time only ops (``host_overhead.py``, ``attention_profile.py``) import this module without torchrec.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

if TYPE_CHECKING:
    from lightning_gem.components import GEMRanker

    from lightning_gem.data import SyntheticRankingSource

__all__ = [
    "CProfileLastSteps",
    "ProfileLastSteps",
    "StepClock",
    "SyncPoints",
    "add_shape_arguments",
    "cprofile_table",
    "device_kernels",
    "device_time",
    "gem_ranker",
    "kernel_family",
    "step_shares",
    "synthetic_users",
    "use_tiny_shapes",
]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-history``, ``--mean-candidates``, ``--max-candidates``, ``--num-items`` and the model's widths."""
    parser.add_argument("--max-history", type=int, default=4096)
    parser.add_argument(
        "--min-history", type=int, default=16, help="shortest history; --max-history: every history that long"
    )
    parser.add_argument("--mean-candidates", type=float, default=128.0)
    parser.add_argument("--max-candidates", type=int, default=512)
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)


def use_tiny_shapes(args: argparse.Namespace) -> None:
    """Shrink the shape arguments in place to a smoke run of the whole path (CPU-sized)."""
    args.max_history, args.mean_candidates, args.max_candidates = 64, 4.0, 8
    args.min_history = min(args.min_history, args.max_history)
    args.num_items, args.embedding_dim, args.model_dim, args.num_layers = 500, 32, 64, 2


def synthetic_users(args: argparse.Namespace, num_users: int) -> SyntheticRankingSource:
    """``num_users`` training users of the shape arguments' sizes (one validation and one test user)."""
    from lightning_gem.data import SyntheticRankingSource

    return SyntheticRankingSource(
        num_items=args.num_items,
        num_train_users=num_users,
        num_val_users=1,
        num_test_users=1,
        min_history_length=args.min_history,
        max_history_length=args.max_history,
        mean_candidates=args.mean_candidates,
        max_candidates=args.max_candidates,
        seed=args.seed,
    )


def gem_ranker(
    source: SyntheticRankingSource,
    args: argparse.Namespace,
    attention_impl: str = "auto",
    token_multiple: int | None = None,
    fused_optimizer: bool = False,
    cuda_graphs: bool = False,
    token_growth: float | None = None,
) -> GEMRanker:
    """The GEM example at the shape arguments' widths (AdamW, lr 1e-4); ``token_multiple``, ``token_growth``,
    ``fused_optimizer`` and ``cuda_graphs``: GEMRanker's."""
    from lightning_gem.components import GEMRanker

    return GEMRanker(
        source.schema,
        embedding_dim=args.embedding_dim,
        model_dim=args.model_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_hidden_dims=(args.model_dim,),
        attention_impl=attention_impl,
        lr=1e-4,
        token_multiple=token_multiple,
        token_growth=token_growth,
        fused_optimizer=fused_optimizer,
        cuda_graphs=cuda_graphs,
    )


def device_kernels(prof: torch.profiler.profile) -> list[Any]:
    """The kernels a finished ``torch.profiler`` run recorded on CUDA devices, without the device-side ranges of
    user annotations (an optimizer step's), which would count their kernels twice."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in prof.events() if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


#: Kernel families of a training step, by substrings of their kernel names (the first family that matches).
KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("gdpa", "bwd_delta", "flash", "fmha", "attn", "attention")),
    ("embeddings", ("embedding", "tbe", "fbgemm", "bounds_check", "linearize_index")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "sgd", "adagrad")),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "_mm_", "scaled_mm", "splitk", "sm90_")),
    ("norm+quantize", ("norm", "quantize", "amax", "rowwise", "hadamard")),
    ("copies", ("memcpy", "memset", "copy")),
)


def kernel_family(name: str) -> str:
    """The :data:`KERNEL_FAMILIES` entry a kernel's name falls in; ``"other"`` (elementwise, reductions) if none.

    Example:
        >>> [kernel_family(name) for name in ("_gdpa_fwd_kernel", "nvjet_tst_128x256", "vectorized_elementwise")]
        ['attention', 'gemm', 'other']
    """
    lowered = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(key in lowered for key in keys):
            return family
    return "other"


def device_time(kernels: list[Any]) -> dict[str, float]:
    """Milliseconds of a profiled window's device timeline: each kernel family's busy time, ``busy`` (any kernel
    running) and ``window`` (first kernel's start to last kernel's end).

    A family's time is the union of its kernels' intervals (kernels of one family overlapping on two streams count
    once); families can overlap each other on different streams, so they may sum to more than ``busy``. Kernel
    times are the device's own, so they hold under a profiler; the window does not (profiling slows the host, so
    its gaps grow): divide by an unprofiled step time to get shares of a real step.

    Args:
        kernels: ``(name, start_us, end_us)`` triples, or profiler events with ``name`` and ``time_range``
            (:func:`device_kernels`).

    Example:
        >>> device_time([("_gdpa_fwd_kernel", 0, 600), ("nvjet_tst", 500, 900), ("elementwise", 1500, 2000)])
        {'attention': 0.6, 'gemm': 0.4, 'other': 0.5, 'busy': 1.4, 'window': 2.0}
    """
    spans = [_span(k) for k in kernels]
    spans = [s for s in spans if s[2] > s[1]]
    if not spans:
        return {}
    by_family: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for name, begin, end in spans:
        by_family[kernel_family(name)].append((begin, end))
    times = {family: _union_length(intervals) / 1e3 for family, intervals in sorted(by_family.items())}
    times["busy"] = _union_length([(b, e) for _, b, e in spans]) / 1e3
    times["window"] = (max(s[2] for s in spans) - min(s[1] for s in spans)) / 1e3
    return times


def family_kernels(kernels: list[Any], num_steps: int = 1, per_family: int = 5) -> list[str]:
    """What each :data:`KERNEL_FAMILIES` family of a profiled window spent its time on: per family (costliest
    first), its ``per_family`` costliest kernel names with their device ms a step and launches a step. The families'
    shares say where a step goes; this says which kernels those are (the elementwise ops, copies and reductions
    behind "other", say).

    Args:
        kernels: as :func:`device_time`'s.
        num_steps: profiled steps the window held (times and counts are per step).
        per_family: kernels listed per family.

    Example:
        >>> family_kernels([("_gdpa_fwd_kernel", 0, 600), ("elementwise_add", 600, 700), ("reduce_sum", 700, 1000),
        ...                 ("elementwise_add", 1000, 1100)], per_family=1)
        ['attention      0.60 ms   1 launches  _gdpa_fwd_kernel', 'other          0.30 ms   1 launches  reduce_sum']
    """
    spent: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    launches: collections.Counter[str] = collections.Counter()
    for name, begin, end in (_span(k) for k in kernels):
        spent[kernel_family(name)][name] += (end - begin) / 1e3 / num_steps
        launches[name] += 1
    lines = []
    for family, by_name in sorted(spent.items(), key=lambda item: -sum(item[1].values())):
        for name, ms in by_name.most_common(per_family):
            label = name if len(name) <= 100 else name[:97] + "..."
            lines.append(f"{family:<13} {ms:5.2f} ms {launches[name] / num_steps:3.0f} launches  {label}")
    return lines


def step_shares(times: dict[str, float], num_steps: int, step_ms: float) -> dict[str, float]:
    """:func:`device_time` of ``num_steps`` profiled steps as shares of an unprofiled step of ``step_ms``: each
    family's, ``busy`` and ``host gaps`` (``1 - busy``: the device waiting for the host)."""
    shares = {k: v / num_steps / step_ms for k, v in times.items() if k != "window"}
    shares["busy"] = min(shares.get("busy", 0.0), 1.0)
    return {**shares, "host gaps": 1.0 - shares["busy"]}


def _span(kernel: Any) -> tuple[str, float, float]:
    if isinstance(kernel, tuple):
        return kernel
    return kernel.name, float(kernel.time_range.start), float(kernel.time_range.end)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for begin, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total


class ProfileLastSteps(L.Callback):
    """``torch.profiler`` over the last ``num_steps`` training steps; prints the ops that took the most device
    and host time (where a slow stack spends its step). ``sync_stacks``: with Python stacks, and the places of the
    host's waits for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``)
    counted by their innermost frames outside torch and Lightning, however they were called (C++ included)."""

    def __init__(
        self, num_steps: int, last_step: int, label: str, path: Path | None = None, sync_stacks: bool = False
    ) -> None:
        self.first, self.label, self.profiler, self.path = last_step - num_steps, label, None, path
        self.num_steps, self.sync_stacks = num_steps, sync_stacks
        self.device_ms: dict[str, float] = {}  # device_time of the profiled steps, once training has ended

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.first and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, with_stack=self.sync_stacks)
            self.profiler.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        averages = self.profiler.key_averages()
        kernels = device_kernels(self.profiler)
        self.device_ms = device_time(kernels)
        text = [f"== {self.label}: device time of a profiled step, ms (window: under the profiler) =="]
        text += [f"{key:>14}  {value / self.num_steps:9.2f}" for key, value in self.device_ms.items()]
        # What the host issues a step (kernels, copies and fills): where the host bounds a step, its launches do.
        text.append(f"{'device ops':>14}  {len(kernels) / self.num_steps:9.1f}  (kernels, copies, fills a step)")
        text.append(f"== {self.label}: costliest kernels of each family, a step ==")
        text += family_kernels(kernels, self.num_steps)
        for key in ("self_device_time_total", "self_cpu_time_total"):
            text.append(f"== {self.label}: profile of the last steps, by {key} ==")
            text.append(averages.table(sort_by=key, row_limit=25, max_name_column_width=70))
        if self.sync_stacks:
            text += self._sync_places() + self._op_places()
        _emit("\n".join(text), self.path)

    @staticmethod
    def _place(event: Any, max_ops: int) -> tuple[list[str], list[str]]:
        """The ops enclosing ``event`` (innermost first, up to ``max_ops`` below the first Python frame) and its
        innermost three Python frames outside torch and Lightning. With stacks on, the profiler records Python
        calls as events too: this walks up the enclosing events."""
        ops, frames, owner = [], [], event.cpu_parent
        while owner is not None and len(frames) < 3:
            name = owner.name
            if ".py(" in name:
                if "/torch/" not in name and "/lightning/" not in name:
                    frames.append(name.rsplit("/", 1)[-1])
            elif not frames and len(ops) < max_ops:
                ops.append(name)
            owner = owner.cpu_parent
        if not frames:  # some profiler builds keep the Python frames as each op's stack instead
            frames = [f for f in getattr(event, "stack", None) or [] if "/torch/" not in f and "/lightning/" not in f]
            frames = [f.rsplit("/", 1)[-1] for f in frames[:3]]
        return ops, frames

    def _sync_places(self) -> list[str]:
        waits: collections.Counter[str] = collections.Counter()
        waited: collections.Counter[str] = collections.Counter()
        for event in self.profiler.events():
            if event.name not in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
                continue
            ops, frames = self._place(event, 2)
            place = f"{event.name} in {' < '.join(ops) or '-'}: " + ("; ".join(frames) or "(no Python frame)")
            waits[place] += 1
            waited[place] += event.cpu_time_total / 1e3
        lines = [f"== {self.label}: host waits for the device in the profiled steps (count, ms, where) =="]
        lines += [f"{n:>5} {waited[place]:9.2f}  {place}" for place, n in waits.most_common(25)]
        return lines

    def _op_places(self, rows: int = 40) -> list[str]:
        """The ops that ran kernels themselves (their own device time; on CPU, their own host time), by op and
        Python place: which lines of the model the copies, reductions and small GEMMs come from. Backward ops run
        on the autograd engine's thread, with no Python frame: those are listed by op and forward op (the
        profiler links them by sequence number only, so the place is the op's name)."""
        cuda = torch.cuda.is_available()
        spent: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        for event in self.profiler.events():
            own = event.self_device_time_total if cuda else event.self_cpu_time_total
            if own <= 0 or ".py(" in event.name or not event.name.startswith("aten::"):
                continue
            ops, frames = self._place(event, 8)
            caller = re.sub(r" of \w+ object at 0x[0-9a-f]+", "", ops[-1]) if ops else "-"
            place = f"{event.name} < {caller}: " + ("; ".join(frames) or "(no Python frame)")
            spent[place] += own / 1e3
            calls[place] += 1
        unit = "device" if cuda else "host"
        lines = [f"== {self.label}: own {unit} time of ops by place in the profiled steps (calls, ms, where) =="]
        lines += [f"{calls[place]:>5} {ms:9.2f}  {place}" for place, ms in spent.most_common(rows)]
        return lines


class CProfileLastSteps(L.Callback):
    """Python's ``cProfile`` over the last ``num_steps`` training steps; prints the functions with the most own
    time and the most cumulative time (what the host does while a host-bound step's GPU waits)."""

    def __init__(
        self, num_steps: int, last_step: int, label: str, path: Path | None = None, dump: Path | None = None
    ) -> None:
        import cProfile

        self.first, self.label, self.profiler, self.on = last_step - num_steps, label, cProfile.Profile(), False
        self.path, self.dump = path, dump

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.first and not self.on:
            self.on = True
            self.profiler.enable()

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.on:
            return
        self.profiler.disable()
        _emit(cprofile_table(self.profiler, f"{self.label}: cProfile of the last steps", rows=40), self.path)
        if self.dump is not None:  # the whole profile, for pstats or snakeviz
            self.dump.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.dump_stats(self.dump)


def cprofile_table(profiler: Any, title: str, rows: int, keys: tuple[str, ...] = ("tottime", "cumulative")) -> str:
    """A finished ``cProfile.Profile``'s ``rows`` costliest functions by each of ``keys`` (own time, then time with
    callees), each table headed ``== title, by key ==``."""
    import io
    import pstats

    lines = []
    for key in keys:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(rows)
        lines.append(f"== {title}, by {key} ==")
        lines.extend(line[:200] for line in text.getvalue().splitlines()[4:] if line.strip())  # from the column header
    return "\n".join(lines)


class StepClock(L.Callback):
    """The end of every training batch on the device's timeline and its loss (the ranks' mean when ``mean_loss``);
    with gradient accumulation, a step is ``batches_per_step`` batches.

    On CUDA each end is an event recorded on the current stream and each loss stays a device tensor until training
    ends: the clock adds no device sync per step, so the host runs ahead of the device as it would in a run
    without it, and the interval between two ends is the step's real cost (data loading and the prefetched
    work between steps included). Elsewhere: wall-clock times.
    """

    def __init__(self, mean_loss: bool = False, batches_per_step: int = 1) -> None:
        self.mean_loss = mean_loss
        self.batches_per_step = batches_per_step  # micro-batches of one optimizer step (gradient accumulation)
        self.ends: list[float] = []  # seconds from the first step's end, filled when training ends
        self.losses: list[float] = []
        self._marks: list[Any] = []
        self._losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"].detach().float().clone()
        if self.mean_loss and torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        self._losses.append(loss)
        if loss.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._marks and isinstance(self._marks[0], torch.cuda.Event):
            self._marks[-1].synchronize()
            self.ends = [self._marks[0].elapsed_time(mark) / 1e3 for mark in self._marks]
        else:
            self.ends = [mark - self._marks[0] for mark in self._marks] if self._marks else []
        self.losses = [float(loss) for loss in self._losses]

    def median_interval(self, skip: int) -> float:
        """Median seconds between consecutive step ends, after the first ``skip`` steps (a step ends with its last
        micro-batch)."""
        k = self.batches_per_step
        ends = self.ends[k - 1 :: k][skip:]
        return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False)) if len(ends) > 1 else math.nan


class SyncPoints(L.Callback):
    """Where one CUDA training step makes the host wait for the device: ``torch.cuda.set_sync_debug_mode("warn")``
    over step ``step``, each synchronising call counted by its place (the innermost frames outside torch)."""

    def __init__(self, step: int, label: str, path: Path | None = None) -> None:
        self.step, self.label, self.path = step, label, path
        self.counts: collections.Counter[str] = collections.Counter()
        self._caught: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or not torch.cuda.is_available() or self._caught is not None:
            return
        self._caught = warnings.catch_warnings()
        self._caught.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._count
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._caught is None or trainer.global_step != self.step + 1:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._caught.__exit__(None, None, None)
        lines = [f"== {self.label}: {sum(self.counts.values())} device syncs in training step {self.step} =="]
        lines += [f"{n:>5}  {where}" for where, n in self.counts.most_common()]
        _emit("\n".join(lines), self.path)

    def _count(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [
            f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename
        ]
        self.counts["; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:])] += 1


def profiling_callbacks(args: argparse.Namespace, last_step: int, label: str, stem: str | None = None) -> list[Any]:
    """The profilers the command line asks for (``--cprofile-steps``, ``--profile-steps``, ``--sync-debug``), over
    the steps up to ``last_step`` and labelled ``label``; with ``stem``, each appends its report to a file of that
    stem instead of printing it."""

    def path(suffix: str) -> Path | None:
        return None if stem is None else Path(stem + suffix)

    callbacks: list[Any] = []
    if args.cprofile_steps:
        dump = getattr(args, "cprofile_dump", None)
        dump = None if dump is None else Path(dump) / f"{label}.pstats"
        callbacks.append(CProfileLastSteps(args.cprofile_steps, last_step, label, path(".cprof.txt"), dump))
    if args.profile_steps:
        callbacks.append(
            ProfileLastSteps(args.profile_steps, last_step, label, path(".prof.txt"), sync_stacks=args.sync_debug)
        )
    if args.sync_debug:
        callbacks.append(SyncPoints(args.warmup, label, path(".syncs.txt")))
    return callbacks


def _emit(text: str, path: Path | None) -> None:
    """Print ``text``, or append it to ``path`` when given (a long profile stays out of the console)."""
    if path is None:
        print(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text + "\n")
