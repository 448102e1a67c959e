"""One loaded model: its bounded queue, who gets the next batch, and the lane it runs in.

A pool queues its model's requests (:meth:`ModelPool.submit`), makes idle workers ready for what
is queued, gives each its batch when its slot gives it a turn (:meth:`ModelPool.take_batch`) and
hears how the batch went. It is composed of two parts: the workers, from their start to their
retirement (:class:`~mmserver.serving.workers.WorkerGroup`), and the model's copies in the
backend slots with the memory they take (:class:`~mmserver.serving.binding.Copies`). What every
request and every batch passes through is the pool's own code, not a call into a part: it runs
tens of thousands of times a second.

The pool keeps the model's measured cost; when the cost calls for the other lane
(:func:`~mmserver.policy.scheduling.lane_now`), the model's workers move there: new ones start
in the new lane and the old ones leave as soon as they are not running a batch.

Concurrency contract: every method runs on the event loop; :meth:`submit` is synchronous, so the
scaling check after an enqueue cannot interleave with another request's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mmserver import errors
from mmserver.backend.placement import BackendPool, Slot, env_lane
from mmserver.backend.wire import LoadInfo
from mmserver.codecs.requests import Request
from mmserver.config.server import ModelConfig
from mmserver.envs.registry import Environment
from mmserver.ops.metrics import Metrics, ModelRequests
from mmserver.ops.series import CounterChild
from mmserver.ops.traces import Trace
from mmserver.policy.scaling import (
    PoolSnapshot,
    should_add_background_worker,
    should_add_worker,
    should_retire,
)
from mmserver.policy.scheduling import LIGHT, Cost, lane_bounds, lane_for, lane_now
from mmserver.serving.alarm import Alarm
from mmserver.serving.binding import Copies
from mmserver.serving.jobs import NORMAL, Job, JobQueue, Tally, cut_batch, waited_too_long
from mmserver.serving.worker import Worker
from mmserver.serving.workers import WorkerGroup

log = logging.getLogger(__name__)


_new_tuple = tuple.__new__


class PoolEvents(Protocol):
    """What a pool tells its owner (the room of loaded models, :mod:`mmserver.lifecycle.room`) as it
    happens, so that the owner keeps its own server-wide counts without a pass over the pools.
    Each is called on the event loop, synchronously, once the pool's own state has changed."""

    #: The jobs queued for every model: the pool's queue counts its own in it.
    queued: Tally

    def pool_loaded(self, pool: ModelPool, info: LoadInfo) -> None:
        """The model's first copy is loaded: :attr:`ModelPool.copy_bytes` is measured."""

    def pool_idle(self, pool: ModelPool) -> None:
        """A batch ended and the model has nothing queued or running: it may be evicted."""

    def pool_memory_changed(self, pool: ModelPool, change: int) -> None:
        """:attr:`ModelPool.accounted_bytes` changed by ``change`` bytes."""

    def pool_moved(self, pool: ModelPool, old_lane: str) -> None:
        """The model moved from ``old_lane`` to :attr:`ModelPool.lane`."""


