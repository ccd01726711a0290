"""SequentialRecommender on hand-made RetrievalBatches: loss, gradients, catalogue ranking, a short fit."""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import pytest
import torch
from lightning_gem.components import SequentialRecommender
from lightning_gem.components.encoder import HSTULayer, recency_positions
from lightning_gem.components.retrieval import catalogue_ranks, sampled_softmax_loss
from torch.utils.data import DataLoader

from lightning_gem.data.schema import RetrievalSchema
from lightning_gem.metrics import rank_of_target


def _loader(batches: list) -> DataLoader:
    return DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch)


def test_sampled_softmax_loss_by_hand_with_accidental_hits() -> None:
    queries = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    positives = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    negatives = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    loss = sampled_softmax_loss(queries, positives, negatives, torch.tensor([3, 7]), torch.tensor([5, 7]), 0.5)
    s = 1 / math.sqrt(2)
    row0 = -(2.0 - math.log(math.exp(2.0) + math.exp(0.0) + math.exp(2 * s)))
    row1 = -(0.0 - math.log(math.exp(0.0) + math.exp(2.0)))  # negative id 7 is row 1's target: masked
    assert float(loss) == pytest.approx((row0 + row1) / 2, rel=1e-5)


@pytest.mark.parametrize("num_distinct", [3, 40])  # few: one matmul then a gather; many: gathered embeddings
def test_sampled_softmax_loss_per_row_negatives(num_distinct: int) -> None:
    torch.manual_seed(0)
    queries, positives, table = torch.randn(4, 6), torch.randn(4, 6), torch.randn(num_distinct, 6)
    positive_ids, table_ids = torch.tensor([0, 1, 2, 9]), torch.arange(100, 100 + num_distinct)
    table_ids[-1] = 9  # row 3's target: an accidental hit wherever a row draws it
    index = torch.randint(0, num_distinct, (4, 2))
    index[3, 1] = num_distinct - 1
    got = sampled_softmax_loss(queries, positives, table, positive_ids, table_ids[index], 0.1, negative_index=index)
    # Row by row with that row's negatives as a shared set.
    rows = [
        sampled_softmax_loss(
            queries[r : r + 1], positives[r : r + 1], table[index[r]], positive_ids[r : r + 1], table_ids[index[r]], 0.1
        )
        for r in range(4)
    ]
    torch.testing.assert_close(got, torch.stack(rows).mean())


def test_catalogue_ranks_exclude_seen_items_but_never_the_target() -> None:
    catalogue = torch.eye(5)
    queries = torch.tensor([[0.1, 0.9, 0.5, 0.4, 0.0], [0.0, 0.0, 0.0, 1.0, 0.8]])
    target = torch.tensor([2, 3])
    assert catalogue_ranks(queries, catalogue, target).tolist() == [2, 1]
    # row 0 saw items 1 and 2 (its target): 1 is removed, 2 stays; row 1 saw item 4; -1 rows are skipped
    ranks = catalogue_ranks(
        queries, catalogue, target, seen_rows=torch.tensor([0, 0, 1, -1]), seen_items=torch.tensor([1, 2, 4, 0])
    )
    assert ranks.tolist() == [1, 1]


@pytest.mark.parametrize(
    ("shared_negatives", "relative_bias", "reference_encoding", "time_bias"),
    [
        (False, False, False, False),
        (True, False, False, False),
        (False, True, False, False),
        (False, True, True, False),
        (False, False, True, False),
        (False, True, True, True),
    ],
)
def test_forward_training_step_and_gradients_with_empty_and_single_event_sequences(
    batches, shared_negatives: bool, relative_bias: bool, reference_encoding: bool, time_bias: bool
) -> None:
    torch.manual_seed(0)
    schema = batches.retrieval_schema()
    model = SequentialRecommender(
        schema,
        embedding_dim=16,
        num_layers=1,
        use_time=True,
        num_negatives=8,
        shared_negatives=shared_negatives,
        relative_attention_bias=relative_bias,
        position_encoding="absolute" if reference_encoding else "recency",
        fixed_attention_normalization=reference_encoding,
        relative_time_bias=time_bias,
    )
    assert model.encoder.layers[0].normalization_length == (schema.max_history_length if reference_encoding else None)
    if relative_bias:  # a fresh layer's residual branch is zero: give it weights so the bias gets a gradient
        torch.nn.init.normal_(model.encoder.layers[0].output.weight, std=0.1)
    batch = batches.make_retrieval_batch(schema, [0, 1, 5, 3])
    out = model(batch)
    assert out.shape == (9, 16) and torch.isfinite(out).all()
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(9))
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.embeddings.embeddings["item"].weight.grad.abs().sum() > 0
    assert model.embeddings.embeddings["rating"].weight.grad.abs().sum() > 0
    assert model.encoder.time.weight.grad.abs().sum() > 0
    assert model.item_embeddings(torch.tensor([0, 3])).shape == (2, 16)
    if relative_bias:
        assert model.encoder.layers[0].relative_bias.weight.grad.abs().sum() > 0
    if time_bias:
        assert model.encoder.layers[0].time_bias.weight.grad.abs().sum() > 0
        with pytest.raises(ValueError, match="timestamps"):
            model(dataclasses.replace(batch, timestamps=None))


