"""The journal's thread: every use of the journal runs there, the ones asked for while it was
busy together in one transaction (group commit, :meth:`Journal.together
<mmserver.asynchronous.journal.Journal.together>`): one sync to disk for all the requests
accepted, started and ended meanwhile."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from mmserver import errors
from mmserver.asynchronous.journal import Journal

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_Call = tuple[Callable[[], object], "asyncio.Future[Any]"]


class JournalThread:
    """Runs the uses of :attr:`journal` in one thread of its own, batched."""

    def __init__(self) -> None:
        self.journal: Journal | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmserver-async-journal")
        #: Uses waiting for the thread, and whether it runs them now.
        self._calls: list[_Call] = []
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
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._calls.append((functools.partial(fn, *args, **kwargs), future))
            start = not self._writing
            self._writing = True
        if start:
            loop.run_in_executor(self._thread, self._write, loop)
        result: R = await future
        return result

    def _write(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the thread: run the uses asked for, a batch at a time, until none is left, and
        give each its result on the event loop."""
        while True:
            with self._lock:
                batch, self._calls = self._calls, []
                if not batch:
                    self._writing = False
                    return
            journal = self.journal
            results: list[object | BaseException]
            if journal is None:
                stopped = errors.ShuttingDown("asynchronous inference is stopped")
                results = [stopped] * len(batch)
            else:
                try:
                    results = journal.together([call for call, _ in batch])
                except Exception as exc:  # the transaction itself failed (the disk, say)
                    log.error("the asynchronous journal could not be written: %s", exc)
                    results = [exc] * len(batch)
            try:
                loop.call_soon_threadsafe(_settle, batch, results)
            except RuntimeError:  # the event loop is closed: nobody waits any more
                with self._lock:
                    self._writing = False
                return


def _settle(batch: list[_Call], results: list[object | BaseException]) -> None:
    for (_, future), result in zip(batch, results, strict=True):
        if future.done():
            continue  # its caller was cancelled
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
