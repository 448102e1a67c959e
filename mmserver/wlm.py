"""The WorkLoadManager: which models are loaded, loading them lazily, and unloading the least
recently used ones when memory runs short.

Request path: every protocol's handler calls :meth:`WorkLoadManager.submit`, which finds the
model's pool (loading the model on its first request, one load however many requests wait for
it), marks it most recently used, and queues the request; a request to a loaded model costs no
coroutine of its own. Everything runs on the event loop; a load's file work (looking up,
unpacking, reading ``serving.properties``: :mod:`mmserver.files`) runs in the unpacking
processes (or threads), and listing the store in a thread.

Each model the manager knows of has one :class:`~mmserver.record.ModelRecord`, with its status
and its checked transitions (UNLOADED → LOADING → READY → UNLOADING → UNLOADED, LOADING →
FAILED). A failed load answers every request that waited for it with the reason, and is retried
on a request that comes ``load_retry_seconds`` later, not on every request of a storm.

What the manager returns is data (:class:`ModelView`, :class:`ModelListing`); the API renders it
in each protocol's shapes.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from cachetools import LRUCache

from mmserver import capacity, errors, files
from mmserver.backend import BackendPool, LoadInfo
from mmserver.codecs import Request
from mmserver.config import ModelConfig, ServerConfig
from mmserver.eviction import Candidate, choose_victims
from mmserver.jobs import Tally
from mmserver.metrics import Metrics, ModelRequests
from mmserver.pool import ModelPool
from mmserver.record import Failure, ModelRecord, ModelStatus
from mmserver.scheduling import Cost
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


#: Threads doing a load's file work (:mod:`mmserver.files`) where the unpacking processes do
#: not: without backend processes, and an object store's downloads.
UNPACK_THREADS = 4
#: Processes doing a load's file work (with backend processes).
UNPACK_PROCESSES = 2
#: Failed loads remembered at most (each answers its model's requests until its retry time).
MAX_FAILURES = 1000
#: Models whose measured size and cost are remembered after they unload, at most.
MAX_REMEMBERED = 10_000
#: Seconds between two readings of the backend processes' resident memory (a read of
#: ``/proc/PID/statm`` each, ~10 µs), and after a load ends: how long what a model's predictions
#: keep, or a leak, may stay over the budget before models are evicted or a process replaced.
MEMORY_WATCH_S = 1.0


class Submission:
    """What :meth:`WorkLoadManager.submit` gives back: the future of the answer's body, and the
    model's series to count the answer in, known once the request has reached a loaded model
    (at once for a loaded one)."""

    __slots__ = ("answer", "requests")

    answer: asyncio.Future[bytes]
    requests: ModelRequests | None

    def __init__(self, answer: asyncio.Future[bytes], requests: ModelRequests | None) -> None:
        self.answer = answer
        self.requests = requests


@dataclass(frozen=True)
class WorkerView:
    """One worker of a loaded model, for describe."""

    id: int
    start_time: float
    status: str
    backend: int
    lane: str


@dataclass(frozen=True)
class ModelView:
    """What the server knows of one model, for describe (rendered by the API)."""

    name: str
    url: str
    status: ModelStatus
    config: ModelConfig
    startup: bool
    queued: int = 0
    workers: tuple[WorkerView, ...] = ()
    #: Of a loaded model: its memory, lane, measured cost, and the predict paths its first load
    #: chose with the batches each took (``None`` for a custom handler).
    memory_bytes: int | None = None
    lane: str | None = None
    cost: Cost | None = None
    paths: dict[str, Any] | None = None
    path_batches: dict[str, int] | None = None
    error: str | None = None
    #: The named columns a loaded model takes (:mod:`mmserver.schema`); ``None`` for a model
    #: that takes rows of numbers.
    inputs: list[dict[str, Any]] | None = None


class ModelListing(NamedTuple):
    """One row of a listing: a model's name, url and status."""

    name: str
    url: str
    status: ModelStatus


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
        self.load_retry_seconds = load_retry_seconds
        self.room_wait_seconds = room_wait_seconds
        self._clock = clock
        self._defaults = config.model_defaults()
        # File work runs in threads of its own: look-ups of unknown names, scrapes and the other
        # blocking calls of the default pool never wait behind a slow archive.
        self._unpacker = ThreadPoolExecutor(UNPACK_THREADS, thread_name_prefix="mmserver-unpack")
        # With backend processes, it runs in processes of its own, so that a stream of cold
        # loads does not take the interpreter lock from the event loop.
        self._unpack_processes: UnpackProcesses | None = None
        #: The store as an unpacking process opens it (``None``: an object store, whose
        #: downloads stay in the frontend's threads and hand only their archives over).
        self._portable_store = store.portable()
        if self.backend.context is not None:
            self._unpack_processes = UnpackProcesses(UNPACK_PROCESSES, self.backend.context)
            if self._portable_store is None:
                store.unpack = self._unpack_processes.unpack
        #: The memory budget of loaded models (MiB) and where it came from; measured again
        #: once the backend processes run (:meth:`start`).
        self.budget = config.memory_budget(capacity.rss_bytes([os.getpid()]))
        self._budget_bytes = self.budget.value * 2**20
        #: Every model the server knows of now, least recently used first (see ModelRecord).
        self._models: collections.OrderedDict[str, ModelRecord] = collections.OrderedDict()
        #: How many of them are READY, and the sum of their pools' accounted_bytes.
        self._loaded = 0
        self._loaded_bytes = 0
        #: The jobs queued for every model, and the loaded models in each lane (the metrics'
        #: server-wide gauges, kept as they change).
        self._queued = Tally()
        self._lanes: collections.Counter[str] = collections.Counter()
        #: The models whose failure is remembered, the oldest failure first (MAX_FAILURES).
        self._failed: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: The registered models' names (their records hold the entries), so that a listing's
        #: pages merge them without a pass over every record.
        self._registered: set[str] = set()
        # Bytes of one copy, and seconds a batch holds a backend, remembered across evictions
        # for the next load's estimate and lane; bounded, least recently loaded forgotten.
        self._measured: LRUCache[str, int] = LRUCache(MAX_REMEMBERED)
        self._holds: LRUCache[str, float] = LRUCache(MAX_REMEMBERED)
        self._reserved_bytes = 0
        self._reserved_count = 0
        #: Set when room may have been made: a load ended or a loaded model went idle.
        self._room_changed = asyncio.Event()
        #: Set when a load ended: the memory watch reads the backends' memory then.
        self._loaded_one = asyncio.Event()
        self._generation = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The scan of a local store begun at :meth:`start` (which does not wait for it).
        self.first_scan: asyncio.Task[None] | None = None
        #: The store's names, for listing (:mod:`mmserver.store.index`).
        self.index = StoreIndex(store, max_age_s=config.store_index_max_age)

    # Lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend processes, then load the models named by ``load_models``."""
        await self.backend.start()
        if self._unpack_processes is not None:
            self._unpack_processes.bind(asyncio.get_running_loop())
        if not self.config.max_memory_mb:
            # What the server holds before any model: the frontend and its backend processes,
            # and as much again as a backend for each process started on first use (the heavy
            # lane's and the unpacking ones).
            started = self.backend.pids()
            own = capacity.rss_bytes([os.getpid(), *started])
            later = len(self.backend.slots) - len(started)
            if self._unpack_processes is not None:
                later += UNPACK_PROCESSES
            if started and later:
                own += later * max(capacity.rss_bytes([pid]) for pid in started)
            self.budget = self.config.memory_budget(own)
            self._budget_bytes = self.budget.value * 2**20
        self.accepting = True
        self.first_scan = self._background(
            self._scan_local_store(), "mmserver-store-index-first-scan"
        )
        if self.backend.context is not None:
            self._background(self._watch_memory(), "mmserver-memory-watch")
        wanted = self.config.load_models.strip()
        if wanted.upper() == "NONE" or not wanted:
            return
        if wanted.upper() == "ALL":
            names = [model.name for model in await self.list_models()]
        else:
            names = [n.strip() for n in wanted.split(",") if n.strip()]
        for name in names:
            try:
                self._record(normalize_name(name)).startup = True
                await self._get_pool(name)
            except errors.MMServerError as exc:
                log.error("model %s not loaded at start: %s", name, exc.message)

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` in a task of its own, cancelled by :meth:`stop`."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _scan_local_store(self) -> None:
        """Fill the store index once at start when the store is a directory (whose scans are
        cheap and whose changes its modification time tells), so that loads of the names it
        lists are looked up where they unpack (:meth:`_load`). An object store's index is
        filled by the first listing."""
        try:
            if await asyncio.to_thread(self.store.version) is not None:
                await self.index.refresh()
        except Exception as exc:
            log.warning("the model store could not be scanned at start: %s", exc)

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (``/ping`` reports 503)."""
        self.accepting = False

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
        loads = [r.load for r in self._models.values() if r.load is not None]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        # The pools drain as loaded models: they stay READY, with their series, until the end.
        loaded = [(r, r.pool) for r in self._models.values() if r.pool is not None]
        await asyncio.gather(
            *(pool.stop(drain_timeout) for _, pool in loaded), return_exceptions=True
        )
        for record, _ in loaded:
            record.pool = None
            record.become(ModelStatus.UNLOADING)
            record.become(ModelStatus.UNLOADED)
            self._drop_if_unkept(record)
        self._loaded = self._loaded_bytes = 0
        self._lanes.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.index.stop()
        await self.backend.stop()
        self._unpacker.shutdown(wait=False, cancel_futures=True)
        if self._unpack_processes is not None:
            await self._unpack_processes.close()
        self.refresh_metrics()

    # Requests ---------------------------------------------------------------------------------

    def submit(
        self,
        name: str,
        request: Request,
        client_gone: Callable[[], bool] | None = None,
        *,
        deadline: float | None = None,
    ) -> Submission:
        """Queue ``request`` for model ``name`` (any spelling), loading the model first if
        needed: every inference path comes in here. The answer's body is the result of the
        submission's future (its type follows from the request,
        :func:`~mmserver.answers.response_type`).

        A loaded model named exactly ``name`` gets the request queued at once, with no task of
        its own; otherwise a task finds (or loads) the model, then queues it. Raises
        :class:`errors.ShuttingDown` at once; every other error is the future's.
        ``deadline`` is on the event loop's clock; by default the model's predict_timeout."""
        self._refuse_if_stopping()
        record = self._models.get(name)
        if record is not None:
            pool = record.pool
            if pool is not None:
                self._models.move_to_end(name)
                try:
                    answer = pool.submit(request, deadline, client_gone)
                except errors.MMServerError as exc:  # the model's queue is full
                    answer = asyncio.get_running_loop().create_future()
                    answer.set_exception(exc)
                return Submission(answer, pool.requests)
        submission = Submission.__new__(Submission)
        submission.requests = None
        submission.answer = asyncio.get_running_loop().create_task(
            self._submit_after_load(name, request, deadline, client_gone, submission)
        )
        return submission

    async def _submit_after_load(
        self,
        name: str,
        request: Request,
        deadline: float | None,
        client_gone: Callable[[], bool] | None,
        submission: Submission,
    ) -> bytes:
        arrived = asyncio.get_running_loop().time()  # the load it waits for counts
        pool = await self._get_pool(name)
        submission.requests = pool.requests
        return await pool.submit(request, deadline, client_gone, arrived)

    async def infer(
        self,
        name: str,
        request: Request,
        *,
        deadline: float | None = None,
        client_gone: Callable[[], bool] | None = None,
    ) -> bytes:
        """:meth:`submit`, and wait for the answer's body."""
        return await self.submit(name, request, client_gone, deadline=deadline).answer

    async def ready(self, name: str) -> str:
        """Load model ``name`` (any spelling) if it is not loaded; its name."""
        self._refuse_if_stopping()
        return (await self._get_pool(name)).name

    def _record(self, name: str) -> ModelRecord:
        """The record of ``name``, made if the server did not know the model yet."""
        record = self._models.get(name)
        if record is None:
            record = self._models[name] = ModelRecord(name)
        return record

    def _drop_if_unkept(self, record: ModelRecord) -> None:
        if not record.kept and self._models.get(record.name) is record:
            del self._models[record.name]

    async def _get_pool(self, name: str) -> ModelPool:
        """The pool of a loaded model, loading it first if needed (single flight)."""
        name = normalize_name(name)
        while True:
            record = self._models.get(name)
            if record is not None:
                if record.pool is not None:
                    self._models.move_to_end(name)
                    return record.pool
                if record.unload is not None:
                    await asyncio.shield(record.unload)
                    continue
            task = record.load if record is not None else None
            if task is None:
                failure = record.failure if record is not None else None
                if failure is not None and self._clock() - failure.at < self.load_retry_seconds:
                    raise failure.error
                record = self._record(name)
                record.become(ModelStatus.LOADING)
                task = asyncio.get_running_loop().create_task(
                    self._load(record), name=f"mmserver-load-{name}"
                )
                record.load = task
                task.add_done_callback(functools.partial(self._load_done, record))
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

    async def _find(self, record: ModelRecord) -> StoreEntry:
        """The store entry of the model (a file-system or object-store lookup, in a thread), or
        :class:`errors.ModelNotFound`."""
        name = record.name
        return self._found(name, record.registered or await self._lookup(name))

    def _found(self, name: str, entry: StoreEntry | None) -> StoreEntry:
        """``entry``, or :class:`errors.ModelNotFound` when the lookup found no model."""
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

    async def _load(self, record: ModelRecord) -> ModelPool:
        """Load the model of ``record`` (LOADING): READY with its pool, FAILED with the reason
        when the model is at fault, else back to what it was before.

        A model the store index lists is looked up where its files are then prepared, in one
        request (:meth:`_file_work`). Any other name is looked up on its own first (in the
        default thread pool), so that an unknown name is answered 404 without waiting behind
        archives being unpacked."""
        name = record.name
        started = time.perf_counter()
        self.metrics.open_model(name)
        prepared: files.Prepared | Exception | None = None
        try:
            # Not remembered as a failure: an entry added to the store is found on its next
            # request, and a refused name says nothing of a model.
            if record.registered is None and name in self.index:
                entry, prepared = await self._file_work(name, files.find_and_prepare, name)
                self.index.note(name, None if entry is None else entry_suffix(entry))
                entry = self._found(name, entry)
            else:
                entry = await self._find(record)
        except BaseException:
            self._load_abandoned(record)
            raise
        try:
            pool = await self._load_model(record, entry, prepared)
        except errors.ResourceError:
            self._load_abandoned(record)
            raise  # the model is fine; the server is full or stopping
        except errors.MMServerError as exc:
            if isinstance(exc, errors.ModelLoadError) and exc.model is None:
                exc = type(exc)(f"model {name} failed to load: {exc.message}", model=name)
            self._load_failed(record, exc)
            log.error("%s", exc.message)
            raise exc from None
        except asyncio.CancelledError:
            self._load_abandoned(record)
            raise
        except Exception as exc:
            error = errors.ModelLoadError(
                f"model {name} failed to load: {type(exc).__name__}: {exc}", model=name
            )
            self._load_failed(record, error)
            log.exception("model %s failed to load", name)
            raise error from None
        record.load = None
        record.pool = pool
        record.become(ModelStatus.READY)
        if record.failure is not None:
            record.failure = None
            self._failed.pop(name, None)
        self._models.move_to_end(name)
        self._loaded += 1
        self._lanes[pool.lane] += 1
        self._loaded_bytes += pool.accounted_bytes
        seconds = time.perf_counter() - started
        self.metrics.model_loads.inc()
        self.metrics.model_load_seconds.observe(seconds)
        self.metrics.models_loaded.set(self._loaded)
        paths = pool.paths
        log.info(
            "model %s loaded from %s in %.1f ms (%d worker(s), %d loaded)%s",
            name,
            record.source,
            seconds * 1000,
            len(pool.workers),
            self._loaded,
            f"; {paths['family']} {paths['method']}: {paths['summary']}" if paths else "",
        )
        return pool

    def _load_done(self, record: ModelRecord, task: asyncio.Task[ModelPool]) -> None:
        if task.cancelled():
            if record.load is task:  # cancelled (by stop) before it began: nothing ended it
                self._load_abandoned(record)
        else:
            task.exception()  # retrieved: the requests that waited for it got it

    def _load_abandoned(self, record: ModelRecord) -> None:
        """The load ended for a reason that is not the model's: back to FAILED (a failure is
        still remembered) or UNLOADED."""
        record.load = None
        record.become(ModelStatus.FAILED if record.failure is not None else ModelStatus.UNLOADED)
        self._release_series(record)
        self._drop_if_unkept(record)

    def _load_failed(self, record: ModelRecord, error: errors.MMServerError) -> None:
        """Remember why the model failed to load (bounded: the oldest failure is forgotten
        first, with its series)."""
        record.load = None
        record.failure = Failure(error, self._clock())
        record.become(ModelStatus.FAILED)
        failed = self._failed
        failed.pop(record.name, None)
        failed[record.name] = None
        while len(failed) > MAX_FAILURES:
            oldest, _ = failed.popitem(last=False)
            forgotten = self._models.get(oldest)
            if forgotten is not None:
                self._forget_failure(forgotten)

    def _clear_failure(self, record: ModelRecord) -> bool:
        """Forget why the model's last load failed (FAILED → UNLOADED); whether it had."""
        if record.failure is None:
            return False
        record.failure = None
        self._failed.pop(record.name, None)
        if record.status is ModelStatus.FAILED:
            record.become(ModelStatus.UNLOADED)
        return True

    def _forget_failure(self, record: ModelRecord) -> None:
        """:meth:`_clear_failure`, and the model's series and record unless something else
        holds them."""
        if self._clear_failure(record):
            self._release_series(record)
            self._drop_if_unkept(record)

    def _release_series(self, record: ModelRecord) -> None:
        """Remove the metric series of the model unless it is loading or loaded, or its failure
        is still remembered (then its requests count under its name)."""
        if record.status in (ModelStatus.UNLOADED, ModelStatus.UNLOADING):
            self.metrics.forget_model(record.name)

    async def _load_model(
        self,
        record: ModelRecord,
        entry: StoreEntry,
        prepared: files.Prepared | Exception | None = None,
    ) -> ModelPool:
        """Load the model of ``entry``; ``prepared`` is what :func:`files.find_and_prepare` made
        of its files (``None``: prepare them now)."""
        name = record.name
        if prepared is None:
            prepared = await self._file_work(name, files.prepare, entry)
        if isinstance(prepared, Exception):
            raise prepared
        model_dir, config = prepared
        config = self._configured(record, config or self._defaults)
        need = self._estimate_bytes(name, entry, config)
        await self._make_room(name, need)  # reserves the room it made
        try:
            pool = await self._start_pool(name, model_dir, config)
        finally:
            self._reserved_bytes -= need
            self._reserved_count -= 1
            self._room_changed.set()
            self._loaded_one.set()
        record.source = entry.url
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
                queued=self._queued,
                on_move=self._lane_changed,
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

    async def _file_work(self, name: str, work: Callable[..., Any], *args: Any) -> Any:
        """``work(store, *args, defaults)``, a function of :mod:`mmserver.files` for model
        ``name``: in an unpacking process when the store can be opened there (a directory),
        else in an unpacking thread."""
        processes, portable = self._unpack_processes, self._portable_store
        if processes is not None and portable is not None:
            what = "preparing its files"
            return await processes.run(name, what, work, portable, *args, self._defaults)
        return await asyncio.get_running_loop().run_in_executor(
            self._unpacker, functools.partial(work, self.store, *args, self._defaults)
        )

    def _configured(self, record: ModelRecord, config: ModelConfig) -> ModelConfig:
        """The model's configuration with its management overrides, checked against the
        server's worker limit."""
        overrides = record.overrides
        if overrides:
            config = config.replace(**overrides)
        too_many = self.config.check_workers(config.min_workers, config.max_workers)
        if too_many is not None:
            raise errors.ConfigError(
                f"model {record.name}: serving.properties: {too_many}", model=record.name
            )
        return config

    def _estimate_bytes(self, name: str, entry: StoreEntry, config: ModelConfig) -> int:
        if config.required_memory_mb is not None:
            return int(config.required_memory_mb * 2**20)
        return self._measured.get(name) or int(1.2 * entry.size_bytes)

    def _on_first_load(self, pool: ModelPool, info: LoadInfo) -> None:
        self._measured[pool.name] = pool.copy_bytes
        record = self._models.get(pool.name)
        if record is not None:
            record.signature = info.signature

    def _used_bytes(self) -> int:
        """The memory counted for the loaded models: the sum of their ``accounted_bytes``,
        kept as they change (O(1) a load, however many models are loaded)."""
        return self._loaded_bytes

    def _lane_changed(self, pool: ModelPool, old: str) -> None:
        record = self._models.get(pool.name)
        if record is not None and record.pool is pool:
            self._lanes[old] -= 1
            self._lanes[pool.lane] += 1

    def _memory_changed(self, pool: ModelPool, change: int) -> None:
        record = self._models.get(pool.name)
        if record is not None and record.pool is pool:
            self._loaded_bytes += change

    async def _make_room(self, name: str, need: int) -> None:
        """Unload least recently used idle models until ``need`` more bytes and one more model
        fit. While every loaded model is busy, wait (up to ``room_wait_seconds``) for one to go
        idle or for another load to end; then give up with :class:`errors.NoCapacity`."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.room_wait_seconds
        while True:
            victims = choose_victims(
                (
                    Candidate(n, r.pool.memory_bytes, r.pool.busy)
                    for n, r in self._models.items()
                    if r.pool is not None
                ),
                loaded=self._loaded + self._reserved_count,
                used_bytes=self._used_bytes() + self._reserved_bytes + self._unaccounted(),
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
        if victims is None:
            raise errors.NoCapacity(
                f"no room to load model {name}: {self._loaded} model(s) loaded, all busy "
                f"(max_loaded_models={self.config.max_loaded_models or 'unlimited'}, "
                f"memory budget {self._budget_bytes // 2**20} MiB)"
            )
        # Reserved before any await, so concurrent loads cannot claim the same room.
        self._reserved_bytes += need
        self._reserved_count += 1
        for victim in victims:
            await self._unload(victim, reason=f"evicted (least recently used) to load {name}")
            self.metrics.model_evictions.inc()

    def _unaccounted(self) -> int:
        """What the backend processes hold beyond their start and their models' measured
        loads (:meth:`~mmserver.backend.ProcessSlot.unaccounted_bytes`): counted against the
        budget with the models."""
        return sum(slot.unaccounted_bytes() for slot in self.backend.slots)

    async def _watch_memory(self) -> None:
        """Every :data:`MEMORY_WATCH_S`, and after each load, keep the backends' memory in the
        budget (:meth:`_keep_in_budget`)."""
        while True:
            try:
                await asyncio.wait_for(self._loaded_one.wait(), MEMORY_WATCH_S)
            except TimeoutError:
                pass
            self._loaded_one.clear()
            try:
                await self._keep_in_budget()
            except Exception:
                log.exception("the memory watch failed; it goes on")

    async def _keep_in_budget(self) -> None:
        """Replace each backend process that holds more than its share of the budget
        (the budget over the processes running) beyond what its models' loads measured, once
        it is idle; then, while the loaded models and what the processes hold beyond them pass
        the budget, unload the least recently used idle model (an unload gives its pages back,
        and with them what its predictions kept)."""
        share = self._budget_bytes // max(1, len(self.backend.pids()))
        for slot in self.backend.slots:
            extra = slot.unaccounted_bytes()
            if extra > share:
                slot.recycle(
                    f"it held {extra / 2**20:.0f} MiB beyond its models' measured loads, more "
                    f"than its share of the memory budget ({share / 2**20:.0f} MiB)"
                )
        for _ in range(self._loaded):
            unaccounted = self._unaccounted()
            used = self._used_bytes() + self._reserved_bytes + unaccounted
            if used <= self._budget_bytes:
                return
            victim = next((n for n, r in self._models.items() if r.pool and not r.pool.busy), None)
            if victim is None:
                return
            await self._unload(
                victim,
                reason=f"evicted (least recently used): the models and the backend processes held "
                f"{used / 2**20:.0f} MiB ({unaccounted / 2**20:.0f} MiB of it beyond the models' "
                f"measured loads), over the memory budget of {self._budget_bytes / 2**20:.0f} MiB",
            )
            self.metrics.model_evictions.inc()

    async def _unload(self, name: str, reason: str, drain_timeout: float | None = None) -> None:
        """READY → UNLOADING → UNLOADED: the pool leaves the loaded models at once, then stops
        (answering what it has queued, up to ``drain_timeout``); logged with ``reason``."""
        record = self._models.get(name)
        if record is None or record.pool is None:
            return
        pool, record.pool = record.pool, None
        record.become(ModelStatus.UNLOADING)
        self._loaded -= 1
        self._lanes[pool.lane] -= 1
        self._loaded_bytes -= pool.accounted_bytes
        self.metrics.models_loaded.set(self._loaded)
        task = asyncio.get_running_loop().create_task(
            self._stop_pool(record, pool, reason, drain_timeout), name=f"mmserver-unload-{name}"
        )
        record.unload = task
        await asyncio.shield(task)

    async def _stop_pool(
        self, record: ModelRecord, pool: ModelPool, reason: str, drain_timeout: float | None
    ) -> None:
        try:
            await pool.stop(drain_timeout)
        finally:
            record.unload = None
            record.become(ModelStatus.UNLOADED)
            record.source = None
            record.signature = None
            if pool.cost.hold is not None:  # its lane, when it loads again
                self._holds[record.name] = pool.cost.single
            self._release_series(record)
            self._drop_if_unkept(record)
        log.info("model %s unloaded: %s (%d loaded)", record.name, reason, self._loaded)

    # Management -------------------------------------------------------------------------------

    def status(self, name: str) -> ModelStatus:
        """The status of model ``name`` (safe to call from any thread)."""
        record = self._models.get(name)
        return record.status if record is not None else ModelStatus.UNLOADED

    def failure(self, name: str) -> str | None:
        """Why the last load of ``name`` failed, while it counts as failed."""
        record = self._models.get(name)
        failure = record.failure if record is not None else None
        return failure.error.message if failure is not None else None

    def signature(self, name: str) -> dict[str, Any] | None:
        """What the load of model ``name`` told of it (:func:`mmserver.predictor.signature`);
        ``None`` while it is not loaded into a backend (a model with ``minWorkers=0`` is
        loaded there on its first request)."""
        record = self._models.get(name)
        return record.signature if record is not None else None

    async def list_page(self, after: str | None, limit: int) -> tuple[list[ModelListing], bool]:
        """Up to ``limit`` models after the name ``after``, of the store and registered, sorted
        by name, and whether more follow. From the store index: O(log n + limit)."""
        stored, more = await self.index.page(after, limit)
        models = self._models
        if self._registered:
            names = sorted(self._registered)
            start = bisect.bisect_right(names, after) if after else 0
            extra = [(n, _registered_url(models[n])) for n in names[start : start + limit]]
            more = more or start + limit < len(names)
            merged = dict(stored)
            merged.update(extra)
            rows = sorted(merged.items())
            more = more or len(rows) > limit
            stored = rows[:limit]
        listing = []
        for name, url in stored:
            record = models.get(name)
            if record is None:
                listing.append(ModelListing(name, url, ModelStatus.UNLOADED))
            else:
                listing.append(ModelListing(name, record.url or url, record.status))
        return listing, more

    async def list_models(self) -> list[ModelListing]:
        """Every model of the store and every registered one, sorted by name."""
        models: list[ModelListing] = []
        after: str | None = None
        while True:
            page, more = await self.list_page(after, 10_000)
            models += page
            if not more or not page:
                return models
            after = page[-1].name

    async def describe(self, name: str) -> ModelView:
        """What the server knows of model ``name``: its configuration and status, and of a
        loaded model its workers, memory, cost and predict paths; the last load's error."""
        name = normalize_name(name)
        record = self._models.get(name)
        pool = record.pool if record is not None else None
        entry = record.registered if record is not None else None
        if pool is None and entry is None:
            entry = await self._lookup(name)
            if entry is None:
                raise errors.ModelNotFound(f"model {name} is not in the store nor registered")
            record = self._models.get(name)  # the lookup awaited: it may have changed
            pool = record.pool if record is not None else None
        overrides = (record.overrides if record is not None else None) or {}
        config = pool.config if pool is not None else self._defaults.replace(**overrides)
        source = entry.url if entry is not None else record.source if record is not None else None
        url = (record.url if record is not None else None) or str(source)
        failure = record.failure if record is not None else None
        view = ModelView(
            name=name,
            url=url,
            status=record.status if record is not None else ModelStatus.UNLOADED,
            config=config,
            startup=record.startup if record is not None else False,
            error=failure.error.message if failure is not None else None,
            inputs=(record.signature or {}).get("inputs") if record is not None else None,
        )
        if pool is None:
            return view
        return dataclasses.replace(
            view,
            queued=len(pool.queue),
            workers=tuple(
                WorkerView(w.id, w.start_time, w.state.value, w.slot.index, w.slot.lane.name)
                for w in pool.workers.values()
            ),
            memory_bytes=pool.memory_bytes,
            lane=pool.lane,
            cost=pool.cost,
            paths=pool.paths,
            path_batches=pool.path_batches(),
        )

    async def register(
        self, *, url: str, name: str | None, overrides: dict[str, Any], synchronous: bool
    ) -> str:
        """Register a model from a directory or archive under the allowed roots and load it."""
        self._refuse_if_stopping()
        path = await asyncio.to_thread(resolve_model_url, url, self.config.allowed_roots)
        if not name:
            name = path.name
        name = normalize_name(name)
        record = self._models.get(name)
        if record is not None and (
            record.registered is not None
            or record.status in (ModelStatus.READY, ModelStatus.LOADING)
        ):
            raise errors.ModelExists(f"model {name} is already registered; DELETE it first")
        entry = self.store.entry_for_path(path, name)
        self._check_overrides(overrides)
        record = self._record(name)
        record.registered = entry
        record.url = url
        self._registered.add(name)
        self._clear_failure(record)  # its series stay: the new load counts on in them
        if overrides:
            record.overrides = dict(overrides)
        if not synchronous:
            self._background(self._register_in_background(name), f"mmserver-register-{name}")
            return name
        try:
            await self._get_pool_for_management(name)
        except BaseException:
            self._forget(name)
            raise
        return name

    async def load(self, name: str) -> None:
        """Load a model of the store, or a registered one, now (management: no room is 507)."""
        self._refuse_if_stopping()
        await self._get_pool_for_management(name)

    async def _get_pool_for_management(self, name: str) -> ModelPool:
        """:meth:`_get_pool` for a management call, which is told that the server has no room
        for the model as 507 (DJL's answer to a registration it cannot load), not 503."""
        try:
            return await self._get_pool(name)
        except errors.NoCapacity as exc:
            raise errors.InsufficientMemory(exc.room) from None

    async def _register_in_background(self, name: str) -> None:
        try:
            await self._get_pool_for_management(name)
        except errors.MMServerError as exc:
            log.error("model %s: registration failed: %s", name, exc.message)

    def _check_overrides(self, overrides: dict[str, Any]) -> None:
        unknown = set(overrides) - set(RESCALABLE)
        if unknown:
            raise errors.InvalidInput(f"unknown setting(s): {', '.join(sorted(unknown))}")
        self._defaults.requested(**overrides)
        too_many = self.config.check_workers(
            overrides.get("min_workers", 0), overrides.get("max_workers", 0)
        )
        if too_many is not None:
            raise errors.InvalidInput(too_many)

    async def rescale(self, name: str, overrides: dict[str, Any]) -> ModelConfig:
        """Apply new worker and batching settings to a model, live (loading it if needed);
        the model's configuration now."""
        self._refuse_if_stopping()
        name = normalize_name(name)
        self._check_overrides(overrides)
        pool = await self._get_pool_for_management(name)
        config = pool.config.requested(**overrides)
        record = self._models.get(name)
        if record is not None:
            record.overrides = {**(record.overrides or {}), **overrides}
        await pool.rescale(config)
        log.info("model %s rescaled: %s", name, overrides)
        return config

    async def unload(self, name: str) -> None:
        """Unload a model (answering what it has queued first) and forget its registration."""
        name = normalize_name(name)
        record = self._models.get(name)
        if record is not None and record.load is not None:
            await asyncio.gather(record.load, return_exceptions=True)
            record = self._models.get(name)
        known = record is not None and (
            record.pool is not None or record.registered is not None or record.failure is not None
        )
        if not known:
            raise errors.ModelNotFound(f"model {name} is not loaded")
        await self._unload(
            name, reason="unloaded by the management API", drain_timeout=self.config.predict_timeout
        )
        self._forget(name)

    def _forget(self, name: str) -> None:
        record = self._models.get(name)
        if record is None:
            return
        record.startup = False
        record.registered = None
        self._registered.discard(name)
        record.overrides = None
        record.url = None
        self._forget_failure(record)
        self._drop_if_unkept(record)

    # Metrics ----------------------------------------------------------------------------------

    def _pools(self) -> Iterator[ModelPool]:
        for record in self._models.values():
            if record.pool is not None:
                yield record.pool

    def refresh_metrics(self) -> None:
        """Set the gauges from the current state (called before a scrape; free on the hot
        path)."""
        m = self.metrics
        if m.workers.labelled:
            for pool in self._pools():
                name = pool.name
                m.queue_length.labels(name).set(len(pool.queue))
                m.workers.labels(name).set(len(pool.workers))
                m.model_lane.labels(name, pool.lane).set(1)
        else:
            # Kept as they change: a scrape does not walk the loaded models on the event loop.
            m.queue_length.set(self._queued.jobs)
            m.workers.set(sum(slot.bound_workers for slot in self.backend.slots))
            for lane in self.backend.lanes:
                m.model_lane.labels("", lane).set(self._lanes[lane])
        m.models_loaded.set(self._loaded)
        m.model_memory_bytes.set(self._used_bytes())

    @property
    def loaded(self) -> list[str]:
        """Loaded model names, least recently used first."""
        return [pool.name for pool in self._pools()]

    def pool(self, name: str) -> ModelPool | None:
        record = self._models.get(name)
        return record.pool if record is not None else None


def _registered_url(record: ModelRecord) -> str:
    """Where a registered model comes from, as its store entry says."""
    if record.registered is None:
        raise AssertionError(f"model {record.name} is listed as registered without an entry")
    return record.registered.url


def entry_suffix(entry: StoreEntry) -> str:
    """The suffix of a store entry's file name (``""`` for a folder, else the archive's)."""
    return suffix_of(entry.url.rsplit("/", 1)[-1], entry.name)
