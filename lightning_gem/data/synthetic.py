"""Synthetic sources: a GEM-like ranking log with a hidden click model, and structured next-item sequences.

Both are deterministic functions of their arguments (one ``numpy`` generator seeded by ``seed``), need no
files, and build in 1-3 s on one CPU core at their default sizes (the ranking one; retrieval in < 0.1 s).

**Ranking** (:class:`SyntheticRankingSource`). Items belong to ``num_topics`` latent topics; item ``i``
has a unit vector ``v_i`` near its topic's centre, a bias ``b_i`` and a conversion propensity. Each user
has a hidden taste (a primary and a secondary topic) that generates a heavy-tailed history
(``L = clip(max_history_length * u**history_length_power, min_history_length, max_history_length)``, ``u``
uniform) of item ids with action types (0 view, 1 click, 2 convert; clicks are likelier on items close to
the taste) and time deltas (seconds before the request, growing with distance), pooled features (a user
segment and 1-4 interest tags, both tied to topics) and dense features (a noisy user propensity, the
scaled log history length, the history's click and conversion rates). The hidden click model reads only
what the batch carries:

- interest ``h = sum_j w_j v_{item_j} / sum_j w_j`` over the history with
  ``w_j = action_weight[action_j] * (0.15 + exp(-k_j / 24))`` (``k_j`` events from the most recent one),
  plus ``0.4 x`` the mean topic centre of the user's pooled features;
- ``P(click) = sigmoid(5 h . v_c + b_c + 0.5 z + c0)`` for candidate ``c`` (``z`` the user propensity,
  ``c0`` solved so the mean click rate is ``click_rate``);
- ``P(convert | click) = sigmoid(conv_c + 0.8 log1p(history conversions) + 2 h . v_c - 3.5)``; the
  ``cvr`` label is click AND convert, so ``cvr <= ctr``.

Half the candidates come from the user's taste topics and half from the item popularity, so positives
are common (about ``click_rate``). :meth:`SyntheticRankingSource.oracle_probabilities` returns the true
probabilities, whose AUC is the Bayes-optimal one.

**Retrieval** (:class:`SyntheticRetrievalSource`). Users walk over topics (stay with probability
``topic_stickiness``, else move to a neighbouring topic); with probability ``successor_prob`` the next
item is the fixed successor of the current one, else a popular item of the current topic.

Example:
    >>> from lightning_gem.data.synthetic import SyntheticRankingSource
    >>> source = SyntheticRankingSource(num_train_users=200, num_val_users=50, num_test_users=50)
    >>> batch = source.collate([source.dataset("train")[i] for i in range(4)])
    >>> batch.batch_size, batch.labels.shape[1]
    (4, 2)
"""

from __future__ import annotations

import numpy as np

from lightning_gem.data.schema import RankingSchema, RetrievalSchema, SparseFeature
from lightning_gem.data.sources import (
    RankingArrays,
    RankingSource,
    RetrievalArrays,
    RetrievalSource,
    _check_int,
    check_split,
    leave_one_out_windows,
)

__all__ = ["SyntheticRankingSource", "SyntheticRetrievalSource"]

_ACTION_WEIGHT = np.array([1.0, 3.0, 6.0])  # view, click, convert
_RECENCY_FLOOR, _RECENCY_SCALE = 0.15, 24.0
_POOLED_WEIGHT, _CLICK_SCALE, _USER_BIAS_SCALE, _ITEM_NOISE = 0.4, 5.0, 0.5, 0.3


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _check_number(value: float, name: str, low: float = 0.0, high: float = 1.0) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"`{name}` must be a number in [{low}, {high}], got {value!r}")
    return float(value)


