"""Real time first: the rules that keep asynchronous (background) work to what real-time traffic
leaves, as tables over snapshots."""

from __future__ import annotations

import asyncio

import pytest

from mmserver.asynchronous.admission import room_for_async
from mmserver.jobs import Job, JobQueue, Tally
from mmserver.scaling import (
    PoolSnapshot,
    background_share,
    should_add_background_worker,
    should_add_worker,
)


@pytest.mark.parametrize(
    ("workers", "background", "async_max", "max_workers", "expected"),
    [
        (0, 1, 1, 4, True),  # a model with no worker gets one for its first request
        (1, 1, 1, 4, False),
        (1, 5, 1, 4, False),  # async_max_workers bounds it, however deep the backlog
        (1, 2, 2, 4, True),
        (2, 2, 2, 4, False),  # one worker per queued background job
        (2, 9, 8, 2, False),  # and maxWorkers
    ],
)
def test_background_scale_up_table(
    workers: int, background: int, async_max: int, max_workers: int, expected: bool
) -> None:
    assert should_add_background_worker(workers, background, async_max, max_workers) is expected


@pytest.mark.parametrize(
    ("real_time_queued", "running", "max_running", "expected"),
    [
        (0, 0, 1, True),
        (1, 0, 1, False),  # a real-time request waits: nothing asynchronous starts
        (0, 1, 1, False),
        (0, 2, 3, True),
        (5, 0, 3, False),
    ],
)
def test_room_for_async_table(
    real_time_queued: int, running: int, max_running: int, expected: bool
) -> None:
    assert room_for_async(real_time_queued, running, max_running) is expected


@pytest.mark.parametrize(("processes", "share"), [(0, 1), (1, 1), (2, 1), (4, 3), (16, 15)])
def test_asynchronous_work_leaves_one_process_to_real_time(processes: int, share: int) -> None:
    assert background_share(processes) == share


async def test_background_jobs_are_counted_apart_and_not_in_the_scaling_snapshot() -> None:
    loop = asyncio.get_running_loop()
    tally = Tally()
    queue = JobQueue(100, tally)
    now = loop.time()
    for i in range(6):
        queue.put(Job((b"", "", None), loop.create_future(), now, now + i, background=i % 2 == 0))
    assert (len(queue), queue.background, tally.jobs, tally.background) == (6, 3, 6, 3)
    # The real-time rule sees the real-time jobs only: 3 is not more than 2 * batch_size.
    assert not should_add_worker(PoolSnapshot(1, len(queue) - queue.background, 1, 4, 2))
    expired, _ = queue.expire(now + 1.5)  # deadlines now + 0 (background) and + 1
    assert len(expired) == 2
    assert (queue.background, tally.background) == (2, 2)
    taken = queue.take(2)
    assert [job.background for job in taken] == [True, False]
    assert (queue.background, tally.background) == (1, 1)
    queue.drain()
    assert (len(queue), queue.background, tally.jobs, tally.background) == (0, 0, 0, 0)
