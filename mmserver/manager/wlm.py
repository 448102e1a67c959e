"""The WorkLoadManager: the frontend's one entry point to the models, a façade over the parts
that do its jobs, each the one owner of its state:

- :mod:`mmserver.lifecycle.catalog` — the models the server knows of (one
  :class:`~mmserver.lifecycle.record.ModelRecord` each), registrations, remembered failures and
  measurements, lookups in the store, listing and describe;
- :mod:`mmserver.lifecycle.room` — the loaded models in LRU order, the memory budget, eviction (the
  policy is :func:`mmserver.policy.eviction.choose_victims`), unloading, and the memory watch;
- :mod:`mmserver.lifecycle.files` — a load's file work, in threads and unpacking processes;
- :mod:`mmserver.lifecycle.loading` — loading on demand, one load however many requests wait for it;
- :mod:`mmserver.lifecycle.versions` — the versions of a model with versions, and which of them a
  request goes to;
- :mod:`mmserver.lifecycle.warmset` — with a ``state_dir``, the models loaded, saved and loaded
  again at the next start;
- :mod:`mmserver.manager.submission` — a request queued for its model: every protocol's handler
  calls :meth:`WorkLoadManager.submit`.

Everything runs on the event loop. The manager starts and stops the parts in order
(:meth:`WorkLoadManager.start`, :meth:`WorkLoadManager.stop`) and turns management calls into
their steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mmserver import errors
from mmserver.backend.placement import BackendPool
from mmserver.codecs.requests import Request
from mmserver.config.server import ModelConfig, ServerConfig
from mmserver.config.trust import matching
from mmserver.envs.registry import Environments
from mmserver.lifecycle.catalog import Catalog, ModelListing, ModelView, WorkerView
from mmserver.lifecycle.files import UNPACK_PROCESSES, FileWork
from mmserver.lifecycle.loading import Loader
from mmserver.lifecycle.record import ModelStatus
from mmserver.lifecycle.room import Room
from mmserver.lifecycle.shadow import Shadows
from mmserver.lifecycle.versions import Versions
from mmserver.lifecycle.warmfile import FILE_NAME as WARM_FILE
from mmserver.lifecycle.warmset import WarmSet
from mmserver.manager.submission import Submission, Submitter
from mmserver.ops.metrics import Metrics
from mmserver.ops.traces import Trace
from mmserver.policy.rollout import Rollout
from mmserver.policy.scaling import background_share
from mmserver.serving.jobs import NORMAL
from mmserver.serving.pool import ModelPool
from mmserver.store.names import normalize_name, normalize_target
from mmserver.store.source import ModelSource
from mmserver.store.urls import resolve_model_url

__all__ = ["ModelListing", "ModelView", "Submission", "WorkLoadManager", "WorkerView"]


log = logging.getLogger(__name__)


class WorkLoadManager:
    """Registry, lazy loading and LRU eviction of models; the frontend's single entry point."""

    def __init__(
        self,
        config: ServerConfig,
        store: ModelSource,
        metrics: Metrics,
        backend: BackendPool | None = None,
        *,
        load_retry_seconds: float = 2.0,
        room_wait_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.backend = backend or BackendPool(
            config.backend_processes,
            metrics,
            heavy_processes=config.heavy_processes,
            heavy_nice=config.heavy_nice,
            heavy_sched_idle=config.heavy_sched_idle,
            heavy_batch_ms=config.heavy_batch_ms,
            heavy_reserved_cpus=config.heavy_reserved_cpus,
        )
        self.accepting = False
        self._stopped = False
        self.catalog = Catalog(config, store, metrics)
        self.files = FileWork(store, self.catalog.defaults, self.backend.context)
        self.room = Room(
            config, self.catalog, self.backend, metrics, wait_seconds=room_wait_seconds
        )
        #: The model environments (built for models whose requirements the server lacks).
        self.envs = Environments(
            config.env_path(config.cache_path),
            metrics,
            timeout=config.env_build_timeout_s,
            retry_s=config.env_retry_s,
            max_envs=config.max_envs,
            disk_mb=config.env_disk_mb,
            uv=config.env_uv,
        )
        self.envs.on_remove = self.backend.stop_env
        self.loader = Loader(
            self.catalog,
            self.room,
            self.backend,
            metrics,
            self.files,
            envs=self.envs,
            retry_seconds=load_retry_seconds,
            clock=clock,
        )
        state_dir = config.state_path if config.state_dir.strip() else config.cache_path
        self.versions = Versions(self.catalog, self.room.loaded, state_dir)
        self.submitter = Submitter(self.room, self.loader, self.versions)
        #: With a ``state_dir``: the models loaded, saved, and loaded again at the next start.
        self.warm: WarmSet | None = None
        if config.state_dir.strip():
            path = config.state_path / WARM_FILE
            self.warm = WarmSet(
                path,
                self.room,
                self.catalog,
                self.loader,
                self.versions,
                ready_timeout=config.warm_ready_timeout,
            )
        self.shadows = Shadows(
            self._run_shadow,
            background_share(config.backend_processes),
            lambda: self.real_time_queued,
            metrics,
        )
        self.submitter.shadows = self.shadows
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The scan of a local store begun at :meth:`start` (which does not wait for it).
        self.first_scan: asyncio.Task[None] | None = None

    # The parts' state, as the API and the tests read it ---------------------------------------

    def healthy(self) -> bool:
        """What the health checks answer: accepting work, and not holding back while the warm
        set is loaded again (``warm_ready_timeout``)."""
        return self.accepting and (self.warm is None or self.warm.settled())

    @property
    def real_time_queued(self) -> int:
        """Real-time jobs waiting in every model's queue now (background jobs not counted)."""
        queued = self.room.queued
        return queued.jobs - queued.background

    # Lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend processes, then load the models named by ``load_models`` and
        the pinned ones (:meth:`_load_pinned`); then, with a ``state_dir``, begin to load the
        warm set again (in the background: it does not delay the start)."""
        await self.backend.start()
        found = await asyncio.to_thread(self.envs.scan)
        if found:
            log.info("%d model environment(s) found in %s", found, self.envs.folder)
        await self.versions.open()
        self.files.bind(asyncio.get_running_loop())
        self.room.measure_budget(UNPACK_PROCESSES if self.files.processes is not None else 0)
        self.accepting = True
        self.first_scan = self._background(
            self._scan_local_store(), "mmserver-store-index-first-scan"
        )
        if self.backend.context is not None:
            self._background(self.room.watch_memory(), "mmserver-memory-watch")
        wanted = self.config.load_models.strip()
        if wanted and wanted.upper() != "NONE":
            await self._load_named(wanted)
        await self._load_pinned()
        if self.warm is not None:
            self.warm.start()

    async def _load_named(self, wanted: str) -> None:
        """Load the models ``load_models`` names (``ALL`` or a list; a failed load is
        logged)."""
        if wanted.upper() == "ALL":
            names = [model.name for model in await self.list_models()]
        else:
            names = [n.strip() for n in wanted.split(",") if n.strip()]
        for name in names:
            try:
                key = await self.versions.resolve(name)
                self.catalog.record(key).startup = True
                await self.loader.get_pool(key)
            except errors.MMServerError as exc:
                log.error("model %s not loaded at start: %s", name, exc.message)

    async def _load_pinned(self) -> None:
        """Load the models of the store that ``pinned_models`` matches. A set that does not fit
        (more models than ``max_loaded_models``, more memory than the budget) stops the start
        (:class:`errors.ConfigError`, naming the total); a model whose load fails is logged and
        loaded at its first request."""
        patterns = self.config.pinned
        if not patterns:
            return
        option = f"option pinned_models={self.config.pinned_models}"
        names = [m.name for m in await self.list_models() if matching(patterns, m.name)]
        if not names:
            log.warning("%s matches no model of the store", option)
            return
        limit = self.config.max_loaded_models
        if limit and len(names) > limit:
            raise errors.ConfigError(
                f"{option}: it pins {len(names)} models ({_some(names)}), more than "
                f"max_loaded_models={limit}"
            )
        log.info("loading %d pinned models (%s)", len(names), _some(names))
        room = self.room
        for name in names:
            try:
                await self.loader.get_pool(await self.versions.resolve(name))
            except errors.NoCapacity:
                raise errors.ConfigError(
                    self._pins_over(option, f"when model {name} could not load")
                ) from None
            except errors.MMServerError as exc:
                log.error("pinned model %s not loaded at start: %s", name, exc.message)
        if room.pinned_bytes() > room.budget_bytes:
            raise errors.ConfigError(self._pins_over(option, "once loaded"))

    def _pins_over(self, option: str, when: str) -> str:
        room = self.room
        return (
            f"{option}: the pinned models do not fit the memory budget of "
            f"{room.budget_bytes / 2**20:.0f} MiB ({room.budget.source}): {len(room.pinned)} of "
            f"them took {room.pinned_bytes() / 2**20:.0f} MiB {when}; pin fewer models or raise "
            "max_memory_mb"
        )

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` in a task of its own, cancelled by :meth:`stop`."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _scan_local_store(self) -> None:
        """Fill the store index once at start when the store is a directory (whose scans are
        cheap and whose changes its modification time tells), so that loads of the names it
        lists are looked up where they unpack (:mod:`mmserver.lifecycle.loading`). An object store's
        index is filled by the first listing."""
        try:
            if await asyncio.to_thread(self.store.version) is not None:
                await self.catalog.index.refresh()
        except Exception as exc:
            log.warning("the model store could not be scanned at start: %s", exc)

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (``/ping`` reports 503)."""
        self.accepting = False
        self.room.close()

    def _refuse_if_stopping(self) -> None:
        if not self.accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")

    async def stop(self, drain_timeout: float) -> None:
        """Refuse new jobs, answer every accepted one (up to ``drain_timeout`` seconds; what is
        left then is answered 503), stop the workers, then the backend processes."""
        if self._stopped:
            return
        self._stopped = True
        self.begin_shutdown()
        if self.warm is not None:
            await self.warm.stop()  # the set as it is, before the models drain
        await self.shadows.stop()
        await self.loader.cancel_all()
        await self.envs.stop()  # builds under way are stopped, their folders left unfinished
        # The pools drain as loaded models: they stay READY, with their series, until the end.
        records = [r for r in self.catalog.records.values() if r.pool is not None]
        await asyncio.gather(
            *(r.pool.stop(drain_timeout, unload=False) for r in records if r.pool is not None),
            return_exceptions=True,
        )
        for record in records:
            record.pool = None
            record.become(ModelStatus.UNLOADING)
            record.become(ModelStatus.UNLOADED)
            self.catalog.drop_if_unkept(record)
        self.room.forget_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.catalog.index.stop()
        await self.backend.stop()
        await self.files.close()
        self.refresh_metrics()

    # Requests ---------------------------------------------------------------------------------

    def submit(
        self,
        name: str,
        request: Request,
        client_gone: Callable[[], bool] | None = None,
        *,
        deadline: float | None = None,
        background: bool = False,
        routing: str | None = None,
        priority: int = NORMAL,
        trace: Trace | None = None,
    ) -> Submission:
        """Queue ``request`` for model ``name`` (any spelling), loading the model first if
        needed: every inference path comes in here. The answer's body is the result of the
        submission's future (its type follows from the request,
        :func:`~mmserver.codecs.answers.response_type`).

        A loaded model named exactly ``name`` gets the request queued at once, with no task of
        its own; otherwise a task finds (or loads) the model, then queues it. Raises
        :class:`errors.ShuttingDown` at once; every other error is the future's.
        ``deadline`` is on the event loop's clock; by default the model's predict_timeout.
        A ``background`` request (an asynchronous one) does not count toward the model's
        real-time scale-up (:mod:`mmserver.policy.scaling`). ``routing``, a routing key, picks the
        version of a canary rollout (:mod:`mmserver.lifecycle.versions`). ``priority``: the
        caller's tenant's (:data:`~mmserver.serving.jobs.PRIORITY`). ``trace``: a sampled
        request's (:mod:`mmserver.ops.traces`)."""
        if not self.accepting:  # checked inline: this is every request's path
            self._refuse_if_stopping()
        return self.submitter.submit(
            name, request, client_gone, deadline, background, routing, priority, trace
        )

    async def _run_shadow(self, key: str, request: Request) -> bytes:
        """A shadow run of ``request`` on version ``key``: a background job."""
        return await self.submit(key, request, background=True).answer

    async def ready(self, name: str) -> str:
        """Load model ``name`` (any spelling; of a model with versions, the version it names or
        the default) if it is not loaded; its name (a version's key)."""
        self._refuse_if_stopping()
        return (await self.loader.get_pool(await self.versions.resolve(name))).name

    async def set_default_version(self, name: str, version: int) -> Rollout:
        """Load version ``version`` of model ``name`` (management: no room is 507), then send
        the requests that name no version to it (:meth:`Versions.switch`)."""
        self._refuse_if_stopping()
        return await self.versions.switch(name, version, self._get_pool_for_management)

    async def set_share(self, name: str, version: int, role: str, percent: float) -> Rollout:
        """Load version ``version`` of model ``name``, then give it ``percent`` % of the
        requests that name no version as its ``role`` (``canary`` or ``shadow``; 0 ends the
        role, and nothing is loaded)."""
        self._refuse_if_stopping()
        load = self._get_pool_for_management
        return await self.versions.switch(name, version, load, role, percent)

    # Management -------------------------------------------------------------------------------

    def status(self, name: str) -> ModelStatus:
        """The status of model ``name`` (safe to call from any thread)."""
        record = self.catalog.records.get(name)
        return record.status if record is not None else ModelStatus.UNLOADED

    def failure(self, name: str) -> str | None:
        """Why the last load of ``name`` failed, while it counts as failed."""
        record = self.catalog.get(name)
        failure = record.failure if record is not None else None
        return failure.error.message if failure is not None else None

    def signature(self, name: str) -> dict[str, Any] | None:
        """What the load of model ``name`` told of it
        (:func:`mmserver.execution.predictor.signature`); ``None`` while it is not loaded into a
        backend (a model with ``minWorkers=0`` is
        loaded there on its first request)."""
        record = self.catalog.get(name)
        return record.signature if record is not None else None

    async def list_page(self, after: str | None, limit: int) -> tuple[list[ModelListing], bool]:
        """Up to ``limit`` models after the name ``after``, of the store and registered, sorted
        by name, and whether more follow. From the store index: O(log n + limit). A model
        with versions has the status of its default version."""
        page, more = await self.catalog.list_page(after, limit)
        return self.versions.listed(page), more

    async def list_models(self) -> list[ModelListing]:
        """Every model of the store and every registered one, sorted by name."""
        return self.versions.listed(await self.catalog.list_models())

    async def register(
        self,
        *,
        url: str,
        name: str | None,
        overrides: dict[str, Any],
        synchronous: bool,
        trusted: bool = False,
    ) -> str:
        """Register a model from a directory or archive under the allowed roots and load it
        (its files fully trusted if ``trusted``)."""
        self._refuse_if_stopping()
        path = await asyncio.to_thread(resolve_model_url, url, self.config.allowed_roots)
        name = normalize_name(name or path.name)
        entry = self.store.entry_for_path(path, name)
        self.catalog.register(name, entry, url, overrides, trusted)
        if not synchronous:
            self._background(self._register_in_background(name), f"mmserver-register-{name}")
            return name
        try:
            await self._get_pool_for_management(name)
        except BaseException:
            self.catalog.forget(name)
            raise
        return name

    async def load(self, name: str) -> None:
        """Load a model of the store, or a registered one, now (management: no room is 507)."""
        self._refuse_if_stopping()
        await self._get_pool_for_management(await self.versions.resolve(name))

    async def _get_pool_for_management(self, name: str) -> ModelPool:
        """The model's pool, loaded if needed, for a management call, which is told that the
        server has no room for the model as 507 (DJL's answer to a registration it cannot
        load), not 503."""
        try:
            return await self.loader.get_pool(name)
        except errors.NoCapacity as exc:
            raise errors.InsufficientMemory(exc.room) from None

    async def _register_in_background(self, name: str) -> None:
        try:
            await self._get_pool_for_management(name)
        except errors.MMServerError as exc:
            log.error("model %s: registration failed: %s", name, exc.message)

    async def rescale(self, name: str, overrides: dict[str, Any]) -> ModelConfig:
        """Apply new worker and batching settings to a model, live (loading it if needed);
        the model's configuration now."""
        self._refuse_if_stopping()
        name = await self.versions.resolve(name)
        self.catalog.check_overrides(overrides)
        pool = await self._get_pool_for_management(name)
        config = pool.config.requested(**overrides)
        record = self.catalog.get(name)
        if record is not None:
            record.overrides = {**(record.overrides or {}), **overrides}
        await pool.rescale(config)
        log.info("model %s rescaled: %s", name, overrides)
        return config

    async def pin(self, name: str, pinned: bool) -> str:
        """Pin model ``name`` (loading it if needed; no room is 507) or unpin it; its key.
        A model a ``pinned_models`` pattern pins cannot be unpinned by a call (400)."""
        self._refuse_if_stopping()
        key = await self.versions.resolve(name)
        if not pinned:
            by = matching(self.config.pinned, key)
            if by is not None:
                raise errors.InvalidInput(
                    f"model {key} is pinned by option pinned_models={by}; change the option "
                    "to unpin it"
                )
            self.room.unpin(key)
            return key
        why = self.room.too_many_pins(key)
        if why is not None:
            raise errors.InsufficientMemory(f"model {key} cannot be pinned: {why}")
        self.catalog.record(key).pinned = True
        try:
            self.room.pin((await self._get_pool_for_management(key)).name)
        except BaseException:
            self.room.unpin(key)
            raise
        log.info("model %s pinned by a management call", key)
        return key

    async def unload(self, name: str) -> None:
        """Unload a model or version (answering what it has queued first) and forget its
        registration. A model with versions: every version of it that is loaded."""
        name = normalize_target(name)
        rollout = self.versions.rollouts.get(name)
        if rollout is not None:
            keys = [k for k in map(rollout.key, rollout.versions) if self.catalog.get(k)]
            if not keys:
                raise errors.ModelNotFound(f"model {name}: none of its versions is loaded")
            for key in keys:
                await self.unload(key)
            return
        record = self.catalog.get(name)
        if record is not None and record.load is not None:
            await asyncio.gather(record.load, return_exceptions=True)
            record = self.catalog.get(name)
        known = record is not None and (
            record.pool is not None or record.registered is not None or record.failure is not None
        )
        if not known:
            raise errors.ModelNotFound(f"model {name} is not loaded")
        await self.room.unload(
            name, reason="unloaded by the management API", drain_timeout=self.config.predict_timeout
        )
        self.catalog.forget(name)

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges from the current state (called before a scrape; free on the hot
        path)."""
        self.room.refresh_metrics()
        self.metrics.processes.set_backends(self.backend.processes())


def _some(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names``, and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
