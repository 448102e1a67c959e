"""A full queue sheds the newest real-time job of the lowest priority below the new one's."""

from __future__ import annotations

import asyncio

import pytest

from mmserver import errors
from mmserver.serving.jobs import HIGH, LOW, NORMAL, Job, JobQueue

REQUEST = (b"[[0.5]]", "application/json", None, None)


def job(loop: asyncio.AbstractEventLoop, priority: int, background: bool = False) -> Job:
    return Job(REQUEST, loop.create_future(), 0.0, 60.0, None, background, priority)  # type: ignore[arg-type]


async def test_a_full_queue_sheds_the_newest_of_the_lowest_priority() -> None:
    loop = asyncio.get_running_loop()
    queue = JobQueue(4)
    low_old, normal, low_new, high = (job(loop, p) for p in (LOW, NORMAL, LOW, HIGH))
    for queued in (low_old, normal, low_new, high):
        queue.put(queued)
    arriving = job(loop, HIGH)
    queue.put(arriving)
    assert low_new.future.done() and isinstance(low_new.future.exception(), errors.QueueFull)
    assert "a request of a higher priority took this one's place" in str(low_new.future.exception())
    assert not low_old.future.done()
    queue.put(job(loop, NORMAL))  # the other low one goes
    assert low_old.future.done()
    with pytest.raises(errors.QueueFull, match="the model's queue is full"):
        queue.put(job(loop, NORMAL))  # nothing below normal is left
    assert queue.ranked == 2  # the two high ones
    taken = queue.take(10)
    assert [j.priority for j in taken] == [NORMAL, HIGH, HIGH, NORMAL]
    assert (len(queue), queue.ranked, queue.tally.jobs) == (0, 0, 0)


async def test_low_and_normal_shed_nothing_of_their_own_rank_and_background_stays() -> None:
    loop = asyncio.get_running_loop()
    queue = JobQueue(2)
    background = job(loop, LOW, background=True)
    queue.put(background)
    queue.put(job(loop, NORMAL))
    with pytest.raises(errors.QueueFull):
        queue.put(job(loop, LOW))
    with pytest.raises(errors.QueueFull):
        queue.put(job(loop, NORMAL))
    with pytest.raises(errors.QueueFull):
        queue.put(job(loop, NORMAL))
    queue.put(job(loop, HIGH))  # the normal real-time job goes; the asynchronous one stays
    assert not background.future.done()
    assert (len(queue), queue.background, queue.tally.jobs) == (2, 1, 2)
