"""The shared tuner's timing (:func:`lightning_gem.ops._tuning.measure`), with CUDA's events and synchronize replaced
by a clock that each candidate's run advances by its own cost (this test runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_gem.ops import _tuning


class _Clock:
    now = 0.0


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = _Clock.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:
        return other.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)


def test_short_candidates_are_timed_over_more_runs(fake_cuda: None) -> None:
    cost = {"tiny": 0.01, "small": 0.25, "large": 4.0, "broken": 1.0}  # ms a run
    runs = {name: 0 for name in cost}

    def run(name: str) -> None:
        if name == "broken":
            raise RuntimeError("out of shared memory")
        runs[name] += 1
        _Clock.now += cost[name]

    times = _tuning.measure(list(cost), run, rounds=3, reps=3, round_ms=1.0)
    assert set(times) == {"tiny", "small", "large"}  # the one that fails is left out
    for name, ms in times.items():
        assert ms == pytest.approx(cost[name])
    # warm-up and sizing runs, then three rounds: about round_ms of runs each, at least reps, at most MAX_REPS
    assert runs == {"tiny": 2 + 3 * _tuning.MAX_REPS, "small": 2 + 3 * 4, "large": 2 + 3 * 3, "broken": 0}


def test_median_of_rounds_drops_one_slow_round(fake_cuda: None) -> None:
    calls = {"n": 0}

    def run(name: str) -> None:
        calls["n"] += 1
        _Clock.now += 5.0 if calls["n"] == 5 else 1.0  # one stall in the first timed round

    assert _tuning.measure(["a"], run, rounds=3, reps=3) == {"a": pytest.approx(1.0)}