class ModelPool:
    """The queue and workers of one loaded model (see the module docstring): what its owner and
    its workers call. Its workers' lifetime is its :class:`WorkerGroup`'s, its copies in the
    backend slots are its :class:`Copies`. Its attributes are slots: the per-request path reads
    them from a thousand pools in turn (a plain instance past 30 attributes keeps them in a dict
    of its own, looked up by hash on every read)."""

    __slots__ = (
        "_copies",
        "_delay",
        "_dispatch_handle",
        "_expiry",
        "_group",
        "_idle",
        "_lane_since",
        "_loop",
        "_m_batch",
        "_m_cpu",
        "_m_paths",
        "_m_predict",
        "_m_queue_wait",
        "_m_waited",
        "_metrics",
        "_reap_handle",
        "_stay_high",
        "_stay_low",
        "backend",
        "config",
        "cost",
        "env",
        "events",
        "key",
        "lane",
        "model_dir",
        "name",
        "queue",
        "readied",
        "requests",
        "running",
        "stopped",
        "unloading",
        "workers",
    )

    def __init__(
        self,
        name: str,
        key: str,
        model_dir: Path,
        config: ModelConfig,
        backend: BackendPool,
        metrics: Metrics,
        events: PoolEvents,
        measured: Measured | None = None,
        env: Environment | None = None,
    ) -> None:
        """``key`` names this load of the model in the backend slots. ``measured`` is what an
        earlier load of the model measured, if there was one: the CPU seconds one of its
        requests took choose the lane its first workers start in, and the memory of one copy is
        what :attr:`accounted_bytes` counts until this load measures it. ``env``: the model
        environment it runs in (``None``: the server's own), whose lane it keeps."""
        measured = measured or Measured()
        known = measured.hold
        self.name = name
        self.key = key
        self.model_dir = model_dir
        self.config = config
        self.backend = backend
        self.events = events
        self.queue = JobQueue(config.job_queue_size, events.queued)
        #: Batches of the model running, and workers of it waiting for their slots (ready):
        #: its workers count them (see :class:`~mmserver.serving.worker.WorkerHost`).
        self.running = 0
        self.readied = 0
        self.cost = Cost(known)
        self.lane = lane_for(LIGHT, known, backend.heavy_batch_s)
        #: The CPU seconds a request may take for the model to stay in its lane.
        self._stay_low, self._stay_high = lane_bounds(self.lane, backend.heavy_batch_s)
        if config.trust.own_process:  # in a process of its own: no lane to move to
            self.lane = LIGHT
            self._stay_low, self._stay_high = -math.inf, math.inf
        #: The model environment the model runs in: its processes are its lane's, and only its.
        self.env = env
        if env is not None:
            self.lane = env_lane(env.key)
            self._stay_low, self._stay_high = -math.inf, math.inf
        self._lane_since = -float("inf")  # when it last moved (time.monotonic())
        self._loop = loop = asyncio.get_running_loop()
        self._dispatch_handle: asyncio.Handle | None = None
        #: The delayed dispatch, armed for when :func:`cut_batch` lets a batch go.
        self._delay = Alarm(loop, self._dispatch)
        #: Answers queued jobs 504 at their deadline (:meth:`_expire`), armed for the earliest.
        self._expiry = Alarm(loop, self._expire)
        self._reap_handle: asyncio.TimerHandle | None = None
        #: Set when :meth:`stop` begins: workers leaving now are not scaling.
        self.unloading = False
        #: Set when :meth:`stop` has drained: what is left is answered, no worker starts again.
        self.stopped = False
        self._copies = Copies(
            self,
            measured.copy_bytes,
            functools.partial(events.pool_loaded, self),
            functools.partial(events.pool_memory_changed, self),
        )
        self._group = WorkerGroup(self, backend, self._copies, metrics)
        #: The group's workers, and its idle ones (the most recently idle last: it is the one
        #: given the next batch, so the others stay idle long enough to retire). The same dict
        #: and list as the group's: the per-request path reads them without going through it.
        self.workers = self._group.workers
        self._idle = self._group.idle
        self._metrics = metrics
        self._m_queue_wait = metrics.queue_wait_seconds.labels(name)
        self._m_batch = metrics.batch_size.labels(name)
        self._m_predict = metrics.predict_seconds.labels(name)
        self._m_cpu = metrics.model_cpu_seconds.labels(name)
        self._m_waited = metrics.model_waited_batches.labels(name)
        self._m_paths: dict[str, CounterChild] = {}
        #: The series of this model's answered requests, counted by the HTTP layer.
        self.requests = ModelRequests(metrics, name)
        self._group.refuse_if_stopped()

    # Requests ---------------------------------------------------------------------------------

    def submit(
        self,
        request: Request,
        deadline: float | None,
        client_gone: Callable[[], bool] | None,
        arrived: float | None = None,
        background: bool = False,
        priority: int = NORMAL,
        trace: Trace | None = None,
    ) -> asyncio.Future[bytes]:
        """Queue one request (raises :class:`errors.QueueFull` at once when full), then apply
        the scaling rule. The future's result is the answer's body. ``deadline`` is on the event
        loop's clock; by default the model's predict_timeout from ``arrived`` (the request's
        arrival, before a load it waited for; by default now). A job still queued at its
        deadline is answered 504 then, not when a batch would have taken it. A ``background``
        job (an asynchronous request's) scales the model by its own rule
        (:func:`~mmserver.policy.scaling.should_add_background_worker`), not the real-time one.
        ``priority`` (:data:`~mmserver.serving.jobs.PRIORITY`) says who a full queue sheds
        first. A sampled request's ``trace`` records the job's way from now on."""
        loop = self._loop
        now = loop.time()
        if deadline is None:
            deadline = (now if arrived is None else arrived) + self.config.predict_timeout
        future: asyncio.Future[bytes] = loop.create_future()
        queue = self.queue
        passage = None if trace is None else trace.queued()
        queue.put(Job(request, future, now, deadline, client_gone, background, priority, passage))
        if deadline < self._expiry.at:  # only an earlier deadline moves the alarm
            self._expiry.arm(deadline)
        if self._idle and self._dispatch_handle is None:
            if self.running:
                # A batch of this model is running: the requests arriving in this turn of the
                # event loop go together, in the next one.
                self._dispatch_handle = self._loop.call_soon(self._dispatch)
            else:
                self._dispatch()
        if should_add_worker(self.snapshot()):
            self._group.add("queue")
        elif background and should_add_background_worker(
            len(self.workers),
            queue.background,
            self.config.async_max_workers,
            self.config.max_workers,
        ):
            self._group.add("asynchronous requests")
        return future

    # Batches ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Make idle workers ready for what is queued: one per ``batch_size`` jobs not yet
        covered by a ready worker, and any whose slot is free while jobs wait, as long as
        :func:`~mmserver.serving.jobs.cut_batch` lets a batch go (otherwise try again when it says).
        A worker whose slot is free goes first; otherwise the one idle most recently."""
        self._dispatch_handle = None
        queue, idle = self.queue, self._idle
        config = self.config
        while idle:
            take, due = cut_batch(
                len(queue.jobs),
                queue.oldest_enqueued_at(),
                self._loop.time(),
                config.batch_size,
                config.batch_delay_s,
            )
            if not take:
                if due is None:
                    break  # nothing queued
                if due < self._delay.at:  # not armed for as early already
                    self._delay.arm(due)
                return
            uncovered = len(queue.jobs) > self.readied * config.batch_size
            if uncovered and len(idle) == 1:
                worker = idle.pop()  # the common case: no choice to make
            else:
                free = next((i for i in range(len(idle) - 1, -1, -1) if idle[i].slot.free()), None)
                if free is not None:
                    worker = idle.pop(free)
                elif uncovered:
                    worker = idle.pop()
                else:
                    break  # ready workers cover the queue, and none of ours could run sooner
            worker.request_turn()
        if idle and len(self.workers) > self.config.min_workers:
            self._arm_reaper()

    def take_batch(self) -> list[Job]:
        """The jobs of a worker's next batch (none when nothing is queued)."""
        queue = self.queue
        config = self.config
        return queue.take(config.batch_size, config.max_batch_bytes) if queue.jobs else []

    def waited(self, batches: int) -> None:
        self.cost.waited += batches
        self._m_waited.inc(batches)

    def observe_cost(
        self,
        cpu_seconds: float,
        wall_seconds: float,
        rows: int,
        requests: int,
        charged: float,
        path: str,
    ) -> None:
        """Count a batch's cost (``requests`` requests of ``rows`` rows in all, charged
        ``charged`` CPU seconds when it started) and its predict path, and move the model to
        the lane its cost calls for."""
        if rows:
            counter = self._m_paths.get(path)
            if counter is None:
                counter = self._m_paths[path] = self._metrics.model_path_batches.labels(
                    self.name, path
                )
            counter.value += 1
        cost = self.cost
        cost.observe(cpu_seconds, wall_seconds, rows, requests, charged)
        self._m_cpu.value += cpu_seconds
        single = cost.single
        # Within its lane's bounds (kept here) a model stays: the decision is asked only outside.
        if not self._stay_low <= single <= self._stay_high and not self.unloading:
            lane = lane_now(
                self.lane, single, self.backend.heavy_batch_s, time.monotonic(), self._lane_since
            )
            if lane != self.lane:
                self._move(lane)

    def _move(self, lane: str) -> None:
        """Run in ``lane`` from now on: workers start there (at least one, at least
        ``minWorkers``; the scaling rule adds more as the queue asks), and those elsewhere leave
        once they are not running a batch or loading (:meth:`worker_idle`)."""
        old, self.lane = self.lane, lane
        self._lane_since = time.monotonic()
        self.events.pool_moved(self, old)
        self._stay_low, self._stay_high = lane_bounds(lane, self.backend.heavy_batch_s)
        self._metrics.model_lane.remove(self.name, old)  # the scrape sets the new one
        self._metrics.model_lane_moves.labels(self.name).inc()  # a series once it moved
        cost = self.cost
        log.info(
            "model %s: moves to the %s lane (a request takes %.3f ms of CPU at %.0f rows, "
            "its batches %.3f ms)",
            self.name,
            lane,
            cost.single * 1000,
            cost.rows_per_request,
            (cost.per_batch if cost.per_batch is not None else cost.single) * 1000,
            extra={"model": self.name},
        )
        self._group.follow_lane()

    def _expire(self) -> None:
        """Answer 504 the queued jobs whose deadline has passed (waiting for a batch, a
        worker or a turn on a process), and watch the earliest deadline left."""
        expired, earliest = self.queue.expire(self._loop.time())
        for job in expired:
            job.fail(waited_too_long())
        if earliest is not None and not self.stopped:
            self._expiry.arm(earliest)
        elif self.queue.closed:
            self._group.drained()

    def worker_idle(self, worker: Worker) -> None:
        """``worker`` has loaded its model or finished a batch: give it the next batch, retire
        it, or keep it idle."""
        queue = self.queue
        if self.stopped or (queue.closed and not queue.jobs):
            worker.exit(None)
            self._group.drained()
            return
        if worker.slot.lane.name != self.lane or should_retire(
            self.snapshot(), 0.0, self.config.max_idle_time
        ):
            worker.exit(None)
            return
        self._idle.append(worker)
        if queue.jobs:
            self._dispatch()
        elif len(self.workers) > self.config.min_workers:
            self._arm_reaper()

    def _arm_reaper(self, delay: float | None = None) -> None:
        if self._reap_handle is None:
            self._reap_handle = self._loop.call_later(
                self.config.max_idle_time if delay is None else delay, self._reap
            )

    def _reap(self) -> None:
        """Retire workers idle for ``max_idle_time`` above ``minWorkers``
        (:meth:`WorkerGroup.retire_idle`), and come back when the next may retire."""
        self._reap_handle = None
        delay = self._group.retire_idle(self._loop.time())
        if delay is not None:
            self._arm_reaper(delay)

    @property
    def busy(self) -> bool:
        """Has queued or running jobs: never evicted."""
        return bool(self.queue.jobs) or self.running > 0

    def snapshot(self) -> PoolSnapshot:
        c = self.config
        queue = self.queue
        # Made by tuple's own __new__: the named tuple's is a Python call (twice a request).
        return _new_tuple(
            PoolSnapshot,
            (
                len(self.workers),
                len(queue.jobs) - queue.background,
                c.min_workers,
                c.max_workers,
                c.batch_size,
            ),
        )

    def observe_batch(self, batch: list[Job], started: float, seconds: float) -> None:
        self._m_batch.observe(len(batch))
        self._m_predict.observe(seconds)
        for job in batch:
            self._m_queue_wait.observe(started - job.enqueued_at)
        if not self.running and not self.queue.jobs:
            self.events.pool_idle(self)

    # Workers and copies -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start ``minWorkers`` workers and wait until the model is loaded in their slots.
        Raises the load error of the first worker that failed."""
        await self._group.start()

    async def bind(self, slot: Slot) -> None:
        """Make sure this model is loaded in ``slot`` (one load per slot, shared by workers)."""
        info = await self._copies.load(slot)
        probe = info.probe_seconds
        if self.cost.hold is None and probe is not None:
            # The probe row's cost is the first estimate: a heavy model leaves the light lane
            # before its first batch runs there.
            self.cost.set_probe(probe)
            if not self._stay_low <= probe <= self._stay_high and not self.unloading:
                lane = lane_now(
                    self.lane, probe, self.backend.heavy_batch_s, time.monotonic(), self._lane_since
                )
                if lane != self.lane:
                    self._move(lane)

    def worker_exited(self, worker: Worker, error: BaseException | None) -> None:
        """Forget ``worker``; unload the model from its slot if no other worker is there."""
        self._group.exited(worker, error)

    @property
    def copy_bytes(self) -> int:
        """The memory of one copy of the model (0 until its first load is measured)."""
        return self._copies.copy_bytes

    @property
    def memory_bytes(self) -> int:
        """The memory of the model's copies loaded or loading."""
        return self._copies.memory_bytes

    @property
    def accounted_bytes(self) -> int:
        """The memory counted for this model by the eviction policy
        (:attr:`Copies.accounted_bytes`)."""
        return self._copies.accounted_bytes

    @property
    def paths(self) -> dict[str, Any] | None:
        """The family and predict paths the model's first load reported (``None``: a custom
        handler, or not loaded yet)."""
        return self._copies.paths

    def path_batches(self) -> dict[str, int]:
        """The batches each predict path took."""
        return {name: int(c.value) for name, c in self._m_paths.items()}

    # Management -------------------------------------------------------------------------------

    async def rescale(self, config: ModelConfig) -> None:
        """Apply new limits live: queued and running jobs are kept (with ``maxWorkers`` 0,
        queued jobs are answered 503)."""
        self.config = config
        self.queue.maxsize = config.job_queue_size
        started = self._group.rescale()
        if self._idle and self.queue.jobs:
            self._dispatch()  # the new batch size or delay may let a batch go now
        if started:
            await asyncio.gather(*(w.ready for w in started))

    async def warm(self, workers: int) -> None:
        """Start workers until the model has ``workers`` (at most ``maxWorkers``), as it had
        before a restart (:mod:`mmserver.lifecycle.warmset`), and wait for their loads; those
        above ``minWorkers`` retire when idle, as any do. A worker that fails to load is the
        pool's to report, as any is; a cancelled wait leaves the workers be."""
        started = self._group.grow(workers)
        if started:
            await asyncio.wait([w.ready for w in started])

    async def stop(self, drain_timeout: float | None, unload: bool = True) -> None:
        """Refuse new jobs; let the workers answer what is queued (up to ``drain_timeout``
        seconds; ``None`` = do not wait); answer the rest with 503; stop the workers and unload
        the model from every slot (unless ``unload`` is false: the server is stopping, and the
        backend processes with it, some maybe still held by a prediction past the drain)."""
        self.unloading = True
        self.queue.close()
        if self._idle and self.queue.jobs:
            self._dispatch()
        self._group.drained()
        if drain_timeout:
            await self._group.wait_left(drain_timeout)
        self.stopped = True
        for handle in (self._dispatch_handle, self._reap_handle):
            if handle is not None:
                handle.cancel()
        self._dispatch_handle = self._reap_handle = None
        self._delay.cancel()
        self._expiry.cancel()
        for job in self.queue.drain():
            job.fail(errors.ShuttingDown("the model was unloaded before this request ran"))
        await self._group.stop()
        await self._copies.leave_all(self.backend.slots, unload)
        if self.env is not None:
            self.env.leave(self.name)


@dataclass(slots=True)
class Measured:
    """What the loads of a model measured, for the next load's estimate and lane: remembered
    across its unloads (:class:`~mmserver.lifecycle.catalog.Catalog`, bounded), read by its pool
    when it starts, written by the catalog when a load has measured them."""

    #: Bytes of one loaded copy (0: not measured yet).
    copy_bytes: int = 0
    #: CPU seconds one request of the model took alone, which chose its lane
    #: (:attr:`~mmserver.policy.scheduling.Cost.single`; ``None``: no batch ran yet).
    hold: float | None = None
