"""Processes by pid: identity, descendants, stopping, memory, readiness.

A pid alone is not an identity: once a process has exited, the kernel may give its pid to an
unrelated process. :class:`ProcessId` pairs the pid with the process's start time (psutil's
``create_time``), and nothing here signals a pid whose start time no longer matches.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from mmserver.commands.cluster import procfs
from mmserver.commands.cluster.procfs import HOST


@dataclass(frozen=True)
class ProcessId:
    """A pid and the start time that tells this process from a later one with the same pid."""

    pid: int
    #: When the process started, in seconds since the epoch (psutil's ``create_time``: the same
    #: float for the same process, read again by any process of this boot).
    start: float

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    def alive(self) -> bool:
        """Running (not a zombie) and still the process this id was taken from."""
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.start and procfs.live(proc)
        except psutil.Error:
            return False

    def signal(self, signum: int) -> bool:
        """Send ``signum`` if this is still the same live process; whether it was sent."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def to_json(self) -> dict[str, float]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: dict[str, float]) -> ProcessId:
        return cls(int(data["pid"]), float(data["start"]))


def descendants(pid: int) -> list[ProcessId]:
    """Every live descendant of ``pid``, children first (mmserver's fork server and backends)."""
    found = []
    for child in procfs.descendant_processes(pid):
        try:
            found.append(ProcessId(child.pid, child.create_time()))
        except psutil.Error:
            continue
    return found


def wait_gone(idents: Iterable[ProcessId], timeout: float) -> list[ProcessId]:
    """Wait up to ``timeout`` s for the processes to exit; the ones still alive."""
    left = [i for i in idents if i.alive()]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [i for i in left if i.alive()]
    return left


def kill_all(idents: Iterable[ProcessId]) -> None:
    """SIGKILL each process that is still the one recorded."""
    for ident in idents:
        ident.signal(signal.SIGKILL)


def reap(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Collect a child's exit status, so it does not stay a zombie."""
    if proc is not None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class LoggedChild:
    """A child process in its own session (a Ctrl-C of the caller does not reach it), its output
    appended to ``log_path``; ``ident`` identifies it once started."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.ident: ProcessId | None = None
        self._log: IO[bytes] | None = None

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        if self._log is None:
            self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.ident = ProcessId.of(self.proc.pid) or ProcessId(self.proc.pid, 0)

    def exited(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def failure(self) -> str | None:
        """Why it is not running, once it has exited (for :func:`wait_until`)."""
        code = self.exited()
        return None if code is None else f"exited with code {code}; see {self.log_path}"

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass(frozen=True)
class Memory:
    """Memory of a process tree, in KiB: resident (RSS, shared pages counted in each process)
    and proportional (PSS, shared pages split between the processes sharing them)."""

    rss_kb: int
    pss_kb: int
    processes: int


def tree_memory(pid: int) -> Memory:
    """RSS and PSS of ``pid`` and all its descendants together."""
    processes = procfs.tree_memory(pid)
    return Memory(
        sum(p.rss_kb for p in processes), sum(p.pss_kb for p in processes), len(processes)
    )


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """``GET http://127.0.0.1:port/path``: (status, body); status 0 when nothing answered."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def wait_until(
    ready: Callable[[], bool], failed: Callable[[], str | None], timeout: float, what: str
) -> None:
    """Poll ``ready`` every 50 ms until it holds; raise ``RuntimeError`` when ``failed`` returns
    a reason or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        reason = failed()
        if reason is not None:
            raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready within {timeout:.0f} s")
        time.sleep(0.05)
