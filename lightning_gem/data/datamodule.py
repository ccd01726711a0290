"""``GEMDataModule``: a thin LightningDataModule over a :class:`~lightning_gem.data.sources.DataSource`.

The module knows nothing about features: the source makes datasets and collates batches; this class
picks samplers, builds DataLoaders and keeps the (seed, epoch) position for resumption. The train
sampler comes from one hook, :meth:`GEMDataModule._make_sampler`, where the load-balancing sampler
(Base Batch Shuffling: a ``DistributedSampler`` subclass fed with ``source.sample_lengths("train")``)
plugs in.

Example:
    >>> from lightning_gem.data import GEMDataModule, SyntheticRankingSource
    >>> source = SyntheticRankingSource(num_train_users=64, num_val_users=16, num_test_users=16)
    >>> data = GEMDataModule(source=source, batch_size=32)
    >>> data.setup("fit")
    >>> next(iter(data.train_dataloader())).batch_size
    32
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, SequentialSampler
from typing_extensions import override

from lightning_gem.data.balancing import BalancedDistributedSampler, ResumableEpochSampler
from lightning_gem.data.schema import RankingSchema, RetrievalSchema
from lightning_gem.data.sources import DataSource, check_split
from lightning_gem.data.token_budget import BatchedDataset, TokenBudgetSampler

__all__ = ["GEMDataModule"]

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}


def _check_positive_int(value: object, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value}")
    return value


class _WholeEpochSampler(BalancedDistributedSampler):
    """A :class:`BalancedDistributedSampler` whose length is the whole epoch's, also when resumed mid-epoch.

    Lightning restores the epoch's batch counter on a mid-epoch resume and keeps counting from it (the
    first resumed batch has ``batch_idx = k``); it ends the epoch when that counter reaches the
    loader's length, so the loader must report the full epoch, not the batches left.
    """

    @override
    def __len__(self) -> int:
        return self.num_samples


class GEMDataModule(LightningDataModule):
    """Train/val/test DataLoaders of a data source, with seeded shuffling and a resumable position.

    Args:
        source: where samples come from (``SyntheticRankingSource``, ``MovieLens1MSource``, ... or any
            :class:`DataSource`); its ``schema`` is this module's :attr:`schema`.
        batch_size: samples (users) per training batch, per data-parallel rank.
        eval_batch_size: samples per validation/test batch; ``None``: ``batch_size``.
        num_workers: DataLoader worker processes (0 loads in the main process).
        seed: seed of the training shuffle (epoch ``e`` uses permutation ``seed + e``).
        drop_last: drop the last incomplete training batch.
        pin_memory: pin batches (they implement torchrec's ``Pipelineable.pin_memory``).
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        balance: split each global training batch across ranks by cost
            (:class:`~lightning_gem.data.balancing.BalancedDistributedSampler` over
            ``source.sample_lengths("train")``); ``False``: a plain ``DistributedSampler``.
        max_tokens: token-budget batching: each training batch holds as many samples as fit this many
            history tokens per rank (at most ``batch_size``), split across ranks by cost
            (:class:`~lightning_gem.data.token_budget.TokenBudgetSampler`); the number of steps per
            epoch then depends on the lengths. ``None``: fixed ``batch_size``.
        cost_model: per-sample cost ``lengths [N] -> costs [N]`` the ranks are balanced by; ``None``:
            the model's ``sample_cost_model()`` when it has one (``GEMRanker`` and
            ``SequentialRecommender`` derive it from their FLOPs), else
            :class:`~lightning_gem.data.balancing.AttentionCostModel`.
    """

    def __init__(
        self,
        source: DataSource,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        balance: bool = True,
        max_tokens: int | None = None,
        cost_model: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(source, DataSource):
            raise TypeError(f"`source` must be a lightning_gem.data.DataSource, got {type(source).__name__}")
        self.source = source
        self.batch_size = _check_positive_int(batch_size, "batch_size")
        self.eval_batch_size = (
            batch_size if eval_batch_size is None else _check_positive_int(eval_batch_size, "eval_batch_size")
        )
        self.num_workers = _check_positive_int(num_workers, "num_workers", low=0)
        self.seed = _check_positive_int(seed, "seed", low=0)
        self.drop_last = bool(drop_last)
        self.pin_memory = bool(pin_memory)
        self.persistent_workers = bool(persistent_workers) and num_workers > 0
        self.balance = bool(balance)
        self.max_tokens = None if max_tokens is None else _check_positive_int(max_tokens, "max_tokens")
        if cost_model is not None and not callable(cost_model):
            raise TypeError(f"`cost_model` must be callable (lengths -> costs), got {type(cost_model).__name__}")
        self.cost_model = cost_model
        self._datasets: dict[str, Dataset] = {}
        self._epoch = 0
        # (epoch, trained batches) restored by `load_state_dict`, applied to the next train sampler of that epoch.
        self._pending_position: tuple[int, int] | None = None

    @property
    def schema(self) -> RankingSchema | RetrievalSchema:
        """The source's feature schema (LightningCLI links it to ``model.schema``)."""
        return self.source.schema

    @override
    def setup(self, stage: str) -> None:
        """Build the datasets of ``stage`` (``"fit"``: train and val; ``"validate"``; ``"test"``; ``"predict"``)."""
        if stage not in _STAGE_SPLITS:
            raise ValueError(f"`stage` must be one of {tuple(_STAGE_SPLITS)}, got {stage!r}")
        for split in _STAGE_SPLITS[stage]:
            self.dataset(split)

    def dataset(self, split: str) -> Dataset:
        """The (cached) dataset of ``split``."""
        if check_split(split) not in self._datasets:
            self._datasets[split] = self.source.dataset(split)
        return self._datasets[split]

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")

    def _replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism: the Trainer's world, or ``(1, 0)`` without one."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _make_sampler(self, split: str, dataset: Dataset) -> Sampler:
        """THE SAMPLER HOOK: the sampler of ``split``; the load-balancing sampler replaces the train one here.

        Train: a seeded ``DistributedSampler`` (also with one replica) shuffling with ``seed + epoch``,
        balanced by cost when ``balance`` (a subclass: same global batches, same ``set_epoch``);
        Lightning calls its ``set_epoch`` every epoch and leaves a ``DistributedSampler`` in place.
        Val/test: sequential (Lightning shards it over ranks when it runs distributed).
        """
        if split != "train":
            return SequentialSampler(dataset)
        num_replicas, rank = self._replicas()
        if self.balance or self.max_tokens is not None:
            lengths = self.source.sample_lengths(split)
            if len(lengths) != len(dataset):
                raise ValueError(
                    f"`source.sample_lengths({split!r})` has {len(lengths)} entries for {len(dataset)} samples"
                )
            kwargs = {"shuffle": True, "seed": self.seed, "drop_last": self.drop_last, "cost_model": self._cost_model()}
        if self.max_tokens is not None:
            sampler = TokenBudgetSampler(
                lengths, self.max_tokens, num_replicas, rank, max_batch_size=self.batch_size, **kwargs
            )
        elif self.balance:
            # Under a Trainer the loader reports the whole epoch even when resumed mid-epoch (see below).
            sampler_cls = BalancedDistributedSampler if self.trainer is None else _WholeEpochSampler
            sampler = sampler_cls(lengths, self.batch_size, num_replicas, rank, **kwargs)
        else:
            sampler = DistributedSampler(
                dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=self.seed, drop_last=self.drop_last
            )
        epoch = self._current_epoch()
        sampler.set_epoch(epoch)
        self._apply_pending_position(sampler, epoch)
        return sampler

    def _cost_model(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """``cost_model``, else the LightningModule's ``sample_cost_model()``, else None (the sampler's default)."""
        if self.cost_model is not None:
            return self.cost_model
        module = None if self.trainer is None else self.trainer.lightning_module
        hook = getattr(module, "sample_cost_model", None)
        return hook() if callable(hook) else None

    def _apply_pending_position(self, sampler: Sampler, epoch: int) -> None:
        """Start ``sampler`` at the restored mid-epoch position, once, if it was saved in ``epoch``."""
        pending, self._pending_position = self._pending_position, None
        if pending is None or pending[0] != epoch or pending[1] <= 0:
            return
        if not isinstance(sampler, ResumableEpochSampler):
            rank_zero_warn(
                "GEMDataModule: the checkpoint was saved mid-epoch but the train sampler cannot resume mid-epoch"
                " (`balance=False`): this epoch restarts from its first batch."
            )
            return
        sampler.load_state_dict({"epoch": epoch, "batches_consumed": pending[1]})

    def _loader(self, split: str) -> DataLoader:
        dataset = self.dataset(split)
        train = split == "train"
        if train and self.max_tokens is not None:  # the sampler yields whole batches
            return DataLoader(
                BatchedDataset(dataset, self.source.collate),
                batch_size=None,
                sampler=self._make_sampler(split, dataset),
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                persistent_workers=self.persistent_workers,
            )
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            sampler=self._make_sampler(split, dataset),
            collate_fn=self.source.collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and train,
            persistent_workers=self.persistent_workers,
        )

    def _current_epoch(self) -> int:
        trainer = self.trainer
        return self._epoch if trainer is None else max(trainer.current_epoch, self._epoch)

    def _trained_batches(self) -> int:
        """Training batches of the current (unfinished) epoch already trained; 0 between epochs or without a Trainer.

        Read from the fit loop's progress, not from the sampler: DataLoader workers prefetch, so the
        sampler runs ahead of training. ``processed`` counts batches whose training step ran; it is
        right when saving from ``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps=...)``),
        where ``completed`` still lags by the current batch (and ``ready`` runs ahead when saving
        during a step), and after a mid-epoch validation, where they agree.
        """
        trainer = self.trainer
        if trainer is None:
            return 0
        fit_loop = trainer.fit_loop
        epochs = fit_loop.epoch_progress.current
        if epochs.started <= epochs.completed:  # no epoch in progress: the next one starts from its first batch
            return 0
        return int(fit_loop.epoch_loop.batch_progress.current.processed)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch", "batch_size"}`` (+ ``"batches_trained"`` mid-epoch): enough to replay the training order.

        ``batches_trained`` (only when > 0): the training batches of ``epoch`` already trained, so a
        checkpoint saved mid-epoch resumes at the next batch.
        """
        state = {"seed": self.seed, "epoch": self._current_epoch(), "batch_size": self.batch_size}
        if self.max_tokens is not None:
            state["max_tokens"] = self.max_tokens
        trained = self._trained_batches()
        if trained > 0:
            state["batches_trained"] = trained
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the seed, epoch and mid-epoch position saved by :meth:`state_dict` (the checkpoint's seed wins).

        The position (``batches_trained``; absent in older checkpoints: 0) is applied when the train
        sampler of that epoch is next built; it needs the same ``batch_size`` (and number of ranks).
        """
        missing = {"seed", "epoch"} - set(state_dict)
        if missing:
            raise ValueError(f"`state_dict` must hold {sorted(missing)} (from GEMDataModule.state_dict)")
        self.seed = int(state_dict["seed"])
        self._epoch = int(state_dict["epoch"])
        trained = int(state_dict.get("batches_trained", 0))
        if trained > 0 and int(state_dict.get("batch_size", self.batch_size)) != self.batch_size:
            raise ValueError(
                f"`state_dict` was saved mid-epoch with batch_size {state_dict['batch_size']}, this module's is"
                f" {self.batch_size}: its batch position does not carry over"
            )
        if trained > 0 and state_dict.get("max_tokens") != self.max_tokens:
            raise ValueError(
                f"`state_dict` was saved mid-epoch with max_tokens {state_dict.get('max_tokens')}, this module's is"
                f" {self.max_tokens}: its batch position does not carry over"
            )
        self._pending_position = (self._epoch, trained) if trained > 0 else None
