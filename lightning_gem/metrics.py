"""Evaluation metrics of recommendation models: NE (ranking), HR@K / NDCG@K (retrieval), AUC.

All metrics are torchmetrics ``Metric`` s, so they accumulate over batches, synchronise across ranks
and can be logged with ``LightningModule.log`` directly. AUC is torchmetrics' ``BinaryAUROC``, re-exported
here so every metric the kit logs has one home.

Example:
    >>> import torch
    >>> from lightning_gem.metrics import HitRate, NDCG, NormalizedEntropy, rank_of_target
    >>> ne = NormalizedEntropy()
    >>> ne.update(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 1.0]))
    >>> bool(ne.compute() < 1.0)  # better than predicting the base rate
    True
    >>> ranks = rank_of_target(torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.1]]), torch.tensor([2, 0]))
    >>> ranks.tolist()
    [2, 1]
    >>> hr = HitRate(k=1)
    >>> hr.update(ranks)
    >>> float(hr.compute())
    0.5
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

__all__ = ["NDCG", "BinaryAUROC", "HitRate", "NormalizedEntropy", "rank_of_target"]


def rank_of_target(
    scores: Tensor, target: Tensor, *, ties: Literal["pessimistic", "optimistic"] = "pessimistic"
) -> Tensor:
    """1-based rank of each row's target item among that row's scores.

    ``rank = 1 + #{j != target : scores[j] > scores[target]}`` with ``ties="optimistic"``, and with
    ``ties="pessimistic"`` (the default) items scoring *equal* to the target also rank above it
    (``>=``). Pessimistic counting keeps a constant scorer (e.g. an untrained model) from reaching
    HR = 1; items excluded with ``-inf`` never outrank a finite target score. A NaN target score ranks
    last (``N``).

    Args:
        scores: ``[B, N]`` float scores over ``N`` items.
        target: ``[B]`` integer index of the target item of each row, in ``[0, N)``.
        ties: how items tied with the target count.

    Returns:
        ``[B]`` int64 ranks in ``[1, N]``.
    """
    if scores.dim() != 2:
        raise ValueError(f"`scores` must be [B, N], got shape {tuple(scores.shape)}")
    if target.dim() != 1 or target.shape[0] != scores.shape[0]:
        raise ValueError(f"`target` must be [B] with B = {scores.shape[0]}, got shape {tuple(target.shape)}")
    if ties not in ("pessimistic", "optimistic"):
        raise ValueError(f"`ties` must be 'pessimistic' or 'optimistic', got {ties!r}")
    if scores.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=scores.device)
    target = target.to(torch.int64)
    if bool(((target < 0) | (target >= scores.shape[1])).any()):
        raise ValueError(f"`target` must lie in [0, {scores.shape[1]}), got {target.tolist()}")
    target_score = scores.gather(1, target[:, None])
    above = scores >= target_score if ties == "pessimistic" else scores > target_score
    count = above.sum(dim=1) - (1 if ties == "pessimistic" else 0)  # the target ties with itself
    rank = count.to(torch.int64) + 1
    return torch.where(torch.isnan(target_score[:, 0]), torch.full_like(rank, scores.shape[1]), rank)


def _check_ranks(ranks: Tensor) -> Tensor:
    if ranks.dim() != 1:
        raise ValueError(f"`ranks` must be 1-D [B], got shape {tuple(ranks.shape)}")
    if ranks.numel() and bool((ranks < 1).any()):
        raise ValueError(f"`ranks` must be 1-based (>= 1), got min {int(ranks.min())}")
    return ranks


class _RankMetric(Metric):
    """Mean over queries of a per-query gain of the target's 1-based rank, cut off at ``k``."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, k: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"`k` must be >= 1, got {k}")
        self.k = k
        self.add_state("gain", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def _gain(self, ranks: Tensor) -> Tensor:
        """``[B]`` float64 gain of each query from its float64 rank (0 beyond ``k``)."""
        raise NotImplementedError

    def update(self, ranks: Tensor) -> None:
        ranks = _check_ranks(ranks).to(torch.float64)
        self.gain += self._gain(ranks).sum()
        self.total += ranks.numel()

    def compute(self) -> Tensor:
        return (self.gain / self.total.clamp_min(1)).to(torch.float32)


class HitRate(_RankMetric):
    """HR@K: the fraction of queries whose target ranks in the top ``k``.

    ``update(ranks)`` takes ``[B]`` 1-based ranks (see :func:`rank_of_target`).

    Args:
        k: the cut-off.
    """

    def _gain(self, ranks: Tensor) -> Tensor:
        return (ranks <= self.k).to(torch.float64)


class NDCG(_RankMetric):
    """NDCG@K with one relevant item per query: ``1 / log2(rank + 1)`` if ``rank <= k`` else 0, averaged.

    ``update(ranks)`` takes ``[B]`` 1-based ranks (see :func:`rank_of_target`).

    Args:
        k: the cut-off.
    """

    def _gain(self, ranks: Tensor) -> Tensor:
        return torch.where(ranks <= self.k, 1.0 / torch.log2(ranks + 1.0), torch.zeros_like(ranks))


class NormalizedEntropy(Metric):
    """Normalized entropy (He et al., 2014): mean log loss divided by the entropy of the base rate.

    ``NE = mean(BCE(pred, label)) / H(p)`` with ``p`` the mean label of the evaluated data and
    ``H(p) = -p log p - (1 - p) log(1 - p)``. NE < 1 means the model beats always predicting the base
    rate. If every label is equal (``H(p) = 0``) NE is undefined and ``compute`` returns NaN.

    ``update(preds, target)``: ``preds`` are logits (``from_logits=True``, the default) or
    probabilities, ``target`` are labels in [0, 1], both of the same shape (flattened).

    Args:
        from_logits: whether ``preds`` are logits rather than probabilities.
        eps: probabilities are clamped to ``[eps, 1 - eps]`` when ``from_logits=False``.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, from_logits: bool = True, eps: float = 1e-7, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.from_logits = from_logits
        self.eps = eps
        self.add_state("log_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("positives", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        if preds.shape != target.shape:
            raise ValueError(
                f"`preds` and `target` must have the same shape, got {tuple(preds.shape)} and {tuple(target.shape)}"
            )
        preds = preds.detach().reshape(-1).to(torch.float64)
        target = target.detach().reshape(-1).to(torch.float64)
        if self.from_logits:
            loss = F.binary_cross_entropy_with_logits(preds, target, reduction="sum")
        else:
            loss = F.binary_cross_entropy(preds.clamp(self.eps, 1.0 - self.eps), target, reduction="sum")
        self.log_loss += loss
        self.positives += target.sum()
        self.total += target.numel()

    def compute(self) -> Tensor:
        n = self.total.to(torch.float64)
        if int(self.total) == 0:
            return torch.tensor(math.nan)
        p = self.positives / n
        entropy = -(torch.special.xlogy(p, p) + torch.special.xlogy(1.0 - p, 1.0 - p))
        if float(entropy) <= 0.0:
            return torch.tensor(math.nan)
        return (self.log_loss / n / entropy).to(torch.float32)
