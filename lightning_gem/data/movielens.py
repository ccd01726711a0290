"""MovieLens sources: ML-1M next-item retrieval (leave-one-out) and ML-100K CTR ranking.

The data are not shipped: download them from GroupLens (research use only; cite F. M. Harper and
J. A. Konstan, "The MovieLens Datasets: History and Context", ACM TiiS 5(4), 2015) and pass the folder.

- ML-1M (https://grouplens.org/datasets/movielens/1m/): ``sequences.txt`` (one line per user,
  ``UserID MovieID MovieID ...``, oldest first) or, when it is absent, the original ``ratings.dat``
  (``UserID::MovieID::Rating::Timestamp``, ordered per user by timestamp, ties kept in file order), plus
  ``movies.dat`` (``MovieID::Title::Genres``, ISO-8859-1).
- ML-100K (https://grouplens.org/datasets/movielens/100k/): ``u.data`` (tab-separated
  ``user item rating unix_ts``), ``u.user`` (``user|age|gender|occupation|zip``) and ``u.item``
  (``item|title|date|video|url|19 genre flags``, ISO-8859-1).

Example:
    >>> source = MovieLens1MSource(path="data/ml-1m")  # doctest: +SKIP
    >>> source.schema.num_items  # every movie of movies.dat  # doctest: +SKIP
    3883
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_gem.data.schema import RankingSchema, RetrievalSchema, SparseFeature
from lightning_gem.data.sources import (
    RankingArrays,
    RankingSource,
    RetrievalArrays,
    RetrievalSource,
    _check_int,
    _check_train_windows,
    check_split,
    leave_one_out_windows,
)

__all__ = ["MovieLens100KRankingSource", "MovieLens1MSource"]

ML1M_URL = "https://grouplens.org/datasets/movielens/1m/"
ML100K_URL = "https://grouplens.org/datasets/movielens/100k/"
_AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])  # ML-1M's age groups: <18, 18-24, ..., 56+
_NUM_GENRES = 19
# The published files (their READMEs): rows, and the collection period as unix times with a day of margin.
ML100K_ROWS = {"u.data": 100_000, "u.user": 943, "u.item": 1_682}
ML100K_PERIOD = (874_540_800, 893_376_000)  # 1997-09-18 .. 1998-04-24 UTC ("September 19th, 1997 - April 22nd, 1998")
ML1M_ROWS = {"ratings": 1_000_209, "users": 6_040, "movies.dat": 3_883}
ML1M_PERIOD = (946_684_800, 1_072_915_200)  # 2000-01-01 .. 2004-01-01 UTC (users who joined in 2000; last rating 2003)
_RATINGS = (1, 5)


def _data_file(folder: Path, name: str, fmt: str, url: str) -> Path:
    file = folder / name
    if not file.is_file():
        raise FileNotFoundError(
            f"MovieLens file {file} not found: expected {name} ({fmt}) in the folder given as `path`. "
            f"Download the public data set from {url} and pass the unpacked folder."
        )
    return file


def _malformed(file: Path, line_number: int, line: str, fmt: str, url: str) -> ValueError:
    return ValueError(
        f"{file}, line {line_number}: expected {fmt}, got {line[:80]!r}. The file looks damaged: "
        f"download the public data set again from {url}."
    )


def _line(file: Path, row: int) -> tuple[int, str]:
    """``(line number, text)`` of the ``row``-th non-empty line of ``file`` (rows as the readers count them)."""
    lines = ((n, line) for n, line in enumerate(file.read_text(encoding="latin-1").splitlines(), start=1))
    non_empty = (item for item in lines if item[1].strip())
    return next(item for index, item in enumerate(non_empty) if index == row)


def _check_range(values: np.ndarray, low: int, high: int, what: str, file: Path, url: str) -> None:
    """``ValueError`` naming the file, line and value of the first of ``values`` (one per row) outside low..high."""
    bad = np.flatnonzero((values < low) | (values > high))
    if len(bad):
        number, line = _line(file, int(bad[0]))
        raise ValueError(
            f"{file}, line {number}: {what} must lie in {low}..{high}, got {int(values[bad[0]])} in {line[:80]!r} "
            f"({len(bad)} such lines). The file looks damaged: download the public data set again from {url}."
        )


def _check_rows(count: int, expected: int, what: str, file: Path, url: str) -> None:
    if count != expected:
        raise ValueError(
            f"{file} holds {count:,} {what}; the published file holds {expected:,}: it is cut off or not the "
            f"original (`published=False` reads another copy). Download the public data set again from {url}."
        )


def _read_ints(file: Path, sep: str | None, num_fields: int | None, fmt: str, url: str) -> list[np.ndarray]:
    """One int64 array per non-empty line, split on ``sep`` (``num_fields`` each if given)."""
    rows = []
    for number, line in enumerate(file.read_text(encoding="latin-1").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split(sep)
        try:
            if num_fields is not None and len(fields) != num_fields:
                raise ValueError
            rows.append(np.array(fields, dtype=np.int64))
        except ValueError:
            raise _malformed(file, number, line, fmt, url) from None
    if not rows:
        raise ValueError(f"{file} is empty: expected {fmt}. Download the public data set from {url}.")
    return rows


def _read_table(file: Path, sep: str, num_fields: int, fmt: str, url: str) -> np.ndarray:
    """``[rows, num_fields]`` int64 table; a fast whole-file parse, then a line-by-line one to name a bad line."""
    text = file.read_text(encoding="latin-1")
    lines = [line for line in text.splitlines() if line.strip()]
    tokens = text.replace(sep, " ").split()
    num_lines = len(lines)
    if tokens and len(tokens) == num_lines * num_fields and all(line.count(sep) == num_fields - 1 for line in lines):
        try:
            return np.array(tokens, dtype=np.int64).reshape(num_lines, num_fields)
        except ValueError:
            pass
    return np.stack(_read_ints(file, sep, num_fields, fmt, url))


def _read_fields(
    file: Path, sep: str, num_fields: int, fmt: str, url: str, digits: tuple[int, ...] = (0,), at_least: bool = False
) -> list[list[str]]:
    """The ``sep``-separated fields of each non-empty line; fields ``digits`` must be non-negative integers."""
    rows = []
    for number, line in enumerate(file.read_text(encoding="latin-1").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split(sep)
        wrong_count = len(fields) < num_fields if at_least else len(fields) != num_fields
        if wrong_count or not all(fields[i].strip().isdigit() for i in digits):
            raise _malformed(file, number, line, fmt, url)
        rows.append(fields)
    if not rows:
        raise ValueError(f"{file} is empty: expected {fmt}. Download the public data set from {url}.")
    return rows


def _dense_ids(ids: np.ndarray, catalogue: np.ndarray, what: str, file: Path, url: str) -> np.ndarray:
    """Map original ids to their rank in the sorted ``catalogue``; ``ValueError`` for unknown ids."""
    index = np.clip(np.searchsorted(catalogue, ids), 0, len(catalogue) - 1)
    unknown = catalogue[index] != ids
    if unknown.any():
        raise ValueError(
            f"{file} holds {what} {int(ids[unknown][0])} that the catalogue does not list ({int(unknown.sum())} "
            f"such ids): the files do not belong together. Download the public data set again from {url}."
        )
    return index.astype(np.int64)


class MovieLens1MSource(RetrievalSource):
    """MovieLens-1M next-item retrieval, leave-one-out, ranked against the full catalogue.

    The catalogue is every movie listed in ``movies.dat`` (3,883; 3,706 of them are rated): dense id
    ``j`` is the ``j``-th smallest MovieID (:attr:`movie_ids` maps back). Splits per user ``s``
    (see :func:`~lightning_gem.data.sources.leave_one_out_windows`): train inputs ``s[:-3]`` with targets
    ``s[1:-2]`` (the last two items are never trained on); val inputs ``s[:-2]``, last target ``s[-2]``;
    test inputs ``s[:-1]``, last target ``s[-1]``; inputs keep the most recent ``max_history_length``.
    ``train_on_validation_item=True`` follows the HSTU reference recipe instead: train inputs ``s[:-2]``, targets
    ``s[1:-1]`` (only the test item is never trained on). Validation then scores a trained-on item: keep the
    last checkpoint rather than select one on validation metrics. ``train_windows="all"`` also trains on the
    windows before each user's most recent one (a quarter of the users have more than 200 training targets:
    with "last", about a third of all ratings are never trained on).

    Removing seen items at evaluation: the items a user has seen before the held-out one are the
    sample's own inputs, so the batch's ``history`` KJT is the set to mask (within the
    ``max_history_length`` window, as the reference implementations do). Timestamps: read from ``ratings.dat``
    as seconds since each user's first rating (float32: exact over the first 194 days, to a few seconds over
    ML-1M's three years), for ``use_time`` and ``relative_time_bias``; ``sequences.txt`` has none (``None``).

    Args:
        path: folder with ``sequences.txt`` (or ``ratings.dat``) and ``movies.dat``.
        max_history_length: longest input window (most recent events kept).
        train_on_validation_item: train on each user's validation item too (the reference recipe; see above).
        train_windows: ``"last"`` (each user's most recent ``max_history_length`` inputs, the reference recipe)
            or ``"all"`` (see :func:`~lightning_gem.data.sources.leave_one_out_windows`).
        published: the files are GroupLens's: 3,883 movies, 6,040 users, 1,000,209 ratings (the lines of
            ``sequences.txt``, its ids after the first, or the lines of ``ratings.dat``), rated from 2000 on; a
            cut-off file is an error. False reads any other copy or subset (every line is still checked).

    Raises:
        FileNotFoundError: a file is missing (the message says where to download the data).
        ValueError: a line of a file is malformed or out of range (the message names the file and line), or,
            with ``published``, a file holds other counts than the published data set (when it is read).
    """

    def __init__(
        self,
        *,
        path: str = "data/ml-1m",
        max_history_length: int = 200,
        train_on_validation_item: bool = False,
        train_windows: str = "last",
        published: bool = True,
    ) -> None:
        if not isinstance(published, bool):
            raise TypeError(f"`published` must be a bool, got {published!r}")
        self.published = published
        if not isinstance(train_on_validation_item, bool):
            raise TypeError(f"`train_on_validation_item` must be a bool, got {train_on_validation_item!r}")
        self.train_on_validation_item = train_on_validation_item
        self.train_windows = _check_train_windows(train_windows)  # here too: fail before reading the data
        self.path = Path(path)
        movies = _data_file(self.path, "movies.dat", "MovieID::Title::Genres lines", ML1M_URL)
        if (self.path / "sequences.txt").is_file() or not (self.path / "ratings.dat").is_file():
            fmt = "lines 'UserID MovieID MovieID ...', oldest first; or the original ratings.dat"
            self._events_file = _data_file(self.path, "sequences.txt", fmt, ML1M_URL)
        else:
            self._events_file = self.path / "ratings.dat"
        fmt = "'MovieID::Title::Genres' (ISO-8859-1)"
        rows = _read_fields(movies, "::", 3, fmt, ML1M_URL, at_least=True)
        if published:
            _check_rows(len(rows), ML1M_ROWS["movies.dat"], "movies", movies, ML1M_URL)
        self.movie_ids = np.unique(np.array([int(r[0]) for r in rows], dtype=np.int64))
        """``[num_items]`` original MovieID of each dense item id."""
        self._schema = RetrievalSchema(
            num_items=len(self.movie_ids), max_history_length=_check_int(max_history_length, "max_history_length", 1)
        )
        self._user_ids: np.ndarray | None = None

    @property
    def schema(self) -> RetrievalSchema:
        return self._schema

    def sample_users(self, split: str) -> np.ndarray:
        """``[N]`` original UserID of each sample of ``split``."""
        arrays = self.arrays(split)
        assert self._user_ids is not None
        return self._user_ids[np.searchsorted(self._offsets, arrays.starts, side="right") - 1]

    def _read_events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``(user_ids [U], offsets [U + 1], movie_ids [T], timestamps [T] or None)`` with each user's events oldest
        first; timestamps (``ratings.dat`` only) in seconds since the user's first event."""
        file = self._events_file
        if file.name == "sequences.txt":
            fmt = "'UserID MovieID MovieID ...' (integers, at least one movie per user)"
            lines = _read_ints(file, None, None, fmt, ML1M_URL)
            for row in lines:
                if len(row) < 2:
                    raise ValueError(f"{file}: user {int(row[0])} has no movies; expected {fmt}")
            users = np.array([row[0] for row in lines], dtype=np.int64)
            lengths = np.array([len(row) - 1 for row in lines], dtype=np.int64)
            movies = np.concatenate([row[1:] for row in lines])
            timestamps = None
            _check_range(users, 1, np.iinfo(np.int64).max, "UserID", file, ML1M_URL)
            if self.published:
                _check_rows(len(users), ML1M_ROWS["users"], "users (lines)", file, ML1M_URL)
                _check_rows(len(movies), ML1M_ROWS["ratings"], "ratings (movie ids)", file, ML1M_URL)
        else:
            table = _read_table(file, "::", 4, "'UserID::MovieID::Rating::Timestamp'", ML1M_URL)
            _check_range(table[:, 0], 1, np.iinfo(np.int64).max, "UserID", file, ML1M_URL)
            _check_range(table[:, 2], *_RATINGS, "ratings", file, ML1M_URL)
            if self.published:
                _check_range(table[:, 3], *ML1M_PERIOD, "timestamps (the collection period)", file, ML1M_URL)
                _check_rows(len(table), ML1M_ROWS["ratings"], "ratings", file, ML1M_URL)
            table = table[np.lexsort((np.arange(len(table)), table[:, 3], table[:, 0]))]
            users, lengths = np.unique(table[:, 0], return_counts=True)
            movies = table[:, 1]
            first = np.repeat(table[np.cumsum(lengths) - lengths, 3], lengths)
            timestamps = (table[:, 3] - first).astype(np.float32)
        if len(np.unique(users)) != len(users):
            raise ValueError(f"{file} lists a UserID twice: expected one line per user")
        return users, np.concatenate([[0], np.cumsum(lengths)]), movies, timestamps

    def _build(self) -> dict[str, RetrievalArrays]:
        users, offsets, movies, timestamps = self._read_events()
        items = _dense_ids(movies, self.movie_ids, "MovieID", self._events_file, ML1M_URL)[:, None]
        self._user_ids, self._offsets = users, offsets
        built = {}
        for split in ("train", "val", "test"):
            starts, ends = leave_one_out_windows(
                offsets,
                check_split(split),
                self.schema.max_history_length,
                self.train_on_validation_item,
                self.train_windows,
            )
            built[split] = RetrievalArrays(items=items, starts=starts, ends=ends, timestamps=timestamps)
        return built


