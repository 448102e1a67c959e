"""The workers of one model, from their start to their retirement (DJL's worker group).

A worker starts bound to a slot of the model's lane, a slot with none of the model's workers
first, least-loaded first (:meth:`BackendPool.bind <mmserver.backend.BackendPool.bind>`); the
model's copy there is its pool's to load (:mod:`~mmserver.serving.binding`). Workers start for
``minWorkers``, when the scaling rule asks (:mod:`mmserver.policy.scaling`), when the model
moves to another lane, and up to the workers it had before a restart (the warm set); they leave
when idle above ``minWorkers`` for ``max_idle_time`` (the pool's reaper asks
:meth:`WorkerGroup.retire_idle`), above a lowered ``maxWorkers``, when the model moved (as soon
as they are not running a batch or loading), or when the model unloads.

Concurrency contract: every method runs on the event loop, called by the model's pool or, as
they leave, by its workers (:meth:`WorkerGroup.exited`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

from mmserver import errors
from mmserver.backend.placement import BackendPool
from mmserver.config.server import ModelConfig
from mmserver.envs.registry import Environment
from mmserver.ops.metrics import Metrics
from mmserver.policy.scaling import (
    PoolSnapshot,
    should_add_worker,
    should_retire,
    workers_to_start,
)
from mmserver.serving.binding import Copies
from mmserver.serving.jobs import JobQueue
from mmserver.serving.worker import Worker, WorkerHost, WorkerState

log = logging.getLogger(__name__)


class GroupHost(WorkerHost, Protocol):
    """What a model's worker group needs of its pool (which implements it), beyond what each
    worker needs."""

    config: ModelConfig
    queue: JobQueue
    #: The lane the model runs in: new workers start there.
    lane: str
    #: The model environment it runs in (``None``: the server's own).
    env: Environment | None
    #: The pool's stop has begun: workers leaving now are not scaling down.
    unloading: bool
    #: The pool's stop has answered what was left: no worker starts again.
    stopped: bool

    def snapshot(self) -> PoolSnapshot: ...


class WorkerGroup:
    """The workers of one model (see the module docstring): who they are, which are idle, how
    many are in each slot, and their coming and going."""

    __slots__ = (
        "_backend",
        "_copies",
        "_host",
        "_m_scale_down",
        "_m_scale_up",
        "_next_id",
        "_per_slot",
        "idle",
        "workers",
    )

    def __init__(
        self, host: GroupHost, backend: BackendPool, copies: Copies, metrics: Metrics
    ) -> None:
        """``copies``: the model's copies in the slots, which it leaves with its last worker
        there."""
        self._host = host
        self._backend = backend
        self._copies = copies
        #: Every worker of the model, by id.
        self.workers: dict[int, Worker] = {}
        #: Idle workers, the most recently idle last: it is the one given the next batch, so
        #: the others stay idle long enough to retire.
        self.idle: list[Worker] = []
        #: Workers per slot index (the slots the model is bound to).
        self._per_slot: collections.Counter[int] = collections.Counter()
        self._next_id = 1
        self._m_scale_up = metrics.worker_scale.labels(host.name, "up")
        self._m_scale_down = metrics.worker_scale.labels(host.name, "down")

    # Coming -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start ``minWorkers`` workers and wait until the model is loaded in their slots.
        Raises the load error of the first worker that failed. Their lines are debug: the
        model's load line counts them."""
        started = [
            self.add("minWorkers", level=logging.DEBUG)
            for _ in range(workers_to_start(self._host.snapshot()))
        ]
        if started:
            await asyncio.gather(*(w.ready for w in started))

    def add(self, reason: str, *, scaling: bool = True, level: int = logging.INFO) -> Worker:
        """Start a worker in the model's lane; ``scaling``: counted as a scale-up."""
        host = self._host
        env = host.env
        if env is not None:  # in its environment's processes
            slot = self._backend.bind_env(env.key, env.python, self._per_slot.keys())
        elif host.config.trust.own_process:  # its code never shares a process with another model
            slot = self._backend.bind_own(host.name, self._per_slot.keys())
        else:
            slot = self._backend.bind(self._per_slot.keys(), host.lane)
        worker = Worker(host, self._next_id, slot)
        self._next_id += 1
        self.workers[worker.id] = worker
        self._per_slot[slot.index] += 1
        if scaling:
            self._m_scale_up.inc()
        log.log(
            level,
            "model %s: worker %d added on %s (%s; %d worker(s), %d queued)",
            host.name,
            worker.id,
            slot.describe(),
            reason,
            len(self.workers),
            len(host.queue.jobs),
        )
        worker.start()
        return worker

    def grow(self, workers: int) -> list[Worker]:
        """Start workers until the model has ``workers``, at most ``maxWorkers`` (the warm set's
        restore: the workers it had before a restart). The workers started, loading."""
        host = self._host
        if host.stopped or host.unloading:
            return []
        wanted = min(workers, host.config.max_workers) - len(self.workers)
        return [self.add("warm set", scaling=False) for _ in range(wanted)]

    def follow_lane(self) -> None:
        """The model moved to another lane: its idle and ready workers leave now (the others
        once they are idle, :meth:`ModelPool.worker_idle
        <mmserver.serving.pool.ModelPool.worker_idle>`), and workers start in the new lane."""
        for worker in list(self.workers.values()):
            if worker.state in (WorkerState.IDLE, WorkerState.READY):
                worker.exit(None)
        self._fill_lane()

    def _fill_lane(self) -> None:
        """Start workers in the model's lane until it has ``max(1, minWorkers)`` there, within
        ``maxWorkers`` in all (workers still in the old lane count until they leave)."""
        host = self._host
        wanted = max(1, host.config.min_workers)
        while (
            sum(w.slot.lane.name == host.lane for w in self.workers.values()) < wanted
            and len(self.workers) < host.config.max_workers
        ):
            self.add(f"moved to the {host.lane} lane", scaling=False)

    def rescale(self) -> list[Worker]:
        """Apply the pool's new limits: with ``maxWorkers`` 0 its queue refuses jobs, workers
        start up to ``minWorkers``, idle ones above ``maxWorkers`` leave now (busy ones after
        their batch). The workers started, loading."""
        self.refuse_if_stopped()
        started = [self.add("minWorkers") for _ in range(workers_to_start(self._host.snapshot()))]
        excess = len(self.workers) - self._host.config.max_workers
        for worker in list(self.idle):
            if excess <= 0:
                break
            worker.exit(None)
            excess -= 1
        return started

    def refuse_if_stopped(self) -> None:
        """With ``maxWorkers`` 0 the model keeps no worker: its queue refuses new jobs, and
        answers those it holds, with :class:`errors.WorkersStopped` (503), as DJL does."""
        host = self._host
        queue = host.queue
        if host.config.max_workers > 0:
            if queue.closed and not host.unloading:
                queue.reopen()
            return
        message = (
            f"model {host.name} has no workers: its maxWorkers is 0. Give it some with "
            f"PUT /models/{host.name}?max_worker=N"
        )
        queue.close(lambda: errors.WorkersStopped(message))
        for job in queue.drain():
            job.fail(errors.WorkersStopped(message))

    # Going ------------------------------------------------------------------------------------

    def retire_idle(self, now: float) -> float | None:
        """Retire workers idle for ``max_idle_time`` above ``minWorkers``, longest idle first;
        the seconds until the next may retire, if any idle one is above ``minWorkers``."""
        host = self._host
        idle = self.idle
        for worker in sorted(idle, key=lambda w: w.idle_since):
            if host.stopped or should_retire(
                host.snapshot(), now - worker.idle_since, host.config.max_idle_time
            ):
                worker.exit(None)
        if idle and len(self.workers) > host.config.min_workers:
            oldest = min(w.idle_since for w in idle)
            return max(0.001, oldest + host.config.max_idle_time - now)
        return None

    def drained(self) -> None:
        """A closed queue is empty: the idle workers leave too (a stop waits for every worker,
        and an idle one would otherwise wait for a batch that cannot come until the drain's
        timeout)."""
        if not self._host.queue.jobs:
            for worker in list(self.idle):
                worker.exit(None)

    async def wait_left(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every worker to leave."""
        waits = [w.done for w in self.workers.values()]
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    async def stop(self) -> None:
        """Stop every worker now and wait for their loads to end."""
        workers = list(self.workers.values())
        for worker in workers:
            worker.exit(None)
        await asyncio.gather(*(w.wait_started() for w in workers))

    def exited(self, worker: Worker, error: BaseException | None) -> None:
        """Forget ``worker``; the model leaves its slot if no other worker is there. When it
        failed and was the last, what is queued is answered with its error; otherwise the
        scaling rule may start another."""
        workers = self.workers
        if workers.pop(worker.id, None) is None:
            return
        if worker in self.idle:
            self.idle.remove(worker)
        host = self._host
        slot = worker.slot
        self._backend.release(slot)
        per_slot = self._per_slot
        per_slot[slot.index] -= 1
        if not per_slot[slot.index]:
            del per_slot[slot.index]
        if host.unloading:
            reason = "model unloading"
        elif slot.lane.name != host.lane:
            reason = f"model moved to the {host.lane} lane"
        elif error is not None:
            reason = f"failed: {error}"
        else:
            reason = "idle"
            self._m_scale_down.inc()
        log.log(
            logging.DEBUG if host.unloading else logging.INFO,  # the unload line says it
            "model %s: worker %d on %s retired (%s; %d worker(s) left)",
            host.name,
            worker.id,
            slot.describe(),
            reason,
            len(workers),
        )
        if slot.index not in per_slot:
            self._copies.leave(slot)
        if slot.lane.name != host.lane and not host.stopped and not host.unloading:
            self._fill_lane()
        queue = host.queue
        if error is not None and not workers and not host.stopped:
            # No worker is left to serve what is queued: answer it with the reason.
            for job in queue.drain():
                job.fail(
                    error
                    if isinstance(error, errors.MMServerError)
                    else errors.MMServerError(f"the model's worker failed: {error}")
                )
        elif queue.jobs and not host.stopped and should_add_worker(host.snapshot()):
            self.add("queue")
