"""Real time first: when an asynchronous request may start, and when it may be submitted to its
model. Asynchronous work takes only what real-time traffic leaves: nothing asynchronous is
submitted while a real-time request is queued for any model (they share the backends), and at
most all the backend processes but one have asynchronous requests submitted at once, so a
real-time request arriving meanwhile finds a process asynchronous work leaves free. Reading
inputs and writing answers overlap the predictions (:data:`IO_PER_PREDICTION`).

Accepting a call is work of the event loop too, and its clients may send as fast as they are
answered: while real-time requests arrive and keep the event loop busy, calls are accepted one
at a time, :data:`PACE_S` apart (:class:`Intake`); their 202s wait, their clients with them.
Measured with the bench's asynchronous section on the S3 test server (real-time p99 beside a
stream of calls over p99 alone, two servers, alternated rounds): 1.70 to 1.88 with the calls
paced, 2.04 to 2.40 without; the real-time requests answered beside them rose from 2,400-2,750
to 3,200-3,480 a second.

Running a request costs far more than accepting it, and not only on the event loop: with its
input and answer in S3, about 20 ms of CPU over the frontend, its object-call process and the
object store's client (measured beside the S3 test server), on the cores the real-time requests
need, whatever the niceness of the processes. So while the event loop is busy the same way,
requests also start one at a time, :data:`START_PACE_S` apart (:meth:`Intake.start_pause`).
Measured as above (three alternated rounds, the first round of each server apart): real-time
p99 beside over alone 1.68-1.76 with starts 100 ms apart, 1.30-1.47 with 250 ms; the real-time
requests answered beside them 3,470-3,890 and 4,150-4,320 a second, 2,840-2,930 with starts not
paced. On a machine where the real-time load alone answers three times as many requests (its
p99 near 1.5 ms), the bench's S3 runs measured 1.37-1.58 with 250 ms and 1.33-1.48 with 500 ms;
with the starts held the whole run, 1.29-1.36, within the spread of that machine's runs alone."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

#: Asynchronous requests running at once (reading inputs, predicting, writing answers) per
#: request submitted to a model at once: the reading and writing overlap the predictions.
IO_PER_PREDICTION = 4
#: Seconds before looking again while real-time requests are queued.
YIELD_S = 0.005
#: The share of its wall time the event loop's thread may spend on the CPU, with real-time
#: requests arriving, before calls are accepted one at a time...
BUSY = 0.5
#: ... this many seconds apart; measured over looks of this many seconds.
PACE_S = 0.01
LOOK_S = 0.1
#: Seconds between the starts of asynchronous requests meanwhile.
START_PACE_S = 0.5


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


class Intake:
    """When an asynchronous call is accepted, and when a request starts: at once, unless over
    the last look real-time requests arrived (``arrived()`` grew) and the event loop's thread
    spent at least :data:`BUSY` of the look's time on the CPU (``cpu()``, that thread's CPU
    time: use it only on the event loop); then one call at a time, :data:`PACE_S` apart, in the
    order they came, so that a stream of calls takes little of what the real-time requests need
    from the loop, and one start every :data:`START_PACE_S` (:meth:`start_pause`). ``paced()``
    is told of each call that waits. Waiting calls all go at once when the loop is no longer
    busy."""

    def __init__(
        self,
        arrived: Callable[[], int],
        paced: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self._arrived = arrived
        self._paced = paced
        self._clock = clock
        self._cpu = cpu
        self._since = clock()
        self._cpu_then = cpu()
        self._arrived_then = arrived()
        self._busy = False
        #: When the next call may be accepted, and the next request start, while the loop is
        #: busy.
        self._next = 0.0
        self._next_start = 0.0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def busy(self) -> bool:
        """Whether real-time requests keep the event loop busy (as of the last whole look)."""
        now = self._clock()
        if now - self._since >= LOOK_S:
            cpu, arrived = self._cpu(), self._arrived()
            self._busy = arrived > self._arrived_then and (
                cpu - self._cpu_then >= BUSY * (now - self._since)
            )
            self._since, self._cpu_then, self._arrived_then = now, cpu, arrived
        return self._busy

    def start_pause(self) -> float:
        """The seconds before an asynchronous request may start; 0.0: it may start now, and
        while the loop is busy that takes the turn (the next start comes
        :data:`START_PACE_S` later), so ask only for a request about to start."""
        if not self.busy():
            return 0.0
        now = self._clock()
        if now < self._next_start:
            return self._next_start - now
        self._next_start = now + START_PACE_S
        return 0.0

    async def take(self) -> None:
        """Wait for the call's turn to be accepted."""
        if not self._waiting:
            if not self.busy():
                return
            now = self._clock()
            if now >= self._next:
                self._next = now + PACE_S
                return
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiting.append(turn)
        self._paced()
        if self._timer is None:
            self._timer = loop.call_later(max(0.0, self._next - self._clock()), self._release)
        await turn

    def _release(self) -> None:
        """The next waiting call's turn (every waiting call's, once the loop is not busy)."""
        self._timer = None
        busy = self.busy()
        while self._waiting:
            turn = self._waiting.popleft()
            if turn.done():  # its caller left
                continue
            turn.set_result(None)
            if busy:
                break
        self._next = self._clock() + PACE_S
        if self._waiting:
            self._timer = asyncio.get_running_loop().call_later(PACE_S, self._release)
