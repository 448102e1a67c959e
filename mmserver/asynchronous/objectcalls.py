"""The object store's calls of asynchronous requests, in a process of its own at a lower CPU
priority than the server's.

A call through botocore costs the process that makes it several milliseconds of CPU (3 to 4 ms
for a ``GetObject``, ``HeadObject`` or ``PutObject`` of a small body, measured against the S3
test server), most of it in Python: made in the frontend's threads, that CPU and the GIL it holds
would be taken from the real-time requests on the event loop. So the calls with small bodies
(an input read whole, an answer or a failure written) run in :data:`PROCESSES` process niced
by :data:`NICE`, with a client of its own, asked and answered on the event loop
(:class:`~mmserver.procs.sidework.SideProcesses`): a body crosses in a pipe, and no frontend thread
takes part (a :class:`~concurrent.futures.ProcessPoolExecutor` woke its manager and feeder
threads for each call, each taking the interpreter lock from the event loop). Streams (a large
input read in pieces, a large answer uploaded from its file) stay in the frontend's threads:
they are few and long. The process starts at the first call, or as the server starts when its
answers go to S3 (:meth:`ObjectCalls.prepare`).

One process, not more: on a server busy with real-time requests a niced process still takes
its share of the CPU, and the event loop waits for the CPU meanwhile. Measured with the bench's
asynchronous section on the S3 test server (real-time p99 beside 8,000 asynchronous requests
over p99 alone, two servers, three alternated rounds each): 1.75 to 2.58 (median 1.85) with one
process, 2.14 to 2.55 (median 2.32) with two. Asynchronous requests are then answered more
slowly while real-time traffic lasts, as they should be.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.asynchronous.locations import Locations
from mmserver.procs.sidework import Kind, SideProcesses

#: Processes making the calls.
PROCESSES = 1
#: Their niceness above the server's.
NICE = 10
#: Their name (``/proc/PID/comm``).
PROCESS_NAME = "mmserver-objects"


class CallLost(errors.ServiceUnavailable):
    """The process making an object store call died (or its answer did not pickle)."""


def _lost(location: str, message: str) -> CallLost:
    return CallLost(f"{location}: {message}")


KIND = Kind(title="mmserver: object calls", comm=PROCESS_NAME, failure=_lost, nice=NICE)

#: A process's locations, made at its first call (per input roots: one in practice).
_made: dict[tuple[str, ...], Locations] = {}


def _locations(roots: tuple[str, ...]) -> Locations:
    found = _made.get(roots)
    if found is None:
        found = _made[roots] = Locations([Path(root) for root in roots])
    return found


def _input(roots: tuple[str, ...], location: str, most: int) -> bytes | int:
    return _locations(roots).read_unless_larger(location, most)


def _write(roots: tuple[str, ...], location: str, body: bytes, content_type: str) -> None:
    _locations(roots).write(location, body, content_type)


def _prepare(roots: tuple[str, ...], location: str) -> None:
    _locations(roots).objects.client  # noqa: B018 (made on first use: boto3's imports)


class ObjectCalls:
    """Makes calls of :class:`Locations` in the processes (the module docstring); their errors
    are raised here as they were there. A call whose process died is made again, once, in a
    new one."""

    def __init__(self, input_roots: tuple[Path, ...]) -> None:
        self._roots = tuple(str(root) for root in input_roots)
        self._processes = SideProcesses(PROCESSES, multiprocessing.get_context("spawn"), KIND)

    async def read_input(self, location: str, most: int) -> bytes | int:
        """:meth:`Locations.read_unless_larger`."""
        found: bytes | int = await self._call(f"reading {location}", _input, location, most)
        return found

    async def write(self, location: str, body: bytes, content_type: str) -> None:
        """:meth:`Locations.write`."""
        await self._call(f"writing {location}", _write, location, body, content_type)

    async def prepare(self, location: str) -> None:
        """Start the process and make its S3 client, for ``location`` (an ``s3://`` URL the
        calls will be for): its start costs about a second of CPU (boto3's imports), better
        spent before the first request than beside it."""
        await self._call(f"preparing the calls of {location}", _prepare, location)

    async def _call(self, what: str, work: Callable[..., Any], location: str, *args: Any) -> Any:
        """``work(roots, location, *args)`` in the process, made again once in a new one if
        the process died meanwhile."""
        try:
            return await self._processes.run(location, what, work, self._roots, location, *args)
        except CallLost:
            return await self._processes.run(location, what, work, self._roots, location, *args)

    def pids(self) -> list[int]:
        """The processes making the calls (started, not found dead)."""
        return self._processes.pids()

    async def close(self) -> None:
        """Stop the processes once their calls are made."""
        await self._processes.close()
