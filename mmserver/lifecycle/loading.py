"""Loading: a model's pool, loaded on demand, one load however many requests wait for it.

:meth:`Loader.get_pool` is the single flight: the first request for a model that is not loaded
starts its load (UNLOADED or FAILED → LOADING), and every request waits for that one task. A
load finds the model's files (:class:`~mmserver.lifecycle.files.FileWork`), reserves room for it
(:class:`~mmserver.lifecycle.room.Room`, which evicts), and starts its pool; it ends READY, FAILED
with the reason when the model is at fault (remembered by the catalog and answered to every request
until ``load_retry_seconds`` have passed, not retried on every request of a storm), or back to
what it was when it ended for a reason that is not the model's (no room, shutdown).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from mmserver import errors
from mmserver.backend.placement import BackendPool
from mmserver.config.server import ModelConfig
from mmserver.envs.registry import Environment, Environments
from mmserver.envs.requirements import RequirementSet
from mmserver.lifecycle import files
from mmserver.lifecycle.catalog import Catalog
from mmserver.lifecycle.record import ModelRecord, ModelStatus
from mmserver.lifecycle.room import Room
from mmserver.ops.metrics import Metrics
from mmserver.serving.pool import ModelPool
from mmserver.store.names import normalize_target
from mmserver.store.source import StoreEntry

log = logging.getLogger(__name__)


class Loader:
    """Loads models into pools (see the module docstring). Only the event loop calls it."""

    def __init__(
        self,
        catalog: Catalog,
        room: Room,
        backend: BackendPool,
        metrics: Metrics,
        file_work: files.FileWork,
        *,
        envs: Environments | None,
        retry_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self.catalog = catalog
        self.room = room
        self.backend = backend
        self.metrics = metrics
        self.file_work = file_work
        #: The model environments (``None``: models run in the server's environment only).
        self.envs = envs
        #: How long a failed load answers its model's requests before one is tried again.
        self.retry_seconds = retry_seconds
        self._clock = clock
        #: Loads started so far: each pool's key in the backends is its model's name and this.
        self._generation = 0

    async def get_pool(self, name: str) -> ModelPool:
        """The pool of a loaded model or version, loading it first if needed (single
        flight)."""
        name = normalize_target(name)
        catalog, loaded = self.catalog, self.room.loaded
        while True:
            pool = loaded.get(name)
            if pool is not None:
                loaded.move_to_end(name)
                return pool
            record = catalog.get(name)
            if record is not None and record.unload is not None:
                await asyncio.shield(record.unload)
                continue
            task = record.load if record is not None else None
            if task is None:
                failure = record.failure if record is not None else None
                if failure is not None and self._clock() - failure.at < self.retry_seconds:
                    raise failure.error
                record = catalog.record(name)
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

    async def cancel_all(self) -> None:
        """Cancel the loads under way, and wait for them to end."""
        loads = [r.load for r in self.catalog.records.values() if r.load is not None]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    async def _load(self, record: ModelRecord) -> ModelPool:
        """Load the model of ``record`` (LOADING): READY with its pool, FAILED with the reason
        when the model is at fault, else back to what it was before.

        A model the store index lists is looked up where its files are then prepared, in one
        request (:meth:`FileWork.run`). Any other name is looked up on its own first (in the
        default thread pool), so that an unknown name is answered 404 without waiting behind
        archives being unpacked."""
        name = record.name
        catalog = self.catalog
        started = time.perf_counter()
        self.metrics.open_model(name)
        prepared: files.Prepared | Exception | None = None
        try:
            # Not remembered as a failure: an entry added to the store is found on its next
            # request, and a refused name says nothing of a model.
            if record.registered is None and name in catalog.index:
                entry, prepared = await self.file_work.run(name, files.find_and_prepare, name)
                catalog.note(name, entry)
                entry = catalog.found(name, entry)
            else:
                entry = await catalog.find(record)
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
            said = record.failure  # a refusal is logged once, not at every retry
            catalog.fail(record, exc, self._clock())
            refused = refusal(exc)
            self.metrics.model_load_failures.labels(refused or "error").inc()
            if refused is None or said is None or said.error.message != exc.message:
                log.error("%s", exc.message, extra={"model": name})
            raise exc from None
        except asyncio.CancelledError:
            self._load_abandoned(record)
            raise
        except Exception as exc:
            error = errors.ModelLoadError(
                f"model {name} failed to load: {type(exc).__name__}: {exc}", model=name
            )
            catalog.fail(record, error, self._clock())
            self.metrics.model_load_failures.labels("error").inc()
            log.exception("model %s failed to load", name, extra={"model": name})
            raise error from None
        record.load = None
        record.pool = pool
        record.become(ModelStatus.READY)
        if record.failure is not None:
            catalog.clear_failure(record)
        self.room.admit(pool)
        seconds = time.perf_counter() - started
        self.metrics.model_loads.inc()
        if record.signature is not None and record.signature.get("trained_with"):
            self.metrics.model_version_skew_loads.inc()
        self.metrics.model_load_seconds.observe(seconds)
        paths = pool.paths
        log.info(
            "model %s loaded from %s in %.1f ms (%d worker(s), %d loaded)%s",
            name,
            record.source,
            seconds * 1000,
            len(pool.workers),
            len(self.room.loaded),
            f"; {paths['family']} {paths['method']}: {paths['summary']}" if paths else "",
            extra={"model": name},
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
        self.catalog.release_series(record)
        self.catalog.drop_if_unkept(record)

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
            prepared = await self.file_work.run(name, files.prepare, entry)
        if isinstance(prepared, Exception):
            raise prepared
        model_dir, config, wanted = prepared
        config = self.catalog.configured(record, config)
        env = None
        record.environment = None
        if wanted is not None and self.envs is not None and not await self.envs.met(wanted):
            if not wanted.operator and not config.trust.full:
                raise untrusted_set(name, wanted, config)
            env = record.environment = self.envs.get(wanted, entry)  # shown while it builds
            await self.envs.ready(env, name)
        need = self._estimate_bytes(record, entry, config)
        try:
            await self.room.reserve(name, need)
        except BaseException:
            if env is not None:
                env.leave(name)
            raise
        try:
            pool = await self._start_pool(record, model_dir, config, env)
        finally:
            self.room.release(need)
        record.source = entry.url
        return pool

    async def _start_pool(
        self, record: ModelRecord, model_dir: Path, config: ModelConfig, env: Environment | None
    ) -> ModelPool:
        """The model's pool, started (its minWorkers loaded). A backend process that dies while
        the model loads into it is replaced, and the load is tried once more before it counts as
        the model's failure: a model whose own load kills its process fails the second time."""
        name = record.name
        for attempt in (1, 2):
            self._generation += 1
            key = f"{name}#{self._generation}"
            pool = ModelPool(
                name,
                key,
                model_dir,
                config,
                self.backend,
                self.metrics,
                self.room,
                record.measured,
                env,
            )
            try:
                await pool.start()
            except errors.BackendDied as exc:
                await pool.stop(None)
                if attempt == 2:
                    raise
                if env is not None:  # the stop left it; this attempt uses it again
                    env.users.add(name)
                log.warning(
                    "model %s: %s; loading it again", name, exc.message, extra={"model": name}
                )
            except BaseException:
                await pool.stop(None)
                raise
            else:
                return pool
        raise AssertionError("unreachable")

    @staticmethod
    def _estimate_bytes(record: ModelRecord, entry: StoreEntry, config: ModelConfig) -> int:
        if config.required_memory_mb is not None:
            return int(config.required_memory_mb * 2**20)
        return record.measured.copy_bytes or int(1.2 * entry.size_bytes)


def refusal(exc: errors.MMServerError) -> str | None:
    """The ``reason`` label of a load the server's options refused (the same each time it is
    tried): ``untrusted``, ``version_skew`` or ``environment`` (a requirement set that cannot be
    installed, remembered until ``env_retry_s``); ``None`` for any other failure."""
    if isinstance(exc, errors.UntrustedModel):
        return "untrusted"
    if isinstance(exc, errors.VersionSkew):
        return "version_skew"
    if isinstance(exc, errors.EnvironmentFailed):
        return "environment"
    return None


def untrusted_set(name: str, wanted: RequirementSet, config: ModelConfig) -> errors.UntrustedModel:
    """The refusal of a model whose files ask for packages the server does not have, for a
    model the operator does not trust: installing and importing a package runs its code."""
    return errors.UntrustedModel(
        f"model {name} asks for packages the server does not have "
        f"({', '.join(wanted.requirements)}); installing and importing them runs their code, "
        f"so their environment is built only for a model the server's trusted_models option "
        f"names ({config.trust.named})",
        model=name,
    )
