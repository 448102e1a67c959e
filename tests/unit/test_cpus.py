"""The CPU reserve on real processes: the heavy lane's processes keep off the reserved CPUs
while light batches are sent and get every CPU back once they stop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mmserver.backend.cpus import CpuReserve, allowed_cpus, set_process_cpus

EVERY = allowed_cpus()
needs_two_cpus = pytest.mark.skipif(len(EVERY) < 2, reason="needs two CPUs to reserve one")


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU masks of every thread of ``pid``."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two idle processes with a second thread each, standing in for heavy backends."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start()"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(2)
    ]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


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
    changes: list[int] = []
    changed = asyncio.Event()

    def on_change(count: int) -> None:
        changes.append(count)
        changed.set()

    reserve = CpuReserve(1, lambda: pids, hold=0.05, on_change=on_change)
    narrow = EVERY - {min(EVERY)}
    assert reserve.narrow == narrow
    for _ in range(2):  # and again after a quiet spell
        reserve.light_batch()
        reserve.light_batch()  # already narrowed: one change
        assert reserve.narrowed and reserve.heavy_cpus == narrow
        assert [thread_cpus(pid) for pid in pids] == [{narrow}, {narrow}]
        assert changes[-1] == len(narrow)
        changed.clear()
        await asyncio.wait_for(changed.wait(), 30)
        assert not reserve.narrowed and reserve.heavy_cpus == EVERY
        assert [thread_cpus(pid) for pid in pids] == [{EVERY}, {EVERY}]
        assert changes[-1] == len(EVERY)
    assert changes == [len(narrow), len(EVERY)] * 2
    assert reserve.narrowings == 2 and reserve.batches == 4


@needs_two_cpus
async def test_a_check_keeps_the_reserve_while_batches_come_and_a_new_process_is_placed(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    first, late = (proc.pid for proc in sleepers)
    reserve = CpuReserve(1, lambda: [first], hold=3600.0)  # checked here, not by the timer
    narrow = EVERY - {min(EVERY)}
    reserve.light_batch()
    for _ in range(3):  # a check that finds a batch sent since the last one keeps the reserve
        reserve.light_batch()
        reserve.check()
        assert reserve.narrowed and thread_cpus(first) == {narrow}
    reserve.place(late)  # started meanwhile, with every CPU
    assert thread_cpus(late) == {narrow}
    reserve.check()  # no batch since the last check
    assert not reserve.narrowed and thread_cpus(first) == {EVERY}
    reserve.place(late)  # not narrowed: left as it is
    assert thread_cpus(late) == {narrow}
    reserve.check()  # nothing to do
    assert not reserve.narrowed and reserve.narrowings == 1
    reserve.close()


def test_a_process_that_is_gone_is_not_placed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert set_process_cpus(proc.pid, EVERY) is False
