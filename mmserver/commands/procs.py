"""Processes by pid: identity, descendants, stopping, memory.

A pid alone is not an identity: once a process has exited, the kernel may give its pid to an
unrelated process. :class:`ProcessId` pairs the pid with the process's start time (psutil's
``create_time``), and nothing here signals a pid whose start time no longer matches.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from mmserver.commands import procfs


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