def test_without_input_projection_the_layers_read_the_scaled_item_embedding(batches) -> None:
    """input_projection=False, final_norm=False (the HSTU reference's input and output): with no layers, a
    position's encoding is ``normalize(sqrt(D) * item_row + position_row)``; with layers it trains, and a
    schema with extra features is refused."""
    torch.manual_seed(0)
    schema = RetrievalSchema(num_items=batches.NUM_ITEMS, max_history_length=16)
    kwargs = dict(embedding_dim=16, num_negatives=8, dropout=0.0, input_projection=False, final_norm=False)
    model = SequentialRecommender(schema, num_layers=0, **kwargs)
    assert isinstance(model.encoder.input_proj, torch.nn.Identity)
    assert isinstance(model.encoder.final_norm, torch.nn.Identity)
    batch = batches.make_retrieval_batch(schema, [3, 0, 5])
    items = batch.history[schema.item_feature].values()
    positions = recency_positions(batch.offsets(), schema.max_history_length)
    rows = model.embeddings.embeddings["item"].weight[items]
    expected = torch.nn.functional.normalize(4.0 * rows + model.encoder.position.weight[positions], dim=-1)
    torch.testing.assert_close(model.eval()(batch), expected)

    model = SequentialRecommender(schema, num_layers=2, **kwargs)
    assert all(isinstance(layer, HSTULayer) for layer in model.encoder.layers)
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and model.embeddings.embeddings["item"].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="extra features"):
        SequentialRecommender(batches.retrieval_schema(), **kwargs)


def test_ranking_inputs_take_each_sequences_last_position_and_its_history(batches) -> None:
    """One ranking row per sequence with a position and a target: its last position's query and target, and its
    history events as its seen pairs; empty sequences, and one whose last target is ignored, get no row."""
    torch.manual_seed(0)
    schema = batches.retrieval_schema()
    model = SequentialRecommender(schema, embedding_dim=8, num_layers=1).eval()
    batch = batches.make_retrieval_batch(schema, [0, 3, 2, 1])
    batch.targets[-1] = -1  # the fourth sequence's only target is ignored
    queries, target, seen_rows, seen_items = model.ranking_inputs(batch)
    torch.testing.assert_close(queries, model(batch)[[2, 4]])
    assert target.tolist() == batch.targets[[2, 4]].tolist()
    assert seen_rows.tolist() == [0, 0, 0, 1, 1, -1]
    assert seen_items.tolist() == batch.history[schema.item_feature].values().tolist()
    queries, target, _, _ = model.ranking_inputs(batches.make_retrieval_batch(schema, [0, 0]))
    assert queries.shape == (0, 8) and target.numel() == 0


def test_ignored_targets_and_schema_errors(batches) -> None:
    schema = batches.retrieval_schema()
    model = SequentialRecommender(schema, embedding_dim=8, num_layers=1, num_negatives=4)
    batch = batches.make_retrieval_batch(schema, [3, 2])
    batch.targets[:] = -1
    loss = model.training_step(batch, 0)
    assert float(loss.detach()) == 0.0
    with pytest.raises(ValueError, match="schema"):
        SequentialRecommender().configure_model()
    with pytest.raises(TypeError, match="RetrievalSchema"):
        SequentialRecommender(batches.ranking_schema())


def test_fit_learns_successors_and_logs_hr_and_ndcg(batches, quiet_trainer) -> None:
    torch.manual_seed(0)
    schema = batches.retrieval_schema()
    g = torch.Generator().manual_seed(0)

    def batch(n: int):
        lengths = torch.randint(1, 12, (n,), generator=g).tolist()
        return batches.make_retrieval_batch(schema, lengths, generator=g, learnable=True)

    model = SequentialRecommender(
        schema, embedding_dim=16, num_layers=1, num_negatives=16, dropout=0.0, lr=1e-2, top_k=(1, 10)
    )
    trainer = quiet_trainer(max_steps=60, num_sanity_val_steps=0, check_val_every_n_epoch=10)
    trainer.fit(model, _loader([batch(16) for _ in range(6)]), _loader([batch(32)]))
    metrics = trainer.callback_metrics
    for name in model.metrics_names("val"):
        assert name in metrics and torch.isfinite(metrics[name]), name
    # item i is always followed by i + 1: a random ranker has HR@10 = 10 / 50
    assert float(metrics["val/hr@10"]) > 0.5
    results = trainer.test(model, _loader([batch(8)]), verbose=False)[0]
    assert set(model.metrics_names("test")) <= set(results)


