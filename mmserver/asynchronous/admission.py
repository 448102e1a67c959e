"""Real time first: when an asynchronous request may start, and when it may be submitted to its
model. Asynchronous work takes only what real-time traffic leaves: nothing asynchronous is
submitted while a real-time request is queued for any model (they share the backends), and at
most all the backend processes but one have asynchronous requests submitted at once, so a
real-time request arriving meanwhile finds a process asynchronous work leaves free. Reading
inputs and writing answers overlap the predictions (:data:`IO_PER_PREDICTION`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: Asynchronous requests running at once (reading inputs, predicting, writing answers) per
#: request submitted to a model at once: the reading and writing overlap the predictions.
IO_PER_PREDICTION = 4
#: Seconds before looking again while real-time requests are queued.
YIELD_S = 0.005


def room_for_async(real_time_queued: int, running: int, max_running: int) -> bool:
    """Whether an asynchronous request may start (``running`` of ``max_running`` have), or be
    submitted to its model (``running`` of ``max_running`` are): only while no real-time
    request waits for any model."""
    return real_time_queued == 0 and running < max_running


class Turns:
    """The turns of asynchronous requests to be submitted to their models: at most ``limit``
    at once, and only while ``real_time_queued()`` is 0 (``yielded()`` is told each time one
    waits for that)."""

    def __init__(
        self, limit: int, real_time_queued: Callable[[], int], yielded: Callable[[], None]
    ) -> None:
        self.limit = limit
        self.active = 0
        self._real_time_queued = real_time_queued
        self._yielded = yielded
        self._ended = asyncio.Event()

    async def take(self) -> None:
        """Wait for a turn; the caller gives it back with :meth:`give_back`, whatever
        happens."""
        while not room_for_async(self._real_time_queued(), self.active, self.limit):
            self._ended.clear()
            if not self._real_time_queued():
                # Only a turn given back makes room: no looking again meanwhile.
                await self._ended.wait()
                continue
            self._yielded()
            try:  # real-time requests leave the queue untold: look again soon
                async with asyncio.timeout(YIELD_S):
                    await self._ended.wait()
            except TimeoutError:
                pass
        self.active += 1

    def give_back(self) -> None:
        self.active -= 1
        self._ended.set()
