"""A model's answer times of the last minute (the status page's p50 and p99)."""

from __future__ import annotations

import pytest

from mmserver.ops import recent
from mmserver.ops.recent import BOUNDS, Recent


def test_quantiles_are_the_bounds_of_the_buckets_they_fall_in() -> None:
    times = Recent()
    assert times.summary() == (0, None, None)
    for _ in range(98):
        times.add(0.001)
    times.add(0.2)
    times.add(30.0)
    count, p50, p99 = times.summary()
    assert count == 100
    assert p50 is not None and p99 is not None
    assert 0.001 <= p50 < 0.001 * 1.5  # within a bucket's width above the time
    assert 0.2 <= p99 < 0.2 * 1.5
    times.add(1e9)  # past the last bound: counted in the last bucket
    assert times.summary()[0] == 101


def test_only_the_last_minute_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(recent, "_monotonic", lambda: clock[0])
    times = Recent()
    times.add(0.001)
    clock[0] += 30
    times.add(0.004)
    times.add(0.004)
    assert times.summary()[0] == 3
    clock[0] += 35  # the first slot is now more than a minute old
    assert times.summary()[0] == 2
    clock[0] += 60
    times.add(0.01)  # a slot reused after a minute starts empty
    assert times.summary() == (1, BOUNDS[14], BOUNDS[14])
    assert BOUNDS[13] < 0.01 <= BOUNDS[14]


def test_a_slot_is_made_when_first_counted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model asked once holds one slot, not six: the status page's memory grows with the
    traffic a model had in the last minute, not with the models loaded."""
    clock = [1000.0]
    monkeypatch.setattr(recent, "_monotonic", lambda: clock[0])
    times = Recent()
    assert times._slots == [None] * 6
    times.add(0.001)
    assert sum(slot is not None for slot in times._slots) == 1
    for _ in range(7):  # a minute and more, one request every ten seconds: every slot made
        clock[0] += 10
        times.add(0.001)
    assert all(slot is not None for slot in times._slots)
    assert times.summary()[0] == 6  # the slots reused count only their own period
