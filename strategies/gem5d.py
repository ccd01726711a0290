"""``GEM5DStrategy`` (``strategy="gem5d"``): a thin Lightning adapter over plain functions: ``mesh.py``
(layout), ``parallelize.py`` (over ``sparse.py``, ``replication.py`` and ``dense.py``), ``distributed_checkpoint.py``,
``activation_checkpointing/``, ``tp_batches.py`` and ``pipeline.py`` (the loaders).

Example:
    >>> import lightning as L
    >>> from lightning_gem.strategies import GEM5DStrategy
    >>> strategy = GEM5DStrategy(sparse_group_size=2, dense_replicate_size=2)
    >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from . import dense, distributed_checkpoint, sparse
from .mesh import MeshLayout, build_device_mesh, check_size, resolve_layout
from .parallelize import ParallelModel, parallelize_model
from .replication import SparseReplication, check_replication, evaluate_without_inference_mode
from .sparse import EmbeddingOptimizerConfig, EmbeddingOptimizerName, TableConstraint, check_comm_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GEM5DStrategy"]

log = logging.getLogger(__name__)


class GEM5DStrategy(ParallelStrategy):
    """Sparse 2D x dense 3D parallelism for recommendation models holding torchrec embedding modules.

    Embedding tables (every torchrec ``EmbeddingCollection`` / ``EmbeddingBagCollection`` of the model) are
    sharded by torchrec's planner inside sharding groups of ``sparse_group_size`` ranks and replicated
    across groups (on CUDA through torchrec's ``DMPCollection``, elsewhere through ``DistributedModelParallel``
    over a 2D sharding environment; the replicas averaged after each step either way, see ``sparse_replication``);
    they are trained by a fused optimizer inside the backward. The rest of the model
    trains with the LightningModule's optimizer under FSDP2 (HSDP when ``dense_replicate_size > 1``; plain
    replicas when nothing is left to shard)
    and optionally tensor parallelism over the plans the components declare, optionally with sequence
    parallelism in the HSTU encoder. Every rank (every tensor-parallel group) trains on its own batch;
    gradients are those of the mean of the ranks' losses, which is the loss of one process on the whole
    global batch when the ranks' batches weigh the same (as the tests check). Gradient clipping covers the
    dense parameters (the tables are updated inside the backward).

    Rank layout (``W`` ranks; details and an example in :mod:`lightning_gem.strategies.mesh`):
    ``rank = (replicate * dense_shard + shard) * tensor_parallel + tp`` on the dense axes, and
    sharding group ``rank // sparse_group_size`` on the sparse axes (groups are contiguous; shard
    ``rank % sparse_group_size`` is replicated across groups).

    Args:
        sparse_group_size: ranks each embedding table is sharded over. ``None``: all ranks (plain
            torchrec sharding); ``1``: every rank holds every table (pure replication). Must divide ``W``.
        sparse_replication: how the replicas of the embedding shards are kept equal
            (:mod:`lightning_gem.strategies.replication`): ``"collection"``: torchrec's ``DMPCollection`` shards the
            tables and its ``sync()`` averages tables and optimizer states over each replica group after every
            step (CUDA only); ``"fully_sharded"``: ``DMPCollection``'s ``FULLY_SHARDED`` strategy, each replica
            holding ``1 / replicas`` of its tables between forward and backward (CUDA only);
            ``"replica_sync"``: ``DistributedModelParallel`` over a 2D sharding environment and gem5d's own average
            of tables and optimizer states (any device); ``"auto"``: ``"collection"`` where it can run (CUDA, an
            optimizer other than ``adam``, ...), else ``"replica_sync"``, the reason logged. Same rank layout and
            same plan in every mode. Evaluation runs under ``torch.no_grad``, not inference mode (as Lightning's
            FSDP strategy: FSDP2 and fully sharded tables need it).
        dense_replicate_size: HSDP replicas of the dense parameters. With a dense shard size of 1 and no tensor
            parallelism (``dense_replicate_size`` = the world size, or one process) nothing is sharded: the dense
            parameters stay plain tensors and their gradients are averaged in one all-reduce before each step, as
            DDP does, without FSDP2's per-unit gathers and hooks (the cheaper choice for small dense models).
        dense_shard_size: ranks each dense parameter is sharded over; ``None``:
            ``W / (dense_replicate_size x tensor_parallel_size)``.
        tensor_parallel_size: ranks the tensor-parallel linears are split over (see ``dense.py``). The ranks of
            a tensor-parallel group train on one batch, their batches merged (``tp_batches.py``).
        sequence_parallel: with ``tensor_parallel_size > 1``, Megatron-style sequence parallelism in the
            components that declare it (``enable_sequence_parallel``, e.g. ``JaggedHistoryEncoder``): between
            their layers each rank of a tensor-parallel group holds ``1 / tensor_parallel_size`` of the
            tokens: the norms and residuals run on that share (their activations take ``1 / tensor_parallel_size``
            of the memory), column-wise linears all-gather the tokens, row-wise linears reduce-scatter them. No
            effect without tensor parallelism.
        table_constraints: per-table planner constraints (table name -> :class:`TableConstraint`).
        embedding_optimizer: fused optimizer of the tables: ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam``
            (CUDA only).
        embedding_lr: its learning rate; ``None``: the LightningModule's ``hparams.lr``.
        embedding_eps: epsilon of the adaptive embedding optimizers.
        embedding_weight_decay: weight decay of the embedding optimizer.
        reshard_after_forward: FSDP2 frees gathered dense parameters after forward (``False``: ZeRO-2).
        activation_memory_budget: activation checkpointing under this budget: bytes (``int``) or a fraction in
            ``(0, 1]`` of the measured unconstrained peak; ``None``: no checkpointing.
        train_pipeline: overlap the embedding input all-to-all of the next batch with the current batch's
            compute (torchrec's sparse-dist pipelining inside Lightning's loop; see ``pipeline.py``).
        compile_layers: ``torch.compile`` each HSTU layer of the model (the repeated blocks of every
            ``JaggedHistoryEncoder``) in place, with dynamic shapes (one graph for every jagged batch size), after
            activation checkpointing and tensor parallelism and before FSDP2, the order torchtitan compiles its
            blocks in. Fewer kernel launches and less host time per layer; the first batches compile. It pays
            where a layer is many small PyTorch ops (the ML-1M model: an epoch 1.8x faster on an H200); GDPA's and
            the FP8 kernels are already fused, so a layer of them gains nothing (0.99x in bf16 at width 1024), and
            ``MXFP8Precision``'s linears and fused norms run eagerly between the graphs (a graph break each:
            0.90x at width 1024).
        embedding_comm_precision: the precision the embedding collectives (the lookups' all-to-alls and
            reduce-scatters, forward and backward) send, through torchrec's quantized comms: ``"bf16"`` or
            ``"fp16"`` halve their bytes, rounding the embeddings and their gradients on the way; ``"fp32"``:
            the tables' own precision.
        weights_from: a gem5d checkpoint whose model weights are loaded at setup, whatever layout or world
            size wrote it (a new run from trained weights; ``fit(ckpt_path=...)`` resumes a run instead).
        process_group_backend: ``"nccl"``/``"gloo"``; ``None``: the device's default.
        timeout: collective timeout.

    Raises:
        ValueError: at setup, sizes that do not fit the world size (naming the argument),
            ``sequence_parallel`` under tensor parallelism on a model with no component declaring it, or a
            ``sparse_replication`` of ``DMPCollection`` where it cannot run (saying why: not CUDA, ``adam``, ...);
            at construction, a bad size, optimizer, ``embedding_comm_precision`` or ``sparse_replication`` (or
            one the installed torchrec lacks).
        TypeError: at construction, a size, ``sequence_parallel`` or ``compile_layers`` of the wrong type.
    """

    strategy_name = "gem5d"

    def __init__(
        self,
        sparse_group_size: int | None = None,
        sparse_replication: SparseReplication = "auto",
        dense_replicate_size: int = 1,
        dense_shard_size: int | None = None,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        table_constraints: dict[str, TableConstraint] | None = None,
        embedding_optimizer: EmbeddingOptimizerName = "rowwise_adagrad",
        embedding_lr: float | None = None,
        embedding_eps: float = 1e-8,
        embedding_weight_decay: float = 0.0,
        reshard_after_forward: bool = True,
        activation_memory_budget: int | float | None = None,
        train_pipeline: bool = False,
        compile_layers: bool = False,
        embedding_comm_precision: str = "fp32",
        weights_from: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
        )
        # Checked now against a world that fits them, again at setup against the real world size.
        for name, value in (
            ("sparse_group_size", sparse_group_size),
            ("dense_replicate_size", dense_replicate_size),
            ("dense_shard_size", dense_shard_size),
            ("tensor_parallel_size", tensor_parallel_size),
        ):
            if value is not None:
                check_size(value, name)
        for name, flag in (("sequence_parallel", sequence_parallel), ("compile_layers", compile_layers)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be a bool, got {flag!r}")
        if activation_memory_budget is not None and (
            isinstance(activation_memory_budget, bool)
            or activation_memory_budget <= 0
            or (isinstance(activation_memory_budget, float) and activation_memory_budget > 1)
        ):
            raise ValueError(
                "`activation_memory_budget` must be bytes (an int > 0) or a fraction in (0, 1] of the unconstrained "
                f"peak, got {activation_memory_budget!r}"
            )
        self._sizes = {
            "sparse_group_size": sparse_group_size,
            "dense_replicate_size": dense_replicate_size,
            "dense_shard_size": dense_shard_size,
            "tensor_parallel_size": tensor_parallel_size,
        }
        self.sparse_replication = check_replication(sparse_replication)
        self.table_constraints = {
            name: c if isinstance(c, TableConstraint) else TableConstraint(**c)
            for name, c in (table_constraints or {}).items()
        }
        self._embedding_lr = embedding_lr
        self._embedding_optimizer = EmbeddingOptimizerConfig(
            name=embedding_optimizer,
            lr=1.0 if embedding_lr is None else embedding_lr,
            eps=embedding_eps,
            weight_decay=embedding_weight_decay,
        )
        self.reshard_after_forward = reshard_after_forward
        self.sequence_parallel = sequence_parallel
        self.activation_memory_budget = activation_memory_budget
        self.train_pipeline = bool(train_pipeline)
        self.compile_layers = compile_layers
        self.embedding_comm_precision = check_comm_precision(embedding_comm_precision)
        self.weights_from = weights_from
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1  # set by the Trainer's `num_nodes`
        self.layout: MeshLayout | None = None
        self._meshes: tuple[DeviceMesh, DeviceMesh, DeviceMesh] | None = None
        self.parallel: ParallelModel | None = None
        self.activation_checkpoint_plan: Any = None

    # -- Lightning plumbing -----------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self) -> DeviceMesh:
        """The root mesh over all ranks (its dense and sparse views: :attr:`dense_mesh`, :attr:`sparse_mesh`)."""
        return self._require_meshes()[0]

    @property
    def dense_mesh(self) -> DeviceMesh:
        """``("dense_replicate", "dense_shard", "tensor_parallel")`` view of the mesh."""
        return self._require_meshes()[1]

    @property
    def sparse_mesh(self) -> DeviceMesh:
        """``("sparse_replicate", "sparse_shard")`` view of the mesh."""
        return self._require_meshes()[2]

    def _require_meshes(self) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
        if self._meshes is None:
            raise RuntimeError("the gem5d device mesh exists once the processes are initialised (Trainer setup)")
        return self._meshes

    @property
    def is_distributed(self) -> bool:
        """Lightning gives the evaluation loaders a ``DistributedSampler`` (each rank its share) when True."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.layout = resolve_layout(self.world_size, **self._sizes)
        self._meshes = build_device_mesh(self.layout, self.root_device.type)
        sequence = ", sequence parallel" if self.sequence_parallel and self.layout.tensor_parallel > 1 else ""
        rank_zero_info(f"gem5d: {self.layout.describe()}{sequence}")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        # Evaluation under no_grad, as Lightning's FSDP strategy does (FSDP2 and fully sharded tables need it).
        evaluate_without_inference_mode(trainer)
        self.parallelize(self.model, trainer)
        # Lightning moves the metrics the module logged to the CPU when a run ends; a later run (validate after
        # fit) starts from the parallelized model, which nothing else moves back.
        _metrics_to_device(self.model, self.root_device)
        if self.weights_from is not None:
            self.load_weights(self.weights_from)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Gradient clipping (Trainer(gradient_clip_val=...)): the norm over DTensor and plain gradients together.
        # The precision plugin keeps its role; only its norm clipping is replaced on this instance.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: torch.nn.Module, trainer: pl.Trainer | None = None) -> None:
        """Parallelize ``module`` in place (:func:`~lightning_gem.strategies.parallelize.parallelize_model`)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        assert self.layout is not None, "setup_environment must run first"
        device = self.root_device
        optimizer = self._embedding_optimizer
        if self._embedding_lr is None and sparse.embedding_module_paths(module):
            lr = getattr(getattr(module, "hparams", {}), "get", lambda *_: None)("lr")
            if lr is None:
                raise ValueError("GEM5DStrategy needs `embedding_lr` when the LightningModule has no `hparams.lr`")
            optimizer = EmbeddingOptimizerConfig(**{**asdict(optimizer), "lr": float(lr)})
        budget = self.activation_memory_budget
        self.parallel = parallelize_model(
            module,
            self.layout,
            self.dense_mesh,
            self.sparse_mesh,
            device,
            embedding_optimizer=optimizer,
            table_constraints=self.table_constraints,
            local_world_size=self.num_processes,
            reshard_after_forward=self.reshard_after_forward,
            sequence_parallel=self.sequence_parallel,
            train_pipeline=self.train_pipeline,
            compile_layers=self.compile_layers,
            sparse_replication=self.sparse_replication,
            embedding_comm_precision=self.embedding_comm_precision,
            move=lambda batch: _move_batch(batch, device, move_data_to_device),
            before_dense=None if budget is None else lambda m: self._apply_activation_checkpointing(m, trainer),
        )

    @property
    def embedding_optimizer(self) -> Any:
        """torchrec's fused optimizer of the tables (after setup; None without tables)."""
        return None if self.parallel is None else self.parallel.embedding_optimizer

    @property
    def prefetcher(self) -> Any:
        """The train pipeline's prefetcher (after setup with ``train_pipeline=True``), else None."""
        return None if self.parallel is None else self.parallel.prefetcher

    def _apply_activation_checkpointing(self, module: torch.nn.Module, trainer: pl.Trainer | None) -> None:
        """Plan checkpointing on the first training batch under ``activation_memory_budget`` and apply it."""
        from .activation_checkpointing import plan_on_training_step

        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # nothing trains, nothing to save memory for
        # The train loader as the fit loop will get it (datamodule, module hook or the loader given to fit);
        # a throwaway iterator: checkpoint restore (and the DataModule's position) comes after setup.
        loader = trainer.fit_loop._data_source.dataloader()
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"activation_memory_budget plans on one training batch; got a {type(loader).__name__}")
        batch = self.batch_to_device(next(iter(loader)))
        # Measured as the loop runs the step: under the precision plugin's autocast, so the saved activations
        # have the dtypes (and, with MXFP8Precision(saved_activations="fp8"), the FP8 sizes) they will have.
        with self.precision_plugin.train_step_context():
            self.activation_checkpoint_plan = plan_on_training_step(
                module, batch, self.activation_memory_budget, sparse.local_state_tensors(module)
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.activation_checkpoint_plan
        if plan is None:
            return super().training_step(*args, **kwargs)
        from .activation_checkpointing import compile_memory_budget

        # Regions the user compiles get the same budget through the partitioner's activation memory budget.
        with compile_memory_budget(plan.compile_budget_fraction):
            return super().training_step(*args, **kwargs)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        # The tables are trained by the fused optimizer: Lightning's optimizers get the dense parameters only.
        assert self.model is not None
        sparse_ids = sparse.sparse_parameter_ids(self.model)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in sparse_ids]

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        # The tables are not clipped: their fused optimizer has already applied their gradients.
        dense.clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        parallel = self.parallel
        if parallel is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce() -> Any:
            out = closure()
            parallel.reduce_gradients()
            return out

        with dense.split_mixed_param_groups(optimizer):
            out = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        parallel.after_step()
        return out

    @override
    def process_dataloader(self, dataloader: object) -> object:
        layout = self.layout
        if layout is not None and layout.tensor_parallel > 1:
            from .tp_batches import merge_tensor_parallel_batches

            first = self.global_rank - self.global_rank % layout.tensor_parallel
            dataloader = merge_tensor_parallel_batches(dataloader, list(range(first, first + layout.tensor_parallel)))
        if self.prefetcher is not None:
            dataloader = self.prefetcher.wrap(dataloader)
        return dataloader

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # A fully sharded table that an evaluation's forwards left sharded is gathered when the evaluation ends, before
    # anything (a checkpoint, the next stage) reads it.
    @override
    def on_validation_end(self) -> None:
        self._gather_sharded_tables()

    @override
    def on_test_end(self) -> None:
        self._gather_sharded_tables()

    @override
    def on_predict_end(self) -> None:
        self._gather_sharded_tables()

    def _gather_sharded_tables(self) -> None:
        if self.parallel is not None and self.parallel.sparse.replication == "fully_sharded":
            from .replication import gather_sharded_tables

            assert self.model is not None
            gather_sharded_tables(self.model)

    @override
    def teardown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.remove()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints ------------------------------------------------------------------------------

    def _checkpoint_meta(self) -> dict[str, Any]:
        assert self.parallel is not None
        return self.parallel.describe()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.model.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # Saved by save_checkpoint through DCP (flattened); Lightning's per-optimizer dump is not used.
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("GEM5DStrategy.save_checkpoint does not take `storage_options` (it writes with DCP)")
        assert self.model is not None
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        checkpoint["gem5d"] = self._checkpoint_meta()
        distributed_checkpoint.save(
            path,
            self.model,
            [_unwrap(o) for o in self.optimizers],
            self.embedding_optimizer,
            checkpoint,
            is_global_zero=self.is_global_zero,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = distributed_checkpoint.read_meta(path)
        saved = meta.get("gem5d", {})
        current = self._checkpoint_meta()
        same_plan = saved.get("layout") == current["layout"] and saved.get("plan") == current["plan"]
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [_unwrap(o) for o in self.optimizers] if fitting else []
        return distributed_checkpoint.load(
            path,
            self.model,
            optimizers,
            self.embedding_optimizer,
            same_embedding_plan=same_plan,
            strict=self.lightning_module.strict_loading if self.lightning_module is not None else True,
        )

    def load_weights(self, path: str | Path) -> None:
        """Load only the model weights of a gem5d checkpoint (any world size or layout) into the set-up model."""
        if self.model is None or self.layout is None:
            raise RuntimeError("load_weights needs the set-up model: pass `weights_from=` or call it after setup")
        distributed_checkpoint.load(Path(self.broadcast(str(path))), self.model, [], None, same_embedding_plan=True)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            distributed_checkpoint.remove(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="GEM 5D: sparse 2D x dense 3D parallelism")


def _metrics_to_device(module: torch.nn.Module, device: torch.device) -> None:
    """Move every torchmetrics ``Metric`` of ``module`` that is not on ``device`` there."""
    from torchmetrics import Metric

    for sub in module.modules():
        if isinstance(sub, Metric) and sub.device != device:
            sub.to(device)


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _move_batch(batch: Any, device: torch.device, move: Callable[[Any, torch.device], Any]) -> Any:
    """The train pipeline's copy of a batch to ``device``: a torchrec ``Pipelineable`` batch (the kit's, torchrec's)
    goes with ``non_blocking=True`` on CUDA, so a pinned batch (``GEMDataModule(pin_memory=True)``) copies
    asynchronously on the prefetch stream (Lightning's own move is blocking for anything but a tensor); anything
    else through Lightning's ``move``."""
    from torchrec.streamable import Pipelineable

    if device.type == "cuda" and isinstance(batch, Pipelineable):
        return batch.to(device, non_blocking=True)
    return move(batch, device)
