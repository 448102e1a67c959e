"""One loaded model: its bounded queue, its workers, and the backend slots holding it.

The model is loaded into a slot when one of its workers is bound there, and only there; it is
unloaded from a slot when the last of its workers there stops. Workers of one model go to
different slots while there are any, least-loaded first (:meth:`BackendPool.pick`).

Concurrency contract: every method runs on the event loop; :meth:`submit` is synchronous, so the
scaling check after an enqueue cannot interleave with another request's.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.backend import BackendPool, LoadInfo, LoadSpec, ProcessSlot, ThreadSlot
from mmserver.batching import Job, JobQueue
from mmserver.codecs import Request
from mmserver.config import ModelConfig
from mmserver.metrics import Metrics
from mmserver.scaling import PoolSnapshot, should_add_worker, should_retire, workers_to_start
from mmserver.worker import Worker, WorkerState

log = logging.getLogger(__name__)


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
        on_load: Callable[[ModelPool, LoadInfo], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.key = key
        self.model_dir = model_dir
        self.config = config
        self.backend = backend
        self.queue = JobQueue(config.job_queue_size)
        self.workers: dict[int, Worker] = {}
        self.n_features: int | None = None
        self.copy_bytes = 0  # memory of one copy, known after the first load
        self.running = 0
        self._next_id = 1
        self._slot_loads: dict[int, asyncio.Future[LoadInfo]] = {}
        self._on_load = on_load
        self._on_idle = on_idle
        self._metrics = metrics
        self._m_scale_up = metrics.worker_scale.labels(name, "up")
        self._m_scale_down = metrics.worker_scale.labels(name, "down")
        self._m_queue_wait = metrics.queue_wait_seconds.labels(name)
        self._m_batch = metrics.batch_size.labels(name)
        self._m_predict = metrics.predict_seconds.labels(name)
        #: The series of this model's answered requests, counted by the HTTP layer.
        self.m_answered = metrics.requests.labels(name, "200")
        self.m_request_seconds = metrics.request_seconds.labels(name)
        self._stopped = False
        self._unloading = False  # set when stop() begins: workers leaving now are not scaling

    # Requests ---------------------------------------------------------------------------------

    def submit(
        self,
        request: Request,
        now: float,
        deadline: float,
        client_gone: Callable[[], bool] | None,
    ) -> asyncio.Future[bytes]:
        """Queue one request (raises :class:`errors.QueueFull` at once when full), then apply
        the scaling rule. The future's result is the answer's body."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        queue = self.queue
        queue.put(Job(request, future, now, deadline, client_gone))
        # should_add_worker's own test, first on plain numbers: most requests add no worker.
        if (not self.workers or len(queue) > 2 * self.config.batch_size) and should_add_worker(
            self.snapshot()
        ):
            self._add_worker("queue")
        return future

    @property
    def busy(self) -> bool:
        """Has queued or running jobs: never evicted."""
        return bool(len(self.queue)) or self.running > 0

    @property
    def memory_bytes(self) -> int:
        return self.copy_bytes * len(self._slot_loads)

    def snapshot(self) -> PoolSnapshot:
        c = self.config
        return PoolSnapshot(
            len(self.workers), len(self.queue), c.min_workers, c.max_workers, c.batch_size
        )

    # Workers ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start ``minWorkers`` workers and wait until the model is loaded in their slots.
        Raises the load error of the first worker that failed."""
        started = [self._add_worker("minWorkers") for _ in range(workers_to_start(self.snapshot()))]
        if started:
            await asyncio.gather(*(w.ready for w in started))

    def _add_worker(self, reason: str) -> Worker:
        taken = {w.slot.index for w in self.workers.values()}
        slot = self.backend.pick(taken)
        worker = Worker(self, self._next_id, slot)
        self._next_id += 1
        self.workers[worker.id] = worker
        slot.bound_workers += 1
        self._m_scale_up.inc()
        log.info(
            "model %s: worker %d added on %s (%s; %d worker(s), %d queued)",
            self.name, worker.id, slot.describe(), reason, len(self.workers), len(self.queue),
        )
        worker.start()
        return worker

    async def bind(self, slot: ProcessSlot | ThreadSlot) -> None:
        """Make sure this model is loaded in ``slot`` (one load per slot, shared by workers)."""
        future = self._slot_loads.get(slot.index)
        if future is None:
            future = asyncio.ensure_future(
                slot.load(LoadSpec(self.key, self.model_dir, self.config))
            )
            self._slot_loads[slot.index] = future
        try:
            info = await asyncio.shield(future)
        except BaseException:
            if self._slot_loads.get(slot.index) is future:
                del self._slot_loads[slot.index]
            raise
        if self.n_features is None:
            self.n_features = info.n_features
        if not self.copy_bytes:
            self.copy_bytes = int(self.config.required_memory_mb * 2**20) \
                if self.config.required_memory_mb is not None else info.memory_bytes
            if self._on_load is not None:
                self._on_load(self, info)

    def may_retire(self, worker: Worker, idle_seconds: float) -> bool:
        if self._stopped:
            return True
        return should_retire(self.snapshot(), idle_seconds, self.config.max_idle_time)

    def observe_batch(self, batch: list[Job], started: float, seconds: float) -> None:
        self._m_batch.observe(len(batch))
        self._m_predict.observe(seconds)
        for job in batch:
            self._m_queue_wait.observe(started - job.enqueued_at)
        if self._on_idle is not None and not self.running and not len(self.queue):
            self._on_idle()

    def worker_exited(self, worker: Worker, error: BaseException | None) -> None:
        """Forget ``worker``; unload the model from its slot if no other worker is there."""
        if self.workers.pop(worker.id, None) is None:
            return
        slot = worker.slot
        slot.bound_workers -= 1
        if self._unloading:
            reason = "model unloading"
        elif error is not None:
            reason = f"failed: {error}"
        else:
            reason = "idle"
            self._m_scale_down.inc()
        log.info(
            "model %s: worker %d on %s retired (%s; %d worker(s) left)",
            self.name, worker.id, slot.describe(), reason, len(self.workers),
        )
        if not any(w.slot is slot for w in self.workers.values()):
            if self._slot_loads.pop(slot.index, None) is not None:
                asyncio.get_running_loop().create_task(
                    slot.unload(self.key), name=f"mmserver-unload-{self.name}"
                )
        if error is not None and not self.workers and not self._stopped:
            # No worker is left to serve what is queued: answer it with the reason.
            for job in self.queue.drain():
                job.fail(error if isinstance(error, errors.MMServerError) else
                         errors.MMServerError(f"the model's worker failed: {error}"))
        elif len(self.queue) and not self._stopped and should_add_worker(self.snapshot()):
            self._add_worker("queue")

    # Management -------------------------------------------------------------------------------

    async def rescale(self, config: ModelConfig) -> None:
        """Apply new limits live: queued and running jobs are kept."""
        self.config = config
        self.queue.maxsize = config.job_queue_size
        started = [self._add_worker("minWorkers") for _ in range(workers_to_start(self.snapshot()))]
        excess = len(self.workers) - config.max_workers
        for worker in list(self.workers.values()):
            if excess <= 0:
                break
            if worker.state is WorkerState.IDLE and worker.task is not None:
                worker.task.cancel()
                excess -= 1
        if started:
            await asyncio.gather(*(w.ready for w in started))

    async def stop(self, drain_timeout: float | None) -> None:
        """Refuse new jobs; let the workers answer what is queued (up to ``drain_timeout``
        seconds; ``None`` = do not wait); answer the rest with 503; stop the workers and unload
        the model from every slot."""
        self._unloading = True
        self.queue.close()
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        if tasks and drain_timeout:
            await asyncio.wait(tasks, timeout=drain_timeout)
        self._stopped = True
        for job in self.queue.drain():
            job.fail(errors.ShuttingDown("the model was unloaded before this request ran"))
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        slots = {s.index: s for s in self.backend.slots}
        for index in list(self._slot_loads):
            self._slot_loads.pop(index)
            await slots[index].unload(self.key)

    def describe_workers(self) -> list[dict[str, Any]]:
        return [
            {
                "id": w.id,
                "startTime": datetime.datetime.fromtimestamp(
                    w.start_time, datetime.UTC
                ).isoformat(timespec="milliseconds"),
                "status": w.state.value,
                "backend": w.slot.index,
            }
            for w in self.workers.values()
        ]
