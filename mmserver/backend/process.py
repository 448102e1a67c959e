"""The operating-system process behind a process slot (:class:`BackendProcess`): forked from the
fork server (or a model environment's, :mod:`~mmserver.backend.envprocs`), placed on the heavy
lane's CPUs, killed and reaped, its restarts counted."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import socket
import time

from mmserver.backend.child import child_main
from mmserver.backend.cpus import CpuReserve
from mmserver.backend.envprocs import EnvContext, EnvProcess
from mmserver.ops import capacity

#: Seconds a stopping process gets to exit by itself once its pipe is closed.
_STOP_GRACE_S = 2.0
#: A crash loop: this many starts within :data:`_CRASH_LOOP_S` seconds.
_CRASH_LOOP_STARTS = 5
_CRASH_LOOP_S = 10.0


class BackendProcess:
    """The process of one slot, the latest of those started for it: each replacement is started
    here again (:meth:`start`), and the pid is that of the newest.

    Blocking calls (the fork server's start, ``join``) run in the event loop's executor.
    """

    def __init__(
        self,
        index: int,
        lane: str,
        context: multiprocessing.context.ForkServerContext | EnvContext,
        nice: int = 0,
        idle: bool = False,
        reserve: CpuReserve | None = None,
    ) -> None:
        self.index = index
        self._lane = lane
        self._context = context
        self._nice = nice
        self._idle_policy = idle
        #: Places the process on the heavy lane's CPUs when it starts (a heavy slot's only).
        self._reserve = reserve
        self._process: multiprocessing.process.BaseProcess | EnvProcess | None = None
        #: When the latest replacements started, to slow a crash loop down (:meth:`throttle`).
        self._restarts: collections.deque[float] = collections.deque(maxlen=_CRASH_LOOP_STARTS)

    @property
    def started(self) -> bool:
        """A process was started (it may have died since)."""
        return self._process is not None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def live_pid(self) -> int | None:
        """The process's id while it runs (not once it has exited: the id may be another's)."""
        process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def describe(self) -> str:
        pid = self.pid
        return f"backend process {self.index} ({'not started' if pid is None else f'pid {pid}'})"

    async def start(self) -> socket.socket:
        """Start a new process (the slot's from now on); the non-blocking socket of its pipe."""
        loop = asyncio.get_running_loop()
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=child_main,
            args=(child, self.index, self._nice, self._idle_policy, self._lane),
            name=f"mmserver-backend-{self.index}",
            daemon=True,
        )
        await loop.run_in_executor(None, process.start)
        child.close()
        if self._reserve is not None and process.pid is not None:
            self._reserve.place(process.pid)
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        parent.close()
        sock.setblocking(False)
        self._process = process
        return sock

    def resident_bytes(self) -> int:
        """The process's resident bytes now (0 before it started)."""
        pid = self.pid
        return capacity.rss_bytes([pid]) if pid is not None else 0

    def kill(self) -> None:
        """Kill the process now if it runs."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    async def join(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the process to exit; its exit code (``None``
        while it runs, or when none was started)."""
        process = self._process
        if process is None:
            return None
        await asyncio.get_running_loop().run_in_executor(None, process.join, timeout)
        return process.exitcode

    async def stop(self) -> None:
        """Reap the process once its pipe is closed: it exits by itself within a grace period,
        or is killed."""
        process = self._process
        if process is None:
            return
        loop = asyncio.get_running_loop()
        # Past the drain nothing the process still computes is wanted: an idle process
        # exits at once, one held by a model's code is killed after this grace.
        await loop.run_in_executor(None, process.join, _STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            await loop.run_in_executor(None, process.join, 5.0)

    async def throttle(self) -> None:
        """Count a replacement about to start; in a crash loop, wait a second first so it does
        not spin."""
        now = time.monotonic()
        self._restarts.append(now)
        if len(self._restarts) == self._restarts.maxlen and now - self._restarts[0] < _CRASH_LOOP_S:
            await asyncio.sleep(1.0)
