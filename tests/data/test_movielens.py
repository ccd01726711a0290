"""MovieLens sources on the real files (../shared/data, skipped when absent) and on broken copies in tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from lightning_gem.data import MovieLens1MSource, MovieLens100KRankingSource


@pytest.fixture(scope="module")
def ml1m(ml1m_dir: Path) -> MovieLens1MSource:
    return MovieLens1MSource(path=str(ml1m_dir))


@pytest.fixture(scope="module")
def ml100k(ml100k_dir: Path) -> MovieLens100KRankingSource:
    return MovieLens100KRankingSource(path=str(ml100k_dir))


def _sequences(ml1m_dir: Path) -> dict[int, list[int]]:
    lines = (ml1m_dir / "sequences.txt").read_text().split("\n")
    return {int(line.split()[0]): [int(x) for x in line.split()[1:]] for line in lines if line.strip()}


def test_ml1m_catalogue_is_every_listed_movie(ml1m: MovieLens1MSource, ml1m_dir: Path) -> None:
    listed = sorted(int(line.split("::")[0]) for line in (ml1m_dir / "movies.dat").read_text("latin-1").splitlines())
    assert ml1m.schema.num_items == len(listed) == 3883
    np.testing.assert_array_equal(ml1m.movie_ids, listed)


def test_ml1m_leave_one_out_split(ml1m: MovieLens1MSource, ml1m_dir: Path, check_retrieval_batch) -> None:
    sequences = _sequences(ml1m_dir)
    movie = ml1m.movie_ids  # dense id -> MovieID
    h = ml1m.schema.max_history_length
    for split, drop in (("train", 3), ("val", 2), ("test", 1)):
        dataset, users = ml1m.dataset(split), ml1m.sample_users(split)
        assert len(dataset) == 6040
        for index in range(0, len(dataset), 97):
            seq, sample = sequences[int(users[index])], dataset[index]
            inputs = seq[: len(seq) - drop]
            assert movie[sample.history[:, 0]].tolist() == inputs[-h:]
            assert movie[sample.targets].tolist() == seq[1 : len(seq) - drop + 1][-h:]
        batch = ml1m.collate([dataset[i] for i in range(64)])
        check_retrieval_batch(batch, ml1m.schema)
        assert batch.timestamps is None
    # The held-out items: the last target of a test sample is the last movie, of a val sample the one before.
    first = int(ml1m.sample_users("test")[0])
    assert movie[ml1m.dataset("test")[0].targets[-1]] == sequences[first][-1]
    assert movie[ml1m.dataset("val")[0].targets[-1]] == sequences[first][-2]
    assert movie[ml1m.dataset("train")[0].targets[-1]] == sequences[first][-3]
    lengths = ml1m.sample_lengths("test")
    assert lengths.max() == h and lengths.min() >= 1


def test_ml100k_histories_are_strictly_earlier(ml100k: MovieLens100KRankingSource, ml100k_dir: Path) -> None:
    ratings = np.loadtxt(ml100k_dir / "u.data", dtype=np.int64)
    by_user = {u: ratings[ratings[:, 0] == u] for u in np.unique(ratings[:, 0])}
    h = ml100k.schema.max_history_length
    last_time: dict[int, float] = {}
    for split in ("train", "val", "test"):
        arrays, dataset, times = ml100k.arrays(split), ml100k.dataset(split), ml100k.candidate_times(split)
        for index in range(len(dataset)):
            c0, c1 = arrays.candidate_offsets[index], arrays.candidate_offsets[index + 1]
            start, end = arrays.history_starts[index], arrays.history_ends[index]
            first_candidate = times[c0:c1].min()
            if end > start:
                assert arrays.event_times[start:end].max() < first_candidate  # no leak
            sample = dataset[index]
            assert (sample.time_deltas > 0).all()
            # Independent recomputation from u.data: the user's latest events before the first candidate.
            user = int(sample.pooled[0][0]) + 1
            events = by_user[user]
            earlier = events[events[:, 3] < first_candidate]
            earlier = earlier[np.lexsort((earlier[:, 1], earlier[:, 3]))][-h:] if len(earlier) else earlier
            assert (sample.history[:, 0] + 1).tolist() == earlier[:, 1].tolist()
            assert (sample.history[:, 1] + 1).tolist() == earlier[:, 2].tolist()
            assert set((sample.candidates[:, 0] + 1).tolist()) <= set(events[:, 1].tolist())
            # Splits are chronological per user: no val/test candidate precedes a train one.
            if split != "train":
                assert first_candidate >= last_time.get((user, "train"), -np.inf)
            if split == "test":
                assert first_candidate >= last_time.get((user, "val"), -np.inf)
            last_time[(user, split)] = max(last_time.get((user, split), -np.inf), times[c0:c1].max())


def test_ml100k_batches_and_counts(ml100k: MovieLens100KRankingSource, check_ranking_batch) -> None:
    total = sum(len(ml100k.arrays(s).candidates) for s in ("train", "val", "test"))
    assert total == 100_000  # every rating is a candidate exactly once
    for split in ("train", "val", "test"):
        dataset = ml100k.dataset(split)
        batch = ml100k.collate([dataset[i] for i in range(0, len(dataset), max(1, len(dataset) // 200))])
        check_ranking_batch(batch, ml100k.schema)
    assert ml100k.schema.tasks == ("ctr",)
    assert 0.45 <= ml100k.arrays("test").labels.mean() <= 0.6


def test_ml100k_simple_baseline_reaches_the_target_range(ml100k: MovieLens100KRankingSource) -> None:
    """An item positive rate (train, smoothed) times the user's history positive rate: AUC ~0.77 on test."""
    train, test = ml100k.arrays("train"), ml100k.arrays("test")
    num_items = ml100k.schema.candidate_features[0].num_embeddings
    prior, k = float(train.labels.mean()), 5.0
    count = np.bincount(train.candidates[:, 0], minlength=num_items)
    positive = np.bincount(train.candidates[:, 0], weights=train.labels[:, 0], minlength=num_items)
    item_rate = (positive + k * prior) / (count + k)
    per_sample = np.diff(test.candidate_offsets)
    length = np.repeat(ml100k.sample_lengths("test"), per_sample)
    user_rate = (np.repeat(test.dense[:, 2], per_sample) * length + k * prior) / (length + k)

    def logit(p: np.ndarray) -> np.ndarray:
        return np.log(p / (1 - p))

    labels = torch.from_numpy(test.labels[:, 0]).long()
    item_auc = binary_auroc(torch.from_numpy(item_rate[test.candidates[:, 0]]), labels).item()
    both_auc = binary_auroc(torch.from_numpy(logit(item_rate[test.candidates[:, 0]]) + logit(user_rate)), labels).item()
    print(f"ml-100k test AUC: item rate {item_auc:.3f}, item + user rate {both_auc:.3f}")
    assert item_auc >= 0.68 and both_auc >= 0.74


