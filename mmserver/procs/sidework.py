"""Work of the frontend in processes of its own, asked and answered on the event loop.

Python work that holds the interpreter lock (unpacking an archive, a call through botocore) or a
blocking call that hands the lock back and forth, made in the frontend's threads, takes the lock
from the event loop; and every hand-off between a thread and the loop, or between the threads of
a :class:`~concurrent.futures.ProcessPoolExecutor` (its manager and its queue's feeder), costs
more than small work itself, each thread woken needing the lock and the CPU the loop waits for.
:class:`SideProcesses` runs such work in a few processes instead: the event loop writes a request
to an idle process's pipe and reads its answer as it reads the backends' replies, and no frontend
thread takes part (:meth:`SideProcesses.run`). Threads hand work over the same way
(:meth:`SideProcesses.run_from_thread`).

Each process runs one request at a time; requests wait in order for an idle one. A process that
dies (killed, out of memory) fails the request it was running with the error its owner chooses
and is replaced for the next one. Used for a load's file work (:mod:`mmserver.store.unpacking`)
and for the object store's calls of asynchronous requests
(:mod:`mmserver.asynchronous.objectcalls`).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import setproctitle

from mmserver.errors import ShuttingDown
from mmserver.procs.framing import FrameProtocol, frame

log = logging.getLogger(__name__)

#: What a failed request raises, made from the name it was asked for and a message: the
#: owner's error class (it is also made in the processes, so it must pickle).
Failure = Callable[[str, str], Exception]


def _stopping(name: str) -> ShuttingDown:
    return ShuttingDown(f"{name}: the server is stopping")


@dataclass(frozen=True)
class Kind:
    """What the processes are: how the operator's tools show them, their niceness above the
    frontend's, the error of a request whose process died or whose answer does not pickle (a
    module-level function: the processes make it too), and the error of a request refused once
    the processes stop, made from the name it was asked for (by default "NAME: the server is
    stopping")."""

    #: What ``ps`` shows.
    title: str
    #: ``/proc/PID/comm``, which tells the processes from their siblings.
    comm: str
    failure: Failure
    nice: int = 0
    stopping: Callable[[str], ShuttingDown] = _stopping


def _serve(conn: Connection, kind: Kind) -> None:
    """A process: answer each request ``(name, function, arguments)`` with ``(True, result)``
    or ``(False, error)``, in turn, until the pipe closes."""
    setproctitle.setproctitle(kind.title)
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(kind.comm)
    except OSError:
        pass  # not Linux: the name is only for the operator's tools
    if kind.nice:
        os.nice(kind.nice)
    # The frontend decides when we stop (it closes the pipe), also when a stop signal reaches
    # the whole process group (Ctrl-C): the work it drains may still need us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # What the process was forked with (the fork server's modules, never garbage) is frozen:
    # no collection scans it again, nor writes to the pages it shares with the fork server.
    gc.freeze()
    while True:
        try:
            name, work, args = conn.recv()
        except (EOFError, OSError):
            return
        answer: tuple[bool, Any]
        try:
            answer = (True, work(*args))
        except Exception as exc:  # every error goes back to the request that asked
            answer = (False, exc)
        try:
            conn.send(answer)
        except Exception as exc:  # an answer that does not pickle
            conn.send((False, kind.failure(name, f"{type(exc).__name__}: {exc}")))


class _Process:
    """One process, and the answer awaited from it (one request at a time)."""

    def __init__(self, process: BaseProcess, kind: Kind) -> None:
        self.process = process
        self.kind = kind
        self.transport: asyncio.Transport | None = None
        self.alive = True
        self.answer: asyncio.Future[Any] | None = None
        #: The name and the work the request is for, for the message if the process dies.
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
        log.warning("a process (%s) died (exit code %s)", self.kind.title, self.process.exitcode)
        answer.set_exception(
            self.kind.failure(self._name, f"the process {self._what} died (out of memory?)")
        )

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, 5.0)
        if self.process.is_alive():
            self.process.kill()
            await loop.run_in_executor(None, self.process.join)


class SideProcesses:
    """``processes`` processes of one :class:`Kind`, started on first use, made by ``context``.
    Runs on the event loop (:meth:`run`); threads hand work over with :meth:`run_from_thread`.
    """

    def __init__(self, processes: int, context: BaseContext, kind: Kind) -> None:
        self.processes = processes
        self.kind = kind
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
        """The event loop :meth:`run_from_thread` hands work to."""
        self._loop = loop

    async def run(self, name: str, what: str, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` in one of the processes (``work`` and its arguments pickle; so must
        its result and errors), asked for ``name``; ``what`` says what it does ("unpacking
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

    def run_from_thread(self, name: str, what: str, work: Callable[..., Any], *args: Any) -> Any:
        """:meth:`run`, for a thread (blocking)."""
        if self._loop is None:
            raise RuntimeError("SideProcesses.run_from_thread before bind()")
        asked = self.run(name, what, work, *args)
        return asyncio.run_coroutine_threadsafe(asked, self._loop).result()

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

    def pids(self) -> list[int]:
        """The processes started and not found dead."""
        return [p.process.pid for p in self._started if p.alive and p.process.pid is not None]

    # Inside -------------------------------------------------------------------------------------

    def _refuse_if_closed(self, name: str) -> None:
        if self._closed:
            raise self.kind.stopping(name)

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
                args=(child, self.kind),
                name=f"{self.kind.comm}-{next(self._indices)}",
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
        started = _Process(process, self.kind)
        self._started.add(started)
        transport, _ = await loop.create_unix_connection(
            lambda: FrameProtocol(started.answered, lambda _: started.lost()), sock=sock
        )
        started.transport = transport
        return started
