"""Where a GDPA call's time goes: device time per kernel, host time to issue the call, backward on its own.

For each workload of ``attention.py`` (same shapes and seeds) and its first mode, on a CUDA machine::

    python examples/benchmarks/attention_profile.py --workloads block4k,cross,jagged1k

prints, for the forward (under ``no_grad``; ``fwd+graph``: with grad enabled, as in training) and the backward of
``gdpa(..., impl="triton")``:

- ``host us``: wall time to issue the call without waiting for the device (mean of many calls after a
  synchronize; the device queue is far from full, so this is the host's own cost);
- ``device us``: the sum of the device kernels' durations per call, from ``torch.profiler`` (each kernel
  named, with its share);
- ``timed ms``: the median of ``triton.testing.do_bench`` of the call alone (forward; or the backward through
  ``torch.autograd.grad`` on a kept graph), i.e. what ``attention.py`` sees: the larger of host and device
  time when the host is the bottleneck.

With ``--candidates`` it also times every tile candidate of the forward and backward launchers on the
workload (what the tuner chooses among), so variants (tile shapes, TMA or pointer loads, atomic or
one-launch backward) are compared on the same inputs in one run.

``--host-only`` needs no GPU: it runs the whole Python path of every mode of each workload on CPU tensors, with
the kernels defined by Triton's interpreter and their launches replaced by no-ops, and prints the median host
time per call of the forward (grad enabled, as in training; and under ``no_grad``) and of the backward, phase by
phase, with the torch ops each issues (on a GPU host each costs an allocation or a kernel launch)::

    python examples/benchmarks/attention_profile.py --host-only --workloads cross,jagged1k,block4k

What it does not see: Triton's own launcher (argument binding and specialization, the driver call) and the CUDA
runtime; both come on top on a GPU host. The rest runs as on CUDA: the kernel and launch shape are the tuner's
first CUDA candidate, remembered as a tuned choice is, and segments hold one token each (the length hints are
the workload's) so that the torch ops cost their dispatch only, not CPU work on real sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import WORKLOAD_NAMES, make_case, make_workload
from gem_example import cprofile_table

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.spec import Spec


def _host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernels(fn, calls: int = 20) -> list[tuple[str, float]]:
    """(kernel name, device us per call), largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = event.self_cuda_time_total
        if device_us > 0:
            rows.append((event.key, device_us / calls))
    return sorted(rows, key=lambda r: -r[1])


def _candidates(case, kwargs: dict) -> None:
    """Median time (``do_bench``) of each forward and backward tile candidate, launched directly on the case's
    inputs."""
    import triton.testing

    from lightning_gem.ops.attention.impl.triton._tuning import (
        SHORT_QUERY_ROWS,
        backward_candidates,
        candidate_tiles,
    )
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    q, k, v = case.q, case.k, case.v
    max_q, max_kv = kwargs["max_seq_len_q"], kwargs["max_seq_len_kv"]
    spec = Spec(case.q_offsets, case.kv_offsets, None, None, case.activation, case.causal, None, case.block_size,
                case.scale, max_q, max_kv)  # fmt: skip
    fwd = candidate_tiles("fwd", q.dtype, q.device, q.shape[2], block_size=case.block_size, max_len_q=max_q,
                          pointwise=case.activation != "softmax")  # fmt: skip
    out, lse = gdpa_forward(q, k, v, spec)
    print("  forward candidates:")
    for tiles in fwd:
        try:
            ms = triton.testing.do_bench(lambda t=tiles: gdpa_forward(q, k, v, spec, tiles=t), warmup=10, rep=50,
                                         return_mode="median")  # fmt: skip
            print(f"    {ms * 1e3:8.1f} us  {tiles}")
        except Exception as error:
            print(f"    failed    {tiles}: {type(error).__name__}")
    print("  backward candidates:")
    short_query = max_q <= SHORT_QUERY_ROWS
    for plan in backward_candidates(q.dtype, q.device, q.shape[2], deterministic=False, block_size=case.block_size,
                                    max_len_q=max_q, short_query=short_query):  # fmt: skip
        tiles = {"short_tiles": plan.dkdv} if plan.short else {"dkdv_tiles": plan.dkdv, "dq_tiles": plan.dq}

        def run(tiles=tiles) -> None:
            gdpa_backward(case.grad_out, q, k, v, out, lse, spec, **tiles)

        try:
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            print(f"    {ms * 1e3:8.1f} us  {plan}")
        except Exception as error:
            print(f"    failed    {plan}: {type(error).__name__}")


def _calls(case, kwargs: dict) -> tuple:
    """``(forward, forward under no_grad, backward, leaves)`` of one GDPA call on fresh leaves of ``case``'s q, k,
    v; ``backward`` runs ``autograd.grad`` on a graph made once and kept."""
    kv_offsets = None if case.self_attention else case.kv_offsets
    leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]

    def forward() -> torch.Tensor:
        return gdpa(*leaves, case.q_offsets, kv_offsets, **kwargs)

    def forward_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return forward()

    out = forward()

    def backward() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, case.grad_out, retain_graph=True)

    return forward, forward_no_grad, backward, leaves


