"""DJL's scaling rule and the retire rule, as tables."""

from __future__ import annotations

import pytest

from mmserver.policy.scaling import PoolSnapshot, should_add_worker, should_retire, workers_to_start


@pytest.mark.parametrize(
    ("workers", "queued", "min_w", "max_w", "batch", "expected"),
    [
        (0, 1, 0, 4, 1, True),  # scale-to-zero: the first request starts a worker
        (0, 0, 0, 4, 1, True),  # no worker at all: always add one
        (1, 1, 1, 4, 1, False),  # queue not past 2 x batch
        (1, 2, 1, 4, 1, False),  # exactly 2 x batch: not past it
        (1, 3, 1, 4, 1, True),  # past 2 x batch
        (3, 3, 1, 4, 1, True),
        (4, 100, 1, 4, 1, False),  # at maxWorkers: never more
        (5, 100, 1, 4, 1, False),  # above (rescaled down): never more
        (1, 16, 1, 4, 8, False),  # batch 8: threshold is 16
        (1, 17, 1, 4, 8, True),
        (1, 50, 1, 1, 1, False),  # maxWorkers 1
    ],
)
def test_add_worker_table(
    workers: int, queued: int, min_w: int, max_w: int, batch: int, expected: bool
) -> None:
    assert should_add_worker(PoolSnapshot(workers, queued, min_w, max_w, batch)) is expected


@pytest.mark.parametrize(
    ("workers", "min_w", "max_w", "idle", "max_idle", "expected"),
    [
        (2, 1, 4, 60.0, 60, True),  # above min, idle long enough
        (2, 1, 4, 59.9, 60, False),  # not idle long enough
        (1, 1, 4, 1e9, 60, False),  # at min: stays
        (1, 0, 4, 60.0, 60, True),  # scale-to-zero: the last worker goes too
        (0, 0, 4, 60.0, 60, False),
        (5, 1, 4, 0.0, 60, True),  # above a lowered max: goes at once
    ],
)
def test_retire_table(
    workers: int, min_w: int, max_w: int, idle: float, max_idle: int, expected: bool
) -> None:
    snapshot = PoolSnapshot(workers, 0, min_w, max_w, 1)
    assert should_retire(snapshot, idle, max_idle) is expected


def test_concurrent_enqueues_cannot_overshoot_max() -> None:
    """Applying the rule once per enqueue, counting each added worker before the next check,
    ends exactly at maxWorkers however many requests arrive."""
    workers, queued = 1, 0
    for _ in range(1000):
        queued += 1
        if should_add_worker(PoolSnapshot(workers, queued, 1, 3, 1)):
            workers += 1
    assert workers == 3


@pytest.mark.parametrize(("workers", "min_w", "expected"), [(0, 2, 2), (1, 2, 1), (3, 2, 0)])
def test_workers_to_start(workers: int, min_w: int, expected: int) -> None:
    assert workers_to_start(PoolSnapshot(workers, 0, min_w, 4, 1)) == expected