def _copy(src: Path, dst: Path, names: list[str]) -> Path:
    dst.mkdir()
    for name in names:
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_missing_files_say_what_and_where(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"movies\.dat.*grouplens\.org/datasets/movielens/1m"):
        MovieLens1MSource(path=str(tmp_path), published=False)
    (tmp_path / "movies.dat").write_text("1::Toy Story (1995)::Animation\n")
    with pytest.raises(FileNotFoundError, match=r"sequences\.txt.*ratings\.dat.*movielens/1m"):
        MovieLens1MSource(path=str(tmp_path), published=False)
    with pytest.raises(FileNotFoundError, match=r"u\.data.*user item rating unix_ts.*movielens/100k"):
        MovieLens100KRankingSource(path=str(tmp_path / "nowhere"))


def test_malformed_files_say_what_and_where(tmp_path: Path) -> None:
    (tmp_path / "movies.dat").write_text("1::A::Drama\n2::B::Comedy\n3::C::Drama\n")
    (tmp_path / "sequences.txt").write_text("1 1 2 3 1\n2 1 two 3\n")
    with pytest.raises(ValueError, match=r"sequences\.txt, line 2.*UserID MovieID.*movielens/1m"):
        MovieLens1MSource(path=str(tmp_path), published=False).dataset("train")
    (tmp_path / "sequences.txt").write_text("1 1 2 3 1\n2 1 9 3\n")
    with pytest.raises(ValueError, match=r"MovieID 9.*movielens/1m"):
        MovieLens1MSource(path=str(tmp_path), published=False).dataset("train")
    (tmp_path / "movies.dat").write_text("x::A::Drama\n")
    with pytest.raises(ValueError, match=r"movies\.dat, line 1.*MovieID::Title::Genres"):
        MovieLens1MSource(path=str(tmp_path), published=False)


