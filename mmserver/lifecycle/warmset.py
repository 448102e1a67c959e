"""The warm set: the models loaded when the server stopped, loaded again when it starts.

With a ``state_dir``, the server keeps ``warm.json`` there: the models loaded (each a model of
the store, or one version of a model with versions), most recently used first, each with its
workers and the memory it was counted for (:mod:`mmserver.lifecycle.warmfile`). It is written
whole (:func:`~mmserver.ops.statefile.write_atomically`, in a thread) when the set or a model's
workers change, looked at once a second (:data:`CHECK_S`), so that a stream of loads and
unloads is one write; and at stop, before the models drain (:meth:`WarmSet.stop`), with the
order of use of that moment. Models registered with ``POST /models`` are left out: a
registration does not outlive a restart.

At start, in the background once the models of ``load_models`` are loaded (the server listens
meanwhile, and answers ready before the restore ends unless ``warm_ready_timeout`` holds it
back: :meth:`WarmSet.settled`), the models it
lists are loaded again, most recently used first, one at a time, through the manager's load path
(:meth:`Loader.get_pool <mmserver.lifecycle.loading.Loader.get_pool>`): a request naming one of
them meanwhile waits for that same load, or starts it. Each gets its workers back, within its
``minWorkers`` and ``maxWorkers`` of now (those above ``minWorkers`` retire when idle, as any
do), and takes its place in the LRU order behind the models restored before it. The restore
never evicts: it stops at the first model that does not fit beside those loaded, in the memory
budget and under ``max_loaded_models`` (:meth:`Room.fits <mmserver.lifecycle.room.Room.fits>`).
A model gone from the store, or that fails to load, is skipped with a line in the log; the
restore goes on. A file that cannot be read or parsed is logged and ignored: the server starts
cold. Nothing of a model's folder is read here; the entries not restored yet stay in the file
behind the loaded models until the restore reaches them, so a stop during the restore keeps them.

Only the event loop calls this module; its file work runs in threads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.lifecycle.catalog import Catalog
from mmserver.lifecycle.loading import Loader
from mmserver.lifecycle.room import Room
from mmserver.lifecycle.versions import Versions
from mmserver.lifecycle.warmfile import (
    WarmModel,
    ordered,
    progress_due,
    read,
    restored_workers,
    save,
    signature,
)
from mmserver.serving.pool import ModelPool

log = logging.getLogger(__name__)

#: Seconds between two looks at the loaded models for a change to write.
CHECK_S = 1.0


# The warm set of a running server ------------------------------------------------------------


class Outcome(enum.Enum):
    """How the restore of one model ended."""

    LOADED = "loaded"
    SKIPPED = "skipped"  # gone from the store, or failed to load
    NO_ROOM = "no room"  # would have evicted a model
    STOPPING = "stopping"  # the server is shutting down


class WarmSet:
    """The warm set of a server with a ``state_dir`` (see the module docstring). Started by the
    WorkLoadManager once the models of ``load_models`` are loaded (:meth:`start` does not wait
    for the restore); stopped at the beginning of its stop, before any model drains. It owns
    its two tasks, the restore and the writer, and cancels and awaits them at :meth:`stop`."""

    def __init__(
        self,
        path: Path,
        room: Room,
        catalog: Catalog,
        loader: Loader,
        versions: Versions,
        *,
        ready_timeout: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.ready_timeout = ready_timeout
        self.room = room
        self.catalog = catalog
        self.loader = loader
        self.versions = versions
        self._clock = clock
        #: The file's entries the restore has not reached yet: kept in the file behind the
        #: loaded models until it does.
        self._pending: list[WarmModel] = []
        #: What the file holds (:func:`signature`); ``None`` until it has been read: nothing is
        #: written before (a start that failed leaves the file as it was).
        self._written: dict[str, int] | None = None
        #: A change seen that is not written yet (a write failed): looked at again.
        self._pending_write = False
        #: The write under way, in a thread; :meth:`stop` waits for it before its own.
        self._saving: asyncio.Future[None] | None = None
        self._failed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Set when the restore has ended (every model tried, or stopped for want of room, or
        #: nothing to restore).
        self.restored = asyncio.Event()
        #: When :meth:`settled` answers true whatever the restore (on the clock; set at start).
        self._ready_by = -math.inf

    def start(self) -> None:
        """Read the file and restore its models, in the background."""
        self._ready_by = self._clock() + self.ready_timeout
        self._spawn(self._run(), "mmserver-warm-set-restore")

    def settled(self) -> bool:
        """Whether the server may answer ready: the restore has ended, or ``ready_timeout``
        has passed since :meth:`start` (at once with 0)."""
        return self.restored.is_set() or self._clock() >= self._ready_by

    async def stop(self) -> None:
        """Stop the restore and the writer, then write the set as it is now (the order of use
        of this moment): called before any model drains."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._written is not None:
            await self._write(self._current())

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("the warm set's %s failed", task.get_name(), exc_info=task.exception())

    # Writing ----------------------------------------------------------------------------------

    def _current(self) -> list[WarmModel]:
        """The warm set now: the loaded models of the store, then the entries not restored
        yet. O(loaded models), no I/O."""
        records = self.catalog.records
        loaded = []
        for key, pool in self.room.loaded.items():
            record = records.get(key)
            if record is not None and record.registered is not None:
                continue
            loaded.append(WarmModel(key, len(pool.workers), pool.accounted_bytes, pool.copy_bytes))
        return ordered(loaded, self._pending)

    async def _watch(self) -> None:
        """Write the set when it has changed, looked at every :data:`CHECK_S`: the room's
        count of loads and unloads and the loaded models' workers tell whether it may have
        (a sum, ~0.1 µs a model, where making the set is ~2 µs a model), the set whether it
        has."""
        room = self.room
        seen: tuple[int, int] | None = None
        while True:
            await asyncio.sleep(CHECK_S)
            mark = (room.changes, sum(len(pool.workers) for pool in room.loaded.values()))
            if mark == seen and not self._pending_write:
                continue
            seen = mark
            models = self._current()
            self._pending_write = signature(models) != self._written
            if self._pending_write:
                await self._write(models)
                self._pending_write = signature(models) != self._written

    async def _write(self, models: list[WarmModel]) -> None:
        """Write ``models`` in a thread, after the write under way if there is one. A failure
        is logged (once until the next success); the server goes on."""
        previous = self._saving
        if previous is not None:
            await asyncio.wait([previous])
            if not previous.cancelled():
                previous.exception()  # retrieved: the writer that began it is gone (stop)
        saving = asyncio.ensure_future(asyncio.to_thread(save, self.path, tuple(models)))
        self._saving = saving
        try:
            # Shielded: a writer cancelled by stop() leaves the thread to end; stop waits for it.
            await asyncio.shield(saving)
        except OSError as exc:
            message = str(exc)
            if message != self._failed:
                log.warning("the warm set could not be written to %s: %s", self.path, message)
            self._failed = message
            return
        self._failed = None
        self._written = signature(models)

    # Restoring --------------------------------------------------------------------------------

    async def _run(self) -> None:
        saved = await self._read()
        self._pending = list(saved)
        self._written = signature(saved)
        self._spawn(self._watch(), "mmserver-warm-set-writer")
        try:
            if saved:
                await self._restore(saved)
        finally:
            self.restored.set()

    async def _read(self) -> list[WarmModel]:
        """The file's models, or none: no file, or one that cannot be read or parsed (logged)."""
        try:
            return await asyncio.to_thread(read, self.path)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:  # WarmFileError, UnicodeDecodeError
            log.warning(
                "the warm set in %s is ignored (the server starts cold): %s", self.path, exc
            )
            return []

    async def _restore(self, saved: list[WarmModel]) -> None:
        """Load the models of ``saved`` most recently used first (see the module docstring)."""
        total = len(saved)
        began = self._clock()
        log.info("restoring %d warm model(s) from %s, most recently used first", total, self.path)
        counts = {outcome: 0 for outcome in Outcome}
        for done, model in enumerate(saved, 1):
            self._pending = saved[done - 1 :]  # this one stays in the file while it loads
            outcome = await self._restore_one(model)
            counts[outcome] += 1
            if outcome is Outcome.NO_ROOM:
                log.info(
                    "warm set: the restore stops at model %s (%d model(s) not restored): it "
                    "does not fit beside the %d model(s) loaded without evicting one "
                    "(max_loaded_models=%s, memory budget %d MiB)",
                    model.key,
                    total - done + 1,
                    len(self.room.loaded),
                    self.room.config.max_loaded_models or "unlimited",
                    self.room.budget_bytes // 2**20,
                )
                break
            if outcome is Outcome.STOPPING:
                return
            if progress_due(done, total):
                log.info(
                    "warm set: %d/%d loaded, %d skipped (%.1f s)",
                    counts[Outcome.LOADED],
                    total,
                    counts[Outcome.SKIPPED],
                    self._clock() - began,
                )
        self._pending = []
        log.info(
            "warm set: %d of %d model(s) restored from %s in %.1f s (%d skipped, %d left out "
            "for want of room)",
            counts[Outcome.LOADED],
            total,
            self.path,
            self._clock() - began,
            counts[Outcome.SKIPPED],
            total - counts[Outcome.LOADED] - counts[Outcome.SKIPPED],
        )

    async def _restore_one(self, model: WarmModel) -> Outcome:
        """Load ``model`` unless it is loaded or loading already (a request named it first),
        if it fits without evicting; then give it its workers back."""
        try:
            key = await self.versions.resolve(model.key)
        except errors.MMServerError as exc:
            log.warning("warm set: model %s skipped: %s", model.key, exc.message)
            return Outcome.SKIPPED
        room = self.room
        pool: ModelPool | None = room.loaded.get(key)
        record = self.catalog.get(key)
        ours = pool is None and (record is None or record.load is None)
        if ours:
            if not room.fits(model.memory_bytes):
                return Outcome.NO_ROOM
            # The load reserves what the model took before the restart, not an estimate from
            # its files: the room checked above is the room the load asks for.
            measured = self.catalog.record(key).measured
            if not measured.copy_bytes:
                measured.copy_bytes = model.copy_bytes
        if pool is None:
            try:
                pool = await self.loader.get_pool(key)
            except errors.ShuttingDown:
                return Outcome.STOPPING
            except errors.MMServerError as exc:
                log.warning("warm set: model %s skipped: %s", key, exc.message)
                return Outcome.SKIPPED
            if ours and room.loaded.get(key) is pool and not pool.busy:
                # Less recently used than every model restored before it; a model a request
                # uses now stays the most recently used.
                room.loaded.move_to_end(key, last=False)
        config = pool.config
        await pool.warm(restored_workers(model.workers, config.min_workers, config.max_workers))
        return Outcome.LOADED
