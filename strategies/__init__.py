"""Parallel training strategies: ``strategy="gem5d"``, sparse 2D embedding sharding x dense 3D.

Importing this package registers ``"gem5d"`` in Lightning's ``StrategyRegistry`` (see
:func:`register_strategies`), so ``Trainer(strategy="gem5d")`` and ``strategy: gem5d`` in a LightningCLI
config resolve to :class:`GEM5DStrategy` with its defaults.

Modules: ``mesh`` (rank layout, sizes), ``sparse`` (torchrec 2D sharding, fused embedding optimizer),
``replication`` (torchrec's ``DMPCollection`` on CUDA or gem5d's replica sync keeping the table replicas equal),
``dense`` (FSDP2/HSDP, tensor parallel), ``activation_checkpointing`` (recomputation planned under a memory
budget), ``distributed_checkpoint`` (save and load with ``torch.distributed.checkpoint``), ``gem5d`` (the
Lightning adapter).
"""

from __future__ import annotations

from .gem5d import GEM5DStrategy

__all__ = ["GEM5DStrategy", "register_strategies"]


def register_strategies() -> list[str]:
    """Register ``"gem5d"`` in ``lightning.pytorch``'s strategy registry (idempotent); the names registered.

    ``pytorch_lightning`` (the standalone package) keeps a separate registry of its own ``Strategy``
    classes; :class:`GEM5DStrategy` derives from ``lightning.pytorch``'s, which that Trainer rejects, so it
    is not registered there.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    if GEM5DStrategy.strategy_name not in StrategyRegistry:
        GEM5DStrategy.register_strategies(StrategyRegistry)
    return [GEM5DStrategy.strategy_name]


register_strategies()
