"""``GEMRanker``: a multi-task ranking LightningModule built from the kit's components.

Pipeline for a :class:`~lightning_gem.data.batch.RankingBatch` of ``B`` users:

1. torchrec ``EmbeddingCollection`` over the history and candidate features (shared tables where the
   schema says so) and an ``EmbeddingBagCollection`` over the pooled user features; each token is the
   sum of its features' embeddings through one projection per *table*, so a candidate item and the same
   item in the history start as the same vector;
2. :class:`~lightning_gem.components.encoder.JaggedHistoryEncoder` (HSTU layers over the jagged history);
3. :class:`~lightning_gem.components.interaction.GDPAInteraction`: each candidate attends to its user's
   encoded history, then interacts with the user's context tokens (history summary, pooled features,
   dense features);
4. :class:`~lightning_gem.components.heads.MultiTaskHead`: one logit per task.

Training minimises binary cross-entropy per task; validation and test log ``{stage}/auc_{task}`` and
``{stage}/ne_{task}`` (normalized entropy), and ``{stage}/loss``, the training loss's mean over every candidate of
the stage. All three are torchmetrics states, reduced over the ranks of a distributed run: a multi-rank
evaluation logs the values of one process evaluating the whole split. Throughput is logged by
:class:`lightning_gem.callbacks.ThroughputReport`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_gem import jagged
from lightning_gem.data.balancing import AttentionCostModel
from lightning_gem.data.batch import RankingBatch
from lightning_gem.data.schema import RankingSchema, RetrievalSchema, SparseFeature
from lightning_gem.graphs import ShapeGraphs
from lightning_gem.metrics import BinaryAUROC, NormalizedEntropy
from lightning_gem.ops._launch import next_power_of_2
from lightning_gem.ops.attention import ACTIVATIONS, IMPLS

from .embeddings import (
    build_embedding_bag_collection,
    build_embedding_collection,
    concat_sequence_embeddings,
    tables_from_features,
)
from .encoder import JaggedHistoryEncoder, NormKind, check_option
from .heads import MultiTaskHead
from .interaction import GDPAInteraction

__all__ = [
    "GEMRanker",
    "adamw_param_groups",
    "append_padding_user",
    "schema_from_datamodule",
    "schema_from_hparams",
    "schema_to_hparams",
    "segment_mean",
    "token_bucket",
]


def schema_to_hparams(schema: RankingSchema | RetrievalSchema) -> dict[str, Any]:
    """A schema as plain containers (``dataclasses.asdict``), so checkpoints load with ``weights_only=True``
    and ``hparams.yaml`` stays readable."""
    return dataclasses.asdict(schema)


def schema_from_hparams(value: object, kind: type[RankingSchema] | type[RetrievalSchema]) -> Any:
    """The schema of ``kind`` from a schema object or from :func:`schema_to_hparams` output (a checkpoint)."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"`schema` must be a {kind.__name__}, got {type(value).__name__}")
    fields = dict(value)
    if kind is RankingSchema:
        for name in ("history_features", "candidate_features", "pooled_features"):
            fields[name] = tuple(SparseFeature(**f) for f in fields.get(name, ()))
        fields["tasks"] = tuple(fields.get("tasks", ("ctr", "cvr")))
    return kind(**fields)


def schema_from_datamodule(module: L.LightningModule, kind: type[RankingSchema] | type[RetrievalSchema]) -> Any:
    """The schema of ``kind`` of the Trainer's datamodule, for a model built without one (``configure_model``)."""
    trainer = module._trainer
    schema = getattr(getattr(trainer, "datamodule", None), "schema", None) if trainer is not None else None
    name = type(module).__name__
    if schema is None:
        raise ValueError(
            f"{name} needs a `schema` (a {kind.__name__}): pass {name}(schema=datamodule.schema), or link "
            "data.schema -> model.schema in LightningCLI, or give the Trainer a datamodule with a `schema`"
        )
    if not isinstance(schema, kind):
        raise TypeError(f"`datamodule.schema` must be a {kind.__name__} for {name}, got {type(schema).__name__}")
    return schema


