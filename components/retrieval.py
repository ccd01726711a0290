"""``SequentialRecommender``: HSTU-style next-item retrieval as a LightningModule.

Each position of a user's sequence predicts the next item. Training uses a sampled softmax over
L2-normalised embeddings with uniform negatives and a temperature (the HSTU recipe); evaluation embeds
each sequence's last position, scores the full catalogue, removes the items already in that user's
history (never the target) and logs HR@K and NDCG@K.

Item ids are embedded by one torchrec ``EmbeddingCollection`` table that serves both the inputs and the
output side (targets, negatives, the catalogue): output-side ids go through the same table under an
extra lookup-only KJT key, so a sharded table works unchanged.

Legend: ``T`` events over the batch, ``B`` sequences, ``N`` negatives, ``I`` items in the catalogue.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from typing_extensions import override

from lightning_gem import jagged
from lightning_gem.data.balancing import AttentionCostModel
from lightning_gem.data.batch import RetrievalBatch
from lightning_gem.data.schema import RetrievalSchema
from lightning_gem.metrics import NDCG, HitRate, rank_of_target
from lightning_gem.ops.attention import ACTIVATIONS, IMPLS

from .embeddings import TableConfig, build_embedding_collection, concat_sequence_embeddings
from .encoder import JaggedHistoryEncoder, NormKind, check_option
from .ranker import adamw_param_groups, schema_from_datamodule, schema_from_hparams, schema_to_hparams

__all__ = ["SequentialRecommender", "catalogue_ranks", "exclude_seen", "sampled_softmax_loss"]


def sampled_softmax_loss(
    queries: Tensor,
    positives: Tensor,
    negatives: Tensor,
    positive_ids: Tensor,
    negative_ids: Tensor,
    temperature: float,
    negative_index: Tensor | None = None,
) -> Tensor:
    """Mean sampled-softmax loss over L2-normalised embeddings, with shared or per-row negatives.

    ``loss_t = -log(exp(s(u_t, p_t) / tau) / (exp(s(u_t, p_t) / tau) + sum_n exp(s(u_t, e_tn) / tau)))`` with
    ``s`` the cosine similarity; a negative equal to the row's positive id is masked (an accidental hit).
    Computed in fp32 whatever the autocast state: at ``tau = 0.05`` a bf16 cosine (a step of 2^-8 near 1) would
    move a logit by up to 0.08.

    Args:
        queries: ``[T, D]`` sequence embeddings. positives: ``[T, D]`` target item embeddings.
        negatives: ``[N, D]`` negative item embeddings: shared by every row, or, with ``negative_index``,
            the distinct negatives that rows pick from.
        positive_ids: ``[T]`` target ids. negative_ids: ``[N]`` ids of ``negatives`` (shared), or
            ``[T, K]`` ids of each row's own negatives (with ``negative_index``).
        temperature: softmax temperature ``tau``.
        negative_index: ``[T, K]`` rows of ``negatives`` that are row ``t``'s negatives; None: shared.
    """
    if queries.shape[0] == 0:
        return queries.sum() * 0.0
    with torch.autocast(queries.device.type, enabled=False):
        u = F.normalize(queries.float(), dim=-1)
        pos_logits = (u * F.normalize(positives.float(), dim=-1)).sum(-1, keepdim=True) / temperature  # [T, 1]
        negatives = F.normalize(negatives.float(), dim=-1)
        if negative_index is None:
            neg_logits = u @ negatives.T / temperature  # [T, N]
            negative_ids = negative_ids[None, :]
        elif negatives.shape[0] <= negative_index.shape[1] * negatives.shape[1]:
            # Few distinct negatives (a small catalogue): score them all with one matmul, then pick ([T, N] scores).
            neg_logits = (u @ negatives.T).gather(1, negative_index) / temperature  # [T, K]
        else:  # many: gather each row's K embeddings ([T, K, D])
            neg_logits = torch.einsum("td,tkd->tk", u, negatives[negative_index]) / temperature
        neg_logits = neg_logits.masked_fill(negative_ids == positive_ids[:, None], float("-inf"))
        logits = torch.cat([pos_logits, neg_logits], dim=1)
        return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def catalogue_ranks(
    queries: Tensor,
    catalogue: Tensor,
    target: Tensor,
    *,
    seen_rows: Tensor | None = None,
    seen_items: Tensor | None = None,
) -> Tensor:
    """1-based rank of each query's target among the full catalogue, excluding already-seen items.

    Scores are ``queries @ catalogue.T`` in fp32, whatever the autocast state (bf16 scores, a step of 2^-8 near 1,
    tie the target with its neighbours, and ties count against it); the pairs ``(seen_rows[s], seen_items[s])`` are
    set to ``-inf`` (entries with ``seen_rows < 0`` are skipped), except each row's own target, which keeps its
    score. Ties count pessimistically (see :func:`lightning_gem.metrics.rank_of_target`).

    Args:
        queries: ``[B, D]``. catalogue: ``[I, D]``. target: ``[B]`` ids in ``[0, I)``.
        seen_rows: ``[S]`` row of each seen item. seen_items: ``[S]`` item ids.

    Returns:
        ``[B]`` int64 ranks in ``[1, I]``.
    """
    with torch.autocast(queries.device.type, enabled=False):
        scores = queries.float() @ catalogue.float().T  # [B, I]
    target = target.to(torch.int64)
    if seen_rows is not None and seen_items is not None:
        scores = exclude_seen(scores, target, seen_rows, seen_items)
    return rank_of_target(scores, target)


def exclude_seen(scores: Tensor, target: Tensor, seen_rows: Tensor, seen_items: Tensor) -> Tensor:
    """``scores [B, I]`` with the pairs ``(seen_rows[s], seen_items[s])`` set to ``-inf`` (entries with
    ``seen_rows < 0`` skipped), except each row's own ``target [B]``, which keeps its score (out of place)."""
    target = target.to(torch.int64)
    target_score = scores.gather(1, target[:, None])
    keep = seen_rows >= 0
    rows, items = seen_rows[keep].to(torch.int64), seen_items[keep].to(torch.int64)
    scores = scores.index_put((rows, items), scores.new_tensor(float("-inf")))
    return scores.scatter(1, target[:, None], target_score)