class _Catalogue:
    """Items grouped by topic with Zipf popularity; samples items of given topics, or popular items."""

    def __init__(self, rng: np.random.Generator, num_items: int, num_topics: int, exponent: float = 0.8) -> None:
        self.item_topic = rng.permutation(np.arange(num_items) % num_topics)
        weight = (1.0 + rng.permutation(num_items)) ** -exponent
        self.order = np.argsort(self.item_topic, kind="stable")
        topic_sorted = self.item_topic[self.order]
        cum = np.cumsum(weight[self.order])
        counts = np.bincount(self.item_topic, minlength=num_topics)
        self.topic_last = np.cumsum(counts) - 1
        before = np.concatenate([[0.0], cum[self.topic_last[:-1]]])
        total = cum[self.topic_last] - before
        self.topic_cdf = topic_sorted + (cum - before[topic_sorted]) / total[topic_sorted]
        self.global_cdf = np.cumsum(weight) / weight.sum()

    def in_topics(self, rng: np.random.Generator, topics: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.topic_cdf, topics + rng.random(topics.shape), side="right")
        return self.order[np.minimum(idx, self.topic_last[topics])]

    def popular(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.global_cdf, rng.random(size), side="right"), len(self.global_cdf) - 1)


def _tied_ids(rng: np.random.Generator, topics: np.ndarray, num_ids: int, num_topics: int) -> np.ndarray:
    """Ids in ``[0, num_ids)`` whose topic (``id % num_topics``) is ``topics``."""
    per_topic = (num_ids - 1 - topics) // num_topics + 1
    return topics + num_topics * np.floor(rng.random(topics.shape) * per_topic).astype(np.int64)


