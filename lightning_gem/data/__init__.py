"""Data: feature schemas, batch types, sources (synthetic, MovieLens) and the ``GEMDataModule``.

Importing this package imports torchrec (the batches hold ``KeyedJaggedTensor`` s) and Lightning.

Example:
    >>> from lightning_gem.data import GEMDataModule, SyntheticRankingSource
    >>> data = GEMDataModule(source=SyntheticRankingSource(num_train_users=100, num_val_users=20,
    ...                                                    num_test_users=20), batch_size=16)
    >>> data.schema.tasks
    ('ctr', 'cvr')
"""

from lightning_gem.data.batch import RankingBatch, RetrievalBatch
from lightning_gem.data.collate import RankingSample, RetrievalSample, collate_ranking, collate_retrieval
from lightning_gem.data.datamodule import GEMDataModule
from lightning_gem.data.movielens import MovieLens1MSource, MovieLens100KRankingSource
from lightning_gem.data.schema import RankingSchema, RetrievalSchema, SparseFeature
from lightning_gem.data.sources import (
    SPLITS,
    DataSource,
    RankingArrays,
    RankingDataset,
    RankingSource,
    RetrievalArrays,
    RetrievalDataset,
    RetrievalSource,
)
from lightning_gem.data.synthetic import SyntheticRankingSource, SyntheticRetrievalSource

__all__ = [
    "SPLITS",
    "DataSource",
    "GEMDataModule",
    "MovieLens100KRankingSource",
    "MovieLens1MSource",
    "RankingArrays",
    "RankingBatch",
    "RankingDataset",
    "RankingSample",
    "RankingSchema",
    "RankingSource",
    "RetrievalArrays",
    "RetrievalBatch",
    "RetrievalDataset",
    "RetrievalSample",
    "RetrievalSchema",
    "RetrievalSource",
    "SparseFeature",
    "SyntheticRankingSource",
    "SyntheticRetrievalSource",
    "collate_ranking",
    "collate_retrieval",
]
