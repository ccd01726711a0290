"""lightning_gem.jagged: every validation error (type and argument name), and the conversions' round trips."""

from __future__ import annotations

import pytest
import torch

from lightning_gem import jagged
from lightning_gem.testing.jagged_inputs import lengths_to_offsets, random_lengths

META = torch.device("meta")


def _raises(exc: type[Exception], name: str):
    """``pytest.raises`` that also demands the argument's name, back-quoted as the kit writes it."""
    return pytest.raises(exc, match=f"`{name}`")


# --------------------------------------------------------------------------------------------- offsets


@pytest.mark.parametrize(
    ("offsets", "kwargs", "exc"),
    [
        pytest.param([0, 2, 5], {}, TypeError, id="not-a-tensor"),
        pytest.param(torch.tensor([0.0, 2.0]), {}, TypeError, id="float-dtype"),
        pytest.param(torch.tensor([0, 2], dtype=torch.int16), {}, TypeError, id="int16-dtype"),
        pytest.param(torch.tensor([[0, 2]]), {}, ValueError, id="2-D"),
        pytest.param(torch.tensor([], dtype=torch.int64), {}, ValueError, id="empty"),
        pytest.param(torch.tensor([1, 2, 5]), {}, ValueError, id="not-starting-at-0"),
        pytest.param(torch.tensor([0, 3, 2, 5]), {}, ValueError, id="decreasing"),
        pytest.param(torch.tensor([0, 2, 5]), {"num_values": 6}, ValueError, id="last-not-num-values"),
        pytest.param(torch.tensor([0, 2, 5]), {"device": META}, ValueError, id="wrong-device"),
    ],
)
@pytest.mark.parametrize("name", ["offsets", "q_offsets"])
def test_validate_offsets_errors(offsets: object, kwargs: dict, exc: type[Exception], name: str) -> None:
    with _raises(exc, name):
        jagged.validate_offsets(offsets, name, **kwargs)


def test_validate_offsets_messages_locate_the_problem() -> None:
    with pytest.raises(ValueError, match=r"offsets\[1\] = 3 > offsets\[2\] = 2"):
        jagged.validate_offsets(torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="offsets\\[-1\\] = 5"):
        jagged.validate_offsets(torch.tensor([0, 2, 5]), num_values=6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets", [[0], [0, 0], [0, 2, 2, 5], [0, 1]])
def test_validate_offsets_accepts_valid(offsets: list[int], dtype: torch.dtype) -> None:
    tensor = torch.tensor(offsets, dtype=dtype)
    assert jagged.validate_offsets(tensor, num_values=offsets[-1], device="cpu") is tensor


def test_validate_offsets_without_values_skips_the_sync() -> None:
    # Offsets on the meta device have no values to read: only the metadata checks may run.
    offsets = torch.tensor([1, 0, 7], device=META)
    assert jagged.validate_offsets(offsets, device=META, check_values=False) is offsets
    with _raises(ValueError, "offsets"):
        jagged.validate_offsets(torch.tensor([], dtype=torch.int64, device=META), check_values=False)


# ---------------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(
    ("lengths", "exc"),
    [
        pytest.param((2, 3), TypeError, id="not-a-tensor"),
        pytest.param(torch.tensor([2.0, 3.0]), TypeError, id="float-dtype"),
        pytest.param(torch.tensor([[2, 3]]), ValueError, id="2-D"),
        pytest.param(torch.tensor([2, -1, 3]), ValueError, id="negative"),
    ],
)
def test_validate_lengths_errors(lengths: object, exc: type[Exception]) -> None:
    with _raises(exc, "seq_lengths"):
        jagged.validate_lengths(lengths, "seq_lengths")
    with _raises(exc, "lengths"):
        jagged.lengths_to_offsets(lengths)


def test_validate_lengths_accepts_empty_and_zero() -> None:
    for lengths in (torch.tensor([], dtype=torch.int64), torch.tensor([0, 0], dtype=torch.int32)):
        assert jagged.validate_lengths(lengths) is lengths


