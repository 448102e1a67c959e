"""Process trees by pid (with :mod:`psutil`), and free loopback ports.

Processes by pid and start time (:mod:`mmserver.commands.procs`), the launcher
(:mod:`mmserver.commands.launch`) and the load generator's CPU readings build on these; the tools
under ``scripts/`` (benchmark, stress tools) import them through ``scripts/proctools.py``. psutil
reads ``/proc`` for us, and a :class:`psutil.Process` checks its start time before it answers or
signals, so a pid the kernel has given to another process since is never taken for the old one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil

HOST = "127.0.0.1"

#: Processes looked at below one root at most: a runaway fork loop is not walked for ever.
MAX_DESCENDANTS = 10_000


def free_port() -> int:
    """A port the kernel picks as free on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def live(proc: psutil.Process) -> bool:
    """Running: not gone, not a zombie, and still the process ``proc`` was made for."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendant_processes(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid``, parents before children (none when ``pid`` is gone)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [child for child in children[:MAX_DESCENDANTS] if live(child)]


def descendants(pid: int) -> list[int]:
    """The pids of every live process below ``pid``, parents before children."""
    return [child.pid for child in descendant_processes(pid)]


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory in KiB: resident (RSS; shared pages counted in each process) and
    proportional (PSS, from ``smaps_rollup``; shared pages split between the sharers)."""

    pid: int
    name: str
    rss_kb: int
    pss_kb: int


def tree_memory(pid: int) -> list[ProcessMemory]:
    """The memory of ``pid`` and of each live descendant, ``pid`` first (parents before
    children); a process that exits meanwhile is left out."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    out = []
    for proc in [root, *descendant_processes(pid)]:
        try:
            with proc.oneshot():
                name = proc.name()
                memory = proc.memory_full_info()
        except psutil.Error:
            continue
        out.append(ProcessMemory(proc.pid, name, memory.rss // 1024, memory.pss // 1024))
    return out
