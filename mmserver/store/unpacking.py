"""A load's file work in processes of their own.

Looking a model up, unpacking its archive (tar headers, gzip, the checks of
:func:`mmserver.store.archive.unpack_archive`) and reading its ``serving.properties`` is Python
work that holds the interpreter lock, and a blocking call that hands it back and forth: run in the
frontend's threads, a stream of cold loads takes the lock from the event loop, and every hand-off
between a thread and the loop costs more than the work itself. :class:`UnpackProcesses` runs that
work in a few processes of the fork server instead. The event loop writes a request to an idle
process's pipe and reads its answer as it reads the backends' replies: no frontend thread takes
part (:meth:`UnpackProcesses.run`). Threads that need an archive unpacked (an object store's
downloads) hand it over the same way (:meth:`UnpackProcesses.unpack`).

Measured (cold loads of the reference archive over 16 connections, CPU time of the frontend
process per load): 4.6 ms with the unpacking in the frontend's threads; 1.3 to 1.5 ms with only the
unpacking in these processes, behind threads that handed archives over and waited; 0.9 ms with
the whole file work here, asked from the event loop (8,000 loads, alternated runs).

Each process runs one request at a time; requests wait in order for an idle one. A process that
dies (killed, out of memory) fails the request it was running with
:class:`~mmserver.errors.ModelLoadError` and is replaced for the next one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import setproctitle

from mmserver.errors import ModelLoadError, ShuttingDown
from mmserver.framing import FrameProtocol, frame
from mmserver.store.archive import unpack_archive

log = logging.getLogger(__name__)


#: The unpacking processes' name (``/proc/PID/comm``), which tells them from the backend
#: processes, their siblings under the fork server.
PROCESS_NAME = "mmserver-unpack"


def _serve(conn: Connection) -> None:
    """An unpacking process: answer each request ``(model name, function, arguments)`` with
    ``(True, result)`` or ``(False, error)``, in turn, until the pipe closes."""
    setproctitle.setproctitle("mmserver: unpacking")  # what ps shows
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(PROCESS_NAME)
    except OSError:
        pass  # not Linux: the name is only for the operator's tools
    # The frontend decides when we stop (it closes the pipe), also when a stop signal reaches
    # the whole process group (Ctrl-C): the loads it drains may still need their files.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            name, work, args = conn.recv()
        except (EOFError, OSError):
            return
        answer: tuple[bool, Any]
        try:
            answer = (True, work(*args))
        except Exception as exc:  # every error goes back to the load that asked
            answer = (False, exc)
        try:
            conn.send(answer)
        except Exception as exc:  # an answer that does not pickle
            error = ModelLoadError(f"model {name}: {type(exc).__name__}: {exc}", model=name)
            conn.send((False, error))


class _Process:
    """One unpacking process, and the answer awaited from it (one request at a time)."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        self.transport: asyncio.Transport | None = None
        self.alive = True
        self.answer: asyncio.Future[Any] | None = None
        #: The model and the work the request is for, for the message if the process dies.
        self._name = ""
        self._what = ""

    def ask(
        self, name: str, what: str, work: Callable[..., Any], args: tuple[Any, ...]
    ) -> asyncio.Future[Any]:
        assert self.transport is not None
        answer = self.answer = asyncio.get_running_loop().create_future()
        self._name, self._what = name, what
        self.transport.writelines(frame((name, work, args)))
        return answer

    def answered(self, reply: tuple[bool, Any]) -> None:
        answer, self.answer = self.answer, None
        if answer is None or answer.done():
            return
        ok, value = reply
        if ok:
            answer.set_result(value)
        else:
            answer.set_exception(value)

    def lost(self) -> None:
        self.alive = False
        answer, self.answer = self.answer, None
        if answer is None or answer.done():
            return
        log.warning("a process unpacking archives died (exit code %s)", self.process.exitcode)
        answer.set_exception(
            ModelLoadError(
                f"model {self._name}: the process {self._what} died (out of memory?)",
                model=self._name,
            )
        )

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, 5.0)
        if self.process.is_alive():
            self.process.kill()
            await loop.run_in_executor(None, self.process.join)


