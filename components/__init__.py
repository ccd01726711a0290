"""Model components: plain ``nn.Module`` s over jagged tensors and the task LightningModules built from them.

- :mod:`~lightning_gem.components.embeddings`: torchrec ``EmbeddingCollection`` / ``EmbeddingBagCollection``
  builders from typed table configs (shared tables by name).
- :mod:`~lightning_gem.components.encoder`: :class:`HSTULayer`, :class:`JaggedHistoryEncoder`.
- :mod:`~lightning_gem.components.interaction`: :class:`GDPAInteraction` (candidates attend to the history).
- :mod:`~lightning_gem.components.heads`: :class:`MultiTaskHead` (per-task towers, optional ESMM).
- :mod:`~lightning_gem.components.ranker`: :class:`GEMRanker`, multi-task ranking LightningModule.
- :mod:`~lightning_gem.components.retrieval`: :class:`SequentialRecommender`, next-item retrieval.

Importing this package imports Lightning and torchrec (the package root ``lightning_gem`` does not), and
registers the ``"gem5d"`` strategy name with Lightning (:mod:`lightning_gem.strategies`).
"""

import importlib

from lightning_gem.components.embeddings import (
    TableConfig,
    build_embedding_bag_collection,
    build_embedding_collection,
    concat_sequence_embeddings,
    tables_from_features,
)
from lightning_gem.components.encoder import HSTULayer, JaggedHistoryEncoder
from lightning_gem.components.heads import MultiTaskHead
from lightning_gem.components.interaction import GDPAInteraction
from lightning_gem.components.ranker import GEMRanker
from lightning_gem.components.retrieval import SequentialRecommender

# Registers strategy="gem5d" (Lightning is imported here anyway).
importlib.import_module("lightning_gem.strategies")

__all__ = [
    "GDPAInteraction",
    "GEMRanker",
    "HSTULayer",
    "JaggedHistoryEncoder",
    "MultiTaskHead",
    "SequentialRecommender",
    "TableConfig",
    "build_embedding_bag_collection",
    "build_embedding_collection",
    "concat_sequence_embeddings",
    "tables_from_features",
]