def _segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-segment sums of ``values [T, ...]`` for non-empty segments given by ``offsets [U + 1]``."""
    return np.add.reduceat(values, offsets[:-1], axis=0)


class SyntheticRankingSource(RankingSource):
    """GEM-like multi-task (CTR, CVR) ranking data with a hidden ground-truth model (see module docs).

    Splits are disjoint users: the first ``num_train_users`` train, then validation, then test.

    Args:
        num_items: catalogue size (ids of ``item_id`` and ``candidate_item_id``).
        num_train_users, num_val_users, num_test_users: samples per split (one user each).
        min_history_length, max_history_length: history length bounds (>= 1).
        history_length_power: ``p`` in ``L = max_history_length * u**p``; larger is more heavy-tailed.
        mean_candidates: mean candidates per user (``1 + Poisson(mean - 1)``), at most ``max_candidates``.
        max_candidates: most candidates of one user.
        num_topics: latent topics (<= ``num_items``, ``num_segments``, ``num_interest_tags``).
        latent_dim: dimension of the hidden item vectors.
        num_segments: ids of the pooled ``user_segment`` feature.
        num_interest_tags: ids of the pooled ``user_interest_tags`` feature.
        click_rate: mean click probability the hidden model is calibrated to.
        seed: the generator's seed; equal arguments give equal data.

    Example:
        >>> source = SyntheticRankingSource(num_train_users=100, num_val_users=20, num_test_users=20)
        >>> [f.name for f in source.schema.sequence_features]
        ['item_id', 'action_type', 'candidate_item_id']
        >>> source.oracle_probabilities("val").shape[1]
        2
    """

    def __init__(
        self,
        *,
        num_items: int = 2000,
        num_train_users: int = 20000,
        num_val_users: int = 2000,
        num_test_users: int = 2000,
        min_history_length: int = 4,
        max_history_length: int = 256,
        history_length_power: float = 3.0,
        mean_candidates: float = 10.0,
        max_candidates: int = 32,
        num_topics: int = 20,
        latent_dim: int = 16,
        num_segments: int = 64,
        num_interest_tags: int = 256,
        click_rate: float = 0.25,
        seed: int = 0,
    ) -> None:
        self.num_topics = _check_int(num_topics, "num_topics", 1)
        self.num_items = _check_int(num_items, "num_items", max(2, num_topics))
        self.num_users = {
            "train": _check_int(num_train_users, "num_train_users", 1),
            "val": _check_int(num_val_users, "num_val_users", 1),
            "test": _check_int(num_test_users, "num_test_users", 1),
        }
        self.max_history_length = _check_int(max_history_length, "max_history_length", 1)
        self.min_history_length = _check_int(min_history_length, "min_history_length", 1, max_history_length)
        self.history_length_power = _check_number(history_length_power, "history_length_power", 0.0, 100.0)
        self.max_candidates = _check_int(max_candidates, "max_candidates", 1)
        self.mean_candidates = _check_number(mean_candidates, "mean_candidates", 1.0, float(max_candidates))
        self.latent_dim = _check_int(latent_dim, "latent_dim", 2)
        self.num_segments = _check_int(num_segments, "num_segments", num_topics)
        self.num_interest_tags = _check_int(num_interest_tags, "num_interest_tags", num_topics)
        self.click_rate = _check_number(click_rate, "click_rate", 0.01, 0.99)
        self.seed = _check_int(seed, "seed", 0)
        self._schema = RankingSchema(
            history_features=(
                SparseFeature(name="item_id", num_embeddings=num_items, table="item"),
                SparseFeature(name="action_type", num_embeddings=3),
            ),
            candidate_features=(SparseFeature(name="candidate_item_id", num_embeddings=num_items, table="item"),),
            pooled_features=(
                SparseFeature(name="user_segment", num_embeddings=num_segments),
                SparseFeature(name="user_interest_tags", num_embeddings=num_interest_tags),
            ),
            num_dense=4,
            has_time=True,
            tasks=("ctr", "cvr"),
            max_history_length=max_history_length,
        )
        self._oracle: dict[str, np.ndarray] = {}

    @property
    def schema(self) -> RankingSchema:
        return self._schema

    def oracle_probabilities(self, split: str) -> np.ndarray:
        """``[C, 2]`` float64 true ``P(click)`` and ``P(click and convert)`` of every candidate of ``split``.

        Rows follow the candidates in dataset order (``labels`` rows of ``source.arrays(split)``); the AUC
        of column 0 against the ``ctr`` labels is the Bayes-optimal CTR AUC.
        """
        self.arrays(split)
        return self._oracle[split]

    def _build(self) -> dict[str, RankingArrays]:
        rng = np.random.default_rng(self.seed)
        k, d = self.num_topics, self.latent_dim
        centers = _normalize(rng.standard_normal((k, d)))
        catalogue = _Catalogue(rng, self.num_items, k)
        # Latent vectors in float32: the gathers over ~1M history events dominate the build time.
        item_vec = _normalize(
            centers[catalogue.item_topic] + _ITEM_NOISE * _normalize(rng.standard_normal((self.num_items, d)))
        ).astype(np.float32)
        item_bias = rng.normal(0.0, 0.5, self.num_items)
        item_conv = rng.normal(0.0, 1.0, self.num_items)

        num_users = sum(self.num_users.values())
        primary, secondary = rng.integers(k, size=num_users), rng.integers(k, size=num_users)
        taste = _normalize(
            0.7 * centers[primary] + 0.4 * centers[secondary] + 0.2 * rng.standard_normal((num_users, d))
        ).astype(np.float32)
        propensity = rng.standard_normal(num_users)

        # Histories: heavy-tailed lengths, items mostly from the taste topics, actions from the affinity.
        raw = self.max_history_length * rng.random(num_users) ** self.history_length_power
        lengths = np.clip(raw.astype(np.int64), self.min_history_length, self.max_history_length)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        owner = np.repeat(np.arange(num_users), lengths)
        from_end = offsets[owner + 1] - 1 - np.arange(offsets[-1])
        pick = rng.random(owner.shape)
        topics = np.where(
            pick < 0.5, primary[owner], np.where(pick < 0.8, secondary[owner], rng.integers(k, size=owner.shape))
        )
        items = catalogue.in_topics(rng, topics)
        affinity = np.einsum("td,td->t", item_vec[items], taste[owner])
        clicked = rng.random(owner.shape) < _sigmoid(4.0 * affinity - 2.0)
        converted = clicked & (rng.random(owner.shape) < _sigmoid(item_conv[items] - 1.0))
        actions = clicked.astype(np.int64) + converted
        gaps = rng.exponential(3600.0, owner.shape) * np.exp(rng.normal(0.0, 1.0, num_users))[owner]
        cum = np.cumsum(gaps)
        deltas = cum[offsets[owner + 1] - 1] - cum + gaps  # seconds before the request, >= the newest gap

        # The hidden interest: history (weighted by action and recency) plus the pooled features' topics.
        weight = (_ACTION_WEIGHT[actions] * (_RECENCY_FLOOR + np.exp(-from_end / _RECENCY_SCALE))).astype(np.float32)
        interest = _segment_sum(weight[:, None] * item_vec[items], offsets) / _segment_sum(weight, offsets)[:, None]
        on_topic = rng.random(num_users) < 0.7
        segment = _tied_ids(rng, np.where(on_topic, primary, rng.integers(k, size=num_users)), self.num_segments, k)
        num_tags = rng.integers(1, 5, size=num_users)
        tag_owner = np.repeat(np.arange(num_users), num_tags)
        pick = rng.random(tag_owner.shape)
        tag_topic = np.where(
            pick < 0.4,
            primary[tag_owner],
            np.where(pick < 0.6, secondary[tag_owner], rng.integers(k, size=tag_owner.shape)),
        )
        tags = _tied_ids(rng, tag_topic, self.num_interest_tags, k)
        tag_offsets = np.concatenate([[0], np.cumsum(num_tags)])
        pooled_vec = (centers[segment % k] + _segment_sum(centers[tag_topic], tag_offsets)) / (1 + num_tags)[:, None]
        interest = interest + _POOLED_WEIGHT * pooled_vec

        # Candidates: half from the taste topics, half popular items; labels from the hidden model.
        num_cands = np.clip(1 + rng.poisson(self.mean_candidates - 1.0, num_users), 1, self.max_candidates)
        cand_offsets = np.concatenate([[0], np.cumsum(num_cands)])
        cand_owner = np.repeat(np.arange(num_users), num_cands)
        taste_topic = np.where(rng.random(cand_owner.shape) < 0.65, primary[cand_owner], secondary[cand_owner])
        matched = catalogue.in_topics(rng, taste_topic)
        cand = np.where(rng.random(cand_owner.shape) < 0.5, matched, catalogue.popular(rng, len(cand_owner)))
        score = np.einsum("cd,cd->c", interest[cand_owner], item_vec[cand])
        logit = _CLICK_SCALE * score + item_bias[cand] + _USER_BIAS_SCALE * propensity[cand_owner]
        p_click = _sigmoid(logit + _solve_intercept(logit, self.click_rate))
        conversions = np.add.reduceat(converted.astype(np.float64), offsets[:-1])
        p_convert = _sigmoid(item_conv[cand] + 0.8 * np.log1p(conversions)[cand_owner] + 2.0 * score - 3.5)
        click = rng.random(cand.shape) < p_click
        convert = click & (rng.random(cand.shape) < p_convert)
        labels = np.stack([click, convert], axis=1).astype(np.float32)
        oracle = np.stack([p_click, p_click * p_convert], axis=1)

        dense = np.stack(
            [
                propensity + rng.normal(0.0, 0.7, num_users),
                np.log1p(lengths) / np.log1p(self.max_history_length),
                np.add.reduceat((actions > 0).astype(np.float64), offsets[:-1]) / lengths,
                conversions / lengths,
            ],
            axis=1,
        ).astype(np.float32)

        history = np.stack([items, actions], axis=1).astype(np.int64)
        bounds = np.cumsum([0, self.num_users["train"], self.num_users["val"], self.num_users["test"]])
        built = {}
        for split, lo, hi in zip(("train", "val", "test"), bounds[:-1], bounds[1:], strict=True):
            h0, h1, c0, c1 = offsets[lo], offsets[hi], cand_offsets[lo], cand_offsets[hi]
            built[split] = RankingArrays(
                history=history[h0:h1],
                history_starts=offsets[lo:hi] - h0,
                history_ends=offsets[lo + 1 : hi + 1] - h0,
                candidate_offsets=cand_offsets[lo : hi + 1] - c0,
                candidates=cand[c0:c1, None].astype(np.int64),
                labels=labels[c0:c1],
                pooled_offsets=(np.arange(hi - lo + 1, dtype=np.int64), tag_offsets[lo : hi + 1] - tag_offsets[lo]),
                pooled_values=(
                    segment[lo:hi].astype(np.int64),
                    tags[tag_offsets[lo] : tag_offsets[hi]].astype(np.int64),
                ),
                dense=dense[lo:hi],
                event_times=-deltas[h0:h1],
                request_times=np.zeros(hi - lo),
            )
            self._oracle[split] = oracle[c0:c1]
        return built


def _solve_intercept(logit: np.ndarray, rate: float) -> float:
    """The ``c`` with ``mean(sigmoid(logit + c)) == rate`` (bisection; the mean is increasing in ``c``)."""
    low, high = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if _sigmoid(logit + mid).mean() < rate else (low, mid)
    return 0.5 * (low + high)


class SyntheticRetrievalSource(RetrievalSource):
    """Next-item sequences with topic and successor structure, split leave-one-out (see module docs).

    Args:
        num_items: catalogue size.
        num_users: users (each appears in train, val and test, leave-one-out).
        num_topics: topics of the walk (<= ``num_items``).
        min_sequence_length, max_sequence_length: bounds of the full sequence length (>= 4), drawn
            heavy-tailed like the ranking histories.
        max_history_length: longest input window (the most recent events are kept).
        topic_stickiness: probability of staying in the current topic.
        successor_prob: probability that the next item is the current item's fixed successor.
        seed: the generator's seed.

    Example:
        >>> source = SyntheticRetrievalSource(num_users=50)
        >>> batch = source.collate([source.dataset("test")[i] for i in range(3)])
        >>> batch.batch_size
        3
    """

    def __init__(
        self,
        *,
        num_items: int = 1000,
        num_users: int = 2000,
        num_topics: int = 20,
        min_sequence_length: int = 8,
        max_sequence_length: int = 120,
        max_history_length: int = 100,
        topic_stickiness: float = 0.8,
        successor_prob: float = 0.4,
        seed: int = 0,
    ) -> None:
        self.num_topics = _check_int(num_topics, "num_topics", 1)
        self.num_items = _check_int(num_items, "num_items", max(2, num_topics))
        self.num_users = _check_int(num_users, "num_users", 1)
        self.max_sequence_length = _check_int(max_sequence_length, "max_sequence_length", 4)
        self.min_sequence_length = _check_int(min_sequence_length, "min_sequence_length", 4, max_sequence_length)
        self.topic_stickiness = _check_number(topic_stickiness, "topic_stickiness")
        self.successor_prob = _check_number(successor_prob, "successor_prob")
        self.seed = _check_int(seed, "seed", 0)
        self._schema = RetrievalSchema(
            num_items=num_items, max_history_length=_check_int(max_history_length, "max_history_length", 1)
        )

    @property
    def schema(self) -> RetrievalSchema:
        return self._schema

    def _build(self) -> dict[str, RetrievalArrays]:
        rng = np.random.default_rng(self.seed)
        k, n = self.num_topics, self.num_users
        catalogue = _Catalogue(rng, self.num_items, k)
        successor = np.empty(self.num_items, dtype=np.int64)  # a random cycle inside each topic
        for topic in range(k):
            members = rng.permutation(np.flatnonzero(catalogue.item_topic == topic))
            successor[members] = np.roll(members, -1)
        raw = self.max_sequence_length * rng.random(n) ** 2.0
        lengths = np.clip(raw.astype(np.int64), self.min_sequence_length, self.max_sequence_length)
        walk = np.zeros((n, self.max_sequence_length), dtype=np.int64)
        topic = rng.integers(k, size=n)
        walk[:, 0] = catalogue.in_topics(rng, topic)
        for step in range(1, self.max_sequence_length):
            move = rng.random(n) >= self.topic_stickiness
            topic = np.where(move, (topic + rng.choice([-1, 1, 2], size=n)) % k, topic)
            fresh = catalogue.in_topics(rng, topic)
            follow = (rng.random(n) < self.successor_prob) & ~move
            walk[:, step] = np.where(follow, successor[walk[:, step - 1]], fresh)
        mask = np.arange(self.max_sequence_length)[None, :] < lengths[:, None]
        items = walk[mask][:, None]  # row-major: each user's events back to back, oldest first
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        gaps = rng.exponential(600.0, len(items))
        cum = np.cumsum(gaps)
        timestamps = (cum - cum[np.repeat(offsets[:-1], lengths)]).astype(np.float32)  # seconds since first event
        built = {}
        for split in ("train", "val", "test"):
            starts, ends = leave_one_out_windows(offsets, check_split(split), self.schema.max_history_length)
            built[split] = RetrievalArrays(items=items, starts=starts, ends=ends, timestamps=timestamps)
        return built
