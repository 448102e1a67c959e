"""The backend slots of the server, in their lanes, and where a new worker goes."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import shutil
import tempfile
from collections.abc import Collection
from multiprocessing.context import BaseContext, ForkServerContext
from pathlib import Path

from mmserver import errors
from mmserver.backend.cpus import CpuReserve
from mmserver.backend.envprocs import EnvContext, EnvForkServer, package_link
from mmserver.backend.process_slot import ProcessSlot
from mmserver.backend.thread_slot import ThreadSlot
from mmserver.ops.metrics import Metrics
from mmserver.policy.scheduling import HEAVY, LIGHT, Lane

#: A backend slot: one process, or a thread pool inside the frontend.
Slot = ProcessSlot | ThreadSlot

#: Imported once by the fork server and shared copy-on-write by every backend process, so a
#: process starts (or is replaced) in milliseconds and a model's first load does not pay for
#: importing the estimator families most stores use (the optional ones when installed: a module
#: that cannot be imported is skipped).
PRELOAD = (
    "mmserver.backend",
    "mmserver.execution.predictor",
    "joblib",
    "sklearn",
    "sklearn.linear_model",
    "sklearn.pipeline",
    "sklearn.preprocessing",
    "sklearn.tree",
    "sklearn.ensemble",
    "treelite",
    "treelite.sklearn",
    "treelite.gtil",
    "mmserver.backend.optional",  # xgboost and lightgbm, where they load
    # The unpacking processes are forked by the same server: what their file work runs.
    "mmserver.procs.sidework",
    "mmserver.lifecycle.files",
    "mmserver.store.local",
)


def env_lane(env: str) -> str:
    """The lane of model environment ``env``'s processes: ``env-`` and its id's first 8 hex
    digits (``ps`` shows ``mmserver: backend env-1a2b3c4d 5``)."""
    return f"env-{env[:8]}"


class BackendPool:
    """The backend slots of the server, in their lanes, and the choice of slot for a new worker.

    ``processes`` slots make the light lane and start with the server; ``heavy_processes`` more,
    at ``heavy_nice`` (or, with ``heavy_sched_idle``, under ``SCHED_IDLE``), make the heavy lane
    and start when a model first needs one. A model whose
    batches take more than ``heavy_batch_ms`` of CPU belongs in the heavy lane
    (:mod:`mmserver.policy.scheduling`). While the light lane has work, the heavy lane's processes
    keep off ``heavy_reserved_cpus`` of the CPUs (:class:`~mmserver.backend.cpus.CpuReserve`).
    With ``processes = 0`` there is one thread slot and one lane.
    """

    def __init__(
        self,
        processes: int,
        metrics: Metrics,
        threads: int = 8,
        *,
        heavy_processes: int = 0,
        heavy_nice: int = 5,
        heavy_sched_idle: bool = False,
        heavy_batch_ms: float = 2.0,
        heavy_reserved_cpus: int = 1,
    ) -> None:
        #: Every slot: the shared ones, then the models' own (:meth:`bind_own`).
        self.slots: list[Slot]
        #: The slots every model may share.
        self.shared: list[Slot]
        #: The slots of each model that has processes of its own, by model name, and of each
        #: model environment, by its lane's name.
        self._own: dict[str, list[ProcessSlot]] = {}
        #: Each model environment's fork server, by the environment's id.
        self._env_servers: dict[str, EnvForkServer] = {}
        #: The folder holding a link to mmserver's package, the environments' path.
        self._env_path: Path | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._metrics = metrics
        self.lanes = {LIGHT: Lane(LIGHT)}
        #: The fork server's context the processes come from (None: thread slots).
        self.context: BaseContext | None = None
        #: Above this many seconds a batch, a model moves to the heavy lane (0: no heavy lane;
        #: see :func:`~mmserver.policy.scheduling.lane_bounds`).
        self.heavy_batch_s = 0.0
        #: Keeps CPUs free of the heavy lane while the light lane has work (None: no heavy lane).
        self.reserve: CpuReserve | None = None
        if processes == 0:
            self.slots = [ThreadSlot(0, threads, self.lanes[LIGHT])]
            self.shared = list(self.slots)
            self._indexes = itertools.count(1)
            return
        self.context = context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        reserve = None
        if heavy_processes:
            reserve = self.reserve = CpuReserve(
                heavy_reserved_cpus, lambda: self.pids(HEAVY), on_change=metrics.heavy_lane_cpus.set
            )
            if reserve.every:
                metrics.heavy_lane_cpus.set(len(reserve.every))
        light = self.lanes[LIGHT]
        self.slots = [
            ProcessSlot(i, context, metrics, light, reserve=reserve) for i in range(processes)
        ]
        if heavy_processes:
            self.heavy_batch_s = heavy_batch_ms / 1000.0
            self.lanes[HEAVY] = heavy = Lane(HEAVY)
            self.slots += [
                ProcessSlot(
                    processes + i,
                    context,
                    metrics,
                    heavy,
                    heavy_nice,
                    heavy_sched_idle,
                    reserve=reserve,
                )
                for i in range(heavy_processes)
            ]
        self.shared = list(self.slots)
        self._indexes = itertools.count(len(self.slots))

    async def start(self) -> None:
        """Start the light lane's processes (the heavy lane's start on first use)."""
        await asyncio.gather(*(slot.start() for slot in self.slots if slot.lane.name == LIGHT))

    async def stop(self) -> None:
        if self.reserve is not None:
            self.reserve.close()
        await asyncio.gather(
            *(slot.stop() for slot in self.slots), *self._stopping, return_exceptions=True
        )
        await asyncio.gather(*(self.stop_env(env) for env in list(self._env_servers)))
        if self._env_path is not None:
            shutil.rmtree(self._env_path, ignore_errors=True)

    def bind(self, taken: Collection[int], lane: str = LIGHT) -> Slot:
        """The slot in ``lane`` for a new worker of a model already bound to the slots in
        ``taken``, counted as bound there until :meth:`release`: one the model is not in if
        any, least-loaded (fewest bound workers) first, lowest index on ties."""
        slots = [s for s in self.shared if s.lane.name == lane] or self.shared
        free = [s for s in slots if s.index not in taken]
        candidates = free or slots
        slot = min(candidates, key=lambda s: (s.bound_workers, s.index))
        slot.bound_workers += 1
        return slot

    def bind_own(self, model: str, taken: Collection[int]) -> Slot:
        """The slot for a new worker of a model whose files run code (fully trusted), already
        bound to the slots in ``taken``: a backend process no other model shares, started on
        first use and stopped when the model's last worker there leaves, so that nothing its
        code changed in the process outlives it or reaches another model. A model has as many
        such processes as the light lane has, a new one for a worker while every one it has
        holds a worker of it. Without backend processes, the thread slot (shared)."""
        context = self.context
        if not isinstance(context, ForkServerContext):
            return self.bind(taken, LIGHT)
        return self._bind_group(model, taken, context, self.lanes[LIGHT], runs_code=True)

    def bind_env(self, env: str, python: Path, taken: Collection[int]) -> Slot:
        """The slot for a new worker of a model that runs in environment ``env`` (its
        interpreter ``python``), already bound to the slots in ``taken``: a process of that
        environment, forked by its own fork server, in the environment's lane (:func:`env_lane`,
        its batches scheduled among themselves). An environment has as many processes as the
        light lane has, started as its models' workers need them and stopped with the last
        worker there; its fork server runs until :meth:`stop_env` or the server's stop."""
        if self.context is None:
            raise errors.ModelLoadError(
                "a model with an environment of its own needs backend processes "
                "(backend_processes > 0)"
            )
        lane = env_lane(env)
        server = self._env_servers.get(env)
        if server is None:
            if self._env_path is None:
                self._env_path = Path(tempfile.mkdtemp(prefix="mmserver-envpath-"))
                package_link(self._env_path)
            server = self._env_servers[env] = EnvForkServer(lane, python, self._env_path)
            self.lanes[lane] = Lane(lane)
        return self._bind_group(lane, taken, EnvContext(server), self.lanes[lane])

    async def stop_env(self, env: str) -> None:
        """Stop environment ``env``'s fork server (its models are unloaded: it is removed)."""
        server = self._env_servers.pop(env, None)
        self.lanes.pop(env_lane(env), None)
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)

    def _bind_group(
        self,
        group: str,
        taken: Collection[int],
        context: ForkServerContext | EnvContext,
        lane: Lane,
        runs_code: bool = False,
    ) -> Slot:
        """A slot of ``group``'s own (a model's, an environment's), one a new worker of a model
        bound to the slots in ``taken`` is not in, started as needed."""
        own = self._own.setdefault(group, [])
        free = [s for s in own if s.index not in taken]
        if not free and len(own) < max(1, sum(s.lane.name == LIGHT for s in self.shared)):
            slot = ProcessSlot(
                next(self._indexes),
                context,
                self._metrics,
                lane,
                reserve=self.reserve if runs_code else None,
                runs_code=runs_code,
            )
            own.append(slot)
            self.slots.append(slot)
            free = [slot]
        slot = min(free or own, key=lambda s: (s.bound_workers, s.index))
        slot.bound_workers += 1
        return slot

    def release(self, slot: Slot) -> None:
        """A worker bound by :meth:`bind` or :meth:`bind_own` has left ``slot``; a model's own
        slot stops with its last worker."""
        slot.bound_workers -= 1
        if slot.bound_workers or not isinstance(slot, ProcessSlot) or slot in self.shared:
            return
        group = next((name for name, own in self._own.items() if slot in own), None)
        if group is None:
            return
        own = self._own[group]
        own.remove(slot)
        if not own:
            del self._own[group]
        self.slots.remove(slot)
        task = asyncio.get_running_loop().create_task(
            slot.stop(), name=f"mmserver-stop-own-backend-{group}"
        )
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def processes(self) -> list[tuple[str, int]]:
        """The backend processes that run now, each ``(name, pid)``: ``light 0``, as ``ps``
        shows them after ``mmserver: backend``."""
        return [
            (f"backend {s.lane.name} {s.index}", pid)
            for s in self.slots
            if isinstance(s, ProcessSlot) and (pid := s.live_pid)
        ]

    def pids(self, lane: str | None = None) -> list[int]:
        """The ids of the backend processes that run now (of ``lane`` only, when given)."""
        return [
            pid
            for s in self.slots
            if isinstance(s, ProcessSlot)
            and (lane is None or s.lane.name == lane)
            and (pid := s.live_pid)
        ]