def test_ml100k_malformed_u_data(tmp_path: Path, ml100k_dir: Path) -> None:
    folder = _copy(ml100k_dir, tmp_path / "ml-100k", ["u.user", "u.item"])
    (folder / "u.data").write_text("1\t1\t5\t874965758\n1\t2\t3\n")
    with pytest.raises(ValueError, match=r"u\.data, line 2.*user item rating unix_ts.*movielens/100k"):
        MovieLens100KRankingSource(path=str(folder), published=False).dataset("train")
    (folder / "u.data").write_text("1\t1\t7\t874965758\n")
    with pytest.raises(ValueError, match="ratings must lie in 1..5"):
        MovieLens100KRankingSource(path=str(folder), published=False).dataset("train")
    (folder / "u.user").write_text("1|24|X|technician|85711\n")
    with pytest.raises(ValueError, match=r"u\.user.*gender"):
        MovieLens100KRankingSource(path=str(folder), published=False)


def test_ml1m_reads_original_ratings_dat(tmp_path: Path) -> None:
    """Without sequences.txt, the original ratings.dat is ordered per user by timestamp (ties in file order)."""
    (tmp_path / "movies.dat").write_text("".join(f"{m}::M{m}::Drama\n" for m in (10, 20, 30, 40, 50)))
    rows = [(2, 10, 3, 100), (1, 50, 5, 300), (1, 20, 4, 100), (1, 30, 4, 200), (1, 40, 1, 200), (1, 10, 2, 50)]
    (tmp_path / "ratings.dat").write_text("".join("::".join(map(str, r)) + "\n" for r in rows))
    source = MovieLens1MSource(path=str(tmp_path), published=False)
    assert source.schema.num_items == 5
    (sample,) = [source.dataset("test")[i] for i in range(len(source.dataset("test")))]  # user 2 has 1 event
    assert source.movie_ids[sample.history[:, 0]].tolist() == [10, 20, 30, 40]
    assert source.movie_ids[sample.targets].tolist() == [20, 30, 40, 50]
    assert source.sample_users("test").tolist() == [1]
    assert sample.timestamps.tolist() == [0.0, 50.0, 150.0, 150.0]  # seconds since the user's first rating


def test_ml1m_timestamps_reach_the_batch_only_from_ratings_dat(tmp_path: Path) -> None:
    """ratings.dat's times flow into RetrievalBatch.timestamps; sequences.txt has none."""
    from lightning_gem.data.collate import collate_retrieval

    (tmp_path / "movies.dat").write_text("".join(f"{m}::M{m}::Drama\n" for m in range(1, 6)))
    rows = [(1, m, 4, 978300000 + 7 * m) for m in range(1, 6)] + [(2, m, 3, 978000000 + m) for m in (2, 4, 5)]
    (tmp_path / "ratings.dat").write_text("".join("::".join(map(str, r)) + "\n" for r in rows))
    source = MovieLens1MSource(path=str(tmp_path), published=False)
    dataset = source.dataset("test")
    batch = collate_retrieval([dataset[i] for i in range(len(dataset))], source.schema)
    assert batch.timestamps.dtype == torch.float32
    assert batch.timestamps.tolist() == [0.0, 7.0, 14.0, 21.0, 0.0, 2.0]
    (tmp_path / "sequences.txt").write_text("1 1 2 3 4 5\n2 2 4 5\n")
    assert MovieLens1MSource(path=str(tmp_path), published=False).dataset("test")[0].timestamps is None


