"""A worker: the unit ``minWorkers``/``maxWorkers`` count.

An asyncio task of the frontend bound to one backend slot. It makes sure its model is loaded in
that slot, then takes batches from its model's queue and sends them there, until it retires (idle
above ``minWorkers``, or above a lowered ``maxWorkers``) or its queue closes and is empty.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Protocol

from mmserver import errors
from mmserver.backend import ProcessSlot, ThreadSlot
from mmserver.batching import Job, JobQueue, collect_batch, partition_live
from mmserver.config import ModelConfig

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    STARTING = "STARTING"
    IDLE = "IDLE"
    BUSY = "BUSY"
    STOPPING = "STOPPING"


_TRANSITIONS = {
    WorkerState.STARTING: {WorkerState.IDLE, WorkerState.STOPPING},
    WorkerState.IDLE: {WorkerState.BUSY, WorkerState.STOPPING},
    WorkerState.BUSY: {WorkerState.IDLE, WorkerState.STOPPING},
    WorkerState.STOPPING: set(),
}


class WorkerHost(Protocol):
    """What a worker needs from the model it serves (implemented by the model's pool)."""

    name: str
    key: str
    queue: JobQueue
    config: ModelConfig
    running: int

    async def bind(self, slot: ProcessSlot | ThreadSlot) -> None: ...
    def may_retire(self, worker: Worker, idle_seconds: float) -> bool: ...
    def observe_batch(self, batch: list[Job], started: float, seconds: float) -> None: ...
    def worker_exited(self, worker: Worker, error: BaseException | None) -> None: ...


class Worker:
    """One worker of one model, bound to one backend slot."""

    def __init__(self, host: WorkerHost, worker_id: int, slot: ProcessSlot | ThreadSlot) -> None:
        self.host = host
        self.id = worker_id
        self.slot = slot
        self.state = WorkerState.STARTING
        self.start_time = time.time()
        self.task: asyncio.Task[None] | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"mmserver-worker-{self.host.name}-{self.id}"
        )

    def _set_state(self, state: WorkerState) -> None:
        if state is not self.state and state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"worker {self.id}: {self.state.value} -> {state.value}")
        self.state = state

    async def _run(self) -> None:
        host = self.host
        queue = host.queue
        loop = asyncio.get_running_loop()
        error: BaseException | None = None
        batch: list[Job] = []
        try:
            await host.bind(self.slot)
            self._set_state(WorkerState.IDLE)
            if not self.ready.done():
                self.ready.set_result(None)
            last_active = loop.time()
            while True:
                job = queue.get_nowait()
                if job is None:
                    job = await queue.get(host.config.max_idle_time)
                if job is None:
                    if queue.closed and not len(queue):
                        break
                    if host.may_retire(self, loop.time() - last_active):
                        break
                    continue
                self._set_state(WorkerState.BUSY)
                config = host.config
                batch = [job]
                await collect_batch(
                    queue, batch, config.batch_size, config.batch_delay_s, loop.time
                )
                await self._run_batch(batch, loop)
                batch = []
                self._set_state(WorkerState.IDLE)
                last_active = loop.time()
                if host.may_retire(self, 0.0):
                    break
        except asyncio.CancelledError:
            # A deliberate stop: whatever this worker held is answered, never dropped.
            stopped = errors.ShuttingDown("the model's worker was stopped before this request ran")
            for held in batch:
                held.fail(stopped)
            raise
        except BaseException as exc:
            error = exc
            for held in batch:
                held.fail(exc)
            if not isinstance(exc, errors.MMServerError):
                log.exception("worker %d of %s crashed", self.id, host.name)
        finally:
            self.state = WorkerState.STOPPING
            if not self.ready.done():
                self.ready.set_exception(error or errors.ShuttingDown("the worker was stopped"))
                self.ready.exception()  # marked retrieved: the pool reports it
            host.worker_exited(self, error)

    async def _run_batch(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        host = self.host
        started = loop.time()
        live = partition_live(batch, started)
        if not live:
            return
        host.running += 1
        try:
            answers = await self.slot.predict(
                host.key, [job.request for job in live], max(job.deadline for job in live)
            )
        except errors.MMServerError as exc:
            for job in live:
                job.fail(exc)
            return
        except Exception as exc:
            log.exception("batch of %s failed", host.name)
            failure = errors.MMServerError(f"the batch failed: {type(exc).__name__}")
            for job in live:
                job.fail(failure)
            return
        finally:
            host.running -= 1
            host.observe_batch(live, started, loop.time() - started)
        for job, answer in zip(live, answers, strict=True):
            job.settle(answer)
