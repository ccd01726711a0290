"""GEMRanker on hand-made RankingBatches: shapes, empty users, gradients, schema handling, a short fit; option
checks; validation metrics over 2 gloo ranks equal to one process's."""

from __future__ import annotations

import dataclasses

import lightning as L
import numpy as np
import pytest
import torch
from lightning_gem.components import GEMRanker
from lightning_gem.components.ranker import token_bucket
from torch.utils.data import DataLoader

from lightning_gem.data import GEMDataModule, SyntheticRankingSource
from lightning_gem.testing.distributed import run_ranks


def _loader(batches: list) -> DataLoader:
    return DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch)


def _tiny(schema, **kwargs) -> GEMRanker:
    defaults = dict(embedding_dim=8, model_dim=16, num_layers=1, num_heads=2, head_hidden_dims=(16,))
    return GEMRanker(schema, **{**defaults, **kwargs})


@pytest.mark.parametrize("self_interaction", [True, False])
def test_forward_backward_with_empty_histories_and_users_without_candidates(batches, self_interaction: bool) -> None:
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    model = _tiny(schema, self_interaction=self_interaction)
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    logits = model(batch)
    assert logits.shape == (6, 2) and torch.isfinite(logits).all()
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
    for table in ("item", "hist_action"):
        assert model.sequence_embeddings.embeddings[table].weight.grad.abs().sum() > 0, table
    assert model.pooled_embeddings.embedding_bags["user_tags"].weight.grad.abs().sum() > 0
    assert model.encoder.time.weight.grad.abs().sum() > 0
    assert model.dense_proj.weight.grad.abs().sum() > 0


def test_padded_attention_baseline_gives_the_same_model(batches) -> None:
    """The plain stack (padded attention) and the kit's jagged attention compute the same function."""
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    model = _tiny(schema, attention_impl="reference", interaction_activation="softmax")
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    expected = model(batch)
    for module in model.modules():
        if hasattr(module, "attention_impl"):
            module.attention_impl = "padded"
    torch.testing.assert_close(model(batch), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("multiple", "growth"), [(8, None), (9, None), (6, None), (3, None), (2, 1.5), (1, 1.3)])
