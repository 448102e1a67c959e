"""The journal's thread: every use of the journal, and the local file work that must reach the
disk before a row changes, runs there, batched (group commit).

What is asked for while the thread is busy runs together, as one batch, in one hand-off:

1. each step's file work (:meth:`JournalThread.run`'s ``files``: an answer written beside its
   place, synced and renamed into place; an input's path resolved; a small input read), in the
   order asked;
2. each folder a rename went to synced once (not once per file);
3. one transaction for every row change of the batch (:meth:`Journal.together
   <mmserver.asynchronous.journal.Journal.together>`): one sync to disk for all the requests
   accepted, started and ended meanwhile;
4. what may go once that is on disk (``after``: a saved body no longer needed deleted);
5. one call on the event loop gives every step its result.

So a row never says more than the disk holds: an answer is on disk before its row says
``done``, and a request is in the journal before its caller (the 202) hears of it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

from mmserver import errors
from mmserver.asynchronous.journal import Journal
from mmserver.store.objects import sync_folder

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F")

#: The folders whose renames a batch makes durable (file work adds to it).
Folders = set[Path]


@dataclass(slots=True)
class _Step(Generic[F]):
    """One use of the thread: file work, then a change in the journal's transaction."""

    files: Callable[[Folders], F] | None
    record: Callable[[F], Any]
    after: Callable[[Any], object] | None
    future: asyncio.Future[Any]


class JournalThread:
    """Runs the uses of :attr:`journal` in one thread of its own, batched (module docstring)."""

    def __init__(self) -> None:
        self.journal: Journal | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmserver-async-journal")
        #: Steps waiting for the thread, and whether it runs them now.
        self._steps: list[_Step[Any]] = []
        self._lock = threading.Lock()
        self._writing = False

    async def open(self, journal: Callable[[], Journal]) -> None:
        """Open the journal ``journal()`` makes, in the thread."""
        loop = asyncio.get_running_loop()
        self.journal = await loop.run_in_executor(self._thread, journal)

    async def close(self) -> None:
        """Close the journal once the uses asked for before have run; stop the thread."""
        journal, self.journal = self.journal, None
        if journal is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, journal.close)
        self._thread.shutdown(wait=True)

    def current(self) -> Journal:
        if self.journal is None:
            raise errors.ShuttingDown("asynchronous inference is stopped")
        return self.journal

    async def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` (a use of the journal) run in the thread, in one transaction
        with the others asked for meanwhile; its result, or what it raised."""
        call = functools.partial(fn, *args, **kwargs)
        return await self.run(None, lambda _: call())

    async def run(
        self,
        files: Callable[[Folders], F] | None,
        record: Callable[[F], R],
        after: Callable[[R], object] | None = None,
    ) -> R:
        """In the thread: ``files(folders)`` (file work; it adds to ``folders`` each folder
        whose renames must be durable), then, once those folders are synced, ``record`` of its
        result in the batch's transaction, then, once that is on disk, ``after`` of the result
        of ``record``. The result of ``record``, or what ``files`` or ``record`` raised
        (``record`` does not run when ``files`` raised, nor ``after`` when ``record`` did)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._steps.append(_Step(files, record, after, future))
            start = not self._writing
            self._writing = True
        if start:
            # Not run_in_executor: its end would wake the event loop once more for nothing.
            self._thread.submit(self._write, loop)
        result: R = await future
        return result

    def _write(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the thread: run the steps asked for, a batch at a time, until none is left, and
        give each its result on the event loop."""
        while True:
            with self._lock:
                batch, self._steps = self._steps, []
                if not batch:
                    self._writing = False
                    return
            try:
                results = self._batch(batch)
            except Exception as exc:  # a fault of its own: its steps hear of it, others run
                log.exception("the asynchronous journal's thread failed")
                results = [exc] * len(batch)
            try:
                loop.call_soon_threadsafe(_settle, batch, results)
            except RuntimeError:  # the event loop is closed: nobody waits any more
                with self._lock:
                    self._writing = False
                return

    def _batch(self, batch: list[_Step[Any]]) -> list[object | BaseException]:
        """Run one batch (module docstring): each step's result or exception."""
        journal = self.journal
        if journal is None:
            return [errors.ShuttingDown("asynchronous inference is stopped")] * len(batch)
        folders: Folders = set()
        results: list[object | BaseException] = []
        for step in batch:
            try:
                results.append(None if step.files is None else step.files(folders))
            except Exception as exc:
                results.append(_Failed(exc))
        for folder in folders:
            sync_folder(folder)
        recorded = [i for i, r in enumerate(results) if not isinstance(r, _Failed)]
        try:
            changes = journal.together(
                [functools.partial(batch[i].record, results[i]) for i in recorded]
            )
        except Exception as exc:  # the transaction itself failed (the disk, say)
            log.error("the asynchronous journal could not be written: %s", exc)
            changes = [exc] * len(recorded)
        for i, change in zip(recorded, changes, strict=True):
            results[i] = change
            after = batch[i].after
            if after is not None and not isinstance(change, BaseException):
                try:
                    after(change)
                except Exception as exc:
                    log.warning("asynchronous journal: clearing up after a change: %s", exc)
        return [r.error if isinstance(r, _Failed) else r for r in results]


@dataclass(frozen=True, slots=True)
class _Failed:
    """A step's file work that raised ``error``."""

    error: Exception


def _settle(batch: list[_Step[Any]], results: list[object | BaseException]) -> None:
    for step, result in zip(batch, results, strict=True):
        future = step.future
        if future.done():
            continue  # its caller was cancelled
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