def test_checkpoint_round_trip_rebuilds_the_model(batches, tmp_path, quiet_trainer) -> None:
    schema = batches.retrieval_schema()
    model = SequentialRecommender(schema, embedding_dim=8, num_layers=1, num_negatives=4)
    batch = batches.make_retrieval_batch(schema, [3, 2])
    trainer = quiet_trainer(max_steps=1, default_root_dir=tmp_path)
    trainer.fit(model, _loader([batch]))
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = SequentialRecommender.load_from_checkpoint(tmp_path / "model.ckpt")
    assert loaded.schema == schema
    torch.testing.assert_close(loaded.eval()(batch), model.eval()(batch))


@pytest.mark.slow
def test_compiled_layers_match_eager_layers(batches) -> None:
    """compile_layers=True compiles every HSTU layer (one graph over batches of other shapes) and changes neither
    the parameter names nor the loss and gradients of a training step."""
    torch.manual_seed(0)
    schema = batches.retrieval_schema()
    kwargs = {"embedding_dim": 16, "num_layers": 2, "num_negatives": 8, "dropout": 0.0, "relative_attention_bias": True}
    eager = SequentialRecommender(schema, **kwargs)
    for layer in eager.encoder.layers:  # a fresh residual branch is zero: give it weights
        torch.nn.init.normal_(layer.output.weight, std=0.1)
    compiled = SequentialRecommender(schema, **kwargs, compile_layers=True)
    compiled.load_state_dict(eager.state_dict())
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert all(layer._compiled_call_impl is not None for layer in compiled.encoder.layers)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for lengths in ([0, 1, 5, 3], [7, 2], [4, 4, 4, 1, 6]):
        batch = batches.make_retrieval_batch(schema, lengths)
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            torch.manual_seed(1)  # the same negatives
            loss = model.training_step(batch, 0)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert torch.allclose(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-5), name
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, graphs  # forward of a layer (+ one recompile at most)


def test_cosine_schedule_warms_up_then_decays_to_zero(batches, quiet_trainer) -> None:
    from lightning_gem.components.retrieval import _lr_factor

    assert [_lr_factor(s, warmup=2, total=0) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [round(_lr_factor(s, warmup=2, total=6), 6) for s in range(7)]
    assert cosine == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    schema = batches.retrieval_schema()
    model = SequentialRecommender(
        schema, embedding_dim=8, num_layers=1, num_negatives=4, lr=0.01, lr_schedule="cosine", warmup_steps=2
    )
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = quiet_trainer(max_epochs=2, callbacks=[Record()])
    trainer.fit(model, _loader([batches.make_retrieval_batch(schema, [3, 2]) for _ in range(4)]))
    expected = [0.01 * _lr_factor(s, warmup=2, total=8) for s in range(8)]
    assert seen == pytest.approx(expected)
    with pytest.raises(ValueError, match="lr_schedule"):
        SequentialRecommender(schema, lr_schedule="linear")
    with pytest.raises(ValueError, match="finite"):
        L.Trainer(max_steps=-1, max_epochs=-1, accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            SequentialRecommender(schema, embedding_dim=8, num_layers=1, lr_schedule="cosine"),
            _loader([batches.make_retrieval_batch(schema, [3, 2])]),
        )


def test_scores_and_loss_are_fp32_under_bf16_autocast() -> None:
    """Under bf16 autocast (``precision="bf16-mixed"`` wraps every step in it) the catalogue is still ranked and
    the sampled softmax still computed in fp32: bf16 cosines (a step of 2^-8 near 1) tie close items, and ties
    count against the target."""
    g = torch.Generator().manual_seed(0)
    queries, catalogue = torch.randn(64, 32, generator=g), torch.randn(500, 32, generator=g)
    queries, catalogue = (
        torch.nn.functional.normalize(queries, dim=-1),
        torch.nn.functional.normalize(catalogue, dim=-1),
    )
    target = torch.randint(0, 500, (64,), generator=g)
    fp32 = catalogue_ranks(queries, catalogue, target)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(catalogue_ranks(queries, catalogue, target), fp32)
        bf16 = rank_of_target(queries @ catalogue.T, target)  # what the ranking was before: bf16 scores
    assert not torch.equal(bf16, fp32)
    negatives = torch.randn(40, 32, generator=g)
    ids = torch.randint(0, 40, (64, 8), generator=g)
    loss = sampled_softmax_loss(queries, catalogue[target], negatives, target, ids, 0.05, negative_index=ids)
    with torch.autocast("cpu", torch.bfloat16):
        loss_autocast = sampled_softmax_loss(
            queries, catalogue[target], negatives, target, ids, 0.05, negative_index=ids
        )
    assert loss_autocast.dtype == torch.float32
    torch.testing.assert_close(loss_autocast, loss, rtol=0, atol=0)


@pytest.mark.parametrize("option", ["attention_activation", "attention_impl", "norm", "position_encoding"])
def test_option_values_are_checked_at_construction_under_their_own_names(option: str) -> None:
    with pytest.raises(ValueError, match=f"^`{option}` must be one of '.*'; got 'swish'$"):
        SequentialRecommender(**{option: "swish"})
    with pytest.raises(ValueError, match="^`activation` must be one of 'softmax', 'silu'"):
        HSTULayer(16, 2, activation="swish")  # the layer names its own argument
