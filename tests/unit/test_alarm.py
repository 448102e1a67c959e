"""A pool's alarm: armed for a time, moved, cancelled, and disarmed when it rings."""

from __future__ import annotations

import asyncio
import math

from mmserver.serving.alarm import Alarm


async def test_an_alarm_rings_once_at_the_time_it_was_last_armed_for() -> None:
    loop = asyncio.get_running_loop()
    rang = asyncio.Event()
    seen: list[float] = []

    def ring() -> None:
        seen.append(alarm.at)
        rang.set()

    alarm = Alarm(loop, ring)
    assert alarm.at == math.inf  # not armed
    alarm.arm(loop.time() + 3600)
    due = loop.time()
    alarm.arm(due)  # moved: due now, uvloop's handle without a time
    assert alarm.at == due
    await rang.wait()
    assert seen == [math.inf]  # disarmed before its callback, which may arm it again
    assert alarm.at == math.inf


async def test_a_cancelled_alarm_does_not_ring() -> None:
    loop = asyncio.get_running_loop()
    rang: list[str] = []
    later = asyncio.Event()
    cancelled = Alarm(loop, lambda: rang.append("cancelled"))
    witness = Alarm(loop, later.set)
    cancelled.arm(loop.time())
    cancelled.cancel()
    assert cancelled.at == math.inf
    witness.arm(loop.time() + 0.01)  # rings after the cancelled one would have
    await later.wait()
    assert rang == []


async def test_an_alarm_armed_again_from_its_callback_rings_again() -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    rings = 0

    def ring() -> None:
        nonlocal rings
        rings += 1
        if rings < 3:
            alarm.arm(loop.time())
        else:
            done.set()

    alarm = Alarm(loop, ring)
    alarm.arm(loop.time())
    await done.wait()
    assert rings == 3
