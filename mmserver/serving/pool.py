"""One loaded model: its bounded queue, its workers, and the backend slots holding it.

The model is loaded into a slot when one of its workers is bound there, and only there; it is
unloaded from a slot when the last of its workers there stops. Workers of one model go to
different slots of the model's lane while there are any, least-loaded first
(:meth:`BackendPool.pick`). The pool keeps the model's measured cost; when the cost calls for the
other lane (:mod:`mmserver.policy.scheduling`), the model's workers move there: new ones start in
the new lane and the old ones leave as soon as they are not running a batch.

Concurrency contract: every method runs on the event loop; :meth:`submit` is synchronous, so the
scaling check after an enqueue cannot interleave with another request's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from mmserver import errors
from mmserver.backend import BackendPool, LoadInfo, LoadSpec, Slot
from mmserver.codecs.requests import Request
from mmserver.config.server import ModelConfig
from mmserver.ops.metrics import CounterChild, Metrics, ModelRequests
from mmserver.policy.scaling import (
    PoolSnapshot,
    should_add_background_worker,
    should_add_worker,
    should_retire,
    workers_to_start,
)
from mmserver.policy.scheduling import LIGHT, Cost, lane_bounds, lane_for, may_move
from mmserver.serving.jobs import Job, JobQueue, Tally, cut_batch, waited_too_long
from mmserver.serving.worker import Worker, WorkerState

log = logging.getLogger(__name__)


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
    """The queue and workers of one loaded model."""

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
    ) -> None:
        """``key`` names this load of the model in the backend slots. ``measured`` is what an
        earlier load of the model measured, if there was one: the seconds its batches held a
        backend choose the lane its first workers start in, and the memory of one copy is what
        :attr:`accounted_bytes` counts until this load measures it."""
        measured = measured or Measured()
        hold = measured.hold
        self.name = name
        self.key = key
        self.model_dir = model_dir
        self.config = config
        self.backend = backend
        self.events = events
        self.queue = JobQueue(config.job_queue_size, events.queued)
        self.workers: dict[int, Worker] = {}
        #: Workers per slot index (the slots the model is bound to).
        self._per_slot: collections.Counter[int] = collections.Counter()
        self.copy_bytes = 0  # memory of one copy, known after the first load
        #: Batches of the model running, and workers of it waiting for their slots (ready):
        #: its workers tell it (:meth:`batch_started`, :meth:`turn_requested`...).
        self.running = 0
        self.readied = 0
        self.cost = Cost(hold)
        self.lane = lane_for(LIGHT, hold, backend.heavy_batch_s)
        #: The seconds a batch may hold a process for the model to stay in its lane.
        self._stay_low, self._stay_high = lane_bounds(self.lane, backend.heavy_batch_s)
        self._lane_since = -float("inf")  # when it last moved (time.monotonic())
        self._next_id = 1
        self._loop = asyncio.get_running_loop()
        #: Idle workers, the most recently idle last: it is the one given the next batch, so
        #: the others stay idle long enough to retire.
        self._idle: list[Worker] = []
        self._dispatch_handle: asyncio.Handle | None = None
        #: The delayed dispatch (:meth:`_dispatch_at`) and its time. The time is kept here:
        #: uvloop's ``call_at`` for a time already reached returns a plain ``Handle``, which
        #: has no ``when()``.
        self._delay_handle: asyncio.Handle | None = None
        self._delay_at = 0.0
        #: Answers queued jobs 504 at their deadline (:meth:`_expire`), armed for the earliest.
        self._expiry_handle: asyncio.TimerHandle | None = None
        self._expiry_at = 0.0
        self._reap_handle: asyncio.TimerHandle | None = None
        self._slot_loads: dict[int, asyncio.Future[LoadInfo]] = {}
        self._known_bytes = measured.copy_bytes
        #: The memory counted for this model by the eviction policy (see accounted_bytes).
        self.accounted_bytes = measured.copy_bytes
        self._metrics = metrics
        self._m_scale_up = metrics.worker_scale.labels(name, "up")
        self._m_scale_down = metrics.worker_scale.labels(name, "down")
        self._m_queue_wait = metrics.queue_wait_seconds.labels(name)
        self._m_batch = metrics.batch_size.labels(name)
        self._m_predict = metrics.predict_seconds.labels(name)
        self._m_cpu = metrics.model_cpu_seconds.labels(name)
        self._m_waited = metrics.model_waited_batches.labels(name)
        self._m_paths: dict[str, CounterChild] = {}
        #: What the model's first load reported of its family and predict paths, pickled.
        self._paths: bytes | None = None
        #: The series of this model's answered requests, counted by the HTTP layer.
        self.requests = ModelRequests(metrics, name)
        self._stopped = False
        self._unloading = False  # set when stop() begins: workers leaving now are not scaling
        self._refuse_if_stopped()

    # Requests ---------------------------------------------------------------------------------

    def submit(
        self,
        request: Request,
        deadline: float | None,
        client_gone: Callable[[], bool] | None,
        arrived: float | None = None,
        background: bool = False,
    ) -> asyncio.Future[bytes]:
        """Queue one request (raises :class:`errors.QueueFull` at once when full), then apply
        the scaling rule. The future's result is the answer's body. ``deadline`` is on the event
        loop's clock; by default the model's predict_timeout from ``arrived`` (the request's
        arrival, before a load it waited for; by default now). A job still queued at its
        deadline is answered 504 then, not when a batch would have taken it. A ``background``
        job (an asynchronous request's) scales the model by its own rule
        (:func:`~mmserver.policy.scaling.should_add_background_worker`), not the real-time one."""
        loop = self._loop
        now = loop.time()
        if deadline is None:
            deadline = (now if arrived is None else arrived) + self.config.predict_timeout
        future: asyncio.Future[bytes] = loop.create_future()
        queue = self.queue
        queue.put(Job(request, future, now, deadline, client_gone, background))
        if self._expiry_handle is None or deadline < self._expiry_at:
            self._expire_at(deadline)
        if self._idle and self._dispatch_handle is None:
            if self.running:
                # A batch of this model is running: the requests arriving in this turn of the
                # event loop go together, in the next one.
                self._dispatch_handle = self._loop.call_soon(self._dispatch)
            else:
                self._dispatch()
        if should_add_worker(self.snapshot()):
            self._add_worker("queue")
        elif background and should_add_background_worker(
            len(self.workers),
            queue.background,
            self.config.async_max_workers,
            self.config.max_workers,
        ):
            self._add_worker("asynchronous requests")
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
            cut = cut_batch(
                len(queue),
                queue.oldest_enqueued_at(),
                self._loop.time(),
                config.batch_size,
                config.batch_delay_s,
            )
            if not cut.take:
                if cut.wait_until is None:
                    break  # nothing queued
                self._dispatch_at(cut.wait_until)
                return
            uncovered = len(queue) > self.readied * config.batch_size
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
        return queue.take(config.batch_size, config.max_batch_bytes) if len(queue) else []

    def turn_requested(self) -> None:
        """A worker of the model waits for its slot to run a batch."""
        self.readied += 1

    def turn_ended(self) -> None:
        """A worker that waited for its slot got its turn, or left."""
        self.readied -= 1

    def batch_started(self) -> None:
        self.running += 1

    def batch_ended(self) -> None:
        self.running -= 1

    def waited(self, batches: int) -> None:
        self.cost.waited += batches
        self._m_waited.inc(batches)

    def observe_cost(self, cpu_seconds: float, wall_seconds: float, rows: int, path: str) -> None:
        """Count a batch's cost and its predict path, and move the model to the lane its cost
        calls for."""
        if rows:
            counter = self._m_paths.get(path)
            if counter is None:
                counter = self._m_paths[path] = self._metrics.model_path_batches.labels(
                    self.name, path
                )
            counter.value += 1
        cost = self.cost
        cost.observe(cpu_seconds, wall_seconds, rows)
        self._m_cpu.value += cpu_seconds
        single = cost.single
        if not self._stay_low <= single <= self._stay_high and not self._unloading:
            heavy_batch_s = self.backend.heavy_batch_s
            if may_move(single, heavy_batch_s, time.monotonic() - self._lane_since):
                self._move(lane_for(self.lane, single, heavy_batch_s))

    def _move(self, lane: str) -> None:
        """Run in ``lane`` from now on: workers start there (at least one, at least
        ``minWorkers``; the scaling rule adds more as the queue asks), and those elsewhere leave
        once they are not running a batch or loading (:meth:`worker_idle`)."""
        old, self.lane = self.lane, lane
        self._lane_since = time.monotonic()
        self.events.pool_moved(self, old)
        self._stay_low, self._stay_high = lane_bounds(lane, self.backend.heavy_batch_s)
        self._metrics.model_lane.remove(self.name, old)  # the scrape sets the new one
        log.info(
            "model %s: moves to the %s lane (a one-row batch holds a backend %.3f ms, its "
            "batches %.3f ms)",
            self.name,
            lane,
            self.cost.single * 1000,
            (self.cost.hold or 0.0) * 1000,
            extra={"model": self.name},
        )
        for worker in list(self.workers.values()):
            if worker.state in (WorkerState.IDLE, WorkerState.READY):
                worker.exit(None)
        self._fill_lane()

    def _fill_lane(self) -> None:
        """Start workers in the model's lane until it has ``max(1, minWorkers)`` there, within
        ``maxWorkers`` in all (workers still in the old lane count until they leave)."""
        wanted = max(1, self.config.min_workers)
        while (
            sum(w.slot.lane.name == self.lane for w in self.workers.values()) < wanted
            and len(self.workers) < self.config.max_workers
        ):
            self._add_worker(f"moved to the {self.lane} lane", scaling=False)

    def _dispatch_at(self, when: float) -> None:
        handle = self._delay_handle
        if handle is not None:
            if self._delay_at <= when:
                return
            handle.cancel()
        self._delay_at = when
        self._delay_handle = self._loop.call_at(when, self._dispatch_delayed)

    def _expire_at(self, when: float) -> None:
        if self._expiry_handle is not None:
            self._expiry_handle.cancel()
        self._expiry_at = when
        self._expiry_handle = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """Answer 504 the queued jobs whose deadline has passed (waiting for a batch, a
        worker or a turn on a process), and watch the earliest deadline left."""
        self._expiry_handle = None
        expired, earliest = self.queue.expire(self._loop.time())
        for job in expired:
            job.fail(waited_too_long())
        if earliest is not None and not self._stopped:
            self._expire_at(earliest)
        elif self.queue.closed:
            self._drained()

    def _drained(self) -> None:
        """A closed queue is empty: the idle workers leave too (a stop waits for every worker,
        and an idle one would otherwise wait for a batch that cannot come until the drain's
        timeout)."""
        if not len(self.queue):
            for idle in list(self._idle):
                idle.exit(None)

    def _dispatch_delayed(self) -> None:
        self._delay_handle = None
        self._dispatch()

    def worker_idle(self, worker: Worker) -> None:
        """``worker`` has loaded its model or finished a batch: give it the next batch, retire
        it, or keep it idle."""
        queue = self.queue
        if self._stopped or (queue.closed and not len(queue)):
            worker.exit(None)
            self._drained()
            return
        if worker.slot.lane.name != self.lane or self.may_retire(worker, 0.0):
            worker.exit(None)
            return
        self._idle.append(worker)
        if len(queue):
            self._dispatch()
        elif len(self.workers) > self.config.min_workers:
            self._arm_reaper()

    def _arm_reaper(self, delay: float | None = None) -> None:
        if self._reap_handle is None:
            self._reap_handle = self._loop.call_later(
                self.config.max_idle_time if delay is None else delay, self._reap
            )

    def _reap(self) -> None:
        """Retire workers idle for ``max_idle_time`` above ``minWorkers``, longest idle first."""
        self._reap_handle = None
        now = self._loop.time()
        for worker in sorted(self._idle, key=lambda w: w.idle_since):
            if self.may_retire(worker, now - worker.idle_since):
                worker.exit(None)
        if self._idle and len(self.workers) > self.config.min_workers:
            oldest = min(w.idle_since for w in self._idle)
            self._arm_reaper(max(0.001, oldest + self.config.max_idle_time - now))

    @property
    def busy(self) -> bool:
        """Has queued or running jobs: never evicted."""
        return bool(len(self.queue)) or self.running > 0

    @property
    def memory_bytes(self) -> int:
        return self.copy_bytes * len(self._slot_loads)

    def _memory_changed(self) -> None:
        """Recount :attr:`accounted_bytes`: the copies loaded, or, with none loaded (scaled to
        zero, or before the first load is measured), one copy's known size."""
        now = self.memory_bytes or self.copy_bytes or self._known_bytes
        change = now - self.accounted_bytes
        if change:
            self.accounted_bytes = now
            self.events.pool_memory_changed(self, change)

    def snapshot(self) -> PoolSnapshot:
        c = self.config
        queue = self.queue
        return PoolSnapshot(
            len(self.workers),
            len(queue) - queue.background,
            c.min_workers,
            c.max_workers,
            c.batch_size,
        )

    @property
    def paths(self) -> dict[str, Any] | None:
        """The family and predict paths the model's first load reported (``None``: a custom
        handler, or not loaded yet)."""
        return None if self._paths is None else cast(dict[str, Any], pickle.loads(self._paths))

    # Workers ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start ``minWorkers`` workers and wait until the model is loaded in their slots.
        Raises the load error of the first worker that failed. Their lines are debug: the
        model's load line counts them."""
        started = [
            self._add_worker("minWorkers", level=logging.DEBUG)
            for _ in range(workers_to_start(self.snapshot()))
        ]
        if started:
            await asyncio.gather(*(w.ready for w in started))

    def _add_worker(
        self, reason: str, *, scaling: bool = True, level: int = logging.INFO
    ) -> Worker:
        slot = self.backend.bind(self._per_slot.keys(), self.lane)
        worker = Worker(self, self._next_id, slot)
        self._next_id += 1
        self.workers[worker.id] = worker
        self._per_slot[slot.index] += 1
        if scaling:
            self._m_scale_up.inc()
        log.log(
            level,
            "model %s: worker %d added on %s (%s; %d worker(s), %d queued)",
            self.name,
            worker.id,
            slot.describe(),
            reason,
            len(self.workers),
            len(self.queue),
        )
        worker.start()
        return worker

    async def bind(self, slot: Slot) -> None:
        """Make sure this model is loaded in ``slot`` (one load per slot, shared by workers)."""
        future = self._slot_loads.get(slot.index)
        if future is None:
            future = asyncio.ensure_future(
                slot.load(LoadSpec(self.key, self.model_dir, self.config))
            )
            self._slot_loads[slot.index] = future
            self._memory_changed()
        try:
            info = await asyncio.shield(future)
        except BaseException:
            if self._slot_loads.get(slot.index) is future:
                self._leave_slot(slot)
            raise
        if self._slot_loads.get(slot.index) is future and isinstance(future, asyncio.Task):
            # Loaded: what stays is a resolved future, not the finished task and its coroutine.
            settled: asyncio.Future[LoadInfo] = asyncio.get_running_loop().create_future()
            settled.set_result(info)
            self._slot_loads[slot.index] = settled
        if not self.copy_bytes:
            self.copy_bytes = (
                int(self.config.required_memory_mb * 2**20)
                if self.config.required_memory_mb is not None
                else info.memory_bytes
            )
            self._memory_changed()
            self._paths = info.paths
            self.events.pool_loaded(self, info)
        probe = info.probe_seconds
        if self.cost.hold is None and probe is not None:
            # The probe row's cost is the first estimate: a heavy model leaves the light lane
            # before its first batch runs there.
            self.cost.set_probe(probe)
            if not self._stay_low <= probe <= self._stay_high and not self._unloading:
                self._move(lane_for(self.lane, probe, self.backend.heavy_batch_s))

    def _leave_slot(self, slot: Slot, unload: bool = True) -> asyncio.Task[None] | None:
        """The model leaves ``slot``: it is unloaded there (the task doing it), or at the end of
        its load there if that is still running in the process."""
        load = self._slot_loads.pop(slot.index, None)
        if load is None:
            return None
        self._memory_changed()
        if not load.done():
            load.add_done_callback(lambda _: self._leave_slot_loaded(slot, load, unload))
            return None
        return self._leave_slot_loaded(slot, load, unload)

    def _leave_slot_loaded(
        self, slot: Slot, load: asyncio.Future[LoadInfo], unload: bool
    ) -> asyncio.Task[None] | None:
        if load.cancelled() or load.exception() is not None:
            return None  # nothing loaded there (and the error is retrieved: no one waits for it)
        if not unload or slot.index in self._slot_loads:  # loaded there again since
            return None
        return asyncio.get_running_loop().create_task(
            slot.unload(self.key), name=f"mmserver-unload-{self.name}"
        )

    def may_retire(self, worker: Worker, idle_seconds: float) -> bool:
        if self._stopped:
            return True
        return should_retire(self.snapshot(), idle_seconds, self.config.max_idle_time)

    def observe_batch(self, batch: list[Job], started: float, seconds: float) -> None:
        self._m_batch.observe(len(batch))
        self._m_predict.observe(seconds)
        for job in batch:
            self._m_queue_wait.observe(started - job.enqueued_at)
        if not self.running and not len(self.queue):
            self.events.pool_idle(self)

    def worker_exited(self, worker: Worker, error: BaseException | None) -> None:
        """Forget ``worker``; unload the model from its slot if no other worker is there."""
        if self.workers.pop(worker.id, None) is None:
            return
        if worker in self._idle:
            self._idle.remove(worker)
        slot = worker.slot
        self.backend.release(slot)
        self._per_slot[slot.index] -= 1
        if not self._per_slot[slot.index]:
            del self._per_slot[slot.index]
        if self._unloading:
            reason = "model unloading"
        elif slot.lane.name != self.lane:
            reason = f"model moved to the {self.lane} lane"
        elif error is not None:
            reason = f"failed: {error}"
        else:
            reason = "idle"
            self._m_scale_down.inc()
        log.log(
            logging.DEBUG if self._unloading else logging.INFO,  # the unload line says it
            "model %s: worker %d on %s retired (%s; %d worker(s) left)",
            self.name,
            worker.id,
            slot.describe(),
            reason,
            len(self.workers),
        )
        if slot.index not in self._per_slot:
            self._leave_slot(slot)
        if slot.lane.name != self.lane and not self._stopped and not self._unloading:
            self._fill_lane()
        if error is not None and not self.workers and not self._stopped:
            # No worker is left to serve what is queued: answer it with the reason.
            for job in self.queue.drain():
                job.fail(
                    error
                    if isinstance(error, errors.MMServerError)
                    else errors.MMServerError(f"the model's worker failed: {error}")
                )
        elif len(self.queue) and not self._stopped and should_add_worker(self.snapshot()):
            self._add_worker("queue")

    # Management -------------------------------------------------------------------------------

    def _refuse_if_stopped(self) -> None:
        """With ``maxWorkers`` 0 the model keeps no worker: its queue refuses new jobs, and
        answers those it holds, with :class:`errors.WorkersStopped` (503), as DJL does."""
        if self.config.max_workers > 0:
            if self.queue.closed and not self._unloading:
                self.queue.reopen()
            return
        message = (
            f"model {self.name} has no workers: its maxWorkers is 0. Give it some with "
            f"PUT /models/{self.name}?max_worker=N"
        )
        self.queue.close(lambda: errors.WorkersStopped(message))
        for job in self.queue.drain():
            job.fail(errors.WorkersStopped(message))

    async def rescale(self, config: ModelConfig) -> None:
        """Apply new limits live: queued and running jobs are kept (with ``maxWorkers`` 0,
        queued jobs are answered 503)."""
        self.config = config
        self.queue.maxsize = config.job_queue_size
        self._refuse_if_stopped()
        started = [self._add_worker("minWorkers") for _ in range(workers_to_start(self.snapshot()))]
        # Idle workers above the new maxWorkers leave now; busy ones after their batch.
        excess = len(self.workers) - config.max_workers
        for worker in list(self._idle):
            if excess <= 0:
                break
            worker.exit(None)
            excess -= 1
        if self._idle and len(self.queue):
            self._dispatch()  # the new batch size or delay may let a batch go now
        if started:
            await asyncio.gather(*(w.ready for w in started))

    async def stop(self, drain_timeout: float | None, unload: bool = True) -> None:
        """Refuse new jobs; let the workers answer what is queued (up to ``drain_timeout``
        seconds; ``None`` = do not wait); answer the rest with 503; stop the workers and unload
        the model from every slot (unless ``unload`` is false: the server is stopping, and the
        backend processes with it, some maybe still held by a prediction past the drain)."""
        self._unloading = True
        self.queue.close()
        if self._idle and len(self.queue):
            self._dispatch()
        if not len(self.queue):
            for worker in list(self._idle):
                worker.exit(None)
        waits = [w.done for w in self.workers.values()]
        if waits and drain_timeout:
            await asyncio.wait(waits, timeout=drain_timeout)
        self._stopped = True
        for handle in (
            self._dispatch_handle,
            self._delay_handle,
            self._reap_handle,
            self._expiry_handle,
        ):
            if handle is not None:
                handle.cancel()
        self._dispatch_handle = self._delay_handle = self._reap_handle = None
        self._expiry_handle = None
        for job in self.queue.drain():
            job.fail(errors.ShuttingDown("the model was unloaded before this request ran"))
        workers = list(self.workers.values())
        for worker in workers:
            worker.exit(None)
        await asyncio.gather(*(w.wait_started() for w in workers))
        slots = {s.index: s for s in self.backend.slots}
        unloads = [self._leave_slot(slots[index], unload) for index in list(self._slot_loads)]
        await asyncio.gather(*(u for u in unloads if u is not None))

    def path_batches(self) -> dict[str, int]:
        """The batches each predict path took."""
        return {name: int(c.value) for name, c in self._m_paths.items()}


@dataclass(slots=True)
class Measured:
    """What the loads of a model measured, for the next load's estimate and lane: remembered
    across its unloads (:class:`~mmserver.lifecycle.catalog.Catalog`, bounded), read by its pool
    when it
    starts, written by the catalog when a load has measured them."""

    #: Bytes of one loaded copy (0: not measured yet).
    copy_bytes: int = 0
    #: Seconds a one-row batch of the model held a backend, which chose its lane
    #: (:attr:`~mmserver.policy.scheduling.Cost.single`; ``None``: no batch ran yet).
    hold: float | None = None
