"""Archives unpacked in processes of their own.

Unpacking is Python work (tar headers, gzip, the checks of
:func:`mmserver.store.archive.unpack_archive`) that holds the interpreter lock: run in the
frontend's threads, a stream of cold loads takes it from the event loop, and the threads and the
loop hand it back and forth at a cost several times the unpacking itself.
:class:`UnpackProcesses` runs :func:`~mmserver.store.archive.unpack_archive` in a few processes of
the fork server instead; a frontend thread that needs an archive unpacked takes an idle process,
sends it the arguments over its pipe and waits (without the lock) for the answer. Measured (2,000
cold loads of the reference archive over 16 connections, CPU time of the frontend process per
load): 4.6 ms with the unpacking in the frontend's threads, 1.5 ms with these processes.

A process that dies (killed, out of memory) fails the archive it was unpacking with
:class:`~mmserver.errors.ModelLoadError` and is replaced for the next one.
"""

from __future__ import annotations

import itertools
import logging
import queue
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from mmserver.errors import ModelLoadError, ShuttingDown
from mmserver.store.archive import unpack_archive

log = logging.getLogger(__name__)


#: The unpacking processes' name (``/proc/PID/comm``), which tells them from the backend
#: processes, their siblings under the fork server.
PROCESS_NAME = "mmserver-unpack"


def _serve(conn: Connection) -> None:
    """An unpacking process: answer each request in turn until the pipe closes."""
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(PROCESS_NAME)
    except OSError:
        pass  # not Linux: the name is only for the operator's tools
    while True:
        try:
            archive, target, limit, name = conn.recv()
        except (EOFError, OSError):
            return
        answer: tuple[bool, Any]
        try:
            answer = (True, unpack_archive(archive, target, limit, name))
        except Exception as exc:  # every error goes back to the load that asked
            answer = (False, exc)
        try:
            conn.send(answer)
        except Exception as exc:  # an exception that does not pickle
            error = ModelLoadError(f"model {name}: {type(exc).__name__}: {exc}", model=name)
            conn.send((False, error))


class _Process:
    def __init__(self, context: BaseContext, index: int) -> None:
        self.conn, child = context.Pipe()
        self.process: BaseProcess = context.Process(  # type: ignore[attr-defined]
            target=_serve, args=(child,), name=f"mmserver-unpack-{index}", daemon=True
        )
        self.process.start()
        child.close()

    def close(self) -> None:
        self.conn.close()
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class UnpackProcesses:
    """``processes`` processes unpacking archives, started on first use; :meth:`unpack` is a
    :data:`mmserver.store.source.Unpacker`, called from threads (at most ``processes`` unpack at
    once, the other callers wait for one)."""

    def __init__(self, processes: int, context: BaseContext) -> None:
        self.processes = processes
        self._context = context
        self._idle: queue.LifoQueue[_Process | None] = queue.LifoQueue()
        for _ in range(processes):
            self._idle.put(None)  # a place for a process not started yet
        self._indices = itertools.count(1)
        self._closed = False

    def unpack(self, archive: Path, target: Path, max_unpacked_bytes: int, name: str) -> Path:
        """:func:`~mmserver.store.archive.unpack_archive` in one of the processes. Blocking."""
        worker = self._idle.get()
        try:
            if self._closed:
                raise ShuttingDown(
                    f"model {name} is not loaded: the server is stopping", model=name
                )
            if worker is None:
                worker = _Process(self._context, next(self._indices))
            try:
                worker.conn.send((archive, target, max_unpacked_bytes, name))
                ok, value = worker.conn.recv()
            except (EOFError, OSError):
                code = worker.process.exitcode
                worker.close()
                worker = None
                log.warning("the process unpacking archives died (exit code %s)", code)
                raise ModelLoadError(
                    f"model {name}: the process unpacking {archive.name} died (out of memory?)",
                    model=name,
                ) from None
            if not ok:
                raise value
            result: Path = value
            return result
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop the processes, once the archives being unpacked are done (they are bounded)."""
        self._closed = True
        for _ in range(self.processes):
            worker = self._idle.get()
            if worker is not None:
                worker.close()
        for _ in range(self.processes):
            self._idle.put(None)  # callers still waiting see the pool closed
