"""NE, HR@K, NDCG@K and rank_of_target against hand-computed values (the AUC the ranker logs: its own tests)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gem.metrics import NDCG, HitRate, NormalizedEntropy, rank_of_target


def test_normalized_entropy_by_hand() -> None:
    probs = [0.8, 0.3, 0.6, 0.1]
    labels = [1.0, 0.0, 1.0, 0.0]
    log_loss = -(math.log(0.8) + math.log(0.7) + math.log(0.6) + math.log(0.9)) / 4
    base = 0.5
    entropy = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    expected = log_loss / entropy

    from_probs = NormalizedEntropy(from_logits=False)
    from_probs.update(torch.tensor(probs), torch.tensor(labels))
    assert float(from_probs.compute()) == pytest.approx(expected, rel=1e-6)

    # logits, accumulated over two updates, give the same value
    logits = torch.logit(torch.tensor(probs, dtype=torch.float64))
    accumulated = NormalizedEntropy()
    accumulated.update(logits[:1], torch.tensor(labels[:1]))
    accumulated.update(logits[1:], torch.tensor(labels[1:]))
    assert float(accumulated.compute()) == pytest.approx(expected, rel=1e-6)


def test_normalized_entropy_of_base_rate_predictor_is_one_and_degenerate_labels_nan() -> None:
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ne = NormalizedEntropy(from_logits=False)
    ne.update(torch.full((4,), 0.25), labels)
    assert float(ne.compute()) == pytest.approx(1.0, rel=1e-6)

    constant = NormalizedEntropy()
    constant.update(torch.zeros(3), torch.ones(3))
    assert math.isnan(float(constant.compute()))
    with pytest.raises(ValueError, match="same shape"):
        constant.update(torch.zeros(3), torch.ones(2))


def test_rank_of_target_ties_and_exclusions() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.5], [0.3, 0.2, 0.1, 0.0], [1.0, 1.0, 1.0, float("-inf")]])
    target = torch.tensor([2, 0, 3])
    assert rank_of_target(scores, target).tolist() == [3, 1, 4]  # tie with item 3 counted above
    assert rank_of_target(scores, target, ties="optimistic").tolist() == [2, 1, 4]
    constant = torch.zeros(2, 5)
    assert rank_of_target(constant, torch.tensor([0, 4])).tolist() == [5, 5]
    with pytest.raises(ValueError, match="target"):
        rank_of_target(scores, torch.tensor([0, 1, 4]))
    assert rank_of_target(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_hit_rate_and_ndcg_by_hand() -> None:
    ranks = torch.tensor([1, 3, 12])
    hr, ndcg = HitRate(k=10), NDCG(k=10)
    hr.update(ranks[:2])
    hr.update(ranks[2:])
    ndcg.update(ranks)
    assert float(hr.compute()) == pytest.approx(2 / 3)
    assert float(ndcg.compute()) == pytest.approx((1.0 + 1.0 / math.log2(4)) / 3)
    ndcg_1 = NDCG(k=1)
    ndcg_1.update(ranks)
    assert float(ndcg_1.compute()) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="1-based"):
        hr.update(torch.tensor([0]))
    with pytest.raises(ValueError, match="k"):
        HitRate(k=0)
