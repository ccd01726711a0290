"""One spawn runner for the gloo tests: ``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)``
in ``world_size`` fresh processes (a free port each call, the environment variables torchrun sets, so
Lightning sees an externally launched job) and returns each rank's return value, in rank order.

An exception in any rank is re-raised here as ``RankError`` carrying that rank's formatted traceback
(a string: it survives pickling whatever the original exception holds). ``fn`` must be importable
(a module-level function) and its arguments and results picklable plain values (numpy arrays, not
tensors: a tensor is passed as shared memory that dies with its process).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankError", "free_port", "run_ranks"]


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` failed; the message holds its traceback."""


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001  (everything must reach the parent)
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results in rank order.

    Raises:
        RankError: a rank raised (the first failing rank's traceback), or a rank exited or timed out
            without a result.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception as err:  # queue.Empty: a rank hung or died
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in failures]
                raise RankError(f"no result within {timeout} s; ranks that exited without one: {dead}") from err
            (results if ok else failures)[rank] = value
            if failures:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 30)
            if p.is_alive():
                p.terminate()
                p.join()
    if failures:
        rank = min(failures)
        raise RankError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [results[r] for r in range(world_size)]