@pytest.mark.parametrize("self_interaction", [True, False])
def test_token_multiple_pads_with_a_user_that_changes_nothing(
    batches, self_interaction: bool, multiple: int, growth: float | None
) -> None:
    """token_multiple: a padding user brings the history (9) and candidate (6) token counts to multiples (both
    padded, one side only with the other user's side empty, or neither); with token_growth, to buckets, over several
    padding users (2 with 1 history token at (2, 1.5); 3 with 1, 1 and 0 at (1, 1.3)): the same logits, loss and
    gradients as the model without it."""
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    plain = _tiny(schema, self_interaction=self_interaction)
    padded = _tiny(schema, self_interaction=self_interaction, token_multiple=multiple, token_growth=growth)
    padded.load_state_dict(plain.state_dict())
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    results = []
    for model in (plain, padded):
        logits = model(batch)
        loss = model.training_step(batch, 0)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((logits, loss, grads))
    (logits, loss, grads), (logits_p, loss_p, grads_p) = results
    assert logits_p.shape == logits.shape == (6, 2)
    torch.testing.assert_close(logits_p, logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads_p.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_p[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("growth", [1.0625, 1.125, 1.5])
def test_token_buckets_bound_the_padding_and_the_padding_users(growth: float) -> None:
    """token_bucket: every count up to 200 multiples lands in the smallest bucket that holds it, padded by at most a
    ``growth - 1`` share past the first ``1 / (growth - 1)`` multiples (one multiple below), each bucket with one
    user count whose users of at most ``multiple`` tokens hold any padding of the bucket; and the counts of a
    jagged run (32 users of clip(4096 u^3, 16, 4096)) meet a few buckets where multiples meet dozens."""
    multiple = 64
    buckets: dict[int, int] = {}
    for n in range(1, 200 * multiple):
        padded, users = token_bucket(n, multiple, growth)
        assert padded >= n and padded % multiple == 0
        assert buckets.setdefault(padded, users) == users
        assert padded - n <= max(multiple - 1, (growth - 1) * n + multiple)
        assert padded - n <= users * multiple
        smaller = [b for b in buckets if b < padded]
        assert not smaller or max(smaller) < n
    assert token_bucket(0, multiple, growth) == (0, 1)
    rng = np.random.default_rng(0)
    totals = [int(np.clip(4096 * rng.random(32) ** 3, 16, 4096).astype(int).sum()) for _ in range(500)]
    by_growth = {token_bucket(t, 1024, growth)[0] for t in totals}
    by_multiple = {token_bucket(t, 1024)[0] for t in totals}
    assert len(by_growth) < len(by_multiple) / 2, (len(by_growth), len(by_multiple))


def test_token_growth_needs_a_multiple_and_growth(batches) -> None:
    schema = batches.ranking_schema()
    with pytest.raises(ValueError, match="`token_growth` must be > 1 and needs `token_multiple`"):
        _tiny(schema, token_growth=1.125)
    with pytest.raises(ValueError, match="`token_growth` must be > 1"):
        _tiny(schema, token_multiple=8, token_growth=1.0)


def test_fused_optimizer_is_adamw_fused_over_the_same_groups(batches) -> None:
    """fused_optimizer=True: AdamW with ``fused=True`` (its numerics are PyTorch's) over the same parameter groups
    and weight decays as the default multi-tensor one; a step with it trains every group."""
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    plain, fused = _tiny(schema, weight_decay=0.01), _tiny(schema, weight_decay=0.01, fused_optimizer=True)
    opt_plain, opt_fused = plain.configure_optimizers(), fused.configure_optimizers()
    assert opt_plain.defaults["fused"] is None and opt_fused.defaults["fused"] is True
    names = {id(p): n for n, p in plain.named_parameters()}
    names_fused = {id(p): n for n, p in fused.named_parameters()}
    groups = [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt_plain.param_groups]
    assert groups == [([names_fused[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt_fused.param_groups]
    assert [wd for _, wd in groups] == [0.01, 0.0]
    before = [[p.detach().clone() for p in g["params"]] for g in opt_fused.param_groups]
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    fused.training_step(batch, 0).backward()
    opt_fused.step()
    for group, old in zip(opt_fused.param_groups, before, strict=True):
        assert any(not torch.equal(p, o) for p, o in zip(group["params"], old, strict=True))


def test_a_batch_without_any_candidate(batches) -> None:
    schema = batches.ranking_schema(pooled=False, num_dense=0, has_time=False, tasks=("ctr",))
    model = _tiny(schema, esmm=False)
    batch = batches.make_ranking_batch(schema, history_lengths=[2, 0], candidate_counts=[0, 0])
    assert model(batch).shape == (0, 1)
    loss = model.training_step(batch, 0)
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_candidate_scores_do_not_depend_on_other_users(batches) -> None:
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    model = _tiny(schema, num_layers=2).eval()
    for layer in model.encoder.layers:  # residual branches start at zero: give them weights
        torch.nn.init.normal_(layer.output.weight, std=0.3)
    batch = batches.make_ranking_batch(schema, history_lengths=[4, 7, 2], candidate_counts=[2, 3, 1])
    together = model(batch)
    alone = batches.make_ranking_batch(schema, history_lengths=[7], candidate_counts=[3])
    # rebuild user 1 alone from the same values
    kjt = batch.sequence_features
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    jt = kjt.to_dict()
    single = KeyedJaggedTensor.from_jt_dict(
        {
            k: type(v)(values=v.values()[int(v.offsets()[1]) : int(v.offsets()[2])], lengths=v.lengths()[1:2])
            for k, v in jt.items()
        }
    )
    pooled = batch.pooled_features.to_dict()["user_tags"]
    alone.sequence_features = single
    alone.pooled_features = KeyedJaggedTensor.from_jt_dict(
        {
            "user_tags": type(pooled)(
                values=pooled.values()[int(pooled.offsets()[1]) : int(pooled.offsets()[2])],
                lengths=pooled.lengths()[1:2],
            )
        }
    )
    alone.dense_features = batch.dense_features[1:2]
    h = batch.history_offsets()
    alone.history_time_deltas = batch.history_time_deltas[int(h[1]) : int(h[2])]
    torch.testing.assert_close(together[2:5], model(alone), atol=1e-5, rtol=1e-5)


def test_schema_is_required_and_taken_from_the_datamodule(batches, quiet_trainer) -> None:
    model = GEMRanker(embedding_dim=8, model_dim=16)
    with pytest.raises(ValueError, match="schema"):
        model.configure_model()
    schema = batches.ranking_schema()

    class _DataModule(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.schema = schema

        def train_dataloader(self) -> DataLoader:
            return _loader([batches.make_ranking_batch(schema, [3, 2], [2, 1])])

    trainer = quiet_trainer(max_steps=1)
    trainer.fit(model, datamodule=_DataModule())
    assert model.schema is schema
    assert GEMRanker(**model.hparams).schema == schema  # hparams hold the schema as plain containers
    with pytest.raises(TypeError, match="RankingSchema"):
        GEMRanker(batches.retrieval_schema())


def test_labels_shape_is_checked(batches) -> None:
    schema = batches.ranking_schema()
    model = _tiny(schema)
    batch = batches.make_ranking_batch(schema, [2], [3])
    batch.labels = batch.labels[:, :1]
    with pytest.raises(ValueError, match="labels"):
        model.training_step(batch, 0)


@pytest.mark.parametrize("esmm", [False, True])
def test_fit_learns_and_logs_auc_and_ne(batches, esmm: bool, quiet_trainer) -> None:
    torch.manual_seed(0)
    schema = batches.ranking_schema(has_time=False)
    g = torch.Generator().manual_seed(1)

    def batch(n_users: int):
        lengths = torch.randint(0, 12, (n_users,), generator=g).tolist()
        counts = torch.randint(0, 5, (n_users,), generator=g).tolist()
        return batches.make_ranking_batch(schema, lengths, counts, generator=g, learnable=True)

    model = _tiny(schema, esmm=esmm, lr=1e-2)
    train, val = [batch(16) for _ in range(6)], [batch(32) for _ in range(2)]
    trainer = quiet_trainer(max_steps=60, num_sanity_val_steps=0, check_val_every_n_epoch=10)
    trainer.fit(model, _loader(train), _loader(val))
    metrics = trainer.callback_metrics
    for name in model.metrics_names("val"):
        assert name in metrics and torch.isfinite(metrics[name]), name
    assert float(metrics["val/auc_ctr"]) > 0.75  # the label is the parity of the candidate item id
    results = trainer.test(model, _loader(val), verbose=False)[0]
    assert set(model.metrics_names("test")) <= set(results)
    assert trainer.predict(model, _loader(val[:1]))[0].shape[1] == 2


def _auc_by_hand(scores: list[float], labels: list[int]) -> float:
    """The probability that a positive outscores a negative, ties counting one half (every pair, by hand)."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def test_validation_auc_and_ne_cover_the_whole_epoch(batches, quiet_trainer) -> None:
    """The logged ``val/auc_{task}`` and ``val/ne_{task}`` are the AUC and NE of every candidate of the epoch (three
    batches of different sizes, one with a user without candidates), from each task's column of the model's logits."""
    torch.manual_seed(0)
    schema = batches.ranking_schema(has_time=False)
    g = torch.Generator().manual_seed(5)
    val = [
        batches.make_ranking_batch(schema, [3, 0, 7, 2], [4, 0, 3, 2], generator=g),
        batches.make_ranking_batch(schema, [5, 1], [3, 5], generator=g),
        batches.make_ranking_batch(schema, [2, 9, 4], [1, 6, 2], generator=g),
    ]
    model = _tiny(schema)
    trainer = quiet_trainer()
    metrics = trainer.validate(model, _loader(val), verbose=False)[0]
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in val]).double()
    labels = torch.cat([batch.labels for batch in val]).double()
    for i, task in enumerate(schema.tasks):
        task_labels = labels[:, i]
        assert 0 < int(task_labels.sum()) < task_labels.numel(), task  # both classes: the AUC is defined
        auc = _auc_by_hand(torch.sigmoid(logits[:, i]).tolist(), task_labels.long().tolist())
        assert metrics[f"val/auc_{task}"] == pytest.approx(auc, abs=1e-6), task
        p = torch.sigmoid(logits[:, i])
        log_loss = -(task_labels * p.log() + (1 - task_labels) * (1 - p).log()).mean()
        base = task_labels.mean()
        entropy = -(base * base.log() + (1 - base) * (1 - base).log())
        assert metrics[f"val/ne_{task}"] == pytest.approx(float(log_loss / entropy), rel=1e-5), task


def test_checkpoint_round_trip_rebuilds_the_model(batches, tmp_path, quiet_trainer) -> None:
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    model = _tiny(schema)
    batch = batches.make_ranking_batch(schema, [3, 0, 2], [1, 2, 2])
    trainer = quiet_trainer(max_steps=1, default_root_dir=tmp_path)
    trainer.fit(model, _loader([batch]))
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = GEMRanker.load_from_checkpoint(tmp_path / "model.ckpt")  # weights_only: plain hparams only
    assert loaded.schema == schema
    model.eval()
    loaded.eval()
    torch.testing.assert_close(loaded(batch), model(batch))


def test_a_forward_validates_the_batch_once(batches, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fused check of both offsets and the length hint a batch (one device sync); the encoder, its layers
    and the interaction do not check again."""
    from lightning_gem import jagged

    schema = batches.ranking_schema()
    model = _tiny(schema, num_layers=2)
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    calls = {"together": 0, "single": 0}
    together, single = jagged.validate_offsets_together, jagged.validate_offsets

    def count_together(checks):
        calls["together"] += 1
        return together(checks)

    def count_single(offsets, name="offsets", **kwargs):
        calls["single"] += kwargs.get("check_values", True)
        return single(offsets, name, **kwargs)

    monkeypatch.setattr(jagged, "validate_offsets_together", count_together)
    monkeypatch.setattr(jagged, "validate_offsets", count_single)
    model(batch)
    assert calls == {"together": 1, "single": 0}
    bad = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    too_long = _tiny(dataclasses.replace(schema, max_history_length=4))
    with pytest.raises(ValueError, match="history offsets"):
        too_long(bad)


@pytest.mark.parametrize("token_multiple", [None, 8])
def test_a_training_step_reads_the_device_once(
    batches, monkeypatch: pytest.MonkeyPatch, token_multiple: int | None
) -> None:
    """Every host read of device values stalls the launch queue on a GPU: a step of the kernels' path makes one
    (the batch's offsets check, which also returns the length hints), none in the layers or the interaction, and
    none for a padding user (``token_multiple``)."""
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ours = tuple(str(root / d) for d in ("components", "lightning_gem", "strategies"))
    reads: list[str] = []
    for name in ("__bool__", "__int__", "__index__", "__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def read(t, *args, real=real, name=name):
            stack = traceback.extract_stack()[:-1]
            mine = [i for i, f in enumerate(stack) if f.filename.startswith(ours)]
            # Reads by Triton's interpreter inside a kernel launch are not the model's (compiled kernels make none).
            inside_triton = mine and any("triton" in Path(f.filename).parts for f in stack[mine[-1] + 1 :])
            if mine and not inside_triton:
                reads.append(f"{name} at {stack[mine[-1]].filename}:{stack[mine[-1]].lineno}")
            return real(t, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    schema = batches.ranking_schema()
    model = _tiny(schema, num_layers=3, attention_impl="triton", token_multiple=token_multiple)
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    reads.clear()
    model(batch).float().sum().backward()
    assert len(reads) == 1, reads
    # A collated batch carries its longest sequences as host ints: no read at all, the same logits.
    hinted = dataclasses.replace(batch, longest_history=5, most_candidates=3)
    reads.clear()
    logits = model(hinted)
    logits.float().sum().backward()
    assert reads == []
    torch.testing.assert_close(logits, model(batch))


@pytest.mark.parametrize(
    ("option", "allowed"),
    [
        ("attention_activation", "'softmax', 'silu', 'gelu', 'relu', 'sigmoid'"),
        ("interaction_activation", "'softmax', 'silu', 'gelu', 'relu', 'sigmoid'"),
        ("attention_impl", "'auto', 'reference', 'triton', 'flash', 'padded'"),
        ("norm", "'rms', 'layer'"),
    ],
)
def test_option_values_are_checked_at_construction_under_their_own_names(option: str, allowed: str) -> None:
    # Without a schema too: the CLI builds the layers only at fit start.
    with pytest.raises(ValueError, match=f"^`{option}` must be one of {allowed}; got 'swish'$"):
        GEMRanker(**{option: "swish"})


def _validate(rank: int, world_size: int) -> dict[str, float]:
    """The validation metrics of the same tiny ranker over 96 users, on ``world_size`` ranks (48 users each, in
    batches of 20, 20 and 8: a mean of per-batch means would weigh the batches wrongly)."""
    torch.manual_seed(0)
    source = SyntheticRankingSource(
        num_items=100,
        num_train_users=16,
        num_val_users=96,
        num_test_users=4,
        max_history_length=16,
        max_candidates=8,
        mean_candidates=4.0,
    )
    model = _tiny(source.schema)
    strategy = "ddp" if world_size > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, datamodule=GEMDataModule(source=source, eval_batch_size=20), verbose=False)
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_validation_metrics_over_two_gloo_ranks_are_one_process_metrics() -> None:
    single = _validate(0, 1)
    ranks = run_ranks(_validate, 2)
    assert set(single) == {"val/loss", "val/auc_ctr", "val/auc_cvr", "val/ne_ctr", "val/ne_cvr"}
    for metrics in ranks:  # every rank logs the reduced value
        assert metrics.keys() == single.keys()
        for name, value in single.items():
            assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_cuda_graphs_options_are_checked(batches) -> None:
    """cuda_graphs needs token_multiple (at construction), CUDA tensors (at the first training call: no silent eager
    run), and layers neither compiled nor activation-checkpointed."""
    schema = batches.ranking_schema()
    with pytest.raises(ValueError, match="`cuda_graphs=True` needs `token_multiple`"):
        _tiny(schema, cuda_graphs=True)
    model = _tiny(schema, cuda_graphs=True, token_multiple=8)
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        model.training_step(batch, 0)
    model.eval()
    with torch.no_grad():
        assert model(batch).shape == (6, 2)  # evaluation runs eagerly
    model.train()
    model.encoder.layers[0].compile()
    cuda = type("Cuda", (), {"is_cuda": True})  # past the device check, to the module check (made before capture)
    with pytest.raises(ValueError, match="compiled or activation-checkpointed modules: JaggedHistoryEncoder.layers.0"):
        model._graphs()[0]._capture(None, (cuda(),))


def test_cuda_graphs_call_the_encoder_and_interaction_as_eager(batches, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the captures replaced by their bound calls (a capture needs a GPU), cuda_graphs gives the eager model's
    logits, loss and gradients, and a batch of the same padded token counts and length buckets replays the same two
    signatures (encoder, interaction) instead of adding new ones."""
    from lightning_gem.graphs import ShapeGraphs

    captured = []
    monkeypatch.setattr(ShapeGraphs, "_capture", lambda self, bound, tensors: captured.append(bound) or bound)
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    eager = _tiny(schema, token_multiple=8)
    graphed = _tiny(schema, token_multiple=8, cuda_graphs=True)
    graphed.load_state_dict(eager.state_dict())
    assert graphed.graph_signatures == {} and eager.graph_signatures == {}
    batch = batches.make_ranking_batch(schema, history_lengths=[0, 1, 5, 3], candidate_counts=[2, 0, 3, 1])
    results = []
    for model in (eager, graphed):
        loss = model.training_step(batch, 0)
        loss.backward()
        results.append((loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_g, grads_g) = results
    torch.testing.assert_close(loss_g, loss)
    assert grads_g.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_g[name], grad, msg=name)
    assert len(captured) == 2 and graphed.graph_signatures == {"encoder": 1, "interaction": 1}
    # Other lengths, the same padded token counts (16 and 8) and length buckets (8 and 4): the same signatures.
    other = batches.make_ranking_batch(schema, history_lengths=[2, 4, 0, 6], candidate_counts=[1, 3, 0, 2])
    loss = graphed.training_step(other, 0)
    with pytest.raises(RuntimeError, match="set_to_none=True"):
        loss.backward()  # gradients held from the first call: refused
    loss = graphed.training_step(other, 0)
    graphed.zero_grad()  # Lightning's order: between the forward and the backward
    loss.backward()
    assert len(captured) == 2 and graphed.graph_signatures == {"encoder": 1, "interaction": 1}


@pytest.mark.gpu
def test_cuda_graphs_train_as_eager_gpu(batches) -> None:
    """Captured and replayed on a GPU: six optimizer steps on batches of two signatures give the eager model's
    losses and parameters (bf16 autocast, as under ``precision="bf16-mixed"``), with the gradients set to None as
    Lightning does (between the forward and the backward)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    schema = batches.ranking_schema()
    models = [_tiny(schema, token_multiple=8, attention_impl="triton", cuda_graphs=g).cuda() for g in (False, True)]
    models[1].load_state_dict(models[0].state_dict())
    shapes = [([0, 1, 5, 3], [2, 0, 3, 1]), ([2, 4, 0, 6], [1, 3, 0, 2]), ([9, 1, 2, 3], [2, 2, 2, 2])]
    losses = []
    for model in models:
        optimizer = model.configure_optimizers()
        losses.append([])
        for step, (history, candidates) in enumerate(shapes * 2):
            generator = torch.Generator().manual_seed(step)
            batch = batches.make_ranking_batch(schema, history, candidates, generator=generator)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.training_step(batch.to(torch.device("cuda")), step)
            optimizer.zero_grad()  # Lightning's order: after the forward
            loss.backward()
            optimizer.step()
            losses[-1].append(loss.item())
    assert models[1]._graphs()[0].num_graphs >= 2
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-3, atol=1e-4)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4, msg=name)