def test_ml1m_train_on_validation_item(tmp_path: Path) -> None:
    """The reference recipe trains on every item but the test one; the default holds the validation item out too."""
    (tmp_path / "movies.dat").write_text("".join(f"{m}::M{m}::Drama\n" for m in range(1, 8)))
    (tmp_path / "sequences.txt").write_text("1 1 2 3 4 5 6 7\n2 3 4 5 6\n")
    default = MovieLens1MSource(path=str(tmp_path), published=False)
    reference = MovieLens1MSource(path=str(tmp_path), train_on_validation_item=True, published=False)

    def split(source: MovieLens1MSource, name: str) -> list[tuple[list[int], list[int]]]:
        dataset = source.dataset(name)
        samples = [dataset[i] for i in range(len(dataset))]
        return [(source.movie_ids[s.history[:, 0]].tolist(), source.movie_ids[s.targets].tolist()) for s in samples]

    assert split(default, "train") == [([1, 2, 3, 4], [2, 3, 4, 5]), ([3], [4])]
    assert split(reference, "train") == [([1, 2, 3, 4, 5], [2, 3, 4, 5, 6]), ([3, 4], [4, 5])]
    for name in ("val", "test"):  # evaluation splits do not change
        assert split(reference, name) == split(default, name)
    with pytest.raises(TypeError, match="train_on_validation_item"):
        MovieLens1MSource(path=str(tmp_path), train_on_validation_item="yes")


def test_ml1m_train_windows_all_trains_every_target_once(tmp_path: Path) -> None:
    """With train_windows='all' a history longer than the window yields its earlier windows too: every training
    target exactly once, consecutive windows, the most recent one as with 'last'; evaluation does not change."""
    (tmp_path / "movies.dat").write_text("".join(f"{m}::M{m}::Drama\n" for m in range(1, 13)))
    (tmp_path / "sequences.txt").write_text("1 1 2 3 4 5 6 7 8 9 10 11 12\n2 3 4 5\n3 7 8 9 10 11 12 1\n")
    kwargs = {"path": str(tmp_path), "max_history_length": 3, "train_on_validation_item": True, "published": False}
    last = MovieLens1MSource(**kwargs)
    every = MovieLens1MSource(**kwargs, train_windows="all")

    def split(source: MovieLens1MSource, name: str) -> list[tuple[list[int], list[int]]]:
        dataset = source.dataset(name)
        samples = [dataset[i] for i in range(len(dataset))]
        return [(source.movie_ids[s.history[:, 0]].tolist(), source.movie_ids[s.targets].tolist()) for s in samples]

    # User 1 trains on 1..11 (inputs 1..10), user 2 on 3, 4 (input 3), user 3 on 7..12 (inputs 7..11).
    assert split(last, "train") == [([8, 9, 10], [9, 10, 11]), ([3], [4]), ([9, 10, 11], [10, 11, 12])]
    assert split(every, "train") == [
        ([1], [2]),
        ([2, 3, 4], [3, 4, 5]),
        ([5, 6, 7], [6, 7, 8]),
        ([8, 9, 10], [9, 10, 11]),
        ([3], [4]),
        ([7, 8], [8, 9]),
        ([9, 10, 11], [10, 11, 12]),
    ]
    assert every.sample_users("train").tolist() == [1, 1, 1, 1, 2, 3, 3]
    for name in ("val", "test"):
        assert split(every, name) == split(last, name)
    with pytest.raises(ValueError, match="train_windows"):
        MovieLens1MSource(path=str(tmp_path), train_windows="random", published=False)


