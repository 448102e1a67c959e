"""A worker: the unit ``minWorkers``/``maxWorkers`` count.

A worker is bound to one backend slot. It first makes sure its model is loaded in that slot (an
asyncio task, once); from then on it is driven by callbacks. When it is idle and its model has
jobs queued, its pool makes it *ready* (:meth:`Worker.request_turn`): it waits in its slot's run
queue until the slot admits it (:mod:`mmserver.policy.scheduling` decides the order), and only then
takes its batch from the queue and sends it (:meth:`Worker.begin`), so a batch holds every job
queued until it can run, and a model's jobs go to whichever of its workers gets a turn first. When
the answers come back it settles the batch's jobs and tells its pool it is idle again. No task wakes
up per batch: on a server answering tens of thousands of requests a second from one event loop, a
task's wake-ups per batch cost more than the batch's own bookkeeping.

A worker leaves (:meth:`Worker.exit`) when its pool retires it: idle above ``minWorkers`` for
``max_idle_time``, above a lowered ``maxWorkers``, or when its model is unloaded.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Protocol

from mmserver import errors
from mmserver.backend.batching import Answer
from mmserver.backend.placement import Slot
from mmserver.backend.wire import BatchResult
from mmserver.ops.traces import Passage
from mmserver.policy.scheduling import Cost
from mmserver.serving.jobs import Job, partition_live

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    STARTING = "STARTING"
    IDLE = "IDLE"
    READY = "READY"  # waiting for its slot to run its next batch
    BUSY = "BUSY"
    STOPPING = "STOPPING"


# The states a batch moves a worker through, as module names: an enum member read through its
# class is not specialized by the interpreter (CPython 3.11: ~75 ns against ~5), and every
# request's batch reads four.
_IDLE, _READY, _BUSY = WorkerState.IDLE, WorkerState.READY, WorkerState.BUSY


class WorkerHost(Protocol):
    """What a worker needs from the model it serves (implemented by the model's pool). The
    workers count, in ``readied``, those of them waiting for their slots to run a batch, and in
    ``running`` the batches running (plain counters: every batch changes each twice)."""

    name: str
    key: str
    cost: Cost
    readied: int
    running: int

    async def bind(self, slot: Slot) -> None: ...
    def take_batch(self) -> list[Job]: ...
    def waited(self, batches: int) -> None: ...
    def observe_cost(
        self,
        cpu_seconds: float,
        wall_seconds: float,
        rows: int,
        requests: int,
        charged: float,
        path: str,
    ) -> None: ...
    def observe_batch(self, batch: list[Job], started: float, seconds: float) -> None: ...
    def worker_idle(self, worker: Worker) -> None: ...
    def worker_exited(self, worker: Worker, error: BaseException | None) -> None: ...


class Worker:
    """One worker of one model, bound to one backend slot."""

    __slots__ = (
        "_batch",
        "_began",
        "_binding",
        "_loop",
        "_started",
        "charge",
        "cost",
        "done",
        "host",
        "id",
        "idle_since",
        "ready",
        "slot",
        "start_time",
        "state",
    )

    def __init__(self, host: WorkerHost, worker_id: int, slot: Slot) -> None:
        self.host = host
        #: Its model's measured cost (the host's, which it keeps for its lifetime), which the
        #: slot's run queue reads.
        self.cost: Cost = host.cost
        self.id = worker_id
        self.slot = slot
        self.state = WorkerState.STARTING
        self.start_time = time.time()
        #: On the event loop's clock: when the worker last became idle.
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        #: Resolved once the model is loaded in the slot (or with the reason it is not).
        self.ready: asyncio.Future[None] = self._loop.create_future()
        #: Resolved when the worker has left.
        self.done: asyncio.Future[None] = self._loop.create_future()
        self._binding: asyncio.Task[None] | None = None
        self._batch: list[Job] = []
        self._started = 0.0
        #: When the batch began, on :func:`time.perf_counter`'s clock (a sampled request's
        #: trace reads it; the event loop's clock may count in milliseconds).
        self._began = 0.0
        #: The estimated CPU seconds of the batch it began last, which its lane charges.
        self.charge = 0.0

    def start(self) -> None:
        """Load the model in the slot; the worker is idle (and told to its pool) once it is."""
        self._binding = self._loop.create_task(
            self._bind(), name=f"mmserver-worker-{self.host.name}-{self.id}"
        )

    async def _bind(self) -> None:
        try:
            await self.host.bind(self.slot)
        except asyncio.CancelledError:
            self.exit(None)
            raise
        except BaseException as exc:
            if not isinstance(exc, errors.MMServerError):
                log.exception(
                    "worker %d of %s failed to start",
                    self.id,
                    self.host.name,
                    extra={"model": self.host.name},
                )
            self.exit(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if self.state is not WorkerState.STARTING:
            return  # stopped while loading
        self.state = _IDLE
        self.idle_since = self._loop.time()
        self.ready.set_result(None)
        self._binding = None  # done: a loaded worker keeps no finished task (and its coroutine)
        self.host.worker_idle(self)

    # Batches ----------------------------------------------------------------------------------

    def request_turn(self) -> None:
        """Wait for a turn on the slot to run a batch of the model's queued jobs."""
        self.state = _READY
        self.host.readied += 1
        self.slot.ready(self)

    def waiting(self) -> bool:
        """Still waiting for its turn (not gone, not given a batch otherwise)."""
        return self.state is _READY

    def begin(self, waited: int = 0) -> bool:
        """The slot's turn has come: take a batch from the queue and send it. ``False`` when no
        job was left to compute (the model's other workers took them, or they were answered):
        the worker is idle again. ``waited`` counts the other batches that ran first."""
        host = self.host
        host.readied -= 1
        if waited:
            host.waited(waited)
        started = self._loop.time()
        live: list[Job] = []
        while not live:
            batch = host.take_batch()
            if not batch:
                self._become_idle()
                return False
            live = partition_live(batch, started)
        self.state = _BUSY
        host.running += 1
        self._batch = live
        self._started = started
        self._began = time.perf_counter()
        cost = self.cost
        self.charge = charge = cost.charge(len(live))
        estimate = cost.estimate
        try:
            if len(live) == 1:
                requests, deadline = [live[0].request], live[0].deadline
            else:
                requests, deadline = [j.request for j in live], max(j.deadline for j in live)
            self.slot.send_batch(
                host.key,
                requests,
                deadline,
                self._answered,
                charge if charge > estimate else estimate,
            )
        except errors.MMServerError as exc:  # the slot is stopping
            host.running -= 1
            self._batch = []
            for job in live:
                job.fail(exc)
            self._become_idle()
            return False
        return True

    def _become_idle(self) -> None:
        self.state = _IDLE
        self.idle_since = self._loop.time()
        self.host.worker_idle(self)

    def _answered(self, result: BatchResult | None, error: BaseException | None) -> None:
        """The batch's answers, their CPU seconds and rows (or its error), as soon as the slot
        has them."""
        batch, self._batch = self._batch, []
        host = self.host
        host.running -= 1
        answers: list[Answer] | None = None
        if result is not None:
            answers, cpu_seconds, wall_seconds, rows, path, _ = result
            host.observe_cost(cpu_seconds, wall_seconds, rows, len(batch), self.charge, path)
        host.observe_batch(batch, self._started, self._loop.time() - self._started)
        if error is None:
            if answers is not None and len(answers) == len(batch):
                # The lengths are checked above (zip's strict= costs 0.1 us a batch).
                for job, answer in zip(batch, answers):  # noqa: B905
                    if job.trace is not None:
                        self._traced(job.trace, len(batch), result)
                    job.settle(answer)
                batch = []
            else:
                got = len(answers) if answers is not None else 0
                error = errors.MMServerError(
                    f"the backend answered {got} of the batch's {len(batch)} requests"
                )
        if error is not None:
            if not isinstance(error, errors.MMServerError):
                log.error(
                    "batch of %s failed", host.name, exc_info=error, extra={"model": host.name}
                )
                error = errors.MMServerError(f"the batch failed: {type(error).__name__}")
            for job in batch:
                if job.trace is not None:
                    self._traced(job.trace, len(batch), result)
                job.fail(error)
        if self.state is _BUSY:
            self._become_idle()

    def _traced(self, passage: Passage, size: int, result: BatchResult | None) -> None:
        """Record the batch a sampled request's job went in, and the backend's times of it."""
        passage.taken = self._began
        passage.answered = time.perf_counter()
        passage.size = size
        if result is not None:
            passage.rows, passage.path, passage.backend = result[3], result[4], result[5]

    # Leaving ----------------------------------------------------------------------------------

    def exit(self, error: BaseException | None) -> None:
        """Leave now: the jobs of a batch still running are answered 503 (their answers, if any
        come, are dropped), a load still running is cancelled. Safe to call more than once."""
        if self.state is WorkerState.STOPPING:
            return
        if self.state is _READY:
            self.host.readied -= 1
        self.state = WorkerState.STOPPING
        stopped = errors.ShuttingDown("the model's worker was stopped before this request ran")
        for job in self._batch:
            job.fail(stopped)
        binding = self._binding
        if binding is not None and not binding.done() and binding is not asyncio.current_task():
            binding.cancel()
        if not self.ready.done():
            self.ready.set_exception(error or errors.ShuttingDown("the worker was stopped"))
            self.ready.exception()  # marked retrieved: the pool reports it
        self.done.set_result(None)
        self.host.worker_exited(self, error)

    async def wait_started(self) -> None:
        """Wait for the start-up task to end (after :meth:`exit`, a cancelled load)."""
        if self._binding is not None:
            await asyncio.gather(self._binding, return_exceptions=True)
