"""Multi-process helpers for tests and benchmarks of distributed code.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)``
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

import numpy as np
import torch

__all__ = ["RankError", "forget_torchrec_node_groups", "free_port", "full_weights", "run_ranks"]


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` failed; the message holds its traceback."""


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, threads: int, args: tuple, queue: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        OMP_NUM_THREADS=str(threads),
    )
    import torch

    torch.set_num_threads(threads)
    try:
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results in rank order.

    ``timeout``: seconds to wait for each result; ``threads``: intra-op CPU threads of each process.

    Raises:
        RankError: a rank raised (the first failing rank's traceback), or a rank exited or timed out
            without a result.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, threads, args, queue)) for r in range(world_size)
    ]
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


def forget_torchrec_node_groups() -> None:
    """Drop torchrec's process-wide cache of its table-row-wise node groups.

    torchrec keeps them in module globals for the life of the process; a process that trains several
    layouts in turn (tests, benchmarks) starts each fit without the previous fit's groups.
    """
    from torchrec.distributed import comm

    comm._INTRA_PG = comm._CROSS_PG = comm._INTRA_PG_2D = comm._CROSS_PG_2D = None
    comm._NODE_GROUP_SIZE_2D = None


def full_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every entry of the (sharded) model's state dict as a full CPU array, the same on every rank (collective).

    Arrays, not tensors: tensors cross process boundaries as shared memory that dies with the rank.

    Raises:
        RuntimeError: the replicas of a torchrec table hold different values.
    """
    return {name: _full(value).cpu().numpy() for name, value in model.state_dict().items()}


def _full(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from lightning_gem.strategies.sparse import local_shards

        if not hasattr(value.to_local(), "local_shards"):  # FSDP2 / tensor-parallel DTensor
            return value.full_tensor().detach().float().clone()
        # torchrec's sharded table: place this rank's shards, average over the ranks holding each element
        # (replicas of a shard hold equal values). On the shards' device, which the process group can reduce.
        shards = local_shards(value)
        device = shards[0][0].device if shards else _collective_device()
        full = torch.zeros(value.shape, dtype=torch.float32, device=device)
        count = torch.zeros(value.shape, dtype=torch.float32, device=device)
        for shard, offset in shards:
            index = tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))
            full[index] += shard.detach().to(full.dtype)
            count[index] += 1
        high = torch.where(count > 0, full, torch.finfo(full.dtype).min)
        low = torch.where(count > 0, full, torch.finfo(full.dtype).max)
        torch.distributed.all_reduce(full)
        torch.distributed.all_reduce(count)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
        spread = float((high - low).abs().max())
        if spread != 0.0:
            raise RuntimeError(f"replicas of a table differ by {spread}")
        return full / count
    return value.detach().float().clone() if value.is_floating_point() else value.detach().clone()


def _collective_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