class MovieLens100KRankingSource(RankingSource):
    """MovieLens-100K as a CTR ranking task: a rating ``>= positive_rating`` is a click.

    Every rating event is a candidate. Each user's events, ordered by (timestamp, item), are split
    chronologically per user: the last ``test_fraction`` of them (at least one, for users with three
    events or more) are test candidates, the ``val_fraction`` before them validation, the rest train.
    Within a split, a user's consecutive events are grouped ``candidates_per_sample`` at a time into one
    sample whose history is every event of the user strictly earlier than the group's first event
    (events sharing that second are left out), the most recent ``max_history_length`` of them. So no
    history holds a candidate or a later event of its user, and validation/test histories hold the
    user's earlier (train) events, as in serving. The split is per user, not by a global time cutoff
    (most ML-100K users rate in one burst, so a global cutoff would leave most test users cold); other
    users' train events may therefore be later in calendar time than a test event.

    Features: history ``item_id`` (table ``item``) and ``rating`` (stars - 1), time deltas (seconds
    before the group's first event); candidates ``candidate_item_id`` (table ``item``) and
    ``candidate_genre`` (the first genre flag of ``u.item``, 0 = unknown); pooled ``user_id``,
    ``user_gender``, ``user_age`` (ML-1M's 7 age groups) and ``user_occupation``; dense
    ``[log1p(L) / log1p(max_history_length), (mean history rating - 3) / 2, history positive rate]``
    (0 for an empty history). Task: ``("ctr",)``.

    Args:
        path: folder with ``u.data``, ``u.user`` and ``u.item``.
        max_history_length: longest history (most recent events kept).
        candidates_per_sample: events grouped into one sample.
        val_fraction, test_fraction: per-user fractions of events for validation and test.
        positive_rating: lowest rating that counts as positive.
        published: the files are GroupLens's: 100,000 ratings of 943 users on 1,682 items, rated between
            September 19th, 1997 and April 22nd, 1998; a cut-off file is an error. False reads any other copy or
            subset (every line is still checked).

    Raises:
        FileNotFoundError: a file is missing (the message says where to download the data).
        ValueError: a line of a file is malformed or out of range (the message names the file and line), or,
            with ``published``, a file holds other counts than the published data set (u.data when it is read).
    """

    def __init__(
        self,
        *,
        path: str = "data/ml-100k",
        max_history_length: int = 256,
        candidates_per_sample: int = 8,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        positive_rating: int = 4,
        published: bool = True,
    ) -> None:
        if not isinstance(published, bool):
            raise TypeError(f"`published` must be a bool, got {published!r}")
        self.published = published
        self.path = Path(path)
        self.max_history_length = _check_int(max_history_length, "max_history_length", 1)
        self.candidates_per_sample = _check_int(candidates_per_sample, "candidates_per_sample", 1)
        self.positive_rating = _check_int(positive_rating, "positive_rating", 1, 5)
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not isinstance(value, (int, float)) or not 0.0 <= value < 0.5:
                raise ValueError(f"`{name}` must be a number in [0, 0.5), got {value!r}")
        self.val_fraction, self.test_fraction = float(val_fraction), float(test_fraction)
        self._files = {
            "u.data": _data_file(self.path, "u.data", "tab-separated 'user item rating unix_ts' lines", ML100K_URL),
            "u.user": _data_file(self.path, "u.user", "'user|age|gender|occupation|zip' lines", ML100K_URL),
            "u.item": _data_file(self.path, "u.item", "'item|title|date|video|url|19 genre flags' lines", ML100K_URL),
        }
        self._users = self._read_users()
        self._items = self._read_items()
        self._candidate_times: dict[str, np.ndarray] = {}
        num_users, num_items = len(self._users["id"]), len(self._items["id"])
        self._schema = RankingSchema(
            history_features=(
                SparseFeature(name="item_id", num_embeddings=num_items, table="item"),
                SparseFeature(name="rating", num_embeddings=5),
            ),
            candidate_features=(
                SparseFeature(name="candidate_item_id", num_embeddings=num_items, table="item"),
                SparseFeature(name="candidate_genre", num_embeddings=_NUM_GENRES),
            ),
            pooled_features=(
                SparseFeature(name="user_id", num_embeddings=num_users),
                SparseFeature(name="user_gender", num_embeddings=2),
                SparseFeature(name="user_age", num_embeddings=len(_AGE_EDGES) + 1),
                SparseFeature(name="user_occupation", num_embeddings=len(self._users["occupations"])),
            ),
            num_dense=3,
            has_time=True,
            tasks=("ctr",),
            max_history_length=self.max_history_length,
        )

    @property
    def schema(self) -> RankingSchema:
        return self._schema

    def candidate_times(self, split: str) -> np.ndarray:
        """``[C]`` float64 unix time of each candidate of ``split`` (rows follow the labels)."""
        self.arrays(split)
        return self._candidate_times[split]

    def _read_users(self) -> dict[str, np.ndarray]:
        file = self._files["u.user"]
        fmt = "'user|age|gender|occupation|zip' with gender M or F"
        rows = _read_fields(file, "|", 5, fmt, ML100K_URL, digits=(0, 1))
        if self.published:
            _check_rows(len(rows), ML100K_ROWS["u.user"], "users", file, ML100K_URL)
        if any(r[2] not in ("M", "F") for r in rows):
            bad = next(r for r in rows if r[2] not in ("M", "F"))
            raise ValueError(f"{file}: expected {fmt}, got {'|'.join(bad)!r}. Download again from {ML100K_URL}.")
        occupations = sorted({r[3] for r in rows})
        ids = np.array([int(r[0]) for r in rows], dtype=np.int64)
        order = np.argsort(ids)
        return {
            "id": ids[order],
            "gender": np.array([r[2] == "F" for r in rows], dtype=np.int64)[order],
            "age": np.searchsorted(_AGE_EDGES, np.array([int(r[1]) for r in rows]), side="right")[order],
            "occupation": np.array([occupations.index(r[3]) for r in rows], dtype=np.int64)[order],
            "occupations": np.array(occupations),
        }

    def _read_items(self) -> dict[str, np.ndarray]:
        file = self._files["u.item"]
        fmt = "'item|title|date|video|url|' followed by 19 genre flags (0 or 1)"
        genres = tuple(range(5, 5 + _NUM_GENRES))
        rows = _read_fields(file, "|", 5 + _NUM_GENRES, fmt, ML100K_URL, digits=(0, *genres))
        if self.published:
            _check_rows(len(rows), ML100K_ROWS["u.item"], "items", file, ML100K_URL)
        flags = [r[5:] for r in rows]
        if any(f not in ("0", "1") for row in flags for f in row):
            raise ValueError(
                f"{file}: expected {fmt}; found a genre flag that is not 0 or 1. Download from {ML100K_URL}"
            )
        ids = np.array([int(r[0]) for r in rows], dtype=np.int64)
        genre = np.argmax(np.array(flags, dtype=np.int64), axis=1)  # first set flag; 0 (unknown) if none
        order = np.argsort(ids)
        return {"id": ids[order], "genre": genre[order]}

    def _build(self) -> dict[str, RankingArrays]:
        file = self._files["u.data"]
        table = _read_table(file, "\t", 4, "tab-separated 'user item rating unix_ts'", ML100K_URL)
        _check_range(table[:, 2], *_RATINGS, "ratings", file, ML100K_URL)
        if self.published:
            _check_range(table[:, 3], *ML100K_PERIOD, "timestamps (the collection period)", file, ML100K_URL)
            _check_rows(len(table), ML100K_ROWS["u.data"], "ratings", file, ML100K_URL)
        user = _dense_ids(table[:, 0], self._users["id"], "user id", file, ML100K_URL)
        item = _dense_ids(table[:, 1], self._items["id"], "item id", file, ML100K_URL)
        order = np.lexsort((item, table[:, 3], user))
        user, item, rating, time = user[order], item[order], table[order, 2], table[order, 3]
        offsets = np.concatenate([[0], np.cumsum(np.bincount(user, minlength=len(self._users["id"])))])
        history = np.stack([item, rating - 1], axis=1)
        positive = rating >= self.positive_rating
        sort_key = user * (int(time.max()) + 1) + time  # sorted; equal keys = same user, same second
        prefix = {"rating": np.concatenate([[0], np.cumsum(rating)]), "pos": np.concatenate([[0], np.cumsum(positive)])}

        groups = self._group_starts(offsets)
        built = {}
        for split, (starts, ends) in groups.items():
            owner = user[starts]
            hist_end = np.searchsorted(sort_key, sort_key[starts], side="left")  # first event of that second
            hist_start = np.maximum(offsets[owner], hist_end - self.max_history_length)
            length = hist_end - hist_start
            mean_rating = (prefix["rating"][hist_end] - prefix["rating"][hist_start]) / np.maximum(length, 1)
            positive_rate = (prefix["pos"][hist_end] - prefix["pos"][hist_start]) / np.maximum(length, 1)
            dense = np.stack(
                [
                    np.log1p(length) / np.log1p(self.max_history_length),
                    np.where(length > 0, (mean_rating - 3.0) / 2.0, 0.0),
                    positive_rate,
                ],
                axis=1,
            ).astype(np.float32)
            rows = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
            n = len(starts)
            single = np.arange(n + 1, dtype=np.int64)
            built[split] = RankingArrays(
                history=history,
                history_starts=hist_start,
                history_ends=hist_end,
                candidate_offsets=np.concatenate([[0], np.cumsum(ends - starts)]),
                candidates=np.stack([item[rows], self._items["genre"][item[rows]]], axis=1),
                labels=positive[rows, None].astype(np.float32),
                pooled_offsets=(single,) * 4,
                pooled_values=(
                    owner,
                    self._users["gender"][owner],
                    self._users["age"][owner],
                    self._users["occupation"][owner],
                ),
                dense=dense,
                event_times=time.astype(np.float64),
                request_times=time[starts].astype(np.float64),
            )
            self._candidate_times[split] = time[rows].astype(np.float64)
        return built

    def _group_starts(self, offsets: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per split, ``[N]`` first and end rows of each sample's candidate group."""
        counts = np.diff(offsets)

        def held_out(fraction: float) -> np.ndarray:  # at least one event for users with >= 3 events
            if fraction == 0:
                return np.zeros_like(counts)
            return np.where(counts >= 3, np.maximum(1, np.round(counts * fraction)), 0).astype(np.int64)

        num_val, num_test = held_out(self.val_fraction), held_out(self.test_fraction)
        bounds = {
            "train": (offsets[:-1], offsets[1:] - num_val - num_test),
            "val": (offsets[1:] - num_val - num_test, offsets[1:] - num_test),
            "test": (offsets[1:] - num_test, offsets[1:]),
        }
        k = self.candidates_per_sample
        groups = {}
        for split, (lo, hi) in bounds.items():
            starts = [np.arange(a, b, k) for a, b in zip(lo, hi, strict=True)]
            first = np.concatenate(starts).astype(np.int64)
            groups[split] = (first, np.minimum(first + k, np.repeat(hi, [len(s) for s in starts])))
        return groups