# ------------------------------------------------------------------------------------ ids, float, device


@pytest.mark.parametrize(
    ("ids", "exc"),
    [
        pytest.param([0, 1], TypeError, id="not-a-tensor"),
        pytest.param(torch.tensor([0.0, 1.0]), TypeError, id="float-dtype"),
        pytest.param(torch.tensor([0, -1, 3]), ValueError, id="negative"),
        pytest.param(torch.tensor([0, 10, 3]), ValueError, id="equal-to-num-embeddings"),
        pytest.param(torch.tensor([0, 11], dtype=torch.int32), ValueError, id="above-num-embeddings"),
    ],
)
def test_check_ids_errors(ids: object, exc: type[Exception]) -> None:
    with _raises(exc, "item_ids"):
        jagged.check_ids(ids, 10, "item_ids")


def test_check_ids_names_the_bad_id_and_accepts_the_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 10\).*got -4"):
        jagged.check_ids(torch.tensor([3, -4, 12]), 10)
    ids = torch.tensor([0, 9, 5])
    assert jagged.check_ids(ids, 10) is ids
    empty = torch.tensor([], dtype=torch.int64)
    assert jagged.check_ids(empty, 0) is empty


@pytest.mark.parametrize("value", [[1.0], torch.tensor([1, 2]), torch.tensor([True])], ids=["list", "int", "bool"])
def test_check_floating_errors(value: object) -> None:
    with _raises(TypeError, "weights"):
        jagged.check_floating(value, "weights")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_check_floating_accepts_floats(dtype: torch.dtype) -> None:
    tensor = torch.zeros(2, dtype=dtype)
    assert jagged.check_floating(tensor, "x") is tensor


def test_check_device() -> None:
    with _raises(ValueError, "values"):
        jagged.check_device(torch.zeros(2), "values", META)
    with _raises(ValueError, "values"):
        jagged.check_device(torch.zeros(2, device=META), "values", torch.device("cpu"))
    jagged.check_device(torch.zeros(2), "values", torch.device("cpu"))  # no error


# ------------------------------------------------------------------------------------------ conversions


LENGTH_CASES = [[], [0], [0, 0, 0], [1], [5], [2, 0, 3], [0, 7, 1, 0, 3], [13, 1, 0, 1]]


@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_lengths_offsets_round_trip(lengths: list[int], dtype: torch.dtype) -> None:
    offsets = jagged.lengths_to_offsets(torch.tensor(lengths, dtype=dtype))
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == lengths_to_offsets(lengths).tolist()
    back = jagged.offsets_to_lengths(offsets.to(dtype))
    assert back.dtype == dtype
    assert back.tolist() == lengths


def test_offsets_to_lengths_checks_its_argument() -> None:
    with _raises(TypeError, "offsets"):
        jagged.offsets_to_lengths(torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=str)
def test_max_length_and_segment_ids(lengths: list[int]) -> None:
    offsets = lengths_to_offsets(lengths)
    assert jagged.max_length(offsets) == max(lengths, default=0)
    expected = [b for b, n in enumerate(lengths) for _ in range(n)]
    assert jagged.segment_ids(offsets).tolist() == expected
    assert jagged.segment_ids(offsets, num_values=sum(lengths)).tolist() == expected


def test_max_length_hint_reads_in_eager_and_bounds_under_compile() -> None:
    offsets = torch.tensor([0, 3, 3, 10, 12])
    assert jagged.max_length_hint(offsets, 12) == 7
    assert jagged.max_length_hint(torch.tensor([0]), 5) == 5  # no segment: the row count bounds nothing wrongly
    compiled = torch.compile(lambda o: torch.full((jagged.max_length_hint(o, 12),), 1.0), backend="eager")
    assert compiled(offsets).shape == (12,)  # traced: the row count, no sync


