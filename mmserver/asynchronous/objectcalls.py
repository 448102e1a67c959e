"""The object store's calls of asynchronous requests, in processes of their own at a lower CPU
priority than the server's.

A call through botocore costs the process that makes it several milliseconds of CPU (about
4.6 ms for a ``GetObject`` or a ``PutObject`` of a small body, measured against the S3 test
server), most of it in Python: made in the frontend's threads, that CPU and the GIL it holds
would be taken from the real-time requests on the event loop. So the calls with small bodies
(an input read whole, an answer or a failure written) run in :data:`PROCESSES` processes niced
by :data:`NICE`, each with a client of its own; a body crosses in a pipe. What real-time
requests leave of the CPU goes to them: on a busy server they wait, as asynchronous requests do
for the backends. Streams (a large input read in pieces, a large answer uploaded from its file)
stay in the frontend's threads: they are few and long. The processes start at the first call.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from mmserver.asynchronous.locations import Locations

#: Processes making the calls.
PROCESSES = 2
#: Their niceness above the server's.
NICE = 10

#: A process's own locations (set when it starts).
_locations: Locations | None = None


def _start(input_roots: tuple[str, ...]) -> None:
    global _locations
    os.nice(NICE)
    _locations = Locations([Path(root) for root in input_roots])


def _input(location: str, most: int) -> bytes | int:
    assert _locations is not None
    return _locations.read_unless_larger(location, most)


def _write(location: str, body: bytes, content_type: str) -> None:
    assert _locations is not None
    _locations.write(location, body, content_type)


class ObjectCalls:
    """Makes calls of :class:`Locations` in the processes (the module docstring); their errors
    are raised here as they were there."""

    def __init__(self, input_roots: tuple[Path, ...]) -> None:
        self._roots = tuple(str(root) for root in input_roots)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    PROCESSES,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start,
                    initargs=(self._roots,),
                )
            return self._pool

    async def _call(self, function: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            pool = self._executor()
            try:
                return await loop.run_in_executor(pool, function, *args)
            except BrokenProcessPool:
                # A process ended (killed): the call is made again in new ones, once.
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                await asyncio.to_thread(pool.shutdown, wait=False, cancel_futures=True)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def read_input(self, location: str, most: int) -> bytes | int:
        """:meth:`Locations.read_unless_larger`."""
        found: bytes | int = await self._call(_input, location, most)
        return found

    async def write(self, location: str, body: bytes, content_type: str) -> None:
        """:meth:`Locations.write`."""
        await self._call(_write, location, body, content_type)

    def close(self) -> None:
        """Stop the processes once their calls are made (blocks: call it in a thread)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