class SequentialRecommender(L.LightningModule):
    """Next-item retrieval over jagged sequences: item embeddings -> causal HSTU encoder -> sampled softmax.

    Batches are :class:`~lightning_gem.data.batch.RetrievalBatch`: ``history`` holds the item key (and
    the schema's extra per-event keys), ``targets[t]`` the next item after position ``t`` (negative
    targets are ignored by the loss). For evaluation, the target of each sequence's last position is
    the held-out item ranked against the full catalogue.

    Args:
        schema: the item catalogue and features (``datamodule.schema``); ``None`` only so LightningCLI can
            link it; the model is then built in ``configure_model`` from ``trainer.datamodule.schema``.
        embedding_dim: width of the item embeddings and of the model.
        num_layers: HSTU layers.
        num_heads: attention heads.
        attention_activation: GDPA activation (``"silu"`` = HSTU, ``"softmax"`` = SASRec-like).
        attention_window: local attention window (None: full causal).
        dropout: dropout of the encoder.
        norm: ``"rms"`` or ``"layer"``.
        per_head_norm: normalise the attention output per head (False: over all heads, as the HSTU paper).
        attention_scale: GDPA score scale; None: ``1 / sqrt(head dim)`` (the HSTU reference uses ``1.0``).
        relative_attention_bias: a learned bias of the relative position in every layer's scores (HSTU's
            positional relative attention bias; a dense attention path for short histories, see
            :class:`~lightning_gem.components.encoder.HSTULayer`).
        position_encoding: ``"recency"`` (positions from the end of the history) or ``"absolute"`` (from its
            start, as the HSTU reference; see :class:`~lightning_gem.components.encoder.JaggedHistoryEncoder`).
        fixed_attention_normalization: pointwise attention divided by the history length cap instead of each
            sequence's own length (the HSTU reference's ``1 / N``).
        use_time: encode the gap to the previous event (``batch.timestamps``; causal: no future times).
        relative_time_bias: a learned bias of the time between the query's and the key's events in every layer's
            scores (the time half of HSTU's relative attention bias, with ``batch.timestamps``; each position's
            query time is that of the event it predicts, as the reference's: see
            :func:`~lightning_gem.components.encoder.relative_time_buckets`).
        num_negatives: uniform negatives of each position's sampled softmax.
        shared_negatives: draw one set of ``num_negatives`` for the whole batch instead of one per position
            (cheaper, but every position then sees the same few items as negatives: on ML-1M it learns
            several times slower; the reference recipe draws per position).
        temperature: softmax temperature over cosine similarities.
        top_k: the cut-offs of HR@K and NDCG@K.
        lr: AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay of the Linear weights.
        embedding_init_scale: item rows uniform in ``[-s, s]``; None: torchrec's default.
        attention_impl: GDPA ``impl``.
        compile_layers: ``torch.compile`` every HSTU layer in place (dynamic shapes: one graph for every batch's
            token count and longest sequence). Short histories make a step bound by the host's kernel launches;
            a compiled layer issues a few fused kernels instead of dozens.
        lr_schedule: ``"constant"`` or ``"cosine"`` (after ``warmup_steps`` of linear warm-up, the learning rate
            decays to 0 at the last step, ``trainer.estimated_stepping_batches``).
        warmup_steps: linear warm-up steps of the learning rate (both schedules).
        input_projection: project the item embedding through a Linear before the layers (False: the
            embedding enters them directly, scaled by ``sqrt(embedding_dim)``, as in the HSTU reference, so the
            input and output sides of the model share one item space; needs a schema without extra features).
        final_norm: normalise the last layer's output before its L2 normalisation (False: as the HSTU
            reference).

    Example:
        >>> from lightning_gem.data.schema import RetrievalSchema
        >>> model = SequentialRecommender(RetrievalSchema(num_items=100, max_history_length=20), embedding_dim=16)
        >>> model.metrics_names("val")[:2]
        ['val/hr@10', 'val/ndcg@10']
    """

    LOOKUP_KEY = "__item_lookup"
    """KJT key through which targets, negatives and the catalogue are looked up in the item table."""

    def __init__(
        self,
        schema: RetrievalSchema | None = None,
        *,
        embedding_dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        attention_activation: str = "silu",
        attention_window: int | None = None,
        dropout: float = 0.2,
        norm: NormKind = "rms",
        per_head_norm: bool = True,
        attention_scale: float | None = None,
        relative_attention_bias: bool = False,
        position_encoding: str = "recency",
        fixed_attention_normalization: bool = False,
        use_time: bool = False,
        relative_time_bias: bool = False,
        num_negatives: int = 128,
        shared_negatives: bool = False,
        temperature: float = 0.05,
        top_k: tuple[int, ...] = (10, 50, 200),
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        embedding_init_scale: float | None = 0.05,
        attention_impl: str = "auto",
        compile_layers: bool = False,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        input_projection: bool = True,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        # Checked here, not only in the layers: under the CLI the layers are built at fit start (configure_model).
        check_option(attention_activation, "attention_activation", ACTIVATIONS)
        check_option(attention_impl, "attention_impl", IMPLS)
        check_option(norm, "norm", ("rms", "layer"))
        check_option(position_encoding, "position_encoding", ("recency", "absolute"))
        check_option(lr_schedule, "lr_schedule", ("constant", "cosine"))
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")
        if num_negatives < 1:
            raise ValueError(f"`num_negatives` must be >= 1, got {num_negatives}")
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}")
        if not top_k or any(k < 1 for k in top_k):
            raise ValueError(f"`top_k` must be non-empty positive cut-offs, got {top_k}")
        schema = schema_from_hparams(schema, RetrievalSchema)  # a dict when loaded from a checkpoint
        self.save_hyperparameters(ignore=["schema"])
        self.hparams["schema"] = None if schema is None else schema_to_hparams(schema)
        self.schema: RetrievalSchema | None = None
        self._catalogue: Tensor | None = None
        if schema is not None:
            self._build(schema)

    # -- construction ------------------------------------------------------------------------------

    def _build(self, schema: RetrievalSchema) -> None:
        hp = self.hparams
        if self.LOOKUP_KEY == schema.item_feature or self.LOOKUP_KEY in schema.extra:
            raise ValueError(f"feature name {self.LOOKUP_KEY!r} is reserved by SequentialRecommender")
        self.schema = schema
        dim = hp.embedding_dim
        tables = [
            TableConfig(
                name="item",
                num_embeddings=schema.num_items,
                embedding_dim=dim,
                feature_names=(schema.item_feature, self.LOOKUP_KEY),
                init_scale=hp.embedding_init_scale,
            )
        ]
        tables += [
            TableConfig(
                name=name,
                num_embeddings=size,
                embedding_dim=dim,
                feature_names=(name,),
                init_scale=hp.embedding_init_scale,
            )
            for name, size in schema.extra.items()
        ]
        self._input_keys = [schema.item_feature, *schema.extra]
        input_projection = hp.get("input_projection", True)
        if not input_projection and schema.extra:
            raise ValueError(
                f"`input_projection=False` feeds the item embedding to the layers as it is; the schema's extra "
                f"features {sorted(schema.extra)} need the projection of their concatenation"
            )
        # Without the projection, the embedding enters the layers scaled as the reference's (sqrt(D)).
        self._input_scale = None if input_projection else math.sqrt(dim)
        self.embeddings = build_embedding_collection(tables)
        self.encoder = JaggedHistoryEncoder(
            len(self._input_keys) * dim if input_projection else None,
            dim,
            hp.num_layers,
            hp.num_heads,
            max_length=schema.max_history_length,
            activation=hp.attention_activation,
            causal=True,
            window=hp.attention_window,
            dropout=hp.dropout,
            norm=hp.norm,
            per_head_norm=hp.per_head_norm,
            attention_scale=hp.attention_scale,
            relative_attention_bias=hp.relative_attention_bias,
            position_encoding=hp.get("position_encoding", "recency"),
            fixed_attention_normalization=hp.get("fixed_attention_normalization", False),
            use_time=hp.use_time,
            relative_time_bias=hp.get("relative_time_bias", False),
            attention_impl=hp.attention_impl,
            final_norm=hp.get("final_norm", True),
        )
        if hp.get("compile_layers", False):
            self.encoder.compile_layers()
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{kind}_{k}": HitRate(k) if kind == "hr" else NDCG(k)
                for stage in ("val", "test")
                for k in hp.top_k
                for kind in ("hr", "ndcg")
            }
        )

    @override
    def configure_model(self) -> None:
        if self.schema is not None:
            return
        schema = schema_from_datamodule(self, RetrievalSchema)
        self.hparams["schema"] = schema_to_hparams(schema)  # so checkpoints rebuild the same model
        self._build(schema)

    def sample_cost_model(self) -> AttentionCostModel:
        """The encoder's training FLOPs of one sequence, ``a * len + b * len**2`` (``GEMDataModule`` balances by it)."""
        self._require_schema()
        return self.encoder.sample_cost_model()

    def metrics_names(self, stage: str) -> list[str]:
        """The metric names logged at ``stage``: ``{stage}/hr@K`` and ``{stage}/ndcg@K`` for each K."""
        return [f"{stage}/{kind}@{k}" for k in self.hparams.top_k for kind in ("hr", "ndcg")]

    def _require_schema(self) -> RetrievalSchema:
        if self.schema is None:
            raise ValueError("SequentialRecommender has no schema yet: pass `schema=` or let configure_model take it")
        return self.schema

    # -- model -------------------------------------------------------------------------------------

    def _embed(self, history: KeyedJaggedTensor | None, lookup_ids: Tensor) -> tuple[Tensor, Tensor]:
        """One EmbeddingCollection call: the history's input features ``[T, K * D]`` and ``[n, D]`` rows
        of the item table for ``lookup_ids`` (all placed in the last sequence of the lookup key)."""
        lookup_ids = lookup_ids.to(torch.int64)
        if history is None:
            keys = self._input_keys
            empty = torch.zeros(len(keys), dtype=torch.int64, device=lookup_ids.device)
            history = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=lookup_ids[:0], lengths=empty)
        stride = history.stride()
        lengths = torch.zeros(stride, dtype=torch.int64, device=lookup_ids.device)
        lengths[-1] = lookup_ids.numel()
        lookup = KeyedJaggedTensor.from_jt_dict({self.LOOKUP_KEY: JaggedTensor(values=lookup_ids, lengths=lengths)})
        embeddings = self.embeddings(KeyedJaggedTensor.concat([history, lookup]))
        return concat_sequence_embeddings(embeddings, self._input_keys), embeddings[self.LOOKUP_KEY].values()

    def _encode(self, batch: RetrievalBatch, features: Tensor, offsets: Tensor) -> Tensor:
        time_deltas = None
        if self.hparams.use_time:
            if batch.timestamps is None:
                raise ValueError("use_time=True needs `batch.timestamps` ([T] seconds)")
            time_deltas = _gap_to_previous(batch.timestamps, offsets)
        timestamps = None
        if self.hparams.get("relative_time_bias", False):
            if batch.timestamps is None:
                raise ValueError("relative_time_bias=True needs `batch.timestamps` ([T] seconds)")
            timestamps = batch.timestamps
        if self._input_scale is not None:
            features = features * self._input_scale
        return self.encoder(
            features,
            offsets,
            time_deltas=time_deltas,
            timestamps=timestamps,
            max_seq_len=self._require_schema().max_history_length,
        )

    @override
    def forward(self, batch: RetrievalBatch) -> Tensor:
        """L2-normalised sequence embeddings ``[T, D]``, one per position (row ``t`` predicts ``targets[t]``)."""
        features, _ = self._embed(batch.history, batch.targets[:0])
        return F.normalize(self._encode(batch, features, batch.offsets()), dim=-1)

    def item_embeddings(self, ids: Tensor) -> Tensor:
        """L2-normalised item embeddings ``[n, D]`` of ``ids [n]`` (the output side of the model)."""
        _, rows = self._embed(None, ids)
        return F.normalize(rows, dim=-1)

    @override
    def training_step(self, batch: RetrievalBatch, batch_idx: int) -> Tensor:
        schema = self._require_schema()
        targets = batch.targets.to(torch.int64)
        if targets.shape[0] != batch.history[batch.item_key].values().shape[0]:
            raise ValueError(f"`batch.targets` must have one entry per event ([T]), got shape {tuple(targets.shape)}")
        valid = targets >= 0
        num_rows = int(valid.sum()) if not self.hparams.shared_negatives else 1
        negatives = torch.randint(0, schema.num_items, (num_rows, self.hparams.num_negatives), device=targets.device)
        # Each distinct item is looked up once; per-position negatives index those rows.
        unique, inverse = torch.unique(negatives, return_inverse=True)
        features, rows = self._embed(batch.history, torch.cat([targets.clamp_min(0), unique]))
        queries = self._encode(batch, features, batch.offsets())
        num_targets = targets.shape[0]
        shared = self.hparams.shared_negatives
        loss = sampled_softmax_loss(
            queries[valid],
            rows[:num_targets][valid],
            rows[num_targets:],
            targets[valid],
            unique if shared else negatives,
            self.hparams.temperature,
            negative_index=None if shared else inverse,
        )
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        return loss

    def _catalogue_embeddings(self) -> Tensor:
        if self._catalogue is None:
            ids = torch.arange(self._require_schema().num_items, device=self.device)
            self._catalogue = torch.cat([self.item_embeddings(chunk) for chunk in ids.split(65536)])
        return self._catalogue

    def ranking_inputs(self, batch: RetrievalBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What :func:`catalogue_ranks` takes to rank each sequence's held-out item (its last position's target).

        Returns:
            ``(queries [R, D], target [R], seen_rows [T], seen_items [T])``: one row per sequence with a position
            and a target (``R`` may be 0, and then the encoder does not run); every history event of a ranked
            sequence is a seen pair of its row, the others have ``seen_rows = -1``.
        """
        offsets = batch.offsets()
        lengths = jagged.offsets_to_lengths(offsets)
        kept = torch.nonzero(lengths > 0).squeeze(1)  # an empty sequence has no position to predict from
        last = offsets[1:][kept] - 1
        target = batch.targets.to(torch.int64)[last]
        kept, last, target = kept[target >= 0], last[target >= 0], target[target >= 0]
        # Row r of the ranking is sequence kept[r].
        row_of_sequence = torch.full_like(lengths, -1, dtype=torch.int64)
        row_of_sequence[kept] = torch.arange(kept.numel(), device=kept.device)
        queries = self(batch)[last] if kept.numel() else torch.zeros(0, self.hparams.embedding_dim, device=last.device)
        seen_rows = row_of_sequence[jagged.segment_ids(offsets)]
        return queries, target, seen_rows, batch.history[batch.item_key].values()

    def _evaluate(self, batch: RetrievalBatch, stage: str) -> None:
        queries, target, seen_rows, seen_items = self.ranking_inputs(batch)
        if target.numel():
            ranks = catalogue_ranks(
                queries, self._catalogue_embeddings(), target, seen_rows=seen_rows, seen_items=seen_items
            )
            for k in self.hparams.top_k:
                self.metrics[f"{stage}_hr_{k}"].update(ranks)
                self.metrics[f"{stage}_ndcg_{k}"].update(ranks)
        for k in self.hparams.top_k:
            for kind in ("hr", "ndcg"):
                self.log(
                    f"{stage}/{kind}@{k}",
                    self.metrics[f"{stage}_{kind}_{k}"],
                    on_step=False,
                    on_epoch=True,
                    prog_bar=k == self.hparams.top_k[0],
                    batch_size=max(int(target.numel()), 1),
                )

    @override
    def on_validation_epoch_start(self) -> None:
        self._catalogue = None  # weights changed since the last evaluation

    @override
    def on_test_epoch_start(self) -> None:
        self._catalogue = None

    @override
    def on_validation_epoch_end(self) -> None:
        self._catalogue = None

    @override
    def on_test_epoch_end(self) -> None:
        self._catalogue = None

    @override
    def validation_step(self, batch: RetrievalBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: RetrievalBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def configure_optimizers(self) -> Any:
        self._require_schema()
        hp = self.hparams
        optimizer = torch.optim.AdamW(adamw_param_groups(self, hp.weight_decay), lr=hp.lr, betas=tuple(hp.betas))
        schedule, warmup = hp.get("lr_schedule", "constant"), hp.get("warmup_steps", 0)
        if schedule == "constant" and warmup == 0:
            return optimizer
        total = self.trainer.estimated_stepping_batches if schedule == "cosine" else 0
        if schedule == "cosine" and not 0 < total < math.inf:
            raise ValueError(f"lr_schedule='cosine' needs a finite number of training steps, got {total}")
        factor = functools.partial(_lr_factor, warmup=warmup, total=int(total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _lr_factor(step: int, *, warmup: int, total: int) -> float:
    """The learning rate's factor at optimizer step ``step``: linear warm-up over ``warmup`` steps, then constant
    (``total == 0``) or a cosine decay reaching 0 at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if total == 0:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _gap_to_previous(timestamps: Tensor, offsets: Tensor) -> Tensor:
    """``[T]`` seconds since the previous event of the same sequence (0 for a sequence's first event)."""
    gaps = torch.zeros_like(timestamps, dtype=torch.float32)
    if timestamps.numel() > 1:
        gaps[1:] = (timestamps[1:] - timestamps[:-1]).to(torch.float32)
    starts = offsets[:-1][jagged.offsets_to_lengths(offsets) > 0].to(torch.int64)
    gaps[starts] = 0.0
    return gaps