class UnpackProcesses:
    """``processes`` processes doing the file work of loads, started on first use. Runs on the
    event loop (:meth:`run`); threads hand work over with :meth:`unpack`."""

    def __init__(self, processes: int, context: BaseContext) -> None:
        self.processes = processes
        self._context = context
        #: Idle processes; ``None`` is a place for a process not started (or replaced) yet.
        self._idle: list[_Process | None] = [None] * processes
        self._waiting: collections.deque[asyncio.Future[_Process | None]] = collections.deque()
        #: Every process started and not found dead, idle or not.
        self._started: set[_Process] = set()
        self._indices = itertools.count(1)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop :meth:`unpack` hands work to from threads."""
        self._loop = loop

    async def run(self, name: str, what: str, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` in one of the processes (``work`` and its arguments pickle; so must
        its result and errors), for model ``name``; ``what`` says what it does ("unpacking
        m.tar.gz"), for the error when the process dies meanwhile. Waits for an idle process
        first. Raises :class:`~mmserver.errors.ShuttingDown` once :meth:`close` began."""
        self._refuse_if_closed(name)
        process = await self._take()
        try:
            self._refuse_if_closed(name)
            if process is None or not process.alive:
                process = None
                process = await self._start()
                self._refuse_if_closed(name)  # closed while it started: close() stops it
            answer = process.ask(name, what, work, args)
        except BaseException:
            self._give_back(process)
            raise
        # The process is free once it answered (or died), whoever still waits for the answer.
        answer.add_done_callback(lambda _: self._give_back(process))
        return await asyncio.shield(answer)

    def unpack(self, archive: Path, target: Path, max_unpacked_bytes: int, name: str) -> Path:
        """:func:`~mmserver.store.archive.unpack_archive` in one of the processes, for a thread
        (a :data:`mmserver.store.source.Unpacker`; blocking)."""
        if self._loop is None:
            raise RuntimeError("UnpackProcesses.unpack before bind()")
        work = self.run(
            name,
            f"unpacking {archive.name}",
            unpack_archive,
            archive,
            target,
            max_unpacked_bytes,
            name,
        )
        result: Path = asyncio.run_coroutine_threadsafe(work, self._loop).result()
        return result

    async def close(self) -> None:
        """Stop the processes, once the work they run is done (it is bounded); requests still
        waiting for one are refused."""
        self._closed = True
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(ShuttingDown("the server is stopping"))
        while answers := [p.answer for p in self._started if p.answer is not None]:
            await asyncio.gather(*answers, return_exceptions=True)
        processes, self._started = self._started, set()
        self._idle = [None] * self.processes
        await asyncio.gather(*(p.close() for p in processes), return_exceptions=True)

    # Inside -------------------------------------------------------------------------------------

    def _refuse_if_closed(self, name: str) -> None:
        if self._closed:
            raise ShuttingDown(f"model {name} is not loaded: the server is stopping", model=name)

    async def _take(self) -> _Process | None:
        if self._idle:
            return self._idle.pop()
        waiter: asyncio.Future[_Process | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(waiter.result())  # handed over as this request left
            raise

    def _give_back(self, process: _Process | None) -> None:
        """Hand ``process`` (``None``: a place for a new one) to the longest waiting request."""
        if process is not None and not process.alive:
            self._started.discard(process)
            process = None
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(process)
                return
        self._idle.append(process)

    async def _start(self) -> _Process:
        loop = asyncio.get_running_loop()
        parent, child = self._context.Pipe()
        try:
            process: BaseProcess = self._context.Process(  # type: ignore[attr-defined]
                target=_serve,
                args=(child,),
                name=f"mmserver-unpack-{next(self._indices)}",
                daemon=True,
            )
            try:
                await loop.run_in_executor(None, process.start)
            finally:
                child.close()
            sock = socket.socket(fileno=os.dup(parent.fileno()))
        finally:
            parent.close()
        sock.setblocking(False)
        unpacker = _Process(process)
        self._started.add(unpacker)
        transport, _ = await loop.create_unix_connection(
            lambda: FrameProtocol(unpacker.answered, lambda _: unpacker.lost()), sock=sock
        )
        unpacker.transport = transport
        return unpacker
