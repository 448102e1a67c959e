"""The CPU reserve on real processes: the heavy lane's processes keep off the reserved CPUs
while light batches are sent and get every CPU back once they stop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mmserver.backend.cpus import CpuReserve, set_process_cpus
from mmserver.ops.capacity import affinity_mask

EVERY = affinity_mask()
needs_two_cpus = pytest.mark.skipif(len(EVERY) < 2, reason="needs two CPUs to reserve one")


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU masks of every thread of ``pid``."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two idle processes with a second thread each (started before they are handed out),
    standing in for heavy backends."""
    code = (
        "import sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 2
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


class Changes:
    """What the reserve reported, and an event for each report."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.event = asyncio.Event()

    def __call__(self, count: int) -> None:
        self.counts.append(count)
        self.event.set()

    async def next(self) -> int:
        await asyncio.wait_for(self.event.wait(), 30)
        self.event.clear()
        return self.counts[-1]


def test_the_reserve_leaves_at_least_one_cpu_to_the_heavy_lane() -> None:
    assert CpuReserve(1, list, cpus={0, 1, 2, 3}).narrow == {1, 2, 3}
    assert CpuReserve(3, list, cpus={4, 6, 7, 9}).narrow == {9}
    assert CpuReserve(8, list, cpus={0, 1}).narrow == {1}
    for count, cpus in ((0, {0, 1}), (1, {3}), (2, set())):
        reserve = CpuReserve(count, list, cpus=cpus)
        assert not reserve.enabled
        reserve.light_batch()  # nothing to keep free: no timer, nothing narrowed
        assert not reserve.narrowed and reserve.heavy_cpus == frozenset(cpus)


@needs_two_cpus
async def test_light_batches_narrow_the_heavy_processes_and_a_quiet_spell_widens_them(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    pids = [proc.pid for proc in sleepers]
    changes = Changes()
    reserve = CpuReserve(1, lambda: pids, hold=0.05, on_change=changes)
    narrow = EVERY - {min(EVERY)}
    assert reserve.narrow == narrow
    for _ in range(2):  # and again after a quiet spell
        reserve.light_batch()
        reserve.light_batch()  # already narrowed: one change
        assert reserve.narrowed and reserve.heavy_cpus == narrow
        assert await changes.next() == len(narrow)
        assert [thread_cpus(pid) for pid in pids] == [{narrow}, {narrow}]
        assert await changes.next() == len(EVERY)
        assert not reserve.narrowed and reserve.heavy_cpus == EVERY
        assert [thread_cpus(pid) for pid in pids] == [{EVERY}, {EVERY}]
    assert changes.counts == [len(narrow), len(EVERY)] * 2
    assert reserve.narrowings == 2 and reserve.batches == 4


@needs_two_cpus
async def test_a_check_keeps_the_reserve_while_batches_come_and_a_new_process_is_placed(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    first, late = (proc.pid for proc in sleepers)
    changes = Changes()
    reserve = CpuReserve(1, lambda: [first], hold=3600.0, on_change=changes)  # checked here
    narrow = EVERY - {min(EVERY)}
    reserve.light_batch()
    assert await changes.next() == len(narrow)
    for _ in range(3):  # a check that finds a batch sent since the last one keeps the reserve
        reserve.light_batch()
        reserve.check()
        assert reserve.narrowed and thread_cpus(first) == {narrow}
    reserve.place(late)  # started meanwhile, with every CPU
    assert thread_cpus(late) == {narrow}
    reserve.check()  # no batch since the last check
    assert not reserve.narrowed and thread_cpus(first) == {EVERY}
    assert changes.counts == [len(narrow), len(EVERY)]
    reserve.place(late)  # not narrowed: left as it is
    assert thread_cpus(late) == {narrow}
    reserve.check()  # nothing to do
    assert not reserve.narrowed and reserve.narrowings == 1
    reserve.close()
    reserve.light_batch()  # closed: the server is stopping
    assert not reserve.narrowed and reserve.narrowings == 1


async def test_a_refused_mask_turns_the_reserve_off(
    sleepers: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """A mask the system refuses (here a CPU that does not exist) is logged once; the reserve
    is off from then on and reports every CPU."""
    pid = sleepers[0].pid
    changes = Changes()
    reserve = CpuReserve(1, lambda: [pid], cpus={min(EVERY), 4095}, on_change=changes)
    reserve.light_batch()
    assert await changes.next() == 2
    assert not reserve.enabled and not reserve.narrowed
    assert thread_cpus(pid) == {frozenset({min(EVERY)})}  # every CPU it was given that exists
    assert [r.getMessage() for r in caplog.records] == [
        "the heavy lane's CPUs cannot be set ([Errno 22] Invalid argument): no CPU is kept "
        "free for it"
    ]
    reserve.light_batch()
    assert reserve.narrowings == 1 and not reserve.narrowed


def test_a_process_that_is_gone_is_not_placed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert set_process_cpus(proc.pid, EVERY) is False