def test_ml1m_train_windows_all_covers_every_rating(ml1m_dir: Path) -> None:
    """On the real data: 'all' trains on every rating but each user's first and last (the test item)."""
    source = MovieLens1MSource(path=str(ml1m_dir), train_on_validation_item=True, train_windows="all")
    lengths = source.sample_lengths("train")
    assert lengths.max() == 200
    assert lengths.sum() == 1_000_209 - 2 * 6040
    assert MovieLens1MSource(path=str(ml1m_dir), train_on_validation_item=True).sample_lengths("train").sum() < 700_000


def test_cut_off_or_garbled_published_files_are_errors_naming_file_and_line(tmp_path: Path, ml100k_dir: Path) -> None:
    folder = _copy(ml100k_dir, tmp_path / "ml-100k", ["u.user", "u.item"])
    lines = (ml100k_dir / "u.data").read_text().splitlines()
    # Cut off mid-line: the last line's timestamp lost its digits (read as 1970 before).
    (folder / "u.data").write_text("\n".join(lines[:50_702]) + "\n" + lines[50_702][:-8] + "\n")
    with pytest.raises(ValueError, match=r"u\.data, line 50703: timestamps \(the collection period\) must lie in"):
        MovieLens100KRankingSource(path=str(folder)).dataset("train")
    (folder / "u.data").write_text("\n".join(lines[:50_702]) + "\n")  # cut off at a line end
    with pytest.raises(ValueError, match=r"u\.data holds 50,702 ratings; the published file holds 100,000"):
        MovieLens100KRankingSource(path=str(folder)).dataset("train")
    assert len(MovieLens100KRankingSource(path=str(folder), published=False).dataset("train")) > 0  # a chosen subset
    user, item, _, when = lines[7].split("\t")
    garbled = [*lines[:7], f"{user}\t{item}\t0\t{when}", *lines[8:]]
    (folder / "u.data").write_text("\n".join(garbled) + "\n")
    with pytest.raises(ValueError, match=r"u\.data, line 8: ratings must lie in 1\.\.5, got 0"):
        MovieLens100KRankingSource(path=str(folder), published=False).dataset("train")
    (folder / "u.user").write_text("\n".join((ml100k_dir / "u.user").read_text().splitlines()[:900]) + "\n")
    with pytest.raises(ValueError, match=r"u\.user holds 900 users; the published file holds 943"):
        MovieLens100KRankingSource(path=str(folder))


def test_cut_off_ml1m_files_are_errors(tmp_path: Path, ml1m_dir: Path) -> None:
    folder = _copy(ml1m_dir, tmp_path / "ml-1m", ["movies.dat"])
    lines = (ml1m_dir / "sequences.txt").read_text().splitlines()
    (folder / "sequences.txt").write_text("\n".join(lines[:-1]) + "\n" + " ".join(lines[-1].split()[:5]) + "\n")
    with pytest.raises(
        ValueError, match=r"sequences\.txt holds [\d,]+ ratings \(movie ids\); the published file holds"
    ):
        MovieLens1MSource(path=str(folder)).dataset("train")
    (folder / "sequences.txt").write_text("\n".join(lines[:3000]) + "\n")
    with pytest.raises(ValueError, match=r"sequences\.txt holds 3,000 users \(lines\); the published file holds 6,040"):
        MovieLens1MSource(path=str(folder)).dataset("train")
    (folder / "ratings.dat").write_text("1::1193::5::978300760\n1::661::3::97830\n")
    (folder / "sequences.txt").unlink()
    with pytest.raises(ValueError, match=r"ratings\.dat, line 2: timestamps \(the collection period\)"):
        MovieLens1MSource(path=str(folder)).dataset("train")
    (folder / "ratings.dat").write_text("1::1193::5::978300760\n1::661::6::978302109\n")
    with pytest.raises(ValueError, match=r"ratings\.dat, line 2: ratings must lie in 1\.\.5, got 6"):
        MovieLens1MSource(path=str(folder), published=False).dataset("train")
