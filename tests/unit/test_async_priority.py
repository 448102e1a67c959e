"""Real time first: the rules that keep asynchronous (background) work to what real-time traffic
leaves, as tables over snapshots."""

from __future__ import annotations

import asyncio

import pytest

from mmserver.asynchronous.admission import BUSY, LOOK_S, START_PACE_S, Intake, room_for_async
from mmserver.policy.scaling import (
    PoolSnapshot,
    background_share,
    should_add_background_worker,
    should_add_worker,
)
from mmserver.serving.jobs import Job, JobQueue, Tally


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


class _Meter:
    """What an :class:`Intake` reads: the clock, the loop thread's CPU time, the real-time
    arrivals, set by the test; and the calls it paced."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 10.0
        self.arrived = 0
        self.paced = 0

    def intake(self) -> Intake:
        return Intake(lambda: self.arrived, self._pace, lambda: self.now, lambda: self.cpu)

    def _pace(self) -> None:
        self.paced += 1

    def look(self, cpu_share: float, arrivals: int) -> None:
        """A look's time (and a half) passes, with the loop on the CPU for ``cpu_share`` of it."""
        self.now += 1.5 * LOOK_S
        self.cpu += cpu_share * 1.5 * LOOK_S
        self.arrived += arrivals


@pytest.mark.parametrize(
    ("cpu_share", "arrivals", "busy"),
    [
        (0.9, 10, True),  # real-time requests keep the loop busy: calls are paced
        (BUSY + 0.1, 1, True),
        (BUSY - 0.1, 10, False),  # real-time requests leave the loop room
        (0.9, 0, False),  # busy with no real-time request: the calls themselves, say
    ],
)
def test_intake_paces_calls_only_while_real_time_keeps_the_loop_busy(
    cpu_share: float, arrivals: int, busy: bool
) -> None:
    meter = _Meter()
    intake = meter.intake()
    assert not intake.busy()
    meter.look(cpu_share, arrivals)
    assert intake.busy() is busy
    meter.look(0.0, 0)  # the next look: quiet again
    assert not intake.busy()


async def test_paced_calls_are_accepted_one_at_a_time_in_their_order() -> None:
    meter = _Meter()
    intake = meter.intake()
    meter.look(0.9, 5)
    assert intake.busy()
    await intake.take()  # the first goes at once
    accepted: list[int] = []

    async def call(number: int) -> None:
        await intake.take()
        accepted.append(number)

    calls = [asyncio.create_task(call(n)) for n in range(3)]
    await calls[0]
    assert accepted == [0]  # one turn: the others still wait theirs
    assert meter.paced == 3
    await calls[1]
    assert accepted == [0, 1]
    meter.look(0.1, 0)  # quiet again: what waits goes at once, what comes is not held
    await calls[2]
    await intake.take()
    assert (accepted, meter.paced) == ([0, 1, 2], 3)


async def test_a_call_that_leaves_while_it_waits_gives_its_turn_to_the_next() -> None:
    meter = _Meter()
    intake = meter.intake()
    meter.look(0.9, 5)
    await intake.take()
    leaving = asyncio.create_task(intake.take())
    staying = asyncio.create_task(intake.take())
    await asyncio.sleep(0)  # both wait their turns
    leaving.cancel()
    await staying
    assert leaving.cancelled()
    assert meter.paced == 2


def test_requests_start_one_at_a_time_while_real_time_keeps_the_loop_busy() -> None:
    meter = _Meter()
    intake = meter.intake()
    assert [intake.start_pause() for _ in range(3)] == [0.0, 0.0, 0.0]  # quiet: all at once
    meter.look(0.9, 5)
    assert intake.start_pause() == 0.0  # busy: the first starts, and takes the turn
    assert intake.start_pause() == pytest.approx(START_PACE_S)
    meter.look(0.9, 5)
    waited = 1.5 * LOOK_S
    while waited < START_PACE_S:  # still busy: the next waits the rest of its turn
        assert intake.start_pause() == pytest.approx(START_PACE_S - waited)
        meter.look(0.9, 5)
        waited += 1.5 * LOOK_S
    assert intake.start_pause() == 0.0  # its turn came
    assert intake.start_pause() == pytest.approx(START_PACE_S)
    meter.look(0.1, 0)  # quiet again: the rest start at once
    assert [intake.start_pause() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert meter.paced == 0  # what counts the calls paced at acceptance
