"""The WorkLoadManager: which models are loaded, loading them lazily, and unloading the least
recently used ones when memory runs short.

Request path: :meth:`WorkLoadManager.infer` finds the model's pool (loading the model on its
first request, one load however many requests wait for it), marks it most recently used, and
queues the request. The HTTP layer takes the same steps itself (``ready_pool``, ``ensure_pool``,
``enqueue``), so that a request to a loaded model costs no coroutine of its own. Everything runs
on the event loop; file work (listing, unpacking, reading ``serving.properties``) runs in threads.

Model lifecycle: UNLOADED → LOADING → READY → UNLOADING → UNLOADED, and LOADING → FAILED. A failed
load answers every request that waited for it with the reason, and is retried on a request that
comes ``load_retry_seconds`` later, not on every request of a storm.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import enum
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachetools import LRUCache

from mmserver import capacity, errors
from mmserver.backend import BackendPool, LoadInfo
from mmserver.codecs import Request
from mmserver.config import ModelConfig, ServerConfig, load_model_config
from mmserver.eviction import Candidate, choose_victims
from mmserver.metrics import Metrics
from mmserver.pool import ModelPool
from mmserver.store import (
    ModelSource,
    StoreEntry,
    StoreIndex,
    UnpackProcesses,
    normalize_name,
    resolve_model_url,
    suffix_of,
)

log = logging.getLogger(__name__)

#: Management overrides that may change on a loaded model (DJL's PUT /models/{model}).
RESCALABLE = (
    "min_workers",
    "max_workers",
    "batch_size",
    "max_batch_delay",
    "max_idle_time",
    "job_queue_size",
)


#: Threads unpacking archives (and reading serving.properties) for first loads.
UNPACK_THREADS = 4
#: Processes unpacking archives for those threads (with backend processes).
UNPACK_PROCESSES = 2
#: Failed loads remembered at most (each answers its model's requests until its retry time).
MAX_FAILURES = 1000
#: Models whose measured size and cost are remembered after they unload, at most.
MAX_REMEMBERED = 10_000


class ModelStatus(enum.Enum):
    UNLOADED = "UNLOADED"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    FAILED = "FAILED"


@dataclass
class _Failure:
    error: errors.MMServerError
    at: float


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
        )
        self.accepting = False
        self._stopped = False
        self.load_retry_seconds = load_retry_seconds
        self.room_wait_seconds = room_wait_seconds
        self._clock = clock
        self._defaults = config.model_defaults()
        # Archives unpack in threads of their own: store look-ups, scrapes and the other
        # blocking calls of the default pool never wait behind a slow archive.
        self._unpacker = ThreadPoolExecutor(UNPACK_THREADS, thread_name_prefix="mmserver-unpack")
        # With backend processes, the unpacking itself runs in processes of its own, so that a
        # stream of cold loads does not take the interpreter lock from the event loop.
        self._unpack_processes: UnpackProcesses | None = None
        if self.backend.context is not None:
            self._unpack_processes = UnpackProcesses(UNPACK_PROCESSES, self.backend.context)
            store.unpack = self._unpack_processes.unpack
        #: The memory budget of loaded models (MiB) and where it came from; measured again
        #: once the backend processes run (:meth:`start`).
        self.budget = config.memory_budget(capacity.rss_bytes([os.getpid()]))
        self._budget_bytes = self.budget.value * 2**20
        #: Loaded models, least recently used first.
        self._ready: collections.OrderedDict[str, ModelPool] = collections.OrderedDict()
        #: The sum of the loaded models' accounted_bytes (see _used_bytes).
        self._loaded_bytes = 0
        self._loading: dict[str, asyncio.Task[ModelPool]] = {}
        self._unloading: dict[str, asyncio.Task[None]] = {}
        #: Why loads failed, for the retry delay and describe; bounded (MAX_FAILURES).
        self._failures: collections.OrderedDict[str, _Failure] = collections.OrderedDict()
        self._registered: dict[str, StoreEntry] = {}
        self._overrides: dict[str, dict[str, Any]] = {}
        self._urls: dict[str, str] = {}  # as given to POST /models
        self._sources: dict[str, str] = {}  # where each loaded model came from, for users
        # Bytes of one copy, and seconds a batch holds a backend, remembered across evictions
        # for the next load's estimate and lane; bounded, least recently loaded forgotten.
        self._measured: LRUCache[str, int] = LRUCache(MAX_REMEMBERED)
        self._holds: LRUCache[str, float] = LRUCache(MAX_REMEMBERED)
        self._signatures: dict[str, dict[str, Any] | None] = {}  # of loaded models only
        self._startup: set[str] = set()  # named by load_models, until unregistered
        self._reserved_bytes = 0
        self._reserved_count = 0
        #: Set when room may have been made: a load ended or a loaded model went idle.
        self._room_changed = asyncio.Event()
        self._generation = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The store's names, for listing (:mod:`mmserver.store.index`).
        self.index = StoreIndex(store, max_age_s=config.store_index_max_age)

    # Lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend processes, then load the models named by ``load_models``."""
        await self.backend.start()
        if not self.config.max_memory_mb:
            # What the server holds before any model: the frontend and its backend processes.
            own = capacity.rss_bytes([os.getpid(), *self.backend.pids()])
            self.budget = self.config.memory_budget(own)
            self._budget_bytes = self.budget.value * 2**20
        self.accepting = True
        wanted = self.config.load_models.strip()
        if wanted.upper() == "NONE" or not wanted:
            return
        if wanted.upper() == "ALL":
            names = [m["modelName"] for m in await self.list_models()]
        else:
            names = [n.strip() for n in wanted.split(",") if n.strip()]
        for name in names:
            try:
                self._startup.add(normalize_name(name))
                await self._get_pool(name)
            except errors.MMServerError as exc:
                log.error("model %s not loaded at start: %s", name, exc.message)

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (``/ping`` reports 503)."""
        self.accepting = False

    async def stop(self, drain_timeout: float) -> None:
        """Refuse new jobs, answer every accepted one (up to ``drain_timeout`` seconds; what is
        left then is answered 503), stop the workers, then the backend processes."""
        if self._stopped:
            return
        self._stopped = True
        self.begin_shutdown()
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        pools = list(self._ready.values())
        await asyncio.gather(*(p.stop(drain_timeout) for p in pools), return_exceptions=True)
        self._ready.clear()
        self._loaded_bytes = 0
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.index.stop()
        await self.backend.stop()
        self._unpacker.shutdown(wait=False, cancel_futures=True)
        if self._unpack_processes is not None:
            await asyncio.to_thread(self._unpack_processes.close)
        self.refresh_metrics()

    # Requests ---------------------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        request: Request,
        *,
        deadline: float | None = None,
        client_gone: Callable[[], bool] | None = None,
    ) -> bytes:
        """Answer ``request`` with model ``name``: the body of the answer (its type follows from
        the request, :func:`~mmserver.codecs.response_type`).

        ``deadline`` is on the event loop's clock; by default the model's predict_timeout."""
        pool = self.ready_pool(name) or await self.ensure_pool(name)
        return await self.enqueue(pool, request, deadline=deadline, client_gone=client_gone)

    def ready_pool(self, name: str) -> ModelPool | None:
        """The pool of ``name`` if it is loaded under exactly that name, marked most recently
        used; otherwise ``None`` (then :meth:`ensure_pool` finds, or loads, it). Raises
        :class:`errors.ShuttingDown` once shutdown has begun."""
        if not self.accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")
        pool = self._ready.get(name)
        if pool is not None:
            self._ready.move_to_end(name)
        return pool

    async def ensure_pool(self, name: str) -> ModelPool:
        """The pool of model ``name`` (any spelling), loading the model first if needed."""
        if not self.accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")
        return await self._get_pool(name)

    def enqueue(
        self,
        pool: ModelPool,
        request: Request,
        *,
        deadline: float | None = None,
        client_gone: Callable[[], bool] | None = None,
    ) -> asyncio.Future[bytes]:
        """Queue ``request`` for ``pool``'s model at once; the future of the answer's body."""
        return pool.submit(request, deadline, client_gone)

    async def _get_pool(self, name: str, *, management: bool = False) -> ModelPool:
        """The pool of a loaded model, loading it first if needed (single flight)."""
        name = normalize_name(name)
        while True:
            pool = self._ready.get(name)
            if pool is not None:
                self._ready.move_to_end(name)
                return pool
            # A task that has ended stays in _unloading/_loading until its owner's next step;
            # awaiting it would return without yielding, so this loop would spin forever.
            unloading = self._unloading.get(name)
            if unloading is not None and not unloading.done():
                await asyncio.shield(unloading)
                continue
            task = self._loading.get(name)
            if task is not None and task.done():
                task = None  # its pool is already unloaded again: load anew
            if task is None:
                failure = self._failures.get(name)
                if failure is not None and self._clock() - failure.at < self.load_retry_seconds:
                    raise failure.error
                task = asyncio.get_running_loop().create_task(
                    self._load(name, management), name=f"mmserver-load-{name}"
                )
                self._loading[name] = task
                task.add_done_callback(self._load_ended)
            # Shielded: a client that goes away does not cancel a load others wait for.
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and current is not None and not current.cancelling():
                    # Not this request: the load was cancelled by stop(). Answer, don't drop it.
                    raise errors.ShuttingDown(
                        f"the server is shutting down; model {name} was not loaded"
                    ) from None
                raise

    # Loading and eviction ---------------------------------------------------------------------

    def _load_ended(self, task: asyncio.Task[ModelPool]) -> None:
        for name, loading in list(self._loading.items()):
            if loading is task:
                del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: the requests that waited for it got it

    async def _find(self, name: str) -> StoreEntry:
        """The store entry of ``name`` (a file-system or object-store lookup, in a thread), or
        :class:`errors.ModelNotFound`. Not remembered as a failure: an entry added to the store
        is found on its next request."""
        entry = self._registered.get(name) or await self._lookup(name)
        if entry is None:
            raise errors.ModelNotFound(
                f"model {name} is not in the model store ({self.store.root}) and is not "
                f"registered; add {name}.tar.gz (or a folder {name}/) to the store, or register "
                "it with POST /models"
            )
        return entry

    async def _lookup(self, name: str) -> StoreEntry | None:
        """The store's entry of ``name`` now (in a thread); the answer goes into the index."""
        entry = await asyncio.to_thread(self.store.find, name)
        self.index.note(name, None if entry is None else entry_suffix(entry))
        return entry

    async def _load(self, name: str, management: bool) -> ModelPool:
        started = time.perf_counter()
        self.metrics.open_model(name)
        try:
            return await self._load_model(name, management, started)
        except BaseException:
            self._release_series(name)
            raise

    def _release_series(self, name: str) -> None:
        """Remove the metric series of ``name`` unless it is loaded or its failure is still
        remembered (then its requests count under its name)."""
        if name not in self._ready and name not in self._failures:
            self.metrics.forget_model(name)

    def _remember_failure(self, name: str, error: errors.MMServerError) -> None:
        """Remember why ``name`` failed to load (bounded: the oldest failure is forgotten
        first, with its series)."""
        failures = self._failures
        failures.pop(name, None)
        failures[name] = _Failure(error, self._clock())
        while len(failures) > MAX_FAILURES:
            oldest, _ = failures.popitem(last=False)
            self._release_series(oldest)

    async def _load_model(self, name: str, management: bool, started: float) -> ModelPool:
        entry = await self._find(name)
        try:
            model_dir, config = await asyncio.get_running_loop().run_in_executor(
                self._unpacker, self._prepare, entry, name
            )
            need = self._estimate_bytes(name, entry, config)
            await self._make_room(name, need, management)  # reserves the room it made
            try:
                pool = await self._start_pool(name, model_dir, config)
            finally:
                self._reserved_bytes -= need
                self._reserved_count -= 1
                self._room_changed.set()
        except errors.MMServerError as exc:
            if isinstance(exc, errors.NoCapacity | errors.InsufficientMemory | errors.ShuttingDown):
                raise  # the model is fine; the server is full or stopping
            if isinstance(exc, errors.ModelLoadError) and not exc.message.startswith("model "):
                exc = type(exc)(f"model {name} failed to load: {exc.message}")
            self._remember_failure(name, exc)
            log.error("%s", exc.message)
            raise exc from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = errors.ModelLoadError(
                f"model {name} failed to load: {type(exc).__name__}: {exc}"
            )
            self._remember_failure(name, error)
            log.exception("model %s failed to load", name)
            raise error from None
        self._failures.pop(name, None)
        self._sources[name] = entry.url
        self._ready[name] = pool
        self._loaded_bytes += pool.accounted_bytes
        seconds = time.perf_counter() - started
        self.metrics.model_loads.inc()
        self.metrics.model_load_seconds.observe(seconds)
        self.metrics.models_loaded.set(len(self._ready))
        paths = pool.paths
        log.info(
            "model %s loaded from %s in %.1f ms (%d worker(s), %d loaded)%s",
            name,
            entry.url,
            seconds * 1000,
            len(pool.workers),
            len(self._ready),
            f"; {paths['family']} {paths['method']}: {paths['summary']}" if paths else "",
        )
        return pool

    async def _start_pool(self, name: str, model_dir: Path, config: ModelConfig) -> ModelPool:
        """The model's pool, started (its minWorkers loaded). A backend process that dies while
        the model loads into it is replaced, and the load is tried once more before it counts as
        the model's failure: a model whose own load kills its process fails the second time."""
        for attempt in (1, 2):
            self._generation += 1
            pool = ModelPool(
                name,
                f"{name}#{self._generation}",
                model_dir,
                config,
                self.backend,
                self.metrics,
                on_load=self._on_first_load,
                on_idle=self._room_changed.set,
                hold=self._holds.get(name),
                on_memory=self._memory_changed,
                known_bytes=self._measured.get(name, 0),
            )
            try:
                await pool.start()
            except errors.BackendDied as exc:
                await pool.stop(None)
                if attempt == 2:
                    raise
                log.warning("model %s: %s; loading it again", name, exc.message)
            except BaseException:
                await pool.stop(None)
                raise
            else:
                return pool
        raise AssertionError("unreachable")

    def _prepare(self, entry: StoreEntry, name: str) -> tuple[Path, ModelConfig]:
        """File work for a load (runs in a thread): unpack, then read serving.properties."""
        model_dir = self.store.prepare(entry)
        config = load_model_config(model_dir, self._defaults)
        overrides = self._overrides.get(name)
        if overrides:
            config = config.replace(**overrides)
        too_many = self.config.check_workers(config.min_workers, config.max_workers)
        if too_many is not None:
            raise errors.ConfigError(f"model {name}: serving.properties: {too_many}")
        return model_dir, config

    def _estimate_bytes(self, name: str, entry: StoreEntry, config: ModelConfig) -> int:
        if config.required_memory_mb is not None:
            return int(config.required_memory_mb * 2**20)
        return self._measured.get(name) or int(1.2 * entry.size_bytes)

    def _on_first_load(self, pool: ModelPool, info: LoadInfo) -> None:
        self._measured[pool.name] = pool.copy_bytes
        self._signatures[pool.name] = info.signature

    def _used_bytes(self) -> int:
        """The memory counted for the loaded models: the sum of their ``accounted_bytes``,
        kept as they change (O(1) a load, however many models are loaded)."""
        return self._loaded_bytes

    def _memory_changed(self, pool: ModelPool, change: int) -> None:
        if self._ready.get(pool.name) is pool:
            self._loaded_bytes += change

    async def _make_room(self, name: str, need: int, management: bool) -> None:
        """Unload least recently used idle models until ``need`` more bytes and one more model
        fit. While every loaded model is busy, wait (up to ``room_wait_seconds``) for one to go
        idle or for another load to end; then give up with 503 (507 for management)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.room_wait_seconds
        while True:
            victims = choose_victims(
                (Candidate(n, p.memory_bytes, p.busy) for n, p in self._ready.items()),
                loaded=len(self._ready) + self._reserved_count,
                used_bytes=self._used_bytes() + self._reserved_bytes,
                need_bytes=need,
                max_models=self.config.max_loaded_models,
                budget_bytes=self._budget_bytes,
            )
            remaining = give_up_at - loop.time()
            if victims is not None or remaining <= 0 or not self.accepting:
                break
            self._room_changed.clear()
            try:
                await asyncio.wait_for(self._room_changed.wait(), remaining)
            except TimeoutError:
                pass
        if victims is not None:
            # Reserved before any await, so concurrent loads cannot claim the same room.
            self._reserved_bytes += need
            self._reserved_count += 1
        if victims is None:
            message = (
                f"no room to load model {name}: {len(self._ready)} model(s) loaded, all busy "
                f"(max_loaded_models={self.config.max_loaded_models or 'unlimited'}, "
                f"memory budget {self._budget_bytes // 2**20} MiB)"
            )
            if management:
                raise errors.InsufficientMemory(message)
            raise errors.NoCapacity(message + "; retry later")
        for victim in victims:
            await self._unload(victim, reason=f"evicted (least recently used) to load {name}")
            self.metrics.model_evictions.inc()

    async def _unload(self, name: str, reason: str, drain_timeout: float | None = None) -> None:
        pool = self._ready.pop(name, None)
        if pool is None:
            return
        self._loaded_bytes -= pool.accounted_bytes
        self.metrics.models_loaded.set(len(self._ready))
        task = asyncio.get_running_loop().create_task(
            pool.stop(drain_timeout), name=f"mmserver-unload-{name}"
        )
        self._unloading[name] = task
        try:
            await asyncio.shield(task)
        finally:
            if self._unloading.get(name) is task:
                del self._unloading[name]
        if pool.cost.hold is not None:
            self._holds[name] = pool.cost.hold
        self._sources.pop(name, None)
        self._signatures.pop(name, None)
        self._release_series(name)
        log.info("model %s unloaded: %s (%d loaded)", name, reason, len(self._ready))

    # Management -------------------------------------------------------------------------------

    def status(self, name: str) -> ModelStatus:
        if name in self._ready:
            return ModelStatus.READY
        if name in self._loading:
            return ModelStatus.LOADING
        if name in self._unloading:
            return ModelStatus.UNLOADING
        if name in self._failures:
            return ModelStatus.FAILED
        return ModelStatus.UNLOADED

    def failure(self, name: str) -> str | None:
        """Why the last load of ``name`` failed, while it counts as failed."""
        failure = self._failures.get(name)
        return failure.error.message if failure is not None else None

    def signature(self, name: str) -> dict[str, Any] | None:
        """What the load of model ``name`` told of it (:func:`mmserver.predictor.signature`);
        ``None`` while it is not loaded into a backend (a model with ``minWorkers=0`` is
        loaded there on its first request)."""
        return self._signatures.get(name)

    async def list_page(self, after: str | None, limit: int) -> tuple[list[dict[str, str]], bool]:
        """Up to ``limit`` models after the name ``after``, of the store and registered, sorted
        by name, and whether more follow. From the store index: O(log n + limit)."""
        stored, more = await self.index.page(after, limit)
        registered = self._registered
        if registered:
            names = sorted(registered)
            start = bisect.bisect_right(names, after) if after else 0
            extra = [(n, registered[n].url) for n in names[start : start + limit]]
            more = more or start + limit < len(names)
            merged = dict(stored)
            merged.update(extra)
            rows = sorted(merged.items())
            more = more or len(rows) > limit
            stored = rows[:limit]
        return [
            {"modelName": n, "modelUrl": self._urls.get(n, url), "status": self.status(n).value}
            for n, url in stored
        ], more

    async def list_models(self) -> list[dict[str, str]]:
        """Every model of the store and every registered one, sorted by name."""
        models: list[dict[str, str]] = []
        after: str | None = None
        while True:
            page, more = await self.list_page(after, 10_000)
            models += page
            if not more or not page:
                return models
            after = page[-1]["modelName"]

    async def describe(self, name: str) -> dict[str, Any]:
        """The fields of DJL's ``DescribeWorkflowResponse.Model`` for model ``name``, and the
        server's own (memory, cost, predict paths, the last load's error)."""
        name = normalize_name(name)
        pool = self._ready.get(name)
        entry = self._registered.get(name)
        if pool is None and entry is None:
            entry = await self._lookup(name)
            if entry is None:
                raise errors.ModelNotFound(f"model {name} is not in the store nor registered")
        config = (
            pool.config
            if pool is not None
            else self._defaults.replace(**self._overrides.get(name, {}))
        )
        source = entry.url if entry is not None else self._sources.get(name)
        url = self._urls.get(name) or str(source)
        result: dict[str, Any] = {
            "modelName": name,
            "modelUrl": url,
            "batchSize": config.batch_size,
            "maxBatchDelayMillis": config.max_batch_delay,
            "maxIdleSeconds": config.max_idle_time,
            "queueSize": config.job_queue_size,
            "requestInQueue": len(pool.queue) if pool is not None else 0,
            "status": self.status(name).value,
            "loadedAtStartup": name in self._startup,
            "workerGroups": [
                {
                    "device": {"deviceType": "cpu", "deviceId": -1},
                    "minWorkers": config.min_workers,
                    "maxWorkers": config.max_workers,
                    "workers": pool.describe_workers() if pool is not None else [],
                }
            ],
        }
        if pool is not None:
            result["memoryBytes"] = pool.memory_bytes
            result.update(pool.describe_cost())
        failure = self._failures.get(name)
        if failure is not None:
            result["error"] = failure.error.message
        return result

    async def register(
        self, *, url: str, name: str | None, overrides: dict[str, Any], synchronous: bool
    ) -> str:
        """Register a model from a directory or archive under the allowed roots and load it."""
        path = await asyncio.to_thread(resolve_model_url, url, self.config.allowed_roots)
        if not name:
            name = path.name
        name = normalize_name(name)
        if name in self._ready or name in self._loading or name in self._registered:
            raise errors.ModelExists(f"model {name} is already registered; DELETE it first")
        entry = self.store.entry_for_path(path, name)
        self._check_overrides(overrides)
        self._registered[name] = entry
        self._urls[name] = url
        self._failures.pop(name, None)
        if overrides:
            self._overrides[name] = dict(overrides)
        if not synchronous:
            task = asyncio.get_running_loop().create_task(
                self._register_in_background(name), name=f"mmserver-register-{name}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return name
        try:
            await self._get_pool(name, management=True)
        except BaseException:
            self._forget(name)
            raise
        return name

    async def load(self, name: str) -> None:
        """Load a model of the store, or a registered one, now (management: no room is 507)."""
        if not self.accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")
        await self._get_pool(name, management=True)

    async def _register_in_background(self, name: str) -> None:
        try:
            await self._get_pool(name, management=True)
        except errors.MMServerError as exc:
            log.error("model %s: registration failed: %s", name, exc.message)

    def _check_overrides(self, overrides: dict[str, Any]) -> None:
        unknown = set(overrides) - set(RESCALABLE)
        if unknown:
            raise errors.InvalidInput(f"unknown setting(s): {', '.join(sorted(unknown))}")
        try:
            self._defaults.replace(**overrides)
        except errors.ConfigError as exc:
            raise errors.InvalidInput(exc.message) from None
        too_many = self.config.check_workers(
            overrides.get("min_workers", 0), overrides.get("max_workers", 0)
        )
        if too_many is not None:
            raise errors.InvalidInput(too_many)

    async def rescale(self, name: str, overrides: dict[str, Any]) -> ModelConfig:
        """Apply new worker and batching settings to a model, live (loading it if needed);
        the model's configuration now."""
        name = normalize_name(name)
        self._check_overrides(overrides)
        pool = await self._get_pool(name, management=True)
        try:
            config = pool.config.replace(**overrides)
        except errors.ConfigError as exc:
            raise errors.InvalidInput(exc.message) from None
        self._overrides.setdefault(name, {}).update(overrides)
        await pool.rescale(config)
        log.info("model %s rescaled: %s", name, overrides)
        return config

    async def unload(self, name: str) -> None:
        """Unload a model (answering what it has queued first) and forget its registration."""
        name = normalize_name(name)
        task = self._loading.get(name)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        known = name in self._ready or name in self._registered or name in self._failures
        if not known:
            raise errors.ModelNotFound(f"model {name} is not loaded")
        await self._unload(
            name, reason="unloaded by the management API", drain_timeout=self.config.predict_timeout
        )
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._startup.discard(name)
        self._registered.pop(name, None)
        self._overrides.pop(name, None)
        self._urls.pop(name, None)
        if self._failures.pop(name, None) is not None:
            self._release_series(name)

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges from the current state (called before a scrape; free on the hot
        path)."""
        m = self.metrics
        if m.workers.labelled:
            for name, pool in self._ready.items():
                m.queue_length.labels(name).set(len(pool.queue))
                m.workers.labels(name).set(len(pool.workers))
                m.model_lane.labels(name, pool.lane).set(1)
        else:
            lanes = dict.fromkeys(self.backend.lanes, 0)
            queued = workers = 0
            for pool in self._ready.values():
                queued += len(pool.queue)
                workers += len(pool.workers)
                lanes[pool.lane] = lanes.get(pool.lane, 0) + 1
            m.queue_length.set(queued)
            m.workers.set(workers)
            for lane, count in lanes.items():
                m.model_lane.labels("", lane).set(count)
        m.models_loaded.set(len(self._ready))
        m.model_memory_bytes.set(self._used_bytes())

    @property
    def loaded(self) -> list[str]:
        """Loaded model names, least recently used first."""
        return list(self._ready)

    def pool(self, name: str) -> ModelPool | None:
        return self._ready.get(name)


def entry_suffix(entry: StoreEntry) -> str:
    """The suffix of a store entry's file name (``""`` for a folder, else the archive's)."""
    return suffix_of(entry.url.rsplit("/", 1)[-1], entry.name)
