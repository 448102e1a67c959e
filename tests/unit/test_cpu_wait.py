"""A batch's hold leaves out the time it waited for a CPU (:func:`cpu_wait_seconds`): another
process's work on the same CPU is not the model's cost."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from mmserver.backend.child import cpu_wait_seconds


def _spin(
    ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
) -> None:
    ready.set()
    while not stop.is_set():
        pass


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux schedstat")
def test_time_waiting_for_a_busy_cpu_is_counted() -> None:
    """This thread and a spinning process share one CPU: while the thread computes 50 ms of CPU
    time, the scheduler keeps it waiting for a share of that CPU."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    spinner = context.Process(target=_spin, args=(ready, stop), daemon=True)
    try:
        spinner.start()  # inherits the one-CPU mask
        assert ready.wait(30)
        waited = cpu_wait_seconds()
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass
        assert cpu_wait_seconds() - waited > 0.005
    finally:
        stop.set()
        spinner.join(30)
        os.sched_setaffinity(0, before)


def test_cpu_wait_never_goes_back() -> None:
    first = cpu_wait_seconds()
    assert first >= 0.0
    assert cpu_wait_seconds() >= first