@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=str)
@pytest.mark.parametrize("trailing", [(), (2, 3)], ids=["1-D", "3-D"])
def test_to_padded_from_padded_round_trip(lengths: list[int], trailing: tuple[int, ...]) -> None:
    offsets = lengths_to_offsets(lengths)
    values = torch.randn(sum(lengths), *trailing)
    padded, mask = jagged.to_padded(values, offsets, padding_value=-7.0)
    longest = max(lengths, default=0)
    assert padded.shape == (len(lengths), longest, *trailing)
    assert mask.shape == (len(lengths), longest) and mask.dtype == torch.bool
    start = 0
    for b, n in enumerate(lengths):  # checked row by row against a loop, not against from_padded alone
        assert mask[b].tolist() == [True] * n + [False] * (longest - n)
        torch.testing.assert_close(padded[b, :n], values[start : start + n], rtol=0, atol=0)
        assert bool((padded[b, n:] == -7.0).all())
        start += n
    torch.testing.assert_close(jagged.from_padded(padded, offsets), values, rtol=0, atol=0)


def test_to_padded_max_len_truncates_and_pads() -> None:
    offsets = lengths_to_offsets([3, 0, 1])
    values = torch.arange(4.0)
    padded, mask = jagged.to_padded(values, offsets, max_len=2)
    assert padded.tolist() == [[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]]
    assert mask.tolist() == [[True, True], [False, False], [True, False]]
    padded, _ = jagged.to_padded(values, offsets, max_len=5)
    assert padded.shape == (3, 5)
    assert jagged.from_padded(padded, offsets).tolist() == values.tolist()


def test_to_padded_validates_offsets_against_values() -> None:
    with _raises(ValueError, "offsets"):
        jagged.to_padded(torch.arange(4.0), lengths_to_offsets([2, 3]))


def test_from_padded_errors() -> None:
    offsets = lengths_to_offsets([2, 3])
    with _raises(ValueError, "padded"):
        jagged.from_padded(torch.zeros(3, 3), offsets)  # one row per sequence
    with _raises(ValueError, "padded"):
        jagged.from_padded(torch.zeros(2, 2), offsets)  # shorter than the longest sequence
    with _raises(ValueError, "offsets"):
        jagged.from_padded(torch.zeros(2, 3), torch.tensor([0, 3, 2]))


def test_random_lengths_include_the_edges() -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        lengths = random_lengths(4, 11, generator)
        assert 0 in lengths and 1 in lengths and max(lengths) <= 11


def test_validate_offsets_together_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    for name in ("__bool__", "__int__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, real=real: reads.append(1) or real(t))
    history, candidates = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 1, 4, 4], dtype=torch.int32)
    longest = jagged.validate_offsets_together([(history, "history", 7, 4), (candidates, "candidates", 4, None)])
    assert len(reads) == 1
    assert longest == [4, 3]  # the longest sequence of each, read in the same sync
    assert jagged.validate_offsets_together([(torch.tensor([0]), "empty", 0, None)]) == [0]


@pytest.mark.parametrize(
    ("checks", "match"),
    [
        ([(torch.tensor([1, 3]), "history", None, None)], "`history` must start at 0"),
        ([(torch.tensor([0, 3, 2]), "history", None, None)], "`history` must be non-decreasing"),
        ([(torch.tensor([0, 3]), "history", 4, None)], "`history` must end at the number of values 4"),
        ([(torch.tensor([0, 3, 8]), "history", 8, 4)], "`history` holds a sequence of 5, longer than .* 4"),
        ([(torch.tensor([0, 1]), "a", 1, None), (torch.tensor([0, 2, 1]), "b", 1, None)], "`b` must be"),
        ([(torch.tensor([0.0, 1.0]), "a", None, None)], "`a` must have dtype"),
    ],
)
def test_validate_offsets_together_names_what_is_wrong(checks: list, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        jagged.validate_offsets_together(checks)


def test_segment_positions_count_from_each_segment_start() -> None:
    segment, position = jagged.segment_positions(torch.tensor([0, 2, 2, 5]), 5)
    assert segment.tolist() == [0, 0, 2, 2, 2]
    assert position.tolist() == [0, 1, 0, 1, 2]