def profile_case(name: str, candidates: bool) -> None:
    import triton.testing

    workload = make_workload(name, tiny=False, seed=0)
    label, options = workload.modes[0]
    case = make_case(workload, label, options, torch.device("cuda"))
    hints = dict(max_seq_len_q=int(case.q_lengths.max()), max_seq_len_kv=int(case.kv_lengths.max()))
    kwargs = dict(case.options, scale=case.scale, **hints, impl="triton", check_offsets=False)
    forward, forward_no_grad, backward, _ = _calls(case, kwargs)
    backward()  # compiles and tunes

    print(f"\n== {name}: {label} ==")
    # "forward" under no_grad, as before; "fwd+graph" with grad enabled, as in training (the graph is dropped).
    for part, fn in (("forward", forward_no_grad), ("fwd+graph", forward), ("backward", backward)):
        host = _host_us(fn)
        kernels = _kernels(fn)
        device = sum(us for _, us in kernels)
        timed = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"{part:9s} host {host:8.1f} us | device {device:8.1f} us | timed {timed * 1e3:8.1f} us")
        for kernel, us in kernels[:8]:
            print(f"    {us:8.1f} us  {kernel[:110]}")
    if candidates:
        _candidates(case, kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# --host-only: the Python path with no-op launches, on CPU


def _no_op_launches() -> Counter:
    """Kernels defined by Triton's interpreter, launched as no-ops (counted); the tuner remembers CUDA's first
    candidate for each key, as after tuning on a GPU. Returns the launch counter."""
    if "lightning_gem.ops.attention.impl.triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("--host-only must define the kernels itself: run it in a fresh process")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined (on import below)
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_gem.ops.attention.impl.triton import _tuning, backward, forward

    launches: Counter = Counter()

    def run(kernel, *args, grid, warmup, **meta) -> None:
        launches[kernel.__name__] += 1

    def first_remembered(registry, key, candidates, run, tensors, **options):
        registry[key] = candidates[0]
        return candidates[0]

    cuda = torch.device("cuda")
    candidate_tiles, backward_candidates = _tuning.candidate_tiles, _tuning.backward_candidates
    InterpretedFunction.run = run
    _tuning.pick_fastest = first_remembered
    forward.candidate_tiles = lambda kernel, dtype, device, *a, **kw: candidate_tiles(kernel, dtype, cuda, *a, **kw)
    backward.backward_candidates = lambda dtype, device, *a, **kw: backward_candidates(dtype, cuda, *a, **kw)
    return launches


def _median_us(fn: Callable[[], object], calls: int, rounds: int = 3) -> float:
    """Median host time of ``fn`` over ``calls`` calls, the lowest of ``rounds`` rounds (other work on the machine
    only ever adds time)."""
    for _ in range(min(100, calls)):
        fn()
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def _torch_ops(fn: Callable[[], object], calls: int = 20) -> str:
    """The aten ops one call issues (``torch.profiler`` on CPU: no dispatch mode, so the path is unchanged)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    counts = {e.key.removeprefix("aten::"): e.count // calls for e in prof.key_averages() if e.key.startswith("aten::")}
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n)


@dataclasses.dataclass
class _Stubs:
    """Replaces a layer of the call with a stub that returns what the real layer returned once."""

    patches: list[tuple[object, str, object]] = dataclasses.field(default_factory=list)

    def replace(self, owner: object, name: str, fake: object) -> None:
        self.patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fake)

    def replay(self, owner: object, name: str, call: Callable[[], object]) -> None:
        """Stub ``owner.name`` with what it returned during one real ``call()``."""
        real, fake = _remembering(getattr(owner, name))
        self.replace(owner, name, real)
        call()
        setattr(owner, name, fake)  # restore() still puts back the original: the patch above recorded it

    def restore(self) -> None:
        for owner, name, real in reversed(self.patches):
            setattr(owner, name, real)
        self.patches.clear()


def _remembering(fn: Callable) -> tuple[Callable, Callable]:
    """``fn`` that keeps its last result, and a stub that returns that result without doing anything."""
    kept: list = []

    def real(*args, **kwargs):
        kept[:] = [fn(*args, **kwargs)]
        return kept[0]

    return real, lambda *args, **kwargs: kept[0]


class _Identity(torch.autograd.Function):
    """The least an autograd.Function over q, k, v costs: the floor under the op's own host time."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def profile_host(name: str, calls: int, cprofile: bool) -> None:
    """Host time of every mode of workload ``name`` per phase, with no-op launches (see the module docstring)."""
    launches = _no_op_launches()
    full = make_workload(name, tiny=False, seed=0)
    kv_lengths = full.q_lengths if full.kv_lengths is None else full.kv_lengths
    hints = dict(max_seq_len_q=int(full.q_lengths.max()), max_seq_len_kv=int(kv_lengths.max()))
    one_kv = None if full.kv_lengths is None else torch.ones_like(full.kv_lengths)
    ones = dataclasses.replace(full, q_lengths=torch.ones_like(full.q_lengths), kv_lengths=one_kv)
    for label, options in full.modes:
        case = make_case(ones, label, options, torch.device("cpu"))
        print(
            f"\n== {name}: {label} | {len(case.q_lengths)} segments, H={case.q.shape[1]}, D={case.q.shape[2]}, "
            f"{case.q.dtype}, hints {hints} =="
        )
        _profile_host_case(case, hints, launches, calls, cprofile)


def _profile_host_case(case, hints: dict, launches: Counter, calls: int, cprofile: bool) -> None:
    import lightning_gem.ops.attention.impl.triton as triton_impl
    from lightning_gem.ops.attention.impl.triton import backward, forward, ops

    kwargs = dict(case.options, scale=case.scale, **hints, impl="triton", check_offsets=False)
    forward_grad, forward_no_grad, backward_call, leaves = _calls(case, kwargs)
    backward_call()
    launched = []
    for fn in (forward_grad, backward_call):
        launches.clear()
        fn()
        launched.append(dict(launches))
    print(f"launches: forward {launched[0]}, backward {launched[1]}")
    floor_out = _Identity.apply(*leaves)
    floor_fwd = _median_us(lambda: _Identity.apply(*leaves), calls)
    floor_bwd = _median_us(lambda: torch.autograd.grad(floor_out, leaves[0], case.grad_out, retain_graph=True), calls)
    print(f"floor, an empty autograd.Function over q, k, v: forward {floor_fwd:.1f} us, backward {floor_bwd:.1f} us")

    # Each phase stubs the layers below it: the differences between rows are the phases' own host time.
    stubs = _Stubs()
    rows = []
    forward_phases = ("api: gdpa validation, dispatch", "+ gdpa_triton, autograd.Function", "+ launcher: buffers, "
                      "args, tiles", "+ launch()")  # fmt: skip
    for phase, stub in zip(forward_phases, ("impl", "launcher", "launch", None), strict=True):
        if stub == "impl":
            stubs.replay(triton_impl, "gdpa_triton", forward_grad)
        elif stub == "launcher":
            stubs.replay(ops, "gdpa_forward", forward_grad)
        elif stub == "launch":
            stubs.replace(forward, "launch", lambda *a, **kw: None)
        rows.append((phase, _median_us(forward_grad, calls), _median_us(forward_no_grad, calls)))
        stubs.restore()
    print(f"forward host us (median of {calls}, lowest of 3 rounds; grad enabled | no_grad), cumulative:")
    for phase, grad_us, no_grad_us in rows:
        print(f"    {grad_us:7.1f} | {no_grad_us:7.1f}  {phase}")
    rows = []
    backward_phases = ("autograd engine, Function.backward", "+ launcher", "+ launch()")
    for phase, stub in zip(backward_phases, ("launcher", "launch", None), strict=True):
        if stub == "launcher":
            stubs.replay(ops, "gdpa_backward", backward_call)
        elif stub == "launch":
            stubs.replace(backward, "launch", lambda *a, **kw: None)
        rows.append((phase, _median_us(backward_call, calls)))
        stubs.restore()
    print(f"backward host us (median of {calls}, lowest of 3 rounds; autograd.grad on a kept graph), cumulative:")
    for phase, us in rows:
        print(f"    {us:7.1f}  {phase}")
    print(f"torch ops per forward: {_torch_ops(forward_grad)}")
    print(f"torch ops per backward: {_torch_ops(backward_call)}")
    if cprofile:
        _print_cprofile(forward_grad, backward_call, calls)


def _print_cprofile(forward_call: Callable, backward_call: Callable, calls: int) -> None:
    import cProfile

    for part, fn in (("forward", forward_call), ("backward", backward_call)):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        print(cprofile_table(profiler, f"cProfile, {part} ({calls} calls)", rows=20, keys=("tottime",)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="block4k,cross,jagged1k,jagged4k",
                        help=f"comma-separated from {', '.join(WORKLOAD_NAMES)}")  # fmt: skip
    parser.add_argument("--candidates", action="store_true", help="also time every tile candidate")
    parser.add_argument("--host-only", action="store_true",
                        help="no GPU: host time of the Python path per phase, kernel launches as no-ops")  # fmt: skip
    parser.add_argument("--calls", type=int, default=3000, help="--host-only: timed calls per phase")
    parser.add_argument("--cprofile", action="store_true", help="--host-only: also print cProfile's top functions")
    args = parser.parse_args()
    if args.host_only:
        for name in args.workloads.split(","):
            profile_host(name.strip(), args.calls, args.cprofile)
        return
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    for name in args.workloads.split(","):
        profile_case(name.strip(), args.candidates)


if __name__ == "__main__":
    main()
