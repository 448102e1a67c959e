"""The batch-cut rule, as tables: when a pool's next batch goes, and how many jobs it holds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mmserver.serving.jobs import Cut, batch_length, cut_batch


@pytest.mark.parametrize(
    ("queued", "oldest", "now", "batch_size", "delay", "expected"),
    [
        (0, None, 10.0, 4, 0.0, Cut(0, None)),  # empty queue: nothing to take or wait for
        (0, None, 10.0, 4, 0.25, Cut(0, None)),
        (4, 10.0, 10.0, 4, 0.25, Cut(4)),  # a full batch goes at once
        (9, 10.0, 10.0, 4, 0.25, Cut(4)),  # more than a batch: a full one goes
        (3, 10.0, 10.0, 4, 0.25, Cut(0, 10.25)),  # partial: waits for the oldest's deadline
        (3, 10.0, 10.2, 4, 0.25, Cut(0, 10.25)),  # the deadline follows the oldest job
        (3, 10.0, 10.25, 4, 0.25, Cut(3)),  # at the deadline: what is there goes
        (3, 10.0, 11.0, 4, 0.25, Cut(3)),  # past it: the same
        (1, 10.0, 10.0, 4, 0.0, Cut(1)),  # max_batch_delay 0: whatever is queued goes at once
        (9, 10.0, 10.0, 4, 0.0, Cut(4)),
        (1, 10.0, 10.0, 1, 0.25, Cut(1)),  # batch_size 1: every job is a full batch
    ],
)
def test_cut_table(
    queued: int, oldest: float | None, now: float, batch_size: int, delay: float, expected: Cut
) -> None:
    assert cut_batch(queued, oldest, now, batch_size, delay) == expected


@pytest.mark.parametrize(
    ("sizes", "batch_size", "max_bytes", "expected"),
    [
        ([], 4, 0, 0),  # empty queue
        ([5, 5, 5], 2, 0, 2),  # up to batch_size
        ([5, 5, 5], 8, 0, 3),  # all that is queued
        ([5, 5, 5], 0, 0, 1),  # at least one
        ([5, 5, 5], 8, 10, 2),  # max_bytes reached exactly: the batch ends there
        ([5, 5, 5], 8, 9, 1),  # a second would pass max_bytes
        ([50, 5], 8, 10, 1),  # a first job over max_bytes goes alone
        ([5, 50, 5], 8, 20, 1),  # a job over the limit ends the batch; none is skipped
        ([5, 50, 5], 8, 0, 3),  # max_bytes 0: no limit
    ],
)
def test_batch_length_table(
    sizes: list[int], batch_size: int, max_bytes: int, expected: int
) -> None:
    assert batch_length(sizes, batch_size, max_bytes) == expected


def test_batch_length_reads_sizes_only_as_far_as_the_batch_goes() -> None:
    def sizes() -> Iterator[int]:
        yield 5
        yield 5
        raise AssertionError("read past the batch")

    assert batch_length(sizes(), 2, 0) == 2
    assert batch_length(sizes(), 8, 9) == 1