def segment_mean(values: Tensor, offsets: Tensor) -> Tensor:
    """Mean of each jagged segment: ``[T, D]`` with ``[B + 1]`` offsets -> ``[B, D]`` (zeros if empty)."""
    num_segments = offsets.numel() - 1
    lengths = jagged.offsets_to_lengths(offsets).to(values.dtype)
    seg = jagged.segment_ids(offsets, values.shape[0])
    sums = values.new_zeros(num_segments, values.shape[1]).index_add_(0, seg, values)
    return sums / lengths.clamp_min(1.0)[:, None]


def token_bucket(num_tokens: int, multiple: int, growth: float | None = None) -> tuple[int, int]:
    """``(padded, users)``: the token count one side of a batch is padded to, and how many padding users carry that
    padding with at most ``multiple`` tokens each (``GEMRanker(token_multiple=..., token_growth=...)``).

    Without ``growth`` the count is rounded up to a multiple of ``multiple`` (one padding user). With it, to the next
    of the bucket sizes ``multiple * b_k`` with ``b_0 = 1`` and ``b_{k+1} = max(b_k + 1, ceil(b_k * growth))``: from
    ``1 / (growth - 1)`` multiples on they grow geometrically, so the counts a run meets fall into a few buckets
    (each a CUDA graph signature) at a cost of at most a ``growth - 1`` share of padding. Such padding can exceed
    ``multiple`` tokens: it is spread over ``b_k - b_{k-1}`` padding users, so that none is longer than
    ``multiple`` (a padding user's attention costs the square of its length); the number of users is fixed by the
    bucket.

    Example:
        >>> token_bucket(5000, 1024)
        (5120, 1)
        >>> token_bucket(40_000, 1024, growth=1.125)  # 40 multiples -> bucket 44 (the one before: 39)
        (45056, 5)
        >>> token_bucket(0, 1024, growth=1.125)
        (0, 1)
    """
    units = -(-num_tokens // multiple)
    previous, bucket = units - 1, units
    if growth is not None and units > 1:
        previous, bucket = 1, 2
        while bucket < units:
            previous, bucket = bucket, max(bucket + 1, math.ceil(bucket * growth))
    return bucket * multiple, max(bucket - previous, 1)


def append_padding_user(
    history_offsets: Tensor,
    candidate_offsets: Tensor,
    history_pad: int,
    candidate_pad: int,
    *,
    users: int = 1,
    multiple: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Both offsets with ``users`` more users after the last real one, holding ``history_pad`` history and
    ``candidate_pad`` candidate tokens (either may be 0) between them: ``GEMRanker(token_multiple=...)``'s padding
    users. Over several users each side's padding fills them in order, ``multiple`` tokens at most each (then
    empty ones). No device read.

    Example:
        >>> ho, co = append_padding_user(torch.tensor([0, 2, 5]), torch.tensor([0, 1, 4]), 3, 0)
        >>> ho.tolist(), co.tolist()
        ([0, 2, 5, 8], [0, 1, 4, 4])
        >>> ho, co = append_padding_user(torch.tensor([0, 2, 5]), torch.tensor([0, 1, 4]), 5, 1, users=3, multiple=2)
        >>> ho.tolist(), co.tolist()
        ([0, 2, 5, 7, 9, 10], [0, 1, 4, 5, 5, 5])
    """
    if users == 1:
        history_offsets = torch.cat([history_offsets, history_offsets[-1:] + history_pad])
        candidate_offsets = torch.cat([candidate_offsets, candidate_offsets[-1:] + candidate_pad])
        return history_offsets, candidate_offsets
    if multiple is None or users * multiple < max(history_pad, candidate_pad):
        raise ValueError(f"{users} padding users of at most {multiple} tokens cannot hold {history_pad} and "
                         f"{candidate_pad} tokens")  # fmt: skip
    filled = torch.arange(1, users + 1, device=history_offsets.device) * multiple

    def extended(offsets: Tensor, pad: int) -> Tensor:
        return torch.cat([offsets, (offsets[-1:] + filled.clamp_max(pad)).to(offsets.dtype)])

    return extended(history_offsets, history_pad), extended(candidate_offsets, candidate_pad)


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with ``rows`` zero rows appended (the padding user's context)."""
    return torch.cat([x, x.new_zeros(rows, *x.shape[1:])]) if rows else x


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups for AdamW: weight decay on the weights of ``nn.Linear`` layers only.

    Embedding tables (torchrec's and ``nn.Embedding``), norms and biases are not decayed: decaying
    embedding rows shrinks rarely seen ids toward zero at every step.
    """
    decay, no_decay, seen = [], [], set()
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if isinstance(sub, nn.Linear) and name == "weight" else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class GEMRanker(L.LightningModule):
    """Multi-task ranking model over jagged user histories (HSTU encoder + GDPA candidate interaction).

    Args:
        schema: the features the batches carry (``datamodule.schema``). ``None`` only so that
            LightningCLI can link it from the DataModule; the model is then built in ``configure_model``
            from ``trainer.datamodule.schema``. Saved in ``hparams`` as plain containers, so
            ``GEMRanker.load_from_checkpoint(path)`` rebuilds the model.
        embedding_dim: width of every embedding table.
        model_dim: width of the encoder and interaction.
        num_layers: HSTU layers of the history encoder.
        num_heads: attention heads (encoder and interaction).
        attention_activation: GDPA activation of the history self-attention (``"silu"`` = HSTU).
        interaction_activation: GDPA activation of the candidate-to-history attention.
        attention_window: local attention window of the encoder (None: full causal).
        use_time: time-delta encoding of history events; None: ``schema.has_time``.
        self_interaction: per-candidate token interaction with the user's context tokens.
        head_hidden_dims: hidden widths of each task tower.
        esmm: ESMM heads (the ``cvr`` label must then be click-and-convert; see ``MultiTaskHead``).
        dropout: dropout in the encoder, interaction and heads.
        norm: ``"rms"`` or ``"layer"``.
        lr: AdamW learning rate (dense and embedding parameters).
        weight_decay: AdamW weight decay of the Linear weights (see :func:`adamw_param_groups`).
        loss_reduction: combine the per-task mean BCE losses by ``"sum"`` or ``"mean"``.
        embedding_init_scale: embedding rows uniform in ``[-s, s]``; None: torchrec's default.
        attention_impl: GDPA ``impl`` (``"auto"``, ``"reference"``, ``"triton"``, or the ``"padded"`` baseline).
        token_multiple: pad the history and candidate tokens of each batch to multiples of this with one padding
            user (zero inputs to the feature projections, :func:`append_padding_user`; its outputs are dropped
            before the loss, the real users' are unchanged since its tokens attend only to its own): every GEMM
            over tokens then meets a few row counts instead of a new one each jagged batch, which would cost the
            host 7-12x a repeated one (the library selects a kernel per new shape). FLOP counters count the padding
            user's products too (fewer than ``token_multiple`` tokens a side a batch). None: no padding.
        token_growth: with ``token_multiple``, pad each side instead to the next of geometrically growing bucket
            sizes (:func:`token_bucket`; e.g. 1.125: under 12.5% padding plus one multiple; 7% on average on batches of
            32 users of clip(4096 u^3, 16, 4096)), spread over as
            many padding users as the bucket needs to keep each within ``token_multiple`` tokens. Jagged batches of
            a fixed number of users then meet a few token counts (with ``cuda_graphs``: a few signatures, captured
            early in a run) instead of one for every multiple their totals span. None: multiples.
        fused_optimizer: AdamW's fused implementation (``fused=True``: the whole update in one kernel per group of
            tensors) instead of its multi-tensor one (several kernels a step): less host time a step.
        cuda_graphs: in training, run the history encoder and the candidate interaction through CUDA graphs
            (:class:`lightning_gem.graphs.ShapeGraphs`: forward and backward captured once per token count and
            length bucket, then replayed), their length hints rounded up to powers of two. Needs ``token_multiple``
            (else every jagged batch would be a new shape) and CUDA; evaluation runs eagerly. Not with
            torch.compile'd or activation-checkpointed layers, nor with gradients accumulated over batches
            (``accumulate_grad_batches``) or zeroed in place: a replay's backward refuses parameters holding one.
            Each captured signature keeps its own input, output and gradient buffers (more memory the more token
            counts a run meets).

    Example:
        >>> from lightning_gem.data.schema import RankingSchema, SparseFeature
        >>> schema = RankingSchema(
        ...     history_features=(SparseFeature(name="hist_item", num_embeddings=100, table="item"),),
        ...     candidate_features=(SparseFeature(name="cand_item", num_embeddings=100, table="item"),),
        ...     tasks=("ctr",), max_history_length=32)
        >>> model = GEMRanker(schema, embedding_dim=8, model_dim=16)
        >>> sorted(model.metrics_names("val"))
        ['val/auc_ctr', 'val/ne_ctr']
    """

    def __init__(
        self,
        schema: RankingSchema | None = None,
        *,
        embedding_dim: int = 32,
        model_dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        attention_activation: str = "silu",
        interaction_activation: str = "softmax",
        attention_window: int | None = None,
        use_time: bool | None = None,
        self_interaction: bool = True,
        head_hidden_dims: tuple[int, ...] = (64,),
        esmm: bool = False,
        dropout: float = 0.0,
        norm: NormKind = "rms",
        lr: float = 2e-3,
        weight_decay: float = 0.0,
        loss_reduction: Literal["sum", "mean"] = "sum",
        embedding_init_scale: float | None = 0.05,
        attention_impl: str = "auto",
        token_multiple: int | None = None,
        token_growth: float | None = None,
        fused_optimizer: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__()
        if token_multiple is not None and token_multiple < 1:
            raise ValueError(f"`token_multiple` must be >= 1 or None, got {token_multiple}")
        if token_growth is not None and (token_multiple is None or not token_growth > 1):
            raise ValueError(f"`token_growth` must be > 1 and needs `token_multiple`, got {token_growth}")
        if cuda_graphs and token_multiple is None:
            raise ValueError("`cuda_graphs=True` needs `token_multiple`: unpadded jagged batches are a new shape each")
        # Checked here, not only in the layers: under the CLI the layers are built at fit start (configure_model).
        check_option(attention_activation, "attention_activation", ACTIVATIONS)
        check_option(interaction_activation, "interaction_activation", ACTIVATIONS)
        check_option(attention_impl, "attention_impl", IMPLS)
        check_option(norm, "norm", ("rms", "layer"))
        check_option(loss_reduction, "loss_reduction", ("sum", "mean"))
        schema = schema_from_hparams(schema, RankingSchema)  # a dict when loaded from a checkpoint
        self.save_hyperparameters(ignore=["schema"])
        self.hparams["schema"] = None if schema is None else schema_to_hparams(schema)
        self.schema: RankingSchema | None = None
        if schema is not None:
            self._build(schema)

    # -- construction ------------------------------------------------------------------------------

    def _build(self, schema: RankingSchema) -> None:
        hp = self.hparams
        self.schema = schema
        self._history_keys = [f.name for f in schema.history_features]
        self._candidate_keys = [f.name for f in schema.candidate_features]
        self._pooled_keys = [f.name for f in schema.pooled_features]
        dim, emb = hp.model_dim, hp.embedding_dim
        tables = tables_from_features(schema.sequence_features, emb, init_scale=hp.embedding_init_scale)
        self.sequence_embeddings = build_embedding_collection(tables)
        self.pooled_embeddings = None
        if schema.pooled_features:
            pooled = tables_from_features(schema.pooled_features, emb, init_scale=hp.embedding_init_scale)
            self.pooled_embeddings = build_embedding_bag_collection(pooled, pooling="mean")
        # One projection per table, shared by the features of that table (see the module docstring).
        self._table_of = {f.name: f.table_name for f in schema.all_features}
        self.feature_proj = nn.ModuleDict({t.name: nn.Linear(emb, dim, bias=False) for t in tables})
        self.history_bias = nn.Parameter(torch.zeros(dim))
        self.candidate_bias = nn.Parameter(torch.zeros(dim))
        self.use_time = schema.has_time if hp.use_time is None else hp.use_time
        self.encoder = JaggedHistoryEncoder(
            None,
            dim,
            hp.num_layers,
            hp.num_heads,
            max_length=schema.max_history_length,
            activation=hp.attention_activation,
            window=hp.attention_window,
            dropout=hp.dropout,
            norm=hp.norm,
            use_time=self.use_time,
            attention_impl=hp.attention_impl,
        )
        self.pooled_proj = nn.Linear(len(schema.pooled_features) * emb, dim) if schema.pooled_features else None
        self.dense_proj = nn.Linear(schema.num_dense, dim) if schema.num_dense else None
        num_context = 1 + (self.pooled_proj is not None) + (self.dense_proj is not None)  # + history summary
        self.interaction = GDPAInteraction(
            dim,
            hp.num_heads,
            activation=hp.interaction_activation,
            dropout=hp.dropout,
            norm=hp.norm,
            self_interaction=hp.self_interaction,
            num_context_tokens=num_context if hp.self_interaction else 0,
            attention_impl=hp.attention_impl,
        )
        self.head = MultiTaskHead(dim, schema.tasks, hp.head_hidden_dims, dropout=hp.dropout, esmm=hp.esmm)
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{kind}_{task}": BinaryAUROC() if kind == "auc" else NormalizedEntropy()
                for stage in ("val", "test")
                for kind in ("auc", "ne")
                for task in schema.tasks
            }
        )
        # Weighted by candidates: the stage's loss is the mean over all its candidates, whatever the batches.
        self.metrics.update({f"{stage}_loss": MeanMetric() for stage in ("val", "test")})

    @override
    def configure_model(self) -> None:
        if self.schema is not None:
            return
        schema = schema_from_datamodule(self, RankingSchema)
        self.hparams["schema"] = schema_to_hparams(schema)  # so checkpoints rebuild the same model
        self._build(schema)

    def sample_cost_model(self) -> AttentionCostModel:
        """Training FLOPs of one sample as ``a * len + b * len**2`` of its history length: the encoder's.

        :class:`~lightning_gem.data.GEMDataModule` balances data-parallel ranks with it (Base Batch
        Shuffling). Parts whose cost does not grow with the history (heads, the candidates' side) are
        left out: they add the same to every rank of a balanced step on average.
        """
        self._require_schema()
        return self.encoder.sample_cost_model()

    def metrics_names(self, stage: Literal["val", "test"]) -> list[str]:
        """The metric names logged at ``stage``: ``{stage}/auc_{task}`` and ``{stage}/ne_{task}``."""
        tasks = self._require_schema().tasks
        return [f"{stage}/{kind}_{task}" for kind in ("auc", "ne") for task in tasks]

    def _require_schema(self) -> RankingSchema:
        if self.schema is None:
            raise ValueError("GEMRanker has no schema yet: pass `schema=` or let configure_model take the datamodule's")
        return self.schema

    # -- model -------------------------------------------------------------------------------------

    @override
    def forward(self, batch: RankingBatch) -> Tensor:
        """Logits ``[C, num_tasks]`` for the ``C`` candidates of ``batch`` (task order of the schema)."""
        schema = self._require_schema()
        embeddings = self.sequence_embeddings(batch.sequence_features)
        history_offsets = batch.history_offsets()
        candidate_offsets = batch.candidate_offsets()
        history_inputs = [concat_sequence_embeddings(embeddings, [key]) for key in self._history_keys]
        candidate_inputs = [concat_sequence_embeddings(embeddings, [key]) for key in self._candidate_keys]
        num_history, num_candidates = history_inputs[0].shape[0], candidate_inputs[0].shape[0]
        history_pad, candidate_pad, padding_users = self._padding(num_history, num_candidates)
        history_tokens = self._tokens(history_inputs, self._history_keys, self.history_bias, history_pad)
        candidates = self._tokens(candidate_inputs, self._candidate_keys, self.candidate_bias, candidate_pad)
        # The encoder and the interaction skip their own offset checks and take the longest sequences as exact
        # kernel hints. A collated batch knows them on the host (offsets built from its lengths: valid); otherwise
        # one device sync a batch checks both offsets and reads their longest sequences back together. Under
        # torch.compile (data-dependent): no check, the schema's bound.
        max_history, max_candidates = schema.max_history_length, None
        if batch.longest_history is not None and batch.most_candidates is not None:
            max_history, max_candidates = batch.longest_history, batch.most_candidates
        elif not torch.compiler.is_compiling():
            max_history, max_candidates = jagged.validate_offsets_together(
                [
                    (history_offsets, "history offsets", num_history, schema.max_history_length),
                    (candidate_offsets, "candidate offsets", num_candidates, None),
                ]
            )
        time_deltas = batch.history_time_deltas if self.use_time else None
        padded = padding_users if history_pad > 0 or candidate_pad > 0 else 0  # rows of user-level tensors
        if padded:
            history_offsets, candidate_offsets = append_padding_user(
                history_offsets, candidate_offsets, history_pad, candidate_pad, users=padded,
                multiple=self.hparams.token_multiple,
            )  # fmt: skip
            if time_deltas is not None:
                time_deltas = _pad_rows(time_deltas, history_pad)
            # The longest padding user: the first ones are full (append_padding_user).
            if type(max_history) is int:
                max_history = max(max_history, min(history_pad, self.hparams.token_multiple))
            if type(max_candidates) is int:
                max_candidates = max(max_candidates, min(candidate_pad, self.hparams.token_multiple))
        encoder, interaction = self.encoder, self.interaction
        if self.hparams.get("cuda_graphs") and not torch.compiler.is_compiling():
            encoder, interaction = self._graphs()
            max_history = next_power_of_2(max_history)
            max_candidates = None if max_candidates is None else next_power_of_2(max_candidates)
        history = encoder(
            history_tokens, history_offsets, time_deltas=time_deltas, max_seq_len=max_history, check_offsets=False
        )
        context = [segment_mean(history, history_offsets)]
        if self.pooled_proj is not None:
            if batch.pooled_features is None:
                raise ValueError("the schema has pooled features but `batch.pooled_features` is None")
            # By name: a sharded EmbeddingBagCollection's output lists its keys in sharding order (tables placed
            # table-wise on different ranks come back grouped by rank), not in the collection's order.
            pooled = self.pooled_embeddings(batch.pooled_features).to_dict()
            context.append(
                _pad_rows(self.pooled_proj(torch.cat([pooled[k] for k in self._pooled_keys], dim=1)), padded)
            )
        if self.dense_proj is not None:
            if batch.dense_features is None:
                raise ValueError(f"the schema has num_dense={schema.num_dense} but `batch.dense_features` is None")
            context.append(_pad_rows(self.dense_proj(batch.dense_features.to(candidates.dtype)), padded))
        context_BND = torch.stack(context, dim=1)
        if not self.interaction.self_interaction:
            # Without token interaction the user context joins each candidate token additively.
            user = jagged.segment_ids(candidate_offsets, candidates.shape[0])
            candidates = candidates + context_BND.sum(dim=1)[user]
            context_BND = None
        interacted = interaction(
            candidates,
            candidate_offsets,
            history,
            history_offsets,
            context=context_BND,
            max_history_len=max_history,
            max_candidates=max_candidates,
            check_offsets=False,
        )
        return self.head(interacted)[:num_candidates]

    @property
    def graph_signatures(self) -> dict[str, int]:
        """Signatures captured so far by the encoder's and the interaction's CUDA graphs (``cuda_graphs``): each new
        one cost its step eager warm-up runs and a capture, and past ``ShapeGraphs.max_graphs`` new ones run eagerly.
        Empty before the first graphed call."""
        graphs = self.__dict__.get("_shape_graphs")
        return {} if graphs is None else {"encoder": graphs[0].num_graphs, "interaction": graphs[1].num_graphs}

    def _graphs(self) -> tuple[ShapeGraphs, ShapeGraphs]:
        """The encoder's and the interaction's CUDA graphs (``cuda_graphs``), made on first use; kept outside the
        module tree (they hold the same modules)."""
        graphs = self.__dict__.get("_shape_graphs")
        if graphs is None or graphs[0].module is not self.encoder or graphs[1].module is not self.interaction:
            graphs = self.__dict__["_shape_graphs"] = (ShapeGraphs(self.encoder), ShapeGraphs(self.interaction))
        return graphs

    def _padding(self, num_history: int, num_candidates: int) -> tuple[int, int, int]:
        """``(history_pad, candidate_pad, padding_users)`` of a batch (``token_multiple``, ``token_growth``): the
        rows each side is padded with and the number of padding users holding them (:func:`token_bucket`)."""
        multiple = self.hparams.get("token_multiple")
        if multiple is None:
            return 0, 0, 0
        growth = self.hparams.get("token_growth")
        history_to, history_users = token_bucket(num_history, multiple, growth)
        candidates_to, candidate_users = token_bucket(num_candidates, multiple, growth)
        return history_to - num_history, candidates_to - num_candidates, max(history_users, candidate_users)

    def _tokens(self, inputs: list[Tensor], keys: list[str], bias: Tensor, pad: int) -> Tensor:
        """``[N + pad, model_dim]``: the sum over ``keys`` of each feature's table projection of its ``inputs``
        (``[N, embedding_dim]`` each), plus ``bias``, the projections' inputs padded with ``pad`` zero rows."""
        out = bias
        for key, x in zip(keys, inputs, strict=True):
            out = out + self.feature_proj[self._table_of[key]](_pad_rows(x, pad))
        return out

    def _loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, list[Tensor]]:
        num_tasks = logits.shape[1]
        if labels.shape != logits.shape:
            raise ValueError(f"`batch.labels` must be [C, num_tasks] = {list(logits.shape)}, got {list(labels.shape)}")
        if logits.shape[0] == 0:
            zero = logits.sum() * 0.0
            return zero, [zero] * num_tasks
        per_task = [
            F.binary_cross_entropy_with_logits(logits[:, i], labels[:, i].to(logits.dtype)) for i in range(num_tasks)
        ]
        total = torch.stack(per_task).sum()
        if self.hparams.loss_reduction == "mean":
            total = total / num_tasks
        return total, per_task

    @override
    def training_step(self, batch: RankingBatch, batch_idx: int) -> Tensor:
        logits = self(batch)
        loss, per_task = self._loss(logits, batch.labels)
        size = batch.batch_size
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        for task, task_loss in zip(self._require_schema().tasks, per_task, strict=True):
            self.log(f"train/loss_{task}", task_loss, batch_size=size)
        return loss

    def _evaluate(self, batch: RankingBatch, stage: str) -> None:
        logits = self(batch)
        loss, _ = self._loss(logits, batch.labels)
        if logits.shape[0]:
            self.metrics[f"{stage}_loss"].update(loss.detach(), weight=logits.shape[0])
        self.log(f"{stage}/loss", self.metrics[f"{stage}_loss"], on_step=False, on_epoch=True)
        for i, task in enumerate(self._require_schema().tasks):
            auc, ne = self.metrics[f"{stage}_auc_{task}"], self.metrics[f"{stage}_ne_{task}"]
            if logits.shape[0]:
                # Probabilities, not logits: BinaryAUROC applies a sigmoid only to batches outside [0, 1].
                auc.update(torch.sigmoid(logits[:, i].float()), batch.labels[:, i].long())
                ne.update(logits[:, i], batch.labels[:, i])
            self.log(f"{stage}/auc_{task}", auc, on_step=False, on_epoch=True, prog_bar=task == self.schema.tasks[0])
            self.log(f"{stage}/ne_{task}", ne, on_step=False, on_epoch=True)

    @override
    def validation_step(self, batch: RankingBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: RankingBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def predict_step(self, batch: RankingBatch, batch_idx: int) -> Tensor:
        """Probabilities ``[C, num_tasks]`` (with ``esmm``, the cvr column is pCTCVR)."""
        return torch.sigmoid(self(batch))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        self._require_schema()
        fused = bool(self.hparams.get("fused_optimizer"))
        return torch.optim.AdamW(
            adamw_param_groups(self, self.hparams.weight_decay), lr=self.hparams.lr, fused=fused or None
        )
