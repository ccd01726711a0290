"""Where a GDPA call's time goes: device time per kernel, host time to issue the call, backward on its own.

For each workload of ``attention.py`` (same shapes and seeds) and its first mode, on a CUDA machine::

    python examples/benchmarks/attention_profile.py --workloads block4k,cross,jagged1k

prints, for the forward and the backward of ``gdpa(..., impl="triton")``:

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
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import WORKLOAD_NAMES, make_case, make_workload  # noqa: E402

from lightning_gem.ops import gdpa  # noqa: E402


def _host_us(fn, calls: int = 200) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernels(fn, calls: int = 20) -> list[tuple[str, float]]:  # noqa: ANN001
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


def _candidates(case, kwargs: dict) -> None:  # noqa: ANN001
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
    jagged = (case.q_offsets, case.kv_offsets, None, None)
    mode = dict(activation=case.activation, causal=case.causal, window=None, block_size=case.block_size,
                scale=case.scale)  # fmt: skip
    max_q, max_kv = kwargs["max_seq_len_q"], kwargs["max_seq_len_kv"]
    fwd = candidate_tiles("fwd", q.dtype, q.device, q.shape[2], block_size=case.block_size, max_len_q=max_q)
    out, lse = gdpa_forward(q, k, v, *jagged, **mode, max_seq_len_q=max_q)
    print("  forward candidates:")
    for tiles in fwd:
        try:
            ms = triton.testing.do_bench(lambda t=tiles: gdpa_forward(q, k, v, *jagged, **mode, max_seq_len_q=max_q,
                                                                      tiles=t), warmup=10, rep=50,
                                         return_mode="median")  # fmt: skip
            print(f"    {ms * 1e3:8.1f} us  {tiles}")
        except Exception as error:  # noqa: BLE001  (out of shared memory and kin)
            print(f"    failed    {tiles}: {type(error).__name__}")
    print("  backward candidates:")
    short_query = max_q <= SHORT_QUERY_ROWS
    for plan in backward_candidates(q.dtype, q.device, q.shape[2], deterministic=False, block_size=case.block_size,
                                    max_len_q=max_q, short_query=short_query):  # fmt: skip
        tiles = {"short_tiles": plan.dkdv} if plan.short else {"dkdv_tiles": plan.dkdv, "dq_tiles": plan.dq}

        def run(tiles=tiles) -> None:  # noqa: ANN001
            gdpa_backward(case.grad_out, q, k, v, out, lse, *jagged, **mode, max_seq_len_q=max_q, max_seq_len_kv=max_kv,
                          **tiles)  # fmt: skip

        try:
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            print(f"    {ms * 1e3:8.1f} us  {plan}")
        except Exception as error:  # noqa: BLE001
            print(f"    failed    {plan}: {type(error).__name__}")


def profile_case(name: str, candidates: bool) -> None:
    import triton.testing

    workload = make_workload(name, tiny=False, seed=0)
    label, options = workload.modes[0]
    case = make_case(workload, label, options, torch.device("cuda"))
    kv_offsets = None if case.self_attention else case.kv_offsets
    kwargs = dict(case.options, scale=case.scale, max_seq_len_q=int(case.q_lengths.max()),
                  max_seq_len_kv=int(case.kv_lengths.max()), impl="triton", check_offsets=False)  # fmt: skip
    leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]

    def forward() -> torch.Tensor:
        return gdpa(*leaves, case.q_offsets, kv_offsets, **kwargs)

    def forward_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return forward()

    out = forward()
    torch.autograd.grad(out, leaves, case.grad_out, retain_graph=True)  # compiles and tunes

    def backward() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, case.grad_out, retain_graph=True)

    print(f"\n== {name}: {label} ==")
    for part, fn in (("forward", forward_no_grad), ("backward", backward)):
        host = _host_us(fn)
        kernels = _kernels(fn)
        device = sum(us for _, us in kernels)
        timed = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"{part:9s} host {host:8.1f} us | device {device:8.1f} us | timed {timed * 1e3:8.1f} us")
        for kernel, us in kernels[:8]:
            print(f"    {us:8.1f} us  {kernel[:110]}")
    if candidates:
        _candidates(case, kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="block4k,cross,jagged1k,jagged4k",
                        help=f"comma-separated from {', '.join(WORKLOAD_NAMES)}")  # fmt: skip
    parser.add_argument("--candidates", action="store_true", help="also time every tile candidate")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    for name in args.workloads.split(","):
        profile_case(name.strip(), args.candidates)


if __name__ == "__main__":
    main()
