"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP) for the gem5d strategy.

A checkpoint is a directory: DCP shards (every rank writes its part of the model, of the dense
optimizers and of the fused embedding optimizer) plus ``meta.pt``, the rest of Lightning's checkpoint
(loops, callbacks, the DataModule's position, hyper-parameters) and the layout that wrote it.

Keys: ``model`` is ``module.state_dict()`` (torchrec's sharded tables are DTensors/ShardedTensors and
FSDP2's parameters DTensors, so DCP reshards both on load); ``optimizer_{i}`` the dense optimizers,
flattened (``flatten_optimizer_state_dict=True``: keys are parameter names, so they reshard too);
``embedding_optimizer`` the fused optimizer's state, which loads only onto the same embedding plan
(torchrec cannot reshard it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dense import split_mixed_param_groups

__all__ = ["LayoutMismatchError", "consolidate", "is_distributed_checkpoint", "load", "save"]

META_FILENAME = "meta.pt"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's own index, written by every save
_MODEL, _EMBEDDING_OPTIMIZER = "model", "embedding_optimizer"


class LayoutMismatchError(ValueError):
    """The embedding optimizer state was saved under another embedding plan and cannot be resharded."""


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save`."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file()


# Both run with the optimizer's mixed parameter groups split (dense.split_mixed_param_groups): DCP first steps an
# optimizer that has no state yet with zero gradients, and the multi-tensor kernels refuse groups mixing FSDP2's
# DTensors with the replicated plain parameters. The flattened state dicts are keyed by parameter name, so they
# are the same with the groups split or not.


def _dense_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    with split_mixed_param_groups(optimizer):
        return get_optimizer_state_dict(module, optimizer, options=options)


def _set_dense_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    with split_mixed_param_groups(optimizer):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=options)


def save(
    path: str | Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    embedding_optimizer: Any,
    meta: dict[str, Any],
    *,
    is_global_zero: bool,
) -> None:
    """Write a distributed checkpoint of ``module``, its optimizers and ``meta`` to the directory ``path``.

    Every rank must call it. A file at ``path`` is replaced; ``meta`` (plain objects) is written by rank 0, last
    and atomically (a temporary file renamed), and an earlier checkpoint's meta is removed before its shards are
    overwritten: a directory is a complete checkpoint exactly when it holds ``meta.pt``, even if the process is
    killed while saving.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if is_global_zero:
        if path.is_file():
            path.unlink()
        elif path.is_dir() and not (is_distributed_checkpoint(path) or (path / _DCP_METADATA).is_file()):
            raise IsADirectoryError(f"the checkpoint path is a directory that is not a gem5d checkpoint: {path}")
        (path / META_FILENAME).unlink(missing_ok=True)
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    state: dict[str, Any] = {_MODEL: module.state_dict()}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = _dense_optimizer_state(module, optimizer)
    if embedding_optimizer is not None:
        state[_EMBEDDING_OPTIMIZER] = embedding_optimizer.state_dict()
    dcp.save(state, checkpoint_id=path)
    if is_global_zero:
        partial = path / f"{META_FILENAME}.partial"
        torch.save(meta, partial)
        os.replace(partial, path / META_FILENAME)
    if dist.is_initialized():
        dist.barrier()


def read_meta(path: str | Path) -> dict[str, Any]:
    """The metadata ``meta.pt`` of a checkpoint written by :func:`save`."""
    path = Path(path)
    if not is_distributed_checkpoint(path):
        raise FileNotFoundError(f"not a gem5d distributed checkpoint (a directory with {META_FILENAME}): {path}")
    return torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)


def load(
    path: str | Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    embedding_optimizer: Any,
    *,
    same_embedding_plan: bool,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` in place and return its metadata.

    The model always loads (DCP reshards to this world and layout). Optimizer states load when
    ``optimizers`` is not empty: the dense ones reshard; the embedding optimizer's needs
    ``same_embedding_plan``.

    Raises:
        LayoutMismatchError: optimizer states requested but the embedding plan differs from the saved one.
        FileNotFoundError: ``path`` is not such a checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    if optimizers and embedding_optimizer is not None and not same_embedding_plan:
        saved = meta.get("gem5d", {})
        raise LayoutMismatchError(
            "the checkpoint's embedding optimizer state was saved under another layout or embedding plan "
            f"({saved.get('layout')}; {saved.get('plan')}), and torchrec cannot reshard optimizer state: "
            "load the weights only (trainer.validate/test/predict(ckpt_path=...), or a new run with "
            "GEM5DStrategy(weights_from=path)) or resume on the saved layout"
        )
    model_state = module.state_dict()
    state: dict[str, Any] = {_MODEL: model_state}
    dense_states = []
    for index, optimizer in enumerate(optimizers):
        dense_states.append(_dense_optimizer_state(module, optimizer))
        state[f"optimizer_{index}"] = dense_states[-1]
    if optimizers and embedding_optimizer is not None:
        state[_EMBEDDING_OPTIMIZER] = embedding_optimizer.state_dict()
    dcp.load(state, checkpoint_id=Path(path))
    module.load_state_dict(state[_MODEL], strict=strict)
    for optimizer, dense_state in zip(optimizers, dense_states, strict=True):
        _set_dense_optimizer_state(module, optimizer, dense_state)
    if optimizers and embedding_optimizer is not None:
        embedding_optimizer.load_state_dict(state[_EMBEDDING_OPTIMIZER])
    return meta


def consolidate(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """The checkpoint as one ordinary Lightning checkpoint (full tensors, no process group needed).

    Its ``state_dict`` holds the full model weights under the names of the unsharded model (torchrec
    tables and FSDP2/tensor-parallel parameters keep their module paths), so
    ``LightningModule.load_from_checkpoint`` rebuilds the model in a single process for evaluation or
    export. Optimizer states are left out. Written to ``out`` with ``torch.save`` when given.

    Example:
        >>> from lightning_gem.components import GEMRanker  # doctest: +SKIP
        >>> consolidate("epoch=0-step=6.ckpt", "model.ckpt")  # doctest: +SKIP
        >>> model = GEMRanker.load_from_checkpoint("model.ckpt")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint = {k: v for k, v in read_meta(path).items() if k != "gem5d"}
    prefix = f"{_MODEL}."
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({_MODEL: model}, checkpoint_id=Path(path), no_dist=True)
    checkpoint["state_dict"] = model
    if out is not None:
        torch.save(checkpoint, out)
    return checkpoint


def remove(path: str | Path) -> None:
    """Delete a checkpoint directory written by :func:`save` (Lightning's ``remove_checkpoint``)."""
    path = Path(path)
    if is_distributed_checkpoint(path):
        shutil.rmtree(path)
    elif path.is_file():
        path.unlink()
