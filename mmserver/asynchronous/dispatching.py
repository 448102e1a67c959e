"""Dispatching asynchronous requests (step 2 of :mod:`mmserver.asynchronous.runner`): the queue of
the accepted requests, per model in the order they were accepted, and the loop that starts them
under the admission rules (:mod:`mmserver.asynchronous.admission`).

A queued request starts when its model may run one more asynchronous request
(``option.async_max_workers``) and real-time requests leave room (:func:`room_for_async`: none is
queued, and fewer than ``max_running`` asynchronous requests run); while real-time requests keep
the event loop busy, one starts every :data:`~mmserver.asynchronous.admission.START_PACE_S`. The
models take turns: once one of its requests starts, a model's next waits for the others'. A
request not started within its TTL expires instead (the queue is swept every :data:`SWEEP_S`);
after the server lacked room to run one, its model's requests wait :data:`RETRY_AFTER_S`.

The :class:`Dispatcher` owns the tasks of its loop and of the running requests (each ended by
:class:`~mmserver.asynchronous.running.Runner`), and begins the journal's hourly pruning.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver.asynchronous.admission import YIELD_S, Intake, room_for_async
from mmserver.asynchronous.journal import Invocation
from mmserver.asynchronous.running import Runner
from mmserver.asynchronous.settling import Settler
from mmserver.config.server import ServerConfig
from mmserver.ops.metrics import Metrics

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager

log = logging.getLogger(__name__)

#: Seconds a model's queued requests wait after the server lacked room to run one.
RETRY_AFTER_S = 1.0
#: Seconds between the sweeps that expire queued requests past their TTL.
SWEEP_S = 1.0
#: Seconds between prunings of the journal (:meth:`Settler.prune
#: <mmserver.asynchronous.settling.Settler.prune>`).
PRUNE_EVERY_S = 3600.0


class Dispatcher:
    """Queues the accepted requests of one server and starts them (module docstring), from
    :meth:`start` to :meth:`close`.

    Its loop looks again when ``wake`` is set (a request queued, one ended) or after the wait
    the last look named. It owns that loop's task and the running requests' tasks:
    :meth:`close` cancels the loop; :meth:`stop` awaits it, gives the running requests their
    drain time, then cancels and awaits those left."""

    def __init__(
        self,
        config: ServerConfig,
        wlm: WorkLoadManager,
        metrics: Metrics,
        intake: Intake,
        runner: Runner,
        settler: Settler,
        *,
        max_running: int,
        wake: asyncio.Event,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._wlm = wlm
        self._metrics = metrics
        #: When requests start while real-time requests keep the event loop busy.
        self.intake = intake
        self._runner = runner
        self._settler = settler
        #: At most this many requests run at once, over every model.
        self._max_running = max_running
        self._wake = wake
        self._clock = clock
        #: Queued requests per model, in the order they were accepted; the models in the
        #: order they get their next turn.
        self._queued: dict[str, collections.deque[Invocation]] = {}
        #: The requests in :attr:`_queued` (kept as they come and go: read at every accept).
        self._queued_count = 0
        self._running: dict[str, asyncio.Task[None]] = {}
        self._per_model: collections.Counter[str] = collections.Counter()
        self._not_before: dict[str, float] = {}
        self._open = False
        self._task: asyncio.Task[None] | None = None
        self._last_sweep = 0.0
        self._pruning: asyncio.Task[None] | None = None

    @property
    def open_requests(self) -> int:
        """Requests queued or running."""
        return self._queued_count + len(self._running)

    def enqueue(self, invocation: Invocation, front: bool = False) -> None:
        """Queue ``invocation`` behind its model's others (``front``: before them)."""
        queue = self._queued.get(invocation.model)
        if queue is None:
            queue = self._queued[invocation.model] = collections.deque()
        if front:
            queue.appendleft(invocation)
        else:
            queue.append(invocation)
        self._queued_count += 1
        self._wake.set()

    # Lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop that starts the queued requests."""
        self._open = True
        self._task = asyncio.get_running_loop().create_task(
            self._dispatch_forever(), name="mmserver-async-dispatcher"
        )

    def close(self) -> None:
        """Start nothing more; a request the server lacks room for stays out of the queue (its
        row says ``queued``, for the next start)."""
        self._open = False
        if self._task is not None:
            self._task.cancel()

    async def stop(self, drain_timeout: float) -> None:
        """Once closed: let running requests end for up to ``drain_timeout`` seconds, then
        cancel the rest and wait for them (the ends they began are the settler's to finish)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        running = list(self._running.values())
        if running and drain_timeout:
            await asyncio.wait(running, timeout=drain_timeout)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    # Starting ---------------------------------------------------------------------------------

    async def _dispatch_forever(self) -> None:
        while True:
            self._wake.clear()
            wait = self._start_what_may_run()
            if wait is None:
                await self._wake.wait()
                continue
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _start_what_may_run(self) -> float | None:
        """Start the requests that may run now, one model after another; the seconds after
        which to look again (``None``: only when something changes)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._queued and self._clock() - self._last_sweep >= SWEEP_S:
            self._sweep()
        if self._clock() - self._settler.last_prune >= PRUNE_EVERY_S and self._pruning is None:
            self._pruning = self._settler.begin(self._settler.prune())
            self._pruning.add_done_callback(self._pruned)
        wait = SWEEP_S if self._queued else None
        for model in list(self._queued):
            if not room_for_async(
                self._wlm.real_time_queued, len(self._running), self._max_running
            ):
                if self._wlm.real_time_queued:
                    self._metrics.async_yields.inc()
                    wait = YIELD_S
                break
            queue = self._queued[model]
            not_before = self._not_before.get(model, 0.0)
            if not_before > now:
                wait = min(SWEEP_S, not_before - now)
                continue
            pool = self._wlm.room.loaded.get(model)
            limit = pool.config.async_max_workers if pool else self._config.async_max_workers
            if self._per_model[model] >= limit:
                continue
            pause = self.intake.start_pause()
            if pause:  # real time keeps the event loop busy: one start at a time
                self._metrics.async_yields.inc()
                wait = pause if wait is None else min(wait, pause)
                break
            invocation = queue.popleft()
            self._queued_count -= 1
            if not queue:
                del self._queued[model]
            else:  # its next request waits for the other models' turns
                self._queued[model] = self._queued.pop(model)
            self._start(invocation)
        return wait

    def _pruned(self, task: asyncio.Task[None]) -> None:
        self._pruning = None
        if not task.cancelled() and task.exception() is not None:
            log.error("the asynchronous journal could not be pruned: %s", task.exception())

    def _sweep(self) -> None:
        """Expire the queued requests past their TTL."""
        now = self._last_sweep = self._clock()
        for model in list(self._queued):
            queue = self._queued[model]
            expired = [i for i in queue if i.expires_at <= now]
            if not expired:
                continue
            left = collections.deque(i for i in queue if i.expires_at > now)
            self._queued_count -= len(expired)
            if left:
                self._queued[model] = left
            else:
                del self._queued[model]
            for invocation in expired:
                self._settler.begin(self._settler.expire(invocation))

    # Running ----------------------------------------------------------------------------------

    def _start(self, invocation: Invocation) -> None:
        self._per_model[invocation.model] += 1
        task = asyncio.get_running_loop().create_task(
            self._run(invocation), name=f"mmserver-async-{invocation.id}"
        )
        self._running[invocation.id] = task
        task.add_done_callback(lambda t: self._run_ended(invocation, t))

    async def _run(self, invocation: Invocation) -> None:
        """Run ``invocation``; if it went back to the queue, its model's requests wait
        :data:`RETRY_AFTER_S` and it is first of them (unless the dispatcher is closed)."""
        if await self._runner.run(invocation) and self._open:
            loop = asyncio.get_running_loop()
            self._not_before[invocation.model] = loop.time() + RETRY_AFTER_S
            self.enqueue(invocation, front=True)

    def _run_ended(self, invocation: Invocation, task: asyncio.Task[None]) -> None:
        self._running.pop(invocation.id, None)
        self._per_model[invocation.model] -= 1
        if not self._per_model[invocation.model]:
            del self._per_model[invocation.model]
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "asynchronous request %s of %s failed",
                invocation.id,
                invocation.model,
                exc_info=task.exception(),
            )
        self._wake.set()

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges of the queued requests (called before a scrape)."""
        backlog = self._metrics.async_backlog
        now = self._clock()
        seen = set()
        oldest = None
        for model, queue in self._queued.items():
            backlog.labels(model).set(len(queue))
            seen.add(model)
            first = queue[0].accepted_at if queue else None
            if first is not None and (oldest is None or first < oldest):
                oldest = first
        for (model,), _, _ in backlog.series():
            if model not in seen:
                backlog.remove(model)
        self._metrics.async_oldest_seconds.set(0.0 if oldest is None else max(0.0, now - oldest))
